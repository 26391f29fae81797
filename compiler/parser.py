"""The Lark edge: source text -> SourceFile with spans, or located syntax diagnostics. Nothing is validated here."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from lark import Lark, Token, Transformer, UnexpectedInput, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedToken

from compiler.diagnostics import Diagnostic, error
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
    Span,
    Str,
)

GRAMMAR = Path(__file__).with_name("grammar.lark")


@functools.cache
def lark_parser(strict: bool = False) -> Lark:
    """The LALR parser, built once per process (and cached on disk by Lark)."""
    return Lark(
        GRAMMAR.read_text(),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=False,
        cache=not strict,
        strict=strict,
    )


def _span(path: str, meta) -> Span:
    return Span(path, meta.line, meta.column, meta.end_line, meta.end_column)


def _tok_span(path: str, tok: Token) -> Span:
    return Span(path, tok.line, tok.column, tok.end_line, tok.end_column)


def _unquote(tok: Token) -> str:
    # INVARIANT: the STRING terminal only admits JSON string syntax, so json.loads cannot fail here.
    return json.loads(tok)


class _Build(Transformer):
    """Builds syntax nodes only; every judgement happens in the passes."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @v_args(meta=True)
    def start(self, meta, children):
        header, *decls = children
        return header, tuple(decls)

    def header(self, children):
        (tok,) = children
        return int(tok), _tok_span(self.path, tok)

    @v_args(meta=True)
    def decl(self, meta, children):
        kind, tok, *body = children
        return Named(
            str(kind), _unquote(tok), body[0] if body else None,
            _tok_span(self.path, kind), _tok_span(self.path, tok), _span(self.path, meta),
        )

    @v_args(meta=True)
    def named(self, meta, children):
        return self.decl(meta, children)

    @v_args(meta=True)
    def object(self, meta, children):
        pairs = tuple(c for c in children if isinstance(c, Pair))
        blocks = tuple(c for c in children if isinstance(c, Named))
        return Obj(pairs, blocks, _span(self.path, meta))

    def pair(self, children):
        (key, quoted, key_span), value = children
        return Pair(key, value, quoted, key_span)

    def bare_key(self, children):
        (tok,) = children
        return str(tok), False, _tok_span(self.path, tok)

    def quoted_key(self, children):
        (tok,) = children
        return _unquote(tok), True, _tok_span(self.path, tok)

    def string(self, children):
        (tok,) = children
        return Str(_unquote(tok), _tok_span(self.path, tok))

    def number(self, children):
        (tok,) = children
        text = str(tok)
        value: int | float = int(text) if text.lstrip("-").isdigit() else float(text)
        return Num(value, text, _tok_span(self.path, tok))

    @v_args(meta=True)
    def true(self, meta, children):
        return Bool(True, _span(self.path, meta))

    @v_args(meta=True)
    def false(self, meta, children):
        return Bool(False, _span(self.path, meta))

    @v_args(meta=True)
    def null(self, meta, children):
        return Null(_span(self.path, meta))

    def ref(self, children):
        (tok,) = children
        return Ref(str(tok), _tok_span(self.path, tok))

    @v_args(meta=True)
    def list(self, meta, children):
        return ListV(tuple(c for c in children if c is not None), _span(self.path, meta))


# Friendly syntax errors: each label comes with broken snippets that fail in the same parser state
# (lark's `UnexpectedInput.match_examples`).
_EXAMPLES: dict[str, tuple[str, list[str]]] = {
    "bad-string": ("unterminated string or invalid escape", []),
    "missing-header": (
        "a policy file must start with `egresslaw 1`",
        ['workspace "a"', 'catalog "x"', 'connection "c" {}', 'worker "w" {}', ''],
    ),
    "missing-value": (
        "expected a value after `=`",
        ['egresslaw 1\nworker "w" { a = }', 'egresslaw 1\nworker "w" { a: }'],
    ),
    "missing-assign": (
        "expected `=` or `:` between a key and its value",
        ['egresslaw 1\nworker "w" { a "b" }', 'egresslaw 1\nworker "w" { a 1 }', 'egresslaw 1\nworker "w" { a true }'],
    ),
    "unclosed-block": (
        "a block is not closed; expected `}`",
        ['egresslaw 1\nworker "w" { a = 1', 'egresslaw 1\nconnection "c" { a = 1', 'egresslaw 1\nworker "w" {'],
    ),
    "unclosed-list": (
        "a list is not closed; expected `]`",
        ['egresslaw 1\nworker "w" { a = [1, 2 }', 'egresslaw 1\nworker "w" { a = ["x" "y"] }', 'egresslaw 1\nworker "w" { a = [1 2] }'],
    ),
    "unquoted-name": (
        "expected a quoted name after the declaration keyword",
        ['egresslaw 1\nworker w {}', 'egresslaw 1\nconnection c {}', 'egresslaw 1\nworkspace acme'],
    ),
    "stray-assignment": (
        "expected a declaration such as `worker \"name\" { … }`, not an assignment",
        ['egresslaw 1\nx = 1', 'egresslaw 1\nworker = 1'],
    ),
}

