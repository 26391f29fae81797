"""The audit log under faults, against the real proxy: a full disk, SIGTERM and kill -9 under load, a client
that leaves while its name is resolved, a refused reload, the health endpoints, and the write-ahead in both
sync modes (an upstream that reads the audit log at the moment a request reaches it).

Each test compares the set of requests that reached the upstream (the loopback upstream records every path;
each request here has a path of its own) with the set of events in the audit log: nothing reaches the upstream
without its decision event written first, and every answer a client got has its event.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from egress_proxy.audit.log import OWN_KINDS, AuditLog, segment_files, verify
from egress_proxy.custody.keys import load_audit_key
from tests.conformance.wire import open_socket, read_answer
from tests.proxy_harness import (
    ScriptedResolver,
    build_artifact,
    free_port,
    make_env,
    proof_signing_key,
    settle,
    start_proxy,
    start_upstream,
    stop_proxy,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API = "api.acme-test.dev"


# -- a proxy process, and load on it ----------------------------------------------------------------


class Proc:
    """`egresslaw proxy` as a child process (stderr to a file: a full pipe would block it)."""

    def __init__(self, env, tls_upstream, pki, audit_log: Path, *extra: str) -> None:
        self.env, self.audit, self.port, self.admin = env, audit_log, free_port(), free_port()
        self.stderr_path = env.root / f"proxy-{self.port}.err"
        args = [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof),
                "--keys", str(env.keys), "--store", str(env.store), "--listen", f"127.0.0.1:{self.port}",
                "--admin", f"127.0.0.1:{self.admin}", "--confdir", str(env.confdir), "--audit-log", str(audit_log), "--workers", "1",
                "--resolve", f"{API}=93.184.216.34", "--connect-to", f"{API}:443:127.0.0.1:{tls_upstream.port}",
                "--upstream-ca", str(pki.ca_pem), *extra]  # fmt: skip
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 30
        while not _listening(self.port):
            assert self.proc.poll() is None and time.time() < deadline, self.stderr()
            time.sleep(0.05)
        self.lease = env.lease(connection="github", ttl=3600)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def get(self, path: str) -> tuple[int | None, str | None]:
        with open_socket("127.0.0.1", self.port, 10) as sock:
            sock.sendall(_wire(path, self.lease))
            answer = read_answer(sock)
        return answer.status, answer.header("x-egresslaw-deny")

    def admin_get(self, path: str) -> tuple[int, str]:
        with socket.create_connection(("127.0.0.1", self.admin), timeout=5) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: admin\r\n\r\n".encode())
            answer = read_answer(sock)
        return answer.status, answer.body.decode()

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(30)


def _wire(path: str, lease: str) -> bytes:
    return (f"GET https://{API}{path} HTTP/1.1\r\nHost: {API}\r\nAccept: application/json\r\n"
            f"Proxy-Authorization: Bearer {lease}\r\n\r\n").encode()


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


class Load:
    """Threads sending keep-alive requests, each to a path of its own: every fourth is denied (`/admin/…`)."""

    def __init__(self, proc: Proc, tag: str, threads: int = 4) -> None:
        self.proc, self.tag = proc, tag
        self.answers: list[tuple[str, int | None, str | None]] = []  # (path, status, deny reason)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(30)

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def _run(self, index: int) -> None:
        sock, n = None, 0
        while not self.stopping.is_set():
            n += 1
            path = f"/{'admin' if n % 4 == 0 else 'repos/acme'}/{self.tag}-{index}-{n}"
            try:
                if sock is None:
                    sock = open_socket("127.0.0.1", self.proc.port, 10)
                sock.sendall(_wire(path, self.proc.lease))
                answer = read_answer(sock)
            except OSError:
                answer = None
            status = answer.status if answer is not None else None
            with self._lock:
                self.answers.append((path, status, answer.header("x-egresslaw-deny") if status else None))
            if status is None or (answer.header("connection") or "").lower() == "close":
                with contextlib.suppress(OSError, AttributeError):
                    sock.close()
                sock = None
                if status is None:
                    time.sleep(0.02)


def _events(audit_log: Path) -> list[dict]:
    """Every complete line of every segment of the log, in order (the log's own records left out)."""
    out = []
    for path, _ in segment_files(audit_log.parent):
        data = path.read_bytes()
        out += [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]
    return [e for e in out if e["kind"] not in OWN_KINDS]


def _upstream_paths(upstream, tag: str) -> set[str]:
    return {s.path for s in upstream.raw_requests() if f"/{tag}-" in s.path}


def _check_against_the_log(events: list[dict], load_answers, reached: set[str], *, outcomes_required: bool, may_lose: int = 0) -> dict:
    """The comparisons every test here makes; returns the decided requests by path. `may_lose`: how many answered
    requests may have no event (kill -9: the batch in flight, at most one request per client thread)."""
    by_path = {v["path"]: v for v in settle(events) if v["kind"] == "request"}
    assert len(by_path) == sum(1 for e in events if e["kind"] == "request"), "two events for one request"
    allowed = {p for p, v in by_path.items() if v["decision"] == "allow"}
    # Nothing reached the upstream without its allow decision in the log.
    assert reached <= allowed, sorted(reached - allowed)[:5]
    lost = [(p, s) for p, s, _ in load_answers if s is not None and p not in by_path]
    assert len(lost) <= may_lose and not any(s == 200 or p in reached for p, s in lost), lost  # and none was forwarded
    for path, status, told in load_answers:
        if status is None or path not in by_path:
            continue  # no answer, or lost as allowed above
        view = by_path[path]
        if status == 200:
            assert view["decision"] == "allow" and path in reached, (path, view)
        else:
            assert view["told"] == told, (path, status, told, view)
        if outcomes_required and view["decision"] == "allow":
            assert view["outcome"] is not None and view["status"] == status, (path, status, view)
    return by_path


# -- SIGTERM and kill -9 under load ---------------------------------------------------------------


def test_sigterm_under_load_drains_and_every_answer_has_its_event(tmp_path, tls_upstream, pki):
    env = make_env(tmp_path / "env")
    audit_log = tmp_path / "logs" / "audit.jsonl"
    proc = Proc(env, tls_upstream, pki, audit_log, "--drain-grace", "5")
    with Load(proc, "term") as load:
        deadline = time.time() + 120  # the loop ends at the count; the deadline only bounds a loaded machine's pace
        while load.count() < 150 and time.time() < deadline:
            time.sleep(0.05)
        assert proc.stop() == 0, proc.stderr()
    answers = load.answers
    assert sum(1 for _, s, _ in answers if s == 200) >= 50, answers[-5:]
    events = _events(audit_log)
    _check_against_the_log(events, answers, _upstream_paths(tls_upstream, "term"), outcomes_required=True)
    # Drained, then closed by a signed checkpoint; every line verifies under the key.
    assert verify(audit_log.parent, key=load_audit_key(env.keys)).status == "intact"
    assert "audit log flushed and closed by a signed checkpoint" in proc.stderr()


def test_kill_9_under_load_loses_at_most_the_batch_in_flight_and_never_a_forwarded_request(tmp_path, tls_upstream, pki):
    env = make_env(tmp_path / "env")
    audit_log = tmp_path / "logs" / "audit.jsonl"
    proc = Proc(env, tls_upstream, pki, audit_log)
    with Load(proc, "kill") as load:
        deadline = time.time() + 20
        while load.count() < 150 and time.time() < deadline:
            time.sleep(0.05)
        proc.stop(signal.SIGKILL)
    reached = _upstream_paths(tls_upstream, "kill")
    events = _events(audit_log)
    # What was lost can only be the batch in flight, and nothing of it was forwarded (its allows were not yet
    # written, so they waited); outcomes of forwarded requests may be lost, never their decision.
    _check_against_the_log(events, load.answers, reached, outcomes_required=False, may_lose=4)
    key = load_audit_key(env.keys)
    assert verify(audit_log.parent, key=key).status == "open"  # every line checks; no closing checkpoint
    # The next start cuts a torn line if there is one, records that the run before was not closed, and goes on.
    AuditLog(audit_log, key).close()
    result = verify(audit_log.parent, key=key)
    assert result.status == "intact" and any("was not closed" in n for n in result.notes), result


# -- the write-ahead, as the upstream sees it -----------------------------------------------------------------


class ReadsTheLog(list):
    """Stands in for an upstream's list of the requests it received: at the moment each request arrives (before it
    is answered), it reads the audit log and notes whether that request's allow decision is already in the file,
    and what `also()` says (e.g. whether an fsync had completed)."""

    def __init__(self, audit_log: Path, also=lambda: None) -> None:
        super().__init__()
        self.audit_log, self.also = audit_log, also
        self.at_arrival: dict[str, tuple[bool, object]] = {}

    def append(self, seen) -> None:
        needle = b'"path":' + json.dumps(seen.path).encode()
        line = next((x for x in self.audit_log.read_bytes().splitlines() if needle in x), b"")
        self.at_arrival[seen.path] = (b'"kind":"request"' in line and b'"decision":"allow"' in line, self.also())
        super().append(seen)


def test_default_sync_every_forwarded_request_has_its_decision_in_the_file_when_the_upstream_sees_it(tmp_path, pki):
    """The default (`--audit-sync 1`): no request waits for an fsync, yet none reaches the upstream before its decision
    event is written to the file (so a proxy killed right then still leaves it), under load from four clients."""
    env = make_env(tmp_path / "env")
    audit_log = tmp_path / "logs" / "audit.jsonl"
    upstream = start_upstream(pki)
    try:
        upstream.requests = probe = ReadsTheLog(audit_log)
        proc = Proc(env, upstream, pki, audit_log)  # no --audit-sync flag: the default
        with Load(proc, "ahead") as load:
            deadline = time.time() + 120  # the loop ends at the count; the deadline only bounds a loaded machine's pace
            while load.count() < 200 and time.time() < deadline:
                time.sleep(0.05)
        assert proc.stop() == 0, proc.stderr()
    finally:
        upstream.stop()
    arrived = {p: v for p, v in probe.at_arrival.items() if "/ahead-" in p}
    assert len(arrived) >= 100
    assert [p for p, (logged, _) in arrived.items() if not logged] == []
    _check_against_the_log(_events(audit_log), load.answers, set(arrived), outcomes_required=True)
    assert verify(audit_log.parent, key=load_audit_key(env.keys)).status == "intact"


@pytest.mark.parametrize("sync", ["request", "1"])
def test_per_request_sync_forwards_only_after_the_fsync_and_the_default_does_not_wait_for_it(tmp_path, pki, sync):
    """Every fsync is held at a gate. `--audit-sync request`: the request reaches the upstream only after an fsync
    covering its decision returned. `--audit-sync 1`: it is answered while the gate is still closed. In both, its
    decision event is in the file when the upstream sees it."""
    env = make_env(tmp_path / "env", build_artifact())
    upstream, plain = start_upstream(pki), start_upstream(None)
    proxy = start_proxy(env, pki, (upstream, plain), [f"{API}:443:127.0.0.1:{upstream.port}"], listen=free_port(),
                        config={"audit_sync": sync})
    audit = proxy.addon.audit
    gate, entered, synced = threading.Event(), threading.Event(), threading.Event()
    real = audit._os_fsync

    def gated(fd):
        entered.set()
        gate.wait(30)
        real(fd)
        synced.set()

    try:
        assert audit.sync_requests is (sync == "request")
        assert audit.flush()  # everything before this test is durable: the next fsync is the one for our request
        upstream.requests = probe = ReadsTheLog(env.audit, also=synced.is_set)
        audit._os_fsync = gated
        lease = proxy.lease(connection="github")
        if sync == "request":
            answer: list = []
            client = threading.Thread(target=lambda: answer.append(_get(proxy, "/repos/acme/gated", lease)[:2]))
            client.start()
            assert entered.wait(30)  # its decision is appended and its fsync has started: it waits for that
            time.sleep(0.3)  # (time for a proxy that did not wait to forward it: the probe would then say so)
            gate.set()
            client.join(30)
            assert answer == [(200, None)]
            assert probe.at_arrival["/repos/acme/gated"] == (True, True)  # in the file, and fsync'd, on arrival
        else:
            assert _get(proxy, "/repos/acme/gated", lease)[:2] == (200, None)  # answered with every fsync held
            assert not synced.is_set()
            assert probe.at_arrival["/repos/acme/gated"] == (True, False)  # in the file on arrival, not yet fsync'd
    finally:
        gate.set()
        stop_proxy(proxy)
        upstream.stop()
        plain.stop()
    assert synced.is_set()  # the interval's fsync came (at the latest when the log was closed)
    assert verify(env.audit, key=load_audit_key(env.keys)).status == "intact"


# -- a full disk ----------------------------------------------------------------------------------


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True)
    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True).returncode == 0


