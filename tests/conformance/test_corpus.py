"""The adversarial corpus (tests/conformance/cases.py) against the real proxy.

Every case goes on the wire byte for byte. A denial must answer with its reason code (403/407 JSON
and `X-Egresslaw-Deny`, or mitmproxy's own 400 where it refuses before our hooks), be audited with
that reason, and leave both counting upstreams untouched: no TCP accept, no byte, no request. An
allowed request reaches the upstream exactly once, with exactly one injected credential (connection
leases) or none (profile leases), only allowlisted headers, and never the client's Authorization or
Proxy-Authorization. At module end, the canary is in no audit line, log line or client answer.
"""

from __future__ import annotations

import json
import secrets
import socket
import ssl
import time

import pytest

from compiler.constants import header_is_denylisted
from egress_proxy.custody.lease import mint
from tests.conformance.cases import CASES, FAMILIES, Case
from tests.conformance.wire import (
    Answer,
    client_hello,
    h2_exchange,
    insert_after_request_line,
    open_socket,
    read_answer,
    tls_client,
)
from tests.proxy_harness import CANARY, assert_no_canary

pytestmark = pytest.mark.slow

REQUIRED_FAMILIES = {
    "host-case", "trailing-dot", "suffix-over-match", "nul-in-host", "idn", "bracketed", "connect-authority", "ipv4-numeric",
    "ipv6-embedded", "zone-id", "special-purpose-answer", "mixed-answers", "dns-rebinding", "self-connection", "sni",
    "non-tls-in-tunnel", "host-spoofing", "absolute-in-tunnel", "h2-authority", "userinfo-fragment", "scheme", "plaintext-to-https",
    "path", "segment-boundary", "method", "method-override", "forwarding-headers", "smuggling", "bodyless-body", "upgrade",
    "trailers", "redirect", "forged-response-headers", "credential-echo", "lease",
}  # fmt: skip


def test_the_corpus_covers_every_family():
    assert len(CASES) >= 60
    assert REQUIRED_FAMILIES <= set(FAMILIES), REQUIRED_FAMILIES - set(FAMILIES)
    ids = [f"{c.family}/{c.id}" for c in CASES]
    assert len(ids) == len(set(ids))
    assert {c.expect for c in CASES} <= {"deny", "allow", "allow-connect", "tls-refused"}
    for c in CASES:
        assert (c.reason is None) == (c.expect in ("allow", "allow-connect")), c.id


def lease_for(proxy, which: str | None) -> str | None:
    if which == "GH":
        return proxy.lease(connection="github")
    if which == "CI":
        return proxy.lease(profile="ci")
    if which == "EXPIRED":
        return mint(proxy.env.lease_key, "agent-1", connection="github", ttl=1, now=time.time() - 60)
    if which == "FORGED":
        token = proxy.lease(connection="github")
        return token[:-2] + ("AA" if token[-2:] != "AA" else "BB")
    if which == "SHORT":
        return mint(proxy.env.lease_key, "agent-1", connection="github", ttl=2, now=time.time())
    if which == "UNKNOWN":
        return proxy.lease(connection="not-in-artifact")
    if which in (None, "RAW"):
        return None
    raise AssertionError(which)


def fill(proxy, wire: bytes, used: list[str] | None = None) -> bytes:
    for name in ("GH", "CI"):
        marker = ("{%s}" % name).encode()
        if marker in wire:
            token = lease_for(proxy, name)
            if used is not None:
                used.append(token)
            wire = wire.replace(marker, token.encode())
    return wire


class Exchange:
    """What one case did on the wire: the answer the client got, and whether TLS was refused."""

    def __init__(self) -> None:
        self.leases: list[str] = []  # every lease token this case put on the wire
        self.answer: Answer = Answer(None)
        self.tls_refused = False
        self.connect_status: int | None = None
        self.mark = None  # where the judged part starts (after the setup of a multi-step case)
        self.pipelined = False  # the setup request's events may interleave with the case's: count from the start


def _connect(proxy, case: Case, lease: str | None, authority: str | None = None) -> tuple[socket.socket, Answer]:
    sock = open_socket(proxy.host, proxy.port, case.timeout)
    target = authority or case.connect
    wire = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n".encode()
    if lease:
        wire += f"Proxy-Authorization: Bearer {lease}\r\n".encode()
    sock.sendall(wire + b"\r\n")
    return sock, read_answer(sock, "CONNECT")


