"""The lease at the real proxy: Basic from a proxy URL, the 407 offering both schemes, what a lease denial
audits, one client connection = one subject (HTTP/1 keep-alive, absolute-form then CONNECT, inside a
tunnel, HTTP/2 streams), and lease keys rotated under a running proxy.

Every test runs the in-process proxy (tests/proxy_harness.py) against the loopback upstreams of
tests/conftest.py; a denial is checked for its reason, its event and zero upstream bytes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import time

import httpx
import pytest

from egress_proxy.custody.keys import rotate_lease_key
from egress_proxy.custody.lease import mint
from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.proxy_harness import (
    CANARY,
    HOSTS,
    RunningProxy,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
)

pytestmark = pytest.mark.slow

CURL = shutil.which("curl")
API = "api.acme-test.dev"


def _connect_to(tls_port: int, http_port: int) -> list[str]:
    return [f"{h}:443:127.0.0.1:{tls_port}" for h in HOSTS if h != "self.acme-test.dev"] + [f"pkgs.acme-test.dev:80:127.0.0.1:{http_port}"]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream):
    env = make_env(tmp_path_factory.mktemp("lease-edge"))
    p = start_proxy(env, pki, (tls_upstream, http_upstream), _connect_to(tls_upstream.port, http_upstream.port))
    p.tokens = []  # every lease a test put on the wire: none may appear in a log line or an event
    yield p
    stop_proxy(p)
    p.assert_nothing_leaked()
    text = p.logs.text() + p.audit_bytes().decode()
    assert not any(t in text for t in p.tokens), [line for line in text.splitlines() if any(t in line for t in p.tokens)][:3]


def lease(p: RunningProxy, **kw) -> str:
    token = p.lease(**kw)
    p.tokens.append(token)
    return token


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _raw(p: RunningProxy, wire: bytes, method: str = "GET"):
    with open_socket(p.host, p.port) as sock:
        sock.sendall(wire)
        answer = read_answer(sock, method)
    p.record(answer.raw)
    return answer


def _event(p: RunningProxy, mark, **match) -> dict:
    events = [e for e in p.new_events(mark) if all(e.get(k) == v for k, v in match.items())]
    assert len(events) == 1, (match, p.new_events(mark))
    return events[0]


# ---------------------------------------------------------------------------------------------
# Basic from a proxy URL, one code path with Bearer
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
@pytest.mark.parametrize("userinfo", ["sandbox:{L}", "{L}"], ids=["lease-as-password", "lease-as-user"])
def test_curl_with_the_lease_in_the_proxy_url(proxy, tls_upstream, userinfo):
    token = lease(proxy, connection="github")
    mark = proxy.mark()
    url = f"http://{userinfo.format(L=token)}@{proxy.host}:{proxy.port}"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    r = subprocess.run([CURL, "-sS", "--max-time", "60", "-x", url, "--cacert", str(proxy.ca), f"https://{API}/repos/acme/basic"],
                       capture_output=True, env=env, timeout=90)
    proxy.record(r.stdout + r.stderr)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "/repos/acme/basic"
    assert tls_upstream.requests[-1].all("Authorization") == [f"Bearer {CANARY}"]
    assert _event(proxy, mark, kind="connect")["decision"] == "allow"
    assert _event(proxy, mark, kind="request")["subject"] == "agent-1"


def test_httpx_with_the_lease_in_the_proxy_url_both_transports(proxy, http_upstream):
    token = lease(proxy, profile="ci")
    mark = proxy.mark()
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    with httpx.Client(proxy=f"http://sandbox:{token}@{proxy.host}:{proxy.port}", verify=ctx, trust_env=False, timeout=10) as c:
        plain = c.get("http://pkgs.acme-test.dev/simple/pip/")  # absolute-form, Basic on the request itself
        tunnelled = c.get(f"https://{API}/repos/acme/x")  # CONNECT, Basic on the CONNECT
    assert (plain.status_code, tunnelled.status_code) == (200, 200)
    assert not http_upstream.requests[-1].all("Proxy-Authorization") and not http_upstream.requests[-1].all("Authorization")
    assert {e["profile"] for e in proxy.new_events(mark) if e["kind"] != "outcome"} == {"ci"}


# ---------------------------------------------------------------------------------------------
# The 407: both schemes offered; the event and log line name the target and the scheme, never the token
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("credentials", "scheme", "reason"),
    [
        (None, "none", "lease-missing"),
        ("Basic !!!", "basic", "lease-malformed"),
        ("BASIC:EXPIRED", "basic", "lease-expired"),
        ("Bearer EXPIRED", "bearer", "lease-expired"),
        ("Bearer FORGED", "bearer", "lease-invalid"),
        ("BASIC:FORGED", "basic", "lease-invalid"),
        ("Negotiate abc", "other", "lease-malformed"),
        ("RAWTOKEN", "other", "lease-malformed"),
    ],
)
@pytest.mark.parametrize("form", ["connect", "absolute"])
def test_a_lease_denial_offers_both_schemes_and_audits_target_and_scheme(proxy, credentials, scheme, reason, form):
    expired = mint(proxy.env.lease_key, "agent-1", connection="github", ttl=1, now=time.time() - 60)
    good = lease(proxy, connection="github")
    forged = good[:-2] + ("AA" if not good.endswith("AA") else "BB")
    proxy.tokens += [expired, forged]
    value = {None: None, "BASIC:EXPIRED": _basic("sandbox", expired), "Bearer EXPIRED": f"Bearer {expired}",
             "Bearer FORGED": f"Bearer {forged}", "BASIC:FORGED": _basic(forged, ""), "RAWTOKEN": good}.get(credentials, credentials)
    auth = f"Proxy-Authorization: {value}\r\n" if value else ""
    if form == "connect":
        wire, method, host = f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\n{auth}\r\n".encode(), "CONNECT", API
    else:
        wire, method, host = f"GET http://pkgs.acme-test.dev/simple/ HTTP/1.1\r\nHost: pkgs.acme-test.dev\r\n{auth}\r\n".encode(), "GET", "pkgs.acme-test.dev"
    mark = proxy.mark()
    answer = _raw(proxy, wire, method)
    assert answer.status == 407 and answer.header("x-egresslaw-deny") == reason
    assert answer.all("proxy-authenticate") == ['Basic realm="egresslaw"', 'Bearer realm="egresslaw"']
    assert (answer.header("connection") or "").lower() == "close"
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    event = _event(proxy, mark, reason=reason)
    assert (event["host"], event["port"], event["auth"], event["decision"]) == (host, 443 if form == "connect" else 80, scheme, "deny")
    lines = [line for line in proxy.logs.lines[-50:] if f"deny {reason}" in line and host in line]
    assert lines and lines[-1].endswith(f"(offered {scheme})"), lines


def test_other_denials_carry_no_auth_field(proxy):
    mark = proxy.mark()
    token = lease(proxy, connection="github")
    answer = _raw(proxy, f"GET https://{API}/admin HTTP/1.1\r\nHost: {API}\r\nProxy-Authorization: {_basic('x', token)}\r\n\r\n".encode())
    assert answer.status == 403 and answer.header("x-egresslaw-deny") == "path-not-allowed"
    assert "auth" not in _event(proxy, mark, reason="path-not-allowed")


# ---------------------------------------------------------------------------------------------
# One client connection, one subject
# ---------------------------------------------------------------------------------------------


def _absolute(host: str, path: str, token: str | None, scheme: str = "https") -> bytes:
    auth = f"Proxy-Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {scheme}://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode()


def test_keep_alive_absolute_form_with_another_lease_is_refused_and_closed(proxy, tls_upstream, http_upstream):
    gh, ci = lease(proxy, connection="github", subject="agent-a"), lease(proxy, profile="ci", subject="agent-b")
    with open_socket(proxy.host, proxy.port) as sock:
        sock.sendall(_absolute(API, "/repos/acme/first", gh))
        first = read_answer(sock)
        assert first.status == 200
        mark = proxy.mark()
        sock.sendall(_absolute("pkgs.acme-test.dev", "/simple/", ci, scheme="http"))
        second = read_answer(sock)
        assert second.status == 407 and second.header("x-egresslaw-deny") == "lease-mismatch"
        assert (second.header("connection") or "").lower() == "close"
        assert sock.recv(1) == b""  # the proxy closed the connection
    proxy.record(first.raw + second.raw)
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    event = _event(proxy, mark, reason="lease-mismatch")
    assert (event["subject"], event["profile"], event["host"], event["port"], event["auth"]) == ("agent-b", "ci", "pkgs.acme-test.dev", 80, "bearer")


def test_a_re_minted_lease_of_the_same_subject_keeps_the_connection(proxy):
    first, renewed = lease(proxy, connection="github", subject="agent-r"), lease(proxy, connection="github", subject="agent-r", ttl=900)
    assert first != renewed
    with open_socket(proxy.host, proxy.port) as sock:
        for token in (first, renewed):
            sock.sendall(_absolute(API, "/repos/acme/renewed", token))
            answer = read_answer(sock)
            proxy.record(answer.raw)
            assert answer.status == 200, answer


def test_connect_after_absolute_form_with_another_lease_is_refused(proxy):
    gh, other = lease(proxy, connection="github", subject="agent-a"), lease(proxy, connection="github", subject="agent-c")
    with open_socket(proxy.host, proxy.port) as sock:
        sock.sendall(_absolute(API, "/repos/acme/first", gh))
        assert read_answer(sock).status == 200
        mark = proxy.mark()
        sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: {_basic('x', other)}\r\n\r\n".encode())
        answer = read_answer(sock, "CONNECT")
    proxy.record(answer.raw)
    assert answer.status == 407 and answer.header("x-egresslaw-deny") == "lease-mismatch"
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    event = _event(proxy, mark, kind="connect")
    assert (event["reason"], event["subject"], event["host"], event["port"], event["auth"]) == ("lease-mismatch", "agent-c", API, 443, "basic")


def test_another_lease_inside_a_tunnel_is_refused_and_closes_it(proxy):
    gh, ci = lease(proxy, connection="github"), lease(proxy, profile="ci")
    sock = open_socket(proxy.host, proxy.port)
    sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {gh}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    with tls_client(sock, proxy.ca, API) as tls:
        tls.sendall(f"GET /repos/acme/a HTTP/1.1\r\nHost: {API}\r\nProxy-Authorization: Bearer not-a-lease\r\n\r\n".encode())
        assert read_answer(tls).status == 200  # a client header that is no lease is stripped, not judged
        mark = proxy.mark()
        tls.sendall(f"GET /repos/acme/b HTTP/1.1\r\nHost: {API}\r\nProxy-Authorization: Bearer {ci}\r\n\r\n".encode())
        answer = read_answer(tls)
        proxy.record(answer.raw)
        assert answer.status == 407 and answer.header("x-egresslaw-deny") == "lease-mismatch"
        assert tls.recv(1) == b""
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert _event(proxy, mark, reason="lease-mismatch")["connection"] == "github"  # the tunnel's subject is the one audited


class _H2:
    """Sequential HTTP/2 requests on one connection (the h2 library, which mitmproxy already depends on)."""

    def __init__(self, tls) -> None:
        import h2.config
        import h2.connection

        self.tls = tls
        self.conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        tls.sendall(self.conn.data_to_send())

    def get(self, path: str, *extra: tuple[str, str]) -> tuple[int | None, dict[str, str], bytes]:
        import h2.events

        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(":method", "GET"), (":scheme", "https"), (":authority", API), (":path", path), *extra], end_stream=True)
        self.tls.sendall(self.conn.data_to_send())
        status, headers, body = None, {}, b""
        while True:
            chunk = self.tls.recv(65536)
            if not chunk:
                return status, headers, body
            for event in self.conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream:
                    headers = dict(event.headers)
                    status = int(headers.pop(":status"))
                elif isinstance(event, h2.events.DataReceived) and event.stream_id == stream:
                    body += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)) and event.stream_id == stream:
                    self.tls.sendall(self.conn.data_to_send())
                    return status, headers, body
            self.tls.sendall(self.conn.data_to_send())


def test_http2_streams_with_another_lease_are_refused_for_the_rest_of_the_connection(proxy):
    gh, ci = lease(proxy, connection="github"), lease(proxy, profile="ci")
    sock = open_socket(proxy.host, proxy.port)
    sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {gh}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    with tls_client(sock, proxy.ca, API, alpn=("h2",)) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        h2c = _H2(tls)
        first = h2c.get("/repos/acme/h2", ("proxy-authorization", f"Bearer {gh}"))  # the same lease again is fine
        assert first[0] == 200, first
        mark = proxy.mark()
        other = h2c.get("/repos/acme/h2", ("proxy-authorization", f"Bearer {ci}"))
        after = h2c.get("/repos/acme/h2")
    for status, headers, body in (first, other, after):
        proxy.record(repr((status, headers)).encode() + body)
    assert (other[0], other[1].get("x-egresslaw-deny")) == (407, "lease-mismatch")
    assert (after[0], after[1].get("x-egresslaw-deny")) == (407, "lease-mismatch")  # every later stream: the connection is refused
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]


# ---------------------------------------------------------------------------------------------
# Lease keys rotated under a running proxy
# ---------------------------------------------------------------------------------------------


def test_rotation_with_an_overlap_then_retirement_under_a_running_proxy(tmp_path, pki, tls_upstream, http_upstream):
    env = make_env(tmp_path / "rot")
    p = start_proxy(env, pki, (tls_upstream, http_upstream), _connect_to(tls_upstream.port, http_upstream.port), listen=free_port())
    try:
        def status(token: str) -> tuple[int, str | None]:
            answer = _raw(p, _absolute(API, "/repos/acme/rot", token))
            return answer.status, answer.header("x-egresslaw-deny")

        old = env.lease(connection="github")
        assert status(old) == (200, None)
        keys, _ = rotate_lease_key(env.keys, overlap=600, now=time.time())
        new = mint(keys, "agent-1", connection="github", now=time.time())
        assert new.split(".")[1] != old.split(".")[1]
        assert status(new) == (200, None)  # the proxy read the rotated key set without a restart
        assert status(old) == (200, None)  # the old key still verifies during the overlap
        rotate_lease_key(env.keys, overlap=0, now=time.time())  # the key that minted `new` retires at once
        assert status(new) == (407, "lease-key-retired")
        assert status(old) == (407, "lease-key-retired")  # `--overlap 0` cuts every older key too
        assert any("lease keys read again" in line for line in p.logs.lines)
        os.chmod(env.keys / "lease.key", 0o644)  # a key file that changed and no longer loads: fail closed
        assert status(new)[0] == 403 and status(new)[1] == "internal-error"
        os.chmod(env.keys / "lease.key", 0o600)
        os.utime(env.keys / "lease.key")
    finally:
        stop_proxy(p)
    p.assert_nothing_leaked()
