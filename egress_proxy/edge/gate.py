"""The tunnel gate: what is refused without a flow, and its one audit event.

Inside an admitted CONNECT only TLS naming the tunnel's host (no ECH) or plain HTTP is served: `tls_clienthello`
judges the hello, `tls_start_client` makes a refused handshake fail (the client sees a TLS alert), `tcp_start` and
`udp_start` refuse any other bytes. The client connection is then refused for good (`Client.refused`): its server
connections are never dialled, its requests are denied. Heads and connections refused before any hook (a limit, a
cap, a head mitmproxy could not parse) are audited here too (`audit_refusal`; `audit_malformed`, which
`RefusalWatch` calls from mitmproxy's own log of such a head).

It takes from the addon, at construction: `record` (the client record of a connection, made on first need), the
`clients` map (to find a connection's tunnel or peer without making a record) and the audit trail's three writers
(`count` for /metrics, `log_event` for the log line, `emit` for the audit event).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from mitmproxy import tls
from mitmproxy.utils import human

from compiler.normalize import HostError, normalize_host
from egress_proxy.audit.event import Event
from egress_proxy.edge.events import event_id
from egress_proxy.edge.flows import Client, Tunnel, log_internal, tunnel_of

ECH = (0xFE0D, 0xFE02)  # encrypted client hello (final and draft): the name it hides cannot be judged


class TunnelGate:
    """The TLS hello and raw bytes inside a tunnel, and the refusals that have no flow."""

    def __init__(self, *, record: Callable[[Any], Client], clients: Mapping[str, Client], count: Callable[..., None],
                 log_event: Callable[..., None], emit: Callable[[Event], Any]) -> None:
        self._record = record
        self._clients = clients
        self._count, self._log_event, self._emit = count, log_event, emit

    # -- TLS inside a tunnel ---------------------------------------------------------------------

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        try:
            client = self._record(data.context.client)
            tunnel = client.tunnel
            if tunnel is None:
                # TLS to the proxy itself (not inside a CONNECT) is not a supported transport.
                client.refused = "sni-mismatch"
                return
            hello = data.client_hello
            if any(ext_type in ECH for ext_type, _ in hello.extensions):
                tunnel.refused = "ech-refused"
            elif not hello.sni:
                tunnel.refused = "sni-missing"
            else:
                try:
                    sni = normalize_host(hello.sni).value
                except HostError:
                    sni = None
                if sni != tunnel.host:
                    tunnel.refused = "sni-mismatch"
            data.ignore_connection = False  # never pass an unjudged TLS stream through
            data.establish_server_tls_first = False
        except Exception:
            log_internal("internal error in tls_clienthello; refusing the handshake")
            self._record(data.context.client).refused = "internal-error"

    def tls_start_client(self, data: tls.TlsData) -> None:
        client = None
        try:
            client = self._record(data.context.client)
            reason = client.refused or (client.tunnel.refused if client.tunnel else "sni-mismatch")
        except Exception:
            log_internal("internal error in tls_start_client; refusing the handshake")
            reason = "internal-error"
        if reason is None:
            return
        if client is not None:
            client.refused = reason
        # A context with no certificate can complete no handshake: the client sees a TLS alert.
        from OpenSSL import SSL

        data.ssl_conn = SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD))
        data.ssl_conn.set_accept_state()
        self._tls_refused(data.context, reason)

    def _tls_refused(self, context: Any, reason: str) -> None:
        tunnel = tunnel_of(self._clients, context.client.id)
        lease = tunnel.lease if tunnel else None
        self._count("deny", reason, 0.0, "tls")
        event = Event.decided("tls", event_id(), lease, "deny", reason, host=tunnel.host if tunnel else None,
                              port=tunnel.port if tunnel else None, rule=None, status=None)
        self._log_event(logging.INFO, event, "deny %s tls %s:%s", reason, tunnel.host if tunnel else "-", tunnel.port if tunnel else "-")
        self._emit(event)

    # -- anything but TLS or HTTP inside a tunnel --------------------------------------------------

    def tcp_start(self, flow: Any) -> None:
        # Non-HTTP bytes inside a tunnel would become a raw relay that skips every HTTP check;
        # server_connect refuses to dial for a refused client, whatever happens below.
        client = self._record(flow.client_conn)
        client.refused = "non-http-in-tunnel"
        try:
            if flow.killable:
                flow.kill()
            tunnel = client.tunnel
            self._count("deny", "non-http-in-tunnel", 0.0, "tcp")
            self._tcp_refused(tunnel)
        except Exception:
            log_internal("internal error in tcp_start; its server connection is refused anyway")

    def udp_start(self, flow: Any) -> None:
        self.tcp_start(flow)

    def _tcp_refused(self, tunnel: Tunnel | None) -> None:
        event = Event.decided("tcp", event_id(), tunnel.lease if tunnel else None, "deny", "non-http-in-tunnel",
                              host=tunnel.host if tunnel else None, port=tunnel.port if tunnel else None, rule=None, status=None)
        self._log_event(logging.INFO, event, "deny non-http-in-tunnel tcp %s:%s", tunnel.host if tunnel else "-", tunnel.port if tunnel else "-")
        self._emit(event)

    # -- refusals before any hook ----------------------------------------------------------------

    def audit_malformed(self, peername: Any) -> None:
        """A request mitmproxy refused itself (400 or an HTTP/2 protocol error) before any hook: one audit event."""
        cid = next((c.id for c in self._clients.values() if c.peername == peername), None)
        if cid is None:
            return  # another proxy's client (several masters can share a process), or already gone
        self.audit_refusal(cid, "malformed-request", 400)

    def audit_refusal(self, cid: str | None, reason: str, status: int | None, kind: str = "request") -> None:
        """One audit event for a refusal that has no flow: a malformed or over-limit head, a connection over a cap."""
        try:
            tunnel = tunnel_of(self._clients, cid)
            self._count("deny", reason, 0.0, kind)
            event = Event.decided(kind, event_id(), tunnel.lease if tunnel else None, "deny", reason, method=None,
                                  host=tunnel.host if tunnel else None, port=tunnel.port if tunnel else None, path=None,
                                  tunnel=tunnel is not None, rule=None, status=status)
            self._log_event(logging.INFO, event, "deny %s %s:%s", reason, tunnel.host if tunnel else "-", tunnel.port if tunnel else "-")
            self._emit(event)
        except Exception:
            log_internal("internal error while auditing a refusal")


class RefusalWatch(logging.Filter):
    """Audits the requests mitmproxy refuses before any hook runs.

    When mitmproxy cannot parse a request line or header block (HTTP/1: it answers 400 and closes) or
    an HTTP/2 request (protocol error), no flow exists and no hook is called: its only trace is a log
    record of `mitmproxy.proxy.server` carrying the client's peername. This filter turns those records
    into one audit event each (`report(peername)`: the gate's `audit_malformed`). The logger is opened to INFO
    for that, and records below the level its parent would let through are filtered out again, so the visible
    log output does not change.
    """

    LOGGER = "mitmproxy.proxy.server"
    REFUSAL = re.compile(r"^\S+: (?:Bad HTTP request line|Invalid headers|Invalid header line|HTTP/2 protocol error|Invalid HTTP/2 request headers)")

    def __init__(self, report: Callable[[Any], None]) -> None:
        super().__init__()
        self.report = report
        self._old_level = logging.NOTSET

    def install(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        self._old_level = logger.level
        logger.setLevel(min(logging.INFO, logger.getEffectiveLevel()))
        logger.addFilter(self)

    def uninstall(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeFilter(self)
        if not logger.filters:
            logger.setLevel(self._old_level)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            peer = getattr(record, "client", None)
            message = record.getMessage()
            # Only the client's own refusals: an upstream's HTTP/2 protocol error is logged the same way, with
            # the upstream's address first, and is audited with its request (upstream-error).
            if peer is not None and self.REFUSAL.match(message) and message.startswith(human.format_address(peer) + ": "):
                self.report(peer)
        except Exception:
            log_internal("internal error while auditing a refused request")
        return record.levelno >= logging.getLogger(self.LOGGER).parent.getEffectiveLevel()
