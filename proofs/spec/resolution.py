"""dns-confined, stated from the artifact as declared: the names a front end may resolve for a subject.

A front end (the mitmproxy edge, the Envoy lane) resolves a name only for a request the decision admitted before any
address (`egress_proxy/front/admit.py`: a CONNECT, or a plain request or one inside a tunnel), and the name it
resolves is that request's host (normalized) at its port. The statement: that `host:port` is one the subject
declares it reaches, so a resolver's query names nothing the workload chose beyond which declared destination:

- a connection: the host and port of one of its rules;
- a sandbox profile: one `host:port` of its allowlist (nothing when its network is `none`). The rules it brokers add
  none: the compiler requires a brokered rule's host in the allowlist (EL0040), and nothing here trusts that;
- a profile in observe mode (`requests.observed`: trusted, with a network, brokering nothing) resolves the names it
  observes, any host and port: DNS is not confined for it. Its statement is only that a name outside its allowlist
  is resolved as observed: the decision marks it (`would-deny` in the audit).

An IP literal is held to the same statement (a front end "resolves" one to itself, without DNS; compiled artifacts
declare names only). Nothing here imports `egress_proxy`.
"""

from __future__ import annotations

from typing import Any

from compiler.artifact import Connection, SandboxProfile
from proofs.spec.requests import observed


def destinations(subject: Connection | SandboxProfile) -> frozenset[tuple[str, int]]:
    """The `(host, port)` pairs `subject` declares it reaches: a connection's rules, a profile's allowlist."""
    if isinstance(subject, Connection):
        return frozenset((r.host, r.port) for r in subject.rules)
    if subject.network.mode != "allowlist":
        return frozenset()
    return frozenset((h.host, h.port) for h in subject.network.allowed_hosts)


def confined(subject: Connection | SandboxProfile) -> bool:
    """DNS is confined for `subject`: every subject but a profile in observe mode."""
    return not (isinstance(subject, SandboxProfile) and observed(subject))


def resolvable(ev, subject: Connection | SandboxProfile, obs) -> Any:
    """The symbolic (or concrete) request `obs` names a host the normalizer accepted and a `(host, port)` that
    `subject` declares: what a front end may resolve for it."""
    return ev.and_(ev.not_(obs.host_error),
                   ev.or_(*[ev.and_(ev.eq(obs.host, h), ev.eq(obs.port, p)) for h, p in sorted(destinations(subject))]))


def resolvable_text(subject: Connection | SandboxProfile, host: str | None, port: int) -> bool:
    """`resolvable` on a concrete name as a front end resolves it (the decision's normalized host, the port)."""
    return host is not None and (host, port) in destinations(subject)
