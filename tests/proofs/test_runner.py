"""The runner: the same report, timings aside, on a quiet machine, under load and with any `--jobs`; a task whose
process fails is `unknown` for each of its checks, never lost."""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool

import pytest

import proofs.runner as runner
from proofs.gate import GateError, check_report, required_checks
from proofs.runner import plan, prove
from tests.proofs.helpers import cpu_burners, demo_artifact, without_timings


def test_the_report_is_the_same_quiet_under_load_and_with_two_jobs():
    """The verdicts depend on the rlimit (steps), never on the wall clock: two CPU burners on this machine, or the
    tasks split over two processes that finish in any order, change nothing but `time_ms`."""
    art = demo_artifact()
    quiet = prove(art, jobs=1)
    assert quiet.exit_code() == 0, quiet.render_text()
    with cpu_burners(2):
        loaded = prove(art, jobs=1)
    two = prove(art, jobs=2)
    for other in (loaded, two):
        assert without_timings(other) == without_timings(quiet)
        assert other.render_text() == quiet.render_text()
    assert quiet.budget == {"rlimit": 50_000_000, "rlimit_scope": "solver call", "wall_clock_ms": 600_000, "seed": 0}


class _Pool:
    """A stand-in for the process pool, in this process: the task `dies` fails as a dead worker process would."""

    dies: tuple = ()

    def __init__(self, max_workers, mp_context, initializer, initargs):
        initializer(*initargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, task):
        fut: cf.Future = cf.Future()
        if task == self.dies:
            fut.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
        else:
            fut.set_result(fn(task))
        return fut


def test_a_task_whose_process_dies_is_unknown_for_each_of_its_checks(monkeypatch):
    art = demo_artifact()
    tasks = plan(art, 2)
    dead = next(t for t in tasks if t[1] == "subjects")
    monkeypatch.setattr(_Pool, "dies", dead)
    monkeypatch.setattr(runner.cf, "ProcessPoolExecutor", _Pool)
    report = prove(art, jobs=2)
    assert report.exit_code() == 4
    lost = {f"{kind}:{name}" for kind, name in dead[2]}
    unknown = [r for r in report.results if r.verdict == "unknown"]
    assert {r.subject for r in unknown} == lost
    assert all(r.detail.startswith("the check raised BrokenProcessPool at proofs/runner.py:") for r in unknown)
    assert all(r.verdict == "proved" for r in report.results if r.subject not in lost)
    # no check is skipped: the gate finds every required one, and refuses the report for what it does not prove
    assert required_checks(art) <= {r.key for r in report.results}
    with pytest.raises(GateError, match="does not prove"):
        check_report(report.to_json(), art, allow_unsigned=True)
