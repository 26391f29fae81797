"""The mitmproxy addon: one class that adapts flows to the pure decision functions and back.

Every hook is guarded: an exception inside a hook denies (mitmproxy itself would log it and
forward the request, i.e. fail open). Decisions come from `egress_proxy.decision.adapter`
(`decide_connect`, `decide_without_addresses`, `judge_answers`, `decide`: the functions `egresslaw explain`
calls too), through the one admission `egress_proxy.front.admit`; this module translates requests and answers. Its audit trail is `egress_proxy.edge.events.AuditTrail` (a mixin), and the state records every part
shares are in `egress_proxy.edge.flows`.

The rest is answered by collaborators, each given what it takes at construction (never the addon), and the class's
hook table (`Hook` rows) hands their hooks to them by name:
- `gate` (`edge.gate.TunnelGate`): TLS and raw bytes inside a tunnel, refusals that have no flow;
- `upstreams` (`edge.upstreams.Upstreams`): pins, the dial of each server connection, reuse keys, closing upstreams;
- `binding` (`edge.binding.LeaseBinding`): the admission's hooks for a client connection (its claim on one lease);
- `attacher` (`edge.attach.Attacher`): the credential a request carries (custody, mints), its head, its signature;
- `responses` (`edge.responses.ResponsePath`): heads cleaned, credentialed bodies scanned, failures answered.

Where state lives (never in flow metadata, which other addons and dumps can read): two maps, nothing else.
- `_clients[client id]`: a `flows.Client`, everything kept about one client connection (its tunnel, the lease it
  is bound to, its refusal, its vetted answers and the pins a server connection must dial), from `client_connected`
  to `client_disconnected`, which forgets it with one pop;
- `_flows[flow id]`: a `flows.FlowState`, per-request bookkeeping (the injected credential's encodings for the
  response scan included) until its closing audit event (a denial, or the outcome of an allow whose decision event
  was written ahead) is queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any, Optional

from mitmproxy import ctx, exceptions, http
from mitmproxy.utils import human

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import (
    AuditError,
    AuditLog,
    parse_sync,
    strip_query,
)
from egress_proxy.credentials.base import (
    MAX_HASHED_BODY,
    Attached,
    CredentialError,
)
from egress_proxy.credentials.exchange import verified_context
from egress_proxy.custody.records import CustodyError, CustodyUnavailable
from egress_proxy.decision.reasons import REASONS
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.edge import layers
from egress_proxy.edge.denials import (
    denial,
    denial_response,
)
from egress_proxy.edge.attach import Attacher
from egress_proxy.edge.binding import LeaseBinding
from egress_proxy.edge.events import AuditTrail
from egress_proxy.edge.flows import (
    AUDITED,
    Client,
    FlowState,
    Tunnel,
    carrier_of,
    deny,
    has_body,
    log_internal,
    printable,
    tunnel_of,
)
from egress_proxy.edge.gate import RefusalWatch, TunnelGate
from egress_proxy.edge.limits import (
    ClosingLayer,
    LimitError,
    Limits,
    declared_length,
    limit_config,
    request_problem,
)
from egress_proxy.front.admit import Admission, Ask, admit
from egress_proxy.front.resolver import AsyncResolver, routed
from egress_proxy.edge.responses import ResponseCaps, ResponsePath
from egress_proxy.front.settings import BOUNDS, DEFAULTS
from egress_proxy.front.startup import Policy, Resolver, StartupError, file_stamps, load_audit_key_file, load_lease_key_file, load_policy, parse_connect_to, parse_resolve, routing_record
from egress_proxy.edge.startup import check_rule_caps, make_resolver, open_custody, parse_response_caps
from egress_proxy.edge.upstreams import Upstreams

log = logging.getLogger("egresslaw.proxy")


# mitmproxy options the enforcement relies on; configure() refuses to run with anything else.
REQUIRED_OPTIONS: dict[str, Any] = {
    "connection_strategy": "lazy",
    "rawtcp": False,
    "http3": False,
    "websocket": False,
    "ssl_insecure": False,
    "upstream_cert": False,
    "stream_large_bodies": None,
    "mode": ["regular"],
    "validate_inbound_headers": True,  # mitmproxy's own refusal of ambiguous framing (smuggling)
    "ignore_hosts": [],  # an ignored host would be relayed as raw TLS, never decided
    "allow_hosts": [],
    "tcp_hosts": [],
    "udp_hosts": [],
}


_SYSTEM_RESOLVER: Any = None


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """Every address of `host` (A, then AAAA) from the system's nameservers (/etc/resolv.conf), asynchronously.

    The addon uses its own configured `AsyncResolver` (`self.dns`); this process-wide default is its fall-back."""
    global _SYSTEM_RESOLVER
    if _SYSTEM_RESOLVER is None:
        _SYSTEM_RESOLVER = AsyncResolver()
    return await _SYSTEM_RESOLVER(host, port)


class Hook:
    """One row of the hook table: `EgressLaw.<hook>` is `EgressLaw.<collaborator>.<hook>` (mitmproxy and the layers
    look hooks up by name, so the collaborator's own bound method is what they call)."""

    __slots__ = ("via", "name")

    def __init__(self, via: str) -> None:
        self.via, self.name = via, ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, addon: Any, owner: type | None = None) -> Any:
        return self if addon is None else getattr(getattr(addon, self.via), self.name)


