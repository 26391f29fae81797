"""`egresslaw proxy --workers N`: N mitmproxy worker processes behind one listen address, and their supervisor.

**Listening: SO_REUSEPORT.** Every worker binds the listen address itself with SO_REUSEPORT and the kernel
spreads new connections over the workers by a hash of each connection's addresses and ports. A listening
socket shared by all workers (the pre-fork model) was the other choice; it loses to this one where it matters
for a proxy: asyncio accepts in batches, so a burst of connections (16 keep-alive clients connecting at once)
lands on whichever worker wakes first and stays there. The supervisor holds a bound, non-listening socket on
the address from pre-flight to exit: it reserves the port (a restarted worker binds beside its peers, and no
other user can take it in between), it never receives a connection (the kernel hands them to listening
sockets only), and a busy address fails the start before any worker runs. The costs: the connections queued
at a worker that dies are reset (Linux >= 5.14 hands them to the other workers with
`net.ipv4.tcp_migrate_req=1`), and another process of the same user could bind beside the workers.

**Start-up fails closed, before anything listens.** Pre-flight in the supervisor (limits, keys, store,
routing options, the CA file, both addresses reserved); the artifact, its proof and the trusted proof key
are copied into a private snapshot that is verified there once and that every worker loads; the mitmproxy
CA is created once (workers starting together would each make their own). Then every worker starts with
its listener bound but not accepting, and confirms. Only when all N have does anything listen: the admin
listener, then each worker's listener. A worker that cannot start stops the others: exit 2.

**Supervision.** A worker that exits is restarted, after 0.5 s doubling to 30 s while restarts keep
failing (reset once a worker has served 30 s); each restart is logged with the exit status and counted
(`egresslaw_worker_restarts_total`). A worker whose supervisor disappears (its control socket closes) drains
and exits. Workers run in their own session: a terminal's Ctrl-C reaches the supervisor only.

**Reload.** SIGHUP to the supervisor, or the artifact file changing, makes a new snapshot that the gate
checks once, in the supervisor. Refused: every worker keeps its artifact and writes the refusal into its
audit log. Accepted: every worker loads exactly that snapshot and checks its digest; one that cannot is
restarted on it, and a worker that starts during a reload is moved to the new snapshot before it serves.
Workers ignore SIGHUP, so no worker can reload on its own.

**Audit: one chain per worker.** Worker i writes `audit.wI.jsonl` beside the configured `--audit-log
audit.jsonl` (its own segments when it rotates; a restarted worker continues its chain). Not a single
writer: every allowed request waits for its decision event to be durable, and a writer process shared over
IPC would add a process hop and a cross-process wake-up to that wait, and funnel N cores through one again.
`egresslaw audit verify` given the directory, or the configured path, walks every worker's chain.

**Metrics and health.** Workers write their counters to prometheus_client's multiprocess files; the
supervisor's `/metrics` merges them (`egress_proxy.run.metrics`). `/readyz` is ready only while every worker
serves and says it is ready (workers report every second and on every change). SIGTERM (or SIGINT) drains
every worker at once (`Edge.shutdown`, `--drain-grace`); a second one stops them at once. SIGUSR1 makes every
worker's audit events so far durable and logs `audit logs flushed` (before a backup, shipping, or verifying
live logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.artifact import load_artifact
from egress_proxy.audit.event import Event
from egress_proxy.audit.verify import WORKER_EVENT, worker_audit_path
from egress_proxy.front.ca import ca_certificate
from egress_proxy.edge.limits import return_large_buffers
from egress_proxy.front.startup import Policy, StartupError, file_stamps, gate
from egress_proxy.run.exporter import ExportCollector, ExporterChild
from egress_proxy.run.metrics import AdminServer, Metrics, WorkerProcesses, admin_token
from egress_proxy.front.startup import bind_error
from egress_proxy.run.server import Edge, EdgeConfig, preflight

log = logging.getLogger("egresslaw.proxy")

WORKER_START_TIMEOUT = 90.0  # importing mitmproxy, opening the store and the audit log, on a loaded machine
RESTART_FIRST = 0.5
RESTART_MAX = 30.0
RESTART_RESET = 30.0  # a worker that served this long starts the backoff afresh
STATUS_EVERY = 1.0  # seconds between a worker's status reports (and at every change)
STATUS_LOST = 15.0  # a worker silent this long is not ready (its event loop is stuck)
MAX_WORKERS = 256
LISTEN_HELP = "free it or choose another with `--listen HOST:PORT` (or EGRESSLAW_LISTEN); `ss -ltnp` shows who holds a port"
ADMIN_HELP = "free it or choose another with `--admin HOST:PORT` (or EGRESSLAW_ADMIN); `ss -ltnp` shows who holds a port"


def default_workers(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The cores this process may use: its CPU affinity, lowered to its cgroup's CPU quota rounded up (a container's
    CPU limit: `--cpus 2` or a Kubernetes `limits.cpu: 2` gives 2 workers on a 64-core host, not 64)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = max(1, os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`,
    the lowest along the path up to the root); None when there is none or it cannot be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2: 0::/path
            base, reader = Path(cgroup_root), _v2_quota
        elif "cpu" in controllers.split(","):  # v1: N:cpu,cpuacct:/path
            base = next((Path(cgroup_root) / d for d in ("cpu,cpuacct", "cpu") if (Path(cgroup_root) / d).is_dir()), None)
            if base is None:
                continue
            reader = _v1_quota
        else:
            continue
        here = base / rel if rel else base
        while True:
            q = reader(here)
            if q is not None:
                found.append(q)
            if here == base or base not in here.parents:
                break
            here = here.parent
    return min(found) if found else None


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


# -- the supervisor's side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Artifact, proof and trusted key as the supervisor read and verified them; what every worker loads."""

    generation: int
    artifact: Path
    proof: Path
    trust: Path | None
    digest: str
    proved: bool
    stamps: tuple  # the configured files' (inode, size, mtime) when they were read: the watcher compares them


