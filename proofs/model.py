"""What the decision core answers on the symbolic inputs: `egress_proxy.core`, evaluated by `proofs.symexec`.

Nothing here re-states the semantics: each term below is the symbolic evaluation of the core
function the proxy calls natively (`request_verdict`, `carrier`, `request_worker`, `judge_address`,
`answers_verdict`, `forwarded`, `credential_header`, `follows_redirect`), composed exactly as
`egress_proxy.decide` composes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from catalog import CatalogError, SpecialPurposeTable
from compiler.artifact import Artifact, Connection, SandboxProfile
from compiler.constants import DEFAULT_WORKER
from compiler.normalize import normalize_prefix
from egress_proxy import core
from egress_proxy.addresses import worker_judge  # the proxy's cache of the core's worker tables
from proofs.symexec import Evaluator, SymStr
from proofs.inputs import SymbolicRequest


def subject_table(artifact: Artifact, table: SpecialPurposeTable, kind: str, name: str) -> core.Subject | None:
    """The core's table of one subject, built by the same core code the proxy's index uses; None if unusable.
    ValueError (or CatalogError) when a worker setting is malformed or a brokered connection is unusable."""
    if kind == "connection":
        conn = artifact.connection(name)
        worker = artifact.worker(conn.worker) if conn is not None else None
        if conn is None or worker is None:
            return None
        return core.connection_subject(conn, worker_judge(worker, table).tables, normalize_prefix)
    prof = artifact.profile(name)
    worker = artifact.worker(DEFAULT_WORKER)
    if prof is None or worker is None:
        return None
    connections = _Connections(artifact, table)
    return core.profile_subject(prof, worker_judge(worker, table).tables, connections)


class _Connections(Mapping):
    """Every connection's table by name, built on first use (what a profile brokers from); None when unusable."""

    def __init__(self, artifact: Artifact, table: SpecialPurposeTable) -> None:
        self.artifact, self.table = artifact, table
        self.names = [c.name for c in artifact.connections]

    def __getitem__(self, name: str) -> core.Subject | None:
        if self.artifact.connection(name) is None:
            raise KeyError(name)
        try:
            return subject_table(self.artifact, self.table, "connection", name)
        except (ValueError, CatalogError):
            return None

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def declared(artifact: Artifact, kind: str, name: str) -> Connection | SandboxProfile | None:
    return artifact.connection(name) if kind == "connection" else artifact.profile(name)


@dataclass
class Outcome:
    """The core's verdict on the symbolic request, as terms."""

    subject: core.Subject
    obs: core.Observation  # the symbolic request the core was run on
    pre: Any  # the request is admitted before the address check
    rule: Any  # the admitting rule's index (-1 for none or a profile): an int or a Choice of ints
    answers: tuple[Any, ...]  # per answer slot: the judgement's reason ("" when absent or dialable)
    allowed: Any  # Bool term
    reason: Any  # Choice of reason codes ("" when allowed)
    carrier: Any  # the connection whose credential the request carries: a name, None, or a Choice of them
    worker: Any  # the WorkerTable that judged the answers (or a Choice of them)

    def rule_name(self, ev: Evaluator) -> Any:
        """The admitting rule's name (None for no rule), as the adapter reads `subject.rules[rule].name`."""
        alts = self.rule.alts if not isinstance(self.rule, int) else ((True, self.rule),)
        rules = self.subject.rules
        return ev.choice([(g, rules[i].name if 0 <= i < len(rules) else None) for g, i in alts])


def outcome(ev: Evaluator, subject: core.Subject, sym: SymbolicRequest, obs: core.Observation | None = None) -> Outcome:
    """decide() on the symbolic request: the request checks, then every present answer judged by the request's
    worker (as the adapter composes them)."""
    obs = obs if obs is not None else sym.observation()
    reason, rule = ev.call(core.request_verdict, subject, obs)
    carrier = ev.call(core.carrier, subject, rule)
    worker = ev.call(core.request_worker, subject, rule)
    answers = tuple(ev.merge(present, judged(ev, worker, is6, x), "") for present, is6, x in sym.answers)
    addresses = ev.call(core.answers_verdict, answers)
    pre = ev.eq(reason, "")
    allowed = ev.and_(pre, ev.eq(addresses, ""))
    names = ev.choice([(g, c.name if c is not None else None) for g, c in ev.alternatives(carrier)])
    return Outcome(subject, obs, ev.bool_term(pre), rule, answers, ev.bool_term(allowed), ev.merge(pre, addresses, reason),
                   names, worker)


def judged(ev: Evaluator, worker: Any, is6: Any, x: Any) -> Any:
    """`core.judge_address` by a worker that may depend on the request (a Choice): each one's summary, merged."""
    alts = ev.alternatives(worker)
    result = ev.call(core.judge_address, alts[-1][1], is6, x)
    for g, w in reversed(alts[:-1]):
        result = ev.merge(g, ev.call(core.judge_address, w, is6, x), result)
    return result


def forwarded(ev: Evaluator, out: Outcome, name: SymStr, listed: Any) -> Any:
    """The caller's header `name` travels upstream: the request is admitted and the core forwards it."""
    return ev.and_(out.allowed, ev.call(core.forwarded, out.subject, out.rule, name, listed))


def credential_header(ev: Evaluator, out: Outcome) -> Any:
    return ev.call(core.credential_header, out.subject, out.rule)


def address_reason(ev: Evaluator, w: core.WorkerTable, is6: Any, x: Any) -> Any:
    return ev.call(core.judge_address, w, is6, x)


def follows(ev: Evaluator, w: core.WorkerTable, status: Any, hop: int) -> Any:
    return ev.call(core.follows_redirect, w, status, hop)


def widens(ev: Evaluator, new: Outcome, old: Outcome | None) -> Any:
    """The new version grants what the old did not: it admits a request the old denied, or attaches a credential the
    old did not attach to it (adding a broker to a profile is a widening, though the request was admitted before)."""
    if old is None:  # the old subject was unusable: it admitted nothing
        return new.allowed
    kept = ev.and_(old.allowed, ev.or_(ev.eq(new.carrier, None), ev.eq(new.carrier, old.carrier)))
    return ev.bool_term(ev.and_(new.allowed, ev.not_(kept)))
