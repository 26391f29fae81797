"""Fuzzing with Hypothesis (bounded examples, no deadline).

1. Raw request bytes to the real proxy (absolute-form in the clear and HTTP/1 inside a CONNECT+TLS
   tunnel), built from adversarial pieces (methods, schemes, hosts, path segments, framing, routing
   and override headers) and also fully random bytes. Properties: the proxy never stops serving;
   every request that reaches the upstream matches a rule of the connection (exact host, method,
   segment-bounded prefix of the normalized path) and carries exactly one credential; the client's
   own Authorization never reaches the upstream; nothing leaks.
2. decide() inputs (tests/egress_proxy/decision/test_adapter.py already proves "never raises", "allows only what
   a rule admits" and the header properties; these add): deciding the normalized request again gives
   the same verdict and rule, and spellings that normalize alike (case, one trailing dot, an explicit
   default port in Host) never change a decision.
"""

from __future__ import annotations

import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.normalize import (
    HostError,
    PathError,
    normalize_host,
    normalize_path,
    normalize_prefix,
    prefix_matches,
)
from egress_proxy.decision.adapter import decide
from egress_proxy.decision.types import Lease, Request
from tests.conformance.conftest import conformance_artifact, launch
from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.proxy_harness import CANARY, stop_proxy

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"
RAW_EXAMPLES = 120
STATS = {"examples": 0, "forwarded": 0}  # the property is not vacuous: some fuzzed requests are allowed

METHODS = st.sampled_from(["GET", "GET", "GET", "POST", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "get", "Get", "PROPFIND", "CONNECT"])
SCHEMES = st.sampled_from(["https", "http", "HTTPS", "ftp", "ws"])
HOSTS = st.sampled_from([API, API, API, API, "API.acme-test.dev", API + ".", API + ":443", API + ":8443", API + ":0443", "other.acme-test.dev",
                         "pkgs.acme-test.dev", "rebind.acme-test.dev", "private.acme-test.dev", "127.0.0.1", "[::1]", "169.254.169.254",
                         "2130706433", "0x7f.1", API + ".evil.test", "evilapi.acme-test.dev", "xn--pi-6kc.acme-test.dev", "[::ffff:127.0.0.1]",
                         "sp3.acme-test.dev", "mix1.acme-test.dev"])
SEGMENTS = st.sampled_from(["repos", "acme", "acmex", "app", "issues", "echo", "forge", "leak", "plain", "body", "status", "302",
                            "..", ".", "%2e%2e", "%2E", "%2f", "%5c", "x;y", "%00", "", "admin", "%41", "%252e", "a b", "\\", "%"])
HEADER_POOL = st.sampled_from([
    "Accept: */*", "User-Agent: fuzz", "X-GitHub-Api-Version: 2022-11-28", "Authorization: Bearer client-fuzz",
    "X-HTTP-Method-Override: DELETE", "X-Original-URL: /admin", "X-Forwarded-Host: 127.0.0.1", "Forwarded: host=internal",
    "Cookie: a=b", "Connection: upgrade", "Upgrade: websocket", "Connection: close", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    "Host: other.acme-test.dev", "Host: api.acme-test.dev", "Proxy-Connection: keep-alive", "X-Egresslaw-Deny: forged",
    "Content-Type: application/json", "Proxy-Authorization: Bearer garbage", "Accept: a\rX-Injected: 1", "User-Agent: a\r\n X-Injected: 1",
])  # fmt: skip
PREFIXES = st.sampled_from(["/repos/acme", "/repos/acme", "/repos/acme/app/issues", "/echo", "/forge", "/status/302", "/leak/b64/body",
                            "/", "/repos/acmex", "/repos"])
FRAMING = st.sampled_from(["none", "none", "none", "length", "chunked", "length+chunked", "length-twice"])


