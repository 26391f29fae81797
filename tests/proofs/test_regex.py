"""The prover's translation of the pattern subset (`proofs.regex`) against Python's matcher (`compiler.patterns.matches`).

The translation is the evaluator's one primitive for `matches` and the statements' reading of a pattern: if it were
wrong, a proof about a pattern would be about another language. Random patterns of the subset and random texts must
get the same answer from Z3 and from Python's `re`, both ways (a match Z3 misses, and one it invents).
"""

from __future__ import annotations

import z3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.patterns import PatternError, matches, parse_pattern
from proofs.regex import node_regex
from proofs.shapes import text_of

# Characters that make patterns interesting: literals, classes, ranges, escapes, groups, quantifiers, the newline
# `.` excludes and one character past ASCII.
PATTERN_ALPHABET = "ab-z09/.[]^()|?*+{}\\,dws2"
TEXT_ALPHABET = "ab-z09/.\n é_"


def z3_matches(pattern: str, text: str) -> bool:
    ctx = z3.Context()
    s = z3.Solver(ctx=ctx)
    s.add(z3.InRe(z3.StringVal(text, ctx), node_regex(parse_pattern(pattern).node, ctx)))
    return s.check() == z3.sat


def parses(text: str) -> bool:
    try:
        parse_pattern(text)
    except PatternError:
        return False
    return True


patterns = st.text(PATTERN_ALPHABET, min_size=1, max_size=10).filter(parses)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(patterns, st.text(TEXT_ALPHABET, max_size=8))
def test_the_translation_matches_what_python_matches(pattern, text):
    assert z3_matches(pattern, text) == matches(parse_pattern(pattern), text), (pattern, text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(patterns)
def test_a_text_z3_finds_for_a_pattern_is_one_python_matches(pattern):
    ctx = z3.Context()
    s = z3.Solver(ctx=ctx)
    x = z3.String("x", ctx)
    s.add(z3.InRe(x, node_regex(parse_pattern(pattern).node, ctx)), z3.Length(x) <= 12)
    if s.check() == z3.sat:
        found = text_of(s.model().eval(x))
        assert matches(parse_pattern(pattern), found), (pattern, found)


def test_the_edges_of_the_subset():
    cases = [("[^/]*", "a\nb", True), ("[^/]*", "a/b", False), (".", "\n", False), (".", "é", True), ("a{0}", "", True),
             ("a{0}", "a", False), ("a{2,3}", "aaaa", False), ("\\d+", "٣", False), ("[a-c]{1,2}x?", "cbx", True),
             ("-?(0|[1-9][0-9]{0,18})", "-0", True), ("-?(0|[1-9][0-9]{0,18})", "01", False)]
    for pattern, text, expected in cases:
        assert matches(parse_pattern(pattern), text) is expected, (pattern, text)
        assert z3_matches(pattern, text) is expected, (pattern, text)
