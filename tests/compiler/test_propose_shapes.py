"""`propose` for a credentialed connection: never wider than what was denied.

Denials are made by the real decision function (`decide`, `judge_body`) against a compiled policy with request shapes,
and written as the edge writes them (reason, connection, host, port, method, path, `detail` naming the rule and the
place). Each proposal is written to a temporary directory, compiled with `egresslaw compile`, and replayed through
`decide`: it admits exactly the denied requests, and their nearest neighbours stay denied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from compiler.compile import compile_paths, compile_sources
from compiler.propose import Denial, exact_name, exact_rules, propose, template_text
from egress_proxy.decision.adapter import decide, judge_body
from egress_proxy.decision.types import Lease, Request
from egresslaw.cli import main

HEADER = 'egresslaw 1\n\nworkspace "acme"\ncatalog "2026.11"\n'

# A new user's policy: one read rule on the repository's issues, carrying the production token.
NEW_USER = HEADER + """
connection "github" {
  credential = "gh-prod"
  inject = {"header": "Authorization", "format": "Bearer {secret}"}

  egress "read-issues" {
    host = "api.github.com"
    path_prefix = "/repos/acme/app/issues"
    methods = ["GET"]
    headers = ["accept"]
  }
}
"""

SHAPED = HEADER + """
connection "agent" {
  credential = "agent-prod"
  inject = {"header": "Authorization", "format": "Bearer {secret}"}

  egress "tools" {
    host = "mcp.acme-test.dev"
    path = "/mcp"
    methods = ["POST"]
    headers = ["content-type", "accept"]
    mcp = {
      "methods": ["initialize", "tools/call", "tools/list"],
      "tools": {
        "get_issue": {
          "arguments": {
            "repo": ["acme/app"]
          },
          "required": ["repo"]
        }
      }
    }
  }

  egress "graph" {
    host = "api.acme-test.dev"
    path = "/graphql"
    methods = ["POST"]
    headers = ["content-type"]
    graphql = {
      "query": ["viewer"],
      "mutation": ["addComment"]
    }
  }

  egress "push" {
    host = "git.acme-test.dev"
    path_prefix = "/acme/app.git"
    methods = ["GET", "POST"]
    headers = ["content-type"]
    git = {
      "fetch": true,
      "push": ["refs/heads/agent/*"],
      "create": true
    }
  }

  egress "issues" {
    host = "api.acme-test.dev"
    path = "/repos/acme/{repo:app|web}/issues"
    methods = ["GET"]
    headers = ["accept"]
    query = {
      "state": ["open", "closed"]
    }
  }
}
"""
IP = "93.184.216.34"
GITHUB = Lease(subject="agent-7", profile=None, connection="github", exp=0)
AGENT = Lease(subject="agent-7", profile=None, connection="agent", exp=0)
JSON = (("Content-Type", "application/json"),)
GIT = (("Content-Type", "application/x-git-receive-pack-request"),)
OLD, NEW = "1" * 40, "2" * 40


@pytest.fixture
def cli(capsys):
    """`egresslaw ARGS…` in this process: (exit code, stdout, stderr)."""

    def run(*argv):
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def compiled(text: str):
    result = compile_sources({"p/policy.egress": text}, [])
    assert result.ok, result.diagnostics
    return result


def judged(artifact, lease: Lease, method: str, host: str, target: str, headers=(), body: bytes | None = None):
    """The real decision: the head, then the body when the rule judges one."""
    req = Request(method=method, scheme="https", host=host, port=443, target=target, headers=tuple(headers),
                  has_body=body is not None)
    d = decide(artifact, lease, req, [IP])
    if d.allowed and d.body_shape is not None:
        d = judge_body(artifact, lease, req, d, body or b"")
    return d


def denied(n: int, artifact, lease: Lease, method: str, host: str, target: str, headers=(), body: bytes | None = None) -> dict:
    """The audit event the edge writes for a request the real decision denies."""
    d = judged(artifact, lease, method, host, target, headers, body)
    assert not d.allowed, (method, host, target)
    return {"kind": "request", "id": f"ev{n:030d}", "decision": "deny", "reason": d.reason, "subject": lease.subject,
            "profile": lease.profile, "connection": lease.connection, "method": method, "scheme": "https", "host": host,
            "port": 443, "path": target.split("?")[0], "rule": None, "detail": d.detail,
            "headers": sorted({h.lower() for h, _ in headers})}


def as_denials(events: list[dict]) -> list[Denial]:
    return [Denial(e["id"], "audit.jsonl", i, e["kind"], e["decision"], e["reason"], e) for i, e in enumerate(events, 1)]


def applied(proposal, tmp_path: Path, cli):
    """The proposal written to a temporary policy directory and compiled by `egresslaw compile` (the CLI)."""
    policy = tmp_path / "policy"
    policy.mkdir()
    for name, text in proposal.new_sources.items():
        (policy / Path(name).name).write_text(text)
    code, _, err = cli("compile", policy, "-o", tmp_path / "build.json")
    assert code == 0, err
    result = compile_paths([policy])
    assert result.ok
    return result.artifact


def never_wider(proposal) -> None:
    """No wildcard, no bare or pattern variable, no prefix rule among the proposed rules."""
    for c in proposal.changes:
        text = json.dumps(c.add)
        assert "*" not in text, text
        if "egress" in c.add:
            rule = c.add["egress"]
            assert "path_prefix" not in rule
            for variable in re.findall(r"\{[^}]*\}", rule["path"]):
                assert re.fullmatch(r"\{segment\d+:[^/{}]+\}", variable), variable  # an enum, never `{x}` or `{x:/../}`


def mcp_call(tool: str, arguments: dict | None = None) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments or {}}}).encode()


def mcp_method(method: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": method}).encode()


def graphql(document: str) -> bytes:
    return json.dumps({"query": document}).encode()


def push(ref: str, old: str = OLD) -> bytes:
    line = f"{old} {NEW} {ref}\0report-status\n"
    return f"{len(line) + 4:04x}{line}0000".encode() + b"PACK"


# ---------------------------------------------------------------------------------------------
# The new user's two denials: two exact rules, never `/`
# ---------------------------------------------------------------------------------------------


def test_two_unrelated_denials_become_two_exact_rules(tmp_path, cli):
    art = compiled(NEW_USER).artifact
    events = [denied(1, art, GITHUB, "POST", "api.github.com", "/repos/acme/app/pulls", (("Accept", "x"),)),
              denied(2, art, GITHUB, "GET", "api.github.com", "/orgs/acme/members", (("Accept", "x"),))]
    assert [e["reason"] for e in events] == ["path-not-allowed", "path-not-allowed"]
    p = propose(compiled(NEW_USER), as_denials(events))
    never_wider(p)
    assert [(c.add["egress"]["path"], c.add["egress"]["methods"]) for c in p.changes] == [
        ("/orgs/acme/members", ["GET"]), ("/repos/acme/app/pulls", ["POST"])]
    assert 'path_prefix = "/"' not in p.diff and not any("note" in n for c in p.changes for n in c.evidence.notes)
    after = applied(p, tmp_path, cli)
    for method, path in (("POST", "/repos/acme/app/pulls"), ("GET", "/orgs/acme/members"), ("GET", "/repos/acme/app/issues/1")):
        assert judged(after, GITHUB, method, "api.github.com", path).allowed, (method, path)
    for method, path in (("DELETE", "/repos/acme/app"), ("GET", "/orgs/acme/secrets"), ("GET", "/repos/acme/app/pulls"),
                         ("POST", "/orgs/acme/members"), ("POST", "/repos/acme/app/pulls/1/merge"), ("GET", "/orgs/acme/members/"),
                         ("DELETE", "/repos/acme/app/pulls"), ("GET", "/"), ("POST", "/repos/acme/app/issues")):
        assert not judged(after, GITHUB, method, "api.github.com", path).allowed, (method, path)


def test_values_of_one_segment_share_one_enum_and_nothing_else_merges():
    art = compiled(NEW_USER).artifact
    accept = (("Accept", "x"),)
    events = [denied(1, art, GITHUB, "GET", "api.github.com", "/repos/acme/app/pulls", accept),
              denied(2, art, GITHUB, "GET", "api.github.com", "/repos/acme/web/pulls", accept),
              denied(3, art, GITHUB, "GET", "api.github.com", "/repos/acme/int/pulls", accept),
              denied(4, art, GITHUB, "POST", "api.github.com", "/repos/acme/api/pulls", accept),  # another method: its own rule
              denied(5, art, GITHUB, "GET", "api.github.com", "/repos/acme/cli/labels", accept),  # two segments differ
              denied(6, art, GITHUB, "GET", "api.github.com", "/repos/acme/app/pulls", accept)]
    p = propose(compiled(NEW_USER), as_denials(events))
    never_wider(p)
    rules = sorted((c.add["egress"]["path"], tuple(c.add["egress"]["methods"]), c.evidence.count) for c in p.changes)
    assert rules == [('/repos/acme/api/pulls', ("POST",), 1), ('/repos/acme/cli/labels', ("GET",), 1),
                     ('/repos/acme/{segment3:app|"int"|web}/pulls', ("GET",), 4)]
    after = p.result.artifact
    for repo in ("app", "web", "int"):
        assert judged(after, GITHUB, "GET", "api.github.com", f"/repos/acme/{repo}/pulls").allowed
    for method, path in (("GET", "/repos/acme/api/pulls"), ("POST", "/repos/acme/app/pulls"), ("GET", "/repos/acme/cli/pulls"),
                         ("GET", "/repos/acme/app/labels"), ("GET", "/repos/acme/integer/pulls")):
        assert not judged(after, GITHUB, method, "api.github.com", path).allowed, (method, path)


@pytest.mark.parametrize("paths, methods, rules", [
    ([("/a/x/c", "GET"), ("/a/y/c", "GET"), ("/a/x/d", "GET")], None, 2),  # x/y and x-d: greedy, one variable per rule
    ([("/a/x", "GET"), ("/a/x/", "GET")], None, 2),  # a trailing `/` is another segment count
    ([("/a/", "GET"), ("/b/", "GET")], None, 1),  # the empty last segment is never an enum option, the first is
])
def test_exact_rules_admit_exactly_the_paths_seen(paths, methods, rules):
    got = exact_rules([(p, m, None, None) for p, m in paths])
    assert len(got) == rules
    admitted = set()
    for rule in got:
        variable = rule.variable
        for value in rule.segments[variable - 1] if variable else [None]:
            admitted.add("/" + "/".join(value if i == variable else s[0] for i, s in enumerate(rule.segments, start=1)))
        assert all(len(s) == 1 for i, s in enumerate(rule.segments, start=1) if i != variable)
    assert admitted == {p for p, _ in paths}
    assert template_text([["a"], ["x", "int"], [""]]) == '/a/{segment2:x|"int"}/'


# ---------------------------------------------------------------------------------------------
# Shape denials: exactly the refused name, in the rule that refused it
# ---------------------------------------------------------------------------------------------

# (request that is denied, reason, the change's `add`, requests the proposal admits, requests it still denies)
MCP = ("POST", "mcp.acme-test.dev", "/mcp", JSON)
GQL = ("POST", "api.acme-test.dev", "/graphql", JSON)
PUSH = ("POST", "git.acme-test.dev", "/acme/app.git/git-receive-pack", GIT)
CASES = [
    pytest.param(MCP + (mcp_call("delete_issue"),), "mcp-tool-not-allowed",
                 {"rule": "tools", "mcp": {"tools": {"delete_issue": {"arguments": {}}}}},
                 [MCP + (mcp_call("delete_issue"),), MCP + (mcp_call("get_issue", {"repo": "acme/app"}),)],
                 [MCP + (mcp_call("delete_issue", {"repo": "acme/app"}),), MCP + (mcp_call("delete_repo"),)], id="mcp-tool"),
    pytest.param(MCP + (mcp_method("resources/list"),), "mcp-method-not-allowed",
                 {"rule": "tools", "mcp": {"methods": ["resources/list"]}},
                 [MCP + (mcp_method("resources/list"),)], [MCP + (mcp_method("resources/read"),)], id="mcp-method"),
    pytest.param(GQL + (graphql("mutation { createIssue(x: 1) { id } }"),), "graphql-field-not-allowed",
                 {"rule": "graph", "graphql": {"mutation": ["createIssue"]}},
                 [GQL + (graphql("mutation { createIssue { id } }"),), GQL + (graphql("mutation { addComment { id } }"),)],
                 [GQL + (graphql("query { createIssue { id } }"),), GQL + (graphql("mutation { deleteRepository { id } }"),)],
                 id="graphql-field"),
    pytest.param(PUSH + (push("refs/heads/main"),), "git-ref-not-allowed",
                 {"rule": "push", "git": {"push": ["refs/heads/main"]}},
                 [PUSH + (push("refs/heads/main"),), PUSH + (push("refs/heads/agent/x"),)],
                 [PUSH + (push("refs/heads/main2"),), PUSH + (push("refs/heads/release"),), PUSH + (push("refs/heads/main/x"),)],
                 id="git-ref"),
    pytest.param(("GET", "api.acme-test.dev", "/repos/acme/cli/issues", (), None), "path-template-mismatch",
                 {"rule": "issues", "path": {"segment": 3, "enum": ["cli"]}},
                 [("GET", "api.acme-test.dev", "/repos/acme/cli/issues", (), None),
                  ("GET", "api.acme-test.dev", "/repos/acme/app/issues?state=open", (), None)],
                 [("GET", "api.acme-test.dev", "/repos/acme/clix/issues", (), None),
                  ("GET", "api.acme-test.dev", "/repos/acme/cli/issues?state=merged", (), None)], id="template-enum"),
    pytest.param(("GET", "api.acme-test.dev", "/repos/acme/app/issues?page=2", (), None), "query-parameter-not-allowed",
                 {"rule": "issues", "query": {"page": {"max_length": 256}}},
                 [("GET", "api.acme-test.dev", "/repos/acme/app/issues?page=2&state=open", (), None)],
                 [("GET", "api.acme-test.dev", "/repos/acme/app/issues?per_page=2", (), None),
                  ("GET", "api.acme-test.dev", "/repos/acme/app/issues?page=" + "9" * 257, (), None),
                  ("GET", "api.acme-test.dev", "/repos/acme/app/issues?page=1&page=2", (), None)], id="query-name"),
]


@pytest.mark.parametrize("request_, reason, add, admits, refuses", CASES)
def test_a_shape_denial_adds_exactly_what_was_refused(request_, reason, add, admits, refuses, tmp_path, cli):
    before = compiled(SHAPED)
    event = denied(1, before.artifact, AGENT, *request_)
    assert event["reason"] == reason
    p = propose(before, as_denials([event]))
    never_wider(p)
    (change,) = p.changes
    assert (change.kind, change.subject, change.add) == ("connection", "agent", add)
    assert p.not_proposable == () and p.review == ()
    after = applied(p, tmp_path, cli)
    assert [r.name for r in after.connection("agent").rules] == [r.name for r in before.artifact.connection("agent").rules]
    for r in admits:
        assert judged(after, AGENT, *r).allowed, r
    for r in refuses:
        assert not judged(after, AGENT, *r).allowed, r
    # the same log against the proposed policy: nothing more to do
    again = propose(compile_sources(p.new_sources, []), as_denials([event]))
    assert again.changes == () and again.admitted.count == 1


def test_a_proposed_tool_admits_no_argument_and_says_so():
    p = propose(compiled(SHAPED), as_denials([denied(1, compiled(SHAPED).artifact, AGENT, *MCP, mcp_call("close_issue", {"n": 1}))]))
    assert "# proposed: tool `close_issue` admits no argument until its `arguments` list it" in p.new_sources["p/policy.egress"]
    assert "mcp-argument-refused" in " ".join(p.changes[0].evidence.notes)
    tool = [t for t in p.result.artifact.connection("agent").rules[0].mcp.tools if t.name == "close_issue"]
    assert [(t.arguments, t.additional, t.required) for t in tool] == [((), False, ())]


@pytest.mark.parametrize("request_, reason, rule, where", [
    (MCP + (mcp_call("get_issue", {"repo": "acme/web"}),), "mcp-argument-refused", "tools",
     "tool=get_issue path=$.repo: not one of the allowed values"),
    (("GET", "api.acme-test.dev", "/repos/acme/app/issues?state=merged", (), None), "query-value-refused", "issues",
     "name=state: not one of the allowed values"),
    (GQL + (graphql("subscription { x }"),), "graphql-operation-not-allowed", "graph", "operation=subscription"),
    (GQL + (graphql("{ __schema { types { name } } }"),), "graphql-introspection-refused", "graph", "field=__schema"),
    (PUSH + (push("refs/heads/agent/x", old="0" * 40),), None, None, None),  # create = true: admitted, the control below
    (PUSH + (push("refs/heads/agent/x", old=OLD).replace(NEW.encode(), b"0" * 40),), "git-delete-refused", "push",
     "ref=refs/heads/agent/x"),
])
def test_a_refused_value_is_named_for_review_never_proposed(request_, reason, rule, where):
    before = compiled(SHAPED)
    if reason is None:
        assert judged(before.artifact, AGENT, *request_).allowed
        return
    event = denied(1, before.artifact, AGENT, *request_)
    assert event["reason"] == reason
    p = propose(before, as_denials([event]))
    assert p.changes == () and p.diff == ""
    (review,) = p.review
    assert (review.reason, review.subject, review.rule, review.where) == (reason, "connection:agent", rule, where)
    assert review.evidence.count == 1 and review.why


def test_the_new_user_scenario_through_the_cli_has_no_merge_note(tmp_path, cli):
    """Two denials written as an audit log; `egresslaw propose` prints two exact rules, no `note:` about a merge."""
    art = compiled(NEW_USER).artifact
    events = [denied(1, art, GITHUB, "POST", "api.github.com", "/repos/acme/app/pulls", (("Accept", "x"),)),
              denied(2, art, GITHUB, "GET", "api.github.com", "/orgs/acme/members", (("Accept", "x"),)),
              denied(3, compiled(SHAPED).artifact, AGENT, *MCP, mcp_call("get_issue", {"repo": "acme/web"}))]
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "audit.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "p.egress").write_text(NEW_USER + SHAPED[len(HEADER):])
    code, out, err = cli("propose", "--audit", audit, policy)
    assert code == 0, err
    assert 'path = "/orgs/acme/members"' in out and 'path = "/repos/acme/app/pulls"' in out
    assert "note:" not in out and "path_prefix = \"/\"" not in out
    assert "info: connection:agent rule `tools`: mcp-argument-refused tool=get_issue path=$.repo: not one of the allowed values (1)" in out
    code, out, _ = cli("propose", "--audit", audit, policy, "--format", "json")
    doc = json.loads(out)
    assert [r["where"] for r in doc["review"]] == ["tool=get_issue path=$.repo: not one of the allowed values"]
    assert [c["add"]["egress"]["path"] for c in doc["changes"]] == ["/orgs/acme/members", "/repos/acme/app/pulls"]


@pytest.mark.parametrize("shown, exact", [
    ("delete_repo", "delete_repo"),
    ("caf\\xe9", None),  # escaped by the proxy: not the name the request carried
    ("a" * 77 + "...", None),  # cut to 80 characters
    ("a" * 79, "a" * 79),
    ("", None),
])
def test_only_a_name_shown_exactly_is_proposed(shown, exact):
    assert exact_name(shown) == exact


def test_a_cut_or_escaped_name_is_not_proposed():
    before = compiled(SHAPED)
    event = denied(1, before.artifact, AGENT, *MCP, mcp_call("t" * 100))
    p = propose(before, as_denials([event]))
    assert p.changes == () and "cut short" in p.not_proposable[0].why


def test_a_shape_denial_without_its_detail_is_not_proposed():
    before = compiled(SHAPED)
    event = denied(1, before.artifact, AGENT, *MCP, mcp_call("delete_issue"))
    del event["detail"]
    p = propose(before, as_denials([event]))
    assert p.changes == () and "names no rule and place" in p.not_proposable[0].why


def test_a_literal_segment_or_another_length_is_another_path_an_exact_rule_of_its_own():
    before = compiled(SHAPED)
    events = [denied(1, before.artifact, AGENT, "GET", "api.acme-test.dev", "/repos/acme/app/pulls"),
              denied(2, before.artifact, AGENT, "GET", "api.acme-test.dev", "/repos/acme/app/issues/7")]
    assert [e["reason"] for e in events] == ["path-template-mismatch"] * 2
    p = propose(before, as_denials(events))
    never_wider(p)
    assert sorted(c.add["egress"]["path"] for c in p.changes) == ["/repos/acme/app/issues/7", "/repos/acme/app/pulls"]
    after = p.result.artifact
    for path in ("/repos/acme/app/pulls", "/repos/acme/app/issues/7"):
        assert judged(after, AGENT, "GET", "api.acme-test.dev", path).allowed
    for path in ("/repos/acme/web/pulls", "/repos/acme/app/issues/8", "/repos/acme/app/pulls/1"):
        assert not judged(after, AGENT, "GET", "api.acme-test.dev", path).allowed, path


def test_a_segment_with_a_range_or_pattern_is_named_for_review():
    text = SHAPED.replace('path = "/repos/acme/{repo:app|web}/issues"', 'path = "/repos/acme/{repo:/[a-z]{3}/}/issues"')
    before = compiled(text)
    event = denied(1, before.artifact, AGENT, "GET", "api.acme-test.dev", "/repos/acme/apps/issues")
    p = propose(before, as_denials([event]))
    assert p.changes == ()
    ((review),) = p.review
    assert (review.reason, review.rule, review.where) == ("path-template-mismatch", "issues", "segment 3: does not match the pattern")


@pytest.mark.parametrize("request_, reason", [
    (("GET", "api.acme-test.dev", "/repos/acme/app/issues?state=open&state=closed", (), None), "query-parameter-repeated"),
    (GQL + (graphql("query A { viewer } query B { viewer }"),), "graphql-multiple-operations"),
    (("POST", "mcp.acme-test.dev", "/mcp", (("Content-Type", "text/plain"),), mcp_call("get_issue")), "content-type-mismatch"),
    (MCP + (b'{"jsonrpc": "2.0", "id": 1, "id": 2, "method": "ping"}',), "body-malformed"),
])
def test_refusals_the_caller_fixes_are_not_proposable(request_, reason):
    before = compiled(SHAPED)
    event = denied(1, before.artifact, AGENT, *request_)
    assert event["reason"] == reason
    p = propose(before, as_denials([event]))
    assert p.changes == () and p.review == ()
    assert [r.reason for r in p.not_proposable] == [reason]
    assert "caller" in p.not_proposable[0].why or "never admitted" in p.not_proposable[0].why


def test_a_shape_event_marked_would_deny_is_not_read_as_evidence():
    """Observe mode is a profile's, and an observed profile brokers nothing: a shape denial is always `deny`."""
    before = compiled(SHAPED)
    event = denied(1, before.artifact, AGENT, *MCP, mcp_call("delete_issue")) | {"decision": "would-deny"}
    p = propose(before, as_denials([event]))
    assert p.changes == () and "never in observe mode" in p.not_proposable[0].why


