"""Request shapes judged (egress_proxy/decision/shapes.py), and through the decision function (`decide`, `judge_body`):
each constraint admits what it lists and refuses its nearest neighbour, with the reason and the place."""

from __future__ import annotations

import hashlib
import json

import pytest

from compiler.artifact import Git, GraphQL, Mcp, Param, Segment, Tool, Value
from egress_proxy.decision import shapes as sh
from egress_proxy.decision.adapter import decide_without_addresses, judge_body
from egress_proxy.decision.types import Lease, Request
from tests.egress_proxy import builders as b

INT = Value(type="integer", minimum=1, maximum=100)
HOST = "api.acme-test.dev"


def rule(**shape):
    base = b.rule(shape.pop("name", "r"), HOST, shape.pop("prefix", "/"), shape.pop("methods", ("GET", "POST")),
                  shape.pop("headers", ("content-type", "accept", "x-version")))
    return base.model_copy(update=shape)


def shape(**kw) -> sh.Shape:
    got = sh.shape_of(rule(**kw))
    assert got is not None
    return got


TEMPLATE = (Segment(literal="repos"), Segment(name="owner", value=Value(enum=("acme",))),
            Segment(name="repo", value=Value(enum=("app", "web"))), Segment(literal="issues"),
            Segment(name="n", value=INT), Segment(name="sha", value=Value(pattern="[0-9a-f]{4}")))


@pytest.mark.parametrize("path, where", [
    ("/repos/acme/app/issues/7/beef", ""),
    ("/repos/acme/web/issues/100/0000", ""),
    ("/repos/evil/app/issues/7/beef", "segment 2: not one of the allowed values"),
    ("/repos/acme/app/issues/101/beef", "segment 5: above 100"),
    ("/repos/acme/app/issues/0/beef", "segment 5: below 1"),
    ("/repos/acme/app/issues/07/beef", "segment 5: not an integer (canonical decimal digits)"),
    ("/repos/acme/app/issues/7/BEEF", "segment 6: does not match the pattern"),
    ("/repos/acme/app/issues/7/beef/x", "7 segments, the template has 6"),
    ("/repos/acme/app/pulls/7/beef", "segment 4 is not `pulls`".replace("pulls", "issues")),
])
def test_a_template_admits_each_segment_by_its_constraint(path, where):
    got = sh.judge_path(shape(template=TEMPLATE), path)
    assert got == (("", "") if not where else ("path-template-mismatch", where))


def test_a_bare_variable_is_one_non_empty_segment():
    s = shape(template=(Segment(literal="a"), Segment(name="x", value=Value())))
    assert sh.judge_path(s, "/a/anything-at-all")[0] == ""
    assert sh.judge_path(s, "/a/")[0] == "path-template-mismatch"
    assert sh.judge_path(s, "/a/b/c")[0] == "path-template-mismatch"


@pytest.mark.parametrize("query, got", [
    (None, ("", "")),
    ("state=open&per_page=5", ("", "")),
    ("state=open&per_page=500", ("query-value-refused", "name=per_page: above 100")),
    ("state=merged", ("query-value-refused", "name=state: not one of the allowed values")),
    ("state=open&token=x", ("query-parameter-not-allowed", "name=token")),
    ("state=open&state=closed", ("query-parameter-repeated", "name=state")),
    ("state=%ff", ("query-value-refused", "the query does not decode to UTF-8")),
    ("state=op%65n", ("", "")),  # decoded once, then judged
])
def test_a_listed_query_is_default_deny(query, got):
    s = shape(query=(Param(name="state", value=Value(enum=("closed", "open"))), Param(name="per_page", value=INT)))
    assert sh.judge_query(s, query) == got


def test_an_empty_query_list_admits_no_parameter_and_no_list_admits_any():
    assert sh.judge_query(shape(query=()), "a=1")[0] == "query-parameter-not-allowed"
    assert sh.judge_query(shape(query=()), None)[0] == ""
    assert sh.judge_query(shape(query=()), "") == ("query-parameter-not-allowed", "an empty query")  # `/x?`
    assert sh.shape_of(rule()) is None  # no shape at all: the query is free, as before shapes


