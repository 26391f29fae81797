"""Request-side limits, decided before the lease: head size, header count, request line, body size, connections
per client address and in total, header-read and idle timeouts, the file-descriptor ceiling.

mitmproxy buffers a request head until its blank line with no bound, keeps reading a client while a hook is
pending, buffers request bodies whole, and calls no hook before a head is complete. So the limits sit where the
bytes are: `EgressHttpLayer` stands in for mitmproxy's HTTP layer on every client connection (swapped in from
the `next_layer` hook) and brings two small subclasses of mitmproxy's own:

- `_Http1Server` measures the unparsed head on every read, before mitmproxy parses it (431/414), and arms the
  header-read deadline at the first byte of each head (408);
- `_Stream` (one per request) records whether the request's HEADERS ended it (HTTP/2 has no other way to tell a
  `GET` with DATA frames), stops reading the client while `requestheaders` decides, answers a refused request at
  once instead of buffering its body, and counts a streamed body against its limit, cutting the upstream off
  before it could receive a complete request (413).

The client's reader is wrapped by `_Gate`: reads wait while a decision is pending or mitmproxy's unparsed buffer
is full (TCP backpressure instead of memory), and a connection whose first byte does not come within the
header-read timeout is closed. What is allowed is decided elsewhere (decide.py); this module is bytes and time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import re
import resource
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import ctx, http
from mitmproxy import flow as mflow
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import (
    DropStream,
    ErrorCode,
    Http1Server,
    HttpErrorHook,
    HttpLayer,
    HttpRequestHook,
    HttpResponseHeadersHook,
    HttpStream,
    RequestData,
    RequestEndOfMessage,
    RequestProtocolError,
    RequestTrailers,
    ResponseData,
    ResponseEndOfMessage,
    ResponseProtocolError,
    SendHttp,
)

from egress_proxy.edge.denials import denial_response, raw_denial
from egress_proxy.edge.flowcontrol import MeteredH2Connection, StreamMeter, Valve
from egress_proxy.front.settings import BOUNDS, DEFAULTS, KiB, MiB
from egress_proxy.errors import EgressError

log = logging.getLogger("egresslaw.proxy")

FD_RESERVE = 64  # descriptors kept out of the automatic connection ceiling: listeners, audit log, store, DNS, TLS files
FD_LOG_INTERVAL = 60.0  # seconds between two "out of file descriptors" lines
DISCARD_LIMIT = 1 * MiB  # body bytes of an already answered request read and dropped before the connection is cut
_SIZE = re.compile(r"([0-9]+)\s*([kmg]?)(i?b)?", re.IGNORECASE)
_BLANK_LINE = re.compile(rb"\n\r?\n")  # the end of a head, as h11 (and so mitmproxy) finds it


class LimitError(EgressError, ValueError):
    """A limit option that cannot be used; the message names the option and what it takes."""


def parse_size(text: str | int, what: str = "size") -> int:
    """`65536`, `64k`, `64m`, `1g` (`KiB`/`MB` spellings too: powers of 1024) as a number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.fullmatch(str(text).strip())
        if m is None:
            raise LimitError(f"{what} `{text}` is not a size (e.g. 65536, 64k, 64m, 1g)")
        value = int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1024 * MiB}[m.group(2).lower()]
    if value <= 0:
        raise LimitError(f"{what} `{text}` must be greater than 0")
    return value


def parse_body_limits(entries: Sequence[str]) -> dict[str, int]:
    """`NAME=SIZE` or `NAME/RULE=SIZE` entries (NAME a connection or profile) as a map from `NAME[/RULE]` to bytes."""
    out: dict[str, int] = {}
    for entry in entries:
        name, sep, size = entry.partition("=")
        subject, _, rule = name.strip().partition("/")
        if not sep or not subject or (rule == "" and "/" in name):
            raise LimitError(f"--max-body-for `{entry}` is not NAME=SIZE or NAME/RULE=SIZE")
        out[name.strip()] = parse_size(size, f"--max-body-for `{entry}`")
    return out