class EgressLaw(AuditTrail):
    """The egress edge: leases, decisions, pinning, credential injection, response scanning, audit."""

    def __init__(
        self,
        *,
        resolver: Resolver | None = None,
        custody: Any = None,
        clock: Callable[[], float] = time.time,
        metrics: Any = None,
    ) -> None:
        self._resolver = resolver
        self._closed_world = False
        self.dns: Resolver | None = None  # the AsyncResolver built from the egresslaw_dns_* options (unless `resolver` is injected)
        self.resolve_timeout = DEFAULTS.dns_timeout  # a lookup that takes longer is a failed lookup (resolve-failed)
        self._custody_override = custody
        self.custody: Any = custody
        self.clock = clock
        self.metrics = metrics
        self.policy: Policy | None = None
        self.audit: AuditLog | None = None
        self.resolve_map: dict[str, tuple[str, ...]] = {}
        self.test_routing: dict[str, Any] = {}
        self.own_addresses: set[tuple[str, int]] = set()
        self._clients: dict[str, Client] = {}  # client id -> all the edge keeps of that connection
        self._flows: dict[str, FlowState] = {}  # flow id -> its state until its closing event is queued
        self._opts: Any = None
        self._watch: RefusalWatch | None = None
        self.is_running = False
        self.limits = Limits()
        # The collaborators the hook table below hands mitmproxy's hooks to, each given only what it takes.
        self.upstreams = Upstreams(clients=self._clients, flows=self._flows, limits=self.limits, own_addresses=self.own_addresses)
        self.gate = TunnelGate(record=self._client, clients=self._clients, count=self._count, log_event=self._log_event, emit=self._emit)
        self.attacher = Attacher(custody=lambda: self.custody, resolve=self._resolve, dial=self.upstreams.dial, now=self._now,
                                 clock=lambda: self.clock(), count=self._count, emit=self._emit)
        self.binding = LeaseBinding(record=self._client, resolve=self._resolve, pin=self.upstreams.pin, clock=lambda: self.clock())
        self.responses = ResponsePath(flows=self._flows, limits=self.limits, attacher=self.attacher, upstreams=self.upstreams,
                                      now=self._now, finish=self._finish,
                                      caps=ResponseCaps(human.parse_size(DEFAULTS.max_response), human.parse_size(DEFAULTS.max_decoded)))
        self.limits.on_refusal = self.gate.audit_refusal
        self.limits.on_flow_refusal = self._refuse_mid_body
        self.limits.on_stall = self._stalled
        self.limits.on_rapid_reset = self._rapid_reset
        self.draining_since: float | None = None  # shutdown began: requests that arrive after it get 503 `draining`
        self._done = False
        self._refused_stamps: tuple | None = None  # (artifact, proof) file stamps of the last refused reload
        self._last_look: tuple | None = None  # the stamps the artifact watcher saw at its previous look

    # -- the hook table: the hooks a collaborator answers (mitmproxy's, and the layers' `Listener`) -----------

    tls_clienthello = Hook("gate")  # TLS inside a tunnel: the hello names the tunnel's host, no ECH
    tls_start_client = Hook("gate")  # a refused hello gets a handshake that cannot complete
    tcp_start = Hook("gate")  # non-HTTP bytes inside a tunnel: refused for good
    udp_start = Hook("gate")
    audit_malformed = Hook("gate")  # (layers) a head mitmproxy refused before any hook
    server_connect = Hook("upstreams")  # only the pinned, vetted address is dialled
    server_connected = Hook("upstreams")
    server_connect_error = Hook("upstreams")
    server_disconnected = Hook("upstreams")
    reuse_key = Hook("upstreams")  # (layers) which flows may share an upstream connection
    responseheaders = Hook("responses")  # the head judged and cleaned, a credentialed body's scan set up
    response = Hook("responses")  # a whole body scanned; what the client got recorded; the closing event
    error = Hook("responses")  # a protocol error: what the client got, then the closing event

    # -- options --------------------------------------------------------------------------------

    def load(self, loader) -> None:
        loader.add_option("egresslaw_artifact", str, "", "Path of the compiled artifact to enforce.")
        loader.add_option("egresslaw_proof", str, "", "Path of the proof report that must prove the artifact.")
        loader.add_option("egresslaw_keys", str, "", "Keys directory (lease.key, custody.key).")
        loader.add_option("egresslaw_store", str, "", "Custody store holding the sealed credentials: a SQLite file or a postgresql:// URL.")
        loader.add_option("egresslaw_audit_log", str, "", "Append-only JSONL audit log.")
        loader.add_option("egresslaw_audit_max_bytes", int, DEFAULTS.audit_max_bytes, "Rotate the audit log when its active file reaches this size.")
        loader.add_option("egresslaw_audit_max_age", int, DEFAULTS.audit_max_age, "Rotate the audit log when its active file is this many seconds old.")
        loader.add_option("egresslaw_audit_sync", str, DEFAULTS.audit_sync, "`request`: an allowed request waits for the fsync of its decision event; "
                          "SECONDS: it waits for the event's write, and every line is fsync'd within SECONDS.")
        loader.add_option("egresslaw_allow_unproven", bool, False, "Serve an artifact that is not all-proved (warns on every request).")
        loader.add_option("egresslaw_trust_proofs", Optional[str], None, "Accept only proof reports signed by this Ed25519 public key.")
        loader.add_option("egresslaw_allow_unsigned_proofs", bool, False, "Accept an unsigned proof report (development only; logged).")
        loader.add_option("egresslaw_require_within", Optional[str], None, "Require `within` proved against the ceiling artifact of this digest.")
        loader.add_option("egresslaw_resolve", Sequence[str], [], "Test routing: HOST=IP[,IP...] answers for HOST (still judged).")
        loader.add_option("egresslaw_connect_to", Sequence[str], [], "Test routing: HOST:PORT:ADDR:APORT, dial ADDR:APORT after the checks.")
        loader.add_option("egresslaw_upstream_ca", Optional[str], None, "Test routing: also trust this CA for upstream certificates.")
        loader.add_option("egresslaw_nameservers", Sequence[str], [], "DNS servers (IP[:PORT]) to ask; default: /etc/resolv.conf.")
        loader.add_option("egresslaw_dns_timeout", float, DEFAULTS.dns_timeout, "Seconds a name lookup may take (queueing included) before resolve-failed.")
        loader.add_option("egresslaw_dns_concurrency", int, DEFAULTS.dns_concurrency, "Names looked up at once (A and AAAA each); more wait for a slot.")
        # Request-side limits (docs/proxy.md "Limits"); the idle timeout is mitmproxy's own `tcp_timeout`.
        d = DEFAULTS
        loader.add_option("egresslaw_max_head_bytes", int, d.max_head_bytes, "Largest request head (request line + headers) in bytes (431).")
        loader.add_option("egresslaw_max_headers", int, d.max_headers, "Most header fields in a request (431).")
        loader.add_option("egresslaw_max_request_line", int, d.max_request_line, "Longest request line (HTTP/2: method + :path) in bytes (414).")
        loader.add_option("egresslaw_max_body", int, d.max_body, "Largest request body in bytes, unless egresslaw_max_body_for names it (413).")
        loader.add_option("egresslaw_max_body_for", Sequence[str], [], "NAME=SIZE or NAME/RULE=SIZE: the body limit of a connection or profile (or one of its rules).")
        loader.add_option("egresslaw_max_connections_per_client", int, d.max_connections_per_client, "Most open connections from one client address (429).")
        loader.add_option("egresslaw_max_connections", int, d.max_connections, "Most open client connections in total; 0 derives it from the descriptor limit (503).")
        loader.add_option("egresslaw_header_timeout", float, d.header_timeout, "Seconds from the first byte of a request head (or from accept) to its end (408).")
        for name, kind, text in BOUNDS:
            loader.add_option(f"egresslaw_{name}", float if kind == "seconds" else int, getattr(d, name), text[0].upper() + text[1:] + ".")
        loader.add_option("egresslaw_max_response", str, DEFAULTS.max_response, "Cap on a credentialed response body as received (e.g. 512m, 1g).")
        loader.add_option("egresslaw_rule_max_response", Sequence[str], [], "CONNECTION/RULE=SIZE: the response cap of one rule.")
        loader.add_option("egresslaw_max_decoded", str, DEFAULTS.max_decoded, "Cap on a credentialed response body once decoded.")

    def configure(self, updated: set[str]) -> None:
        opts = ctx.options
        if not opts.egresslaw_artifact:
            return  # not configured yet: every request is denied (no policy)
        self._opts = opts
        for name, want in REQUIRED_OPTIONS.items():
            have = getattr(opts, name)
            if (list(have) if isinstance(have, (list, tuple)) else have) != want:
                raise exceptions.OptionsError(f"egresslaw needs mitmproxy option `{name}` = `{want}`, not `{have}`")
        if not any(name.startswith("egresslaw_") for name in updated):
            return
        if not (opts.egresslaw_artifact and opts.egresslaw_proof and opts.egresslaw_keys and opts.egresslaw_audit_log):
            raise exceptions.OptionsError("egresslaw needs an artifact, a proof, a keys directory and an audit log")
        try:
            self.limits.config = limit_config(
                max_head_bytes=opts.egresslaw_max_head_bytes, max_headers=opts.egresslaw_max_headers,
                max_request_line=opts.egresslaw_max_request_line, max_body=opts.egresslaw_max_body,
                max_body_for=opts.egresslaw_max_body_for, max_connections_per_client=opts.egresslaw_max_connections_per_client,
                max_connections=opts.egresslaw_max_connections, header_timeout=opts.egresslaw_header_timeout,
                **{name: getattr(opts, f"egresslaw_{name}") for name, _, _ in BOUNDS},
            )
        except LimitError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        try:
            layers.install(self)
        except layers.LayerError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        try:
            received, decoded, per_rule = parse_response_caps(opts.egresslaw_max_response, opts.egresslaw_max_decoded,
                                                              opts.egresslaw_rule_max_response)
            self.responses.caps = ResponseCaps(received, decoded, MappingProxyType(dict(per_rule)))
            self.resolve_map = parse_resolve(opts.egresslaw_resolve)
            self.upstreams.connect_to = parse_connect_to(opts.egresslaw_connect_to)
            self.dns, self.resolve_timeout = make_resolver(opts) if self._resolver is None else (None, opts.egresslaw_dns_timeout)
            # Test routing with no nameserver of its own answers only the names it lists (never the system resolver).
            self._closed_world = bool(self.resolve_map) and self._resolver is None and not opts.egresslaw_nameservers
            self.policy = load_policy(opts.egresslaw_artifact, opts.egresslaw_proof, allow_unproven=opts.egresslaw_allow_unproven,
                                      trust_proofs=opts.egresslaw_trust_proofs, allow_unsigned=opts.egresslaw_allow_unsigned_proofs,
                                 require_within=opts.egresslaw_require_within)
            check_rule_caps(dict(per_rule), self.policy.artifact)
            self.binding.lease_keys = load_lease_key_file(opts.egresslaw_keys)
            if self._custody_override is None:
                self.custody = open_custody(opts.egresslaw_store, opts.egresslaw_keys, self.policy.artifact)
            self.attacher.setup(tls=verified_context(opts.ssl_verify_upstream_trusted_ca), clock=self.clock)
            try:
                sync_requests, sync_seconds = parse_sync(opts.egresslaw_audit_sync)
            except ValueError as exc:
                raise AuditError(str(exc)) from None
            if self.audit is None or str(self.audit.path) != opts.egresslaw_audit_log:
                if self.audit is not None:
                    self.audit.close()
                self.audit = AuditLog(opts.egresslaw_audit_log, load_audit_key_file(opts.egresslaw_keys), sync_requests=sync_requests,
                                      sync_seconds=sync_seconds, rotate_bytes=opts.egresslaw_audit_max_bytes, rotate_seconds=opts.egresslaw_audit_max_age)
            else:
                self.audit.rotate_bytes, self.audit.rotate_seconds = opts.egresslaw_audit_max_bytes, opts.egresslaw_audit_max_age
                self.audit.sync_requests, self.audit.sync_seconds = sync_requests, sync_seconds
        except AuditError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        except StartupError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        self.test_routing = routing_record(opts.egresslaw_resolve, opts.egresslaw_connect_to, opts.egresslaw_upstream_ca)

    # -- reload ---------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Load the artifact and proof again; swap atomically on success, keep the old one serving on failure."""
        opts = self._opts if self._opts is not None else ctx.options
        stamps = file_stamps(opts.egresslaw_artifact, opts.egresslaw_proof)
        try:
            policy = load_policy(opts.egresslaw_artifact, opts.egresslaw_proof, allow_unproven=opts.egresslaw_allow_unproven,
                                 trust_proofs=opts.egresslaw_trust_proofs, allow_unsigned=opts.egresslaw_allow_unsigned_proofs,
                                 require_within=opts.egresslaw_require_within)
        except Exception as exc:  # any failure keeps the old policy serving
            self._refused_stamps = stamps  # the watcher waits for the artifact or its proof to change again
            message = str(exc) if isinstance(exc, StartupError) else exc.__class__.__name__
            log.error("reload refused, still serving artifact `%s`: %s", self.policy.artifact.digest[:12] if self.policy else "-", message)
            self.reload_refused(message)
            return False
        old = self.policy
        self._refused_stamps = None
        self.adopt(policy)
        log.info("reloaded artifact `%s` (was `%s`)", policy.artifact.digest[:12], old.artifact.digest[:12] if old else "-")
        return True

    def adopt(self, policy: Policy) -> None:
        """Serve `policy` from now on, counted and audited (a reload that passed the gate, here or in the supervisor
        of `--workers`)."""
        self.policy = policy  # INVARIANT: one reference swap; flows keep the Policy they started with
        if self.attacher.broker is not None:
            self.attacher.broker.forget()  # kinds, endpoints and handles may have changed: mint again under the new artifact
        self._count_reload("ok")
        if self.metrics is not None:
            self.metrics.serving(policy.artifact.digest, policy.proved)
        self._emit(Event.of({"kind": "reload", "decision": "allow", "reason": "reloaded", "artifact": policy.artifact.digest}))

    def reload_refused(self, message: str) -> None:
        """Keep serving the current policy: the refused reload is counted and audited."""
        self._count_reload("failed")
        self._emit(Event.of({"kind": "reload", "decision": "deny", "reason": "reload-failed", "detail": message}))

    def artifact_changed(self) -> bool:
        """True when the artifact file on disk is not the one loaded (inode, size or mtime differ) and has settled
        (the same at the previous look: a file rewritten in place is not read half-written, and one rewrite is one
        reload), unless a reload of exactly these artifact and proof files was refused already (then: once either
        changes)."""
        if self.policy is None:
            return False
        opts = self._opts if self._opts is not None else ctx.options
        stamps = file_stamps(self.policy.path, opts.egresslaw_proof)
        previous, self._last_look = self._last_look, stamps
        if stamps[0] is None or stamps == self._refused_stamps:
            return False
        return stamps[0] != self.policy.stamp and stamps == previous

    def _count_reload(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.reload(result)

    # -- lifecycle ------------------------------------------------------------------------------

    def running(self) -> None:
        self.is_running = True  # mitmproxy calls this after it tried to set up its listeners
        try:
            self.limits.watch_descriptors(asyncio.get_running_loop())
        except Exception:
            log_internal("cannot watch for descriptor exhaustion")
        if self._watch is None:
            self._watch = RefusalWatch(self.gate.audit_malformed)
            self._watch.install()
        try:
            server = self.upstreams.proxyserver = ctx.master.addons.get("proxyserver")
            for addr in server.listen_addrs():
                self.own_addresses.add((str(addr[0]), int(addr[1])))
        except Exception:  # pragma: no cover - listeners are also checked at every pin
            log_internal("cannot read the proxy's listen addresses")

    def done(self) -> None:
        """Shutdown (after the edge drained): the flows still open get their closing event, then the log closes."""
        if self._done:
            return
        self._done = True
        if self._watch is not None:
            self._watch.uninstall()
            self._watch = None
        self.start_draining()
        for state in list(self._flows.values()):
            if state.flow is None:
                continue  # a CONNECT still in http_connect: it writes its own event
            try:
                self._fail(state, "shutdown", "draining")
                self._finish(state.flow, kind="request")
            except Exception:
                log_internal("cannot audit a flow open at shutdown")
        try:
            if self.audit is not None and not self.audit.close():
                log.error("audit log `%s` was not closed cleanly: %s", self.audit.path, self.audit.error or "the writer did not finish in time")
        except Exception:
            log_internal("cannot close the audit log")

    def next_layer(self, nextlayer) -> None:
        try:
            self.limits.install(nextlayer)  # our HTTP layer: limits enforced as bytes arrive
        except Exception:
            log_internal("internal error in next_layer; closing the connection")
            nextlayer.layer = ClosingLayer(nextlayer.context)  # never mitmproxy's own layer, which has no limits

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def start_draining(self) -> None:
        """From now on, allowed requests that arrive get 503 `draining`; those already in flight go on."""
        if self.draining_since is None:
            self.draining_since = self._now()

    def in_flight(self) -> int:
        """Requests (and CONNECTs) decided or being decided whose closing event is not written yet."""
        return len(self._flows)

    def client_connected(self, client) -> None:
        try:
            record = self._client(client)
            if self.metrics is not None and not record.counted:
                record.counted = True
                self.metrics.connection(+1)
            refused = self.limits.connected(client)  # before anything is read: connection caps
            if refused is not None:
                self.limits.refuse_connection(client, *refused)
                self.gate.audit_refusal(None, refused[0], refused[1], "connection")
                return
            record.peername = client.peername
        except Exception:
            log_internal("internal error in client_connected; closing the connection")
            client.error = "egresslaw: internal-error"

    def client_disconnected(self, client) -> None:
        try:
            record = self._clients.pop(client.id, None)  # INVARIANT: the one place a client's state is forgotten
            if record is not None and record.counted and self.metrics is not None:
                self.metrics.connection(-1)
            self.limits.disconnected(client)
            # A request mitmproxy dropped without a response or error hook (the client left while it was decided
            # or forwarded, or HTTP/1 request trailers, which its reader refuses) still gets its closing event.
            for state in [s for s in self._flows.values() if s.flow is not None and s.flow.client_conn.id == client.id]:
                self._fail(state, "client-disconnected", "client-disconnected")
                self._finish(state.flow, kind="request")
            layers.forget_client(client.id)
        except Exception:
            log_internal("internal error in client_disconnected")

    def _client(self, conn: Any) -> Client:
        """The record of client connection `conn`, made by the first hook that needs it (`client_connected`, in a
        running proxy). A connection that has already gone gets a record nothing keeps: no state outlives its
        `client_disconnected` (mitmproxy marks the connection ended before that hook)."""
        record = self._clients.get(conn.id)
        if record is None:
            record = Client(conn.id)
            if conn.timestamp_end is None:
                self._clients[conn.id] = record
        return record

    def _rapid_reset(self, cid: str) -> None:
        """limits.py is closing a client connection for rapid resets: refused for good (no dial, no request)."""
        record = self._clients.get(cid)
        if record is not None and record.refused is None:
            record.refused = "rapid-reset"

    # -- CONNECT --------------------------------------------------------------------------------

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        state = FlowState(started=self._now())
        self._flows[flow.id] = state
        try:
            await self._connect(flow, state)
            if flow.response is None and not state.denied:
                state.reason = "allowed"
                await self._write_ahead(flow, state, "connect")
        except Exception:
            log_internal("internal error in http_connect; denying")
            deny(flow, state, "internal-error")
        if flow.response is not None and state.tunnel:
            self._client(flow.client_conn).tunnel = None  # refused after this CONNECT recorded its tunnel
        self._finish(flow, kind="connect")

    async def _connect(self, flow: http.HTTPFlow, state: FlowState) -> None:
        client = self._client(flow.client_conn)
        if client.tunnel is not None:
            return deny(flow, state, "connect-in-tunnel")
        state.policy = policy = self.policy
        host, port = flow.request.host, flow.request.port
        state.host, state.port = host, port  # known before the lease is judged: a lease denial names its target
        # Judged as sent: mitmproxy has already dropped brackets (`[name]:443`) and leading zeros of the port (`:0443`)
        # from host/port, so its view would admit non-canonical spellings.
        ask = Ask(authority=flow.request.authority or f"{host}:{port}", host=host, port=port,
                  headers=tuple(flow.request.headers.items(multi=True)), has_body=has_body(flow.request),
                  credentials=tuple(flow.request.headers.get_all("proxy-authorization")))
        got = await self._admit(flow, state, policy, ask)
        if got is None:
            return
        name, lease, ips = got.host or host, got.lease, got.answers
        assert lease is not None
        flow.request.host = name  # mitmproxy takes the tunnel's server address from here: the normalized name
        client.tunnel = Tunnel(name, port, lease, ips)
        state.tunnel = True

    # -- requests -------------------------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = FlowState(started=self._now(), flow=flow)
        self._flows[flow.id] = state
        try:
            if flow.error is not None:
                # mitmproxy refused the request itself (framing it will not forward); record why.
                tunnel = tunnel_of(self._clients, flow.client_conn.id)
                state.reason = "connect-in-tunnel" if (tunnel and flow.request.method == "CONNECT") else "smuggling"
                state.denied = True
                return
            await self._request(flow, state)
            if flow.response is None and not state.denied:
                await self._write_ahead(flow, state, "request")  # INVARIANT: the last step before anything goes upstream
        except Exception:
            log_internal("internal error in requestheaders; denying")
            deny(flow, state, "internal-error")
        if flow.response is not None:
            # Refused: the answer goes out at once and the body is dropped unread (egress_proxy/edge/limits.py); no
            # `100 Continue` invites it, and nothing streams.
            flow.request.stream = False
            flow.request.headers.pop("expect", None)

    async def _request(self, flow: http.HTTPFlow, state: FlowState) -> None:
        client = self._client(flow.client_conn)
        if client.refused is not None:
            return deny(flow, state, client.refused)
        tunnel = client.tunnel
        state.tunnel = tunnel is not None
        req = flow.request
        state.path = strip_query(req.path)
        too_big = request_problem(req, self.limits.config)  # before the lease: what the head costs is not its sender's
        if too_big is not None:
            return self._deny_limit(flow, state, too_big[1], too_big[0])
        if len(self._flows) > self.limits.config.max_streams_total:  # (this one included: every request in flight)
            return self._deny_limit(flow, state, "streams-at-capacity", 503)
        state.policy = policy = self.policy
        if tunnel is not None:
            state.lease = tunnel.lease
            state.host, state.port = tunnel.host, tunnel.port
            if tunnel.lease.exp <= self.clock():
                return deny(flow, state, "lease-expired")  # (before anything else it says, as admit() would)
            if self.binding.offers_other_lease(flow, tunnel.lease):
                return deny(flow, state, "lease-mismatch")
            if req.method == "CONNECT":
                return deny(flow, state, "connect-in-tunnel")
        else:
            state.host, state.port = req.host, req.port  # known before the lease is judged
        if policy is not None and not policy.proved:
            log.warning("serving an unproven artifact (--allow-unproven)")
        host, port = (tunnel.host, tunnel.port) if tunnel else (req.host, req.port)
        request = Request(
            # As sent: mitmproxy's `method` property upper-cases, but the wire (and so the upstream) keeps `get`.
            method=req.data.method.decode("utf-8", "surrogateescape"),
            scheme=req.scheme,  # type: ignore[arg-type]
            host=host,
            port=port,
            target=req.path,
            headers=tuple(req.headers.items(multi=True)),  # (name, value) text pairs
            # Inside a tunnel mitmproxy keeps an absolute-form target as sent (and would forward it so): its
            # authority must name the tunnel's host and port exactly like a Host header.
            host_header=req.authority if (tunnel is not None and req.authority) else req.host_header,
            tunnel=tunnel is not None,
            has_body=has_body(req, self.limits.ended(req)),
            inner_port=req.port if tunnel is not None else None,
        )
        ask = Ask(request=request, headers=request.headers, has_body=request.has_body,
                  credentials=() if tunnel is not None else tuple(req.headers.get_all("proxy-authorization")))
        got = await self._admit(flow, state, policy, ask, tunnel)
        if got is None:
            return
        lease, decision, host = got.lease, got.decision, got.host or host
        assert lease is not None and decision is not None
        state.path = decision.path or state.path
        if tunnel is None:
            req.data.host = host  # the normalized name the pin is keyed on (the Host header is left alone)
        try:
            attached = await self.attacher.attach(state)
        except CustodyUnavailable:
            # The shared custody database is unreachable: fail closed with its own reason, nothing goes upstream.
            return deny(flow, state, "custody-unavailable")
        except CustodyError as exc:
            if exc.io:
                raise  # the store itself failed (a corrupt file): internal-error, fail closed
            # No record at the connection's address (or one that does not open): its message names the address, never a value.
            log.warning("deny credential-unavailable connection `%s`: %s", printable(carrier_of(lease, decision) or "-"), exc.message)
            return deny(flow, state, "credential-unavailable")
        except CredentialError as exc:
            # Nothing to attach (a mint refused, a record that does not fit its kind): nothing goes upstream. The
            # denial names the provider's status, never its body.
            log.warning("deny %s connection `%s`: %s", exc.reason, printable(carrier_of(lease, decision) or "-"), exc.message)
            state.provider_status, state.cause = exc.provider_status, exc.cause
            return deny(flow, state, exc.reason)
        if flow.client_conn.timestamp_end is not None:
            return deny(flow, state, "client-disconnected")  # it left while the credential was minted
        if not self._admit_body(flow, state, lease, decision, attached):
            return
        try:
            refused = self.attacher.prepare(flow, state, attached, has_body(req, self.limits.ended(req)))
        except CredentialError as exc:
            state.cause = exc.cause
            return deny(flow, state, exc.reason)
        if refused is not None:
            return deny(flow, state, refused)
        if flow.response is not None:
            return
        state.reason = "allowed"
        # WRITE-AHEAD POINT: the decision is final here; a streamed request's head goes upstream as soon as this
        # hook returns, anything else after `request`. The one await for the decision event's durability goes here.

    def _admit_body(self, flow: http.HTTPFlow, state: FlowState, lease: Lease, decision: Decision, attached: Attached | None) -> bool:
        """Hold the request's body to its limit (413 for a declared size over it) and stream it instead of buffering
        (unless its credential signs the body's hash: then it is held whole, to the smaller limit, and signed in
        `request`)."""
        req = flow.request
        if not has_body(req, self.limits.ended(req)):
            return True
        limit = self.limits.config.body_limit(lease.connection or lease.profile, decision.rule)
        if decision.broker is not None:
            # Brokered: the connection's traffic, so its (rule's) limit holds too, as does the profile's own.
            limit = min(limit, self.limits.config.body_limit(decision.broker, decision.rule))
        hashed = attached is not None and attached.hash_body
        if hashed:
            limit = min(limit, MAX_HASHED_BODY)
        length = declared_length(req)
        if length is not None and length > limit:
            self._deny_limit(flow, state, "body-too-large", 413)
            return False
        self.limits.set_body_limit(flow, limit)  # egress_proxy/edge/limits.py cuts a body that goes over it
        if hashed or (length is None and not req.headers.get("transfer-encoding")):
            # HTTP/2 without content-length, or a body a signature hashes: held (to the limit), framed in `request`
            state.buffered = True
            return True

        def count(chunk: bytes) -> bytes:
            state.uploaded += len(chunk)
            return chunk

        state.streaming = True
        req.stream = count
        return True

    def _deny_limit(self, flow: http.HTTPFlow, state: FlowState, reason: str, status: int) -> None:
        """A limit refusal (408/413/414/431): our JSON with its own status; the connection closes after it."""
        tunnel = tunnel_of(self._clients, flow.client_conn.id)
        if tunnel is not None and state.lease is None:
            state.lease, state.host, state.port = tunnel.lease, tunnel.host, tunnel.port
        state.denied = True
        state.reason = reason
        flow.response = denial_response(status, reason)
        state.injected = ()

    def _stalled(self, flow: http.HTTPFlow) -> None:
        """limits.py reset a stream whose client took nothing for --stall-timeout: that is the outcome's failure."""
        state = self._flows.get(flow.id)
        if state is not None and state.failure is None:
            state.failure = "client-stalled"
            log.warning("reset a stream from %s: its client took nothing queued for it in %gs", printable(state.host or "-"),
                        self.limits.config.stall_timeout)

    def _refuse_mid_body(self, flow: http.HTTPFlow, reason: str, status: int) -> http.Response | None:
        """limits.py found a body over its limit (or trailers) after the decision: the flow becomes that refusal."""
        state = self._flows.get(flow.id)
        if state is None:
            return None  # already answered and audited
        self._deny_limit(flow, state, reason, status)
        return flow.response

    def request(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None:
            if flow.response is None and not flow.metadata.get(AUDITED):
                # INVARIANT: nothing goes upstream that requestheaders did not decide.
                try:
                    state = FlowState(started=self._now(), flow=flow)
                    self._flows[flow.id] = state
                    deny(flow, state, "internal-error")
                except Exception:  # the backstop itself must not fail open
                    log_internal("internal error in request; denying without state")
                    flow.response = denial("internal-error")
            return
        if flow.response is not None or state.denied or state.streaming:
            return  # a streamed request went upstream as it came: limits.py held its body and trailers
        try:
            req = flow.request
            if req.trailers:
                return deny(flow, state, "trailers-denied")
            if state.buffered:
                req.headers["content-length"] = str(len(req.raw_content or b""))
            if state.signing is not None:
                self.attacher.sign(flow, state, req.raw_content or b"")  # the body is whole: its hash is signed
        except CredentialError as exc:
            deny(flow, state, exc.reason)
        except Exception:
            log_internal("internal error in request; denying")
            deny(flow, state, "internal-error")

    # -- mitmproxy's layers call back here (egress_proxy.edge.layers) ---------------------------------

    def owns(self, flow: Any) -> bool:
        return flow.id in self._flows

    def protocol_error(self, flow: Any, code: Any, to_client: bool, reason: str | None = None) -> str | None:
        """A protocol error reached this flow's stream (its error hook comes next): remember mitmproxy's code,
        whether mitmproxy answers it to the client and the reason egresslaw's layers gave it (a bound the upstream
        broke, a stall); the reason that answer names (None: the default)."""
        state = self._flows.get(flow.id)
        if state is None:
            return None
        state.error_code, state.error_to_client = code, to_client
        if reason is not None and reason != "upstream-error" and state.failure is None:
            state.failure = reason
        if state.failure is not None:
            return state.failure
        return state.reason if state.denied and state.reason in REASONS else None

    # -- helpers --------------------------------------------------------------------------------

    def _now(self) -> float:
        """The injected clock for timing; never raises (a hook must not fail before its guard: that fails open)."""
        try:
            return float(self.clock())
        except Exception:
            log_internal("the clock failed; timing this flow with the system clock")
            return time.time()

    async def _admit(self, flow: http.HTTPFlow, state: FlowState, policy: Policy | None, ask: Ask, tunnel: Tunnel | None = None) -> Admission | None:
        """The one admission (`egress_proxy.front.admit`) with this client connection's hooks; None after a denial."""
        if policy is None:
            deny(flow, state, "internal-error")
            return None
        hooks = self.binding.hooks(flow.client_conn)
        if tunnel is not None:
            got = await admit(policy.artifact, ask, hooks, lease=tunnel.lease, answers=tunnel.ips)
        else:
            got = await admit(policy.artifact, ask, hooks)
        state.auth = got.auth if tunnel is None else state.auth
        if got.lease is not None:
            state.lease = got.lease
        if got.host is not None:
            state.host = got.host
        if got.decision is not None:
            state.decision = got.decision
        if not got.allowed:
            deny(flow, state, got.reason, got.decision)
            return None
        return got

    async def _resolve(self, host: str, port: int) -> Sequence[str]:
        """Every address of `host` by test routing, the configured resolver or the system's; a lookup that outlives
        `resolve_timeout` fails."""
        return await asyncio.wait_for(routed(host, port, listed=self.resolve_map, resolver=self._resolver or self.dns or system_resolver,
                                             closed=self._closed_world), self.resolve_timeout)