@pytest.mark.parametrize("disk", ["rlimit", "tmpfs"])
def test_a_full_disk_fails_closed_with_503_and_recovers_by_itself(tmp_path, tls_upstream, pki, disk):
    """The audit log's file system fills up: allowed requests get 503 `audit-unavailable` and nothing goes upstream,
    `/readyz` says why, one ERROR line; once there is room again it serves by itself and the held events are written.

    `tmpfs`: the log on a 256 KiB tmpfs that a filler file fills (needs `mount`, so root; skipped otherwise).
    `rlimit`: RLIMIT_FSIZE on the proxy process, lowered and raised from outside with prlimit (always runs)."""
    env = make_env(tmp_path / "env")
    if disk == "tmpfs":
        logs = tmp_path / "small"
        if not _mount_tmpfs(logs, "256k"):
            pytest.skip("cannot mount a tmpfs here; the rlimit variant covers a full disk")
    else:
        logs = tmp_path / "logs"
    audit_log = logs / "audit.jsonl"
    filler = logs / "filler"
    try:
        proc = Proc(env, tls_upstream, pki, audit_log)
        room = 24 * 1024
        if disk == "tmpfs":
            st = os.statvfs(logs)
            with open(filler, "wb") as fh:
                fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - room))
        else:
            resource.prlimit(proc.proc.pid, resource.RLIMIT_FSIZE, (audit_log.stat().st_size + room, resource.RLIM_INFINITY))
        answers, first_503 = [], None
        for n in range(400):
            path = f"/repos/acme/full-{disk}-{n}"
            status, told = proc.get(path)
            answers.append((path, status, told))
            if status == 503:
                first_503 = n
                break
        assert first_503 is not None and answers[-1][2] == "audit-unavailable", answers[-3:]
        mark = len(_upstream_paths(tls_upstream, f"full-{disk}"))
        for n in range(first_503 + 1, first_503 + 21):  # while full: every allow refused, nothing forwarded
            path = f"/repos/acme/full-{disk}-{n}"
            answers.append((path, *proc.get(path)))
            assert answers[-1][1:] == (503, "audit-unavailable"), answers[-1]
        denied = f"/admin/full-{disk}"
        answers.append((denied, *proc.get(denied)))
        assert answers[-1][1:] == (403, "path-not-allowed")  # a denial needs nothing written first
        assert len(_upstream_paths(tls_upstream, f"full-{disk}")) == mark
        assert proc.admin_get("/readyz") == (503, "not ready: audit-unwritable\n")
        assert proc.admin_get("/healthz") == (200, "ok\n")
        # Room again: it recovers by itself.
        if disk == "tmpfs":
            filler.unlink()
        else:
            resource.prlimit(proc.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        deadline, n = time.time() + 15, 1000
        while True:
            n += 1
            path = f"/repos/acme/full-{disk}-{n}"
            answers.append((path, *proc.get(path)))
            if answers[-1][1] == 200 or time.time() > deadline:
                break
            time.sleep(0.1)
        assert answers[-1][1] == 200, answers[-3:]
        assert proc.admin_get("/readyz") == (200, "ready\n")
        assert proc.stop() == 0, proc.stderr()
        err = proc.stderr()
        assert err.count("cannot write audit log") == 1, err  # logged once, not per request or retry
        assert err.count("is writable again") == 1, err
        events = _events(audit_log)
        _check_against_the_log(events, answers, _upstream_paths(tls_upstream, f"full-{disk}"), outcomes_required=True)
        assert verify(audit_log.parent, key=load_audit_key(env.keys)).status == "intact"
        resumed = [r for r in map(json.loads, audit_log.read_bytes().splitlines()) if r["kind"] == "audit-resumed"]
        assert len(resumed) == 1 and resumed[0]["held"] >= 21 and resumed[0]["dropped"] == 0
    finally:
        with contextlib.suppress(Exception):
            proc.stop(signal.SIGKILL)
        if disk == "tmpfs":
            subprocess.run(["umount", str(logs)], capture_output=True)


# -- in-process: the DNS race, the refused reload, health --------------------------------------------


@pytest.fixture
def live(tmp_path, pki, tls_upstream, http_upstream):
    env = make_env(tmp_path / "env", build_artifact())
    listen = free_port()
    routes = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in (API, "other.acme-test.dev")]
    proxy = start_proxy(env, pki, (tls_upstream, http_upstream), routes, resolver=ScriptedResolver(), listen=listen, watch_interval=0.05)
    yield proxy
    stop_proxy(proxy)


