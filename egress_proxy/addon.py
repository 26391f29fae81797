"""The mitmproxy addon: one class that adapts flows to the pure decision functions and back.

Every hook is guarded: an exception inside a hook denies (mitmproxy itself would log it and
forward the request, i.e. fail open). Decisions come from `egress_proxy.decide` and
`egress_proxy.addresses`; this module only translates, resolves, pins, injects, scans and audits.

Where state lives (never in flow metadata, which other addons and dumps can read):
- `_tunnels[client id]`: the CONNECT target, its lease and its vetted answers;
- `_pins[(client id, host, port)]`: the vetted address a server connection must dial;
- `_flows[flow id]`: per-request bookkeeping until the one audit event is written;
- `_needles[flow id]`: the encodings of the credential injected into that flow, for the response scan.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mitmproxy import ctx, exceptions, http, tls
from mitmproxy.proxy import server_hooks

from compiler.artifact import Artifact, ArtifactError, load_artifact
from compiler.constants import DEFAULT_WORKER
from compiler.normalize import HostError, normalize_host
from egress_proxy import lease as leases
from egress_proxy.audit import AuditError, AuditLog, strip_query
from egress_proxy.types import Decision, Lease, Request

log = logging.getLogger("egresslaw.proxy")

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

DENY_HEADER = "X-Egresslaw-Deny"
RESOLVE_TIMEOUT = 5.0  # seconds
_LINE_BREAK = re.compile(r"[\r\n\x00]")
_CANONICAL_PORT = re.compile(r"[1-9][0-9]{0,4}")
REDIRECT_HEADER = "X-Egresslaw-Redirect"
REDACTED = b"[REDACTED]"
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


class StartupError(Exception):
    """The proxy cannot serve: bad artifact, proof, keys, store or options. The CLI exits 2."""

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.help = help


@dataclass(frozen=True, slots=True)
class Policy:
    """The artifact being enforced; replaced as a whole on reload (never mutated)."""

    artifact: Artifact
    proved: bool
    path: str
    stamp: tuple[int, int, int]  # (inode, size, mtime_ns) of the artifact file when loaded


def load_policy(artifact_path: str, proof_path: str, *, allow_unproven: bool, trust_proofs: str | None = None) -> Policy:
    """Read and verify the artifact and its proof report; StartupError unless the gate accepts the report
    (`proofs.gate`: every required check proved, same egresslaw and decision core, signed by `trust_proofs`
    when given) or `allow_unproven`."""
    from proofs.gate import GateError, read_report

    try:
        st = Path(artifact_path).stat()
        artifact = load_artifact(Path(artifact_path).read_bytes())
    except FileNotFoundError:
        raise StartupError(f"artifact `{artifact_path}` does not exist") from None
    except OSError as exc:
        raise StartupError(f"cannot read artifact `{artifact_path}`: {exc.strerror or exc.__class__.__name__}") from None
    except ArtifactError as exc:
        raise StartupError(f"artifact `{artifact_path}`: {exc}") from None
    if artifact.worker(DEFAULT_WORKER) is None:
        raise StartupError(f"artifact `{artifact_path}` has no `{DEFAULT_WORKER}` worker")
    try:
        read_report(proof_path, artifact, trusted_key=trust_proofs)
        proved, why, help_ = True, "", None
    except GateError as exc:
        proved, why, help_ = False, exc.message, exc.help
    if not proved and not allow_unproven:
        raise StartupError(why, help_ or "run `egresslaw prove` on this artifact")
    if not proved:
        log.warning("serving an unproven artifact (--allow-unproven): %s", why)
    return Policy(artifact, proved, artifact_path, (st.st_ino, st.st_size, st.st_mtime_ns))


def parse_resolve(entries: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """`HOST=IP[,IP…]` entries as a map from the normalized host to its answers (answers are judged later)."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in entries:
        host, sep, ips = entry.partition("=")
        if not sep or not host or not ips:
            raise StartupError(f"--resolve `{entry}` is not HOST=IP[,IP...]")
        try:
            name = normalize_host(host).value
            answers = tuple(str(ipaddress.ip_address(ip.strip())) for ip in ips.split(","))
        except (HostError, ValueError):
            raise StartupError(f"--resolve `{entry}` is not HOST=IP[,IP...]") from None
        out[name] = out.get(name, ()) + answers
    return out


