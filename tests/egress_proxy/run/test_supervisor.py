"""`egresslaw proxy --workers 2` as a real child process: connections spread over both workers, a killed worker
restarted while the proxy keeps serving, a worker that cannot start stopping everything (exit 2, nothing
listening), SIGHUP reaching both workers (a bad artifact refused by both), SIGTERM draining both with every
delivered response audited, one chain per worker that `audit verify` walks, and one `/metrics` for all.

Every wait is bounded and waits for a state (a log line, a count), never for a fixed time.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from egress_proxy.audit.verify import audit_logs, worker_audit_path
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    CANARY,
    FleetProcess,
    assert_no_canary,
    build_artifact,
    free_port,
    make_env,
    proof_for,
    wait_for,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
API = "api.acme-test.dev"


def _routing(upstream_port: int, ca: Path) -> list[str]:
    return ["--resolve", f"{API}=93.184.216.34", "--connect-to", f"{API}:443:127.0.0.1:{upstream_port}", "--upstream-ca", str(ca)]


def _get(fleet: FleetProcess, path: str, lease: str) -> tuple[int, dict, bytes]:
    """One absolute-form request on a new connection (so the kernel picks a worker for each)."""
    conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=90)  # a budget: the drain test holds replies while it waits 30 s twice
    try:
        conn.request("GET", f"https://{API}{path}", headers={"Proxy-Authorization": f"Bearer {lease}"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _requests(chains: list[list[dict]]) -> list[list[dict]]:
    return [[e for e in chain if e["kind"] == "request"] for chain in chains]


def _verify(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "egresslaw", "audit", "verify", str(path), *extra], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text (labels in any order); 0 when absent."""
    for line in metrics.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")) == labels:
            return float(m.group(2))
    return 0.0


@pytest.fixture
def fleet_env(tmp_path):
    return make_env(tmp_path / "env")


