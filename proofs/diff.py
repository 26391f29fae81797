"""Semantic diff of two artifacts (SecGuru/Batfish style): for each subject, example requests one admits and the other denies.

Both artifacts are encoded over the same symbolic request and resolved address; each example is
a model of `new.allowed ∧ ¬old.allowed` (widened) or `old.allowed ∧ ¬new.allowed` (narrowed),
replayed through `decide()` on both sides. Up to `max_examples` per direction, each differing
from the previous ones in (host, port, method, path class).

Beside the examples, how each subject's capacity moved (`capacity_moves`, docs/budget.md): bits per request and per
window, old and new, counted by `proofs.capacity` (no solver).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

import z3

from catalog import CatalogError, load_catalog
from compiler import sarif
from compiler.artifact import Artifact, Connection
from compiler.budget import describe_window
from egress_proxy.decision.adapter import HEAD_SHAPE_REASONS, artifact_index
from egress_proxy.decision.adapter import decide as real_decide
from egress_proxy.decision.shapes import example_target
from egress_proxy.decision.types import Request
from proofs.capacity import Capacity, capacities, ceil2, format_bits
from proofs.decode import (
    decision_dict,
    decision_widens,
    request_dict,
    request_line,
    side,
)
from proofs.inputs import SymbolicRequest, Universe, concretize
from proofs.model import outcome, subject_table, widens
from proofs.properties import clean, nice_ip, owners, shape_links, subject_lease
from proofs.solve import Limits, check
from proofs.spec import requests as spec_requests
from proofs.symexec import Evaluator, Unsupported


@dataclass(frozen=True)
class DiffExample:
    """One request the two versions judge differently."""

    subject: str  # "connection:<name>" | "profile:<name>"
    direction: str  # "widened" (new grants what old did not: admits it, or attaches a credential) | "narrowed" (the reverse)
    request: Request
    resolved_ips: tuple[str, ...]
    old: dict[str, Any]  # decide() on the old artifact
    new: dict[str, Any]  # decide() on the new artifact
    body: str | None = None  # the request's body, when a rule's body shape tells the two apart (judged on both sides)

    def describe(self) -> str:
        with_body = f" with body `{self.body if len(self.body) <= 120 else self.body[:117] + '...'}`" if self.body else ""
        return f"{self.subject}: `{request_line(self.request)}`{with_body}: old {side(self.old)}, new {side(self.new)}"

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "direction": self.direction, "request": request_dict(self.request),
                "resolved_ips": list(self.resolved_ips), "old": self.old, "new": self.new, "summary": self.describe(),
                **({"body": self.body} if self.body is not None else {})}


@dataclass(frozen=True)
class CapacityMove:
    """One subject's capacity in the old and the new artifact (None: the subject is not in that one)."""

    kind: str
    name: str
    old: Capacity | None
    new: Capacity | None

    @property
    def subject(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def moved(self) -> bool:
        if self.old is None or self.new is None:
            return True
        return (self.old.bits, window(self.old)) != (self.new.bits, window(self.new))

    def describe(self) -> list[str]:
        """`profile `x`: 12.00 -> 13.58 bits per request (+1.58)`, and the same per window when either has caps."""
        who = f"{self.kind} `{self.name}`"
        if self.old is None or self.new is None:
            cap = self.new or self.old
            assert cap is not None
            figure = f"{format_bits(cap.bits)} per request" + (f" ({cap.unbounded})" if cap.unbounded else "")
            return [f"{who}: new, {figure}" if self.old is None else f"{who}: removed (was {figure})"]
        lines = [f"{who}: {moved(self.old.bits, self.new.bits, 'per request')}"
                 + (f" ({self.new.unbounded})" if self.new.unbounded and not self.old.unbounded else "")]
        (ow, oseconds), (nw, nseconds) = window(self.old), window(self.new)
        if (ow, oseconds) != (nw, nseconds) and (oseconds or nseconds):
            if oseconds == nseconds:
                label = f"per {describe_window(oseconds)} window"
            elif oseconds and nseconds:
                label = f"per window ({describe_window(oseconds)} -> {describe_window(nseconds)})"
            else:
                label = "per window"
            note = "" if oseconds and nseconds else f" (caps {'removed' if oseconds else 'added'})"
            lines.append(f"{who}: {moved(ow, nw, label)}{note}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "old": self.old.to_dict() if self.old is not None else None,
                "new": self.new.to_dict() if self.new is not None else None, "summary": "; ".join(self.describe())}


def window(cap: Capacity) -> tuple[float, int | None]:
    """(bits per window, its length in seconds): unbounded and None without caps."""
    return (cap.window_bits(), cap.budget.window) if cap.budget is not None else (math.inf, None)


def moved(old: float, new: float, per: str) -> str:
    """`12.00 -> 13.58 bits per request (+1.58)`; `12.00 bits -> unbounded per request`; `unchanged, 12 bits ...`
    (figures rounded up to two decimals, as `format_bits` prints them)."""
    a, b = ceil2(max(old, 0.0)), ceil2(max(new, 0.0))
    if a == b:
        return f"unchanged, {format_bits(old)} {per}"
    if math.isinf(a) or math.isinf(b):
        return f"{format_bits(old)} -> {format_bits(new)} {per}"
    return f"{a:,.2f} -> {b:,.2f} bits {per} ({b - a:+,.2f})"


def capacity_moves(old: Artifact, new: Artifact) -> tuple[CapacityMove, ...]:
    """Every subject of either artifact with its capacity in each (sorted by kind and name)."""
    before = {(c.kind, c.name): c for c in capacities(old)}
    after = {(c.kind, c.name): c for c in capacities(new)}
    return tuple(CapacityMove(k, n, before.get((k, n)), after.get((k, n))) for k, n in sorted(before.keys() | after.keys()))


def render_moves(moves: tuple[CapacityMove, ...]) -> list[str]:
    """The `Capacity` block of `diff` and `prove --against`: a line per subject whose capacity moved, then how many did not."""
    if not moves:
        return []
    changed = [m for m in moves if m.moved]
    lines = ["Capacity (bits an admitted request can carry, old -> new)"]
    lines += [f"  {line}" for m in changed for line in m.describe()]
    if len(changed) < len(moves):
        lines.append(f"  unchanged for {len(moves) - len(changed)} subject(s)")
    return lines


@dataclass(frozen=True)
class SemanticDiff:
    old_digest: str
    new_digest: str
    examples: tuple[DiffExample, ...] = ()
    added: tuple[str, ...] = ()  # subjects only in the new artifact
    removed: tuple[str, ...] = ()  # subjects only in the old artifact
    unknown: tuple[str, ...] = ()  # subjects the solver could not decide
    capacity: tuple[CapacityMove, ...] = ()  # every subject's capacity, old and new
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return not (self.examples or self.added or self.removed or self.unknown)

    @property
    def widened(self) -> tuple[DiffExample, ...]:
        return tuple(e for e in self.examples if e.direction == "widened")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "egresslaw.diff/1", "old_digest": self.old_digest, "new_digest": self.new_digest,
                "same": self.same, "added": list(self.added), "removed": list(self.removed),
                "unknown": list(self.unknown), "examples": [e.to_dict() for e in self.examples],
                **({"capacity": [m.to_dict() for m in self.capacity if m.moved]} if self.capacity else {})}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2, ensure_ascii=True) + "\n"

    def render_text(self) -> str:
        if self.same:
            return "\n".join(["the two artifacts admit exactly the same requests", *render_moves(self.capacity)]) + "\n"
        lines = [f"+ {s} (new subject)" for s in self.added] + [f"- {s} (removed subject)" for s in self.removed]
        for e in self.examples:
            lines.append(("+ " if e.direction == "widened" else "- ") + e.describe())
        lines += [f"? {s}: the solver could not decide (unknown)" for s in self.unknown]
        lines += render_moves(self.capacity)
        return "\n".join(lines) + "\n"

    def _placed(self, locations, old_locations, fallback_uri: str):
        """(kind, level, message, fingerprint, span, uri) for every difference, each placed on a policy line."""
        def where(subject: str, rule: str | None = None, old_first: bool = False):
            maps = (old_locations, locations) if old_first else (locations, old_locations)
            for m in maps:
                span = sarif.locate(m, subject, rule=rule)
                if span is not None:
                    return span
            return None

        out = []
        for e in self.examples:
            rule = e.new.get("rule") or e.old.get("rule")
            out.append((e.direction, "warning" if e.direction == "widened" else "note", e.describe(),
                        f"{e.subject}|{e.direction}|{request_line(e.request)}", where(e.subject, rule)))
        for s in self.added:
            out.append(("subject-added", "note", f"{s} is new", s, where(s)))
        for s in self.removed:
            out.append(("subject-removed", "note", f"{s} was removed", s, where(s, old_first=True)))
        for s in self.unknown:
            out.append(("unknown", "warning", f"{s}: the solver could not decide (unknown)", f"{s}|unknown", where(s)))
        return [(k, lvl, msg, fp, span, span.path if span else fallback_uri) for k, lvl, msg, fp, span in out]

    def to_sarif(self, locations=None, old_locations=None, fallback_uri: str = "build/egresslaw.json") -> str:
        """SARIF 2.1.0, each difference placed on the `.egress` line of its rule or subject (new artifact's
        source map first; a removed subject in the old one)."""
        results = [
            {"ruleId": kind, "level": level, "message": {"text": message},
             "partialFingerprints": {"egresslaw/diff/v1": fp}, "locations": [sarif.physical_location(uri, span)]}
            for kind, level, message, fp, span, uri in self._placed(locations, old_locations, fallback_uri)
        ]
        rules = [sarif.rule("widened", "a request the new version admits and the old one denied"),
                 sarif.rule("narrowed", "a request the old version admitted and the new one denies"),
                 sarif.rule("subject-added", "a profile or connection only the new version has"),
                 sarif.rule("subject-removed", "a profile or connection only the old version has"),
                 sarif.rule("unknown", "the solver could not decide whether the versions differ")]
        return sarif.document({"name": "egresslaw-diff", "rules": rules}, results,
                              {"old_digest": self.old_digest, "new_digest": self.new_digest})

    def render_github(self, locations=None, old_locations=None, fallback_uri: str = "build/egresslaw.json") -> str:
        """GitHub workflow annotations: a warning per widening or undecided subject, a notice per other difference."""
        lines = [sarif.github_annotation(level, message, kind, uri, span)
                 for kind, level, message, fp, span, uri in self._placed(locations, old_locations, fallback_uri)]
        return "".join(line + "\n" for line in lines if line)

    def render(self, fmt: str, locations=None, old_locations=None, fallback_uri: str = "build/egresslaw.json") -> str:
        if fmt == "json":
            return self.to_json()
        if fmt == "sarif":
            return self.to_sarif(locations, old_locations, fallback_uri)
        if fmt == "github":
            return self.render_github(locations, old_locations, fallback_uri)
        return self.render_text()


