"""The fast lane: sandbox-profile traffic on a compiled Envoy data plane, decided by the same core.

- `envoy`      — the artifact compiled to Envoy configuration: which profiles the lane serves, its listeners,
                 routes and clusters, the leaf certificates it needs.
- `reach`      — what each profile may reach, from the artifact alone, by code the generator does not call.
- `translate`  — the translation check: the configuration read back and compared with `reach`.
- `authorize`  — the authorizer Envoy asks once per CONNECT, per plain-HTTP request and per request inside a
                 tunnel, and its event.
- `tunnels`    — the admitted CONNECTs (lease, answers, host:port) the requests inside them are judged with.
- `dnsfront`   — the resolver Envoy dials through: it answers only what the worker admits.
- `ingest`     — Envoy's access log turned into events of the chained audit log.
- `certs`      — leaf certificates for the exact hosts the lane terminates TLS for.

The room imports the front room, the decision, the audit and custody, never mitmproxy, the edge or a credential
kind; the process that runs it is `egress_proxy.run.lane`. docs/lane.md says what the lane does and does not do.
"""
