"""Red-team tests of the seams between features (brokering × connection reuse, × the response scan, …).

Each test drives the real proxy from outside (raw bytes, hostile upstreams) and would fail on the bug it
was written for (docs/conformance.md, "Bugs found and fixed").
"""

from __future__ import annotations

import base64
import ssl

import pytest

from egress_proxy.custody.secret import encodings_of
from tests.conformance import hostile
from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    WORKSPACE,
    ScriptedResolver,
    free_port,
    make_env,
    seal,
    start_proxy,
    stop_proxy,
    wait_for,
)

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"  # the HTTP/1 hostile upstream
H2 = "other.acme-test.dev"  # the HTTP/2 hostile upstream
UPLOAD_CAP = 1024  # --max-body-for github/upload: the connection's rule, which the profile `ci` brokers
BASIC_TOKEN = "ghs_BasicTokenCanary0123456789abcd"
BASIC_SECRET = base64.b64encode(f"x-access-token:{BASIC_TOKEN}".encode()).decode()  # what custody holds, as GitHub's git wants


def _artifact():
    github = b.connection("github", [b.rule("brok", H2, "/h2/brok", ["GET"]), b.rule("h1", API, "/h/brok", ["GET"]),
                                        b.rule("upload", API, "/h/upload", ["POST"], ["content-type"])], credential="gh-prod")
    basic = b.connection("gitbasic", [b.rule("decoded", API, "/h/decoded", ["GET"])], credential="gh-basic", inject_format="Basic {secret}")
    return b.artifact(connections=[github, basic], profiles=[b.profile("ci", [(API, 443), (H2, 443)], brokers=("github", "gitbasic"))],
                      workspace=WORKSPACE)


def _put(env, handle: str, connection: str, value: bytes) -> None:
    seal(env.store, env.keys, connection, handle, value)


class HoldingH2(hostile.HostileH2):
    """HostileH2, except that a stream whose path holds `/hold` is answered only after the next stream on its connection."""

    def _answer(self, h2c, stream: int, path: str, token: bytes) -> None:
        held = self.__dict__.setdefault("held", {}).setdefault(id(h2c), [])
        if "/hold" in path:
            held.append((stream, path, token))
            return
        super()._answer(h2c, stream, path, token)
        while held:
            super()._answer(h2c, *held.pop(0))


class DecodingHttp1(hostile.HostileHttp1):
    """HostileHttp1, except that `/h/decoded…` echoes what a Basic credential decodes to, as servers that greet the
    authenticated user do: `user:password`, the password alone, and the user."""

    def answer(self, conn, path: str, token: bytes) -> bool:
        if "/decoded" not in path:
            return super().answer(conn, path, token)
        user, _, password = base64.b64decode(token.removeprefix(b"Basic ")).partition(b":")
        body = b'{"login": "' + user + b':' + password + b'", "token": "' + password + b'", "b64": "' + base64.b64encode(password) + b'"}'
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Token: " + password + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True


@pytest.fixture(scope="module")
def upstreams(pki):
    h1, h2 = DecodingHttp1()._start(pki, "http/1.1"), HoldingH2()._start(pki, "h2")
    yield h1, h2
    h1.stop()
    h2.stop()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, upstreams):
    h1, h2 = upstreams
    env = make_env(tmp_path_factory.mktemp("seams"), artifact=_artifact())
    _put(env, "gh-basic", "gitbasic", BASIC_SECRET.encode())
    connect_to = [f"{API}:443:127.0.0.1:{h1.port}", f"{H2}:443:127.0.0.1:{h2.port}"]
    p = start_proxy(env, pki, (), connect_to, listen=free_port(), resolver=ScriptedResolver(),
                    config={"max_body_for": (f"github/upload={UPLOAD_CAP}",)})
    yield p
    try:
        p.assert_nothing_leaked()
        basic = encodings_of(BASIC_TOKEN.encode()) + encodings_of(BASIC_SECRET.encode())
        for where, blob in [("the audit log", p.audit_bytes()), ("the proxy logs", p.logs.text().encode()), *(("a client", s) for s in p.seen)]:
            assert not [n for n in basic if n in blob], f"the brokered Basic credential in {where}"
    finally:
        stop_proxy(p)


def _tunnel(proxy, host: str, lease: str, alpn=("http/1.1",)) -> ssl.SSLSocket:
    sock = open_socket(proxy.host, proxy.port)
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    return tls_client(sock, proxy.ca, host, alpn)


