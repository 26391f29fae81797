"""`egresslaw propose --audit DIR POLICY`: denials in the proxy's audit logs -> the smallest policy change, with its
evidence; `--within CEILING` proves it stays inside an operator's ceiling, `--against LOCK` says what it widens.

Exit codes: 0 a change was proposed (or none is needed), and with --within every subject is proved inside the
ceiling; 1 --within refuted (the counterexample is printed); 4 --within unknown; 2 usage, I/O, logs that do not
read exactly or do not verify (--keys), a policy that does not compile, or a proposal that does not.
"""

from __future__ import annotations

import json
import sys

from egresslaw.common import CliError, err, out, read_text, write_text_atomic

SHOWN_EVENTS = 3  # event ids per change in the text form (the count is exact)


def register(sub) -> None:
    p = sub.add_parser(
        "propose",
        help="turn denials in audit logs into a reviewed policy change",
        description="read the denials in the proxy's audit logs and propose the smallest policy change that admits "
        "them (a profile's exact hosts; for a connection, never wider than what was denied: one exact rule per denied path "
        "with the methods seen on it, and exactly the tool, method, field, ref, parameter or segment value a request shape "
        "refused), as a diff with its evidence; a refused value the audit does not hold is named (`info:`) for review, "
        "and denials no policy change fixes are listed, never widened",
        epilog="exit codes: 0 proposed (or nothing needed; with --within: inside the ceiling), 1 --within refuted, "
        "4 --within unknown, 2 usage, I/O, unreadable or unverified logs, or a policy that does not compile",
    )
    p.add_argument("policy", metavar="POLICY", help="the policy directory (or file) the proxy's artifact was compiled from")
    p.add_argument("--audit", required=True, metavar="DIR", help="the directory holding the proxy's `*.jsonl` audit logs")
    p.add_argument("--keys", metavar="KEYS", help="the proxy's keys directory: verify every log's chain and MACs first (refuse if broken)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="text (a diff and its evidence) or json")
    p.add_argument("--write", action="store_true", help="apply the change to the policy files (after printing it)")
    p.add_argument("--enforce", action="store_true",
                   help="also end observe mode for every profile the change touches (`enforce = \"enforce\"`); --within "
                   "then proves the allowlist it will enforce (an observed profile reaches any host: no ceiling holds it)")
    p.add_argument("--within", metavar="CEILING", help="prove the proposed policy inside this ceiling (a policy or its artifact)")
    p.add_argument("--against", metavar="LOCK", help="the policy's egresslaw.lock (or a previous artifact): say which published subjects widen")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="prover processes for --within (default 1)")
    p.set_defaults(run=run)


def _verified(directory: str, keys: str, files) -> None:
    """Refuse unless every log in `directory` verifies under the proxy's audit key and every file read is one of them."""
    from egress_proxy.audit.log import AuditError
    from egress_proxy.audit.verify import audit_logs, verify_logs
    from egress_proxy.custody.keys import KeyFileError, load_audit_key

    try:
        results = verify_logs(directory, key=load_audit_key(keys))
        checked = {path.resolve() for log in audit_logs(directory) for path, _ in log}
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    except AuditError as exc:
        raise CliError(str(exc)) from None
    for name, result in results:
        if result.status == "broken":
            where = f"line {result.line}: " if result.line is not None else ""
            raise CliError(f"audit log `{name}` does not verify: {where}{result.message}",
                           "a proposal is made from evidence that verifies; check it with `egresslaw audit verify`")
        if result.status == "open" and result.message.startswith("incomplete"):  # a line cut short: damaged, not just open
            raise CliError(f"audit log `{name}` is damaged: line {result.line}: {result.message}",
                           "evidence must be exact: restore the log, or move the damaged file out of the directory")
        if result.status == "open":
            err(f"note: audit log `{name}` is not closed by a checkpoint (still written, or cut short); every line verifies")
    strays = [str(f) for f in files if f.resolve() not in checked]
    if strays:
        raise CliError(f"`{strays[0]}` is not an audit log the verifier checked", "move files that are not the proxy's logs out of the directory")