@dataclass(frozen=True)
class LimitConfig:
    """Every request-side limit (the table in docs/proxy.md). Sizes in bytes, times in seconds."""

    max_head_bytes: int = DEFAULTS.max_head_bytes  # (egress_proxy/edge/settings.py says what each limit answers)
    max_headers: int = DEFAULTS.max_headers
    max_request_line: int = DEFAULTS.max_request_line
    max_body: int = DEFAULTS.max_body
    max_body_for: Mapping[str, int] = field(default_factory=dict)
    max_connections_per_client: int = DEFAULTS.max_connections_per_client
    max_connections: int = DEFAULTS.max_connections
    header_timeout: float = DEFAULTS.header_timeout
    # the bounds on what peers make the proxy hold (BOUNDS says what each is; egress_proxy/edge/flowcontrol.py)
    max_response_head: int = DEFAULTS.max_response_head
    max_response_headers: int = DEFAULTS.max_response_headers
    max_response_line: int = DEFAULTS.max_response_line
    stream_buffer: int = DEFAULTS.stream_buffer
    stall_timeout: float = DEFAULTS.stall_timeout
    max_streams: int = DEFAULTS.max_streams
    max_streams_total: int = DEFAULTS.max_streams_total
    max_held_per_connection: int = DEFAULTS.max_held_per_connection
    max_held: int = DEFAULTS.max_held

    def body_limit(self, subject: str | None, rule: str | None) -> int:
        """The body limit of a request of `subject` (connection or profile name) allowed by `rule`."""
        if subject is not None:
            if rule is not None and f"{subject}/{rule}" in self.max_body_for:
                return self.max_body_for[f"{subject}/{rule}"]
            if subject in self.max_body_for:
                return self.max_body_for[subject]
        return self.max_body

    def connection_ceiling(self) -> int:
        return self.max_connections if self.max_connections > 0 else auto_connection_ceiling()


def _bound(name: str, kind: str, value: Any) -> int | float:
    flag = "--" + name.replace("_", "-")
    if kind == "size":
        return parse_size(value, flag)
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise LimitError(f"{flag} `{value}` must be a whole number greater than 0")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise LimitError(f"{flag} `{value}` must be a finite number of seconds greater than 0")
    return float(value)


def limit_config(
    *,
    max_head_bytes: int | str,
    max_headers: int,
    max_request_line: int | str,
    max_body: int | str,
    max_body_for: Sequence[str],
    max_connections_per_client: int,
    max_connections: int,
    header_timeout: float,
    **bounds: Any,
) -> LimitConfig:
    """A checked LimitConfig; LimitError names the first bad value."""
    _bound("max_headers", "count", max_headers)
    _bound("max_connections_per_client", "count", max_connections_per_client)
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 0:
        raise LimitError(f"--max-connections `{max_connections}` must be a whole number (0: derived from the descriptor limit)")
    _bound("header_timeout", "seconds", header_timeout)
    return LimitConfig(
        max_head_bytes=parse_size(max_head_bytes, "--max-head-bytes"),
        max_headers=max_headers,
        max_request_line=parse_size(max_request_line, "--max-request-line"),
        max_body=parse_size(max_body, "--max-body"),
        max_body_for=parse_body_limits(max_body_for),
        max_connections_per_client=max_connections_per_client,
        max_connections=max_connections,
        header_timeout=float(header_timeout),
        **_bounds(bounds),
    )


def _bounds(values: Mapping[str, Any]) -> dict[str, int | float]:
    kinds = {name: kind for name, kind, _ in BOUNDS}
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise LimitError(f"`{unknown[0]}` is not a bound (one of: {', '.join(kinds)})")
    return {name: _bound(name, kinds[name], value) for name, value in values.items()}


def auto_connection_ceiling() -> int:
    """Half the descriptors left after FD_RESERVE: a client connection and its upstream connection each take one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(8, (soft - FD_RESERVE) // 2)


def raise_descriptor_limit(cap: int = 1 << 20) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most `cap`), as Go and nginx do; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    return soft


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 1 * MiB  # above asyncio's 256 KiB socket reads: at 128 KiB every read was an mmap (CPU per request +20-40%)


def return_large_buffers() -> bool:
    """Have glibc map every allocation of 1 MiB or more on its own and unmap it when freed (a fixed
    M_MMAP_THRESHOLD; glibc's default raises the threshold after each such free, and the large buffers a hostile
    peer makes the proxy fill and drop, e.g. bodies held whole, then stay in the heap as resident memory after
    they are let go). False where there is no glibc."""
    try:
        import ctypes  # Imported here: only the proxy process calls this, once, at start-up
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


# -- what a head may be ---------------------------------------------------------------------------------------------


def head_problem(data: bytes, cfg: LimitConfig) -> tuple[int, str, bool]:
    """Judge the unparsed bytes of an HTTP/1 request head (complete or not) against the limits.

    Returns (status, reason, complete): status 0 when nothing is wrong yet; `complete` when `data` holds the
    whole head (its blank line)."""
    line_end = data.find(b"\n", 0, cfg.max_request_line + 2)
    if line_end < 0:
        line = len(data)  # not ended yet (or longer than the window)
    else:
        line = line_end - 1 if data[line_end - 1 : line_end] == b"\r" else line_end
    if line > cfg.max_request_line:
        return 414, "request-line-too-long", False
    blank = _BLANK_LINE.search(data, 0, cfg.max_head_bytes + 2)
    head = blank.end() if blank is not None else len(data)
    if head > cfg.max_head_bytes:
        return 431, "head-too-large", blank is not None
    if data.count(b"\n", 0, head) - (2 if blank is not None else 1) > cfg.max_headers:
        return 431, "too-many-headers", blank is not None
    return 0, "", blank is not None


def request_problem(req: http.Request, cfg: LimitConfig) -> tuple[int, str] | None:
    """The same limits on a parsed request (HTTP/2 heads arrive decoded; HTTP/1 heads were judged as bytes)."""
    data = req.data
    if len(data.method) + len(data.path) + 1 > cfg.max_request_line:
        return 414, "request-line-too-long"
    fields = data.headers.fields
    if len(fields) > cfg.max_headers:
        return 431, "too-many-headers"
    size = len(data.method) + len(data.path) + len(data.authority) + sum(len(k) + len(v) + 4 for k, v in fields)
    if size > cfg.max_head_bytes:
        return 431, "head-too-large"
    return None


def declared_length(req: http.Request) -> int | None:
    """The request's one valid Content-Length, else None (decide() denies two of them or one with chunking)."""
    values = req.headers.get_all("content-length")
    if len(values) != 1 or not values[0].strip().isdigit():
        return None
    return int(values[0])


