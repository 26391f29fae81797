"""Prometheus metrics (`prometheus_client`), served on a separate admin listener that requires a bearer token.

The token lives in `<confdir>/admin.token` (created 0600 with 32 random bytes, hex, on first
start; never logged). Scrapers send `Authorization: Bearer <token>`; anything else gets 401.
`GET /metrics` needs the token; `GET /healthz` (the process serves: 200) and `GET /readyz` (200 when the
artifact is loaded, custody is open, the audit log is writable and the proxy is not draining; 503 with
the short reason codes otherwise) need none and say nothing else. The listener is a tiny asyncio
HTTP/1.1 server on the proxy's loop.

Where the numbers live (`Metrics(role=…)`):
- `single` (`--workers 1`, and every in-process edge of the tests): everything in one registry per edge;
- `worker` (a worker process of `--workers N`): traffic and audit-writer metrics only, written by
  prometheus_client's multiprocess mode to files in `PROMETHEUS_MULTIPROC_DIR` (the supervisor sets it for
  its workers only); reloads are the supervisor's to count;
- `supervisor`: no traffic of its own; `/metrics` merges the workers' files (`MultiProcessCollector`:
  counters and histograms summed over every worker that ever ran, restarted ones included) and adds what only
  it knows: build info with the artifact every worker serves, reloads, workers up and restarts, and each
  worker's process metrics (labelled `worker`).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector

from egress_proxy.decision.provenance import core_digest, egresslaw_version

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
AUDIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
TOKEN_FILE = "admin.token"
MAX_HEAD = 8192
ROLES = ("single", "worker", "supervisor")
disable_created_metrics()  # no `*_created` series: a scrape of a counter is its value, nothing else


class Metrics:
    """The proxy's metrics on their own registry (several edges can share a process: tests); thread-safe."""

    def __init__(self, role: str = "single") -> None:
        if role not in ROLES:
            raise ValueError(f"metrics role `{role}`")
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self.reloads: dict[str, int] = {}  # what egresslaw_reloads_total says, readable without parsing (tests, the supervisor)
        reg = self.registry
        if role != "supervisor":
            self._children: dict[tuple[str, str, str], Any] = {}
            self._decisions = Counter("egresslaw_decisions", "Decisions by kind (request, connect, tls, tcp, mint: the edge's own calls to token endpoints), decision and reason.",
                                      ("kind", "decision", "reason"), registry=reg)
            self._duration = Histogram("egresslaw_request_duration_seconds", "HTTP requests (not CONNECTs): request headers to the audit event.",
                                       buckets=BUCKETS, registry=reg)
            self._audit = Histogram("egresslaw_audit_write_seconds", "Audit writer: one append (write) or one sync (fsync) of the log.",
                                    ("op",), buckets=AUDIT_BUCKETS, registry=reg)
            self._audit_failures = Counter("egresslaw_audit_write_failures", "Audit writer: appends or syncs that failed (the log then fails closed).",
                                           ("op",), registry=reg)
            for op in ("write", "fsync"):
                self._audit.labels(op)
                self._audit_failures.labels(op)
            # Workers of `--workers N` write these to their multiprocess files: gauges summed (connections) or the
            # lowest (custody: 0 as soon as one live worker cannot reach it) over the live workers.
            self._open = Gauge("egresslaw_open_connections", "Client connections open now.", registry=reg, multiprocess_mode="livesum")
            self._outcomes = Counter("egresslaw_outcomes", "Allowed flows by how they ended: failure `none` (the response was delivered) "
                                     "or its failure code (upstream-unreachable, upstream-timeout, response-too-large, client-disconnected …).",
                                     ("kind", "failure"), registry=reg)
            self._redactions = Counter("egresslaw_redactions", "Credential occurrences the response scanner replaced before the client saw them.",
                                       registry=reg)
            self._bytes = Counter("egresslaw_bytes", "Bytes relayed by direction: up (client to upstream), down (upstream to client).",
                                  ("direction",), registry=reg)
            self._would_deny = Counter("egresslaw_would_deny", "Requests and tunnels of profiles in observe mode forwarded although "
                                       "an enforced profile would deny them, by kind and the reason it would have given.",
                                       ("kind", "reason"), registry=reg)
            self._custody = Gauge("egresslaw_custody_reachable", "1 when the custody store answers; 0 while it does not "
                                  "(credentialed requests are then denied custody-unavailable).", registry=reg, multiprocess_mode="livemin")
            for direction in ("up", "down"):
                self._bytes.labels(direction)
            for kind in ("request", "connect"):
                self._outcomes.labels(kind, "none")
            self._custody.set(1)
        if role != "worker":
            self._reloads = Counter("egresslaw_reloads", "Artifact reloads by result.", ("result",), registry=reg)
            for result in ("ok", "failed"):
                self._reloads.labels(result)
            self._build = Gauge("egresslaw_build_info", "The running egresslaw, its decision core and the artifact it enforces (value 1).",
                                ("version", "core", "artifact", "proved"), registry=reg)
        if role == "single":
            ProcessCollector(registry=reg)

    def observe(self, kind: str, decision: str, reason: str, seconds: float) -> None:
        """One decision (its closing audit event); `seconds` feeds the request latency histogram for HTTP requests."""
        key = (kind, decision, reason)
        counter = self._children.get(key)
        if counter is None:  # the labelled child, looked up once per label set (a few dozen: kinds x reasons)
            counter = self._children[key] = self._decisions.labels(kind, decision, reason)
        counter.inc()
        if kind == "request":
            self._duration.observe(seconds)

    def would_deny(self, kind: str, reason: str) -> None:
        """A flow forwarded in observe mode that an enforced profile would have denied for `reason`."""
        self._would_deny.labels(kind, reason).inc()

    def connection(self, delta: int) -> None:
        """A client connection opened (+1) or closed (-1)."""
        self._open.inc(delta)

    def closed(self, kind: str, event: dict) -> None:
        """A flow's closing audit event: its bytes and redactions, and for an allow's outcome how it ended."""
        up, down = event.get("bytes_up") or 0, event.get("bytes_down") or 0
        if up:
            self._bytes.labels("up").inc(up)
        if down:
            self._bytes.labels("down").inc(down)
        if event.get("redactions"):
            self._redactions.inc(event["redactions"])
        if event.get("kind") == "outcome":
            self._outcomes.labels(kind, event.get("failure") or "none").inc()

    def custody(self, reachable: bool) -> None:
        """Whether the custody store answered the last readiness check."""
        self._custody.set(1 if reachable else 0)

    def reload(self, result: str) -> None:
        """A reload, `ok` or `failed` (a worker's are counted once, by its supervisor)."""
        self.reloads[result] = self.reloads.get(result, 0) + 1
        if self.role != "worker":
            self._reloads.labels(result).inc()

    def serving(self, artifact: str, proved: bool) -> None:
        """Build info: the artifact (digest) now enforced."""
        if self.role == "worker":
            return

        self._build.clear()
        self._build.labels(egresslaw_version(), core_digest(), artifact, "true" if proved else "false").set(1)

    def watch_audit(self, audit: Any) -> None:
        """Time every append and sync of this audit log's writer and count the failed ones (wraps its I/O functions)."""
        if audit is None or self.role == "supervisor":
            return
        for attr, op in (("_os_write", "write"), ("_os_fsync", "fsync")):  # the log's own injection points (fault tests use them)
            if callable(getattr(audit, attr, None)):
                setattr(audit, attr, self._timed(getattr(audit, attr), op))

    def _timed(self, fn: Callable, op: str) -> Callable:
        latency, failures = self._audit.labels(op), self._audit_failures.labels(op)

        def timed(fd: int, *data: bytes) -> Any:
            start = time.perf_counter()
            try:
                result = fn(fd, *data)
            except OSError:
                failures.inc()
                raise
            finally:
                latency.observe(time.perf_counter() - start)
            if data and result != len(data[0]):
                failures.inc()  # a short write: the log cuts it back and fails closed
            return result

        return timed

    def render(self) -> bytes:
        return generate_latest(self.registry)


