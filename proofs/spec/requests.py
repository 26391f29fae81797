"""credential-scope and header-safety, stated from the artifact as declared and from SPEC section 2.1.

credential-scope: whenever the credential of a connection is attached, the request is `https`,
names exactly the host and port of one of the connection's rules *as declared in the artifact*,
uses one of that rule's methods, and its path has a normalized form that equals the rule's prefix
`p` (declared, without a trailing `/`) or starts with `p/` (any path when `p` is `/`) — and that
rule is the one the decision names. A sandbox profile's request carries a credential only of a
connection the profile lists in `brokers` (as declared), under such a rule of that connection.

profile-scope: sandbox traffic is `http` or `https` to exactly one `host:port` of the profile's
allowlist as declared (nothing when its network is `none`).

header-safety: no caller header whose (lowercased) name is on the denylist below, or is the
credential header of the connection whose credential the request carries, or a header that connection's
credential kind writes at the edge (SigV4's signing headers), is ever forwarded — for
any header name at all, not only names the artifact mentions; on connection and brokered traffic
only names on the declared allowlist of the rule the decision names are; and the credential rides
in exactly that connection's declared header (a profile that brokers nothing never carries one).
"""

from __future__ import annotations

import z3

from compiler.artifact import Connection, Rule, SandboxProfile

# SPEC section 2.1 ("may never contain a routing- or authorization-bearing header") and section 6
# ("every client-supplied Authorization/Proxy-* is removed"), transcribed here on purpose rather
# than imported from compiler.constants: that list is data the compiler and the proxy both use,
# so a change there would move this statement with it. The implementation denies exactly these
# (tests/proofs/test_spec.py holds the two in step both ways, so dropping a name from the code is
# refuted): `http2-settings` asks for another protocol on the connection, as `upgrade` does, and
# `x-egresslaw-*` are the proxy's own answer headers, which a caller may not forge upstream.
DENYLIST = frozenset({
    "host", "authorization", "proxy-authorization", "proxy-connection", "cookie", "forwarded", "x-real-ip", "via",
    "x-original-url", "x-rewrite-url", "x-http-method-override", "x-http-method", "x-method-override", "connection",
    "upgrade", "http2-settings", "te", "transfer-encoding", "content-length", "keep-alive", "trailer",
})
DENYLIST_PREFIXES = ("x-forwarded-", "proxy-", "x-egresslaw-")


# What a credential kind's edge writes itself besides the credential header (AWS SigV4: the signed date, the session
# token, the payload hash), so a caller's copy would be signed as if the edge had written it. Transcribed from the
# SigV4 documentation, not imported (tests/proofs/test_spec.py holds it in step with compiler.constants.EDGE_HEADERS).
EDGE_WRITTEN = {"aws_sigv4": ("x-amz-date", "x-amz-security-token", "x-amz-content-sha256")}


def denied_name(name: z3.SeqRef, inject_header: str | None, kind: str = "static") -> z3.BoolRef:
    """The lowercased header `name` is on the denylist, is the credential header, or one the credential kind writes."""
    ctx = name.ctx
    names = set(DENYLIST) | ({inject_header.lower()} if inject_header else set()) | set(EDGE_WRITTEN.get(kind, ()))
    terms = [name == z3.StringVal(n, ctx) for n in sorted(names)]
    terms += [z3.PrefixOf(z3.StringVal(p, ctx), name) for p in DENYLIST_PREFIXES]
    return z3.Or(*terms)


def denied_text(name: str, inject_header: str | None, kind: str = "static") -> bool:
    """`denied_name` on a concrete name (for declared allowlists)."""
    lowered = name.lower()
    return (lowered in DENYLIST or lowered.startswith(DENYLIST_PREFIXES) or lowered in EDGE_WRITTEN.get(kind, ())
            or (inject_header is not None and lowered == inject_header.lower()))


def canonical_prefix(rule: Rule) -> str:
    """The declared prefix without its trailing `/` (`/` itself stays)."""
    return rule.path_prefix.rstrip("/") or "/"


def allowlisted(name: z3.SeqRef, rule: Rule) -> z3.BoolRef:
    """The lowercased header `name` is on the declared allowlist of `rule` (names compare case-insensitively)."""
    ctx = name.ctx
    return z3.Or([name == z3.StringVal(h.lower(), ctx) for h in sorted(set(rule.headers))] + [z3.BoolVal(False, ctx)])


def path_constants(conn: Connection) -> list[str]:
    """The constants the statement compares paths with (the path partition must contain them)."""
    return [canonical_prefix(r) for r in conn.rules]


def rule_admits(ev, rule: Rule, obs) -> z3.BoolRef | bool:
    """The declared `rule` admits the symbolic request `obs` (an `egress_proxy.decision.core.Observation` of terms).

    `ev` is the prover's evaluator, used only for its comparisons of symbolic values.
    """
    p = canonical_prefix(rule)
    path_ok = True if p == "/" else ev.or_(ev.eq(obs.path, p), ev.path_startswith(obs.path, p + "/"))
    return ev.and_(
        ev.eq(obs.scheme, "https"),
        ev.not_(obs.host_error),
        ev.eq(obs.host, rule.host),
        ev.eq(obs.port, rule.port),
        ev.contains(obs.method, frozenset(rule.methods)),
        ev.not_(obs.path_error),
        ev.not_(obs.path_odd),
        path_ok,
    )


def observed(prof: SandboxProfile) -> bool:
    """SPEC (observe mode): a profile declared `enforce = "observe"` is observed only if it is trusted, has a network
    and brokers nothing; anything else declared so is enforced (and `trust-lane` refutes the declaration)."""
    return (prof.enforce == "observe" and prof.trust == "trusted" and not prof.brokers
            and prof.network.mode == "allowlist")


def profile_admits(ev, prof: SandboxProfile, obs) -> z3.BoolRef | bool:
    """The declared allowlist of `prof` admits the symbolic (or concrete) request `obs`; an observed profile, any
    host and port (over http or https): what lies outside its allowlist is forwarded as plain traffic and audited."""
    hosts = prof.network.allowed_hosts if prof.network.mode == "allowlist" else ()
    anywhere = observed(prof)
    return ev.and_(
        ev.or_(ev.eq(obs.scheme, "http"), ev.eq(obs.scheme, "https")),
        ev.not_(obs.host_error),
        ev.or_(anywhere, *[ev.and_(ev.eq(obs.host, h.host), ev.eq(obs.port, h.port)) for h in hosts]),
    )
