"""The mitmproxy edge: where a flow becomes the decision's inputs and the decision becomes an answer.

In the order a request meets them:
- `limits`    — head, line, body and per-client bounds, enforced in mitmproxy's layers.
- `flowcontrol` — HTTP/2 queues metered: backpressure, stalls, rapid resets, what the client was given.
- `layers`    — the patches to mitmproxy's HTTP layers (response heads bounded, trailers, protocol errors).
- `addon`     — `EgressLaw`: options, reload, lifecycle, the client records, and a hook table handing every other
                hook to the collaborators below.
- `requests`  — `RequestPath`: a CONNECT or request head read into the shared admission, its body bounded, its
                decision event written ahead.
- `binding`   — `LeaseBinding`: the admission's hooks for a client connection; its claim on one lease.
- `gate`      — `TunnelGate`: TLS and raw bytes inside a tunnel judged, refusals without a flow audited.
- `attach`    — `Attacher`: the credential a request carries (custody, the broker's mints and their token endpoint
                calls), the head written upstream, signatures.
- `upstreams` — `Upstreams`: vetted answers pinned per client connection, the only address a dial uses, reuse keys.
- `flows`     — the state records (one `Client` per client connection, its `Tunnel`, one `FlowState` per flow), what
                the addon's mixin declares it takes from it, and the readings of a flow the others share.
- `responses` — `ResponsePath`: the response hooks; heads cleaned, credentialed bodies scanned.
- `events`    — `AuditTrail`, the addon's audit: the decision event written ahead, one closing event per flow.
- `scanner`   — the response scanner: every coding undone, the credential redacted as it streams.
- `denials`   — the one builder of the proxy's own answers (403/407/503 JSON, `X-Egresslaw-Deny`).
- `startup`   — what only `egresslaw proxy` loads before anything listens: custody, credentials, caps (fail closed).

Settings, the shared start-up, the resolver and the CA are the front room's (`egress_proxy.front`), below the
edge and the lane alike. May import `front`, `credentials`, `decision`, `custody`, `audit` and the z3-free
`proofs.gate`; never `run`, the lane or the CLI.
"""