def test_connections_spread_over_both_workers_with_one_metrics_and_one_readiness(fleet_env, tls_upstream, pki):
    fleet = FleetProcess(fleet_env, _routing(tls_upstream.port, pki.ca_pem))
    try:
        assert fleet.admin_get("/readyz", token=False) == (200, "ready\n")
        lease = fleet_env.lease(connection="github")
        for i in range(24):
            status, _, body = _get(fleet, f"/repos/acme/spread{i}", lease)
            assert status == 200, body
        assert [s.all("Authorization") for s in tls_upstream.raw_requests()[-24:]] == [[f"Bearer {CANARY}"]] * 24
        chains = _requests(fleet.events())
        assert [worker_audit_path(fleet_env.audit, i).name for i in (1, 2)] == [segs[-1][0].name for segs in audit_logs(fleet_env.audit)]
        # Both workers served: the kernel spread 24 connections (all on one of two workers: 2 ** -23).
        assert len(chains) == 2 and all(chains) and sum(map(len, chains)) == 24, [len(c) for c in chains]
        assert sorted(e["path"] for chain in chains for e in chain) == sorted(f"/repos/acme/spread{i}" for i in range(24))
        status, metrics = fleet.admin_get("/metrics")
        assert status == 200
        # Counters are summed over the workers; a CONNECT is not a request (there were none here).
        assert _sample(metrics, "egresslaw_decisions_total", kind="request", decision="allow", reason="allowed") == 24
        assert _sample(metrics, "egresslaw_request_duration_seconds_count") == 24
        assert _sample(metrics, "egresslaw_workers", state="serving") == 2
        assert _sample(metrics, "egresslaw_build_info", version=_version(), core=_core(), artifact=_digest(fleet_env), proved="true") == 1
        assert _sample(metrics, "egresslaw_audit_write_seconds_count", op="fsync") > 0  # the write-ahead syncs, timed in the workers
        for worker in ("1", "2", "supervisor"):
            assert _sample(metrics, "process_resident_memory_bytes", worker=worker) > 0, worker
        assert fleet.admin_get("/metrics", token=False)[0] == 401
        # The lease key is re-read by every worker after a rotation: a lease under the new key works on both.
        rotated = subprocess.run([sys.executable, "-m", "egresslaw", "keys", "rotate", "--lease", "--dir", str(fleet_env.keys)],
                                 capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert rotated.returncode == 0, rotated.stderr
        from egress_proxy.custody.keys import load_lease_keys
        from egress_proxy.custody.lease import mint

        keys = load_lease_keys(fleet_env.keys)
        assert keys.active.material != fleet_env.lease_key
        fresh = mint(keys, "agent-1", connection="github", ttl=600, now=time.time())
        for i in range(16):
            assert _get(fleet, f"/repos/acme/rotated{i}", fresh)[0] == 200
        after = _requests(fleet.events())
        assert all(any(e["path"].startswith("/repos/acme/rotated") for e in chain) for chain in after), [len(c) for c in after]
    finally:
        code = fleet.stop()
    assert code == 0, fleet.text()[-3000:]
    assert_no_canary(fleet.text(), "the proxy's stderr")
    verify = _verify(fleet_env.audit, "--keys", str(fleet_env.keys))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "2 logs, each its own chain: 2 intact, 0 open, 0 broken" in verify.stdout
    assert _verify(fleet_env.audit.parent).returncode == 0  # the directory: the same two chains


def _version() -> str:
    from egress_proxy.decision.provenance import egresslaw_version

    return egresslaw_version()


def _core() -> str:
    from egress_proxy.decision.provenance import core_digest

    return core_digest()


def _digest(env) -> str:
    return json.loads(env.artifact.read_text())["digest"]


def test_a_killed_worker_is_restarted_and_the_proxy_keeps_serving(fleet_env, tls_upstream, pki):
    fleet = FleetProcess(fleet_env, _routing(tls_upstream.port, pki.ca_pem))
    try:
        lease = fleet_env.lease(connection="github")
        assert wait_for(lambda: len(fleet.worker_pids()) == 2, 30)
        victim = fleet.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        assert fleet.wait_line("exited (signal SIGKILL)", timeout=30), fleet.text()[-2000:]
        # While it is down (and after), the proxy serves: the other worker takes every new connection.
        for i in range(6):
            assert _get(fleet, f"/repos/acme/during{i}", lease)[0] == 200
        assert fleet.wait_line("restarted (pid", timeout=60), fleet.text()[-2000:]
        assert wait_for(lambda: fleet.admin_get("/readyz", token=False)[0] == 200, 30)
        assert victim not in fleet.worker_pids() and len(fleet.worker_pids()) == 2
        for i in range(16):
            assert _get(fleet, f"/repos/acme/after{i}", lease)[0] == 200
        chains = _requests(fleet.events())
        assert all(chains), [len(c) for c in chains]  # the restarted worker serves again
        metrics = fleet.admin_get("/metrics")[1]
        assert sum(_sample(metrics, "egresslaw_worker_restarts_total", worker=w) for w in ("1", "2")) == 1
        assert _sample(metrics, "egresslaw_decisions_total", kind="request", decision="allow", reason="allowed") == 22
    finally:
        code = fleet.stop()
    assert code == 0, fleet.text()[-3000:]
    verify = _verify(fleet_env.audit, "--keys", str(fleet_env.keys))
    # Both chains check and are closed; the killed run is a note in its worker's chain, not a break.
    assert verify.returncode == 0 and "the run ending there was not closed (killed or crashed)" in verify.stdout, verify.stdout + verify.stderr


def test_a_worker_that_cannot_start_stops_the_proxy_with_exit_2_and_nothing_listening(fleet_env, tls_upstream, pki):
    # Worker 2's audit log is not an audit log: only that worker can find out (the supervisor opens no audit log).
    worker_audit_path(fleet_env.audit, 2).write_text("this is not an audit log\n")
    port, admin = free_port(), free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "egresslaw", "proxy", "--workers", "2", "--artifact", str(fleet_env.artifact), "--proof", str(fleet_env.proof),
         "--keys", str(fleet_env.keys), "--store", str(fleet_env.store), "--audit-log", str(fleet_env.audit), "--confdir", str(fleet_env.confdir),
         "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}", *_routing(tls_upstream.port, pki.ca_pem)],
        capture_output=True, text=True, cwd=ROOT, timeout=180)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "error: worker-2 cannot start: the first line of audit log" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "listening on" not in proc.stderr
    assert not _listening(port) and not _listening(admin)
    # Worker 1 did start (bound, never accepting), and was stopped cleanly: its chain is closed.
    assert _verify(worker_audit_path(fleet_env.audit, 1)).returncode == 0


