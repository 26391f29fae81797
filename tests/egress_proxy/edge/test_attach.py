"""Credential attachment on its own: the head that goes upstream, a signature, and the edge's call to a token endpoint.

`Attacher` gets what the addon gives it: a custody source, a resolver, the dial (`Upstreams.dial`), clocks and two
audit writers that keep what they are given. The artifact is compiled from a real policy; flows are mitmproxy's
test flows. Minting against real token endpoints (TLS, redirects, rotation) is tests/credentials/test_minted.py.
"""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy import http
from mitmproxy.test import tflow

from compiler.compile import compile_text
from egress_proxy.credentials.base import Attached, MintFailed, TokenRequest
from egress_proxy.decision.types import Decision, Lease
from egress_proxy.edge.attach import Attacher, MintCall
from egress_proxy.edge.flows import FlowState
from egress_proxy.front.startup import Policy

POLICY = """egresslaw 1
workspace "acme"
catalog "2026.11"

connection "github" {
  credential = "github-token"
  egress "api" { host = "api.github.com" path_prefix = "/repos" methods = ["GET", "POST"] headers = ["accept"] }
}

connection "drive" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "client_credentials" }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}
"""
PUBLIC = "142.250.74.10"


@pytest.fixture(scope="module")
def policy() -> Policy:
    result = compile_text(POLICY, "p.egress")
    assert result.ok, result.diagnostics
    return Policy(artifact=result.artifact, proved=True, path="p.json", stamp=(0, 0, 0))


class Parts:
    """What the addon would give the attacher: answers by name, the dial, and the audit writers' record."""

    def __init__(self, answers=None, dial=None):
        self.answers = answers or {}
        self.dialled: list = []
        self.resolved: list = []
        self.counted: list = []
        self.events: list = []
        self._dial = dial

    async def resolve(self, host, port):
        self.resolved.append(host)
        if host not in self.answers:
            raise OSError("nxdomain")
        return self.answers[host]

    def dial(self, host, port, ips):
        self.dialled.append((host, port, ips))
        return self._dial

    def attacher(self, clock=lambda: 1_700_000_000.0) -> Attacher:
        return Attacher(custody=lambda: None, resolve=self.resolve, dial=self.dial, now=lambda: 10.0, clock=clock,
                        count=lambda *a: self.counted.append(a), emit=self.events.append)


def _flow(url="https://api.github.com/repos/acme/x", method="GET", headers=()):
    f = tflow.tflow()
    f.request = http.Request.make(method, url, b"")
    f.request.headers = http.Headers([(k.encode(), v.encode()) for k, v in headers])
    return f


def _state(policy, lease, decision, **more) -> FlowState:
    return FlowState(started=0.0, policy=policy, lease=lease, decision=decision, host=decision.host, port=443, **more)


def test_sandbox_traffic_carries_only_the_headers_the_decision_kept_in_origin_form(policy):
    f = _flow(headers=[("Accept", "a"), ("X-Other", "1"), ("Content-Length", "3")], method="POST")
    decision = Decision(allowed=True, reason="allowed", host="api.github.com", forward_headers=(("Accept", "a"),))
    state = _state(policy, Lease("ci-bot", "ci", None, 0), decision)
    assert Parts().attacher().prepare(f, state, None, True) is None
    assert [(k.lower(), v) for k, v in f.request.headers.items(multi=True)] == [("accept", "a"), ("host", "api.github.com"),
                                                                            ("content-length", "3")]  # framing recomputed
    assert f.request.host_header == "api.github.com" and state.injected == ()


def test_connection_traffic_carries_its_one_credential_and_the_scan_learns_its_encodings(policy):
    f = _flow(headers=[("Accept", "a"), ("Authorization", "Bearer mine"), ("Expect", "100-continue"), ("Content-Length", "2")],
              method="POST")
    decision = Decision(allowed=True, reason="allowed", host="api.github.com",
                        forward_headers=(("Accept", "a"), ("Authorization", "Bearer mine")))
    state = _state(policy, Lease("ci-bot", None, "github", 0), decision)
    attached = Attached(needles=(b"ghp_x",), value=b"Bearer ghp_x")
    assert Parts().attacher().prepare(f, state, attached, True) is None
    assert f.request.headers.get_all("authorization") == ["Bearer ghp_x"]  # the client's own is gone
    assert f.request.headers["expect"] == "100-continue"  # a client waiting for the 100 gets it
    assert state.injected == (b"ghp_x",) and "ghp_x" not in repr(state)


