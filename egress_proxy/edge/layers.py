"""What egresslaw changes inside mitmproxy's HTTP layers, where no hook can reach.

mitmproxy 12 writes some answers itself, after every hook, and reads some upstream bytes as what they
are not. These small changes, installed once per process by `install()` (from the addon's `configure`):

1. **Error answers are ours.** When an upstream cuts or malforms its answer (status line, header line,
   chunk header, an illegal HTTP/2 header value) or cannot be reached, mitmproxy answers the client
   itself with a page that quotes the offending bytes, the echoed credential included
   (`_http1.make_error_response`, `_http2.format_error`). Both are replaced: the body is egresslaw's JSON
   (`{"error": "upstream_error", "reason": …}`, or `egress_denied` for the 4xx mitmproxy answers to
   requests it cannot parse) and never quotes a byte of the peer.
2. **Protocol errors carry a reason code, not peer bytes.** The message of every response-side protocol
   error a stream handles is replaced by a reason code before the `error` hook sees it (so `flow.error`
   never holds upstream bytes), and the addon learns mitmproxy's error code, i.e. what the client is
   about to get (`HttpStream.handle_protocol_error`); the answers of mitmproxy's header validation
   name the reason the addon audited (`HttpStream.check_invalid`).
3. **Interim responses are not final responses.** On an HTTP/1 upstream connection mitmproxy takes a
   `1xx` (103 Early Hints, an unsolicited 100 Continue) for the final answer, and the real answer that
   follows is read as the answer to the *next* request on that connection. `Http1Client.read_headers`
   now drops interim heads (HTTP/2 upstreams already do), marks the connection so the addon closes it
   after the final answer (never reused after doubt), refuses a `101` nobody asked for, and logs bytes
   an idle upstream sends by count only.
4. **Log lines never quote peer bytes or headers.** mitmproxy logs some protocol errors with the bytes
   that caused them (`HTTP/2 protocol error: … b'…'`): a filter on `mitmproxy.proxy.server` cuts every
   quoted byte string from its records. The `hpack` logger, which logs every HTTP/2 header it encodes or
   decodes at DEBUG (the injected credential included), is raised to INFO.
5. **An empty HTTP/2 DATA frame is not the end of a body.** mitmproxy hands a body stream an empty chunk
   for it, which is also how it signals the end (`Http2Connection.handle_h2_event` drops such frames).
6. **An upstream connection is reused only for the same key.** mitmproxy reuses any open upstream
   connection to the same address, HTTP/2 ones even while another stream on them is in flight. The
   listener names each flow's reuse key (who it serves and whose credential it carries); a connection
   is tagged with the key of the flow it was opened for and serves only flows with that key
   (`HttpLayer.get_connection`, `GetHttpConnection.connection_spec_matches`).
7. **A request mitmproxy finds no destination for is audited.** An origin-form request outside a tunnel
   without a usable `Host` gets mitmproxy's 400 before any hook and without a log line
   (`HttpStream.state_wait_for_request_headers`); the listener that knows the client audits it.
8. **Its inactivity timeout is told apart from a client leaving.** mitmproxy reports both as the client
   disconnecting; a client connection its watchdog closed (`ConnectionHandler.on_timeout`: the upstream
   hung) is remembered, so a flow cut that way is not audited as `client-disconnected`; one closed while
   bytes still waited to be written to it (an HTTP/1 client that stopped reading) is `client-stalled`.

Anything unexpected (another mitmproxy major version, a renamed function) makes `install` raise
`LayerError`: the proxy refuses to start rather than run without these changes.
"""

from __future__ import annotations

import logging
import re
import weakref
from typing import Any, Protocol

from egress_proxy.decision.reasons import REASONS
from egress_proxy.edge import flowcontrol
from egress_proxy.edge.denials import (
    error_answer,
)
from egress_proxy.errors import EgressError

log = logging.getLogger("egresslaw.proxy")

SUPPORTED_MAJOR = "12"
SERVER_LOGGER = "mitmproxy.proxy.server"


