"""Releases a team can pin: one version everywhere, a changelog entry for it, pins in the docs that name its tag, and
`deploy/release.sh`, which builds dist/ and tags `v<version>` only from a clean tree whose versions agree.

The script runs on a scratch git copy of the tracked tree (never on this repository: no tag is made here).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

import egresslaw

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\S+))?\s*$", re.MULTILINE)
REV = re.compile(r"\brev:\s*(?P<rev>[^\s,}\]#]+)")


def test_the_version_is_one_in_pyproject_the_package_and_the_changelog() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    assert egresslaw.__version__ == VERSION
    headings = HEADING.findall((ROOT / "CHANGELOG.md").read_text())
    assert headings and headings[0][0] == VERSION, f"CHANGELOG.md's first release is {headings[:1]}, the package is {VERSION}"
    versions = [tuple(map(int, v.split("."))) for v, _ in headings]
    assert versions == sorted(set(versions), reverse=True), "releases newest first, each once"
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) for _, date in headings), headings


def test_every_documented_rev_pins_this_release_tag() -> None:
    places = [*sorted((ROOT / "docs").glob("*.md")), ROOT / ".pre-commit-hooks.yaml"]
    found = {(path.relative_to(ROOT).as_posix(), m["rev"]) for path in places for m in REV.finditer(path.read_text())}
    assert {path for path, _ in found} >= {"docs/ci.md", ".pre-commit-hooks.yaml"}  # the check has something to check
    assert {rev for _, rev in found} == {f"v{VERSION}"}, sorted(found)


# -- deploy/release.sh on a scratch copy -------------------------------------------------------------------------------

GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
# Stands in for `python -m build --outdir dist .` where a test is about the checks and the tag, not the build.
FAKE_BUILD = """#!/bin/sh
set -e
[ "$1 $2 $3 $4 $5" = "-m build --outdir dist ." ] || { echo "unexpected: $*" >&2; exit 9; }
mkdir -p dist && touch "dist/egresslaw-$VERSION.tar.gz" "dist/egresslaw-$VERSION-py3-none-any.whl"
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_ENV}, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The tracked tree (with this working copy's edits) committed in a new repository."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of egresslaw")
    repo = tmp_path / "repo"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, listed):
        rel = Path(name.decode())
        if (ROOT / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, repo / rel)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "release candidate")
    return repo


def _release(repo: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(GIT_ENV, PYTHON=python, VERSION=VERSION)
    return subprocess.run(["bash", "deploy/release.sh", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def _fake_python(tmp_path: Path) -> str:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_BUILD)
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.slow
def test_dry_run_builds_the_sdist_and_wheel_and_tags_nothing(copy: Path) -> None:
    proc = _release(copy, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"would tag v{VERSION}" in proc.stdout
    built = sorted(p.name for p in (copy / "dist").iterdir())
    assert built == [f"egresslaw-{VERSION}-py3-none-any.whl", f"egresslaw-{VERSION}.tar.gz"]
    with tarfile.open(copy / "dist" / f"egresslaw-{VERSION}.tar.gz") as tar:
        assert f"egresslaw-{VERSION}/CHANGELOG.md" in tar.getnames()
    assert _git(copy, "tag", "--list") == ""
    assert _git(copy, "status", "--porcelain") == ""  # dist/ and the egg-info are ignored: the next run starts clean


def test_release_tags_the_version_once_annotated_at_head(copy: Path, tmp_path: Path) -> None:
    python = _fake_python(tmp_path)
    proc = _release(copy, python=python)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _git(copy, "tag", "--list") == f"v{VERSION}\n"
    assert _git(copy, "cat-file", "-t", f"v{VERSION}").strip() == "tag"  # annotated, not a lightweight ref
    assert _git(copy, "rev-list", "-n", "1", f"v{VERSION}") == _git(copy, "rev-parse", "HEAD")
    again = _release(copy, python=python)
    assert again.returncode == 1 and f"tag v{VERSION} already exists" in again.stderr
    assert _release(copy, "--dry-run", python=python).returncode == 1  # a dry run refuses it too


def test_release_refuses_a_dirty_tree(copy: Path, tmp_path: Path) -> None:
    (copy / "notes.txt").write_text("untracked\n")
    proc = _release(copy, python=_fake_python(tmp_path))
    assert proc.returncode == 1 and "not clean" in proc.stderr and "notes.txt" in proc.stderr
    assert not (copy / "dist").exists() and _git(copy, "tag", "--list") == ""


@pytest.mark.parametrize(("path", "old", "new", "message"), [
    ("egresslaw/__init__.py", f'__version__ = "{VERSION}"', '__version__ = "9.9.9"', "egresslaw/__init__.py says 9.9.9"),
    ("CHANGELOG.md", f"## [{VERSION}]", "## [9.9.9]", "the first release in CHANGELOG.md is 9.9.9"),
])
def test_release_refuses_versions_that_disagree(copy: Path, tmp_path: Path, path: str, old: str, new: str, message: str) -> None:
    text = (copy / path).read_text()
    assert old in text
    (copy / path).write_text(text.replace(old, new, 1))
    _git(copy, "commit", "-q", "-a", "-m", "drift")
    proc = _release(copy, python=_fake_python(tmp_path))
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert _git(copy, "tag", "--list") == ""


def test_release_takes_only_dry_run(copy: Path) -> None:
    proc = _release(copy, "--push")
    assert proc.returncode == 2 and "usage" in proc.stderr
