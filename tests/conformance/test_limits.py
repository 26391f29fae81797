"""Limits, decided before the lease: every class as raw bytes against the real proxy.

Head size, header count and request line (431/414, refused as the bytes arrive, before a lease is looked at);
HTTP/2 DATA frames on GET/HEAD/DELETE/OPTIONS (denied like their HTTP/1 spellings); request bodies (413 for a
declared size over the limit, answered before the body is read; a streamed body cut at the limit so the upstream
never receives a complete request; bodies under the limit arrive whole); the header-read timeout (slowloris and
silent clients); the idle timeout; connection caps per client address and in total. Every denial is checked for
zero upstream bytes and its own audit event. One proxy for the module, started with small limits.

test_limits_process.py runs the proxy as a process for what needs one: the descriptor ceiling and memory.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import time

import pytest

from tests.conformance.conftest import API, conformance_artifact, launch
from tests.conformance.wire import (
    Answer,
    h2_exchange,
    open_socket,
    read_answer,
    tls_client,
)
from tests.egress_proxy import builders as b
from tests.proxy_harness import CANARY, stop_proxy, wait_for

pytestmark = pytest.mark.slow

HEAD, HEADERS, LINE = 4096, 20, 1024
BODY, ISSUES_BODY = 64 * 1024, 8 * 1024
HEADER_TIMEOUT, IDLE_TIMEOUT = 1.0, 3  # the timing tests' header timeout (short_header_timeout) and the module's idle timeout
# The module's own header timeout is long, so a loaded machine never cuts another test's connection, and so a timing
# test's bound (HEADER_TIMEOUT + SLACK) tells the short header timeout apart from it.
MODULE_HEADER_TIMEOUT = 60.0
SLACK = 20  # seconds past a timeout for it to be acted on: a loaded CI machine (2 cores, load 3-5) is slow to schedule
LIMITS = dict(max_head_bytes=HEAD, max_headers=HEADERS, max_request_line=LINE, max_body=BODY, max_body_for=(f"github/issues={ISSUES_BODY}",),
              header_timeout=MODULE_HEADER_TIMEOUT, idle_timeout=IDLE_TIMEOUT)
assert HEADER_TIMEOUT + SLACK < MODULE_HEADER_TIMEOUT and IDLE_TIMEOUT + SLACK < 600  # 600 s: mitmproxy's own tcp_timeout
ZERO = [(0, 0, 0), (0, 0, 0)]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream):
    artifact = conformance_artifact((b.rule("bodyless", API, "/bodyless", ["GET", "HEAD", "DELETE", "OPTIONS"]),))
    p = launch(tmp_path_factory, pki, tls_upstream, http_upstream, name="limits", artifact=artifact, config=LIMITS)
    yield p
    try:
        p.assert_nothing_leaked()
    finally:
        stop_proxy(p)


@pytest.fixture
def short_header_timeout(proxy):
    limits = proxy.addon.limits
    old = limits.config
    limits.config = dataclasses.replace(old, header_timeout=HEADER_TIMEOUT)  # read at each connection and each head
    yield
    limits.config = old


@pytest.fixture
def long_idle_timeout(proxy):
    """mitmproxy's `tcp_timeout` (the idle timeout) is read when a connection is accepted: the test's connections get
    the product's default (300 s), not the module's 3 s, so sockets it holds idle are not cut while a loaded machine
    gets through the test."""
    options = proxy.threaded.edge.master.options
    proxy.threaded.call(lambda: options.update(tcp_timeout=300))
    yield
    proxy.threaded.call(lambda: options.update(tcp_timeout=IDLE_TIMEOUT))


# -- clients --------------------------------------------------------------------------------------


def token(proxy, lease: str | None) -> str | None:
    return proxy.lease(connection="github") if lease == "GH" else proxy.lease(profile="ci") if lease == "CI" else None


def head(method: str, target: str, host: str, lease: str | None, extra: list[str] = ()) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", *extra]
    if lease:
        lines.append(f"Proxy-Authorization: Bearer {lease}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def plain(proxy, wire: bytes, timeout: float = 10) -> Answer:
    with open_socket(proxy.host, proxy.port, timeout) as sock:
        try:
            sock.sendall(wire)
        except OSError:
            pass  # cut before everything was sent: the answer (if any) is still readable
        answer = read_answer(sock)
    proxy.record(answer.raw)
    return answer


def open_tunnel(proxy, alpn: tuple[str, ...] = ("http/1.1",), timeout: float = 10):
    """CONNECT to API with a connection lease; the TLS socket inside it."""
    sock = open_socket(proxy.host, proxy.port, timeout)
    sock.sendall(head("CONNECT", f"{API}:443", f"{API}:443", token(proxy, "GH")))
    assert read_answer(sock, "CONNECT").status == 200
    return tls_client(sock, proxy.ca, API, alpn=alpn)


def tunnel(proxy, send, alpn: tuple[str, ...] = ("http/1.1",)) -> Answer:
    with open_tunnel(proxy, alpn) as tls:
        answer = send(tls)
    proxy.record(answer.raw)
    return answer


def in_tunnel(proxy, wire: bytes) -> Answer:
    def send(tls):
        try:
            tls.sendall(wire)
        except OSError:
            pass
        return read_answer(tls)

    return tunnel(proxy, send)


def h2(proxy, method: str, path: str, extra=(), body: bytes = b"", trailers=()) -> Answer:
    headers = [(":method", method), (":scheme", "https"), (":authority", API), (":path", path), *extra]
    return tunnel(proxy, lambda tls: h2_exchange(tls, headers, body, trailers), alpn=("h2",))


def denied(proxy, mark, answer: Answer, status: int, reason: str, *, upstream=ZERO, head_request: bool = False,
           after_allow: bool = False) -> None:
    """The answer is our JSON refusal, nothing reached the upstreams, and exactly one audit event says why
    (`after_allow`: the request was allowed and written ahead, and its outcome event says why it was cut)."""
    assert answer.status == status, answer
    assert answer.header("x-egresslaw-deny") == reason, answer.headers
    if head_request:
        assert answer.body == b""  # an answer to HEAD has no body
    else:
        assert json.loads(answer.body) == {"error": "egress_denied", "reason": reason, "rule": None}
    if upstream is not None:
        assert proxy.upstream_delta(mark) == upstream, "the upstream saw bytes of a refused request"
    if after_allow:
        [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
        assert (event["decision"], event["told"], event["status"]) == ("allow", reason, status), event
    else:
        assert_audited(proxy, mark, reason, status)


def settle(proxy) -> None:
    """Wait until the upstreams stop reading: a request cut mid-body is read by their threads after the answer."""
    last = None
    while (now := [u.mark() for u in proxy.ups]) != last:
        last = now
        time.sleep(0.3)


def assert_audited(proxy, mark, reason: str, status: int | None) -> None:
    assert wait_for(lambda: any(e.get("reason") == reason for e in proxy.new_events(mark))), proxy.new_events(mark)
    events = [e for e in proxy.new_events(mark) if e.get("reason") == reason]
    assert len(events) == 1, events
    assert events[0]["decision"] == "deny" and events[0]["status"] == status, events[0]


# -- heads ----------------------------------------------------------------------------------------

ABSOLUTE = f"https://{API}/repos/acme/x"
TOO_BIG = {
    "head-too-large": (431, ["X-Big: " + "a" * HEAD]),
    "too-many-headers": (431, [f"X-H{i}: {i}" for i in range(HEADERS + 1)]),
    "request-line-too-long": (414, []),
}


def _target(reason: str, base: str) -> str:
    return base + "?q=" + "a" * LINE if reason == "request-line-too-long" else base


@pytest.mark.parametrize("reason", sorted(TOO_BIG))
def test_head_over_a_limit_is_refused_before_the_lease(proxy, reason):
    # No Proxy-Authorization at all: the answer is the limit's (431/414), not 407 — the head is judged first.
    status, extra = TOO_BIG[reason]
    mark = proxy.mark()
    answer = plain(proxy, head("GET", _target(reason, ABSOLUTE), API, None, extra))
    denied(proxy, mark, answer, status, reason)


@pytest.mark.parametrize("reason", sorted(TOO_BIG))
def test_head_over_a_limit_inside_a_tunnel(proxy, reason):
    status, extra = TOO_BIG[reason]
    mark = proxy.mark()
    answer = in_tunnel(proxy, head("GET", _target(reason, "/repos/acme/x"), API, None, extra + ["Authorization: Bearer client-x"]))
    denied(proxy, mark, answer, status, reason)
    event = [e for e in proxy.new_events(mark) if e.get("reason") == reason][0]
    assert event["connection"] == "github" and event["tunnel"] is True  # the tunnel's lease is known


def test_head_just_under_the_limits_is_served(proxy, tls_upstream):
    # The same kinds of head, one short of each limit, reach the upstream: the limits are where they say.
    extra = [f"X-H{i}: {i}" for i in range(HEADERS - 3)]  # with Host, Proxy-Authorization and X-Big: HEADERS fields
    room = HEAD - len(head("GET", ABSOLUTE, API, token(proxy, "GH"), extra + ["X-Big: "]))
    mark = proxy.mark()
    answer = plain(proxy, head("GET", ABSOLUTE, API, token(proxy, "GH"), extra + ["X-Big: " + "a" * room]))
    assert answer.status == 200, answer
    assert proxy.upstream_delta(mark)[0][2] == 1


@pytest.mark.parametrize(("headers", "reason"), [
    ([(f"x-h{i}", str(i)) for i in range(HEADERS + 1)], "too-many-headers"),
    ([("x-big", "a" * HEAD)], "head-too-large"),
])
def test_h2_head_over_a_limit(proxy, headers, reason):
    mark = proxy.mark()
    answer = h2(proxy, "GET", "/repos/acme/x", headers)
    denied(proxy, mark, answer, 431, reason)


def test_h2_path_over_the_line_limit(proxy):
    mark = proxy.mark()
    denied(proxy, mark, h2(proxy, "GET", "/repos/acme/x?q=" + "a" * LINE), 414, "request-line-too-long")


# -- HTTP/2: DATA frames on bodyless methods --------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE", "OPTIONS"])
def test_h2_data_on_a_bodyless_method_is_denied(proxy, method):
    # HEADERS without END_STREAM, then DATA: no content-length, no transfer-encoding, still a body.
    mark = proxy.mark()
    answer = h2(proxy, method, "/bodyless/x", body=b"smuggled body")
    denied(proxy, mark, answer, 403, "body-on-bodyless-method", head_request=method == "HEAD")


@pytest.mark.parametrize("method", ["GET", "DELETE", "OPTIONS"])
def test_h2_bodyless_method_without_data_is_served(proxy, tls_upstream, method):
    mark = proxy.mark()
    answer = h2(proxy, method, "/bodyless/x")
    assert answer.status == 200, answer
    seen = tls_upstream.raw_requests()[-1]
    assert (seen.method, seen.path, seen.body) == (method, "/bodyless/x", b"")
    assert seen.all("Authorization") == [f"Bearer {CANARY}"]
    assert proxy.upstream_delta(mark)[0][2] == 1


# -- request bodies -------------------------------------------------------------------------------

ISSUES = f"https://{API}/repos/acme/app/issues"


@pytest.mark.parametrize("lease", ["GH", None])
def test_declared_body_over_the_limit_is_answered_before_it_is_sent(proxy, lease):
    # Only the head is sent: the answer must come without the body (a proxy that buffered it would wait forever).
    size = 1 << 30
    mark = proxy.mark()
    answer = plain(proxy, head("POST", ISSUES, API, token(proxy, lease), [f"Content-Length: {size}", "Content-Type: application/json"]), timeout=30)
    if lease:
        denied(proxy, mark, answer, 413, "body-too-large")
    else:
        assert answer.status == 407 and answer.header("x-egresslaw-deny") == "lease-missing", answer
        assert proxy.upstream_delta(mark) == ZERO


def test_refused_body_trickled_in_is_cut_at_the_header_timeout(proxy, short_header_timeout):
    # No lease: 407 at once; the client then trickles its declared body. Each byte would reset the idle timer;
    # the answered request's body may take at most the header timeout.
    with open_socket(proxy.host, proxy.port, timeout=30) as sock:
        sock.sendall(head("POST", ISSUES, API, None, ["Content-Length: 100000"]))
        assert read_answer(sock).status == 407
        started = time.time()
        closed = False
        while time.time() - started < HEADER_TIMEOUT + SLACK + 10 and not closed:
            try:
                sock.sendall(b"x")
                time.sleep(0.25)
            except OSError:
                closed = True
        assert closed and time.time() - started < HEADER_TIMEOUT + SLACK


def test_expect_continue_is_not_sent_for_a_refused_body(proxy):
    wire = head("POST", ISSUES, API, token(proxy, "GH"), [f"Content-Length: {ISSUES_BODY + 1}", "Expect: 100-continue"])
    mark = proxy.mark()
    answer = plain(proxy, wire, timeout=30)
    denied(proxy, mark, answer, 413, "body-too-large")  # not `100 Continue`


def chunked(body: bytes, size: int = 4096) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def test_chunked_body_over_the_limit_is_cut_before_the_upstream_has_a_request(proxy, tls_upstream):
    body = b"x" * (ISSUES_BODY + 4096)
    wire = head("POST", "/repos/acme/app/issues", API, None, ["Transfer-Encoding: chunked", "Content-Type: application/json"]) + chunked(body)
    mark = proxy.mark()
    answer = in_tunnel(proxy, wire)
    assert answer.status == 413 and answer.header("x-egresslaw-deny") == "body-too-large", answer
    assert json.loads(answer.body) == {"error": "egress_denied", "reason": "body-too-large", "rule": None}
    # The head went upstream (the request was allowed and written ahead): the audit says so, and its outcome
    # says the body was cut and what the client got.
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert (event["decision"], event["told"], event["status"]) == ("allow", "body-too-large", 413), event
    (accepts, read, requests), _ = proxy.upstream_delta(mark)
    assert requests == 0, "the upstream received a complete request"
    assert read < ISSUES_BODY + 2048, read  # its head and at most the limit of body (with chunk framing)
    settle(proxy)


def test_h2_body_without_length_over_the_limit_is_refused(proxy):
    mark = proxy.mark()
    answer = h2(proxy, "POST", "/repos/acme/app/issues", [("content-type", "application/json")], body=b"x" * (ISSUES_BODY + 1))
    denied(proxy, mark, answer, 413, "body-too-large", after_allow=True)  # the body is held, so nothing went upstream


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_body_at_the_limit_streams_whole(proxy, tls_upstream, framing):
    body = bytes(range(256)) * (ISSUES_BODY // 256)
    extra = ["Content-Type: application/json"]
    extra.append(f"Content-Length: {len(body)}" if framing == "length" else "Transfer-Encoding: chunked")
    wire = head("POST", "/repos/acme/app/issues", API, None, extra) + (body if framing == "length" else chunked(body, 1000))
    mark = proxy.mark()
    answer = in_tunnel(proxy, wire)
    assert answer.status == 200, answer
    seen = tls_upstream.raw_requests()[-1]
    assert seen.body == body and seen.all("Authorization") == [f"Bearer {CANARY}"]
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]  # the allow, its outcome folded in
    assert event["told"] == "allowed" and event["bytes_up"] == len(body), event


def test_h2_body_streams_with_its_length(proxy, tls_upstream):
    body = b"y" * ISSUES_BODY
    answer = h2(proxy, "POST", "/repos/acme/app/issues", [("content-type", "application/json"), ("content-length", str(len(body)))], body=body)
    assert answer.status == 200, answer
    assert tls_upstream.raw_requests()[-1].body == body


def test_streamed_trailers_are_cut(proxy, tls_upstream):
    mark = proxy.mark()
    answer = h2(proxy, "POST", "/repos/acme/app/issues", [("content-type", "application/json"), ("content-length", "2")], body=b"{}",
                trailers=[("authorization", "Bearer client-trailer")])
    denied(proxy, mark, answer, 403, "trailers-denied", upstream=None, after_allow=True)  # the head went upstream first
    settle(proxy)
    assert proxy.upstream_delta(mark)[0][2] == 0, "the upstream received a complete request"


# -- time -----------------------------------------------------------------------------------------


def drip(sock: socket.socket, first: bytes, every: float, limit: float) -> tuple[bytes, float]:
    """Send `first`, then one header line every `every` seconds, until the proxy closes; (what came back, when)."""
    started = time.time()
    got = b""
    sock.settimeout(every)
    sock.sendall(first)
    while time.time() - started < limit:
        try:
            data = sock.recv(4096)
            if not data:
                break
            got += data
        except TimeoutError:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        except OSError:
            break
    return got, time.time() - started


@pytest.mark.parametrize("where", ["plain", "tunnel"])
def test_slowloris_is_cut_at_the_header_timeout(proxy, short_header_timeout, where):
    mark = proxy.mark()
    first = f"GET {ABSOLUTE} HTTP/1.1\r\nHost: {API}\r\n".encode()
    started = time.time()
    try:
        sock = open_socket(proxy.host, proxy.port) if where == "plain" else open_tunnel(proxy)
    except (ssl.SSLError, OSError):  # a loaded machine: the tunnel's deadline ran out during the TLS handshake
        got, elapsed = b"", time.time() - started
    else:
        with sock:
            got, elapsed = drip(sock, first, 0.25, HEADER_TIMEOUT + SLACK + 10)
    proxy.record(got)
    # the short header timeout, not the module's (60 s), nor mitmproxy's tcp_timeout from the last byte
    assert elapsed < HEADER_TIMEOUT + SLACK, elapsed
    assert proxy.upstream_delta(mark) == ZERO
    if where == "plain":
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert_audited(proxy, mark, "header-timeout", 408)
    else:  # the head's deadline (408) or the tunnel's (CONNECT to its first head; closed, no answer), whichever first
        assert got == b"" or got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert_audited(proxy, mark, "header-timeout", 408 if got else None)


def test_silent_connection_is_closed_at_the_header_timeout(proxy, short_header_timeout):
    mark = proxy.mark()
    with open_socket(proxy.host, proxy.port, timeout=HEADER_TIMEOUT + SLACK + 10) as sock:
        started = time.time()
        got = b""
        while chunk := sock.recv(4096):
            got += chunk
        assert time.time() - started < HEADER_TIMEOUT + SLACK
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert_audited(proxy, mark, "header-timeout", 408)


@pytest.mark.parametrize("handshake", [False, True])
def test_tunnel_without_a_request_is_closed_at_the_header_timeout(proxy, short_header_timeout, handshake):
    # After CONNECT the first request head (TLS handshake included) must come within the header timeout too.
    mark = proxy.mark()
    sock = open_socket(proxy.host, proxy.port, timeout=HEADER_TIMEOUT + SLACK + 10)
    sock.sendall(head("CONNECT", f"{API}:443", f"{API}:443", token(proxy, "GH")))
    assert read_answer(sock, "CONNECT").status == 200
    started = time.time()
    try:
        conn = tls_client(sock, proxy.ca, API) if handshake else sock
        with conn:
            assert conn.recv(4096) == b""
    except (ssl.SSLError, ConnectionResetError):
        pass  # closed during the handshake (a loaded machine), or reset
    assert time.time() - started < HEADER_TIMEOUT + SLACK
    assert proxy.upstream_delta(mark) == ZERO
    assert_audited(proxy, mark, "header-timeout", None)


def test_idle_keep_alive_connection_is_closed_at_the_idle_timeout(proxy):
    with open_socket(proxy.host, proxy.port, timeout=IDLE_TIMEOUT + SLACK + 10) as sock:
        sock.sendall(head("GET", ABSOLUTE, API, token(proxy, "GH")))
        assert read_answer(sock).status == 200
        started = time.time()
        assert sock.recv(4096) == b""  # closed by the proxy, not by our timeout (which would raise)
        assert time.time() - started < IDLE_TIMEOUT + SLACK  # not mitmproxy's own (600 s)


# -- connections ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "status", "reason"), [
    ("max_connections_per_client", 429, "too-many-connections"),
    ("max_connections", 503, "proxy-at-capacity"),
])
def test_connection_cap(proxy, tls_upstream, long_idle_timeout, field, status, reason):
    limits = proxy.addon.limits
    assert wait_for(lambda: limits.open_connections() == 0), limits.open_connections()
    old = limits.config
    held = []
    try:
        limits.config = dataclasses.replace(old, **{field: 2})
        held = [open_socket(proxy.host, proxy.port) for _ in range(2)]
        assert wait_for(lambda: limits.open_connections() == 2)
        mark = proxy.mark()
        with open_socket(proxy.host, proxy.port) as sock:
            try:
                sock.sendall(head("GET", ABSOLUTE, API, token(proxy, "GH")))
            except OSError:
                pass
            answer = read_answer(sock)
        # The JSON answer is written before the close; a client still sending may see the reset first.
        assert answer.status in (status, None), answer
        if answer.status is not None:
            assert answer.header("x-egresslaw-deny") == reason
        assert proxy.upstream_delta(mark) == ZERO
        assert_audited(proxy, mark, reason, status)
        held.pop().close()
        assert wait_for(lambda: limits.open_connections() == 1)
        assert plain(proxy, head("GET", ABSOLUTE, API, token(proxy, "GH"))).status == 200
    finally:
        for sock in held:
            sock.close()
        limits.config = old
