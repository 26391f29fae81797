"""Upstream connections: only a vetted, pinned address is dialled, and a connection is reused for its subject only.

`Upstreams` answers the addon's server hooks (`server_connect`, `server_connected`, `server_connect_error`,
`server_disconnected`) and the layers' question `reuse_key`; it pins the answers the admission vetted for a client
connection (`pin`), says where a name is dialled (`dial`: test routing's `connect_to`, never this proxy itself) and
closes an upstream connection at once when the response side doubts it (`close_upstream`).

It takes from the addon, at construction, only the two state maps it reads (the client records and the flows), the
limits (the valve that meters an upstream's reader) and the set of the proxy's own listen addresses; the proxy
server (whose connections it closes) is handed to it once the proxy runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import server_hooks

from egress_proxy.edge import layers
from egress_proxy.edge.flows import Client, FlowState, carrier_of, ip_of, log_internal, upstream_subject


class Upstreams:
    """Resolve once, pin, restore: what a server connection may dial, and which flows may share it."""

    def __init__(self, *, clients: Mapping[str, Client], flows: Mapping[str, FlowState], limits: Any,
                 own_addresses: set[tuple[str, int]]) -> None:
        self._clients = clients  # the addon's client records (read only: the addon makes and forgets them)
        self._flows = flows  # the addon's flow states (read only)
        self.limits = limits  # edge.limits.Limits: an upstream's reader waits while its client takes nothing
        self.own_addresses = own_addresses  # the proxy's own listeners (and admin): never dialled
        self.connect_to: dict[tuple[str, int], tuple[str, int]] = {}  # test routing: (host, port) -> the address dialled
        self.proxyserver: Any = None  # mitmproxy's proxyserver addon, once running: the connections it holds

    # -- where a name is dialled -----------------------------------------------------------------

    def dial(self, host: str, port: int, ips: tuple[str, ...]) -> tuple[str, int] | None:
        """The address a dial to (host, port) with vetted answers `ips` uses (test routing may name another); None
        when that, or the first answer itself, is this proxy."""
        dial = self.connect_to.get((host, port), (ips[0], port))
        if self.is_self(dial) or self.is_self((ips[0], port)):
            return None
        return dial

    def pin(self, client: Client, host: str, port: int, ips: tuple[str, ...]) -> str | None:
        """Keep the vetted answers of (host, port) for this client connection and the address its dials use; the
        reason for a refusal (`self-connection`), else None."""
        dial = self.dial(host, port, ips)
        if dial is None:
            return "self-connection"
        # INVARIANT: a client connection keeps the first vetted answer for a name: no second lookup, no rebinding.
        client.vetted[(host, port)] = ips
        client.pins.setdefault((host, port), dial)
        return None

    def is_self(self, address: tuple[str, int]) -> bool:
        ip = ip_of(address[0])
        if ip is None:
            return False
        for host, port in self.own_addresses:
            if port != address[1]:
                continue
            own = ip_of(host)
            if own is not None and (own == ip or own.is_unspecified):
                return True
        return False

    # -- the server hooks ------------------------------------------------------------------------

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            address = data.server.address
            client = self._clients.get(data.client.id)  # (none: nothing was vetted for it)
            if client is not None and client.refused is not None:
                data.server.error = f"egresslaw: {client.refused}"
                return
            if address is None:
                data.server.error = "egresslaw: no destination"
                return
            host, port = address
            pin = client.pins.get((host, port)) if client is not None else None
            if pin is None:
                # INVARIANT: only an address vetted for this client connection is ever dialled.
                data.server.error = "egresslaw: destination not vetted"
                return
            if self.is_self(pin):
                data.server.error = "egresslaw: self-connection"
                return
            client.dialing[data.server.id] = (host, port)
            data.server.address = pin
            if data.server.tls:
                data.server.sni = host
        except Exception:
            log_internal("internal error in server_connect; refusing the connection")
            data.server.error = "egresslaw: internal-error"

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            self.limits.server_connected(data.client, data.server)  # its reader waits while its client takes nothing
        except Exception:
            log_internal("internal error in server_connected (valve)")
        # Put the name back so mitmproxy reuses this (vetted, pinned) connection for the same name only.
        try:
            client = self._clients.get(data.client.id)
            original = client.dialing.pop(data.server.id, None) if client is not None else None
            if original is not None:
                # mitmproxy refuses `address` changes on an open connection through its __setattr__; the
                # socket is already connected to the pinned peer (see `peername`), so only the label changes.
                object.__setattr__(data.server, "address", original)
        except Exception:  # the connection stays labelled with the pinned address: no reuse, still safe
            log_internal("internal error in server_connected")

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        client = self._clients.get(getattr(data.client, "id", None))
        if client is not None:
            client.dialing.pop(getattr(data.server, "id", None), None)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            layers.forget(data.server.id)
            self.limits.server_disconnected(data.client, data.server)
        except Exception:
            log_internal("internal error in server_disconnected")

    # -- never reused after doubt or for another subject -----------------------------------------

    def reuse_key(self, flow: Any) -> Any:
        """Which flows may share an upstream connection (egress_proxy.edge.layers): those of the same subject carrying the
        same credential or none (a brokered request's differs from its profile's plain traffic). A flow without a
        decided state gets a key of its own."""
        state = self._flows.get(flow.id)
        if state is None or state.lease is None or state.denied:
            return ("unshared", flow.id)
        return upstream_subject(state.lease, carrier_of(state.lease, state.decision))

    def close_upstream(self, flow: http.HTTPFlow) -> None:
        """Close this flow's upstream connection now (the response side doubts it: never reused)."""
        if flow.server_conn is not None and flow.server_conn.address is not None:
            self.close_server(flow.client_conn.id, flow.server_conn)

    def close_server(self, cid: str, server: Any) -> None:
        """Close an upstream connection now, as if the upstream had: marked closed at once (so it is never
        reused), its socket aborted, and mitmproxy's layers see the close like any other (a stream still
        waiting for its answer gets a protocol error: our JSON 502, or a cut connection after the head)."""
        try:
            handler = self.proxyserver.connections.get(cid) if self.proxyserver is not None else None
            io = handler.transports.get(server) if handler is not None else None
            if io is None or io.writer is None:
                return
            server.state = ConnectionState.CLOSED
            io.writer.transport.abort()
        except Exception:
            log_internal("cannot close an upstream connection")
