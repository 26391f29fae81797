"""The lock: published versions, bumps on change, drift detection, and catalog pinning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import catalog.model as catalog_model
from compiler.compile import compile_paths, compile_text
from compiler.lock import apply_lock, read_lock, render_lock, shape_widenings

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


# ---------------------------------------------------------------------------------------------
# Request shapes: the prover takes them as free inputs, so shape_widenings judges a change of them, conservatively.

SHAPED = """egresslaw 1
workspace "acme"
catalog "2026.11"

connection "c" {{
  credential = "c-cred"
  egress "r" {{
    host = "api.example.com"
    methods = ["GET", "POST"]
    headers = ["Accept"]
    {shapes}
  }}
}}
"""


def _shaped(shapes: str):
    result = compile_text(SHAPED.format(shapes=shapes))
    assert result.ok, [(d.code, d.message) for d in result.diagnostics]
    return result.artifact


@pytest.mark.parametrize(
    "before, after",
    [
        ("", 'query = { q = "a" }'),  # a shape added
        ('query = { q = ["a", "b"], n = { type = "integer" } }', 'query = { q = "a" }'),  # a parameter, an enum value removed
        ('query = { n = { type = "integer", minimum = 1 } }', 'query = { n = { type = "integer", minimum = 5, maximum = 9 } }'),
        ('query = { s = { pattern = "[a-z]+" } }', 'query = { s = ["ab", "c"] }'),  # an enum the pattern admits
        ('header_values = { Accept = ["a", "b"] }', 'header_values = { Accept = "a" }'),
        ('path = "/r/{x}"', 'path = "/r/{x:a|b}"'),
        ('path = "/r/{n:int}"', 'path = "/r/7"'),
        ('mcp = { tools = { t = { arguments = { a = {} }, additional = true } } }',
         'mcp = { methods = ["tools/call"], tools = { t = { arguments = { a = ["x"] }, required = ["a"] } } }'),
        ('graphql = { query = ["a", "b"], introspection = true }', 'graphql = { query = ["a"] }'),
        ('git = { fetch = true, push = ["refs/heads/a/*", "refs/heads/b"], create = true }\n    path_prefix = "/x.git"',
         'git = { push = ["refs/heads/b"] }\n    path_prefix = "/x.git"'),
        ('graphql = { query = ["a"] }\n    max_body = 4096', 'graphql = { query = ["a"] }\n    max_body = 1024'),
    ],
)
def test_a_narrower_shape_is_no_widening(before, after):
    assert shape_widenings(_shaped(before), _shaped(after)) == []
    assert shape_widenings(_shaped(after), _shaped(before)) != [] or before == ""


@pytest.mark.parametrize(
    "before, after, words",
    [
        ('query = { q = "a" }', "", "query"),  # a shape removed
        ('query = { q = "a" }', 'query = { q = "a", r = "b" }', "query"),
        ('query = { s = { pattern = "[a-z]+" } }', 'query = { s = { pattern = "[a-c]+" } }', "query"),  # not proved
        ('header_values = { Accept = "a" }', "", "header_values"),
        ('path = "/r/{x:a|b}"', 'path = "/r/{x}"', "template"),
        ('path = "/r/{x}"', 'path = "/r/{x}/"', "template"),
        ('path = "/r/{x}"', 'path_prefix = "/r"', "template"),
        ('mcp = {}', 'mcp = { responses = true }', "mcp"),
        ('mcp = { tools = { t = {} } }', 'mcp = { tools = { t = { additional = true } } }', "mcp"),
        ('mcp = {}', 'graphql = { query = ["a"] }', "mcp"),
        ('git = { push = ["refs/heads/a/b"] }\n    path_prefix = "/x.git"', 'git = { push = ["refs/heads/a/*"] }\n    path_prefix = "/x.git"', "git"),
        ('git = { fetch = true }\n    path_prefix = "/x.git"', 'git = { fetch = true }\n    path_prefix = "/x.git"\n    max_body = 2097152', "max_body"),
    ],
)
def test_a_looser_or_unproved_shape_change_widens(before, after, words):
    found = shape_widenings(_shaped(before), _shaped(after))
    assert len(found) == 1 and found[0][0] == "connection:c" and words in found[0][1], found


def test_a_renamed_rule_is_held_to_the_published_rules_on_its_host():
    old = _shaped('query = { q = "a" }')
    renamed = _shaped("").model_copy(deep=True)
    conn = renamed.connections[0]
    rules = (conn.rules[0].model_copy(update={"name": "other"}),)
    renamed = renamed.model_copy(update={"connections": (conn.model_copy(update={"rules": rules}),)})
    assert shape_widenings(old, renamed) == [("connection:c", "rule `other` drops or loosens its `query` shape")]
