"""The audit exporter against a real OTLP receiver (tests/otlp_receiver.py, built on opentelemetry-proto), over
HTTP/protobuf and gRPC, with a real AuditLog writing: nothing lost, duplicates share their uid, rotation and worker
chains followed, a killed exporter resumes at its checkpoint, a gap is counted, credentials never leak."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from egress_proxy.audit import export
from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditLog, segment_path
from egress_proxy.audit.verify import worker_audit_path
from egress_proxy.custody.keys import init_keys, load_audit_key
from tests.otlp_receiver import Receiver, make_tls

ROOT = Path(__file__).resolve().parents[3]
KINDS = ("http", "grpc")


@pytest.fixture(scope="module")
def key(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    init_keys(keys)
    return load_audit_key(keys)


def _event(i: int) -> Event:
    decision = "deny" if i % 7 == 0 else "allow"
    return Event.of({"kind": "request", "id": f"r{i}", "decision": decision, "reason": "host-not-allowed" if decision == "deny" else "allowed",
                     "method": "GET", "host": "api.example.com", "port": 443, "path": f"/v1/items/{i}", "status": 403 if decision == "deny" else 200})


def _write(path: Path, key, n: int, **kw) -> Path:
    log = AuditLog(path, key, fsync=False, **kw)
    for i in range(n):
        log.emit(_event(i))
        if i % 100 == 99:
            log.flush()  # the writer thread rotates between bursts (a burst is queued whole into one segment)
    assert log.close()
    return path


def _chain(active: Path) -> list[dict]:
    """Every line of a chain, in order (its rotated segments, then the active file)."""
    numbers = export.segment_numbers(active)
    files = [segment_path(active, n) for n in numbers] + ([active] if active.exists() else [])
    return [json.loads(line) for f in files for line in f.read_bytes().splitlines()]


def _wait(condition, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def _following(exporter: export.Exporter) -> tuple[threading.Event, threading.Thread, list]:
    stop, result = threading.Event(), []
    thread = threading.Thread(target=lambda: result.append(exporter.run(stop, follow=True)), daemon=True)
    thread.start()
    return stop, thread, result


def _state(directory: Path) -> dict:
    return export.read_state(directory) or {}


def _all_arrived(rx: Receiver, *actives: Path):
    def check() -> bool:
        have = set(rx.uids())
        return all(line["mac"] in have for active in actives for line in _chain(active))
    return check


@pytest.mark.parametrize("kind", KINDS)
def test_every_line_arrives_once_in_chain_order(kind, key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 1500)
    lines = _chain(log)
    with Receiver(kind) as rx:
        exporter = export.Exporter(log, export.parse_target(rx.url), front="lane", instance="node-a")
        assert exporter.run(threading.Event(), follow=False, deadline=time.monotonic() + 120) == 0
    counts = rx.count_by_uid()
    assert counts == {line["mac"]: 1 for line in lines}  # every line (events and the log's own records) exactly once
    records = rx.records()
    assert [r["metadata"]["sequence"] for r in records] == list(range(1, len(lines) + 1))
    by_uid = {r["metadata"]["uid"]: r for r in records}
    for line, otlp in zip(lines, rx.log_records):
        assert Receiver.attribute(otlp, "log.record.uid") == line["mac"] == by_uid[line["mac"]]["metadata"]["uid"]
        assert Receiver.attribute(otlp, "egresslaw.seq") == line["seq"]
        assert Receiver.attribute(otlp, "ocsf.class_uid") == by_uid[line["mac"]]["class_uid"]
        assert otlp.severity_number == (13 if line["decision"] == "deny" else 9)
        assert otlp.time_unix_nano // 1_000_000 == export.ocsf.millis(line["ts"])
    resource = {kv.key: kv.value.string_value for kv in rx.resources[0].attributes}
    assert resource == {"service.name": "egresslaw", "service.instance.id": "node-a", "egresslaw.front": "lane"}
    state = _state(export.default_state_dir(log))
    chain = state["chains"]["audit.jsonl"]
    assert (state["exported"], chain["seq"], chain["mac"], chain["offset"]) == (len(lines), lines[-1]["seq"], lines[-1]["mac"], log.stat().st_size)
    assert (chain["backlog_bytes"], state["failures"], state["gaps"], chain["broken"]) == (0, 0, 0, None)


@pytest.mark.parametrize("kind", KINDS)
def test_following_through_a_collector_outage_loses_nothing(kind, key, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="egresslaw.audit.export")
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, key, fsync=False, rotate_bytes=256 << 10)
    written = [0]
    done = threading.Event()

    def writer() -> None:
        for i in range(4000):
            log.emit(_event(i))
            written[0] = i + 1
            if i % 50 == 49:
                time.sleep(0.03)
        done.set()

    with Receiver(kind) as rx:
        exporter = export.Exporter(path, export.parse_target(rx.url), state_dir=tmp_path / "state")
        stop, thread, result = _following(exporter)
        threading.Thread(target=writer, daemon=True).start()
        _wait(lambda: len(rx.log_records) >= 300, "the first records")
        rx.stop()
        at_outage = written[0]
        _wait(lambda: _state(tmp_path / "state").get("failures", 0) >= 4, "four failed attempts")
        _wait(lambda: _state(tmp_path / "state")["chains"]["audit.jsonl"]["backlog_bytes"] > 0, "the backlog in the state")
        assert "unreachable" in _state(tmp_path / "state")["last_error"]
        _wait(lambda: written[0] > at_outage + 200, "lines written during the outage")
        rx.start()
        _wait(done.is_set, "the writer")
        assert log.close()
        _wait(_all_arrived(rx, path), "every line after the outage")
        stop.set()
        thread.join(60)
    assert result == [0]
    lines = _chain(path)
    records = rx.records()
    assert {r["metadata"]["sequence"] for r in records} == set(range(1, len(lines) + 1))
    assert set(rx.uids()) == {line["mac"] for line in lines}
    bodies: dict[str, str] = {}
    for otlp in rx.log_records:  # a line sent twice is the same record under the same uid
        assert bodies.setdefault(Receiver.attribute(otlp, "log.record.uid"), otlp.body.string_value) == otlp.body.string_value
    warnings = [r for r in caplog.records if r.name == "egresslaw.audit.export" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "behind" in warnings[0].getMessage()  # one line for the outage, no retry spam
    assert any("caught up" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    state = _state(tmp_path / "state")
    assert state["chains"]["audit.jsonl"]["seq"] == len(lines) and state["failures"] >= 4


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "egresslaw", "audit", "export", *args]


def test_a_killed_exporter_resumes_at_its_checkpoint(key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 3000, rotate_bytes=300 << 10)
    lines = _chain(log)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with Receiver("grpc") as rx:
        rx.slow = 0.1  # a batch at a time, slowly: the kill lands mid-stream
        first = subprocess.Popen(_cli(str(log), "--to", rx.url, "--follow", "--instance", "run-1"), env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _wait(lambda: _state(export.default_state_dir(log)).get("exported", 0) >= 1024, "two acknowledged batches")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        checkpoint = _state(export.default_state_dir(log))["chains"]["audit.jsonl"]
        assert checkpoint["seq"] < len(lines)  # killed mid-stream
        rx.slow = 0.0
        second = subprocess.Popen(_cli(str(log), "--to", rx.url, "--follow", "--instance", "run-2"), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _wait(_all_arrived(rx, log), "every line after the restart")
            _wait(lambda: _state(export.default_state_dir(log))["chains"]["audit.jsonl"]["seq"] == len(lines), "the final checkpoint")
        finally:
            second.send_signal(signal.SIGTERM)
            _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert b"Traceback" not in err
    resumed = [rec["metadata"]["sequence"] for rec, who in zip(rx.records(), rx.instances) if who == "run-2"]
    assert resumed == list(range(checkpoint["seq"] + 1, len(lines) + 1))  # from the checkpoint on, nothing skipped, nothing before it
    assert set(rx.uids()) == {line["mac"] for line in lines}


def test_rotation_is_followed_and_a_worker_chain_is_picked_up(key, tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    main = AuditLog(path, key, fsync=False, rotate_bytes=64 << 10)
    with Receiver("http") as rx:
        exporter = export.Exporter(path, export.parse_target(rx.url))
        stop, thread, result = _following(exporter)
        for i in range(600):
            main.emit(_event(i))
            if i % 100 == 99:
                main.flush()
        worker_path = worker_audit_path(path, 1)
        worker = AuditLog(worker_path, key, fsync=False, rotate_bytes=64 << 10)  # a worker started after the exporter
        for i in range(600):
            worker.emit(_event(i))
            main.emit(_event(i))
            if i % 100 == 99:
                main.flush() and worker.flush()
        assert main.close() and worker.close()
        assert len(export.segment_numbers(path)) >= 3 and export.segment_numbers(worker_path)
        _wait(_all_arrived(rx, path, worker_path), "both chains")
        stop.set()
        thread.join(60)
    assert result == [0]
    assert export.chains(path) == [path, worker_path]
    seqs: dict[str, list[int]] = {}
    for otlp in rx.log_records:
        seqs.setdefault(Receiver.attribute(otlp, "egresslaw.log"), []).append(Receiver.attribute(otlp, "egresslaw.seq"))
    assert sorted(len(s) for s in seqs.values()) == sorted([len(_chain(path)), len(_chain(worker_path))])
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())  # each chain in order, across its segments
    state = _state(export.default_state_dir(path))
    assert set(state["chains"]) == {"audit.jsonl", "audit.w1.jsonl"}
    assert state["chains"]["audit.jsonl"]["segment"] == len(export.segment_numbers(path)) + 1


def test_a_deleted_segment_is_a_counted_gap_and_a_broken_chain_stops(key, tmp_path, caplog) -> None:
    log = _write(tmp_path / "a" / "audit.jsonl", key, 1200, rotate_bytes=64 << 10)
    assert len(export.segment_numbers(log)) >= 3
    lost = {line["mac"] for line in json.loads("[" + ",".join(segment_path(log, 2).read_text().splitlines()) + "]")}
    segment_path(log, 2).unlink()
    with Receiver("http") as rx:
        assert export.Exporter(log, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
        assert set(rx.uids()) == {line["mac"] for line in _chain(log)} and not lost & set(rx.uids())
    assert _state(export.default_state_dir(log))["gaps"] == 1
    assert len([r for r in caplog.records if r.levelno == logging.ERROR and "deleted before" in r.getMessage()]) == 1

    broken = _write(tmp_path / "b" / "audit.jsonl", key, 300)
    raw = broken.read_bytes().splitlines(keepends=True)
    del raw[100]  # a line cut out of the middle
    broken.write_bytes(b"".join(raw))
    caplog.clear()
    with Receiver("http") as rx:
        assert export.Exporter(broken, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
    assert sorted(r["metadata"]["sequence"] for r in rx.records()) == list(range(1, 101))  # up to the break, not past it
    chain = _state(export.default_state_dir(broken))["chains"]["audit.jsonl"]
    assert chain["seq"] == 100 and "expected 101" in chain["broken"]
    assert len([r for r in caplog.records if r.levelno == logging.ERROR and "broken" in r.getMessage()]) == 1


def test_a_replaced_log_is_exported_again_from_its_start(key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 50)
    with Receiver("http") as rx:
        assert export.Exporter(log, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
        log.unlink()
        (tmp_path / ".audit.jsonl.writer").unlink()
        _write(log, key, 80)  # a new log (another log id) in its place, longer than the checkpoint's offset
        assert export.Exporter(log, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
        assert {line["mac"] for line in _chain(log)} <= set(rx.uids())
    assert _state(export.default_state_dir(log))["chains"]["audit.jsonl"]["seq"] == len(_chain(log))


@pytest.mark.parametrize("kind", KINDS)
def test_records_the_collector_rejects_are_counted_not_sent_again(kind, key, tmp_path, caplog) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 1200)  # three batches
    with Receiver(kind) as rx:
        rx.reject = 2
        assert export.Exporter(log, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
    state = _state(export.default_state_dir(log))
    assert set(rx.count_by_uid().values()) == {1} and state["exported"] == len(_chain(log))
    assert state["rejected"] == 2 * 3 and state["failures"] == 0
    said = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(said) == 1 and "rejected on purpose" in said[0]  # logged once, not per batch


@pytest.mark.parametrize("kind", KINDS)
def test_at_a_signal_what_is_written_is_sent_once_more_then_checkpointed(kind, key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 3000)
    stop = threading.Event()
    stop.set()  # the signal came before the exporter got to anything
    with Receiver(kind) as rx:
        rx.stop()
        down = export.Exporter(log, export.parse_target(rx.url), state_dir=tmp_path / "down")
        assert down.run(stop, follow=True) == 0
        assert _state(tmp_path / "down")["failures"] == 1  # one last attempt, no retries
        rx.start()
        assert export.Exporter(log, export.parse_target(rx.url)).run(stop, follow=True) == 0
    assert [r["metadata"]["sequence"] for r in rx.records()] == list(range(1, len(_chain(log)) + 1))
    assert _state(export.default_state_dir(log))["chains"]["audit.jsonl"]["seq"] == len(_chain(log))


def test_one_exporter_per_state_directory(key, tmp_path, caplog) -> None:
    import fcntl  # Imported here: only this test holds the lock itself

    caplog.set_level(logging.INFO, logger="egresslaw.audit.export")
    log = _write(tmp_path / "audit.jsonl", key, 40)
    state_dir = export.default_state_dir(log)
    state_dir.mkdir()
    with Receiver("http") as rx, open(state_dir / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another exporter on this state
        exporter = export.Exporter(log, export.parse_target(rx.url))
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(exporter.run(threading.Event(), follow=False)), daemon=True)
        thread.start()
        _wait(lambda: any("waiting for it" in r.getMessage() for r in caplog.records), "the second exporter to wait")
        assert not rx.log_records and _state(state_dir) == {}
        fcntl.flock(held, fcntl.LOCK_UN)
        thread.join(120)
        assert result == [0] and len(rx.log_records) == len(_chain(log))


CANARY = "Bearer canary-7f3a9c1e-never-in-a-log"


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_credential_is_refused_and_never_leaks(kind, key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 20)
    wrong, right = tmp_path / "wrong.headers", tmp_path / "right.headers"
    wrong.write_text(f"# the collector's token\nAuthorization: {CANARY}\n")
    right.write_text("authorization: Bearer right\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with Receiver(kind, auth=("authorization", "Bearer right")) as rx:
        refused = subprocess.run(_cli(str(log), "--to", rx.url, "--headers", str(wrong), "--timeout", "3"), env=env,
                                 capture_output=True, timeout=120)
        assert refused.returncode == 1 and rx.refused >= 1 and not rx.log_records
        state_text = (export.default_state_dir(log) / "state.json").read_text()
        for where in (refused.stdout, refused.stderr, state_text.encode()):
            assert b"canary" not in where.lower()
        assert "UNAUTHENTICATED" in state_text or "401" in state_text  # the cause is named, the credential is not
        exporter = export.Exporter(log, export.parse_target(rx.url), headers=export.read_headers(wrong))
        assert "canary" not in repr(exporter) and exporter.run(threading.Event(), follow=False, deadline=time.monotonic() + 1) == 1
        assert "canary" not in json.dumps(exporter.state())
        accepted = subprocess.run(_cli(str(log), "--to", rx.url, "--headers", str(right)), env=env, capture_output=True, timeout=120)
        assert accepted.returncode == 0, accepted.stderr
        assert set(rx.uids()) == {line["mac"] for line in _chain(log)}


@pytest.mark.parametrize("kind", KINDS)
def test_tls_to_the_collector_needs_its_ca(kind, key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 30)
    tls = make_tls(tmp_path / "pki")
    with Receiver(kind, tls=tls) as rx:
        target = export.parse_target(rx.url)
        assert target.tls
        untrusted = export.Exporter(log, target, state_dir=tmp_path / "s1", timeout=2)
        assert untrusted.run(threading.Event(), follow=False, deadline=time.monotonic() + 2) == 1  # the system trust does not know it
        assert not rx.log_records
        trusted = export.Exporter(log, target, state_dir=tmp_path / "s2", ca=tls.ca)
        assert trusted.run(threading.Event(), follow=False, deadline=time.monotonic() + 60) == 0
        assert set(rx.uids()) == {line["mac"] for line in _chain(log)}


def test_targets_and_headers_files(tmp_path) -> None:
    assert export.parse_target("http://127.0.0.1:4318") == export.Target("http", "127.0.0.1", 4318, "/v1/logs")
    assert export.parse_target("https://otel.example:443/custom/logs").path == "/custom/logs"
    assert str(export.parse_target("grpcs://[::1]:4317")) == "grpcs://[::1]:4317"
    for bad in ("ftp://h:1", "grpc://h", "grpc://h:1/x", "http://h:1/v1/logs?x=1", "h:4317", "http://:1"):
        with pytest.raises(export.ExportError) as caught:
            export.parse_target(bad)
        assert caught.value.help
    with pytest.raises(export.ExportError) as caught:
        export.parse_target("https://user:hunter2@h:1")
    assert "hunter2" not in caught.value.message + (caught.value.help or "")
    good = tmp_path / "h"
    good.write_text("# comment\n\nAuthorization: Bearer a:b\r\nX-Scope-OrgID:  team-1 \n")
    assert export.read_headers(good) == (("Authorization", "Bearer a:b"), ("X-Scope-OrgID", "team-1"))
    bad = tmp_path / "bad"
    bad.write_text("Authorization: ok\nBearer secret-value-123\n")
    with pytest.raises(export.ExportError) as caught:
        export.read_headers(bad)
    assert "line 2" in caught.value.message and "secret-value-123" not in caught.value.message


# -- review findings: races with the writer's rotation, cut-backs, answers that are no OTLP, options, hygiene --------


def _hand_chain(directory: Path):
    """A chain written by hand (lines that link, `mac` made up): the writer's steps placed exactly between the reader's."""
    from egress_proxy.audit.log import GENESIS  # Imported here: only these tests write chain lines themselves

    state = {"seq": 0, "prev": GENESIS}

    def line(kind: str, **fields) -> bytes:
        state["seq"] += 1
        mac = f"{state['seq']:064x}"
        record = {"v": "egresslaw.audit/2", "ts": "2026-01-01T00:00:00.000Z", "kind": kind, "decision": "info", "reason": "x",
                  "seq": state["seq"], "prev": state["prev"], "mac": mac, **fields}
        state["prev"] = mac
        return (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode()

    return directory / "audit.jsonl", line


def test_a_rotation_between_the_read_and_the_size_is_no_break(tmp_path, monkeypatch) -> None:
    active, line = _hand_chain(tmp_path)
    active.write_bytes(line("audit-open", segment=1, log="L1") + line("request"))
    reader = export.ChainReader(active, export.Cursor())
    reader.advance(reader.read())
    real_stat, fired = os.stat, []

    def stat(path, *args, **kwargs):
        if Path(path) == active and not fired:  # the writer, right after the reader found nothing new at its cursor
            fired.append(1)
            with open(active, "ab") as f:
                f.write(line("request") + line("checkpoint", end="rotated"))
            os.rename(active, segment_path(active, 1))
            active.write_bytes(line("audit-open", segment=2, log="L1"))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(export.os, "stat", stat)
    first = reader.read()
    monkeypatch.setattr(export.os, "stat", real_stat)
    assert fired and reader.cursor.broken is None
    seen = [ln.record["seq"] for ln in first]
    while lines := reader.read():
        reader.advance(lines)
        seen += [ln.record["seq"] for ln in lines]
    assert seen == [3, 4, 5] and reader.cursor.broken is None and reader.gaps == 0


def test_a_rotation_at_the_first_read_skips_no_segment(tmp_path, monkeypatch) -> None:
    active, line = _hand_chain(tmp_path)
    active.write_bytes(line("audit-open", segment=1, log="L") + line("request") + line("checkpoint", end="rotated"))
    real_listdir, fired = os.listdir, []

    def listdir(path):
        names = real_listdir(path)
        if not fired:  # the writer rotates right after the reader listed the directory
            fired.append(1)
            os.rename(active, segment_path(active, 1))
            active.write_bytes(line("audit-open", segment=2, log="L"))
        return names

    monkeypatch.setattr(export.os, "listdir", listdir)
    reader = export.ChainReader(active, export.Cursor())
    lines = reader.read()
    assert fired and [(ln.segment, ln.record["seq"]) for ln in lines] == [(1, 1), (1, 2), (1, 3)] and reader.gaps == 0


def test_a_cut_back_active_file_resends_its_segment_not_the_chain(key, tmp_path) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 1450, rotate_bytes=64 << 10)
    lines = log.read_bytes().splitlines(keepends=True)
    assert export.segment_numbers(log) and len(lines) > 10  # rotated segments, then an active file of many lines
    with Receiver("http") as rx:
        assert export.Exporter(log, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
        sent = len(rx.log_records)
        log.write_bytes(b"".join(lines[:5]))  # the writer's failed fsync cut the active file back below the checkpoint
        assert export.Exporter(log, export.parse_target(rx.url)).run(threading.Event(), follow=False) == 0
        again = rx.log_records[sent:]
    kept = [json.loads(raw) for raw in lines[:5]]
    assert [Receiver.attribute(r, "log.record.uid") for r in again] == [ln["mac"] for ln in kept]  # only the active segment's
    assert _state(export.default_state_dir(log))["chains"]["audit.jsonl"]["seq"] == kept[-1]["seq"]


class _Gateway:
    """An HTTP server answering every POST 200 with a page (an auth gateway in front of no collector)."""

    def __init__(self, content_type: str, body: bytes) -> None:
        import http.server  # Imported here: only this fake gateway serves HTTP itself

        answer = (content_type, body)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", answer[0])
                self.send_header("Content-Length", str(len(answer[1])))
                self.end_headers()
                self.wfile.write(answer[1])

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/logs"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("content_type", "body"), [("text/html", b"<html>sign in</html>"),
                                                    ("application/x-protobuf", b"\xff\xff\xff not protobuf")])
def test_a_2xx_that_is_no_otlp_answer_is_a_failed_send(key, tmp_path, content_type, body) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 20)
    gateway = _Gateway(content_type, body)
    try:
        exporter = export.Exporter(log, export.parse_target(gateway.url), timeout=2)
        assert exporter.run(threading.Event(), follow=False, deadline=time.monotonic() + 1.5) == 1
    finally:
        gateway.close()
    state = _state(export.default_state_dir(log))
    assert state["exported"] == 0 and state["chains"]["audit.jsonl"]["seq"] is None and state["failures"] >= 1
    assert "HTTP 200" in state["last_error"]


def test_check_options_refuses_what_the_child_would_fail_on(tmp_path) -> None:
    pem_ca = make_tls(tmp_path / "pki").ca
    not_pem = tmp_path / "ca.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a not a PEM file")
    euro, grpc_reserved, spaced = tmp_path / "euro", tmp_path / "reserved", tmp_path / "spaced"
    euro.write_text("Authorization: Bearer tok€n-secret\n", encoding="utf-8")
    grpc_reserved.write_text("grpc-timeout: 1S-secret\n")
    spaced.write_text("X.Tenant_ID: team-secret\n")
    refused = [("grpc://127.0.0.1:4317", None, pem_ca, "plaintext"), ("http://127.0.0.1:4318", None, pem_ca, "plaintext"),
               ("grpcs://127.0.0.1:4317", None, not_pem, "PEM"), ("https://127.0.0.1:4318", None, not_pem, "PEM"),
               ("https://127.0.0.1:4318", euro, None, "visible ASCII"), ("grpc://127.0.0.1:4317", grpc_reserved, None, "gRPC metadata")]
    for url, headers, ca, said in refused:
        with pytest.raises(export.ExportError) as caught:
            export.check_options(url, headers=headers and str(headers), ca=ca and str(ca), cert=None, key=None)
        text = caught.value.message + (caught.value.help or "")
        assert said in text and "secret" not in text and caught.value.help, (url, text)
    export.check_options("grpcs://127.0.0.1:4317", headers=str(spaced), ca=str(pem_ca), cert=None, key=None)
    export.check_options("http://127.0.0.1:4318", headers=str(grpc_reserved), ca=None, cert=None, key=None)  # fine over HTTP


def test_the_backlog_of_a_line_that_is_no_json_is_counted_not_raised(tmp_path) -> None:
    active, line = _hand_chain(tmp_path)
    active.write_bytes(line("audit-open", segment=1, log="L") + b"{torn by a crash\n")
    reader = export.ChainReader(active, export.Cursor())
    reader.advance(reader.read())
    assert reader.backlog()[0] == len(b"{torn by a crash\n")


def test_the_target_path_and_header_values_never_show(key, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="egresslaw.audit.export")
    target = export.parse_target("http://127.0.0.1:9/v1/logs/tenant-secret-path")
    assert target.path == "/v1/logs/tenant-secret-path" and str(target) == "http://127.0.0.1:9"
    with pytest.raises(export.ExportError) as caught:
        export.parse_target("http://127.0.0.1:9/p/token-secret?key=query-secret")
    assert "secret" not in caught.value.message
    headers = tmp_path / "h"
    headers.write_text("Authorization: Bearer value-secret\nX-Tenant: tenant-secret\n")
    log = _write(tmp_path / "audit.jsonl", key, 5)
    exporter = export.Exporter(log, target, headers=export.read_headers(headers), timeout=1)
    assert exporter.run(threading.Event(), follow=False, deadline=time.monotonic() + 1) == 1
    said = [r.getMessage() for r in caplog.records]
    plaintext = [m for m in said if "plaintext" in m]
    assert len(plaintext) == 1 and "Authorization" in plaintext[0] and "X-Tenant" in plaintext[0]
    shown = "\n".join(said) + repr(exporter) + (export.default_state_dir(log) / "state.json").read_text()
    assert "secret" not in shown and "127.0.0.1:9" in shown


def test_the_directory_is_listed_again_only_when_it_changed(key, tmp_path, monkeypatch) -> None:
    log = _write(tmp_path / "audit.jsonl", key, 600, rotate_bytes=32 << 10)
    os.utime(tmp_path, ns=(time.time_ns() - 5_000_000_000,) * 2)  # settled: changed seconds ago
    real_listdir, listed = os.listdir, []
    monkeypatch.setattr(export.os, "listdir", lambda path: listed.append(path) or real_listdir(path))
    numbers = export.segment_numbers(log)
    for _ in range(5):
        assert export.chains(log) == [log] and export.segment_numbers(log) == numbers
        export.ChainReader(log, export.Cursor(segment=numbers[0])).backlog()
    assert len(listed) <= 1
    segment_path(log, numbers[-1] + 1).write_bytes(b"")  # a rotation changes the directory: seen at once
    assert export.segment_numbers(log) == numbers + [numbers[-1] + 1]


def test_the_hand_written_request_is_the_generated_classes_bytes(key, tmp_path) -> None:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest  # Imported here: the reference
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource

    log = _write(tmp_path / "audit.jsonl", key, 300)
    lines = export.ChainReader(log, export.Cursor()).read()
    lines[3].record["ts"] = "not a time"  # time_unix_nano 0: absent, as the classes leave it
    wire = export.encode(lines, front="lane", instance="node-ä")
    observed = ExportLogsServiceRequest.FromString(wire).resource_logs[0].scope_logs[0].log_records[0].observed_time_unix_nano

    def text(k: str, v: str) -> KeyValue:
        return KeyValue(key=k, value=AnyValue(string_value=v))

    records = []
    for line in lines:
        projected = export.ocsf.project(line.record, log_id=line.log_id)
        sev, sev_text = export.severity(line.record)
        records.append(LogRecord(time_unix_nano=export.ocsf.millis(line.record["ts"]) * 1_000_000, observed_time_unix_nano=observed,
                                 severity_number=sev, severity_text=sev_text,
                                 body=AnyValue(string_value=json.dumps(projected, sort_keys=True, separators=(",", ":"), ensure_ascii=False)),
                                 attributes=[text("log.record.uid", line.record["mac"]),
                                             KeyValue(key="egresslaw.seq", value=AnyValue(int_value=line.record["seq"])),
                                             text("egresslaw.log", export.ocsf.log_name(line.log_id)),
                                             KeyValue(key="ocsf.class_uid", value=AnyValue(int_value=projected["class_uid"]))]))
    resource = Resource(attributes=[text("service.name", "egresslaw"), text("service.instance.id", "node-ä"), text("egresslaw.front", "lane")])
    reference = ExportLogsServiceRequest(resource_logs=[ResourceLogs(resource=resource, scope_logs=[
        ScopeLogs(scope=InstrumentationScope(name="egresslaw.audit.export"), log_records=records)])])
    assert len(lines) > 300 and wire == reference.SerializeToString()
