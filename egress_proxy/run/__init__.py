"""Running the edge: one process or a fleet of them.

- `server`      — `Edge`: an embedded mitmproxy master with the addon, its admin port, drain and reload.
- `supervisor`  — `egresslaw proxy --workers N`: N proxy processes behind one address, supervised.
- `metrics`     — `/metrics` (Prometheus text format), one process or the whole fleet.

The top room below the CLI: may import every other room; nothing imports it but the CLI.
"""