class LayerError(EgressError):
    """mitmproxy is not a version whose layers egresslaw knows how to adapt."""


class Listener(Protocol):
    """What the addon provides to the layers (the addon that owns the flow is asked)."""

    def owns(self, flow: Any) -> bool: ...

    def protocol_error(self, flow: Any, code: Any, to_client: bool, reason: str | None = None) -> str | None: ...

    def reuse_key(self, flow: Any) -> Any: ...

    def audit_malformed(self, peername: Any) -> None: ...


_listeners: weakref.WeakSet = weakref.WeakSet()
_doubtful: set[str] = set()  # ids of upstream connections that sent an interim response
_reuse_keys: dict[str, Any] = {}  # upstream connection id -> the reuse key of the flow it was opened for
_timed_out: set[str] = set()  # ids of client connections mitmproxy's inactivity timeout closed
_stalled: set[str] = set()  # ... of those, the ones with bytes still waiting to be written to the client
_installed = False


# -- 1. error answers -----------------------------------------------------------------------------


def _reason(status: int, message: str) -> str:
    # `message` is a reason code when it went through `handle_protocol_error` or `check_invalid`; otherwise it is
    # mitmproxy's own text, which may quote peer bytes, and is dropped.
    if message in REASONS:
        return message
    if status >= 500:
        return "upstream-error"
    # mitmproxy's HTTP/1 reader refuses bad framing headers itself, before any hook (the addon audits it so)
    text = message.lower()
    return "smuggling" if "content-length" in text or "transfer-encoding" in text else "malformed-request"


def _make_error_response(status_code: int, message: str = "") -> bytes:
    from mitmproxy import http
    from mitmproxy.net.http import http1

    body, headers = error_answer(status_code, _reason(status_code, message))
    headers["Connection"] = "close"
    return http1.assemble_response(http.Response.make(status_code, body, headers))


def _format_error(status_code: int, message: str) -> bytes:
    return error_answer(status_code, _reason(status_code, message))[0]


# -- 2. protocol errors ---------------------------------------------------------------------------


def _listener_for(flow: Any) -> Listener | None:
    for listener in list(_listeners):
        try:
            if listener.owns(flow):
                return listener
        except Exception:
            continue
    return None


def _tell(flow: Any, code: Any, to_client: bool, default: str, reason: str | None = None) -> str:
    """Tell the flow's listener about a protocol error (before the error hook runs) and the reason code egresslaw
    gave it, if any (a bound an upstream broke); the reason to show."""
    try:
        listener = _listener_for(flow) if flow is not None else None
        if listener is not None:
            return listener.protocol_error(flow, code, to_client, reason) or reason or default
    except Exception:
        log.error("internal error while handling a protocol error (%s)", "listener")
    return default


def _wrap_protocol_error(original):
    from mitmproxy.proxy.layers.http import ResponseProtocolError

    def handle_protocol_error(self, event):
        to_client = isinstance(event, ResponseProtocolError)  # a response-side error is answered to the client
        ours = event.message if to_client and event.message in REASONS else None  # (a code of ours, never peer bytes)
        reason = _tell(getattr(self, "flow", None), event.code, to_client, "upstream-error", ours)
        if to_client:
            event = ResponseProtocolError(event.stream_id, reason, event.code)  # INVARIANT: no peer bytes past here
        return (yield from original(self, event))

    handle_protocol_error.__wrapped__ = original
    return handle_protocol_error


