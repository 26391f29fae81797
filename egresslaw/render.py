"""Shared renderings for compiler output: diagnostics in text/JSON/SARIF/GitHub annotations, to the right stream."""

from __future__ import annotations

import sys

from compiler.diagnostics import render_github, render_json, render_sarif, render_text
from egresslaw import __version__

FORMATS = ("text", "json", "sarif", "github")
FORMAT_HELP = (
    "text (people, on stderr), json, sarif (SARIF 2.1.0 for code scanning) or github (workflow annotations "
    "`::error file=…,line=…::…`); json, sarif and github go to stdout (default: text)"
)


def add_format_option(parser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="text", help=FORMAT_HELP)


def print_diagnostics(diags, sources: dict[str, str], fmt: str) -> None:
    """Text goes to stderr (it's for people); JSON, SARIF and annotations go to stdout (they're for tools),
    JSON and SARIF even when empty."""
    if fmt == "json":
        sys.stdout.write(render_json(diags) + "\n")
    elif fmt == "sarif":
        sys.stdout.write(render_sarif(diags, sources, __version__))
    elif fmt == "github":
        sys.stdout.write(render_github(diags))
    elif diags:
        sys.stderr.write(render_text(diags, sources) + "\n")
