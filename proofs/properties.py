"""The properties of SPEC §5 for one worker and its subjects: encode `config ∧ ¬property`, solve, decode, replay.

Every refutation is replayed through the real `decide()` before it is reported; a counterexample
that does not replay is reported as `unknown` (the encoding and the implementation disagree),
never as refuted and never as proved.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass
from typing import Callable

import z3

from catalog import SpecialPurposeTable
from compiler.artifact import Artifact, Connection, SandboxProfile, Worker
from compiler.constants import DEFAULT_WORKER, header_is_denylisted
from egress_proxy.addresses import WorkerJudge
from egress_proxy.types import Lease
from proofs.addr import AddressModel, decode_addr, fresh_addr, spec_worker
from proofs.decode import Counterexample, concretize, decision_dict, request_line
from proofs.encode import Encoder, SymRequest, Universe, spec_rule_match
from proofs.report import Result
from proofs.solve import Limits, check

NICE_V4 = ("93.184.215.14", "8.8.8.8", "1.1.1.1")


def worker_subject(name: str) -> str:
    return f"worker:{name}"


def redirect_bound(worker: Worker) -> int:
    """How many follow-up requests a worker would issue after 3xx answers (0: it never follows)."""
    if not worker.follow_redirects and worker.max_redirects <= 0:
        return 0
    return max(worker.max_redirects, 1)


def subjects_of(artifact: Artifact, worker: str) -> list[tuple[str, str]]:
    """(kind, name) of every connection that uses `worker`, plus every profile when it is the default worker."""
    out = [("connection", c.name) for c in artifact.connections if c.worker == worker]
    if worker == DEFAULT_WORKER:
        out += [("profile", p.name) for p in artifact.sandbox_profiles]
    return sorted(out)


@dataclass
class Ctx:
    """Everything one check needs: a fresh Z3 context, the encoders, limits and the replay entry point."""

    artifact: Artifact
    old: Artifact | None
    table: SpecialPurposeTable
    limits: Limits
    decide: Callable


def _timed(fn) -> Result:
    start = time.perf_counter()
    res = fn()
    ms = int((time.perf_counter() - start) * 1000)
    return Result(res.worker, res.subject, res.property, res.verdict, ms, res.counterexample, res.detail)


def _res(worker: str, subject: str, prop: str, verdict: str, cex: Counterexample | None = None, detail: str = "") -> Result:
    return Result(worker, subject, prop, verdict, 0, cex.to_dict() if cex is not None else None, detail)


def _unknown(worker: str, subject: str, prop: str, reason: str) -> Result:
    return _res(worker, subject, prop, "unknown", detail=f"solver gave no answer: {reason}")


def _not_replayed(worker: str, subject: str, prop: str, cex: Counterexample) -> Result:
    return Result(worker, subject, prop, "unknown", 0, cex.to_dict(),
                  "the counterexample did not replay through decide(): the encoding does not model the implementation")


def _range_of(table: SpecialPurposeTable, ip, rules) -> dict[str, str] | None:
    cands = [ip]
    if ip.version == 6:
        for r in rules:
            v4 = r.embedded(int(ip))
            if v4 is not None:
                cands.append(ipaddress.IPv4Address(v4))
    for c in cands:
        entry = table.lookup(c)
        if entry is not None:
            return {"cidr": entry.cidr, "name": entry.name, "reference": entry.reference, "address": str(c)}
    return None


def _clean(sym: SymRequest, keep: frozenset[str] = frozenset()) -> list:
    """Preferences that make a counterexample readable: no extra headers, no body, an IPv4 answer, port 443."""
    prefs = [sym.hh_n == 0, z3.Not(sym.auth_given), z3.Not(sym.has_body), z3.Not(sym.cl_multi), z3.Not(sym.ip.is6),
             sym.port == 443, z3.Not(sym.host_err), z3.Not(sym.path_err)]
    for h in sym.uni.headers:
        if h not in keep:
            prefs.append(z3.Not(sym.present[h]))
        prefs.append(z3.Not(sym.hop[h]))
    return prefs


def _nice_ip(sym: SymRequest) -> list:
    """Prefer a familiar public IPv4 answer in examples (readability only)."""
    return [z3.Or([z3.And(z3.Not(sym.ip.is6), sym.ip.x == z3.BitVecVal(int(ipaddress.IPv4Address(a)), 128, sym.ctx))
                   for a in NICE_V4])]


def _lease(kind: str, name: str) -> Lease:
    return Lease(subject="egresslaw-prove", profile=name if kind == "profile" else None,
                 connection=name if kind == "connection" else None, exp=0)


# ---------------------------------------------------------------------------------------------
# worker-level checks
# ---------------------------------------------------------------------------------------------


def worker_checks(c: Ctx, worker: Worker) -> list[Result]:
    ctx = z3.Context()
    results = []
    subj = worker_subject(worker.name)
    try:
        am = AddressModel(ctx, worker, c.table)
    except ValueError as exc:
        return [_res(worker.name, subj, p, "refuted", Counterexample(summary=f"worker `{worker.name}`: {exc}",
                     setting="deny_cidrs/allow_cidrs/nat64_prefixes"), "malformed worker setting")
                for p in ("vacuity", "public-only")]
    judge = WorkerJudge(worker, c.table)

    def vacuity() -> Result:
        a, wf = fresh_addr(ctx)
        out = check(ctx, [wf, am.public(a)], c.limits, [z3.Not(a.is6)])
        if out.status == "unknown":
            return _unknown(worker.name, subj, "vacuity", out.reason)
        if out.status == "unsat":
            cex = Counterexample(summary=f"worker `{worker.name}` reaches no public address at all",
                                 setting=f"deny_cidrs = {list(worker.deny_cidrs)}, ipv6 = {str(worker.ipv6).lower()}")
            return _res(worker.name, subj, "vacuity", "refuted", cex, "every proof about this worker would be vacuous")
        ip = decode_addr(out.model, a)
        return _res(worker.name, subj, "vacuity", "proved", detail=f"reaches e.g. `{ip.compressed}`")

    def public_only() -> Result:
        a, wf = fresh_addr(ctx)
        prefer = [z3.Not(a.is6)]
        out = check(ctx, [wf, am.public(a), z3.Not(am.spec().public(a))], c.limits, prefer)
        if out.status == "unknown":
            return _unknown(worker.name, subj, "public-only", out.reason)
        if out.status == "unsat":
            return _res(worker.name, subj, "public-only", "proved")
        ip = _nicer_ip(decode_addr(out.model, a), worker, judge, c.table)
        cex = _address_cex(worker, ip, am, c.table, judge)
        public, _, _ = judge.judge(ip)
        spec_ok, _, _ = WorkerJudge(_spec_worker(worker, c.table), c.table).judge(ip)
        if not public or spec_ok:
            return _not_replayed(worker.name, subj, "public-only", cex)
        return _res(worker.name, subj, "public-only", "refuted", cex)

    def no_redirect() -> Result:
        out_cex = _redirect_cex(ctx, worker, c.limits, None)
        if isinstance(out_cex, str):
            return _unknown(worker.name, subj, "no-redirect", out_cex)
        if out_cex is None:
            return _res(worker.name, subj, "no-redirect", "proved")
        return _res(worker.name, subj, "no-redirect", "refuted", out_cex)

    results += [_timed(vacuity), _timed(public_only), _timed(no_redirect)]
    return results


def _spec_worker(worker: Worker, table: SpecialPurposeTable) -> Worker:
    return spec_worker(worker, table)


def _nicer_ip(ip, worker: Worker, judge: WorkerJudge, table: SpecialPurposeTable):
    """Replace a solver-chosen address by the first host address of the offending hole, when that shows the same."""
    spec = WorkerJudge(_spec_worker(worker, table), table)
    for cidr in worker.allow_cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        for entry in table.ranges:
            other = entry.network
            if other.version != net.version or not net.overlaps(other):
                continue
            inter = net if net.prefixlen >= other.prefixlen else other
            cand = inter.network_address + (1 if inter.num_addresses > 1 else 0)
            if judge.judge(cand)[0] and not spec.judge(cand)[0]:
                return cand
    return ip


def _address_cex(worker: Worker, ip, am: AddressModel, table, judge, request=None) -> Counterexample:
    rng = _range_of(table, ip, judge.rules)
    holes = am.responsible_allow(ip)
    what = f"{rng['name']}, {rng['reference']}" if rng else "special-purpose address"
    nat64 = [r.prefix for r in judge.rules if r.form == "nat64" and r.embedded(int(ip)) is not None] if ip.version == 6 else []
    if holes:
        setting, head = f"allow_cidrs = {holes}", f"allow_cidrs admits {ip.compressed}"
    elif nat64:
        setting, head = f"nat64_prefixes = {nat64}", f"nat64_prefixes admit {ip.compressed} (judged by its embedded IPv4 only)"
    else:
        setting, head = "unwrap forms", f"admits {ip.compressed}"
    summary = f"worker `{worker.name}`: {head} ({what})"
    if request is not None:
        summary += f" for `{request_line(request)}`"
    return Counterexample(summary=summary, request=request, resolved_ips=(ip.compressed,), ip_range=rng,
                          setting=setting)


def _redirect_cex(ctx, worker: Worker, limits: Limits, first_line: str | None, request=None):
    """None when the worker never follows; a Counterexample with the chain otherwise; a string when unknown."""
    bound = redirect_bound(worker)
    follows = z3.BoolVal(worker.follow_redirects or worker.max_redirects > 0, ctx)
    statuses = [z3.Int(f"status_{i}", ctx) for i in range(max(bound, 1))]
    wf = [z3.And(s >= 100, s <= 599) for s in statuses]
    # issued[i+1]: the worker sends request i+1 after answer i
    issued = [z3.BoolVal(True, ctx)]
    for i, s in enumerate(statuses):
        issued.append(z3.And(issued[-1], follows, z3.BoolVal(i < bound, ctx), s >= 300, s <= 399))
    out = check(ctx, wf + [issued[1]], limits, [statuses[0] == 302])
    if out.status == "unknown":
        return out.reason
    if out.status == "unsat":
        return None
    m = out.model
    chain = []
    for i, s in enumerate(statuses):
        if not z3.is_true(m.eval(issued[i + 1], model_completion=True)):
            break
        chain.append({"status": m.eval(s, model_completion=True).as_long(), "location": "http://169.254.169.254/",
                      "issued": True})
    first = f"`{first_line}` " if first_line else ""
    setting = f"follow_redirects = {str(worker.follow_redirects).lower()}, max_redirects = {worker.max_redirects}"
    summary = (f"worker `{worker.name}`: {first}{chain[0]['status']} Location: {chain[0]['location']} "
               f"→ second request issued ({setting})")
    return Counterexample(summary=summary, request=request, redirect_chain=tuple(chain), setting=setting)


# ---------------------------------------------------------------------------------------------
# subject-level checks
# ---------------------------------------------------------------------------------------------


def subject_checks(c: Ctx, worker: Worker, kind: str, name: str) -> list[Result]:
    ctx = z3.Context()  # INVARIANT: one fresh context per subject, so verdicts do not depend on batching
    subj = f"{kind}:{name}"
    w = worker.name
    new_subject: Connection | SandboxProfile | None = (
        c.artifact.connection(name) if kind == "connection" else c.artifact.profile(name))
    old_subject = None
    if c.old is not None:
        old_subject = c.old.connection(name) if kind == "connection" else c.old.profile(name)
    uni = Universe.build([s for s in (new_subject, old_subject) if s is not None])
    sym = SymRequest(ctx, uni)
    enc = Encoder(ctx, c.artifact, c.table)
    out = enc.subject(kind, name, sym)
    lease = _lease(kind, name)
    results: list[Result] = []
    assert out is not None and new_subject is not None

    def replay(req, ips):
        return c.decide(c.artifact, lease, req, list(ips))

    def example(model) -> tuple:
        req, ips = concretize(model, sym)
        return req, ips

    none_profile = kind == "profile" and new_subject.network.mode == "none"

    def vacuity() -> Result:
        if none_profile:
            return _res(w, subj, "vacuity", "proved", detail="network none: admits nothing by design (not a vacuous proof)")
        o = check(ctx, [sym.wf, out.allowed], c.limits, _clean(sym) + _nice_ip(sym))
        if o.status == "unknown":
            return _unknown(w, subj, "vacuity", o.reason)
        if o.status == "unsat":
            cex = Counterexample(summary=f"{kind} `{name}` admits no request at all: every proof about it is vacuous")
            return _res(w, subj, "vacuity", "refuted", cex)
        req, ips = example(o.model)
        d = replay(req, ips)
        if not d.allowed:
            return _not_replayed(w, subj, "vacuity", Counterexample(summary="witness denied", request=req,
                                                                       resolved_ips=ips, decision=decision_dict(d)))
        return _res(w, subj, "vacuity", "proved", detail=f"admits e.g. `{request_line(req)}` ({ips[0]})")

    def public_only() -> Result:
        am = out.addr
        o = check(ctx, [sym.wf, out.allowed, z3.Not(am.spec().public(sym.ip))], c.limits, _clean(sym))
        if o.status == "unknown":
            return _unknown(w, subj, "public-only", o.reason)
        if o.status == "unsat":
            return _res(w, subj, "public-only", "proved")
        req, _ = example(o.model)
        judge = WorkerJudge(worker, c.table)
        ip = _nicer_ip(decode_addr(o.model, sym.ip), worker, judge, c.table)
        cex = _address_cex(worker, ip, am, c.table, judge, req)
        d = replay(req, [ip.compressed])
        spec_ok = WorkerJudge(_spec_worker(worker, c.table), c.table).judge(ip)[0]
        cex = _with_decision(cex, d)
        if not d.allowed or spec_ok:
            return _not_replayed(w, subj, "public-only", cex)
        return _res(w, subj, "public-only", "refuted", cex)

    def no_redirect() -> Result:
        if redirect_bound(worker) == 0:
            return _res(w, subj, "no-redirect", "proved")
        o = check(ctx, [sym.wf, out.allowed], c.limits, _clean(sym) + _nice_ip(sym))
        if o.status == "unknown":
            return _unknown(w, subj, "no-redirect", o.reason)
        if o.status == "unsat":
            return _res(w, subj, "no-redirect", "proved", detail="the subject admits no request, so none is redirected")
        req, ips = example(o.model)
        cex = _redirect_cex(ctx, worker, c.limits, request_line(req), req)
        if isinstance(cex, str):
            return _unknown(w, subj, "no-redirect", cex)
        if cex is None:
            return _res(w, subj, "no-redirect", "proved")
        d = replay(req, ips)
        cex = _with_decision(cex, d, resolved=ips)
        if not d.allowed:
            return _not_replayed(w, subj, "no-redirect", cex)
        return _res(w, subj, "no-redirect", "refuted", cex)

    def credential_scope() -> Result:
        conn: Connection = new_subject  # type: ignore[assignment]
        in_scope = z3.Or([z3.And(out.rule == i, spec_rule_match(conn, i, sym)) for i in range(len(conn.rules))]
                         or [z3.BoolVal(False, ctx)])
        o = check(ctx, [sym.wf, out.allowed, z3.Not(in_scope)], c.limits, _clean(sym) + _nice_ip(sym))
        if o.status == "unknown":
            return _unknown(w, subj, "credential-scope", o.reason)
        if o.status == "unsat":
            return _res(w, subj, "credential-scope", "proved")
        req, ips = example(o.model)
        rid = o.model.eval(out.rule, model_completion=True).as_long()
        rule = conn.rules[rid] if 0 <= rid < len(conn.rules) else None
        d = replay(req, ips)
        rname = rule.name if rule else None
        why = f"prefix `{rule.path_prefix}` matched as a raw string prefix" if rule else "no rule of its own"
        cex = Counterexample(
            summary=f"`{request_line(req)}` gets the credential of connection `{name}` under rule `{rname}` ({why})",
            request=req, resolved_ips=ips, rule=rname, decision=decision_dict(d))
        shown = d.allowed and d.rule == rname and rule is not None and not _in_scope(rule, req)
        if not shown:
            return _not_replayed(w, subj, "credential-scope", cex)
        return _res(w, subj, "credential-scope", "refuted", cex)

    def header_safety() -> Result:
        conn = new_subject
        inject = conn.inject.header if isinstance(conn, Connection) else None
        bad = [h for h in uni.headers if header_is_denylisted(h, inject)]
        viol = z3.Or([z3.Or(out.requested[h], out.forwarded[h]) for h in bad] or [z3.BoolVal(False, ctx)])
        o = check(ctx, [sym.wf, viol], c.limits)
        if o.status == "unknown":
            return _unknown(w, subj, "header-safety", o.reason)
        if o.status == "unsat":
            return _res(w, subj, "header-safety", "proved")
        hdr = next(h for h in bad if z3.is_true(o.model.eval(z3.Or(out.requested[h], out.forwarded[h]), model_completion=True)))
        o2 = check(ctx, [sym.wf, z3.Or(out.requested[hdr], out.forwarded[hdr])], c.limits,
                   _clean(sym, frozenset({hdr})) + _nice_ip(sym))
        model = o2.model if o2.status == "sat" else o.model
        req, ips = example(model)
        rid = model.eval(out.rule, model_completion=True).as_long()
        rule = conn.rules[rid] if isinstance(conn, Connection) and 0 <= rid < len(conn.rules) else None
        d = replay(req, ips)
        forwarded = [n.lower() for n, _ in d.forward_headers]
        title = "-".join(p.capitalize() for p in hdr.split("-"))
        if hdr in forwarded:
            summary = f"{kind} `{name}`: header `{title}` forwarded" + (f" (rule `{rule.name}`)" if rule else "")
        else:
            summary = (f"{kind} `{name}`: header `{title}` forwarded per the allowlist of rule "
                       f"`{rule.name if rule else None}` (decide() drops it at run time; the compiler never admits it)")
        cex = Counterexample(summary=summary, request=req, resolved_ips=ips, header=hdr,
                             rule=rule.name if rule else None, decision=decision_dict(d),
                             setting=f"headers = {list(rule.headers)}" if rule else None)
        listed = rule is not None and hdr in {x.lower() for x in rule.headers}
        if not (d.allowed and d.rule == (rule.name if rule else None) and (hdr in forwarded or listed)):
            return _not_replayed(w, subj, "header-safety", cex)
        return _res(w, subj, "header-safety", "refuted", cex)

    def no_widening() -> Result:
        assert c.old is not None and old_subject is not None
        old_enc = Encoder(ctx, c.old, c.table)
        old_out = old_enc.subject(kind, name, sym)
        o = check(ctx, [sym.wf, out.allowed, z3.Not(old_out.allowed)], c.limits, _clean(sym) + _nice_ip(sym))
        if o.status == "unknown":
            return _unknown(w, subj, "no-widening", o.reason)
        if o.status == "unsat":
            return _res(w, subj, "no-widening", "proved",
                        detail=f"against version {old_subject.version} ({c.old.digest[:12]})")
        req, ips = example(o.model)
        d_new = replay(req, ips)
        d_old = c.decide(c.old, lease, req, list(ips))
        cex = Counterexample(
            summary=(f"`{request_line(req)}`: old DENY ({d_old.reason}), new ALLOW"
                     + (f" (rule `{d_new.rule}`)" if d_new.rule else "")),
            request=req, resolved_ips=ips, rule=d_new.rule, decision=decision_dict(d_new),
            old_decision=decision_dict(d_old),
            setting=f"version {old_subject.version} -> {new_subject.version}")
        if not (d_new.allowed and not d_old.allowed):
            return _not_replayed(w, subj, "no-widening", cex)
        return _res(w, subj, "no-widening", "refuted", cex)

    def trust_lane() -> Result:
        prof: SandboxProfile = new_subject  # type: ignore[assignment]
        adversarial = prof.trust == "adversarial"
        certified = prof.provider_certification == "security_boundary" and not prof.provider_missing_axes
        ok_config = z3.BoolVal((not adversarial) or prof.network.mode == "none" or certified, ctx)
        o = check(ctx, [sym.wf, z3.Not(ok_config)], c.limits)
        if o.status == "unknown":
            return _unknown(w, subj, "trust-lane", o.reason)
        if o.status == "unsat":
            return _res(w, subj, "trust-lane", "proved")
        why = f"{prof.provider_certification} provider `{prof.provider}`"
        if prof.provider_missing_axes:
            why += f" lacking {', '.join(prof.provider_missing_axes)}"
        o2 = check(ctx, [sym.wf, out.allowed], c.limits, _clean(sym) + _nice_ip(sym))
        req, ips, dec = None, (), None
        if o2.status == "sat":
            req, ips = example(o2.model)
            d = replay(req, ips)
            dec = decision_dict(d)
            if not d.allowed:
                return _not_replayed(w, subj, "trust-lane", Counterexample(summary="example denied", request=req))
        summary = f"profile `{name}`: adversarial with {why} and allowlist egress"
        if req is not None:
            summary += f", e.g. `{request_line(req)}` is admitted"
        cex = Counterexample(summary=summary, request=req, resolved_ips=ips, decision=dec,
                             setting=f"trust = adversarial, network = allowlist, provider = {prof.provider}")
        return _res(w, subj, "trust-lane", "refuted", cex)

    checks = [vacuity, public_only, no_redirect, header_safety]
    if kind == "connection":
        checks.append(credential_scope)
    else:
        checks.append(trust_lane)
    if old_subject is not None:
        checks.append(no_widening)
    for fn in checks:
        results.append(_timed(fn))
    return results


def _in_scope(rule, req) -> bool:
    """SPEC §5 credential-scope, concretely: https, exact host and port, the method, segment-bounded prefix."""
    from compiler.normalize import HostError, PathError, normalize_host, normalize_path, normalize_prefix, prefix_matches

    try:
        host = normalize_host(req.host).value
        path = normalize_path(req.target)
        prefix = normalize_prefix(rule.path_prefix)
    except (HostError, PathError):
        return False
    return (req.scheme == "https" and host == rule.host and req.port == rule.port and req.method in rule.methods
            and prefix_matches(prefix, path))


def _with_decision(cex: Counterexample, d, resolved=None) -> Counterexample:
    from dataclasses import replace

    return replace(cex, decision=decision_dict(d), **({"resolved_ips": tuple(resolved)} if resolved else {}))