def test_sighup_reaches_every_worker_and_a_bad_artifact_is_refused_by_all(fleet_env, tls_upstream, pki):
    fleet = FleetProcess(fleet_env, _routing(tls_upstream.port, pki.ca_pem))
    try:
        lease = fleet_env.lease(connection="github")
        assert _get(fleet, "/new", lease)[0] == 403
        newer = build_artifact([b.rule("new", API, "/new", ["GET"])])
        fleet_env.proof.write_text(proof_for(newer))
        fleet_env.artifact.write_text(newer.to_json())
        reloads = fleet.count("reloaded artifact")
        fleet.proc.send_signal(signal.SIGHUP)
        assert fleet.wait_line("reloaded artifact", reloads + 1), fleet.text()[-2000:]
        for i in range(16):
            assert _get(fleet, f"/new/{i}", lease)[0] == 200, i  # on whichever worker the connection lands
        chains = fleet.events()
        for chain in chains:  # every worker recorded the swap, to the same digest
            assert [e["artifact"] for e in chain if e["kind"] == "reload" and e["decision"] == "allow"] == [newer.digest]
        assert all(_requests([chain])[0] for chain in chains)
        # A broken artifact: refused once, by the supervisor, for every worker; each records the refusal.
        fleet_env.artifact.write_text(newer.to_json().replace('"workspace"', '"workspaces"'))
        refused = fleet.count("reload refused")
        fleet.proc.send_signal(signal.SIGHUP)
        assert fleet.wait_line("reload refused", refused + 1), fleet.text()[-2000:]
        for i in range(16):
            assert _get(fleet, f"/new/again{i}", lease)[0] == 200, i  # still the verified artifact, in both
        for chain in fleet.events():
            denials = [e for e in chain if e["kind"] == "reload" and e["decision"] == "deny"]
            assert len(denials) == 1 and denials[0]["artifact"] == newer.digest and "artifact" in denials[0]["detail"]
            assert str(fleet.env.root) not in denials[0]["detail"] or "egresslaw-run-" not in denials[0]["detail"]
        metrics = fleet.admin_get("/metrics")[1]
        assert (_sample(metrics, "egresslaw_reloads_total", result="ok"), _sample(metrics, "egresslaw_reloads_total", result="failed")) == (1, 1)
        assert _sample(metrics, "egresslaw_build_info", version=_version(), core=_core(), artifact=newer.digest, proved="true") == 1
    finally:
        code = fleet.stop()
    assert code == 0, fleet.text()[-3000:]
    assert fleet.count("reload refused") == 1  # said once (by the supervisor), not once per worker


class _SlowUpstream:
    """A TLS upstream that holds every request until released, counting the requests it holds."""

    def __init__(self, pki) -> None:
        import ssl

        self.held = 0
        self.release = threading.Event()
        self.lock = threading.Lock()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki.cert_pem, pki.key_pem)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

        def serve(conn: socket.socket) -> None:
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.settimeout(30)
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = tls.recv(4096)
                        if not chunk:
                            return
                        head += chunk
                    with self.lock:
                        self.held += 1
                    self.release.wait(30)
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nslow")
            except OSError:
                pass

        def accept() -> None:
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.sock.close()


