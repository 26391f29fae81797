"""Hostile bodies and answers against the MCP rule, through the real edge with raw sockets and httpx: a 100 MiB body, a
10,000-deep nesting, duplicate keys, a chunked body that stalls, and SSE answers to `tools/list` that never end or
carry one event over 1 MiB. Each: its reason, exactly one audit event, nothing upstream where nothing may go, and
memory measured (the process's peak resident set, reset before: the edge runs in this process), never timed.

The module's edge takes bodies up to 128 MiB (`max_body`), so the edge-wide body limit (64 MiB by default) never
answers first: what refuses the 100 MiB body here is the rule's own `max_body` (1 MiB), `body-too-large-to-judge`.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conformance.wire import open_socket, read_answer
from tests.proxy_harness import TEST_WORKERS, wait_for
from tests.shapes import servers
from tests.shapes.world import ALLOWED_TOOLS, MCP, assert_denied_answer, serving, settle

pytestmark = pytest.mark.slow

MiB = 1024 * 1024
HUNDRED_MIB = 100 * MiB
HEADROOM = 24 * MiB  # what the process's peak may grow by while 100 MiB (or 48 MiB of an endless stream) goes through (a streaming edge: ~0)
STREAMED = 48 * MiB  # what the client reads of the endless stream before it leaves
JSON_RPC = ["Accept: application/json, text/event-stream", "Content-Type: application/json"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("shapes-hostile"), MCP, servers.start_mcp, ("mcp",), config={"max_body": 128 * MiB}) as world:
        yield world


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@contextlib.contextmanager
def peak_growth():
    """Yields a dict whose `bytes` is, after the block, how far this process's peak resident set rose above where it
    stood when the block began (the peak is reset first: /proc/self/clear_refs)."""
    if TEST_WORKERS > 1:
        pytest.skip("measures the in-process edge's memory; EGRESSLAW_TEST_WORKERS runs the edge in child processes")
    Path("/proc/self/clear_refs").write_text("5")
    start = _kib("VmRSS")
    out = {"bytes": None}
    yield out
    out["bytes"] = (_kib("VmHWM") - start) * 1024


def _head(world, method: str, path: str, extra: list[str]) -> bytes:
    lines = [f"{method} https://{MCP}{path} HTTP/1.1", f"Host: {MCP}", *JSON_RPC, *extra,
             f"Proxy-Authorization: Bearer {world.proxy.lease(connection='github')}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _send_until_answered(sock: socket.socket, blocks, limit: int) -> int:
    """Send `blocks` until `limit` bytes went out, the edge answered (readable) or cut the connection; bytes sent."""
    sent = 0
    for block in blocks:
        if sent >= limit or select.select([sock], [], [], 0)[0]:
            break
        try:
            sock.sendall(block)
        except OSError:
            break
        sent += len(block)
    return sent


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_100_mib_body_is_refused_without_being_held(world, framing):
    block = b" " * (64 * 1024)  # JSON whitespace: a body that would parse if it were ever read whole
    chunk = b"%x\r\n%s\r\n" % (len(block), block)
    extra = [f"Content-Length: {HUNDRED_MIB}"] if framing == "content-length" else ["Transfer-Encoding: chunked"]
    mark, seen = world.proxy.mark(), world.server.mark()
    with peak_growth() as growth, open_socket(world.proxy.host, world.proxy.port, timeout=60) as sock:
        sock.sendall(_head(world, "POST", "/sse/mcp", extra))
        blocks = (block if framing == "content-length" else chunk for _ in range(HUNDRED_MIB // len(block)))
        sent = _send_until_answered(sock, blocks, HUNDRED_MIB)
        answer = read_answer(sock, "POST")
    world.proxy.record(answer.raw)
    assert_denied_answer(answer.status, answer.headers, answer.body, "body-too-large-to-judge")
    world.proxy.refused(mark, "body-too-large-to-judge")
    settle([world.server])
    assert world.server.since(seen) == [], "the server saw part of a body too large to judge"
    assert growth["bytes"] < HEADROOM, f"the process's peak grew {growth['bytes'] // MiB} MiB while {sent // MiB} MiB were sent"


def _post(world, body: bytes) -> httpx.Response:
    with world.proxy.client() as client:
        response = client.post(f"https://{MCP}/sse/mcp", content=body,
                               headers={"Accept": "application/json, text/event-stream", "Content-Type": "application/json"})
    world.proxy.record(response.content)
    return response


@pytest.mark.parametrize(
    "body",
    [b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "search", "arguments": {"q": '
     + b"[" * 10_000 + b"]" * 10_000 + b"}}}",
     b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "method": "tools/call", "params": {"name": "delete_repo"}}',
     b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "get_issue", "arguments": '
     b'{"repo": "acme/app", "number": 1, "repo": "acme/other"}}}',
     b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list", "x": "\xff"}'],
    ids=["nesting-10000-deep", "duplicate-method", "duplicate-argument", "invalid-utf8"],
)
def test_a_body_that_does_not_read_one_way_is_malformed(world, body):
    mark, seen = world.proxy.mark(), world.server.mark()
    response = _post(world, body)
    assert_denied_answer(response.status_code, response.headers, response.content, "body-malformed")
    world.proxy.refused(mark, "body-malformed")
    settle([world.server])
    assert world.server.since(seen) == []


@pytest.fixture
def short_idle_timeout(world):
    """mitmproxy's `tcp_timeout` (the edge's idle timeout) is read when a connection is accepted: 3 s for this test's."""
    options = world.proxy.threaded.edge.master.options
    old = options.tcp_timeout
    world.proxy.threaded.call(lambda: options.update(tcp_timeout=3))
    yield
    world.proxy.threaded.call(lambda: options.update(tcp_timeout=old))


