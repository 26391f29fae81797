"""The asynchronous resolver (egress_proxy/edge/resolver.py) against a real DNS server on 127.0.0.1
(tests/dns_standin.py), alone and inside the real proxy.

The proxy tests show: many concurrent CONNECTs to distinct names all resolve while the nameserver
takes 0.25 s per answer (the stand-in holds every answer back until 64 queries wait at once, which
a lookup pool of a few threads can never reach); a nameserver that never answers still denies
`resolve-failed`; `--resolve` test routing still wins over DNS; A and AAAA answers are both judged.
The 1,500-CONNECT version runs in bench/resolve.py.
"""

from __future__ import annotations

import asyncio

import dns.exception as dns_exception
import dns.name as dnsname
import pytest

from egress_proxy.front.resolver import (
    AsyncResolver,
    NoAddress,
    ResolverConfigError,
    parse_nameserver,
)
from tests.dns_standin import DnsStandin
from tests.egress_proxy import builders as b
from tests.proxy_harness import build_artifact, make_env, start_proxy, stop_proxy

V4 = "93.184.216.34"
V6 = "2606:2800:220:1:248:1893:25c8:1946"


@pytest.fixture
def standin():
    servers: list[DnsStandin] = []

    def make(table=None, **kw) -> DnsStandin:
        server = DnsStandin(table, **kw)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def run(coro):
    return asyncio.run(coro)


# --- the resolver alone ------------------------------------------------------------------------


def test_a_and_aaaa_both_answered_a_first(standin):
    dns = standin({"both.test": [V6, V4], "v6.test": [V6]})
    r = AsyncResolver([dns.nameserver])
    assert run(r("both.test", 443)) == (V4, V6)
    assert run(r("v6.test", 443)) == (V6,)
    assert dns.queries[("both.test", "A")] == 1 and dns.queries[("both.test", "AAAA")] == 1


def test_unknown_name_fails_and_a_literal_never_queries(standin):
    dns = standin({})
    r = AsyncResolver([dns.nameserver])
    with pytest.raises(NoAddress):
        run(r("nxdomain.test", 443))
    assert run(r("93.184.216.34", 443)) == ("93.184.216.34",)
    assert run(r("2001:db8::1", 443)) == ("2001:db8::1",)
    assert set(dns.queries) == {("nxdomain.test", "A"), ("nxdomain.test", "AAAA")}


def test_names_are_absolute_no_search_domain_no_hosts_file(standin):
    dns = standin({"api": [V4], "api.corp.example": ["93.184.216.99"]})
    r = AsyncResolver([dns.nameserver])
    r._dns.search = [dnsname.from_text("corp.example")]  # as a resolv.conf `search corp.example` would set it
    r._dns.ndots = 5
    assert run(r("api", 443)) == (V4,)
    with pytest.raises(NoAddress):
        run(r("localhost", 443))  # asked of the nameserver (NXDOMAIN here), never answered from /etc/hosts
    assert {name for name, _ in dns.queries} == {"api", "localhost"}


def test_answers_are_cached_for_their_ttl_and_not_longer(standin):
    long = standin({"cached.test": [V4]}, ttl=300)
    r = AsyncResolver([long.nameserver])

    async def twice():
        return await r("cached.test", 443), await r("cached.test", 443)

    assert run(twice()) == ((V4,), (V4,))
    assert long.queries[("cached.test", "A")] == 1  # the second lookup came from the cache

    zero = standin({"fresh.test": [V4]}, ttl=0)
    r0 = AsyncResolver([zero.nameserver])

    async def twice0():
        return await r0("fresh.test", 443), await r0("fresh.test", 443)

    run(twice0())
    assert zero.queries[("fresh.test", "A")] == 2  # TTL 0: never reused

    short = standin({"short.test": [V4]}, ttl=1)
    r1 = AsyncResolver([short.nameserver])

    async def across_expiry():
        await r1("short.test", 443)
        await asyncio.sleep(1.3)  # past the 1 s TTL
        await r1("short.test", 443)

    run(across_expiry())
    assert short.queries[("short.test", "A")] == 2


