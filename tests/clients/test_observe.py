"""Observe first, then a reviewed, proved change: the loop issue 24 describes, on the real proxy with real pip.

1. A profile in observe mode lists pypi.org only; a real `pip install` (configured by `sandbox-env` alone) fetches
   the wheel from files.pythonhosted.org too: it succeeds, and the audit says `would-deny` for that host, the log
   warns, `/metrics` counts it.
2. `egresslaw propose --audit DIR POLICY` proposes exactly that host entry, with the events as evidence.
3. `--enforce --within` a ceiling that lists the host: exit 0; a ceiling that does not: exit 1 with a counterexample,
   and `--write` writes nothing.
4. The diff applied (`--write --enforce`: observe mode ends in the same reviewed change), recompiled: the same
   install passes enforced, with no `would-deny`, and a host outside the new allowlist is denied.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.compile import compile_paths
from tests.clients import standins as si
from tests.clients.world import EGRESSLAW, close, ok, serve

pytestmark = pytest.mark.slow

POLICY = """egresslaw 1

workspace "acme"
catalog "2026.11"

# A new build image: observed until the team knows what it needs.
sandbox_profile "builder" {
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  enforce = "observe"
  network = {
    "type": "limited",
    "allowed_hosts": ["pypi.org"],
    "allow_package_managers": false,
    "allow_mcp_servers": false
  }
}
"""


def _ceiling(root: Path, hosts: list[str]) -> Path:
    """An operator's ceiling: the same profile, enforced, with `hosts`."""
    d = root / f"ceiling-{len(hosts)}"
    d.mkdir()
    text = POLICY.replace('  enforce = "observe"\n', "").replace('["pypi.org"]', json.dumps(hosts))
    (d / "ceiling.egress").write_text(text)
    return d


def _artifact(policy: Path):
    result = compile_paths([policy])
    assert result.artifact is not None, [d.message for d in result.diagnostics]
    return result.artifact


def _pip_install(world, home_tag: str) -> tuple[dict, Path]:
    env, home = world.sandbox_env("--profile", "builder")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-cache-dir"]
    ok(world.run([*pip, "install", "--no-deps", "--target", str(home / "site"), si.WHEEL_NAME], env, home))
    assert (home / "site" / "egresslaw_demo" / "__init__.py").is_file(), home_tag
    return env, home


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([EGRESSLAW, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_observe_propose_prove_within_and_enforce(tmp_path):
    if shutil.which("git") is None or shutil.which("npm") is None:
        pytest.skip("git and npm are needed to build the stand-ins")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "builder.egress").write_text(POLICY)
    services = si.start(tmp_path / "standins")
    try:
        # 1. observe: the install works, and the audit says what enforcement would have refused
        world = serve(tmp_path / "observe", services, _artifact(policy))
        try:
            _pip_install(world, "observe")
            subject = f"sandbox-{world._n}"
            events = world.events(subject)
            would = [e for e in events if e["decision"] == "would-deny"]
            assert {(e["host"], e["port"], e["reason"]) for e in would} == {("files.pythonhosted.org", 443, "profile-host-not-allowed")}
            assert {e["host"] for e in events if e["decision"] == "allow"} == {"pypi.org"}
            assert "would-deny profile-host-not-allowed" in world.proxy.logs.text()
            assert world.proxy.metric("egresslaw_would_deny_total", kind="connect", reason="profile-host-not-allowed") >= 1
            audit_dir = world.env.audit.parent
        finally:
            close(world)
        # 2. the proposal: exactly the missing host, with its evidence
        proposed = _cli("propose", "--audit", str(audit_dir), str(policy), "--format", "json", cwd=tmp_path)
        assert proposed.returncode == 0, proposed.stderr
        proposal = json.loads(proposed.stdout)
        (change,) = proposal["changes"]
        assert change["subject"].endswith("builder") and "files.pythonhosted.org" in json.dumps(change["add"])
        assert set(change["evidence"]["events"]) <= {e["id"] for e in would} and change["evidence"]["count"] >= 1
        assert "+" in proposal["diff"] and '"files.pythonhosted.org"' in proposal["diff"]
        # 3. with observe mode ended (--enforce): proved within a ceiling that allows the host, refuted by one that
        # does not; still observed, the profile reaches any host, so no enforced ceiling holds it
        wide, narrow = _ceiling(tmp_path, ["pypi.org", "files.pythonhosted.org"]), _ceiling(tmp_path, ["pypi.org"])
        inside = _cli("propose", "--audit", str(audit_dir), str(policy), "--enforce", "--within", str(wide), cwd=tmp_path)
        assert inside.returncode == 0, inside.stdout + inside.stderr
        assert 'enforce = "enforce"' in inside.stdout and "within" in inside.stdout and ": proved" in inside.stdout
        outside = _cli("propose", "--audit", str(audit_dir), str(policy), "--enforce", "--within", str(narrow), cwd=tmp_path)
        assert outside.returncode == 1, outside.stdout + outside.stderr
        assert "files.pythonhosted.org" in outside.stdout and "refuted" in outside.stdout
        observed = _cli("propose", "--audit", str(audit_dir), str(policy), "--within", str(wide), cwd=tmp_path)
        assert observed.returncode == 1 and "stays in observe mode" in observed.stdout, observed.stdout
        refused = _cli("propose", "--audit", str(audit_dir), str(policy), "--enforce", "--within", str(narrow), "--write", cwd=tmp_path)
        assert refused.returncode == 1 and "not written" in refused.stderr and "files.pythonhosted.org" not in (policy / "builder.egress").read_text()
        # 4. applied (observe mode ended), recompiled: the same install passes enforced, nothing would-deny
        applied = _cli("propose", "--audit", str(audit_dir), str(policy), "--enforce", "--within", str(wide), "--write", cwd=tmp_path)
        assert applied.returncode == 0, applied.stderr
        assert 'enforce = "enforce"' in (policy / "builder.egress").read_text()
        enforced = _artifact(policy)
        assert enforced.profile("builder").enforce == "enforce"
        assert {(h.host, h.port) for h in enforced.profile("builder").network.allowed_hosts} == {
            ("pypi.org", 443), ("files.pythonhosted.org", 443)}
        world = serve(tmp_path / "enforce", services, enforced)
        try:
            env, home = _pip_install(world, "enforce")
            events = world.events(f"sandbox-{world._n}")
            assert events and {e["decision"] for e in events} == {"allow"}
            # and the allowlist is the boundary again: a host it does not list is denied
            curl = world.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "https://registry.npmjs.org/"], env, home)
            assert curl.stdout.decode().strip() in ("403", "000"), curl.stdout + curl.stderr
            denied = [e for e in world.events(f"sandbox-{world._n}") if e["decision"] == "deny"]
            assert {(e["host"], e["reason"]) for e in denied} == {("registry.npmjs.org", "profile-host-not-allowed")}
        finally:
            close(world)
        for text in (proposed.stdout, proposed.stderr, inside.stdout, outside.stdout, applied.stdout):
            assert "el2." not in text and "Proxy-Authorization" not in text  # no lease in a proposal or its evidence
    finally:
        services.stop()
