"""The checks: for one worker and its subjects, `core behaviour ∧ ¬statement` — solve, decode, replay.

The behaviour side is the decision core evaluated symbolically (`proofs.model`); the statement
side is `proofs/spec/`, which shares no code with the core. Every refutation is replayed through
the real `decide()` (whatever code it runs, a mutant included) before it is reported; a
counterexample that does not replay is reported `unknown`, never refuted and never proved. A core
construct the evaluator cannot run makes the check `unknown` too.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import z3

from catalog import CatalogError, SpecialPurposeTable
from compiler.artifact import Artifact, Connection, SandboxProfile, Worker
from egress_proxy.decision import core
from egress_proxy.decision.adapter import HEAD_SHAPE_REASONS, artifact_index, decide_connect, judge_token_answers, observe
from egress_proxy.decision.addresses import WorkerJudge, worker_judge
from egress_proxy.decision.shapes import example_target, judge_head, shape_of
from egress_proxy.decision.types import Lease
from proofs import shapes as shape_proofs
from proofs.contain import crashed
from proofs.decode import (
    Counterexample,
    decision_dict,
    decision_side,
    decision_widens,
    request_line,
)
from proofs.gate import subject_properties, worker_subject
from proofs.inputs import (
    ID_BITS,
    SymbolicRequest,
    Universe,
    concretize,
    decode_address,
    fresh_address,
)
from proofs.model import (
    Ceiling,
    Outcome,
    address_reason,
    credential_header,
    declared,
    exceeds,
    follows,
    forwarded,
    outcome,
    subject_table,
    widens,
)
from proofs.report import Result
from proofs.solve import Limits, check
from proofs.spec import requests as spec_requests
from proofs.spec import resolution as spec_resolution
from proofs.spec import switches as spec_switches
from proofs.spec.addresses import AddressSpec
from proofs.statements import WORKER_PROPERTIES
from proofs.symexec import Evaluator, Unsupported

NICE_V4 = ("93.184.215.14", "8.8.8.8", "1.1.1.1")
REDIRECT_TARGET = "http://169.254.169.254/"


@dataclass
class Ctx:
    """Everything one check needs: the artifacts, the table, limits and the replay entry point."""

    artifact: Artifact
    old: Artifact | None
    table: SpecialPurposeTable
    limits: Limits
    decide: Callable
    ceiling: Ceiling | None = None  # prove --within


def _timed(fn: Callable[[], Result]) -> Result:
    start = time.perf_counter()
    res = fn()
    return replace(res, time_ms=int((time.perf_counter() - start) * 1000))


def _res(worker: str, subject: str, prop: str, verdict: str, cex: Counterexample | None = None, detail: str = "") -> Result:
    return Result(worker, subject, prop, verdict, 0, cex.to_dict() if cex is not None else None, detail)


def _unknown(worker: str, subject: str, prop: str, reason: str) -> Result:
    return _res(worker, subject, prop, "unknown", detail=f"solver gave no answer: {reason}")


def _not_replayed(worker: str, subject: str, prop: str, cex: Counterexample) -> Result:
    return Result(worker, subject, prop, "unknown", 0, cex.to_dict(),
                  "the counterexample did not replay through decide(): the prover and the proxy disagree")


def owners(artifact: Artifact | None, subject) -> list[Connection]:
    """The connections whose credential `subject`'s requests may carry, as declared: itself, or a profile's `brokers`."""
    if artifact is None or subject is None:
        return []
    if isinstance(subject, Connection):
        return [subject]
    return [c for c in (artifact.connection(n) for n in subject.brokers) if c is not None]


def subject_lease(kind: str, name: str) -> Lease:
    return Lease(subject="egresslaw-prove", profile=name if kind == "profile" else None,
                 connection=name if kind == "connection" else None, exp=0)


def _address_value(ctx: z3.Context, ip) -> tuple[z3.BoolRef, z3.BitVecRef]:
    return z3.BoolVal(ip.version == 6, ctx), z3.BitVecVal(int(ip), 128, ctx)


def _holds(term: Any) -> bool:
    return z3.is_true(z3.simplify(term)) if isinstance(term, z3.ExprRef) else bool(term)


def _out_of_scope(rule, o: core.Observation) -> str:
    """Which declared condition of `rule` the (concrete) request misses, in words."""
    prefix = rule.path_prefix.rstrip("/") or "/"
    if o.scheme != "https":
        return f"scheme `{o.scheme}`: credentials ride https only"
    if o.host_error or o.host != rule.host:
        return f"host `{o.host}`, the rule names `{rule.host}`"
    if o.port != rule.port:
        return f"port {o.port}, the rule names {rule.port}"
    if o.method not in rule.methods:
        return f"method `{o.method}`, the rule allows {', '.join(rule.methods)}"
    if o.path_error:
        return f"the path is refused ({o.path_error}) yet matched"
    if o.path_odd:
        return f"`{o.path}` has no normalized form, yet matched"
    return f"prefix `{prefix}` admits `{o.path}` only segment-bounded: matched as a raw string prefix?"


def _range_of(table: SpecialPurposeTable, ip, forms) -> dict[str, str] | None:
    """The table entry the address, or an IPv4 address it carries, falls in (for the counterexample text)."""
    cands = [ip]
    if ip.version == 6:
        cands += [ipaddress.IPv4Address(core.embedded(f, int(ip))) for f in forms if core.in_form(f, int(ip))]
    for cand in cands:
        entry = table.lookup(cand)
        if entry is not None:
            return {"cidr": entry.cidr, "name": entry.name, "reference": entry.reference, "address": str(cand)}
    return None


def clean(sym: SymbolicRequest) -> list:
    """Preferences that make a counterexample readable: no odd headers, no body, one IPv4 answer, port 443."""
    ctx = sym.ctx
    prefs = [z3.Not(v) for v in sym.flags.values()]
    prefs += [z3.Not(sym.host_bad), z3.Not(sym.path_bad), z3.Not(sym.path_odd), sym.port == z3.BitVecVal(443, sym.port.size(), ctx),
              z3.Not(sym.name_listed), z3.Not(sym.answers[0][1])]
    prefs += [z3.Not(present) for present, _, _ in sym.answers[1:]]
    return prefs


def nice_ip(sym: SymbolicRequest) -> list:
    """Prefer a familiar public IPv4 answer in examples (readability only)."""
    _, is6, x = sym.answers[0]
    return [z3.Or([z3.And(z3.Not(is6), x == z3.BitVecVal(int(ipaddress.IPv4Address(a)), 128, sym.ctx)) for a in NICE_V4])]


# ---------------------------------------------------------------------------------------------
# worker-level checks
# ---------------------------------------------------------------------------------------------


def worker_checks(c: Ctx, worker: Worker) -> list[Result]:
    ctx = z3.Context()
    ev = Evaluator(ctx)
    subj = worker_subject(worker.name)
    try:
        w = core.worker_table(worker, c.table)
        spec = AddressSpec(ctx, c.table, worker)
    except (ValueError, CatalogError) as exc:
        cex = Counterexample(summary=f"worker `{worker.name}`: {exc}", setting="deny_cidrs/allow_cidrs/nat64_prefixes")
        return [_res(worker.name, subj, p, "refuted", cex, "malformed worker setting") for p in WORKER_PROPERTIES]
    judge = WorkerJudge(worker, c.table)
    is6, x, wf = fresh_address(ctx, "ip")

    def dialable() -> Any:
        return ev.bool_term(ev.eq(address_reason(ev, w, is6, x), ""))

    def vacuity() -> Result:
        out = check(ctx, [wf, dialable()], c.limits, [z3.Not(is6)])
        if out.status == "unknown":
            return _unknown(worker.name, subj, "vacuity", out.reason)
        if out.status == "unsat":
            cex = Counterexample(summary=f"worker `{worker.name}` reaches no public address at all",
                                 setting=f"deny_cidrs = {list(worker.deny_cidrs)}, ipv6 = {str(worker.ipv6).lower()}")
            return _res(worker.name, subj, "vacuity", "refuted", cex, "every proof about this worker would be vacuous")
        return _res(worker.name, subj, "vacuity", "proved", detail=f"reaches e.g. `{decode_address(out.model, is6, x).compressed}`")

    def address_property(prop: str, violated: Callable[[Any, Any], Any]) -> Result:
        out = check(ctx, [wf, dialable(), violated(is6, x)], c.limits, [z3.Not(is6)])
        if out.status == "unknown":
            return _unknown(worker.name, subj, prop, out.reason)
        if out.status == "unsat":
            return _res(worker.name, subj, prop, "proved")
        ip = decode_address(out.model, is6, x)
        if prop == "public-only":
            ip = _nicer_ip(ip, worker, judge, spec, ctx)
        cex = _address_cex(worker, prop, ip, c.table, judge)
        shown = judge.judge(ip)[0] and _holds(violated(*_address_value(ctx, ip)))
        return _res(worker.name, subj, prop, "refuted", cex) if shown else _not_replayed(worker.name, subj, prop, cex)

    def no_redirect() -> Result:
        out = _redirect_cex(ev, w, worker, c.limits, None)
        if isinstance(out, str):
            return _unknown(worker.name, subj, "no-redirect", out)
        if out is None:
            return _res(worker.name, subj, "no-redirect", "proved")
        return _res(worker.name, subj, "no-redirect", "refuted", out)

    def guarded(prop: str, fn: Callable[[], Result]) -> Callable[[], Result]:
        def run() -> Result:
            try:
                return fn()
            except Unsupported as exc:
                return _res(worker.name, subj, prop, "unknown", detail=f"the core cannot be evaluated symbolically: {exc}")
            except Exception as exc:  # any crash of a check is its `unknown`, never the prover's
                return crashed(worker.name, subj, prop, exc)
        return run

    return [
        _timed(guarded("vacuity", vacuity)),
        _timed(guarded("public-only", lambda: address_property("public-only", lambda a, b: z3.Not(spec.public(a, b))))),
        _timed(guarded("deny-cidrs", lambda: address_property("deny-cidrs", spec.denied))),
        _timed(guarded("no-redirect", no_redirect)),
    ]


SEPARATE = ("shape-confined",)  # a task of its own (`proofs.runner`): it needs no encoding of the core


def rule_verdicts(c: Ctx, conn: Connection, lease: Lease, check: Callable) -> list:
    """`check` (`proofs.shapes.confined` or `.vacuity`) on every shaped rule of connection `conn`."""
    out = []
    for rule in conn.rules:
        try:
            shape = shape_of(rule)
        except ValueError as exc:  # a pattern outside the subset: the proxy refuses the subject (fail closed)
            out.append(shape_proofs.Verdict("proved", f"rule `{rule.name}`: unusable ({exc}); the subject admits nothing"))
            continue
        if shape is not None:
            out += check(c.artifact, lease, c.decide, rule, shape, c.limits)
    return out


def shape_result(w: str, kind: str, name: str, prop: str, v) -> Result:
    """A shape check's result from the verdict of one rule (`proofs.shapes.Verdict`): a refutation with its request,
    body and replayed decision."""
    subj = f"{kind}:{name}"
    if v.verdict != "refuted" or v.request is None:
        return _res(w, subj, prop, v.verdict, Counterexample(summary=v.summary) if v.verdict == "refuted" else None,
                    detail=v.summary if v.verdict != "refuted" else "")
    body = v.body.decode("utf-8", "backslashreplace") if v.body is not None else None
    cex = Counterexample(summary=f"{kind} `{name}`: {v.summary}", request=v.request,
                         resolved_ips=(v.answer,), rule=v.decision.rule if v.decision else None,
                         decision=decision_dict(v.decision) if v.decision is not None else None,
                         extra={"body": body} if body is not None else {})
    return _res(w, subj, prop, "refuted", cex)


def shape_checks(c: Ctx, worker: Worker, kind: str, name: str) -> list[Result]:
    """`shape-confined` of one connection: nothing a rule's shape judges admit lies outside its shape as declared
    (`proofs/spec/shapes.py`). Its own task in the runner: the judges' questions need no encoding of the core, so they
    run beside the subject's other checks."""
    subj = f"{kind}:{name}"

    def run() -> Result:
        try:
            conn = declared(c.artifact, kind, name)
            verdicts = rule_verdicts(c, conn, subject_lease(kind, name), shape_proofs.confined) if isinstance(conn, Connection) else []
        except Unsupported as exc:
            return _res(worker.name, subj, "shape-confined", "unknown", detail=f"the judges cannot be evaluated symbolically: {exc}")
        except Exception as exc:  # any crash of a check is its `unknown`, never the prover's
            return crashed(worker.name, subj, "shape-confined", exc)
        bad = next((v for v in verdicts if v.verdict == "refuted"), None) or next((v for v in verdicts if v.verdict == "unknown"), None)
        if bad is not None:
            return shape_result(worker.name, kind, name, "shape-confined", bad)
        return _res(worker.name, subj, "shape-confined", "proved", detail="; ".join(v.summary for v in verdicts))

    return [_timed(run)]


