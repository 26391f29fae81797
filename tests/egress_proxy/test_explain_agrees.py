"""`egresslaw explain` refuses what the proxy refuses, with the same reason: the checks that once lived only in the
addon (a CR/LF/NUL inside a header, declared trailers, a tunnelled request naming another port, a CONNECT with a
body, an upgrade or a non-canonical port) are the decision's now, and both call it.

Each case sends raw bytes to a real listening proxy (nothing reaches either upstream, one audit event says why)
and runs `egresslaw explain` on the same artifact with the same request.
"""

from __future__ import annotations

import json
import socket
import ssl
import time

import pytest

from egresslaw.cli import main
from tests.egress_proxy.conftest import HOSTS, free_port
from tests.proxy_harness import start_proxy, stop_proxy
from tests.proxy_harness import wait_for as _wait_for

pytestmark = pytest.mark.slow
API = "api.acme-test.dev"


@pytest.fixture(scope="module")
def proxy(env, tls_upstream, http_upstream, pki):
    connect_to = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in HOSTS if h != "self.acme-test.dev"]
    connect_to.append(f"pkgs.acme-test.dev:80:127.0.0.1:{http_upstream.port}")
    p = start_proxy(env, pki, (tls_upstream, http_upstream), connect_to, listen=free_port())
    yield p
    stop_proxy(p)
    p.assert_nothing_leaked()


def _send(p, raw: bytes, tunnel: bool = False) -> bytes:
    """Raw bytes to the proxy (inside a CONNECT+TLS tunnel to API when `tunnel`); the first answer's bytes."""
    sock = socket.create_connection((p.host, p.port), timeout=10)
    try:
        if tunnel:
            lease = p.lease(connection="github")
            sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(4096)
            assert head.startswith(b"HTTP/1.1 200"), head
            sock = ssl.create_default_context(cafile=str(p.ca)).wrap_socket(sock, server_hostname=API)
        sock.sendall(raw)
        data = b""
        deadline = time.monotonic() + 10
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        p.record(data)
        return data
    finally:
        sock.close()


def _explain(env, capsys, *args: str) -> dict:
    capsys.readouterr()
    code = main(["explain", str(env.artifact), "--connection", "github", "--format", "json", *args])
    out = json.loads(capsys.readouterr().out)
    assert (code == 0) == (out["decision"] == "allow")
    return out


CASES = [
    # (case, bytes after the lease line (request) or the whole CONNECT, in a tunnel?, explain arguments, reason)
    ("bare-cr-in-a-header", "GET https://{api}/repos/acme/app HTTP/1.1\r\nHost: {api}\r\n{auth}Accept: a\rb\r\n\r\n", False,
     ["GET https://{api}/repos/acme/app", "-H", "Accept: a\rb"], "smuggling"),
    ("declared-trailers", "GET https://{api}/repos/acme/app HTTP/1.1\r\nHost: {api}\r\n{auth}Trailer: X-Sneak\r\n\r\n", False,
     ["GET https://{api}/repos/acme/app", "-H", "Trailer: X-Sneak"], "trailers-denied"),
    ("another-port-in-a-tunnel", "GET /repos/acme/app HTTP/1.1\r\nHost: {api}:8443\r\n\r\n", True,
     ["GET https://{api}/repos/acme/app", "-H", "Host: {api}:8443"], "host-header-mismatch"),
    ("connect-with-a-body", "CONNECT {api}:443 HTTP/1.1\r\nHost: {api}:443\r\n{auth}Content-Length: 5\r\n\r\nhello", False,
     ["{api}:443", "-H", "Content-Length: 5", "--body"], "body-on-bodyless-method"),
    ("connect-with-an-upgrade", "CONNECT {api}:443 HTTP/1.1\r\nHost: {api}:443\r\n{auth}Connection: Upgrade\r\nUpgrade: h2c\r\n\r\n", False,
     ["{api}:443", "-H", "Connection: Upgrade", "-H", "Upgrade: h2c"], "upgrade-denied"),
    ("connect-to-a-zero-padded-port", "CONNECT {api}:0443 HTTP/1.1\r\nHost: {api}:0443\r\n{auth}\r\n", False,
     ["{api}:0443"], "port-invalid"),
]


@pytest.mark.parametrize(("case", "raw", "tunnel", "args", "reason"), CASES, ids=[c[0] for c in CASES])
def test_explain_refuses_what_the_proxy_refuses_with_its_reason(proxy, env, capsys, case, raw, tunnel, args, reason):
    mark = proxy.mark()
    auth = f"Proxy-Authorization: Bearer {proxy.lease(connection='github')}\r\n"
    data = _send(proxy, raw.format(api=API, auth=auth).encode(), tunnel)
    assert data.startswith(b"HTTP/1.1 403"), data[:300]
    assert f"x-egresslaw-deny: {reason}".encode() in data.lower()
    assert _wait_for(lambda: any(e.get("decision") == "deny" for e in proxy.new_events(mark)))
    denials = [e for e in proxy.new_events(mark) if e.get("decision") == "deny"]
    assert [e["reason"] for e in denials] == [reason]
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]  # no byte upstream
    said = _explain(env, capsys, *(a.format(api=API) for a in args))
    assert (said["decision"], said["reason"]) == ("deny", reason)


def test_the_same_request_without_the_finding_is_admitted_by_both(proxy, env, capsys):
    """The control: each case differs from an admitted request by its finding alone."""
    auth = f"Proxy-Authorization: Bearer {proxy.lease(connection='github')}\r\n"
    data = _send(proxy, f"GET https://{API}/repos/acme/app HTTP/1.1\r\nHost: {API}\r\n{auth}Accept: ab\r\n\r\n".encode())
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert _explain(env, capsys, f"GET https://{API}/repos/acme/app", "-H", "Accept: ab")["decision"] == "allow"
    assert _explain(env, capsys, f"{API}:443")["decision"] == "allow"


def test_a_plain_request_refused_anyway_resolves_nothing(proxy):
    """Decided before its name is resolved: the refusal is the request's own, whatever the name resolves to (a name
    that resolves to nothing is `resolve-failed` once the request itself is admissible)."""
    auth = f"Proxy-Authorization: Bearer {proxy.lease(connection='github')}\r\n"
    name = "nxdomain.acme-test.dev"
    lookups = proxy.resolver.calls.get(name, 0)  # the in-process proxy's scripted resolver counts every lookup
    refused = _send(proxy, f"GET https://{name}/ HTTP/1.1\r\nHost: {name}\r\n{auth}Trailer: X-Sneak\r\n\r\n".encode())
    assert b"x-egresslaw-deny: trailers-denied" in refused.lower(), refused[:300]
    assert proxy.resolver.calls.get(name, 0) == lookups  # no lookup for a request refused anyway
    admissible = _send(proxy, f"GET https://{name}/ HTTP/1.1\r\nHost: {name}\r\n{auth}\r\n".encode())
    assert b"x-egresslaw-deny: resolve-failed" in admissible.lower(), admissible[:300]
    assert proxy.resolver.calls.get(name, 0) == lookups + 1  # the admissible one is resolved, once
