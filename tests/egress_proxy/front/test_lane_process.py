"""The lane's process never attaches a credential: importing its runner and its command loads no module of the
edge, of credential kinds, of custody's sealed secrets, nor of mitmproxy (the import-linter contract says so of the
code; this says so of the process)."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("mitmproxy", "egress_proxy.edge", "egress_proxy.credentials", "egress_proxy.custody.secret", "egress_proxy.custody.records",
             "egress_proxy.custody.stores")


def test_importing_the_lane_loads_no_edge_credential_or_mitmproxy_module():
    code = ("import json, sys; import egress_proxy.run.lane, egresslaw.commands.lane, egress_proxy.lane.authorize, egress_proxy.front.admit; "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout)
    assert "egress_proxy.run.lane" in loaded and "egress_proxy.lane.authorize" in loaded  # the check can see what it looks for
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