def shape_links(sym: SymbolicRequest, mine: tuple, theirs: tuple, rename: dict[str, str], decide: Callable,
                limits: Limits) -> tuple[list, Any]:
    """Tie the free shape verdicts of subject `mine` = (artifact, table, kind, name) to those of the same-named rules of
    `theirs` = (artifact, table or None, name), another artifact's subject. Where two such rules' shapes differ, the
    judges answer whether mine admits anything theirs refuses (`proofs.shapes.included`, on the same symbolic inputs):
    proved adds "theirs refuses ⇒ mine refuses" to the links; otherwise the `proofs.shapes.Verdict` (refuted: a pair
    replayed on both artifacts; unknown) is returned with the links so far."""
    art, table, kind, name = mine
    other_art, other_table, other_name = theirs
    if other_table is None:
        return [], None
    links: list = []
    lease, other_lease = subject_lease(kind, name), subject_lease(kind, other_name)
    for i, r in enumerate(table.rules):
        mine_owner = name if kind == "connection" else table.owners[i].name
        for j, r2 in enumerate(other_table.rules):
            their_owner = other_name if kind == "connection" else other_table.owners[j].name
            if r.name != r2.name or rename.get(mine_owner, mine_owner) != their_owner:
                continue
            if kind == "profile" and (r.host, r.port) not in table.destinations:
                continue  # a brokered rule the profile cannot reach never admits anything (core.destination refuses first)
            for part, mine_key, their_key in (("head", r.head_shape, r2.head_shape), ("body", r.body_shape, r2.body_shape)):
                if not mine_key or not their_key or mine_key == their_key:
                    continue
                ours, other = _declared_rule(art, mine_owner, r.name), _declared_rule(other_art, their_owner, r2.name)
                try:
                    pair = ((art, lease, ours, shape_of(ours)), (other_art, other_lease, other, shape_of(other)))  # type: ignore[arg-type]
                except (ValueError, AttributeError) as exc:
                    return links, shape_proofs.Verdict("unknown", f"rule `{r.name}`'s shapes cannot be compared: {exc}")
                v = shape_proofs.included(part, *pair, decide, limits)
                if v.verdict != "proved":
                    return links, replace(v, setting=f"the {part} shape of rule `{r.name}` against `{their_owner}`'s")
                links.append(z3.Implies(sym.shape_input(part, their_key), sym.shape_input(part, mine_key)))
    return links, None


def _declared_rule(artifact: Artifact, connection: str, rule: str):
    """The declared rule `rule` of `connection` in `artifact` (None when either is missing)."""
    conn = artifact.connection(connection)
    return next((r for r in conn.rules if r.name == rule), None) if conn is not None else None


def _nicer_ip(ip, worker: Worker, judge: WorkerJudge, spec: AddressSpec, ctx: z3.Context):
    """Replace a solver-chosen address by the first host address of the offending hole, when that shows the same."""
    for cidr in worker.allow_cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        for entry in judge.table.ranges:
            other = entry.network
            if other.version != net.version or not net.overlaps(other):
                continue
            inter = net if net.prefixlen >= other.prefixlen else other
            cand = inter.network_address + (1 if inter.num_addresses > 1 else 0)
            if judge.judge(cand)[0] and not _holds(spec.public(*_address_value(ctx, cand))):
                return cand
    return ip


