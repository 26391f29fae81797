"""Second red-team pass over the response path and the audit (docs/conformance.md, items 20 on).

Hostile upstreams script raw answers from the credential they received; the client side reads raw bytes (HTTP/1) or
decodes every HTTP/2 event, trailers included, so a header an HPACK encoder compressed is still seen.
"""

from __future__ import annotations

import base64
import json

import pytest

from egress_proxy.custody.secret import encodings_of
from tests.conformance import hostile
from tests.conformance.test_seams import _put
from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    CANARY,
    WORKSPACE,
    ScriptedResolver,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
    wait_for,
)

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"  # the scripted HTTP/1 upstream
H2 = "other.acme-test.dev"  # the scripted HTTP/2 upstream
NEEDLES = encodings_of(CANARY.encode())


def leaks(blob: bytes) -> list[bytes]:
    return [n for n in (*NEEDLES, CANARY[:12].encode(), CANARY[-12:].encode()) if n in blob]


class ScriptedHttp1(hostile.HostileHttp1):
    """`/s/<name>`: the raw answer SCRIPTS[name](token); anything else as HostileHttp1."""

    def answer(self, conn, path: str, token: bytes) -> bool:
        name = path.strip("/").split("/")[1] if path.startswith("/s/") else None
        if name == "held":  # the head and a first chunk, then nothing until the proxy goes away
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + hostile.chunked(token + b"x" * 4000, 4096)[:-5])
            conn.settimeout(8)
            while conn.recv(65536):
                pass
            return False
        if name not in SCRIPTS:
            return super().answer(conn, path, token)
        conn.sendall(SCRIPTS[name](token))
        return True  # the connection stays open


def every_character(token: bytes) -> list[bytes]:
    """The credential with every character escaped, as obfuscating URL and HTML encoders write it."""
    return [b"".join(b"%%%02X" % c for c in token), b"".join(b"%%%02x" % c for c in token), b"".join(b"&#%d;" % c for c in token),
            b"".join(b"&#x%x;" % c for c in token), b"".join(b"&#x%X;" % c for c in token)]


def _every_character_answer(token: bytes) -> bytes:
    forms = every_character(token)
    body = b'{"link": "https://x.test/?t=' + forms[0] + b'", "html": "<a title=\'' + b"".join(forms[2:]) + b'\'>", "low": "' + forms[1] + b'"}'
    head = b"HTTP/1.1 302 Found\r\nLocation: https://x.test/cb?code=" + forms[1] + b"\r\nX-Html: " + forms[3]
    return head + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


FORGED = {  # a forged `X-Egresslaw-Deny` behind a bare CR (many clients end a line there) or an obs-fold
    "bare-cr": b"HTTP/1.1 200 OK\r\nX-Echo: a\rX-Egresslaw-Deny: forged\r\nContent-Length: 2\r\n\r\n{}",
    "bare-cr-reason": b"HTTP/1.1 200 OK\rX-Egresslaw-Deny: forged\r\nContent-Length: 2\r\n\r\n{}",
    "obs-fold": b"HTTP/1.1 200 OK\r\nX-Echo: a\r\n X-Egresslaw-Deny: forged\r\nContent-Length: 2\r\n\r\n{}",
    "bare-cr-streamed": b"HTTP/1.1 200 OK\r\nX-Echo: a\rX-Egresslaw-Deny: forged\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
}


def overlapped(token: bytes) -> bytes:
    """The credential's unpadded base64 (which ends in the credential's first character), then the credential from its
    second character on: the plain credential starts inside its base64 form."""
    b64 = base64.b64encode(token).rstrip(b"=")
    assert b64[-1:] == token[:1], "the canary's base64 must end in its first character"
    return b64 + token[1:]


def _overlapped_answer(framing: str):
    def answer(token: bytes) -> bytes:
        body = b'{"echo": "' + overlapped(token) + b'"}'
        head = b"HTTP/1.1 200 OK\r\nX-Echo: " + overlapped(token) + b"\r\n"
        if framing == "length":
            return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + hostile.chunked(body, 5)
    return answer


SCRIPTS = {
    "overlapped-length": _overlapped_answer("length"),
    "overlapped-chunked": _overlapped_answer("chunked"),
    **{f"forged-{name}": (lambda t, raw=raw: raw) for name, raw in FORGED.items()},
    "every-character": _every_character_answer,
}


SPACED_TOKEN = "ghs_SpacedCanary0123456789abcdefgh"
SPACED_SECRET = SPACED_TOKEN + " "  # as custody keeps it: `put` strips one trailing newline, any other whitespace is kept


def _artifact():
    github = b.connection("github", [b.rule("s", API, "/s", ["GET", "HEAD", "POST"], ["content-type"]), b.rule("h2", H2, "/h2", ["GET"])],
                          credential="gh-prod")
    spaced = b.connection("spaced", [b.rule("w", API, "/w", ["GET"])], credential="gh-spaced")
    return b.artifact(connections=[github, spaced], profiles=[b.profile("ci", [(API, 443), (H2, 443)])], workspace=WORKSPACE)


