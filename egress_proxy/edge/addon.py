"""The mitmproxy addon: one class that adapts flows to the pure decision functions and back.

Every hook is guarded: an exception inside a hook denies (mitmproxy itself would log it and
forward the request, i.e. fail open). Decisions come from `egress_proxy.decision.adapter`
(`decide_connect`, `decide_without_addresses`, `judge_answers`, `decide`: the functions `egresslaw explain`
calls too), through the one admission `egress_proxy.front.admit`. This module holds the options, the reload and the
lifecycle of the edge, its client records, and the hook table; its audit trail is `egress_proxy.edge.events.AuditTrail`
(a mixin), and the state records every part shares are in `egress_proxy.edge.flows`.

The rest is answered by collaborators, each given what it takes at construction (never the addon), and the class's
hook table (`Hook` rows) hands their hooks to them by name:
- `gate` (`edge.gate.TunnelGate`): TLS and raw bytes inside a tunnel, refusals that have no flow;
- `upstreams` (`edge.upstreams.Upstreams`): pins, the dial of each server connection, reuse keys, closing upstreams;
- `binding` (`edge.binding.LeaseBinding`): the admission's hooks for a client connection (its claim on one lease);
- `attacher` (`edge.attach.Attacher`): the credential a request carries (custody, mints), its head, its signature;
- `requests` (`edge.requests.RequestPath`): CONNECTs and requests admitted, bodies bounded, decisions written ahead;
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

from mitmproxy import ctx, exceptions
from mitmproxy.utils import human

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import (
    AuditError,
    AuditLog,
    parse_sync,
)
from egress_proxy.credentials.exchange import verified_context
from egress_proxy.edge import layers
from egress_proxy.edge.attach import Attacher
from egress_proxy.edge.binding import LeaseBinding
from egress_proxy.edge.events import AuditTrail
from egress_proxy.edge.flows import (
    Client,
    FlowState,
    log_internal,
)
from egress_proxy.edge.gate import RefusalWatch, TunnelGate
from egress_proxy.edge.limits import (
    ClosingLayer,
    LimitError,
    Limits,
    limit_config,
)
from egress_proxy.edge.requests import RequestPath
from egress_proxy.edge.responses import ResponseCaps, ResponsePath
from egress_proxy.edge.startup import check_rule_caps, make_resolver, open_custody, parse_response_caps
from egress_proxy.edge.upstreams import Upstreams
from egress_proxy.front.resolver import AsyncResolver, routed
from egress_proxy.front.settings import BOUNDS, DEFAULTS
from egress_proxy.front.startup import Policy, Resolver, StartupError, check_assumed_limits, file_stamps, load_audit_key_file, load_lease_key_file, load_policy, open_budget, parse_connect_to, parse_resolve, routing_record

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
        ledger: Any = None,
        clock: Callable[[], float] = time.time,
        metrics: Any = None,
    ) -> None:
        self._resolver = resolver
        self._closed_world = False
        self.dns: Resolver | None = None  # the AsyncResolver built from the egresslaw_dns_* options (unless `resolver` is injected)
        self.resolve_timeout = DEFAULTS.dns_timeout  # a lookup that takes longer is a failed lookup (resolve-failed)
        self._custody_override = custody
        self.custody: Any = custody
        self._ledger_override = ledger
        self.ledger: Any = ledger  # the budget ledger (front.budget.LazyLedger, or a ledger given): kept across reloads
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
        self.binding = LeaseBinding(record=self._client, resolve=self._resolve, pin=self.upstreams.pin, clock=lambda: self.clock(),
                                    ledger=lambda: self.ledger)
        self.requests = RequestPath(flows=self._flows, clients=self._clients, record=self._client, limits=self.limits,
                                    policy=lambda: self.policy, clock=lambda: self.clock(), now=self._now, binding=self.binding,
                                    attacher=self.attacher, write_ahead=self._write_ahead, finish=self._finish)
        self.responses = ResponsePath(flows=self._flows, limits=self.limits, attacher=self.attacher, upstreams=self.upstreams,
                                      now=self._now, finish=self._finish,
                                      caps=ResponseCaps(human.parse_size(DEFAULTS.max_response), human.parse_size(DEFAULTS.max_decoded)))
        self.limits.on_refusal = self.gate.audit_refusal
        self.limits.on_flow_refusal = self.requests.refuse_mid_body
        self.limits.on_response_refusal = self.responses.refuse_held
        self.limits.on_stall = self.requests.stalled
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
    http_connect = Hook("requests")  # a CONNECT admitted (its tunnel recorded) or denied, its event written
    requestheaders = Hook("requests")  # a request head admitted, its credential attached, its decision written ahead
    request = Hook("requests")  # the whole body: trailers refused, a held body framed and signed
    owns = Hook("requests")  # (layers) this addon's flow
    protocol_error = Hook("requests")  # (layers) a protocol error on a flow's stream: its code and reason recorded
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
        loader.add_option("egresslaw_budget_store", str, DEFAULTS.budget_store, "The budget ledger: a SQLite file or a postgresql:// URL "
                          "(opened when the artifact declares a budget).")
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
            check_assumed_limits(self.policy, self.limits.config)  # the proof's capacity figures assumed at most these
            check_rule_caps(dict(per_rule), self.policy.artifact)
            self.binding.lease_keys = load_lease_key_file(opts.egresslaw_keys)
            if self._custody_override is None:
                self.custody = open_custody(opts.egresslaw_store, opts.egresslaw_keys, self.policy.artifact)
            if self._ledger_override is None:
                self.ledger = open_budget(opts.egresslaw_budget_store, self.policy.artifact, self.ledger)
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
            check_assumed_limits(policy, self.limits.config)
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
        if self._ledger_override is None and self.ledger is not None:
            try:
                self.ledger.close()
            except Exception:
                log_internal("cannot close the budget ledger")

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

    # -- helpers --------------------------------------------------------------------------------

    def _now(self) -> float:
        """The injected clock for timing; never raises (a hook must not fail before its guard: that fails open)."""
        try:
            return float(self.clock())
        except Exception:
            log_internal("the clock failed; timing this flow with the system clock")
            return time.time()

    async def _resolve(self, host: str, port: int) -> Sequence[str]:
        """Every address of `host` by test routing, the configured resolver or the system's; a lookup that outlives
        `resolve_timeout` fails."""
        return await asyncio.wait_for(routed(host, port, listed=self.resolve_map, resolver=self._resolver or self.dns or system_resolver,
                                             closed=self._closed_world), self.resolve_timeout)