def test_identical_lookups_in_flight_share_one_query(standin):
    dns = standin({"same.test": [V4]}, delay=0.2, ttl=0)
    r = AsyncResolver([dns.nameserver])

    async def many():
        return await asyncio.gather(*(r("same.test", 443) for _ in range(50)))

    assert run(many()) == [(V4,)] * 50
    assert dns.queries[("same.test", "A")] == 1


def test_concurrency_is_bounded(standin):
    names = {f"n{i}.test": [V4] for i in range(40)}
    dns = standin(names, delay=0.05)
    r = AsyncResolver([dns.nameserver], concurrency=4)

    async def many():
        return await asyncio.gather(*(r(n, 443) for n in names))

    assert run(many()) == [(V4,)] * 40
    assert dns.max_waiting <= 8  # 4 names at once, an A and an AAAA query each


def test_a_nameserver_that_never_answers_fails_within_the_timeout(standin):
    dns = standin({"x.test": [V4]}, silent=True)
    r = AsyncResolver([dns.nameserver], timeout=0.5)
    with pytest.raises((TimeoutError, dns_exception.Timeout)):
        run(r("x.test", 443))
    assert dns.total() >= 2  # it did ask


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1", ("127.0.0.1", 53)), ("127.0.0.1:5353", ("127.0.0.1", 5353)), ("[::1]:53", ("::1", 53)), ("::1", ("::1", 53)), ("[::1]", ("::1", 53))],
)
def test_parse_nameserver(text, expected):
    assert parse_nameserver(text) == expected


@pytest.mark.parametrize("text", ["dns.google", "1.2.3.4:0", "1.2.3.4:99999", "[::1", "[::1]x", "1.2.3.4:x"])
def test_parse_nameserver_refuses(text):
    with pytest.raises(ResolverConfigError):
        parse_nameserver(text)


@pytest.mark.parametrize("kw", [{"timeout": 0}, {"timeout": 61}, {"concurrency": 0}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ResolverConfigError):
        AsyncResolver(["127.0.0.1"], **kw)


def test_default_nameservers_are_the_systems():
    with open("/etc/resolv.conf", encoding="utf-8") as f:
        listed = [line.split()[1] for line in f if line.startswith("nameserver") and len(line.split()) > 1]
    if not listed:
        pytest.skip("no nameserver in /etc/resolv.conf on this machine")
    r = AsyncResolver()
    assert [ns.rsplit(":", 1)[0].strip("[]") for ns in r.nameservers] == listed


# --- inside the real proxy ---------------------------------------------------------------------


async def connect_all(host: str, port: int, lease: str, names: list[str]) -> list[tuple[int | None, str | None]]:
    async def one(name: str):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"CONNECT {name}:443 HTTP/1.1\r\nHost: {name}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            return None, exc.__class__.__name__
        finally:
            writer.close()
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        deny = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("x-egresslaw-deny:")), None)
        return status, deny

    return await asyncio.gather(*(one(n) for n in names))


def proxy_for_names(tmp_path, pki, names, nameserver: str, **kw):
    rules = [b.rule(f"n{i}", name, "/", ["GET"]) for i, name in enumerate(names)]
    env = make_env(tmp_path / "env", build_artifact(rules))
    return start_proxy(env, pki, (), [], nameservers=(nameserver,), log_level=20, **kw)


@pytest.mark.slow
def test_proxy_resolves_hundreds_of_concurrent_connects_through_a_slow_nameserver(tmp_path, pki, standin):
    count = 300
    names = [f"c{i}.fleet.acme-test.dev" for i in range(count)]
    # hold_max: the hold is released on its own only long after set-up (a 300-name proof and a proxy start on a loaded machine)
    dns = standin({n: [V4] for n in names}, delay=0.25, hold=64, hold_max=600)
    # Every CONNECT comes from 127.0.0.1: lift the per-client connection cap (128 by default) above the count.
    p = proxy_for_names(tmp_path, pki, names, dns.nameserver, dns_timeout=30, config={"max_connections_per_client": 2 * count})
    try:
        results = asyncio.run(connect_all(p.host, p.port, p.lease(connection="github"), names))
        reasons = [r for _, r in results if r]
        assert "resolve-failed" not in reasons, reasons[:10]
        assert results == [(200, None)] * count, [r for r in results if r != (200, None)][:10]
        assert dns.max_waiting >= 64  # the answers were held until 64 queries waited at once
        events = [e for e in p.events() if e["kind"] == "connect"]
        assert len(events) == count and {e["reason"] for e in events} == {"allowed"}
    finally:
        stop_proxy(p)


