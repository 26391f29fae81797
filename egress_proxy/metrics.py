"""Prometheus text metrics, served on a separate admin listener that requires a bearer token.

The token lives in `<confdir>/admin.token` (created 0600 with 32 random bytes, hex, on first
start; never logged). Scrapers send `Authorization: Bearer <token>`; anything else gets 401.
`GET /metrics` needs the token; `GET /healthz` (the process serves: 200) and `GET /readyz` (200 when the
artifact is loaded, custody is open, the audit log is writable and the proxy is not draining; 503 with
the short reason codes otherwise) need none and say nothing else. The listener is a tiny asyncio
HTTP/1.1 server on the proxy's loop.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_FILE = "admin.token"
MAX_HEAD = 8192


class Metrics:
    """Counters and a latency histogram; thread-safe; rendered in the Prometheus text format 0.0.4."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}
        self.reloads: dict[str, int] = {}
        self.buckets = [0] * len(BUCKETS)
        self.count = 0
        self.total = 0.0

    def observe(self, decision: str, reason: str, seconds: float) -> None:
        with self._lock:
            key = (decision, reason)
            self.requests[key] = self.requests.get(key, 0) + 1
            self.count += 1
            self.total += seconds
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    self.buckets[i] += 1

    def reload(self, result: str) -> None:
        with self._lock:
            self.reloads[result] = self.reloads.get(result, 0) + 1

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP egresslaw_requests_total Requests (and CONNECTs, TLS and TCP refusals) by decision and reason.",
                "# TYPE egresslaw_requests_total counter",
            ]
            for (decision, reason), n in sorted(self.requests.items()):
                lines.append(f'egresslaw_requests_total{{decision="{decision}",reason="{reason}"}} {n}')
            lines += [
                "# HELP egresslaw_request_duration_seconds Time from request headers to the audit event.",
                "# TYPE egresslaw_request_duration_seconds histogram",
            ]
            for bound, n in zip(BUCKETS, self.buckets):
                lines.append(f'egresslaw_request_duration_seconds_bucket{{le="{bound}"}} {n}')
            lines.append(f'egresslaw_request_duration_seconds_bucket{{le="+Inf"}} {self.count}')
            lines.append(f"egresslaw_request_duration_seconds_sum {self.total:.6f}")
            lines.append(f"egresslaw_request_duration_seconds_count {self.count}")
            lines += ["# HELP egresslaw_reloads_total Artifact reloads by result.", "# TYPE egresslaw_reloads_total counter"]
            for result in ("ok", "failed"):
                lines.append(f'egresslaw_reloads_total{{result="{result}"}} {self.reloads.get(result, 0)}')
            return "\n".join(lines) + "\n"


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

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._handle, host, port)
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
        ctype = "text/plain; version=0.0.4; charset=utf-8" if status.startswith("200") else "text/plain; charset=utf-8"
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
        return "200 OK", self.metrics.render().encode("utf-8")
