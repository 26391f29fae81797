"""The audit log: keyed chain, signed checkpoints, rotation, write-ahead tickets, failing disks, and `verify`
finding every tamper form at its line (exactly with the key; between two signed records without it)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egress_proxy.audit.event import Event
from egress_proxy.audit import log as audit
from egress_proxy.custody.keys import (
    AuditKey,
    init_audit_key,
    init_keys,
    load_audit_key,
    load_audit_public_key,
)


def _fixed_key() -> AuditKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    seed = b"\x02" * 32
    return AuditKey("ak-test", Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw(), b"\x01" * 32, seed)


_KEY = _fixed_key()  # for property tests (no fixture per example)


@pytest.fixture
def keys(tmp_path):
    init_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def key(keys):
    return load_audit_key(keys)


def _write(path, key, n, **kw):
    log = audit.AuditLog(path, key, **kw)
    for i in range(n):
        log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "path": f"/p/{i}"}))
    assert log.close()
    return path


def _records(path):
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


def _put(path, lines):
    path.write_bytes(b"".join(lines))


def _closed_log(tmp_path, key, n=50):
    """A closed log of n events with periodic checkpoints (every 10 events) between them."""
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, checkpoint_events=10)
    for i in range(n):
        log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "path": f"/p/{i}"}))
        if i % 7 == 0:
            assert log.flush()  # several batches, so checkpoints fall between events
    assert log.close()
    return path


def test_chain_is_keyed_signed_and_survives_a_restart(tmp_path, key):
    path = tmp_path / "a.jsonl"
    _write(path, key, 5)
    _write(path, key, 3)
    records = _records(path)
    assert [r["kind"] for r in records] == ["audit-open"] + ["request"] * 5 + ["checkpoint", "audit-open"] + ["request"] * 3 + ["checkpoint"]
    assert records[0]["prev"] == audit.GENESIS and records[0]["previous"] == "none"
    assert all(b["prev"] == a["mac"] for a, b in zip(records, records[1:]))
    assert [r["seq"] for r in records] == list(range(1, len(records) + 1))
    assert records[6]["end"] == "shutdown" and records[7]["previous"] == "closed" and records[7]["reason"] == "started"
    assert records[6]["count"] == 6 and records[-1]["count"] == len(records) - 1
    result = audit.verify(path, key=key)
    assert (result.status, result.lines, result.notes) == ("intact", len(records), ())
    assert any("MAC under audit key" in c for c in result.checked)


def test_keys_init_makes_a_private_audit_key_and_its_public_half(tmp_path, keys, key):
    assert (keys / "audit.key").stat().st_mode & 0o777 == 0o600
    public = load_audit_public_key(keys / "audit.pub")
    assert public.id == key.id and public.public == key.public and public.mac_key is None
    assert "mac_key" not in repr(key) and key.mac_key.hex() not in repr(key)
    with pytest.raises(Exception, match="already exists"):
        init_audit_key(keys)
    (keys / "audit.key").unlink()
    (keys / "audit.pub").unlink()
    with pytest.raises(Exception, match="does not exist") as missing:
        load_audit_key(keys)  # a keys directory from before audit keys: the fix is named
    assert "egresslaw keys add-audit-key" in missing.value.help
    assert init_audit_key(keys).id != key.id


# -- tampering, found at its line ------------------------------------------------------------------


def _kinds(path):
    return [r["kind"] for r in _records(path)]


def _first_event_after_checkpoint(path):
    kinds = _kinds(path)
    first = kinds.index("checkpoint")
    return first + 2 + 1  # 1-based line of the second event after the first periodic checkpoint


def _edit(lines, k):
    lines[k - 1] = lines[k - 1].replace(b'"allow"', b'"deny"', 1)
    assert b'"deny"' in lines[k - 1]


def test_an_edited_line_is_found_at_its_line(tmp_path, key):
    path = _closed_log(tmp_path, key)
    k = _first_event_after_checkpoint(path)
    lines = _lines(path)
    _edit(lines, k)
    _put(path, lines)
    keyed = audit.verify(path, key=key)
    assert (keyed.status, keyed.line) == ("broken", k) and "MAC does not verify" in keyed.message
    keyless = audit.verify(path)  # located between the two signed records around it, and said so
    assert keyless.status == "broken" and keyless.line <= k and f"lines {keyless.line}-" in keyless.message
    assert any("line MACs" in u for u in keyless.unchecked)


def test_an_edit_with_the_chain_recomputed_under_another_key_is_found(tmp_path, key, keys):
    path = _closed_log(tmp_path, key)
    k = _first_event_after_checkpoint(path)
    forger = audit._Keys(load_audit_key(_other_keys(tmp_path)))
    records = _records(path)
    records[k - 1]["decision"] = "deny"
    prev = records[k - 2]["mac"]
    for record in records[k - 1 :]:  # re-chain everything after the edit, as someone without the key must
        record.pop("mac")
        record["prev"] = prev
        record["mac"] = prev = forger.mac(audit.canonical(record))
    path.write_bytes(b"".join(audit.canonical(r) + b"\n" for r in records))
    keyed = audit.verify(path, key=key)
    assert (keyed.status, keyed.line) == ("broken", k)
    assert audit.verify(path).status == "broken"  # the signed checkpoint after it no longer matches


def _other_keys(tmp_path):
    init_keys(tmp_path / "other")
    return tmp_path / "other"


def test_mid_file_corruption_is_found_even_with_an_intact_tail(tmp_path, key):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    lines[4] = b"\x00garbage\n"
    _put(path, lines)
    for result in (audit.verify(path, key=key), audit.verify(path)):
        assert (result.status, result.line) == ("broken", 5) and "not JSON" in result.message


@pytest.mark.parametrize("where", ["middle", "first-event"])
def test_a_deleted_line_is_found_at_its_place(tmp_path, key, where):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    k = 20 if where == "middle" else 2
    del lines[k - 1]
    _put(path, lines)
    for result in (audit.verify(path, key=key), audit.verify(path)):
        assert (result.status, result.line) == ("broken", k), result


def test_inserted_and_reordered_lines_are_found(tmp_path, key):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    _put(path, lines[:10] + [lines[9]] + lines[10:])
    assert (audit.verify(path, key=key).line, audit.verify(path).line) == (11, 11)
    lines[9], lines[10] = lines[10], lines[9]
    _put(path, lines)
    assert (audit.verify(path, key=key).line, audit.verify(path).line) == (10, 10)


def test_deleting_the_last_line_leaves_the_log_unclosed(tmp_path, key):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    _put(path, lines[:-1])
    result = audit.verify(path, key=key)
    assert result.status == "open" and f"ends at line {len(lines) - 1} without a closing checkpoint" in result.message


def test_an_edited_last_line_is_found(tmp_path, key):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    lines[-1] = lines[-1].replace(b'"shutdown"', b'"periodic"', 1)
    _put(path, lines)
    for result in (audit.verify(path, key=key), audit.verify(path)):
        assert (result.status, result.line) == ("broken", len(lines)), result


def test_truncation_at_a_line_boundary_and_to_zero_bytes_are_found(tmp_path, key):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    half = len(lines) // 2
    _put(path, lines[:half])
    result = audit.verify(path, key=key)
    assert result.status == "open" and f"ends at line {half} without a closing checkpoint" in result.message
    path.write_bytes(b"")
    result = audit.verify(path, key=key)
    assert (result.status, result.line) == ("broken", 1) and "empty" in result.message
    path.write_bytes(b"".join(lines)[:-30])  # cut inside the last line
    assert audit.verify(path, key=key).status == "open"


def test_appended_forged_events_are_found(tmp_path, key):
    path = _closed_log(tmp_path, key)
    records = _records(path)
    forged = {"v": audit.FORMAT, "seq": records[-1]["seq"] + 1, "ts": "2030-01-01T00:00:00.000Z", "kind": "request",
              "decision": "allow", "reason": "allowed", "prev": records[-1]["mac"]}
    forged["mac"] = "0" * 64
    with open(path, "ab") as fh:
        fh.write(audit.canonical(forged) + b"\n")
    n = len(records) + 1
    keyed, keyless = audit.verify(path, key=key), audit.verify(path)
    assert (keyed.status, keyed.line) == ("broken", n) and "MAC" in keyed.message
    assert (keyless.status, keyless.line) == ("broken", n) and "after the log was closed" in keyless.message


def test_a_log_rewritten_under_another_key_fails_against_the_real_public_key(tmp_path, key, keys):
    path = tmp_path / "a.jsonl"
    _write(path, load_audit_key(_other_keys(tmp_path)), 3)
    assert audit.verify(path).status == "intact"  # self-consistent: it names its own key …
    assert "compare it with your `audit.pub`" in " ".join(audit.verify(path).unchecked)
    pinned = audit.verify(path, key=load_audit_public_key(keys / "audit.pub"))  # … which is not ours
    assert (pinned.status, pinned.line) == ("broken", 1) and "signed by key" in pinned.message


def test_an_unclosed_run_is_noted_and_the_chain_goes_on(tmp_path, key):
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key)
    log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
    assert log.flush()
    # killed: no close(); a torn half line is left behind as well
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"request","dec')
    assert audit.verify(path, key=key).status == "open"
    _write(path, key, 1)
    records = _records(path)
    assert records[2]["kind"] == "audit-open" and records[2]["previous"] == "not-closed" and records[2]["cut"] == len(b'{"kind":"request","dec')
    result = audit.verify(path, key=key)
    assert result.status == "intact" and any("was not closed" in n for n in result.notes)


def test_a_log_whose_tail_does_not_verify_is_refused_at_start(tmp_path, key):
    path = _closed_log(tmp_path, key)
    lines = _lines(path)
    lines[-1] = lines[-1].replace(b'"shutdown"', b'"periodic"', 1)
    _put(path, lines)
    with pytest.raises(audit.AuditError, match="does not verify under the audit key"):
        audit.AuditLog(path, key)
    with pytest.raises(audit.AuditError, match="audit.key"):
        audit.AuditLog(tmp_path / "b.jsonl", load_audit_public_key(tmp_path / "keys" / "audit.pub"))


# -- rotation --------------------------------------------------------------------------------------


def test_rotation_by_size_chains_segments_and_verify_walks_the_directory(tmp_path, key):
    path = tmp_path / "logs" / "audit.jsonl"
    log = audit.AuditLog(path, key, rotate_bytes=2000)
    for i in range(60):
        log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "path": f"/p/{i}"}))
        assert log.flush()
    assert log.close()
    segments = [p.name for p, _ in audit.segment_files(path.parent)]
    assert len(segments) >= 4 and segments[-1] == "audit.jsonl" and segments[0] == "audit.jsonl.000001"
    first = [_records(path.parent / n) for n in segments[:-1]] + [_records(path)]
    for before, after in zip(first, first[1:]):
        assert before[-1]["end"] == "rotated" and after[0]["prev"] == before[-1]["mac"] and after[0]["seq"] == before[-1]["seq"] + 1
    result = audit.verify(path.parent, key=key)
    assert (result.status, result.segments) == ("intact", len(segments)), result
    # One rotated segment alone verifies too, and says what it could not check.
    alone = audit.verify(path.parent / segments[1], key=key)
    assert alone.status == "intact" and any("were not given" in n for n in alone.notes)
    # Retention deleted the oldest segment: still intact, and noted.
    (path.parent / segments[0]).unlink()
    kept = audit.verify(path.parent, key=key)
    assert kept.status == "intact" and any("starts at segment 2" in n for n in kept.notes)
    # A segment missing in the middle, or one truncated to nothing, is found.
    (path.parent / segments[2]).rename(tmp_path / "aside")
    gap = audit.verify(path.parent, key=key)
    assert gap.status == "broken" and "missing" in gap.message and gap.file.endswith(segments[3])
    (tmp_path / "aside").rename(path.parent / segments[2])
    (path.parent / segments[2]).write_bytes(b"")
    empty = audit.verify(path.parent, key=key)
    assert (empty.status, empty.line) == ("broken", 1) and empty.file.endswith(segments[2])


def test_rotation_by_age_and_a_restart_after_a_rotation(tmp_path, key):
    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path, key, rotate_seconds=0.3)
    log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
    assert log.flush()
    deadline = time.time() + 10
    while not (tmp_path / "audit.jsonl.000001").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert log.close()
    assert (tmp_path / "audit.jsonl.000001").exists()
    _write(path, key, 2)
    assert audit.verify(tmp_path, key=key).status == "intact"


def test_an_idle_log_is_not_rotated_by_age(tmp_path, key):
    log = audit.AuditLog(tmp_path / "audit.jsonl", key, rotate_seconds=0.05)
    with log._cond:
        assert log._next(time.monotonic()) is False  # nothing written yet: no timer fires a rotation
    assert log.close()
    assert not (tmp_path / "audit.jsonl.000001").exists()


# -- a failing disk --------------------------------------------------------------------------------


class Disk:
    """Injected write and fsync: fail with `code` (or write only half: a short write) while `broken`."""

    def __init__(self, log, mode):
        self.log, self.mode, self.broken = log, mode, True
        self.real_write, self.real_fsync = log._os_write, log._os_fsync
        log._os_write, log._os_fsync = self.write, self.fsync

    def write(self, fd, data):
        if self.broken and self.mode == "short":
            return self.real_write(fd, data[: len(data) // 2])  # really half on disk: must be cut back
        if self.broken and self.mode in ("ENOSPC", "EFBIG", "EIO"):
            raise OSError(getattr(errno, self.mode), os.strerror(getattr(errno, self.mode)))
        return self.real_write(fd, data)

    def fsync(self, fd):
        if self.broken and self.mode == "fsync":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.real_fsync(fd)


def hold_retries(log):
    """Stop the failing writer's retries and wait until none is in flight. A retry appends and then, its fsync failing,
    cuts back: the file's size says what is kept only between two attempts (a loaded machine stretches the window)."""
    with log._cond:
        log.retry_seconds = 3600  # an attempt in flight fails into this wait
        log._retry_at = time.monotonic() + 3600
        while log._writing_since is not None:
            log._cond.wait(0.05)