# -- the limits at run time -----------------------------------------------------------------------------------------


Refusal = Callable[[str | None, str, int | None, str], None]  # (client id or None, reason, status, event kind)
FlowRefusal = Callable[[Any, str, int], "http.Response | None"]  # (flow, reason, status) -> the answer to send


class Limits:
    """The run-time side of the limits: connection counts, per-request notes shared with the layers, the gates.

    `on_refusal(client id, reason, status, kind)` audits a refusal that has no flow (a head refused as it
    arrived, a connection over a cap, a silent client, descriptor exhaustion); `on_flow_refusal(flow, reason,
    status)` marks a flow refused mid-body and returns the answer to send (None: the flow is already finished)."""

    def __init__(self, config: LimitConfig | None = None) -> None:
        self.config = config or LimitConfig()
        self.on_refusal: Refusal = lambda cid, reason, status, kind: None
        self.on_flow_refusal: FlowRefusal = lambda flow, reason, status: None
        self._ended: weakref.WeakKeyDictionary[http.Request, bool] = weakref.WeakKeyDictionary()
        self._heads: Counter[str] = Counter()  # request heads seen or refused per client connection (tunnels included)
        self._cut: set[str] = set()  # client connections the proxy refused and closed: one refusal each, not one per layer
        self._body_limits: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()  # flow -> (limit, reason)
        self._response_holds: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # flow -> bytes its answer may hold
        self.on_response_refusal: Callable[[Any, str], None] = lambda flow, reason: None  # an answer held whole went over its limit
        self._gates: dict[str, _Gate] = {}
        self._peer_of: dict[str, str] = {}
        self._per_peer: Counter[str] = Counter()
        self._fd_logged = 0.0
        self._fd_quiet = 0
        self._valves: dict[str, Valve] = {}  # upstream connection id -> its reader
        self._valves_of: dict[str, set[str]] = {}  # client connection id -> ids of its upstream connections
        self._metered: dict[str, list[MeteredH2Connection]] = {}  # client connection id -> its client-side HTTP/2 connections
        self._upstream_h2: dict[str, MeteredH2Connection] = {}  # upstream connection id -> its HTTP/2 connection
        self._held: dict[str, dict[Any, int]] = {}  # client connection id -> stream -> request body bytes held whole
        self._held_total = 0
        self.on_stall: Callable[[Any], None] = lambda flow: None  # a flow's stream was reset as stalled
        self.on_rapid_reset: Callable[[str], None] = lambda cid: None  # a client connection is being closed for rapid resets
        self._meters: weakref.WeakKeyDictionary[Any, StreamMeter] = weakref.WeakKeyDictionary()  # flow -> its HTTP/2 account

    # layers ------------------------------------------------------------------------------------------------------

    def install(self, nextlayer: layer.NextLayer) -> None:
        """Stand in for mitmproxy's HTTP layer (called from the `next_layer` hook, after mitmproxy chose it)."""
        chosen = nextlayer.layer
        if type(chosen) is HttpLayer:
            chosen.context.layers.remove(chosen)
            nextlayer.layer = EgressHttpLayer(chosen.context, chosen.mode, self)

    def note_request(self, cid: str, request: http.Request, ended: bool) -> None:
        self._ended[request] = ended
        self.note_head(cid)

    def note_head(self, cid: str) -> None:
        self._heads[cid] += 1

    def heads(self, cid: str) -> int:
        return self._heads[cid]

    def cut(self, cid: str) -> bool:
        """Mark the client connection refused and closed; False when it already was.

        A tunnelled head has two deadlines racing (the tunnel's, the head's own; and the gate's before the first
        byte): whichever fires first answers and audits, the others find the connection cut and do nothing."""
        if cid in self._cut:
            return False
        self._cut.add(cid)
        return True

    def ended(self, request: http.Request) -> bool | None:
        """Did the request's head end it (no body follows)? None if it did not come through our layer."""
        return self._ended.get(request)

    def set_body_limit(self, flow: Any, limit: int, reason: str = "body-too-large") -> None:
        """A request body over `limit` is cut and refused `reason` (413): `body-too-large`, or
        `body-too-large-to-judge` when a request shape's `max_body` is the limit."""
        self._body_limits[flow] = (limit, reason)

    def body_limit(self, flow: Any) -> int | None:
        got = self._body_limits.get(flow)
        return got[0] if got is not None else None

    def body_refusal(self, flow: Any) -> str:
        """The reason a body over its limit is refused."""
        got = self._body_limits.get(flow)
        return got[1] if got is not None else "body-too-large"

    def hold_response(self, flow: Any, limit: int) -> None:
        """The answer of `flow` is held whole (not streamed) to at most `limit` bytes: past it, the upstream is cut and
        `on_response_refusal(flow, "response-too-large")` makes the answer a refusal (its head never went out)."""
        self._response_holds[flow] = limit

    def response_hold(self, flow: Any) -> int | None:
        return self._response_holds.get(flow)

    # connections -------------------------------------------------------------------------------------------------

    def connected(self, client: Any) -> tuple[str, int] | None:
        """Count a new client connection; (reason, status) when it is over a cap (then it is not counted)."""
        peer = str(client.peername[0]) if client.peername else "-"
        if len(self._peer_of) >= self.config.connection_ceiling():
            return "proxy-at-capacity", 503
        if self._per_peer[peer] >= self.config.max_connections_per_client:
            return "too-many-connections", 429
        self._peer_of[client.id] = peer
        self._per_peer[peer] += 1
        handler = _handler_of(client)
        if handler is not None:
            io = handler.transports.get(client)
            if io is not None and io.reader is not None:
                gate = _Gate(io.reader, self.config.header_timeout, lambda: self._silent(client, io.writer))
                io.reader = gate
                self._gates[client.id] = gate
        return None

    def refuse_connection(self, client: Any, reason: str, status: int) -> None:
        """Answer a connection refused at accept with our JSON (best effort) and have mitmproxy close it."""
        handler = _handler_of(client)
        io = handler.transports.get(client) if handler is not None else None
        if io is not None and io.writer is not None:
            try:
                io.writer.write(raw_denial(status, reason))
            except (OSError, RuntimeError):
                pass
        client.error = f"egresslaw: {reason}"

    def disconnected(self, client: Any) -> None:
        peer = self._peer_of.pop(client.id, None)
        if peer is not None:
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]
        self._gates.pop(client.id, None)
        self._heads.pop(client.id, None)
        self._cut.discard(client.id)
        for server_id in self._valves_of.pop(client.id, ()):
            self._valves.pop(server_id, None)
        for conn in self._metered.pop(client.id, ()):
            conn.lost()  # its streams' outcomes are written now: what was framed is all the client got
        self._held_total -= sum(self._held.pop(client.id, {}).values())

    # backpressure (egress_proxy/edge/flowcontrol.py) ------------------------------------------------------------------

    def server_connected(self, client: Any, server: Any) -> None:
        """Put a Valve in front of a new upstream connection's reader (it waits while its client has too much queued)."""
        handler = _handler_of(client)
        io = handler.transports.get(server) if handler is not None else None
        if io is not None and io.reader is not None and not isinstance(io.reader, Valve):
            io.reader = self._valves[server.id] = Valve(io.reader)
            self._valves_of.setdefault(client.id, set()).add(server.id)

    def server_disconnected(self, client: Any, server: Any) -> None:
        self._valves.pop(server.id, None)
        self._valves_of.get(client.id, set()).discard(server.id)
        conn = self._upstream_h2.pop(server.id, None)
        if conn is not None:
            conn.lost()  # a socket closed without GOAWAY: the client's reader is not left paused for it

    def close_soon(self, client: Any, delay: float = 0.05) -> None:
        """Close a client connection's socket shortly (what is queued for it is written first)."""
        handler = _handler_of(client)
        io = handler.transports.get(client) if handler is not None else None
        if io is not None and io.writer is not None:
            asyncio.get_running_loop().call_later(delay, io.writer.close)

    def pause_server(self, server_id: str, key: Any, on: bool) -> None:
        valve = self._valves.get(server_id)
        if valve is not None:
            valve.pause(key, on)

    def pause_client(self, cid: str, key: Any, on: bool) -> None:
        gate = self._gates.get(cid)
        if gate is not None:
            gate.pause(key, on)

    def metered(self, cid: str, conn: MeteredH2Connection) -> None:
        """A client connection's own HTTP/2 connection: its streams are settled when the client goes."""
        self._metered.setdefault(cid, []).append(conn)

    def metered_upstream(self, server_id: str, conn: MeteredH2Connection) -> None:
        """An upstream HTTP/2 connection: let go of (and its pauses released) when it closes."""
        self._upstream_h2[server_id] = conn

    def note_meter(self, flow: Any, meter: StreamMeter) -> None:
        self._meters[flow] = meter

    def meter_of(self, flow: Any) -> StreamMeter | None:
        """What a flow's HTTP/2 stream framed for the client (None: the client speaks HTTP/1)."""
        return self._meters.get(flow)

    # request bodies held whole ---------------------------------------------------------------------------------------

    def hold_body(self, cid: str, stream: Any, size: int) -> bool:
        """Count `size` more bytes of a body held whole by `stream`; False (nothing counted) over a cap."""
        held = self._held.setdefault(cid, {})
        if sum(held.values()) + size > self.config.max_held_per_connection or self._held_total + size > self.config.max_held:
            return False
        held[stream] = held.get(stream, 0) + size
        self._held_total += size
        return True

    def let_go(self, cid: str, stream: Any) -> None:
        """The stream holds its body no more (sent on, refused, or gone)."""
        self._held_total -= self._held.get(cid, {}).pop(stream, 0)

    def open_connections(self) -> int:
        return len(self._peer_of)

    def _silent(self, client: Any, writer: Any) -> None:
        if not self.cut(client.id):
            return
        try:
            writer.write(raw_denial(408, "header-timeout"))
        except (OSError, RuntimeError, AttributeError):
            pass
        self.on_refusal(client.id, "header-timeout", 408, "request")

    # reading -----------------------------------------------------------------------------------------------------

    def hold(self, cid: str) -> None:
        gate = self._gates.get(cid)
        if gate is not None:
            gate.hold()

    def release(self, cid: str) -> None:
        gate = self._gates.get(cid)
        if gate is not None:
            gate.release()

    def buffer_full(self, cid: str, full: bool) -> None:
        gate = self._gates.get(cid)
        if gate is not None:
            gate.full(full)

    # descriptors -------------------------------------------------------------------------------------------------

    def watch_descriptors(self, loop: asyncio.AbstractEventLoop) -> None:
        """Turn asyncio's traceback per refused accept at EMFILE into one log line (and one audit event) a minute."""
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                self.descriptors_exhausted(exc.errno)
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def descriptors_exhausted(self, code: int) -> None:
        now = time.monotonic()
        if self._fd_logged and now - self._fd_logged < FD_LOG_INTERVAL:
            self._fd_quiet += 1
            return
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        more = f" ({self._fd_quiet} more since the last report)" if self._fd_quiet else ""
        log.warning(
            "out of file descriptors (%s, limit %s, %d client connections open): new connections wait in the listen "
            "backlog; established ones are served%s. Raise `ulimit -n` or lower --max-connections.",
            errno.errorcode.get(code, code), soft, len(self._peer_of), more,
        )
        self._fd_logged, self._fd_quiet = now, 0
        self.on_refusal(None, "fd-exhausted", None, "connection")