def _h2_streams(tls: ssl.SSLSocket, requests: list[list[tuple[str, str]]], between=None) -> dict[int, tuple[int | None, bytes]]:
    """Send the requests (all HEADERS in one write; with `between`, one at a time, calling it after each), read every
    answer: stream id -> (status, body)."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    ids = []
    for headers in requests:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, headers, end_stream=True)
        ids.append(sid)
        if between is not None:
            tls.sendall(conn.data_to_send())
            between(len(ids))
    tls.sendall(conn.data_to_send())
    out: dict[int, list] = {sid: [None, b""] for sid in ids}
    done: set[int] = set()
    tls.settimeout(10)
    while len(done) < len(ids):
        try:
            data = tls.recv(65536)
        except (OSError, ssl.SSLError):
            break
        if not data:
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                out[event.stream_id][0] = int(dict(event.headers)[":status"])
            elif isinstance(event, h2.events.DataReceived):
                out[event.stream_id][1] += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                done.add(event.stream_id)
        pending = conn.data_to_send()
        if pending:
            tls.sendall(pending)
    return {sid: (v[0], v[1]) for sid, v in out.items()}


def test_h2_an_upstream_connection_carrying_the_brokered_credential_never_carries_plain_traffic(proxy, upstreams):
    """Concurrent HTTP/2 streams of one client: a brokered one (credential) and plain ones (none) must not share an
    upstream connection (found: the plain streams rode the credentialed connection, noted only at its response)."""
    _, h2 = upstreams
    lease = proxy.lease(profile="ci", subject="sandbox-h2")
    with h2.lock:
        before = len(h2.requests)
    with _tunnel(proxy, H2, lease, alpn=("h2",)) as tls:
        def req(path):
            return [(":method", "GET"), (":scheme", "https"), (":authority", H2), (":path", path)]

        def arrived(n):
            assert wait_for(lambda: len(h2.requests) >= before + n), "the upstream never got the request"

        answers = _h2_streams(tls, [req("/h2/brok/hold"), req("/h2/plain/1"), req("/h2/plain/2"), req("/h2/brok/2")], between=arrived)
    for status, body in answers.values():
        proxy.record(body)
        assert status == 200
    with h2.lock:
        seen = h2.requests[before:]
    assert sorted(p for _, p, _ in seen) == ["/h2/brok/2", "/h2/brok/hold", "/h2/plain/1", "/h2/plain/2"]
    by_conn: dict[int, set[bool]] = {}
    for number, path, auth in seen:
        assert bool(auth) == path.startswith("/h2/brok"), (path, bool(auth))
        by_conn.setdefault(number, set()).add(bool(auth))
    assert all(len(kinds) == 1 for kinds in by_conn.values()), f"an upstream connection carried both: {seen}"


def test_a_brokered_basic_credential_is_redacted_in_its_decoded_forms(proxy, upstreams):
    """Custody holds base64(`x-access-token:TOKEN`) for `Basic {secret}` (GitHub's git endpoint); an upstream that
    echoes what it decodes to (`x-access-token:TOKEN`, the TOKEN) must show the sandbox neither (found: only the
    base64 value and its encodings were needles, so the token itself went through)."""
    h1, _ = upstreams
    lease = proxy.lease(profile="ci", subject="sandbox-basic")
    with _tunnel(proxy, API, lease) as tls:
        tls.sendall(f"GET /h/decoded HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
        shown = hostile.read_response(tls)
    proxy.record(shown.raw)
    assert shown.status == 200 and shown.complete
    assert h1.seen("/h/decoded")[-1][2] == f"Basic {BASIC_SECRET}"  # the brokered credential went upstream
    for needle in encodings_of(BASIC_TOKEN.encode()):
        assert needle not in shown.raw, "the decoded Basic token reached the sandbox"
    assert b"[REDACTED]" in shown.body and shown.header("x-token") == "[REDACTED]"


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_brokered_request_body_is_held_to_its_connection_rules_limit(proxy, upstreams, framing):
    """`--max-body-for CONNECTION/RULE` caps that rule's uploads, also when a profile's request is brokered under it (found:
    the limit was looked up as PROFILE/RULE, so brokering a rule lifted its cap)."""
    h1, _ = upstreams
    body = b"x" * (UPLOAD_CAP * 4)
    lease = proxy.lease(profile="ci", subject="sandbox-upload")
    framed = (f"Content-Length: {len(body)}\r\n\r\n".encode() + body if framing == "length"
              else b"Transfer-Encoding: chunked\r\n\r\n" + hostile.chunked(body, 512))
    mark = proxy.mark()
    with _tunnel(proxy, API, lease) as tls:
        tls.sendall(f"POST /h/upload/{framing} HTTP/1.1\r\nHost: {API}\r\nContent-Type: text/plain\r\n".encode() + framed)
        shown = hostile.read_response(tls)
    proxy.record(shown.raw)
    assert shown.status == 413 and shown.header("x-egresslaw-deny") == "body-too-large"
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert event["told"] == "body-too-large" and event["status"] == 413
    if framing == "length":
        assert not h1.seen(f"/h/upload/{framing}")  # refused on its declared length: nothing went upstream


@pytest.mark.parametrize("wire", [
    b"GET /h/x HTTP/1.1\r\n\r\n",  # origin-form to the proxy, no Host: mitmproxy knows no destination
    b"GET /h/x HTTP/1.1\r\nHost: a b\r\n\r\n",  # a Host that is no authority
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # the HTTP/2 preface in the clear (h2c prior knowledge)
], ids=["no-host", "bad-host", "h2c-preface"])
def test_a_request_mitmproxy_answers_without_any_hook_is_still_audited(proxy, wire):
    """mitmproxy answers an origin-form request it finds no destination for with its own 400, before any hook and
    without a log line (found: no audit event at all for an answer the client got)."""
    mark = proxy.mark()
    with open_socket(proxy.host, proxy.port) as sock:
        sock.sendall(wire.replace(b"\r\n", f"\r\nProxy-Authorization: Bearer {proxy.lease(profile='ci')}\r\n".encode(), 1))
        answer = hostile.read_response(sock)
    proxy.record(answer.raw)
    assert answer.status == 400 and answer.header("x-egresslaw-deny") == "malformed-request"
    assert wait_for(lambda: proxy.new_events(mark)), "no audit event for the 400"
    [event] = proxy.new_events(mark)
    assert (event["kind"], event["decision"], event["reason"], event["status"]) == ("request", "deny", "malformed-request", 400)
