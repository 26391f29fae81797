"""The response path with an answer filter (request shapes: an MCP `tools/list` answer cut to the rule's tools), through
the real in-process edge and the harness's TLS upstream: the upstream is asked for an uncoded answer, a coded one is
refused before its head goes out, and the filtered answer still goes through the credential scan.
"""

from __future__ import annotations

import json

import pytest

from compiler.artifact import Mcp, Param, Tool, Value
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    CANARY,
    ScriptedResolver,
    _issue,
    build_artifact,
    free_port,
    make_env,
    start_proxy,
    start_upstream,
    stop_proxy,
)
from tests.shapes.world import ShapesProxy

HOST = "api.acme-test.dev"
LIST = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """One MCP rule on api.acme-test.dev/leak (the harness upstream answers its paths whatever the body says)."""
    root = tmp_path_factory.mktemp("shaped-responses")
    rule = b.rule("tools", HOST, "/leak", ["POST"], ["accept", "accept-encoding", "content-type"]).model_copy(
        update={"mcp": Mcp(methods=("tools/call", "tools/list"), tools=(Tool(name="search", arguments=(Param(name="q", value=Value(max_length=20)),)),))})
    pki = _issue(root / "pki", (HOST,))
    upstream = start_upstream(pki)
    env = make_env(root / "edge", artifact=build_artifact(extra_rules=(rule,)))
    proxy = start_proxy(env, pki, (upstream,), [f"{HOST}:443:127.0.0.1:{upstream.port}"],
                        resolver=ScriptedResolver({HOST: [["93.184.216.34"]]}), listen=free_port(), proxy_class=ShapesProxy)
    proxy.upstream = upstream
    yield proxy
    stop_proxy(proxy)
    proxy.assert_nothing_leaked()


def _ask(edge, path: str):
    mark = edge.mark()
    with edge.client() as client:
        response = client.post(f"https://{HOST}{path}", content=LIST,
                               headers={"Content-Type": "application/json", "Accept-Encoding": "gzip, br"})
    edge.record(response.content)
    [seen] = edge.upstream.raw_requests()[mark[1][0][2]:]
    [decision] = [e for e in edge.settled(mark) if e["kind"] == "request"]
    return response, seen, decision


def test_a_coded_answer_to_a_filtered_request_is_refused(edge):
    response, seen, decision = _ask(edge, "/leak/plain/gzip")  # the upstream gzips whatever it was asked
    assert seen.all("Accept-Encoding") == ["identity"]  # asked for an uncoded answer, the client's choice replaced
    assert response.status_code == 502 and response.headers["x-egresslaw-deny"] == "response-coding-unsupported"
    assert json.loads(response.content)["reason"] == "response-coding-unsupported"
    assert (decision["decision"], decision["told"]) == ("allow", "response-coding-unsupported"), decision


def test_a_filtered_json_answer_is_still_scanned_for_the_credential(edge):
    response, seen, decision = _ask(edge, "/leak/plain/body")  # JSON echoing the credential
    assert response.status_code == 200 and decision["redactions"] >= 2, decision
    assert CANARY.encode() not in response.content and b"[REDACTED]" in response.content
    assert response.headers["content-length"] == str(len(response.content))
