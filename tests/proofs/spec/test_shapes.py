"""The shape statement (`proofs/spec/shapes.py`) on concrete values: it reads docs/shapes.md, not the judges.

It imports nothing of egress_proxy (tests/proofs/test_spec.py checks every statement module), and on concrete values it
says what the contract says: JSON equality keeps types apart, a pattern admits strings only, `*` in a push pattern
stops at `/`, a text integer is canonical decimal digits.
"""

from __future__ import annotations

import z3

from compiler.artifact import Git, Value
from proofs.spec import shapes as spec


class Json:
    """A concrete JSON value as the statement reads one."""

    NAMES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}

    def __init__(self, x, ctx: z3.Context) -> None:
        self.kind = self.NAMES[type(x)]
        self.b = z3.BoolVal(x is True, ctx)
        self.i = z3.IntVal(x if type(x) is int else 0, ctx)
        self.s = z3.StringVal(x if type(x) is str else "", ctx)
        self.n = z3.IntVal(len(x) if type(x) is list else 0, ctx)
        self.ctx = ctx

    def is_json(self, name: str) -> z3.BoolRef:
        return z3.BoolVal(name == self.kind, self.ctx)


def holds(term) -> bool:
    return z3.is_true(z3.simplify(term)) if not isinstance(term, bool) else term


def admits(v: Value, x) -> bool:
    ctx = z3.Context()
    s = z3.Solver(ctx=ctx)
    s.add(spec.json_admits(v, Json(x, ctx)))
    return s.check() == z3.sat


def text(v: Value, t: str) -> bool:
    ctx = z3.Context()
    s = z3.Solver(ctx=ctx)
    s.add(spec.text_admits(v, z3.StringVal(t, ctx)))
    return s.check() == z3.sat


def test_json_equality_keeps_types_apart():
    v = Value(type="any", enum=(1, "x"))
    assert admits(v, 1) and admits(v, "x")
    assert not admits(v, True) and not admits(v, 1.0) and not admits(v, "1")


def test_a_pattern_admits_strings_only_and_max_length_counts_characters_or_elements():
    v = Value(type="any", pattern="[a-z]+", max_length=3)
    assert admits(v, "abc") and not admits(v, "abcd") and not admits(v, "ABC")
    assert not admits(v, ["a"]) and not admits(v, 1)
    assert admits(Value(type="array", max_length=2), [1, 2]) and not admits(Value(type="array", max_length=2), [1, 2, 3])


def test_an_integer_range_and_a_text_integer():
    v = Value(type="integer", minimum=1, maximum=100)
    assert admits(v, 1) and admits(v, 100) and not admits(v, 0) and not admits(v, 101) and not admits(v, True)
    assert text(v, "42") and not text(v, "042") and not text(v, "+42") and not text(v, "1e2") and not text(v, "")
    assert text(Value(type="integer", minimum=-5), "-5") and not text(Value(type="integer", minimum=-5), "-6")
    assert not text(Value(type="boolean"), "true")  # a text is never a boolean


def test_a_push_pattern_star_stops_at_a_slash():
    ctx = z3.Context()
    regex = spec.ref_regex("refs/heads/agent/*", ctx)

    def matches(ref: str) -> bool:
        s = z3.Solver(ctx=ctx)
        s.add(z3.InRe(z3.StringVal(ref, ctx), regex))
        return s.check() == z3.sat

    assert matches("refs/heads/agent/x") and matches("refs/heads/agent/")
    assert not matches("refs/heads/agent/x/main") and not matches("refs/heads/main")


def test_git_updates_need_create_and_delete():
    ctx = z3.Context()
    git = Git(push=("refs/heads/*",), create=True, delete=False)
    ref = z3.StringVal("refs/heads/x", ctx)
    count = z3.IntVal(1, ctx)
    t, f = z3.BoolVal(True, ctx), z3.BoolVal(False, ctx)
    assert holds(spec.git_admits(git, count, [(t, f, ref)]))  # creation
    assert not holds(spec.git_admits(git, count, [(f, t, ref)]))  # deletion
    assert holds(spec.git_admits(git, count, [(f, f, ref)]))  # update