def resume_retries(log):
    with log._cond:
        log.retry_seconds, log._retry_at = 0.05, 0.0
        log._cond.notify_all()


@pytest.mark.parametrize("sync_requests", [True, False], ids=["per-request", "interval"])
@pytest.mark.parametrize("mode", ["ENOSPC", "EFBIG", "EIO", "short", "fsync"])
def test_a_failing_disk_fails_closed_logs_once_never_tears_a_line_and_recovers(tmp_path, key, mode, sync_requests, caplog):
    caplog.set_level(logging.WARNING, logger="egresslaw.audit")
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, retry_seconds=0.05, sync_requests=sync_requests)
    size = path.stat().st_size
    disk = Disk(log, mode)
    tickets = [log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x", "status": i})) for i in range(5)]
    assert not log.flush(0.5)
    assert not log.writable and log.error and "cannot write audit log" in log.error
    with pytest.raises(audit.AuditUnavailable):
        asyncio.run(log.written(tickets[-1], timeout=2))
    time.sleep(0.3)  # several retries fail meanwhile
    hold_retries(log)
    assert path.stat().st_size == size and path.read_bytes().endswith(b"\n")  # nothing torn, nothing half-written
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # logged once, not per retry or event
    disk.broken = False
    resume_retries(log)
    assert log.flush(30) and log.writable  # budgets for a loaded machine's disk: the writes succeed now
    asyncio.run(log.written(tickets[-1], timeout=30))
    assert log.close()
    records = _records(path)
    resumed = [r for r in records if r["kind"] == "audit-resumed"]
    assert len(resumed) == 1 and resumed[0]["held"] == 5 and resumed[0]["dropped"] == 0
    assert [r["status"] for r in records if r["kind"] == "request"] == list(range(5))
    assert audit.verify(path, key=key).status == "intact"
    assert any("writable again" in r.getMessage() for r in caplog.records)


def test_beyond_the_held_bound_events_are_counted_as_dropped(tmp_path, key):
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, retry_seconds=0.05, max_held=3)
    disk = Disk(log, "ENOSPC")
    log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
    assert not log.flush(0.5)
    kept = 1
    for _ in range(5):
        try:
            log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
            kept += 1
        except audit.AuditUnavailable:
            pass
    assert kept == 3
    disk.broken = False
    assert log.flush(30) and log.close()
    [resumed] = [r for r in _records(path) if r["kind"] == "audit-resumed"]
    assert (resumed["held"], resumed["dropped"]) == (3, 3)


