"""`audit verify` over a fleet: the chains of `--workers N` found by name and checked as one record."""

from __future__ import annotations

from pathlib import Path

import pytest

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditError, AuditLog
from egress_proxy.audit.verify import WORKER_EVENT, audit_logs, verify_logs, worker_audit_path
from egress_proxy.custody.keys import init_keys, load_audit_key


@pytest.fixture
def key(tmp_path):
    init_keys(tmp_path / "keys")
    return load_audit_key(tmp_path / "keys")


def _chain(path: Path, key, index: int, workers: int, events: int = 3) -> None:
    log = AuditLog(path, key)
    log.emit(Event.of({"kind": WORKER_EVENT, "decision": "info", "reason": "started", "worker": index, "workers": workers}))
    for i in range(events):
        log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "path": f"/w{index}/{i}"}))
    assert log.close()


def test_worker_audit_path() -> None:
    assert worker_audit_path("/var/log/audit.jsonl", 2) == Path("/var/log/audit.w2.jsonl")
    assert worker_audit_path("/var/log/audit", 3) == Path("/var/log/audit.w3")


def test_every_chain_of_a_fleet_verifies_on_its_own(tmp_path, key) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in (1, 2):
        _chain(worker_audit_path(logs / "audit.jsonl", i), key, i, 2)
    results = verify_logs(logs, key=key)
    assert [(name, r.status) for name, r in results] == [("audit.w1.jsonl", "intact"), ("audit.w2.jsonl", "intact")]
    assert len(audit_logs(logs / "audit.jsonl")) == 2  # the configured path names its workers' chains


def test_a_missing_worker_chain_is_a_broken_result(tmp_path, key) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in (1, 3):
        _chain(worker_audit_path(logs / "audit.jsonl", i), key, i, 3)
    results = dict(verify_logs(logs, key=key))
    assert results["audit.w2.jsonl"].status == "broken" and "missing" in results["audit.w2.jsonl"].message
    assert results["audit.w1.jsonl"].ok and results["audit.w3.jsonl"].ok


def test_an_edited_line_breaks_only_its_chain(tmp_path, key) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for i in (1, 2):
        _chain(worker_audit_path(logs / "audit.jsonl", i), key, i, 2)
    edited = worker_audit_path(logs / "audit.jsonl", 2)
    edited.write_bytes(edited.read_bytes().replace(b"/w2/1", b"/w2/9"))
    results = dict(verify_logs(logs, key=key))
    assert results["audit.w1.jsonl"].ok
    assert results["audit.w2.jsonl"].status == "broken" and results["audit.w2.jsonl"].line is not None


def test_nothing_there_is_an_error_that_says_so(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(AuditError, match="holds no audit log"):
        audit_logs(tmp_path / "empty")
    with pytest.raises(AuditError, match="does not exist"):
        audit_logs(tmp_path / "nowhere.jsonl")