def test_header_values_are_judged_case_insensitively_and_once():
    s = shape(header_values=(Param(name="x-version", value=Value(enum=("2022-11-28",))),))
    assert sh.judge_headers(s, [("X-Version", "2022-11-28"), ("Accept", "*/*")])[0] == ""
    assert sh.judge_headers(s, [("X-VERSION", "2023")]) == ("header-value-refused", "name=x-version: not one of the allowed values")
    assert sh.judge_headers(s, [("x-version", "2022-11-28"), ("X-Version", "2022-11-28")])[1] == "name=x-version: given twice"


MCP = Mcp(methods=("initialize", "notifications/initialized", "tools/call", "tools/list"), tools=(
    Tool(name="get_issue", arguments=(Param(name="number", value=INT), Param(name="repo", value=Value(enum=("acme/app",)))),
         required=("number", "repo")),
    Tool(name="search", arguments=(Param(name="q", value=Value(pattern="[a-z ]+", max_length=10)),), forbidden=("sort",),
         additional=True),
))


def call(tool, arguments):
    return ("request", "tools/call", tool, arguments)


@pytest.mark.parametrize("messages, got", [
    ([call("get_issue", {"repo": "acme/app", "number": 3})], ("", "", ())),
    ([call("delete_repo", {"repo": "acme/app"})], ("mcp-tool-not-allowed", "tool=delete_repo", ())),
    ([call("get_issue", {"repo": "acme/other", "number": 3})],
     ("mcp-argument-refused", "tool=get_issue path=$.repo: not one of the allowed values", ())),
    ([call("get_issue", {"repo": "acme/app", "number": True})],
     ("mcp-argument-refused", "tool=get_issue path=$.number: not an integer", ())),
    ([call("get_issue", {"repo": "acme/app", "number": 3.0})],
     ("mcp-argument-refused", "tool=get_issue path=$.number: not an integer", ())),
    ([call("get_issue", {"repo": "acme/app"})], ("mcp-argument-refused", "tool=get_issue path=$.number: required", ())),
    ([call("get_issue", {"repo": "acme/app", "number": 3, "x": 1})],
     ("mcp-argument-refused", "tool=get_issue path=$.x: not an allowed argument", ())),
    ([call("search", {"q": "abc", "page": 2})], ("", "", ())),  # additional keys admitted, any value
    ([call("search", {"q": "abc", "sort": "x"})], ("mcp-argument-refused", "tool=search path=$.sort: forbidden", ())),
    ([call("search", {"q": "abcdefghijk"})], ("mcp-argument-refused", "tool=search path=$.q: longer than 10 characters", ())),
    ([call("search", {"q": "ABC"})], ("mcp-argument-refused", "tool=search path=$.q: does not match the pattern", ())),
    ([call("get_issue", {"repo": "acme/app", "number": 3}), call("delete_repo", {})],
     ("mcp-tool-not-allowed", "index=1 tool=delete_repo", ())),  # a batch is admitted only whole
    ([("request", "resources/read", None, None)], ("mcp-method-not-allowed", "method=resources/read", ())),
    ([("response", None, None, None)], ("mcp-method-not-allowed", "method=(a response)", ())),
    ([("request", "initialize", None, None), ("request", "tools/list", None, None)], ("", "", ("1",))),
    ([("notification", "tools/list", None, None)], ("", "", ())),  # only a request gets an answer to filter
])
def test_mcp_messages_are_judged_every_one(messages, got):
    assert sh.judge_mcp(shape(mcp=MCP), messages) == got


GQL = GraphQL(query=("repository", "viewer"), persisted=(hashlib.sha256(b"{ viewer }").hexdigest(),))


