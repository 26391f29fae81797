"""`egresslaw check PATH…`: parse and admit, write nothing (fast, for pre-commit).

Each path is checked as part of the policy it belongs to: a directory with every policy under it,
a file with the rest of its directory's policy. Several policies are checked separately.
"""

from __future__ import annotations

from egresslaw.common import out
from egresslaw.render import add_format_option, print_diagnostics


def register(sub) -> None:
    p = sub.add_parser(
        "check",
        help="parse and admit policies without writing anything",
        description="parse and admit policies, writing nothing (the pre-commit step); a file is checked as part of "
        "its directory's policy, and several policies are checked separately",
        epilog="exit codes: 0 ok, 1 policy errors, 2 usage or I/O",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="policy files or directories")
    add_format_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from compiler.compile import check
    from compiler.diagnostics import has_errors, sorted_diagnostics

    results = check(args.paths)
    diags = sorted_diagnostics(d for _, r in results for d in r.diagnostics)
    sources = {path: text for _, r in results for path, text in r.sources.items()}
    print_diagnostics(diags, sources, args.format)
    if args.format == "text":
        for root, r in results:
            if root is not None and r.ok:
                a = r.artifact
                out(
                    f"ok: {root.path}: {len(r.sources)} file(s), {len(a.sandbox_profiles)} profile(s), "
                    f"{len(a.connections)} connection(s), {len(a.workers)} worker(s)"
                )
    if any(d.code == "EL0035" for d in diags):
        return 2
    return 1 if has_errors(diags) or not all(r.ok for _, r in results) else 0
