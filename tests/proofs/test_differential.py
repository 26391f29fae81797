"""Differential test: the decision core evaluated symbolically, then instantiated with a concrete request, agrees with decide().

The symbolic evaluator (`proofs.symexec`) runs the source of `egress_proxy.decision.core`; `decide()` runs the
same functions natively. Instantiating the symbolic outcome with the adapter's reading of a request
(`egress_proxy.decision.adapter.observe`) must give decide()'s verdict, reason (host-*/path-* folded into one
class each, as the inputs distinguish them), rule, forwarded headers and credential header.
"""

from __future__ import annotations

import ipaddress

import z3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalog import load_catalog
from compiler.constants import METHODS
from egress_proxy.decision.adapter import decide, observe
from egress_proxy.decision.types import Request
from proofs.inputs import SymbolicRequest, Universe, abstract
from proofs.model import credential_header, forwarded, outcome, subject_table
from proofs.properties import subject_lease
from proofs.symexec import Evaluator
from tests.proofs.helpers import artifact, connection, profile, rule, worker

TABLE = load_catalog("2026.11").special_purpose
HOSTS = ["api.github.com", "uploads.github.com", "pypi.org"]
PREFIXES = ["/", "/repos", "/repos/acme", "/repos/acme/app", "/v1/a.b", "/repos/acme/app/issues"]
HEADERS = ["accept", "content-type", "x-forwarded-host", "user-agent", "authorization", "x-api-key"]
TARGETS = [
    "/repos/acme", "/repos/acme/../x", "/repos/acmex", "/repos/%2e%2e/x", "/", "/repos", "/repos/acme/", "/repos/acme/app/issues/3", "/repos/acme/app?x=1",
    "/v1/a.b", "/v1/a.bc", "/v1/a.b/c", "/repos/acme%2fx", "/a;b", "//repos",
    "/repos/%41", "/repos/acme/%7e", "/repos/acme/%20x", "relative", "/repos/acme#frag", "/repos/./acme",
    "/@types%2fnode", "/a b", "/x%00", "/%zz",
]
REQUEST_HOSTS = HOSTS + [
    "API.GitHub.com.", "other.example.net", "127.1", "2130706433", "0x7f.0.0.1", "0177.0.0.1", "1.2.3.4",
    "100.64.0.1", "[::1]", "::ffff:8.8.8.8", "[2002:808:808::1]", "api..github.com", "*.github.com", "",
]
CIDRS = ["100.64.0.0/10", "169.254.169.254/32", "8.8.8.0/24", "2001:db8::/32", "64:ff9b::/96", "0.0.0.0/0", "1.2.3.4/32"]
NAT64 = ["64:ff9b::/96", "2001:db8:64::/96", "2001:db8:100::/40", "64:ff9b::/48"]


@st.composite
def addresses(draw):
    v4 = ipaddress.IPv4Address(draw(st.one_of(
        st.sampled_from(["8.8.8.8", "100.64.0.1", "169.254.169.254", "10.0.0.1", "192.0.0.192", "1.2.3.4", "127.0.0.1"]),
        st.integers(0, 2**32 - 1).map(lambda i: str(ipaddress.IPv4Address(i))),
    )))
    form = draw(st.sampled_from(["v4", "mapped", "compat", "nat64", "nat64-40", "6to4", "teredo", "isatap", "v6"]))
    x = int(v4)
    if form == "v4":
        return str(v4)
    if form == "v6":
        return str(ipaddress.IPv6Address(draw(st.integers(0, 2**128 - 1))))
    base = {"mapped": "::ffff:0:0", "compat": "::", "nat64": "64:ff9b::", "6to4": "2002::", "teredo": "2001::",
            "isatap": "2600::5efe:0:0", "nat64-40": "2001:db8:100::"}[form]
    b = int(ipaddress.IPv6Address(base))
    if form == "6to4":
        return str(ipaddress.IPv6Address(b | (x << 80)))
    if form == "teredo":
        return str(ipaddress.IPv6Address(b | (x ^ 0xFFFFFFFF)))
    if form == "nat64-40":  # RFC 6052 /40: 24 bits before the u octet, 8 after
        return str(ipaddress.IPv6Address(b | ((x >> 8) << 64) | ((x & 0xFF) << 48)))
    return str(ipaddress.IPv6Address(b | x))


