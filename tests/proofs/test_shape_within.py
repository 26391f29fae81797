"""`--within` and `--against` compare request shapes: a candidate rule whose shape admits what the ceiling's (or the old)
same-named rule refuses is refuted with a pair replayed on both artifacts; identical or narrower shapes prove.

The ceiling is the mutants' shaped artifact (an issues template with a query, an MCP rule, a GraphQL rule, a git rule);
each candidate is it with one shape widened by one step.
"""

from __future__ import annotations

import pytest

from compiler.artifact import Artifact, Param, Value, load_artifact
from egress_proxy.decision.adapter import decide, judge_body
from proofs.decode import request_from_dict
from proofs.model import Ceiling
from proofs.properties import subject_lease
from proofs.runner import prove
from tests.proofs.helpers import only
from tests.proofs.mutants import artifact_json

BASE = load_artifact(artifact_json("shaped"))


def edited(rule_name: str, edit) -> Artifact:
    """BASE with rule `rule_name` of connection `shaped` replaced by `edit(rule)`."""
    conn = BASE.connection("shaped")
    rules = tuple(edit(r) if r.name == rule_name else r for r in conn.rules)
    return BASE.model_copy(update={"connections": (conn.model_copy(update={"rules": rules}),)})


def _mcp(r, **change):
    return r.model_copy(update={"mcp": r.mcp.model_copy(update=change)})


def add_tool(r):
    extra = r.mcp.tools[0].model_copy(update={"name": "delete_repo"})
    return _mcp(r, tools=tuple(sorted((*r.mcp.tools, extra), key=lambda t: t.name)))


def widen_enum(r):
    tool = r.mcp.tools[0]
    args = tuple(p.model_copy(update={"value": Value(enum=("acme/app", "acme/other", "acme/web"))}) if p.name == "repo" else p
                 for p in tool.arguments)
    return _mcp(r, tools=(tool.model_copy(update={"arguments": args}), *r.mcp.tools[1:]))


def add_field(r):
    return r.model_copy(update={"graphql": r.graphql.model_copy(update={"query": ("organization", "repository", "viewer")})})


def add_ref(r):
    return r.model_copy(update={"git": r.git.model_copy(update={"push": ("refs/heads/agent/*", "refs/heads/main")})})


def drop_query(r):
    return r.model_copy(update={"query": None})


def widen_segment(r):
    template = tuple(s.model_copy(update={"value": Value(enum=("api", "app", "web"))}) if s.name == "repo" else s for s in r.template)
    return r.model_copy(update={"template": template})


def widen_query_value(r):
    return r.model_copy(update={"query": (Param(name="state", value=Value(enum=("all", "closed", "open"))),)})


WIDENINGS = [
    ("a tool added", "tools", add_tool, "delete_repo"),
    ("an argument's enum widened", "tools", widen_enum, "acme/other"),
    ("a GraphQL root field added", "graph", add_field, "organization"),
    ("a push pattern added", "push", add_ref, "refs/heads/main"),
    ("the query constraint dropped", "issues", drop_query, "?"),
    ("a template segment widened", "issues", widen_segment, "/repos/acme/api/"),
    ("a query value widened", "issues", widen_query_value, "state=all"),
]


def _replays(candidate: Artifact, ceiling: Artifact, cex: dict) -> None:
    """The pair replays: the candidate admits the request (and body), the ceiling refuses it."""
    lease = subject_lease("connection", "shaped")
    request = request_from_dict(cex["request"])
    body = (cex.get("extra") or {}).get("body")
    sides = []
    for art in (candidate, ceiling):
        d = decide(art, lease, request, cex["resolved_ips"])
        if d.allowed and d.body_shape is not None and body is not None:
            d = judge_body(art, lease, request, d, body.encode())
        sides.append(d)
    assert sides[0].allowed and not sides[1].allowed, sides


@pytest.mark.parametrize(("what", "rule_name", "edit", "shown"), WIDENINGS, ids=[w[0] for w in WIDENINGS])
def test_a_one_step_wider_shape_is_refuted_within_the_ceiling_and_against_the_old(what, rule_name, edit, shown):
    candidate = edited(rule_name, edit)
    report = prove(candidate, jobs=1, ceiling=Ceiling(BASE))
    result = only(report, "connection:shaped", "within")
    assert result.verdict == "refuted", (what, result.verdict, result.detail)
    cex = result.counterexample
    assert shown in cex["summary"] + (cex.get("extra") or {}).get("body", "") + cex["request"]["target"], cex["summary"]
    _replays(candidate, BASE, cex)
    against = only(prove(candidate, BASE, jobs=1), "connection:shaped", "no-widening")
    assert against.verdict == "refuted", (what, against.verdict, against.detail)
    _replays(candidate, BASE, against.counterexample)


def test_identical_and_narrower_shapes_prove_within_and_against():
    assert only(prove(BASE, jobs=1, ceiling=Ceiling(BASE)), "connection:shaped", "within").verdict == "proved"
    narrower = edited("tools", lambda r: _mcp(r, tools=r.mcp.tools[:1]))
    narrower = narrower.model_copy(update={"connections": (narrower.connection("shaped").model_copy(update={"rules": tuple(
        r.model_copy(update={"git": r.git.model_copy(update={"create": False})}) if r.name == "push" else r
        for r in narrower.connection("shaped").rules)}),)})
    report = prove(narrower, jobs=1, ceiling=Ceiling(BASE))
    assert only(report, "connection:shaped", "within").verdict == "proved", only(report, "connection:shaped", "within").detail
    assert only(prove(narrower, BASE, jobs=1), "connection:shaped", "no-widening").verdict == "proved"


def test_diff_shows_a_widened_shape_as_a_replayed_request_and_body():
    from proofs.diff import semantic_diff

    candidate = edited("tools", add_tool)
    diff = semantic_diff(BASE, candidate)
    widened = [e for e in diff.widened if e.subject == "connection:shaped"]
    assert widened and not diff.unknown, diff.render_text()
    example = widened[0]
    assert "delete_repo" in example.body and example.old["reason"] == "mcp-tool-not-allowed" and example.new["allowed"]
    _replays(candidate, BASE, {"request": {**example.to_dict()["request"]}, "resolved_ips": list(example.resolved_ips),
                               "extra": {"body": example.body}})
    narrowed = semantic_diff(candidate, BASE)
    assert [e.direction for e in narrowed.examples if e.subject == "connection:shaped"] == ["narrowed"], narrowed.render_text()
    assert semantic_diff(BASE, BASE).same


def test_a_renamed_rule_with_a_wider_shape_is_never_proved_within():
    """Shapes are compared between same-named rules; a renamed one is left to the request-level question, whose
    free shape verdicts are independent: the difference it finds does not replay, so `within` is unknown, never proved."""
    candidate = edited("tools", lambda r: add_tool(r).model_copy(update={"name": "tools-v2"}))
    result = only(prove(candidate, jobs=1, ceiling=Ceiling(BASE)), "connection:shaped", "within")
    assert result.verdict == "unknown", result.detail