def _wrap_check_invalid(original):
    from mitmproxy.proxy.layers.http import (
        ErrorCode,
        HttpErrorHook,
        ResponseProtocolError,
        SendHttp,
    )

    def check_invalid(self, request):
        # mitmproxy's header validation answers the client itself (400 for a request, 502 for a response), after
        # the error hook: the listener learns of it before that hook, and the answer names its reason.
        code = ErrorCode.REQUEST_VALIDATION_FAILED if request else ErrorCode.RESPONSE_VALIDATION_FAILED
        reason = "malformed-request" if request else "upstream-error"
        commands = original(self, request)
        reply = None
        while True:
            try:
                command = commands.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(command, HttpErrorHook):
                reason = _tell(self.flow, code, True, reason)
            elif isinstance(command, SendHttp) and isinstance(command.event, ResponseProtocolError):
                command = SendHttp(ResponseProtocolError(command.event.stream_id, reason, command.event.code), command.connection)
            reply = yield command

    check_invalid.__wrapped__ = original
    return check_invalid


# -- 3. interim responses on HTTP/1 upstream connections --------------------------------------------


def doubtful(connection_id: str) -> bool:
    """True if this upstream connection sent an interim response (it must not be reused)."""
    return connection_id in _doubtful


def forget(connection_id: str) -> None:
    _doubtful.discard(connection_id)
    _reuse_keys.pop(connection_id, None)


def _wrap_read_headers(original):
    from mitmproxy.net.http import http1
    from mitmproxy.proxy import commands, events
    from mitmproxy.proxy.layers.http import (
        ErrorCode,
        ResponseHeaders,
        ResponseProtocolError,
    )
    from mitmproxy.proxy.layers.http._base import ReceiveHttp
    from mitmproxy.proxy.layers.http._http1 import make_body_reader

    def read_headers(self, event):
        if not isinstance(event, events.DataReceived):
            return (yield from original(self, event))
        if not self.request:
            # Bytes from an upstream nobody asked anything: mitmproxy would log them verbatim.
            yield commands.Log(f"unexpected data from server ({len(self.buf)} bytes), closing")
            yield commands.CloseConnection(self.conn)
            return
        while True:
            head = self.buf.maybe_extract_lines()
            if not head:
                return  # an incomplete head: wait for more bytes (_wrap_client_event bounds what waits)
            cfg = _bounds_of(self)
            problem = response_head_problem(head, cfg) if cfg is not None else None
            if problem is not None:
                yield from _refuse_response(self, problem)
                return
            try:
                response = http1.read_response_head([bytes(x) for x in head])
                expected_size = http1.expected_http_body_size(self.request, response)
            except ValueError:
                yield commands.CloseConnection(self.conn)
                yield ReceiveHttp(ResponseProtocolError(self.stream_id, "upstream-error", ErrorCode.GENERIC_SERVER_ERROR))
                return
            if response.status_code == 101 or not 100 <= response.status_code < 200:
                break
            # An interim answer (RFC 9110 §15.2): dropped; the final one follows on this connection.
            _doubtful.add(self.conn.id)
            yield commands.Log(f"dropped an interim {response.status_code} response from the upstream", logging.DEBUG)
        if response.status_code == 101:
            # Nobody asked to switch protocols (upgrades are refused before the request goes out).
            yield commands.CloseConnection(self.conn)
            yield ReceiveHttp(ResponseProtocolError(self.stream_id, "upstream-error", ErrorCode.GENERIC_SERVER_ERROR))
            return
        self.response = response
        yield ReceiveHttp(ResponseHeaders(self.stream_id, self.response, expected_size == 0))
        self.body_reader = _WithoutTrailers(make_body_reader(expected_size))
        self.state = self.read_body
        yield from self.state(event)

    read_headers.__wrapped__ = original
    return read_headers


def response_head_problem(lines: list, cfg: Any) -> str | None:
    """A reason code when a complete response head (its lines, as h11 extracts them) is over a bound, else None."""
    if len(lines) - 1 > cfg.max_response_headers:
        return "response-head-too-large"
    if any(len(line) > cfg.max_response_line for line in lines):
        return "response-line-too-long"
    if sum(len(line) + 2 for line in lines) > cfg.max_response_head:
        return "response-head-too-large"
    return None


