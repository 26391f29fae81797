"""The response path against hostile upstreams (tests/conformance/hostile.py), raw bytes on both sides.

For every class of answer — the credential echoed under every transfer and content coding, an answer cut
or malformed in its status line, head, a header line, a chunk header (HTTP/1) or carrying an illegal
header value (HTTP/2), interim answers followed by a late final one, stray bytes, a 101, caps — check:
no byte of the credential (or any encoding or fragment of it) in anything the client is shown, and the
audit event's status is the status the client actually got (None when it got no head at all).
"""

from __future__ import annotations

import json
import time

import pytest

from egress_proxy.custody.secret import encodings_of
from tests.conformance import hostile
from tests.conformance.conftest import conformance_artifact, launch
from tests.conformance.wire import h2_exchange, open_socket, read_answer, tls_client
from tests.egress_proxy import builders as b
from tests.proxy_harness import CANARY, assert_no_canary, stop_proxy

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"
H2_HOST = "other.acme-test.dev"
NEEDLES = encodings_of(CANARY.encode())
BULK_CAP = 64 * 1024


@pytest.fixture(scope="module")
def upstreams(pki):
    h1, h2 = hostile.start_http1(pki), hostile.start_h2(pki)
    yield h1, h2
    h1.stop()
    h2.stop()


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream, upstreams):
    art = conformance_artifact()
    extra = [b.rule("hostile", API, "/h", ["GET"], ["accept-encoding"]), b.rule("bulk", API, "/bulk", ["GET"])]
    art = b.artifact(connections=[b.connection("github", [*art.connections[0].rules, *extra], credential="gh-prod")],
                     profiles=list(art.sandbox_profiles), workspace=art.workspace)
    h1, h2 = upstreams
    p = launch(tmp_path_factory, pki, tls_upstream, http_upstream, name="responses", artifact=art, tls_to={API: h1.port, H2_HOST: h2.port},
               extra_options={"egresslaw_rule_max_response": [f"github/bulk={BULK_CAP // 1024}k"], "egresslaw_max_decoded": "4m", "tcp_timeout": 5})
    yield p
    try:
        p.assert_nothing_leaked()
    finally:
        stop_proxy(p)


# -- clients --------------------------------------------------------------------------------------


def lease(proxy, kind: str) -> str:
    return proxy.lease(connection="github") if kind == "GH" else proxy.lease(profile="ci")


def absolute_on(proxy, sock, path: str, kind: str = "GH") -> hostile.Shown:
    sock.sendall(f"GET https://{API}{path} HTTP/1.1\r\nHost: {API}\r\nAccept-Encoding: gzip, br, zstd, deflate\r\n"
                 f"Proxy-Authorization: Bearer {lease(proxy, kind)}\r\n\r\n".encode())
    shown = hostile.read_response(sock)
    proxy.record(shown.raw)
    return shown


def absolute(proxy, path: str, kind: str = "GH") -> hostile.Shown:
    with open_socket(proxy.host, proxy.port) as sock:
        return absolute_on(proxy, sock, path, kind)


def open_tunnel(proxy, host: str = API, kind: str = "GH", alpn=("http/1.1",)):
    sock = open_socket(proxy.host, proxy.port)
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Bearer {lease(proxy, kind)}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    return tls_client(sock, proxy.ca, host, alpn)


def tunnel_on(proxy, tls, path: str) -> hostile.Shown:
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {API}\r\nAccept-Encoding: gzip, br, zstd, deflate\r\n\r\n".encode())
    shown = hostile.read_response(tls)
    proxy.record(shown.raw)
    return shown


def tunnel(proxy, path: str) -> hostile.Shown:
    with open_tunnel(proxy) as tls:
        return tunnel_on(proxy, tls, path)


TRANSPORTS = {"absolute": absolute, "tunnel": tunnel}


