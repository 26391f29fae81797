"""`egresslaw fmt PATH… [--check]`: rewrite policies in canonical form.

Exit codes: 0 nothing to change (or every file formatted), 1 a file would be reformatted
(`--check` only), 2 a file does not parse or cannot be read (it is never rewritten) or a usage error.
"""

from __future__ import annotations

from egresslaw.common import err, out, write_text_atomic

EXIT_WOULD_REFORMAT = 1
EXIT_BROKEN = 2


def register(sub) -> None:
    p = sub.add_parser(
        "fmt",
        help="format policy files canonically",
        description="rewrite policy files in canonical layout, keeping every comment; a file that does not parse is "
        "never rewritten",
        epilog="exit codes: 0 nothing to change (or formatted), 1 would reformat (--check), "
        "2 a file does not parse or cannot be read, or a usage error",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="policy files or directories")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if any file would change")
    p.set_defaults(run=run)


def run(args) -> int:
    from compiler.compile import parse_sources, read_sources
    from compiler.diagnostics import render_text, sorted_diagnostics
    from compiler.fmt import FormatError, format_source

    sources, diags = read_sources(args.paths)
    files, parse_diags = parse_sources(sources)
    diags = sorted_diagnostics(diags + parse_diags)
    broken = bool(diags)
    if diags:
        # a file that does not parse is never rewritten: formatting must not lose anything
        err(render_text(diags, sources))
    changed = []
    for tree in files:
        try:
            text = format_source(tree)
        except FormatError as exc:
            err(f"error: cannot format {exc}")
            broken = True
            continue
        if text != sources[tree.path]:
            changed.append(tree.path)
            if not args.check:
                write_text_atomic(tree.path, text)
    for path in changed:
        out(f"{'would reformat' if args.check else 'formatted'} {path}")
    if broken:
        return EXIT_BROKEN
    return EXIT_WOULD_REFORMAT if (args.check and changed) else 0