@pytest.mark.parametrize("ops, reason", [
    ([("{ viewer }", None, "query", ("viewer", "__typename"))], ""),
    ([("{ x }", None, "query", ("repository", "deleteRepository"))], "graphql-field-not-allowed"),
    ([("m", None, "mutation", ("deleteRepository",))], "graphql-operation-not-allowed"),
    ([("{ __schema }", None, "query", ("__schema",))], "graphql-introspection-refused"),
    ([(None, GQL.persisted[0], None, ())], ""),
    ([(None, "0" * 64, None, ())], "graphql-persisted-query-not-allowed"),
    ([("{ repository }", GQL.persisted[0], "query", ("repository",))], "graphql-persisted-query-not-allowed"),
    ([(None, None, None, ())], "body-malformed"),
    ([("{ viewer }", None, "query", ("viewer",)), ("m", None, "mutation", ("x",))], "graphql-operation-not-allowed"),
])
def test_graphql_operations_are_judged_by_root_field(ops, reason):
    assert sh.judge_graphql(shape(graphql=GQL), ops)[0] == reason


ZERO, A, B = "0" * 40, "a" * 40, "b" * 40


@pytest.mark.parametrize("updates, got", [
    ([(A, B, "refs/heads/agent/x")], ("", "")),
    ([(A, B, "refs/heads/agent/x/y")], ("git-ref-not-allowed", "ref=refs/heads/agent/x/y")),  # `*` stops at `/`
    ([(A, B, "refs/heads/main")], ("git-ref-not-allowed", "ref=refs/heads/main")),
    ([(A, ZERO, "refs/heads/agent/x")], ("git-delete-refused", "ref=refs/heads/agent/x")),
    ([(ZERO, B, "refs/heads/agent/x")], ("git-create-refused", "ref=refs/heads/agent/x")),
    ([(A, B, "refs/heads/agent/x"), (A, B, "refs/heads/main")], ("git-ref-not-allowed", "ref=refs/heads/main")),
])
def test_git_pushes_are_judged_ref_by_ref(updates, got):
    assert sh.judge_git(shape(prefix="/acme/app.git", git=Git(fetch=True, push=("refs/heads/agent/*",))), updates) == got


@pytest.mark.parametrize("method, path, query, got", [
    ("GET", "/acme/app.git/info/refs", "service=git-upload-pack", ("", "", "git-upload-pack")),
    ("POST", "/acme/app.git/git-upload-pack", None, ("", "", "git-upload-pack")),
    ("GET", "/acme/app.git/info/refs", "service=git-receive-pack", ("git-service-not-allowed", "push is not allowed", "git-receive-pack")),
    ("POST", "/acme/app.git/git-receive-pack", None, ("git-service-not-allowed", "push is not allowed", "git-receive-pack")),
    ("GET", "/acme/app.git/objects/info/packs", None, ("git-service-not-allowed", "not a smart-HTTP endpoint below the rule's path", "")),
    ("GET", "/acme/app.git/info/refs", "service=git-upload-pack&x=1", ("git-service-not-allowed", "`info/refs` takes GET with one `service` parameter", "")),
    ("GET", "/acme/app.git/info/refs", "service=git-upload-pack&", ("git-service-not-allowed", "`info/refs` takes GET with one `service` parameter", "")),
    ("GET", "/acme/app.git/info/refs", "&service=git-upload-pack", ("git-service-not-allowed", "`info/refs` takes GET with one `service` parameter", "")),
    ("GET", "/acme/app.git/info/refs", "", ("git-service-not-allowed", "`info/refs` takes GET with one `service` parameter", "")),
    ("POST", "/acme/app.git/git-upload-pack", "", ("git-service-not-allowed", "`git-upload-pack` takes POST with no query", "")),
])
def test_a_git_rule_has_only_the_smart_http_endpoints_of_what_it_allows(method, path, query, got):
    assert sh.git_service(shape(prefix="/acme/app.git", git=Git(fetch=True)), method, path, query) == got