def test_a_closing_log_that_cannot_be_written_says_so(tmp_path, key):
    log = audit.AuditLog(tmp_path / "a.jsonl", key, retry_seconds=0.05)
    Disk(log, "EIO")
    log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
    assert log.close(5) is False and log.close_ok is False
    with pytest.raises(audit.AuditUnavailable):
        log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))


# -- write-ahead and the two sync modes ---------------------------------------------------------------


class GatedFsync:
    """An fsync that blocks until the test opens `gate`; `entered` is set once one is blocked, `done` counts them."""

    def __init__(self, log):
        self.gate, self.entered, self.done = threading.Event(), threading.Event(), []
        self.real = log._os_fsync
        log._os_fsync = self

    def __call__(self, fd):
        self.entered.set()
        self.gate.wait(30)
        self.done.append(fd)
        return self.real(fd)


def test_interval_sync_a_line_is_in_the_file_when_emit_returns_and_written_does_not_wait_for_fsync(tmp_path, key):
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key)  # the default: fsync within `sync_seconds`, not per request
    fsync = GatedFsync(log)
    try:
        ticket = log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "status": 1}), durable=True)
        assert b'"status":1' in path.read_bytes()  # appended by emit() itself: a killed proxy keeps it
        asyncio.run(log.written(ticket, timeout=10))  # while every fsync is blocked
        assert fsync.done == [] and log._written < ticket
        outcome = log.emit(Event.of({"kind": "outcome", "decision": "allow", "reason": "allowed", "status": 2}))
        assert b'"status":2' in path.read_bytes() and outcome == ticket + 1
    finally:
        fsync.gate.set()
    assert log.flush() and fsync.done and log._written == ticket + 1
    assert log.close()
    assert audit.verify(path, key=key).status == "intact"