def _handler_of(client: Any) -> Any:
    """mitmproxy's connection handler of a client connection (None outside a running proxyserver)."""
    try:
        return ctx.master.addons.get("proxyserver").connections.get(client.id)
    except Exception:
        return None


class _Gate(Valve):
    """A client connection's reader: reads wait while a decision is pending (`hold`), mitmproxy's unparsed buffer
    is over the head limit (`full`) or an upstream HTTP/2 stream has too much of this client's body queued
    (`pause`, the Valve's), so the kernel's window is the only buffer; the first read waits at most the
    header-read timeout (a client that connects and says nothing is closed)."""

    def __init__(self, reader: Any, first_byte: float, on_silent: Callable[[], None]) -> None:
        super().__init__(reader)
        self._first_byte: float | None = first_byte
        self._on_silent = on_silent
        self._holds = 0
        self._full = False

    def hold(self) -> None:
        self._holds += 1
        self._open.clear()

    def release(self) -> None:
        self._holds = max(0, self._holds - 1)
        self._update()

    def full(self, full: bool) -> None:
        if full != self._full:
            self._full = full
            self._update()

    def _closed(self) -> bool:
        return bool(self._holds or self._full or self._keys)

    async def read(self, n: int = -1) -> bytes:
        await self._open.wait()
        if self._first_byte is None:
            return await self._reader.read(n)
        timeout, self._first_byte = self._first_byte, None
        try:
            return await asyncio.wait_for(self._reader.read(n), timeout)
        except TimeoutError:
            self._on_silent()
            raise asyncio.CancelledError("header-timeout") from None  # closed as mitmproxy's own inactivity timeout does


