"""`egresslaw compile PATH [-o build/egresslaw.json] [--locked] [--allow-widening]`."""

from __future__ import annotations

from pathlib import Path

from egresslaw.common import CliError, err, out, write_text_atomic
from egresslaw.render import add_format_option, print_diagnostics

EXIT_DRIFT = 3


def register(sub) -> None:
    p = sub.add_parser("compile", help="compile a policy into the artifact and update its lock")
    p.add_argument("path", metavar="PATH", help="a policy directory or file")
    p.add_argument("-o", "--output", default="build/egresslaw.json", help="artifact path (default: build/egresslaw.json)")
    p.add_argument("--locked", action="store_true", help="fail (exit 3) instead of changing the lock (CI)")
    p.add_argument("--allow-widening", action="store_true", help="accept changes that admit requests the published version denied")
    add_format_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from compiler.compile import compile_sources, find_policies, read_files
    from compiler.diagnostics import error
    from compiler.lock import LOCK_NAME, LockError, apply_lock, lock_path, read_lock, render_lock
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
    result = compile_sources(*read_files(root.files))
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
    locked = apply_lock(result.artifact, lock)
    if args.locked and locked.changes:
        print_diagnostics(result.diagnostics, result.sources, args.format)
        err(f"error: `{lpath}` is out of date ({len(locked.changes)} change(s)); run `egresslaw compile {root.path}` and commit the lock")
        for line in describe_changes(locked.changes):
            err(line)
        return EXIT_DRIFT
    changed = {c.key for c in locked.changes if c.kind == "changed"}
    widenings = find_widenings(locked.previous, locked.artifact, changed) if changed and locked.previous is not None else []
    if widenings and not args.allow_widening:
        diags = list(result.diagnostics)
        for subject, example in widenings:
            diags.append(
                error(
                    "EL0037",
                    f"{subject} widens its published version: {example}",
                    Span(str(lpath), 0, 0, 0, 0),
                    "review the change; pass `--allow-widening` to publish it",
                )
            )
        print_diagnostics(diags, result.sources, args.format)
        return 1
    print_diagnostics(result.diagnostics, result.sources, args.format)
    write_text_atomic(args.output, locked.artifact.to_json())
    write_text_atomic(lpath, render_lock(locked.lock))
    if args.format == "text":
        for line in describe_changes(locked.changes):
            out(line)
        for subject, example in widenings:
            out(f"widening accepted: {subject}: {example}")
        a = locked.artifact
        out(f"wrote {args.output} (digest {a.digest[:16]}…): {len(a.sandbox_profiles)} profile(s), {len(a.connections)} connection(s)")
    return 0


def describe_changes(changes) -> list[str]:
    """One line per published-version change, with hosts added and removed."""
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


def find_widenings(previous, current, changed: set[str]) -> list[tuple[str, str]]:
    """(subject, example request) for every changed subject that admits something its published version denied."""
    from proofs.diff import widenings

    return [(subject, example) for subject, example in widenings(previous, current) if subject in changed]
