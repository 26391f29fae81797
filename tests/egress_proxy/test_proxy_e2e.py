"""End to end through a real listening proxy on 127.0.0.1, real loopback upstreams (HTTP and TLS with a
test CA), and real clients (httpx, curl, the stdlib's http.client and ssl).

One proxy instance serves the whole module (started in-process with a scripted resolver, so DNS
rebinding can be shown); the CLI tests at the end run `egresslaw proxy` as a subprocess with
`--resolve`, `--connect-to` and `--upstream-ca`. Every denial asserts its reason code and that
neither upstream saw a single byte.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from egress_proxy.audit.log import OWN_KINDS
from egress_proxy.custody.lease import mint
from compiler.artifact import load_artifact
from tests.egress_proxy import builders as b
from tests.egress_proxy.conftest import (
    CANARY,
    HOSTS,
    assert_no_canary,
    build_artifact,
    free_port,
    make_env,
    proof_for,
)
from tests.proxy_harness import RunningProxy, proof_for, start_proxy, stop_proxy
from tests.proxy_harness import wait_for as _wait_for

pytestmark = pytest.mark.slow

CURL = shutil.which("curl")
needs_curl = pytest.mark.skipif(CURL is None, reason="curl is not installed (apt-get install curl)")
ROOT = Path(__file__).resolve().parents[2]


class Proxy(RunningProxy):
    """The harness's proxy plus the clients this module drives it with."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, lease: str | None, **kw) -> httpx.Client:
        headers = {"Proxy-Authorization": f"Bearer {lease}"} if lease else {}
        ctx = ssl.create_default_context(cafile=str(self.ca))
        return httpx.Client(proxy=httpx.Proxy(self.url, headers=headers), verify=ctx, trust_env=False, timeout=10, **kw)

    def absolute(self, method: str, url: str, lease: str | None, headers: dict | None = None, body: bytes | None = None):
        """An absolute-form request sent to the proxy in the clear (http.client keeps the URL as the target)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        hdrs = dict(headers or {})
        if lease:
            hdrs["Proxy-Authorization"] = f"Bearer {lease}"
        conn.request(method, url, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        self.show(resp.status, resp.getheaders(), data)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data

    def curl(self, *args: str, lease: str | None = None) -> subprocess.CompletedProcess:
        cmd = [CURL, "-sS", "--max-time", "30", "-x", self.url, "--cacert", str(self.ca), "-D", "-", *args]
        if lease:
            cmd[1:1] = ["--proxy-header", f"Proxy-Authorization: Bearer {lease}"]
        envv = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        result = subprocess.run(cmd, capture_output=True, env=envv, timeout=45)
        self.record(result.stdout)
        self.record(result.stderr)
        return result

    def show(self, status, headers, body) -> None:
        """Keep what a client was shown, for the module's leak scan."""
        self.record(repr((status, list(headers))).encode() + body)


@pytest.fixture(scope="module")
def proxy(env, tls_upstream, http_upstream, pki):
    listen = free_port()
    connect_to = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in HOSTS if h != "self.acme-test.dev"]
    connect_to += [
        f"pkgs.acme-test.dev:80:127.0.0.1:{http_upstream.port}",
        f"self.acme-test.dev:443:127.0.0.1:{listen}",
        f"wrongcert.acme-test.dev:443:127.0.0.1:{tls_upstream.port}",
    ]
    p = start_proxy(env, pki, (tls_upstream, http_upstream), connect_to, listen=listen, watch_interval=0.1, proxy_class=Proxy)
    yield p
    stop_proxy(p)
    # Whatever subset of this module ran here (pytest-xdist splits modules), nothing leaked.
    p.assert_nothing_leaked()


def _only_event(p: Proxy, mark, **match) -> dict:
    events = [e for e in p.new_events(mark) if all(e.get(k) == v for k, v in match.items())]
    assert len(events) == 1, (match, p.new_events(mark))
    return events[0]


def _assert_denied(p: Proxy, mark, status: int, headers: dict, body: bytes, reason: str) -> None:
    assert status == (407 if reason.startswith("lease-") else 403), (status, body)
    assert headers.get("x-egresslaw-deny") == reason, headers
    assert json.loads(body) == {"error": "egress_denied", "reason": reason, "rule": None}
    assert p.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)], "upstream saw bytes for a denied request"
    events = [e for e in p.new_events(mark) if e["reason"] == reason and e["decision"] == "deny"]
    assert events, p.new_events(mark)


# ---------------------------------------------------------------------------------------------
# Allowed traffic: exactly one credential, only allowlisted headers
# ---------------------------------------------------------------------------------------------


def test_connect_with_httpx_injects_exactly_one_credential(proxy, tls_upstream):
    mark = proxy.mark()
    with proxy.client(proxy.lease(connection="github")) as c:
        r = c.get(
            "https://api.acme-test.dev/repos/acme/app?per_page=5",
            headers={"Authorization": "Bearer client-supplied", "Accept": "application/json", "X-Custom": "drop-me", "Cookie": "a=b"},
        )
        proxy.show(r.status_code, r.headers.items(), r.content)
    assert r.status_code == 200 and r.json()["tls"] is True
    seen = tls_upstream.requests[-1]
    assert seen.path == "/repos/acme/app?per_page=5"
    assert seen.all("Authorization") == [f"Bearer {CANARY}"]
    assert seen.all("Accept") == ["application/json"]
    assert not seen.all("X-Custom") and not seen.all("Cookie") and not any(k.lower().startswith("proxy-") for k, _ in seen.headers)
    event = _only_event(proxy, mark, kind="request")
    assert (event["decision"], event["reason"], event["rule"], event["path"]) == ("allow", "allowed", "read", "/repos/acme/app")
    assert event["connection"] == "github" and event["subject"] == "agent-1" and event["status"] is None  # written ahead
    assert (proxy.outcome(event)["status"], proxy.outcome(event)["failure"]) == (200, None)
    assert "per_page" not in json.dumps(event)
    assert _only_event(proxy, mark, kind="connect")["decision"] == "allow"


