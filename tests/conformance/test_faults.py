"""Faults: every failing part denies (or fails cleanly), is audited, leaks nothing, and the proxy keeps
serving: after each fault a good request is sent and must be allowed with exactly one credential.

One proxy for the module (its own upstreams), started with a small inactivity timeout so a hanging
upstream is cut quickly. Faults are injected with real parts: a closed port, an upstream that resets,
hangs or answers garbage, a scripted resolver that raises or stalls, a second SQLite writer, a custody
record whose ciphertext is flipped, an artifact file replaced by garbage, and failing objects swapped
into the running addon (custody, clock).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import time

import pytest

from tests.conformance.conftest import launch, resolver_for_corpus
from tests.conformance.wire import Answer, open_socket, read_answer, tls_client
from tests.proxy_harness import (
    CANARY,
    assert_no_canary,
    needs_sqlite_store,
    stop_proxy,
    wait_for,
)

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"
TCP_TIMEOUT = 2  # seconds of inactivity before mitmproxy closes a connection (a hanging upstream)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream):
    # refused.acme-test.dev is routed to a port nobody listens on.
    resolver = resolver_for_corpus()
    resolver.table["refused.acme-test.dev"] = [["93.184.216.60"]]
    # A port bound and never listened on: connecting is refused, and no other process (xdist runs other proxies and
    # upstreams beside this one) can take it while the module runs, as it could a port found free and let go.
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    try:
        p = launch(tmp_path_factory, pki, tls_upstream, http_upstream, name="faults", extra_options={"tcp_timeout": TCP_TIMEOUT},
                   resolver=resolver, tls_to={"refused.acme-test.dev": refused.getsockname()[1]})
        yield p
        try:
            p.assert_nothing_leaked()
        finally:
            stop_proxy(p)
    finally:
        refused.close()


def absolute(proxy, path: str, host: str = API, lease: str | None = "GH", timeout: float = 10) -> Answer:
    token = proxy.lease(connection="github") if lease == "GH" else proxy.lease(profile="ci") if lease == "CI" else None
    wire = f"GET https://{host}{path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer client-fault\r\n"
    if token:
        wire += f"Proxy-Authorization: Bearer {token}\r\n"
    with open_socket(proxy.host, proxy.port, timeout) as sock:
        sock.sendall(wire.encode() + b"\r\n")
        answer = read_answer(sock)
    proxy.record(answer.raw)
    return answer


def tunnel(proxy, path: str, timeout: float = 10) -> Answer:
    token = proxy.lease(connection="github")
    sock = open_socket(proxy.host, proxy.port, timeout)
    sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {token}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    with tls_client(sock, proxy.ca, API) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {API}\r\nAuthorization: Bearer client-fault\r\n\r\n".encode())
        answer = read_answer(tls)
    proxy.record(answer.raw)
    return answer


def request_events(proxy, mark) -> list[dict]:
    """The requests decided since `mark`, each with its outcome folded in (`told`: what the client was told)."""
    return [e for e in proxy.settled(mark) if e["kind"] == "request"]


def still_serving(proxy, tls_upstream) -> None:
    """A good request after the fault: allowed, exactly one credential, audited."""
    mark = proxy.mark()
    answer = absolute(proxy, "/repos/acme/after-fault")
    assert answer.status == 200, answer
    seen = tls_upstream.raw_requests()[-1]
    assert seen.path == "/repos/acme/after-fault" and seen.all("Authorization") == [f"Bearer {CANARY}"]
    assert wait_for(lambda: [(e["reason"], e["failure"]) for e in request_events(proxy, mark)] == [("allowed", None)])


def only_request_event(proxy, mark) -> dict:
    assert wait_for(lambda: len(request_events(proxy, mark)) == 1), proxy.new_events(mark)
    events = request_events(proxy, mark)
    assert len(events) == 1, events
    return events[0]


def test_upstream_refuses_the_connection(proxy, tls_upstream):
    mark = proxy.mark()
    answer = absolute(proxy, "/", host="refused.acme-test.dev")
    assert answer.status == 502, answer
    assert json.loads(answer.body) == {"error": "upstream_error", "reason": "upstream-error"}  # ours, not mitmproxy's page
    event = only_request_event(proxy, mark)
    # Allowed (and written ahead), then the upstream failed: the outcome says so, and what the client got (our 502).
    assert (event["decision"], event["reason"], event["failure"], event["status"]) == ("allow", "allowed", "upstream-error", 502)
    still_serving(proxy, tls_upstream)


@pytest.mark.parametrize("transport", [absolute, tunnel])
def test_upstream_resets_mid_body(proxy, tls_upstream, transport):
    mark = proxy.mark()
    answer = transport(proxy, "/fault/reset")
    # Connection traffic streams: the head went out, then the client connection is cut (never a clean end);
    # the 10 bytes that arrived were still held back by the scan window.
    assert answer.status is None and "IncompleteRead" in (answer.error or ""), answer
    assert b"0123456789" not in answer.raw
    event = only_request_event(proxy, mark)  # it reached the upstream with the credential: an allow, then a failure
    assert (event["decision"], event["reason"], event["rule"], event["failure"]) == ("allow", "allowed", "fault", "upstream-error")
    assert (event["status"], event["outcome"]["aborted"]) == (200, True)  # the client got the head and a cut body
    still_serving(proxy, tls_upstream)


def test_upstream_hangs_until_the_timeout(proxy, tls_upstream):
    mark = proxy.mark()
    started = time.time()
    answer = absolute(proxy, "/fault/hang", timeout=TCP_TIMEOUT + 40)
    # The upstream hangs for 60 s: the proxy's inactivity timeout (2 s) cut it, with room for a loaded machine.
    assert time.time() - started < TCP_TIMEOUT + 28
    assert answer.status in (502, 504, None), answer
    event = only_request_event(proxy, mark)
    assert (event["decision"], event["failure"]) == ("allow", "upstream-error"), event
    assert event["status"] == answer.status
    still_serving(proxy, tls_upstream)


@pytest.mark.parametrize("path", ["/fault/garbage", "/fault/close"])
def test_upstream_answers_garbage_or_nothing(proxy, tls_upstream, path):
    mark = proxy.mark()
    answer = absolute(proxy, path)
    assert answer.status == 502, answer
    assert json.loads(answer.body) == {"error": "upstream_error", "reason": "upstream-error"}
    event = only_request_event(proxy, mark)
    assert (event["decision"], event["failure"], event["status"]) == ("allow", "upstream-error", 502)
    still_serving(proxy, tls_upstream)


@pytest.mark.parametrize("code", [500, 502, 503, 504])
def test_upstream_5xx_is_passed_back_and_audited(proxy, tls_upstream, code):
    mark = proxy.mark()
    answer = absolute(proxy, f"/status/{code}")
    assert answer.status == code and json.loads(answer.body) == {"status": code}
    event = only_request_event(proxy, mark)
    assert (event["decision"], event["reason"], event["status"]) == ("allow", "allowed", code)
    still_serving(proxy, tls_upstream)


class Boom(Exception):
    pass


@pytest.mark.parametrize("failure", [OSError("nxdomain"), Boom("resolver bug"), RuntimeError("x"), []])
def test_resolver_failure_denies(proxy, tls_upstream, failure):
    proxy.resolver.table["broken.acme-test.dev"] = [failure] if not isinstance(failure, list) else [failure]
    with proxy.resolver.lock:
        proxy.resolver.calls["broken.acme-test.dev"] = 0
    mark = proxy.mark()
    answer = absolute(proxy, "/", host="broken.acme-test.dev")
    assert answer.status == 403 and answer.header("x-egresslaw-deny") == "resolve-failed", answer
    assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
    assert only_request_event(proxy, mark)["reason"] == "resolve-failed"
    still_serving(proxy, tls_upstream)


def test_resolver_that_hangs_times_out_and_denies(proxy, tls_upstream):
    proxy.resolver.table["slow.acme-test.dev"] = [["93.184.216.61"]]
    proxy.resolver.delay["slow.acme-test.dev"] = 60
    old = proxy.addon.resolve_timeout
    proxy.addon.resolve_timeout = 0.5
    try:
        mark = proxy.mark()
        started = time.time()
        answer = absolute(proxy, "/", host="slow.acme-test.dev", timeout=40)
        assert time.time() - started < 30  # the resolve timeout fired: the resolver would answer only after 60 s
        assert answer.status == 403 and answer.header("x-egresslaw-deny") == "resolve-failed", answer
        assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
        assert only_request_event(proxy, mark)["reason"] == "resolve-failed"
        still_serving(proxy, tls_upstream)
    finally:
        proxy.addon.resolve_timeout = old


def test_custody_store_write_locked_by_another_process_still_serves(proxy, tls_upstream):
    # WAL mode: a writer holding the lock (e.g. a `custody put` or `rotate` in flight) does not block reads.
    needs_sqlite_store(proxy.env)
    other = sqlite3.connect(proxy.env.store, isolation_level=None, timeout=1)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("UPDATE records SET sealed = zeroblob(length(sealed))")  # uncommitted: never seen by readers
        still_serving(proxy, tls_upstream)
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_custody_record_corrupt_denies(proxy, tls_upstream):
    needs_sqlite_store(proxy.env)
    db = sqlite3.connect(proxy.env.store, isolation_level=None, timeout=5)
    (original,) = db.execute("SELECT sealed FROM records").fetchone()
    flipped = bytes([original[0] ^ 0x01]) + original[1:]
    try:
        db.execute("UPDATE records SET sealed = ?", (flipped,))
        mark = proxy.mark()
        answer = absolute(proxy, "/repos/acme/corrupt")
        # A record that does not open is named as such (the log names its address), not an internal error.
        assert answer.status == 403 and answer.header("x-egresslaw-deny") == "credential-unavailable", answer
        assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
        assert only_request_event(proxy, mark)["told"] == "credential-unavailable"
        # Sandbox traffic needs no credential and is unaffected.
        assert absolute(proxy, "/repos/acme/x", lease="CI").status == 200
    finally:
        db.execute("UPDATE records SET sealed = ?", (original,))
        db.close()
    still_serving(proxy, tls_upstream)


def test_custody_store_file_corrupt_denies(proxy, tls_upstream, tmp_path):
    # A store whose file is garbage: the running proxy's open() fails, it denies, and recovers once the file is back.
    from egress_proxy.custody.sqlite import CustodyStore

    broken = tmp_path / "broken.db"
    broken.write_bytes(b"SQLite format 3\x00" + b"\xff" * 8192)
    live = proxy.addon.custody
    try:
        proxy.addon.custody = CustodyStore.__new__(CustodyStore)
        proxy.addon.custody.__dict__.update(live.__dict__)
        proxy.addon.custody._db = sqlite3.connect(broken, isolation_level=None, check_same_thread=False)
        mark = proxy.mark()
        answer = absolute(proxy, "/repos/acme/corrupt-file")
        assert answer.status == 403 and answer.header("x-egresslaw-deny") == "internal-error", answer
        assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
        assert only_request_event(proxy, mark)["told"] == "internal-error"
    finally:
        proxy.addon.custody = live
    still_serving(proxy, tls_upstream)


def test_artifact_replaced_by_a_corrupt_file_keeps_the_old_one_serving(proxy, tls_upstream):
    original = proxy.env.artifact.read_bytes()
    metrics = proxy.threaded.edge.metrics
    failed = metrics.reloads.get("failed", 0)
    mark = proxy.mark()
    try:
        proxy.env.artifact.write_bytes(original[: len(original) // 2] + b"\x00garbage")
        assert wait_for(lambda: metrics.reloads.get("failed", 0) > failed)
        still_serving(proxy, tls_upstream)
        denied = absolute(proxy, "/admin")
        assert denied.status == 403 and denied.header("x-egresslaw-deny") == "path-not-allowed"
    finally:
        proxy.env.artifact.write_bytes(original)
        assert wait_for(lambda: metrics.reloads.get("ok", 0) >= 1)
    reloads = [e for e in proxy.new_events(mark) if e["kind"] == "reload"]
    assert reloads[0]["decision"] == "deny" and reloads[0]["reason"] == "reload-failed"
    assert reloads[-1]["decision"] == "allow"
    still_serving(proxy, tls_upstream)


class FailingCustody:
    def open(self, address):
        raise RuntimeError(f"custody exploded near {CANARY}")  # the message must never surface


def test_addon_raising_in_custody_denies(proxy, tls_upstream):
    live = proxy.addon.custody
    proxy.addon.custody = FailingCustody()
    try:
        mark = proxy.mark()
        answer = absolute(proxy, "/repos/acme/boom")
        assert answer.status == 403 and answer.header("x-egresslaw-deny") == "internal-error", answer
        assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
        assert only_request_event(proxy, mark)["told"] == "internal-error"
        answer = tunnel(proxy, "/repos/acme/boom")
        assert answer.status == 403 and answer.header("x-egresslaw-deny") == "internal-error", answer
    finally:
        proxy.addon.custody = live
    assert_no_canary(proxy.logs.text(), "the proxy logs")
    still_serving(proxy, tls_upstream)


class FailingClock:
    """A clock that works for `ok` calls, then raises."""

    def __init__(self, ok: int) -> None:
        self.left = ok

    def __call__(self) -> float:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("clock failure")
        return time.time()


@pytest.mark.parametrize("ok", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("transport", [absolute, tunnel])
def test_addon_raising_in_the_clock_never_forwards(proxy, tls_upstream, http_upstream, ok, transport):
    mark = proxy.mark()
    proxy.addon.clock = FailingClock(ok if transport is absolute else ok + 2)
    try:
        try:
            answer = transport(proxy, "/repos/acme/clock", timeout=5)
        except (AssertionError, OSError):
            answer = Answer(None)  # the CONNECT itself was refused
    finally:
        proxy.addon.clock = time.time
    seen = [s for s in tls_upstream.raw_requests() if s.path == "/repos/acme/clock"]
    if answer.status == 200:
        # Allowed only if every step ran: then exactly one credential, as always.
        assert seen and seen[-1].all("Authorization") == [f"Bearer {CANARY}"]
    else:
        assert answer.status in (403, 407, 502, None), answer
        assert not any(s.all("Authorization") == ["Bearer client-fault"] for s in seen), "undecided request forwarded"
        assert proxy.upstream_delta(mark)[0][2] == 0, "a request reached the upstream without a decision"
    still_serving(proxy, tls_upstream)


def test_a_failing_resolver_object_denies(proxy, tls_upstream):
    class Exploding:
        async def __call__(self, host, port):
            await asyncio.sleep(0)
            raise ZeroDivisionError("resolver object bug")

    live = proxy.addon._resolver
    proxy.addon._resolver = Exploding()
    try:
        mark = proxy.mark()
        answer = absolute(proxy, "/", host="other.acme-test.dev")
        assert answer.status == 403 and answer.header("x-egresslaw-deny") == "resolve-failed", answer
        assert proxy.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]
        assert only_request_event(proxy, mark)["reason"] == "resolve-failed"
    finally:
        proxy.addon._resolver = live
    still_serving(proxy, tls_upstream)