class WorkerProcesses:
    """A collector: `process_*` metrics (CPU, memory, descriptors, start time) of each live worker, labelled `worker`."""

    def __init__(self, pids: Callable[[], dict[str, int]]) -> None:
        self._pids = pids

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for worker, pid in sorted(self._pids().items()):
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "worker": worker}, sample.value)
        yield from merged.values()


def admin_token(confdir: str | os.PathLike[str]) -> str:
    """The admin bearer token from `<confdir>/admin.token`, created (0600) if absent; refused if readable by others."""
    root = Path(confdir).expanduser()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
    st = os.stat(path, follow_symlinks=False)
    if st.st_mode & 0o077:
        raise PermissionError(f"`{path}` is accessible by group or others; run `chmod 600 {path}`")
    token = path.read_text(encoding="ascii").strip()
    if len(token) < 32:
        raise PermissionError(f"`{path}` holds no usable token")
    return token


class AdminServer:
    """`GET /metrics` with `Authorization: Bearer <token>` (401 otherwise); `GET /healthz` and `GET /readyz`
    without one; 404 for other paths. `ready()` returns why the proxy is not ready (empty: ready)."""

    def __init__(self, metrics: Metrics, token: str, ready: Callable[[], list[str]] | None = None) -> None:
        self.metrics = metrics
        self._ready = ready
        self._token = token.encode("ascii")
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, *, sock: Any = None) -> tuple[str, int]:
        """Listen on host:port, or on `sock` (bound already: the address was reserved before the workers started)."""
        self._server = await (asyncio.start_server(self._handle, sock=sock) if sock is not None else asyncio.start_server(self._handle, host, port))
        sock = self._server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            status, body = self._answer(head[:MAX_HEAD])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            status, body = "400 Bad Request", b"bad request\n"
        extra = 'WWW-Authenticate: Bearer realm="egresslaw-admin"\r\n' if status.startswith("401") else ""
        ctype = CONTENT_TYPE_PLAIN_0_0_4 if status.startswith("200") else "text/plain; charset=utf-8"
        try:
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _answer(self, head: bytes) -> tuple[str, bytes]:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"GET":
            return "405 Method Not Allowed", b"only GET /metrics\n"
        path = parts[1].split(b"?")[0]
        if path == b"/healthz":
            return "200 OK", b"ok\n"
        if path == b"/readyz":
            try:
                why = self._ready() if self._ready is not None else []
            except Exception:  # a readiness check that fails is a reason not to be ready
                why = ["internal-error"]
            return ("503 Service Unavailable", ("not ready: " + " ".join(why) + "\n").encode()) if why else ("200 OK", b"ready\n")
        token = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                scheme, _, given = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    token = given.strip()
        if not hmac.compare_digest(token, self._token):
            return "401 Unauthorized", b"unauthorized\n"
        if parts[1].split(b"?")[0] != b"/metrics":
            return "404 Not Found", b"not found\n"
        if self._ready is not None and self.metrics.role == "single":
            try:
                self._ready()  # readiness refreshes egresslaw_custody_reachable (workers refresh theirs every 0.25 s)
            except Exception:
                pass
        return "200 OK", self.metrics.render()