@dataclass(eq=False)
class _Slot:
    """One worker position (1..N) and the process currently filling it."""

    index: int
    state: str = "down"  # starting -> started (bound, not accepting) -> serving; stopping; down
    proc: Any = None
    writer: asyncio.StreamWriter | None = None
    generation: int = 0  # the snapshot it serves
    not_ready: list[str] = field(default_factory=list)
    heard: float = 0.0
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = RESTART_FIRST
    audit_ok: bool | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    replies: dict[str, deque] = field(default_factory=dict)
    restart_task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"worker-{self.index}"

    def send(self, message: dict) -> bool:
        if self.writer is None or self.writer.is_closing():
            return False
        try:
            self.writer.write(json.dumps(message).encode() + b"\n")
        except (ConnectionError, RuntimeError):
            return False
        return True

    def expect(self, reply: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.replies.setdefault(reply, deque()).append(future)
        return future

    def answer(self, reply: str, message: dict) -> None:
        waiting = self.replies.get(reply)
        while waiting:
            future = waiting.popleft()
            if not future.done():
                future.set_result(message)
                return

    def fail_waiters(self, error: StartupError) -> None:
        for waiting in self.replies.values():
            while waiting:
                future = waiting.popleft()
                if not future.done():
                    future.set_exception(error)


class Supervisor:
    """Runs and supervises the workers of one proxy; owns the admin listener, reloads and `/metrics`."""

    def __init__(self, config: EdgeConfig, workers: int, *, worker_command: Sequence[str] | None = None,
                 log_options: dict[str, str] | None = None) -> None:

        if not 1 <= workers <= MAX_WORKERS:
            raise StartupError(f"--workers `{workers}` must be from 1 to {MAX_WORKERS}")
        self.config = config
        self.slots = [_Slot(i) for i in range(1, workers + 1)]
        self.command = list(worker_command or [sys.executable, "-m", "egress_proxy.run.supervisor"])
        self.log_options = dict(log_options or {})
        self.metrics = Metrics("supervisor")
        self.exporter: ExporterChild | None = None  # --export-to: ships every worker's chain
        self.run_dir: Path | None = None
        self.snapshot: Snapshot | None = None
        self.listen_addrs: list[tuple[str, int]] = []
        self.admin_addr: tuple[str, int] | None = None
        self.draining = False
        self._admin: Any = None
        self._reserved: socket.socket | None = None
        self._admin_sock: socket.socket | None = None
        self._refused_stamps: tuple | None = None
        self._reload_lock: asyncio.Lock | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stopped: asyncio.Event | None = None
        self._restarts: Any = None
        self._starting = False
        self._stop_asked = False  # a SIGTERM/SIGINT during start-up: honoured the moment the start ends

    # -- start ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Pre-flight, start every worker, then listen; StartupError (exit 2, nothing listening) on any failure."""
        self._reload_lock = asyncio.Lock()
        self._stopped = asyncio.Event()
        self.run_dir = Path(tempfile.mkdtemp(prefix="egresslaw-run-"))
        self._starting = True
        try:
            await self._start()
        except BaseException:
            await self._abort()
            raise
        finally:
            self._starting = False
        if self._stop_asked:
            log.info("a stop signal arrived during start-up; draining now")
            self.shutdown()

    async def _start(self) -> None:
        from prometheus_client import Counter
        from prometheus_client.multiprocess import MultiProcessCollector


        cfg = self.config
        assert self.run_dir is not None
        cfg.limit_options()  # the single process's order: limits, then the policy, then the rest
        self.snapshot = await asyncio.to_thread(self._take_snapshot, 1)
        # limits, keys, store, sealed credentials, routing options, CA file; the policy was checked just above
        preflight(cfg, policy=False, artifact=load_artifact(self.snapshot.artifact.read_bytes()))
        confdir = Path(cfg.confdir).expanduser()
        try:
            confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            ca_certificate(confdir)
            token = admin_token(confdir) if cfg.admin is not None else ""
        except OSError as exc:
            raise StartupError(f"cannot prepare confdir `{confdir}`: {exc.strerror or exc}") from None
        self._reserved = _reserve(cfg.listen, reuse_port=True, what="", help_=LISTEN_HELP)
        host, port = self._reserved.getsockname()[:2]
        self.listen_addrs = [(str(host), int(port))]
        if cfg.admin is not None:
            self._admin_sock = _reserve(cfg.admin, reuse_port=False, what="admin ", help_=ADMIN_HELP)
            self.admin_addr = tuple(self._admin_sock.getsockname()[:2])  # type: ignore[assignment]
        metrics_dir = self.run_dir / "metrics"
        metrics_dir.mkdir(mode=0o700)
        self.metrics_dir = metrics_dir
        MultiProcessCollector(self.metrics.registry, path=str(metrics_dir))
        self.metrics.registry.register(_FleetCollector(self))
        self._restarts = Counter("egresslaw_worker_restarts", "Workers restarted after they exited.", ("worker",), registry=self.metrics.registry)
        for slot in self.slots:
            self._restarts.labels(str(slot.index))
        self.metrics.serving(self.snapshot.digest, self.snapshot.proved)
        results = await asyncio.gather(*(self._launch(slot) for slot in self.slots), return_exceptions=True)
        failed = [(slot, r) for slot, r in zip(self.slots, results) if isinstance(r, BaseException)]
        if failed:
            slot, exc = failed[0]
            if not isinstance(exc, StartupError):
                raise exc
            raise StartupError(f"{slot.name} cannot start: {exc.message}", exc.help)
        if cfg.admin is not None:
            self._admin = AdminServer(self.metrics, token, ready=self.not_ready)
            self.admin_addr = await self._admin.start(*cfg.admin, sock=self._admin_sock)
            self._admin_sock = None  # the server owns it now
        await asyncio.gather(*(self._serve(slot) for slot in self.slots))
        if cfg.export_to:
            self.exporter = ExporterChild(cfg, front="edge")
            self.metrics.registry.register(ExportCollector(self.exporter))
            self.exporter.start()
        if cfg.watch_interval > 0:
            self._spawn_task(self._watch_artifact())

    def _take_snapshot(self, generation: int) -> Snapshot:
        """Copy artifact, proof and trusted key into the run directory and pass them through the gate, once."""
        cfg = self.config
        assert self.run_dir is not None
        stamps = file_stamps(cfg.artifact, cfg.proof)
        sources = [(cfg.artifact, "artifact", "json"), (cfg.proof, "proof", "json")]
        if cfg.trust_proofs:
            sources.append((cfg.trust_proofs, "trust", "pub"))
        try:
            blobs = [Path(src).read_bytes() for src, _, _ in sources]
        except OSError:
            # The gate's own words for a missing or unreadable file (it reads them again and fails the same way).
            gate(cfg)
            raise StartupError(f"cannot read artifact `{cfg.artifact}`, its proof `{cfg.proof}` or the trusted key") from None
        copies = []
        for (_, name, ext), blob in zip(sources, blobs):
            copy = self.run_dir / f"{name}-{generation}.{ext}"
            fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            copies.append(copy)
        trust = copies[2] if cfg.trust_proofs else None
        try:
            policy = gate(cfg, str(copies[0]), str(copies[1]), trust_proofs=str(trust) if trust else None)
        except StartupError as exc:
            raise StartupError(self._unsnap(exc.message), self._unsnap(exc.help) if exc.help else None) from None
        return Snapshot(generation, copies[0], copies[1], trust, policy.artifact.digest, policy.proved, stamps)

    def _unsnap(self, text: str) -> str:
        """A gate message about the snapshot, naming the files the operator configured instead."""
        assert self.run_dir is not None
        out = text
        for name, real in (("artifact", self.config.artifact), ("proof", self.config.proof), ("trust", self.config.trust_proofs)):
            if real:
                out = re.sub(re.escape(str(self.run_dir)) + rf"/{name}-\d+\.(?:json|pub)", lambda _m, real=real: str(real), out)
        return out

    def _worker_config(self, slot: _Slot) -> dict:
        assert self.snapshot is not None
        snap = self.snapshot
        cfg = dataclasses.replace(
            self.config, artifact=str(snap.artifact), proof=str(snap.proof), trust_proofs=str(snap.trust) if snap.trust else None,
            listen=self.listen_addrs[0], admin=None, audit_log=str(worker_audit_path(self.config.audit_log, slot.index)),
            watch_interval=0.0, reuse_port=True, export_to=None, export_headers=None, export_ca=None, export_cert=None, export_key=None,
            export_state=None)  # one exporter, the supervisor's, ships every worker's chain
        return dataclasses.asdict(cfg)

    async def _launch(self, slot: _Slot) -> None:
        """Start one worker and wait until it confirms (bound, not accepting); StartupError if it cannot."""
        assert self.run_dir is not None and self.snapshot is not None
        parent, child = socket.socketpair()
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(self.metrics_dir))
        slot.state, slot.audit_ok, slot.not_ready = "starting", None, []
        slot.exited = asyncio.Event()
        try:
            slot.proc = await asyncio.create_subprocess_exec(
                *self.command, str(child.fileno()), pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as exc:
            parent.close()
            slot.state = "down"
            raise StartupError(f"cannot run a worker process ({exc.strerror or exc})") from None
        finally:
            child.close()
        reader, slot.writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 20)
        slot.generation = self.snapshot.generation
        started = slot.expect("started")
        slot.send({"op": "start", "worker": slot.index, "workers": len(self.slots), "config": self._worker_config(slot), "log": self.log_options,
                   "admin": list(self.admin_addr) if self.admin_addr else None})
        self._spawn_task(self._read(slot, reader))
        try:
            await asyncio.wait_for(started, WORKER_START_TIMEOUT)
        except TimeoutError:
            raise StartupError(f"{slot.name} did not start within {WORKER_START_TIMEOUT:g} s") from None
        slot.state = "started"
        slot.started_at = time.monotonic()
        if slot.generation != self.snapshot.generation:  # a reload happened while it started
            await self._adopt(slot, self.snapshot)

    async def _serve(self, slot: _Slot) -> None:
        serving = slot.expect("serving")
        slot.send({"op": "serve"})
        await asyncio.wait_for(serving, WORKER_START_TIMEOUT)
        slot.state = "serving"
        slot.heard = asyncio.get_running_loop().time()

    async def _read(self, slot: _Slot, reader: asyncio.StreamReader) -> None:
        """Everything a worker says, until its control socket closes; then its exit is handled."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                line = await reader.readline()
            except (ConnectionError, ValueError):
                line = b""
            if not line:
                break
            try:
                message = json.loads(line)
                event = message["ev"]
            except (ValueError, KeyError, TypeError):
                log.error("%s sent something that is not a control message; ignoring it", slot.name)
                continue
            if event == "failed":
                slot.fail_waiters(StartupError(str(message.get("message")), message.get("help")))
            elif event == "status":
                slot.not_ready = [str(w) for w in message.get("not_ready", [])]
                slot.heard = loop.time()
            elif event == "stopped":
                slot.audit_ok = bool(message.get("audit_ok"))
            else:
                slot.answer(event, message)
        code = await slot.proc.wait()
        if slot.writer is not None:
            slot.writer.close()
        slot.fail_waiters(StartupError(f"it exited ({_status(code)}) before it answered"))
        self._exited(slot, code)

    def _exited(self, slot: _Slot, code: int) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        pid = slot.proc.pid if slot.proc is not None else None
        was = slot.state
        slot.state = "down"
        slot.exited.set()
        if pid is not None:
            with contextlib.suppress(OSError):
                mark_process_dead(pid, str(self.metrics_dir))
        if self.draining or was != "serving":
            return  # shutting down, or still starting (whoever starts it handles the failure)
        served = time.monotonic() - slot.started_at
        if served >= RESTART_RESET:
            slot.backoff = RESTART_FIRST
        log.warning("%s (pid %s) exited (%s) after %.1f s; restarting it in %g s", slot.name, pid, _status(code), served, slot.backoff)
        self._schedule_restart(slot)

    def _schedule_restart(self, slot: _Slot) -> None:
        delay = slot.backoff
        slot.backoff = min(RESTART_MAX, slot.backoff * 2)
        slot.restart_task = self._spawn_task(self._restart(slot, delay))

    async def _restart(self, slot: _Slot, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.draining:
            return
        slot.restarts += 1
        self._restarts.labels(str(slot.index)).inc()
        try:
            await self._launch(slot)
            await self._serve(slot)
        except (StartupError, TimeoutError, ConnectionError) as exc:
            message = exc.message if isinstance(exc, StartupError) else exc.__class__.__name__
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.kill()
                await slot.exited.wait()
            if self.draining:
                return
            log.error("%s could not be restarted: %s; trying again in %g s", slot.name, message, slot.backoff)
            self._schedule_restart(slot)
            return
        log.info("%s restarted (pid %s, restart %d)", slot.name, slot.proc.pid, slot.restarts)

    # -- run -----------------------------------------------------------------------------------------

    def not_ready(self) -> list[str]:
        """Why the proxy should get no traffic now (empty: every worker serves and is ready)."""
        now = asyncio.get_running_loop().time()
        why = ["draining"] if self.draining else []
        for slot in self.slots:
            if slot.state != "serving":
                why.append(f"{slot.name}-{slot.state}")
            elif now - slot.heard > STATUS_LOST:
                why.append(f"{slot.name}-unresponsive")
            else:
                why += [f"{slot.name}-{w}" for w in slot.not_ready]
        return why

    def pids(self) -> dict[str, int]:
        """The live workers' process ids, by worker number (and the supervisor's own)."""
        out = {"supervisor": os.getpid()}
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                out[str(slot.index)] = slot.proc.pid
        return out

    def reload(self) -> None:
        """What SIGHUP does: reload in the background (one reload at a time); ignored while the workers start."""
        if self._starting or self.snapshot is None:
            log.warning("SIGHUP during start-up ignored: the workers are loading the artifact as it is now")
            return
        self._spawn_task(self._reload())

    async def _reload(self) -> bool:
        assert self._reload_lock is not None and self.snapshot is not None
        async with self._reload_lock:
            if self.draining:
                return False
            stamps = file_stamps(self.config.artifact, self.config.proof)
            current = self.snapshot
            try:
                snap = await asyncio.to_thread(self._take_snapshot, current.generation + 1)
            except Exception as exc:  # any failure keeps every worker on the current snapshot
                message = exc.message if isinstance(exc, StartupError) else exc.__class__.__name__
                self._refused_stamps = stamps
                log.error("reload refused, still serving artifact `%s` in every worker: %s", current.digest[:12], message)
                self.metrics.reload("failed")
                for slot in self._live():
                    slot.send({"op": "refused", "message": message})
                self._forget_snapshots(current.generation + 1)
                return False
            self._refused_stamps = None
            self.snapshot = snap
            await asyncio.gather(*(self._adopt(slot, snap) for slot in self._live()))
            self.metrics.reload("ok")
            self.metrics.serving(snap.digest, snap.proved)
            log.info("reloaded artifact `%s` (was `%s`) in every worker", snap.digest[:12], current.digest[:12])
            self._forget_snapshots(snap.generation)
            return True

    def _live(self) -> list[_Slot]:
        return [s for s in self.slots if s.state in ("started", "serving")]

    async def _adopt(self, slot: _Slot, snap: Snapshot) -> None:
        """Move one worker to `snap`; a worker that cannot is stopped and restarted (it then starts on `snap`)."""
        reply = slot.expect("adopted")
        if not slot.send({"op": "adopt", "artifact": str(snap.artifact), "digest": snap.digest, "proved": snap.proved,
                          "generation": snap.generation}):
            return
        try:
            answer = await asyncio.wait_for(reply, 30)
        except StartupError:
            return  # it exited meanwhile; it restarts on the current snapshot
        except TimeoutError:
            log.error("%s did not confirm the verified artifact `%s`; restarting it", slot.name, snap.digest[:12])
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.kill()  # it must not go on serving another artifact than its peers
            return
        if answer.get("ok"):
            slot.generation = snap.generation
            return
        # It stops accepting at once and drains; it is restarted on the current snapshot.
        log.error("%s could not load the verified artifact `%s` (%s); restarting it", slot.name, snap.digest[:12], answer.get("message"))

    def _forget_snapshots(self, keep_from: int) -> None:
        """Remove snapshot files no worker can still need (older than the current one and every slot's)."""
        assert self.run_dir is not None and self.snapshot is not None
        needed = {self.snapshot.generation} | {s.generation for s in self.slots}
        for path in self.run_dir.iterdir():
            m = re.fullmatch(r"(?:artifact|proof|trust)-(\d+)\.(?:json|pub)", path.name)
            if m and int(m.group(1)) not in needed and int(m.group(1)) != keep_from:
                with contextlib.suppress(OSError):
                    path.unlink()

    async def _watch_artifact(self) -> None:
        previous = None
        while not self.draining:
            await asyncio.sleep(self.config.watch_interval)
            try:
                stamps = file_stamps(self.config.artifact, self.config.proof)
                previous, settled = stamps, stamps == previous  # as the addon's watcher: act on a file that stopped changing
                assert self.snapshot is not None
                if stamps[0] is None or stamps == self._refused_stamps or stamps[0] == self.snapshot.stamps[0] or not settled:
                    continue
                if self._reload_lock is not None and self._reload_lock.locked():
                    continue
                log.info("artifact file changed; reloading")
                await self._reload()
            except Exception as exc:  # the watcher must never die; a failed reload keeps the old artifact
                log.error("artifact watch failed (%s)", exc.__class__.__name__)

    def flush(self) -> None:
        """What SIGUSR1 does: every worker makes its audit events so far durable; then one log line."""
        self._spawn_task(self._flush())

    async def _flush(self) -> None:
        slots = self._live()
        replies = [slot.expect("flushed") for slot in slots]
        for slot in slots:
            slot.send({"op": "flush"})
        results = await asyncio.gather(*(asyncio.wait_for(r, 30) for r in replies), return_exceptions=True)
        failed = [slot.name for slot, r in zip(slots, results) if isinstance(r, BaseException) or not r.get("ok")]
        if failed:
            log.error("audit logs flushed in %d worker(s); not in %s", len(slots) - len(failed), ", ".join(failed))
        else:
            log.info("audit logs flushed (%d workers)", len(slots))

    # -- stop ----------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """What SIGTERM and SIGINT do: every worker drains (stops accepting, finishes what is in flight within
        `--drain-grace`, closes its audit log); a second signal stops them at once. A signal during start-up
        is kept and honoured as soon as the start ends (its workers bounded by WORKER_START_TIMEOUT)."""
        if self._starting:
            self._stop_asked = True
            return
        if self.draining:
            for slot in self.slots:
                slot.send({"op": "stop"})
            return
        self.draining = True
        if self._reserved is not None:
            self._reserved.close()  # the port is free once every worker has closed its listener
            self._reserved = None
        for slot in self.slots:
            if slot.restart_task is not None and not slot.restart_task.done():
                slot.restart_task.cancel()  # a worker it already started is drained below, like the others
            if slot.proc is not None and slot.proc.returncode is None:
                slot.state = "stopping"
                slot.send({"op": "drain"})
        self._spawn_task(self._wait_stopped())

    async def _wait_stopped(self) -> None:
        grace = self.config.drain_grace + 30  # drain, then the master's own stop and the audit log's close
        for slot in self.slots:
            if slot.proc is None or slot.proc.returncode is not None:
                continue
            try:
                await asyncio.wait_for(slot.exited.wait(), grace)
            except TimeoutError:
                log.error("%s did not stop within %g s; killing it", slot.name, grace)
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.kill()
                await slot.exited.wait()
        assert self._stopped is not None
        self._stopped.set()

    async def wait(self) -> int:
        """Until every worker has stopped (after `shutdown()`); 0 when every worker closed its audit log cleanly."""
        assert self._stopped is not None
        await self._stopped.wait()
        await self._close()
        if self.exporter is not None:  # every worker's chain closed: the exporter ships the last lines
            await self.exporter.stop()
        unclean = [s.name for s in self.slots if not s.audit_ok]
        if unclean:
            log.error("egresslaw proxy stopped, but the audit log of %s was not closed cleanly", ", ".join(unclean))
            return 1
        return 0

    async def _abort(self) -> None:
        """A failed start: stop every worker that started, release everything; nothing is left listening."""
        self.draining = True
        for slot in self.slots:
            slot.send({"op": "stop"})
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                try:
                    await asyncio.wait_for(slot.exited.wait(), 30)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()
                    await slot.exited.wait()
        await self._close()

    async def _close(self) -> None:
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        if self._admin is not None:
            await self._admin.stop()
            self._admin = None
        for sock in (self._reserved, self._admin_sock):
            if sock is not None:
                sock.close()
        self._reserved = self._admin_sock = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class _FleetCollector:
    """`egresslaw_workers{state}` and every live worker's process metrics, computed at each scrape."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily


        states = GaugeMetricFamily("egresslaw_workers", "Worker processes by state (serving, started, starting, stopping, down).",
                                   labels=("state",))
        counts = {state: 0 for state in ("serving", "started", "starting", "stopping", "down")}
        for slot in self._supervisor.slots:
            counts[slot.state] = counts.get(slot.state, 0) + 1
        for state, n in counts.items():
            states.add_metric((state,), n)
        yield states
        yield from WorkerProcesses(self._supervisor.pids).collect()