@pytest.mark.parametrize("query, where", [
    ("", "an empty query"),
    ("&", "an empty parameter at position 1"),
    ("&s=open", "an empty parameter at position 1"),
    ("s=open&", "an empty parameter at position 2"),
    ("s=open&&n=1", "an empty parameter at position 2"),
    ("s=open&n=1&&", "an empty parameter at position 3"),
])
def test_a_place_without_a_parameter_is_refused_under_a_declared_query(query, where):
    # each would be another request upstream (the edge forwards the target as written) that the pairs do not show
    listed = shape(query=(Param(name="s", value=Value(enum=("open",))), Param(name="n", value=INT)))
    assert sh.query_gap(query) == where and sh.query_pairs(query) is None
    assert sh.judge_query(listed, query) == ("query-parameter-not-allowed", where)
    assert sh.judge_head(listed, "GET", "/x", query, ()) == ("query-parameter-not-allowed", where)
    assert sh.judge_head(shape(query=()), "GET", "/x", query, ())[0] == "query-parameter-not-allowed"
    assert sh.judge_head(listed, "GET", "/x", "s=open&n=1", ()) == ("", "")
    assert sh.judge_head(shape(query=()), "GET", "/x", None, ()) == ("", "")
    # the template is judged first, as for any query; no declared `query`: the query is free, `?` and `&&` too
    templated = shape(template=(Segment(literal="x"),), query=())
    assert sh.judge_head(templated, "GET", "/y", query, ())[0] == "path-template-mismatch"
    assert sh.judge_head(shape(template=(Segment(literal="x"),)), "GET", "/x", query, ()) == ("", "")


# --- through the decision function -------------------------------------------------------------------------------

LEASE = Lease(subject="agent", profile=None, connection="gh", exp=2**40)


def artifact(*rules):
    return b.artifact(connections=[b.connection("gh", rules)])


def ask(method, target, headers=(), body=False):
    return Request(method=method, scheme="https", host=HOST, port=443, target=target, headers=tuple(headers), has_body=body)


def test_head_shapes_choose_the_rule_and_name_the_first_refusal():
    art = artifact(
        rule(name="issues", prefix="/repos", template=(Segment(literal="repos"), Segment(name="r", value=Value(enum=("app",))), Segment(literal="issues"))),
        rule(name="pulls", prefix="/repos", template=(Segment(literal="repos"), Segment(name="r", value=Value(enum=("app",))), Segment(literal="pulls"))),
        rule(name="search", prefix="/search", query=(Param(name="q", value=Value(max_length=5)),)),
    )
    assert decide_without_addresses(art, LEASE, ask("GET", "/repos/app/pulls")).rule == "pulls"  # the first refused, the second admits
    refused = decide_without_addresses(art, LEASE, ask("GET", "/repos/web/pulls"))
    assert (refused.allowed, refused.reason, refused.rule) == (False, "path-template-mismatch", "issues")
    assert refused.detail == "rule `issues`: segment 2: not one of the allowed values"
    assert decide_without_addresses(art, LEASE, ask("GET", "/search?q=abc")).allowed
    too_long = decide_without_addresses(art, LEASE, ask("GET", "/search?q=abcdef"))
    assert (too_long.reason, too_long.detail) == ("query-value-refused", "rule `search`: name=q: longer than 5 characters")
    assert decide_without_addresses(art, LEASE, ask("GET", "/elsewhere")).reason == "path-not-allowed"
    for target, where in (("/search?", "an empty query"), ("/search?q=a&", "an empty parameter at position 2"),
                          ("/search?&&q=a", "an empty parameter at position 1")):
        gap = decide_without_addresses(art, LEASE, ask("GET", target))
        assert (gap.allowed, gap.reason, gap.rule, gap.detail) == (False, "query-parameter-not-allowed", "search", f"rule `search`: {where}")


JSON = (("Content-Type", "application/json"),)


