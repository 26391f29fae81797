"""The request path on its own: CONNECTs and request heads through the real shared admission, real lease keys, a real
artifact; the audit trail's `write_ahead` and `finish` are recorders (what the path asks of them is the point here).

Everything a denial looks like on the wire, through the addon and a real proxy, is test_addon.py's and
tests/conformance's; here, that the collaborator takes only what it is given and drives the trail in order.
"""

from __future__ import annotations

import asyncio
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
    edge.path.request(f)
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
    edge.path.request(undecided)
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
