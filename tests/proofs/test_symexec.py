"""The symbolic evaluator against native execution: the same core functions, the same answers.

The two primitives (`within`, `is_token`) are the only code with two implementations; they are
compared here on generated inputs. The evaluator's handling of branches, loops and returns is
compared through `core.judge_address` (every unwrap form, deny/allow, ipv6) on generated
addresses; the request path through the differential test.
"""

from __future__ import annotations

import ast
import ipaddress
import textwrap

import pytest
import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from catalog import load_catalog
from egress_proxy.decision import core
from proofs.symexec import Evaluator, SymStr, Unsupported, _sym_is_token, _sym_within
from tests.egress_proxy.builders import worker

TABLE = load_catalog("2026.11").special_purpose
WORKERS = [
    worker(),
    worker(ipv6=False),
    worker(deny_cidrs=("8.8.8.0/24", "2001:4860::/32"), allow_cidrs=("100.64.0.0/10", "2001::/32")),
    worker(nat64_prefixes=("2600:1f00::/40", "2001:db8:100::/64")),
]
_CACHE: dict[int, tuple] = {}


def _judge_terms(i: int):
    """judge_address of worker i, evaluated once symbolically."""
    if i not in _CACHE:
        ctx = z3.Context()
        ev = Evaluator(ctx)
        w = core.worker_table(WORKERS[i], TABLE)
        is6, x = z3.Bool("is6", ctx), z3.BitVec("x", 128, ctx)
        _CACHE[i] = (ctx, ev, w, is6, x, ev.call(core.judge_address, w, is6, x))
    return _CACHE[i]


def _at(ev, value, pairs):
    if isinstance(value, str):
        return value
    (found,) = [x for g, x in value.alts if z3.is_true(z3.simplify(z3.substitute(ev.bool_term(g), *pairs)))]
    return found


def _embedding(draw_v4: int, form: str, rest: int) -> ipaddress.IPv6Address:
    x = draw_v4
    bases = {"mapped": (0xFFFF << 32) | x, "compat": x, "nat64": int(ipaddress.IPv6Address("64:ff9b::")) | x,
             "6to4": (0x2002 << 112) | (x << 80) | (rest & ((1 << 80) - 1)),
             "teredo": (0x20010000 << 96) | (rest & (((1 << 64) - 1) << 32)) | (x ^ 0xFFFFFFFF),
             "isatap": ((rest >> 64) << 64) | (0x02005EFE << 32) | x,
             "nat64-40": int(ipaddress.IPv6Address("2600:1f00::")) | ((x >> 8) << 64) | ((x & 0xFF) << 48),
             "random": rest}
    return ipaddress.IPv6Address(bases[form])


addresses = st.one_of(
    st.integers(0, (1 << 32) - 1).map(ipaddress.IPv4Address),
    st.builds(_embedding, st.integers(0, (1 << 32) - 1),
              st.sampled_from(["mapped", "compat", "nat64", "6to4", "teredo", "isatap", "nat64-40", "random"]),
              st.integers(0, (1 << 128) - 1)),
    st.sampled_from([ipaddress.ip_address(a) for a in ("10.0.0.1", "100.64.0.1", "8.8.8.8", "2001:4860::1", "::1",
                                                         "64:ff9b::a9fe:a9fe", "fd00:ec2::254", "2002:a00:1::1")]),
)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(WORKERS) - 1), addresses)
def test_symbolic_judge_address_is_the_native_one(i: int, addr):
    ctx, ev, w, is6, x, terms = _judge_terms(i)
    pairs = [(is6, z3.BoolVal(addr.version == 6, ctx)), (x, z3.BitVecVal(int(addr), 128, ctx))]
    assert _at(ev, terms, pairs) == core.judge_address(w, addr.version == 6, int(addr))


spans = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), max_size=6).map(
    lambda xs: core.intervals([f"0.0.{a}.{b}/32" for a, b in xs if a < 256], 4))
