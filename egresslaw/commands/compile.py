"""`egresslaw compile PATH [-o build/egresslaw.json] [--locked] [--allow-widening]`."""

from __future__ import annotations

from pathlib import Path

from egresslaw.common import CliError, Progress, err, out, write_text_atomic
from egresslaw.render import add_format_option, print_diagnostics

EXIT_DRIFT = 3


def register(sub) -> None:
    p = sub.add_parser(
        "compile",
        help="compile a policy into the artifact and update its lock",
        description="compile a policy (a directory, or the policy a file belongs to) into the artifact and update its "
        "lock; with --locked (CI) change nothing and fail on any drift",
        epilog="exit codes: 0 ok, 1 policy errors or an unapproved widening (EL0037), 2 usage or I/O, "
        "3 lock drift with --locked (EL0038)",
    )
    p.add_argument("path", metavar="PATH", help="a policy directory or file")
    p.add_argument("-o", "--output", default="build/egresslaw.json", help="artifact path (default: build/egresslaw.json)")
    p.add_argument("--locked", action="store_true", help="fail (exit 3) instead of changing the lock (CI)")
    p.add_argument("--allow-widening", action="store_true", help="accept changes that admit requests the published version denied")
    p.add_argument("-q", "--quiet", action="store_true", help="print a count of lock changes instead of one line per subject")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress on stderr: auto (once a run lasts 2 s), always or never")
    add_format_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from compiler.compile import compile_sources, find_policies, read_files
    from compiler.diagnostics import error
    from compiler.lock import (
        LOCK_NAME,
        LockError,
        apply_lock,
        lock_path,
        read_lock,
        render_lock,
    )
    from compiler.syntax import Span

    roots, problems = find_policies([args.path])
    if problems:
        print_diagnostics(problems, {}, args.format)
        return 2
    if len(roots) > 1:
        shown = ", ".join(f"`{r.path}`" for r in roots[:5]) + (", …" if len(roots) > 5 else "")
        raise CliError(
            f"`{args.path}` holds {len(roots)} policies ({shown}); `compile` builds one artifact from one policy",
            f"compile them one at a time, e.g. `egresslaw compile {roots[0].path} -o build/{roots[0].path.stem}.json`",
        )
    root = roots[0]
    if root.path != Path(args.path) and args.format == "text":
        err(f"compiling policy `{root.path}`, which `{args.path}` belongs to")
    progress = Progress("compile", args.progress)
    try:
        result = compile_sources(*read_files(root.files), progress=progress)
        if not result.ok:
            print_diagnostics(result.diagnostics, result.sources, args.format)
            return 2 if any(d.code == "EL0035" for d in result.diagnostics) else 1
        lpath = lock_path(root.path)
        shared = lpath.with_name(LOCK_NAME)
        if not root.is_dir and not lpath.exists() and shared.exists() and args.format == "text":
            err(
                f"note: `{root.path.parent}` holds several policies, so `{root.path}` keeps its own lock `{lpath}`; "
                f"if `{shared}` was this policy's lock, rename it: `git mv {shared} {lpath}`"
            )
        try:
            lock = read_lock(lpath)
        except LockError as exc:
            diag = error("EL0036", str(exc), Span(str(lpath), 0, 0, 0, 0), "restore it from version control, or delete it to publish everything anew")
            print_diagnostics(result.diagnostics + [diag], result.sources, args.format)
            return 1
        progress.stage("applying the lock")
        locked = apply_lock(result.artifact, lock)
        if args.locked and locked.changes:
            if args.format == "text":
                print_diagnostics(result.diagnostics, result.sources, args.format)
                err(f"error: `{lpath}` is out of date ({len(locked.changes)} change(s)); run `egresslaw compile {root.path}` and commit the lock")
                for line in describe_changes(locked.changes, args.quiet):
                    err(line)
            else:
                sources = dict(result.sources)
                lock_text = lpath.read_text(encoding="utf-8") if lpath.exists() else ""
                drift = drift_diagnostics(locked, lpath, lock_text, root.path)
                sources[str(lpath)] = lock_text
                print_diagnostics(result.diagnostics + drift, sources, args.format)
            return EXIT_DRIFT
        changed = {c.key for c in locked.changes if c.kind == "changed"}
        widenings = []
        if changed and locked.previous is not None:
            progress.stage(f"looking for widenings in {len(changed)} changed subject(s)")
            widenings = find_widenings(locked.previous, locked.artifact, changed)
    finally:
        progress.close()
    if widenings and not args.allow_widening:
        diags = list(result.diagnostics)
        for subject, example in widenings:
            diags.append(
                error(
                    "EL0037",
                    f"{subject} widens its published version: {example}",
                    _subject_span(locked.artifact, subject, lpath),
                    "review the change; pass `--allow-widening` to publish it",
                )
            )
        print_diagnostics(diags, result.sources, args.format)
        return 1
    print_diagnostics(result.diagnostics, result.sources, args.format)
    write_text_atomic(args.output, locked.artifact.to_json())
    write_text_atomic(lpath, render_lock(locked.lock))
    if args.format == "text":
        for line in describe_changes(locked.changes, args.quiet):
            out(line)
        for subject, example in widenings:
            out(f"widening accepted: {subject}: {example}")
        a = locked.artifact
        out(f"wrote {args.output} (digest {a.digest[:16]}…): {len(a.sandbox_profiles)} profile(s), {len(a.connections)} connection(s)")
    return 0


