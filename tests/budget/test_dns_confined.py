"""DNS carries nothing (docs/budget.md, the property `dns-confined`), from outside: the real front ends, a resolver that
records every name it is asked, and requests refused for every kind of reason. The names asked are exactly the hosts
of the admitted requests; a refused request asks nothing, even for a name that would resolve to a public address.

- the mitmproxy edge, in process (tests/proxy_harness.py), its resolver the scripted one;
- the Envoy lane's authorizer, in process (the admission the lane's Lua filter asks for), its resolver a recorder.
  Envoy's own lookups (through `egress_proxy/lane/dnsfront.py`) are its clusters': one per allowlist entry of a
  served profile, re-resolved on a timer whatever the workload sends, so they carry nothing either (checked on the
  generated configuration below).
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest

from egress_proxy.lane import envoy
from tests.egress_proxy import builders as b
from tests.proxy_harness import HOSTS, ScriptedResolver, build_artifact, free_port, make_env, start_proxy, stop_proxy

pytestmark = pytest.mark.slow

API, PKGS, OTHER = "api.acme-test.dev", "pkgs.acme-test.dev", "other.acme-test.dev"
NARROW = "narrow.acme-test.dev"  # a connection rule's host whose prefix is /only
# Names a request below names and the decision refuses: each would resolve to a public address if it were asked
# (a hostile or merely helpful DNS), so only the decision keeps it from being asked.
REFUSED_NAMES = ("unlisted.acme-test.dev", "evil.acme-test.dev", "rebind.acme-test.dev", "private.acme-test.dev", NARROW,
                 "unruled.acme-test.dev")


def _artifact():
    return build_artifact(extra_rules=[b.rule("narrow", NARROW, "/only", ["GET"])])


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, tls_upstream, http_upstream, pki):
    env = make_env(tmp_path_factory.mktemp("dns-confined"), _artifact())
    connect_to = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in HOSTS if h != "self.acme-test.dev"]
    connect_to.append(f"{PKGS}:80:127.0.0.1:{http_upstream.port}")
    resolver = ScriptedResolver({name: [["93.184.216.77"]] for name in REFUSED_NAMES})
    p = start_proxy(env, pki, (tls_upstream, http_upstream), connect_to, resolver=resolver, listen=free_port())
    yield p
    stop_proxy(p)
    p.assert_nothing_leaked()


def _send(p, raw: bytes) -> bytes:
    """Raw bytes to the proxy on a fresh client connection (the edge resolves once per connection); the answer's head."""
    sock = socket.create_connection((p.host, p.port), timeout=10)
    try:
        sock.sendall(raw)
        data = b""
        deadline = time.monotonic() + 15
        while b"\r\n\r\n" not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        p.record(data)
        return data
    finally:
        sock.close()