# -- the layers -----------------------------------------------------------------------------------------------------


class ClosingLayer(layer.Layer):
    """Closes the client connection: the stand-in when our HTTP layer cannot be installed (never an unlimited one)."""

    def _handle_event(self, event: events.Event):
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


class EgressHttpLayer(HttpLayer):
    """mitmproxy's HTTP layer, with our client-side HTTP/1 connection and our per-request streams."""

    def __init__(self, context: Any, mode: Any, limits: Limits) -> None:
        super().__init__(context, mode)
        self.limits = limits

    def _handle_event(self, event: events.Event):
        client = self.context.client
        if isinstance(event, events.Start) and client not in self.connections and client.alpn in (None, b"", b"http/1.1", b"http/1.0"):
            self.connections[client] = _Http1Server(self.context.fork(), self.limits)
        yield from super()._handle_event(event)

    def make_stream(self, stream_id: int):
        context = self.context.fork()
        client = self.connections.get(self.context.client)
        metered = getattr(client, "h2_conn", None)
        meter = metered.meter(stream_id) if isinstance(metered, MeteredH2Connection) else None
        self.streams[stream_id] = _Stream(context, stream_id, self.limits, metered if meter is not None else None, meter)
        yield from self.event_to_child(self.streams[stream_id], events.Start())

    # egress_proxy/edge/flowcontrol.py: the HTTP/2 connections of this layer and what their queues say

    def adopt_h2(self, conn_layer: Any) -> None:
        """A new HTTP/2 connection layer under this one (client or upstream side): bound its queues and streams."""
        h2_conn = conn_layer.h2_conn
        if not isinstance(h2_conn, MeteredH2Connection):
            return
        cfg = self.limits.config
        h2_conn.buffer = cfg.stream_buffer
        h2_conn.pressure = self
        if conn_layer.conn is self.context.client:
            h2_conn.local_settings.max_concurrent_streams = cfg.max_streams
            h2_conn.local_settings.acknowledge()  # sent in the connection preface (as mitmproxy does for its window)
            # No more in flight from the client than one connection may make us hold (mitmproxy: 2^31-1 per stream).
            h2_conn.advertise(cfg.max_held_per_connection)
            self.limits.metered(self.context.client.id, h2_conn)
        else:
            self.limits.metered_upstream(conn_layer.conn.id, h2_conn)

    def rapid_reset(self, conn: MeteredH2Connection) -> None:
        client = self.context.client
        if getattr(self.connections.get(client), "h2_conn", None) is conn and self.limits.cut(client.id):
            self.limits.on_rapid_reset(client.id)  # the requests it still holds are refused at once
            self.limits.on_refusal(client.id, "rapid-reset", None, "connection")
            # Closed from outside the layers: a stream of it may be waiting on a dial its reset left unanswered, and
            # no command can be yielded from inside h2. The GOAWAY queued here goes out first, when it can.
            self.limits.close_soon(client)

    def over(self, conn: MeteredH2Connection, stream_id: int, over: bool) -> None:
        client = self.connections.get(self.context.client)
        key = (id(conn), stream_id)
        if getattr(client, "h2_conn", None) is conn:
            # The client does not take this stream's response: stop reading the upstream connection that feeds it.
            stream = self.streams.get(stream_id)
            server = stream.context.server if stream is not None else None
            if server is not None:
                self.limits.pause_server(server.id, key, over)
        else:
            # An upstream does not take a request body: stop reading the client.
            self.limits.pause_client(self.context.client.id, key, over)