class GatedResolver(ScriptedResolver):
    """Holds every lookup of `other.acme-test.dev` until the test opens the gate (no timing involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.waiting = threading.Event()

    async def __call__(self, host: str, port: int):
        import asyncio

        if host == "other.acme-test.dev":
            self.waiting.set()
            await asyncio.to_thread(self.gate.wait, 60)
        return await super().__call__(host, port)


def test_drain_stops_accepting_refuses_new_requests_and_lets_the_one_in_flight_finish(tmp_path, pki, tls_upstream, http_upstream):
    import asyncio

    env = make_env(tmp_path / "env", build_artifact())
    routes = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in (API, "other.acme-test.dev")]
    resolver = GatedResolver()
    proxy = start_proxy(env, pki, (tls_upstream, http_upstream), routes, resolver=resolver, listen=free_port(), drain_grace=60)
    try:
        proxy.addon.resolve_timeout = 60
        lease = proxy.lease(connection="github")
        mark = proxy.mark()
        idle = open_socket(proxy.host, proxy.port)  # a keep-alive connection, open before the drain
        idle.sendall(_wire("/repos/acme/before", lease))
        assert read_answer(idle).status == 200
        busy = open_socket(proxy.host, proxy.port)  # a request in flight (held in its name lookup) when the drain starts
        busy.sendall(_wire("/inflight", lease).replace(API.encode(), b"other.acme-test.dev"))
        assert resolver.waiting.wait(30)
        edge = proxy.threaded.edge
        drained = asyncio.run_coroutine_threadsafe(edge.drain(), proxy.threaded.loop)
        deadline = time.time() + 30
        while _listening(proxy.port) and time.time() < deadline:
            time.sleep(0.05)
        assert not _listening(proxy.port)  # stopped accepting
        assert _admin(proxy, "/readyz") == (503, "not ready: draining\n")
        idle.sendall(_wire("/repos/acme/after", lease))
        late = read_answer(idle)
        assert (late.status, late.header("x-egresslaw-deny"), late.header("connection")) == (503, "draining", "close")
        assert not drained.done()  # still waiting for the request in flight
        resolver.gate.set()
        answer = read_answer(busy)
        assert answer.status == 200  # decided before the drain: it finishes
        drained.result(30)
        busy.close()
        idle.close()
    finally:
        resolver.gate.set()
        stop_proxy(proxy)
    decided = {v["path"]: (v["decision"], v["told"], v["status"]) for v in settle(_events(env.audit))}
    assert decided == {"/repos/acme/before": ("allow", "allowed", 200), "/inflight": ("allow", "allowed", 200),
                       "/repos/acme/after": ("deny", "draining", 503)}
    assert _upstream_paths_all(tls_upstream, mark) == {"/repos/acme/before", "/inflight"}
    assert verify(env.audit, key=load_audit_key(env.keys)).status == "intact"


def _upstream_paths_all(upstream, mark) -> set[str]:
    return {s.path for s in upstream.raw_requests()[mark[1][0][2]:]}


def test_a_keys_directory_without_the_audit_key_is_refused_at_start(tmp_path):
    from egress_proxy.front.startup import StartupError
    from egress_proxy.run.server import EdgeConfig, preflight

    env = make_env(tmp_path / "env")
    (env.keys / "audit.key").unlink()
    config = EdgeConfig(artifact=str(env.artifact), proof=str(env.proof), keys=str(env.keys), store=str(env.store), audit_log=str(env.audit),
                        trust_proofs=str(proof_signing_key()[1]))
    with pytest.raises(StartupError, match="audit.key` does not exist") as refused:
        preflight(config)
    assert "egresslaw keys add-audit-key --dir" in refused.value.help


def test_a_client_that_leaves_while_its_name_is_resolved_leaves_no_state(live):
    live.resolver.delay["other.acme-test.dev"] = 1.0
    mark = live.mark()
    lease = live.lease(connection="github")
    for i in range(10):
        with open_socket(live.host, live.port) as sock:
            if i % 2:
                sock.sendall(f"CONNECT other.acme-test.dev:443 HTTP/1.1\r\nHost: other.acme-test.dev:443\r\n"
                             f"Proxy-Authorization: Bearer {lease}\r\n\r\n".encode())
            else:
                sock.sendall(_wire(f"/race-{i}", lease).replace(API.encode(), b"other.acme-test.dev"))
            time.sleep(0.05)  # the proxy is now waiting for the resolver; the client leaves
    addon = live.addon
    deadline = time.time() + 15
    while (live.resolver.calls.get("other.acme-test.dev", 0) < 10 or addon.in_flight()) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.2)  # every stalled lookup has answered by now
    assert live.resolver.calls.get("other.acme-test.dev", 0) == 10
    state = live.threaded.call(lambda: (dict(addon._clients), addon.in_flight()))
    assert state == ({}, 0)
    decided = live.settled(mark)
    assert sorted(v["kind"] for v in decided) == ["connect"] * 5 + ["request"] * 5
    assert all((v["decision"], v["reason"]) == ("deny", "client-disconnected") for v in decided), decided
    assert live.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]


def test_a_refused_reload_waits_for_the_artifact_or_its_proof_to_change(live):
    from tests.egress_proxy import builders as b
    from tests.proxy_harness import proof_for

    addon, metrics = live.addon, live.threaded.edge.metrics
    checks = []
    real = addon.artifact_changed
    addon.artifact_changed = lambda: (checks.append(1), real())[1]
    new = build_artifact([b.rule("extra", API, "/extra", ["GET"])])
    live.env.artifact.write_text(new.to_json())  # no proof for it: refused
    deadline = time.time() + 15
    while len(checks) < 20 and time.time() < deadline:  # the watcher looked at least 20 times
        time.sleep(0.05)
    assert len(checks) >= 20
    assert metrics.reloads.get("failed", 0) == 1
    assert sum("reload refused" in line for line in live.logs.lines) == 1
    assert [e["reason"] for e in live.events() if e["kind"] == "reload"] == ["reload-failed"]
    live.env.proof.write_text(proof_for(new))  # its proof arrives: the next look reloads
    deadline = time.time() + 15
    while metrics.reloads.get("ok", 0) == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert metrics.reloads.get("ok", 0) == 1 and live.addon.policy.artifact.digest == new.digest


def _admin(live, path: str, token: str | None = None) -> tuple[int, str]:
    host, port = live.threaded.edge.admin_addr
    with socket.create_connection((host, port), timeout=5) as sock:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: admin\r\n{auth}\r\n".encode())
        answer = read_answer(sock)
    return answer.status, answer.body.decode()


def _get(live, path: str, lease: str):
    with open_socket(live.host, live.port) as sock:
        sock.sendall(_wire(path, lease))
        answer = read_answer(sock)
    return answer.status, answer.header("x-egresslaw-deny"), answer.body


def test_health_endpoints_and_an_injected_failing_writer(live):
    assert _admin(live, "/healthz") == (200, "ok\n")
    assert _admin(live, "/readyz") == (200, "ready\n")
    assert _admin(live, "/metrics")[0] == 401  # the metrics keep their token
    audit = live.addon.audit
    real = audit._os_write

    def full(fd, data):
        raise OSError(28, "No space left on device")

    mark = live.mark()
    lease = live.lease(connection="github")
    audit._os_write = full
    try:
        assert _get(live, "/repos/acme/held", lease)[:2] == (503, "audit-unavailable")
        deadline = time.time() + 10
        while audit.writable and time.time() < deadline:
            time.sleep(0.05)
        assert _admin(live, "/readyz") == (503, "not ready: audit-unwritable\n")
        status, told, body = _get(live, "/repos/acme/refused", lease)
        assert (status, told) == (503, "audit-unavailable")
        assert json.loads(body) == {"error": "egress_denied", "reason": "audit-unavailable", "rule": None}
        assert live.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    finally:
        audit._os_write = real
    assert audit.flush(10)
    assert _admin(live, "/readyz") == (200, "ready\n")
    told = {v["path"]: (v["decision"], v["told"], v["status"]) for v in live.settled(mark)}
    assert told == {"/repos/acme/held": ("allow", "audit-unavailable", 503), "/repos/acme/refused": ("deny", "audit-unavailable", 503)}