def test_sigterm_drains_both_workers_and_every_delivered_response_is_audited(fleet_env, pki):
    slow = _SlowUpstream(pki)
    fleet = FleetProcess(fleet_env, _routing(slow.port, pki.ca_pem) + ["--drain-grace", "60"])
    results: list[int] = []
    try:
        lease = fleet_env.lease(connection="github")

        def one(i: int) -> None:
            try:
                results.append(_get(fleet, f"/repos/acme/drain{i}", lease)[0])
            except (OSError, http.client.HTTPException):
                results.append(0)

        clients = [threading.Thread(target=one, args=(i,)) for i in range(12)]
        for t in clients:
            t.start()
        assert wait_for(lambda: slow.held == 12, 30), slow.held  # all twelve are in flight, upstream
        fleet.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: not _listening(fleet.port), 30)  # both workers stopped accepting
        slow.release.set()
        for t in clients:
            t.join(30)
        code = fleet.stop()
    finally:
        slow.close()
        if fleet.proc.poll() is None:
            fleet.stop(signal.SIGKILL)
    assert code == 0, fleet.text()[-3000:]
    assert results == [200] * 12
    chains = [[e for e in map(json.loads, path.read_bytes().splitlines())] for path in fleet.audit_files()]
    assert len(chains) == 2
    outcomes = [e for chain in chains for e in chain if e["kind"] == "outcome" and e["of"] == "request"]
    assert sorted((e["status"], e["failure"]) for e in outcomes) == [(200, None)] * 12  # every delivered response, audited
    decided = {e["id"]: e for chain in chains for e in chain if e["kind"] == "request"}
    assert {e["id"] for e in outcomes} == set(decided) and len(decided) == 12
    assert all(chain[-1]["kind"] == "checkpoint" and chain[-1]["end"] == "shutdown" for chain in chains)
    verify = _verify(fleet_env.audit, "--keys", str(fleet_env.keys))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # Shipped side by side with another replica's chains (one directory per pod), one command checks them all.
    import shutil

    shipped = fleet_env.root / "shipped"
    for pod in ("egresslaw-0", "egresslaw-1"):
        (shipped / pod).mkdir(parents=True)
        for path in fleet.audit_files():
            shutil.copy(path, shipped / pod / path.name)
    walked = _verify(shipped, "--keys", str(fleet_env.keys), "--recursive")
    assert walked.returncode == 0 and "4 logs, each its own chain: 4 intact" in walked.stdout, walked.stdout + walked.stderr
    assert "ok: `egresslaw-1/audit.w2.jsonl`" in walked.stdout
    # Without --recursive a directory is read alone: another run's logs below it (here under another audit key)
    # are never judged against this one's key, so they cannot make this run's record look "edited or forged".
    from egress_proxy.custody.keys import init_keys

    other_keys = fleet_env.root / "other-keys"
    init_keys(other_keys)
    run = fleet_env.root / "run"
    run.mkdir()
    for path in fleet.audit_files():
        shutil.copy(path, run / path.name)
    shutil.copytree(shipped / "egresslaw-0", run / "older-run")
    alone = _verify(run, "--keys", str(fleet_env.keys))
    assert alone.returncode == 0 and "2 logs, each its own chain: 2 intact" in alone.stdout, alone.stdout + alone.stderr
    assert "older-run" not in alone.stdout + alone.stderr
    mixed = _verify(run, "--keys", str(other_keys), "--recursive")  # the wrong key for every chain: each one is named
    assert mixed.returncode == 1
    empty = fleet_env.root / "empty-top"
    shutil.copytree(shipped, empty / "below")
    nothing = _verify(empty)
    assert nothing.returncode == 2 and "--recursive" in nothing.stderr, nothing.stderr