def run(args) -> int:
    from compiler.propose import ProposeError, audit_files, propose, read_denials

    if not 1 <= args.jobs <= 1024:
        raise CliError(f"`--jobs {args.jobs}` must be from 1 to 1024")
    try:
        files = audit_files(args.audit)
    except ProposeError as exc:
        raise CliError(exc.message, exc.help) from None
    if args.keys:
        _verified(args.audit, args.keys, files)
    else:
        err(f"warning: the evidence in `{args.audit}` is unverified (give --keys KEYS to check the logs' chains first)")
    from egresslaw.commands.prove import compile_policy

    policy = compile_policy(args.policy, f"policy `{args.policy}`",
                            f"fix it first (`egresslaw check {args.policy}`): a proposal edits a policy that compiles")
    try:
        proposal = propose(policy, read_denials(files), enforce=args.enforce)
    except ProposeError as exc:
        raise CliError(exc.message, exc.help) from None

    widenings = _widenings(args.against, proposal) if args.against else []
    verdict = _within(args, proposal) if args.within else None
    if args.format == "json":
        doc = proposal.to_dict(args.policy)
        doc["widenings"] = widenings
        if verdict is not None:
            doc["within"] = verdict
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        _render_text(proposal, widenings, verdict)
    for path in proposal.reformatted:
        err(f"note: `{path}` was not in `egresslaw fmt`'s layout: the diff reformats it too")
    code = {None: 0, "proved": 0, "refuted": 1, "unknown": 4}[verdict["verdict"] if verdict else None]
    if args.write and proposal.changed_files:
        if code != 0:
            err("not written: the proposal is not proved inside the ceiling")
        else:
            for path in proposal.changed_files:
                write_text_atomic(path, proposal.new_sources[path])
                err(f"wrote {path}")
            err(f"next: review, then `egresslaw compile {args.policy} --allow-widening` (the change widens its subjects)")
    return code


def _render_text(proposal, widenings: list[dict], verdict: dict | None) -> None:
    from egress_proxy.decision.reasons import describe

    if proposal.diff:
        sys.stdout.write(proposal.diff)
    else:
        if proposal.review:
            out("no change proposed: the refused values below are not in the audit; a reviewer decides (`info:`)")
        else:
            out("no change needed: no denial in the logs is one a policy change fixes" if proposal.not_proposable or not proposal.admitted.count
                else "no change needed: the policy already admits every denied request in the logs")
    for c in proposal.changes:
        ev = c.evidence
        shown = ", ".join(ev.events[:SHOWN_EVENTS]) + (f", … ({ev.count} in all)" if ev.count > SHOWN_EVENTS else "")
        out(f"change: {c.kind} `{c.subject}` ({c.file}): {_safe(c.summary)}")
        out(f"  evidence: {ev.count} denied request(s) by {', '.join(f'`{s}`' for s in ev.subjects) or 'no named agent'}: {shown}")
        for note in ev.notes:
            out(f"  note: {note}")
    for r in proposal.review:  # a place a shape refused a value the audit does not hold: the reviewer decides
        out(f"info: {_safe(r.subject or '')} rule `{_safe(r.rule or '')}`: {_safe(r.reason)} {_safe(r.where)} "
            f"({r.evidence.count}): {_safe(r.why)}")
    for r in proposal.not_proposable:  # reason, subject and why may quote an unverified log: escaped for the terminal
        who = f" {_safe(r.subject)}" if r.subject else ""
        out(f"not proposable: {_safe(r.reason)}{who} ({r.evidence.count}): {_safe(r.why)}")
        if describe(r.reason) != "unknown reason code":
            out(f"  ({describe(r.reason)})")
    if proposal.admitted.count:
        out(f"already admitted by the current policy: {proposal.admitted.count} denied request(s) (an older policy's log?)")
    for w in widenings:
        out(f"widens: {w['subject']} (published v{w['from_version']} -> v{w['to_version']}): {w['example']}")
    if verdict is not None:
        out(f"within `{verdict['ceiling']}`: {verdict['verdict']}")
        for cx in verdict["counterexamples"]:
            out(f"  counterexample: {cx}")


def _safe(text: str) -> str:
    """`text` with control characters (and anything not printable) escaped: a log line never drives the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _widenings(path: str, proposal) -> list[dict]:
    """Per published subject the proposal touches: its version change and a request it would newly admit."""
    from compiler.lock import apply_lock
    from egresslaw.commands.compile import find_widenings
    from egresslaw.commands.prove import previous

    current = proposal.result.artifact
    old = previous(path, current)
    touched = {c.key for c in proposal.changes}
    versions = {}
    try:
        lock = json.loads(read_text(path, "lock"))
    except ValueError:
        lock = None
    if isinstance(lock, dict) and "subjects" in lock:
        versions = {c.key: (c.old_version, c.new_version) for c in apply_lock(current, lock).changes if c.kind == "changed"}
    found = find_widenings(old, current, touched)
    return [{"subject": subject, "from_version": versions.get(subject, (None, None))[0],
             "to_version": versions.get(subject, (None, None))[1], "example": example} for subject, example in found]


def _within(args, proposal) -> dict:
    from egresslaw.commands.prove import ceiling_of, prover_imports

    with prover_imports():
        from proofs.runner import prove
    artifact = proposal.result.artifact
    ceiling = ceiling_of(args.within, [], artifact)
    report = prove(artifact, ceiling=ceiling, jobs=args.jobs)
    within = [r for r in report.results if r.property == "within"]
    order = ("proved", "unknown", "refuted")
    worst = max((r.verdict for r in within), key=order.index, default="proved")
    examples = [f"{r.subject}: {(r.counterexample or {}).get('summary') or r.detail or r.verdict}" for r in within if r.verdict != "proved"]
    return {"ceiling": args.within, "verdict": worst, "counterexamples": examples}
