"""The decision core on plain values: the primitives, the tables, and the composition the proxy and the prover run.

`test_adapter.py` drives the same semantics through `decide()`; these pin the core's own functions, so a seeded
bug in one of them (an exclusive interval end, a skipped answer, the wrong worker, a reordered check) fails here
with the function named.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog import load_catalog
from compiler.normalize import normalize_prefix
from egress_proxy.decision import core
from tests.egress_proxy.builders import connection, profile, rule, worker

TABLE = load_catalog("2026.11").special_purpose


def v4(text: str) -> int:
    return int(ipaddress.IPv4Address(text))


def v6(text: str) -> int:
    return int(ipaddress.IPv6Address(text))


def answer(text: str) -> tuple[bool, bool, int]:
    addr = ipaddress.ip_address(text)
    return True, addr.version == 6, int(addr)


# -- intervals, tokens and tables ---------------------------------------------------------------------------------


def test_within_is_closed_at_both_ends() -> None:
    spans = core.intervals(["10.0.0.0/8", "192.168.0.0/16"], 4)
    for inside in ("10.0.0.0", "10.255.255.255", "192.168.0.0", "192.168.255.255", "10.1.2.3"):
        assert core.within(v4(inside), spans), inside
    for outside in ("9.255.255.255", "11.0.0.0", "192.167.255.255", "192.169.0.0", "0.0.0.0"):
        assert not core.within(v4(outside), spans), outside
    assert not core.within(5, core.Intervals(()))


def test_intervals_merge_overlapping_and_adjacent_ranges_of_one_family() -> None:
    spans = core.intervals(["10.0.0.0/9", "10.128.0.0/9", "10.64.0.0/10", "2001:db8::/32"], 4)
    assert spans == core.Intervals(((24, 10),))  # one aligned block: 10.0.0.0/8
    assert core.intervals(["2001:db8::/32"], 4) == core.Intervals(())


@pytest.mark.parametrize("name", ["GET", "x-custom", "a!#$%&'*+-.^_`|~9"])
def test_is_token_accepts_tokens(name: str) -> None:
    assert core.is_token(name)


@pytest.mark.parametrize("name", ["", "a b", "a:b", "a\r", "é", "a/b", "(x)"])
def test_is_token_refuses_everything_else(name: str) -> None:
    assert not core.is_token(name)


# -- addresses ------------------------------------------------------------------------------------------------


W = core.worker_table(worker(), TABLE)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("140.82.112.6", ""),
        ("10.0.0.1", "address-not-public"),
        ("127.0.0.1", "address-not-public"),
        ("169.254.169.254", "address-not-public"),
        ("100.64.0.1", "address-not-public"),  # CGNAT: `is_global` would say public
        ("192.0.0.192", "address-not-public"),
        ("::ffff:10.0.0.1", "address-not-public"),  # mapped
        ("64:ff9b::a00:1", "address-not-public"),  # NAT64 of 10.0.0.1
        ("2002:a00:1::", "address-not-public"),  # 6to4 of 10.0.0.1
        ("2606:50c0:8000::154", ""),
        ("fd00:ec2::254", "address-not-public"),
    ],
)
def test_judge_address(text: str, reason: str) -> None:
    addr = ipaddress.ip_address(text)
    assert core.judge_address(W, addr.version == 6, int(addr)) == reason


def test_deny_beats_allow_and_reaches_embedded_addresses() -> None:
    w = core.worker_table(worker(deny_cidrs=("140.82.112.0/24",), allow_cidrs=("140.82.112.0/24", "100.64.0.0/10")), TABLE)
    assert core.judge_address(w, False, v4("140.82.112.6")) == "address-denied"
    assert core.judge_address(w, True, v6("::ffff:140.82.112.6")) == "address-denied"
    assert core.judge_address(w, False, v4("100.64.0.1")) == ""  # the hole
    off = core.worker_table(worker(ipv6=False), TABLE)
    assert core.judge_address(off, True, v6("2606:50c0:8000::154")) == "ipv6-disabled"


def test_answers_verdict_judges_every_answer_in_order() -> None:
    good, private = answer("140.82.112.6"), answer("10.0.0.5")
    assert core.answers_verdict(W, (good, good, good, good)) == ""
    assert core.answers_verdict(W, (good, good, good, private)) == "address-not-public"  # the fourth counts too
    assert core.answers_verdict(W, (good,) * 40 + (private,)) == "address-not-public"  # and the forty-first
    assert core.answers_verdict(W, (good, (False, False, 0), private)) == "address-invalid"  # the first refusal
    assert core.answers_verdict(W, ()) == "resolve-failed"


# -- requests -------------------------------------------------------------------------------------------------


def conn_subject(w=W, **kw) -> core.Subject:
    conn = connection("c", [rule("read", "api.github.com", "/repos/acme", ["GET"], ["accept"])], **kw)
    return core.connection_subject(conn, w, normalize_prefix)


def obs(host: str = "api.github.com", port: int = 443, method: str = "GET", path: str = "/repos/acme/app", **flags) -> core.Observation:
    o = core.Observation("https", port, "", host)
    o.method, o.path = method, path
    for name, value in flags.items():
        setattr(o, name, value)
    return o


def test_request_verdict_admits_under_the_first_rule() -> None:
    assert core.request_verdict(conn_subject(), obs()) == ("", 0)


@pytest.mark.parametrize(
    "flags, reason",
    [
        ({"field_break": True}, "smuggling"),
        ({"duplicate_host": True}, "smuggling"),
        ({"trailers": True}, "trailers-denied"),
        ({"port_mismatch": True}, "host-header-mismatch"),
        ({"host_mismatch": True}, "host-header-mismatch"),
        ({"upgrade": True}, "upgrade-denied"),
        ({"framing": True}, "smuggling"),
        ({"body": True}, "body-on-bodyless-method"),
        ({"unreadable_headers": True}, "internal-error"),
        ({"path_error": "path-dot-segment"}, "path-dot-segment"),
    ],
)
def test_each_request_finding_refuses_with_its_reason(flags: dict, reason: str) -> None:
    assert core.request_verdict(conn_subject(), obs(**flags)) == (reason, -1)


def test_the_destination_comes_before_the_findings() -> None:
    assert core.request_verdict(conn_subject(), obs(host="evil.example.org", trailers=True)) == ("no-matching-rule", -1)
    assert core.request_verdict(conn_subject(), obs(method="get", trailers=True)) == ("method-not-allowed", -1)


@pytest.mark.parametrize(
    "prefix, path, admitted",
    [("/repos/acme", "/repos/acme", True), ("/repos/acme", "/repos/acme/x", True), ("/repos/acme", "/repos/acmex", False),
     ("/", "/anything", True), (None, "/repos/acme", False), ("/a/", "/a/", True)],
)
def test_segment_prefix(prefix, path, admitted) -> None:
    assert core.segment_prefix(prefix, path) is admitted


def test_connect_verdict_refuses_a_body_or_an_upgrade_before_the_destination() -> None:
    s = conn_subject()
    assert core.connect_verdict(s, obs()) == ""
    assert core.connect_verdict(s, obs(body=True, host="evil.example.org")) == "body-on-bodyless-method"
    assert core.connect_verdict(s, obs(upgrade=True)) == "upgrade-denied"
    assert core.connect_verdict(s, obs(port=-1)) == "port-invalid"


def test_verdict_judges_the_answers_with_the_carriers_worker() -> None:
    strict = core.worker_table(worker("strict", deny_cidrs=("140.82.112.0/24",)), TABLE)
    brokered = conn_subject(strict)
    prof = profile("ci", [("api.github.com", 443), ("pypi.org", 443)], brokers=["c"])
    s = core.profile_subject(prof, W, {"c": brokered})
    ips = (answer("140.82.112.6"),)
    assert core.verdict(s, obs(), ips) == ("address-denied", 0, True)  # brokered: the connection's worker
    assert core.verdict(s, obs(host="pypi.org", path="/simple/"), ips) == ("", -1, True)  # plain: the profile's
    assert core.verdict(s, obs(), None) == ("", 0, True)  # no answers given: the address check is skipped
    assert core.verdict(s, obs(trailers=True), ips) == ("trailers-denied", -1, False)


def test_forwarded_and_the_credential_header() -> None:
    s = conn_subject()
    assert core.forwarded(s, 0, "accept", False)
    assert not core.forwarded(s, 0, "accept", True)  # listed in Connection
    assert not core.forwarded(s, 0, "x-custom", False)
    assert not core.forwarded(s, 0, "authorization", False)
    assert core.credential_header(s, 0) == "Authorization"
    plain = core.profile_subject(profile("ci", [("pypi.org", 443)]), W, {})
    assert core.forwarded(plain, -1, "x-custom", False) and not core.forwarded(plain, -1, "x-forwarded-host", False)
    assert core.credential_header(plain, -1) is None


def test_follows_redirect() -> None:
    assert not core.follows_redirect(W, 302, 0)
    legacy = core.worker_table(worker(follow_redirects=True, max_redirects=2), TABLE)
    assert core.follows_redirect(legacy, 302, 0) and core.follows_redirect(legacy, 399, 1)
    assert not core.follows_redirect(legacy, 302, 2) and not core.follows_redirect(legacy, 200, 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 255), st.integers(8, 32)), max_size=6),
       st.integers(0, (1 << 32) - 1) | st.integers(0x0A000000, 0x0A040000))
def test_within_the_blocks_of_cidrs_is_membership_in_one_of_them(nets, x: int) -> None:
    """`intervals` cuts merged CIDRs into aligned blocks; `within` is membership in the CIDRs, at every edge too."""
    cidrs = [f"10.{a}.{b}.0/{n}" for a, b, n in nets]
    spans = core.intervals(cidrs, 4)
    for point in (x, *[int(ipaddress.ip_network(c, strict=False).network_address) + d for c in cidrs for d in (-1, 0)],
                  *[int(ipaddress.ip_network(c, strict=False).broadcast_address) + d for c in cidrs for d in (0, 1)]):
        expected = any(ipaddress.IPv4Address(point) in ipaddress.ip_network(c, strict=False) for c in cidrs)
        assert core.within(point, spans) == expected, (cidrs, point)