def test_audit_verify_names_the_worker_chain_that_was_edited(fleet_env, tls_upstream, pki):
    fleet = FleetProcess(fleet_env, _routing(tls_upstream.port, pki.ca_pem))
    try:
        lease = fleet_env.lease(connection="github")
        for i in range(12):
            _get(fleet, f"/repos/acme/v{i}", lease)
    finally:
        assert fleet.stop() == 0
    second = worker_audit_path(fleet_env.audit, 2)
    lines = second.read_bytes().splitlines()
    target = next(i for i, line in enumerate(lines) if b'"kind":"request"' in line)
    lines[target] = lines[target].replace(b'"allow"', b'"deny"', 1)
    second.write_bytes(b"\n".join(lines) + b"\n")
    broken = _verify(fleet_env.audit, "--keys", str(fleet_env.keys))
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"error: `{second}`: line {target + 1}: its MAC does not verify" in broken.stderr
    assert "2 logs, each its own chain: 1 intact, 0 open, 1 broken" in broken.stderr
    assert f"ok: `{worker_audit_path(fleet_env.audit, 1).name}`" in broken.stdout
    # A whole chain deleted is found too: every worker's run starts by saying how many workers there are.
    second.unlink()
    missing = _verify(fleet_env.audit, "--keys", str(fleet_env.keys))
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert f"error: `{second}`: missing: the chains beside it say their proxy ran 2 workers" in missing.stderr
    assert "2 logs, each its own chain: 1 intact, 0 open, 1 broken" in missing.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_during_start_up_stops_every_process_cleanly(fleet_env, tls_upstream, pki, workers):
    """A stop that arrives while the workers start (an orchestrator's SIGTERM, a test that saw the port open) is
    honoured once they are up: the proxy exits 0, no worker is left running, every audit chain is closed. Before,
    the supervisor installed its handlers only after the start, so SIGTERM killed it and orphaned its workers."""
    for delay in (0.3, 1.0, "first-listen"):
        port, admin = free_port(), free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "egresslaw", "proxy", "--workers", str(workers), "--artifact", str(fleet_env.artifact), "--proof",
             str(fleet_env.proof), "--keys", str(fleet_env.keys), "--store", str(fleet_env.store), "--audit-log", str(fleet_env.audit),
             "--confdir", str(fleet_env.confdir), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
             *_routing(tls_upstream.port, pki.ca_pem)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        if delay == "first-listen":  # the moment the flaky gate test signalled: one worker accepting, the other not yet
            assert wait_for(lambda: _listening(port) or proc.poll() is not None, timeout=180)  # the workers start in 90 s at most
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=180)  # EOF on stderr too: no worker holds it any more
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"still running 60 s after SIGTERM (delay {delay}): {proc.communicate()[1][-3000:]}") from None
        logs = [fleet_env.audit] if workers == 1 else [worker_audit_path(fleet_env.audit, i) for i in range(1, workers + 1)]
        if proc.returncode == -signal.SIGTERM:  # still importing: nothing was opened yet, and nothing is left behind
            assert delay != "first-listen" and not any(log.exists() for log in logs), (delay, err[-3000:])
        else:
            assert proc.returncode == 0, (delay, err[-3000:])
        assert "Traceback" not in err, err
        assert not _listening(port) and not _listening(admin), delay
        for log in logs:
            if log.exists():
                assert _verify(log).returncode == 0, (delay, log, _verify(log).stdout)
                log.unlink()


@pytest.mark.parametrize(("layout", "expected"), [
    ({"cgroup": "0::/kubepods/pod1/c1\n", "files": {"kubepods/pod1/c1/cpu.max": "150000 100000\n", "kubepods/cpu.max": "max 100000\n"}}, 2),
    ({"cgroup": "0::/a/b\n", "files": {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "100000 100000\n"}}, 1),  # a parent's limit binds
    ({"cgroup": "0::/\n", "files": {"cpu.max": "max 100000\n"}}, None),
    ({"cgroup": "4:cpu,cpuacct:/docker/x\n", "files": {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "300000\n",
                                                        "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}}, 3),
    ({"cgroup": "4:cpu,cpuacct:/docker/x\n", "files": {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "-1\n",
                                                        "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}}, None),
])
def test_the_default_worker_count_follows_the_cgroup_cpu_quota(tmp_path, layout, expected):
    """`--workers` defaults to the container's CPU limit (rounded up), not the host's cores: ~100 MB per worker."""
    from egress_proxy.run.supervisor import cgroup_cpu_quota, default_workers

    root = tmp_path / "cgroup"
    for rel, text in layout["files"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self").write_text(layout["cgroup"])
    quota = cgroup_cpu_quota(str(root), str(tmp_path / "self"))
    cores = len(os.sched_getaffinity(0))
    if expected is None:
        assert quota is None and default_workers(str(root), str(tmp_path / "self")) == cores
    else:
        assert quota is not None and math.ceil(quota) == expected and default_workers(str(root), str(tmp_path / "self")) == min(cores, expected)