def test_interval_sync_every_line_is_synced_within_the_interval_without_anyone_waiting(tmp_path, key):
    log = audit.AuditLog(tmp_path / "a.jsonl", key, sync_seconds=0.05)
    synced = threading.Event()
    real = log._os_fsync
    log._os_fsync = lambda fd: (real(fd), synced.set())[0]
    ticket = log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
    assert synced.wait(30)  # the writer's timer, no flush(), no waiter
    deadline = time.time() + 30
    while log._written < ticket and time.time() < deadline:
        time.sleep(0.01)
    assert log._written == ticket
    assert log.close()


def test_per_request_sync_a_ticket_is_written_only_after_its_fsync(tmp_path, key):
    log = audit.AuditLog(tmp_path / "a.jsonl", key, sync_requests=True)
    fsync = GatedFsync(log)

    async def scenario():
        ticket = log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed"}), durable=True)
        waiter = asyncio.ensure_future(log.written(ticket))
        assert await asyncio.to_thread(fsync.entered.wait, 30)  # its fsync started at once (no timer)
        assert not waiter.done() and not fsync.done  # held back until the line is durable
        fsync.gate.set()
        await waiter
        assert fsync.done

    try:
        asyncio.run(scenario())
    finally:
        fsync.gate.set()
    assert log.close()


