"""The one admission both front ends await: the mitmproxy edge's addon (a CONNECT, a plain request, a request inside
a tunnel) and the Envoy lane's authorizer (a CONNECT, a plain request). What differs between them is a hook, never
a step, so the lane says exactly what the edge says:

1. the lease (`Proxy-Authorization`, Bearer or Basic) against the current lease key set, or the tunnel's own lease
   (which must not have expired since the CONNECT);
2. the lease's subject exists in the artifact in force (`lease-unknown-subject`);
3. `bind`: the front end's own claim on the lease (the edge: one client connection, one subject; `lease-mismatch`);
4. `serves`: the front end serves that subject (the lane: `lane-not-served`);
5. the decision before any lookup (`decide_connect`, `decide_without_addresses`): a refused request resolves nothing;
6. `resolve`: the name's answers (the edge: resolved once per client connection; the lane: its resolver, the same
   answers its DNS front gives Envoy), or the tunnel's answers;
7. every answer judged (`judge_answers` for a CONNECT, `decide` for a request);
8. `pinned`: the front end keeps what it dials (the edge: refuses to dial itself, pins the answer);
9. the budget (docs/budget.md): when the subject (or, brokered, the carrier connection) declares one, the request's
   cost (`budget.request_cost`; a body of undeclared length under a bytes cap: `budget-length-required`) is charged
   to `ledger`, all or nothing across subjects (`budget-exceeded` with the `Charged` cap when a cap has no room; no
   ledger, or a ledger that fails: `budget-unavailable`). A subject without a budget never touches the ledger.

What comes after (a credential, the body's limits, the write-ahead audit event) is the front end's own; the
admission it got is final. Nothing here reads a header value beyond what `decision` reads, or logs one.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from compiler.artifact import Artifact
from egress_proxy.custody import lease as leases
from egress_proxy.custody.keys import KeyFileError
from egress_proxy.decision.adapter import decide, decide_connect, decide_without_addresses, judge_answers
from egress_proxy.decision.reasons import ALLOWED
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.front.budget import Charged, Ledger, LedgerError, request_cost, subjects_charged

log = logging.getLogger("egresslaw.budget")

Refusal = str  # a reason code (egress_proxy.decision.reasons)


@dataclass(frozen=True, slots=True)
class Ask:
    """One request as a front end parsed it. A CONNECT names its `authority` as sent (and `host`, `port` as the
    front end split it, for its events); a plain request (or one inside a tunnel) is its `request`. `credentials`
    are the `Proxy-Authorization` values (never in a repr)."""

    authority: str = ""
    host: str | None = None
    port: int | None = None
    request: Request | None = None
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    has_body: bool = False
    credentials: tuple[str, ...] = field(default=(), repr=False)

    @property
    def connect(self) -> bool:
        return self.request is None


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer: `reason` is `allowed` or why not; what was known when it was decided (the lease, the decision,
    the judged host and port, the answers) comes with it, so the front end's event names it."""

    reason: str
    lease: Lease | None = None
    decision: Decision | None = None
    host: str | None = None
    port: int | None = None
    answers: tuple[str, ...] = ()
    auth: str | None = None  # the scheme offered (Bearer, Basic, other), never the token
    budget: Charged | None = None  # budget-exceeded: the cap that had no room (its window, when it resets)

    @property
    def allowed(self) -> bool:
        return self.reason == ALLOWED


@dataclass
class Hooks:
    """What a front end lends the admission. `lease_keys` may raise KeyFileError (keys unreadable: internal-error)."""

    lease_keys: Callable[[], leases.LeaseKeys]
    verified: leases.VerifiedLeases
    clock: Callable[[], float]
    resolve: Callable[[Lease, str, int], Awaitable[Sequence[str] | Refusal]]
    bind: Callable[[Lease], Refusal | None] | None = None
    serves: Callable[[Lease], Refusal | None] | None = None
    pinned: Callable[[Lease, str, int, tuple[str, ...]], Refusal | None] | None = None
    ledger: Ledger | None = None  # the budget ledger (None: a subject with a budget is refused budget-unavailable)