@st.composite
def artifacts(draw):
    w = worker(
        "w",
        ipv6=draw(st.booleans()),
        ip_literals=draw(st.booleans()),
        allow_cidrs=tuple(draw(st.lists(st.sampled_from(CIDRS), max_size=2, unique=True))),
        deny_cidrs=tuple(draw(st.lists(st.sampled_from(CIDRS[:4] + CIDRS[6:]), max_size=2, unique=True))),
        nat64_prefixes=tuple(draw(st.lists(st.sampled_from(NAT64), min_size=0, max_size=2, unique=True))),
    )
    rules = []
    for i in range(draw(st.integers(1, 4))):
        rules.append(rule(
            f"r{i}", draw(st.sampled_from(HOSTS)), draw(st.sampled_from(PREFIXES)),
            draw(st.lists(st.sampled_from(METHODS), min_size=1, max_size=3, unique=True)),
            draw(st.lists(st.sampled_from(HEADERS), max_size=3, unique=True)),
            port=draw(st.sampled_from([443, 443, 8443])),
        ))
    inject = draw(st.sampled_from(["Authorization", "X-Api-Key"]))
    conn = connection("c", rules, worker="w", inject_header=inject)
    # half the profiles broker the connection (its requests that match a rule carry the credential, judged by "w")
    prof = profile("p", [(draw(st.sampled_from(HOSTS)), draw(st.sampled_from([443, 80])))],
                   brokers=("c",) if draw(st.booleans()) else ())
    return artifact(connections=[conn], profiles=[prof], workers=[w])


@st.composite
def requests(draw):
    host = draw(st.one_of(st.sampled_from(HOSTS), st.sampled_from(REQUEST_HOSTS)))
    scheme = draw(st.sampled_from(["https", "https", "https", "http"]))
    port = draw(st.sampled_from([443, 443, 443, 80, 8443, 0, 70000]))
    names = draw(st.lists(st.sampled_from(HEADERS + ["host", "connection", "upgrade", "content-length",
                                                     "transfer-encoding", "x-other", "proxy-authorization"]),
                          max_size=3))
    headers = []
    for n in names:
        if n == "host":
            headers.append(("Host", draw(st.sampled_from([host, f"{host}:{port}", "evil.example.net"]))))
        elif n == "connection":
            headers.append(("Connection", draw(st.sampled_from(["close", "upgrade", "accept", "x-api-key, accept"]))))
        else:
            headers.append((n.title(), "v"))
    return Request(
        method=draw(st.sampled_from(["GET", "GET", "POST"] + list(METHODS) + ["TRACE", "CONNECT"])),
        scheme=scheme, host=host, port=port, target=draw(st.sampled_from(TARGETS)), headers=tuple(headers),
        host_header=draw(st.sampled_from([None, None, None, host, "evil.example.net"])),
        has_body=draw(st.sampled_from([False, False, True])),
    )


def _evaluate(term, pairs):
    return z3.simplify(z3.substitute(term, *pairs)) if isinstance(term, z3.ExprRef) else term


def _value(ev, v, pairs):
    """A symbolic value (term or Choice) instantiated with `pairs`."""
    if isinstance(v, z3.ExprRef):
        return _evaluate(v, pairs)
    if hasattr(v, "alts"):
        (value,) = [x for g, x in v.alts if z3.is_true(_evaluate(ev.bool_term(g), pairs))]
        return value
    return v


def reason_class(code: str) -> str:
    """decide()'s reason code folded the way the symbolic inputs distinguish them."""
    if code.startswith("host-") and code != "host-header-mismatch":
        return "host-error"
    if code.startswith("path-") and code != "path-not-allowed":
        return "path-error"
    return code


HEADER_PROBES = ["accept", "x-forwarded-host", "authorization", "x-api-key", "proxy-authorization", "connection", "x-other"]


def _compare(art, reqs, ips) -> set[str]:
    """Instantiate the symbolic outcome with every (subject, request, answers) and compare with decide(); the reasons seen."""
    seen: set[str] = set()
    for kind, subject in (("connection", art.connections[0]), ("profile", art.sandbox_profiles[0])):
        ctx = z3.Context()
        ev = Evaluator(ctx)
        table = subject_table(art, TABLE, kind, subject.name)
        if table is None:
            continue
        prefixes = [r.prefix for r in table.rules if r.prefix]
        brokered = [art.connection(n) for n in getattr(subject, "brokers", ())]
        sym = SymbolicRequest(ev, Universe.build([subject, *brokered], prefixes))
        out = outcome(ev, table, sym)
        lease = subject_lease(kind, subject.name)
        probes = {h: forwarded(ev, out, sym.header(), sym.name_listed) for h in HEADER_PROBES}
        for req in reqs:
            seen_obs = observe(art, lease, req)
            assert seen_obs is not None
            _, o, hop = seen_obs
            d = decide(art, lease, req, ips)
            pairs = abstract(sym, o, ips)
            assert z3.is_true(_evaluate(sym.wf, pairs)), (req, ips)
            allowed = z3.is_true(_evaluate(out.allowed, pairs))
            reason = _value(ev, out.reason, pairs) or "allowed"
            rule_name = _value(ev, out.rule_name(ev), pairs) if allowed else None
            assert (allowed, reason, rule_name) == (d.allowed, reason_class(d.reason), d.rule), (kind, req, ips, d)
            seen.add(reason)
            if d.allowed:
                assert _value(ev, credential_header(ev, out), pairs) == d.inject_header
                assert _value(ev, out.carrier, pairs) == (subject.name if kind == "connection" else d.broker), (req, d)
                fwd = {n.lower() for n, _ in d.forward_headers}
                for h in HEADER_PROBES:
                    here = abstract(sym, o, ips, h, h in hop)
                    if any(n.lower() == h for n, _ in req.headers):
                        assert z3.is_true(_evaluate(probes[h], here)) == (h in fwd), (h, req, d)
    return seen


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(art=artifacts(), reqs=st.lists(requests(), min_size=2, max_size=5), ips=st.lists(addresses(), min_size=1, max_size=3))
def test_symbolic_core_agrees_with_decide(art, reqs, ips):
    _compare(art, reqs, ips)