@needs_curl
def test_connect_with_curl_injects_exactly_one_credential(proxy, tls_upstream):
    mark = proxy.mark()
    r = proxy.curl("--http2", "-H", "Authorization: Bearer nope", "-H", "Accept: text/plain", "https://api.acme-test.dev/repos/acme/curl", lease=proxy.lease(connection="github"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"HTTP/1.1 200")  # the CONNECT
    assert b"\r\n\r\nHTTP/2 200" in r.stdout  # HTTP/2 from curl to the proxy, HTTP/1.1 to the upstream
    seen = tls_upstream.requests[-1]
    assert seen.path == "/repos/acme/curl"
    assert seen.all("Authorization") == [f"Bearer {CANARY}"]
    assert proxy.upstream_delta(mark)[0][2] == 1


def test_absolute_form_https_is_upgraded_to_tls_upstream(proxy, tls_upstream):
    mark = proxy.mark()
    status, headers, body = proxy.absolute(
        "POST",
        "https://api.acme-test.dev/repos/acme/app/issues",
        proxy.lease(connection="github"),
        {"Content-Type": "application/json", "Authorization": "Basic eDp5", "Proxy-Connection": "keep-alive", "Connection": "X-Hop", "X-Hop": "1"},
        b'{"title": "t"}',
    )
    assert status == 200 and json.loads(body)["tls"] is True
    seen = tls_upstream.requests[-1]
    assert (seen.method, seen.path, seen.body) == ("POST", "/repos/acme/app/issues", b'{"title": "t"}')
    assert seen.all("Authorization") == [f"Bearer {CANARY}"]
    assert seen.all("Content-Type") == ["application/json"]
    assert not seen.all("X-Hop") and not seen.all("Proxy-Connection")
    assert proxy.upstream_delta(mark)[1] == (0, 0, 0)  # nothing went to the plain-HTTP upstream
    assert _only_event(proxy, mark, kind="request")["rule"] == "issues"


@needs_curl
def test_absolute_form_https_with_curl(proxy, tls_upstream):
    r = proxy.curl("--request-target", "https://api.acme-test.dev/repos/acme/rt", "http://api.acme-test.dev/repos/acme/rt", lease=proxy.lease(connection="github"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"HTTP/1.1 200")
    assert tls_upstream.requests[-1].path == "/repos/acme/rt"
    assert tls_upstream.requests[-1].all("Authorization") == [f"Bearer {CANARY}"]


def test_sandbox_profile_gets_its_hosts_and_never_a_credential(proxy, http_upstream, tls_upstream):
    lease = proxy.lease(profile="ci")
    status, _, body = proxy.absolute("GET", "http://pkgs.acme-test.dev/simple/pip/", lease, {"Proxy-Authorization-Extra": "x", "X-Client": "1"})
    assert status == 200 and json.loads(body)["tls"] is False
    seen = http_upstream.requests[-1]
    assert seen.path == "/simple/pip/" and not seen.all("Authorization") and seen.all("X-Client") == ["1"]
    assert not any(k.lower().startswith("proxy-") for k, _ in seen.headers)
    with proxy.client(lease) as c:
        r = c.get("https://api.acme-test.dev/repos/acme/app")
    assert r.status_code == 200
    assert not tls_upstream.requests[-1].all("Authorization")


# ---------------------------------------------------------------------------------------------
# Denials: reason code, 403/407 JSON, zero bytes upstream
# ---------------------------------------------------------------------------------------------

NOW = time.time()

ABSOLUTE_DENIALS = [
    ("no-lease", "GET", "https://api.acme-test.dev/repos/acme/x", None, {}, None, "lease-missing"),
    ("legacy-forged", "GET", "https://api.acme-test.dev/repos/acme/x", "el1.e30.AAAA", {}, None, "lease-key-unknown"),
    ("expired", "GET", "https://api.acme-test.dev/repos/acme/x", "EXPIRED", {}, None, "lease-expired"),
    ("unknown-subject", "GET", "https://api.acme-test.dev/repos/acme/x", "UNKNOWN", {}, None, "lease-unknown-subject"),
    ("path", "GET", "https://api.acme-test.dev/admin", "GH", {}, None, "path-not-allowed"),
    ("prefix-not-bounded", "GET", "https://api.acme-test.dev/repos/acmex/x", "GH", {}, None, "path-not-allowed"),
    ("method", "DELETE", "https://api.acme-test.dev/repos/acme/x", "GH", {}, None, "method-not-allowed"),
    ("host", "GET", "https://unlisted.acme-test.dev/", "GH", {}, None, "no-matching-rule"),
    ("port", "GET", "https://api.acme-test.dev:8443/repos/acme/x", "GH", {}, None, "no-matching-rule"),
    ("plain-http-connection", "GET", "http://api.acme-test.dev/repos/acme/x", "GH", {}, None, "scheme-not-allowed"),
    ("host-header", "GET", "https://api.acme-test.dev/repos/acme/x", "GH", {"Host": "other.acme-test.dev"}, None, "host-header-mismatch"),
    ("numeric-short", "GET", "https://127.1/", "GH", {}, None, "host-noncanonical-ip"),
    ("numeric-int", "GET", "https://2130706433/", "GH", {}, None, "host-noncanonical-ip"),
    ("numeric-hex", "GET", "https://0x7f.0.0.1/", "GH", {}, None, "host-noncanonical-ip"),
    ("ip-literal", "GET", "https://93.184.216.34/", "GH", {}, None, "ip-literal-refused"),
    ("dot-segment", "GET", "https://api.acme-test.dev/repos/acme/../admin", "GH", {}, None, "path-dot-segment"),
    ("encoded-dot", "GET", "https://api.acme-test.dev/repos/acme/%2e%2e/admin", "GH", {}, None, "path-encoded-dot"),
    ("encoded-slash", "GET", "https://api.acme-test.dev/repos/acme%2f..%2fadmin", "GH", {}, None, "path-encoded-slash"),
    ("params", "GET", "https://api.acme-test.dev/repos/acme/x;jsessionid=1", "GH", {}, None, "path-parameter"),
    ("double-slash", "GET", "https://api.acme-test.dev/repos//acme/x", "GH", {}, None, "path-empty-segment"),
    ("private-answer", "GET", "https://private.acme-test.dev/", "GH", {}, None, "address-not-public"),
    ("one-bad-answer", "GET", "https://mixed.acme-test.dev/", "GH", {}, None, "address-not-public"),
    ("nxdomain", "GET", "https://nxdomain.acme-test.dev/", "GH", {}, None, "resolve-failed"),
    ("self", "GET", "https://self.acme-test.dev/", "GH", {}, None, "self-connection"),
    ("websocket", "GET", "https://api.acme-test.dev/repos/acme/x", "GH", {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"}, None, "upgrade-denied"),
    ("h2c", "GET", "https://api.acme-test.dev/repos/acme/x", "GH", {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"}, None, "upgrade-denied"),
    ("body-on-get", "GET", "https://api.acme-test.dev/repos/acme/x", "GH", {"Content-Type": "text/plain"}, b"payload", "body-on-bodyless-method"),
    ("metadata-followup-connection", "GET", "http://169.254.169.254/latest/meta-data/", "GH", {}, None, "scheme-not-allowed"),
    ("metadata-followup-sandbox", "GET", "http://169.254.169.254/latest/meta-data/", "CI", {}, None, "ip-literal-refused"),
    ("sandbox-unlisted-host", "GET", "https://other.acme-test.dev/", "CI", {}, None, "profile-host-not-allowed"),
    ("sandbox-wrong-port", "GET", "http://api.acme-test.dev/", "CI", {}, None, "profile-host-not-allowed"),
]


def _lease_for(p: Proxy, which: str | None) -> str | None:
    if which in (None,) or which.startswith("el1."):
        return which
    if which == "GH":
        return p.lease(connection="github")
    if which == "CI":
        return p.lease(profile="ci")
    if which == "EXPIRED":
        return mint(p.env.lease_key, "agent-1", connection="github", ttl=1, now=time.time() - 60)
    if which == "UNKNOWN":
        return p.lease(connection="not-in-artifact")
    raise AssertionError(which)


@pytest.mark.parametrize(("case", "method", "url", "lease", "headers", "body", "reason"), ABSOLUTE_DENIALS, ids=[c[0] for c in ABSOLUTE_DENIALS])
def test_absolute_form_denials(proxy, case, method, url, lease, headers, body, reason):
    mark = proxy.mark()
    status, hdrs, data = proxy.absolute(method, url, _lease_for(proxy, lease), headers, body)
    _assert_denied(proxy, mark, status, hdrs, data, reason)
    if reason.startswith("lease-"):
        assert hdrs.get("proxy-authenticate", "").startswith("Bearer")


CONNECT_DENIALS = [
    ("no-lease", "api.acme-test.dev:443", None, "lease-missing"),
    ("legacy-forged", "api.acme-test.dev:443", "el1.AAAA.BBBB", "lease-key-unknown"),
    ("unlisted", "unlisted.acme-test.dev:443", "GH", "no-matching-rule"),
    ("numeric", "127.1:443", "GH", "host-noncanonical-ip"),
    ("loopback-literal", "127.0.0.1:443", "GH", "ip-literal-refused"),
    ("private-answer", "private.acme-test.dev:443", "GH", "address-not-public"),
    ("special-use", "metadata.google.internal:443", "GH", "no-matching-rule"),
    ("sandbox-port", "api.acme-test.dev:22", "CI", "profile-host-not-allowed"),
]


@pytest.mark.parametrize(("case", "target", "lease", "reason"), CONNECT_DENIALS, ids=[c[0] for c in CONNECT_DENIALS])
def test_connect_denials(proxy, case, target, lease, reason):
    mark = proxy.mark()
    status, headers, body = _connect(proxy, target, _lease_for(proxy, lease))
    _assert_denied(proxy, mark, status, headers, body, reason)
    assert _only_event(proxy, mark, kind="connect")["reason"] == reason


def _connect(p: Proxy, target: str, lease: str | None, keep: bool = False):
    sock = socket.create_connection((p.host, p.port), timeout=10)
    auth = f"Proxy-Authorization: Bearer {lease}\r\n" if lease else ""
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode())
    resp = http.client.HTTPResponse(sock, method="CONNECT")
    resp.begin()
    body = resp.read() if resp.status != 200 else b""
    p.show(resp.status, resp.getheaders(), body)
    headers = {k.lower(): v for k, v in resp.getheaders()}
    if keep:
        return resp.status, sock
    sock.close()
    return resp.status, headers, body


@pytest.mark.parametrize(
    ("case", "sni", "reason"),
    [("mismatch", "other.acme-test.dev", "sni-mismatch"), ("missing", None, "sni-missing")],
)
def test_tls_sni_must_equal_connect_host(proxy, case, sni, reason):
    mark = proxy.mark()
    status, sock = _connect(proxy, "api.acme-test.dev:443", proxy.lease(connection="github"), keep=True)
    assert status == 200
    ctx = ssl.create_default_context(cafile=str(proxy.ca))
    ctx.check_hostname = False
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        with ctx.wrap_socket(sock, server_hostname=sni) as tls:
            tls.sendall(b"GET /repos/acme/x HTTP/1.1\r\nHost: api.acme-test.dev\r\n\r\n")
            if not tls.recv(1):
                raise ConnectionError("closed")
    sock.close()
    time.sleep(0.1)
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert _only_event(proxy, mark, kind="tls")["reason"] == reason


def _tunnel(p: Proxy, host: str, lease: str):
    status, sock = _connect(p, f"{host}:443", lease, keep=True)
    assert status == 200
    ctx = ssl.create_default_context(cafile=str(p.ca))
    return ctx.wrap_socket(sock, server_hostname=host)


def test_connect_inside_a_tunnel_is_denied(proxy):
    mark = proxy.mark()
    with _tunnel(proxy, "api.acme-test.dev", proxy.lease(connection="github")) as tls:
        tls.sendall(b"CONNECT other.acme-test.dev:443 HTTP/1.1\r\nHost: other.acme-test.dev:443\r\n\r\n")
        resp = http.client.HTTPResponse(tls)
        resp.begin()
        data = resp.read()
        proxy.show(resp.status, resp.getheaders(), data)
    assert resp.status >= 400
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert _only_event(proxy, mark, kind="request")["reason"] == "connect-in-tunnel"


def test_non_http_inside_a_tunnel_is_refused(proxy):
    mark = proxy.mark()
    with _tunnel(proxy, "api.acme-test.dev", proxy.lease(connection="github")) as tls:
        tls.settimeout(30)  # mitmproxy's 400 comes at once; a loaded machine may take seconds to send it
        tls.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n\x00\x01\x02binary")
        try:
            data = tls.recv(4096)
        except (ssl.SSLError, ConnectionError, TimeoutError):
            data = b""
        proxy.seen.append(data)
    time.sleep(0.1)
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert data.startswith(b"HTTP/1.1 400"), data  # mitmproxy refuses to parse it; it is never relayed


def test_ambiguous_framing_is_refused(proxy):
    mark = proxy.mark()
    lease = proxy.lease(connection="github")
    raw = (
        "POST https://api.acme-test.dev/repos/acme/app/issues HTTP/1.1\r\nHost: api.acme-test.dev\r\n"
        f"Proxy-Authorization: Bearer {lease}\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ).encode()
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(raw)
        data = sock.recv(65536)
    proxy.seen.append(data)
    assert data.startswith(b"HTTP/1.1 4")
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert _only_event(proxy, mark, kind="request")["reason"] == "smuggling"


def test_request_trailers_never_reach_upstream(proxy):
    # mitmproxy's HTTP/1 reader refuses request trailers itself (it drops the connection); HTTP/2
    # trailers reach the addon, which denies them (tests/egress_proxy/edge/test_addon.py).
    mark = proxy.mark()
    lease = proxy.lease(connection="github")
    raw = (
        "POST https://api.acme-test.dev/repos/acme/app/issues HTTP/1.1\r\nHost: api.acme-test.dev\r\n"
        f"Proxy-Authorization: Bearer {lease}\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sneak\r\n\r\n"
        "4\r\nbody\r\n0\r\nX-Sneak: 1\r\n\r\n"
    ).encode()
    with socket.create_connection((proxy.host, proxy.port), timeout=3) as sock:
        sock.sendall(raw)
        try:
            data = sock.recv(65536)
        except (TimeoutError, ConnectionError):
            data = b""
    proxy.seen.append(data)
    assert not data.startswith(b"HTTP/1.1 2")
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert _wait_for(lambda: any(e["kind"] == "request" for e in proxy.new_events(mark)))
    assert _only_event(proxy, mark, kind="request")["reason"] == "trailers-denied"


def test_upstream_certificate_is_verified_against_the_name(proxy, tls_upstream):
    # The upstream's certificate does not name wrongcert.acme-test.dev: the handshake fails, no request is sent.
    mark = proxy.mark()
    status, headers, body = proxy.absolute("GET", "https://wrongcert.acme-test.dev/", proxy.lease(connection="github"))
    assert status == 502
    assert json.loads(body) == {"error": "upstream_error", "reason": "upstream-error"}  # our answer, not mitmproxy's page
    assert proxy.upstream_delta(mark)[0][2] == 0  # not one HTTP request (so no credential) reached it
    event = _only_event(proxy, mark, kind="request")
    outcome = proxy.outcome(event)
    assert (event["decision"], event["reason"], outcome["failure"], outcome["status"]) == ("allow", "allowed", "upstream-error", 502)


# ---------------------------------------------------------------------------------------------
# Redirects, forged headers, read-back
# ---------------------------------------------------------------------------------------------


def test_redirect_is_passed_back_unfollowed_and_its_follow_up_denied(proxy, tls_upstream):
    mark = proxy.mark()
    with proxy.client(proxy.lease(connection="github")) as c:
        r = c.get("https://api.acme-test.dev/redirect")
        proxy.show(r.status_code, r.headers.items(), r.content)
        assert r.status_code == 302
        assert r.headers["location"] == "http://169.254.169.254/latest/meta-data/"
        assert r.headers["x-egresslaw-redirect"] == "not-followed"
        assert proxy.upstream_delta(mark)[0][2] == 1  # the proxy issued exactly the one request
        follow = c.get(r.headers["location"])  # the caller's own follow-up is a new request, judged again
        proxy.show(follow.status_code, follow.headers.items(), follow.content)
    assert follow.status_code == 403 and follow.headers["x-egresslaw-deny"] == "scheme-not-allowed"
    assert proxy.upstream_delta(mark)[0][2] == 1 and proxy.upstream_delta(mark)[1] == (0, 0, 0)


def test_redirect_followed_by_httpx_is_denied_at_the_proxy(proxy, tls_upstream):
    mark = proxy.mark()
    with proxy.client(proxy.lease(profile="ci"), follow_redirects=True) as c:
        r = c.get("https://api.acme-test.dev/redirect")
        proxy.show(r.status_code, r.headers.items(), r.content)
    assert r.status_code == 403 and r.headers["x-egresslaw-deny"] == "ip-literal-refused"
    assert proxy.upstream_delta(mark)[0][2] == 1


def test_forged_egresslaw_headers_are_stripped(proxy):
    with proxy.client(proxy.lease(connection="github")) as c:
        r = c.get("https://api.acme-test.dev/forge")
    assert r.status_code == 200 and r.json() == {"forged": True}
    assert "x-egresslaw-deny" not in r.headers and "x-egresslaw-redirect" not in r.headers


def test_sandbox_responses_are_streamed_with_our_headers_cleaned(proxy):
    mark = proxy.mark()
    with proxy.client(proxy.lease(profile="ci")) as c:
        forged = c.get("https://api.acme-test.dev/forge")
        redirect = c.get("https://api.acme-test.dev/redirect")
    assert forged.status_code == 200 and forged.json() == {"forged": True}
    assert "x-egresslaw-deny" not in forged.headers and "x-egresslaw-redirect" not in forged.headers
    assert redirect.status_code == 302 and redirect.headers["x-egresslaw-redirect"] == "not-followed"
    # a streamed response's event is written when the stream ends, which can be just after the
    # client has read the last byte: wait for it (bounded) rather than race it
    events = [e for e in proxy.new_events(mark) if e["kind"] == "request"]
    assert [(e["profile"], proxy.outcome(e)["bytes_down"]) for e in events] == [("ci", len(b'{"forged": true}')), ("ci", len(b"moved"))]


def test_echoed_credential_is_redacted_and_audited(proxy):
    mark = proxy.mark()
    with proxy.client(proxy.lease(connection="github")) as c:
        r = c.get("https://api.acme-test.dev/echo")
        proxy.show(r.status_code, r.headers.items(), r.content)
    assert r.status_code == 200
    assert r.json() == {"authorization": "Bearer [REDACTED]", "b64": "[REDACTED]", "hex": "[REDACTED]", "url": "[REDACTED]"}
    assert r.headers["x-echo-auth"] == "Bearer [REDACTED]"
    assert_no_canary(r.content + repr(r.headers).encode(), "the echoed response")
    event = _only_event(proxy, mark, kind="request")
    assert proxy.outcome(event)["redactions"] >= 5


# ---------------------------------------------------------------------------------------------
# DNS: one lookup, every answer judged, the vetted address pinned
# ---------------------------------------------------------------------------------------------


def test_rebinding_never_reaches_loopback(proxy, tls_upstream):
    lease = proxy.lease(connection="github")
    before = proxy.resolver.calls.get("rebind.acme-test.dev", 0)
    assert before == 0
    with proxy.client(lease) as c:
        for i in range(3):
            r = c.get(f"https://rebind.acme-test.dev/{i}")
            assert r.status_code == 200, proxy.resolver.calls
    # One CONNECT, one lookup: requests inside the tunnel reuse the vetted, pinned answer.
    assert proxy.resolver.calls["rebind.acme-test.dev"] == 1, proxy.resolver.calls
    mark = proxy.mark()
    with proxy.client(lease) as c, pytest.raises(httpx.ProxyError, match="403"):
        c.get("https://rebind.acme-test.dev/again")  # the new CONNECT resolves again: 127.0.0.1 is refused
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert _only_event(proxy, mark, kind="connect")["reason"] == "address-not-public"
    status, headers, body = proxy.absolute("GET", "https://rebind.acme-test.dev/abs", lease)
    _assert_denied(proxy, mark, status, headers, body, "address-not-public")


# ---------------------------------------------------------------------------------------------
# Audit, metrics, reload
# ---------------------------------------------------------------------------------------------


def test_every_request_yields_exactly_one_event(proxy):
    mark = proxy.mark()
    lease = proxy.lease(connection="github")
    paths = ["/repos/acme/a", "/nope", "/repos/acme/b", "/repos/acme/../x", "/echo"] * 4
    with proxy.client(lease) as c:
        for path in paths:
            r = c.get("https://api.acme-test.dev" + path)
            proxy.show(r.status_code, r.headers.items(), r.content)
    events = [e for e in proxy.new_events(mark) if e["kind"] == "request"]
    assert len(events) == len(paths)
    assert [e["decision"] for e in events] == ["allow", "deny", "allow", "deny", "allow"] * 4


def test_metrics_need_the_admin_token(proxy):
    proxy.absolute("GET", "https://api.acme-test.dev/repos/acme/x", None)
    proxy.absolute("GET", "https://api.acme-test.dev/repos/acme/x", proxy.lease(connection="github"))
    host, port = proxy.admin_address()
    url = f"http://{host}:{port}/metrics"
    with httpx.Client(trust_env=False) as c:
        assert c.get(url).status_code == 401
        assert c.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        token = (proxy.env.confdir / "admin.token").read_text().strip()
        r = c.get(url, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200
    assert 'egresslaw_decisions_total{decision="deny",kind="request",reason="lease-missing"}' in r.text
    assert 'egresslaw_decisions_total{decision="allow",kind="request",reason="allowed"}' in r.text
    assert "egresslaw_request_duration_seconds_bucket" in r.text and "egresslaw_reloads_total" in r.text
    assert oct((proxy.env.confdir / "admin.token").stat().st_mode & 0o777) == "0o600"


def _atomic_write(path: Path, text: str) -> None:
    """Replace a watched file in one step: the watcher must never read half of it (each read is a reload)."""
    staged = path.with_name(f".{path.name}.staged")
    staged.write_text(text)
    staged.replace(path)


def test_reload_keeps_serving_and_swaps_atomically(proxy):
    env = proxy.env
    lease = proxy.lease(connection="github")
    reloads = lambda result: proxy.metric("egresslaw_reloads_total", result=result)  # noqa: E731
    original = env.artifact.read_text()
    original_proof = env.proof.read_text()
    try:
        _atomic_write(env.artifact, original.replace('"workspace"', '"workspaces"'))  # fails verification
        assert _wait_for(lambda: reloads("failed") >= 1)
        status, _, _ = proxy.absolute("GET", "https://api.acme-test.dev/repos/acme/still", lease)
        assert status == 200
        # A valid new artifact whose proof is not all-proved is refused too.
        newer = build_artifact([b.rule("new", "api.acme-test.dev", "/new", ["GET"])])
        unproved, proved = proof_for(newer, verdict="unknown"), proof_for(newer)  # proving takes a moment: before any write
        env.proof.write_text(unproved)
        _atomic_write(env.artifact, newer.to_json())
        assert _wait_for(lambda: reloads("failed") >= 2)
        assert proxy.absolute("GET", "https://api.acme-test.dev/new", lease)[0] == 403
        # With its proof, it is swapped in; the old rules stay because they are in the new artifact too.
        env.proof.write_text(proved)
        os.utime(env.artifact, ns=(time.time_ns(), time.time_ns()))
        assert _wait_for(lambda: reloads("ok") >= 1)
        assert proxy.absolute("GET", "https://api.acme-test.dev/new", lease)[0] == 200
        assert proxy.absolute("GET", "https://api.acme-test.dev/repos/acme/x", lease)[0] == 200
    finally:
        env.proof.write_text(original_proof)
        _atomic_write(env.artifact, original)
        _wait_for(lambda: reloads("ok") >= 2)
    for chain in proxy.chains():  # with several workers, every worker records every reload
        reloads = [e for e in chain if e["kind"] == "reload"]
        assert [e["decision"] for e in reloads][:3] == ["deny", "deny", "allow"]
        assert any("does not prove" in (e.get("detail") or "") for e in reloads)


def test_zz_canary_never_leaks(proxy):
    """Runs last in this module: the audit log, proxy logs and everything clients saw hold no credential."""
    lease = proxy.lease(connection="github")
    with proxy.client(lease) as c:
        for path in ("/echo", "/redirect", "/repos/acme/x", "/nope"):
            r = c.get("https://api.acme-test.dev" + path)
            proxy.show(r.status_code, r.headers.items(), r.content)
    proxy.absolute("GET", "https://wrongcert.acme-test.dev/", lease)  # an upstream error path
    proxy.absolute("GET", "https://api.acme-test.dev/echo", "el1.forged.x")  # a lease error path
    proxy.audit_bytes()  # flushed
    proxy.assert_nothing_leaked()
    assert any("deny" in line for line in proxy.logs.lines)  # the capture did see the proxy's logs
    assert len(proxy.seen) >= 6
    from egress_proxy.audit.verify import verify_logs
    from egress_proxy.custody.keys import load_audit_key

    # Every line verifies, MACs included; the log (every worker's chain) is open while the proxy runs.
    results = verify_logs(proxy.env.audit, key=load_audit_key(proxy.env.keys))
    assert results and all(result.status == "open" for _, result in results), results


# ---------------------------------------------------------------------------------------------
# The CLI: fail-closed start-up, test routing, SIGHUP, graceful shutdown
# ---------------------------------------------------------------------------------------------


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "egresslaw", *args], capture_output=True, text=True, cwd=ROOT, timeout=60, **kw)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("cli"))


def _proxy_args(e, port: int, admin: int, **over) -> list[str]:
    args = {
        "--artifact": str(e.artifact),
        "--proof": str(e.proof),
        "--keys": str(e.keys),
        "--store": str(e.store),
        "--listen": f"127.0.0.1:{port}",
        "--admin": f"127.0.0.1:{admin}",
        "--confdir": str(e.confdir),
        "--audit-log": str(e.audit),
        "--workers": "1",  # one process, one audit file (`--workers N` has its own tests: tests/egress_proxy/run/test_supervisor.py)
    }
    args.update(over)
    out = ["proxy"]
    for k, v in args.items():
        if v is not None:
            out += [k, v]
    return out


def test_cli_start_up_is_fail_closed(cli_env, tmp_path):
    e = cli_env
    port, admin = free_port(), free_port()
    bad_artifact = tmp_path / "bad.json"
    bad_artifact.write_text(e.artifact.read_text().replace('"acme"', '"acme2"'))
    unproven = tmp_path / "unproven.json"
    unproven.write_text(proof_for(load_artifact(e.artifact.read_text()), verdict="unknown"))  # signed, every check unknown
    loose_keys = tmp_path / "keys"
    shutil.copytree(e.keys, loose_keys)
    os.chmod(loose_keys / "lease.key", 0o644)
    cases = {
        "digest": ({"--artifact": str(bad_artifact)}, "digest"),
        "unproven": ({"--proof": str(unproven)}, "does not prove"),
        "no-proof": ({"--proof": str(tmp_path / "missing.json")}, "does not exist"),
        "keys-mode": ({"--keys": str(loose_keys)}, "chmod 600"),
        "no-keys": ({"--keys": str(tmp_path / "nokeys")}, "does not exist"),
        "no-store": ({"--store": str(tmp_path / "missing.db")}, "does not exist"),
        "bad-resolve": ({"--resolve": "api.acme-test.dev"}, "HOST=IP"),
        # the proof's capacity figures assumed the default head limits: a proxy that admits larger heads would carry more
        "head-limit": ({"--max-head-bytes": "1m"}, "--max-head-bytes 1,048,576 admits more than the proof's capacity figures assumed"),
        "header-count": ({"--max-headers": "500"}, "--max-headers 500 admits more"),
    }
    for name, (over, message) in cases.items():
        r = _cli(*_proxy_args(e, port, admin, **over))
        assert r.returncode == 2, (name, r.stderr)
        assert message in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
        assert not _listening(port) and not _listening(admin), name


@needs_curl
def test_cli_proxy_with_test_routing_reload_and_graceful_shutdown(cli_env, tls_upstream, pki):
    e = cli_env
    port, admin = free_port(), free_port()
    args = _proxy_args(e, port, admin) + [
        "--resolve", "api.acme-test.dev=93.184.216.34",
        "--resolve", "private.acme-test.dev=10.0.0.5",
        "--connect-to", f"api.acme-test.dev:443:127.0.0.1:{tls_upstream.port}",
        "--connect-to", f"private.acme-test.dev:443:127.0.0.1:{tls_upstream.port}",
        "--upstream-ca", str(pki.ca_pem),
    ]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "egresslaw", *args], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: _listening(port), 60), "proxy did not start"
        lease = _cli("lease", "--keys", str(e.keys), "--artifact", str(e.artifact), "--connection", "github", "--subject", "cli-test").stdout.strip()
        ca = _cli("ca", "--confdir", str(e.confdir)).stdout.strip()
        assert Path(ca).is_file() and ca.endswith("mitmproxy-ca-cert.pem")
        base = [CURL, "-sS", "--max-time", "30", "-x", f"http://127.0.0.1:{port}", "--cacert", ca, "--proxy-header", f"Proxy-Authorization: Bearer {lease}", "-D", "-"]
        envv = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        ok = subprocess.run([*base, "https://api.acme-test.dev/repos/acme/cli"], capture_output=True, env=envv, timeout=45)
        assert b" 200" in ok.stdout, ok.stderr
        assert tls_upstream.requests[-1].all("Authorization") == [f"Bearer {CANARY}"]
        denied = subprocess.run([*base, "https://private.acme-test.dev/"], capture_output=True, env=envv, timeout=45)
        assert b"address-not-public" in denied.stdout + denied.stderr
        # SIGHUP with a broken artifact: the old one keeps serving.
        original = e.artifact.read_text()
        e.artifact.write_text("{}")
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        again = subprocess.run([*base, "https://api.acme-test.dev/repos/acme/after-hup"], capture_output=True, env=envv, timeout=45)
        assert b" 200" in again.stdout
        e.artifact.write_text(original)
        for blob in (ok.stdout, ok.stderr, denied.stdout, denied.stderr, again.stdout):
            assert_no_canary(blob, "curl output")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    for warning in ("--resolve `api.acme-test.dev=93.184.216.34`", "--connect-to", "--upstream-ca"):
        assert warning in err
    assert "reload refused" in err
    assert_no_canary(out + err, "the proxy's stdout/stderr")
    assert not _listening(port)
    # Graceful shutdown flushed every event; the chain verifies through the CLI.
    events = [ev for ev in map(json.loads, e.audit.read_bytes().splitlines()) if ev["kind"] not in OWN_KINDS]
    requests = [ev for ev in events if ev["kind"] == "request"]
    assert [ev["path"] for ev in requests] == ["/repos/acme/cli", "/repos/acme/after-hup"]
    assert all("test_routing" in ev and "resolve" in ev["test_routing"] for ev in events)
    assert any(ev["kind"] == "connect" and ev["reason"] == "address-not-public" for ev in events)
    assert_no_canary(e.audit.read_bytes(), "the CLI audit log")
    verify = _cli("audit", "verify", str(e.audit))
    assert verify.returncode == 0, verify.stderr
    # A tampered log fails with the line number: exactly with the key, between two checkpoints without it.
    lines = e.audit.read_bytes().splitlines()
    assert b'"allow"' in lines[1]
    lines[1] = lines[1].replace(b'"allow"', b'"deny"', 1)
    e.audit.write_bytes(b"\n".join(lines) + b"\n")
    broken = _cli("audit", "verify", str(e.audit), "--keys", str(e.keys))
    assert broken.returncode == 1 and "line 2: its MAC does not verify" in broken.stderr, broken.stderr
    keyless = _cli("audit", "verify", str(e.audit))
    assert keyless.returncode == 1 and "lines 2-" in keyless.stderr and "not checked: line MACs" in keyless.stderr, keyless.stderr


def test_cli_allow_unproven_warns_on_every_request(tmp_path, tls_upstream, pki):
    e = make_env(tmp_path / "unproven")
    e.proof.write_text(e.proof.read_text().replace('"proved"', '"unknown"'))
    port, admin = free_port(), free_port()
    args = _proxy_args(e, port, admin) + [
        "--allow-unproven",
        "--resolve", "api.acme-test.dev=93.184.216.34",
        "--connect-to", f"api.acme-test.dev:443:127.0.0.1:{tls_upstream.port}",
        "--upstream-ca", str(pki.ca_pem),
    ]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "egresslaw", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: _listening(port), 60)
        lease = _cli("lease", "--keys", str(e.keys), "--artifact", str(e.artifact), "--connection", "github").stdout.strip()
        for i in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", f"https://api.acme-test.dev/repos/acme/{i}", headers={"Proxy-Authorization": f"Bearer {lease}"})
            assert conn.getresponse().status == 200
            conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert err.count("serving an unproven artifact (--allow-unproven)") >= 3
    events = [ev for ev in map(json.loads, e.audit.read_bytes().splitlines()) if ev["kind"] not in OWN_KINDS]
    assert events and all(ev.get("unproven") is True for ev in events)


@needs_curl
def test_cli_real_pipeline_compile_prove_keys_custody_lease_proxy(tmp_path):
    """The production path with real tools: compile the demo policy, prove it, seal the credential, serve."""
    from tests.egress_proxy.conftest import _issue, start_upstream

    pki = _issue(tmp_path / "pki", ("api.github.com",))
    upstream = start_upstream(pki)
    try:
        art, proof, keys, store = tmp_path / "a.json", tmp_path / "p.json", tmp_path / "keys", tmp_path / "custody.db"
        assert _cli("compile", "policies/demo", "-o", str(art)).returncode == 0
        assert _cli("keys", "init", "--proof-signing", "--dir", str(tmp_path / "prover")).returncode == 0
        proved = _cli("prove", str(art), "-o", str(proof), "--sign", str(tmp_path / "prover" / "proof-signing.key"))
        assert proved.returncode == 0, proved.stdout + proved.stderr
        assert _cli("keys", "init", "--dir", str(keys)).returncode == 0
        put = _cli("custody", "put", "--keys", str(keys), "--store", str(store), "--workspace", "acme", "--connection", "github",
                   "--handle", "gh-prod", input=CANARY + "\n")  # fmt: skip
        assert put.returncode == 0, put.stderr
        port, admin = free_port(), free_port()
        audit_log, confdir = tmp_path / "audit.jsonl", tmp_path / "conf"
        argv = [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(art), "--proof", str(proof), "--keys", str(keys),
                "--trust-proofs", str(tmp_path / "prover" / "proof-signing.pub"),
                "--store", str(store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}", "--confdir", str(confdir),
                "--audit-log", str(audit_log), "--workers", "1", "--resolve", "api.github.com=93.184.216.34",
                "--connect-to", f"api.github.com:443:127.0.0.1:{upstream.port}", "--upstream-ca", str(pki.ca_pem)]  # fmt: skip
        # The demo policy has six connections and one is sealed: the proxy refuses to start, naming the first address.
        early = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert early.returncode == 2 and "Traceback" not in early.stderr, early.stderr
        assert ("error: connection `build-artifacts` has no credential in custody: nothing is sealed at "
                "`acme/build-artifacts/ci-artifacts-aws` (and 4 more connection(s))") in early.stderr, early.stderr
        assert "--handle ci-artifacts-aws --kind aws_sigv4" in early.stderr and not _listening(port)
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
        for connection, handle, kind, value in (
                ("github-read", "gh-read", "static", "read-token"), ("status-hook", "status-token", "static", "hook-token"),
                ("github-mcp", "gh-mcp", "static", "mcp-token"),
                ("build-artifacts", "ci-artifacts-aws", "aws_sigv4", json.dumps({"access_key_id": "AKIDEXAMPLE", "secret_access_key": "s" * 40})),
                ("release-bot", "release-bot-app", "github_app", json.dumps({"app_id": "12345", "private_key": pem}))):
            sealed = _cli("custody", "put", "--keys", str(keys), "--store", str(store), "--workspace", "acme", "--connection", connection,
                          "--handle", handle, "--kind", kind, input=value)
            assert sealed.returncode == 0, sealed.stderr
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert _wait_for(lambda: _listening(port), 60), proc.stderr.read() if proc.poll() is not None else "not listening"
            lease = _cli("lease", "--keys", str(keys), "--artifact", str(art), "--connection", "github", "--subject", "demo").stdout.strip()
            ca = _cli("ca", "--confdir", str(confdir)).stdout.strip()
            envv = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
            base = [CURL, "-sS", "--max-time", "30", "-x", f"http://127.0.0.1:{port}", "--cacert", ca,
                    "--proxy-header", f"Proxy-Authorization: Bearer {lease}", "-D", "-"]  # fmt: skip
            ok = subprocess.run([*base, "-H", "X-GitHub-Api-Version: 2022-11-28", "https://api.github.com/repos/acme/app"], capture_output=True, env=envv, timeout=45)
            assert b" 200" in ok.stdout, ok.stdout + ok.stderr
            seen = upstream.requests[-1]
            assert seen.all("Authorization") == [f"Bearer {CANARY}"] and seen.all("X-GitHub-Api-Version") == ["2022-11-28"]
            sneaky = subprocess.run([*base, "https://api.github.com/repos/acmex/app"], capture_output=True, env=envv, timeout=45)
            assert b"x-egresslaw-deny: path-not-allowed" in sneaky.stdout.lower()
            assert len(upstream.requests) == 1
            for blob in (ok.stdout, ok.stderr, sneaky.stdout, sneaky.stderr):
                assert_no_canary(blob, "curl output")
        finally:
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert_no_canary(out + err, "proxy output")
        assert_no_canary(audit_log.read_bytes(), "audit log")
        assert _cli("audit", "verify", str(audit_log)).returncode == 0
    finally:
        upstream.server.shutdown()


def test_cli_ca_prints_the_certificate_path_and_keeps_the_key_private(tmp_path, capsys):
    from cryptography import x509

    from egresslaw.cli import main

    assert main(["ca", "--confdir", str(tmp_path / "conf")]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == tmp_path / "conf" / "mitmproxy-ca-cert.pem"
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert (tmp_path / "conf" / "mitmproxy-ca.pem").stat().st_mode & 0o077 == 0
    assert main(["ca", "--confdir", str(tmp_path / "conf")]) == 0  # idempotent: the same CA
    assert Path(capsys.readouterr().out.strip()).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("busy", ["--listen", "--admin"])
def test_cli_busy_address_exits_2_with_nothing_left_listening(cli_env, busy):
    port, admin = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        if busy == "--listen":
            port = taken_port
        else:
            admin = taken_port
        r = _cli(*_proxy_args(cli_env, port, admin))
        assert r.returncode == 2 and "cannot listen" in r.stderr, r.stderr
    assert not _listening(port) and not _listening(admin)
