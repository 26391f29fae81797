"""Shared renderings for compiler output: diagnostics in text/JSON/SARIF, to the right stream."""

from __future__ import annotations

import sys

from compiler.diagnostics import render_json, render_sarif, render_text
from egresslaw import __version__

FORMATS = ("text", "json", "sarif")


def add_format_option(parser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="text", help="how to print diagnostics (default: text)")


def print_diagnostics(diags, sources: dict[str, str], fmt: str) -> None:
    """Text goes to stderr (it's for people); JSON and SARIF go to stdout (they're for tools), even when empty."""
    if fmt == "json":
        sys.stdout.write(render_json(diags) + "\n")
    elif fmt == "sarif":
        sys.stdout.write(render_sarif(diags, sources, __version__) + "\n")
    elif diags:
        sys.stderr.write(render_text(diags, sources) + "\n")