class _Http1Server(Http1Server):
    """mitmproxy's HTTP/1 server side, with the head judged before it is parsed and a deadline on every head."""

    def __init__(self, context: Any, limits: Limits) -> None:
        super().__init__(context)
        self.limits = limits
        self._deadline: commands.RequestWakeup | None = None
        self._tunnel_deadline: commands.RequestWakeup | None = None
        self._heads_at_connect = 0

    def _handle_event(self, event: events.Event):
        cid = self.context.client.id
        if isinstance(event, events.Wakeup):
            if event.command is self._deadline and self.state == self.read_headers:
                yield from self._refuse(408, "header-timeout")
            elif event.command is self._tunnel_deadline and self.limits.heads(cid) == self._heads_at_connect:
                # No request head inside the tunnel in time (a TLS handshake trickled in, or nothing at all).
                if not self.limits.cut(cid):
                    return
                yield commands.CloseConnection(self.conn)
                self.limits.on_refusal(cid, "header-timeout", None, "request")
            return
        if self.state == self.done and isinstance(event, events.DataReceived):
            return  # refused or finished: nothing more is buffered
        yield from super()._handle_event(event)
        self.limits.buffer_full(cid, len(self.buf) > self.limits.config.max_head_bytes)
        if self.state == self.passthrough and self._tunnel_deadline is None:
            # A tunnel was opened: its first request head (after the TLS handshake) gets the same deadline.
            self._heads_at_connect = self.limits.heads(cid)
            self._tunnel_deadline = commands.RequestWakeup(self.limits.config.header_timeout)
            yield self._tunnel_deadline

    def read_headers(self, event: events.ConnectionEvent):
        if isinstance(event, events.DataReceived) and self.buf:
            if self._deadline is None:
                self._deadline = commands.RequestWakeup(self.limits.config.header_timeout)
                yield self._deadline
            status, reason, complete = head_problem(bytes(self.buf), self.limits.config)
            if status:
                yield from self._refuse(status, reason)
                return
            if complete:
                self._deadline = None  # the next head gets its own deadline at its first byte
        yield from super().read_headers(event)

    def _refuse(self, status: int, reason: str):
        self.buf = type(self.buf)()  # let go of what was read
        self.state = self.done
        self._deadline = None
        if not self.limits.cut(self.context.client.id):
            return  # another layer of this connection refused it first (a tunnel's deadline): nothing more to say
        yield commands.SendData(self.conn, raw_denial(status, reason))
        yield commands.CloseConnection(self.conn)
        self.limits.note_head(self.context.client.id)  # judged: a tunnel's deadline has nothing left to do
        self.limits.on_refusal(self.context.client.id, reason, status, "request")