def _address_cex(worker: Worker, prop: str, ip, table: SpecialPurposeTable, judge: WorkerJudge, request=None,
                 answers: tuple[str, ...] | None = None) -> Counterexample:
    rng = _range_of(table, ip, judge.rules)
    shown = ip.compressed
    if prop == "deny-cidrs":
        setting = f"deny_cidrs = {list(worker.deny_cidrs)}, ipv6 = {str(worker.ipv6).lower()}"
        head = f"{shown} is dialable but excluded by its settings"
    else:
        holes = [cidr for cidr in worker.allow_cidrs if _covers(cidr, ip, judge)]
        nat64 = [f.prefix for f in judge.rules if f.name == "nat64" and ip.version == 6 and core.in_form(f, int(ip))]
        if holes:
            setting, head = f"allow_cidrs = {holes}", f"allow_cidrs admits {shown}"
        elif nat64:
            setting, head = f"nat64_prefixes = {nat64}", f"nat64_prefixes admit {shown} (judged by its embedded IPv4 only)"
        else:
            setting, head = "the address judgement", f"admits {shown}"
        if rng:
            head += f" ({rng['name']}, {rng['reference']})"
    summary = f"worker `{worker.name}`: {head}"
    if request is not None:
        summary += f" for `{request_line(request)}`"
    return Counterexample(summary=summary, request=request, resolved_ips=answers or (shown,), ip_range=rng, setting=setting)


def _covers(cidr: str, ip, judge: WorkerJudge) -> bool:
    net = ipaddress.ip_network(cidr, strict=False)
    cands = [ip]
    if ip.version == 6:
        cands += [ipaddress.IPv4Address(core.embedded(f, int(ip))) for f in judge.rules if core.in_form(f, int(ip))]
    return any(c.version == net.version and c in net for c in cands)


def _redirect_cex(ev: Evaluator, w: core.WorkerTable, worker: Worker, limits: Limits, first_line: str | None, request=None):
    """None when the core never follows; a Counterexample with the chain otherwise; a string when unknown."""
    ctx = ev.ctx
    status = z3.BitVec("status", 16, ctx)
    wf = z3.And(z3.UGE(status, z3.BitVecVal(100, 16, ctx)), z3.ULE(status, z3.BitVecVal(599, 16, ctx)))
    out = check(ctx, [wf, ev.bool_term(follows(ev, w, status, 0))], limits, [status == z3.BitVecVal(302, 16, ctx)])
    if out.status == "unknown":
        return out.reason
    if out.status == "unsat":
        return None
    code = out.model.eval(status, model_completion=True).as_long()
    chain = ({"status": code, "location": REDIRECT_TARGET, "issued": True},)
    setting = f"follow_redirects = {str(worker.follow_redirects).lower()}, max_redirects = {worker.max_redirects}"
    first = f"`{first_line}` " if first_line else ""
    summary = f"worker `{worker.name}`: {first}{code} Location: {REDIRECT_TARGET} → second request issued ({setting})"
    return Counterexample(summary=summary, request=request, redirect_chain=chain, setting=setting)


# ---------------------------------------------------------------------------------------------
# subject-level checks
# ---------------------------------------------------------------------------------------------


def subject_checks(c: Ctx, worker: Worker, kind: str, name: str) -> list[Result]:
    subj, w = f"{kind}:{name}", worker.name
    props = [p for p in subject_properties(c.artifact, kind, name) if p not in SEPARATE]
    old_subject = declared(c.old, kind, name) if c.old is not None else None
    if old_subject is not None:
        props.append("no-widening")
    if c.ceiling is not None:
        props.append("within")
    start = time.perf_counter()
    try:
        checks = _SubjectChecks(c, worker, kind, name, old_subject)
    except (ValueError, CatalogError) as exc:  # the worker is malformed: decide() denies everything (worker-unknown)
        cex = Counterexample(summary=f"{kind} `{name}` admits no request: its worker `{w}` is malformed ({exc})")
        return [_res(w, subj, p, "refuted", cex) if p == "vacuity" else
                _res(w, subj, p, "proved", detail="the subject admits no request (its worker is malformed)") for p in props]
    except Unsupported as exc:
        return [_res(w, subj, p, "unknown", detail=f"the core cannot be evaluated symbolically: {exc}") for p in props]
    results = []
    for prop in props:
        def run(prop: str = prop) -> Result:
            try:
                return getattr(checks, prop.replace("-", "_"))()
            except Unsupported as exc:
                return _res(w, subj, prop, "unknown", detail=f"the core cannot be evaluated symbolically: {exc}")
            except Exception as exc:  # any crash of a check is its `unknown`, never the prover's
                return crashed(w, subj, prop, exc)
        results.append(_timed(run))
    # the first check's time includes running the core symbolically for this subject
    encoding = int((time.perf_counter() - start) * 1000) - sum(r.time_ms for r in results)
    results[0] = replace(results[0], time_ms=results[0].time_ms + max(0, encoding))
    return results