def test_per_request_sync_lines_nobody_waits_for_are_appended_at_once_and_synced_with_the_next_awaited_one(tmp_path, key, monkeypatch):
    monkeypatch.setattr(audit, "SYNC_SECONDS", 3600)  # no timer: only a waiting request makes the fsync
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, sync_requests=True)
    calls = []
    real = log._os_fsync
    log._os_fsync = lambda fd: (calls.append(fd), real(fd))[1]
    log.emit(Event.of({"kind": "outcome", "decision": "allow", "reason": "allowed", "status": 1}))
    assert b'"status":1' in path.read_bytes() and calls == []  # in the file (a killed process keeps it), not fsync'd
    ticket = log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "status": 2}), durable=True)
    asyncio.run(log.written(ticket, timeout=10))
    assert len(calls) == 1  # one fsync for both lines
    assert log.close()


@pytest.mark.parametrize("sync_requests", [True, False], ids=["per-request", "interval"])
def test_a_stuck_fsync_makes_the_log_unwritable(tmp_path, key, monkeypatch, sync_requests):
    """Per request, the waiting request times out; in interval mode the request went on, but once an fsync is stuck
    longer than a request may wait the log refuses (so the unsynced window stays bounded), and lines still append."""
    monkeypatch.setattr(audit, "WAIT_SECONDS", 0.1)
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, sync_requests=sync_requests, sync_seconds=0.05)
    fsync = GatedFsync(log)
    try:
        ticket = log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed"}), durable=True)
        if sync_requests:
            with pytest.raises(audit.AuditUnavailable, match="within"):
                asyncio.run(log.written(ticket, timeout=0.2))
        else:
            asyncio.run(log.written(ticket, timeout=10))
        assert fsync.entered.wait(30)
        deadline = time.time() + 30
        while log.writable and time.time() < deadline:
            time.sleep(0.01)
        assert not log.writable
        log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x", "path": "late"}))
        assert b'"path":"late"' in path.read_bytes()  # a denial still gets its line at once
    finally:
        fsync.gate.set()
    assert log.flush() and log.writable and log.close()
    assert audit.verify(path, key=key).status == "intact"


