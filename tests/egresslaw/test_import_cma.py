"""`import-cma` for real migrations: many environments into one directory policy, and `packages` narrowing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _env(tmp_path: Path, name: str, networking: dict, **config) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, "config": {"type": "cloud", "networking": networking, **config}}))
    return path


BUILDER = {"type": "limited", "allowed_hosts": ["api.github.com"], "allow_package_managers": True}
PACKAGES = {"type": "packages", "pip": ["requests==2.32.3"], "npm": ["tsx"], "apt": []}


def test_many_environments_join_one_policy_and_one_lock(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("crawler", "summarizer"):
        code, out, _ = cli("import-cma", _env(tmp_path, name, {"type": "none"}), "--into", "policies/agents")
        assert code == 0, out
    assert sorted(p.name for p in Path("policies/agents").iterdir()) == ["crawler.egress", "summarizer.egress", "workspace.egress"]
    assert 'workspace "agents"' in Path("policies/agents/workspace.egress").read_text()
    assert cli("fmt", "--check", "policies/agents")[0] == 0  # imports are written canonically
    code, out, err = cli("compile", "policies/agents", "-o", "a.json")
    assert code == 0, err
    assert "new      sandbox_profile:crawler v1" in out and "new      sandbox_profile:summarizer v1" in out
    # a later import adds one subject; nothing is removed or tombstoned
    assert cli("import-cma", _env(tmp_path, "indexer", {"type": "none"}), "--into", "policies/agents")[0] == 0
    code, out, _ = cli("compile", "policies/agents", "-o", "a.json")
    assert code == 0 and out.splitlines()[0] == "  new      sandbox_profile:indexer v1" and "removed" not in out
    lock = json.loads(Path("policies/agents/egresslaw.lock").read_text())
    assert sorted(lock["subjects"]) == ["sandbox_profile:crawler", "sandbox_profile:indexer", "sandbox_profile:summarizer"]
    assert not any(s.get("removed") for s in lock["subjects"].values())


def test_a_name_already_declared_is_refused_and_nothing_written(cli, tmp_path):
    env = _env(tmp_path, "crawler", {"type": "none"})
    into = tmp_path / "agents"
    assert cli("import-cma", env, "--into", into)[0] == 0
    before = {p.name: p.read_text() for p in into.iterdir()}
    code, out, err = cli("import-cma", env, "--into", into)
    assert (code, out) == (2, "")
    assert err == f"error: `crawler` is already declared in `{into / 'crawler.egress'}`\nhelp: import under another name with `--name NAME`\n"
    assert {p.name: p.read_text() for p in into.iterdir()} == before
    code, out, _ = cli("import-cma", env, "--into", into, "--name", "crawler-eu")
    assert code == 0 and out == f"wrote {into / 'crawler-eu.egress'} (sandbox_profile `crawler-eu`)\n"
    assert cli("check", into)[0] == 0


def test_into_a_directory_keeps_its_workspace_and_catalog(cli, tmp_path):
    into = tmp_path / "agents"
    into.mkdir()
    (into / "base.egress").write_text('egresslaw 1\n\nworkspace "acme"\ncatalog "2026.11"\n')
    env = _env(tmp_path, "crawler", {"type": "none"})
    assert cli("import-cma", env, "--into", into, "--workspace", "other")[0] == 2
    assert cli("import-cma", env, "--into", into, "--catalog", "2025.01")[0] == 2
    code, out, _ = cli("import-cma", env, "--into", into)
    assert code == 0 and not (into / "workspace.egress").exists() and "workspace.egress" not in out
    assert cli("check", into)[0] == 0


def test_packages_narrow_the_package_managers(cli, tmp_path):
    env = _env(tmp_path, "builder", BUILDER, packages=PACKAGES)
    code, out, err = cli("import-cma", env)
    assert code == 0
    assert '  package_managers = ["npm", "pip"]\n' in out
    assert err == "note: `allow_package_managers` narrowed to npm, pip, the ecosystems `packages` installs from\n"
    policy = tmp_path / "builder.egress"
    policy.write_text(out.replace('provider = "', 'trust = "trusted"\n  provider = "'))
    assert cli("compile", policy, "-o", tmp_path / "a.json")[0] == 0
    (profile,) = json.loads((tmp_path / "a.json").read_text())["sandbox_profiles"]
    grants = {h["granted_by"] for h in profile["network"]["allowed_hosts"]}
    assert grants == {"allowed_hosts", "allow_package_managers:npm", "allow_package_managers:pip"}


@pytest.mark.parametrize(("networking", "packages", "note"), [
    ({"type": "limited", "allowed_hosts": ["api.github.com"]}, {"type": "packages", "pip": ["x"]},
     "note: `packages` installs from pip but `allow_package_managers` is not true"),
    (BUILDER, {"type": "packages", "conda": ["numpy"]}, "note: `packages` has keys egresslaw does not know (conda)"),
])
def test_packages_that_cannot_be_honoured_are_said(cli, tmp_path, networking, packages, note):
    code, out, err = cli("import-cma", _env(tmp_path, "e", networking, packages=packages))
    assert code == 0 and err.startswith(note) and "package_managers =" not in out