def run(proxy, case: Case, marker: str) -> Exchange:
    ex = Exchange()
    lease = lease_for(proxy, case.lease)
    ex.leases = [t for t in (lease,) if t]
    client_auth = [f"Authorization: Bearer {marker}"] if case.client_auth else []
    inner_auth = client_auth + ([f"Proxy-Authorization: Bearer {marker}-proxy"] if case.client_auth else [])
    wire = fill(proxy, case.wire, ex.leases)
    if case.transport in ("plain", "connect"):
        lines = list(client_auth)
        if lease:
            lines.append(f"Proxy-Authorization: Bearer {lease}")
        with open_socket(proxy.host, proxy.port, case.timeout) as sock:
            sock.sendall(insert_after_request_line(wire, lines))
            ex.answer = read_answer(sock, "CONNECT" if case.transport == "connect" else wire.split(b" ", 1)[0].decode("latin-1"))
        return ex
    if case.transport == "rebind":
        host = case.connect.rsplit(":", 1)[0]
        with proxy.resolver.lock:
            proxy.resolver.calls[host] = 0
        sock, first = _connect(proxy, case, lease)
        assert first.status == 200, first
        with tls_client(sock, proxy.ca, host) as tls:
            for _ in range(2):
                tls.sendall(insert_after_request_line(wire, inner_auth))
                answer = read_answer(tls)
                proxy.record(answer.raw)
                assert answer.status == 200, answer  # the vetted, pinned answer serves the whole tunnel
        assert proxy.resolver.calls[host] == 1
        ex.connect_status = 200
        ex.mark = proxy.mark()
        sock2, ex.answer = _connect(proxy, case, lease)  # a new tunnel resolves again: loopback now
        sock2.close()
        return ex
    if case.transport == "direct-tls":  # TLS straight to the proxy's listener, no CONNECT
        sock = open_socket(proxy.host, proxy.port, case.timeout)
        try:
            with tls_client(sock, proxy.ca, case.sni) as tls:
                tls.sendall(insert_after_request_line(wire, client_auth))
                ex.answer = read_answer(tls)
                ex.tls_refused = ex.answer.status is None
        except (ssl.SSLError, OSError):
            ex.tls_refused = True
        finally:
            sock.close()
        return ex
    if case.transport == "pipeline-plain":
        # Two requests in one write; the first is allowed, the second is the case. Only the second is judged here.
        first, second = wire.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n", wire.split(b"\r\n\r\n", 1)[1]
        lines = client_auth + [f"Proxy-Authorization: Bearer {lease}"]
        with open_socket(proxy.host, proxy.port, case.timeout) as sock:
            sock.sendall(insert_after_request_line(first, lines) + insert_after_request_line(second, client_auth))
            answer = read_answer(sock)
            proxy.record(answer.raw)
            assert answer.status == 200, answer
            ex.mark, ex.pipelined = proxy.mark(), True
            ex.answer = read_answer(sock)
        return ex
    host = case.connect.rsplit(":", 1)[0]
    sock, answer = _connect(proxy, case, lease)
    ex.connect_status = answer.status
    if answer.status != 200:
        ex.answer = answer
        sock.close()
        return ex
    try:
        if case.transport == "raw":
            sock.sendall(insert_after_request_line(wire, inner_auth) if case.client_auth else wire)
            ex.answer = read_answer(sock)
        elif case.transport == "tls":
            if case.hello is not None:
                if case.hello.startswith(b"SNI:"):  # a hello naming exactly these bytes (ssl will not send them)
                    sock.sendall(client_hello(case.hello[4:], None))
                else:
                    sock.sendall(client_hello(host, 0xFE0D if case.hello == b"ECH" else 0xFE02))
                sock.settimeout(5)
                got = b""
                try:
                    while chunk := sock.recv(4096):
                        got += chunk
                        if got[:1] == b"\x15":  # a TLS alert: refused
                            break
                except OSError:
                    pass
                ex.tls_refused = got[:1] in (b"", b"\x15")
                ex.answer = Answer(None, raw=got)
            else:
                try:
                    with tls_client(sock, proxy.ca, case.sni) as tls:
                        tls.sendall(b"GET /repos/acme/x HTTP/1.1\r\nHost: api.acme-test.dev\r\n\r\n")
                        ex.answer = read_answer(tls)
                        ex.tls_refused = ex.answer.status is None
                except (ssl.SSLError, OSError):
                    ex.tls_refused = True
        elif case.transport == "pipeline":
            first, second = wire.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n", wire.split(b"\r\n\r\n", 1)[1]
            with tls_client(sock, proxy.ca, host) as tls:
                tls.sendall(insert_after_request_line(first, inner_auth) + insert_after_request_line(second, inner_auth))
                answer = read_answer(tls)
                proxy.record(answer.raw)
                assert answer.status == 200, answer
                ex.mark, ex.pipelined = proxy.mark(), True
                ex.answer = read_answer(tls, second.split(b" ", 1)[0].decode("latin-1"))
        elif case.transport == "tunnel":
            sni = host if case.sni == "=" else case.sni
            if case.lease == "SHORT":
                time.sleep(2.2)  # the CONNECT's lease expires while the tunnel is open
            with tls_client(sock, proxy.ca, sni) as tls:
                tls.sendall(insert_after_request_line(wire, inner_auth) if case.client_auth else wire)
                ex.answer = read_answer(tls, wire.split(b" ", 1)[0].decode("latin-1"))
        elif case.transport == "h2":
            with tls_client(sock, proxy.ca, host, alpn=("h2",)) as tls:
                assert tls.selected_alpn_protocol() == "h2"
                headers = list(case.h2_headers)
                if not any(k == "authorization" for k, _ in headers):
                    headers.append(("authorization", f"Bearer {marker}"))
                headers.append(("proxy-authorization", f"Bearer {marker}-proxy"))
                ex.answer = h2_exchange(tls, headers, case.h2_body, case.h2_trailers)
        else:
            raise AssertionError(case.transport)
    finally:
        sock.close()
    return ex


