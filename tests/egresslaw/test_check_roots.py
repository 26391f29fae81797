"""Which policy a path belongs to: per-file `check` (pre-commit passes files), several roots, single-file policies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"
EXAMPLES = ROOT / "policies" / "examples"


def _ok(root: Path) -> str:
    return f"ok: {root}: 5 file(s), 3 profile(s), 6 connection(s), 3 worker(s)\n"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A monorepo: two teams' policies (same names inside, different workspaces) and a directory of single-file policies."""
    for team in ("team-a", "team-b"):
        shutil.copytree(DEMO, tmp_path / "policies" / team)
        workers = tmp_path / "policies" / team / "workers.egress"
        workers.write_text(workers.read_text().replace('workspace "acme"', f'workspace "{team}"'))
    shutil.copytree(EXAMPLES, tmp_path / "policies" / "examples")
    (tmp_path / ".git").mkdir()
    return tmp_path


def test_one_file_is_checked_with_the_rest_of_its_policy(cli):
    for name in ("github.egress", "sandboxes.egress", "workers.egress"):
        assert cli("check", DEMO / name) == (0, _ok(DEMO), "")


def test_every_file_of_a_policy_at_once_checks_it_once(cli):
    # what pre-commit passes: the changed files, possibly all of them
    assert cli("check", *sorted(DEMO.glob("*.egress"))) == (0, _ok(DEMO), "")


def test_several_roots_are_checked_separately(cli, repo):
    a, b = repo / "policies" / "team-a", repo / "policies" / "team-b"
    assert cli("check", a, b) == (0, _ok(a) + _ok(b), "")
    assert cli("check", a / "github.egress", b / "sandboxes.egress") == (0, _ok(a) + _ok(b), "")


def test_a_tree_of_policies_checks_each_one_alone(cli, repo):
    code, out, err = cli("check", repo / "policies", "--format", "json")
    assert code == 1
    found = sorted((Path(d["path"]).name, d["code"]) for d in json.loads(out)["diagnostics"])
    # every example raises exactly its own code (and nothing leaks between files or from the teams)
    assert found == sorted((p.name, p.stem.split("-")[0]) for p in EXAMPLES.glob("*.egress"))
    code, out, _ = cli("check", repo / "policies")
    assert _ok(repo / "policies" / "team-a") in out and _ok(repo / "policies" / "team-b") in out


def test_a_file_in_a_subdirectory_belongs_to_the_enclosing_policy(cli, repo):
    team = repo / "policies" / "team-a"
    (team / "more").mkdir()
    (team / "more" / "extra.egress").write_text('egresslaw 1\n\nworker "extra" {\n  ipv6 = false\n}\n')
    code, out, err = cli("check", team / "more" / "extra.egress")
    assert (code, err) == (0, "") and out == f"ok: {team}: 6 file(s), 3 profile(s), 6 connection(s), 4 worker(s)\n"


def test_a_new_policy_next_to_others_is_not_merged_into_them(cli, repo):
    new = repo / "policies" / "team-c"
    new.mkdir()
    (new / "a.egress").write_text('egresslaw 1\n\nworker "w" {\n  ipv6 = false\n}\n')
    code, _, err = cli("check", new / "a.egress")
    assert code == 1 and f"{new / 'a.egress'}:1:11: error[EL0003]: the policy has no `workspace`" in err
    assert "team-a" not in err


def test_relative_paths_from_the_repository_root(cli, repo, monkeypatch):
    monkeypatch.chdir(repo)
    assert cli("check", "policies/team-a/github.egress") == (0, _ok(Path("policies/team-a")), "")
    monkeypatch.chdir(repo / "policies" / "team-a")
    assert cli("check", "github.egress") == (0, _ok(Path(".")), "")


def test_compile_of_a_file_compiles_its_policy(cli, repo):
    team = repo / "policies" / "team-a"
    out_file = repo / "a.json"
    code, out, err = cli("compile", team / "github.egress", "-o", out_file)
    assert code == 0 and err == f"compiling policy `{team}`, which `{team / 'github.egress'}` belongs to\n"
    assert (team / "egresslaw.lock").exists() and json.loads(out_file.read_text())["workspace"] == "team-a"


def test_compile_refuses_a_tree_of_several_policies(cli, repo):
    code, out, err = cli("compile", repo / "policies", "-o", repo / "a.json")
    assert code == 2 and out == "" and not (repo / "a.json").exists()
    assert err.startswith(f"error: `{repo / 'policies'}` holds {len(list(EXAMPLES.glob('*.egress'))) + 2} policies (")  # the examples and two teams
    assert "help: compile them one at a time" in err


def _single(directory: Path, name: str) -> Path:
    path = directory / f"{name}.egress"
    path.write_text(
        f'egresslaw 1\nworkspace "{name}"\ncatalog "2026.11"\n\n'
        f'sandbox_profile "{name}" {{\n  provider = "gvisor@2026.10.1"\n  network = {{"type": "none"}}\n}}\n'
    )
    return path


def test_single_file_policies_sharing_a_directory_keep_separate_locks(cli, tmp_path):
    files = [_single(tmp_path, name) for name in ("one", "two")]
    for f in files:
        assert cli("compile", f, "-o", tmp_path / "x.json")[0] == 0
    assert not (tmp_path / "egresslaw.lock").exists()
    for name in ("one", "two"):
        lock = json.loads((tmp_path / f"{name}.egress.lock").read_text())
        assert list(lock["subjects"]) == [f"sandbox_profile:{name}"]  # never the other's, never a tombstone
    for f in files:
        assert cli("compile", f, "-o", tmp_path / "x.json", "--locked")[0] == 0


def test_a_second_single_file_policy_moves_the_first_ones_lock_visibly(cli, tmp_path):
    one = _single(tmp_path, "one")
    assert cli("compile", one, "-o", tmp_path / "x.json")[0] == 0
    assert (tmp_path / "egresslaw.lock").exists()  # alone in its directory: a directory policy
    _single(tmp_path, "two")
    code, _, err = cli("compile", one, "-o", tmp_path / "x.json", "--locked")
    assert code == 3
    assert f"note: `{tmp_path}` holds several policies, so `{one}` keeps its own lock `{one}.lock`" in err
    assert f"git mv {tmp_path / 'egresslaw.lock'} {one}.lock" in err
