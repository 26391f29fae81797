"""Real, unmodified Python 3.11 clients through the Envoy lane, configured by `egresslaw sandbox-env --lane` alone.

Python 3.11's `http.client` opens a proxy tunnel with `CONNECT host:443 HTTP/1.0`: the lane must serve it as the
mitmproxy edge does (Envoy answered 426 with no reason before it accepted HTTP/1.0). `python3` on PATH is the
interpreter under test (CPython 3.11 with pip 23 on this project's machines), not the virtualenv's.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest

from tests.clients import standins as si
from tests.clients.test_lane_clients import POLICY
from tests.clients.world import lane_beside_edge, ok

pytestmark = pytest.mark.slow

URLLIB = """
import json, os, ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
with urllib.request.urlopen("https://pypi.org/simple/egresslaw-demo/", context=ctx, timeout=60) as r:
    print(json.dumps({"status": r.status, "version": sys.version_info[:2]}))
"""


def _python311() -> str:
    python = shutil.which("python3")
    if python is None:
        pytest.skip("no python3 on PATH")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2] < (3, 12))"], capture_output=True, text=True, timeout=60)
    if version.stdout.strip() != "True":
        pytest.skip("python3 on PATH is not older than 3.12 (its http.client no longer tunnels with HTTP/1.0)")
    return python


def test_python311_urllib_and_pip_tunnel_with_http10_through_the_lane(tmp_path):
    python = _python311()
    with lane_beside_edge(tmp_path, POLICY) as w:
        world, lane, loop, port, audit = w.world, w.lane, w.loop, w.port, w.audit
        sandbox, home = world.sandbox_env("--profile", "builder", "--lane", f"127.0.0.1:{port}")
        assert sandbox["HTTPS_PROXY"].endswith(f"@127.0.0.1:{port}")
        sandbox = {**sandbox, "SSL_CERT_FILE": str(home / "ca-bundle.pem")}
        shown = json.loads(ok(world.run([python, "-c", URLLIB], sandbox, home)))
        assert shown["status"] == 200 and shown["version"] < [3, 12], shown
        pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir", "--no-input"]
        ok(world.run([*pip, "download", "--no-deps", "--dest", str(home / "dl"), si.WHEEL_NAME], sandbox, home, timeout=300))
        assert any(p.name.startswith("egresslaw_demo-1.0.0") for p in (home / "dl").iterdir())
        asyncio.run_coroutine_threadsafe(lane.ingester.poll(), loop).result(30)
        events = [json.loads(line) for line in audit.read_text().splitlines()]
        allowed = {e["host"] for e in events if e.get("kind") == "connect" and e.get("decision") == "allow"}
        assert {"pypi.org", "files.pythonhosted.org"} <= allowed, allowed
        refused = [(e.get("host"), e.get("reason")) for e in events if e.get("decision") == "deny"]
        assert not refused, refused  # no 426, no internal-error: every tunnel was decided and admitted
        assert not any(t in audit.read_text() for t in world.leases)
