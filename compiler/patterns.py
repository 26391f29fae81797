"""egresslaw's pattern subset (docs/shapes.md, "Patterns"): text -> an explicit AST -> a Python `re` source.

A pattern is matched against a whole value (there are no anchors: `matches` uses `re.fullmatch`). The subset is
what every regular-expression engine reads one way and what the prover translates exactly:

- a literal character (any character but a control character and the metacharacters `\\ . [ ] ( ) | ? * + { } ^ $`),
  or one of those escaped with `\\` (and `\\/`, `\\-`);
- `.`: any character except `\\n`;
- a class `[a-z0-9_-]`, negated `[^/]`: single characters and ranges (`-` is literal first or last, or escaped);
- `\\d` = `[0-9]`, `\\w` = `[A-Za-z0-9_]`, `\\s` = `[ \\t\\n\\r\\f\\v]`, inside or outside a class. ASCII only: no
  Unicode digit, letter or space class is ever meant (the Python source is compiled with `re.ASCII` too);
- groups `( )`, alternation `|`, and the quantifiers `?` `*` `+` `{m}` `{m,n}` (bounds at most 1000).

Refused, with the character offset of the offending place: anchors (`^`, `$`, `\\b`, `\\A`, …), backreferences
(`\\1`), lookaround and every other `(?…)` group, lazy or possessive quantifiers, `{m,}`, a quantifier on a group
that holds a quantifier or `|` (how a pattern backtracks exponentially; even `(a|b)?` is refused: write `[ab]?`),
an empty pattern, group or alternative, unbalanced parentheses or brackets, and bad ranges (`[z-a]`, `{3,1}`).

The AST (`Pattern.node`) is what the prover translates; `Pattern.python` is built from it, never from the text.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Union

from compiler.errors import CompilerError

MAX_REPEAT = 1000
_META = set("\\.[]()|?*+{}^$")
_ESCAPABLE = _META | {"/", "-"}
_DIGIT = (("0", "9"),)
_WORD = (("0", "9"), ("A", "Z"), ("_", "_"), ("a", "z"))
_SPACE = (("\t", "\r"), (" ", " "))  # \t \n \v \f \r and space
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_ANCHOR_ESCAPES = set("bBAZzG")


class PatternError(CompilerError):
    """A pattern outside the subset: `message` says what, `offset` is the character offset in the pattern text."""

    def __init__(self, message: str, offset: int, help: str | None = None) -> None:
        super().__init__(message, help)
        self.offset = offset


# ---------------------------------------------------------------------------------------------
# The AST


@dataclass(frozen=True, slots=True)
class Literal:
    """Exactly this one character."""

    char: str


@dataclass(frozen=True, slots=True)
class CharSet:
    """One character in `ranges` (inclusive `(low, high)` character pairs, sorted and merged), or, when `negated`,
    one character in none of them. `.` is `CharSet((("\\n", "\\n"),), negated=True)`."""

    ranges: tuple[tuple[str, str], ...]
    negated: bool = False


@dataclass(frozen=True, slots=True)
class Seq:
    """Each item in turn (two or more items; a sequence of one is that item)."""

    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    """One of `options` (two or more)."""

    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """`item` at least `low` and at most `high` times (`high` None: no upper bound). `item` holds no Repeat or Alt."""

    item: Node
    low: int
    high: int | None


Node = Union[Literal, CharSet, Seq, Alt, Repeat]


@dataclass(frozen=True, slots=True)
class Pattern:
    """A parsed pattern: its source `text`, its AST `node`, and `python`, a `re` source for `re.fullmatch` (re.ASCII)."""

    text: str
    node: Node
    python: str


# ---------------------------------------------------------------------------------------------
# Parsing


def parse_pattern(text: str) -> Pattern:
    """Parse `text` as a pattern of the subset, or raise PatternError naming what and where."""
    node = _Parser(text).parse()
    return Pattern(text=text, node=node, python=to_python(node))


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def fail(self, message: str, offset: int | None = None, help: str | None = None) -> PatternError:
        return PatternError(message, self.i if offset is None else offset, help)

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def parse(self) -> Node:
        if not self.text:
            raise self.fail("the pattern is empty", 0, "write what the whole value must be, e.g. `[a-z]+`")
        node, _ = self.alternation()
        if self.i < len(self.text):  # only a `)` stops an alternation early
            raise self.fail("`)` closes no group", help="escape it as `\\)` or remove it")
        return node

    def alternation(self) -> tuple[Node, bool]:
        """(node, whether it holds a quantifier or `|` anywhere)."""
        options = []
        risky = False
        while True:
            item_start = self.i
            node, inner = self.sequence()
            if node is None:
                raise self.fail("an empty alternative" if options or self.peek() == "|" else "an empty group", item_start,
                                "write something on each side of `|`, inside each `( )`")
            options.append(node)
            risky |= inner
            if self.peek() != "|":
                break
            self.i += 1
        if len(options) == 1:
            return options[0], risky
        return Alt(tuple(options)), True

    def sequence(self) -> tuple[Node | None, bool]:
        items: list[Node] = []
        risky = False
        while self.i < len(self.text) and self.text[self.i] not in "|)":
            atom_start = self.i
            atom, inner = self.atom()
            quantifier = self.quantifier()
            if quantifier is not None:
                if inner:
                    raise self.fail("a quantifier on a group that holds a quantifier or `|`", atom_start,
                                    "such a pattern can backtrack exponentially; write it without the nesting "
                                    "(e.g. `[ab]+` for `(a|b)+`)")
                low, high = quantifier
                atom = Repeat(atom, low, high)
                risky = True
            risky |= inner
            items.append(atom)
        if not items:
            return None, False
        return (items[0] if len(items) == 1 else Seq(tuple(items))), risky

    def atom(self) -> tuple[Node, bool]:
        c = self.text[self.i]
        start = self.i
        if c == "(":
            if self.text.startswith("(?", self.i):
                raise self.fail("`(?…)` groups (lookaround, flags, named or non-capturing groups) are not in the subset",
                                help="use a plain group `( )`")
            self.i += 1
            node, risky = self.alternation()
            if self.peek() != ")":
                raise self.fail("`(` is never closed", start, "add the `)`")
            self.i += 1
            return node, risky
        if c == "[":
            return self.char_class(), False
        if c == ".":
            self.i += 1
            return CharSet((("\n", "\n"),), negated=True), False
        if c == "\\":
            return self.escape(), False
        if c in "^$":
            raise self.fail(f"`{c}` is an anchor: a pattern always matches the whole value", help=f"remove it, or write `\\{c}`")
        if c in "?*+{":
            raise self.fail(f"`{c}` quantifies nothing", help=f"escape it as `\\{c}`")
        if c in "]}":
            raise self.fail(f"`{c}` closes nothing", help=f"escape it as `\\{c}`")
        self.literal_ok(c)
        self.i += 1
        return Literal(c), False

    def literal_ok(self, c: str) -> None:
        if ord(c) < 0x20 or ord(c) == 0x7F:
            raise self.fail("a control character in a pattern", help="patterns match printable text")

    def escape(self) -> Node:
        start = self.i
        if self.i + 1 >= len(self.text):
            raise self.fail("a pattern ends with `\\`", start, "escape it as `\\\\`")
        c = self.text[self.i + 1]
        self.i += 2
        if c in _CLASS_ESCAPES:
            return CharSet(_CLASS_ESCAPES[c])
        if c in _ESCAPABLE:
            return Literal(c)
        if c.isdigit():
            raise self.fail(f"`\\{c}` is a backreference", start, "the subset has no backreferences")
        if c in _ANCHOR_ESCAPES:
            raise self.fail(f"`\\{c}` is an anchor", start, "a pattern always matches the whole value")
        raise self.fail(f"`\\{_show(c)}` is not an escape of the subset", start,
                        "escape only metacharacters (`\\.`, `\\-`, …); classes are `\\d`, `\\w`, `\\s`")

    def char_class(self) -> CharSet:
        start = self.i
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        items: list[tuple[str, str] | CharSet] = []  # characters and ranges as (low, high), class escapes as CharSet
        single = False  # whether the last item is a single character (a range may start there)
        first = self.i
        while True:
            c = self.peek()
            if c is None:
                raise self.fail("`[` is never closed", start, "add the `]`")
            if c == "]":
                if self.i == first:
                    raise self.fail("an empty class", start, "list at least one character; a `]` inside is `\\]`")
                self.i += 1
                break
            if c == "[":
                raise self.fail("`[` inside a class", help="escape it as `\\[`")
            if c == "-" and self.i != first and self.text[self.i + 1 : self.i + 2] != "]":
                # a `-` between two items: a range from the previous single character to the next one
                if not single:
                    raise self.fail("`-` here is neither a range nor first or last", help="escape it as `\\-`")
                here = self.i
                self.i += 1
                high = self.class_char()
                low = items[-1][0]  # type: ignore[index]
                if isinstance(high, CharSet):
                    raise self.fail("a range cannot end in a class escape", here + 1)
                if high[0] < low:
                    raise self.fail(f"range `{_show(low)}-{_show(high[0])}` is reversed", here - 1,
                                    f"write `{_show(high[0])}-{_show(low)}`")
                items[-1] = (low, high[0])
                single = False
                continue
            item = self.class_char()
            items.append(item)
            single = not isinstance(item, CharSet)
        ranges: list[tuple[str, str]] = []
        for item in items:
            ranges += item.ranges if isinstance(item, CharSet) else [item]
        return CharSet(_merge(ranges), negated)

    def class_char(self) -> tuple[str, str] | CharSet:
        c = self.peek()
        if c is None:
            raise self.fail("`[` is never closed", help="add the `]`")
        if c == "\\":
            node = self.escape()
            return node if isinstance(node, CharSet) else (node.char, node.char)
        self.literal_ok(c)
        self.i += 1
        return (c, c)

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c is None or c not in "?*+{":
            return None
        if c == "{":
            m = re.compile(r"\{([0-9]+)(?:(,)([0-9]*))?\}").match(self.text, self.i)
            if m is None:
                raise self.fail("a malformed `{…}` quantifier", help="write `{m}` or `{m,n}`, or escape `\\{`")
            low = int(m.group(1))
            if m.group(2) and not m.group(3):
                raise self.fail("`{m,}` has no upper bound", help=f"write `{{m,n}}` with n at most {MAX_REPEAT}, or `*`/`+`")
            high = int(m.group(3)) if m.group(3) else low
            if high > MAX_REPEAT:
                raise self.fail(f"a bound over {MAX_REPEAT}", help=f"bounds are at most {MAX_REPEAT}")
            if high < low:
                raise self.fail(f"`{m.group(0)}` is reversed", help=f"write `{{{high},{low}}}`")
            self.i = m.end()
        else:
            low, high = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
            self.i += 1
        if self.peek() is not None and self.peek() in "?*+{":
            raise self.fail("a quantifier on a quantifier (lazy, possessive or nested)", self.i,
                            "one quantifier per item; group and quantify once")
        return low, high


def _merge(ranges: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for low, high in sorted(ranges):
        if out and ord(low) <= ord(out[-1][1]) + 1:
            if high > out[-1][1]:
                out[-1] = (out[-1][0], high)
        else:
            out.append((low, high))
    return tuple(out)


def _show(c: str) -> str:
    return c.encode("unicode_escape").decode("ascii")


# ---------------------------------------------------------------------------------------------
# The Python source, built from the AST


def _char(c: str) -> str:
    """One character for a `re` source: alphanumerics as they are, anything else as a `\\x`/`\\u`/`\\U` escape."""
    if c.isascii() and c.isalnum():
        return c
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def to_python(node: Node) -> str:
    """A Python `re` source that, with `re.fullmatch` and `re.ASCII`, matches exactly what `node` does."""
    if isinstance(node, Literal):
        return _char(node.char)
    if isinstance(node, CharSet):
        body = "".join(_char(lo) if lo == hi else f"{_char(lo)}-{_char(hi)}" for lo, hi in node.ranges)
        return f"[{'^' if node.negated else ''}{body}]"
    if isinstance(node, Seq):
        return "".join(f"(?:{to_python(i)})" if isinstance(i, Alt) else to_python(i) for i in node.items)
    if isinstance(node, Alt):
        return "(?:" + "|".join(to_python(o) for o in node.options) + ")"
    inner = to_python(node.item)
    if not isinstance(node.item, (Literal, CharSet)):
        inner = f"(?:{inner})"
    high = "" if node.high is None else str(node.high)
    return f"{inner}{{{node.low},{high}}}"


@functools.lru_cache(maxsize=1024)
def _compiled(python: str) -> re.Pattern[str]:
    return re.compile(python, re.ASCII)


def matches(p: Pattern, text: str) -> bool:
    """Whether the whole of `text` matches `p`."""
    return _compiled(p.python).fullmatch(text) is not None
