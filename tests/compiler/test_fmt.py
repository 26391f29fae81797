"""`fmt`: canonical, idempotent, comment-preserving, and meaning-preserving."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.artifact import SourceMap
from compiler.compile import compile_text
from compiler.fmt import format_source
from compiler.parser import parse_source

ROOT = Path(__file__).resolve().parents[2]
FILES = [
    p
    for p in sorted((ROOT / "policies").rglob("*.egress")) + sorted((ROOT / "tests" / "golden").rglob("*.egress"))
    if not parse_source(p.read_text(), str(p))[1]  # the syntax example cannot be formatted, by design
]


def fmt(text: str) -> str:
    tree, diags = parse_source(text, "f.egress")
    assert not diags
    return format_source(tree)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fmt_is_idempotent_and_keeps_meaning(path):
    text = path.read_text()
    once = fmt(text)
    assert fmt(once) == once
    before, after = compile_text(text, "f.egress"), compile_text(once, "f.egress")
    assert [d.code for d in before.diagnostics] == [d.code for d in after.diagnostics]
    if before.ok:  # the same digest and content; only the advisory source map follows the moved lines
        assert before.artifact.digest == after.artifact.digest
        unplaced = {"locations": SourceMap()}
        assert before.artifact.model_copy(update=unplaced).to_json() == after.artifact.model_copy(update=unplaced).to_json()


def test_shipped_demo_is_already_formatted():
    for path in sorted((ROOT / "policies" / "demo").glob("*.egress")):
        assert fmt(path.read_text()) == path.read_text(), f"run `egresslaw fmt {path}`"


def test_comments_survive():
    text = 'egresslaw 1 # v\n# top\nworkspace "w"\ncatalog "2026.11"\n\nworker "e" { # open\n  # inside\n  ipv6 = false # trailing\n  # last\n}\n# end\n'
    out = fmt(text)
    for c in ("# v", "# top", "# open", "# inside", "# trailing", "# last", "# end"):
        assert c in out
    assert fmt(out) == out


_VALUES = st.recursive(
    st.one_of(st.text(alphabet="abcxyz./:-_ ", max_size=12), st.integers(-5, 70000), st.booleans()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(alphabet="abkey_", min_size=1, max_size=6), inner, max_size=4)),
    max_leaves=12,
)


def _render(value) -> str:
    import json

    return json.dumps(value)


@given(st.dictionaries(st.sampled_from(["network", "trust", "provider", "x", "allowed_hosts", "ipv6"]), _VALUES, max_size=5), st.booleans())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_fmt_round_trips_arbitrary_values(pairs, colon):
    sep = ":" if colon else "="
    body = "\n".join(f"  {k} {sep} {_render(v)}" for k, v in pairs.items())
    text = f'egresslaw 1\nworkspace "w"\ncatalog "2026.11"\nsandbox_profile "p" {{\n{body}\n}}\n'
    once = fmt(text)
    assert fmt(once) == once
    assert [d.code for d in compile_text(text).diagnostics] == [d.code for d in compile_text(once).diagnostics]