def _subjects(a: Artifact) -> set[tuple[str, str]]:
    return {("connection", c.name) for c in a.connections} | {("profile", p.name) for p in a.sandbox_profiles}


def semantic_diff(old: Artifact, new: Artifact, *, limits: Limits = Limits(), max_examples: int = 3,
                  decide=None, capacity: bool = True) -> SemanticDiff:
    """Every subject's widenings and narrowings between `old` and `new`, as replayed example requests, and (with
    `capacity`) how each subject's capacity moved."""
    if decide is None:
        decide = real_decide
    table = load_catalog(new.catalog.version).special_purpose
    old_s, new_s = _subjects(old), _subjects(new)
    examples: list[DiffExample] = []
    unknown: list[str] = []
    for kind, name in sorted(old_s & new_s):
        ctx = z3.Context()
        ev = Evaluator(ctx)
        subj = f"{kind}:{name}"
        a = old.connection(name) if kind == "connection" else old.profile(name)
        b = new.connection(name) if kind == "connection" else new.profile(name)
        tables = [_table(art, table, kind, name) for art in (old, new)]
        subjects = [a, b, *owners(old, a), *owners(new, b)]
        prefixes = [r.prefix for t in tables if t is not None for r in t.rules if r.prefix]
        prefixes += [p for s in subjects if isinstance(s, Connection) for p in spec_requests.path_constants(s)]
        sym = SymbolicRequest(ev, Universe.build(subjects, prefixes, tables))
        obs = sym.observation()
        try:
            o_old, o_new = (outcome(ev, t, sym, obs) if t is not None else None for t in tables)
        except Unsupported:
            unknown.append(subj)
            continue
        lease = subject_lease(kind, name)
        sides = {"widened": ((new, tables[1], kind, name), (old, tables[0], name)),
                 "narrowed": ((old, tables[0], kind, name), (new, tables[1], name))}
        for direction, terms in (("widened", _grants(ev, o_new, o_old)), ("narrowed", _grants(ev, o_old, o_new))):
            mine, theirs = sides[direction]
            links: list = []
            if mine[1] is not None:  # rules whose shapes differ: their judges compared on the same inputs
                try:
                    links, shaped = shape_links(sym, mine, theirs, {}, decide, limits)
                except Unsupported:
                    unknown.append(subj)
                    continue
                if shaped is not None:
                    if shaped.verdict == "refuted" and shaped.request is not None:
                        here, there = decision_dict(shaped.decision), decision_dict(shaped.other)
                        body = shaped.body.decode("utf-8", "backslashreplace") if shaped.body is not None else None
                        examples.append(DiffExample(subj, direction, shaped.request, (shaped.answer,),
                                                    there if direction == "widened" else here,
                                                    here if direction == "widened" else there, body))
                    else:
                        unknown.append(subj)
                    continue
            blocked: list = []
            for _ in range(max_examples):
                res = check(ctx, [sym.wf, *links, terms, *blocked], limits, clean(sym) + nice_ip(sym))
                if res.status == "unknown":
                    unknown.append(subj)
                    break
                if res.status == "unsat":
                    break
                m = res.model
                req, ips = concretize(m, sym)
                d_old, d_new = decide(old, lease, req, list(ips)), decide(new, lease, req, list(ips))
                granting, other = (new, old) if direction == "widened" else (old, new)
                shaped = shaped_witness(granting, lease, req, d_new if direction == "widened" else d_old)
                if shaped is not None:  # the model's path is only the rule's prefix class: one its template admits
                    req = shaped
                    d_old, d_new = decide(old, lease, req, list(ips)), decide(new, lease, req, list(ips))
                if decision_widens(d_new, d_old) if direction == "widened" else decision_widens(d_old, d_new):
                    examples.append(DiffExample(subj, direction, req, ips, decision_dict(d_old), decision_dict(d_new)))
                else:
                    unknown.append(subj)  # did not replay: never claim a difference we cannot show
                    break
                blocked.append(z3.Not(z3.And([v == m.eval(v, model_completion=True)
                                              for v in (sym.host, sym.port, sym.method, sym.path)])))
    return SemanticDiff(
        old_digest=old.digest,
        new_digest=new.digest,
        examples=tuple(examples),
        added=tuple(f"{k}:{n}" for k, n in sorted(new_s - old_s)),
        removed=tuple(f"{k}:{n}" for k, n in sorted(old_s - new_s)),
        unknown=tuple(sorted(set(unknown))),
        capacity=capacity_moves(old, new) if capacity else (),
    )


