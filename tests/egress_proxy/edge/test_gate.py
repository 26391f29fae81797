"""The tunnel gate on its own: the TLS hello and raw bytes inside a tunnel, and the refusals that have no flow.

`TunnelGate` gets what the addon gives it: a record maker over a client map, and three audit writers, here ones that
keep what they are given (the events are the real `Event` values the addon's trail would write). mitmproxy's own
hook data carries the hellos. The same refusals through the addon and a real proxy are in test_addon.py and
tests/conformance.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from mitmproxy import connection, options, tls
from mitmproxy.proxy import context
from mitmproxy.test import tflow

from egress_proxy.decision.types import Lease
from egress_proxy.edge.flows import Client, Tunnel
from egress_proxy.edge.gate import ECH, RefusalWatch, TunnelGate

LEASE = Lease("ci-bot", None, "github", 2_000_000_000)


class Trail:
    """The audit writers the gate is given: what it counted, logged and emitted."""

    def __init__(self) -> None:
        self.counted: list[tuple] = []
        self.logged: list[str] = []
        self.events: list = []

    def count(self, decision, reason, elapsed, kind="request"):
        self.counted.append((decision, reason, kind))

    def log_event(self, level, event, message, *args):
        self.logged.append(message % args)

    def emit(self, event):
        self.events.append(event)
        return len(self.events)


def _gate():
    clients: dict[str, Client] = {}

    def record(conn):
        return clients.setdefault(conn.id, Client(conn.id))

    trail = Trail()
    return TunnelGate(record=record, clients=clients, count=trail.count, log_event=trail.log_event, emit=trail.emit), clients, trail


def _tunnelled(clients, host="api.acme-test.dev"):
    conn = tflow.tclient_conn()
    clients[conn.id] = Client(conn.id, tunnel=Tunnel(host, 443, LEASE, ("93.184.216.34",)))
    return conn


def _hello(conn, sni, extensions=()):
    ctx = context.Context(conn, options.Options())
    return tls.ClientHelloData(ctx, SimpleNamespace(sni=sni, extensions=list(extensions)))


@pytest.mark.parametrize(("sni", "extensions", "reason"), [
    ("other.acme-test.dev", (), "sni-mismatch"), (None, (), "sni-missing"), ("", (), "sni-missing"),
    ("api.acme-test.dev", ((ECH[0], b""),), "ech-refused"), ("api.acme-test.dev", ((ECH[1], b""),), "ech-refused"),
    ("api..acme-test.dev", (), "sni-mismatch"),  # a name that does not normalize
])
def test_a_refused_hello_fails_its_handshake_refuses_the_client_and_is_audited_once(sni, extensions, reason):
    gate, clients, trail = _gate()
    conn = _tunnelled(clients)
    data = _hello(conn, sni, extensions)
    gate.tls_clienthello(data)
    assert data.ignore_connection is False and data.establish_server_tls_first is False  # never passed through unjudged
    start = tls.TlsData(conn, data.context)
    gate.tls_start_client(start)
    assert start.ssl_conn is not None  # a context without a certificate: no handshake can complete
    assert clients[conn.id].refused == reason  # for good: no dial, no request
    [event] = trail.events
    assert (event.kind, event.decision, event.reason, event["host"], event["port"], event["connection"]) == (
        "tls", "deny", reason, "api.acme-test.dev", 443, "github")
    assert trail.counted == [("deny", reason, "tls")] and trail.logged == [f"deny {reason} tls api.acme-test.dev:443"]


def test_the_tunnels_own_name_in_any_spelling_is_left_to_mitmproxys_tls():
    gate, clients, trail = _gate()
    conn = _tunnelled(clients)
    data = _hello(conn, "API.acme-test.dev.")
    gate.tls_clienthello(data)
    start = tls.TlsData(conn, data.context)
    gate.tls_start_client(start)
    assert start.ssl_conn is None and clients[conn.id].refused is None and trail.events == []


def test_tls_to_the_proxy_itself_is_refused():
    gate, clients, trail = _gate()
    conn = tflow.tclient_conn()
    data = _hello(conn, "api.acme-test.dev")
    gate.tls_clienthello(data)
    gate.tls_start_client(tls.TlsData(conn, data.context))
    assert clients[conn.id].refused == "sni-mismatch"
    [event] = trail.events
    assert (event.kind, event.reason, event["host"], event["subject"]) == ("tls", "sni-mismatch", None, None)


def test_bytes_that_are_neither_tls_nor_http_in_a_tunnel_are_refused_for_good():
    gate, clients, trail = _gate()
    conn = _tunnelled(clients)
    for start in (gate.tcp_start, gate.udp_start):
        flow = tflow.ttcpflow(client_conn=conn)
        start(flow)
        assert flow.killable is False  # killed
    assert clients[conn.id].refused == "non-http-in-tunnel"
    assert [(e.kind, e.reason, e["host"]) for e in trail.events] == [("tcp", "non-http-in-tunnel", "api.acme-test.dev")] * 2


def test_a_refusal_without_a_flow_names_the_tunnel_it_came_through():
    gate, clients, trail = _gate()
    conn = _tunnelled(clients)
    gate.audit_refusal(conn.id, "head-too-large", 431)
    gate.audit_refusal(None, "connections-per-client", 429, "connection")
    inside, cap = trail.events
    assert (inside.kind, inside.reason, inside["status"], inside["tunnel"], inside["host"], inside["connection"]) == (
        "request", "head-too-large", 431, True, "api.acme-test.dev", "github")
    assert (cap.kind, cap.reason, cap["status"], cap["tunnel"], cap["host"]) == ("connection", "connections-per-client", 429, False, None)


def test_a_head_mitmproxy_refused_is_audited_for_its_own_client_only():
    gate, clients, trail = _gate()
    conn = _tunnelled(clients)
    clients[conn.id].peername = ("127.0.0.1", 50001)
    gate.audit_malformed(("127.0.0.1", 50002))  # another proxy's client, or one already gone
    assert trail.events == []
    gate.audit_malformed(("127.0.0.1", 50001))
    [event] = trail.events
    assert (event.reason, event["status"], event["host"]) == ("malformed-request", 400, "api.acme-test.dev")


def test_the_refusal_watch_reports_a_clients_refused_head_and_not_an_upstreams_error():
    reported: list = []
    watch = RefusalWatch(reported.append)
    logger = logging.getLogger(RefusalWatch.LOGGER)
    watch.install()
    try:
        client = ("127.0.0.1", 50001)
        logger.info("127.0.0.1:50001: Bad HTTP request line: b'GARBAGE'", extra={"client": client})
        logger.info("127.0.0.1:443: HTTP/2 protocol error: stream reset", extra={"client": client})  # the upstream's
        logger.info("127.0.0.1:50001: client connect", extra={"client": client})
        logger.info("127.0.0.1:50001: Invalid headers", extra={"client": client})
    finally:
        watch.uninstall()
    assert reported == [client, client]
    assert watch not in logger.filters