def test_a_chunked_body_that_stalls_is_cut_and_never_forwarded(world, short_idle_timeout):
    # The idle timeout closes the connection while the body waits to be judged: `client-disconnected` (the request never
    # came whole; nothing went upstream, so never `upstream-error`).
    mark, seen = world.proxy.mark(), world.server.mark()
    with open_socket(world.proxy.host, world.proxy.port, timeout=90) as sock:
        sock.sendall(_head(world, "POST", "/sse/mcp", ["Transfer-Encoding: chunked"]) + b'10\r\n{"jsonrpc": "2.0"\r\n')
        answer = read_answer(sock, "POST")  # whatever the edge says (or nothing) once it gives up on the body
        world.proxy.record(answer.raw)
    assert answer.status is None or 400 <= answer.status < 500 or answer.status == 408, answer
    assert wait_for(lambda: world.proxy.decisions(mark), 30), "no audit event for the stalled request"
    settle([world.server])
    decided = world.proxy.decisions(mark)
    assert [(e["decision"], e["reason"]) for e in decided] == [("deny", "client-disconnected")], decided
    assert world.server.since(seen) == [], "the server saw a request whose body never came"


def _events(lines: Iterable[str]) -> Iterator[str]:
    """SSE events (their joined `data`) from an iterator of lines."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


def _ask_tools(n: int = 1) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": n, "method": "tools/list"}).encode()


def test_an_endless_sse_answer_to_tools_list_is_filtered_as_it_comes_in_bounded_memory(world):
    mark = world.proxy.mark()
    received, answer, notes = 0, None, 0
    with peak_growth() as growth, world.proxy.client() as client:
        with client.stream("POST", f"https://{MCP}/endless/mcp", content=_ask_tools(),
                           headers={"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            for event in _events(response.iter_lines()):
                received += len(event)
                message = json.loads(event)
                if "result" in message:
                    answer = message
                else:
                    notes += 1
                if answer is not None and received > STREAMED:
                    break  # 64 MiB went through a stream that never ends: the client leaves
    assert growth["bytes"] < HEADROOM, f"the process's peak grew {growth['bytes'] // MiB} MiB over a {received // MiB} MiB stream"
    assert answer is not None and sorted(t["name"] for t in answer["result"]["tools"]) == list(ALLOWED_TOOLS), answer
    assert notes > servers.ENDLESS_BEFORE  # the events before the answer and after it came through as they came
    decided = world.proxy.decisions(mark)
    assert [(e["decision"], e["rule"]) for e in decided] == [("allow", "mcp")], decided


def test_an_sse_event_over_1_mib_cuts_the_stream(world):
    mark = world.proxy.mark()
    events, got = [], 0
    with world.proxy.client() as client:
        with contextlib.suppress(httpx.HTTPError):  # the cut: the stream ends early or breaks
            with client.stream("POST", f"https://{MCP}/huge/mcp", content=_ask_tools(),
                               headers={"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}) as response:
                assert response.status_code == 200
                for chunk in response.iter_bytes():
                    got += len(chunk)
                    events.append(chunk)
    shown = b"".join(events)
    world.proxy.record(shown)
    parsed = [json.loads(e) for e in _events(shown.decode(errors="replace").replace("\r\n", "\n").split("\n")) if e.startswith("{")]
    complete = [m for m in parsed if "params" in m or "result" in m]
    assert [m["params"]["data"]["n"] for m in complete if "params" in m] == [0], "the client got an event past the limit"
    assert not any("result" in m for m in complete), "the answer after the oversized event came through"
    assert got < 2 * MiB, f"{got} bytes reached the client: the oversized event was not cut"
    [decision] = [e for e in world.proxy.settled(mark) if e["kind"] == "request"]  # (its CONNECT is decided too)
    assert (decision["decision"], decision["told"]) == ("allow", "response-event-too-large"), decision
