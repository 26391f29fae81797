"""Path templates: segments and values as docs/shapes.md defines them, the literal prefix, refusals at their offset."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.artifact import Segment, Value
from compiler.normalize import normalize_path
from compiler.patterns import PatternError
from compiler.template import TemplateError, parse_template, template_prefix


def test_every_kind_of_segment():
    segments = parse_template('/repos/{owner}/{repo:app|"web"}/issues/{n:int(1..100)}/{id:int}/{s:/[a-z]{2,3}\\/x/}/')
    assert segments == (
        Segment(literal="repos"),
        Segment(name="owner", value=Value(type="string")),
        Segment(name="repo", value=Value(type="string", enum=("app", "web"))),
        Segment(literal="issues"),
        Segment(name="n", value=Value(type="integer", minimum=1, maximum=100)),
        Segment(name="id", value=Value(type="integer")),
        Segment(name="s", value=Value(type="string", pattern="[a-z]{2,3}\\/x")),
        Segment(literal=""),  # the trailing `/`: `/a/` and `/a` are different templates
    )


@pytest.mark.parametrize(
    "text, prefix",
    [
        ("/", "/"),
        ("/{x}", "/"),
        ("/{x}/a", "/"),
        ("/mcp", "/mcp"),
        ("/a/", "/a"),
        ("/repos/acme/{repo}/issues", "/repos/acme"),
        ("/a%20b/{x}", "/a%20b"),
    ],
)
def test_the_prefix_is_the_literal_segments_before_the_first_variable(text, prefix):
    assert template_prefix(parse_template(text)) == prefix


def test_enum_values_are_sorted_and_deduplicated():
    (segment,) = parse_template("/{r:web|app|web}")
    assert segment.value.enum == ("app", "web")


@pytest.mark.parametrize(
    "text, offset, words",
    [
        ("repos", 0, "starts with `/`"),
        ("/a/./b", 3, "`.` or `..`"),
        ("/a/%2e%2e/b", 3, "encoded dot"),
        ("/a%2fb", 1, "encoded slash"),
        ("/a;v=1", 1, "`;`"),
        ("/a%7e", 1, "unreserved"),
        ("/caf%c3%a9", 1, "not in normal form"),
        ("/a//b", 2, "empty segment"),
        ("/a?x=1", 2, "no `?`"),
        ("/v{n}", 2, "unexpected `{`"),
        ("/{n", 3, "ends early"),
        ("/{x}/{x}", 6, "named twice"),
        ("/{n:int(5..1)}", 8, "reversed"),
        ("/{n:int(01..3)}", 8, "canonical"),
        ("/{r:a|a%2fb}", 6, "encoded slash"),
        ("/{r:int|x}", 7, "unexpected `|`"),
    ],
)
def test_refusals_name_their_offset(text, offset, words):
    with pytest.raises(TemplateError) as info:
        parse_template(text)
    assert info.value.offset == offset and words in info.value.message, (info.value.offset, info.value.message)
    assert info.value.help


def test_a_pattern_refusal_points_into_the_template():
    with pytest.raises(PatternError) as info:
        parse_template("/a/{s:/x(y+)+/}")
    assert info.value.offset == len("/a/{s:/x")


_segment = st.text("abz09-._~!$&'()*+,=:@", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))


@settings(max_examples=200, deadline=None)
@given(st.lists(_segment, min_size=1, max_size=5), st.booleans())
def test_normalized_literal_paths_read_back_whole(parts, slash):
    path = "/" + "/".join(parts) + ("/" if slash else "")
    assert normalize_path(path) == path
    segments = parse_template(path)
    assert "/" + "/".join(s.literal for s in segments) == path
    assert template_prefix(segments) == path.rstrip("/")