def unparsed_problem(data: bytes, reading_head: bool, cfg: Any) -> str | None:
    """A reason code when the bytes an upstream sent that do not parse yet are over a bound, else None.

    While a head is read they are its first lines; while a body is read, what is left is the start of a
    chunk-size line or of the trailer fields (h11's readers take every body byte as it comes)."""
    if not data:
        return None
    lines = data.split(b"\n") if reading_head else data.split(b"\n", 1)[:1]
    if max(len(line) for line in lines) > cfg.max_response_line + 1:  # (+1: the CR before the LF)
        return "response-line-too-long"
    if reading_head and len(lines) - 2 > cfg.max_response_headers:
        return "response-head-too-large"
    if len(data) > cfg.max_response_head:
        return "response-head-too-large"
    return None


def _bounds_of(conn: Any) -> Any:
    """The limit config of the HTTP layer above an upstream connection layer (None: not one of ours). The layer is
    found once per connection; its config is read each time (a reload replaces it)."""
    owner = getattr(conn, "_egresslaw_owner", None)
    if owner is None:
        owner = conn._egresslaw_owner = flowcontrol.owner_of(conn.context) or False
    return owner.limits.config if owner else None


def _refuse_response(conn: Any, reason: str):
    """An upstream's head (or chunk line, or trailers) is over a bound: let go of it, close, answer our 502."""
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers.http import ErrorCode, ResponseProtocolError
    from mitmproxy.proxy.layers.http._base import ReceiveHttp

    conn.buf = type(conn.buf)()
    conn.state = conn.done
    yield commands.CloseConnection(conn.conn)
    if conn.stream_id is not None:
        yield ReceiveHttp(ResponseProtocolError(conn.stream_id, reason, ErrorCode.GENERIC_SERVER_ERROR))


def _wrap_client_event(original):
    def _handle_event(self, event):
        from mitmproxy.proxy import commands, events

        yield from original(self, event)
        # What waits unparsed is bounded as it arrives: each read adds at most 64 KiB to it.
        if isinstance(event, events.DataReceived) and self.buf and self.state not in (self.passthrough, self.done):
            cfg = _bounds_of(self)
            if cfg is None:
                return
            if self.state == self.read_headers or self.state == self.read_body:
                problem = unparsed_problem(bytes(self.buf), self.state == self.read_headers, cfg)
                if problem is not None:
                    yield from _refuse_response(self, problem)
            elif len(self.buf) > cfg.max_response_head:
                # Bytes while nothing is being read (mitmproxy would keep them all): the connection is not reused.
                yield commands.Log(f"{len(self.buf)} unexpected bytes from the upstream, closing", logging.DEBUG)
                self.buf = type(self.buf)()
                self.state = self.done
                yield commands.CloseConnection(self.conn)

    _handle_event.__wrapped__ = original
    return _handle_event