def _wait_for(predicate, timeout: float = 30.0) -> bool:  # a budget for a loaded machine: runs out only on failure
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _rule_headers(proxy, rule: str | None) -> set[str]:
    art = proxy.artifact()
    for c in art.connections:
        for r in c.rules:
            if r.name == rule:
                return set(r.headers)
    return set()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.family}/{c.id}" for c in CASES])
def test_case(proxy, tls_upstream, http_upstream, case: Case):
    if proxy.fleet is not None and any("%" in ip for ip in case.resolve):
        pytest.skip("the scripted answer carries an IPv6 zone id, which no real DNS answer can (EGRESSLAW_TEST_WORKERS serves answers over DNS)")
    marker = f"clientsecret-{secrets.token_hex(6)}"
    mark = proxy.mark()
    ex = run(proxy, case, marker)
    if ex.mark is not None:
        # Upstream counts restart after the setup; audit events too, unless they could interleave (pipelining).
        mark = (mark[0] if ex.pipelined else ex.mark[0], ex.mark[1])
    answer = ex.answer
    proxy.record(answer.raw)
    assert_no_canary(answer.raw, f"the answer to {case.id}")
    delta = proxy.upstream_delta(mark)
    # Neither upstream ever sees the client's own Authorization / Proxy-Authorization, nor a lease token;
    # the audit log never holds a lease token either.
    for up in (tls_upstream, http_upstream):
        for seen in up.raw_requests():
            assert not any(marker in v or "client-trailer" in v for _, v in seen.headers), (case.id, seen.headers)
            assert not any(t in v or t in seen.path for t in ex.leases for _, v in seen.headers), "a lease reached the upstream"
    audit = proxy.audit_bytes()
    assert not any(t.encode() in audit for t in ex.leases), "a lease token is in the audit log"

    if case.expect == "tls-refused":
        assert ex.connect_status == 200 or case.transport == "direct-tls"
        assert ex.tls_refused, answer
        assert delta == [(0, 0, 0), (0, 0, 0)], "upstream saw bytes for a refused handshake"
        assert _wait_for(lambda: any(e["kind"] == "tls" and e["reason"] == case.reason for e in proxy.new_events(mark))), proxy.new_events(mark)
        return

    if case.expect == "allow-connect":
        assert answer.status == 200, answer
        assert delta == [(0, 0, 0), (0, 0, 0)]  # lazy: nothing is dialled before a request is decided
        assert _wait_for(lambda: any(e["kind"] == "connect" and e["decision"] == "allow" for e in proxy.new_events(mark)))
        return

    if case.expect == "deny":
        expected = case.status if case.status is not None else (407 if case.reason.startswith("lease-") else 403)
        if expected == 0:
            assert answer.status is None or answer.status >= 400, answer
        else:
            assert answer.status == expected, (answer.status, answer.error, answer.body[:300], answer.headers)
        if answer.status in (403, 407):
            assert answer.header("x-egresslaw-deny") == case.reason, answer.headers
            if not case.wire.startswith(b"HEAD "):  # a HEAD answer has no body
                assert json.loads(answer.body) == {"error": "egress_denied", "reason": case.reason, "rule": None}
        elif answer.status == 502:  # a response refused after the request went upstream: our answer, never the upstream's
            assert answer.header("x-egresslaw-deny") == case.reason, answer.headers
            assert json.loads(answer.body) == {"error": "upstream_error", "reason": case.reason}
        elif answer.status == 400:  # refused inside mitmproxy before (or instead of) our hooks: still our JSON and reason
            assert answer.header("x-egresslaw-deny") == case.reason, answer.headers
            assert json.loads(answer.body) == {"error": "egress_denied", "reason": case.reason, "rule": None}
        # What the client was told: a denial's reason, or the failure the outcome of an allow records (a
        # response-side refusal is an allow, written before the request went, and then an outcome).
        told = lambda: [e["told"] for e in proxy.settled(mark) if e["decision"] == "deny" or e["failure"]]  # noqa: E731
        assert _wait_for(lambda: case.reason in told()), (case.reason, [(e["kind"], e["decision"], e["told"]) for e in proxy.settled(mark)])
        allowed = [e for e in proxy.settled(mark) if e["decision"] == "allow" and e["kind"] == "request" and not e["failure"]]
        if answer.status is not None:  # the audit says what the client got
            assert any(e["told"] == case.reason and e["status"] == answer.status for e in proxy.settled(mark)), (
                answer.status, [(e["kind"], e["told"], e["status"]) for e in proxy.settled(mark)])
        assert len(allowed) == (1 if ex.pipelined else 0), allowed  # a pipelined setup request is the only allow
        if "upstream-reached" in case.check:  # a response-side denial: the request went, its answer did not
            assert proxy.upstream_delta(mark)[0][2] == 1
            return
        assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)], "upstream saw bytes for a denied request"
        return

    # allow
    expected = case.status or 200
    assert answer.status == expected, (answer.status, answer.error, answer.body[:300], answer.headers)
    profile = case.lease == "CI"
    plain_profile = profile and case.transport == "plain" and case.wire.split(b" ", 2)[1].startswith(b"http://")
    used, unused = (http_upstream, tls_upstream) if plain_profile else (tls_upstream, http_upstream)
    d_used, d_unused = (delta[1], delta[0]) if plain_profile else (delta[0], delta[1])
    assert d_unused == (0, 0, 0)
    assert d_used[2] == 1, f"expected exactly one upstream request, got {d_used}"
    seen = used.raw_requests()[-1]
    assert seen.path.startswith("/"), f"not origin-form upstream: {seen.path!r}"
    names = {k.lower() for k, _ in seen.headers}
    assert _wait_for(lambda: any(e["kind"] == "request" for e in proxy.new_events(mark)))
    event = [e for e in proxy.settled(mark) if e["kind"] == "request"][-1]
    assert (event["decision"], event["reason"]) == ("allow", "allowed"), event
    if profile:
        assert not seen.all("Authorization"), "a profile request carried a credential"
        assert not any(header_is_denylisted(n) and n not in ("host", "content-length") for n in names), names
    else:
        assert seen.all("Authorization") == [f"Bearer {CANARY}"], "not exactly one injected credential"
        allowed = _rule_headers(proxy, event["rule"]) | {"host", "authorization", "content-length"}
        assert names <= allowed, (names - allowed, event["rule"])
    for check in case.check:
        if check == "redirect-not-followed":
            assert answer.header("x-egresslaw-redirect") == "not-followed"
        elif check.startswith("location:"):
            assert answer.header("location") == check.removeprefix("location:")
        elif check == "forged-stripped":
            assert not any(k.lower().startswith("x-egresslaw-") for k, _ in answer.headers), answer.headers
            assert json.loads(answer.body) == {"forged": True}
        elif check == "redacted":
            assert b"[REDACTED]" in answer.raw, answer.raw[:400]
            assert event["redactions"] >= 1
        elif check == "no-canary":
            pass  # asserted for every case above
        elif check.startswith("no-header:"):
            assert check.removeprefix("no-header:") not in names, names
        else:
            raise AssertionError(check)