_HELP = {
    "missing-header": "add `egresslaw 1` as the first line",
    "missing-value": "write a value: a string, a number, `true`/`false`, a list or an object",
    "missing-assign": "write `key = value`",
    "unclosed-block": "add the missing `}`",
    "unclosed-list": "separate items with `,` and close the list with `]`",
    "unquoted-name": 'declarations look like `worker "edge" { … }`; settings go inside the braces',
    "bad-string": "close the string with `\"`; strings are one line, with JSON escapes (`\\n`, `\\\"`, `\\u00e9`)",
    "stray-assignment": "settings go inside a declaration's `{ … }` block",
}


@functools.cache
def _example_states() -> dict[tuple[int, bool], str]:
    """(LALR state number, at end of input) -> label, from the broken snippets (first label wins)."""
    table: dict[tuple[int, bool], str] = {}
    for label, (_, snippets) in _EXAMPLES.items():
        for snippet in snippets:
            try:
                lark_parser().parse(snippet)
            except UnexpectedInput as exc:
                state = getattr(exc, "state", None)
                if state is not None:
                    table.setdefault((state.position, _at_end(exc)), label)
    return table


def _classify(exc: UnexpectedInput, text: str) -> str | None:
    # Like lark's `match_examples`, but keyed on the LALR state alone: lark also compares stack depth,
    # which differs with nesting, so a snippet at top level would never match the same error in a block.
    if isinstance(exc, UnexpectedEOF):
        return "unclosed-block" if text.count("{") > text.count("}") else None
    if isinstance(exc, UnexpectedCharacters) and text[exc.pos_in_stream : exc.pos_in_stream + 1] == '"':
        return "bad-string"
    state = getattr(exc, "state", None)
    if state is None:
        return None
    return _example_states().get((state.position, _at_end(exc)))


def _at_end(exc: UnexpectedInput) -> bool:
    token = getattr(exc, "token", None)
    return token is not None and token.type == "$END"


def parse_source(text: str, path: str) -> tuple[SourceFile | None, list[Diagnostic]]:
    """Parse one file. Returns the syntax tree or one located syntax diagnostic, never raises on bad input."""
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        return None, [error("EL0001", "file contains a NUL byte", Span(path, line, 1, line, 2), "remove it")]
    comments: list[tuple[int, int, str]] = []
    parser = lark_parser()
    try:
        tree = parser.parse(text)
    except UnexpectedInput as exc:
        return None, [_syntax_diagnostic(exc, text, path)]
    (version, version_span), decls = _Build(path).transform(tree)
    for i, line in enumerate(text.splitlines(), start=1):
        # Comments for the formatter: lexing is the source of truth for where they are.
        pos = _comment_start(line)
        if pos is not None:
            comments.append((i, pos + 1, line[pos:].rstrip()))
    return SourceFile(path, version, decls, version_span, text, tuple(comments)), []


def _outside_strings(line: str):
    """(index, character) for every character of `line` outside a string literal (quotes excluded)."""
    in_str = False
    escaped = False
    for i, c in enumerate(line):
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        else:
            yield i, c


def _comment_start(line: str) -> int | None:
    """Index of a `#` that starts a comment (not inside a string), or None."""
    return next((i for i, c in _outside_strings(line) if c == "#"), None)


