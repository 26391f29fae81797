"""Shared helpers for the prover tests: build artifacts, prove in-process, pick results."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

from compiler.artifact import Artifact
from proofs.report import Report, Result
from proofs.runner import prove
from tests.egress_proxy.builders import artifact, connection, profile, rule, worker  # noqa: F401  (re-exported)


def github(worker_name: str = "default", extra_headers: tuple[str, ...] = (), version: int = 1, admin: bool = False):
    rules = [rule("read-repos", "api.github.com", "/repos/acme", ["GET", "HEAD"], ["accept", *extra_headers])]
    if admin:
        rules.append(rule("admin", "api.github.com", "/v2/admin", ["POST"]))
    return connection("github", rules, worker=worker_name, version=version)


def only(report: Report, subject: str, prop: str) -> Result:
    found = [r for r in report.results if r.subject == subject and r.property == prop]
    assert len(found) == 1, found
    return found[0]


def prove_one(art: Artifact, old: Artifact | None = None) -> Report:
    return prove(art, old, jobs=1)


def demo_artifact() -> Artifact:
    """policies/demo, compiled in memory (the shipped example every prover change must keep proving)."""
    from pathlib import Path

    from compiler.compile import compile_sources, find_policies, read_files

    roots, problems = find_policies([Path(__file__).resolve().parents[2] / "policies" / "demo"])
    assert not problems and len(roots) == 1
    result = compile_sources(*read_files(roots[0].files))
    assert result.ok, result.diagnostics
    return result.artifact


def without_timings(report: Report) -> dict:
    """The report's JSON form but for `time_ms`: what must not depend on the machine, its load or `--jobs`."""
    doc = report.to_dict()
    doc["results"] = [{k: v for k, v in r.items() if k != "time_ms"} for r in doc["results"]]
    return doc


@contextmanager
def cpu_burners(n: int = 2):
    """`n` processes spinning on a CPU each (a loaded CI machine), killed on the way out whatever happens."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
