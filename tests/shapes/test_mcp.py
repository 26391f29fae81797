"""MCP through the real edge: the `mcp` SDK's own client (`streamable_http_client` + `ClientSession`, httpx with the
edge as its proxy) against the SDK's own server (FastMCP over Streamable HTTP), answers as JSON (stateful: session
id, GET stream, DELETE) and as SSE (stateless).

The rule (tests/shapes/world.py): methods initialize, notifications/initialized, ping, tools/list, tools/call; tools
get_issue (repo "acme/app", number 1..1000, both required) and search (q `[a-z ]+`, at most 20). The server also
offers delete_repo. Every refusal: the client sees an error, the edge's answer names the reason, exactly one audit
event says it, and the server saw no byte of the refused request.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.proxy_harness import CANARY, assert_no_canary
from tests.shapes import servers
from tests.shapes.world import (
    ALLOWED_TOOLS,
    BEARER,
    MCP,
    assert_denied_answer,
    serving,
    settle,
)

pytestmark = pytest.mark.slow

ANSWERS = {"json": "/json/mcp", "sse": "/sse/mcp"}
JSON_RPC_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("shapes-mcp"), MCP, servers.start_mcp, ("mcp",)) as world:
        yield world


def _session(world, path: str, then, *, on_open=None):
    """Open an MCP session through the edge at `path`, initialize it, and return `await then(session)`; `on_open(session)`
    runs first (after initialize). Everything the client was shown is kept for the module's leak scan."""

    async def run():
        async with world.proxy.async_client() as http:
            async with streamable_http_client(f"https://{MCP}{path}", http_client=http) as (read, write, _):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    if on_open is not None:
                        await on_open(session)
                    return await then(session)

    return asyncio.run(asyncio.wait_for(run(), 60))


