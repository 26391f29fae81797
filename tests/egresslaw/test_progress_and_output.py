"""Progress on stderr (CI logs too), never on stdout; `compile --quiet`; outputs that must not clobber each other."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egresslaw.cli import main
from egresslaw.common import Progress

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(DEMO, tmp_path / "policy")
    (tmp_path / "policy" / "egresslaw.lock").unlink()
    return tmp_path


def test_prove_progress_on_a_log_keeps_json_on_stdout_clean(here):
    assert main(["compile", "policy", "-o", "a.json"]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "egresslaw", "prove", "a.json", "--format", "json", "--progress", "always"],
        cwd=here, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["proved"] == 92  # stdout is the report alone
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("prove: 3 worker(s), 6 connection(s), 3 profile(s) (")
    assert any(line.startswith("prove: tasks done ") for line in lines)
    assert lines[-1].startswith("prove: 92 checks: 92 proved, 0 refuted, 0 unknown (")
    assert "\r" not in proc.stderr  # not a terminal: whole lines


def test_compile_progress_names_its_phases(cli, here):
    code, _, err = cli("compile", "policy", "-o", "a.json", "--progress", "always")
    assert code == 0
    assert "compile: parsing 5 file(s) (" in err and "compile: admitting " in err and "compile: files parsed 5/5" in err


def test_progress_waits_before_speaking_and_rewrites_a_terminal_line():
    quiet = io.StringIO()
    p = Progress("prove", "auto", stream=quiet, delay=3600)
    p.update(1, 2, "tasks done")
    p.close("done")
    assert quiet.getvalue() == ""  # a short run prints nothing

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = Progress("prove", "always", stream=tty)
    p.update(1, 4, "tasks done")
    p.update(4, 4, "tasks done")
    p.close("4 checks")
    assert tty.getvalue().startswith("\r\x1b[Kprove: tasks done 1/4 (") and tty.getvalue().endswith(")\n")
    assert tty.getvalue().count("\n") == 1  # one line, rewritten
    off = io.StringIO()
    p = Progress("prove", "never", stream=off)
    p.update(1, 1, "x")
    p.close("y")
    assert off.getvalue() == ""


def test_compile_quiet_counts_the_lock_changes(cli, here):
    code, out, _ = cli("compile", "policy", "-o", "a.json", "--quiet")
    assert code == 0 and out.splitlines()[0] == "  lock: 9 new (without --quiet: one line each)"
    assert "new      connection:github" not in out
    code, out, _ = cli("compile", "policy", "-o", "a.json")
    assert code == 0 and out.startswith("wrote a.json")  # nothing changed: no lock lines at all


def test_prove_of_a_directory_or_a_source_says_to_compile_first(cli, here):
    for path, what in (("policy", "is a directory"), ("policy/github.egress", "is a policy source")):
        code, out, err = cli("prove", path)
        assert code == 2 and out == ""
        assert err == (
            f"error: artifact `{path}` {what}, not a compiled artifact\n"
            f"help: compile it first: `egresslaw compile {path} -o build/egresslaw.json`, then pass `build/egresslaw.json`\n"
        )


def test_prove_against_never_overwrites_the_deploy_proof(cli, here):
    assert cli("compile", "policy", "-o", "build/egresslaw.json")[0] == 0
    code, _, err = cli("prove", "build/egresslaw.json")
    assert code == 0 and err.endswith("wrote build/proof.json\n")
    deploy = (here / "build" / "proof.json").read_bytes()
    code, _, err = cli("prove", "build/egresslaw.json", "--against", "policy/egresslaw.lock")
    assert code == 0 and err.endswith("wrote build/proof-against.json\n")
    assert (here / "build" / "proof.json").read_bytes() == deploy
    assert json.loads((here / "build" / "proof-against.json").read_text())["against_digest"]
