"""The audit log: chain, group commit, recovery of a torn last line, and `verify` finding the broken line."""

from __future__ import annotations

import json
import threading

from egress_proxy import audit


def _write(path, n):
    log = audit.AuditLog(path)
    for i in range(n):
        log.emit({"kind": "request", "decision": "allow", "reason": "ok", "path": f"/p/{i}"})
    log.close()


def test_chain_verifies_and_survives_reopen(tmp_path):
    path = tmp_path / "a.jsonl"
    _write(path, 5)
    _write(path, 3)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 8
    assert json.loads(lines[0])["prev"] == audit.GENESIS
    assert json.loads(lines[5])["prev"] == audit.line_hash(lines[4])
    assert [json.loads(x)["seq"] for x in lines] == list(range(1, 9))
    result = audit.verify(path)
    assert result.ok and result.lines == 8


def test_edit_is_found_with_its_line_number(tmp_path):
    path = tmp_path / "a.jsonl"
    _write(path, 6)
    lines = path.read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"allow"', b'"deny"')
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = audit.verify(path)
    assert not result.ok
    # The edited line still carries the right `prev`, so the break shows on the line after it.
    assert result.broken_line == 4


def test_deleted_line_is_found(tmp_path):
    path = tmp_path / "a.jsonl"
    _write(path, 4)
    lines = path.read_bytes().splitlines()
    del lines[1]
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert audit.verify(path).broken_line == 2


def test_reformatted_line_is_not_canonical(tmp_path):
    path = tmp_path / "a.jsonl"
    _write(path, 1)
    record = json.loads(path.read_bytes())
    path.write_text(json.dumps(record, indent=None) + "\n")  # same content, other spacing
    result = audit.verify(path)
    assert not result.ok and result.broken_line == 1


def test_torn_last_line_is_cut_and_recorded(tmp_path):
    path = tmp_path / "a.jsonl"
    _write(path, 3)
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"request","dec')
    assert audit.verify(path).broken_line == 4
    _write(path, 1)
    records = [json.loads(x) for x in path.read_bytes().splitlines()]
    assert [r["kind"] for r in records] == ["request"] * 3 + ["audit-recovered", "request"]
    assert records[3]["bytes"] == len(b'{"kind":"request","dec')
    assert audit.verify(path).ok


def test_concurrent_emitters_lose_nothing(tmp_path):
    path = tmp_path / "a.jsonl"
    log = audit.AuditLog(path)

    def work(k):
        for i in range(200):
            log.emit({"kind": "request", "worker": k, "i": i})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.flush()
    log.close()
    records = [json.loads(x) for x in path.read_bytes().splitlines()]
    assert len(records) == 1600
    assert {(r["worker"], r["i"]) for r in records} == {(k, i) for k in range(8) for i in range(200)}
    assert audit.verify(path).ok


def test_group_commit_batches_fsyncs(tmp_path, monkeypatch):
    calls = []
    real = audit.os.fsync
    monkeypatch.setattr(audit.os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    log = audit.AuditLog(tmp_path / "a.jsonl")
    with log._cond:  # hold the writer back so the events queue up into one batch
        for i in range(50):
            log._queue.append({"v": audit.FORMAT, "seq": i + 1, "kind": "x"})
            log._enqueued += 1
            log.seq += 1
        log._cond.notify_all()
    assert log.flush()
    log.close()
    assert 1 <= len(calls) < 5
    assert audit.verify(tmp_path / "a.jsonl").lines == 50


def test_strip_query():
    assert audit.strip_query("/a/b?token=x#f") == "/a/b"
    assert len(audit.strip_query("/" + "a" * 5000)) == audit.MAX_PATH
