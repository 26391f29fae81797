"""The shipped `.pre-commit-hooks.yaml`, run by the real `pre-commit` in a scratch git repository.

Offline by construction: `pre-commit try-repo` runs the manifest's `-system` hooks, which use the
`egresslaw` of this venv (put first on PATH) and install nothing. The `language: python` hooks (which
fetch egresslaw from PyPI on first use) are checked to run the very same command on the same files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.lockfiles import constraints

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (BIN / "pre-commit").exists() or not (ROOT / ".git").exists(),
    reason="needs git, pre-commit and a git checkout of egresslaw",
)

BROKEN = """egresslaw 1

connection "wild" {
  credential = "wild-handle"
  egress "any" {
    host = "*.github.com"
    methods = ["GET"]
  }
}
"""
UGLY = 'egresslaw 1\nworker "spare" { ipv6: false, }\n'


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org",
    }


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(DEMO, repo / "policies" / "demo")
    env = _env(tmp_path)
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    return repo


def _hook(repo: Path, hook: str) -> subprocess.CompletedProcess[str]:
    env = _env(repo.parent)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    return subprocess.run(
        [str(BIN / "pre-commit"), "try-repo", str(ROOT), hook, "--all-files", "--color", "never"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )


def test_the_manifest_is_valid_and_both_flavours_run_the_same_command():
    proc = subprocess.run([str(BIN / "pre-commit"), "validate-manifest", str(ROOT / ".pre-commit-hooks.yaml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hooks = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert set(hooks) == {"egresslaw-check", "egresslaw-fmt", "egresslaw-check-system", "egresslaw-fmt-system"}
    for name in ("check", "fmt"):
        python, system = hooks[f"egresslaw-{name}"], hooks[f"egresslaw-{name}-system"]
        assert (python["language"], system["language"]) == ("python", "system")
        same = ("entry", "files", "args", "require_serial", "pass_filenames")
        assert {k: python.get(k) for k in same} == {k: system.get(k) for k in same}
        assert python["entry"] == f"egresslaw {name}"
        # not `python3`: pre-commit would build the hook's env with its own interpreter, and pip refuses egresslaw below 3.12
        assert python["language_version"] == "python3.12"


def test_check_hook_passes_on_the_demo_and_fails_located_on_a_broken_file(scratch: Path):
    proc = _hook(scratch, "egresslaw-check-system")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "egresslaw check" in proc.stdout and "Passed" in proc.stdout
    (scratch / "policies" / "demo" / "wild.egress").write_text(BROKEN)
    proc = _hook(scratch, "egresslaw-check-system")
    assert proc.returncode == 1 and "Failed" in proc.stdout
    assert "policies/demo/wild.egress:6:12: error[EL0010]: wildcard host `*.github.com`" in proc.stdout
    assert "error[EL0003]" not in proc.stdout and "error[EL0030]" not in proc.stdout  # checked as part of its policy


def test_fmt_hook_rewrites_and_fails_then_passes(scratch: Path):
    ugly = scratch / "policies" / "demo" / "spare.egress"
    ugly.write_text(UGLY)
    proc = _hook(scratch, "egresslaw-fmt-system")
    assert proc.returncode == 1 and "files were modified by this hook" in proc.stdout
    assert ugly.read_text() == 'egresslaw 1\n\nworker "spare" {\n  ipv6 = false\n}\n'
    proc = _hook(scratch, "egresslaw-fmt-system")
    assert proc.returncode == 0, proc.stdout


def _older_python() -> str | None:
    """An interpreter >= 3.9 and < 3.12 that runs (pyenv shims can exist and fail), resolved to its real path."""
    for name in ("python3", "python3.11", "python3.10", "python3.9"):
        if shutil.which(name) is None:
            continue
        probe = subprocess.run([name, "-c", "import sys; print(sys.executable); print(sys.version_info >= (3, 9) and sys.version_info < (3, 12))"],
                               capture_output=True, text=True)
        lines = probe.stdout.split()
        if probe.returncode == 0 and lines[-1:] == ["True"]:
            return lines[0]
    return None


@pytest.mark.slow
def test_the_python_hook_builds_its_own_python3_12_env_under_a_pre_commit_on_an_older_python(tmp_path: Path):
    """A user's pre-commit installed with Python 3.11 (this machine's `python3`) runs the `language: python` hook.

    The hook's `language_version: python3.12` makes pre-commit build the hook's environment with python3.12, which
    pip-installs egresslaw from this checkout (dependencies from PyPI); with `python3` it was the 3.11 of pre-commit
    itself, and pip refused egresslaw (`requires-python >= 3.12`).
    """
    older = _older_python()
    if older is None:
        pytest.skip("no Python >= 3.9 and < 3.12 on PATH to run pre-commit with")
    venv = tmp_path / "pc-venv"
    subprocess.run([older, "-m", "venv", str(venv)], check=True, capture_output=True)
    # pre-commit, and the hook environment it builds (PIP_CONSTRAINT below), at the lock's versions, not today's releases
    pinned = constraints(tmp_path)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(pinned), "pre-commit>=3"], check=True,
                   capture_output=True, timeout=300)
    # python3.12 on PATH the way a user's machine has it: the directory of this venv's base interpreter, not this venv
    # (whose egresslaw would hide an install that failed). pyenv's shims are not in front of it.
    py312 = Path(sys._base_executable).resolve().parent
    repo = tmp_path / "repo"
    shutil.copytree(DEMO, repo / "policies" / "demo")
    env = {**_env(tmp_path), "PATH": os.pathsep.join([str(venv / "bin"), str(py312), "/usr/local/bin", "/usr/bin", "/bin"])}
    env = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"))}
    env["PIP_CONSTRAINT"] = str(pinned)
    assert shutil.which("egresslaw", path=env["PATH"]) is None
    subprocess.run(["git", "init", "-q", str(repo)], check=True, env=env)

    def hook() -> subprocess.CompletedProcess[str]:
        subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
        return subprocess.run([str(venv / "bin" / "pre-commit"), "try-repo", str(ROOT), "egresslaw-check", "--all-files", "--color", "never"],
                              cwd=repo, env=env, capture_output=True, text=True, timeout=900)

    proc = hook()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "egresslaw check" in proc.stdout and "Passed" in proc.stdout
    assert "Installing environment for" in proc.stdout + proc.stderr  # built here: no egresslaw on this PATH, none in pre-commit's venv
    (repo / "policies" / "demo" / "wild.egress").write_text(BROKEN)
    proc = hook()
    assert proc.returncode == 1 and "Failed" in proc.stdout
    assert "policies/demo/wild.egress:6:12: error[EL0010]: wildcard host `*.github.com`" in proc.stdout