def shaped_witness(artifact: Artifact, lease, req, decision):
    """`req` with a target the head shapes of the rule that refused it admit (`shapes.example_target`), or None when
    `decision` is no head-shape refusal (the free shape verdict of a model is realized by a real request)."""
    if decision.allowed or decision.reason not in HEAD_SHAPE_REASONS or decision.rule is None:
        return None
    view = artifact_index(artifact).view(lease)[0]
    owner = lease.connection or decision.broker
    shape = view.shaped.get((owner, decision.rule)) if view is not None and view.shaped and owner else None
    if shape is None and view is not None and view.shaped:  # a profile's brokered rule: its owner is not in the denial
        shape = next((s for (_, r), s in view.shaped.items() if r == decision.rule), None)
    target = example_target(shape) if shape is not None else None
    return replace(req, target=target) if target is not None else None


def _table(artifact: Artifact, table, kind: str, name: str):
    """The subject's core table, or None when it is unusable (a malformed worker, a missing broker): it admits nothing."""
    try:
        return subject_table(artifact, table, kind, name)
    except (ValueError, CatalogError):
        return None


def _grants(ev: Evaluator, a, b):
    """Outcome `a` grants what `b` does not (either may be None: a subject that admits nothing)."""
    if a is None:
        return z3.BoolVal(False, ev.ctx)
    return widens(ev, a, b)


def widenings(previous: Artifact, current: Artifact, *, limits: Limits = Limits()) -> list[tuple[str, str]]:
    """(subject key, example) for every subject `current` widens; keys in the lock's form (`connection:<n>`,
    `sandbox_profile:<n>`), the example a replayed request line with both decisions. For `compile --allow-widening`."""
    diff = semantic_diff(previous, current, limits=limits, max_examples=1, capacity=False)
    out: list[tuple[str, str]] = []
    for e in diff.widened:
        kind, _, name = e.subject.partition(":")
        key = f"sandbox_profile:{name}" if kind == "profile" else e.subject
        out.append((key, e.describe().split(": ", 1)[1]))
    for subj in diff.unknown:  # never let an undecided subject pass as "no widening"
        kind, _, name = subj.partition(":")
        out.append((f"sandbox_profile:{name}" if kind == "profile" else subj, "the solver could not decide (unknown)"))
    return out
