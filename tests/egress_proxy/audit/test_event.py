"""The audit event (egress_proxy/audit/event.py): one typed, frozen value, the only thing the log accepts."""

from __future__ import annotations

import json

import pytest

from egress_proxy.audit import log as audit
from egress_proxy.audit.event import Event
from egress_proxy.custody.keys import init_keys, load_audit_key


@pytest.fixture
def key(tmp_path):
    init_keys(tmp_path / "keys")
    return load_audit_key(str(tmp_path / "keys"))


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_log_takes_only_a_typed_event(tmp_path, key):
    """One door: a dict, an undeclared field, a field of the wrong type, an unknown kind or decision, a blob in a
    name are refused before anything is written; the line of an Event is its record."""
    from egress_proxy.audit.event import EventError

    log = audit.AuditLog(tmp_path / "a.jsonl", key)
    with pytest.raises(EventError):
        log.emit({"kind": "request", "decision": "deny", "reason": "x"})
    for bad in ({"kind": "request", "decision": "deny", "reason": "x", "secret": "s"},
                {"kind": "request", "decision": "deny", "reason": "x", "port": "443"},
                {"kind": "request", "decision": "deny", "reason": "x", "tunnel": 1},
                {"kind": "nope", "decision": "deny", "reason": "x"},
                {"kind": "request", "decision": "maybe", "reason": "x"},
                {"kind": "request", "decision": "deny", "reason": "x", "host": "h" * 5000},
                {"kind": "request", "decision": "deny", "reason": "x", "headers": ["x-" + "a" * 100]}):
        with pytest.raises(EventError):
            Event.of(bad)
    event = Event.of({"kind": "request", "id": "r1", "host": "a.test", "decision": "deny", "reason": "host-not-allowed", "rule": None,
                      "status": 403})
    with pytest.raises(AttributeError):
        event.reason = "allowed"  # frozen
    log.emit(event)
    assert log.close()
    line = [r for r in _records(tmp_path / "a.jsonl") if r["kind"] == "request"][0]
    assert {k: line[k] for k in ("kind", "id", "host", "decision", "reason", "rule", "status")} == {
        "kind": "request", "id": "r1", "host": "a.test", "decision": "deny", "reason": "host-not-allowed", "rule": None, "status": 403}