def _status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def _reserve(address: tuple[str, int], *, reuse_port: bool, what: str, help_: str) -> socket.socket:
    """A bound, non-listening socket on `address` (it holds the port and receives nothing); StartupError if busy."""
    host, port = address
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise StartupError(f"cannot listen on {what}address `{host}:{port}`: {getattr(exc, 'strerror', None) or exc}", help_) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        if what:
            raise StartupError(f"cannot listen on {what}address `{host}:{port}`: {bind_error(address)}", help_) from None
        raise StartupError(f"cannot listen on `{host}:{port}`: {bind_error(address)}", help_) from None
    return sock


# -- the worker's side -------------------------------------------------------------------------------


def _edge_config(fields: dict) -> EdgeConfig:
    """An EdgeConfig from its JSON form (lists back to tuples, as the dataclass declares them)."""
    out = {}
    for key, value in fields.items():
        out[key] = tuple(value) if isinstance(value, list) else value
    return EdgeConfig(**out)


async def run_worker(fd: int, setup_logging: Callable[[dict, int], None] | None = None) -> int:
    """One worker: start an Edge (bound, not accepting) from the supervisor's configuration, confirm, serve on
    its word, follow its orders (adopt, refused, flush, drain, stop); exit code 0 when the audit log closed cleanly."""

    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd), limit=1 << 20)

    def say(message: dict) -> None:
        if not writer.is_closing():
            writer.write(json.dumps(message).encode() + b"\n")

    first = json.loads(await reader.readline() or b"{}")
    index = int(first.get("worker", 0))
    if setup_logging is not None:
        setup_logging(first.get("log") or {}, index)
    config = _edge_config(first["config"])
    edge = Edge(config, metrics=Metrics("worker"))
    loop.add_signal_handler(signal.SIGTERM, edge.shutdown)
    loop.add_signal_handler(signal.SIGINT, edge.shutdown)
    loop.add_signal_handler(signal.SIGHUP, lambda: log.warning("SIGHUP ignored: reloads go through the supervisor (send it SIGHUP)"))
    loop.add_signal_handler(signal.SIGUSR1, lambda: edge.addon.audit is not None and asyncio.ensure_future(asyncio.to_thread(edge.addon.audit.flush)))
    try:
        await edge.start(serve=False)
    except StartupError as exc:
        say({"ev": "failed", "message": exc.message, "help": exc.help})
        await writer.drain()
        return 2
    except Exception as exc:  # never a traceback: the supervisor reports it and exits 2
        say({"ev": "failed", "message": f"internal error while starting ({exc.__class__.__name__})"})
        await writer.drain()
        return 2
    if first.get("admin"):
        edge.addon.own_addresses.add((str(first["admin"][0]), int(first["admin"][1])))
    if edge.addon.audit is not None:  # the first event of each run: which chains make the whole record (verify_logs)
        edge.addon.audit.emit(Event.of({"kind": WORKER_EVENT, "decision": "info", "reason": "started", "worker": index,
                                        "workers": int(first.get("workers", 0)), "pid": os.getpid()}))
    say({"ev": "started", "pid": os.getpid()})
    code = {"value": 0}

    async def status() -> None:
        last, sent = None, 0.0
        while True:
            why = edge.not_ready()
            if why != last or loop.time() - sent >= STATUS_EVERY:
                say({"ev": "status", "not_ready": why})
                last, sent = why, loop.time()
            await asyncio.sleep(0.25)

    async def adopt(message: dict) -> None:
        try:
            data = await asyncio.to_thread(Path(message["artifact"]).read_bytes)
            artifact = load_artifact(data)
            if artifact.digest != message["digest"]:
                raise ValueError("digest differs from the verified one")
            st = Path(message["artifact"]).stat()
            edge.addon.adopt(Policy(artifact, bool(message["proved"]), message["artifact"], (st.st_ino, st.st_size, st.st_mtime_ns)))
        except Exception as exc:
            say({"ev": "adopted", "ok": False, "message": exc.__class__.__name__})
            code["value"] = 3
            edge.shutdown()
            return
        log.debug("now serving artifact `%s`", artifact.digest[:12])
        say({"ev": "adopted", "ok": True})

    async def flush() -> None:
        audit = edge.addon.audit
        ok = await asyncio.to_thread(audit.flush) if audit is not None else False
        say({"ev": "flushed", "ok": ok})

    async def orders() -> None:
        while True:
            line = await reader.readline()
            if not line:
                log.warning("the supervisor is gone; draining")
                edge.shutdown()
                return
            message = json.loads(line)
            op = message.get("op")
            if op == "serve":
                await edge.serve()
                say({"ev": "serving"})
            elif op == "adopt":
                await adopt(message)
            elif op == "refused":
                edge.addon.reload_refused(str(message.get("message")))
            elif op == "flush":
                asyncio.ensure_future(flush())
            elif op == "drain":
                edge.shutdown()
            elif op == "stop":
                edge.shutdown()
                edge.shutdown()  # the second call stops at once

    tasks = [asyncio.ensure_future(status()), asyncio.ensure_future(orders())]
    try:
        await edge.wait()
    finally:
        for task in tasks:
            task.cancel()
        await edge.stop()
    audit = edge.addon.audit
    ok = audit is not None and bool(audit.close_ok)
    say({"ev": "stopped", "audit_ok": ok})
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()
    return code["value"] or (0 if ok else 1)


def _basic_logging(options: dict, index: int) -> None:
    logging.basicConfig(level=getattr(logging, str(options.get("level", "info")).upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s %(name)s (worker {index}): %(message)s")


def main(argv: Sequence[str] | None = None, setup_logging: Callable[[dict, int], None] | None = None) -> int:
    """`python -m egress_proxy.run.supervisor FD`: a worker process (its supervisor starts it; FD is its control socket)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        sys.stderr.write("usage: python -m egress_proxy.run.supervisor FD (started by `egresslaw proxy --workers N`)\n")
        return 2
    return_large_buffers()  # as the single process does (egresslaw/commands/proxy.py)
    return asyncio.run(run_worker(int(args[0]), setup_logging or _basic_logging))


if __name__ == "__main__":
    sys.exit(main())