@st.composite
def http_requests(draw, tunnel: bool) -> bytes:
    method = draw(METHODS)
    path = draw(PREFIXES).rstrip("/") + "/" + "/".join(draw(st.lists(SEGMENTS, min_size=0, max_size=3)))
    path += draw(st.sampled_from(["", "?q=../../admin", "#frag", "?a=1#b"]))
    if tunnel:
        target = path
        host_header = draw(st.sampled_from([API, API, API.upper(), API + ":443", API + ".", None, "other.acme-test.dev"]))
    else:
        host = draw(HOSTS)
        target = f"{draw(st.sampled_from(['https', 'https']) | SCHEMES)}://{host}{path}"
        host_header = draw(st.sampled_from([host, host, API, None]))
    headers = draw(st.lists(HEADER_POOL, max_size=3))
    if host_header is not None:
        headers.insert(0, f"Host: {host_header}")
    body = draw(st.sampled_from([b"", b"{}", b"hello world"]))
    framing = draw(FRAMING)
    if framing == "length":
        headers.append(f"Content-Length: {len(body)}")
    elif framing == "chunked":
        headers.append("Transfer-Encoding: chunked")
        body = (f"{len(body):x}\r\n".encode() + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    elif framing == "length+chunked":
        headers += [f"Content-Length: {len(body)}", "Transfer-Encoding: chunked"]
    elif framing == "length-twice":
        headers += [f"Content-Length: {len(body)}", f"Content-Length: {len(body)}"]
    else:
        body = b""
    line_end = draw(st.sampled_from(["\r\n", "\r\n", "\n"]))
    head = line_end.join([f"{method} {target} HTTP/1.1", *headers]) + line_end + line_end
    return head.encode("utf-8", "surrogateescape") + body


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream):
    p = launch(tmp_path_factory, pki, tls_upstream, http_upstream, name="fuzz")
    yield p
    try:
        p.assert_nothing_leaked()
    finally:
        stop_proxy(p)


def _send(proxy, wire: bytes, tunnel: bool, half_close: bool = False) -> None:
    lease = proxy.lease(connection="github")
    try:
        sock = open_socket(proxy.host, proxy.port, 2)
        if tunnel:
            sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
            assert read_answer(sock, "CONNECT").status == 200
            sock = tls_client(sock, proxy.ca, API)
        else:
            end = wire.find(b"\n")
            if end >= 0:
                wire = wire[: end + 1] + f"Proxy-Authorization: Bearer {lease}\r\n".encode() + wire[end + 1 :]
        with sock:
            sock.sendall(wire)
            if half_close:  # no more bytes are coming: the proxy must not wait for the rest of a request
                sock.shutdown(socket.SHUT_WR)
            proxy.record(read_answer(sock).raw)
    except OSError:
        pass  # a refused or dropped connection is an acceptable answer to garbage


def _rule_admits(art, seen) -> bool:
    """Some rule of the connection admits what the upstream received (host from Host, normalized path)."""
    try:
        host = normalize_host(seen.all("Host")[0].rsplit(":", 1)[0] if seen.all("Host") else "").value
        path = normalize_path(seen.path)
    except (HostError, PathError, IndexError):
        return False
    for rule in art.connection("github").rules:
        if rule.host == host and seen.method in rule.methods and prefix_matches(normalize_prefix(rule.path_prefix), path):
            return True
    return False


def _check_upstream(proxy, ups, marks) -> None:
    art = proxy.artifact()
    time.sleep(0.02)
    STATS["examples"] += 1
    for up, mark in zip(ups, marks):
        for seen in up.raw_requests()[mark[2]:]:
            STATS["forwarded"] += 1
            assert _rule_admits(art, seen), f"the upstream received a request no rule admits: {seen.method} {seen.path} {seen.headers}"
            assert seen.all("Authorization") == [f"Bearer {CANARY}"], "not exactly one injected credential"
            assert not any("client-fuzz" in v or "garbage" in v for _, v in seen.headers)
            assert not seen.all("X-Injected"), "a header line was injected through a header value"


def _still_serving(proxy, tls_upstream) -> None:
    mark = tls_upstream.mark()
    _send(proxy, f"GET https://{API}/repos/acme/alive HTTP/1.1\r\nHost: {API}\r\n\r\n".encode(), tunnel=False)
    assert tls_upstream.since(mark)[2] == 1, "the proxy stopped serving"