def test_an_mcp_body_is_judged_after_the_head_and_its_tools_list_answer_is_filtered():
    art = artifact(rule(name="tools", prefix="/mcp", mcp=MCP))
    head = decide_without_addresses(art, LEASE, ask("POST", "/mcp", JSON, body=True))
    assert (head.allowed, head.body_shape, head.body_limit) == (True, "mcp", 1 << 20)
    stream = decide_without_addresses(art, LEASE, ask("GET", "/mcp"))  # the server's SSE stream: no body, its answers cut
    assert stream.allowed and stream.body_shape is None and stream.answer_filter is not None
    replayed = b'id: 7\ndata: {"jsonrpc":"2.0","id":99,"result":{"tools":[{"name":"drop"},{"name":"search"}]}}\n\n'
    sse = stream.answer_filter.sse()
    assert b'"drop"' not in sse.feed(replayed) + sse.close()

    def judged(payload):
        return judge_body(art, LEASE, ask("POST", "/mcp", JSON, body=True), head, json.dumps(payload).encode())

    ok = judged({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "get_issue", "arguments": {"repo": "acme/app", "number": 1}}})
    assert (ok.allowed, ok.body_shape, ok.answer_filter) == (True, None, None)
    refused = judged([{"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                      {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "drop", "arguments": {}}}])
    assert (refused.allowed, refused.reason, refused.rule, refused.detail) == (False, "mcp-tool-not-allowed", "tools", "rule `tools`: index=1 tool=drop")
    listed = judged({"jsonrpc": "2.0", "id": "L", "method": "tools/list"})
    assert listed.allowed and listed.answer_filter is not None
    answer = {"jsonrpc": "2.0", "id": "L", "result": {"tools": [{"name": "get_issue"}, {"name": "drop"}, {"name": "search"}]}}
    assert [t["name"] for t in json.loads(listed.answer_filter.json(json.dumps(answer).encode()))["result"]["tools"]] == ["get_issue", "search"]
    for body, reason in ((b'{"jsonrpc":"2.0","id":1,"method":"ping","id":2}', "body-malformed"),
                         (b"[" * 10_000, "body-malformed"),
                         (b"x" * ((1 << 20) + 1), "body-too-large-to-judge")):
        assert judge_body(art, LEASE, ask("POST", "/mcp", JSON, body=True), head, body).reason == reason
    text = judge_body(art, LEASE, ask("POST", "/mcp", (("Content-Type", "text/plain"),), body=True), head, b"{}")
    assert text.reason == "content-type-mismatch"


def test_a_graphql_get_is_judged_in_the_head_and_a_post_after_it():
    art = artifact(rule(name="graph", prefix="/graphql", graphql=GQL))
    assert decide_without_addresses(art, LEASE, ask("GET", "/graphql?query=%7B%20viewer%20%7D")).allowed
    smuggled = decide_without_addresses(art, LEASE, ask("GET", "/graphql?query=%7B%20viewer%20x%3A%20deleteRepository%20%7D"))
    assert (smuggled.reason, smuggled.detail) == ("graphql-field-not-allowed", "rule `graph`: query field=deleteRepository")
    padded = decide_without_addresses(art, LEASE, ask("GET", "/graphql?query=%7B%20viewer%20%7D&&"))
    assert (padded.allowed, padded.reason, padded.detail) == (False, "query-parameter-not-allowed", "rule `graph`: an empty parameter at position 2")
    head = decide_without_addresses(art, LEASE, ask("POST", "/graphql", JSON, body=True))
    doc = {"query": "query { ...F } fragment F on Query { viewer deleteRepository }"}
    assert judge_body(art, LEASE, ask("POST", "/graphql", JSON, body=True), head, json.dumps(doc).encode()).reason == "graphql-field-not-allowed"
    two = {"query": "query A { viewer } mutation B { deleteRepository }", "operationName": "A"}
    assert judge_body(art, LEASE, ask("POST", "/graphql", JSON, body=True), head, json.dumps(two).encode()).reason == "graphql-multiple-operations"