blocks = st.lists(st.tuples(st.integers(0, 255), st.integers(24, 32)), max_size=5).map(
    lambda xs: core.intervals([f"10.{a}.{a}.0/{n}" for a, n in xs], 4))


@settings(max_examples=200, deadline=None)
@given(st.one_of(spans, blocks), st.integers(0, (1 << 32) - 1) | st.integers(0, 70000))
def test_within_primitive_native_and_symbolic_agree(ivs, point):
    ctx = z3.Context()
    x = z3.BitVec("x", 128, ctx)
    term = Evaluator(ctx).bool_term(_sym_within(Evaluator(ctx), x, ivs))
    got = z3.is_true(z3.simplify(z3.substitute(term, (x, z3.BitVecVal(point, 128, ctx)))))
    assert got == core.within(point, ivs)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcxyz-_.~!:/ ()09", min_size=1, max_size=6))
def test_is_token_primitive_native_and_symbolic_agree(name):
    ctx = z3.Context()
    s = z3.String("s", ctx)
    solver = z3.Solver(ctx=ctx)
    solver.add(s == z3.StringVal(name, ctx), _sym_is_token(Evaluator(ctx), SymStr(s)))
    assert (solver.check() == z3.sat) == core.is_token(name)


def test_unsupported_constructs_are_reported_never_guessed(monkeypatch):
    """A core function the evaluator cannot run raises Unsupported (the check becomes unknown, never proved)."""
    source = textwrap.dedent('''
        def spin(x):
            while x:
                return 1
            return 0
    ''')
    ev = Evaluator(z3.Context())
    node = ast.parse(source).body[0]
    monkeypatch.setattr(ev, "_definition", lambda fn: node)

    def spin(x):  # the native twin of the source above
        return 1 if x else 0

    spin.__module__ = "egress_proxy.decision.core"
    with pytest.raises(Unsupported, match="While"):
        ev.call(spin, z3.Bool("b", ev.ctx))


def test_paths_are_compared_only_with_partition_constants():
    from proofs.symexec import PathChoice

    ctx = z3.Context()
    ev = Evaluator(ctx)
    v = z3.BitVec("p", 16, ctx)
    path = PathChoice([(v == 0, "/a"), (v == 1, "/a/x"), (v == 2, "/b")], frozenset({"/a", "/a/"}))
    assert z3.is_true(z3.simplify(z3.substitute(ev.bool_term(ev.path_startswith(path, "/a/")), (v, z3.BitVecVal(1, 16, ctx)))))
    with pytest.raises(Unsupported, match="not a constant of the path partition"):
        ev.path_startswith(path, "/a/x")  # "/a/xy" and "/a/x" share a class: the answer would be a guess


def test_is_none_narrows_a_choice_in_each_branch():
    """`c = carrier(s, rule); if c is None: …; return c.worker` on a symbolic rule: each branch sees only its own
    alternatives (no attribute of None is read), and every rule value gives the native answer."""
    from egress_proxy.decision.adapter import artifact_index
    from egress_proxy.decision.types import Lease
    from tests.egress_proxy.builders import artifact, connection, profile, rule

    art = artifact(connections=[connection("a", [rule("r", "a.example.org")], worker="edge", inject_header="X-Key"),
                                connection("b", [rule("r", "b.example.org")])],
                   profiles=[profile("p", [("a.example.org", 443)], brokers=("a", "b"))], workers=[worker("edge")])
    s = artifact_index(art).view(Lease("t", "p", None, 0))[0].subject
    ctx = z3.Context()
    ev = Evaluator(ctx)
    pick = z3.Int("rule", ctx)
    rule_choice = ev.choice([(pick == v, v) for v in (-1, 0, 1)])
    for fn in (core.request_worker, core.credential_header, core.carrier):
        value = ev.call(fn, s, rule_choice)
        for v in (-1, 0, 1):
            got = [x for g, x in ev.alternatives(value) if z3.is_true(z3.simplify(z3.substitute(ev.bool_term(g), (pick, z3.IntVal(v, ctx)))))]
            assert got == [fn(s, v)], (fn.__name__, v)
