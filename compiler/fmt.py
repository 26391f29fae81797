"""Canonical formatting: one layout for every policy, comments kept, idempotent, meaning unchanged."""

from __future__ import annotations

import json
import re

from compiler.errors import CompilerError
from compiler.syntax import (
    Bool,
    ListV,
    Named,
    Null,
    Num,
    Obj,
    Pair,
    Ref,
    SourceFile,
    Str,
    Value,
)

INDENT = "  "
WIDTH = 100
_BARE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_KEYWORDS = {"true", "false", "null"}


class _Comments:
    """Comments by line, handed out as the printer passes the lines they were on."""

    def __init__(self, comments: tuple[tuple[int, int, str], ...]):
        self.pending = sorted(comments)

    def before(self, line: int) -> list[str]:
        """Comments on lines before `line` (own-line comments), consumed."""
        out = [c for c in self.pending if c[0] < line]
        self.pending = [c for c in self.pending if c[0] >= line]
        return [text for _, _, text in out]

    def trailing(self, line: int) -> str | None:
        """A comment at the end of `line`, consumed."""
        for c in self.pending:
            if c[0] == line:
                self.pending.remove(c)
                return c[2]
        return None

    def rest(self) -> list[str]:
        out = [text for _, _, text in self.pending]
        self.pending = []
        return out


class FormatError(CompilerError):
    """The file parses but holds something the formatter cannot print without losing it."""


def _check_printable(value: Value) -> None:
    if isinstance(value, ListV):
        for v in value.items:
            _check_printable(v)
    elif isinstance(value, Obj):
        if value.blocks:
            b = value.blocks[0]
            raise FormatError(f"{b.span.path}:{b.span.line}:{b.span.column}: a `{b.kind}` block inside a value")
        for p in value.pairs:
            _check_printable(p.value)


def format_source(tree: SourceFile) -> str:
    """The canonical text of one parsed file (raises FormatError rather than drop anything)."""
    for decl in tree.decls:
        for pair in decl.body.pairs if decl.body else ():
            _check_printable(pair.value)
        for block in decl.body.blocks if decl.body else ():
            for pair in block.body.pairs if block.body else ():
                _check_printable(pair.value)
            if block.body and block.body.blocks:
                b = block.body.blocks[0]
                raise FormatError(f"{b.span.path}:{b.span.line}:{b.span.column}: a `{b.kind}` block nested too deep")
    comments = _Comments(tree.comments)
    out: list[str] = []
    out += comments.before(tree.version_span.line)
    out.append(_with_trailing(f"egresslaw {tree.version}", comments.trailing(tree.version_span.line)))
    previous_kind = None
    for decl in tree.decls:
        leading = comments.before(decl.span.line)
        header_kinds = ("workspace", "catalog")
        if not (decl.kind in header_kinds and previous_kind in header_kinds) or leading:
            out.append("")
        out += leading
        out += _decl(decl, comments, 0)
        previous_kind = decl.kind
    tail = comments.rest()
    if tail:
        out.append("")
        out += tail
    return "\n".join(out).rstrip("\n") + "\n"


def _with_trailing(text: str, comment: str | None) -> str:
    return f"{text}  {comment}" if comment else text


def _decl(decl: Named, comments: _Comments, depth: int) -> list[str]:
    pad = INDENT * depth
    head = f"{pad}{decl.kind} {_string(decl.name)}"
    if decl.body is None:
        return [_with_trailing(head, comments.trailing(decl.span.line))]
    trailing_open = comments.trailing(decl.span.line) if decl.body.pairs and decl.body.pairs[0].key_span.line != decl.span.line else None
    lines = [_with_trailing(head + " {", trailing_open)]
    entries: list[tuple[int, object]] = [(p.key_span.line, p) for p in decl.body.pairs]
    entries += [(b.span.line, b) for b in decl.body.blocks]
    # INVARIANT: pairs and blocks are printed in source order; rule order is semantic (first match wins).
    entries.sort(key=lambda e: (e[0], 0 if isinstance(e[1], Pair) else 1))
    for i, (line, entry) in enumerate(entries):
        leading = comments.before(line)
        if isinstance(entry, Named):
            if i > 0:
                lines.append("")
            lines += [INDENT * (depth + 1) + c for c in leading]
            lines += _decl(entry, comments, depth + 1)
        else:
            lines += [INDENT * (depth + 1) + c for c in leading]
            value = _value(entry.value, depth + 1, len(pad) + len(INDENT) + len(_key(entry)) + 3)
            text = f"{INDENT * (depth + 1)}{_key(entry)} = {value}"
            end_line = entry.value.span.end_line or line
            lines.append(_with_trailing(text, comments.trailing(end_line) or comments.trailing(line)))
    inner = comments.before(decl.span.end_line)
    lines += [INDENT * (depth + 1) + c for c in inner]
    lines.append(_with_trailing(pad + "}", comments.trailing(decl.span.end_line)))
    return lines


def _key(pair: Pair) -> str:
    if not pair.quoted and _BARE_KEY.match(pair.key) and pair.key not in _KEYWORDS:
        return pair.key
    return _string(pair.key)


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value(value: Value, depth: int, column: int) -> str:
    """A value, inline when it is flat and fits, otherwise one item per line."""
    inline = _inline(value)
    if inline is not None and column + len(inline) <= WIDTH:
        return inline
    pad = INDENT * (depth + 1)
    if isinstance(value, ListV):
        items = [f"{pad}{_value(v, depth + 1, len(pad))}" for v in value.items]
        return "[\n" + ",\n".join(items) + "\n" + INDENT * depth + "]"
    if isinstance(value, Obj):
        items = []
        for p in value.pairs:
            key = _string(p.key)
            items.append(f"{pad}{key}: {_value(p.value, depth + 1, len(pad) + len(key) + 2)}")
        # no trailing comma: a formatted object stays valid JSON, so it pastes back into CMA
        return "{\n" + ",\n".join(items) + "\n" + INDENT * depth + "}"
    return inline or ""


def _inline(value: Value) -> str | None:
    if isinstance(value, Str):
        return _string(value.value)
    if isinstance(value, Num):
        return value.text
    if isinstance(value, Bool):
        return "true" if value.value else "false"
    if isinstance(value, Null):
        return "null"
    if isinstance(value, Ref):
        return value.name
    if isinstance(value, ListV):
        parts = [_inline(v) for v in value.items]
        if any(p is None or isinstance(v, (ListV, Obj)) for p, v in zip(parts, value.items)):
            return None
        return "[" + ", ".join(parts) + "]"
    if isinstance(value, Obj):
        if value.blocks:
            return None
        parts = []
        for p in value.pairs:
            inner = _inline(p.value)
            if inner is None or isinstance(p.value, (ListV, Obj)):
                return None
            parts.append(f"{_string(p.key)}: {inner}")
        return "{" + ", ".join(parts) + "}" if parts else "{}"
    return None
