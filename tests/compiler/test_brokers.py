"""`brokers = [...]` on a sandbox profile: the artifact records it in the order written, the lock hash covers it (and
the brokered connections), and publishing a new broker is a widening that needs `--allow-widening`.

Admission errors (EL0030, EL0039, EL0040, W0002) have golden files: tests/golden/brokers-broken and policies/examples."""

from __future__ import annotations

import json
from pathlib import Path

from compiler.compile import compile_paths, compile_text
from compiler.lock import apply_lock, read_lock, render_lock
from egresslaw.cli import main

POLICY = """egresslaw 1
workspace "acme"
catalog "2026.11"

connection "github" {{
  credential = "gh-read"
  egress "refs" {{
    host = "github.com"
    path_prefix = "{prefix}"
    methods = ["GET"]
  }}
}}

connection "status" {{
  credential = "status-token"
  egress "post" {{
    host = "hooks.status-board.io"
    methods = ["POST"]
  }}
}}

sandbox_profile "builder" {{
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {{"type": "limited", "allowed_hosts": ["github.com", "hooks.status-board.io"]}}
  {brokers}
}}
"""


def _write(tmp_path: Path, brokers: str = "", prefix: str = "/acme/") -> Path:
    (tmp_path / "policy.egress").write_text(POLICY.format(brokers=brokers, prefix=prefix))
    return tmp_path


def _publish(tmp_path: Path, **kw):
    result = compile_paths([_write(tmp_path, **kw)])
    assert result.ok, [d.message for d in result.diagnostics]
    lock_file = tmp_path / "egresslaw.lock"
    locked = apply_lock(result.artifact, read_lock(lock_file))
    lock_file.write_text(render_lock(locked.lock))
    return {p.name: p.version for p in locked.artifact.sandbox_profiles} | {c.name: c.version for c in locked.artifact.connections}


def test_the_artifact_keeps_the_written_order_and_leaves_out_an_empty_list():
    result = compile_text(POLICY.format(brokers="brokers = [status, \"github\"]", prefix="/acme/"))
    assert result.ok
    doc = json.loads(result.artifact.to_json())
    assert doc["sandbox_profiles"][0]["brokers"] == ["status", "github"]  # precedence order, never sorted
    plain = json.loads(compile_text(POLICY.format(brokers="", prefix="/acme/")).artifact.to_json())
    assert "brokers" not in plain["sandbox_profiles"][0]  # so every artifact and lock from before brokering is unchanged


def test_a_broker_or_a_brokered_connection_that_changes_is_a_new_version_of_the_profile(tmp_path):
    assert _publish(tmp_path) == {"builder": 1, "github": 1, "status": 1}
    assert _publish(tmp_path, brokers="brokers = [github]") == {"builder": 2, "github": 1, "status": 1}
    assert _publish(tmp_path, brokers="brokers = [github]") == {"builder": 2, "github": 1, "status": 1}
    # the brokered connection changes: it is a new version, and so is the profile whose requests carry its credential
    assert _publish(tmp_path, brokers="brokers = [github]", prefix="/acme/app/") == {"builder": 3, "github": 2, "status": 1}
    # a connection the profile does not broker changes nothing for it
    assert _publish(tmp_path, brokers="brokers = [github, status]", prefix="/acme/app/")["builder"] == 4


def test_compile_refuses_a_new_broker_without_allow_widening(tmp_path, capsys):
    policy = _write(tmp_path)
    out = str(tmp_path / "build.json")
    assert main(["compile", str(policy), "-o", out]) == 0
    _write(tmp_path, brokers="brokers = [github]")
    capsys.readouterr()
    assert main(["compile", str(policy), "-o", out]) == 1
    err = capsys.readouterr().err
    assert "error[EL0037]: sandbox_profile:builder widens its published version" in err
    assert "old ALLOW, new ALLOW (brokered by `github`, rule `refs`)" in err
    assert main(["compile", str(policy), "-o", out, "--allow-widening"]) == 0
    assert "widening accepted: sandbox_profile:builder" in capsys.readouterr().out
    assert main(["compile", str(policy), "-o", out, "--locked"]) == 0
