"""The egresslaw compiler: `.egress` source -> admitted, frozen artifact.

In the order a policy meets them:
- `parser`        — the Lark edge: source text -> `syntax` nodes with spans (the grammar is `grammar.lark`).
- `syntax`        — the syntax tree: frozen nodes; spans never take part in equality.
- `passes`        — admission: the whole policy's tree -> admitted declarations, or diagnostics.
- `template`      — path templates (request shapes): text -> artifact segments (its grammar is `template.lark`).
- `budget`        — the exfiltration budget's windows and sizes, and when a changed budget is a widening.
- `secrets_scan`  — string literals that look like credentials (policies hold custody handles only).
- `compile`       — the driver: paths -> sources -> trees -> passes -> artifact (+ lock versions).
- `artifact`      — the compiled artifact: frozen pydantic models and their canonical JSON.
- `lock`          — `egresslaw.lock`: every profile's and connection's published version, pinned by hash.
- `normalize`     — the one host normalizer and the one path normalizer (compiler, decision, prover).
- `patterns`      — the pattern subset of request shapes: text -> AST (what the prover translates) -> `re` source.
- `constants`     — policy data the compiler, the decision and the prover share (the header denylist, …).
- `codes`, `diagnostics`, `sarif` — every diagnostic code; diagnostics as data; SARIF and GitHub annotations.
- `fmt`           — canonical formatting, comments kept, idempotent.
- `cma`           — `import-cma`: a Claude Managed Agents environment -> `.egress` source.
- `propose`       — audit events -> the smallest edit of the sources that admits them.
- `errors`        — `CompilerError`, the package's root error.

Importing this package pulls in nothing heavy: `compiler.artifact` and `compiler.normalize`
are what `proofs` and `egress_proxy` read; the Lark front end lives in `compiler.parser`.
"""
