"""Running the front ends: one process or a fleet of them.

- `server`      — `Edge`: an embedded mitmproxy master with the addon, its admin port, drain and reload.
- `supervisor`  — `egresslaw proxy --workers N`: N proxy processes behind one address, supervised.
- `metrics`     — `/metrics` (Prometheus text format) and the admin listener, one process or the whole fleet.
- `exporter`    — `--export-to`: the audit exporter (`egresslaw audit export --follow`) as a supervised child
                  process, and its metrics read from its checkpoint.
- `lane`        — `egresslaw lane`: Envoy, the authorizer, the DNS front and the access-log reader in one process
                  (it imports neither the edge, credential kinds nor mitmproxy: a contract).

The top room below the CLI: may import every other room; nothing imports it but the CLI.
"""
