"""`egresslaw fmt PATH… [--check]`: rewrite policies in canonical form."""

from __future__ import annotations

from egresslaw.common import err, out, write_text_atomic


def register(sub) -> None:
    p = sub.add_parser("fmt", help="format policy files canonically")
    p.add_argument("paths", nargs="+", metavar="PATH", help="policy files or directories")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if any file would change")
    p.set_defaults(run=run)


def run(args) -> int:
    from compiler.compile import parse_sources, read_sources
    from compiler.diagnostics import render_text
    from compiler.fmt import FormatError, format_source

    sources, diags = read_sources(args.paths)
    files, parse_diags = parse_sources(sources)
    diags += parse_diags
    if diags:
        # a file that does not parse is never rewritten: formatting must not lose anything
        err(render_text(diags, sources))
        return 1
    changed = []
    for tree in files:
        try:
            text = format_source(tree)
        except FormatError as exc:
            err(f"error: cannot format {exc}")
            return 1
        if text != sources[tree.path]:
            changed.append(tree.path)
            if not args.check:
                write_text_atomic(tree.path, text)
    for path in changed:
        out(f"{'would reformat' if args.check else 'formatted'} {path}")
    return 1 if (args.check and changed) else 0
