"""The request path on its own: CONNECTs and request heads through the real shared admission, real lease keys, a real
artifact; the audit trail's `write_ahead` and `finish` are recorders (what the path asks of them is the point here).

Everything a denial looks like on the wire, through the addon and a real proxy, is test_addon.py's and
tests/conformance's; here, that the collaborator takes only what it is given and drives the trail in order.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from mitmproxy import http
from mitmproxy.test import tflow

from compiler.artifact import load_artifact
from egress_proxy.edge.attach import Attacher
from egress_proxy.edge.binding import LeaseBinding
from egress_proxy.edge.flows import Client
from egress_proxy.edge.limits import Limits
from egress_proxy.edge.requests import RequestPath
from egress_proxy.edge.upstreams import Upstreams
from egress_proxy.front.startup import Policy, load_lease_key_file
from tests.egress_proxy.conftest import make_env

PUBLIC = "93.184.216.34"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("requests"))


class Edge:
    """What the addon gives the request path, made of real parts, and a record of what it asked of the audit trail."""

    def __init__(self, env, policy=True):
        self.clients: dict[str, Client] = {}
        self.flows: dict = {}
        self.trail: list[tuple] = []
        self.policy = Policy(load_artifact(env.artifact.read_text()), True, str(env.artifact), (0, 0, 0)) if policy else None
        upstreams = Upstreams(clients=self.clients, flows=self.flows, limits=Limits(), own_addresses=set())
        binding = LeaseBinding(record=self.record, resolve=self.resolve, pin=upstreams.pin, clock=time.time)
        binding.lease_keys = load_lease_key_file(str(env.keys))
        attacher = Attacher(custody=lambda: None, resolve=self.resolve, dial=upstreams.dial, now=time.time, clock=time.time,
                            count=lambda *a: None, emit=lambda e: None)
        self.path = RequestPath(flows=self.flows, clients=self.clients, record=self.record, limits=Limits(),
                                policy=lambda: self.policy, clock=time.time, now=time.time, binding=binding, attacher=attacher,
                                write_ahead=self.write_ahead, finish=self.finish)

    def record(self, conn):
        return self.clients.setdefault(conn.id, Client(conn.id))

    async def resolve(self, host, port):
        return (PUBLIC,)

    async def write_ahead(self, flow, state, kind):
        self.trail.append(("write_ahead", kind, state.reason))

    def finish(self, flow, *, kind):
        self.trail.append(("finish", kind, self.flows.pop(flow.id).reason))


def _flow(url, method="GET", lease=None):
    f = tflow.tflow()
    f.client_conn.timestamp_end = None  # connected
    f.request = http.Request.make(method, url, b"")
    if lease:
        f.request.headers["Proxy-Authorization"] = f"Bearer {lease}"
    f.response = None
    f.error = None
    return f


def test_an_admitted_request_is_written_ahead_pinned_and_then_goes_on(env):
    edge = Edge(env)
    f = _flow("http://pkgs.acme-test.dev/simple/", lease=env.lease(profile="ci"))
    asyncio.run(edge.path.requestheaders(f))
    assert f.response is None and edge.trail == [("write_ahead", "request", "allowed")]
    assert edge.clients[f.client_conn.id].pins == {("pkgs.acme-test.dev", 80): (PUBLIC, 80)}
    assert edge.path.owns(f)
    asyncio.run(edge.path.request(f))
    assert f.response is None


def test_a_connect_records_its_tunnel_and_writes_its_event(env):
    edge = Edge(env)
    f = _flow("https://api.acme-test.dev:443/", "CONNECT", lease=env.lease(connection="github"))
    f.request.path = ""
    asyncio.run(edge.path.http_connect(f))
    assert f.response is None and edge.trail == [("write_ahead", "connect", "allowed"), ("finish", "connect", "allowed")]
    tunnel = edge.clients[f.client_conn.id].tunnel
    assert (tunnel.host, tunnel.port, tunnel.lease.connection, tunnel.ips) == ("api.acme-test.dev", 443, "github", (PUBLIC,))


def test_a_denial_writes_nothing_ahead(env):
    edge = Edge(env)
    refused = _flow("http://pkgs.acme-test.dev/", lease=env.lease(profile="ci"))
    edge.record(refused.client_conn).refused = "sni-mismatch"  # refused for good: before its lease is even read
    unleased = _flow("http://pkgs.acme-test.dev/")
    elsewhere = _flow("http://elsewhere.acme-test.dev/", lease=env.lease(profile="ci"))
    for f, reason, status in ((refused, "sni-mismatch", 403), (unleased, "lease-missing", 407),
                              (elsewhere, "profile-host-not-allowed", 403)):
        asyncio.run(edge.path.requestheaders(f))
        assert (f.response.status_code, f.response.headers["X-Egresslaw-Deny"]) == (status, reason)
    assert edge.trail == []  # the closing event of a denial is the response side's (`finish` at its end)


def test_without_a_policy_or_a_decision_nothing_goes_upstream(env):
    edge = Edge(env, policy=False)
    f = _flow("http://pkgs.acme-test.dev/", lease=env.lease(profile="ci"))
    asyncio.run(edge.path.requestheaders(f))
    assert f.response.headers["X-Egresslaw-Deny"] == "internal-error" and edge.trail == []
    undecided = _flow("http://pkgs.acme-test.dev/")  # requestheaders never saw it
    asyncio.run(edge.path.request(undecided))  # (async: a judged body is judged, and written ahead, in it)
    assert undecided.response.headers["X-Egresslaw-Deny"] == "internal-error" and edge.path.owns(undecided)


def test_the_layers_and_limits_callbacks_record_on_the_flow(env):
    edge = Edge(env)
    f = _flow("http://pkgs.acme-test.dev/simple/", lease=env.lease(profile="ci"))
    asyncio.run(edge.path.requestheaders(f))
    stranger = _flow("http://pkgs.acme-test.dev/")
    assert edge.path.refuse_mid_body(stranger, "body-too-large", 413) is None and not edge.path.owns(stranger)
    assert edge.path.protocol_error(stranger, None, True) is None
    edge.path.stalled(f)
    assert edge.flows[f.id].failure == "client-stalled"
    assert edge.path.protocol_error(f, "code", False, "response-too-large") == "client-stalled"  # the first failure stays
    answer = edge.path.refuse_mid_body(f, "body-too-large", 413)
    assert answer is f.response and (answer.status_code, edge.flows[f.id].reason) == (413, "body-too-large")


# -- request shapes: a body held whole and judged before anything goes upstream (through the real edge) --------------

MCP_HOST = "api.acme-test.dev"
JUDGED = 4096  # the shaped rule's max_body


@pytest.fixture(scope="module")
def shaped(tmp_path_factory):
    """The real in-process edge with one MCP rule (tools/list and tools/call of `search`; max_body 4 KiB) on
    api.acme-test.dev/mcp, in front of the harness's TLS upstream (it answers any POST with JSON)."""
    from compiler.artifact import Mcp, Param, Tool, Value  # Imported here: only the shaped fixtures need the artifact's shape models
    from tests.egress_proxy import builders as b
    from tests.proxy_harness import ScriptedResolver, _issue, build_artifact, free_port, start_proxy, start_upstream, stop_proxy
    from tests.proxy_harness import make_env as harness_env
    from tests.shapes.world import ShapesProxy

    root = tmp_path_factory.mktemp("shaped-requests")
    rule = b.rule("tools", MCP_HOST, "/mcp", ["POST"], ["accept", "content-type"]).model_copy(
        update={"mcp": Mcp(methods=("tools/call", "tools/list"), tools=(Tool(name="search", arguments=(Param(name="q", value=Value(max_length=20)),)),)), "max_body": JUDGED})
    pki = _issue(root / "pki", (MCP_HOST,))
    upstream = start_upstream(pki)
    env = harness_env(root / "edge", artifact=build_artifact(extra_rules=(rule,)))
    proxy = start_proxy(env, pki, (upstream,), [f"{MCP_HOST}:443:127.0.0.1:{upstream.port}"],
                        resolver=ScriptedResolver({MCP_HOST: [[PUBLIC]]}), listen=free_port(), proxy_class=ShapesProxy)
    proxy.upstream = upstream
    yield proxy
    stop_proxy(proxy)
    proxy.assert_nothing_leaked()