def parse_connect_to(entries: Sequence[str]) -> dict[tuple[str, int], tuple[str, int]]:
    """curl's `HOST:PORT:ADDR:APORT` entries as a map from (host, port) to the address actually dialled."""
    out: dict[tuple[str, int], tuple[str, int]] = {}
    for entry in entries:
        parts = entry.split(":")
        if len(parts) != 4:
            raise StartupError(f"--connect-to `{entry}` is not HOST:PORT:ADDR:APORT")
        host, port, addr, aport = parts
        try:
            key = (normalize_host(host).value, _port(port))
            out[key] = (str(ipaddress.ip_address(addr)), _port(aport))
        except (HostError, ValueError):
            raise StartupError(f"--connect-to `{entry}` is not HOST:PORT:ADDR:APORT (ADDR must be an IP address)") from None
    return out


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError("port")
    return value


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """Every address the system resolver returns for `host` (A and AAAA), in its order, without duplicates."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


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
    streamed: int = 0  # bytes of a streamed (sandbox) response body
    failed: bool = False  # a response-side hook failed: the response is replaced by a denial


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
        self.resolve_timeout = RESOLVE_TIMEOUT  # a lookup that takes longer is a failed lookup (resolve-failed)
        self._custody_override = custody
        self.custody: Any = custody
        self.clock = clock
        self.metrics = metrics
        self.policy: Policy | None = None
        self.audit: AuditLog | None = None
        self.lease_key: bytes | None = None
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
        self._opts: Any = None
        self._peers: dict[Any, str] = {}  # client peername -> client id (to audit refusals mitmproxy only logs)
        self._watch: _RefusalWatch | None = None
        self.is_running = False

    # -- options --------------------------------------------------------------------------------

    def load(self, loader) -> None:
        loader.add_option("egresslaw_artifact", str, "", "Path of the compiled artifact to enforce.")
        loader.add_option("egresslaw_proof", str, "", "Path of the proof report that must prove the artifact.")
        loader.add_option("egresslaw_keys", str, "", "Keys directory (lease.key, custody.key).")
        loader.add_option("egresslaw_store", str, "", "Custody store (SQLite) holding the sealed credentials.")
        loader.add_option("egresslaw_audit_log", str, "", "Append-only JSONL audit log.")
        loader.add_option("egresslaw_allow_unproven", bool, False, "Serve an artifact that is not all-proved (warns on every request).")
        loader.add_option("egresslaw_trust_proofs", Optional[str], None, "Accept only proof reports signed by this Ed25519 public key.")
        loader.add_option("egresslaw_resolve", Sequence[str], [], "Test routing: HOST=IP[,IP...] answers for HOST (still judged).")
        loader.add_option("egresslaw_connect_to", Sequence[str], [], "Test routing: HOST:PORT:ADDR:APORT, dial ADDR:APORT after the checks.")
        loader.add_option("egresslaw_upstream_ca", Optional[str], None, "Test routing: also trust this CA for upstream certificates.")

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
            self.resolve_map = parse_resolve(opts.egresslaw_resolve)
            self.connect_to = parse_connect_to(opts.egresslaw_connect_to)
            self.policy = load_policy(opts.egresslaw_artifact, opts.egresslaw_proof, allow_unproven=opts.egresslaw_allow_unproven,
                                      trust_proofs=opts.egresslaw_trust_proofs)
            self.lease_key = _load_lease_key(opts.egresslaw_keys)
            if self._custody_override is None:
                self.custody = _open_store(opts.egresslaw_store, opts.egresslaw_keys)
            if self.audit is None or str(self.audit.path) != opts.egresslaw_audit_log:
                if self.audit is not None:
                    self.audit.close()
                self.audit = AuditLog(opts.egresslaw_audit_log)
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
        try:
            policy = load_policy(opts.egresslaw_artifact, opts.egresslaw_proof, allow_unproven=opts.egresslaw_allow_unproven,
                                 trust_proofs=opts.egresslaw_trust_proofs)
        except Exception as exc:  # any failure keeps the old policy serving
            message = str(exc) if isinstance(exc, StartupError) else exc.__class__.__name__
            log.error("reload refused, still serving artifact `%s`: %s", self.policy.artifact.digest[:12] if self.policy else "-", message)
            self._count_reload("failed")
            self._emit({"kind": "reload", "decision": "deny", "reason": "reload-failed", "detail": message})
            return False
        old = self.policy
        self.policy = policy  # INVARIANT: one reference swap; flows keep the Policy they started with
        log.info("reloaded artifact `%s` (was `%s`)", policy.artifact.digest[:12], old.artifact.digest[:12] if old else "-")
        self._count_reload("ok")
        self._emit({"kind": "reload", "decision": "allow", "reason": "reloaded", "artifact": policy.artifact.digest})
        return True

    def artifact_changed(self) -> bool:
        """True when the artifact file on disk is not the one loaded (inode, size or mtime differ)."""
        if self.policy is None:
            return False
        try:
            st = Path(self.policy.path).stat()
        except OSError:
            return False
        return (st.st_ino, st.st_size, st.st_mtime_ns) != self.policy.stamp

    def _count_reload(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.reload(result)

    # -- lifecycle ------------------------------------------------------------------------------

    def running(self) -> None:
        self.is_running = True  # mitmproxy calls this after it tried to set up its listeners
        if self._watch is None:
            self._watch = _RefusalWatch(self)
            self._watch.install()
        try:
            server = ctx.master.addons.get("proxyserver")
            for addr in server.listen_addrs():
                self.own_addresses.add((str(addr[0]), int(addr[1])))
        except Exception:  # pragma: no cover - listeners are also checked at every pin
            _log_internal("cannot read the proxy's listen addresses")

    def done(self) -> None:
        if self._watch is not None:
            self._watch.uninstall()
            self._watch = None
        try:
            if self.audit is not None:
                self.audit.close()
        except Exception:
            _log_internal("cannot close the audit log")

    def client_connected(self, client) -> None:
        try:
            self._peers[client.peername] = client.id
        except Exception:
            _log_internal("internal error in client_connected")

    def client_disconnected(self, client) -> None:
        try:
            self._peers.pop(client.peername, None)
            self._forget_client(client.id)
        except Exception:
            _log_internal("internal error in client_disconnected")

    def _forget_client(self, cid: str) -> None:
        # A request mitmproxy dropped without a response or error hook (e.g. HTTP/1 request
        # trailers, which its reader refuses) still gets its one audit event.
        for state in [s for s in self._flows.values() if s.flow is not None and s.flow.client_conn.id == cid]:
            if not state.denied:
                state.denied = True
                state.reason = "internal-error"
            self._finish(state.flow, kind="request")
        self._tunnels.pop(cid, None)
        self._refused_clients.pop(cid, None)
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
        except Exception:
            _log_internal("internal error in http_connect; denying")
            self._deny(flow, state, "internal-error")
        if flow.response is None:
            state.reason = "allowed"
        self._finish(flow, kind="connect")

    async def _connect(self, flow: http.HTTPFlow, state: FlowState) -> None:
        cid = flow.client_conn.id
        if cid in self._tunnels:
            return self._deny(flow, state, "connect-in-tunnel")
        state.policy = policy = self.policy
        lease = self._lease(flow, state)
        if lease is None:
            return
        host, port = flow.request.host, flow.request.port
        state.host, state.port = host, port
        if _has_body(flow.request):
            # The bytes after a CONNECT's head are the tunnel's: a declared body would be read as both.
            return self._deny(flow, state, "body-on-bodyless-method")
        if "upgrade" in flow.request.headers or "upgrade" in flow.request.headers.get("connection", "").lower():
            return self._deny(flow, state, "upgrade-denied")
        # Judge the authority as sent: mitmproxy has already dropped brackets (`[name]:443`) and leading zeros
        # of the port (`:0443`) from host/port, so its view would admit non-canonical spellings.
        raw_host, _, raw_port = (flow.request.authority or f"{host}:{port}").rpartition(":")
        if not _CANONICAL_PORT.fullmatch(raw_port):
            return self._deny(flow, state, "port-invalid")
        decision = self._decide_destination(policy, lease, "https", raw_host, port)
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
        self._count("deny", reason, 0.0)
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
            self._count("deny", "non-http-in-tunnel", 0.0)
            self._emit_tcp(tunnel)
        except Exception:
            _log_internal("internal error in tcp_start; its server connection is refused anyway")

    def audit_malformed(self, peername: Any) -> None:
        """A request mitmproxy refused itself (400 or an HTTP/2 protocol error) before any hook: one audit event."""
        cid = self._peers.get(peername)
        if cid is None:
            return  # another proxy's client (several masters can share a process), or already gone
        tunnel = self._tunnels.get(cid)
        self._count("deny", "malformed-request", 0.0)
        log.info("deny malformed-request %s:%s", tunnel.host if tunnel else "-", tunnel.port if tunnel else "-")
        self._emit({"kind": "request", **self._who(tunnel.lease if tunnel else None), "method": None,
                    "host": tunnel.host if tunnel else None, "port": tunnel.port if tunnel else None, "path": None,
                    "tunnel": tunnel is not None, "decision": "deny", "reason": "malformed-request", "rule": None, "status": 400})

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
        except Exception:
            _log_internal("internal error in requestheaders; denying")
            self._deny(flow, state, "internal-error")

    async def _request(self, flow: http.HTTPFlow, state: FlowState) -> None:
        cid = flow.client_conn.id
        if cid in self._refused_clients:
            return self._deny(flow, state, self._refused_clients[cid])
        tunnel = self._tunnels.get(cid)
        state.tunnel = tunnel is not None
        req = flow.request
        state.path = strip_query(req.path)
        if tunnel is not None:
            state.policy = policy = self.policy
            state.lease = lease = tunnel.lease
            state.host, state.port = tunnel.host, tunnel.port
            if lease.exp <= self.clock():
                return self._deny(flow, state, "lease-expired")
            if req.method == "CONNECT":
                return self._deny(flow, state, "connect-in-tunnel")
        else:
            state.policy = policy = self.policy
            lease = self._lease(flow, state)
            if lease is None:
                return
            state.host, state.port = req.host, req.port
        if policy is not None and not policy.proved:
            log.warning("serving an unproven artifact (--allow-unproven)")
        host, port = (tunnel.host, tunnel.port) if tunnel else (req.host, req.port)
        if "trailer" in req.headers:
            # Declared trailers would arrive after the decision; HTTP/1 trailers also crash mitmproxy's reader.
            return self._deny(flow, state, "trailers-denied")
        if any(_LINE_BREAK.search(k) or _LINE_BREAK.search(v) for k, v in req.headers.items(multi=True)):
            # mitmproxy keeps a bare CR (or an HTTP/2 value's CR/LF/NUL) inside a header value and would write it
            # upstream as is, where a lenient parser reads a second header line (e.g. its own Authorization).
            return self._deny(flow, state, "smuggling")
        if tunnel is not None and req.port != tunnel.port:
            return self._deny(flow, state, "host-header-mismatch")
        if tunnel is None:
            pre = self._decide_destination(policy, lease, req.scheme, host, port)
            if not pre.allowed:
                return self._deny(flow, state, pre.reason, pre)
            host = pre.host or host
            state.host = host
            ips = await self._vet(flow, state, policy, lease, host, port)
            if ips is None:
                return
        else:
            ips = tunnel.ips
        request = Request(
            # As sent: mitmproxy's `method` property upper-cases, but the wire (and so the upstream) keeps `get`.
            method=req.data.method.decode("utf-8", "surrogateescape"),
            scheme=req.scheme,  # type: ignore[arg-type]
            host=host,
            port=port,
            target=req.path,
            headers=tuple((k, v) for k, v in req.headers.items(multi=True)),
            # Inside a tunnel mitmproxy keeps an absolute-form target as sent (and would forward it so): its
            # authority must name the tunnel's host and port exactly like a Host header.
            host_header=req.authority if (tunnel is not None and req.authority) else req.host_header,
            tunnel=tunnel is not None,
            has_body=_has_body(req),
        )
        from egress_proxy.decide import decide

        decision = decide(policy.artifact, lease, request, list(ips))
        state.decision = decision
        state.path = decision.path or state.path
        if not decision.allowed:
            return self._deny(flow, state, decision.reason, decision)
        if tunnel is None:
            req.data.host = host  # the normalized name the pin is keyed on (the Host header is left alone)
        state.reason = "allowed"

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
                    flow.response = http.Response.make(403, b'{"error": "egress_denied", "reason": "internal-error", "rule": null}',
                                                       {"Content-Type": "application/json", DENY_HEADER: "internal-error"})
            return
        if flow.response is not None or state.denied:
            return
        try:
            self._prepare_upstream(flow, state)
        except Exception:
            _log_internal("internal error in request; denying")
            self._deny(flow, state, "internal-error")

    def _prepare_upstream(self, flow: http.HTTPFlow, state: FlowState) -> None:
        req = flow.request
        decision, lease, policy = state.decision, state.lease, state.policy
        if decision is None or lease is None or policy is None or not decision.allowed:
            return self._deny(flow, state, "internal-error")  # INVARIANT: only decided flows go upstream
        if req.trailers:
            return self._deny(flow, state, "trailers-denied")
        body = req.raw_content or b""
        if lease.connection is None:
            # Sandbox traffic: the end-to-end headers decide() kept, framing recomputed. No credential, ever.
            fields = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape")) for k, v in decision.forward_headers]
            req.headers = http.Headers(fields)
            req.host_header = _authority(state.host or req.host, state.port or req.port, req.scheme)
            if not req.is_http2:
                req.authority = ""  # origin-form upstream, as for connection traffic
            if body or req.method in ("POST", "PUT", "PATCH"):
                req.headers["content-length"] = str(len(body))
            return
        connection = policy.artifact.connection(lease.connection)
        if connection is None:
            return self._deny(flow, state, "lease-unknown-subject")
        inject = decision.inject_header or connection.inject.header
        fields = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape")) for k, v in decision.forward_headers
                  if k.lower() != inject.lower() and k.lower() not in ("host", "content-length", "transfer-encoding")]
        from egress_proxy.custody import Address

        secret = self.custody.open(Address(policy.artifact.workspace, connection.name, connection.credential_handle))
        self._needles[flow.id] = secret.needles()
        prefix, _, suffix = connection.inject.format.partition("{secret}")
        # INVARIANT: the only place the credential's bytes are revealed; it lives in this header until sent.
        fields.append((inject.encode("ascii"), prefix.encode("utf-8") + secret.reveal() + suffix.encode("utf-8")))
        req.headers = http.Headers(fields)
        req.host_header = _authority(state.host or req.host, state.port or req.port, "https")
        if not req.is_http2:
            req.authority = ""  # origin-form upstream: the judged Host is the only authority the upstream sees
        if body or req.method in ("POST", "PUT", "PATCH"):
            req.headers["content-length"] = str(len(body))

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

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        resp = flow.response
        if resp is None or (state is not None and state.denied):
            return  # our own denial: nothing to clean, and its X-Egresslaw-Deny must stay
        try:
            _mark_response_headers(resp)
            if state is not None and not state.denied and state.lease is not None and state.lease.connection is None:
                # Sandbox traffic carries no credential: stream it (package downloads can be large), counting bytes.
                def count(chunk: bytes) -> bytes:
                    state.streamed += len(chunk)
                    return chunk

                resp.stream = count
            else:
                resp.stream = False  # INVARIANT: connection traffic is buffered so it can be scanned before it is sent
        except Exception:
            _log_internal("internal error in responseheaders; the response will be replaced by a denial")
            resp.stream = False
            if state is not None:
                state.failed = True

    def response(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None:
            return
        try:
            if state.failed:
                raise RuntimeError("responseheaders failed")
            if not state.denied:
                self._clean_response(flow, state)
        except Exception:
            _log_internal("internal error in response; replacing it with a denial")
            state.denied = False
            self._deny(flow, state, "internal-error")
        self._finish(flow, kind="request")

    def _clean_response(self, flow: http.HTTPFlow, state: FlowState) -> None:
        resp = flow.response
        assert resp is not None
        if resp.stream:
            return  # sandbox traffic, streamed: its headers were cleaned in responseheaders
        _mark_response_headers(resp)
        fields = list(resp.headers.fields)
        needles = self._needles.get(flow.id, ())
        if needles:
            ordered = sorted(needles, key=len, reverse=True)
            cleaned = []
            for k, v in fields:
                k2, hits_k = _redact(k, ordered)
                v2, hits_v = _redact(v, ordered)
                state.redactions += hits_k + hits_v
                cleaned.append((k2, v2))
            fields = cleaned
            resp.headers = http.Headers(fields)
            reason_bytes = resp.reason.encode("latin-1", "replace") if resp.reason else b""
            r2, hits = _redact(reason_bytes, ordered)
            if hits:
                state.redactions += hits
                resp.reason = r2.decode("latin-1")
            if resp.raw_content:
                if resp.headers.get("content-encoding"):
                    resp.decode()  # strict: a body we cannot decode cannot be scanned, so it is not passed back
                body, hits = _redact(resp.raw_content or b"", ordered)
                if hits:
                    state.redactions += hits
                    resp.set_content(body)
            if resp.trailers:
                resp.trailers = None
        if state.redactions:
            log.warning("redacted %d credential occurrence(s) in a response from %s", state.redactions, state.host)

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            if flow.metadata.get(AUDITED):
                return
            state = self._flows.get(flow.id)
            if state is None:
                state = FlowState(started=self._now(), flow=flow)
                self._flows[flow.id] = state
            if state.reason in (None, "allowed"):
                state.reason = "upstream-error"
                state.denied = True
        except Exception:
            _log_internal("internal error in error")
        self._finish(flow, kind="request")

    # -- helpers --------------------------------------------------------------------------------

    def _now(self) -> float:
        """The injected clock for timing; never raises (a hook must not fail before its guard: that fails open)."""
        try:
            return float(self.clock())
        except Exception:
            _log_internal("the clock failed; timing this flow with the system clock")
            return time.time()

    def _lease(self, flow: http.HTTPFlow, state: FlowState) -> Lease | None:
        values = flow.request.headers.get_all("proxy-authorization")
        header = values[0] if values else None
        try:
            if len(values) > 1:
                raise leases.LeaseError("lease-invalid", "more than one Proxy-Authorization header")
            if self.lease_key is None:
                raise leases.LeaseError("lease-invalid", "no lease key loaded")
            lease = leases.verify(self.lease_key, leases.bearer(header), now=self.clock())
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
        return lease

    def _decide_destination(self, policy: Policy | None, lease: Lease, scheme: str, host: str, port: int) -> Decision:
        from egress_proxy.decide import decide_destination

        assert policy is not None
        return decide_destination(policy.artifact, lease, scheme, host, port)

    def _worker_of(self, policy: Policy, lease: Lease) -> str:
        if lease.connection is not None:
            conn = policy.artifact.connection(lease.connection)
            return conn.worker if conn is not None else DEFAULT_WORKER
        return DEFAULT_WORKER

    async def _vet(self, flow, state: FlowState, policy: Policy | None, lease: Lease, host: str, port: int) -> tuple[str, ...] | None:
        """Resolve `host` once per client connection, judge every answer (again on every request, under the
        current policy), then pin the first answer for this client connection."""
        from egress_proxy.addresses import judge_ips

        assert policy is not None
        key = (flow.client_conn.id, host, port)
        ips = self._vetted.get(key, ())
        if not ips:
            try:
                ips = tuple(await asyncio.wait_for(self._resolve(host, port), self.resolve_timeout))
            except Exception as exc:  # resolver failures of any kind deny
                log.info("resolve of `%s` failed: %s", _printable(host), exc.__class__.__name__)
                ips = ()
        if not ips:
            self._deny(flow, state, "resolve-failed")
            return None
        judged = judge_ips(policy.artifact, self._worker_of(policy, lease), list(ips))
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
        resolver = self._resolver or system_resolver
        return await resolver(host, port)

    def _is_self(self, address: tuple[str, int]) -> bool:
        try:
            ip = ipaddress.ip_address(address[0])
        except ValueError:
            return False
        for host, port in self.own_addresses:
            if port != address[1]:
                continue
            try:
                own = ipaddress.ip_address(host)
            except ValueError:
                continue
            if own == ip or own.is_unspecified:
                return True
        return False

    def _deny(self, flow: http.HTTPFlow, state: FlowState, reason: str, decision: Decision | None = None) -> None:
        """Answer with our own response (403, or 407 for lease problems); nothing goes upstream."""
        state.denied = True
        state.reason = reason
        if decision is not None:
            state.decision = decision
        lease_problem = reason.startswith("lease-")
        body = json.dumps({"error": "egress_denied", "reason": reason, "rule": None}).encode("ascii")
        headers = {"Content-Type": "application/json", DENY_HEADER: reason, "Connection": "close" if lease_problem else "keep-alive"}
        if lease_problem:
            headers["Proxy-Authenticate"] = 'Bearer realm="egresslaw"'
        flow.response = http.Response.make(407 if lease_problem else 403, body, headers)
        self._needles.pop(flow.id, None)

    def _finish(self, flow: http.HTTPFlow, *, kind: str) -> None:
        """Write the one audit event of this flow, count it, forget its state."""
        state = self._flows.pop(flow.id, None)
        self._needles.pop(flow.id, None)
        if state is None:
            return
        flow.metadata[AUDITED] = True  # a flag only: no lease, no credential in metadata
        try:
            self._scrub(flow, state)
            elapsed = max(0.0, self._now() - state.started)
            decision = "deny" if state.denied else "allow"
            reason = state.reason or ("allowed" if not state.denied else "internal-error")
            rule = state.decision.rule if (state.decision is not None and not state.denied) else None
            status = flow.response.status_code if flow.response is not None else None
            event = {
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
                "rule": rule,
                "status": status,
                "bytes_up": len(flow.request.raw_content or b"") if kind != "connect" else 0,
                "bytes_down": (len(flow.response.raw_content or b"") + state.streamed) if (flow.response is not None and kind != "connect") else 0,
                "duration_ms": round(elapsed * 1000, 3),
                "redactions": state.redactions,
            }
            if state.denied and reason != "allowed":
                log.info("deny %s %s %s:%s%s", reason, _printable(flow.request.method), _printable(state.host), state.port, _printable(state.path or ""))
            self._count(decision, reason, elapsed)
            self._emit(event)
        except Exception:
            _log_internal("internal error while auditing a flow")
            self._count("deny", "internal-error", 0.0)
            self._emit({"kind": kind, "id": flow.id, "decision": "deny", "reason": "internal-error"})

    def _scrub(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Remove the injected credential from the flow object once it has been sent (or not)."""
        if state.lease is None or state.lease.connection is None or state.policy is None:
            return
        connection = state.policy.artifact.connection(state.lease.connection)
        if connection is not None and connection.inject.header in flow.request.headers:
            flow.request.headers[connection.inject.header] = "[REDACTED]"

    def _who(self, lease: Lease | None) -> dict[str, Any]:
        return {
            "subject": lease.subject if lease else None,
            "profile": lease.profile if lease else None,
            "connection": lease.connection if lease else None,
        }

    def _emit(self, event: dict[str, Any]) -> None:
        if self.audit is None:
            return
        policy = self.policy
        event.setdefault("artifact", policy.artifact.digest if policy else None)
        if policy is not None and not policy.proved:
            event["unproven"] = True
        if self.test_routing:
            event["test_routing"] = self.test_routing
        self.audit.emit(event)

    def _count(self, decision: str, reason: str, elapsed: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(decision, reason, elapsed)


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
            if peer is not None and self.REFUSAL.match(record.getMessage()):
                self.addon.audit_malformed(peer)
        except Exception:
            _log_internal("internal error while auditing a refused request")
        return record.levelno >= logging.getLogger(self.LOGGER).parent.getEffectiveLevel()


def _mark_response_headers(resp: http.Response) -> None:
    """Strip `X-Egresslaw-*` an upstream sent (they are ours to set) and mark a 3xx as not followed."""
    fields = [(k, v) for k, v in resp.headers.fields if not k.lower().startswith(OUR_PREFIX)]
    if len(fields) != len(resp.headers.fields):
        resp.headers = http.Headers(fields)
    if 300 <= resp.status_code < 400:
        resp.headers[REDIRECT_HEADER] = "not-followed"


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


def _has_body(req: http.Request) -> bool:
    cl = req.headers.get("content-length")
    if req.headers.get("transfer-encoding"):
        return True
    try:
        return cl is not None and int(cl) > 0
    except ValueError:
        return True


def _redact(data: bytes, needles: Sequence[bytes]) -> tuple[bytes, int]:
    hits = 0
    for needle in needles:
        if needle in data:
            hits += data.count(needle)
            data = data.replace(needle, REDACTED)
    return data, hits


def _authority(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return shown if port == default else f"{shown}:{port}"


def _load_lease_key(keys_dir: str) -> bytes:
    from egress_proxy.keys import KeyFileError, load_lease_key

    try:
        return load_lease_key(keys_dir)
    except KeyFileError as exc:
        raise StartupError(exc.message, exc.help) from None


def _open_store(store: str, keys_dir: str):
    from egress_proxy.custody import CustodyError, CustodyStore
    from egress_proxy.keys import KeyFileError

    if not store:
        raise StartupError("a custody store is required (`--store custody.db`)")
    try:
        return CustodyStore(store, keys_dir, create=False)
    except (CustodyError, KeyFileError) as exc:
        raise StartupError(exc.message, exc.help) from None
