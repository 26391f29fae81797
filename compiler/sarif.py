"""What every tool-facing rendering shares: SARIF 2.1.0 documents and GitHub workflow annotations.

Diagnostics (`check`, `compile`), proof reports (`prove`) and semantic diffs (`diff`) each build
their results here, so every result has a physical location and the same escaping rules apply.
Locations come from the artifact's `SourceMap` (where each worker, subject and rule was written).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from compiler.artifact import SourceMap, SourceSpan

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
Level = Literal["error", "warning", "note", "none"]
_GITHUB_COMMAND = {"error": "error", "warning": "warning", "note": "notice"}


def region(line: int, column: int, end_line: int, end_column: int) -> dict[str, int]:
    """A SARIF region; columns are only given when known (SARIF columns are 1-based)."""
    out = {"startLine": line}
    if column >= 1:
        out["startColumn"] = column
    if end_line >= line:
        out["endLine"] = end_line
        if column >= 1 and end_column >= 1 and (end_line > line or end_column > column):
            out["endColumn"] = end_column
    return out


def physical_location(path: str, span: SourceSpan | None = None, logical: str | None = None) -> dict[str, Any]:
    """One SARIF `location`: the file, the region when a line is known, and an optional logical name."""
    physical: dict[str, Any] = {"artifactLocation": {"uri": path}}
    if span is not None and span.line >= 1:
        physical["region"] = region(span.line, span.column, span.end_line, span.end_column)
    location: dict[str, Any] = {"physicalLocation": physical}
    if logical:
        location["logicalLocations"] = [{"fullyQualifiedName": logical}]
    return location


def document(driver: dict[str, Any], results: list[dict[str, Any]], properties: dict[str, Any] | None = None) -> str:
    """A SARIF 2.1.0 log with one run."""
    run: dict[str, Any] = {"tool": {"driver": driver}, "results": results}
    if properties:
        run["properties"] = properties
    return json.dumps({"$schema": SCHEMA_URI, "version": "2.1.0", "runs": [run]}, sort_keys=True, indent=2, ensure_ascii=True) + "\n"


def rule(rule_id: str, summary: str, name: str | None = None) -> dict[str, Any]:
    return {"id": rule_id, "name": name or rule_id, "shortDescription": {"text": summary}}


def subject_key(subject: str) -> str:
    """The SourceMap key of a subject written as `connection:C`, `profile:P`, `sandbox_profile:P` or `worker:W`."""
    kind, _, name = subject.partition(":")
    return f"profile:{name}" if kind == "sandbox_profile" else subject


def locate(locations: SourceMap | None, subject: str, worker: str | None = None, rule: str | None = None,
           setting: str | None = None, keys: Iterable[str] = ()) -> SourceSpan | None:
    """The most specific place a result about `subject` points at: the rule (and one of its `keys`), the
    worker setting, the subject, the worker, and finally the policy's `workspace` declaration."""
    if locations is None:
        return None
    subject = subject_key(subject)
    kind, _, name = subject.partition(":")
    wanted: list[str] = []
    if rule and kind == "connection":
        wanted += [f"rule:{name}/{rule}.{k}" for k in keys] + [f"rule:{name}/{rule}"]
    if setting:
        for w in filter(None, (name if kind == "worker" else None, worker)):
            wanted.append(f"worker:{w}.{setting}")
    wanted += [f"{subject}.{k}" for k in keys] + [subject]
    if worker:
        wanted.append(f"worker:{worker}")
    wanted += ["workspace", "catalog"]
    return locations.first(*wanted)


def github_annotation(level: Level, message: str, title: str, path: str | None = None, span: SourceSpan | None = None) -> str | None:
    """A GitHub Actions workflow command (`::error file=…,line=…,col=…::…`), or None for a passing result."""
    command = _GITHUB_COMMAND.get(level)
    if command is None:
        return None
    props: list[str] = []
    if path:
        props.append(f"file={_escape_property(path)}")
        if span is not None and span.line >= 1:
            props.append(f"line={span.line}")
            if span.end_line >= span.line:
                props.append(f"endLine={span.end_line}")
            if span.column >= 1:
                props.append(f"col={span.column}")
                if span.end_line == span.line and span.end_column > span.column:
                    props.append(f"endColumn={span.end_column}")
    props.append(f"title={_escape_property(title)}")
    return f"::{command} {','.join(props)}::{_escape_data(message)}"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")