def _raw(proxy, extra: list[str], body: bytes = b"") -> bytes:
    lines = [f"POST https://{MCP_HOST}/mcp HTTP/1.1", f"Host: {MCP_HOST}", "Content-Type: application/json", *extra,
             f"Proxy-Authorization: Bearer {proxy.lease(connection='github')}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _call(tool: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": tool, "arguments": {}}}).encode()


def _chunked(body: bytes, size: int = 100) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)) + b"0\r\n\r\n"


def _requests(proxy, mark) -> list[dict]:
    return [e for e in proxy.new_events(mark) if e["kind"] == "request"]


def _seen(proxy, mark) -> list:
    return proxy.upstream.raw_requests()[mark[1][0][2]:]


def test_expect_continue_invites_a_judged_body_which_goes_up_with_its_credential(shaped):
    from tests.conformance.wire import open_socket, read_answer  # Imported here: the raw-socket helpers of the wire tests
    from tests.proxy_harness import CANARY

    body = _call("search")
    mark = shaped.mark()
    with open_socket(shaped.host, shaped.port, timeout=30) as sock:
        sock.sendall(_raw(shaped, ["Expect: 100-continue", f"Content-Length: {len(body)}"]))
        interim = b""
        while b"\r\n\r\n" not in interim:
            got = sock.recv(1)
            assert got, interim
            interim += got
        assert interim.startswith(b"HTTP/1.1 100"), interim
        sock.sendall(body)
        answer = read_answer(sock, "POST")
    shaped.record(answer.raw)
    assert answer.status == 200, answer
    [seen] = _seen(shaped, mark)
    assert seen.body == body and seen.all("Authorization") == [f"Bearer {CANARY}"] and seen.all("Expect") == []
    assert [(e["decision"], e["rule"]) for e in _requests(shaped, mark)] == [("allow", "tools")]


