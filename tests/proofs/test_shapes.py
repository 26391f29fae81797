"""Request shapes proved (`proofs/shapes.py`): the judges of egress_proxy/decision/shapes.py run symbolically.

A shaped artifact proves `shape-gate`, `shape-confined` and the shape part of `vacuity`; seeded bugs in the judges
(and in the core's use of their verdict) are refuted by the real `egresslaw prove` with a counterexample that the
mutated code admits and the real code refuses (request and body replayed); a tool, field, pattern or template that
admits nothing is refuted by `vacuity`, naming it; a judge the evaluator cannot run is `unknown`, naming the construct.
"""

from __future__ import annotations

import json

import pytest
import z3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler.artifact import Git, GraphQL, Mcp, Param, Segment, Tool, Value, load_artifact
from egress_proxy.decision import shapes
from egress_proxy.decision.adapter import decide, judge_body
from egress_proxy.decision.shapes import check_of, judge_json, judge_text, shape_of
from proofs.decode import request_from_dict
from proofs.properties import subject_lease
from proofs.shapes import ShapeModel, confined
from proofs.solve import Limits
from proofs.symexec import JSON_TYPES, SHAPE_MODULES, Evaluator, SymJson
from tests.proofs.helpers import artifact, connection, only, prove_one, rule
from tests.proofs.mutants import MUTANTS, artifact_json, baseline, judge, run_child
from tests.shapes.world import shapes_artifact

SHAPE_MUTANTS = tuple(m.id for m in MUTANTS if m.artifact == "shaped")
BY_ID = {m.id: m for m in MUTANTS}


def test_the_shapes_world_proves_every_shape_check():
    report = prove_one(shapes_artifact())
    assert report.exit_code() == 0, report.render_text()
    for prop in ("shape-gate", "shape-confined", "vacuity"):
        assert only(report, "connection:github", prop).verdict == "proved"
    assert "5 templates, tools, root fields and push patterns" in only(report, "connection:github", "vacuity").detail


def test_the_mutants_exercising_artifact_proves_clean_with_its_brokering_profile():
    report = prove_one(load_artifact(artifact_json("shaped")))
    assert report.exit_code() == 0, report.render_text()
    assert only(report, "profile:ci", "shape-gate").verdict == "proved"  # a profile brokering shaped rules


