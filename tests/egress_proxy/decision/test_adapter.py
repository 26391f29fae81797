"""The decision function: table-driven cases asserting reason codes, and Hypothesis properties."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from catalog import load_catalog
from compiler.constants import METHODS, header_is_denylisted
from compiler.normalize import (
    normalize_host,
    normalize_path,
    normalize_prefix,
    prefix_matches,
)
from egress_proxy.decision.adapter import (
    artifact_index,
    decide,
    decide_connect,
    decide_destination,
    decide_without_addresses,
    judge_answers,
)
from egress_proxy.decision.addresses import judge_ip
from egress_proxy.decision.reasons import ALLOWED, REASONS
from egress_proxy.decision.types import Decision, Lease, Request
from tests.egress_proxy.builders import artifact, connection, profile, rule, worker

TABLE = load_catalog("2026.11").special_purpose
GH = "api.github.com"

ART = artifact(
    workers=[
        worker("edge", ip_literals=True),
        worker("v4only", ipv6=False),
        worker("cgnat", allow_cidrs=("100.64.0.0/10",)),
        worker("strict", deny_cidrs=("140.82.112.0/20",)),
    ],
    connections=[
        connection(
            "github",
            [
                rule("read-repos", GH, "/repos/acme/", ["GET", "HEAD"], ["Accept", "X-GitHub-Api-Version", "User-Agent"]),
                rule("open-issues", GH, "/repos/acme/app/issues", ["POST"], ["Accept", "Content-Type"]),
                rule("alt-port", GH, "/alt", ["GET"], ["accept"], port=8443),
            ],
        ),
        connection(
            "overlap",
            [
                rule("narrow-first", "api.example.com", "/v1/items", ["GET"], ["accept"]),
                rule("broad", "api.example.com", "/v1", ["GET", "POST"], ["accept", "content-type"]),
                rule("narrow-after", "api.example.com", "/v1/items/special", ["GET"], ["user-agent"]),
            ],
        ),
        # The inject header and x-forwarded-host are smuggled into an allowlist (the compiler refuses
        # both); the decision function must still never forward them.
        connection(
            "keyed",
            [rule("any", "api.keyed.io", "/", list(METHODS), ["x-api-key", "accept", "x-forwarded-host", "cookie"])],
            inject_header="X-Api-Key",
            inject_format="{secret}",
        ),
        connection("literal", [rule("lit", GH, "/", ["GET"])], worker="edge"),
        connection("v4", [rule("v4", GH, "/", ["GET"])], worker="v4only"),
        connection("cgnat", [rule("c", GH, "/", ["GET"])], worker="cgnat"),
        connection("strict", [rule("s", GH, "/", ["GET"])], worker="strict"),
        connection("ghost", [rule("g", GH, "/", ["GET"])], worker="no-such-worker"),
        connection("badprefix", [rule("q", GH, "/repos?x", ["GET"]), rule("dots", GH, "/a/./b", ["GET"])]),
        connection("root", [rule("all", "uploads.example.org", "/", ["PUT", "DELETE", "OPTIONS"], ["content-type"])]),
    ],
    profiles=[
        profile(
            "ci",
            [
                ("deb.debian.org", 80, "allow_package_managers:apt"),
                ("pypi.org", 443, "allow_package_managers:pip"),
                ("files.pythonhosted.org", 443, "allow_package_managers:pip"),
                (GH, 443),
            ],
        ),
        profile("offline", []),
    ],
)

C = Lease("agent-1", None, "github", 2_000_000_000)
P = Lease("agent-1", "ci", None, 2_000_000_000)
IPS = ("140.82.112.6",)


def L(connection: str | None = None, profile: str | None = None) -> Lease:
    return Lease("agent-1", profile, connection, 2_000_000_000)


def req(method: str = "GET", target: str = "/repos/acme/app", host: str = GH, port: int = 443, scheme: str = "https", **kw) -> Request:
    return Request(method=method, scheme=scheme, host=host, port=port, target=target, **kw)  # type: ignore[arg-type]


def check(decision: Decision, reason: str, rule: str | None = None) -> None:
    assert decision.reason == reason, decision.detail
    assert decision.allowed == (reason == ALLOWED)
    assert reason == ALLOWED or reason in REASONS
    if decision.allowed:
        assert decision.rule == rule
    else:
        assert decision.rule is None and decision.forward_headers == () and decision.inject_header is None


# --- destination: decide_destination and the first stage of decide -----------------------------------

NUMERIC_HOSTS = [
    "127.1", "127.0.1", "2130706433", "0x7f.0.0.1", "0x7f000001", "0177.0.0.1", "017700000001",
    "127.000.000.001", "0x7F.1", "127.0.0.0x1", "0x7f.0x0.0x0.0x1", "127.0.0.1.1", "1.2.3.4.5",
    "169.254.43518", "169.16689662", "2852039166", "0xa9fea9fe", "0xa9.0xfe.0xa9.0xfe",
    "0251.0376.0251.0376", "025177524776", "169.254.169.0376", "\uff11\uff12\uff17.0.0.1",
]
IP_LITERAL_HOSTS = ["127.0.0.1", "127.0.0.1.", "169.254.169.254", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]",
                    "[64:ff9b::a9fe:a9fe]", "[fd00:ec2::254]", "192.0.0.192", "100.64.0.1", "8.8.8.8", "[2001:4860:4860::8888]"]

DESTINATION_CASES = [
    # (lease, scheme, host, port, reason)
    (C, "https", GH, 443, ALLOWED),
    (C, "https", "API.GitHub.com", 443, ALLOWED),
    (C, "https", "api.github.com.", 443, ALLOWED),
    (C, "https", GH, 8443, ALLOWED),
    (C, "https", GH, 80, "no-matching-rule"),
    (C, "https", "github.com", 443, "no-matching-rule"),
    (C, "https", "api.github.com.evil.com", 443, "no-matching-rule"),
    (C, "http", GH, 443, "scheme-not-allowed"),  # credentials only ride TLS
    (C, "http", GH, 80, "scheme-not-allowed"),
    (C, "ftp", GH, 443, "scheme-not-allowed"),
    (C, "https", GH, 0, "port-invalid"),
    (C, "https", GH, 65536, "port-invalid"),
    (C, "https", GH, -443, "port-invalid"),
    (L(connection="nope"), "https", GH, 443, "lease-unknown-subject"),
    (L(profile="nope"), "https", GH, 443, "lease-unknown-subject"),
    (L(connection="ghost"), "https", GH, 443, "worker-unknown"),
    (P, "http", "deb.debian.org", 80, ALLOWED),  # apt over plain http to a port-80 entry
    (P, "https", "deb.debian.org", 443, "profile-host-not-allowed"),
    (P, "https", "pypi.org", 443, ALLOWED),
    (P, "https", "pypi.org", 8443, "profile-host-not-allowed"),
    (P, "https", "evil.org", 443, "profile-host-not-allowed"),
    (P, "gopher", "pypi.org", 443, "scheme-not-allowed"),
    (L(profile="offline"), "https", "pypi.org", 443, "profile-host-not-allowed"),
    # host normalization refusals become the reason
    (C, "https", "", 443, "host-empty"),
    (C, "https", "*.github.com", 443, "host-wildcard"),
    (C, "https", "https://api.github.com", 443, "host-scheme"),
    (C, "https", "user@api.github.com", 443, "host-userinfo"),
    (C, "https", "api.github.com/x", 443, "host-path"),
    (C, "https", "api.github.com\\x", 443, "host-path"),
    (C, "https", "api.github.com\x00", 443, "host-invalid-character"),
    (C, "https", "api.github.com:443", 443, "host-port"),
    (C, "https", "api..github.com", 443, "host-empty-label"),
    (C, "https", "-api.github.com", 443, "host-label-syntax"),
    (C, "https", "a" * 64 + ".com", 443, "host-label-length"),
    (C, "https", ("a" * 60 + ".") * 5 + "com", 443, "host-too-long"),
    (C, "https", "xn--zz.com", 443, "host-idna"),
    (C, "https", "[::1", 443, "host-bracket"),
    (C, "https", "[fe80::1%eth0]", 443, "host-zone-id"),
]


@pytest.mark.parametrize(("lease", "scheme", "host", "port", "expected"), DESTINATION_CASES)
def test_destination(lease: Lease, scheme: str, host: str, port: int, expected: str) -> None:
    check(decide_destination(ART, lease, scheme, host, port), expected)


@pytest.mark.parametrize("host", NUMERIC_HOSTS)
@pytest.mark.parametrize("lease", [C, L(connection="literal"), P], ids=["connection", "ip-literals-worker", "profile"])
def test_non_canonical_numeric_hosts_are_refused_before_resolution(host: str, lease: Lease) -> None:
    check(decide_destination(ART, lease, "https", host, 443), "host-noncanonical-ip")
    check(decide(ART, lease, req(host=host), ["8.8.8.8"]), "host-noncanonical-ip")


@pytest.mark.parametrize("host", IP_LITERAL_HOSTS)
def test_ip_literals_are_refused_unless_the_worker_allows_them(host: str) -> None:
    check(decide_destination(ART, C, "https", host, 443), "ip-literal-refused")
    check(decide_destination(ART, P, "https", host, 443), "ip-literal-refused")
    # with ip_literals = true the literal is judged by the public-only predicate, then must match a rule
    public = judge_ip(host.strip("[]").rstrip("."), worker(), TABLE)[0]
    expected = "no-matching-rule" if public else "address-not-public"
    check(decide_destination(ART, L(connection="literal"), "https", host, 443), expected)


def test_destination_reports_the_normalized_host() -> None:
    assert decide_destination(ART, C, "https", "API.GitHub.COM.", 443).host == GH
    assert decide_destination(ART, C, "https", "[::FFFF:127.0.0.1]", 443).host == "::ffff:7f00:1"


# --- the full request ----------------------------------------------------------------------------

REQUEST_CASES = [
    # (id, lease, request, ips, reason, rule)
    ("read", C, req(), IPS, ALLOWED, "read-repos"),
    ("read-head", C, req("HEAD"), IPS, ALLOWED, "read-repos"),
    ("prefix-itself", C, req(target="/repos/acme"), IPS, ALLOWED, "read-repos"),
    ("prefix-trailing-slash", C, req(target="/repos/acme/"), IPS, ALLOWED, "read-repos"),
    ("query-ignored", C, req(target="/repos/acme/app?ref=main&x=/../"), IPS, ALLOWED, "read-repos"),
    ("segment-boundary", C, req(target="/repos/acmex"), IPS, "path-not-allowed", None),
    ("segment-boundary-deeper", C, req(target="/repos/acmex/app"), IPS, "path-not-allowed", None),
    ("segment-boundary-dash", C, req(target="/repos/acme-evil/app"), IPS, "path-not-allowed", None),
    ("parent", C, req(target="/repos"), IPS, "path-not-allowed", None),
    ("case-matters", C, req(target="/Repos/acme/app"), IPS, "path-not-allowed", None),
    ("post-issue", C, req("POST", "/repos/acme/app/issues", has_body=True), IPS, ALLOWED, "open-issues"),
    ("post-issue-comment", C, req("POST", "/repos/acme/app/issues/1/comments"), IPS, ALLOWED, "open-issues"),
    ("post-elsewhere", C, req("POST", "/repos/acme/app/pulls"), IPS, "method-not-allowed", None),
    ("post-issuesx", C, req("POST", "/repos/acme/app/issuesx"), IPS, "method-not-allowed", None),
    ("delete", C, req("DELETE"), IPS, "method-not-allowed", None),
    ("lowercase-method", C, req("get"), IPS, "method-not-allowed", None),
    ("connect", C, req("CONNECT"), IPS, "method-not-allowed", None),
    ("trace", C, req("TRACE"), IPS, "method-not-allowed", None),
    ("other-port", C, req(target="/alt/x", port=8443, host_header="api.github.com:8443"), IPS, ALLOWED, "alt-port"),
    ("other-port-other-rules", C, req(target="/repos/acme/app", port=8443), IPS, "path-not-allowed", None),
    ("plain-http", C, req(scheme="http", port=80), IPS, "scheme-not-allowed", None),
    # first matching rule in the artifact's rule order wins
    ("overlap-first", L(connection="overlap"), req(host="api.example.com", target="/v1/items/special"), IPS, ALLOWED, "narrow-first"),
    ("overlap-broad", L(connection="overlap"), req(host="api.example.com", target="/v1/other"), IPS, ALLOWED, "broad"),
    ("overlap-method", L(connection="overlap"), req("POST", host="api.example.com", target="/v1/items"), IPS, ALLOWED, "broad"),
    # rules whose prefix is not canonical never match (fail closed)
    ("bad-prefix-query", L(connection="badprefix"), req(target="/repos"), IPS, "path-not-allowed", None),
    ("bad-prefix-dots", L(connection="badprefix"), req(target="/a/b"), IPS, "path-not-allowed", None),
    # path refusals: every PathError reason the normalizer raises for a request
    ("fragment", C, req(target="/repos/acme/app#x"), IPS, "path-fragment", None),
    ("not-absolute", C, req(target="repos/acme/app"), IPS, "path-not-absolute", None),
    ("asterisk", C, req(target="*"), IPS, "path-not-absolute", None),
    ("absolute-form-target", C, req(target="https://api.github.com/repos/acme"), IPS, "path-not-absolute", None),
    ("empty-target", C, req(target=""), IPS, "path-not-absolute", None),
    ("bad-escape", C, req(target="/repos/acme/%zz"), IPS, "path-bad-escape", None),
    ("short-escape", C, req(target="/repos/acme/%2"), IPS, "path-bad-escape", None),
    ("encoded-slash", C, req(target="/repos/acme%2fapp"), IPS, "path-encoded-slash", None),
    ("encoded-slash-upper", C, req(target="/repos/acme%2Fapp"), IPS, "path-encoded-slash", None),
    ("encoded-backslash", C, req(target="/repos/acme/%5c..%5capp"), IPS, "path-encoded-slash", None),
    ("encoded-dot", C, req(target="/repos/acme/%2e%2e/x"), IPS, "path-encoded-dot", None),
    ("encoded-dot-upper", C, req(target="/repos/acme/%2E"), IPS, "path-encoded-dot", None),
    ("nul", C, req(target="/repos/acme/app\x00"), IPS, "path-nul", None),
    ("encoded-nul", C, req(target="/repos/acme/app%00"), IPS, "path-nul", None),
    ("parameter", C, req(target="/repos/acme;x=1/app"), IPS, "path-parameter", None),
    ("encoded-parameter", C, req(target="/repos/acme%3bx/app"), IPS, "path-parameter", None),
    ("noncanonical-escape", C, req(target="/repos/%61cme/app"), IPS, "path-noncanonical-escape", None),
    ("space", C, req(target="/repos/acme/a b"), IPS, "path-invalid-character", None),
    ("backslash", C, req(target="/repos/acme\\..\\x"), IPS, "path-invalid-character", None),
    ("non-ascii", C, req(target="/repos/acme/\u00e9"), IPS, "path-invalid-character", None),
    ("double-slash", C, req(target="/repos//acme/app"), IPS, "path-empty-segment", None),
    ("leading-double-slash", C, req(target="//evil.com/repos/acme"), IPS, "path-empty-segment", None),
    ("dot-dot", C, req(target="/repos/acme/../../admin"), IPS, "path-dot-segment", None),
    ("dot", C, req(target="/repos/acme/./app"), IPS, "path-dot-segment", None),
    ("trailing-dot", C, req(target="/repos/acme/."), IPS, "path-dot-segment", None),
    # Host header agreement
    ("host-header-same", C, req(host_header="api.github.com"), IPS, ALLOWED, "read-repos"),
    ("host-header-port", C, req(host_header="api.github.com:443"), IPS, ALLOWED, "read-repos"),
    ("host-header-case-dot", C, req(host_header="API.GITHUB.COM."), IPS, ALLOWED, "read-repos"),
    ("host-header-other", C, req(host_header="evil.com"), IPS, "host-header-mismatch", None),
    ("host-header-other-port", C, req(host_header="api.github.com:8443"), IPS, "host-header-mismatch", None),
    ("host-header-empty-port", C, req(host_header="api.github.com:"), IPS, "host-header-mismatch", None),
    ("host-header-signed-port", C, req(host_header="api.github.com:+443"), IPS, "host-header-mismatch", None),
    ("host-header-numeric", C, req(host_header="127.1"), IPS, "host-header-mismatch", None),
    ("host-header-empty", C, req(host_header=""), IPS, "host-header-mismatch", None),
    ("host-header-userinfo", C, req(host_header="api.github.com@evil.com"), IPS, "host-header-mismatch", None),
    ("host-header-v6", C, req(host_header="[::1]:443"), IPS, "host-header-mismatch", None),
    ("host-in-headers", C, req(headers=(("Host", "evil.com"),)), IPS, "host-header-mismatch", None),
    ("host-in-headers-ok", C, req(headers=(("host", "api.github.com"),), host_header="api.github.com"), IPS, ALLOWED, "read-repos"),
    ("two-host-headers", C, req(headers=(("Host", GH), ("Host", GH))), IPS, "smuggling", None),
    # framing the proxy's HTTP layer would pass on as read: decided here, so `explain` says the same
    ("bare-cr-in-value", C, req(headers=(("Accept", "a\rAuthorization: x"),)), IPS, "smuggling", None),
    ("lf-in-value", C, req(headers=(("Accept", "a\nb"),)), IPS, "smuggling", None),
    ("nul-in-name", C, req(headers=(("X-\x00", "1"),)), IPS, "smuggling", None),
    ("esc-in-value", C, req(headers=(("Accept", "a\x1b[2Jb"),)), IPS, "smuggling", None),  # RFC 9110 §5.5: no CTL but HTAB
    ("del-in-value", C, req(headers=(("Accept", "a\x7fb"),)), IPS, "smuggling", None),
    ("htab-in-value", C, req(headers=(("Accept", "a\tb"),)), IPS, ALLOWED, "read-repos"),
    ("obs-text-in-value", C, req(headers=(("Accept", "caf\xe9"),)), IPS, ALLOWED, "read-repos"),
    ("declared-trailers", C, req(headers=(("Trailer", "x-checksum"),)), IPS, "trailers-denied", None),
    ("declared-trailers-profile", P, req(host="pypi.org", target="/simple/", headers=(("trailer", "x"),)), IPS, "trailers-denied", None),
    ("tunnel-other-port", C, req(tunnel=True, inner_port=8443), IPS, "host-header-mismatch", None),
    ("tunnel-same-port", C, req(tunnel=True, inner_port=443), IPS, ALLOWED, "read-repos"),
    ("no-tunnel-inner-port", C, req(tunnel=False, inner_port=8443), IPS, ALLOWED, "read-repos"),
    ("profile-default-port", P, req(scheme="http", host="deb.debian.org", port=80, target="/debian/dists", host_header="deb.debian.org"), IPS, ALLOWED, None),
    ("profile-port-mismatch", P, req(scheme="http", host="deb.debian.org", port=80, target="/", host_header="deb.debian.org:443"), IPS, "host-header-mismatch", None),
    # upgrades, framing and bodies
    ("upgrade", C, req(headers=(("Upgrade", "websocket"),)), IPS, "upgrade-denied", None),
    ("connection-upgrade", C, req(headers=(("Connection", "keep-alive, Upgrade"),)), IPS, "upgrade-denied", None),
    ("h2c", C, req(headers=(("HTTP2-Settings", "AAMAAABkAAQAAP__"),)), IPS, "upgrade-denied", None),
    ("te-and-cl", C, req("POST", "/repos/acme/app/issues", headers=(("Transfer-Encoding", "chunked"), ("Content-Length", "3")), has_body=True), IPS, "smuggling", None),
    ("two-cl", C, req("POST", "/repos/acme/app/issues", headers=(("Content-Length", "3"), ("content-length", "4")), has_body=True), IPS, "smuggling", None),
    ("get-body", C, req(has_body=True), IPS, "body-on-bodyless-method", None),
    ("head-body", C, req("HEAD", has_body=True), IPS, "body-on-bodyless-method", None),
    ("delete-body", L(connection="root"), req("DELETE", host="uploads.example.org", has_body=True), IPS, "body-on-bodyless-method", None),
    ("options-body", L(connection="root"), req("OPTIONS", host="uploads.example.org", has_body=True), IPS, "body-on-bodyless-method", None),
    ("put-body", L(connection="root"), req("PUT", host="uploads.example.org", target="/f", has_body=True), IPS, ALLOWED, "all"),
    ("delete-no-body", L(connection="root"), req("DELETE", host="uploads.example.org", target="/f"), IPS, ALLOWED, "all"),
    # resolved addresses, judged with the subject's worker
    ("no-answers", C, req(), (), "resolve-failed", None),
    ("one-private-answer", C, req(), ("140.82.112.6", "10.0.0.5"), "address-not-public", None),
    ("metadata-answer", C, req(), ("169.254.169.254",), "address-not-public", None),
    ("mapped-metadata", C, req(), ("::ffff:169.254.169.254",), "address-not-public", None),
    ("nat64-loopback", C, req(), ("64:ff9b::7f00:1",), "address-not-public", None),
    ("cgnat-answer", C, req(), ("100.64.0.1",), "address-not-public", None),
    ("cgnat-hole", L(connection="cgnat"), req(), ("100.64.0.1",), ALLOWED, "c"),
    ("oracle-metadata", C, req(), ("192.0.0.192",), "address-not-public", None),
    ("aws-v6-metadata", C, req(), ("fd00:ec2::254",), "address-not-public", None),
    ("ipv6-ok", C, req(), ("2606:50c0:8000::154",), ALLOWED, "read-repos"),
    ("ipv6-disabled", L(connection="v4"), req(), ("140.82.112.6", "2606:50c0:8000::154"), "ipv6-disabled", None),
    ("deny-cidr", L(connection="strict"), req(), ("140.82.112.6",), "address-denied", None),
    ("deny-cidr-mapped", L(connection="strict"), req(), ("::ffff:140.82.112.6",), "address-denied", None),
    ("profile-answers", P, req(host="pypi.org", target="/simple/"), ("10.1.1.1",), "address-not-public", None),
    ("profile-answers-ok", P, req(host="pypi.org", target="/simple/"), ("151.101.0.223",), ALLOWED, None),
    # a profile grants whole host:port pairs: only malformed targets are refused (npm scoped packages
    # fetch `/@scope%2fname`), while a connection's rules match paths, so its paths must read one way
    ("profile-encoded-slash", P, req(host="pypi.org", target="/@types%2fnode"), IPS, ALLOWED, None),
    ("profile-dot-segment", P, req(host="pypi.org", target="/simple/../pip/"), IPS, ALLOWED, None),
    ("profile-nul", P, req(host="pypi.org", target="/simple/%00"), IPS, "path-nul", None),
    ("profile-space", P, req(host="pypi.org", target="/simple/a b"), IPS, "path-invalid-character", None),
    ("profile-relative", P, req(host="pypi.org", target="simple"), IPS, "path-not-absolute", None),
    ("connection-encoded-slash", C, req(target="/repos/acme%2fapp"), IPS, "path-encoded-slash", None),
]


@pytest.mark.parametrize(("lease", "request_", "ips", "expected", "rule_name"), [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES])
def test_decide(lease: Lease, request_: Request, ips: tuple[str, ...], expected: str, rule_name: str | None) -> None:
    check(decide(ART, lease, request_, ips), expected, rule_name)


def test_every_normalizer_reason_is_a_documented_reason() -> None:
    source = (Path(__file__).parents[3] / "compiler" / "normalize.py").read_text()
    codes = set(re.findall(r'(?:HostError|PathError)\(\s*"([a-z0-9-]+)"', source))
    assert len(codes) >= 25
    assert codes <= set(REASONS), codes - set(REASONS)


def test_proxy_side_codes_are_in_the_table() -> None:
    proxy = ("lease-missing lease-invalid lease-expired lease-unknown-subject sni-mismatch sni-missing ech-refused "
             "non-http-in-tunnel connect-in-tunnel upgrade-denied host-header-mismatch resolve-failed self-connection "
             "upstream-error internal-error smuggling body-on-bodyless-method trailers-denied scheme-not-allowed")
    assert set(proxy.split()) <= set(REASONS)
    assert ALLOWED not in REASONS
    assert all(d and d == d.strip() and not d.endswith(".") for d in REASONS.values())


# --- headers --------------------------------------------------------------------------------------

CALLER_HEADERS = (
    ("Accept", "application/json"),
    ("ACCEPT", "text/plain"),
    ("User-Agent", "agent/1"),
    ("Content-Type", "application/json"),
    ("Authorization", "Bearer caller-supplied"),
    ("Proxy-Authorization", "Bearer lease"),
    ("Proxy-Connection", "keep-alive"),
    ("Cookie", "a=b"),
    ("X-Forwarded-Host", "evil.com"),
    ("X-Forwarded-For", "1.2.3.4"),
    ("Forwarded", "for=1.2.3.4"),
    ("Via", "1.1 x"),
    ("X-Real-IP", "1.2.3.4"),
    ("X-HTTP-Method-Override", "DELETE"),
    ("X-Api-Key", "caller-key"),
    ("x-api-key", "caller-key-2"),
    ("Keep-Alive", "timeout=5"),
    ("TE", "trailers"),
    ("X-Egresslaw-Deny", "forged"),
    ("X-Custom", "1"),
)


def test_connection_headers_are_the_rule_allowlist_only() -> None:
    d = decide(ART, C, req(headers=CALLER_HEADERS), IPS)
    check(d, ALLOWED, "read-repos")
    assert d.forward_headers == (("Accept", "application/json"), ("ACCEPT", "text/plain"), ("User-Agent", "agent/1"))
    assert d.inject_header == "Authorization"


def test_smuggled_allowlist_entries_and_the_inject_header_are_never_forwarded() -> None:
    d = decide(ART, L(connection="keyed"), req(host="api.keyed.io", target="/x", headers=CALLER_HEADERS), IPS)
    check(d, ALLOWED, "any")
    assert d.forward_headers == (("Accept", "application/json"), ("ACCEPT", "text/plain"))
    assert d.inject_header == "X-Api-Key"


def test_headers_named_in_connection_are_hop_by_hop() -> None:
    d = decide(ART, C, req(headers=(("Connection", "Accept"), ("Accept", "x"), ("User-Agent", "y"))), IPS)
    check(d, ALLOWED, "read-repos")
    assert d.forward_headers == (("User-Agent", "y"),)


def test_profile_headers_drop_every_denylisted_header() -> None:
    d = decide(ART, P, req(host="pypi.org", target="/simple/", headers=CALLER_HEADERS + (("Bad Name", "x"), ("Connection", "X-Custom"))), IPS)
    check(d, ALLOWED, None)
    assert d.inject_header is None
    assert d.forward_headers == (
        ("Accept", "application/json"),
        ("ACCEPT", "text/plain"),
        ("User-Agent", "agent/1"),
        ("Content-Type", "application/json"),
        ("X-Api-Key", "caller-key"),
        ("x-api-key", "caller-key-2"),
    )
    assert d.detail == "granted by allow_package_managers:pip"


def test_decision_never_carries_a_header_value_in_detail() -> None:
    d = decide(ART, C, req(headers=(("Host", "secret-looking-value.example"),)), IPS)
    check(d, "host-header-mismatch")
    d = decide(ART, C, req(headers=(("Upgrade", "secret-token-123"),)), IPS)
    assert "secret-token-123" not in (d.detail or "")


def test_decide_without_addresses_skips_only_the_address_check() -> None:
    check(decide_without_addresses(ART, C, req()), ALLOWED, "read-repos")
    check(decide_without_addresses(ART, C, req(target="/repos/acmex")), "path-not-allowed")
    check(decide(ART, C, req(), ()), "resolve-failed")


def test_index_is_per_artifact_object() -> None:
    assert artifact_index(ART) is artifact_index(ART)
    mutant = ART.model_copy(update={"connections": ()})  # same digest, different content
    assert artifact_index(mutant) is not artifact_index(ART)
    check(decide(mutant, C, req(), IPS), "lease-unknown-subject")
    check(decide(ART, C, req(), IPS), ALLOWED, "read-repos")


def test_unknown_catalog_version_denies() -> None:
    bad = ART.model_copy(update={"catalog": ART.catalog.model_copy(update={"version": "1999.01"})})
    check(decide(bad, C, req(), IPS), "internal-error")


def test_deterministic() -> None:
    first = decide(ART, C, req(headers=CALLER_HEADERS), IPS)
    assert first.allowed
    assert all(decide(ART, C, req(headers=CALLER_HEADERS), IPS) == first for _ in range(5))


# --- properties -------------------------------------------------------------------------------------

LEASES = [C, P, L(connection="overlap"), L(connection="keyed"), L(connection="literal"), L(connection="v4"),
          L(connection="root"), L(connection="badprefix"), L(connection="ghost"), L(connection="nope"), L(profile="offline")]
HOSTS = [GH, "API.GITHUB.COM.", "api.example.com", "api.keyed.io", "uploads.example.org", "pypi.org", "deb.debian.org",
         "evil.com", *NUMERIC_HOSTS[:6], *IP_LITERAL_HOSTS[:6]]
SEGMENTS = ["repos", "acme", "acmex", "app", "issues", "v1", "items", "special", "x", ".", "..", "%2e", "%2F", "%41",
            "a;b", "", "%zz", "\x00", "alt", "simple", "debian", "f"]
HEADER_NAMES = ["Accept", "accept", "User-Agent", "Content-Type", "Authorization", "Proxy-Authorization", "X-Api-Key",
                "X-Forwarded-Host", "Cookie", "Host", "Connection", "Upgrade", "Content-Length", "Transfer-Encoding",
                "TE", "X-Custom", "Via", "Forwarded", "proxy-foo", "X-Egresslaw-Rule"]
IP_STRATEGY = st.one_of(
    st.sampled_from(["140.82.112.6", "10.0.0.1", "::ffff:127.0.0.1", "64:ff9b::808:808", "2606:50c0:8000::154",
                     "169.254.169.254", "100.64.0.1", "fe80::1%eth0", "bogus", "2002:a00:1::1"]),
    st.integers(0, (1 << 32) - 1).map(lambda x: str(ipaddress.IPv4Address(x))),
    st.integers(0, (1 << 128) - 1).map(lambda x: str(ipaddress.IPv6Address(x))),
    st.text(max_size=20),
)
targets = st.one_of(
    st.lists(st.sampled_from(SEGMENTS), max_size=5).map(lambda s: "/" + "/".join(s)),
    st.lists(st.sampled_from(SEGMENTS), max_size=5).map(lambda s: "/" + "/".join(s) + "?q=/../"),
    st.text(max_size=40),
)
requests = st.builds(
    Request,
    method=st.one_of(st.sampled_from(METHODS + ("CONNECT", "TRACE", "get")), st.text(max_size=8)),
    scheme=st.one_of(st.sampled_from(["https", "http"]), st.text(max_size=6)),
    host=st.one_of(st.sampled_from(HOSTS), st.text(max_size=30)),
    port=st.one_of(st.sampled_from([443, 80, 8443]), st.integers(-5, 70_000)),
    target=targets,
    headers=st.lists(
        st.tuples(st.one_of(st.sampled_from(HEADER_NAMES), st.text(max_size=12)), st.one_of(st.sampled_from([GH, "x", "upgrade", "accept"]), st.text(max_size=12))),
        max_size=6,
    ).map(tuple),
    host_header=st.one_of(st.none(), st.sampled_from([GH, "api.github.com:443", "pypi.org", "evil.com"]), st.text(max_size=20)),
    tunnel=st.booleans(),
    has_body=st.booleans(),
)
ips_strategy = st.lists(IP_STRATEGY, max_size=3)
PROPERTY_SETTINGS = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(st.sampled_from(LEASES), requests, ips_strategy)
@PROPERTY_SETTINGS
def test_decide_never_raises_and_allows_only_what_a_rule_admits(lease: Lease, request: Request, ips: list[str]) -> None:
    d = decide(ART, lease, request, ips)  # any exception is a bug
    assert isinstance(d, Decision)
    assert d.allowed == (d.reason == ALLOWED)
    assert d.reason == ALLOWED or d.reason in REASONS
    if not d.allowed:
        assert d.rule is None and d.forward_headers == () and d.inject_header is None
        return
    host = normalize_host(request.host).value
    path = normalize_path(request.target)
    assert (d.host, d.path) == (host, path)
    assert ips and all(judge_ip(ip, ART.worker(_worker_of(lease)), TABLE)[0] for ip in ips)
    if lease.profile is not None:
        prof = ART.profile(lease.profile)
        assert (host, request.port) in {(h.host, h.port) for h in prof.network.allowed_hosts}
        assert d.rule is None and d.inject_header is None
        return
    conn = ART.connection(lease.connection)
    assert request.scheme == "https"
    matching = [r for r in conn.rules if r.host == host and r.port == request.port and request.method in r.methods
                and prefix_matches(normalize_prefix(r.path_prefix), path)]
    assert matching and matching[0].name == d.rule  # the first matching rule, in artifact order
    assert d.inject_header == conn.inject.header


def _worker_of(lease: Lease) -> str:
    return ART.connection(lease.connection).worker if lease.connection else "default"


@given(st.sampled_from(LEASES), requests, ips_strategy)
@PROPERTY_SETTINGS
def test_forward_headers_never_carry_a_denylisted_or_inject_header(lease: Lease, request: Request, ips: list[str]) -> None:
    d = decide(ART, lease, request, ips)
    inject = ART.connection(lease.connection).inject.header if lease.connection and ART.connection(lease.connection) else None
    for name, value in d.forward_headers:
        assert not header_is_denylisted(name, inject)
        assert name.lower() != "authorization" and not name.lower().startswith("proxy-")
        assert (name, value) in request.headers
    if d.allowed and lease.connection:
        rule = next(r for r in ART.connection(lease.connection).rules if r.name == d.rule)
        assert all(name.lower() in rule.headers for name, _ in d.forward_headers)


@given(st.sampled_from(LEASES), requests, ips_strategy)
@settings(max_examples=500, deadline=None)
def test_a_destination_denial_is_the_request_denial(lease: Lease, request: Request, ips: list[str]) -> None:
    dest = decide_destination(ART, lease, request.scheme, request.host, request.port)
    full = decide(ART, lease, request, ips)
    if not dest.allowed:
        assert full.reason == dest.reason
    if full.allowed:
        assert dest.allowed


@given(st.sampled_from(["/repos/acme", "/repos/acme/", "/v1", "/"]), st.text(alphabet="abcxyz-_/.", max_size=12))
@settings(max_examples=500, deadline=None)
def test_prefix_is_segment_bounded(prefix: str, suffix: str) -> None:
    art = artifact(connections=[connection("p", [rule("r", GH, prefix, ["GET"])])])
    d = decide(art, L(connection="p"), req(target=prefix.rstrip("/") + suffix), IPS)
    if d.allowed:
        canonical = prefix.rstrip("/") or "/"
        assert canonical == "/" or d.path == canonical or d.path.startswith(canonical + "/")


@pytest.mark.parametrize(
    "settings_",
    [{"nat64_prefixes": ("64:ff9b::/80",)}, {"deny_cidrs": ("not-a-cidr",)}, {"allow_cidrs": ("10.0.0.0/33",)}],
)
def test_malformed_worker_settings_fail_closed(settings_: dict) -> None:
    art = artifact(connections=[connection("c", [rule("r", GH)], worker="bad")], workers=[worker("bad", **settings_)])
    check(decide(art, L(connection="c"), req(target="/"), IPS), "worker-unknown")
    check(decide_destination(art, L(connection="c"), "https", GH, 443), "worker-unknown")
    from egress_proxy.decision.addresses import judge_ips

    check(judge_ips(art, "bad", IPS), "worker-unknown")


@pytest.mark.parametrize(
    "headers",
    [((b"Host", b"evil.com"),), (("Accept", None),), (("Accept",),), (("a", "b", "c"),), ([("Accept", "x")],)],
    ids=["bytes", "none-value", "short", "long", "list-item"],
)
def test_unreadable_headers_deny_instead_of_being_skipped(headers) -> None:
    check(decide(ART, C, req(headers=headers), IPS), "internal-error")


WILD = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=10), st.binary(max_size=10),
                 st.lists(st.integers(), max_size=2), st.tuples(st.text(max_size=3)))


@given(st.sampled_from(LEASES), WILD, WILD, WILD, WILD, WILD, WILD, WILD,
       st.lists(st.one_of(st.tuples(WILD, WILD), WILD), max_size=3).map(tuple), st.lists(WILD, max_size=2))
@settings(max_examples=1000, deadline=None)
def test_decide_never_raises_on_values_of_the_wrong_type(lease, method, scheme, host, port, target, host_header, has_body, headers, ips) -> None:
    request = Request(method=method, scheme=scheme, host=host, port=port, target=target, headers=headers,
                      host_header=host_header, has_body=has_body)
    d = decide(ART, lease, request, ips)  # any exception is a bug
    assert d.reason == ALLOWED or d.reason in REASONS
    d = decide_destination(ART, lease, scheme, host, port)
    assert d.reason == ALLOWED or d.reason in REASONS


@given(st.sampled_from(LEASES), requests, ips_strategy)
@settings(max_examples=300, deadline=None)
def test_decision_does_not_depend_on_caches(lease: Lease, request: Request, ips: list[str]) -> None:
    from compiler.artifact import load_artifact

    fresh = load_artifact(ART.to_json())  # a new object: its own index, cold per-artifact state
    assert fresh is not ART
    assert decide(fresh, lease, request, ips) == decide(ART, lease, request, ips)


# --- the CONNECT stage: decide_connect judges the authority as sent and the CONNECT's own framing ------------


@pytest.mark.parametrize(
    "authority, headers, body, expected",
    [
        ("api.github.com:443", (), False, ALLOWED),
        ("API.GitHub.com.:443", (), False, ALLOWED),
        ("api.github.com:0443", (), False, "port-invalid"),
        ("api.github.com:+443", (), False, "port-invalid"),
        ("api.github.com:", (), False, "port-invalid"),
        ("api.github.com", (), False, "port-invalid"),
        ("api.github.com:99999", (), False, "port-invalid"),
        ("api.github.com:443", (("Upgrade", "h2c"),), False, "upgrade-denied"),
        ("api.github.com:443", (("Connection", "Upgrade"),), False, "upgrade-denied"),
        ("api.github.com:443", (("Content-Length", "5"),), True, "body-on-bodyless-method"),
        ("api.github.com:9999", (), False, "no-matching-rule"),
        ("127.1:443", (), False, "host-noncanonical-ip"),
    ],
)
def test_decide_connect(authority: str, headers: tuple, body: bool, expected: str) -> None:
    d = decide_connect(ART, C, authority, headers, body)
    check(d, expected)
    if d.allowed:
        assert d.host == GH


def test_judge_answers_uses_the_subjects_own_worker() -> None:
    check(judge_answers(ART, C, IPS), ALLOWED)
    check(judge_answers(ART, C, ("140.82.112.6", "10.0.0.5")), "address-not-public")
    check(judge_answers(ART, C, ("not-an-ip",)), "address-invalid")
    check(judge_answers(ART, C, ()), "resolve-failed")
    check(judge_answers(ART, L(connection="strict"), ("140.82.112.6",)), "address-denied")
