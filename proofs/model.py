"""What the decision core answers on the symbolic inputs: `egress_proxy.core`, evaluated by `proofs.symexec`.

Nothing here re-states the semantics: each term below is the symbolic evaluation of the core
function the proxy calls natively (`request_verdict`, `judge_address`, `answers_verdict`,
`forwarded`, `credential_header`, `follows_redirect`), composed exactly as
`egress_proxy.decide` composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from catalog import SpecialPurposeTable
from compiler.artifact import Artifact, Connection, SandboxProfile
from compiler.constants import DEFAULT_WORKER
from compiler.normalize import normalize_prefix
from egress_proxy import core
from egress_proxy.addresses import worker_judge  # the proxy's cache of the core's worker tables
from proofs.symexec import Evaluator, SymStr
from proofs.inputs import SymbolicRequest


def subject_table(artifact: Artifact, table: SpecialPurposeTable, kind: str, name: str) -> core.Subject | None:
    """The core's table of one subject, built by the same core code the proxy's index uses; None if unusable."""
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
    return core.profile_subject(prof, worker_judge(worker, table).tables)


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

    def rule_name(self, ev: Evaluator) -> Any:
        """The admitting rule's name (None for no rule), as the adapter reads `subject.rules[rule].name`."""
        alts = self.rule.alts if not isinstance(self.rule, int) else ((True, self.rule),)
        rules = self.subject.rules
        return ev.choice([(g, rules[i].name if 0 <= i < len(rules) else None) for g, i in alts])


def outcome(ev: Evaluator, subject: core.Subject, sym: SymbolicRequest, obs: core.Observation | None = None) -> Outcome:
    """decide() on the symbolic request: the request checks, then every present answer (as the adapter composes them)."""
    obs = obs if obs is not None else sym.observation()
    reason, rule = ev.call(core.request_verdict, subject, obs)
    answers = tuple(ev.merge(present, ev.call(core.judge_address, subject.worker, is6, x), "")
                    for present, is6, x in sym.answers)
    addresses = ev.call(core.answers_verdict, answers)
    pre = ev.eq(reason, "")
    allowed = ev.and_(pre, ev.eq(addresses, ""))
    return Outcome(subject, obs, ev.bool_term(pre), rule, answers, ev.bool_term(allowed), ev.merge(pre, addresses, reason))


def forwarded(ev: Evaluator, out: Outcome, name: SymStr, listed: Any) -> Any:
    """The caller's header `name` travels upstream: the request is admitted and the core forwards it."""
    return ev.and_(out.allowed, ev.call(core.forwarded, out.subject, out.rule, name, listed))


def credential_header(ev: Evaluator, out: Outcome) -> Any:
    return ev.call(core.credential_header, out.subject)


def address_reason(ev: Evaluator, w: core.WorkerTable, is6: Any, x: Any) -> Any:
    return ev.call(core.judge_address, w, is6, x)


def follows(ev: Evaluator, w: core.WorkerTable, status: Any, hop: int) -> Any:
    return ev.call(core.follows_redirect, w, status, hop)