def _request(p, lease: str, method: str, url: str, host: str) -> bytes:
    return _send(p, f"{method} {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())


def _connect(p, lease: str, authority: str) -> bytes:
    return _send(p, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())


def test_the_edge_resolves_exactly_the_admitted_requests_hosts(proxy):
    ci, gh = proxy.lease(profile="ci"), proxy.lease(connection="github")
    refused = {
        "profile, unlisted host": lambda: _request(proxy, ci, "GET", "http://unlisted.acme-test.dev/", "unlisted.acme-test.dev"),
        "profile, IP literal": lambda: _request(proxy, ci, "GET", "http://93.184.216.99/", "93.184.216.99"),
        "profile, CONNECT to an unlisted host": lambda: _connect(proxy, ci, "evil.acme-test.dev:443"),
        "profile, listed host at another port": lambda: _connect(proxy, ci, f"{PKGS}:8080"),
        "connection, path outside its rule": lambda: _request(proxy, gh, "GET", f"https://{NARROW}/elsewhere", NARROW),
        "connection, method its rule does not allow": lambda: _request(proxy, gh, "DELETE", "https://rebind.acme-test.dev/", "rebind.acme-test.dev"),
        "connection, a path with no normalized form": lambda: _request(proxy, gh, "GET", "https://private.acme-test.dev/x/%00", "private.acme-test.dev"),
        "connection, host no rule names": lambda: _request(proxy, gh, "GET", "https://unruled.acme-test.dev/", "unruled.acme-test.dev"),
        "connection, IP literal": lambda: _request(proxy, gh, "GET", "https://93.184.216.98/", "93.184.216.98"),
        "connection, CONNECT to an unlisted host": lambda: _connect(proxy, gh, "evil.acme-test.dev:443"),
    }
    for case, send in refused.items():
        data = send()
        assert data.startswith(b"HTTP/1.1 4") and b"x-egresslaw-deny:" in data.lower(), (case, data[:300])
        assert proxy.resolver.calls == {}, f"{case}: a refused request asked the resolver {proxy.resolver.calls}"
    admitted = {
        PKGS: lambda: _request(proxy, ci, "GET", f"http://{PKGS}/simple/", PKGS),
        API: lambda: _request(proxy, gh, "GET", f"https://{API}/repos/acme/app", API),
        OTHER: lambda: _connect(proxy, gh, f"{OTHER}:443"),
    }
    for host, send in admitted.items():
        data = send()
        assert data.startswith(b"HTTP/1.1 200"), (host, data[:300])
    assert set(proxy.resolver.calls) == set(admitted), proxy.resolver.calls


def test_the_lanes_authorizer_resolves_exactly_the_admitted_requests_hosts(tmp_path):
    from egress_proxy.audit.log import AuditLog
    from egress_proxy.custody.keys import load_audit_key
    from egress_proxy.lane.authorize import Authorizer, parse_check

    env = make_env(tmp_path / "env", _artifact())
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int):
        asked.append((host, port))
        return ("93.184.216.77",)  # every name would resolve to a public address: only the decision stops a lookup

    audit = AuditLog(tmp_path / "lane.jsonl", load_audit_key(str(env.keys)))
    policy = SimpleNamespace(artifact=_artifact(), proved=True)
    authorizer = Authorizer(policy=lambda: policy, lease_keys=lambda: env.lease_key, served=lambda: frozenset({"ci"}),
                            resolve=resolve, resolve_timeout=30, audit=audit)
    lease = env.lease(profile="ci")

    def check(method: str, authority: str, scheme: str = "http", path: str = "/") -> int:
        pseudo = [f":method: {method}", f":authority: {authority}"]
        if method != "CONNECT":
            pseudo += [f":scheme: {scheme}", f":path: {path}"]
        body = "\r\n".join([*pseudo, f"proxy-authorization: Bearer {lease}"]).encode()
        return asyncio.run(authorizer.check(parse_check(body))).status

    refused = [("GET", "unlisted.acme-test.dev"), ("GET", "93.184.216.99"), ("CONNECT", "evil.acme-test.dev:443"),
               ("CONNECT", f"{PKGS}:8080"), ("GET", f"{API}:8443"), ("BREW", PKGS)]
    for method, authority in refused:
        assert check(method, authority) >= 400, (method, authority)
    assert asked == []
    assert check("GET", PKGS, path="/simple/") == 200 and check("CONNECT", f"{API}:443") == 200
    assert asked == [(PKGS, 80), (API, 443)]
    assert audit.close()


def test_envoys_own_lookups_are_the_served_profiles_allowlists(tmp_path):
    """Envoy resolves (through the lane's DNS front) only its clusters' names: one per allowlist entry of a profile the
    lane serves, on a timer; no request of the workload names one."""
    art = _artifact()
    layout = envoy.Layout(listen=("127.0.0.1", 8081), envoy_admin=tmp_path / "envoy-admin.sock",
                          authorizer=tmp_path / "authorizer.sock", dns={"default": ("127.0.0.1", 5353)}, run_dir=tmp_path,
                          trust_bundle=tmp_path / "bundle.pem")
    clusters = envoy.generate(art, layout)["cds"]["resources"]
    dialled = {(c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"],
                c["name"].rsplit(":", 1)[1]) for c in clusters if c.get("type") == "STRICT_DNS"}
    allowlisted = {(h.host, str(h.port)) for p in envoy.served(art).profiles for h in p.network.allowed_hosts}
    assert dialled and dialled == allowlisted