@pytest.mark.slow
def test_proxy_denies_when_the_nameserver_never_answers(tmp_path, pki, standin):
    names = ["silent.fleet.acme-test.dev", "routed.fleet.acme-test.dev"]
    dns = standin({n: [V4] for n in names}, silent=True)
    p = proxy_for_names(tmp_path, pki, names, dns.nameserver, dns_timeout=1.0)
    try:
        p.addon.resolve_map["routed.fleet.acme-test.dev"] = (V4,)  # `--resolve` test routing still wins over DNS
        results = asyncio.run(connect_all(p.host, p.port, p.lease(connection="github"), names))
        assert results == [(403, "resolve-failed"), (200, None)], results  # a hanging lookup would give TimeoutError
        assert dns.queries[("silent.fleet.acme-test.dev", "A")] >= 1
        assert ("routed.fleet.acme-test.dev", "A") not in dns.queries
        reasons = {e["host"]: e["reason"] for e in p.events() if e["kind"] == "connect"}
        assert reasons == {"silent.fleet.acme-test.dev": "resolve-failed", "routed.fleet.acme-test.dev": "allowed"}
    finally:
        stop_proxy(p)


@pytest.mark.slow
def test_proxy_judges_every_answer_of_both_families(tmp_path, pki, standin):
    names = ["dual.fleet.acme-test.dev", "v6private.fleet.acme-test.dev", "v4private.fleet.acme-test.dev"]
    dns = standin({names[0]: [V4, V6], names[1]: [V4, "fd00::1"], names[2]: ["10.0.0.7", V6]})
    p = proxy_for_names(tmp_path, pki, names, dns.nameserver)
    try:
        results = asyncio.run(connect_all(p.host, p.port, p.lease(connection="github"), names))
        assert results == [(200, None), (403, "address-not-public"), (403, "address-not-public")], results
        assert p.addon.dns is not None and p.addon.dns.nameservers == (dns.nameserver,)
    finally:
        stop_proxy(p)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--nameserver", "dns.google"], "is not an IP address"), (["--dns-timeout", "0"], "resolver timeout must be more than 0")],
)
def test_proxy_refuses_bad_resolver_settings_at_start(tmp_path, flags, message):
    import subprocess
    import sys

    from tests.proxy_harness import free_port

    env = make_env(tmp_path / "env")
    proc = subprocess.run(
        [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--keys", str(env.keys),
         "--store", str(env.store), "--listen", f"127.0.0.1:{free_port()}", "--admin", "127.0.0.1:0", "--confdir", str(tmp_path / "conf"),
         "--audit-log", str(tmp_path / "audit.jsonl"), *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_test_routing_is_a_closed_world():
    """With --resolve and no --nameserver, a name test routing does not list gets no answer (NXDOMAIN: the request is
    refused resolve-failed) and the resolver behind it is never asked; the edge and the lane both ask through
    `routed` (the edge's configure: tests/egress_proxy/edge/test_addon.py)."""
    from egress_proxy.front.resolver import NoAddress, routed

    asked = []

    async def system(host, port):
        asked.append(host)
        return ("93.184.215.14",)

    listed = {"api.acme-test.dev": ("127.0.0.1",)}
    assert asyncio.run(routed("api.acme-test.dev", 443, listed=listed, resolver=system, closed=True)) == ("127.0.0.1",)
    with pytest.raises(NoAddress):
        asyncio.run(routed("unlisted.acme-test.dev", 443, listed=listed, resolver=system, closed=True))
    assert asked == []
    assert asyncio.run(routed("unlisted.acme-test.dev", 443, listed=listed, resolver=system, closed=False)) == ("93.184.215.14",)