@pytest.mark.parametrize("sync_requests", [True, False], ids=["per-request", "interval"])
def test_a_failed_fsync_cuts_back_and_writes_the_lines_again(tmp_path, key, sync_requests):
    """What was appended since the last good fsync may or may not be on disk: it is cut off and written again,
    once, in order, after an `audit-resumed` line; nothing is duplicated, nothing lost."""
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, sync_requests=sync_requests, retry_seconds=0.05)
    size = path.stat().st_size
    disk = Disk(log, "fsync")
    for i in range(3):
        log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "status": i}), durable=True)
    assert not log.flush(0.5) and not log.writable
    hold_retries(log)
    assert path.stat().st_size == size  # cut back to the last durable line
    disk.broken = False
    resume_retries(log)
    assert log.flush(10) and log.close()
    records = _records(path)
    assert [r["status"] for r in records if r["kind"] == "request"] == [0, 1, 2]
    assert [r["kind"] for r in records].count("audit-resumed") == 1
    assert audit.verify(path, key=key).status == "intact"


def test_parse_sync():
    assert audit.parse_sync("request") == (True, audit.SYNC_SECONDS)
    assert audit.parse_sync("1") == (False, 1.0)
    assert audit.parse_sync("0.25s") == (False, 0.25)
    for bad in ("0", "-1", "61", "nan", "always", ""):
        with pytest.raises(ValueError, match="neither `request` nor a number of seconds"):
            audit.parse_sync(bad)


def test_concurrent_emitters_lose_nothing(tmp_path, key):
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path, key, checkpoint_events=100)

    def work(k):
        for i in range(200):
            log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "worker": k, "port": i}))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.flush()
    assert log.close()
    records = [r for r in _records(path) if r["kind"] == "request"]
    assert {(r["worker"], r["port"]) for r in records} == {(k, i) for k in range(8) for i in range(200)} and len(records) == 1600
    assert any(r["kind"] == "checkpoint" and r["reason"] == "periodic" for r in _records(path))
    assert audit.verify(path, key=key).status == "intact"


