"""The readings of a flow the edge shares (does a body follow, what framing goes upstream, whose credential), its state
records, and what the addon's mixins declare they take from it."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from mitmproxy.test import tutils

from egress_proxy.decision.types import Decision, Lease
from egress_proxy.edge.addon import EgressLaw
from egress_proxy.edge.attach import Attacher, MintCall
from egress_proxy.edge.binding import LeaseBinding
from egress_proxy.edge.events import AuditTrail
from egress_proxy.edge.flows import (AuditHost, FlowState, authority, carrier_of, has_body, identity, ip_of, printable,
                                     upstream_framing)
from egress_proxy.edge.gate import TunnelGate
from egress_proxy.edge.requests import RequestPath
from egress_proxy.edge.responses import ResponsePath
from egress_proxy.edge.upstreams import Upstreams


def _req(method: str = "POST", headers: dict | None = None, http2: bool = False):
    req = tutils.treq(method=method.encode(), content=b"")
    req.headers.clear()
    for k, v in (headers or {}).items():
        req.headers[k] = v
    if http2:
        req.http_version = "HTTP/2.0"
    return req


@pytest.mark.parametrize(
    "headers, http2, ended, expected",
    [({}, False, None, False), ({"content-length": "0"}, False, None, False), ({"content-length": "5"}, False, None, True),
     ({"content-length": "x"}, False, None, True), ({"transfer-encoding": "chunked"}, False, None, True),
     ({}, True, None, True), ({}, True, True, False), ({}, True, False, True)],
)
def test_has_body(headers, http2, ended, expected) -> None:
    assert has_body(_req(headers=headers, http2=http2), ended) is expected


def test_upstream_framing_is_recomputed_never_copied() -> None:
    assert upstream_framing(_req("POST"), False) == [(b"content-length", b"0")]
    assert upstream_framing(_req("GET"), False) == []
    assert upstream_framing(_req(headers={"content-length": "5"}), True) == [(b"content-length", b"5")]
    assert upstream_framing(_req(headers={"transfer-encoding": "chunked"}), True) == [(b"transfer-encoding", b"chunked")]
    assert upstream_framing(_req(http2=True), True) == []  # held whole, framed in `request`


def test_whose_credential_a_flow_carries() -> None:
    conn = Lease("s", None, "github", 0)
    prof = Lease("s", "ci", None, 0)
    brokered = Decision(allowed=True, reason="allowed", broker="github")
    assert carrier_of(conn, None) == "github"
    assert carrier_of(prof, None) is None and carrier_of(prof, Decision()) is None
    assert carrier_of(prof, brokered) == "github"
    assert carrier_of(prof, Decision(reason="path-not-allowed", broker="github")) is None  # a denial carries nothing
    assert identity(Lease("s", "ci", None, 1)) == identity(Lease("s", "ci", None, 2))  # a re-minted lease binds alike


def test_small_readings() -> None:
    assert authority("api.github.com", 443, "https") == "api.github.com"
    assert authority("::1", 8443, "https") == "[::1]:8443"
    assert authority("deb.debian.org", 80, "http") == "deb.debian.org"
    assert str(ip_of("::ffff:127.0.0.1")) == "::ffff:7f00:1" and ip_of("name.example") is None
    assert "\n" not in printable("a\nb\x00c")


def test_a_flows_injected_credential_is_never_in_its_repr() -> None:
    state = FlowState(started=0.0, injected=(b"ghp_canary-secret",))
    assert state.injected == (b"ghp_canary-secret",) and "canary" not in repr(state)


def _self_names(cls: type) -> tuple[set[str], set[str]]:
    """(the names `cls` defines: its methods and the attributes it assigns on self, the names it reads off self)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(tree, ast.ClassDef)
    own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (own if isinstance(node.ctx, ast.Store) else used).add(node.attr)
    return own, used


def _declared(protocol: type) -> set[str]:
    members = set(protocol.__dict__.get("__annotations__", {}))
    return members | {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("__")}


def test_the_mixin_takes_from_the_addon_exactly_what_its_host_protocol_declares() -> None:
    """`AuditTrail` uses `EgressLaw`'s state through `self`: every name it takes from it is on its host protocol in
    flows.py (a new one is declared there first), none is declared that it does not take, and the addon provides each."""
    own, used = _self_names(AuditTrail)
    assert used - own == _declared(AuditHost)
    assert not own & _declared(AuditHost)  # a mixin declares only what it takes
    assert isinstance(EgressLaw(), AuditHost)


@pytest.mark.parametrize("collaborator", [TunnelGate, Upstreams, Attacher, MintCall, LeaseBinding, RequestPath,
                                          ResponsePath])
def test_a_collaborator_reads_through_self_only_what_it_was_given_or_made(collaborator: type) -> None:
    """The addon's collaborators are not mixins: each reads off `self` only its own methods and the attributes it
    assigns (what its constructor was given, or made), so a hidden reach into the addon cannot creep back in."""
    own, used = _self_names(collaborator)
    assert used <= own, sorted(used - own)
    assert not any(base.__module__.startswith("egress_proxy.edge.addon") for base in collaborator.__mro__)
