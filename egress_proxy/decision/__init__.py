"""The decision, in one place: what the proxy enforces, `egresslaw explain` shows and `prove` proves.

- `core`        — the enforcement semantics, run natively by the proxy and symbolically by `proofs.symexec`.
- `adapter`     — the one function per stage that turns a request (CONNECT, HTTP request, resolver answers)
                  into the core's inputs and its verdict into a `Decision`; the per-artifact tables.
- `addresses`   — resolver answers parsed and judged by the core, explained in words.
- `shapes`      — request shapes judged (docs/shapes.md): a rule's path template, query, header values and its
                  MCP, GraphQL or git body, on the values `bodies` parsed; examples of what a shape admits.
- `bodies`      — request bodies (JSON, MCP, GraphQL, git push commands) read one way, strictly and bounded, for
                  the shapes; the `tools/list` answer filtered to the allowed tools (JSON and SSE).
- `reasons`     — every reason code and its meaning.
- `answers`     — what a refusal looks like on the wire (status, `X-Egresslaw-Deny`, JSON body), for both front ends.
- `types`       — `Lease`, `Request`, `Decision`: the values that cross between the edge and the decision.
- `provenance`  — the running version and the core's digest that a proof report must match.

Imports `catalog` and the compiler's artifact model, normalizers and constants; never the edge, the audit,
custody, the prover, mitmproxy, z3 or lark.
"""