def test_nothing_undecided_or_uncredentialed_is_prepared(policy):
    attacher = Parts().attacher()
    allowed = Decision(allowed=True, reason="allowed", host="api.github.com")
    assert attacher.prepare(_flow(), _state(policy, Lease("s", None, "github", 0), Decision(host="x")), None, False) == "internal-error"
    assert attacher.prepare(_flow(), _state(policy, Lease("s", None, "github", 0), allowed), None, False) == "internal-error"
    assert attacher.prepare(_flow(), _state(policy, Lease("s", None, "gone", 0), allowed), None, False) == "lease-unknown-subject"


def test_a_signature_is_written_on_the_final_head_and_over_the_whole_body_when_it_hashes_it(policy):
    seen: list = []

    def sign(view, body, now):
        seen.append((view.method, view.host, body, now, [k for k, _ in view.headers]))
        return [("x-signature", "sig")]

    decision = Decision(allowed=True, reason="allowed", host="api.github.com", forward_headers=(("Accept", "a"),))
    attacher = Parts().attacher(clock=lambda: 42.0)
    f = _flow(headers=[("Accept", "a")])
    state = _state(policy, Lease("s", None, "github", 0), decision)
    attacher.prepare(f, state, Attached(needles=(b"k",), sign=sign), False)
    assert seen == [("GET", "api.github.com", None, 42.0, ["Accept", "Host"])] and f.request.headers["x-signature"] == "sig"
    assert state.signing is None
    # A hashed body is held: the signature waits for it (the addon's `request` hook).
    f = _flow(headers=[("Accept", "a"), ("Content-Length", "4")], method="POST")
    state = _state(policy, Lease("s", None, "github", 0), decision, buffered=True)
    attacher.prepare(f, state, Attached(needles=(b"k",), sign=sign, hash_body=True), True)
    assert len(seen) == 1 and state.signing is not None
    attacher.sign(f, state, b"body")
    assert seen[-1][2] == b"body" and f.request.headers.get_all("x-signature") == ["sig"] and state.signing is None


def _mint(policy, parts: Parts) -> tuple[MintCall, MintFailed]:
    attacher = parts.attacher()
    conn = policy.artifact.connection("drive")
    call = MintCall(attacher, policy)
    with pytest.raises(MintFailed) as caught:
        asyncio.run(call(conn, TokenRequest(headers=[], body=b"")))
    return call, caught.value


def test_a_token_endpoint_that_resolves_to_a_private_address_is_never_dialled_and_its_mint_is_audited(policy):
    parts = Parts(answers={"oauth2.googleapis.com": ("10.1.2.3",)})
    call, error = _mint(policy, parts)
    assert parts.dialled == [] and "address-not-public" in error.message
    [event] = parts.events
    assert (event.kind, event.decision, event.reason, event["answer_reason"], event["status"], event["host"]) == (
        "mint", "deny", error.reason, "address-not-public", None, "oauth2.googleapis.com")
    assert parts.counted == [("deny", error.reason, 0.0, "mint")]
    call.report(policy.artifact.connection("drive"), None, error)  # the broker reports too: still one event
    assert len(parts.events) == 1


def test_a_token_endpoint_that_is_this_proxy_or_does_not_resolve_is_refused(policy):
    parts = Parts(answers={"oauth2.googleapis.com": (PUBLIC,)}, dial=None)
    _, error = _mint(policy, parts)
    assert parts.dialled == [("oauth2.googleapis.com", 443, (PUBLIC,))] and error.message == "the token endpoint is this proxy"
    parts = Parts()
    _, error = _mint(policy, parts)
    assert parts.resolved == ["oauth2.googleapis.com"] and "did not resolve (OSError)" in error.message
    assert [e["detail"] for e in parts.events] == [error.message]


def test_without_a_broker_nothing_is_attached_and_the_head_is_refused(policy):
    attacher = Parts().attacher()
    decision = Decision(allowed=True, reason="allowed", host="api.github.com")
    state = _state(policy, Lease("s", None, "github", 0), decision)
    assert asyncio.run(attacher.attach(state)) is None  # (setup, from the addon's configure, makes the broker)
    assert attacher.prepare(_flow(), state, None, False) == "internal-error"
    sandbox = _state(policy, Lease("s", "ci", None, 0), decision)
    assert asyncio.run(attacher.attach(sandbox)) is None and attacher.prepare(_flow(), sandbox, None, False) is None
