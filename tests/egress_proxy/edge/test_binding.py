"""Lease binding on its own: the admission's hooks for one client connection, with real lease keys and real leases.

`LeaseBinding` gets what the addon gives it: a record maker over a client map, a lookup (here one that counts what it
is asked), `Upstreams.pin` of a real `Upstreams` and a clock. The same claims through the addon and a real proxy are
in test_addon.py and tests/clients/test_lease_proxy.py (the `lease-not-bound` mutant is caught by both).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from mitmproxy import http
from mitmproxy.test import tflow

from egress_proxy.custody import lease as leases
from egress_proxy.decision.types import Lease
from egress_proxy.edge.binding import LeaseBinding
from egress_proxy.edge.flows import Client
from egress_proxy.edge.limits import Limits
from egress_proxy.edge.upstreams import Upstreams
from egress_proxy.front.startup import load_lease_key_file
from tests.egress_proxy.conftest import make_env

PUBLIC = "93.184.216.34"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("binding"))


class Parts:
    def __init__(self, answers=None):
        self.clients: dict[str, Client] = {}
        self.asked: list[str] = []
        self.answers = answers if answers is not None else {"api.acme-test.dev": (PUBLIC,)}
        self.upstreams = Upstreams(clients=self.clients, flows={}, limits=Limits(), own_addresses={("127.0.0.1", 8080)})

    def record(self, conn):
        return self.clients.setdefault(conn.id, Client(conn.id))

    async def resolve(self, host, port):
        self.asked.append(host)
        if host not in self.answers:
            raise OSError("nxdomain")
        return self.answers[host]

    def binding(self, env=None) -> LeaseBinding:
        bound = LeaseBinding(record=self.record, resolve=self.resolve, pin=self.upstreams.pin, clock=time.time)
        if env is not None:
            bound.lease_keys = load_lease_key_file(str(env.keys))
        return bound


def _conn():
    conn = tflow.tclient_conn()
    conn.timestamp_end = None  # connected
    return conn


def test_the_first_lease_binds_the_connection_and_another_refuses_it_for_good():
    parts = Parts()
    conn = _conn()
    hooks = parts.binding().hooks(conn)
    assert hooks.bind(Lease("agent-1", None, "github", 1)) is None
    assert hooks.bind(Lease("agent-1", None, "github", 2)) is None  # the same, re-minted
    assert parts.clients[conn.id].refused is None
    assert hooks.bind(Lease("agent-2", None, "github", 1)) == "lease-mismatch"
    assert parts.clients[conn.id].refused == "lease-mismatch"
    assert parts.clients[conn.id].bound == ("agent-1", None, "github")  # the claim stays the first lease's
    parts.binding().hooks(conn).bind(Lease("agent-1", None, "github", 3))
    assert parts.clients[conn.id].refused == "lease-mismatch"  # for good: every later request is refused with it


def test_a_name_is_resolved_once_per_connection_and_pinned_to_its_first_answer():
    parts = Parts()
    conn = _conn()
    hooks = parts.binding().hooks(conn)
    lease = Lease("agent-1", None, "github", 1)
    first = asyncio.run(hooks.resolve(lease, "api.acme-test.dev", 443))
    assert first == (PUBLIC,) and hooks.pinned(lease, "api.acme-test.dev", 443, first) is None
    parts.answers["api.acme-test.dev"] = ("10.0.0.1",)  # a rebinding answer is never asked for
    assert asyncio.run(hooks.resolve(lease, "api.acme-test.dev", 443)) == (PUBLIC,) and parts.asked == ["api.acme-test.dev"]
    assert parts.clients[conn.id].pins == {("api.acme-test.dev", 443): (PUBLIC, 443)}
    assert asyncio.run(hooks.resolve(lease, "gone.acme-test.dev", 443)) == ()  # a failed lookup: no answers, denied by admit
    assert hooks.pinned(lease, "self.acme-test.dev", 8080, ("127.0.0.1",)) == "self-connection"


def test_a_client_that_left_during_its_lookup_keeps_nothing():
    parts = Parts()
    conn = _conn()
    hooks = parts.binding().hooks(conn)
    conn.timestamp_end = time.time()
    assert asyncio.run(hooks.resolve(Lease("a", None, "github", 1), "api.acme-test.dev", 443)) == "client-disconnected"
    assert parts.clients[conn.id].vetted == {}


def test_without_a_lease_key_every_lease_is_refused(env):
    hooks = Parts().binding().hooks(_conn())
    with pytest.raises(leases.LeaseError) as caught:
        hooks.lease_keys()
    assert caught.value.reason == "lease-key-unknown"
    assert Parts().binding(env).key_set() is not None


def _in_tunnel(token: str | None):
    f = tflow.tflow()
    f.client_conn.timestamp_end = None
    f.request = http.Request.make("GET", "https://api.acme-test.dev/x", b"")
    if token is not None:
        f.request.headers["Proxy-Authorization"] = f"Bearer {token}"
    return f


def test_inside_a_tunnel_another_valid_lease_refuses_the_connection(env):
    parts = Parts()
    binding = parts.binding(env)
    tunnel_lease = leases.authenticate(binding.key_set(), [f"Bearer {env.lease(connection='github')}"], now=time.time())
    for token, other in ((None, False), ("not-a-lease", False), (env.lease(connection="github"), False),
                         (env.lease(connection="github", subject="agent-2"), True)):
        f = _in_tunnel(token)
        assert binding.offers_other_lease(f, tunnel_lease) is other, token
        assert (parts.clients.get(f.client_conn.id) is not None and parts.clients[f.client_conn.id].refused == "lease-mismatch") is other