def test_a_server_response_the_rule_does_not_admit_is_named_for_review():
    before = compiled(SHAPED)
    event = denied(1, before.artifact, AGENT, *MCP, b'{"jsonrpc": "2.0", "id": 7, "result": {}}')
    assert (event["reason"], event["detail"]) == ("mcp-method-not-allowed", "rule `tools`: method=(a response)")
    p = propose(before, as_denials([event]))
    assert p.changes == () and "responses = true" in p.review[0].why


def test_a_brokered_profile_request_changes_the_carrier_connections_rule():
    """A profile that brokers through `agent` meets `agent`'s shapes; its denial names that rule, and the change is
    the connection's."""
    text = SHAPED + """
sandbox_profile "builder" {
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {"type": "limited", "allowed_hosts": ["mcp.acme-test.dev", "api.acme-test.dev", "git.acme-test.dev"]}
  brokers = ["agent"]
}
"""
    before = compiled(text)
    builder = Lease(subject="agent-7", profile="builder", connection=None, exp=0)
    event = denied(1, before.artifact, builder, *MCP, mcp_call("delete_issue"))
    assert (event["reason"], event["profile"], event["connection"]) == ("mcp-tool-not-allowed", "builder", None)
    p = propose(before, as_denials([event]))
    (change,) = p.changes
    assert (change.kind, change.subject, change.add["rule"]) == ("connection", "agent", "tools")
    assert judged(p.result.artifact, builder, *MCP, mcp_call("delete_issue")).allowed
