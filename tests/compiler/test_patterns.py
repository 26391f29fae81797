"""The pattern subset: `matches` agrees with two independent readings (a backtracking matcher over the AST, and
Python's `re` on the original text, whose semantics coincide on the subset); refusals name their offset."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.errors import CompilerError
from compiler.patterns import (
    Alt,
    CharSet,
    Literal,
    Pattern,
    PatternError,
    Repeat,
    Seq,
    matches,
    parse_pattern,
)

# ---------------------------------------------------------------------------------------------
# An independent reference: the set of end positions each node can reach from `i`.


def _in(node: CharSet, c: str) -> bool:
    inside = any(lo <= c <= hi for lo, hi in node.ranges)
    return inside != node.negated


def _ends(node, s: str, i: int) -> set[int]:
    if isinstance(node, Literal):
        return {i + 1} if s[i : i + 1] == node.char else set()
    if isinstance(node, CharSet):
        return {i + 1} if i < len(s) and _in(node, s[i]) else set()
    if isinstance(node, Seq):
        here = {i}
        for item in node.items:
            here = {e for j in here for e in _ends(item, s, j)}
        return here
    if isinstance(node, Alt):
        return {e for o in node.options for e in _ends(o, s, i)}
    assert isinstance(node, Repeat)
    out = {i} if node.low == 0 else set()
    here, count = {i}, 0
    while here and (node.high is None or count < node.high):
        here = {e for j in here for e in _ends(node.item, s, j)}
        count += 1
        if count >= node.low:
            before = len(out)
            out |= here
            if node.high is None and len(out) == before and count > node.low:
                break  # no new position: more repetitions reach nothing new
    return out


def reference(p: Pattern, s: str) -> bool:
    return len(s) in _ends(p.node, s, 0)


# ---------------------------------------------------------------------------------------------
# Patterns of the subset, as text

ALPHABET = "ab0_-/. \nZ"
_chars = st.sampled_from(["a", "b", "0", "Z", "_", "\\.", "\\-", "\\/", " ", "\\(", "\\+"])
_classes = st.sampled_from(["[ab]", "[a-c]", "[^/]", "[^a]", "[0-9_-]", "\\d", "\\w", "\\s", ".", "[\\d.]", "[-a]", "[^\\s]"])
_quantifiers = st.sampled_from(["?", "*", "+", "{2}", "{0,2}", "{1,3}"])


def _plain_atom():
    return st.one_of(_chars, _classes)


@st.composite
def _quantified(draw, atom):
    return draw(atom) + draw(st.one_of(st.just(""), _quantifiers))


def _patterns():
    # safe: no quantifier and no `|` inside (may carry a quantifier on its group); risky: holds either
    plain = st.lists(_plain_atom(), min_size=1, max_size=3).map("".join)
    safe_group = plain.map(lambda t: f"({t})")
    simple = st.lists(_quantified(st.one_of(_plain_atom(), safe_group)), min_size=1, max_size=4).map("".join)

    def extend(inner):
        alt = st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")")
        return st.lists(st.one_of(inner, alt, _quantified(safe_group)), min_size=1, max_size=3).map("".join)

    return st.recursive(simple, extend, max_leaves=6) | st.lists(simple, min_size=2, max_size=3).map("|".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_patterns(), st.lists(st.text(ALPHABET, max_size=8), min_size=1, max_size=6))
def test_matches_agrees_with_the_ast_and_with_re_on_the_text(text, subjects):
    p = parse_pattern(text)
    for s in subjects:
        expected = re.fullmatch(text, s, re.ASCII) is not None
        assert matches(p, s) == expected == reference(p, s), (text, p.python, s)


@settings(max_examples=200, deadline=None)
@given(_patterns())
def test_python_is_built_from_the_ast(text):
    p = parse_pattern(text)
    assert p.text == text
    # Another spelling of the same AST gives the same source: it is built from the AST, not the text.
    assert parse_pattern(f"(({text}))").python == p.python
    for s in ("", "a", "ab", "a0_", "//", "\n", "Z.Z", "aaaa"):
        assert matches(p, s) == reference(p, s)


def test_class_escapes_are_ascii_only():
    assert matches(parse_pattern("\\d+"), "0123456789")
    assert not matches(parse_pattern("\\d"), "٣")  # ARABIC-INDIC DIGIT THREE
    assert not matches(parse_pattern("\\w"), "é")
    assert not matches(parse_pattern("\\s"), "\u00a0")
    assert matches(parse_pattern("\\s{6}"), " \t\n\r\f\v")
    assert not matches(parse_pattern("."), "\n") and matches(parse_pattern("[^/]"), "\n")


def test_the_whole_value_must_match():
    p = parse_pattern("[a-z]+")
    assert matches(p, "abc") and not matches(p, "abc\n") and not matches(p, "1abc") and not matches(p, "")


def test_the_ast_is_explicit():
    assert parse_pattern("[0-9_-]").node == CharSet((("-", "-"), ("0", "9"), ("_", "_")))
    assert parse_pattern("(ab){2,3}").node == Repeat(Seq((Literal("a"), Literal("b"))), 2, 3)
    assert parse_pattern("x|y+").node == Alt((Literal("x"), Repeat(Literal("y"), 1, None)))
    assert parse_pattern("[c-ea-c]").node == CharSet((("a", "e"),))  # ranges sorted and merged


@pytest.mark.parametrize(
    "text, offset, words",
    [
        ("", 0, "empty"),
        ("^a", 0, "anchor"),
        ("ab$", 2, "anchor"),
        ("a\\b", 1, "anchor"),
        ("(a)\\1", 3, "backreference"),
        ("x(?=a)", 1, "(?"),
        ("(?<n>a)", 0, "(?"),
        ("(a+)+", 0, "quantifier on a group"),
        ("x(a|b)*", 1, "quantifier on a group"),
        ("((a)b*)?", 0, "quantifier on a group"),
        ("a+?", 2, "quantifier on a quantifier"),
        ("a{2}{3}", 4, "quantifier on a quantifier"),
        ("(ab", 0, "never closed"),
        ("ab)", 2, "closes no group"),
        ("[ab", 0, "never closed"),
        ("a]", 1, "closes nothing"),
        ("[z-a]", 1, "reversed"),
        ("a{3,1}", 1, "reversed"),
        ("a{1001}", 1, "over 1000"),
        ("a{2,1001}", 1, "over 1000"),
        ("a{2,}", 1, "no upper bound"),
        ("a{x}", 1, "malformed"),
        ("*a", 0, "quantifies nothing"),
        ("a||b", 2, "empty alternative"),
        ("a()", 2, "empty group"),
        ("[]", 0, "empty class"),
        ("[a-c-e]", 4, "neither a range"),
        ("\\q", 0, "not an escape"),
        ("\\D", 0, "not an escape"),
        ("ab\\", 2, "ends with"),
    ],
)
def test_refusals_name_their_offset(text, offset, words):
    with pytest.raises(PatternError) as info:
        parse_pattern(text)
    assert isinstance(info.value, CompilerError)
    assert info.value.offset == offset and words in info.value.message
    assert info.value.help
