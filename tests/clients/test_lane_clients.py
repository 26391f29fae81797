"""Real, unmodified pip, npm and git through the Envoy lane, configured by `egresslaw sandbox-env --lane` alone.

The mitmproxy edge and the lane run side by side (one CA, one artifact). `sandbox-env` gives the sandbox of a profile
the lane serves the lane's address and nothing else. Every request the
clients make is decided by the lane's authorizer and audited in the lane's chain; the edge sees none of them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys

import pytest

from tests.clients import standins as si
from tests.clients.world import lane_beside_edge, ok

pytestmark = pytest.mark.slow

POLICY = """egresslaw 1

workspace "acme"
catalog "2026.11"

sandbox_profile "builder" {
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {
    "type": "limited",
    "allowed_hosts": ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "github.com"],
    "allow_package_managers": false,
    "allow_mcp_servers": false
  }
}
"""


def test_pip_npm_and_git_through_the_lane_configured_by_sandbox_env_only(tmp_path):
    if shutil.which("git") is None or shutil.which("npm") is None:
        pytest.skip("git and npm are needed to build the stand-ins")
    with lane_beside_edge(tmp_path, POLICY) as w:
        world, lane, loop, port, audit = w.world, w.lane, w.loop, w.port, w.audit
        sandbox, home = world.sandbox_env("--profile", "builder", "--lane", f"127.0.0.1:{port}")
        assert sandbox["HTTPS_PROXY"].endswith(f"@127.0.0.1:{port}") and sandbox["HTTP_PROXY"] == sandbox["HTTPS_PROXY"]
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
        ok(world.run([*pip, "install", "--no-deps", "--target", str(home / "site"), si.WHEEL_NAME], sandbox, home))
        assert (home / "site" / "egresslaw_demo" / "__init__.py").is_file()
        project = home / "project"
        project.mkdir()
        ok(world.run(["npm", "init", "-y"], sandbox, home, cwd=project))
        ok(world.run(["npm", "install", si.NPM_PLAIN], sandbox, home, cwd=project))
        assert (project / "node_modules" / si.NPM_PLAIN / "package.json").is_file()
        ok(world.run(["git", "clone", "-q", f"https://github.com/{si.GIT_REPO}", str(home / "clone")], sandbox, home))
        assert (home / "clone" / si.GIT_FILE).read_text() == si.GIT_TEXT
        # a host the profile does not list: refused by the lane, with its reason
        denied = world.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "https://api.github.com/"], sandbox, home)
        assert denied.stdout.decode().strip() in ("403", "000")
        asyncio.run_coroutine_threadsafe(lane.ingester.poll(), loop).result(30)
        events = [json.loads(line) for line in audit.read_text().splitlines()]
        allowed = {e["host"] for e in events if e.get("kind") == "connect" and e.get("decision") == "allow"}
        assert allowed == {"pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "github.com"}
        denials = {(e["host"], e["reason"]) for e in events if e.get("decision") == "deny"}
        # git's libcurl asks without credentials first and answers the 407 challenge: its lease-missing is expected
        assert ("api.github.com", "profile-host-not-allowed") in denials and denials <= {
            ("api.github.com", "profile-host-not-allowed"), ("github.com", "lease-missing")}, denials
        assert not world.events(f"sandbox-{world._n}"), "the edge saw a request the lane serves"
        lease_text = audit.read_text()
        assert not any(t in lease_text for t in world.leases)
