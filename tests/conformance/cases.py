"""The adversarial corpus, as data: one row per case.

Each `Case` is the request exactly as it goes on the wire (sent with a raw socket or an ssl socket, so
no client library fixes anything), how it is sent (`transport`), which lease it carries, and what must
happen: the verdict (`deny`, `allow`, `tls-refused`), the status and the reason code. The runner
(`test_corpus.py`) adds to every HTTP/1 request a client-supplied `Authorization` (and, inside a
tunnel, a client-supplied `Proxy-Authorization`) right after the request line, and checks that the
upstream never sees either; for absolute-form and CONNECT it adds the lease's `Proxy-Authorization`.

Transports:
  plain    the bytes are sent to the proxy in the clear (absolute-form, origin-form, anything)
  connect  the bytes are a CONNECT request; the verdict is the proxy's answer to it
  tunnel   CONNECT `connect` with the lease, TLS with SNI `sni` (default: the CONNECT host), then the bytes
  tls      CONNECT, then a TLS client hello (`sni`, or the raw hello `hello`) that must be refused
  raw      CONNECT, then the bytes without TLS
  h2       CONNECT, TLS with ALPN h2, then one HTTP/2 request made of `h2_headers` (and `h2_trailers`)
  rebind   the bytes through two tunnels to a name whose second lookup answers loopback
  pipeline two requests in one write inside a tunnel: the first is allowed, the second is the case
  pipeline-plain  the same in absolute-form (the lease is on the first request only)
  direct-tls      TLS straight to the proxy's listener (no CONNECT) with SNI `sni`, then the bytes

Placeholders in the bytes: `{GH}`, `{CI}`, `{EXPIRED}`, `{FORGED}` are replaced by leases (with
`lease="RAW"`, the case writes its own Proxy-Authorization).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from catalog import load_catalog

API = "api.acme-test.dev"
CONN_RULE_HEADERS = ("accept", "user-agent", "x-github-api-version")  # rule "read" of tests/proxy_harness.build_artifact


@dataclass(frozen=True)
class Case:
    family: str
    id: str
    transport: str
    wire: bytes = b""
    lease: str | None = "GH"  # GH (connection github) | CI (profile ci) | EXPIRED | SHORT (2 s) | FORGED | UNKNOWN | RAW | None
    expect: str = "deny"  # deny | allow | tls-refused
    reason: str | None = None  # the reason code (deny) — asserted in the response and the audit log
    status: int | None = None  # default: 403, 407 for lease-*, 200 for allow; 0: the connection is dropped (no answer)
    connect: str = f"{API}:443"
    sni: str | None = "="  # "=" the CONNECT host; None: no SNI
    hello: bytes | None = None  # a raw TLS client hello (transport tls)
    h2_headers: tuple[tuple[str, str], ...] = ()
    h2_body: bytes = b""
    h2_trailers: tuple[tuple[str, str], ...] = ()
    timeout: float = 10.0  # seconds the client waits for an answer
    client_auth: bool = True  # add the client-supplied Authorization / Proxy-Authorization lines
    check: tuple[str, ...] = ()  # extra response checks: redirect-not-followed, forged-stripped, redacted, no-header:<name>
    resolve: tuple[str, ...] = ()  # answers the scripted resolver gives for the case's host (host in `resolve_host`)
    resolve_host: str | None = None
    note: str = ""

    @property
    def audit_reason(self) -> str | None:
        return self.reason


def req(method: str, target: str, host: str | None = API, headers: tuple[str, ...] = (), body: bytes = b"", version: str = "HTTP/1.1") -> bytes:
    """One HTTP/1 request, byte for byte (headers given as raw `Name: value` lines)."""
    lines = [f"{method} {target} {version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += list(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def get(target: str, *headers: str, host: str | None = API) -> bytes:
    return req("GET", target, host, headers)


def absolute(path: str = "/repos/acme/x", host: str = API, scheme: str = "https", method: str = "GET", headers: tuple[str, ...] = (), host_header: str | None = None) -> bytes:
    return req(method, f"{scheme}://{host}{path}", host_header if host_header is not None else host, headers)


def connect(authority: str, host_header: str | None = None) -> bytes:
    return req("CONNECT", authority, host_header if host_header is not None else authority)


CASES: list[Case] = []


def add(*cases: Case) -> None:
    CASES.extend(cases)


# --- host case, trailing dot, suffix over-match --------------------------------------------------
add(
    Case("host-case", "absolute-upper", "plain", absolute(host="API.ACME-TEST.DEV"), expect="allow"),
    Case("host-case", "connect-mixed", "tunnel", get("/repos/acme/x", host="Api.Acme-Test.Dev"), connect="Api.Acme-Test.Dev:443", sni="API.acme-test.DEV", expect="allow"),
    Case("host-case", "host-header-upper", "tunnel", get("/repos/acme/x", host="API.ACME-TEST.DEV"), expect="allow"),
    Case("trailing-dot", "absolute", "plain", absolute(host=API + "."), expect="allow"),
    Case("trailing-dot", "connect", "tunnel", get("/repos/acme/x", host=API + "."), connect=API + ".:443", sni=API, expect="allow"),
    Case("trailing-dot", "two-dots", "plain", absolute(host=API + ".."), status=400, reason="malformed-request"),
    Case("trailing-dot", "connect-two-dots", "connect", connect(API + "..:443"), status=400, reason="malformed-request"),
    Case("suffix-over-match", "evil-suffix", "plain", absolute(host=API + ".evil.test"), reason="no-matching-rule"),
    Case("suffix-over-match", "evil-prefix", "plain", absolute(host="evilapi.acme-test.dev"), reason="no-matching-rule"),
    Case("suffix-over-match", "parent-domain", "plain", absolute(host="acme-test.dev"), reason="no-matching-rule"),
    Case("suffix-over-match", "sub-domain", "plain", absolute(host="x." + API), reason="no-matching-rule"),
    Case("suffix-over-match", "connect-evil-suffix", "connect", connect(API + ".evil.test:443"), reason="no-matching-rule"),
    Case("suffix-over-match", "connect-evil-prefix", "connect", connect("evilapi.acme-test.dev:443"), reason="no-matching-rule"),
)

# --- NUL and control characters in the host ------------------------------------------------------
add(
    Case("nul-in-host", "absolute", "plain", absolute(host=API + "\x00.evil.test"), status=400, reason="malformed-request",
         note="mitmproxy cannot parse the request line: 400 before any hook, audited as malformed-request"),
    Case("nul-in-host", "connect", "connect", connect(API + "\x00.evil.test:443"), status=400, reason="malformed-request"),
    Case("nul-in-host", "host-header-in-tunnel", "tunnel", get("/repos/acme/x", host=API + "\x00.evil.test"), reason="smuggling",
         note="a NUL in any header value is refused before the decision"),
    Case("nul-in-host", "percent-nul", "plain", absolute(host=API + "%00.evil.test"), status=400, reason="malformed-request"),
    Case("nul-in-host", "sni-nul", "tls", sni=None, hello=b"SNI:" + API.encode() + b"\x00.evil.test", expect="tls-refused", reason="sni-missing",
         note="the hello's server_name does not parse as a host name: no SNI"),
)

# --- IDN homographs, enclosed alphanumerics ------------------------------------------------------
add(
    Case("idn", "cyrillic-a", "plain", absolute(host="\u0430pi.acme-test.dev"), status=400, reason="malformed-request", note="non-ASCII request line"),
    Case("idn", "cyrillic-a-host-header", "tunnel", get("/repos/acme/x", host="\u0430pi.acme-test.dev"), reason="host-header-mismatch"),
    Case("idn", "cyrillic-a-sni", "tls", sni="\u0430pi.acme-test.dev", expect="tls-refused", reason="sni-mismatch"),
    Case("idn", "cyrillic-a-h2-authority", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", "\u0430pi.acme-test.dev"), (":path", "/repos/acme/x")), status=0, reason="malformed-request",
         note="hyper-h2 refuses a non-ASCII :authority (GOAWAY): audited as malformed-request"),
    Case("idn", "enclosed-alnum-host-header", "tunnel", get("/repos/acme/x", host="\u24d0\u24df\u24d8.acme-test.dev"), expect="allow",
         note="UTS-46 maps ⓐⓟⓘ to api: the Host agrees with the judged tunnel host"),
    Case("idn", "enclosed-loopback-host-header", "tunnel", get("/repos/acme/x", host="\u2460\u2461\u2466.\u24ea.\u24ea.\u2460"), reason="host-header-mismatch"),
    Case("idn", "punycode-homograph", "plain", absolute(host="xn--pi-6kc.acme-test.dev"), reason="no-matching-rule"),
    Case("idn", "connect-cyrillic", "connect", connect("\u0430pi.acme-test.dev:443"), status=400, reason="malformed-request"),
    Case("idn", "enclosed-alnum-maps-to-allowed", "plain", absolute(host="\u24d0\u24df\u24d8.acme-test.dev"), status=400, reason="malformed-request"),
    Case("idn", "enclosed-loopback", "plain", absolute(host="\u2460\u2461\u2466.\u24ea.\u24ea.\u2460"), status=400, reason="malformed-request"),
    Case("idn", "enclosed-short-loopback", "connect", connect("\u2460\u2461\u2466.\u2460:443"), status=400, reason="malformed-request"),
    Case("idn", "fullwidth-metadata", "plain", absolute(host="\uff11\uff16\uff19\uff0e\uff12\uff15\uff14\uff0e\uff11\uff16\uff19\uff0e\uff12\uff15\uff14"), status=400, reason="malformed-request"),
    Case("idn", "ideographic-dots-metadata", "plain", absolute(host="169\u3002254\u3002169\u3002254"), status=400, reason="malformed-request"),
    Case("idn", "enclosed-localhost", "plain", absolute(host="\u24db\u24de\u24d2\u24d0\u24db\u24d7\u24de\u24e2\u24e3"), status=400, reason="malformed-request"),
)

# --- bracketed names, zone ids -------------------------------------------------------------------
add(
    Case("bracketed", "connect-bracketed-name", "connect", connect(f"[{API}]:443"), reason="host-bracket"),
    Case("bracketed", "absolute-bracketed-name", "plain", absolute(host=f"[{API}]"), status=400, reason="malformed-request"),
    Case("bracketed", "connect-v6-loopback", "connect", connect("[::1]:443"), reason="ip-literal-refused"),
    Case("bracketed", "connect-unbracketed-v6", "connect", connect("::1:443"), status=400, reason="malformed-request"),
    Case("zone-id", "connect-zone", "connect", connect("[fe80::1%25eth0]:443"), reason="host-zone-id"),
    Case("zone-id", "absolute-zone", "plain", absolute(host="[fe80::1%25lo]"), reason="ip-literal-refused",
         note="in absolute-form mitmproxy has removed the brackets before the hook; the literal is still refused before DNS"),
    Case("zone-id", "answer-with-zone", "plain", absolute(host="zone.acme-test.dev", path="/"), resolve_host="zone.acme-test.dev", resolve=("fe80::1%eth0",), reason="address-invalid"),
)

# --- malformed CONNECT authorities and ports -----------------------------------------------------
add(
    Case("connect-authority", "port-leading-zero", "connect", connect(f"{API}:0443"), reason="port-invalid"),
    Case("connect-authority", "port-65536", "connect", connect(f"{API}:65536"), status=400, reason="malformed-request"),
    Case("connect-authority", "port-zero", "connect", connect(f"{API}:0"), status=400, reason="malformed-request"),
    Case("connect-authority", "port-missing", "connect", connect(API), status=400, reason="malformed-request"),
    Case("connect-authority", "port-empty", "connect", connect(f"{API}:"), status=400, reason="malformed-request"),
    Case("connect-authority", "port-negative", "connect", connect(f"{API}:-443"), status=400, reason="malformed-request"),
    Case("connect-authority", "port-plus", "connect", connect(f"{API}:+443"), status=400, reason="malformed-request"),
    Case("connect-authority", "port-hex", "connect", connect(f"{API}:0x1bb"), status=400, reason="malformed-request"),
    Case("connect-authority", "two-ports", "connect", connect(f"{API}:443:443"), status=400, reason="malformed-request"),
    Case("connect-authority", "userinfo", "connect", connect(f"user:pw@{API}:443"), status=400, reason="malformed-request"),
    Case("connect-authority", "scheme", "connect", connect(f"https://{API}:443"), status=400, reason="malformed-request"),
    Case("connect-authority", "connect-with-body", "connect", req("CONNECT", f"{API}:443", f"{API}:443", ("Content-Length: 5",), b"hello"), reason="body-on-bodyless-method"),
    Case("connect-authority", "connect-chunked", "connect", req("CONNECT", f"{API}:443", f"{API}:443", ("Transfer-Encoding: chunked",), b"5\r\nhello\r\n0\r\n\r\n"), reason="body-on-bodyless-method"),
    Case("connect-authority", "connect-upgrade", "connect", req("CONNECT", f"{API}:443", f"{API}:443", ("Connection: Upgrade", "Upgrade: websocket")), reason="upgrade-denied"),
    Case("connect-authority", "wrong-port-for-rule", "connect", connect(f"{API}:8443"), reason="no-matching-rule"),
    Case("connect-authority", "host-header-disagrees", "connect", connect(f"{API}:443", host_header="other.acme-test.dev:443"), expect="allow-connect",
         note="the CONNECT target decides; the Host of a CONNECT is not used for routing"),
)

# --- every numeric IPv4 spelling of 127.0.0.1 and 169.254.169.254 --------------------------------
NUMERIC = {
    "127.0.0.1": ["127.1", "127.0.1", "2130706433", "0x7f000001", "0x7f.0.0.1", "0x7f.0x0.0x0.0x1", "0177.0.0.1", "0177.0.0.01",
                  "017700000001", "127.000.000.001", "0x7f.1", "0127.0.0.1", "127.0.0.1.", "0x7F.0.0.1", "00000127.0.0.1"],
    "169.254.169.254": ["2852039166", "0xa9fea9fe", "0251.0376.0251.0376", "169.254.43518", "169.16689662", "0xa9.0xfe.0xa9.0xfe",
                        "0xa9.254.0251.254", "0xA9FEA9FE", "025177524776", "169.254.169.254."],
}
for canonical, spellings in NUMERIC.items():
    add(Case("ipv4-numeric", f"absolute-{canonical}", "plain", absolute(host=canonical, path="/"), reason="ip-literal-refused"))
    add(Case("ipv4-numeric", f"connect-{canonical}", "connect", connect(f"{canonical}:443"), reason="ip-literal-refused"))
    for spelling in spellings:
        # A trailing dot after a canonical literal is the literal itself (one trailing dot is dropped).
        expected = "ip-literal-refused" if spelling.rstrip(".") == canonical else "host-noncanonical-ip"
        add(Case("ipv4-numeric", f"absolute-{spelling}", "plain", absolute(host=spelling, path="/"), reason=expected))
    for spelling in spellings[:4]:
        add(Case("ipv4-numeric", f"connect-{spelling}", "connect", connect(f"{spelling}:443"), reason="host-noncanonical-ip"))


# --- IPv6 forms embedding IPv4: as literals (refused before DNS) and as resolver answers ---------
def _v6(prefix: str, v4: str) -> str:
    return str(ipaddress.IPv6Address(int(ipaddress.IPv6Address(prefix)) | int(ipaddress.IPv4Address(v4))))


def _nat64_local(v4: str) -> str:
    """RFC 6052 /48 embedding under 64:ff9b:1::/48: bits 48–63 and 72–87 (bits 64–71 are zero)."""
    n = int(ipaddress.IPv4Address(v4))
    hi, lo = n >> 16, n & 0xFFFF
    base = int(ipaddress.IPv6Address("64:ff9b:1::"))
    return str(ipaddress.IPv6Address(base | (hi << (127 - 63)) | (lo << (127 - 87))))


def _6to4(v4: str) -> str:
    return str(ipaddress.IPv6Address((0x2002 << 112) | (int(ipaddress.IPv4Address(v4)) << 80) | 1))


def _teredo(client_v4: str) -> str:
    # 2001:0:<server 93.184.216.34>:<flags>:<port^ffff>:<client^ffffffff>
    server = int(ipaddress.IPv4Address("93.184.216.34"))
    client = int(ipaddress.IPv4Address(client_v4)) ^ 0xFFFFFFFF
    return str(ipaddress.IPv6Address((0x20010000 << 96) | (server << 64) | (0x8000 << 48) | (0x63BF << 32) | client))


def _isatap(v4: str) -> str:
    return str(ipaddress.IPv6Address((0x2600 << 112) | (0x00005EFE << 32) | int(ipaddress.IPv4Address(v4))))


EMBEDDED = {
    "mapped": lambda v4: "::ffff:" + v4,
    "compatible": lambda v4: _v6("::", v4),
    "nat64-wkp": lambda v4: _v6("64:ff9b::", v4),
    "nat64-local": _nat64_local,
    "6to4": _6to4,
    "teredo": _teredo,
    "isatap": _isatap,
}
for form, make in EMBEDDED.items():
    for v4 in ("127.0.0.1", "169.254.169.254"):
        v6 = make(v4)
        add(Case("ipv6-embedded", f"literal-{form}-{v4}", "connect", connect(f"[{v6}]:443"), reason="ip-literal-refused"))
        host = f"{form}-{v4.replace('.', '-')}.acme-test.dev"
        add(Case("ipv6-embedded", f"answer-{form}-{v4}", "plain", absolute(host=host, path="/"), resolve_host=host, resolve=(v6,), reason="address-not-public"))
add(
    Case("ipv6-embedded", "literal-mapped-hex", "plain", absolute(host="[::ffff:7f00:1]", path="/"), reason="ip-literal-refused"),
    Case("ipv6-embedded", "literal-mapped-zone", "connect", connect("[::ffff:127.0.0.1%25eth0]:443"), reason="host-zone-id"),
)

# --- names resolving to every special-purpose range of the catalog, and mixed answers -------------
SPECIAL = load_catalog("2026.11").special_purpose.ranges
for i, entry in enumerate(SPECIAL):
    net = ipaddress.ip_network(entry.cidr)
    ip = net.network_address + (1 if net.num_addresses > 2 else 0)
    host = f"sp{i}.acme-test.dev"
    add(Case("special-purpose-answer", f"{entry.cidr}", "plain", absolute(host=host, path="/"), resolve_host=host, resolve=(str(ip),), reason="address-not-public",
             note=entry.name))
add(
    Case("mixed-answers", "public-then-private", "plain", absolute(host="mix1.acme-test.dev", path="/"), resolve_host="mix1.acme-test.dev", resolve=("93.184.216.50", "10.1.2.3"), reason="address-not-public"),
    Case("mixed-answers", "private-then-public", "plain", absolute(host="mix2.acme-test.dev", path="/"), resolve_host="mix2.acme-test.dev", resolve=("10.1.2.3", "93.184.216.50"), reason="address-not-public"),
    Case("mixed-answers", "public-then-v6-loopback", "plain", absolute(host="mix3.acme-test.dev", path="/"), resolve_host="mix3.acme-test.dev", resolve=("93.184.216.50", "::1"), reason="address-not-public"),
    Case("mixed-answers", "three-with-metadata-last", "connect", connect("mix4.acme-test.dev:443"), resolve_host="mix4.acme-test.dev", resolve=("93.184.216.50", "93.184.216.51", "169.254.169.254"), reason="address-not-public"),
    Case("mixed-answers", "no-answer", "plain", absolute(host="nxdomain.acme-test.dev", path="/"), reason="resolve-failed"),
    Case("mixed-answers", "empty-answer", "connect", connect("empty.acme-test.dev:443"), resolve_host="empty.acme-test.dev", resolve=(), reason="resolve-failed"),
)

# --- DNS rebinding, self-connection -------------------------------------------------------------
add(
    Case("dns-rebinding", "second-lookup-is-loopback", "rebind", get("/rb", host="rebind.acme-test.dev"), connect="rebind.acme-test.dev:443",
         reason="address-not-public",
         note="first tunnel: one lookup, requests reuse the vetted pin; a new tunnel looks up again and is refused"),
    Case("self-connection", "connect-to-own-port", "plain", absolute(host="self.acme-test.dev", path="/"), reason="self-connection"),
    Case("self-connection", "tunnel-to-own-port", "connect", connect("self.acme-test.dev:443"), reason="self-connection"),
    Case("self-connection", "loopback-literal", "connect", connect("127.0.0.1:8080"), reason="ip-literal-refused"),
)

# --- TLS in the tunnel: SNI mismatch, missing SNI, ECH -------------------------------------------
add(
    Case("sni", "mismatch", "tls", sni="other.acme-test.dev", expect="tls-refused", reason="sni-mismatch"),
    Case("sni", "suffix", "tls", sni=API + ".evil.test", expect="tls-refused", reason="sni-mismatch"),
    Case("sni", "parent", "tls", sni="acme-test.dev", expect="tls-refused", reason="sni-mismatch"),
    Case("sni", "missing", "tls", sni=None, expect="tls-refused", reason="sni-missing"),
    Case("sni", "ech", "tls", hello=b"ECH", expect="tls-refused", reason="ech-refused"),
    Case("sni", "ech-draft", "tls", hello=b"ECH-DRAFT", expect="tls-refused", reason="ech-refused"),
    Case("sni", "direct-tls-no-connect", "direct-tls", get("/repos/acme/x"), sni=API, expect="tls-refused", reason="sni-mismatch",
         note="TLS straight to the proxy (no CONNECT) is not a transport: the handshake is refused"),
    Case("sni", "sni-case-and-dot", "tunnel", get("/repos/acme/x"), sni="API.acme-test.dev", expect="allow"),
)

# --- non-TLS bytes in a tunnel -------------------------------------------------------------------
add(
    Case("non-tls-in-tunnel", "ssh-banner", "raw", b"SSH-2.0-OpenSSH_9.6\r\n\r\n\x00\x01binary", client_auth=False, status=400, reason="malformed-request"),
    Case("non-tls-in-tunnel", "plain-http", "raw", get("/repos/acme/x"), reason="scheme-not-allowed"),
    Case("non-tls-in-tunnel", "garbage", "raw", b"\x00\xff\x00\xff" * 8 + b"\r\n\r\n", client_auth=False, status=400, reason="malformed-request"),
)

# --- Host header spoofing, absolute-form inside a tunnel, HTTP/2 :authority ----------------------
add(
    Case("host-spoofing", "tunnel-other-host", "tunnel", get("/repos/acme/x", host="other.acme-test.dev"), reason="host-header-mismatch"),
    Case("host-spoofing", "tunnel-other-port", "tunnel", get("/repos/acme/x", host=API + ":8443"), reason="host-header-mismatch"),
    Case("host-spoofing", "tunnel-loopback", "tunnel", get("/repos/acme/x", host="127.0.0.1"), reason="host-header-mismatch"),
    Case("host-spoofing", "tunnel-metadata", "tunnel", get("/repos/acme/x", host="169.254.169.254"), reason="host-header-mismatch"),
    Case("host-spoofing", "tunnel-userinfo", "tunnel", get("/repos/acme/x", host="x@" + API), reason="host-header-mismatch"),
    Case("host-spoofing", "tunnel-two-hosts", "tunnel", req("GET", "/repos/acme/x", API, ("Host: other.acme-test.dev",)), reason="smuggling"),
    Case("host-spoofing", "tunnel-no-host", "tunnel", req("GET", "/repos/acme/x", None), expect="allow", note="an absent Host is written from the judged name"),
    Case("host-spoofing", "absolute-other-host", "plain", absolute(host_header="other.acme-test.dev"), reason="host-header-mismatch"),
    Case("host-spoofing", "absolute-metadata-host", "plain", absolute(host_header="169.254.169.254"), reason="host-header-mismatch"),
    Case("host-spoofing", "absolute-two-hosts", "plain", req("GET", f"https://{API}/repos/acme/x", API, ("Host: other.acme-test.dev",)), reason="smuggling"),
    Case("host-spoofing", "origin-form-to-proxy", "plain", get("/repos/acme/x"), reason="scheme-not-allowed", note="origin-form outside a tunnel is plain http"),
    Case("absolute-in-tunnel", "other-host", "tunnel", get("https://other.acme-test.dev/", host="other.acme-test.dev"), reason="host-header-mismatch"),
    Case("absolute-in-tunnel", "other-host-api-host-header", "tunnel", get("https://other.acme-test.dev/repos/acme/x"), reason="host-header-mismatch"),
    Case("absolute-in-tunnel", "metadata", "tunnel", get("http://169.254.169.254/latest/meta-data/"), reason="host-header-mismatch"),
    Case("absolute-in-tunnel", "same-host", "tunnel", get(f"https://{API}/repos/acme/x"), expect="allow"),
    Case("h2-authority", "mismatch", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", "other.acme-test.dev"), (":path", "/repos/acme/x")), reason="host-header-mismatch"),
    Case("h2-authority", "metadata", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", "169.254.169.254"), (":path", "/repos/acme/x")), reason="host-header-mismatch"),
    Case("h2-authority", "port", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API + ":8443"), (":path", "/repos/acme/x")), reason="host-header-mismatch"),
    Case("h2-authority", "host-disagrees", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/x"), ("host", "other.acme-test.dev")), status=0, reason="malformed-request",
         note="hyper-h2 refuses a host that disagrees with :authority (GOAWAY): no flow, audited as malformed-request"),
    Case("h2-authority", "match", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/x"), ("authorization", "Bearer client-supplied-h2")), expect="allow"),
    Case("h2-authority", "path-traversal", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/../admin")), reason="path-dot-segment"),
    Case("h2-authority", "absolute-path", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "https://other.acme-test.dev/repos/acme/x")), reason="path-not-absolute"),
    Case("h2-authority", "scheme-http", "h2", h2_headers=((":method", "GET"), (":scheme", "http"), (":authority", API), (":path", "/repos/acme/x")), expect="allow",
         note="inside a TLS tunnel mitmproxy takes the scheme from the connection (https): the request goes upstream over verified TLS"),
    Case("h2-authority", "lowercase-method", "h2", h2_headers=((":method", "get"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/x")), reason="method-not-allowed"),
    Case("h2-authority", "extended-connect", "h2", h2_headers=((":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/x")), status=0, reason="malformed-request"),
    Case("h2-authority", "plain-connect", "h2", h2_headers=((":method", "CONNECT"), (":authority", "other.acme-test.dev:443")), status=0, reason="malformed-request"),
    Case("h2-authority", "no-authority", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":path", "/repos/acme/x")), status=0, reason="malformed-request"),
    Case("h2-authority", "te-trailers-and-cookie", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/x"), ("te", "trailers"), ("cookie", "a=b"), ("x-forwarded-for", "127.0.0.1")),
         expect="allow", check=("no-header:te", "no-header:cookie", "no-header:x-forwarded-for")),
    Case("h2-authority", "trailers", "h2", h2_headers=((":method", "POST"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/app/issues"), ("content-type", "application/json")),
         h2_body=b"{}", h2_trailers=(("authorization", "Bearer client-trailer"),), reason="trailers-denied"),
)

# --- userinfo and fragment parser differentials --------------------------------------------------
add(
    Case("userinfo-fragment", "userinfo-allowed-host", "plain", req("GET", f"https://user:pw@{API}/repos/acme/x", API), status=400, reason="malformed-request"),
    Case("userinfo-fragment", "allowed-as-userinfo", "plain", req("GET", f"https://{API}@other.acme-test.dev/repos/acme/x", "other.acme-test.dev"), status=400, reason="malformed-request"),
    Case("userinfo-fragment", "fragment-at", "plain", req("GET", f"https://other.acme-test.dev#@{API}/repos/acme/x", API), status=400, reason="malformed-request"),
    Case("userinfo-fragment", "backslash-at", "plain", req("GET", f"https://{API}\\@other.acme-test.dev/repos/acme/x", API), status=400, reason="malformed-request"),
    Case("userinfo-fragment", "host-header-userinfo", "tunnel", get("/repos/acme/x", host=f"{API}@other.acme-test.dev"), reason="host-header-mismatch"),
    Case("userinfo-fragment", "host-header-fragment-at", "tunnel", get("/repos/acme/x", host=f"other.acme-test.dev#@{API}"), reason="host-header-mismatch"),
    Case("userinfo-fragment", "host-header-question-at", "tunnel", get("/repos/acme/x", host=f"other.acme-test.dev?@{API}"), reason="host-header-mismatch"),
    Case("userinfo-fragment", "fragment-in-path", "plain", absolute(path="/repos/acme/x#frag"), reason="path-fragment"),
    Case("userinfo-fragment", "fragment-in-tunnel", "tunnel", get("/repos/acme/x#../../admin"), reason="path-fragment"),
    Case("userinfo-fragment", "question-at", "plain", req("GET", f"https://other.acme-test.dev?@{API}/repos/acme/x", API), status=400, reason="malformed-request"),
)

# --- non-HTTP schemes, plaintext to an HTTPS rule ------------------------------------------------
add(
    Case("scheme", "ftp", "plain", absolute(scheme="ftp"), status=400, reason="malformed-request"),
    Case("scheme", "gopher", "plain", absolute(scheme="gopher"), status=400, reason="malformed-request"),
    Case("scheme", "file", "plain", req("GET", "file:///etc/passwd", API), status=400, reason="malformed-request"),
    Case("scheme", "ws", "plain", absolute(scheme="ws"), status=400, reason="malformed-request"),
    Case("scheme", "profile-ftp", "plain", absolute(scheme="ftp", host="pkgs.acme-test.dev"), lease="CI", status=400, reason="malformed-request"),
    Case("plaintext-to-https", "http-scheme", "plain", absolute(scheme="http"), reason="scheme-not-allowed"),
    Case("plaintext-to-https", "http-scheme-port-443", "plain", absolute(scheme="http", host=API + ":443", host_header=API + ":443"), reason="scheme-not-allowed"),
    Case("plaintext-to-https", "profile-wrong-port", "plain", absolute(scheme="http", host="api.acme-test.dev"), lease="CI", reason="profile-host-not-allowed"),
)

# --- paths: every traversal and encoding form, segment boundary -----------------------------------
PATHS = [
    ("dot-dot", "/repos/acme/../admin", "path-dot-segment"),
    ("dot", "/repos/acme/./x", "path-dot-segment"),
    ("leading-dot", "/./repos/acme/x", "path-dot-segment"),
    ("trailing-dot-dot", "/repos/acme/x/..", "path-dot-segment"),
    ("encoded-dot-dot", "/repos/acme/%2e%2e/admin", "path-encoded-dot"),
    ("encoded-dot-dot-upper", "/repos/acme/%2E%2E/admin", "path-encoded-dot"),
    ("half-encoded", "/repos/acme/.%2e/admin", "path-encoded-dot"),
    ("encoded-dot", "/repos/acme/%2e/x", "path-encoded-dot"),
    ("encoded-slash", "/repos/acme%2f..%2fadmin", "path-encoded-slash"),
    ("encoded-slash-upper", "/repos/acme/x%2F..%2Fadmin", "path-encoded-slash"),
    ("encoded-backslash", "/repos/acme/..%5cadmin", "path-encoded-slash"),
    ("backslash", "/repos/acme/..\\admin", "path-invalid-character"),
    ("dot-dot-semicolon", "/repos/acme/..;/admin", "path-parameter"),
    ("parameter", "/repos/acme/x;jsessionid=1", "path-parameter"),
    ("encoded-semicolon", "/repos/acme/x%3bx", "path-parameter"),
    ("encoded-nul", "/repos/acme/x%00.json", "path-nul"),
    ("double-slash", "/repos//acme/x", "path-empty-segment"),
    ("leading-double-slash", "//repos/acme/x", "path-empty-segment"),
    ("unicode-escape", "/repos/acme/%u002e%u002e/admin", "path-bad-escape"),
    ("truncated-escape", "/repos/acme/x%2", "path-bad-escape"),
    ("noncanonical-escape", "/repos/%61cme/x", "path-noncanonical-escape"),
    ("non-ascii", "/repos/acme/\u00e9", "path-invalid-character"),
    ("asterisk", "*", "path-not-absolute"),
    ("prefix-not-bounded", "/repos/acmex/app", "path-not-allowed"),
    ("prefix-shorter", "/repos/acm", "path-not-allowed"),
    ("prefix-dash", "/repos/acme-evil/x", "path-not-allowed"),
    ("prefix-case", "/repos/ACME/x", "path-not-allowed"),
    ("outside", "/admin", "path-not-allowed"),
]
for name, path, reason in PATHS:
    family = "segment-boundary" if reason == "path-not-allowed" else "path"
    add(Case(family, f"tunnel-{name}", "tunnel", get(path), reason=reason))
for name, path, reason in PATHS[:12]:
    add(Case("path", f"absolute-{name}", "plain", absolute(path=path), reason=reason))
add(
    Case("path", "double-encoded-stays-inside", "tunnel", get("/repos/acme/%252e%252e/admin"), expect="allow",
         note="%25 is a literal %: the segment `%252e%252e` is not a dot segment, and it is inside the prefix"),
    Case("path", "query-is-not-path", "tunnel", get("/repos/acme/x?next=../../admin"), expect="allow"),
    Case("path", "raw-nul", "tunnel", get("/repos/acme/x\x00/../admin"), reason="path-nul"),
    Case("path", "raw-space", "tunnel", b"GET /repos/acme/x /../admin HTTP/1.1\r\nHost: api.acme-test.dev\r\n\r\n", status=400, reason="malformed-request"),
    Case("segment-boundary", "exact-prefix", "tunnel", get("/repos/acme"), expect="allow"),
    Case("segment-boundary", "prefix-slash", "tunnel", get("/repos/acme/"), expect="allow"),
)

# --- methods, method override and rewrite headers ------------------------------------------------
add(
    Case("method", "delete", "tunnel", req("DELETE", "/repos/acme/x"), reason="method-not-allowed"),
    Case("method", "trace", "tunnel", req("TRACE", "/repos/acme/x"), reason="method-not-allowed"),
    Case("method", "lowercase-get", "tunnel", req("get", "/repos/acme/x"), reason="method-not-allowed"),
    Case("method", "propfind", "tunnel", req("PROPFIND", "/repos/acme/x"), reason="method-not-allowed"),
    Case("method", "post-on-read-rule", "tunnel", req("POST", "/repos/acme/x", headers=("Content-Length: 0",)), reason="method-not-allowed"),
    Case("method", "connect-in-tunnel", "tunnel", connect("other.acme-test.dev:443"), status=400, reason="connect-in-tunnel"),
    Case("method", "absolute-trace", "plain", absolute(method="TRACE"), reason="method-not-allowed"),
    Case("method", "profile-trace", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", method="TRACE"), lease="CI", reason="method-not-allowed"),
)
OVERRIDES = ["X-HTTP-Method-Override: DELETE", "X-HTTP-Method: DELETE", "X-Method-Override: DELETE", "X-Original-URL: /admin",
             "X-Rewrite-URL: /admin", "X-Original-Method: DELETE", "_method: DELETE"]
for line in OVERRIDES:
    name = line.split(":")[0].lower()
    add(Case("method-override", f"tunnel-{name}", "tunnel", get("/repos/acme/x", line), expect="allow", check=(f"no-header:{name}",)))
add(Case("method-override", "profile-x-http-method-override", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", path="/simple/", headers=("X-HTTP-Method-Override: DELETE",)),
         lease="CI", expect="allow", check=("no-header:x-http-method-override",)))

# --- forwarding and routing headers (stripped on allowed requests) -------------------------------
FORWARDING = ["X-Forwarded-For: 127.0.0.1", "X-Forwarded-Host: 169.254.169.254", "X-Forwarded-Proto: http", "Forwarded: for=127.0.0.1;host=internal",
              "X-Real-IP: 10.0.0.1", "Via: 1.1 internal", "X-Forwarded-Port: 22", "Cookie: session=stolen", "Proxy-Connection: keep-alive",
              "Connection: close, X-Secret-Hop", "X-Egresslaw-Rule: admin", "Proxy-Authorization-Extra: x"]
for line in FORWARDING:
    name = line.split(":")[0].lower()
    add(Case("forwarding-headers", f"tunnel-{name}", "tunnel", get("/repos/acme/x", line, "X-Secret-Hop: 1"), expect="allow", check=(f"no-header:{name}", "no-header:x-secret-hop")))
for line in FORWARDING[:6]:
    name = line.split(":")[0].lower()
    add(Case("forwarding-headers", f"profile-{name}", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", path="/simple/", headers=(line,)), lease="CI", expect="allow", check=(f"no-header:{name}",)))

add(
    Case("forwarding-headers", "connection-names-authorization", "tunnel", get("/repos/acme/x", "Connection: Authorization, close"), expect="allow",
         note="a caller cannot make the injected credential hop-by-hop: exactly one Authorization arrives"),
    Case("forwarding-headers", "bare-cr-in-allowlisted-value", "tunnel", get("/repos/acme/x", "Accept: a\rAuthorization: Bearer client-trailer"), reason="smuggling",
         note="mitmproxy keeps the bare CR in the value; a lenient upstream would read a second Authorization line"),
    Case("forwarding-headers", "bare-cr-absolute", "plain", absolute(headers=("User-Agent: a\rHost: 169.254.169.254",)), reason="smuggling"),
    Case("forwarding-headers", "bare-cr-profile", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", path="/simple/", headers=("X-A: a\rAuthorization: Bearer client-trailer",)), lease="CI", reason="smuggling"),
    Case("forwarding-headers", "h2-cr-in-value", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/repos/acme/x"), ("accept", "a\r\nauthorization: Bearer client-trailer")), status=0, reason="malformed-request"),
    Case("forwarding-headers", "huge-header", "tunnel", get("/repos/acme/x", "X-Big: " + "a" * 300_000), status=431, reason="head-too-large",
         note="a head over --max-head-bytes (64 KiB) is refused as it arrives, before mitmproxy parses or buffers it"),
    Case("forwarding-headers", "many-headers", "plain", absolute(headers=tuple(f"X-H{i}: {i}" for i in range(2000))), status=431, reason="too-many-headers"),
    Case("forwarding-headers", "big-unlisted-header", "tunnel", get("/repos/acme/x", "X-Big: " + "a" * 30_000), expect="allow", check=("no-header:x-big",),
         note="a 30 kB header that is not allowlisted is dropped"),
)

# --- request smuggling ---------------------------------------------------------------------------
ISSUES = "/repos/acme/app/issues"
add(
    Case("smuggling", "cl-te", "tunnel", req("POST", ISSUES, headers=("Content-Length: 4", "Transfer-Encoding: chunked"), body=b"0\r\n\r\n"), status=400, reason="smuggling"),
    Case("smuggling", "te-cl", "plain", req("POST", f"https://{API}{ISSUES}", API, ("Transfer-Encoding: chunked", "Content-Length: 4"), b"0\r\n\r\n"), status=400, reason="smuggling"),
    Case("smuggling", "duplicate-cl-different", "tunnel", req("POST", ISSUES, headers=("Content-Length: 2", "Content-Length: 4"), body=b"{}{}"), status=400, reason="smuggling"),
    Case("smuggling", "duplicate-cl-same", "tunnel", req("POST", ISSUES, headers=("Content-Length: 2", "Content-Length: 2"), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "cl-list", "tunnel", req("POST", ISSUES, headers=("Content-Length: 2, 2",), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "cl-plus", "tunnel", req("POST", ISSUES, headers=("Content-Length: +2",), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "bad-te", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding: xchunked",), body=b"2\r\n{}\r\n0\r\n\r\n"), status=400, reason="smuggling"),
    Case("smuggling", "te-identity", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding: identity",), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "te-chunked-identity", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding: chunked, identity",), body=b"2\r\n{}\r\n0\r\n\r\n"), status=400, reason="smuggling"),
    Case("smuggling", "te-space-before-colon", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding : chunked", "Content-Length: 2"), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "cl-space-before-colon", "tunnel", req("POST", ISSUES, headers=("Content-Length : 2",), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "obs-fold", "tunnel", req("POST", ISSUES, headers=("Content-Length: 2", "X-Fold: a", " Transfer-Encoding: chunked"), body=b"{}"), reason="smuggling",
         note="mitmproxy unfolds the line into the X-Fold value (with its CRLF): refused like any line break in a value"),
    Case("smuggling", "obs-fold-allowlisted", "tunnel", get("/repos/acme/x", "Accept: a", " Authorization: Bearer client-trailer"), reason="smuggling"),
    Case("smuggling", "te-tab", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding:\tchunked", "Content-Length: 2"), body=b"{}"), status=400, reason="smuggling"),
    Case("smuggling", "bare-lf", "tunnel", b"GET /repos/acme/x HTTP/1.1\nHost: api.acme-test.dev\nX-A: 1\n\n", client_auth=False, expect="allow",
         note="bare LF line endings are parsed the same way by mitmproxy and re-framed upstream with CRLF"),
)

# --- HTTP versions --------------------------------------------------------------------------------
add(
    Case("http-version", "http-1.0-absolute", "plain", req("GET", f"https://{API}/repos/acme/x", API, version="HTTP/1.0"), expect="allow"),
    Case("http-version", "http-1.0-tunnel", "tunnel", req("GET", "/repos/acme/x", API, version="HTTP/1.0"), expect="allow"),
    Case("http-version", "http-0.9", "plain", b"GET https://api.acme-test.dev/repos/acme/x\r\n\r\n", client_auth=False, status=400, reason="malformed-request"),
    Case("http-version", "http-2.0-on-http1", "tunnel", req("GET", "/repos/acme/x", API, version="HTTP/2.0"), expect="allow",
         note="an HTTP/1 message labelled HTTP/2.0 is parsed and judged as HTTP/1 (same decision)"),
    Case("http-version", "http-1.2", "tunnel", req("GET", "/repos/acme/x", API, version="HTTP/1.2"), expect="allow"),
    Case("http-version", "lowercase-version", "plain", req("GET", f"https://{API}/repos/acme/x", API, version="http/1.1"), status=400, reason="malformed-request"),
)

# --- bodies on bodyless methods, upgrades, trailers ----------------------------------------------
add(
    Case("bodyless-body", "get-cl", "tunnel", req("GET", "/repos/acme/x", headers=("Content-Length: 5",), body=b"hello"), reason="body-on-bodyless-method"),
    Case("bodyless-body", "get-chunked", "tunnel", req("GET", "/repos/acme/x", headers=("Transfer-Encoding: chunked",), body=b"5\r\nhello\r\n0\r\n\r\n"), reason="body-on-bodyless-method"),
    Case("bodyless-body", "head-cl", "tunnel", req("HEAD", "/repos/acme/x", headers=("Content-Length: 5",), body=b"hello"), reason="body-on-bodyless-method"),
    Case("bodyless-body", "absolute-get", "plain", req("GET", f"https://{API}/repos/acme/x", API, ("Content-Length: 5",), b"hello"), reason="body-on-bodyless-method"),
    Case("bodyless-body", "get-cl-zero", "tunnel", req("GET", "/repos/acme/x", headers=("Content-Length: 0",)), expect="allow"),
    Case("upgrade", "websocket", "tunnel", get("/repos/acme/x", "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"), reason="upgrade-denied"),
    Case("upgrade", "h2c", "tunnel", get("/repos/acme/x", "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"), reason="upgrade-denied"),
    Case("upgrade", "upgrade-only", "tunnel", get("/repos/acme/x", "Upgrade: websocket"), reason="upgrade-denied"),
    Case("upgrade", "connection-upgrade-only", "tunnel", get("/repos/acme/x", "Connection: keep-alive, Upgrade"), reason="upgrade-denied"),
    Case("upgrade", "http2-settings-only", "tunnel", get("/repos/acme/x", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"), reason="upgrade-denied"),
    Case("upgrade", "tls-upgrade", "plain", absolute(scheme="http", headers=("Connection: Upgrade", "Upgrade: TLS/1.2")), reason="scheme-not-allowed"),
    Case("upgrade", "profile-websocket", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", headers=("Connection: Upgrade", "Upgrade: websocket")), lease="CI", reason="upgrade-denied"),
    Case("trailers", "declared-auth-trailer", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding: chunked", "Trailer: Authorization"), body=b"2\r\n{}\r\n0\r\nAuthorization: Bearer client-trailer\r\n\r\n"), status=0, timeout=2, reason="trailers-denied",
         note="denied and audited at the headers; the client gets no answer (the connection is held, then dropped)"),
    Case("trailers", "absolute-declared", "plain", req("POST", f"https://{API}{ISSUES}", API, ("Transfer-Encoding: chunked", "Trailer: X-Sneak"), b"2\r\n{}\r\n0\r\nX-Sneak: 1\r\n\r\n"), status=0, timeout=2, reason="trailers-denied"),
    Case("trailers", "undeclared-auth-trailer", "tunnel", req("POST", ISSUES, headers=("Transfer-Encoding: chunked",), body=b"2\r\n{}\r\n0\r\nAuthorization: Bearer client-trailer\r\n\r\n"), status=0, timeout=2, reason="client-disconnected",
         note="undeclared trailers pass the header stage (the allow is written ahead); mitmproxy's HTTP/1 reader then drops "
              "the connection before anything goes upstream, and the outcome records client-disconnected"),
)

# --- responses: redirects, forged headers, credential echo ---------------------------------------
for code in (301, 302, 303, 307, 308):
    for target in ("http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:8080/", "https://10.0.0.1/"):
        add(Case("redirect", f"{code}-{target.split('/')[2]}", "tunnel", get(f"/status/{code}?to={target}"), expect="allow", status=code, check=("redirect-not-followed", f"location:{target}")))
add(
    Case("redirect", "profile-302", "tunnel", get("/status/302"), lease="CI", expect="allow", status=302, check=("redirect-not-followed",)),
    Case("redirect", "follow-up-connection", "plain", absolute(scheme="http", host="169.254.169.254", path="/latest/meta-data/"), reason="scheme-not-allowed"),
    Case("redirect", "follow-up-profile", "plain", absolute(scheme="http", host="169.254.169.254", path="/latest/meta-data/"), lease="CI", reason="ip-literal-refused"),
    Case("forged-response-headers", "connection", "tunnel", get("/forge"), expect="allow", check=("forged-stripped",)),
    Case("forged-response-headers", "profile", "tunnel", get("/forge"), lease="CI", expect="allow", check=("forged-stripped",)),
    Case("forged-response-headers", "absolute", "plain", absolute(path="/forge"), expect="allow", check=("forged-stripped",)),
)
for enc in ("plain", "b64", "b64url", "url", "hex", "HEX", "basic"):
    for where in ("header", "body"):
        add(Case("credential-echo", f"{enc}-{where}", "tunnel", get(f"/leak/{enc}/{where}"), expect="allow", check=("redacted",)))
add(
    Case("credential-echo", "plain-header-name", "tunnel", get("/leak/plain/header-name"), expect="allow", check=("redacted",)),
    Case("credential-echo", "plain-status-reason", "tunnel", get("/leak/plain/reason"), expect="allow", check=("redacted",)),
    Case("credential-echo", "gzip-body", "tunnel", get("/leak/b64/gzip", "Accept-Encoding: gzip"), expect="allow", check=("redacted",)),
    Case("credential-echo", "echo-all", "plain", absolute(path="/echo"), expect="allow", check=("redacted",)),
    Case("credential-echo", "gzip-twice", "tunnel", get("/leak/plain/gzip-twice", "Accept-Encoding: gzip"), expect="allow", check=("redacted",),
         note="`Content-Encoding: gzip, gzip` is decoded twice, then scanned"),
    Case("credential-echo", "unknown-encoding", "tunnel", get("/leak/plain/unknown-encoding"), status=502, reason="response-coding-unsupported",
         note="a body the proxy cannot decode cannot be scanned: our 502 instead (the upstream did receive the request)", check=("upstream-reached",)),
    Case("credential-echo", "location-header", "tunnel", get("/leak/url/location"), expect="allow", status=302, check=("redacted", "redirect-not-followed")),
    Case("credential-echo", "early-hints-103", "tunnel", get("/leak/plain/early-hints"), expect="allow", status=200, check=("no-canary",),
         note="the 103 (carrying the credential) is dropped; the final 200 after it is the answer"),
    Case("credential-echo", "response-trailer", "tunnel", get("/leak/plain/trailer"), expect="allow", check=("no-canary",),
         note="response trailers (the credential in one) are dropped; the body is passed on"),
    Case("credential-echo", "h2-echo", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/echo")), expect="allow", check=("redacted",)),
    Case("credential-echo", "h2-trailer", "h2", h2_headers=((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/leak/plain/trailer")), expect="allow", check=("no-canary",)),
)

# --- leases --------------------------------------------------------------------------------------
add(
    Case("lease", "missing", "plain", absolute(), lease=None, reason="lease-missing"),
    Case("lease", "missing-connect", "connect", connect(f"{API}:443"), lease=None, reason="lease-missing"),
    Case("lease", "forged", "plain", absolute(), lease="FORGED", reason="lease-invalid"),
    Case("lease", "forged-connect", "connect", connect(f"{API}:443"), lease="FORGED", reason="lease-invalid"),
    Case("lease", "expired", "plain", absolute(), lease="EXPIRED", reason="lease-expired"),
    Case("lease", "expired-connect", "connect", connect(f"{API}:443"), lease="EXPIRED", reason="lease-expired"),
    Case("lease", "unknown-subject", "plain", absolute(), lease="UNKNOWN", reason="lease-unknown-subject"),
    Case("lease", "garbage-token", "plain", absolute(headers=("Proxy-Authorization: Bearer not-a-lease",)), lease="RAW", reason="lease-malformed"),
    Case("lease", "basic-not-a-lease", "plain", absolute(headers=("Proxy-Authorization: Basic Z2g6e0dIfQ==",)), lease="RAW", reason="lease-malformed",
         note="base64 of `gh:{GH}`: the braces are literal, so the password is not a lease"),
    Case("lease", "basic-not-base64", "plain", absolute(headers=("Proxy-Authorization: Basic !!!",)), lease="RAW", reason="lease-malformed"),
    Case("lease", "other-scheme", "plain", absolute(headers=("Proxy-Authorization: Digest username=\"x\"",)), lease="RAW", reason="lease-malformed"),
    Case("lease", "empty-bearer", "plain", absolute(headers=("Proxy-Authorization: Bearer ",)), lease="RAW", reason="lease-missing"),
    Case("lease", "empty-basic", "plain", absolute(headers=("Proxy-Authorization: Basic Og==",)), lease="RAW", reason="lease-missing", note="base64 of `:`"),
    Case("lease", "two-leases", "plain", absolute(headers=("Proxy-Authorization: Bearer {GH}", "Proxy-Authorization: Bearer {CI}")), lease="RAW", reason="lease-malformed"),
    Case("lease", "lease-in-authorization", "plain", absolute(headers=("Authorization: Bearer {GH}",)), lease=None, reason="lease-missing"),
    Case("lease", "lease-inside-tunnel-only", "tunnel", get("/repos/acme/x", "Proxy-Authorization: Bearer {GH}"), lease=None, reason="lease-missing",
         note="the CONNECT carries no lease: refused at CONNECT; the inner lease is never looked at"),
    Case("lease", "profile-on-connection-host", "plain", absolute(host="other.acme-test.dev", path="/"), lease="CI", reason="profile-host-not-allowed"),
    Case("lease", "profile-connect-connection-host", "connect", connect("other.acme-test.dev:443"), lease="CI", reason="profile-host-not-allowed"),
    Case("lease", "profile-allowed-no-credential", "tunnel", get("/repos/acme/x"), lease="CI", expect="allow"),
    Case("lease", "profile-http-allowed", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", path="/simple/pip/"), lease="CI", expect="allow"),
)

# --- pipelining: a second request on a connection whose first was allowed is judged on its own ----
add(
    Case("pipelining", "tunnel-second-path", "pipeline", get("/repos/acme/first") + get("/admin"), reason="path-not-allowed"),
    Case("pipelining", "tunnel-second-host", "pipeline", get("/repos/acme/first") + get("/repos/acme/x", host="other.acme-test.dev"), reason="host-header-mismatch"),
    Case("pipelining", "tunnel-second-absolute", "pipeline", get("/repos/acme/first") + get("https://other.acme-test.dev/repos/acme/x"), reason="host-header-mismatch"),
    Case("pipelining", "tunnel-second-connect", "pipeline", get("/repos/acme/first") + connect("other.acme-test.dev:443"), status=400, reason="connect-in-tunnel"),
    Case("pipelining", "absolute-second-without-lease", "pipeline-plain", absolute(path="/repos/acme/first") + absolute(), status=0, reason="lease-missing",
         note="the 407 closes the connection; when the client's pipelined bytes race the close, it may see the close first"),
    Case("pipelining", "absolute-second-other-host", "pipeline-plain", absolute(path="/repos/acme/first") + absolute(host="private.acme-test.dev", path="/"), status=0, reason="lease-missing"),
    Case("lease", "expires-inside-tunnel", "tunnel", get("/repos/acme/x"), lease="SHORT", reason="lease-expired",
         note="the CONNECT's lease is checked again for expiry on every request in the tunnel"),
)

FAMILIES = sorted({c.family for c in CASES})


def by_id() -> dict[str, Case]:
    out: dict[str, Case] = {}
    for c in CASES:
        key = f"{c.family}/{c.id}"
        assert key not in out, f"duplicate case {key}"
        out[key] = c
    return out