def event_for(proxy, mark, path: str, timeout: float = 8.0) -> dict:
    """The request's decision event with its outcome folded in (status, bytes, redactions, failure: what the client got)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in proxy.settled(mark) if e["kind"] == "request" and e.get("path") == path]
        if found:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no audit event for {path}: {proxy.new_events(mark)}")


def no_leak(shown_raw: bytes, where: str) -> None:
    assert_no_canary(shown_raw, where)
    assert CANARY[:12].encode() not in shown_raw and CANARY[-12:].encode() not in shown_raw, f"a fragment of the credential in {where}"


def redacted_echo() -> dict:
    return {"echo": ["[REDACTED]"] * len(NEEDLES), "plain": "[REDACTED]"}


# -- 1. every transfer and content coding ----------------------------------------------------------

CODINGS = ["none", "gzip", "deflate", "rawdeflate", "br", "zstd", "gzip+br", "br+gzip", "gzip+gzip", "zstd+deflate"]


@pytest.mark.parametrize("codings", CODINGS)
@pytest.mark.parametrize("framing", hostile.FRAMINGS)
def test_echo_under_every_coding_is_decoded_and_redacted(proxy, framing, codings):
    path = f"/h/code/{framing}/{codings}"
    mark = proxy.mark()
    shown = tunnel(proxy, path)
    no_leak(shown.raw, path)
    assert shown.status == 200 and shown.complete, (shown.status, shown.raw[:300])
    assert json.loads(shown.body) == redacted_echo()
    assert shown.header("x-echo") == "[REDACTED]"
    assert b"HTTP/1.1 200 OK [REDACTED]\r\n" in shown.raw
    # decoded: no coding left; a small declared body is buffered and re-framed, anything else streams chunked
    assert shown.header("content-encoding") is None and shown.header("content-length") in (None, str(len(shown.body)))
    event = event_for(proxy, mark, path)
    assert (event["decision"], event["status"], event["redactions"]) == ("allow", 200, len(NEEDLES) + 3)
    assert event["bytes_down"] == len(shown.body)


@pytest.mark.parametrize("framing,codings", [("gzip-chunked", "br"), ("close", "gzip"), ("gzip-close", "none"), ("length", "zstd")])
def test_echo_in_absolute_form_too(proxy, framing, codings):
    path = f"/h/code/{framing}/{codings}"
    mark = proxy.mark()
    shown = absolute(proxy, path)
    no_leak(shown.raw, path)
    assert shown.status == 200 and shown.complete and json.loads(shown.body) == redacted_echo()
    assert event_for(proxy, mark, path)["status"] == 200


def test_an_http10_client_gets_a_close_delimited_body(proxy):
    path = "/h/code/gzip-chunked/br"
    with open_socket(proxy.host, proxy.port) as sock:
        sock.sendall(f"GET https://{API}{path} HTTP/1.0\r\nHost: {API}\r\nProxy-Authorization: Bearer {lease(proxy, 'GH')}\r\n\r\n".encode())
        shown = hostile.read_response(sock)
    proxy.record(shown.raw)
    no_leak(shown.raw, "an HTTP/1.0 exchange")
    assert shown.status == 200 and shown.header("transfer-encoding") is None and shown.closed
    assert json.loads(shown.body) == redacted_echo()


@pytest.mark.parametrize("framing,codings", [("compress-chunked", "none"), ("length", "x-custom"), ("chunked", "gzip+x-custom")])
def test_an_unknown_coding_is_refused_never_passed_on(proxy, framing, codings):
    path = f"/h/code/{framing}/{codings}"
    mark = proxy.mark()
    shown = tunnel(proxy, path)
    no_leak(shown.raw, path)
    assert shown.status == 502 and json.loads(shown.body) == {"error": "upstream_error", "reason": "response-coding-unsupported"}
    event = event_for(proxy, mark, path)
    assert (event["decision"], event["told"], event["status"]) == ("allow", "response-coding-unsupported", 502)


# -- 2. answers cut or malformed ------------------------------------------------------------------

def broken(proxy, transport: str, where: str) -> tuple[hostile.Shown, dict]:
    """What the client is shown for an answer broken at `where`, checked for leaks, and its audit event."""
    path = f"/h/cut/{where}"
    mark = proxy.mark()
    shown = TRANSPORTS[transport](proxy, path)
    no_leak(shown.raw, f"{where} over {transport}")
    return shown, event_for(proxy, mark, path)


HEAD_STAGE = ["status-line", "bad-status", "mid-head", "mid-header", "bad-header", "cl-and-te", "short-length"]  # short: buffered
BODY_STAGE = ["bad-chunk-header", "mid-chunk-header", "mid-chunk", "long-length"]


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("where", HEAD_STAGE)
def test_a_broken_head_gets_our_json_never_the_upstream_bytes(proxy, transport, where):
    shown, event = broken(proxy, transport, where)
    assert shown.status == 502, shown.raw[:400]
    assert json.loads(shown.body) == {"error": "upstream_error", "reason": "upstream-error"}
    assert shown.header("x-egresslaw-deny") == "upstream-error"
    assert (event["decision"], event["told"], event["status"]) == ("allow", "upstream-error", 502)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("where", BODY_STAGE)
def test_a_body_broken_after_the_head_cuts_the_client_off(proxy, transport, where):
    shown, event = broken(proxy, transport, where)
    # The head went out before the body broke: the client sees it, then a connection closed mid-body.
    assert shown.status == 200 and not shown.complete and shown.closed, shown.raw[:400]
    assert shown.body == b""  # the 20 credential bytes that did arrive were held back, never shown
    assert (event["decision"], event["told"], event["status"], event["aborted"]) == ("allow", "upstream-error", 200, True)


def test_a_switch_nobody_asked_for_and_stray_bytes(proxy):
    mark = proxy.mark()
    shown = tunnel(proxy, "/h/switch")
    no_leak(shown.raw, "a 101")
    assert shown.status == 502 and json.loads(shown.body)["reason"] == "upstream-error"
    assert event_for(proxy, mark, "/h/switch")["status"] == 502
    shown = tunnel(proxy, "/h/extra")
    no_leak(shown.raw, "stray bytes")
    assert shown.status == 200 and shown.body == b"{}" and shown.complete
    assert event_for(proxy, mark, "/h/extra")["status"] == 200
    assert_no_canary(proxy.logs.text(), "the proxy logs")  # mitmproxy would log the stray bytes verbatim


# -- 3. interim answers, a late final answer, and the next request on the connection ---------------


@pytest.mark.parametrize("codes", ["103", "100", "100+103"])
def test_interim_answers_are_dropped_and_never_taken_for_the_final_one(proxy, upstreams, codes):
    h1, _ = upstreams
    first, second = f"/h/interim/{codes}", f"/h/echo/after-{codes}"
    mark = proxy.mark()
    with open_socket(proxy.host, proxy.port) as sock:
        shown = absolute_on(proxy, sock, first)
        no_leak(shown.raw, "the interim exchange")
        assert shown.status == 200 and json.loads(shown.body) == {"late": "[REDACTED]"}, shown.raw[:400]
        # The next request on this client connection, with another lease: its own answer (or a denial), never
        # the late answer to the first, and never on the upstream connection that carried the credential.
        other = absolute_on(proxy, sock, second, "CI")
        no_leak(other.raw, "the next exchange")
        assert other.status in (200, 403, 407), other.raw[:400]
        if other.status == 200:
            assert json.loads(other.body) == {"path": second, "token": "no-credential"}
    assert event_for(proxy, mark, first)["status"] == 200
    carried = {number for number, _, _ in h1.seen(first)}
    reached = h1.seen(second)
    assert len(carried) == 1 and not any(number in carried for number, _, _ in reached), (carried, reached)
    assert all(auth == "" for _, _, auth in reached)


def test_an_upstream_connection_is_not_reused_after_an_interim_answer(proxy, upstreams):
    h1, _ = upstreams
    first, second = "/h/interim/103/same-lease", "/h/echo/same-lease"
    with open_tunnel(proxy) as tls:
        shown = tunnel_on(proxy, tls, first)
        assert shown.status == 200 and json.loads(shown.body) == {"late": "[REDACTED]"}
        again = tunnel_on(proxy, tls, second)
        assert again.status == 200 and json.loads(again.body) == {"path": second, "token": "[REDACTED]"}
        no_leak(shown.raw + again.raw, "a tunnel after an interim answer")
    (conn_first, _, _), (conn_second, _, _) = h1.seen(first)[0], h1.seen(second)[0]
    assert conn_first != conn_second


def test_a_second_client_connection_gets_its_own_answer_during_a_late_one(proxy):
    import threading

    results: dict[str, hostile.Shown] = {}
    slow = threading.Thread(target=lambda: results.setdefault("slow", absolute(proxy, "/h/interim/100+103/concurrent")))
    slow.start()
    results["fast"] = absolute(proxy, "/h/echo/concurrent")
    slow.join(10)
    assert json.loads(results["fast"].body) == {"path": "/h/echo/concurrent", "token": "[REDACTED]"}
    assert json.loads(results["slow"].body) == {"late": "[REDACTED]"}
    for shown in results.values():
        no_leak(shown.raw, "concurrent exchanges")


def test_an_upstream_connection_that_carried_a_credential_is_not_reused_for_another_subject(proxy, upstreams):
    h1, _ = upstreams
    first, second = "/h/echo/subject-a", "/h/echo/subject-b"
    with open_socket(proxy.host, proxy.port) as sock:
        assert absolute_on(proxy, sock, first).status == 200
        other = absolute_on(proxy, sock, second, "CI")
        no_leak(other.raw, "the other subject's exchange")
    reached = h1.seen(second)
    if reached:  # absent if the client connection is bound to its first lease and the request was denied
        assert reached[0][0] != h1.seen(first)[0][0] and reached[0][2] == ""


# -- 4. HTTP/2 upstream ---------------------------------------------------------------------------


def h2_get(proxy, path: str):
    with open_tunnel(proxy, H2_HOST, alpn=("h2",)) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        answer = h2_exchange(tls, [(":method", "GET"), (":scheme", "https"), (":authority", H2_HOST), (":path", path)])
    proxy.record(answer.raw)
    return answer


@pytest.mark.parametrize("path", ["/h2/bad-value", "/h2/bad-name"])
def test_an_illegal_http2_header_gets_our_json(proxy, upstreams, path):
    _, h2 = upstreams
    mark = proxy.mark()
    answer = h2_get(proxy, path)
    no_leak(answer.raw, path)
    assert h2.seen(path), "the request did not reach the HTTP/2 upstream"
    assert answer.status == 502 and json.loads(answer.body) == {"error": "upstream_error", "reason": "upstream-error"}, answer
    event = event_for(proxy, mark, path)
    assert (event["told"], event["status"]) == ("upstream-error", 502)
    assert_no_canary(proxy.logs.text(), "the proxy logs")  # mitmproxy logs HTTP/2 protocol errors with the bytes
    time.sleep(0.3)
    # the upstream's protocol error is not also audited as a malformed request of the client (a 400 it never got)
    assert [e["told"] for e in proxy.settled(mark) if e["kind"] == "request"] == ["upstream-error"]


@pytest.mark.parametrize("path", ["/h2/echo", "/h2/gzip"])
def test_http2_echo_across_frames_is_decoded_and_redacted(proxy, path):
    mark = proxy.mark()
    answer = h2_get(proxy, path)
    no_leak(answer.raw, path)
    assert answer.status == 200 and json.loads(answer.body) == redacted_echo(), answer
    assert dict(answer.headers).get("x-echo") == "[REDACTED]" and "content-encoding" not in dict(answer.headers)
    event = event_for(proxy, mark, path)
    assert (event["status"], event["redactions"]) == (200, len(NEEDLES) + 2)


def test_http2_interim_and_trailers(proxy):
    answer = h2_get(proxy, "/h2/interim")
    no_leak(answer.raw, "an HTTP/2 interim answer")
    assert answer.status == 200 and json.loads(answer.body) == redacted_echo()
    answer = h2_get(proxy, "/h2/trailers")
    no_leak(answer.raw, "HTTP/2 trailers")
    assert answer.status == 200 and answer.body == b"{}"


# -- 5. caps --------------------------------------------------------------------------------------


def test_a_declared_length_over_the_rule_cap_is_refused_before_the_head(proxy):
    path = f"/bulk/big/{4 * BULK_CAP}/length"
    mark = proxy.mark()
    shown = tunnel(proxy, path)
    no_leak(shown.raw, path)
    assert shown.status == 502 and json.loads(shown.body) == {"error": "upstream_error", "reason": "response-too-large"}
    event = event_for(proxy, mark, path)
    assert (event["told"], event["status"], event["aborted"]) == ("response-too-large", 502, False)


def test_a_stream_over_the_rule_cap_is_cut(proxy):
    path = f"/bulk/big/{4 * BULK_CAP}/chunked"
    mark = proxy.mark()
    shown = tunnel(proxy, path)
    no_leak(shown.raw, path)
    assert shown.status == 200 and not shown.complete and len(shown.body) <= BULK_CAP
    event = event_for(proxy, mark, path)
    assert (event["told"], event["status"], event["aborted"]) == ("response-too-large", 200, True)
    assert event["bytes_down"] == len(shown.body)


def test_a_decompression_bomb_is_cut(proxy):
    mark = proxy.mark()
    shown = tunnel(proxy, "/h/bomb/128")  # ~130 kB of gzip: streamed
    assert shown.status == 200 and not shown.complete and len(shown.body) <= 4 << 20
    event = event_for(proxy, mark, "/h/bomb/128")
    assert (event["told"], event["status"], event["aborted"]) == ("decoded-too-large", 200, True)
    shown = tunnel(proxy, "/h/bomb/16")  # ~16 kB of gzip: buffered, refused whole
    assert shown.status == 502 and json.loads(shown.body) == {"error": "upstream_error", "reason": "decoded-too-large"}
    assert event_for(proxy, mark, "/h/bomb/16")["status"] == 502


def test_the_rule_cap_does_not_apply_to_other_rules(proxy):
    shown = tunnel(proxy, f"/h/big/{4 * BULK_CAP}/chunked")
    assert shown.status == 200 and shown.complete and len(shown.body) == 4 * BULK_CAP - len(CANARY) + len("[REDACTED]")
    assert shown.body.startswith(b"[REDACTED]")

