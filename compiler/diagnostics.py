"""Diagnostics as data (HCL-style) and their three renderings: text, JSON and SARIF 2.1.0."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from compiler import sarif
from compiler.codes import BY_ID, CODES
from compiler.secrets_scan import mask_secrets
from compiler.syntax import NO_SPAN, Span

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Diagnostic:
    code: str
    message: str
    span: Span = NO_SPAN
    help: str | None = None
    severity: Severity = "error"

    def __post_init__(self) -> None:
        if self.code not in BY_ID:  # INVARIANT: every code is documented
            raise ValueError(f"undocumented diagnostic code {self.code}")

    @property
    def sort_key(self) -> tuple:
        s = self.span
        return (s.path, s.line, s.column, self.code, self.message)


def error(code: str, message: str, span: Span = NO_SPAN, help: str | None = None) -> Diagnostic:
    return Diagnostic(code, message, span, help, "error")


def warning(code: str, message: str, span: Span = NO_SPAN, help: str | None = None) -> Diagnostic:
    return Diagnostic(code, message, span, help, "warning")


def has_errors(diags: list[Diagnostic] | tuple[Diagnostic, ...]) -> bool:
    return any(d.severity == "error" for d in diags)


def sorted_diagnostics(diags) -> list[Diagnostic]:
    """Stable order, duplicates removed."""
    seen = set()
    out = []
    for d in sorted(diags, key=lambda d: d.sort_key):
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def render_text(diags, sources: dict[str, str]) -> str:
    """`path:line:col: error[EL0123]: message`, the source line, a caret under the span, then `help:`."""
    blocks = []
    for d in diags:
        s = d.span
        if s.line:
            head = f"{s.path}:{s.line}:{s.column}: {d.severity}[{d.code}]: {d.message}"
        else:
            head = f"{s.path}: {d.severity}[{d.code}]: {d.message}"
        lines = [head]
        text = sources.get(s.path)
        if text is not None and s.line:
            src_lines = text.splitlines()
            if 0 < s.line <= len(src_lines):
                src = mask_secrets(src_lines[s.line - 1].replace("\t", " "))
                width = (s.end_column - s.column) if s.end_line == s.line else len(src) - s.column + 1
                gutter = str(s.line)
                lines.append(f"{' ' * len(gutter)} |")
                lines.append(f"{gutter} | {src}")
                lines.append(f"{' ' * len(gutter)} | {' ' * (s.column - 1)}{'^' * max(1, width)}")
        if d.help:
            lines.append(f"help: {d.help}")
        blocks.append("\n".join(lines))
    errors = sum(1 for d in diags if d.severity == "error")
    warnings = len(diags) - errors
    if diags:
        blocks.append(f"{errors} error{'s' if errors != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}")
    return "\n\n".join(blocks)


def _as_dict(d: Diagnostic) -> dict:
    s = d.span
    return {
        "code": d.code,
        "severity": d.severity,
        "message": d.message,
        "help": d.help,
        "path": s.path,
        "line": s.line,
        "column": s.column,
        "end_line": s.end_line,
        "end_column": s.end_column,
    }


def render_json(diags) -> str:
    return json.dumps({"diagnostics": [_as_dict(d) for d in diags]}, indent=2, sort_keys=True)


def fingerprint(d: Diagnostic, sources: dict[str, str]) -> str:
    """Stable across unrelated edits: code, file, message and the text of the flagged line, not its number."""
    line_text = ""
    text = sources.get(d.span.path)
    if text is not None and d.span.line:
        src = text.splitlines()
        if 0 < d.span.line <= len(src):
            line_text = mask_secrets(src[d.span.line - 1].strip())
    raw = "\x1f".join((d.code, d.span.path, d.message, line_text))
    return hashlib.sha256(raw.encode()).hexdigest()


def render_sarif(diags, sources: dict[str, str], tool_version: str) -> str:
    """SARIF 2.1.0: one run, ruleId = error code, partialFingerprints stable across line shifts, and a
    physical location on every result (the file alone when no line is known, e.g. an unreadable path)."""
    index = {c.id: i for i, c in enumerate(CODES)}
    results = []
    for d in diags:
        result = {
            "ruleId": d.code,
            "ruleIndex": index[d.code],
            "level": d.severity,
            "message": {"text": d.message + (f"\nhelp: {d.help}" if d.help else "")},
            "partialFingerprints": {"egresslawDiagnostic/v1": fingerprint(d, sources)},
        }
        if d.span.path != NO_SPAN.path:
            result["locations"] = [sarif.physical_location(d.span.path, d.span)]
        results.append(result)
    driver = {"name": "egresslaw", "version": tool_version, "rules": [sarif.rule(c.id, c.summary, c.name) for c in CODES]}
    return sarif.document(driver, results)


def render_github(diags) -> str:
    """GitHub workflow annotations, one line per diagnostic (`::error file=…,line=…,col=…::…`)."""
    lines = []
    for d in diags:
        path = d.span.path if d.span.path != NO_SPAN.path else None
        message = d.message + (f"\nhelp: {d.help}" if d.help else "")
        line = sarif.github_annotation(d.severity, message, f"{d.code} {BY_ID[d.code].name}", path, d.span)
        if line:
            lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")
