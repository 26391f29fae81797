"""The front room: what both front ends (the mitmproxy edge and the Envoy lane) share, below both, so each says
exactly what the other says.

- settings: every setting with a default, declared once, typed; the CLI options and the one `EGRESSLAW_*`
  environment binding of `egresslaw proxy` and `egresslaw lane` are generated from it
- startup: what both load before anything listens (the policy through the proof gate, the keys, test routing, the
  bind error), each failure a `StartupError`
- resolver: the asynchronous resolver and the closed world of test routing
- admit: the one admission (lease, subject, decision, answers, budget) both the addon and the lane's authorizer await
- budget: the exfiltration budget's enforcement: what a request costs, who is charged, the ledger (SQLite or
  PostgreSQL) that keeps the counts per aligned window
- ca: the proxy CA both intercept with, made without mitmproxy

It imports neither the edge, the lane, credential kinds nor mitmproxy (a contract in pyproject.toml).
"""