@pytest.fixture(scope="module")
def shaped_base(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("shape-mutants")
    return workdir, baseline("shaped", workdir)


@pytest.mark.parametrize("mutant_id", SHAPE_MUTANTS)
def test_a_seeded_bug_in_the_shape_judges_is_caught_by_prove(mutant_id, shaped_base):
    workdir, (path, verdicts, _) = shaped_base
    mutant = BY_ID[mutant_id]
    code, report = run_child(mutant, path, workdir)
    outcome = judge(mutant, code, report, verdicts, path.read_text())
    assert outcome.ok, outcome.detail


def test_a_refuted_body_replays_refused_by_the_real_judge(shaped_base):
    """The counterexample the batch mutant yields is a real body: the real edge refuses it, the mutant admitted it."""
    workdir, (path, verdicts, _) = shaped_base
    code, report = run_child(BY_ID["shapes-batch-first-only"], path, workdir)
    result = next(r for r in report["results"] if r["property"] == "shape-confined" and r["verdict"] == "refuted")
    cex = result["counterexample"]
    body = cex["extra"]["body"]
    assert json.loads(body)[1]["method"] == "tools/call"  # the second message of a batch
    art = load_artifact(path.read_text())
    lease = subject_lease("connection", "shaped")
    request = request_from_dict(cex["request"])
    d = decide(art, lease, request, cex["resolved_ips"])
    assert d.allowed and d.body_shape == "mcp"
    assert judge_body(art, lease, request, d, body.encode()).reason in ("mcp-tool-not-allowed", "mcp-argument-refused",
                                                                         "mcp-method-not-allowed")


def _vacuous(rule_) -> str:
    report = prove_one(artifact(connections=[connection("c", [rule_])]))
    result = only(report, "connection:c", "vacuity")
    assert result.verdict == "refuted", (result.verdict, result.detail)
    return result.counterexample["summary"]


def test_a_tool_whose_required_key_is_forbidden_is_vacuous():
    tool = Tool(name="broken", arguments=(Param(name="k", value=Value()),), required=("k",), forbidden=("k",))
    ok = Tool(name="fine")
    r = rule("tools", "mcp.example.com", "/mcp", ["POST"]).model_copy(update={"mcp": Mcp(methods=("tools/call",), tools=(ok, tool))})
    assert "tool `broken` admits nothing" in _vacuous(r)


def test_an_enum_that_contradicts_its_pattern_is_vacuous():
    template = (Segment(literal="v1"), Segment(name="x", value=Value(enum=("ABC",), pattern="[a-z]+")))
    r = rule("t", "api.example.com", "/v1", ["GET"]).model_copy(update={"template": template})
    assert "its path template admits nothing" in _vacuous(r)


def test_a_push_pattern_no_ref_can_match_is_vacuous():
    r = rule("push", "github.com", "/acme/app.git", ["GET", "POST"]).model_copy(update={
        "git": Git(fetch=True, push=("refs/heads/a b",))})  # git's command line never carries a space in a ref
    assert "push pattern `refs/heads/a b` admits nothing" in _vacuous(r)


def test_a_root_field_of_an_operation_type_is_a_witness_of_its_own():
    r = rule("graph", "graphql.example.com", "/graphql", ["POST"]).model_copy(update={"graphql": GraphQL(query=("viewer",))})
    report = prove_one(artifact(connections=[connection("c", [r])]))
    assert only(report, "connection:c", "vacuity").verdict == "proved"
    assert only(report, "connection:c", "shape-confined").verdict == "proved"


def test_a_judge_the_evaluator_cannot_run_is_unknown_naming_the_construct(monkeypatch):
    """A judge that tests a key by its prefix is outside what the model of names is exact for: never `proved`."""
    source = shapes.__loader__.get_source(shapes.__name__)
    mutated = source.replace("        if key in tool.forbidden:\n", "        if key in tool.forbidden or key.startswith(\"x-\"):\n")
    assert mutated != source
    monkeypatch.setattr("proofs.symexec.module_source", lambda name: mutated if name == shapes.__name__ else source)
    monkeypatch.setattr("proofs.symexec._TREES", {})
    monkeypatch.setattr("proofs.shapes._BUILT", {})
    r = rule("tools", "mcp.example.com", "/mcp", ["POST"]).model_copy(update={
        "mcp": Mcp(methods=("tools/call",), tools=(Tool(name="t", arguments=(Param(name="k", value=Value()),)),))})
    art = artifact(connections=[connection("c", [r])])
    out = confined(art, subject_lease("connection", "c"), decide, r, shape_of(r), Limits())
    assert [v.verdict for v in out] == ["unknown"]
    assert "`startswith` on a argument key" in out[0].summary


def test_the_symbolic_judge_agrees_with_the_native_one_on_concrete_bodies():
    """Differential: a concrete MCP message put into the model's variables gets the native judge's verdict."""
    tool = Tool(name="get", arguments=(Param(name="n", value=Value(type="integer", minimum=1, maximum=9)),
                                       Param(name="s", value=Value(pattern="[a-z]+", max_length=3))), required=("n",))
    r = rule("tools", "mcp.example.com", "/mcp", ["POST"]).model_copy(update={
        "mcp": Mcp(methods=("ping", "tools/call"), tools=(tool,))})
    shape = shape_of(r)
    cases = [{"n": 3}, {"n": 0}, {"n": True}, {"n": 3.0}, {"s": "ab"}, {"n": 1, "s": "abcd"}, {"n": 1, "s": "AB"},
             {"n": 1, "zz_other_key": None}, {"n": 9, "s": "xyz"}]
    ctx = z3.Context()
    model = ShapeModel(ctx, r, shape)
    q = model.body()
    m = q.extra["messages"][0]
    for arguments in cases:
        native = shapes.mcp_refusal(shape, (("request", "tools/call", "get", arguments),))[0] == ""
        pins = [q.extra["count"] == 1, m.kind == 0, m.method.var == m.method.labels.index("tools/call"),
                m.tool.var == m.tool.labels.index("get")]
        for present, key, value in m.slots:
            name = key if isinstance(key, str) else "zz_other_key"
            pins.append(present == (name in arguments))
            if name in arguments:
                pins += _pin(value, arguments[name])
        s = z3.Solver(ctx=ctx)
        s.add(*q.wf, *pins)
        assert s.check() == z3.sat
        symbolic = z3.is_true(s.model().eval(q.admitted, model_completion=True))
        assert symbolic == native, (arguments, symbolic, native)


def _pin(value, x) -> list:
    tag = JSON_TYPES.index(type(x))
    pins = [value.tag == tag]
    if type(x) is list:
        pins.append(value.n == len(x))
    if type(x) is bool:
        pins.append(value.b == x)
    elif type(x) is int:
        pins.append(value.i == x)
    elif type(x) is float:
        pins.append(value.r == x)
    elif type(x) is str:
        pins.append(value.s == z3.StringVal(x, value.s.ctx))
    return pins


def test_the_gate_requires_the_shape_checks_of_shaped_subjects_only():
    from proofs.gate import required_checks

    required = required_checks(load_artifact(artifact_json("shaped")))
    assert ("default", "connection:shaped", "shape-confined") in required
    assert ("default", "connection:shaped", "shape-gate") in required
    assert ("default", "profile:ci", "shape-gate") in required  # it brokers the shaped connection
    plain = required_checks(load_artifact(artifact_json("basic")))
    assert not any(p.startswith("shape-") for _, _, p in plain)


# -- the evaluator's primitives against Python, on random values and constraints -------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["", "a", "ab", "1", "-1", "01", "abc"]))
JSON = st.one_of(SCALARS, st.floats(-3, 3, allow_nan=False).map(lambda f: round(f, 1)), st.lists(st.none(), max_size=3),
                 st.just({}), st.sampled_from(["abcd", "a b", "A", "-0", "+1", "12", "٣"]))


@st.composite
def values(draw) -> Value:
    kind = draw(st.sampled_from(["any", "string", "integer", "boolean", "null", "array", "object"]))
    fields = {"type": kind}
    if draw(st.booleans()):
        fields["enum"] = tuple(draw(st.lists(SCALARS, min_size=1, max_size=3)))
    if kind in ("any", "string") and draw(st.booleans()):
        fields["pattern"] = draw(st.sampled_from(["[a-z]+", "a?b*", "-?[0-9]{1,2}", "."]))
    if kind in ("any", "string", "array") and draw(st.booleans()):
        fields["max_length"] = draw(st.integers(0, 3))
    if kind in ("any", "integer") and draw(st.booleans()):
        fields["minimum"] = draw(st.integers(-2, 2))
    if kind in ("any", "integer") and draw(st.booleans()):
        fields["maximum"] = draw(st.integers(-2, 2))
    return Value(**fields)


def _symbolic_admits(fn, check, x, text: bool) -> bool:
    ctx = z3.Context()
    ev = Evaluator(ctx, SHAPE_MODULES)
    types = (str,) if text else JSON_TYPES
    tag = z3.IntVal(JSON_TYPES.index(str), ctx) if text else z3.Int("tag", ctx)
    sym = SymJson(tag, z3.Bool("b", ctx), z3.Int("i", ctx), z3.Real("r", ctx), z3.String("s", ctx), z3.Int("n", ctx), types)
    reason = ev.call(fn, check, sym)
    s = z3.Solver(ctx=ctx)
    s.add(*_pin(sym, x), ev.bool_term(ev.eq(reason, "")))
    return s.check() == z3.sat


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values(), JSON)
def test_the_symbolic_value_judge_is_the_native_one(value, x):
    check = check_of(value)
    assert _symbolic_admits(judge_json, check, x, text=False) == (judge_json(check, x) == ""), (value, x)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values(), st.sampled_from(["", "a", "ab", "abcd", "1", "-1", "01", "-0", "+1", "12", "999", "٣", "1_0", " 1", "a b"]))
def test_the_symbolic_text_judge_is_the_native_one(value, text):
    check = check_of(value)
    assert _symbolic_admits(judge_text, check, text, text=True) == (judge_text(check, text) == ""), (value, text)


def test_shape_confined_runs_in_a_task_of_its_own_with_the_same_report_for_any_jobs():
    from proofs.runner import plan, prove
    from tests.proofs.helpers import without_timings

    art = load_artifact(artifact_json("shaped"))
    assert ("default", "shapes", (("connection", "shaped"),)) in plan(art, 2)
    one, two = prove(art, jobs=1), prove(art, jobs=2)
    assert without_timings(one) == without_timings(two)
    assert only(two, "connection:shaped", "shape-confined").verdict == "proved"
