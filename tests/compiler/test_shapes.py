"""Request shapes in policy text (docs/shapes.md) -> the artifact's Rule fields; each mistake is one located
diagnostic with a help text; a policy without shapes compiles to the artifact (and lock) it always did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from compiler.artifact import GraphQL, Git, Mcp, Param, Segment, Tool, Value
from compiler.compile import compile_text

ROOT = Path(__file__).resolve().parents[2]
HEAD = 'egresslaw 1\nworkspace "acme"\ncatalog "2026.11"\n\n'


def policy(rule: str, methods: str = '["GET", "POST"]', headers: str = '["Accept", "Content-Type"]') -> str:
    return (HEAD + 'connection "c" {\n  credential = "c-cred"\n  egress "r" {\n    host = "api.example.com"\n'
            f"    methods = {methods}\n    headers = {headers}\n    {rule}\n  }}\n}}\n")


def rule_of(text: str):
    result = compile_text(text)
    assert result.ok, [(d.code, d.message) for d in result.diagnostics]
    return result.artifact.connection("c").rules[0]


def only_error(text: str, code: str):
    result = compile_text(text)
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert [d.code for d in errors] == [code], [(d.code, d.message) for d in errors]
    assert errors[0].help and errors[0].span.line, errors[0]
    return errors[0]


def test_the_language_example_compiles_to_its_shapes():
    result = compile_text((ROOT / "tests" / "golden" / "shapes" / "input.egress").read_text())
    assert result.ok
    issues, tools, graph, push = result.artifact.connection("github").rules
    assert issues.path_prefix == "/repos" and issues.template == (
        Segment(literal="repos"),
        Segment(name="owner", value=Value(enum=("acme",))),
        Segment(name="repo", value=Value(enum=("app", "web"))),
        Segment(literal="issues"),
        Segment(name="number", value=Value(type="integer", minimum=1, maximum=1000000)),
    )
    assert issues.query == (
        Param(name="per_page", value=Value(type="integer", minimum=1, maximum=100)),
        Param(name="state", value=Value(enum=("closed", "open"))),
    )
    assert issues.header_values == (Param(name="x-github-api-version", value=Value(enum=("2022-11-28",))),)
    assert tools.path_prefix == "/mcp" and tools.template == (Segment(literal="mcp"),)
    assert tools.mcp == Mcp(
        methods=("initialize", "notifications/initialized", "ping", "tools/call", "tools/list"),
        tools=(
            Tool(name="get_issue", required=("number", "repo"), arguments=(
                Param(name="number", value=Value(type="integer", minimum=1)),
                Param(name="repo", value=Value(enum=("acme/app", "acme/web"))),
            )),
            Tool(name="search", arguments=(Param(name="q", value=Value(pattern="[a-z0-9 ]+", max_length=64)),)),
        ),
    )
    assert graph.graphql == GraphQL(query=("repository", "viewer"))
    assert push.git == Git(fetch=True, push=("refs/heads/agent/*",), create=True) and push.template is None
    assert push.path_prefix == "/acme/app.git"
    assert (issues.max_body, issues.mcp, issues.graphql, issues.git) == (None, None, None, None)


def test_defaults_and_canonical_forms():
    r = rule_of(policy("mcp = {}\n    max_body = 2048", methods='["POST"]'))
    assert r.mcp == Mcp(methods=("initialize", "notifications/initialized", "ping", "tools/call", "tools/list"))
    assert r.max_body == 2048 and r.query is None and r.template is None
    assert rule_of(policy("query = {}")).query == ()  # present and empty: no query at all
    h = "AB" * 32
    g = rule_of(policy(f'graphql = {{ mutation = ["b", "a", "b"], persisted = ["{h}"], introspection = true }}')).graphql
    assert g == GraphQL(mutation=("a", "b"), persisted=(h.lower(),), introspection=True)
    args = rule_of(policy('mcp = { tools = { t = { arguments = { n = [3, 1], f = [true], z = null, o = { type = "object" } },'
                          ' additional = true, forbidden = ["x"] } } }')).mcp.tools[0]
    assert args.arguments == (
        Param(name="f", value=Value(type="boolean", enum=(True,))),
        Param(name="n", value=Value(type="integer", enum=(1, 3))),
        Param(name="o", value=Value(type="object")),
        Param(name="z", value=Value(type="null", enum=(None,))),
    )
    assert args.additional and args.forbidden == ("x",)
    q = rule_of(policy('query = { n = 42, id = { type = "integer", enum = [7, -1] } }')).query
    assert q == (Param(name="id", value=Value(type="integer", enum=(-1, 7))), Param(name="n", value=Value(type="integer", enum=(42,))))


@pytest.mark.parametrize(
    "rule, code, words",
    [
        ('path = "/a/{x}"\n    path_prefix = "/a"', "EL0044", "not both"),
        ('path = "/a/../b"', "EL0044", "`..`"),
        ('path = "/a/{x:/x$/}"', "EL0045", "anchor"),
        ('query = { q = { pattern = "(a|b)+" } }', "EL0045", "quantifier on a group"),
        ('query = { q = { type = "integer", minimum = 5, maximum = 1 } }', "EL0046", "above"),
        ('query = { q = { type = "boolean" } }', "EL0046", "text"),
        ('query = { q = { max_length = 0 } }', "EL0023", "max_length"),
        ('query = { q = { type = "integer", pattern = "[0-9]+" } }', "EL0046", "`pattern` constrains string"),
        ('query = { q = { enum = ["ab", "c"], pattern = "[a-z]{2}" } }', "EL0046", "does not match"),
        ('query = { q = ["a", 1] }', "EL0046", "is a integer"),
        ('query = { q = [] }', "EL0046", "empty list"),
        ('query = { q = { typ = "string" } }', "EL0007", "did you mean `type`"),
        ('query = { q = "a", q = "b" }', "EL0032", "twice"),
        ('header_values = { Accept = "x", accept = "y" }', "EL0032", "twice"),
        ('header_values = { "X-Other" = "x" }', "EL0048", "not in the rule's `headers`"),
        ('header_values = { Authorization = "x" }', "EL0048", "carries the credential"),
        ('header_values = { Host = "x" }', "EL0048", "denylisted"),
        ('mcp = { methods = ["tools/cal"] }', "EL0047", "tools/cal"),
        ('mcp = { methods = ["ping"], tools = { t = {} } }', "EL0047", "tools/call"),
        ('mcp = { tools = { t = { required = ["a"] } } }', "EL0047", "requires `a`"),
        ('mcp = { tools = { t = { argumnts = {} } } }', "EL0007", "did you mean `arguments`"),
        ('mcp = {}\n    graphql = { query = ["a"] }', "EL0047", "at most one"),
        ('graphql = { query = ["__schema"] }', "EL0047", "introspection"),
        ('graphql = { persisted = ["abc"] }', "EL0047", "sha256"),
        ('git = { push = ["heads/main"] }\n    path_prefix = "/a.git"', "EL0047", "`refs/`"),
        ('git = { push = ["refs/heads/a..b"] }\n    path_prefix = "/a.git"', "EL0047", "`..`"),
        ('git = { push = ["refs/heads/a b"] }\n    path_prefix = "/a.git"', "EL0047", "git refuses"),
        ('git = { fetch = true }\n    path = "/a.git"', "EL0047", "not a `path` template"),
        ('git = { fetch = true }', "EL0047", "needs `path_prefix`"),
        ('max_body = 1024', "EL0047", "has none"),
        ('graphql = { query = ["a"] }\n    max_body = 67108865', "EL0023", "max_body"),
    ],
)
def test_each_mistake_is_one_located_error(rule, code, words):
    found = only_error(policy(rule), code)
    assert words in found.message or words in (found.help or ""), (found.message, found.help)


def test_a_body_shape_needs_post():
    found = only_error(policy('graphql = { query = ["viewer"] }', methods='["GET"]'), "EL0047")
    assert "POST" in found.help


def test_the_template_error_points_at_the_character():
    text = policy('path = "/repos/v{n}"')
    found = only_error(text, "EL0044")
    line = text.splitlines()[found.span.line - 1]
    assert line[found.span.column - 1] == "{"


def test_without_shapes_the_demo_lock_still_verifies(tmp_path):
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, "-m", "egresslaw", "compile", "policies/demo", "-o", str(out), "--locked"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
