"""The egress edge and everything it stands on, one room per job (arrows point down this list).

- `run`       — running it: the embedded server (`Edge`), the `--workers N` supervisor, `/metrics`.
- `edge`      — the mitmproxy edge: addon hooks that only adapt a flow to the decision, request and
                response limits, layer patches, the resolver, the response scanner, denial answers.
- `audit`     — the hash-chained event log (`log`) and `egresslaw audit verify` over a fleet's logs (`verify`).
- `custody`   — keys, leases, secrets and the sealed credential stores (SQLite, PostgreSQL).
- `decision`  — the decision: the core the prover proves (`core`), the one adapter that turns a request
                into its inputs (`adapter`), addresses, reasons, the values that cross, the core's digest.

`decision` imports nothing of the edge, the audit, custody or the prover; the prover (`proofs`) imports
`decision`, and the edge imports the prover's z3-free gate only. The contracts are in `pyproject.toml`
(`[tool.importlinter]`), checked by `make test`.
"""
