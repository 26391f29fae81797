"""A check that raises is `unknown`, naming its property, subject and the line that raised; every other check still
runs; `prove` exits 4 and prints no traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import proofs.properties as properties
from egress_proxy.decision.adapter import decide as real_decide
from proofs.gate import required_checks
from proofs.runner import prove
from proofs.statements import WORKER_PROPERTIES
from tests.proofs.helpers import artifact, github, only, profile, prove_one

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/proofs/test_contain.py"


def _art():
    return artifact(connections=[github()], profiles=[profile("ci", [("pypi.org", 443)])])


def _planted(*args):
    raise RuntimeError("planted fault")


PLANTED = f"{HERE}:{_planted.__code__.co_firstlineno + 1}"


def _others_proved(report, subject: str, prop: str | None = None) -> None:
    rest = [r for r in report.results if r.subject != subject or (prop is not None and r.property != prop)]
    assert rest and all(r.verdict == "proved" for r in rest), report.render_text()


def test_a_replay_that_raises_for_one_subject_is_unknown_there_only():
    def decide(art, lease, request, ips):
        if lease.connection == "github":
            _planted()
        return real_decide(art, lease, request, ips)

    report = prove(_art(), decide=decide)
    r = only(report, "connection:github", "vacuity")  # vacuity replays its witness request
    assert r.verdict == "unknown"
    assert r.detail == f"the check raised RuntimeError at {PLANTED}: planted fault"
    _others_proved(report, "connection:github", "vacuity")
    assert report.exit_code() == 4
    assert f"unknown  vacuity           connection:github (worker `default`)\n         {r.detail}" in report.render_text()


def test_a_property_that_raises_is_unknown_naming_its_line(monkeypatch):
    monkeypatch.setattr(properties._SubjectChecks, "profile_scope", lambda self: 1 // 0)
    report = prove_one(_art())
    r = only(report, "profile:ci", "profile-scope")
    line = Path(__file__).read_text().splitlines().index(
        '    monkeypatch.setattr(properties._SubjectChecks, "profile_scope", lambda self: 1 // 0)') + 1
    assert (r.verdict, r.detail) == ("unknown", f"the check raised ZeroDivisionError at {HERE}:{line}: integer division or modulo by zero")
    _others_proved(report, "profile:ci", "profile-scope")


def test_a_subject_whose_encoding_raises_is_unknown_for_every_check_it_has(monkeypatch):
    real_lease = properties.subject_lease

    def lease(kind, name):
        if name == "ci":
            _planted()
        return real_lease(kind, name)

    monkeypatch.setattr(properties, "subject_lease", lease)
    art = _art()
    report = prove_one(art)
    mine = [r for r in report.results if r.subject == "profile:ci"]
    assert {r.key for r in mine} == {k for k in required_checks(art) if k[1] == "profile:ci"}  # none skipped
    assert all(r.verdict == "unknown" and r.detail == f"the check raised RuntimeError at {PLANTED}: planted fault" for r in mine)
    _others_proved(report, "profile:ci")


def test_a_worker_whose_encoding_raises_is_unknown_for_every_worker_check(monkeypatch):
    monkeypatch.setattr(properties, "fresh_address", _planted)
    report = prove_one(_art())
    mine = [r for r in report.results if r.subject == "worker:default"]
    assert sorted(r.property for r in mine) == sorted(WORKER_PROPERTIES)
    assert all(r.verdict == "unknown" and PLANTED in r.detail for r in mine)
    _others_proved(report, "worker:default")


def test_the_cli_reports_a_raising_replay_as_unknown_exit_4_without_a_traceback(tmp_path):
    """The real `egresslaw prove`, in its own process, with the replay target replaced by one that raises for one
    subject (a wrapper script patches it, then runs the CLI's main)."""
    path = tmp_path / "a.json"
    path.write_text(_art().to_json())
    script = tmp_path / "prove_with_a_raising_replay.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import proofs.runner
        from egress_proxy.decision.adapter import decide

        def raising(art, lease, request, ips):
            if lease.connection == "github":
                raise KeyError("planted")
            return decide(art, lease, request, ips)

        proofs.runner.real_decide = raising
        from egresslaw.cli import main
        sys.exit(main(sys.argv[1:]))
    """))
    proc = subprocess.run([sys.executable, str(script), "prove", str(path), "-o", str(tmp_path / "proof.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "unknown  vacuity           connection:github (worker `default`)" in proc.stdout
    # the innermost frame in the project's code: the replay in proofs/properties.py (the script is not the project's)
    assert "the check raised KeyError at proofs/properties.py:" in proc.stdout and ": 'planted'" in proc.stdout
    assert ", 1 unknown (" in proc.stdout
