"""The lock: published versions, bumps on change, drift detection, and catalog pinning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import catalog.model as catalog_model
from compiler.compile import compile_paths
from compiler.lock import apply_lock, read_lock, render_lock

ROOT = Path(__file__).resolve().parents[2]
BASE = """egresslaw 1
workspace "acme"
catalog "{catalog}"

sandbox_profile "builder" {{
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {{"type": "limited", "allowed_hosts": [{hosts}], "allow_package_managers": true}}
  package_managers = ["pip"]
}}

connection "github" {{
  credential = "gh"
  egress "read" {{
    host = "api.github.com"
    path_prefix = "{prefix}"
    methods = ["GET"]
  }}
}}
"""


def _compile(tmp: Path, catalog="2026.11", hosts='"api.github.com"', prefix="/repos/acme"):
    (tmp / "policy.egress").write_text(BASE.format(catalog=catalog, hosts=hosts, prefix=prefix))
    result = compile_paths([tmp])
    assert result.ok, [d.message for d in result.diagnostics]
    lock_file = tmp / "egresslaw.lock"
    locked = apply_lock(result.artifact, read_lock(lock_file))
    lock_file.write_text(render_lock(locked.lock))
    return locked


def _versions(locked):
    return {p.name: p.version for p in locked.artifact.sandbox_profiles} | {c.name: c.version for c in locked.artifact.connections}


def test_first_compile_publishes_version_1_and_recompile_changes_nothing(tmp_path):
    first = _compile(tmp_path)
    assert _versions(first) == {"builder": 1, "github": 1}
    assert {c.kind for c in first.changes} == {"new"}
    again = _compile(tmp_path)
    assert again.changes == []
    assert again.artifact.to_json() == first.artifact.to_json()


def test_a_change_bumps_only_that_subject_and_reports_hosts(tmp_path):
    _compile(tmp_path)
    changed = _compile(tmp_path, hosts='"api.github.com", "uploads.github.com"')
    assert _versions(changed) == {"builder": 2, "github": 1}
    [change] = changed.changes
    assert change.key == "sandbox_profile:builder" and change.kind == "changed"
    assert change.hosts_added == ("uploads.github.com:443",) and change.hosts_removed == ()
    narrowed = _compile(tmp_path, hosts="", prefix="/repos/acme/app")
    assert _versions(narrowed) == {"builder": 3, "github": 2}
    assert {c.key: c.hosts_removed for c in narrowed.changes}["sandbox_profile:builder"] == ("api.github.com:443", "uploads.github.com:443")


def test_previous_state_is_rebuilt_from_the_lock(tmp_path):
    first = _compile(tmp_path)
    second = _compile(tmp_path, prefix="/repos")
    assert second.previous is not None
    old = second.previous.connection("github")
    assert old.rules[0].path_prefix == "/repos/acme" and old.version == 1
    assert second.previous.profile("builder") == first.artifact.profile("builder")


def test_removed_subject_keeps_its_version_history(tmp_path):
    _compile(tmp_path)
    (tmp_path / "policy.egress").write_text(BASE.format(catalog="2026.11", hosts='"x.io"', prefix="/").split("connection")[0])
    result = compile_paths([tmp_path])
    locked = apply_lock(result.artifact, read_lock(tmp_path / "egresslaw.lock"))
    assert ("connection:github", "removed") in {(c.key, c.kind) for c in locked.changes}
    (tmp_path / "egresslaw.lock").write_text(render_lock(locked.lock))
    back = _compile(tmp_path)
    assert _versions(back)["github"] == 2  # not 1 again: a re-added subject is a new publication


@pytest.fixture
def newer_catalog(tmp_path_factory, monkeypatch):
    """A copy of the catalog data with a `2099.01` that adds a pip host, as a new publication would."""
    data = tmp_path_factory.mktemp("catalog-data")
    shutil.copytree(catalog_model.DATA_DIR, data, dirs_exist_ok=True)
    shutil.copytree(data / "2026.11", data / "2099.01")
    pm = json.loads((data / "2099.01" / "package_managers.json").read_text())
    pm["version"] = "2099.01"
    pm["ecosystems"]["pip"].append({"host": "pypi-mirror.example-cdn.net", "port": 443, "source": "test"})
    (data / "2099.01" / "package_managers.json").write_text(json.dumps(pm))
    monkeypatch.setattr(catalog_model, "DATA_DIR", data)
    catalog_model.load_catalog.cache_clear()
    yield
    catalog_model.load_catalog.cache_clear()


def test_catalog_change_reaches_a_profile_only_as_a_new_version(tmp_path, newer_catalog):
    first = _compile(tmp_path)
    pinned = _compile(tmp_path)  # a newer catalog exists, but the policy pins 2026.11: nothing moves
    assert pinned.changes == [] and _versions(pinned)["builder"] == 1
    adopted = _compile(tmp_path, catalog="2099.01")
    assert _versions(adopted)["builder"] == 2
    change = {c.key: c for c in adopted.changes}["sandbox_profile:builder"]
    assert change.hosts_added == ("pypi-mirror.example-cdn.net:443",)
    assert adopted.artifact.profile("builder").network_policy_hash != first.artifact.profile("builder").network_policy_hash