@pytest.fixture(scope="module")
def upstreams(pki):
    h1, h2 = ScriptedHttp1()._start(pki, "http/1.1"), hostile.HostileH2()._start(pki, "h2")
    yield h1, h2
    h1.stop()
    h2.stop()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, upstreams):
    h1, h2 = upstreams
    env = make_env(tmp_path_factory.mktemp("seams2"), artifact=_artifact())
    _put(env, "gh-spaced", "spaced", SPACED_SECRET.encode())
    connect_to = [f"{API}:443:127.0.0.1:{h1.port}", f"{H2}:443:127.0.0.1:{h2.port}"]
    p = start_proxy(env, pki, (), connect_to, listen=free_port(), resolver=ScriptedResolver(), extra_options={"tcp_timeout": 5})
    yield p
    try:
        p.assert_nothing_leaked()
        spaced = encodings_of(SPACED_TOKEN.encode())
        for where, blob in [("the audit log", p.audit_bytes()), ("the proxy logs", p.logs.text().encode()), *(("a client", s) for s in p.seen)]:
            assert not [n for n in spaced if n in blob], f"the credential custody keeps with a trailing space in {where}"
    finally:
        stop_proxy(p)


def _tunnel(proxy, host: str = API, alpn=("http/1.1",), lease: str | None = None):
    sock = open_socket(proxy.host, proxy.port)
    lease = lease or proxy.lease(connection="github")
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    return tls_client(sock, proxy.ca, host, alpn)


def _get(proxy, path: str, lease: str | None = None) -> hostile.Shown:
    """One GET in a tunnel to the HTTP/1 upstream: the raw answer, recorded for the leak scan."""
    with _tunnel(proxy, lease=lease) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
        shown = hostile.read_response(tls)
    proxy.record(shown.raw)
    return shown