def test_a_declared_length_over_max_body_is_refused_unread_and_never_invited(shaped):
    from tests.conformance.wire import open_socket, read_answer  # Imported here: the raw-socket helpers of the wire tests

    mark = shaped.mark()
    with open_socket(shaped.host, shaped.port, timeout=30) as sock:
        sock.sendall(_raw(shaped, ["Expect: 100-continue", f"Content-Length: {JUDGED + 1}"]))
        answer = read_answer(sock, "POST")  # http.client would skip a 100: the raw answer shows there was none
    shaped.record(answer.raw)
    assert answer.status == 413 and b" 100 " not in answer.raw.split(b"\r\n", 1)[0]
    assert ("x-egresslaw-deny", "body-too-large-to-judge") in [(k.lower(), v) for k, v in answer.headers]
    [event] = _requests(shaped, mark)
    assert (event["decision"], event["reason"]) == ("deny", "body-too-large-to-judge") and "4096" in event["detail"], event
    assert _seen(shaped, mark) == []


def test_a_chunked_body_is_held_judged_and_sent_with_its_length(shaped):
    from tests.conformance.wire import open_socket, read_answer  # Imported here: the raw-socket helpers of the wire tests

    body = _call("search")
    mark = shaped.mark()
    with open_socket(shaped.host, shaped.port, timeout=30) as sock:
        sock.sendall(_raw(shaped, ["Transfer-Encoding: chunked"], _chunked(body)))
        answer = read_answer(sock, "POST")
    assert answer.status == 200, answer
    [seen] = _seen(shaped, mark)
    assert seen.body == body and seen.all("Content-Length") == [str(len(body))] and seen.all("Transfer-Encoding") == []


def test_a_chunked_body_growing_past_max_body_is_cut_and_refused_once(shaped):
    from tests.conformance.wire import open_socket, read_answer  # Imported here: the raw-socket helpers of the wire tests

    mark = shaped.mark()
    with open_socket(shaped.host, shaped.port, timeout=30) as sock:
        sock.sendall(_raw(shaped, ["Transfer-Encoding: chunked"], _chunked(b" " * (JUDGED + 1) + _call("search"))))
        answer = read_answer(sock, "POST")
    shaped.record(answer.raw)
    assert answer.status == 413 and ("x-egresslaw-deny", "body-too-large-to-judge") in [(k.lower(), v) for k, v in answer.headers]
    [event] = _requests(shaped, mark)
    assert (event["decision"], event["reason"]) == ("deny", "body-too-large-to-judge"), event
    assert _seen(shaped, mark) == []


def test_a_refused_body_is_a_denial_naming_its_place_and_nothing_goes_up(shaped):
    with shaped.client() as client:
        response = client.post(f"https://{MCP_HOST}/mcp", content=_call("delete_repo"), headers={"Content-Type": "application/json"})
    shaped.record(response.content)
    assert response.status_code == 403 and response.headers["x-egresslaw-deny"] == "mcp-tool-not-allowed"
    assert json.loads(response.content)["reason"] == "mcp-tool-not-allowed"
    events = [e for e in shaped.events() if e["kind"] == "request" and e["reason"] == "mcp-tool-not-allowed"]
    assert [e["detail"] for e in events] == ["rule `tools`: tool=delete_repo"], events
    assert not any(b"delete_repo" in s.body for s in shaped.upstream.raw_requests())
