"""Upstream connections on their own: pins, the dial of a server connection, the reuse key, never this proxy.

`Upstreams` is given what the addon gives it (its client records, its flow states, real `Limits`, the set of the
proxy's own addresses); the server connections are mitmproxy's own objects. The end-to-end pinning (a real proxy, a
real rebinding resolver) is in tests/conformance; here each decision of the collaborator, alone.
"""

from __future__ import annotations

from mitmproxy import connection
from mitmproxy.proxy import server_hooks
from mitmproxy.test import tflow

from egress_proxy.decision.types import Decision, Lease
from egress_proxy.edge.flows import Client, FlowState, upstream_subject
from egress_proxy.edge.limits import Limits
from egress_proxy.edge.upstreams import Upstreams

PUBLIC = "93.184.216.34"


def _upstreams(own=()):
    clients: dict[str, Client] = {}
    flows: dict[str, FlowState] = {}
    return Upstreams(clients=clients, flows=flows, limits=Limits(), own_addresses=set(own)), clients, flows


def _hook(client_conn, host="api.acme-test.dev", port=443, tls=True):
    server = connection.Server(address=(host, port))
    server.tls = tls
    return server_hooks.ServerConnectionHookData(server=server, client=client_conn)


def test_a_pinned_name_is_dialled_at_its_vetted_address_and_labelled_by_its_name_again():
    up, clients, _ = _upstreams()
    conn = tflow.tclient_conn()
    record = clients[conn.id] = Client(conn.id)
    assert up.pin(record, "api.acme-test.dev", 443, (PUBLIC, "93.184.216.35")) is None
    data = _hook(conn)
    up.server_connect(data)
    assert (data.server.address, data.server.sni, data.server.error) == ((PUBLIC, 443), "api.acme-test.dev", None)
    assert record.dialing == {data.server.id: ("api.acme-test.dev", 443)}
    up.server_connected(data)  # (no proxy server: the valve is skipped, the label is restored)
    assert data.server.address == ("api.acme-test.dev", 443) and record.dialing == {}


def test_the_first_vetted_answer_is_kept_for_the_connection():
    up, _, _ = _upstreams()
    record = Client("c")
    up.pin(record, "api.acme-test.dev", 443, (PUBLIC,))
    up.pin(record, "api.acme-test.dev", 443, ("93.184.216.99",))  # a second look never moves the pin
    assert record.pins[("api.acme-test.dev", 443)] == (PUBLIC, 443)


def test_nothing_is_dialled_that_was_not_vetted_for_this_client_connection():
    up, clients, _ = _upstreams()
    vetted, other = tflow.tclient_conn(), tflow.tclient_conn()
    clients[vetted.id] = Client(vetted.id)
    up.pin(clients[vetted.id], "api.acme-test.dev", 443, (PUBLIC,))
    for conn, host in ((other, "api.acme-test.dev"), (vetted, "elsewhere.acme-test.dev")):  # another's name, another name
        data = _hook(conn, host=host)
        up.server_connect(data)
        assert data.server.error == "egresslaw: destination not vetted" and data.server.address == (host, 443)
    nowhere = _hook(vetted)
    nowhere.server.address = None
    up.server_connect(nowhere)
    assert nowhere.server.error == "egresslaw: no destination"


def test_a_client_refused_for_good_dials_nothing():
    up, clients, _ = _upstreams()
    conn = tflow.tclient_conn()
    record = clients[conn.id] = Client(conn.id)
    up.pin(record, "api.acme-test.dev", 443, (PUBLIC,))
    record.refused = "sni-mismatch"
    data = _hook(conn)
    up.server_connect(data)
    assert data.server.error == "egresslaw: sni-mismatch" and data.server.address == ("api.acme-test.dev", 443)


def test_this_proxy_is_never_dialled_by_answer_by_test_routing_or_on_any_address():
    up, clients, _ = _upstreams(own={("127.0.0.1", 8080), ("0.0.0.0", 9090)})
    record = Client("c")
    assert up.pin(record, "a.acme-test.dev", 8080, ("127.0.0.1",)) == "self-connection"
    assert up.pin(record, "b.acme-test.dev", 9090, ("10.0.0.7",)) == "self-connection"  # a wildcard listener is every address
    up.connect_to = {("c.acme-test.dev", 443): ("127.0.0.1", 8080)}
    assert up.pin(record, "c.acme-test.dev", 443, (PUBLIC,)) == "self-connection"
    assert up.dial("c.acme-test.dev", 443, (PUBLIC,)) is None
    assert record.pins == {} and record.vetted == {}
    up.connect_to = {("d.acme-test.dev", 443): ("127.0.0.1", 4443)}  # test routing to a local upstream
    assert up.dial("d.acme-test.dev", 443, (PUBLIC,)) == ("127.0.0.1", 4443)
    assert up.is_self(("127.0.0.1", 8080)) and not up.is_self(("127.0.0.1", 8081)) and not up.is_self(("name", 8080))
    # A pin made before the proxy learnt one of its own addresses is checked again at the dial.
    conn = tflow.tclient_conn()
    late = clients[conn.id] = Client(conn.id)
    up.pin(late, "e.acme-test.dev", 443, ("127.0.0.2",))
    up.own_addresses.add(("127.0.0.2", 443))
    data = _hook(conn, host="e.acme-test.dev")
    up.server_connect(data)
    assert data.server.error == "egresslaw: self-connection"


def test_a_failed_dial_forgets_the_name_it_would_restore():
    up, clients, _ = _upstreams()
    conn = tflow.tclient_conn()
    record = clients[conn.id] = Client(conn.id)
    up.pin(record, "api.acme-test.dev", 443, (PUBLIC,))
    data = _hook(conn)
    up.server_connect(data)
    up.server_connect_error(data)
    assert record.dialing == {}
    up.server_disconnected(data)  # (nothing metered it: a no-op, never an error)


def test_only_flows_of_one_subject_and_one_credential_share_an_upstream_connection():
    up, _, flows = _upstreams()
    undecided, denied, plain, brokered = (tflow.tflow() for _ in range(4))
    lease = Lease("ci-bot", "ci", None, 0)
    flows[denied.id] = FlowState(started=0.0, lease=lease, denied=True)
    flows[plain.id] = FlowState(started=0.0, lease=lease, decision=Decision(allowed=True, reason="allowed"))
    flows[brokered.id] = FlowState(started=0.0, lease=lease, decision=Decision(allowed=True, reason="allowed", broker="github"))
    assert up.reuse_key(undecided) == ("unshared", undecided.id)
    assert up.reuse_key(denied) == ("unshared", denied.id)
    assert up.reuse_key(plain) == upstream_subject(lease, None)
    assert up.reuse_key(brokered) == upstream_subject(lease, "github") != up.reuse_key(plain)

