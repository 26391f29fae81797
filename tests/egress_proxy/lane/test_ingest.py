"""Envoy's access log into the chain: the reader's position, its rotation, and a crash in the middle of one.

Lines are written here as Envoy writes them (one JSON object per line); the lane's real Envoy drives the same
reader in tests/egress_proxy/run/test_lane.py."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditLog
from egress_proxy.custody.keys import init_keys, load_audit_key
from egress_proxy.lane.ingest import Ingester


def _line(n: int) -> str:
    return json.dumps({"lane": "front", "id": f"id-{n}", "method": "CONNECT", "authority": "pypi.org:443", "status": 200,
                       "flags": "-", "decided": "allow", "bytes_up": 10, "bytes_down": 20, "duration_ms": 5}) + "\n"


@pytest.fixture
def setup(tmp_path):
    init_keys(tmp_path / "keys")
    audit = AuditLog(tmp_path / "audit.jsonl", load_audit_key(tmp_path / "keys"), fsync=False)
    yield tmp_path, audit
    audit.close()


def _reader(tmp_path, audit, **kw) -> Ingester:
    return Ingester(tmp_path / "access.log", tmp_path / "ingest.pos", audit, refusal=lambda host: None, policy=lambda: None, **kw)


def _ids(tmp_path, audit) -> list[str]:
    audit.flush()
    return [e["id"] for e in map(json.loads, (tmp_path / "audit.jsonl").read_text().splitlines()) if e.get("kind") == "outcome"]


def test_a_restart_resumes_at_the_saved_position_and_a_partial_line_waits(setup):
    tmp, audit = setup
    log = tmp / "access.log"
    log.write_text(_line(1) + _line(2) + _line(3)[:20])
    asyncio.run(_reader(tmp, audit).poll())
    with log.open("a") as fh:
        fh.write(_line(3)[20:])
    asyncio.run(_reader(tmp, audit).poll())  # a new reader: the saved position, not the start
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3"]


def test_rotation_and_a_crash_in_the_middle_of_one_lose_nothing_and_repeat_nothing(setup):
    tmp, audit = setup
    log = tmp / "access.log"
    reopened: list[bool] = []

    async def reopen() -> None:  # Envoy: what it held goes to the renamed file, then it opens the name again
        with (tmp / "access.log.1").open("a") as fh:
            fh.write(_line(2))
        log.write_text(_line(3))
        reopened.append(True)

    reader = _reader(tmp, audit, reopen=reopen, rotate_bytes=1)
    log.write_text(_line(1))

    async def first() -> bool:
        await reader.poll()
        return await reader.rotate()

    assert asyncio.run(first()) and reopened and not (tmp / "access.log.1").exists()
    asyncio.run(reader.poll())
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3"]
    # a crash after the rename and before the renamed file was finished: the next start reads it first
    os.replace(log, tmp / "access.log.1")
    with (tmp / "access.log.1").open("a") as fh:
        fh.write(_line(4))
    log.write_text(_line(5))
    restarted = _reader(tmp, audit)

    async def start() -> None:
        await restarted.recover()
        await restarted.poll()

    asyncio.run(start())
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3", "id-4", "id-5"]
    assert not (tmp / "access.log.1").exists()


def test_a_reopen_that_fails_gives_the_file_its_name_back(setup):
    tmp, audit = setup
    log = tmp / "access.log"

    async def reopen() -> None:
        raise OSError("envoy is gone")

    reader = _reader(tmp, audit, reopen=reopen, rotate_bytes=1)
    log.write_text(_line(1))

    async def go() -> bool:
        await reader.poll()
        return await reader.rotate()

    assert asyncio.run(go()) is False
    assert log.exists() and not (tmp / "access.log.1").exists()
    with log.open("a") as fh:
        fh.write(_line(2))
    asyncio.run(reader.poll())
    assert _ids(tmp, audit) == ["id-1", "id-2"]


def _front(n: int, decided: str | None, status: int, deny: str | None = None) -> str:
    return json.dumps({"lane": "front", "id": f"id-{n}", "method": "POST", "authority": "pypi.org", "scheme": "http", "path": "/x",
                       "status": status, "flags": "DPE", "details": "http1.codec_error", "decided": decided, "deny": deny,
                       "bytes_up": 0, "bytes_down": 67, "duration_ms": 2}) + "\n"


def _events(tmp_path, audit) -> list[dict]:
    audit.flush()
    return [e for e in map(json.loads, (tmp_path / "audit.jsonl").read_text().splitlines()) if e.get("id", "").startswith("id-")]


def test_a_line_envoy_wrote_without_the_verdict_of_an_admitted_check_is_that_checks_outcome(setup):
    """Envoy refused the request (400) while the check was out; the authorizer then admitted it. The reader waits for
    the check and writes the allow's outcome (Envoy's status, the refusal as `failure`), never a `deny` decision."""
    tmp, audit = setup
    reader = _reader(tmp, audit)
    (tmp / "access.log").write_text(_front(1, None, 400, "malformed-request"))

    async def go() -> None:
        assert reader.admissions.begin("id-1")
        polled = asyncio.ensure_future(reader.poll())
        await asyncio.sleep(0.2)
        assert not polled.done()  # the reader waits for the check still in the authorizer
        reader.admissions.end("id-1", "allow")
        await polled

    asyncio.run(go())
    [outcome] = _events(tmp, audit)
    assert (outcome["kind"], outcome["of"], outcome["status"], outcome["failure"]) == ("outcome", "request", 400, "malformed-request")
    assert len(reader.admissions) == 0  # forgotten once its line is read


def test_a_refused_check_keeps_its_one_decision_and_an_unknown_one_is_closed(setup):
    tmp, audit = setup
    reader = _reader(tmp, audit)
    reader.admissions.begin("id-1")
    reader.admissions.end("id-1", "deny")
    (tmp / "access.log").write_text(_front(1, None, 503) + _front(2, None, 503))
    asyncio.run(reader.poll())
    [denial] = _events(tmp, audit)  # id-1: the authorizer's refusal stands alone; id-2: the reader's denial
    assert (denial["id"], denial["decision"], denial["reason"]) == ("id-2", "deny", "proxy-at-capacity")
    assert reader.admissions.closed("id-2") and not reader.admissions.begin("id-2")  # a check arriving later: no event


def test_the_record_is_bounded_and_rebuilt_from_the_audit_log_after_a_restart(setup):
    from egress_proxy.lane.ingest import Admissions

    tmp, audit = setup
    small = Admissions(bound=3)
    for i in range(5):
        small.begin(f"r{i}")
    assert len(small) == 3 and not small.closed("r0")
    audit.emit(Event.of({"kind": "connect", "id": "id-1", "decision": "allow", "reason": "allowed", "lane": "envoy", "tunnel": False}))
    audit.emit(Event.of({"kind": "connect", "id": "id-2", "decision": "allow", "reason": "allowed", "lane": "envoy", "tunnel": False}))
    audit.emit(Event.of({"kind": "outcome", "of": "connect", "id": "id-2", "decision": "allow", "reason": "allowed", "lane": "envoy"}))
    audit.flush()
    (tmp / "access.log").write_text(_front(1, None, 503, "authorizer-unavailable"))
    restarted = _reader(tmp, audit)  # a new process: its record is rebuilt from the chain before the first poll

    async def start() -> None:
        await restarted.recover()
        await restarted.poll()

    asyncio.run(start())
    kinds = [(e["kind"], e["decision"]) for e in _events(tmp, audit) if e["id"] == "id-1"]
    assert kinds == [("connect", "allow"), ("outcome", "allow")]  # the outcome, not a second decision


def test_a_line_that_is_not_json_is_skipped_alone_in_its_batch(setup):
    tmp, audit = setup
    (tmp / "access.log").write_text(_line(1) + '{"lane": "front", "id": \n' + _line(2) + "x" * 70000 + "\n" + _line(3))
    reader = _reader(tmp, audit)
    asyncio.run(reader.poll())
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3"] and reader.skipped == 2


def test_inner_lines_become_request_events_as_before():
    """The per-line fast paths (numbers, printable text, the tunnel's authority) give the events the slow ones did."""
    from egress_proxy.lane.ingest import _text

    assert _text("/a b") == "/a b" and _text("/a\\b") == "/a\\\\b" and _text("/\x1b") == "/\\x1b" and _text("/é") == "/\\xe9"
    assert _text("x" * 10, 8) == "xxxxx..." and _text("-") is None and _text(7) == "7"
