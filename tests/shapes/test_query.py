"""Query shapes through the real edge, raw bytes on the wire: under a declared `query`, a present empty query (`?`)
and an empty `&` component (leading, trailing, doubled) are refused 403 `query-parameter-not-allowed`, one audit
event each, and nothing reaches the upstream; the exact target and the listed pairs still go through, as written.

The edge forwards the target as the client wrote it, so `/x?` or `/y?a=1&&b=2` would be other requests upstream than
`/x` and `/y?a=1&b=2`: a channel no shape would show (docs/budget.md, "Capacity"). Requests are sent inside a CONNECT
tunnel in origin form (the target reaches the edge byte for byte) and in absolute form on the proxy port.
"""

from __future__ import annotations

import pytest

from compiler.artifact import Param, Segment, Value
from tests.conformance.wire import Answer, open_socket, read_answer, tls_client
from tests.egress_proxy import builders as b
from tests.proxy_harness import ScriptedResolver, build_artifact, free_port, make_env, start_proxy
from tests.shapes import servers
from tests.shapes.world import GRAPHQL, PUBLIC, ShapesProxy, World, assert_denied_answer, close_world, settle, shapes_pki

pytestmark = pytest.mark.slow

INT = Value(type="integer", minimum=0, maximum=9)


def query_rules():
    """`/x` with `query = {}`; `/y` with two listed integer parameters (on the GraphQL stand-in's name: it records
    every request, whatever its path)."""
    bare = b.rule("bare", GRAPHQL, "/x", ["GET"], []).model_copy(update={"template": (Segment(literal="x"),), "query": ()})
    listed = b.rule("listed", GRAPHQL, "/y", ["GET"], []).model_copy(
        update={"template": (Segment(literal="y"),), "query": (Param(name="a", value=INT), Param(name="b", value=INT))})
    return bare, listed


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes-query")
    pki = shapes_pki(root / "pki")
    server = servers.start_graphql(pki.cert_pem, pki.key_pem)
    env = make_env(root / "edge", artifact=build_artifact(extra_rules=query_rules()))
    resolver = ScriptedResolver({name: [[ip]] for name, ip in PUBLIC.items()})
    proxy = start_proxy(env, pki, (), [f"{GRAPHQL}:443:127.0.0.1:{server.port}"], resolver=resolver, listen=free_port(),
                        proxy_class=ShapesProxy)
    world = World(root, pki, proxy)
    world.server = server
    yield world
    try:
        close_world(world)
    finally:
        server.stop()


def _lease(world) -> str:
    return f"Proxy-Authorization: Bearer {world.proxy.lease(connection='github')}"


def _tunnelled(world, target: str) -> Answer:
    """`GET target` in origin form inside a CONNECT tunnel to the stand-in's name, the edge's CA trusted."""
    with open_socket(world.proxy.host, world.proxy.port, timeout=30) as sock:
        sock.sendall(f"CONNECT {GRAPHQL}:443 HTTP/1.1\r\nHost: {GRAPHQL}:443\r\n{_lease(world)}\r\n\r\n".encode())
        connected = read_answer(sock, "CONNECT")
        assert connected.status == 200, connected
        with tls_client(sock, world.proxy.ca, GRAPHQL) as tls:
            tls.sendall(f"GET {target} HTTP/1.1\r\nHost: {GRAPHQL}\r\nConnection: close\r\n\r\n".encode())
            return read_answer(tls, "GET")


def _absolute(world, target: str) -> Answer:
    """`GET https://name{target}` in absolute form on the proxy port."""
    with open_socket(world.proxy.host, world.proxy.port, timeout=30) as sock:
        sock.sendall(f"GET https://{GRAPHQL}{target} HTTP/1.1\r\nHost: {GRAPHQL}\r\n{_lease(world)}\r\nConnection: close\r\n\r\n".encode())
        return read_answer(sock, "GET")


SEND = {"tunnel": _tunnelled, "absolute": _absolute}


@pytest.mark.parametrize("form", ["tunnel", "absolute"])
@pytest.mark.parametrize("target, where", [
    ("/x?", "rule `bare`: an empty query"),
    ("/x?&", "rule `bare`: an empty parameter at position 1"),
    ("/x?&&&", "rule `bare`: an empty parameter at position 1"),
    ("/x?a=1", "rule `bare`: name=a"),
    ("/y?&a=1", "rule `listed`: an empty parameter at position 1"),
    ("/y?a=1&", "rule `listed`: an empty parameter at position 2"),
    ("/y?a=1&&b=2", "rule `listed`: an empty parameter at position 2"),
    ("/y?&", "rule `listed`: an empty parameter at position 1"),
    ("/y?", "rule `listed`: an empty query"),
])
def test_a_place_without_a_parameter_is_refused_and_nothing_goes_upstream(world, form, target, where):
    mark, seen = world.proxy.mark(), world.server.mark()
    answer = SEND[form](world, target)
    world.proxy.record(answer.raw)
    assert answer.status == 403, answer
    assert_denied_answer(answer.status, answer.headers, answer.body, "query-parameter-not-allowed")
    denial = world.proxy.refused(mark, "query-parameter-not-allowed")
    assert denial["detail"] == where, denial
    settle([world.server])
    assert world.server.since(seen) == [], f"{target} reached the upstream"


@pytest.mark.parametrize("form", ["tunnel", "absolute"])
@pytest.mark.parametrize("target", ["/x", "/y", "/y?a=1&b=2", "/y?b=2", "/y?a=1"])
def test_the_exact_target_and_the_listed_pairs_go_through_as_written(world, form, target):
    seen = world.server.mark()
    answer = SEND[form](world, target)
    world.proxy.record(answer.raw)
    assert answer.status == 200, answer
    [arrived] = world.server.since(seen)
    assert (arrived.method, arrived.path) == ("GET", target)

