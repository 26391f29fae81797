"""The symbolic evaluator against native execution: the same core functions, the same answers.

There are no primitives: `within` and `is_token` are core code the evaluator runs from source, compared
here with native execution on generated inputs. The evaluator's handling of branches, loops and returns
is compared through `core.judge_address` (every unwrap form, deny/allow, ipv6) on generated addresses;
the request path through the differential test. The finite abstractions (hosts, methods, paths as
`Atom`s, the answers as an `AnswerList`) are held to their refusals: every operation they are not exact
for raises `Unsupported`, so such a core is never proved.
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
from proofs.symexec import AnswerList, Atom, Domain, Evaluator, SymStr, Unsupported
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
def test_within_evaluated_from_source_is_the_native_one(ivs, point):
    ctx = z3.Context()
    ev = Evaluator(ctx)
    x = z3.BitVec("x", 128, ctx)
    term = ev.bool_term(ev.call(core.within, x, ivs))
    got = z3.is_true(z3.simplify(z3.substitute(term, (x, z3.BitVecVal(point, 128, ctx)))))
    assert got == core.within(point, ivs)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcxyz-_.~!:/ ()09", min_size=0, max_size=6))
def test_is_token_evaluated_from_source_is_the_native_one(name):
    ctx = z3.Context()
    s = z3.String("s", ctx)
    solver = z3.Solver(ctx=ctx)
    solver.add(s == z3.StringVal(name, ctx), Evaluator(ctx).bool_term(Evaluator(ctx).call(core.is_token, SymStr(s))))
    assert (solver.check() == z3.sat) == core.is_token(name)


def _run(source: str, *args, ev: Evaluator | None = None):
    """Evaluate `source` (one function) as if it were core code, on `args`."""
    ev = ev or Evaluator(z3.Context())
    node = ast.parse(textwrap.dedent(source)).body[0]
    namespace: dict = dict(vars(core))
    exec(compile(ast.Module(body=[node], type_ignores=[]), "<core>", "exec"), namespace)  # noqa: S102 - test source
    fn = namespace[node.name]
    fn.__module__ = "egress_proxy.decision.core"
    ev._definition(core.within)  # the real core's definitions first
    ev._defs["egress_proxy.decision.core"][node.name] = node
    return ev.call(fn, *args)


def _hosts(ctx):
    domain = Domain("host", ["api.github.com", "pypi.org", ""])
    atoms = [Atom("api.github.com", domain, False), Atom("pypi.org", domain, False), Atom("other.example.net", domain, True)]
    v = z3.BitVec("h", 16, ctx)
    return Evaluator(ctx).choice([(v == i, a) for i, a in enumerate(atoms)]), v


@pytest.mark.parametrize("expr", [
    'host.endswith("." + rule)',  # a DNS-suffix match: `evil.pypi.org` would pass
    'rule in host',  # a substring test
    'host.lower() == rule',  # case folding
    'host[-len(rule):] == rule',
    'len(host) > 3',
    'host == "metadata.google.internal"',  # a constant no table holds: "any other name" would be a guess
    'host < rule',
])
def test_a_host_is_compared_only_for_equality_with_table_entries(expr):
    ctx = z3.Context()
    host, _ = _hosts(ctx)
    with pytest.raises(Unsupported):
        _run(f"def f(host, rule):\n    return {expr}\n", host, "pypi.org", ev=Evaluator(ctx))


def test_host_equality_and_membership_with_table_entries_are_exact():
    ctx = z3.Context()
    host, v = _hosts(ctx)
    ev = Evaluator(ctx)
    term = ev.bool_term(_run("def f(host, hosts):\n    return host == \"pypi.org\" or (host, 443) in hosts\n",
                             host, frozenset({("api.github.com", 443)}), ev=ev))
    got = [z3.is_true(z3.simplify(z3.substitute(term, (v, z3.BitVecVal(i, 16, ctx))))) for i in range(3)]
    assert got == [True, True, False]


def test_methods_refuse_case_folding():
    ctx = z3.Context()
    domain = Domain("method", ["GET", "POST"])
    v = z3.BitVec("m", 16, ctx)
    ev = Evaluator(ctx)
    method = ev.choice([(v == 0, Atom("GET", domain, False)), (v == 1, Atom("TRACE", domain, True))])
    with pytest.raises(Unsupported, match="method"):
        _run("def f(m, allowed):\n    return m.upper() in allowed\n", method, frozenset({"GET"}), ev=ev)
    with pytest.raises(Unsupported, match="method"):
        _run("def f(m, allowed):\n    return m in allowed or m == \"get\"\n", method, frozenset({"GET"}), ev=ev)


def _answers(ctx, n=3):
    slots = [(z3.Bool(f"p{i}", ctx), (True, z3.Bool(f"six{i}", ctx), z3.BitVec(f"x{i}", 128, ctx))) for i in range(n)]
    return AnswerList(slots)


@pytest.mark.parametrize("body", [
    "    for valid, is6, x in answers[:3]:\n        if x == 1:\n            return 'bad'\n    return ''\n",  # slice
    "    if len(answers) > 3:\n        return ''\n    return 'x'\n",
    "    first = answers[0]\n    return ''\n",
    "    n = 0\n    for valid, is6, x in answers:\n        n += 1\n        if n > 3:\n            return ''\n    return 'x'\n",
    # the verdict of the last answer only: `reason` carried past the loop
    "    reason = ''\n    for valid, is6, x in answers:\n        reason = 'bad' if x == 1 else ''\n    return reason\n",
    # a flag assigned two constants: which one wins depends on the order
    "    ok = True\n    for valid, is6, x in answers:\n        if x == 1:\n            ok = False\n        else:\n            ok = True\n"
    "    return '' if ok else 'bad'\n",
    "    if not answers:\n        return 'resolve-failed'\n    return ''\n",
])
def test_the_answers_are_only_iterated_whole_without_carried_state(body):
    ctx = z3.Context()
    with pytest.raises(Unsupported):
        _run("def f(answers):\n" + body, _answers(ctx), ev=Evaluator(ctx))


def test_the_cores_answer_loop_is_accepted_and_needs_three_answers():
    """answers_verdict: one flag (`seen`), so a counterexample needs at most 1 + (1 + 1) answers, which the model has."""
    ctx = z3.Context()
    ev = Evaluator(ctx)
    answers = _answers(ctx)
    w = core.worker_table(WORKERS[0], TABLE)
    ev.call(core.answers_verdict, w, answers)
    assert answers.need == 3
    twice = _answers(ctx)  # two loops on one path: a sub-list showing both needs 1 + 2 + 2 answers
    _run("def g(w, answers):\n    return (answers_verdict(w, answers), answers_verdict(w, answers))\n", w, twice, ev=Evaluator(ctx))
    assert twice.need == 5


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
    ctx = z3.Context()
    ev = Evaluator(ctx)
    v = z3.BitVec("p", 16, ctx)
    domain = Domain("path", ["/a", "/a/", ""], prefixes=True)
    path = ev.choice([(v == i, Atom(w, domain, True)) for i, w in enumerate(("/a", "/a/x", "/b"))])
    assert z3.is_true(z3.simplify(z3.substitute(ev.bool_term(ev.path_startswith(path, "/a/")), (v, z3.BitVecVal(1, 16, ctx)))))
    with pytest.raises(Unsupported, match="no entry of the tables"):
        ev.path_startswith(path, "/a/x")  # "/a/xy" and "/a/x" share a class: the answer would be a guess
    with pytest.raises(Unsupported, match="path"):
        _run("def f(p):\n    return p[1] == 'a'\n", path, ev=ev)


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
