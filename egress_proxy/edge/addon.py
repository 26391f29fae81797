"""The mitmproxy addon: one class that adapts flows to the pure decision functions and back.

Every hook is guarded: an exception inside a hook denies (mitmproxy itself would log it and
forward the request, i.e. fail open). Decisions come from `egress_proxy.decision.adapter` and
`egress_proxy.decision.addresses`; this module only translates, resolves, pins, injects, scans and audits.

Where state lives (never in flow metadata, which other addons and dumps can read):
- `_tunnels[client id]`: the CONNECT target, its lease and its vetted answers;
- `_pins[(client id, host, port)]`: the vetted address a server connection must dial;
- `_flows[flow id]`: per-request bookkeeping until its closing audit event (a denial, or the outcome of an
  allow whose decision event was written ahead) is queued;
- `_needles[flow id]`: the encodings of the credential injected into that flow, for the response scan.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ipaddress
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mitmproxy import ctx, exceptions, http, tls
from mitmproxy import flow as flow_module
from mitmproxy.connection import ConnectionState
from mitmproxy.net.http.http1 import expected_http_body_size
from mitmproxy.proxy import server_hooks
from mitmproxy.utils import human

from compiler.normalize import HostError, normalize_host
from egress_proxy.audit.log import (
    AuditError,
    AuditLog,
    AuditUnavailable,
    parse_sync,
    strip_query,
)
from egress_proxy.custody import lease as leases
from egress_proxy.custody.keys import KeyFileError
from egress_proxy.custody.records import Address, CustodyUnavailable
from egress_proxy.decision.adapter import (
    decide,
    decide_connect,
    decide_without_addresses,
    judge_answers,
)
from egress_proxy.decision.reasons import REASONS
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.edge import layers
from egress_proxy.edge.denials import (
    denial,
    denial_response,
    error_answer,
)
from egress_proxy.edge.limits import (
    ClosingLayer,
    LimitError,
    Limits,
    declared_length,
    limit_config,
    request_problem,
)
from egress_proxy.edge.resolver import AsyncResolver
from egress_proxy.edge.scanner import (
    BodyScanner,
    Needles,
    ScanError,
    codings,
    redact,
    scan_whole,
)
from egress_proxy.edge.settings import DEFAULTS
from egress_proxy.edge.startup import (
    Policy,
    Resolver,
    StartupError,
    check_rule_caps,
    file_stamps,
    load_audit_key_file,
    load_lease_key_file,
    load_policy,
    make_resolver,
    open_custody,
    parse_connect_to,
    parse_resolve,
    parse_response_caps,
)

log = logging.getLogger("egresslaw.proxy")


REDIRECT_HEADER = "X-Egresslaw-Redirect"
SMALL_BODY = 64 * 1024  # a credentialed body declared this small is buffered and scanned whole, not streamed
OUR_PREFIX = b"x-egresslaw-"
AUDITED = "egresslaw.audited"
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


@dataclass(slots=True)
class Tunnel:
    host: str
    port: int
    lease: Lease
    ips: tuple[str, ...]
    refused: str | None = None  # a reason found at the TLS client hello


@dataclass(slots=True)
class FlowState:
    started: float
    flow: Any = None
    policy: Policy | None = None
    lease: Lease | None = None
    host: str | None = None
    port: int | None = None
    path: str | None = None
    decision: Decision | None = None
    reason: str | None = None
    denied: bool = False
    tunnel: bool = False
    redactions: int = 0
    streamed: int = 0  # body bytes the client was sent (decoded and redacted for connection traffic)
    auth: str | None = None  # the Proxy-Authorization scheme offered (none|bearer|basic|other), never its value
    uploaded: int = 0  # bytes of a streamed request body
    streaming: bool = False  # the request body goes upstream as it arrives (head sent after requestheaders)
    buffered: bool = False  # an HTTP/2 body without content-length: held (to its limit) and framed in `request`
    failed: bool = False  # a response-side hook failed: the response is replaced by a denial
    audit_ticket: int | None = None  # set once the allow decision event is queued: from then on only an outcome follows
    client_status: int | None = None  # the status the client got, when no flow.response says it
    # What the client got, once known (the audit's status), and what failed on the response side.
    status: int | None = None
    answered: bool = False  # `status` and `streamed` are final
    head_sent: bool = False  # the response head went out before the body (streaming)
    head_scanned: bool = False
    failure: str | None = None  # what went wrong after an allow (a reason code: the outcome event's `failure`)
    aborted: bool = False  # the client got a head and a cut body
    error_code: Any = None  # mitmproxy's ErrorCode of a protocol error on this flow's stream
    error_to_client: bool = False  # mitmproxy answers that error to the client (our JSON, egress_proxy.edge.layers)
    needles: Needles | None = None  # the credential's encodings, prepared once for this response


class EgressLaw:
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
        self.dns: Resolver | None = None  # the AsyncResolver built from the egresslaw_dns_* options (unless `resolver` is injected)
        self.resolve_timeout = DEFAULTS.dns_timeout  # a lookup that takes longer is a failed lookup (resolve-failed)
        self._custody_override = custody
        self.custody: Any = custody
        self.clock = clock
        self.metrics = metrics
        self.policy: Policy | None = None
        self.audit: AuditLog | None = None
        self.lease_keys: Any = None  # keys.LeaseKeyFile: re-read when `keys rotate --lease` replaces it
        self._verified = leases.VerifiedLeases()  # tokens that verified, checked again only for time and key set
        self.resolve_map: dict[str, tuple[str, ...]] = {}
        self.connect_to: dict[tuple[str, int], tuple[str, int]] = {}
        self.test_routing: dict[str, Any] = {}
        self.own_addresses: set[tuple[str, int]] = set()
        self._tunnels: dict[str, Tunnel] = {}
        self._pins: dict[tuple[str, str, int], tuple[str, int]] = {}
        self._vetted: dict[tuple[str, str, int], tuple[str, ...]] = {}
        self._restore: dict[str, tuple[str, int]] = {}
        self._flows: dict[str, FlowState] = {}
        self._needles: dict[str, tuple[bytes, ...]] = {}
        self._refused_clients: dict[str, str] = {}
        self._bound: dict[str, tuple[str, str | None, str | None]] = {}  # client id -> the lease identity it is bound to
        self._opts: Any = None
        self._peers: dict[Any, str] = {}  # client peername -> client id (to audit refusals mitmproxy only logs)
        self._watch: _RefusalWatch | None = None
        self._proxyserver: Any = None
        self.max_response: int | None = human.parse_size(DEFAULTS.max_response)
        self.max_decoded: int | None = human.parse_size(DEFAULTS.max_decoded)
        self.rule_max_response: dict[str, int | None] = {}
        self._needle_sets: collections.OrderedDict[tuple[bytes, ...], Needles] = collections.OrderedDict()  # a few credentials' prepared needles
        self.is_running = False
        self.limits = Limits()
        self.limits.on_refusal = self.audit_refusal
        self.limits.on_flow_refusal = self._refuse_mid_body
        self.draining_since: float | None = None  # shutdown began: requests that arrive after it get 503 `draining`
        self._done = False
        self._refused_stamps: tuple | None = None  # (artifact, proof) file stamps of the last refused reload
        self._last_look: tuple | None = None  # the stamps the artifact watcher saw at its previous look

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
            )
        except LimitError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        try:
            layers.install(self)
        except layers.LayerError as exc:
            raise exceptions.OptionsError(str(exc)) from None
        try:
            self.max_response, self.max_decoded, self.rule_max_response = parse_response_caps(
                opts.egresslaw_max_response, opts.egresslaw_max_decoded, opts.egresslaw_rule_max_response)
            self.resolve_map = parse_resolve(opts.egresslaw_resolve)
            self.connect_to = parse_connect_to(opts.egresslaw_connect_to)
            self.dns, self.resolve_timeout = make_resolver(opts) if self._resolver is None else (None, opts.egresslaw_dns_timeout)
            self.policy = load_policy(opts.egresslaw_artifact, opts.egresslaw_proof, allow_unproven=opts.egresslaw_allow_unproven,
                                      trust_proofs=opts.egresslaw_trust_proofs)
            check_rule_caps(self.rule_max_response, self.policy.artifact)
            self.lease_keys = load_lease_key_file(opts.egresslaw_keys)
            if self._custody_override is None:
                self.custody = open_custody(opts.egresslaw_store, opts.egresslaw_keys)
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
        routing: dict[str, Any] = {}
        if opts.egresslaw_resolve:
            routing["resolve"] = list(opts.egresslaw_resolve)
        if opts.egresslaw_connect_to:
            routing["connect_to"] = list(opts.egresslaw_connect_to)
        if opts.egresslaw_upstream_ca:
            routing["upstream_ca"] = opts.egresslaw_upstream_ca
        self.test_routing = routing

    # -- reload ---------------------------------------------------------------------------------

    def reload(self) -> bool:
        """Load the artifact and proof again; swap atomically on success, keep the old one serving on failure."""
        opts = self._opts if self._opts is not None else ctx.options
        stamps = file_stamps(opts.egresslaw_artifact, opts.egresslaw_proof)
        try:
            policy = load_policy(opts.egresslaw_artifact, opts.egresslaw_proof, allow_unproven=opts.egresslaw_allow_unproven,
                                 trust_proofs=opts.egresslaw_trust_proofs)
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
        self._count_reload("ok")
        if self.metrics is not None:
            self.metrics.serving(policy.artifact.digest, policy.proved)
        self._emit({"kind": "reload", "decision": "allow", "reason": "reloaded", "artifact": policy.artifact.digest})

    def reload_refused(self, message: str) -> None:
        """Keep serving the current policy: the refused reload is counted and audited."""
        self._count_reload("failed")
        self._emit({"kind": "reload", "decision": "deny", "reason": "reload-failed", "detail": message})

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
            _log_internal("cannot watch for descriptor exhaustion")
        if self._watch is None:
            self._watch = _RefusalWatch(self)
            self._watch.install()
        try:
            server = self._proxyserver = ctx.master.addons.get("proxyserver")
            for addr in server.listen_addrs():
                self.own_addresses.add((str(addr[0]), int(addr[1])))
        except Exception:  # pragma: no cover - listeners are also checked at every pin
            _log_internal("cannot read the proxy's listen addresses")

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
                _log_internal("cannot audit a flow open at shutdown")
        try:
            if self.audit is not None and not self.audit.close():
                log.error("audit log `%s` was not closed cleanly: %s", self.audit.path, self.audit.error or "the writer did not finish in time")
        except Exception:
            _log_internal("cannot close the audit log")

    def next_layer(self, nextlayer) -> None:
        try:
            self.limits.install(nextlayer)  # our HTTP layer: limits enforced as bytes arrive
        except Exception:
            _log_internal("internal error in next_layer; closing the connection")
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
            refused = self.limits.connected(client)  # before anything is read: connection caps
            if refused is not None:
                self.limits.refuse_connection(client, *refused)
                self.audit_refusal(None, refused[0], refused[1], "connection")
                return
            self._peers[client.peername] = client.id
        except Exception:
            _log_internal("internal error in client_connected; closing the connection")
            client.error = "egresslaw: internal-error"

    def client_disconnected(self, client) -> None:
        try:
            self.limits.disconnected(client)
            self._peers.pop(client.peername, None)
            self._forget_client(client.id)
            layers.forget_client(client.id)
        except Exception:
            _log_internal("internal error in client_disconnected")

    def _forget_client(self, cid: str) -> None:
        # A request mitmproxy dropped without a response or error hook (the client left while it was decided
        # or forwarded, or HTTP/1 request trailers, which its reader refuses) still gets its closing event.
        for state in [s for s in self._flows.values() if s.flow is not None and s.flow.client_conn.id == cid]:
            self._fail(state, "client-disconnected", "client-disconnected")
            self._finish(state.flow, kind="request")
        self._tunnels.pop(cid, None)
        self._refused_clients.pop(cid, None)
        self._bound.pop(cid, None)
        for key in [k for k in self._pins if k[0] == cid]:
            del self._pins[key]
        for key in [k for k in self._vetted if k[0] == cid]:
            del self._vetted[key]

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
            _log_internal("internal error in http_connect; denying")
            self._deny(flow, state, "internal-error")
        if flow.response is not None and state.tunnel:
            self._tunnels.pop(flow.client_conn.id, None)  # refused after this CONNECT recorded its tunnel
        self._finish(flow, kind="connect")

    async def _connect(self, flow: http.HTTPFlow, state: FlowState) -> None:
        cid = flow.client_conn.id
        if cid in self._tunnels:
            return self._deny(flow, state, "connect-in-tunnel")
        state.policy = policy = self.policy
        host, port = flow.request.host, flow.request.port
        state.host, state.port = host, port  # known before the lease is judged: a lease denial names its target
        lease = self._lease(flow, state)
        if lease is None:
            return
        # Judged as sent: mitmproxy has already dropped brackets (`[name]:443`) and leading zeros of the port (`:0443`)
        # from host/port, so its view would admit non-canonical spellings.
        decision = decide_connect(policy.artifact, lease, flow.request.authority or f"{host}:{port}",
                                  tuple(flow.request.headers.items(multi=True)), _has_body(flow.request))
        if not decision.allowed:
            return self._deny(flow, state, decision.reason, decision)
        name = decision.host or host
        state.host = name
        ips = await self._vet(flow, state, policy, lease, name, port)
        if ips is None:
            return
        flow.request.host = name  # mitmproxy takes the tunnel's server address from here: the normalized name
        self._tunnels[cid] = Tunnel(name, port, lease, ips)
        state.decision = decision
        state.tunnel = True

    # -- TLS inside a tunnel --------------------------------------------------------------------

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        try:
            tunnel = self._tunnels.get(data.context.client.id)
            if tunnel is None:
                # TLS to the proxy itself (not inside a CONNECT) is not a supported transport.
                self._refused_clients[data.context.client.id] = "sni-mismatch"
                return
            hello = data.client_hello
            if any(ext_type in (0xFE0D, 0xFE02) for ext_type, _ in hello.extensions):
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
            _log_internal("internal error in tls_clienthello; refusing the handshake")
            self._refused_clients[data.context.client.id] = "internal-error"

    def tls_start_client(self, data: tls.TlsData) -> None:
        cid = data.context.client.id
        try:
            tunnel = self._tunnels.get(cid)
            reason = self._refused_clients.get(cid) or (tunnel.refused if tunnel else "sni-mismatch")
        except Exception:
            _log_internal("internal error in tls_start_client; refusing the handshake")
            reason = "internal-error"
        if reason is None:
            return
        self._refused_clients[cid] = reason
        # A context with no certificate can complete no handshake: the client sees a TLS alert.
        from OpenSSL import SSL

        data.ssl_conn = SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD))
        data.ssl_conn.set_accept_state()
        self._emit_tunnel_refusal(data.context, reason)

    def _emit_tunnel_refusal(self, context, reason: str) -> None:
        tunnel = self._tunnels.get(context.client.id)
        lease = tunnel.lease if tunnel else None
        self._count("deny", reason, 0.0, "tls")
        log.info("deny %s tls %s:%s", reason, tunnel.host if tunnel else "-", tunnel.port if tunnel else "-")
        self._emit(
            {
                "kind": "tls",
                **self._who(lease),
                "host": tunnel.host if tunnel else None,
                "port": tunnel.port if tunnel else None,
                "decision": "deny",
                "reason": reason,
                "rule": None,
                "status": None,
            }
        )

    def tcp_start(self, flow) -> None:
        # Non-HTTP bytes inside a tunnel would become a raw relay that skips every HTTP check;
        # server_connect refuses to dial for a refused client, whatever happens below.
        cid = flow.client_conn.id
        self._refused_clients[cid] = "non-http-in-tunnel"
        try:
            if flow.killable:
                flow.kill()
            tunnel = self._tunnels.get(cid)
            self._count("deny", "non-http-in-tunnel", 0.0, "tcp")
            self._emit_tcp(tunnel)
        except Exception:
            _log_internal("internal error in tcp_start; its server connection is refused anyway")

    def audit_malformed(self, peername: Any) -> None:
        """A request mitmproxy refused itself (400 or an HTTP/2 protocol error) before any hook: one audit event."""
        cid = self._peers.get(peername)
        if cid is None:
            return  # another proxy's client (several masters can share a process), or already gone
        self.audit_refusal(cid, "malformed-request", 400)

    def audit_refusal(self, cid: str | None, reason: str, status: int | None, kind: str = "request") -> None:
        """One audit event for a refusal that has no flow: a malformed or over-limit head, a connection over a cap."""
        try:
            tunnel = self._tunnels.get(cid) if cid is not None else None
            self._count("deny", reason, 0.0, kind)
            log.info("deny %s %s:%s", reason, tunnel.host if tunnel else "-", tunnel.port if tunnel else "-")
            self._emit({"kind": kind, **self._who(tunnel.lease if tunnel else None), "method": None,
                        "host": tunnel.host if tunnel else None, "port": tunnel.port if tunnel else None, "path": None,
                        "tunnel": tunnel is not None, "decision": "deny", "reason": reason, "rule": None, "status": status})
        except Exception:
            _log_internal("internal error while auditing a refusal")

    def _emit_tcp(self, tunnel: Tunnel | None) -> None:
        self._emit({"kind": "tcp", **self._who(tunnel.lease if tunnel else None), "host": tunnel.host if tunnel else None,
                    "port": tunnel.port if tunnel else None, "decision": "deny", "reason": "non-http-in-tunnel", "rule": None, "status": None})

    def udp_start(self, flow) -> None:
        self.tcp_start(flow)

    # -- requests -------------------------------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = FlowState(started=self._now(), flow=flow)
        self._flows[flow.id] = state
        try:
            if flow.error is not None:
                # mitmproxy refused the request itself (framing it will not forward); record why.
                tunnel = self._tunnels.get(flow.client_conn.id)
                state.reason = "connect-in-tunnel" if (tunnel and flow.request.method == "CONNECT") else "smuggling"
                state.denied = True
                return
            await self._request(flow, state)
            if flow.response is None and not state.denied:
                await self._write_ahead(flow, state, "request")  # INVARIANT: the last step before anything goes upstream
        except Exception:
            _log_internal("internal error in requestheaders; denying")
            self._deny(flow, state, "internal-error")
        if flow.response is not None:
            # Refused: the answer goes out at once and the body is dropped unread (egress_proxy/edge/limits.py); no
            # `100 Continue` invites it, and nothing streams.
            flow.request.stream = False
            flow.request.headers.pop("expect", None)

    async def _request(self, flow: http.HTTPFlow, state: FlowState) -> None:
        cid = flow.client_conn.id
        if cid in self._refused_clients:
            return self._deny(flow, state, self._refused_clients[cid])
        tunnel = self._tunnels.get(cid)
        state.tunnel = tunnel is not None
        req = flow.request
        state.path = strip_query(req.path)
        too_big = request_problem(req, self.limits.config)  # before the lease: what the head costs is not its sender's
        if too_big is not None:
            return self._deny_limit(flow, state, too_big[1], too_big[0])
        if tunnel is not None:
            state.policy = policy = self.policy
            state.lease = lease = tunnel.lease
            state.host, state.port = tunnel.host, tunnel.port
            if lease.exp <= self.clock():
                return self._deny(flow, state, "lease-expired")
            if self._offers_other_lease(flow, lease):
                return self._deny(flow, state, "lease-mismatch")
            if req.method == "CONNECT":
                return self._deny(flow, state, "connect-in-tunnel")
        else:
            state.policy = policy = self.policy
            state.host, state.port = req.host, req.port  # known before the lease is judged
            lease = self._lease(flow, state)
            if lease is None:
                return
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
            has_body=_has_body(req, self.limits.ended(req)),
            inner_port=req.port if tunnel is not None else None,
        )
        if tunnel is None:
            # Everything but the answers first: a request refused anyway resolves nothing.
            pre = decide_without_addresses(policy.artifact, lease, request)
            if not pre.allowed:
                return self._deny(flow, state, pre.reason, pre)
            host = pre.host or host
            state.host = host
            ips = await self._vet(flow, state, policy, lease, host, port)
            if ips is None:
                return
        else:
            ips = tunnel.ips
        decision = decide(policy.artifact, lease, request, list(ips))
        state.decision = decision
        state.path = decision.path or state.path
        if not decision.allowed:
            return self._deny(flow, state, decision.reason, decision)
        if tunnel is None:
            req.data.host = host  # the normalized name the pin is keyed on (the Host header is left alone)
        if not self._admit_body(flow, state, lease, decision):
            return
        try:
            self._prepare_upstream(flow, state)
        except CustodyUnavailable:
            # The shared custody database is unreachable: fail closed with its own reason, nothing goes upstream.
            return self._deny(flow, state, "custody-unavailable")
        if flow.response is not None:
            return
        state.reason = "allowed"
        # WRITE-AHEAD POINT: the decision is final here; a streamed request's head goes upstream as soon as this
        # hook returns, anything else after `request`. The one await for the decision event's durability goes here.

    def _admit_body(self, flow: http.HTTPFlow, state: FlowState, lease: Lease, decision: Decision) -> bool:
        """Hold the request's body to its limit (413 for a declared size over it) and stream it instead of buffering."""
        req = flow.request
        if not _has_body(req, self.limits.ended(req)):
            return True
        limit = self.limits.config.body_limit(lease.connection or lease.profile, decision.rule)
        if decision.broker is not None:
            # Brokered: the connection's traffic, so its (rule's) limit holds too, as does the profile's own.
            limit = min(limit, self.limits.config.body_limit(decision.broker, decision.rule))
        length = declared_length(req)
        if length is not None and length > limit:
            self._deny_limit(flow, state, "body-too-large", 413)
            return False
        self.limits.set_body_limit(flow, limit)  # egress_proxy/edge/limits.py cuts a body that goes over it
        if length is None and not req.headers.get("transfer-encoding"):
            state.buffered = True  # HTTP/2 without content-length: held (to the limit), framed in `request`
            return True

        def count(chunk: bytes) -> bytes:
            state.uploaded += len(chunk)
            return chunk

        state.streaming = True
        req.stream = count
        return True

    def _deny_limit(self, flow: http.HTTPFlow, state: FlowState, reason: str, status: int) -> None:
        """A limit refusal (408/413/414/431): our JSON with its own status; the connection closes after it."""
        tunnel = self._tunnels.get(flow.client_conn.id)
        if tunnel is not None and state.lease is None:
            state.lease, state.host, state.port = tunnel.lease, tunnel.host, tunnel.port
        state.denied = True
        state.reason = reason
        flow.response = denial_response(status, reason)
        self._needles.pop(flow.id, None)

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
                    self._deny(flow, state, "internal-error")
                except Exception:  # the backstop itself must not fail open
                    _log_internal("internal error in request; denying without state")
                    flow.response = denial("internal-error")
            return
        if flow.response is not None or state.denied or state.streaming:
            return  # a streamed request went upstream as it came: limits.py held its body and trailers
        try:
            req = flow.request
            if req.trailers:
                return self._deny(flow, state, "trailers-denied")
            if state.buffered:
                req.headers["content-length"] = str(len(req.raw_content or b""))
        except Exception:
            _log_internal("internal error in request; denying")
            self._deny(flow, state, "internal-error")

    def _prepare_upstream(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """The head the upstream gets (called at the end of requestheaders: a streamed head leaves right after)."""
        req = flow.request
        decision, lease, policy = state.decision, state.lease, state.policy
        if decision is None or lease is None or policy is None or not decision.allowed:
            return self._deny(flow, state, "internal-error")  # INVARIANT: only decided flows go upstream
        framing = _framing(req, _has_body(req, self.limits.ended(req)))
        carrier = _carrier(lease, decision)
        if carrier is None:
            # Sandbox traffic: the end-to-end headers decide() kept, framing recomputed. No credential.
            fields = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape")) for k, v in decision.forward_headers]
            req.headers = http.Headers(fields)
            req.host_header = _authority(state.host or req.host, state.port or req.port, req.scheme)
            if not req.is_http2:
                req.authority = ""  # origin-form upstream, as for connection traffic
            req.headers.fields = (*req.headers.fields, *framing)
            return
        # Connection traffic, or a profile's request brokered as that connection's traffic (decision.broker): its
        # allowlisted headers, its one credential from custody, and below, its needles for the response scan.
        connection = policy.artifact.connection(carrier)
        if connection is None:
            return self._deny(flow, state, "lease-unknown-subject")
        inject = decision.inject_header or connection.inject.header
        fields = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape")) for k, v in decision.forward_headers
                  if k.lower() != inject.lower() and k.lower() not in ("host", "content-length", "transfer-encoding")]
        secret = self.custody.open(_address(policy.artifact.workspace, connection.name, connection.credential_handle))
        self._needles[flow.id] = secret.needles(connection.inject.format)
        prefix, _, suffix = connection.inject.format.partition("{secret}")
        # INVARIANT: the only place the credential's bytes are revealed; it lives in this header until sent.
        fields.append((inject.encode("ascii"), prefix.encode("utf-8") + secret.reveal() + suffix.encode("utf-8")))
        req.headers = http.Headers(fields)
        req.host_header = _authority(state.host or req.host, state.port or req.port, "https")
        if not req.is_http2:
            req.authority = ""  # origin-form upstream: the judged Host is the only authority the upstream sees
        req.headers.fields = (*req.headers.fields, *framing)

    # -- upstream connection: resolve once, pin, restore ----------------------------------------

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            address = data.server.address
            cid = data.client.id
            if cid in self._refused_clients:
                data.server.error = f"egresslaw: {self._refused_clients[cid]}"
                return
            if address is None:
                data.server.error = "egresslaw: no destination"
                return
            host, port = address
            pin = self._pins.get((cid, host, port))
            if pin is None:
                # INVARIANT: only an address vetted for this client connection is ever dialled.
                data.server.error = "egresslaw: destination not vetted"
                return
            if self._is_self(pin):
                data.server.error = "egresslaw: self-connection"
                return
            self._restore[data.server.id] = (host, port)
            data.server.address = pin
            if data.server.tls:
                data.server.sni = host
        except Exception:
            _log_internal("internal error in server_connect; refusing the connection")
            data.server.error = "egresslaw: internal-error"

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        # Put the name back so mitmproxy reuses this (vetted, pinned) connection for the same name only.
        try:
            original = self._restore.pop(data.server.id, None)
            if original is not None:
                # mitmproxy refuses `address` changes on an open connection through its __setattr__; the
                # socket is already connected to the pinned peer (see `peername`), so only the label changes.
                object.__setattr__(data.server, "address", original)
        except Exception:  # the connection stays labelled with the pinned address: no reuse, still safe
            _log_internal("internal error in server_connected")

    def server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._restore.pop(getattr(data.server, "id", None), None)

    # -- responses ------------------------------------------------------------------------------
    #
    # Connection traffic streams through egress_proxy.edge.scanner: every coding undone, the credential
    # redacted (a window catches a needle split across chunks), sizes capped. Headers, the reason phrase
    # and the codings are judged in responseheaders, before the head goes out; a response refused there
    # gets our JSON 502 instead (its upstream connection is closed). A failure after the head went out
    # (a cap, a corrupt coding) cuts the client connection: the client sees a truncated body, never a
    # clean end and never an unredacted byte. What the client got is recorded on FlowState.

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        resp = flow.response
        if resp is None or (state is not None and state.denied):
            return  # our own denial: nothing to clean, and its X-Egresslaw-Deny must stay
        try:
            _mark_response_headers(resp)
            if state is None:
                resp.stream = False
                return
            if state.lease is not None and _carrier(state.lease, state.decision) is None:
                # Sandbox traffic carries no credential: stream it (package downloads can be large), counting bytes.
                def count(chunk: bytes) -> bytes:
                    state.streamed += len(chunk)
                    return chunk

                resp.stream = count
                state.head_sent = True
                return
            self._scan_head(flow, state)
            self._start_body_scan(flow, state)
        except Exception:
            _log_internal("internal error in responseheaders; the response will be replaced by a denial")
            resp.stream = False  # INVARIANT: never streamed unscanned
            if state is not None:
                state.failed = True
                self._close_upstream(flow)

    def _scan_head(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Redact the credential from header names, values and the reason phrase."""
        resp = flow.response
        assert resp is not None
        state.head_scanned = True
        needles = self._prepared(flow, state)
        if not needles:
            return
        cleaned, hits = [], 0
        for k, v in resp.headers.fields:
            k2, hits_k = redact(k, needles)
            v2, hits_v = redact(v, needles)
            hits += hits_k + hits_v
            cleaned.append((k2, v2))
        if hits:
            resp.headers = http.Headers(cleaned)
        reason, hits_r = redact(resp.data.reason or b"", needles)
        if hits_r:
            resp.data.reason = reason
        state.redactions += hits + hits_r

    def _start_body_scan(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Stream the body through a BodyScanner, or refuse the response before its head goes out."""
        resp, req = flow.response, flow.request
        assert resp is not None
        if not _has_response_body(req, resp):
            return  # HEAD, 1xx, 204, 304, Content-Length 0: nothing to stream
        limit = self._response_limit(state)
        declared = resp.headers.get("content-length", "")
        try:
            order = codings(resp.headers.get("transfer-encoding"), ", ".join(resp.headers.get_all("content-encoding")))
            if limit is not None and declared.isdigit() and int(declared) > limit:
                raise ScanError("response-too-large")
            scan = BodyScanner(self._prepared(flow, state), order, max_received=limit, max_decoded=self.max_decoded)
        except ScanError as exc:
            return self._refuse(flow, state, exc.reason)
        if declared.isdigit() and int(declared) <= SMALL_BODY:
            resp.stream = False  # small: buffered, scanned whole in `response` (one write fewer, and a failure is still a 502)
            return
        # The client gets the decoded, redacted body: no coding, and a length nobody knows in advance.
        for name in ("content-length", "content-encoding", "transfer-encoding"):
            if name in resp.headers:
                del resp.headers[name]
        if not (req.is_http2 or req.is_http3):
            if req.http_version == "HTTP/1.0":
                resp.headers["connection"] = "close"  # close-delimited, as an HTTP/1.0 client expects
            else:
                resp.headers["transfer-encoding"] = "chunked"
                if resp.http_version == "HTTP/1.0":
                    resp.http_version = "HTTP/1.1"
        head_hits = state.redactions

        def stream(chunk: bytes) -> list[bytes]:
            # mitmproxy calls this per received chunk, and once with b"" at the end of the message.
            if state.failure is not None:
                return []
            try:
                out = scan.feed(chunk) if chunk else scan.finish()
            except ScanError as exc:
                self._abort(flow, state, exc.reason)
                return []
            except Exception:
                _log_internal("internal error in the response scan; aborting the response")
                self._abort(flow, state, "internal-error")
                return []
            state.streamed = scan.delivered
            state.redactions = head_hits + scan.redactions
            return [out] if out else []  # never b"": mitmproxy would frame it as the last chunk

        resp.stream = stream
        state.head_sent = True

    def _prepared(self, flow: http.HTTPFlow, state: FlowState) -> Needles:
        if state.needles is None:
            key = self._needles.get(flow.id, ())
            prepared = self._needle_sets.get(key)
            if prepared is None:
                prepared = self._needle_sets[key] = Needles(key)
                if len(self._needle_sets) > 64:
                    self._needle_sets.popitem(last=False)
            state.needles = prepared
        return state.needles

    def _response_limit(self, state: FlowState) -> int | None:
        rule = state.decision.rule if state.decision is not None else None
        connection = _carrier(state.lease, state.decision) if state.lease is not None else None
        return self.rule_max_response.get(f"{connection}/{rule}", self.max_response)

    def _refuse(self, flow: http.HTTPFlow, state: FlowState, reason: str) -> None:
        """Refuse a response before its head goes out: buffer nothing more, answer 502 with `reason`."""
        state.failure = reason
        if flow.response is not None:
            flow.response.stream = False
        self._close_upstream(flow)
        log.warning("refused a response from %s: %s", _printable(state.host), reason)

    def _abort(self, flow: http.HTTPFlow, state: FlowState, reason: str) -> None:
        """A streamed response failed after its head went out: stop, close upstream, cut the client off."""
        state.failure = reason
        state.aborted = True
        self._close_upstream(flow)
        log.warning("aborted a response from %s after %d bytes: %s", _printable(state.host), state.streamed, reason)

    def response(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None:
            return
        streamed = flow.response is not None and bool(flow.response.stream)
        try:
            if state.failed:
                raise RuntimeError("responseheaders failed")
            if state.aborted:
                self._cut(flow, state)
            elif state.denied:
                pass  # our own answer (a denial, or a 503 after the decision event could not be written) stays
            elif state.failure is not None:
                self._answer_failure(flow, state, state.failure)
            else:
                self._clean_response(flow, state)
            if flow.server_conn is not None and layers.doubtful(flow.server_conn.id):
                self._close_upstream(flow)  # it sent an interim answer: never reused
        except Exception:
            if streamed:
                _log_internal("internal error in response after streaming; cutting the connection")
                state.failure = state.failure or "internal-error"
                self._cut(flow, state)
            else:
                _log_internal("internal error in response; replacing it with a denial")
                state.denied = False
                self._deny(flow, state, "internal-error")
        try:
            state.status = flow.response.status_code if flow.response is not None else None
            state.answered = True
        except Exception:
            _log_internal("internal error while recording a response")
        self._finish(flow, kind="request")

    def _cut(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """The head went out, the body cannot be completed: kill the flow (no last chunk, connection closed)."""
        state.aborted = True
        state.denied = True
        state.reason = state.failure or "internal-error"
        self._close_upstream(flow)
        if flow.killable:
            flow.kill()

    def _answer_failure(self, flow: http.HTTPFlow, state: FlowState, reason: str) -> None:
        """Our JSON 502 in place of an upstream answer we refused (nothing of it went out)."""
        state.denied = True
        state.reason = reason
        body, headers = error_answer(502, reason)
        headers["Connection"] = "close"
        flow.response = http.Response.make(502, body, headers)
        self._needles.pop(flow.id, None)

    def _clean_response(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """A response that was not streamed (no body, or a whole one): the same scan, in one go."""
        resp = flow.response
        assert resp is not None
        if resp.trailers:
            resp.trailers = None  # never passed on (HTTP/2 trailers of a streamed response are sent after this hook)
        if resp.stream:
            return  # streamed: cleaned in responseheaders and as it went
        _mark_response_headers(resp)
        needles = self._prepared(flow, state)
        if needles and not state.head_scanned:
            self._scan_head(flow, state)
        if resp.raw_content and (needles or resp.headers.get("content-encoding")):
            try:
                order = codings(resp.headers.get("transfer-encoding"), ", ".join(resp.headers.get_all("content-encoding")))
                body, hits = scan_whole(needles, order, resp.raw_content, max_received=self._response_limit(state), max_decoded=self.max_decoded)
            except ScanError as exc:
                return self._answer_failure(flow, state, exc.reason)
            changed = bool(hits)
            for name in ("content-encoding", "transfer-encoding"):
                if name in resp.headers:
                    del resp.headers[name]
                    changed = True
            if changed or body is not resp.raw_content or resp.headers.get_all("content-length") != [str(len(body))]:
                resp.set_content(body)  # (otherwise it would set the same bytes and the same content-length)
            state.redactions += hits
        if state.redactions:
            log.warning("redacted %d credential occurrence(s) in a response from %s", state.redactions, _printable(state.host))

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            if flow.metadata.get(AUDITED):
                return
            state = self._flows.get(flow.id)
            if state is None:
                state = FlowState(started=self._now(), flow=flow)
                self._flows[flow.id] = state
            if state.reason in (None, "allowed"):
                # A request-side error: the client went (closed, reset its stream), not the upstream; unless mitmproxy's
                # inactivity timeout closed the client connection, reported the same way: then the upstream hung.
                left = state.error_code is not None and not state.error_to_client and not layers.timed_out(flow.client_conn.id)
                state.reason = state.failure or ("client-disconnected" if left else "upstream-error")
                state.denied = True
            self._record_error_answer(flow, state)
        except Exception:
            _log_internal("internal error in error")
        self._finish(flow, kind="request")

    def _record_error_answer(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """What the client gets after a protocol error: the head already sent and a cut body, our JSON page
        (mitmproxy writes it right after this hook, see egress_proxy.edge.layers), or nothing at all."""
        resp = flow.response
        killed = flow.error is not None and flow.error.msg == flow_module.Error.KILLED_MESSAGE
        if state.head_sent and resp is not None:
            state.status, state.aborted = resp.status_code, True
        elif state.error_code is not None and state.error_to_client and not killed:
            state.status = state.error_code.http_status_code()
        else:
            state.status = None  # killed, or the client went away: it gets no answer
        state.answered = True

    # -- mitmproxy's layers call back here (egress_proxy.edge.layers) ---------------------------------

    def owns(self, flow: Any) -> bool:
        return flow.id in self._flows

    def protocol_error(self, flow: Any, code: Any, to_client: bool) -> str | None:
        """A protocol error reached this flow's stream (its error hook comes next): remember mitmproxy's code
        and whether mitmproxy answers it to the client; the reason that answer names (None: the default)."""
        state = self._flows.get(flow.id)
        if state is None:
            return None
        state.error_code, state.error_to_client = code, to_client
        if state.failure is not None:
            return state.failure
        return state.reason if state.denied and state.reason in REASONS else None

    # -- upstream connections: never reused after doubt or for another subject -------------------

    def reuse_key(self, flow: Any) -> Any:
        """Which flows may share an upstream connection (egress_proxy.edge.layers): those of the same subject carrying the
        same credential or none (a brokered request's differs from its profile's plain traffic). A flow without a
        decided state gets a key of its own."""
        state = self._flows.get(flow.id)
        if state is None or state.lease is None or state.denied:
            return ("unshared", flow.id)
        return _subject(state.lease, _carrier(state.lease, state.decision))

    def _close_upstream(self, flow: http.HTTPFlow) -> None:
        if flow.server_conn is not None and flow.server_conn.address is not None:
            self._close_server(flow.client_conn.id, flow.server_conn)

    def _close_server(self, cid: str, server: Any) -> None:
        """Close an upstream connection now, as if the upstream had: marked closed at once (so it is never
        reused), its socket aborted, and mitmproxy's layers see the close like any other (a stream still
        waiting for its answer gets a protocol error: our JSON 502, or a cut connection after the head)."""
        try:
            handler = self._proxyserver.connections.get(cid) if self._proxyserver is not None else None
            io = handler.transports.get(server) if handler is not None else None
            if io is None or io.writer is None:
                return
            server.state = ConnectionState.CLOSED
            io.writer.transport.abort()
        except Exception:
            _log_internal("cannot close an upstream connection")

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            layers.forget(data.server.id)
        except Exception:
            _log_internal("internal error in server_disconnected")

    # -- helpers --------------------------------------------------------------------------------

    def _now(self) -> float:
        """The injected clock for timing; never raises (a hook must not fail before its guard: that fails open)."""
        try:
            return float(self.clock())
        except Exception:
            _log_internal("the clock failed; timing this flow with the system clock")
            return time.time()

    def _lease(self, flow: http.HTTPFlow, state: FlowState) -> Lease | None:
        """The request's lease (Bearer or Basic, one code path), checked against the artifact and against the lease
        its client connection is bound to; None after a denial."""
        values = flow.request.headers.get_all("proxy-authorization")
        state.auth = leases.scheme_of(values[0] if values else None)
        try:
            lease = self._verified.authenticate(self._lease_key_set(), values, now=self.clock())
        except leases.LeaseError as exc:
            self._deny(flow, state, exc.reason)
            return None
        state.lease = lease
        policy = state.policy
        if policy is None or (lease.profile and policy.artifact.profile(lease.profile) is None) or (
            lease.connection and policy.artifact.connection(lease.connection) is None
        ):
            self._deny(flow, state, "lease-unknown-subject")
            return None
        cid = flow.client_conn.id
        # INVARIANT: one client connection, one subject. The first accepted lease binds the connection; another
        # lease on it is refused and the connection is refused for good (closed after this answer in HTTP/1).
        if self._bound.setdefault(cid, _identity(lease)) != _identity(lease):
            self._refused_clients[cid] = "lease-mismatch"
            self._deny(flow, state, "lease-mismatch")
            return None
        return lease

    def _lease_key_set(self) -> leases.LeaseKeys:
        if self.lease_keys is None:
            raise leases.LeaseError("lease-key-unknown", "no lease key loaded")
        try:
            return self.lease_keys.current()  # read again when `keys rotate --lease` replaced the file
        except KeyFileError:
            raise leases.LeaseError("internal-error", "lease keys unavailable") from None  # fail closed (logged once)

    def _offers_other_lease(self, flow: http.HTTPFlow, lease: Lease) -> bool:
        """Inside a tunnel (HTTP/1 or an HTTP/2 stream), a `Proxy-Authorization` carrying another valid lease."""
        values = flow.request.headers.get_all("proxy-authorization")
        if not values:
            return False
        try:
            other = self._verified.authenticate(self._lease_key_set(), values, now=self.clock())
        except leases.LeaseError:
            return False  # not a lease at all: it is stripped like any client header
        if _identity(other) == _identity(lease):
            return False
        self._refused_clients[flow.client_conn.id] = "lease-mismatch"
        return True

    def _lease_detail(self, state: FlowState) -> dict[str, Any]:
        """What a lease denial's event adds: the scheme offered (never the token)."""
        return {"auth": state.auth} if (state.auth is not None and (state.reason or "").startswith("lease-")) else {}

    async def _vet(self, flow, state: FlowState, policy: Policy | None, lease: Lease, host: str, port: int) -> tuple[str, ...] | None:
        """Resolve `host` once per client connection, judge every answer (again on every request, under the
        current policy), then pin the first answer for this client connection."""
        assert policy is not None
        key = (flow.client_conn.id, host, port)
        ips = self._vetted.get(key, ())
        if not ips:
            try:
                ips = tuple(await asyncio.wait_for(self._resolve(host, port), self.resolve_timeout))
            except Exception as exc:  # resolver failures of any kind deny
                log.info("resolve of `%s` failed: %s", _printable(host), exc.__class__.__name__)
                ips = ()
            if flow.client_conn.timestamp_end is not None:
                # INVARIANT: no state for a client that has gone (its client_disconnected already ran, and forgot it).
                self._deny(flow, state, "client-disconnected")
                return None
        if not ips:
            self._deny(flow, state, "resolve-failed")
            return None
        judged = judge_answers(policy.artifact, lease, ips)
        if not judged.allowed:
            self._deny(flow, state, judged.reason, judged)
            return None
        dial = self.connect_to.get((host, port), (ips[0], port))
        if self._is_self(dial) or self._is_self((ips[0], port)):
            self._deny(flow, state, "self-connection")
            return None
        # INVARIANT: a client connection keeps the first vetted answer for a name: no second lookup, no rebinding.
        self._vetted[key] = ips
        self._pins.setdefault(key, dial)
        return ips

    async def _resolve(self, host: str, port: int) -> Sequence[str]:
        if host in self.resolve_map:
            return self.resolve_map[host]
        resolver = self._resolver or self.dns or system_resolver
        return await resolver(host, port)

    def _is_self(self, address: tuple[str, int]) -> bool:
        ip = _ip(address[0])
        if ip is None:
            return False
        for host, port in self.own_addresses:
            if port != address[1]:
                continue
            own = _ip(host)
            if own is not None and (own == ip or own.is_unspecified):
                return True
        return False

    def _deny(self, flow: http.HTTPFlow, state: FlowState, reason: str, decision: Decision | None = None) -> None:
        """Answer with our own response (403, or 407 for lease problems); nothing goes upstream."""
        state.denied = True
        state.reason = reason
        if decision is not None:
            state.decision = decision
        flow.response = denial(reason)
        self._needles.pop(flow.id, None)

    async def _write_ahead(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> None:
        """Write this allowed flow's decision event before anything goes upstream: appended to the file by `emit`
        itself (with `--audit-sync request`, also fsync'd: a bounded wait); deny with 503 when the proxy is draining
        or the audit log cannot be written, so nothing is ever forwarded unaudited."""
        audit = self.audit
        if self.draining_since is not None and state.started >= self.draining_since:
            return self._deny(flow, state, "draining")
        if audit is None or not audit.writable:
            return self._deny(flow, state, "audit-unavailable")
        state.audit_ticket = self._emit(self._event(flow, state, kind), durable=True)
        if state.audit_ticket is None:
            return self._deny(flow, state, "audit-unavailable")
        try:
            await audit.written(state.audit_ticket)
        except AuditUnavailable:
            state.failure = "audit-unavailable"
            self._deny(flow, state, "audit-unavailable")

    def _fail(self, state: FlowState, failure: str, reason: str) -> None:
        """A flow that ends without its response: `failure` for the outcome of an allow, `reason` for an undecided flow."""
        if state.audit_ticket is not None:
            state.failure = state.failure or failure
        elif not state.denied:
            state.denied = True
            state.reason = reason

    def _finish(self, flow: http.HTTPFlow, *, kind: str) -> None:
        """Queue this flow's closing event (its denial, or the outcome of its allow), count it, forget its state."""
        state = self._flows.pop(flow.id, None)
        self._needles.pop(flow.id, None)
        if state is None:
            return
        flow.metadata[AUDITED] = True  # a flag only: no lease, no credential in metadata
        try:
            self._scrub(flow, state)
            if state.audit_ticket is None:
                event = self._event(flow, state, kind)
                if event["decision"] == "deny":
                    log.info("deny %s %s %s:%s%s%s", event["reason"], _printable(flow.request.method), _printable(state.host), state.port,
                             _printable(state.path or ""), "".join(f" (offered {v})" for v in self._lease_detail(state).values()))
            else:
                event = self._outcome(flow, state, kind)
            self._count(event["decision"], event["reason"], event["duration_ms"] / 1000, kind)
        except Exception:
            _log_internal("internal error while auditing a flow")
            self._count("deny", "internal-error", 0.0, kind)
            event = {"kind": kind, "id": flow.id, "decision": "deny", "reason": "internal-error"}
            if state.audit_ticket is not None:
                event = {"kind": "outcome", "of": kind, "id": flow.id, "decision": "allow", "reason": "allowed", "failure": "internal-error"}
        self._emit(event)

    # The one mapping from a flow's state to its events: a decision event (an allow is written ahead, before
    # anything goes upstream; a denial is final) and, after an allow, an outcome event linked by `id`.

    def _event(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> dict[str, Any]:
        decision = "deny" if state.denied else "allow"
        reason = state.reason or ("internal-error" if state.denied else "allowed")
        final = state.denied  # an allow's status, bytes and redactions come in its outcome event
        up, down = self._bytes(flow, state, kind) if final else (0, 0)
        return {
            "kind": kind,
            "id": flow.id,
            **self._who(state.lease),
            "method": flow.request.method,
            "scheme": "https" if kind == "connect" else flow.request.scheme,
            "host": state.host,
            "port": state.port,
            "path": None if kind == "connect" else state.path,
            "tunnel": state.tunnel,
            "decision": decision,
            "reason": reason,
            "rule": state.decision.rule if (state.decision is not None and not state.denied) else None,
            "broker": state.decision.broker if (state.decision is not None and not state.denied) else None,
            "status": self._client_status(flow, state) if final else None,
            "bytes_up": up,
            "bytes_down": down,
            "duration_ms": self._elapsed_ms(state),
            "redactions": state.redactions if final else 0,
            **self._lease_detail(state),
        }

    def _outcome(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> dict[str, Any]:
        failure = state.failure or (state.reason if state.denied else None)
        status = self._client_status(flow, state)
        if kind == "connect" and status is None and failure is None:
            status = 200  # mitmproxy answers an accepted CONNECT itself
        up, down = self._bytes(flow, state, kind)
        return {
            "kind": "outcome",
            "of": kind,
            "id": flow.id,
            "decision": "allow",
            "reason": "allowed",
            "rule": state.decision.rule if state.decision is not None else None,
            "broker": state.decision.broker if state.decision is not None else None,
            "status": status,
            "failure": failure,
            "aborted": state.aborted,  # the client got a head and a cut body
            "error": state.error_code.name.lower().replace("_", "-") if state.error_code is not None else None,  # mitmproxy's code
            "bytes_up": up,
            "bytes_down": down,
            "duration_ms": self._elapsed_ms(state),
            "redactions": state.redactions,
        }

    def _client_status(self, flow: http.HTTPFlow, state: FlowState) -> int | None:
        if state.answered:  # the response side recorded what the client got (a cut body, our 502, nothing)
            return state.status
        if state.client_status is not None:
            return state.client_status
        return flow.response.status_code if flow.response is not None else None

    def _bytes(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> tuple[int, int]:
        if kind == "connect":
            return 0, 0
        down = (len(flow.response.raw_content or b"") + state.streamed) if flow.response is not None else state.streamed
        return len(flow.request.raw_content or b"") + state.uploaded, down

    def _elapsed_ms(self, state: FlowState) -> float:
        return round(max(0.0, self._now() - state.started) * 1000, 3)

    def _scrub(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Remove the injected credential from the flow object once it has been sent (or not)."""
        carrier = _carrier(state.lease, state.decision) if state.lease is not None else None
        if carrier is None or state.policy is None:
            return
        connection = state.policy.artifact.connection(carrier)
        if connection is not None and connection.inject.header in flow.request.headers:
            flow.request.headers[connection.inject.header] = "[REDACTED]"

    def _who(self, lease: Lease | None) -> dict[str, Any]:
        return {
            "subject": lease.subject if lease else None,
            "profile": lease.profile if lease else None,
            "connection": lease.connection if lease else None,
        }

    def _emit(self, event: dict[str, Any], *, durable: bool = False) -> int | None:
        """Queue one event (`durable`: a request will wait for it); its ticket, or None when the log is closed or
        already holds too much."""
        if self.audit is None:
            return None
        policy = self.policy
        event.setdefault("artifact", policy.artifact.digest if policy else None)
        if policy is not None and not policy.proved:
            event["unproven"] = True
        if self.test_routing:
            event["test_routing"] = self.test_routing
        try:
            return self.audit.emit(event, durable=durable)
        except AuditUnavailable as exc:  # held events beyond the bound are counted by the log (audit-resumed)
            if self.audit.error is None:
                log.error("audit event lost: %s", exc)
            return None

    def _count(self, decision: str, reason: str, elapsed: float, kind: str = "request") -> None:
        if self.metrics is not None:
            self.metrics.observe(kind, decision, reason, elapsed)


class _RefusalWatch(logging.Filter):
    """Audits the requests mitmproxy refuses before any hook runs.

    When mitmproxy cannot parse a request line or header block (HTTP/1: it answers 400 and closes) or
    an HTTP/2 request (protocol error), no flow exists and no hook is called: its only trace is a log
    record of `mitmproxy.proxy.server` carrying the client's peername. This filter turns those records
    into one audit event each. The logger is opened to INFO for that, and records below the level its
    parent would let through are filtered out again, so the visible log output does not change.
    """

    LOGGER = "mitmproxy.proxy.server"
    REFUSAL = re.compile(r"^\S+: (?:Bad HTTP request line|Invalid headers|Invalid header line|HTTP/2 protocol error|Invalid HTTP/2 request headers)")

    def __init__(self, addon: EgressLaw) -> None:
        super().__init__()
        self.addon = addon
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
                self.addon.audit_malformed(peer)
        except Exception:
            _log_internal("internal error while auditing a refused request")
        return record.levelno >= logging.getLogger(self.LOGGER).parent.getEffectiveLevel()


_FIELD_BREAK = re.compile(rb"[\r\n\x00]")


def _mark_response_headers(resp: http.Response) -> None:
    """Strip `X-Egresslaw-*` an upstream sent (they are ours to set), make every CR, LF or NUL inside a header value or
    the reason phrase a SP (an obs-fold, or a bare CR many clients end a line at: RFC 9112 §2.2, §5.2), and mark a 3xx
    as not followed."""
    fields = [(k, v) for k, v in resp.headers.fields if not k.lower().startswith(OUR_PREFIX)]
    broken = any(_FIELD_BREAK.search(v) for _, v in fields)
    if broken:
        fields = [(k, _FIELD_BREAK.sub(b" ", v)) for k, v in fields]
    if broken or len(fields) != len(resp.headers.fields):
        resp.headers = http.Headers(fields)
    if resp.data.reason and _FIELD_BREAK.search(resp.data.reason):
        resp.data.reason = _FIELD_BREAK.sub(b" ", resp.data.reason)
    if 300 <= resp.status_code < 400:
        resp.headers[REDIRECT_HEADER] = "not-followed"


@functools.lru_cache(maxsize=1024)
def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an IP address (None if it is not one), memoized: the same few addresses are checked on every request."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _printable(text: object) -> str:
    """User input for a log line: control characters escaped (no forged log lines), bounded length."""
    shown = str(text).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 200 else shown[:197] + "..."


def _log_internal(what: str) -> None:
    """Log an unexpected exception by type and location only: messages may carry header values or input."""
    import sys
    import traceback

    exc = sys.exc_info()[1]
    where = ""
    if exc is not None and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" at {Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    log.error("%s (%s%s)", what, exc.__class__.__name__ if exc is not None else "unknown", where)


def _has_body(req: http.Request, ended: bool | None = None) -> bool:
    """Does a body follow the head? Framing headers say so in HTTP/1; in HTTP/2 a head that did not end its stream
    (HEADERS without END_STREAM: DATA frames or trailers follow, content-length or not) counts as a body too.
    `ended` is what the HTTP layer saw (None: unknown, taken as a body for HTTP/2)."""
    cl = req.headers.get("content-length")
    if req.headers.get("transfer-encoding"):
        return True
    try:
        if cl is not None and int(cl) > 0:
            return True
    except ValueError:
        return True
    if req.is_http2 or req.is_http3:
        return ended is not True
    return False


def _framing(req: http.Request, has_body: bool) -> list[tuple[bytes, bytes]]:
    """The framing headers of the head sent upstream: the declared length, HTTP/1 chunking (re-chunked by
    mitmproxy as the body streams), `content-length: 0` for a bodyless POST/PUT/PATCH; none for an HTTP/2 body
    without content-length (held and framed in `request`)."""
    if not has_body:
        return [(b"content-length", b"0")] if req.method in ("POST", "PUT", "PATCH") else []
    length = declared_length(req)
    if length is not None:
        return [(b"content-length", str(length).encode("ascii"))]
    chunked = req.headers.get("transfer-encoding")
    return [(b"transfer-encoding", chunked.encode("ascii", "replace"))] if chunked else []


def _has_response_body(req: http.Request, resp: http.Response) -> bool:
    try:
        return expected_http_body_size(req, resp) != 0
    except ValueError:
        return True


def _subject(lease: Lease, carrier: str | None = None) -> tuple:
    """Who an upstream connection served, and whose credential it carried (a brokered request's differs from its
    profile's plain traffic, so such an upstream connection is never reused for the other)."""
    return (lease.subject, lease.connection, lease.profile, carrier)


def _carrier(lease: Lease, decision: Decision | None) -> str | None:
    """The connection whose credential this flow carries: the lease's, or the one a profile's request is brokered to."""
    if lease.connection is not None:
        return lease.connection
    return decision.broker if decision is not None and decision.allowed else None


def _authority(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return shown if port == default else f"{shown}:{port}"


@functools.lru_cache(maxsize=1024)
def _address(workspace: str, connection: str, handle: str) -> Any:
    """The custody Address of a connection's credential, built (and its names checked) once."""
    return Address(workspace, connection, handle)


def _identity(lease: Lease) -> tuple[str, str | None, str | None]:
    """What binds a client connection: who, and the one profile or connection (a re-minted lease of the same is the same)."""
    return (lease.subject, lease.profile, lease.connection)


