"""What the decision core answers on the symbolic inputs: `egress_proxy.decision.core`, evaluated by `proofs.symexec`.

Nothing here re-states the semantics or composes them: each term below is the symbolic evaluation of
the core function the proxy calls natively (`verdict` — the whole composition — then `carrier`,
`request_worker`, `judge_address`, `forwarded`, `credential_header`, `follows_redirect` to read it),
on the subject tables the proxy's own index builds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from catalog import SpecialPurposeTable
from compiler.artifact import Artifact, Connection, SandboxProfile
from egress_proxy.decision import core
from egress_proxy.decision.adapter import artifact_index
from proofs.inputs import SymbolicRequest
from proofs.symexec import Evaluator, SymStr


def subject_table(artifact: Artifact, table: SpecialPurposeTable, kind: str, name: str) -> core.Subject | None:
    """The core's table of one subject, built by the proxy's own index (`ArtifactIndex.subject_table`: the one
    construction both use); None if the subject or its worker is missing. ValueError (or CatalogError) when a
    worker setting is malformed or a brokered connection is unusable."""
    return artifact_index(artifact, table).subject_table(kind, name)


def declared(artifact: Artifact, kind: str, name: str) -> Connection | SandboxProfile | None:
    return artifact.connection(name) if kind == "connection" else artifact.profile(name)


@dataclass(frozen=True)
class Ceiling:
    """`prove --within`: the ceiling's artifact, and the ceiling subject that bounds each candidate subject (the
    same-named one unless `mapping` says otherwise: `("connection:github", "github-any")`)."""

    artifact: Artifact
    mapping: tuple[tuple[str, str], ...] = ()

    def name_for(self, kind: str, name: str) -> str:
        return dict(self.mapping).get(f"{kind}:{name}", name)

    def rename(self) -> dict[str, str]:
        """Candidate connection -> the ceiling connection that bounds it: how carriers compare across the two."""
        return {k.split(":", 1)[1]: v for k, v in self.mapping if k.startswith("connection:")}


@dataclass
class Outcome:
    """The core's verdict on the symbolic request, as terms."""

    subject: core.Subject
    obs: core.Observation  # the symbolic request the core was run on
    pre: Any  # the request is admitted before the address check
    rule: Any  # the admitting rule's index (-1 for none or a profile): an int or a Choice of ints
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
    """decide() on the symbolic request: `core.verdict`, the one composition the proxy runs (the request checks,
    then every present answer judged by the worker of the request's carrier)."""
    obs = obs if obs is not None else sym.observation()
    if any(r.head_shape for r in subject.rules):
        obs = with_head_shapes(ev, obs, subject, sym)
    answers = sym.answer_list()  # a list of any length: the evaluator refuses any use but iterating it whole
    ev.new_run()
    reason, rule, admitted = ev.call(core.verdict, subject, obs, answers)
    sym.check_answers(answers)
    carrier = ev.call(core.carrier, subject, rule)
    worker = ev.call(core.request_worker, subject, rule)
    allowed = ev.eq(reason, "")
    # A rule's body shape (docs/shapes.md) refuses after the core admitted: a free input too, so the request may be
    # refused by it whenever its rule has one.
    bodies = [ev.and_(ev.eq(rule, i), sym.shape_input("body", r.body_shape)) for i, r in enumerate(subject.rules) if r.body_shape]
    if bodies:
        allowed = ev.and_(allowed, ev.not_(ev.or_(*bodies)))
    names = ev.choice([(g, c.name if c is not None else None) for g, c in ev.alternatives(carrier)])
    return Outcome(subject, obs, ev.bool_term(admitted), rule, ev.bool_term(allowed), reason, names, worker)


def with_head_shapes(ev: Evaluator, obs: core.Observation, subject: core.Subject, sym: SymbolicRequest) -> core.Observation:
    """`obs` with `shapes` set for `subject`'s rules: each rule's head-shape verdict a free input (shared by rules whose
    shapes judge alike: equal keys), so what is proved holds for any verdict of the shapes (docs/shapes.md)."""
    out = core.Observation(obs.scheme, obs.port, obs.host_error, obs.host, obs.is_ip, obs.ip6, obs.ip)
    for name in core.Observation.__slots__:
        setattr(out, name, getattr(obs, name))
    out.shapes = tuple(ev.merge(sym.shape_input("head", r.head_shape), SHAPE_REFUSED, "") if r.head_shape else ""
                       for r in subject.rules)
    return out


SHAPE_REFUSED = "path-template-mismatch"  # the reason a free head-shape refusal carries (any shape reason would do)


def forwarded(ev: Evaluator, out: Outcome, name: SymStr, listed: Any) -> Any:
    """The caller's header `name` travels upstream: the request is admitted and the core forwards it."""
    return ev.and_(out.allowed, ev.call(core.forwarded, out.subject, out.rule, name, listed))


def credential_header(ev: Evaluator, out: Outcome) -> Any:
    return ev.call(core.credential_header, out.subject, out.rule)


def address_reason(ev: Evaluator, w: core.WorkerTable, is6: Any, x: Any) -> Any:
    return ev.call(core.judge_address, w, is6, x)


def follows(ev: Evaluator, w: core.WorkerTable, status: Any, hop: int) -> Any:
    return ev.call(core.follows_redirect, w, status, hop)


def exceeds(ev: Evaluator, new: Outcome, ceiling: Outcome | None, rename: dict[str, str]) -> Any:
    """`prove --within`: the candidate grants what the ceiling does not (`widens` against the ceiling's subject), its
    carriers read through `rename` (a candidate connection -> the ceiling connection it is mapped to)."""
    if rename:
        carrier = ev.choice([(g, rename.get(n, n) if n is not None else None) for g, n in ev.alternatives(new.carrier)])
        new = replace(new, carrier=carrier)
    return widens(ev, new, ceiling)


def widens(ev: Evaluator, new: Outcome, old: Outcome | None) -> Any:
    """The new version grants what the old did not: it admits a request the old denied, or attaches a credential the
    old did not attach to it (adding a broker to a profile is a widening, though the request was admitted before)."""
    if old is None:  # the old subject was unusable: it admitted nothing
        return new.allowed
    kept = ev.and_(old.allowed, ev.or_(ev.eq(new.carrier, None), ev.eq(new.carrier, old.carrier)))
    return ev.bool_term(ev.and_(new.allowed, ev.not_(kept)))
