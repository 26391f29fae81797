"""The fast lane: sandbox-profile traffic on a compiled Envoy data plane, decided by the same core.

- `egress_proxy.lane.envoy`: the artifact compiled to Envoy configuration (which profiles the lane serves, its
  listeners, routes, clusters and the leaf certificates it needs);
- `egress_proxy.lane.translate`: the translation check, reading that configuration back;
- `egress_proxy.lane.authorize`: the authorizer Envoy asks once per CONNECT and per plain-HTTP request
  (lease, `decide_connect` / `decide`, resolver answers), and its event;
- `egress_proxy.lane.dnsfront`: the resolver Envoy dials through, which answers only what the worker admits;
- `egress_proxy.lane.ingest`: Envoy's access log turned into events of the chained audit log.

The room imports the decision, the audit and custody, never mitmproxy or the edge; the process that runs it is
`egress_proxy.run.lane`. docs/lane.md says what the lane does and does not do.
"""
