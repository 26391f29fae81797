"""The egress edge and everything it stands on, one room per job (arrows point down this list).

- `run`          — running it: the embedded server (`Edge`), the `--workers N` supervisor, `/metrics`, the lane's process.
- `edge`, `lane` — the two front ends: the mitmproxy edge (hooks that only adapt a flow to the decision, limits,
                   layer patches, the response scanner, denial answers) and the Envoy lane (sandbox profiles only).
- `front`        — the front room below both: settings declared once, start-up loaded once, the one `admit()`,
                   the typed audit `Event`, the resolver and the CA.
- `credentials`  — the credential kinds and their broker: what the edge attaches (never the lane).
- `audit`        — the hash-chained event log (`log`) and `egresslaw audit verify` over a fleet's logs (`verify`).
- `custody`      — keys, leases, secrets and the sealed credential stores (SQLite, PostgreSQL).
- `decision`     — the decision: the core the prover proves (`core`), the one adapter that turns a request
                   into its inputs (`adapter`), addresses, reasons, answers, the values that cross, the core's digest.
- `errors`       — `EgressError`, the root error every room's errors derive from.

`decision` imports nothing of the edge, the audit, custody or the prover; the prover (`proofs`) imports
`decision`, and the edge imports the prover's z3-free gate only. The contracts are in `pyproject.toml`
(`[tool.importlinter]`), checked by `make test`.
"""