def _h2_all(tls, path: str) -> tuple[int | None, list, bytes, list, str | None]:
    """One HTTP/2 GET: status, headers, body, trailers (every event decoded), how it ended."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", H2), (":path", path)], end_stream=True)
    tls.sendall(conn.data_to_send())
    status, headers, body, trailers, end = None, [], b"", [], None
    tls.settimeout(10)
    while end is None:
        try:
            data = tls.recv(65536)
        except (OSError, TimeoutError) as exc:
            end = exc.__class__.__name__
            break
        if not data:
            end = "closed"
            break
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.ResponseReceived):
                headers = list(event.headers)
                status = int(dict(headers)[b":status"])
            elif isinstance(event, h2.events.TrailersReceived):
                trailers = list(event.headers)
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                end = "ended"
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                end = "reset"
        if conn.data_to_send():
            tls.sendall(conn.data_to_send())
    return status, headers, body, trailers, end


def test_http2_response_trailers_of_a_streamed_answer_never_reach_the_client(proxy, upstreams):
    """An HTTP/2 upstream sends a body, then trailers holding the credential; the client speaks HTTP/2 too (found:
    the trailers of a streamed answer went to the client unredacted, after the `response` hook that drops them for
    buffered answers; the earlier test read the HPACK-coded bytes, where the value is Huffman-coded)."""
    _, h2 = upstreams
    mark = proxy.mark()
    with _tunnel(proxy, H2, ("h2",)) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        status, headers, body, trailers, end = _h2_all(tls, "/h2/trailers")
    seen = repr((headers, trailers)).encode() + body
    proxy.record(seen)
    assert h2.seen("/h2/trailers")[-1][2] == f"Bearer {CANARY}"  # the credential went upstream, so the trailers held it
    assert (status, body, end) == (200, b"{}", "ended")
    assert not leaks(seen), "the credential in HTTP/2 trailers reached the client"
    assert trailers == []
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert (event["decision"], event["status"]) == ("allow", 200)


def test_the_credential_url_or_html_escaped_character_by_character_is_redacted(proxy, upstreams):
    """The README claims URL- and HTML-escaped copies are redacted; an encoder that escapes every character writes
    `%67%68…` or `&#103;&#104;…`, which a browser or URL decoder turns back into the credential (found: only the forms
    Python's `quote` and `html.escape` write were needles, and they leave letters and digits alone)."""
    mark = proxy.mark()
    shown = _get(proxy, "/s/every-character")
    assert shown.status == 302 and shown.complete
    assert not [form for form in every_character(CANARY.encode()) if form in shown.raw], "an escaped credential reached the client"
    assert shown.header("location") == "https://x.test/cb?code=[REDACTED]" and shown.header("x-html") == "[REDACTED]"
    assert shown.body.count(b"[REDACTED]") == 5
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert (event["status"], event["redactions"]) == (302, 7)


@pytest.mark.parametrize("name", sorted(FORGED))
@pytest.mark.parametrize("kind", ["connection", "profile"])
def test_a_forged_egresslaw_header_behind_a_bare_cr_or_a_fold_never_reaches_a_client(proxy, name, kind):
    """`X-Egresslaw-*` from an upstream is stripped; one hidden behind a bare CR inside a header value or the reason
    phrase, or an obs-fold, was passed on as sent (found), and Python's http.client (requests, urllib3) ends a header
    line at a bare CR: it read the forged `X-Egresslaw-Deny`. Such bytes now become SP (RFC 9112 §2.2, §5.2)."""
    import http.client
    import io

    lease = proxy.lease(connection="github") if kind == "connection" else proxy.lease(profile="ci")
    mark = proxy.mark()
    shown = _get(proxy, f"/s/forged-{name}", lease=lease)
    assert shown.status == 200 and shown.body == b"{}"
    head = shown.raw.split(b"\r\n\r\n", 1)[0]
    assert b"\r" not in head.replace(b"\r\n", b"") and b"\n " not in head, f"a bare CR or a fold reached the client: {head!r}"

    class Raw:  # what Python's http.client (requests, urllib3) makes of those bytes
        def makefile(self, *args, **kwargs):
            return io.BytesIO(shown.raw)

    parsed = http.client.HTTPResponse(Raw())
    parsed.begin()
    assert parsed.getheader("x-egresslaw-deny") is None, f"a client read a forged header: {parsed.getheaders()}"
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert (event["decision"], event["status"]) == ("allow", 200)


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_the_credential_starting_inside_another_encoding_of_it_is_redacted_whole(proxy, framing):
    """An upstream writes the credential's base64 (ending in `g`) and then `hp_…`: the plain credential `ghp_…` starts
    inside the base64 one (found: leftmost-first redaction replaced the base64 and showed the client all of the plain
    credential but its first character). Overlapping occurrences are now one span."""
    mark = proxy.mark()
    shown = _get(proxy, f"/s/overlapped-{framing}")
    assert shown.status == 200 and shown.complete
    assert not leaks(shown.raw) and CANARY[1:].encode() not in shown.raw, "the credential (but its first character) reached the client"
    assert shown.body == b'{"echo": "[REDACTED]"}' and shown.header("x-echo") == "[REDACTED]"
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert (event["status"], event["redactions"]) == (200, 2)


def test_a_credential_kept_with_trailing_whitespace_is_redacted_as_the_upstream_reads_it(proxy, upstreams):
    """Custody keeps a secret's trailing whitespace (only one newline is stripped at `put`); injected as `Bearer {secret}`
    it ends the header value, where every HTTP server strips it, so an upstream echoes the credential without it (found:
    the needles were the stored value's, space included, and the echo reached the client whole)."""
    h1, _ = upstreams
    shown = _get(proxy, "/w/echo", lease=proxy.lease(connection="spaced"))
    assert h1.seen("/w/echo")[-1][2] == f"Bearer {SPACED_TOKEN}"  # what the upstream read (the trailing space stripped)
    assert shown.status == 200 and shown.complete
    assert not [n for n in encodings_of(SPACED_TOKEN.encode()) if n in shown.raw], "the credential reached the client"
    assert json.loads(shown.body)["token"] == "[REDACTED]"


@pytest.mark.parametrize("how", ["http1-close", "h2-reset", "h2-close"])
def test_a_client_that_leaves_during_a_streamed_answer_is_audited_as_such(proxy, how):
    """The client reads the head of a streamed answer and leaves (closes its connection, or resets its HTTP/2 stream)
    while the upstream is still sending: the outcome's `failure` is `client-disconnected` (found: `upstream-error`,
    which says the upstream failed, on an upstream that did nothing wrong)."""
    import h2.config
    import h2.connection
    import h2.events

    mark = proxy.mark()
    tls = _tunnel(proxy, alpn=("http/1.1",) if how == "http1-close" else ("h2",))
    try:
        tls.settimeout(10)
        if how == "http1-close":
            tls.sendall(f"GET /s/held HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += tls.recv(65536)
            proxy.record(head)
            assert head.startswith(b"HTTP/1.1 200 ")
        else:
            conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/s/held")], end_stream=True)
            tls.sendall(conn.data_to_send())
            while not any(isinstance(e, h2.events.ResponseReceived) for e in conn.receive_data(tls.recv(65536))):
                pass
            if how == "h2-reset":
                conn.reset_stream(sid, 8)  # CANCEL
                tls.sendall(conn.data_to_send())
                assert wait_for(lambda: [e for e in proxy.settled(mark, timeout=0) if e["kind"] == "request" and e["outcome"]])
    finally:
        tls.close()
    [event] = [e for e in proxy.settled(mark) if e["kind"] == "request"]
    assert (event["status"], event["aborted"], event["failure"]) == (200, True, "client-disconnected"), event