class _WithoutTrailers:
    """A body reader that drops the trailer fields of a chunked response.

    mitmproxy's HTTP/1 reader raises NotImplementedError on response trailers (its connection handler then
    logs a crash and the client waits for a timeout). The addon never passes trailers on anyway.
    """

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    def __call__(self, buf: Any) -> Any:
        import h11

        event = self._reader(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            return h11.EndOfMessage()
        return event

    def read_eof(self) -> Any:
        return self._reader.read_eof()


def _wrap_h2_event(original):
    import h2.events

    def handle_h2_event(self, event):
        # An empty DATA frame that does not end the stream carries nothing; mitmproxy would hand the
        # stream an empty chunk, which a body stream reads as the end of the body (see addon.responseheaders).
        if isinstance(event, h2.events.DataReceived) and not event.data and not event.stream_ended:
            if event.flow_controlled_length:
                self.h2_conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return False
        return (yield from original(self, event))

    handle_h2_event.__wrapped__ = original
    return handle_h2_event


# -- 6. upstream connection reuse -------------------------------------------------------------------

_UNKEYED = object()  # the key of a flow no listener owns: equal to nothing else, so such a flow never shares


def _key_of(layer: Any, event: Any) -> Any:
    try:
        flow = getattr(layer.command_sources.get(event), "flow", None)
        listener = _listener_for(flow) if flow is not None else None
        return listener.reuse_key(flow) if listener is not None else _UNKEYED
    except Exception:
        log.error("internal error while keying an upstream connection (%s)", "listener")
        return object()  # never shared


def _wrap_get_connection(original):
    def get_connection(self, event, *, reuse: bool = True):
        # INVARIANT: the key is on the event before any connection is compared with it, and on a new connection
        # before any command of its opening goes out (no other event is handled in between).
        event._egresslaw_key = _key_of(self, event)
        known = set(self.connections)
        commands = original(self, event, reuse=reuse)
        reply = None
        while True:
            try:
                command = commands.send(reply)
            except StopIteration as stop:
                _tag(self, known, event)
                return stop.value
            _tag(self, known, event)
            reply = yield command

    get_connection.__wrapped__ = original
    return get_connection


def _tag(layer: Any, known: set, event: Any) -> None:
    from mitmproxy.connection import Server

    for connection in layer.connections:
        if connection not in known and isinstance(connection, Server):
            _reuse_keys.setdefault(connection.id, event._egresslaw_key)


def _wrap_spec_matches(original):
    def connection_spec_matches(self, connection) -> bool:
        # An untagged connection (the tunnel's own, never opened for a flow) matches no keyed flow.
        return original(self, connection) and _reuse_keys.get(connection.id, _UNKEYED) == getattr(self, "_egresslaw_key", _UNKEYED)

    connection_spec_matches.__wrapped__ = original
    return connection_spec_matches


# -- 7. requests without a destination ---------------------------------------------------------------


def _wrap_request_headers(original):
    from mitmproxy.proxy.layers.http import ErrorCode, ResponseProtocolError, SendHttp

    def state_wait_for_request_headers(self, event):
        commands = original(self, event)
        reply = None
        while True:
            try:
                command = commands.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(command, SendHttp) and isinstance(command.event, ResponseProtocolError) \
                    and command.event.code == ErrorCode.DESTINATION_UNKNOWN:
                for listener in list(_listeners):
                    try:
                        listener.audit_malformed(self.context.client.peername)  # only the client's own listener audits
                    except Exception:
                        log.error("internal error while auditing a request without a destination (%s)", "listener")
                command = SendHttp(ResponseProtocolError(command.event.stream_id, "malformed-request", command.event.code), command.connection)
            reply = yield command

    state_wait_for_request_headers.__wrapped__ = original
    return state_wait_for_request_headers


# -- 8. inactivity timeouts ----------------------------------------------------------------------------


def timed_out(client_id: str) -> bool:
    """True if mitmproxy's inactivity timeout closed this client connection (not the client)."""
    return client_id in _timed_out


def stalled(client_id: str) -> bool:
    """True if the inactivity timeout closed this client connection while bytes waited for it (it stopped reading)."""
    return client_id in _stalled


def forget_client(client_id: str) -> None:
    _timed_out.discard(client_id)
    _stalled.discard(client_id)


def _wrap_on_timeout(original):
    async def on_timeout(self):
        try:
            _timed_out.add(self.client.id)
            io = self.transports.get(self.client)
            transport = getattr(getattr(io, "writer", None), "transport", None)
            if transport is not None and transport.get_write_buffer_size() > 0:
                _stalled.add(self.client.id)  # the client, not the upstream, is why nothing moved
        except Exception:
            log.error("internal error while noting an inactivity timeout (%s)", "client")
        return await original(self)

    on_timeout.__wrapped__ = original
    return on_timeout


# -- 4. log lines ---------------------------------------------------------------------------------

_QUOTED = re.compile(r"""\bb(['"]).*""", re.S)


class _PeerBytesFilter(logging.Filter):
    """Cut every quoted byte string (`b'…'`) out of mitmproxy's connection log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        if _QUOTED.search(message):
            record.msg = _QUOTED.sub("(peer bytes withheld)", message)
            record.args = ()
        return True


_filter = _PeerBytesFilter()


# -- installation ---------------------------------------------------------------------------------


def install(listener: Listener) -> None:
    """Apply the changes (once per process) and register `listener`; LayerError if mitmproxy is unknown."""
    global _installed
    _listeners.add(listener)
    if _installed:
        return
    try:
        from mitmproxy import version
        from mitmproxy.proxy import server as proxy_server
        from mitmproxy.proxy.layers import http as layer_http
        from mitmproxy.proxy.layers.http import _http1, _http2
    except ImportError as exc:  # pragma: no cover - mitmproxy is a dependency
        raise LayerError(f"cannot import mitmproxy's HTTP layers ({exc.__class__.__name__})") from None
    if version.VERSION.split(".")[0] != SUPPORTED_MAJOR:
        raise LayerError(f"egresslaw adapts mitmproxy {SUPPORTED_MAJOR}.x, not {version.VERSION}")
    needed = {
        "_http1.make_error_response": getattr(_http1, "make_error_response", None),
        "_http2.format_error": getattr(_http2, "format_error", None),
        "HttpStream.handle_protocol_error": getattr(layer_http.HttpStream, "handle_protocol_error", None),
        "HttpStream.check_invalid": getattr(layer_http.HttpStream, "check_invalid", None),
        "Http1Client.read_headers": getattr(_http1.Http1Client, "read_headers", None),
        "Http2Connection.handle_h2_event": getattr(_http2.Http2Connection, "handle_h2_event", None),
        "HttpLayer.get_connection": getattr(layer_http.HttpLayer, "get_connection", None),
        "HttpStream.state_wait_for_request_headers": getattr(layer_http.HttpStream, "state_wait_for_request_headers", None),
        "GetHttpConnection.connection_spec_matches": getattr(layer_http.GetHttpConnection, "connection_spec_matches", None),
        "ConnectionHandler.on_timeout": getattr(proxy_server.ConnectionHandler, "on_timeout", None),
        "Http1Client._handle_event": getattr(_http1.Http1Client, "_handle_event", None),
        "Http2Connection.__init__": getattr(_http2.Http2Connection, "__init__", None),
        "_http2.BufferedH2Connection": getattr(_http2, "BufferedH2Connection", None),
    }
    missing = [name for name, value in needed.items() if not callable(value)]
    if missing:
        raise LayerError(f"mitmproxy {version.VERSION} lacks {', '.join(missing)}")
    _http1.make_error_response = _make_error_response
    _http2.format_error = _format_error
    layer_http.HttpStream.handle_protocol_error = _wrap_protocol_error(layer_http.HttpStream.handle_protocol_error)
    layer_http.HttpStream.check_invalid = _wrap_check_invalid(layer_http.HttpStream.check_invalid)
    _http1.Http1Client.read_headers = _wrap_read_headers(_http1.Http1Client.read_headers)
    _http2.Http2Connection.handle_h2_event = _wrap_h2_event(_http2.Http2Connection.handle_h2_event)
    layer_http.HttpLayer.get_connection = _wrap_get_connection(layer_http.HttpLayer.get_connection)
    layer_http.HttpStream.state_wait_for_request_headers = _wrap_request_headers(layer_http.HttpStream.state_wait_for_request_headers)
    layer_http.GetHttpConnection.connection_spec_matches = _wrap_spec_matches(layer_http.GetHttpConnection.connection_spec_matches)
    proxy_server.ConnectionHandler.on_timeout = _wrap_on_timeout(proxy_server.ConnectionHandler.on_timeout)
    _http1.Http1Client._handle_event = _wrap_client_event(_http1.Http1Client._handle_event)
    flowcontrol.install()
    logging.getLogger(SERVER_LOGGER).addFilter(_filter)
    # hpack logs every header it encodes or decodes at DEBUG, the injected credential included.
    logging.getLogger("hpack").setLevel(max(logging.INFO, logging.getLogger("hpack").level))
    _installed = True