@settings(max_examples=RAW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_raw_requests_never_allow_without_a_rule(proxy, tls_upstream, http_upstream, data):
    tunnel = data.draw(st.booleans(), label="tunnel")
    wire = data.draw(http_requests(tunnel), label="wire")
    marks = [tls_upstream.mark(), http_upstream.mark()]
    _send(proxy, wire, tunnel)
    _check_upstream(proxy, (tls_upstream, http_upstream), marks)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.binary(min_size=1, max_size=300), st.booleans())
def test_random_bytes_never_reach_the_upstream(proxy, tls_upstream, http_upstream, blob, tunnel):
    marks = [tls_upstream.mark(), http_upstream.mark()]
    _send(proxy, blob, tunnel, half_close=True)
    _check_upstream(proxy, (tls_upstream, http_upstream), marks)


def test_zz_still_serving_after_the_fuzz(proxy, tls_upstream):
    _still_serving(proxy, tls_upstream)
    print(f"\nfuzz: {STATS}")
    if STATS["examples"] >= RAW_EXAMPLES:  # the fuzz ran in this process (xdist may split the module)
        assert STATS["forwarded"] > 0, "no fuzzed request was ever allowed: the properties would be vacuous"


# --- decide() -----------------------------------------------------------------------------------

ART = conformance_artifact()
GH = Lease("agent", None, "github", 2**40)
CI = Lease("agent", "ci", None, 2**40)
PUBLIC_IPS = ["93.184.216.34"]


@st.composite
def decide_requests(draw) -> Request:
    rule = draw(st.sampled_from(ART.connection("github").rules))
    host = draw(st.sampled_from([rule.host, "other.acme-test.dev", "pkgs.acme-test.dev"]))
    segs = draw(st.lists(st.sampled_from(["repos", "acme", "acmex", "app", "issues", "x", "..", "%2e", "leak", "status", ""]), max_size=4))
    target = draw(st.sampled_from([rule.path_prefix, "/"])).rstrip("/") + "/" + "/".join(segs) + draw(st.sampled_from(["", "?a=b"]))
    return Request(
        method=draw(st.sampled_from(["GET", "HEAD", "POST", "DELETE", "get"])),
        scheme=draw(st.sampled_from(["https", "https", "http"])),
        host=host,
        port=draw(st.sampled_from([443, 443, 80, 8443])),
        target=target,
        headers=tuple(draw(st.lists(st.sampled_from([("Accept", "*/*"), ("Content-Type", "text/plain"), ("X-Forwarded-Host", "x")]), max_size=3))),
        host_header=draw(st.sampled_from([None, host])),
        tunnel=draw(st.booleans()),
        has_body=draw(st.booleans()),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([GH, CI]), decide_requests())
def test_deciding_the_normalized_request_again_gives_the_same_verdict(lease, request):
    first = decide(ART, lease, request, PUBLIC_IPS)
    if not first.allowed:
        return
    query = "?" + request.target.split("?", 1)[1] if "?" in request.target else ""
    again = Request(request.method, request.scheme, first.host, request.port, first.path + query, request.headers,
                    None if request.host_header is None else first.host, request.tunnel, request.has_body)
    second = decide(ART, lease, again, PUBLIC_IPS)
    assert (second.allowed, second.reason, second.rule, second.path) == (True, "allowed", first.rule, first.path)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([GH, CI]), decide_requests(), st.sampled_from(["upper", "dot", "port"]))
def test_spellings_that_normalize_alike_decide_alike(lease, request, spelling):
    base = decide(ART, lease, request, PUBLIC_IPS)
    host = {"upper": request.host.upper(), "dot": request.host + ".", "port": request.host}[spelling]
    header = request.host_header
    if header is not None:
        default = 443 if request.scheme == "https" else 80  # an explicit default port is the same authority
        header = {"upper": header.upper(), "dot": header + ".", "port": f"{header}:{default}"}[spelling]
    variant = Request(request.method, request.scheme, host, request.port, request.target, request.headers, header, request.tunnel, request.has_body)
    other = decide(ART, lease, variant, PUBLIC_IPS)
    assert (other.allowed, other.reason, other.rule) == (base.allowed, base.reason, base.rule)