def describe_changes(changes, quiet: bool = False) -> list[str]:
    """One line per published-version change, with hosts added and removed (a count when `quiet`)."""
    if quiet:
        if not changes:
            return []
        counts = {kind: sum(1 for c in changes if c.kind == kind) for kind in ("new", "changed", "removed")}
        return ["  lock: " + ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) + " (without --quiet: one line each)"]
    lines = []
    for c in changes:
        if c.kind == "new":
            lines.append(f"  new      {c.key} v{c.new_version}")
        elif c.kind == "removed":
            lines.append(f"  removed  {c.key} (was v{c.old_version})")
        else:
            lines.append(f"  changed  {c.key} v{c.old_version} -> v{c.new_version}")
        lines += [f"             + {h}" for h in c.hosts_added]
        lines += [f"             - {h}" for h in c.hosts_removed]
    return lines


def _subject_span(artifact, subject: str, lpath: Path):
    """Where a subject (`connection:C` or `sandbox_profile:P`) is declared, else the lock file."""
    from compiler.sarif import subject_key
    from compiler.syntax import Span

    span = artifact.locations.span(subject_key(subject))
    return Span(*span) if span is not None else Span(str(lpath), 0, 0, 0, 0)


def drift_diagnostics(locked, lpath: Path, lock_text: str, root: Path) -> list:
    """One EL0038 per subject whose published version in the lock differs from what the policy compiles to:
    new and changed subjects at their declaration, removed ones at their entry in the lock."""
    from compiler.diagnostics import error
    from compiler.syntax import Span

    help = f"run `egresslaw compile {root}` and commit `{lpath}`, so the change is reviewed as a new published version"
    diags = []
    for c in locked.changes:
        hosts = "".join(f", +{h}" for h in c.hosts_added) + "".join(f", -{h}" for h in c.hosts_removed)
        if c.kind == "removed":
            needle = f'"{c.key}": {{'
            line = next((i for i, text in enumerate(lock_text.splitlines(), 1) if needle in text), 0)
            column = lock_text.splitlines()[line - 1].index(needle) + 1 if line else 0
            span = Span(str(lpath), line, column, line, column + len(needle) - 3 if line else 0)
            message = f"`{c.key}` is published as v{c.old_version} in the lock but no longer declared{hosts}"
        elif c.kind == "new":
            span = _subject_span(locked.artifact, c.key, lpath)
            message = f"`{c.key}` is not published in the lock yet (would be v{c.new_version}){hosts}"
        else:
            span = _subject_span(locked.artifact, c.key, lpath)
            message = f"`{c.key}` differs from its published v{c.old_version} (would be v{c.new_version}){hosts}"
        diags.append(error("EL0038", message, span, help))
    return diags


def find_widenings(previous, current, changed: set[str]) -> list[tuple[str, str]]:
    """(subject, example request) for every changed subject that admits something its published version denied."""
    from compiler.lock import budget_widenings, shape_widenings
    from egresslaw.commands.prove import prover_imports

    with prover_imports():  # only a changed published subject needs the prover; a first compile does not
        from proofs.diff import widenings

    # The prover's diff compares same-named rules' request shapes (docs/shapes.md) and replays its example; the
    # compiler's own comparison also holds each changed rule's shapes to its published version's (conservatively: a
    # renamed rule, or a change the diff cannot decide), naming the rule; and each changed subject's budget to its
    # published budget (docs/budget.md: a cap dropped or raised, or a window shortened with its cap kept).
    found = [(s, example) for s, example in widenings(previous, current) if s in changed]
    for more in (shape_widenings(previous, current), budget_widenings(previous, current)):
        seen = {s for s, _ in found}
        found += [w for w in more if w[0] in changed and w[0] not in seen]
    return found