def _unclosed(text: str) -> tuple[str, int, int] | None:
    """The innermost `{` or `[` never closed (outside strings and comments): (char, line, column), or None."""
    stack: list[tuple[str, int, int]] = []
    closing = {"}": "{", "]": "["}
    for number, line in enumerate(text.splitlines(), start=1):
        for i, c in _outside_strings(line):
            if c == "#":
                break
            if c in "{[":
                stack.append((c, number, i + 1))
            elif c in closing and stack and stack[-1][0] == closing[c]:
                stack.pop()
    return stack[-1] if stack else None


def _looks_like_cma(text: str) -> bool:
    """A Claude Managed Agents environment (JSON or YAML) saved as `.egress` instead of imported."""
    head = text.lstrip()
    if head.startswith("{"):
        return '"networking"' in text or '"config"' in text or '"allowed_hosts"' in text
    return any(line.split(":", 1)[0].strip() in ("name", "config", "networking") and ":" in line
               for line in text.splitlines()[:20] if line and not line.startswith((" ", "#", "\t")))


def _syntax_diagnostic(exc: UnexpectedInput, text: str, path: str) -> Diagnostic:
    if _looks_like_cma(text) and not text.lstrip().startswith("egresslaw"):
        return error(
            "EL0001",
            "this is a Claude Managed Agents environment (JSON or YAML), not egresslaw source",
            Span(path, 1, 1, 1, 2),
            f"convert it: `egresslaw import-cma {path} > policy.egress` (keep the environment file under its own name)",
        )
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and _at_end(exc)):
        opener = _unclosed(text)
        if opener is not None:
            char, line, column = opener
            what, close = ("block", "}") if char == "{" else ("list", "]")
            return error(
                "EL0001",
                f"a {what} is not closed: the `{char}` opened at line {line}, column {column} has no matching `{close}`",
                Span(path, line, column, line, column + 1),
                f"add the missing `{close}` (the file ends inside this {what})",
            )
    line = getattr(exc, "line", 1) or 1
    column = getattr(exc, "column", 1) or 1
    if isinstance(exc, UnexpectedEOF) or line < 1:
        lines = text.splitlines() or [""]
        line = len(lines)
        column = len(lines[-1]) + 1
    width = 1
    found = ""
    if isinstance(exc, UnexpectedToken) and exc.token is not None and exc.token.type != "$END":
        width = max(1, len(str(exc.token)))
        found = f" (found `{_short(str(exc.token))}`)"
    elif isinstance(exc, UnexpectedCharacters):
        found = f" (found `{_short(text[exc.pos_in_stream:exc.pos_in_stream + 1])}`)"
    span = Span(path, line, column, line, column + width)
    label = _classify(exc, text)
    if label is not None:
        message, _ = _EXAMPLES[label]
        if label in ("unclosed-block", "unclosed-list"):
            pos = getattr(exc, "pos_in_stream", None)
            opener = _unclosed(text[:pos] if isinstance(pos, int) else text)
            if opener is not None:
                found += f"; the `{opener[0]}` opened at line {opener[1]}, column {opener[2]}"
        return error("EL0001", message + found, span, _HELP[label])
    expected = _expected(exc)
    help = f"expected one of: {expected}" if expected else None
    return error("EL0001", f"unexpected input{found}", span, help)


def _short(s: str) -> str:
    s = s.encode("unicode_escape").decode("ascii")
    return s if len(s) <= 40 else s[:37] + "..."


_TERMINAL_NAMES = {
    "RBRACE": "`}`", "LBRACE": "`{`", "RSQB": "`]`", "LSQB": "`[`", "COMMA": "`,`", "EQUAL": "`=`",
    "COLON": "`:`", "STRING": "a string", "NAME": "a name", "SIGNED_NUMBER": "a number", "INT": "a number",
    "TRUE": "`true`", "FALSE": "`false`", "NULL": "`null`",
}


def _expected(exc: UnexpectedInput) -> str:
    names = getattr(exc, "expected", None) or getattr(exc, "allowed", None) or set()
    shown = sorted({_TERMINAL_NAMES.get(n, f"`{n.lower()}`") for n in names})
    return ", ".join(shown[:8])
