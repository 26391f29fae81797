"""Shared helpers for the prover tests: build artifacts, prove in-process, pick results."""

from __future__ import annotations

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