def known_subject(artifact: Artifact, lease: Lease) -> bool:
    """The lease's profile or connection is in the artifact in force (a lease outlives a reload that removes it)."""
    if lease.profile is not None:
        return artifact.profile(lease.profile) is not None
    return artifact.connection(lease.connection or "") is not None


async def admit(artifact: Artifact, ask: Ask, hooks: Hooks, *, lease: Lease | None = None,
                answers: Sequence[str] | None = None) -> Admission:
    """Decide `ask` under `artifact`. Inside a tunnel, `lease` and `answers` are the tunnel's (from its CONNECT)."""
    auth = leases.scheme_of(ask.credentials[0] if ask.credentials else None)
    request = ask.request
    host, port = (request.host, request.port) if request is not None else (ask.host or "", ask.port if ask.port is not None else -1)
    where = {"host": host, "port": port, "auth": auth}
    if lease is None:
        try:
            lease = hooks.verified.authenticate(hooks.lease_keys(), ask.credentials, now=hooks.clock())
        except KeyFileError:
            return Admission("internal-error", **where)  # the key file went unreadable: fail closed (logged by its loader)
        except leases.LeaseError as exc:
            return Admission(exc.reason, **where)
    elif lease.exp <= hooks.clock():
        return Admission("lease-expired", lease, **where)
    if not known_subject(artifact, lease):
        return Admission("lease-unknown-subject", lease, **where)
    for claim in (hooks.bind, hooks.serves):
        refused = claim(lease) if claim is not None else None
        if refused is not None:
            return Admission(refused, lease, **where)
    if request is None:
        decision = decide_connect(artifact, lease, ask.authority, ask.headers, ask.has_body)
    elif answers is None:
        decision = decide_without_addresses(artifact, lease, request)
    else:
        decision = decide(artifact, lease, request, list(answers))
        got = Admission(decision.reason, lease, decision, decision.host or host, port, tuple(answers), auth)
        return charged(artifact, ask, hooks, got) if got.allowed else got
    if not decision.allowed:
        return Admission(decision.reason, lease, decision, decision.host or host, port, auth=auth)
    name = decision.host or host
    got = await hooks.resolve(lease, name, port)
    if isinstance(got, str):
        return Admission(got, lease, decision, name, port, auth=auth)
    ips = tuple(got)
    if not ips:
        return Admission("resolve-failed", lease, decision, name, port, auth=auth)
    judged = judge_answers(artifact, lease, ips) if request is None else decide(artifact, lease, request, list(ips))
    if not judged.allowed:
        return Admission(judged.reason, lease, judged, name, port, ips, auth)
    refused = hooks.pinned(lease, name, port, ips) if hooks.pinned is not None else None
    if refused is not None:
        return Admission(refused, lease, judged, name, port, ips, auth)
    return charged(artifact, ask, hooks, Admission(ALLOWED, lease, decision if request is None else judged, name, port, ips, auth))


def charged(artifact: Artifact, ask: Ask, hooks: Hooks, got: Admission) -> Admission:
    """Step 9: `got` (admitted) charged to the budgets it falls under, or refused."""
    assert got.lease is not None
    charges = subjects_charged(artifact, got.lease, got.decision)
    if not charges:
        return got
    cost = request_cost(ask)
    if cost is None:
        if any(b.bytes is not None for _, b in charges):
            return _refused(got, "budget-length-required")
        cost = 0  # requests caps only: the bytes are not counted
    if hooks.ledger is None:
        log.error("a subject with a budget and no budget ledger: refused budget-unavailable")
        return _refused(got, "budget-unavailable")
    try:
        answer = hooks.ledger.charge(charges, cost, hooks.clock())
    except (LedgerError, sqlite3.Error, OSError) as exc:
        log.error("the budget ledger failed: %s", exc)  # its message names the ledger and the failure, no request value
        return _refused(got, "budget-unavailable")
    return got if answer.ok else _refused(got, "budget-exceeded", answer)


def _refused(got: Admission, reason: str, budget: Charged | None = None) -> Admission:
    """`got`, refused `reason` by step 9 (what was known when it was decided kept)."""
    return Admission(reason, got.lease, got.decision, got.host, got.port, got.answers, got.auth, budget)