def _refusal(exc: BaseException) -> httpx.Response | None:
    """The edge's refusal the SDK client raised (httpx.HTTPStatusError, inside the transport's exception group)."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response
    for inner in getattr(exc, "exceptions", ()):
        found = _refusal(inner)
        if found is not None:
            return found
    return None


def _call_refused(world, path: str, tool: str, arguments: dict) -> tuple[httpx.Response, object, int]:
    """Call `tool` through the SDK client and expect the edge to refuse it; (the refusal, the audit mark, the server's
    mark), both marks taken once the session was open, just before the call."""
    marks = {}

    async def mark(_session):
        marks["audit"], marks["server"] = world.proxy.mark(), world.server.mark()

    async def call(session):
        return await session.call_tool(tool, arguments)

    try:
        result = _session(world, path, call, on_open=mark)
    except Exception as exc:  # an ExceptionGroup from the SDK's transport
        response = _refusal(exc)
        assert response is not None, f"the client failed, but not with the edge's refusal: {exc!r}"
        return response, marks["audit"], marks["server"]
    pytest.fail(f"the call was not refused; the server answered {result.model_dump_json()[:300]}")


def _posts_since(world, mark) -> list[servers.Received]:
    """The POSTs the server saw since `mark`, but the session's `notifications/initialized`: the SDK sends it from a
    background task after `initialize` returns, so it may land after the mark (it is not the request under test)."""
    settle([world.server])
    return [r for r in world.server.since(mark) if r.method == "POST" and not _initialized(r.body)]


def _initialized(body: bytes) -> bool:
    try:
        message = json.loads(body)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("method") == "notifications/initialized"


@pytest.mark.parametrize("answer", ANSWERS)
def test_allowed_call_carries_the_credential_the_client_never_sees(world, answer):
    mark, seen = world.proxy.mark(), world.server.mark()

    async def call(session):
        return await session.call_tool("get_issue", {"repo": "acme/app", "number": 7})

    result = _session(world, ANSWERS[answer], call)
    assert not result.isError and result.content[0].text == "issue 7 of acme/app: it works"
    shown = result.model_dump_json()
    world.proxy.record(shown.encode())
    assert_no_canary(shown, "the tool's result")
    calls = [r for r in world.server.since(seen) if b'"tools/call"' in r.body]
    assert len(calls) == 1 and calls[0].all("Authorization") == [BEARER]  # the edge attached the credential, once
    assert json.loads(calls[0].body)["params"] == {"name": "get_issue", "arguments": {"repo": "acme/app", "number": 7}}
    decided = world.proxy.decisions(mark)
    assert decided and all((e["decision"], e["rule"]) == ("allow", "mcp") for e in decided), decided


@pytest.mark.parametrize("answer", ANSWERS)
def test_tools_list_shows_only_the_tools_the_rule_allows(world, answer):
    seen = world.server.mark()

    async def listed(session):
        return await session.list_tools()

    tools = _session(world, ANSWERS[answer], listed)
    assert sorted(t.name for t in tools.tools) == list(ALLOWED_TOOLS)
    assert any(b'"tools/list"' in r.body for r in world.server.since(seen))  # the server was asked (and offered delete_repo)


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_tool_the_rule_does_not_list_is_refused_before_the_server_sees_it(world, answer):
    response, mark, seen = _call_refused(world, ANSWERS[answer], "delete_repo", {"repo": "acme/app"})
    assert_denied_answer(response.status_code, response.headers, response.read(), "mcp-tool-not-allowed")
    event = world.proxy.refused(mark, "mcp-tool-not-allowed")
    assert "delete_repo" in (event.get("detail") or ""), event
    assert _posts_since(world, seen) == [], "the server saw the refused call"


@pytest.mark.parametrize(
    ("arguments", "where"),
    [({"repo": "acme/other", "number": 7}, "$.repo"), ({"repo": "acme/app", "number": 1001}, "$.number"),
     ({"repo": "acme/app"}, "$.number"), ({"repo": "acme/app", "number": 7, "force": True}, "$.force")],
    ids=["repo-outside-enum", "number-over-maximum", "required-missing", "unlisted-key"],
)
def test_an_argument_outside_the_tool_is_refused(world, arguments, where):
    response, mark, seen = _call_refused(world, ANSWERS["json"], "get_issue", arguments)
    assert_denied_answer(response.status_code, response.headers, response.read(), "mcp-argument-refused")
    event = world.proxy.refused(mark, "mcp-argument-refused")
    assert where in (event.get("detail") or ""), event
    assert _posts_since(world, seen) == []


def test_search_pattern_and_length_hold(world):
    async def call(session):
        return await session.call_tool("search", {"q": "open bugs"})

    assert _session(world, ANSWERS["sse"], call).content[0].text == "results for open bugs"
    for q in ("Open", "a" * 21):
        response, mark, seen = _call_refused(world, ANSWERS["sse"], "search", {"q": q})
        assert_denied_answer(response.status_code, response.headers, response.read(), "mcp-argument-refused")
        world.proxy.refused(mark, "mcp-argument-refused")
        assert _posts_since(world, seen) == []


def _post(world, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    with world.proxy.client() as client:
        response = client.post(f"https://{MCP}{path}", content=body, headers=headers or JSON_RPC_HEADERS)
    world.proxy.record(response.content)
    return response


def _call(n: int, name: str, arguments: dict) -> dict:
    return {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def test_a_batch_with_one_refused_call_is_refused_whole(world):
    batch = [_call(1, "get_issue", {"repo": "acme/app", "number": 1}), _call(2, "delete_repo", {"repo": "acme/app"})]
    mark, seen = world.proxy.mark(), world.server.mark()
    response = _post(world, ANSWERS["sse"], json.dumps(batch).encode())
    assert_denied_answer(response.status_code, response.headers, response.content, "mcp-tool-not-allowed")
    event = world.proxy.refused(mark, "mcp-tool-not-allowed")
    assert "index=1" in (event.get("detail") or ""), event
    settle([world.server])
    assert world.server.since(seen) == [], "the server saw part of a refused batch"


@pytest.mark.parametrize(
    ("message", "reason"),
    [({"jsonrpc": "2.0", "id": 1, "method": "resources/list"}, "mcp-method-not-allowed"),
     ({"jsonrpc": "2.0", "id": 1, "method": "sampling/createMessage", "params": {}}, "mcp-method-not-allowed"),
     ({"jsonrpc": "2.0", "id": 1, "result": {}}, "mcp-method-not-allowed"),  # a response: the rule has no `responses`
     ({"id": 1, "method": "tools/list"}, "body-malformed")],  # not JSON-RPC 2.0
    ids=["resources-list", "sampling", "response", "not-json-rpc"],
)
def test_messages_the_rule_does_not_admit(world, message, reason):
    mark, seen = world.proxy.mark(), world.server.mark()
    response = _post(world, ANSWERS["sse"], json.dumps(message).encode())
    assert_denied_answer(response.status_code, response.headers, response.content, reason)
    world.proxy.refused(mark, reason)
    settle([world.server])
    assert world.server.since(seen) == []


def test_a_body_that_is_not_json_typed_is_refused(world):
    mark, seen = world.proxy.mark(), world.server.mark()
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
    response = _post(world, ANSWERS["sse"], body, {"Accept": JSON_RPC_HEADERS["Accept"], "Content-Type": "text/plain"})
    assert_denied_answer(response.status_code, response.headers, response.content, "content-type-mismatch")
    world.proxy.refused(mark, "content-type-mismatch")
    settle([world.server])
    assert world.server.since(seen) == []


def test_nothing_secret_reached_the_client_or_the_logs(world):
    # The module's last word before teardown (which scans the audit log, the logs and every answer kept too).
    assert CANARY not in world.proxy.logs.text()
    world.proxy.assert_nothing_leaked()
