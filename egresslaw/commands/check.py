"""`egresslaw check PATH…`: parse and admit, write nothing (fast, for pre-commit)."""

from __future__ import annotations

from egresslaw.common import out
from egresslaw.render import add_format_option, print_diagnostics


def register(sub) -> None:
    p = sub.add_parser("check", help="parse and admit policies without writing anything")
    p.add_argument("paths", nargs="+", metavar="PATH", help="policy files or directories")
    add_format_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    from compiler.compile import check

    result = check(args.paths)
    print_diagnostics(result.diagnostics, result.sources, args.format)
    if not result.ok:
        return 2 if any(d.code == "EL0035" for d in result.diagnostics) else 1
    if args.format == "text":
        a = result.artifact
        out(f"ok: {len(result.sources)} file(s), {len(a.sandbox_profiles)} profile(s), {len(a.connections)} connection(s), {len(a.workers)} worker(s)")
    return 0
