"""The public-only predicate over the catalog's special-purpose table: table-driven, asserting reason codes."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog import CatalogError, load_catalog
from compiler.artifact import Worker
from egress_proxy.decision import core
from egress_proxy.decision.addresses import (
    judge_ip,
    judge_ips,
    parse_address,
    unwrap_rules,
    worker_judge,
)
from egress_proxy.decision.reasons import ALLOWED, REASONS
from tests.egress_proxy.builders import artifact, worker

TABLE = load_catalog("2026.11").special_purpose
DEFAULT = worker()
PUBLIC = ""  # judge_ip's reason for a public address


def _v4(text: str) -> int:
    return int(ipaddress.IPv4Address(text))


def teredo(client: str, server: str = "65.54.227.120") -> str:
    """A Teredo address (RFC 4380): 2001:0:<server>:<flags>:<port ^ ffff>:<client ^ ffffffff>."""
    x = (0x20010000 << 96) | (_v4(server) << 64) | (0x8000 << 48) | (0xFFFF ^ 0x1234) << 32 | (_v4(client) ^ 0xFFFFFFFF)
    return ipaddress.IPv6Address(x).compressed


def sixtofour(v4: str, suffix: int = 1) -> str:
    return ipaddress.IPv6Address((0x2002 << 112) | (_v4(v4) << 80) | suffix).compressed


def isatap(container64: str, v4: str, marker: int = 0x00005EFE) -> str:
    hi = int(ipaddress.IPv6Address(container64)) >> 64 << 64
    return ipaddress.IPv6Address(hi | (marker << 32) | _v4(v4)).compressed


def nat64_48(v4: str, prefix: str = "64:ff9b:1::") -> str:
    """RFC 6052 /48 layout: IPv4 bits 0-15 at address bits 48-63, bits 16-31 at 72-87 (bits 64-71 zero)."""
    x = _v4(v4)
    base = int(ipaddress.IPv6Address(prefix))
    return ipaddress.IPv6Address(base | ((x >> 16) << 64) | ((x & 0xFFFF) << 40)).compressed


def nat64_64(v4: str, prefix: str) -> str:
    """RFC 6052 /64 layout: IPv4 at address bits 72-103."""
    return ipaddress.IPv6Address(int(ipaddress.IPv6Address(prefix)) | (_v4(v4) << 24)).compressed


# (answer, worker settings, expected reason) -- "" means public.
CASES = [
    # plain IPv4
    ("8.8.8.8", {}, PUBLIC),
    ("1.1.1.1", {}, PUBLIC),
    ("127.0.0.1", {}, "address-not-public"),
    ("127.255.255.254", {}, "address-not-public"),
    ("0.0.0.0", {}, "address-not-public"),
    ("10.0.0.1", {}, "address-not-public"),
    ("172.16.0.1", {}, "address-not-public"),
    ("192.168.1.1", {}, "address-not-public"),
    ("169.254.169.254", {}, "address-not-public"),
    ("169.254.170.2", {}, "address-not-public"),
    ("100.100.100.200", {}, "address-not-public"),
    ("192.0.0.192", {}, "address-not-public"),
    ("192.0.0.8", {}, "address-not-public"),
    ("224.0.0.1", {}, "address-not-public"),
    ("255.255.255.255", {}, "address-not-public"),
    ("240.0.0.1", {}, "address-not-public"),
    ("198.18.0.1", {}, "address-not-public"),
    ("192.88.99.1", {}, "address-not-public"),
    # CGNAT: the edges of 100.64.0.0/10
    ("100.63.255.255", {}, PUBLIC),
    ("100.64.0.0", {}, "address-not-public"),
    ("100.64.0.1", {}, "address-not-public"),
    ("100.127.255.255", {}, "address-not-public"),
    ("100.128.0.0", {}, PUBLIC),
    # plain IPv6
    ("2001:4860:4860::8888", {}, PUBLIC),
    ("2606:4700:4700::1111", {}, PUBLIC),
    ("::1", {}, "address-not-public"),
    ("::", {}, "address-not-public"),
    ("fe80::1", {}, "address-not-public"),
    ("fc00::1", {}, "address-not-public"),
    ("fd00:ec2::254", {}, "address-not-public"),
    ("fec0::1", {}, "address-not-public"),
    ("ff02::1", {}, "address-not-public"),
    ("2001:db8::1", {}, "address-not-public"),
    ("3fff::1", {}, "address-not-public"),
    ("100::1", {}, "address-not-public"),
    ("4000::1", {}, "address-not-public"),
    ("1::1", {}, "address-not-public"),
    # IPv4-mapped: judged by the embedded IPv4 only
    ("::ffff:8.8.8.8", {}, PUBLIC),
    ("::ffff:127.0.0.1", {}, "address-not-public"),
    ("::ffff:169.254.169.254", {}, "address-not-public"),
    ("::ffff:100.64.0.1", {}, "address-not-public"),
    ("::ffff:192.0.0.192", {}, "address-not-public"),
    # IPv4-compatible (deprecated): embedded only
    ("::8.8.8.8", {}, PUBLIC),
    ("::127.0.0.1", {}, "address-not-public"),
    ("::169.254.169.254", {}, "address-not-public"),
    # NAT64 well-known prefix (the worker's default nat64_prefixes)
    ("64:ff9b::8.8.8.8", {}, PUBLIC),
    ("64:ff9b::127.0.0.1", {}, "address-not-public"),
    ("64:ff9b::169.254.169.254", {}, "address-not-public"),
    ("64:ff9b::10.0.0.1", {}, "address-not-public"),
    # NAT64 local-use 64:ff9b:1::/48, always unwrapped, RFC 6052 /48 layout
    (nat64_48("8.8.8.8"), {}, PUBLIC),
    (nat64_48("127.0.0.1"), {}, "address-not-public"),
    (nat64_48("169.254.169.254"), {}, "address-not-public"),
    (nat64_48("8.8.8.8"), {"nat64_prefixes": ("2600:1f00::/96",)}, PUBLIC),
    # a worker-declared NAT64 prefix replaces the default one
    ("2600:1f00::8.8.8.8", {"nat64_prefixes": ("2600:1f00::/96",)}, PUBLIC),
    ("2600:1f00::127.0.0.1", {"nat64_prefixes": ("2600:1f00::/96",)}, "address-not-public"),
    ("2600:1f00::127.0.0.1", {}, PUBLIC),  # not a NAT64 prefix of this worker: an ordinary global address
    ("64:ff9b::8.8.8.8", {"nat64_prefixes": ("2600:1f00::/96",)}, "address-not-public"),  # ::/3, not unwrapped
    (nat64_64("8.8.8.8", "2600:1f00:0:1::"), {"nat64_prefixes": ("2600:1f00:0:1::/64",)}, PUBLIC),
    (nat64_64("10.1.2.3", "2600:1f00:0:1::"), {"nat64_prefixes": ("2600:1f00:0:1::/64",)}, "address-not-public"),
    # 6to4: container (2002::/16, not special) and embedded
    (sixtofour("8.8.8.8"), {}, PUBLIC),
    (sixtofour("127.0.0.1"), {}, "address-not-public"),
    (sixtofour("169.254.169.254"), {}, "address-not-public"),
    (sixtofour("192.0.0.192"), {}, "address-not-public"),
    # Teredo: the container 2001::/32 lies in 2001::/23, so it is refused unless a hole is punched
    (teredo("8.8.8.8"), {}, "address-not-public"),
    (teredo("8.8.8.8"), {"allow_cidrs": ("2001::/32",)}, PUBLIC),
    (teredo("127.0.0.1"), {"allow_cidrs": ("2001::/32",)}, "address-not-public"),
    (teredo("169.254.169.254"), {"allow_cidrs": ("2001::/32",)}, "address-not-public"),
    # ISATAP interface ids (both marker forms), container and embedded
    (isatap("2600:1f00::", "8.8.8.8"), {}, PUBLIC),
    (isatap("2600:1f00::", "127.0.0.1"), {}, "address-not-public"),
    (isatap("2600:1f00::", "169.254.169.254", 0x02005EFE), {}, "address-not-public"),
    (isatap("2600:1f00::", "8.8.8.8", 0x02005EFE), {}, PUBLIC),
    (isatap("fe80::", "8.8.8.8"), {}, "address-not-public"),  # container is link-local
    (isatap("2600:1f00::", "8.8.8.8", 0x01005EFE), {}, PUBLIC),  # the "g" bit variant (RFC 5214 6.1), public inside
    (isatap("2600:1f00::", "10.0.0.1", 0x01005EFE), {}, "address-not-public"),  # ... and judged: every u/g variant
    (isatap("2600:1f00::", "10.0.0.1", 0x03005EFE), {}, "address-not-public"),
    (isatap("2600:1f00::", "10.0.0.1", 0x04005EFE), {}, PUBLIC),  # not an ISATAP marker: an ordinary global address
    (isatap("2002:a00:1::", "8.8.8.8"), {}, "address-not-public"),  # 6to4 embeds 10.0.0.1
    (isatap("2002:808:808::", "10.0.0.1"), {}, "address-not-public"),  # ISATAP embeds 10.0.0.1
    # allow_cidrs punch holes into "public only"
    ("100.64.0.1", {"allow_cidrs": ("100.64.0.0/10",)}, PUBLIC),
    ("169.254.169.254", {"allow_cidrs": ("169.254.169.254/32",)}, PUBLIC),
    ("::ffff:100.64.0.1", {"allow_cidrs": ("100.64.0.0/10",)}, PUBLIC),
    ("64:ff9b::100.64.0.1", {"allow_cidrs": ("100.64.0.0/10",)}, PUBLIC),
    ("100.128.0.1", {"allow_cidrs": ("100.64.0.0/10",)}, PUBLIC),
    ("10.0.0.1", {"allow_cidrs": ("100.64.0.0/10",)}, "address-not-public"),
    ("fd00::1", {"allow_cidrs": ("fd00::/64",)}, PUBLIC),
    ("::ffff:127.0.0.1", {"allow_cidrs": ("::ffff:0:0/96",)}, "address-not-public"),  # holes apply to what is judged
    # deny_cidrs always deny: the address itself and every embedded IPv4
    ("8.8.8.8", {"deny_cidrs": ("8.8.8.0/24",)}, "address-denied"),
    ("8.8.4.4", {"deny_cidrs": ("8.8.8.0/24",)}, PUBLIC),
    ("::ffff:8.8.8.8", {"deny_cidrs": ("8.8.8.0/24",)}, "address-denied"),
    ("64:ff9b::8.8.8.8", {"deny_cidrs": ("8.8.8.0/24",)}, "address-denied"),
    (sixtofour("8.8.8.8"), {"deny_cidrs": ("8.8.8.0/24",)}, "address-denied"),
    (nat64_48("8.8.8.8"), {"deny_cidrs": ("8.8.8.0/24",)}, "address-denied"),
    ("2001:4860:4860::8888", {"deny_cidrs": ("2001:4860::/32",)}, "address-denied"),
    ("64:ff9b::8.8.8.8", {"deny_cidrs": ("64:ff9b::/96",)}, "address-denied"),
    ("100.64.0.1", {"deny_cidrs": ("100.64.0.0/16",), "allow_cidrs": ("100.64.0.0/10",)}, "address-denied"),
    ("10.0.0.1", {"deny_cidrs": ("10.0.0.0/8",)}, "address-denied"),  # deny wins over not-public for the reason
    # ipv6 = false refuses every IPv6 answer, IPv4-mapped included
    ("2001:4860:4860::8888", {"ipv6": False}, "ipv6-disabled"),
    ("::ffff:8.8.8.8", {"ipv6": False}, "ipv6-disabled"),
    ("64:ff9b::8.8.8.8", {"ipv6": False}, "ipv6-disabled"),
    ("::1", {"ipv6": False}, "ipv6-disabled"),
    ("8.8.8.8", {"ipv6": False}, PUBLIC),
    # not an address at all
    ("fe80::1%eth0", {}, "address-invalid"),
    ("2001:4860:4860::8888%1", {}, "address-invalid"),
    ("", {}, "address-invalid"),
    ("dns.google", {}, "address-invalid"),
    (" 8.8.8.8", {}, "address-invalid"),
    (None, {}, "address-invalid"),
    (134744072, {}, "address-invalid"),
]

# Every numeric spelling of 127.0.0.1 and 169.254.169.254 other than the canonical one. As an answer
# they are not addresses (a resolver returns canonical text); as hosts they are tested in test_decide.
NUMERIC_127 = ["127.1", "127.0.1", "2130706433", "0x7f.0.0.1", "0x7f000001", "0177.0.0.1", "017700000001", "127.000.000.001", "0x7F.1"]
NUMERIC_169 = ["169.254.43518", "169.16689662", "2852039166", "0xa9fea9fe", "0xa9.0xfe.0xa9.0xfe", "0251.0376.0251.0376", "025177524776"]


@pytest.mark.parametrize(("ip", "settings_", "expected"), CASES, ids=[f"{c[0]}-{sorted(c[1])}" for c in CASES])
def test_judge_ip(ip: object, settings_: dict, expected: str) -> None:
    public, reason, detail = judge_ip(ip, worker(**settings_), TABLE)
    assert reason == expected, detail
    assert public == (expected == PUBLIC)
    assert detail


@pytest.mark.parametrize("ip", NUMERIC_127 + NUMERIC_169)
def test_non_canonical_numeric_answers_are_not_addresses(ip: str) -> None:
    assert judge_ip(ip, DEFAULT, TABLE)[1] == "address-invalid"


def test_ipaddress_objects_are_accepted() -> None:
    assert judge_ip(ipaddress.ip_address("8.8.8.8"), DEFAULT, TABLE)[0] is True
    assert judge_ip(ipaddress.ip_address("::ffff:10.0.0.1"), DEFAULT, TABLE)[1] == "address-not-public"


def test_detail_names_the_range_and_the_embedding() -> None:
    _, _, detail = judge_ip("::ffff:169.254.169.254", DEFAULT, TABLE)
    assert "169.254.169.254" in detail and "ipv4-mapped" in detail and "metadata" in detail
    _, _, detail = judge_ip("192.0.0.192", DEFAULT, TABLE)
    assert "Oracle" in detail  # the most specific range, not 192.0.0.0/24


def test_unwrap_forms_come_from_the_catalog() -> None:
    rules = unwrap_rules(DEFAULT, TABLE)
    assert [r.name for r in rules] == [u.form for u in TABLE.unwrap]
    assert {r.name: r.prefix for r in rules} == {u.form: ipaddress.IPv6Network(u.prefix).compressed for u in TABLE.unwrap}
    assert {r.name: r.judge_container for r in rules} == {u.form: u.judge == "container and embedded" for u in TABLE.unwrap}
    custom = unwrap_rules(worker(nat64_prefixes=("2600:1f00::/96", "2600:1f00:1::/48")), TABLE)
    assert [r.prefix for r in custom if r.name == "nat64"] == ["2600:1f00::/96", "2600:1f00:1::/48"]
    assert "64:ff9b:1::/48" in [r.prefix for r in custom]  # the local-use prefix is always unwrapped


def test_nat64_prefix_of_a_non_rfc6052_length_fails_closed() -> None:
    with pytest.raises(CatalogError):
        unwrap_rules(worker(nat64_prefixes=("2600:1f00::/80",)), TABLE)


@pytest.mark.parametrize("length", [32, 40, 48, 56, 64, 96])
def test_rfc6052_layouts_round_trip(length: int) -> None:
    v4 = _v4("192.0.2.33")
    # RFC 6052 section 2.4 examples use prefix 2001:db8::/length and embed 192.0.2.33.
    examples = {
        32: "2001:db8:c000:221::",
        40: "2001:db8:1c0:2:21::",
        48: "2001:db8:122:c000:2:2100::",
        56: "2001:db8:122:3c0:0:221::",
        64: "2001:db8:122:344:c0:2:2100:0",
        96: "2001:db8:122:344::192.0.2.33",
    }
    x = int(ipaddress.IPv6Address(examples[length]))
    prefix = ipaddress.IPv6Network((x, length), strict=False).compressed  # 2001:db8:100::/40, 2001:db8:122::/48, ...
    (form,) = [f for f in unwrap_rules(worker(nat64_prefixes=(prefix,)), TABLE) if f.name == "nat64"]
    assert core.in_form(form, x) and core.embedded(form, x) == v4


def test_judges_are_cached_per_worker() -> None:
    assert worker_judge(DEFAULT, TABLE) is worker_judge(worker(), TABLE)
    assert worker_judge(DEFAULT, TABLE) is not worker_judge(worker(ipv6=False), TABLE)


def test_parse_address_rejects_zone_ids() -> None:
    assert parse_address("fe80::1%eth0") is None
    assert parse_address("8.8.8.8") == ipaddress.IPv4Address("8.8.8.8")


# --- judge_ips: every answer must be public ------------------------------------------------------

ART = artifact(workers=[worker("edge", allow_cidrs=("100.64.0.0/10",)), worker("v4", ipv6=False)])


@pytest.mark.parametrize(
    ("worker_name", "ips", "expected"),
    [
        ("default", ["8.8.8.8"], ALLOWED),
        ("default", ["8.8.8.8", "2001:4860:4860::8888"], ALLOWED),
        ("default", [], "resolve-failed"),
        ("default", ["8.8.8.8", "10.0.0.1"], "address-not-public"),  # one bad answer refuses the name
        ("default", ["127.0.0.1", "8.8.8.8"], "address-not-public"),
        ("default", ["8.8.8.8", "bogus"], "address-invalid"),
        ("edge", ["100.64.0.1", "8.8.8.8"], ALLOWED),
        ("default", ["100.64.0.1"], "address-not-public"),
        ("v4", ["8.8.8.8", "2001:4860:4860::8888"], "ipv6-disabled"),
        ("ghost", ["8.8.8.8"], "worker-unknown"),
    ],
)
def test_judge_ips(worker_name: str, ips: list[str], expected: str) -> None:
    decision = judge_ips(ART, worker_name, ips)
    assert decision.reason == expected, decision.detail
    assert decision.allowed == (expected == ALLOWED)


def test_judge_ips_accepts_a_generator() -> None:
    assert judge_ips(ART, "default", (ip for ip in ["8.8.8.8"])).allowed
    assert judge_ips(ART, "default", (ip for ip in [])).reason == "resolve-failed"


def test_every_reason_is_documented() -> None:
    for _, _, expected in CASES:
        assert expected == PUBLIC or expected in REASONS


# --- properties ------------------------------------------------------------------------------------

ipv4s = st.integers(min_value=0, max_value=(1 << 32) - 1)
ipv6s = st.integers(min_value=0, max_value=(1 << 128) - 1)


def _public4(x: int) -> bool:
    return judge_ip(str(ipaddress.IPv4Address(x)), DEFAULT, TABLE)[0]


@given(ipv4s)
@settings(max_examples=400)
def test_ipv4_public_iff_in_no_table_range(x: int) -> None:
    addr = ipaddress.IPv4Address(x)
    assert judge_ip(addr, DEFAULT, TABLE)[0] == (TABLE.lookup(addr) is None)


@given(ipv4s)
@settings(max_examples=300)
def test_embedded_only_forms_agree_with_the_ipv4(x: int) -> None:
    expected = _public4(x)
    for base in (0xFFFF << 32, 0, int(ipaddress.IPv6Address("64:ff9b::"))):
        assert judge_ip(ipaddress.IPv6Address(base | x), DEFAULT, TABLE)[0] == expected
    assert judge_ip(nat64_48(str(ipaddress.IPv4Address(x))), DEFAULT, TABLE)[0] == expected


@given(ipv4s)
@settings(max_examples=300)
def test_container_forms_need_a_public_ipv4(x: int) -> None:
    v4 = str(ipaddress.IPv4Address(x))
    expected = _public4(x)
    assert judge_ip(sixtofour(v4), DEFAULT, TABLE)[0] == expected
    assert judge_ip(isatap("2600:1f00::", v4), DEFAULT, TABLE)[0] == expected
    assert judge_ip(teredo(v4), worker(allow_cidrs=("2001::/32",)), TABLE)[0] == expected
    assert judge_ip(teredo(v4), DEFAULT, TABLE)[0] is False


@given(ipv6s)
@settings(max_examples=400)
def test_ipv6_without_embedding_is_public_iff_in_no_table_range(x: int) -> None:
    addr = ipaddress.IPv6Address(x)
    rules = unwrap_rules(DEFAULT, TABLE)
    embedded = [core.embedded(r, x) for r in rules if core.in_form(r, x)]
    public = judge_ip(addr, DEFAULT, TABLE)[0]
    if not embedded:
        assert public == (TABLE.lookup(addr) is None)
    elif public:
        assert all(TABLE.lookup(ipaddress.IPv4Address(v)) is None for v in embedded)


@given(ipv4s)
@settings(max_examples=200)
def test_ipv6_disabled_refuses_every_ipv6_answer(x: int) -> None:
    w = worker(ipv6=False)
    assert judge_ip(ipaddress.IPv6Address((0xFFFF << 32) | x), w, TABLE)[1] == "ipv6-disabled"
    assert judge_ip(ipaddress.IPv4Address(x), w, TABLE)[1] != "ipv6-disabled"


def test_worker_model_is_hashable_for_the_cache() -> None:
    assert hash(Worker(name="default")) == hash(Worker(name="default"))