def test_per_request_sync_group_commit_shares_fsyncs(tmp_path, key):
    log = audit.AuditLog(tmp_path / "a.jsonl", key, sync_requests=True)
    calls = []
    real = log._os_fsync
    log._os_fsync = lambda fd: (calls.append(fd), real(fd))[1]
    with log._cond:  # (a re-entrant lock) hold the writer back while 50 requests append and want their fsync
        tickets = [log.emit(Event.of({"kind": "request", "decision": "allow", "reason": "allowed", "port": i}), durable=True) for i in range(50)]
    async def wait_all():
        await asyncio.gather(*(log.written(t, timeout=10) for t in tickets))

    asyncio.run(wait_all())
    assert 1 <= len(calls) < 5
    assert log.close()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=6).filter(lambda k: k != "mac"), _JSON, max_size=8))
def test_a_sealed_line_is_the_canonical_record_with_its_mac(record):
    keys = audit._Keys(_KEY)
    mac, line = keys.seal(record)
    assert mac == keys.mac(audit.canonical(record))
    assert line == audit.canonical({**record, "mac": mac}) + b"\n"


@pytest.mark.parametrize("record", [
    {},
    {"a": 1},
    {"z": 1},
    {"kind": "request", "path": '/x"mac":"' + audit._PLACEHOLDER + '"', "test_routing": {"resolve": ["a=1"]}},
    {"kind": "request", "nested": {"mac": audit._PLACEHOLDER}, "v": 1},  # the placeholder twice: the two-encoding path
    {"kind": "request", "mac": "stale", "seq": 3},
])
def test_sealing_from_one_encoding_gives_the_two_encodings_line(record):
    keys = audit._Keys(_KEY)
    assert keys.seal(record) == keys._seal_halves(record)
    mac, line = keys.seal(record)
    body = {k: v for k, v in record.items() if k != "mac"}
    assert mac == keys.mac(audit.canonical(body)) and line == audit.canonical({**body, "mac": mac}) + b"\n"


def test_strip_query():
    assert audit.strip_query("/a/b?token=x#f") == "/a/b"
    assert len(audit.strip_query("/" + "a" * 5000)) == audit.MAX_PATH


# -- the CLI ----------------------------------------------------------------------------------------


def test_cli_verify_exit_codes_and_what_it_could_not_check(tmp_path, key, keys, capsys):
    from egresslaw.cli import main

    path = _closed_log(tmp_path, key)
    assert main(["audit", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: `{path}`") and "not checked: line MACs" in out and "compare it with your `audit.pub`" in out
    assert main(["audit", "verify", str(path), "--keys", str(keys)]) == 0
    out = capsys.readouterr().out
    assert "MAC under audit key" in out and "not checked" not in out
    assert main(["audit", "verify", str(path), "--public-key", str(keys / "audit.pub")]) == 0
    assert "compare it with" not in capsys.readouterr().out
    lines = _lines(path)
    _put(path, lines[:-1])
    assert main(["audit", "verify", str(path), "--keys", str(keys)]) == 3
    assert capsys.readouterr().err.startswith(f"open: `{path}`: line ")
    _edit(lines, 3)
    _put(path, lines)
    assert main(["audit", "verify", str(path), "--keys", str(keys)]) == 1
    assert f"error: `{path}`: line 3: its MAC does not verify" in capsys.readouterr().err
    assert main(["audit", "verify", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_second_process_cannot_write_the_same_chain(tmp_path):
    """One writer per chain: a proxy and a lane given the same --audit-log (EGRESSLAW_AUDIT_LOG is read by both) must
    not interleave two chains in one file; the second is refused at start-up, and the chain is free once the first closes."""
    import subprocess
    import sys
    import textwrap

    from egress_proxy.audit.log import AuditError, AuditLog
    from egress_proxy.custody.keys import init_keys, load_audit_key

    init_keys(tmp_path / "keys")
    key = load_audit_key(str(tmp_path / "keys"))
    path = tmp_path / "audit.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from egress_proxy.audit.log import AuditLog
        from egress_proxy.custody.keys import load_audit_key
        log = AuditLog({str(path)!r}, load_audit_key({str(tmp_path / "keys")!r}))
        print("open", flush=True)
        sys.stdin.readline()
        log.close()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(AuditError) as refused:
            AuditLog(path, key)
        assert "another process" in refused.value.message and "--audit-log" in refused.value.help
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    log = AuditLog(path, key)  # free again
    assert log.close()