class _SubjectChecks:
    """The checks of one subject, over one symbolic request in one fresh context (so batching changes nothing)."""

    def __init__(self, c: Ctx, worker: Worker, kind: str, name: str, old_subject) -> None:
        self.c, self.worker, self.kind, self.name = c, worker, kind, name
        self.subj, self.w = f"{kind}:{name}", worker.name
        self.ctx = z3.Context()
        self.ev = Evaluator(self.ctx)
        self.declared: Connection | SandboxProfile = declared(c.artifact, kind, name)  # type: ignore[assignment]
        self.table = subject_table(c.artifact, c.table, kind, name)
        assert self.table is not None
        self.old_table = subject_table(c.old, c.table, kind, name) if old_subject is not None else None  # type: ignore[arg-type]
        # prove --within: the ceiling subject that bounds this one (None: the ceiling has none, so it admits nothing)
        self.ceil_name = c.ceiling.name_for(kind, name) if c.ceiling is not None else name
        self.ceil_subject = declared(c.ceiling.artifact, kind, self.ceil_name) if c.ceiling is not None else None
        self.ceil_table = (subject_table(c.ceiling.artifact, c.table, kind, self.ceil_name)  # type: ignore[union-attr]
                           if self.ceil_subject is not None else None)
        # The connections whose credential this subject's requests may carry, as declared: the connection itself,
        # or those a profile lists in `brokers`.
        self.owners = owners(c.artifact, self.declared)
        subjects = [self.declared, *self.owners] + ([old_subject, *owners(c.old, old_subject)] if old_subject is not None else [])
        if self.ceil_subject is not None:
            subjects += [self.ceil_subject, *owners(c.ceiling.artifact, self.ceil_subject)]  # type: ignore[union-attr]
        tables = (self.table, self.old_table, self.ceil_table)
        prefixes = [r.prefix for t in tables if t is not None for r in t.rules if r.prefix]
        for s in subjects:
            if isinstance(s, Connection):
                prefixes += spec_requests.path_constants(s)
        self.uni = Universe.build([s for s in subjects if s is not None], prefixes, tables)
        self.sym = SymbolicRequest(self.ev, self.uni)
        self.out: Outcome = outcome(self.ev, self.table, self.sym)
        self._specs: dict[str, AddressSpec] = {}
        self.spec = self.spec_of(worker)
        self.judge = worker_judge(worker, c.table)
        self.lease = subject_lease(kind, name)

    # -- helpers ----------------------------------------------------------------------------------

    def res(self, prop: str, verdict: str, cex: Counterexample | None = None, detail: str = "") -> Result:
        return _res(self.w, self.subj, prop, verdict, cex, detail)

    def replay(self, req, ips, artifact: Artifact | None = None):
        return self.c.decide(artifact or self.c.artifact, self.lease, req, list(ips))

    def solve(self, assertions: list, prefer: list | None = None, strings: bool = False):
        return check(self.ctx, [self.sym.wf, *assertions], self.c.limits,
                     prefer if prefer is not None else clean(self.sym) + nice_ip(self.sym), strings)

    def spec_of(self, worker: Worker) -> AddressSpec:
        if worker.name not in self._specs:
            self._specs[worker.name] = AddressSpec(self.ctx, self.c.table, worker)
        return self._specs[worker.name]

    def judging_worker(self, carrier: str | None) -> Worker:
        """The worker that judges a request carrying `carrier`'s credential, as declared: that connection's
        `worker`; the subject's own (the default worker for a profile) for a request that carries none."""
        conn = self.c.artifact.connection(carrier) if carrier is not None else None
        worker = self.c.artifact.worker(conn.worker) if conn is not None else None
        return worker if worker is not None else self.worker

    def judging(self) -> list[tuple[Any, Worker]]:
        """(guard, declared worker) for every worker that may judge the symbolic request, by the credential it carries."""
        groups: dict[str, tuple[Worker, list]] = {}
        for g, name in self.ev.alternatives(self.out.carrier):
            w = self.judging_worker(name)
            groups.setdefault(w.name, (w, []))[1].append(g)
        return [(self.ev.or_(*gs), w) for w, gs in groups.values()]

    def carried(self, d) -> str | None:
        """Whose credential a replayed decision attached (None: none)."""
        if not d.allowed:
            return None
        return self.name if self.kind == "connection" else d.broker

    def example(self, extra: list | None = None) -> tuple[Any, tuple[str, ...], Any] | str | None:
        """An admitted request (request, answers, decision), None if there is none, or why unknown."""
        o = self.solve([self.out.allowed, *(extra or [])])
        if o.status != "sat":
            return o.reason if o.status == "unknown" else None
        req, ips = concretize(o.model, self.sym)
        d = self.replay(req, ips)
        if not d.allowed and d.reason in HEAD_SHAPE_REASONS:
            req = self.shaped_example(o.model, req)
            d = self.replay(req, ips)
        return req, ips, d

    def shaped_example(self, model, req):
        """The witness `req` with its target replaced by one the admitting rule's head shapes admit (the model takes a
        shape's verdict as a free input, so its path is only one of the rule's prefix)."""
        view = artifact_index(self.c.artifact, self.c.table).view(self.lease)[0]
        for g, i in self.ev.alternatives(self.out.rule):
            if not z3.is_true(model.eval(self.ev.bool_term(g), model_completion=True)):
                continue
            shape = view.shapes[i] if view is not None and view.shapes and 0 <= i < len(view.shapes) else None
            target = example_target(shape) if shape is not None else None
            if target is not None:
                return replace(req, target=target)
        return req

    # -- the properties ---------------------------------------------------------------------------------

    def vacuity(self) -> Result:
        if self.kind == "profile" and self.declared.network.mode == "none":  # type: ignore[union-attr]
            return self.res("vacuity", "proved", detail="network none: admits nothing by design (not a vacuous proof)")
        shaped = self._shape_verdicts(shape_proofs.vacuity)
        refuted = next((v for v in shaped or () if v.verdict == "refuted"), None)
        if refuted is not None:  # a template, tool, field or pattern that admits nothing (the request witness may fail too)
            return self._shape_result("vacuity", refuted)
        found = self.example()
        if isinstance(found, tuple) and not found[1]:
            # A witness is a request admitted on at least one judged resolver answer. One admitted on none had nothing
            # judged (the dialer would resolve the name itself): no witness of anything (public-only refutes it).
            req, ips, d = found
            found = self.example([self.sym.answers[0][0]])
            if found is None:
                cex = Counterexample(summary=f"{self.kind} `{self.name}` admits requests only with no resolver answer judged, "
                                     f"e.g. `{request_line(req)}`: every proof about its answers is vacuous",
                                     request=req, resolved_ips=ips, decision=decision_dict(d))
                return self.res("vacuity", "refuted", cex) if d.allowed else _not_replayed(self.w, self.subj, "vacuity", cex)
        if isinstance(found, str):
            return _unknown(self.w, self.subj, "vacuity", found)
        if found is None:
            cex = Counterexample(summary=f"{self.kind} `{self.name}` admits no request at all: every proof about it is vacuous")
            return self.res("vacuity", "refuted", cex)
        req, ips, d = found
        if not d.allowed or not ips:
            return _not_replayed(self.w, self.subj, "vacuity", Counterexample(
                summary="witness denied" if not d.allowed else "witness admitted on no answer", request=req,
                resolved_ips=ips, decision=decision_dict(d)))
        detail = f"admits e.g. `{request_line(req)}` ({ips[0]})"
        if shaped is not None:
            bad = next((v for v in shaped if v.verdict == "unknown"), None)
            if bad is not None:
                return self._shape_result("vacuity", bad)
            if shaped:
                detail += f"; each of {len(shaped)} templates, tools, root fields and push patterns admits a witness"
        return self.res("vacuity", "proved", detail=detail)

    # -- request shapes (docs/shapes.md) ------------------------------------------------------------------

    def _shape_verdicts(self, check: Callable) -> list | None:
        """`check` (`proofs.shapes.confined` or `.vacuity`) on every shaped rule of a connection (None for a profile)."""
        if self.kind != "connection":
            return None
        return rule_verdicts(self.c, self.declared, self.lease, check)  # type: ignore[arg-type]

    def _shape_result(self, prop: str, v) -> Result:
        return shape_result(self.w, self.kind, self.name, prop, v)

    def shape_gate(self) -> Result:
        """The core admits under a rule only when its head shapes admit the request (any verdict of them), and a POST
        admitted under a rule with a body shape is handed on for its body to be judged (a replayed witness per rule)."""
        ev, sym, out = self.ev, self.sym, self.out
        heads = [(i, r) for i, r in enumerate(self.table.rules) if r.head_shape]
        if heads:
            bad = ev.or_(*[ev.and_(ev.eq(out.rule, i), sym.shape_input("head", r.head_shape)) for i, r in heads])
            o = self.solve([out.allowed, ev.bool_term(bad)])
            if o.status == "unknown":
                return _unknown(self.w, self.subj, "shape-gate", o.reason)
            if o.status == "sat":
                return self._gate_cex(o.model, heads)
        view = artifact_index(self.c.artifact, self.c.table).view(self.lease)[0]
        checked = 0
        for i, r in enumerate(self.table.rules):
            shape = view.shapes[i] if view is not None and view.shapes and i < len(view.shapes) else None
            if not r.body_shape or shape is None or "POST" not in r.methods:
                continue
            expected = "git" if shape.git is not None else shape.body
            if expected == "git" and not shape.git.push:  # type: ignore[union-attr]
                continue
            post = self.uni.methods.index("POST")
            found = self.example([ev.bool_term(ev.eq(out.rule, i)), sym.method == z3.BitVecVal(post, ID_BITS, self.ctx)])
            if isinstance(found, str):
                return _unknown(self.w, self.subj, "shape-gate", found)
            if found is None:
                continue  # the rule admits no POST: no body to judge
            req, ips, _ = found
            base = "" if shape.prefix == "/" else shape.prefix
            target = f"{base}/git-receive-pack" if expected == "git" else (example_target(shape) or req.target)
            req = replace(req, target=target, method="POST", has_body=True)
            d = self.replay(req, ips)
            cex = Counterexample(summary=f"`{request_line(req)}` is admitted under rule `{r.name}` without its {expected} body "
                                 "being judged", request=req, resolved_ips=ips, rule=d.rule, decision=decision_dict(d))
            if not (d.allowed and d.rule == r.name):
                return _not_replayed(self.w, self.subj, "shape-gate", cex)
            if d.body_shape != expected:
                return self.res("shape-gate", "refuted", cex)
            checked += 1
        return self.res("shape-gate", "proved", detail=f"{len(heads)} rules with head shapes; {checked} body shapes handed on")

    def _gate_cex(self, model, heads) -> Result:
        """A request the core admits under rule i although i's head shape refused it: made concrete with a target that
        rule's real shape refuses, and replayed."""
        req, ips = concretize(model, self.sym)
        view = artifact_index(self.c.artifact, self.c.table).view(self.lease)[0]
        i = next((j for g, j in self.ev.alternatives(self.out.rule) if z3.is_true(model.eval(self.ev.bool_term(g), model_completion=True))), -1)
        shape = view.shapes[i] if view is not None and view.shapes and 0 <= i < len(view.shapes) else None
        name = self.table.rules[i].name if 0 <= i < len(self.table.rules) else "?"
        tries = [req, replace(req, target=req.target.rstrip("/") + "/zz-egresslaw"), replace(req, target=req.target + "?zz_egresslaw=1")]
        for cand in tries:
            seen = self._observed(cand)
            if shape is None or seen is None:
                break
            query = cand.target.split("?", 1)[1] if "?" in cand.target else None
            refused = judge_head(shape, seen.method, seen.path, query, cand.headers)[0]
            if not refused:
                continue
            d = self.replay(cand, ips)
            cex = Counterexample(summary=f"`{request_line(cand)}` is admitted under rule `{name}`, whose head shape refuses it "
                                 f"({refused})", request=cand, resolved_ips=ips, rule=d.rule, decision=decision_dict(d))
            if d.allowed and d.rule == name:
                return self.res("shape-gate", "refuted", cex)
            return _not_replayed(self.w, self.subj, "shape-gate", cex)
        return _not_replayed(self.w, self.subj, "shape-gate", Counterexample(
            summary=f"the core admits under rule `{name}` when its head shape refuses, but no request its shape refuses was "
                    "found to show it", request=req, resolved_ips=ips))

    def _answers(self, prop: str, violated: Callable[[AddressSpec, Any, Any], Any]) -> Result:
        """An admitted request was judged on at least one resolver answer, and every present answer satisfies the
        statement of the worker that judges it as declared."""
        ev, sym = self.ev, self.sym
        judging = [(g, self.spec_of(w)) for g, w in self.judging()]
        bad = ev.or_(*[ev.and_(present, ev.or_(*[ev.and_(g, violated(spec, is6, x)) for g, spec in judging]))
                       for present, is6, x in sym.answers])
        prefer = clean(self.sym)
        o = self.solve([self.out.allowed, ev.bool_term(bad)], prefer)
        if o.status == "unsat":
            # present answers come first: none at all is an admission on nothing judged (the dialer would resolve the
            # name again, and dial what that lookup returns, unjudged)
            o = self.solve([self.out.allowed, z3.Not(sym.answers[0][0])], prefer)
        if o.status == "unknown":
            return _unknown(self.w, self.subj, prop, o.reason)
        if o.status == "unsat":
            return self.res(prop, "proved")
        req, ips = concretize(o.model, sym)
        d = self.replay(req, ips)
        worker = self.judging_worker(self.carried(d))
        if not ips:
            cex = Counterexample(
                summary=f"{self.kind} `{self.name}`: `{request_line(req)}` is admitted with no resolver answer judged "
                        f"(the worker `{worker.name}` never saw what would be dialled)",
                request=req, resolved_ips=ips, decision=decision_dict(d), setting="the answers judgement (none judged)",
                extra={"worker": worker.name} if worker.name != self.worker.name else {})
            return self.res(prop, "refuted", cex) if d.allowed else _not_replayed(self.w, self.subj, prop, cex)
        spec, judge = self.spec_of(worker), worker_judge(worker, self.c.table)

        def violates(ip) -> bool:
            return _holds(violated(spec, *_address_value(self.ctx, ip)))

        offending = next((ipaddress.ip_address(ip) for ip in ips if violates(ipaddress.ip_address(ip))), ipaddress.ip_address(ips[0]))
        if prop == "public-only" and len(ips) == 1:
            nicer = _nicer_ip(offending, worker, judge, spec, self.ctx)
            if nicer != offending and self.replay(req, [nicer.compressed]).allowed:
                offending, ips = nicer, (nicer.compressed,)
                d = self.replay(req, ips)
        cex = replace(_address_cex(worker, prop, offending, self.c.table, judge, req, ips), decision=decision_dict(d),
                      extra={"worker": worker.name} if worker.name != self.worker.name else {})
        shown = d.allowed and violates(offending)
        return self.res(prop, "refuted", cex) if shown else _not_replayed(self.w, self.subj, prop, cex)

    def public_only(self) -> Result:
        return self._answers_and_endpoint("public-only", lambda spec, a, b: z3.Not(spec.public(a, b)))

    def deny_cidrs(self) -> Result:
        return self._answers_and_endpoint("deny-cidrs", lambda spec, a, b: spec.denied(a, b))

    def _answers_and_endpoint(self, prop: str, violated: Callable[[AddressSpec, Any, Any], Any]) -> Result:
        """The property for the subject's requests, then for its token endpoint: the edge dials a minting connection's
        endpoint on `core.mint_verdict` over the table the proxy's index picks for it (`ArtifactIndex.token_view`, the
        composition `judge_token_answers` runs), which must admit only answers the connection's declared worker allows,
        and at least one."""
        first = self._answers(prop, violated)
        mint = getattr(self.declared, "mint", None)
        if first.verdict != "proved" or self.kind != "connection" or mint is None or not mint.token_host:
            return first
        endpoint = f"the token endpoint `{mint.token_host}:{mint.token_port}`"
        view = artifact_index(self.c.artifact, self.c.table).token_view(self.name)
        if view is None:  # the edge refuses to mint (worker-unknown): nothing is dialled
            return replace(first, detail=f"{first.detail + '; ' if first.detail else ''}{endpoint} is never dialled")
        ev, sym = self.ev, self.sym
        ev.new_run()
        answers = sym.answer_list()
        reason = ev.call(core.mint_verdict, view.subject, answers)
        sym.check_answers(answers)
        worker = self.judging_worker(self.name)  # the connection's worker, as declared
        spec = self.spec_of(worker)
        bad = ev.or_(*[ev.and_(present, violated(spec, is6, x)) for present, is6, x in sym.answers])
        o = self.solve([ev.bool_term(ev.eq(reason, "")), ev.bool_term(bad)], clean(sym))
        if o.status == "unsat":  # and at least one answer judged
            o = self.solve([ev.bool_term(ev.eq(reason, "")), z3.Not(sym.answers[0][0])], clean(sym))
        if o.status == "unknown":
            return _unknown(self.w, self.subj, prop, o.reason)
        if o.status == "unsat":
            return replace(first, detail=f"{first.detail + '; ' if first.detail else ''}{endpoint} too")
        _, ips = concretize(o.model, sym)
        d = judge_token_answers(self.c.artifact, self.name, list(ips))
        extra = {"token_endpoint": f"{mint.token_host}:{mint.token_port}", "worker": worker.name}
        if not ips:
            cex = Counterexample(summary=f"{endpoint} may be dialled with no resolver answer judged (connection `{self.name}`)",
                                 resolved_ips=ips, decision=decision_dict(d), extra=extra)
            return self.res(prop, "refuted", cex) if d.allowed else _not_replayed(self.w, self.subj, prop, cex)
        ip = next((ipaddress.ip_address(i) for i in ips if _holds(violated(spec, *_address_value(self.ctx, ipaddress.ip_address(i))))),
                  ipaddress.ip_address(ips[0]))
        base = _address_cex(worker, prop, ip, self.c.table, worker_judge(worker, self.c.table), None, ips)
        cex = replace(base, summary=f"{endpoint} is dialled at `{ip.compressed}` when it resolves to {list(ips)}: {base.summary}",
                      decision=decision_dict(d), extra=extra)
        return self.res(prop, "refuted", cex) if d.allowed else _not_replayed(self.w, self.subj, prop, cex)

    def no_redirect(self) -> Result:
        # every worker that may judge one of the subject's requests (a brokering profile's: its connections' too)
        idle = ""
        for guard, table in self.ev.alternatives(self.out.worker):
            worker = self.c.artifact.worker(table.name) or self.worker
            cex = _redirect_cex(self.ev, table, worker, self.c.limits, None)
            if isinstance(cex, str):
                return _unknown(self.w, self.subj, "no-redirect", cex)
            if cex is None:
                continue
            found = self.example([self.ev.bool_term(guard)])
            if isinstance(found, str):
                return _unknown(self.w, self.subj, "no-redirect", found)
            if found is None:
                idle = "the subject admits no request, so none is redirected"
                continue
            req, ips, d = found
            cex = _redirect_cex(self.ev, table, worker, self.c.limits, request_line(req), req)
            cex = replace(cex, resolved_ips=ips, decision=decision_dict(d))  # type: ignore[arg-type]
            return self.res("no-redirect", "refuted", cex) if d.allowed else _not_replayed(self.w, self.subj, "no-redirect", cex)
        return self.res("no-redirect", "proved", detail=idle)

    def credential_scope(self) -> Result:
        ev, obs = self.ev, self.out.obs
        names, carrier = self.out.rule_name(ev), self.out.carrier
        # as declared: the carrying connection is the subject itself or one the profile lists in `brokers`, and the
        # rule the decision names is one of that connection's rules that admits the request
        in_scope = ev.or_(*[ev.and_(ev.eq(carrier, conn.name), ev.eq(names, r.name), spec_requests.rule_admits(ev, r, obs))
                            for conn in self.owners for r in conn.rules])
        carrying = ev.and_(self.out.allowed, ev.not_(ev.eq(carrier, None)))
        o = self.solve([ev.bool_term(carrying), ev.bool_term(ev.not_(in_scope))])
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "credential-scope", o.reason)
        if o.status == "unsat":
            return self.res("credential-scope", "proved")
        req, ips = concretize(o.model, self.sym)
        d = self.replay(req, ips)
        owner = self.carried(d)
        conn = next((c for c in self.owners if c.name == owner), None)
        rule = next((r for r in conn.rules if r.name == d.rule), None) if conn is not None else None
        seen = self._observed(req)
        if owner is not None and conn is None:
            why = f"`{owner}` is not in the `brokers` of profile `{self.name}`"
        else:
            why = _out_of_scope(rule, seen) if rule is not None and seen is not None else "no rule of its own"
        brokered = f" (brokered for profile `{self.name}`)" if self.kind == "profile" else ""
        cex = Counterexample(
            summary=f"`{request_line(req)}` gets the credential of connection `{owner}`{brokered} under rule `{d.rule}` ({why})",
            request=req, resolved_ips=ips, rule=d.rule, decision=decision_dict(d))
        shown = owner is not None and (rule is None or not self._admitted_as_declared(rule, req))
        return self.res("credential-scope", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "credential-scope", cex)

    def _admitted_as_declared(self, rule, req) -> bool:
        """The statement on the concrete request, through the adapter's own reading of it."""
        seen = self._observed(req)
        return seen is not None and _holds(self.ev.bool_term(spec_requests.rule_admits(self.ev, rule, seen)))

    def _rule_of(self, i: int) -> tuple[Connection | None, Any]:
        """The declared connection and rule behind rule `i` of the core's table (a profile's: of the broker it belongs to)."""
        owner = self.name if self.kind == "connection" else self.table.owners[i].name
        conn = next((c for c in self.owners if c.name == owner), None)
        rule = next((r for r in conn.rules if r.name == self.table.rules[i].name), None) if conn is not None else None
        return conn, rule

    def _expected_header(self, owner: str | None) -> str | None:
        """The credential header a request carrying `owner`'s credential must use, as declared ("" : none is right)."""
        if owner is None:
            return None
        conn = next((c for c in self.owners if c.name == owner), None)
        return conn.inject.header.lower() if conn is not None else ""

    def _bad_name(self, i: int, name: z3.SeqRef) -> Any:
        """Header `name` must not travel under rule `i` (-1: plain profile traffic): denylisted, or off the declared allowlist."""
        if i < 0:
            return spec_requests.denied_name(name, None)
        conn, rule = self._rule_of(i)
        if conn is None or rule is None:
            return z3.BoolVal(True, self.ctx)
        return z3.Or(spec_requests.denied_name(name, conn.inject.header, conn.kind), z3.Not(spec_requests.allowlisted(name, rule)))

    def _bad_text(self, d, hdr: str) -> bool:
        """`_bad_name` on a replayed decision."""
        owner = self.carried(d)
        if owner is None:
            return spec_requests.denied_text(hdr, None)
        conn = next((c for c in self.owners if c.name == owner), None)
        rule = next((r for r in conn.rules if r.name == d.rule), None) if conn is not None else None
        if conn is None or rule is None:
            return True
        return spec_requests.denied_text(hdr, conn.inject.header, conn.kind) or hdr not in {h.lower() for h in rule.headers}

    def header_safety(self) -> Result:
        ev, sym = self.ev, self.sym
        # 1. what the artifact's allowlists ask for (the compiler refuses these; a hand-built artifact may not)
        for i in range(len(self.table.rules)):
            conn, r = self._rule_of(i)
            if conn is None or r is None:
                continue
            asked = [h for h in r.headers if spec_requests.denied_text(h, conn.inject.header, conn.kind)]
            if not asked:
                continue
            o = self.solve([self.out.allowed, ev.bool_term(ev.eq(self.out.rule, i))])
            if o.status != "sat":
                continue  # the rule admits nothing: its allowlist is never used
            req, ips = concretize(o.model, sym)
            title = "-".join(p.capitalize() for p in asked[0].split("-"))
            req = replace(req, headers=req.headers + ((title, "v"),))
            d = self.replay(req, ips)
            cex = Counterexample(
                summary=f"connection `{conn.name}`: header `{title}` forwarded per the allowlist of rule `{r.name}`"
                        " (the decision drops it at run time; the compiler never admits it)",
                request=req, resolved_ips=ips, header=asked[0], rule=r.name, decision=decision_dict(d),
                setting=f"headers = {list(r.headers)}")
            if d.allowed and d.rule == r.name:
                return self.res("header-safety", "refuted", cex)
            return _not_replayed(self.w, self.subj, "header-safety", cex)
        # 2. the credential rides in exactly the declared header of the connection whose credential it is (plain
        # profile traffic, and a profile that brokers nothing, never carry one)
        carried = credential_header(ev, self.out)  # header names compare case-insensitively
        lowered = ev.choice([(g, v.lower() if isinstance(v, str) else v) for g, v in ev.alternatives(carried)])
        wrong = ev.or_(*[ev.and_(g, ev.not_(ev.eq(lowered, self._expected_header(owner))))
                         for g, owner in ev.alternatives(self.out.carrier)])
        o = self.solve([self.out.allowed, ev.bool_term(wrong)]) if wrong is not False else None
        if o is not None and o.status == "sat":
            req, ips = concretize(o.model, sym)
            d = self.replay(req, ips)
            expected = self._expected_header(self.carried(d))
            said = f"not the declared `{expected}`" if expected else (
                "a profile never carries one" if expected is None or not self.owners else "its connection is not brokered here")
            rides = f"rides in `{d.inject_header}`" if d.inject_header else "is named no header"
            cex = Counterexample(summary=f"{self.kind} `{self.name}`: the credential {rides}, {said}",
                                 request=req, resolved_ips=ips, decision=decision_dict(d))
            if expected is None:
                shown = d.allowed and d.inject_header is not None
            else:  # "": the credential of a connection this subject does not broker; any header is wrong
                shown = d.allowed and (expected == "" or (d.inject_header or "").lower() != expected)
            return self.res("header-safety", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "header-safety", cex)
        if o is not None and o.status == "unknown":
            return _unknown(self.w, self.subj, "header-safety", o.reason)
        # 3. any header name at all. First over every rule at once, the request left out (a weaker premise:
        # unsat there is a proof); only if that finds a name, the full question yields a replayable request.
        name = sym.header()
        first = -1 if self.kind == "profile" else 0
        indices = list(range(first, len(self.table.rules))) or [0]
        any_rule = z3.BitVec("any_rule", 16, self.ctx)
        picks = [(any_rule == z3.BitVecVal(i & 0xFFFF, 16, self.ctx), i) for i in indices]
        rules = ev.choice(picks)
        bad_any = z3.Or([z3.And(g, self._bad_name(i, sym.name)) for g, i in picks])
        loose = ev.and_(ev.call(core.forwarded, self.table, rules, name, sym.name_listed), bad_any)
        o = check(self.ctx, [sym.header_wf, ev.bool_term(loose)], self.c.limits, strings=True)
        if o.status == "unsat":
            return self.res("header-safety", "proved")
        rule_alts = ev.alternatives(self.out.rule) if not isinstance(self.out.rule, int) else ((True, self.out.rule),)
        bad = ev.or_(*[ev.and_(g, self._bad_name(i, sym.name)) for g, i in rule_alts])
        leak = ev.and_(forwarded(ev, self.out, name, sym.name_listed), bad)
        injects = {c.inject.header.lower() for c in self.owners}
        written = {h for c in self.owners for h in spec_requests.EDGE_WRITTEN.get(c.kind, ())}
        familiar = sorted(spec_requests.DENYLIST | {"x-forwarded-host", "x-forwarded-for", "proxy-foo"} | injects | written)
        prefer = clean(sym) + [z3.Or([sym.name == z3.StringVal(n, self.ctx) for n in familiar])]
        o = self.solve([sym.header_wf, ev.bool_term(leak)], prefer, strings=True)
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "header-safety", o.reason)
        if o.status == "unsat":
            return self.res("header-safety", "proved")
        req, ips = concretize(o.model, sym, header=True)
        hdr = o.model.eval(sym.name, model_completion=True).as_string()
        d = self.replay(req, ips)
        title = "-".join(p.capitalize() for p in hdr.split("-"))
        via = f" (rule `{d.rule}`" + (f" of `{d.broker}`" if d.broker else "") + ")" if d.rule else ""
        owner = next((c for c in self.owners if c.name == self.carried(d)), None)
        off = "" if spec_requests.denied_text(hdr, self._expected_header(self.carried(d)) or None, owner.kind if owner else "static") \
            or not d.rule else ", off its allowlist"
        cex = Counterexample(summary=f"{self.kind} `{self.name}`: header `{title}` forwarded{via}{off}",
                             request=req, resolved_ips=ips, header=hdr, rule=d.rule, decision=decision_dict(d))
        shown = d.allowed and hdr in {n.lower() for n, _ in d.forward_headers} and self._bad_text(d, hdr)
        return self.res("header-safety", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "header-safety", cex)

    def worker_switches(self) -> Result:
        """An admitted request's IP-literal host obeys every switch of the worker that judges it as declared (observe
        mode included): none at all with `ip_literals = false`, else public, outside `deny_cidrs`, IPv4 with `ipv6 = false`."""
        ev, obs = self.ev, self.out.obs
        bad = ev.or_(*[ev.and_(g, spec_switches.literal_refused(self.spec_of(w), w, obs.is_ip, obs.ip6, obs.ip))
                       for g, w in self.judging()])
        o = self.solve([self.out.allowed, ev.bool_term(bad)], clean(self.sym) + nice_ip(self.sym) + [z3.Not(self.sym.lit6)])
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "worker-switches", o.reason)
        if o.status == "unsat":
            return self.res("worker-switches", "proved")
        req, ips = concretize(o.model, self.sym)
        d = self.replay(req, ips)
        worker = self.judging_worker(self.carried(d))
        spec = self.spec_of(worker)
        seen = self._observed(req)
        refused, why = False, "no IP literal on replay"
        if seen is not None and _holds(seen.is_ip):
            is6, x = z3.BoolVal(bool(seen.ip6), self.ctx), z3.BitVecVal(seen.ip, 128, self.ctx)
            refused = _holds(spec_switches.literal_refused(spec, worker, True, is6, x))
            if not worker.ip_literals:
                why = "`ip_literals = false`"
            elif _holds(spec.denied(is6, x)):
                why = "`ipv6 = false`" if seen.ip6 and not worker.ipv6 else f"`deny_cidrs = {list(worker.deny_cidrs)}`"
            else:
                rng = _range_of(self.c.table, ipaddress.ip_address(seen.host), worker_judge(worker, self.c.table).rules)
                why = "not public" + (f" ({rng['name']}, {rng['reference']})" if rng else "")
        observed = " (observe mode)" if self.kind == "profile" and spec_requests.observed(self.declared) else ""  # type: ignore[arg-type]
        cex = Counterexample(
            summary=f"{self.kind} `{self.name}`{observed}: `{request_line(req)}` is admitted, an IP-literal host worker "
                    f"`{worker.name}` refuses: {why}",
            request=req, resolved_ips=ips, rule=d.rule, decision=decision_dict(d),
            setting=f"ip_literals = {str(worker.ip_literals).lower()}, ipv6 = {str(worker.ipv6).lower()}, "
                    f"allow_cidrs = {list(worker.allow_cidrs)}, deny_cidrs = {list(worker.deny_cidrs)}",
            extra={"worker": worker.name} if worker.name != self.worker.name else {})
        shown = d.allowed and refused
        return self.res("worker-switches", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "worker-switches", cex)

    def profile_scope(self) -> Result:
        ev = self.ev
        prof: SandboxProfile = self.declared  # type: ignore[assignment]
        inside = spec_requests.profile_admits(ev, prof, self.out.obs)
        o = self.solve([self.out.allowed, ev.bool_term(ev.not_(inside))])
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "profile-scope", o.reason)
        if o.status == "unsat":
            return self.res("profile-scope", "proved")
        req, ips = concretize(o.model, self.sym)
        d = self.replay(req, ips)
        cex = Counterexample(summary=f"profile `{self.name}` admits `{request_line(req)}`, outside its allowlist",
                             request=req, resolved_ips=ips, decision=decision_dict(d),
                             setting=f"allowed_hosts = {[f'{h.host}:{h.port}' for h in prof.network.allowed_hosts]}")
        seen = self._observed(req)
        shown = d.allowed and seen is not None and not _holds(ev.bool_term(spec_requests.profile_admits(ev, prof, seen)))
        return self.res("profile-scope", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "profile-scope", cex)

    def dns_confined(self) -> Result:
        """A front end resolves a name only for a request the core admitted before any address (a request:
        `core.request_verdict`, the `admitted` of `core.verdict`; a CONNECT: `core.connect_verdict`, read as the adapter
        reads one, https), and that name at its port is one of the subject's destinations as declared
        (`proofs/spec/resolution.py`); a profile in observe mode only resolves a name outside its allowlist as observed."""
        ev, obs, declared = self.ev, self.out.obs, self.declared
        confined = spec_resolution.confined(declared)
        inside = spec_resolution.resolvable(ev, declared, obs)
        if not confined:  # observe mode: any name, but outside the allowlist only as observed (would-deny)
            inside = ev.or_(inside, ev.not_(ev.eq(ev.call(core.observed_miss, self.table, obs), "")))
        ev.new_run()
        tunnel = ev.and_(ev.eq(ev.call(core.connect_verdict, self.table, obs), ""), ev.eq(obs.scheme, "https"))
        request_bad = ev.bool_term(ev.and_(self.out.pre, ev.not_(inside)))
        tunnel_bad = ev.bool_term(ev.and_(tunnel, ev.not_(inside)))
        o = self.solve([z3.Or(request_bad, tunnel_bad)])
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "dns-confined", o.reason)
        if o.status == "unsat":
            return self.res("dns-confined", "proved", detail=self._dns_detail(confined))
        req, ips = concretize(o.model, self.sym)
        if z3.is_true(o.model.eval(request_bad, model_completion=True)):
            d = self.c.decide(self.c.artifact, self.lease, req, None)  # decide_without_addresses: what admit() runs first
            shown_req, line = req, request_line(req)
        else:
            authority = (f"[{req.host}]" if ":" in req.host else req.host) + f":{req.port}"
            d = decide_connect(self.c.artifact, self.lease, authority, req.headers, req.has_body)
            shown_req, line = replace(req, method="CONNECT", scheme="https", target="/"), f"CONNECT {authority}"
        name = d.host or req.host
        observed = " (observe mode), not marked observed" if not confined else ""
        where = sorted(f"{h}:{p}" for h, p in spec_resolution.destinations(declared))
        cex = Counterexample(
            summary=f"{self.kind} `{self.name}`{observed}: `{line}` is admitted before any address, so `{name}` is resolved "
                    f"at port {req.port}, outside its declared destinations",
            request=shown_req, resolved_ips=ips, rule=d.rule, decision=decision_dict(d),
            setting=f"destinations = {where}",
            extra={"resolves": f"{name}:{req.port}", **({"connect": line.split(" ", 1)[1]} if shown_req is not req else {})})
        shown = d.allowed and not spec_resolution.resolvable_text(declared, d.host, req.port) and (confined or not d.observed)
        return self.res("dns-confined", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "dns-confined", cex)

    def _dns_detail(self, confined: bool) -> str:
        """What a proved dns-confined says of this subject: the names it may resolve (observe mode: any)."""
        names = sorted({h for h, _ in spec_resolution.destinations(self.declared)})
        if not confined:
            return (f"observe mode: resolves the names it observes (any host and port; outside its allowlist "
                    f"{', '.join(f'`{n}`' for n in names) or 'nothing'} each marked would-deny): DNS is not confined")
        if not names:
            return "resolves no name (it admits nothing before an address)"
        out = f"resolves only {', '.join(f'`{n}`' for n in names)}"
        mint = getattr(self.declared, "mint", None)
        if mint is not None and mint.token_host:
            out += f"; its token endpoint `{mint.token_host}` is the artifact's own (no request names it)"
        return out

    def _observed(self, req):
        """The adapter's own reading of a concrete request (to check a statement on it)."""
        seen = observe(self.c.artifact, self.lease, req)
        return seen[1] if seen is not None else None

    def trust_lane(self) -> Result:
        prof: SandboxProfile = self.declared  # type: ignore[assignment]
        if prof.trust == "adversarial" and prof.brokers:
            shown = ", ".join(f"`{b}`" for b in prof.brokers)
            cex = Counterexample(
                summary=f"profile `{self.name}`: adversarial and brokers {shown}: the credential would ride on requests the "
                        "adversary's code makes, so the adversary could use it (the decision core brokers nothing for it)",
                setting=f"trust = adversarial, brokers = {list(prof.brokers)}")
            return self.res("trust-lane", "refuted", cex)
        if prof.enforce == "observe" and (prof.trust == "adversarial" or prof.brokers):
            why = "adversarial: the adversary would reach any public host" if prof.trust == "adversarial" else \
                f"it brokers {', '.join(f'`{b}`' for b in prof.brokers)}: observe mode forwards requests no rule admits"
            cex = Counterexample(summary=f"profile `{self.name}`: declared `enforce = \"observe\"`, but {why} "
                                 "(the decision core enforces it anyway)",
                                 setting=f"enforce = observe, trust = {prof.trust}, brokers = {list(prof.brokers)}")
            return self.res("trust-lane", "refuted", cex)
        certified = prof.provider_certification == "security_boundary" and not prof.provider_missing_axes
        if prof.trust != "adversarial" or prof.network.mode == "none" or certified:
            return self.res("trust-lane", "proved")
        why = f"{prof.provider_certification} provider `{prof.provider}`"
        if prof.provider_missing_axes:
            why += f" lacking {', '.join(prof.provider_missing_axes)}"
        found = self.example()
        req, ips, dec = None, (), None
        if isinstance(found, tuple):
            req, ips, d = found
            dec = decision_dict(d)
            if not d.allowed:
                return _not_replayed(self.w, self.subj, "trust-lane", Counterexample(summary="example denied", request=req))
        summary = f"profile `{self.name}`: adversarial with {why} and allowlist egress"
        if req is not None:
            summary += f", e.g. `{request_line(req)}` is admitted"
        cex = Counterexample(summary=summary, request=req, resolved_ips=ips, decision=dec,
                             setting=f"trust = adversarial, network = allowlist, provider = {prof.provider}")
        return self.res("trust-lane", "refuted", cex)

    def _shape_links(self, other_art: Artifact, other_table, other_name: str, rename: dict[str, str], prop: str) -> tuple[list, Result | None]:
        """`shape_links` for this subject against `other_table` (the ceiling's or the old artifact's subject `other_name`):
        the links to add to the question, or this property's refuted (a replayed pair) or unknown result."""
        links, v = shape_links(self.sym, (self.c.artifact, self.table, self.kind, self.name), (other_art, other_table, other_name),
                               rename, self.c.decide, self.c.limits)
        if v is None:
            return links, None
        if v.verdict != "refuted" or v.request is None:
            return links, self.res(prop, "unknown", detail=v.summary)
        body = v.body.decode("utf-8", "backslashreplace") if v.body is not None else None
        cex = Counterexample(summary=f"{self.kind} `{self.name}`: {v.summary}", request=v.request, resolved_ips=(v.answer,),
                             rule=v.decision.rule if v.decision is not None else None, decision=decision_dict(v.decision),
                             old_decision=decision_dict(v.other), setting=v.setting,
                             extra={"body": body} if body is not None else {})
        return links, self.res(prop, "refuted", cex)

    def within(self) -> Result:
        """Every request this subject admits, the ceiling's subject admits too, with no credential it does not attach."""
        ceiling = self.c.ceiling
        assert ceiling is not None
        target = f"{self.kind} `{self.ceil_name}`"
        ceil = outcome(self.ev, self.ceil_table, self.sym, self.out.obs) if self.ceil_table is not None else None
        links, shaped = self._shape_links(ceiling.artifact, self.ceil_table, self.ceil_name, ceiling.rename(), "within")
        if shaped is not None:
            return shaped
        o = self.solve([*links, self.ev.bool_term(exceeds(self.ev, self.out, ceil, ceiling.rename()))])
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "within", o.reason)
        where = f"ceiling {ceiling.artifact.workspace} ({ceiling.artifact.digest[:12]})"
        if o.status == "unsat":
            return self._within_headers(ceil, target, where, links)
        req, ips = concretize(o.model, self.sym)
        d_new = self.replay(req, ips)
        d_ceil = self.c.decide(ceiling.artifact, subject_lease(self.kind, self.ceil_name), req, list(ips))
        mine = self.carried(d_new)
        mine = ceiling.rename().get(mine, mine) if mine is not None else None
        theirs = (self.ceil_name if self.kind == "connection" else d_ceil.broker) if d_ceil.allowed else None
        shown = d_new.allowed and not (d_ceil.allowed and (mine is None or mine == theirs))
        if self.ceil_subject is None:
            summary = f"`{request_line(req)}` is admitted, and the ceiling has no {target}"
        elif d_ceil.allowed and d_new.allowed:
            summary = (f"`{request_line(req)}` carries {f'the `{mine}`' if mine else 'no'} credential here, "
                       f"{f'the `{theirs}` one' if theirs else 'none'} under the ceiling")
        else:
            summary = f"`{request_line(req)}`: ceiling {decision_side(d_ceil)}, candidate {decision_side(d_new)}"
        cex = Counterexample(summary=summary, request=req, resolved_ips=ips, rule=d_new.rule,
                             decision=decision_dict(d_new), old_decision=decision_dict(d_ceil),
                             setting=f"within {target} of the {where}")
        return self.res("within", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "within", cex)

    def _within_headers(self, ceil: Outcome | None, target: str, where: str, links: list) -> Result:
        """Within, second half: for any header name, what the candidate forwards on a request the ceiling admits, the
        ceiling forwards too (a wider header allowlist exceeds the ceiling even where every request is admitted)."""
        ev, sym = self.ev, self.sym
        if ceil is None:  # no ceiling subject and the first half proved: this subject admits no request at all
            return self.res("within", "proved", detail=f"within {target} of the {where}")
        name = sym.header()
        extra = ev.and_(forwarded(ev, self.out, name, sym.name_listed), ceil.allowed,
                        ev.not_(forwarded(ev, ceil, name, sym.name_listed)))
        o = self.solve([*links, sym.header_wf, ev.bool_term(extra)], strings=True)
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "within", o.reason)
        if o.status == "unsat":
            return self.res("within", "proved", detail=f"within {target} of the {where}")
        req, ips = concretize(o.model, sym, header=True)
        hdr = o.model.eval(sym.name, model_completion=True).as_string()
        d_new = self.replay(req, ips)
        d_ceil = self.c.decide(self.c.ceiling.artifact, subject_lease(self.kind, self.ceil_name), req, list(ips))  # type: ignore[union-attr]
        title = "-".join(p.capitalize() for p in hdr.split("-"))
        cex = Counterexample(summary=f"`{request_line(req)}`: header `{title}` is forwarded here (rule `{d_new.rule}`), "
                             f"not under the ceiling (rule `{d_ceil.rule}`)", request=req, resolved_ips=ips, header=hdr,
                             rule=d_new.rule, decision=decision_dict(d_new), old_decision=decision_dict(d_ceil),
                             setting=f"within {target} of the {where}")
        sent = {n.lower() for n, _ in d_new.forward_headers}
        kept = {n.lower() for n, _ in d_ceil.forward_headers} if d_ceil.allowed else set()
        shown = d_new.allowed and d_ceil.allowed and hdr in sent and hdr not in kept
        return self.res("within", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "within", cex)

    def no_widening(self) -> Result:
        c = self.c
        assert c.old is not None
        old = outcome(self.ev, self.old_table, self.sym, self.out.obs) if self.old_table is not None else None
        links, shaped = self._shape_links(c.old, self.old_table, self.name, {}, "no-widening")
        if shaped is not None:
            return shaped
        o = self.solve([*links, self.ev.bool_term(widens(self.ev, self.out, old))])
        if o.status == "unknown":
            return _unknown(self.w, self.subj, "no-widening", o.reason)
        old_version = declared(c.old, self.kind, self.name).version  # type: ignore[union-attr]
        if o.status == "unsat":
            return self.res("no-widening", "proved", detail=f"against version {old_version} ({c.old.digest[:12]})")
        req, ips = concretize(o.model, self.sym)
        d_new, d_old = self.replay(req, ips), self.replay(req, ips, c.old)
        cex = Counterexample(
            summary=f"`{request_line(req)}`: old {decision_side(d_old)}, new {decision_side(d_new)}",
            request=req, resolved_ips=ips, rule=d_new.rule, decision=decision_dict(d_new), old_decision=decision_dict(d_old),
            setting=f"version {old_version} -> {self.declared.version}")
        shown = decision_widens(d_new, d_old)
        return self.res("no-widening", "refuted", cex) if shown else _not_replayed(self.w, self.subj, "no-widening", cex)
