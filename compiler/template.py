"""Path templates (docs/shapes.md, "path"): `/repos/{owner:acme}/{n:int(1..100)}` -> artifact `Segment`s.

The text is parsed by a small Lark grammar (`template.lark`); this module judges what it parsed: literal segments
in normal form (the path normalizer's rules), unique variable names, integer ranges in order, enum values that are
normal segments, patterns of the subset (`compiler.patterns`). Every refusal is a `TemplateError` (or, for a
pattern, a `PatternError`) with the character offset in the template text.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from lark import Lark, Token, Tree, UnexpectedInput
from lark.exceptions import UnexpectedToken

from compiler.artifact import Segment, Value
from compiler.errors import CompilerError
from compiler.normalize import PathError, normalize_path
from compiler.patterns import PatternError, parse_pattern

GRAMMAR = Path(__file__).with_name("template.lark")


class TemplateError(CompilerError):
    """A path template that cannot be admitted: `message`, `offset` (character offset in the template), `help`."""

    def __init__(self, message: str, offset: int, help: str | None = None) -> None:
        super().__init__(message, help)
        self.offset = offset


@functools.cache
def template_parser() -> Lark:
    """The template grammar's LALR parser, built once per process."""
    return Lark(GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


def parse_template(text: str) -> tuple[Segment, ...]:
    """The segments of `text`, in order (a trailing `/` is a last, empty literal segment)."""
    if not text.startswith("/"):
        raise TemplateError("a path template starts with `/`", 0, "write the whole path, e.g. `/repos/{owner}`")
    for i, c in enumerate(text):
        if c in "?#":
            raise TemplateError(f"a path template holds no `{c}`", i, "shape the query with `query = { … }`")
    try:
        tree = template_parser().parse(text)
    except UnexpectedInput as exc:
        at_end = isinstance(exc, UnexpectedToken) and exc.token.type == "$END"
        offset = len(text) if at_end else max(0, (exc.column or 1) - 1)
        raise TemplateError(_syntax_message(text, offset), offset,
                            "a segment is a literal or one `{name}`, `{name:int}`, `{name:int(LO..HI)}`, "
                            "`{name:a|b}` or `{name:/PATTERN/}`") from None
    parts: list[Tree] = tree.children
    segments: list[Segment] = []
    names: set[str] = set()
    for index, part in enumerate(parts):
        if not part.children:
            if index != len(parts) - 1:
                raise TemplateError("an empty segment (`//`)", part.meta.start_pos, "remove the extra `/`")
            segments.append(Segment(literal=""))
            continue
        node = part.children[0]
        if node.data == "literal":
            tok = node.children[0]
            segments.append(Segment(literal=_literal(str(tok), tok.start_pos)))
            continue
        name_tok: Token = node.children[0]
        if str(name_tok) in names:
            raise TemplateError(f"variable `{name_tok}` is named twice", name_tok.start_pos, "give each variable its own name")
        names.add(str(name_tok))
        value = Value(type="string") if node.data == "any" else _constraint(node.children[1], name_tok.end_pos + 1)
        segments.append(Segment(name=str(name_tok), value=value))
    return tuple(segments)


def template_prefix(segments: tuple[Segment, ...]) -> str:
    """The canonical literal prefix before the first variable segment (`/` when the first segment is one)."""
    literals = []
    for segment in segments:
        if segment.literal is None:
            break
        literals.append(segment.literal)
    return ("/" + "/".join(literals)).rstrip("/") or "/"


def _literal(text: str, offset: int) -> str:
    """A literal segment in normal form, or the refusal (`.`/`..`, `;`, encoded `/` or `.`, a lowercase escape, …)."""
    try:
        normal = normalize_path("/" + text)[1:]
    except PathError as exc:
        raise TemplateError(f"segment `{_show(text)}`: {exc.message}", offset,
                            "write the segment as the normalized request path has it") from None
    if normal != text:
        raise TemplateError(f"segment `{_show(text)}` is not in normal form", offset, f"write `{_show(normal)}`")
    return text


def _constraint(tree: Tree, offset: int) -> Value:
    kind = tree.data
    if kind == "int_any":
        return Value(type="integer")
    if kind == "int_range":
        low_tok, high_tok = tree.children
        low, high = _number(low_tok), _number(high_tok)
        if low > high:
            raise TemplateError(f"range `{low}..{high}` is reversed", low_tok.start_pos, f"write `{high}..{low}`")
        return Value(type="integer", minimum=low, maximum=high)
    if kind == "pattern":
        tok: Token = tree.children[0]
        text = str(tok)[1:-1]
        try:
            parse_pattern(text)
        except PatternError as exc:
            raise PatternError(exc.message, tok.start_pos + 1 + exc.offset, exc.help) from None
        return Value(type="string", pattern=text)
    values: dict[str, None] = {}
    for option in tree.children:
        tok = option.children[0]
        # INVARIANT: the STRING terminal only admits JSON string syntax, so json.loads cannot fail here.
        value = json.loads(str(tok)) if option.data == "quoted" else str(tok)
        if not value:
            raise TemplateError("an empty option", tok.start_pos, "a segment is never empty")
        _literal(value, tok.start_pos)
        values[value] = None
    return Value(type="string", enum=tuple(sorted(values)))


def _number(tok: Token) -> int:
    text = str(tok)
    if text.lstrip("-").startswith("0") and text.lstrip("-") != "0" or text == "-0":
        raise TemplateError(f"`{text}` is not a canonical decimal number", tok.start_pos, f"write `{int(text)}`")
    return int(text)


def _syntax_message(text: str, pos: int) -> str:
    if pos >= len(text):
        return "the template ends early (an unclosed `{`?)"
    return f"unexpected `{_show(text[pos])}` in the template"


def _show(text: str) -> str:
    shown = text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 60 else shown[:57] + "..."