def test_agreement_covers_every_reason_class():
    """A fixed table through the same comparison: the agreement above must not be vacuous for any reason."""
    art = artifact(
        connections=[connection("c", [rule("r0", "api.github.com", "/repos/acme", ["GET"], ["accept", "x-forwarded-host"])],
                                worker="w")],
        profiles=[profile("p", [("pypi.org", 443)])],
        workers=[worker("w", ipv6=False, ip_literals=True, deny_cidrs=("8.8.4.0/24",), allow_cidrs=("100.64.0.0/10",))],
    )
    ok = dict(method="GET", scheme="https", host="api.github.com", port=443, target="/repos/acme/x")
    variants = [
        {}, {"scheme": "http"}, {"port": 0}, {"host": "127.1"}, {"host": "10.0.0.1"}, {"host": "8.8.4.4"},
        {"host": "pypi.org"}, {"method": "TRACE"}, {"method": "POST"}, {"target": "/repos/acmex"},
        {"target": "/repos/acme/../x"}, {"headers": (("Host", "a.example.org"), ("Host", "b.example.org"))},
        {"host_header": "evil.example.net"}, {"headers": (("Upgrade", "websocket"),)},
        {"headers": (("Content-Length", "1"), ("Transfer-Encoding", "chunked"))}, {"has_body": True},
        {"headers": (("Accept", "x"), ("X-Forwarded-Host", "e"), ("Connection", "accept"))},
        {"headers": ((b"Accept", b"x"),)},
    ]
    reqs = [Request(**{**ok, **v}) for v in variants]
    seen: set[str] = set()
    for ips in (["93.184.215.14"], ["8.8.4.4"], ["10.0.0.1"], ["100.64.0.1"], ["::ffff:8.8.8.8"], ["93.184.215.14", "10.0.0.1"]):
        seen |= _compare(art, reqs, ips)
    assert seen >= {
        "allowed", "scheme-not-allowed", "port-invalid", "host-error", "address-not-public", "address-denied",
        "ipv6-disabled", "no-matching-rule", "method-not-allowed", "path-not-allowed", "path-error", "smuggling",
        "host-header-mismatch", "upgrade-denied", "body-on-bodyless-method", "profile-host-not-allowed", "internal-error",
    }, seen


def test_agreement_on_brokered_profile_traffic():
    """A brokering profile through the same comparison: brokered (credential, the connection's allowlist and worker),
    plain (same host, outside the rules), a path without a normalized form, plain http, and the worker's deny list."""
    art = artifact(
        connections=[connection("c", [rule("r0", "api.github.com", "/repos/acme", ["GET"], ["accept"])], worker="w",
                                inject_header="X-Api-Key")],
        profiles=[profile("p", [("api.github.com", 443), ("api.github.com", 80), ("pypi.org", 443)], brokers=("c",))],
        workers=[worker("w", deny_cidrs=("8.8.4.0/24",))],
    )
    ok = dict(method="GET", scheme="https", host="api.github.com", port=443, target="/repos/acme/x",
              headers=(("Accept", "x"), ("X-Api-Key", "mine"), ("User-Agent", "u")))
    variants = [{}, {"target": "/repos/acmex"}, {"target": "/repos/acme/%2e/x"}, {"method": "POST"}, {"scheme": "http", "port": 80},
                {"host": "pypi.org"}]
    reqs = [Request(**{**ok, **v}) for v in variants]
    brokered = [decide(art, subject_lease("profile", "p"), req, ["93.184.215.14"]).broker for req in reqs]
    assert brokered == ["c", None, None, None, None, None]
    seen: set[str] = set()
    for ips in (["93.184.215.14"], ["8.8.4.4"], ["10.0.0.1"]):
        seen |= _compare(art, reqs, ips)
    assert {"allowed", "address-denied", "address-not-public", "no-matching-rule"} <= seen, seen
