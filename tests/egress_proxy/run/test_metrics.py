"""The metrics (prometheus_client): decisions by kind (a CONNECT is not a request), build info following the
artifact, process metrics, and the audit writer's latency and failures measured on a real audit log."""

from __future__ import annotations

import errno
import re

import pytest

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditLog
from egress_proxy.custody.keys import init_keys, load_audit_key
from egress_proxy.run.metrics import Metrics, WorkerProcesses


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")) == labels:
            return float(m.group(2))
    return None


def test_decisions_by_kind_and_only_requests_in_the_latency_histogram():
    m = Metrics()
    m.observe("connect", "allow", "allowed", 30.0)  # a tunnel's lifetime must not count as a request's latency
    m.observe("request", "allow", "allowed", 0.004)
    m.observe("request", "deny", "lease-missing", 0.001)
    m.observe("tls", "deny", "sni-mismatch", 0.0)
    text = m.render().decode()
    assert _sample(text, "egresslaw_decisions_total", kind="connect", decision="allow", reason="allowed") == 1
    assert _sample(text, "egresslaw_decisions_total", kind="request", decision="allow", reason="allowed") == 1
    assert _sample(text, "egresslaw_decisions_total", kind="tls", decision="deny", reason="sni-mismatch") == 1
    assert _sample(text, "egresslaw_request_duration_seconds_count") == 2
    assert _sample(text, "egresslaw_request_duration_seconds_sum") == pytest.approx(0.005)
    assert "_created" not in text


def test_build_info_names_the_artifact_now_enforced_and_process_metrics_are_there():
    m = Metrics()
    m.serving("a" * 64, True)
    m.serving("b" * 64, False)  # a reload: the old series goes
    text = m.render().decode()
    infos = [line for line in text.splitlines() if line.startswith("egresslaw_build_info{")]
    assert len(infos) == 1 and 'artifact="' + "b" * 64 + '"' in infos[0] and 'proved="false"' in infos[0]
    assert _sample(text, "process_resident_memory_bytes") > 0
    m.reload("ok")
    assert _sample(m.render().decode(), "egresslaw_reloads_total", result="ok") == 1 and m.reloads == {"ok": 1}


def test_a_worker_counts_no_reloads_and_has_no_build_info_its_supervisor_does():
    worker, supervisor = Metrics("worker"), Metrics("supervisor")
    worker.reload("ok")
    supervisor.serving("c" * 64, True)
    assert "egresslaw_reloads_total" not in worker.render().decode() and "egresslaw_build_info" not in worker.render().decode()
    assert "egresslaw_decisions_total" not in supervisor.render().decode()
    assert _sample(supervisor.render().decode(), "egresslaw_build_info", **_labels(supervisor.render().decode())) == 1


def _labels(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if line.startswith("egresslaw_build_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_worker_processes_are_labelled_by_worker():
    import os

    families = {f.name: f for f in WorkerProcesses(lambda: {"1": os.getpid(), "supervisor": os.getppid()}).collect()}
    workers = {s.labels["worker"] for s in families["process_resident_memory_bytes"].samples}
    assert workers == {"1", "supervisor"}


def test_the_audit_writer_is_timed_and_its_failures_counted(tmp_path):
    init_keys(tmp_path / "keys")
    log = AuditLog(tmp_path / "a.jsonl", load_audit_key(tmp_path / "keys"), retry_seconds=0.05)
    real = log._os_write
    broken = {"on": True}

    def disk(fd: int, data: bytes) -> int:
        if broken["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    log._os_write = disk
    m = Metrics()
    m.watch_audit(log)
    log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "x"}))
    assert not log.flush(0.3)  # the write fails (and is retried)
    broken["on"] = False
    assert log.flush(5) and log.close()
    text = m.render().decode()
    assert _sample(text, "egresslaw_audit_write_failures_total", op="write") >= 1
    assert _sample(text, "egresslaw_audit_write_seconds_count", op="write") >= 2  # the failed ones and the one that landed
    assert _sample(text, "egresslaw_audit_write_seconds_count", op="fsync") >= 1
    assert _sample(text, "egresslaw_audit_write_failures_total", op="fsync") == 0