class _Stream(HttpStream):
    """mitmproxy's per-request stream, with the request body never buffered unbounded and never sent beyond its limit."""

    def __init__(self, context: Any, stream_id: int, limits: Limits, client_h2: MeteredH2Connection | None = None,
                 meter: StreamMeter | None = None) -> None:
        super().__init__(context, stream_id)
        self.limits = limits
        self.client_h2 = client_h2  # the client's HTTP/2 connection (None: HTTP/1)
        self.meter = meter  # what this stream framed for the client (egress_proxy/edge/flowcontrol.py)
        self._stall: commands.RequestWakeup | None = None
        self._stall_sent = 0
        self._noted = False
        self._body = 0  # request body bytes seen
        self._declared: int | None = None  # a streamed body's content-length
        self._last: RequestData | None = None  # the chunk that completes the declared length, held for the end
        self._discarded = 0
        self._discard_deadline: commands.RequestWakeup | None = None
        self._answered = False  # we answered (a refusal) before the request ended: upstream errors are ours

    def _handle_event(self, event: events.Event):
        if isinstance(event, events.Wakeup):
            if event.command is self._discard_deadline and self.client_state == self.state_discard_request_body:
                yield from self._stop_reading()  # a refused body trickled in: it no longer holds the connection
            elif event.command is self._stall:
                self._stall = None
                yield from self._watch(stalled_check=True)
            return
        try:
            yield from super()._handle_event(event)
        finally:
            if self.client_state != self.state_consume_request_body:
                self.limits.let_go(self.context.client.id, self)
            if self.meter is not None and not self._noted and getattr(self, "flow", None) is not None:
                self._noted = True
                self.limits.note_meter(self.flow, self.meter)
        if self.meter is not None and self._stall is None:
            yield from self._watch(stalled_check=False)

    def _watch(self, stalled_check: bool):
        """While bytes are queued for the client: a wakeup every --stall-timeout; one with nothing taken since the
        last resets the stream (client-stalled) and closes its upstream."""
        assert self.meter is not None and self.client_h2 is not None
        if self.meter.settled or not self.client_h2.queued(self.stream_id):
            return
        if stalled_check and self.meter.sent == self._stall_sent:
            yield from self._stalled()
            return
        self._stall_sent = self.meter.sent
        self._stall = commands.RequestWakeup(self.limits.config.stall_timeout)
        yield self._stall

    def _stalled(self):
        flow = getattr(self, "flow", None)
        if flow is not None:
            self.limits.on_stall(flow)
        if self.server_state not in (self.state_done, self.state_errored):
            # The upstream is still sending (its reader paused): the flow fails here, and the upstream is let go.
            self.client_state = self.server_state = self.state_errored
            if flow is not None:
                flow.error = mflow.Error("egresslaw: client-stalled")
                yield HttpErrorHook(flow)
            yield SendHttp(RequestProtocolError(self.stream_id, "client-stalled", ErrorCode.CANCEL), self.context.server)
        yield SendHttp(ResponseProtocolError(self.stream_id, "client-stalled", ErrorCode.CANCEL), self.context.client)

    def state_wait_for_request_headers(self, event):
        cid = self.context.client.id
        self.limits.note_request(cid, event.request, event.end_stream)
        pending = not event.end_stream
        if pending:
            self.limits.hold(cid)  # no body byte is read while requestheaders decides
        try:
            yield from super().state_wait_for_request_headers(event)
        finally:
            if pending:
                self.limits.release(cid)
        if pending and self.client_state == self.state_consume_request_body and self.flow.response is not None:
            yield from self._answer_now()
        elif pending:
            self._declared = declared_length(self.flow.request)

    def _answer_now(self):
        """A request refused before its body: answer at once (mitmproxy would buffer the whole body first), drop the body."""
        self.client_state = self.state_discard_request_body
        self._answered = True
        self.request_body_buf.clear()
        yield HttpRequestHook(self.flow)
        if self.flow.response is None:  # pragma: no cover - an addon took our answer back
            self.flow.response = denial_response(403, "internal-error")
        self.flow.response.timestamp_start = time.time()
        yield from self._send_answer()

    def _send_answer(self):
        if self.flow.request.method == "HEAD":
            self.flow.response.data.content = b""  # no body in an answer to HEAD (HTTP/2 would call it malformed)
        yield HttpResponseHeadersHook(self.flow)
        yield from self.send_response()
        yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)
        self._discard_deadline = commands.RequestWakeup(self.limits.config.header_timeout)
        yield self._discard_deadline

    def _stop_reading(self):
        """Cut the rest of an answered request's body: the connection (HTTP/1) or the stream (HTTP/2)."""
        self.client_state = self.state_errored
        yield SendHttp(ResponseProtocolError(self.stream_id, "request body not read", ErrorCode.CANCEL), self.context.client)

    def state_discard_request_body(self, event):
        if isinstance(event, RequestData):
            self._discarded += len(event.data)
            if self._discarded > DISCARD_LIMIT:
                yield from self._stop_reading()
        elif isinstance(event, RequestEndOfMessage):
            self.client_state = self.state_done
            self.flow.live = False
            yield DropStream(self.stream_id)

    def state_consume_request_body(self, event):
        # Only an allowed HTTP/2 body without content-length gets here with data (it is framed for the upstream
        # once complete); it is held to its limit like a streamed one.
        if isinstance(event, RequestData):
            limit = self.limits.body_limit(self.flow)
            refusal = None
            if limit is not None and len(self.request_body_buf) + len(event.data) > limit:
                refusal = self.limits.body_refusal(self.flow), 413
            elif not self.limits.hold_body(self.context.client.id, self, len(event.data)):
                refusal = "held-bodies-at-capacity", 503  # the connection's or the process's cap on bodies held whole
            if refusal is not None:
                self.request_body_buf.clear()
                self.limits.let_go(self.context.client.id, self)
                answer = self.limits.on_flow_refusal(self.flow, *refusal)
                if answer is not None:
                    self.flow.response = answer
                    yield from self._answer_now()
                    return
        yield from super().state_consume_request_body(event)

    def state_stream_request_body(self, event):
        if isinstance(event, RequestData):
            self._body += len(event.data)
            limit = self.limits.body_limit(self.flow)
            if limit is not None and self._body > limit:
                yield from self._cut(self.limits.body_refusal(self.flow), 413)
                return
            if self._declared is not None and self._body >= self._declared:
                # The chunk that completes a declared length waits for the end of the request: if trailers come
                # instead, the upstream must not already hold a complete request.
                self._last = event
                return
        elif isinstance(event, RequestTrailers):
            yield from self._cut("trailers-denied", 403)  # trailers would arrive after the decision
            return
        elif isinstance(event, RequestEndOfMessage) and self._last is not None:
            last, self._last = self._last, None
            yield from super().state_stream_request_body(last)
        yield from super().state_stream_request_body(event)

    def _cut(self, reason: str, status: int):
        """A streamed request refused mid-body: the upstream connection (HTTP/1) or stream (HTTP/2) is cut before
        this chunk, so it never receives a complete request; the client is answered if no answer has started."""
        yield SendHttp(RequestProtocolError(self.stream_id, reason, ErrorCode.REQUEST_TOO_LARGE), self.context.server)
        answer = self.limits.on_flow_refusal(self.flow, reason, status)
        if answer is not None and self.server_state == self.state_wait_for_response_headers:
            self.flow.response = answer
            self.client_state = self.state_discard_request_body
            self._answered = True
            yield from self._send_answer()
            return
        self.client_state = self.server_state = self.state_errored
        if answer is not None:
            self.flow.error = mflow.Error(f"egresslaw: {reason}")
            yield HttpErrorHook(self.flow)
        yield SendHttp(ResponseProtocolError(self.stream_id, reason, ErrorCode.KILL), self.context.client)

    def state_consume_response_body(self, event):
        # An answer held whole for the addon (a filtered MCP answer) is held to its limit: past it, the upstream is
        # cut, nothing more is buffered, and the addon's `response` hook answers the refusal instead.
        if isinstance(event, ResponseData):
            limit = self.limits.response_hold(self.flow)
            if limit is not None and len(self.response_body_buf) + len(event.data) > limit:
                self.response_body_buf.clear()
                self._answered = True  # the upstream going away after this is ours
                yield SendHttp(RequestProtocolError(self.stream_id, "response-too-large", ErrorCode.CANCEL), self.context.server)
                self.limits.on_response_refusal(self.flow, "response-too-large")
                assert self.flow.response is not None
                self.flow.response.data.content = b""
                self.flow.response.trailers = None
                yield from self.send_response()
                if self.server_state == self.state_done:
                    self.server_state = self.state_errored  # the rest of what the upstream sends is dropped
                return
        yield from super().state_consume_response_body(event)

    def handle_protocol_error(self, event):
        if self._answered and isinstance(event, ResponseProtocolError):
            self.server_state = self.state_errored  # the upstream we cut (or gave up on) going away: already answered
            return
        yield from super().handle_protocol_error(event)
