"""Embedding: a mitmproxy Master with only the addons the edge needs, the admin listener, reload.

    edge = Edge(EdgeConfig(artifact=..., proof=..., keys=..., store=..., audit_log=...))
    await edge.start()        # StartupError: nothing is listening
    ...
    edge.shutdown()           # SIGTERM: drain (stop accepting, finish in-flight requests), then stop
    await edge.stop()         # drains, then writes the last events and closes the audit log

`start_in_thread(config)` runs the same thing on its own loop in a background thread (tests, bench).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egress_proxy.edge.addon import REQUIRED_OPTIONS, EgressLaw
from egress_proxy.edge.limits import LimitError, limit_config
from egress_proxy.front.settings import DEFAULTS, FrontConfig
from egress_proxy.front.startup import check_budget_store, bind_error, upstream_bundle, Resolver, StartupError, load_audit_key_file, load_lease_key_file, gate, parse_connect_to, parse_resolve
from egress_proxy.edge.startup import check_credentials_sealed, open_custody
from egress_proxy.run.exporter import ExportCollector, ExporterChild, check_export
from egress_proxy.run.metrics import AdminServer, Metrics, admin_token

log = logging.getLogger("egresslaw.proxy")

START_TIMEOUT = 15.0
WATCH_INTERVAL = 1.0


@dataclass(frozen=True, kw_only=True)
class EdgeConfig(FrontConfig):
    """Everything `egresslaw proxy` takes: the front ends' settings (`FrontConfig`) and the edge's own."""

    store: str
    allow_missing_credentials: bool = False  # start although a connection's credential is not sealed (warned; denied at use)
    watch_interval: float = WATCH_INTERVAL
    # Request-side limits (docs/proxy.md "Limits"); sizes in bytes, times in seconds.
    max_request_line: int = DEFAULTS.max_request_line
    max_body: int = DEFAULTS.max_body
    max_body_for: Sequence[str] = ()  # NAME=SIZE or NAME/RULE=SIZE
    max_connections_per_client: int = DEFAULTS.max_connections_per_client
    bounds: Mapping[str, Any] = field(default_factory=dict)  # egress_proxy.edge.limits.BOUNDS: name -> value (unset: its default)
    extra_options: dict[str, Any] = field(default_factory=dict)
    reuse_port: bool = False  # listen with SO_REUSEPORT beside the other workers of `--workers N` (egress_proxy.run.supervisor)

    def limit_options(self) -> dict[str, Any]:
        """The addon options of the limits (StartupError if one is unusable)."""
        values = dict(
            max_head_bytes=self.max_head_bytes, max_headers=self.max_headers, max_request_line=self.max_request_line,
            max_body=self.max_body, max_body_for=list(self.max_body_for), max_connections_per_client=self.max_connections_per_client,
            max_connections=self.max_connections, header_timeout=self.header_timeout,
        )
        try:
            checked = limit_config(**values, **self.bounds)
        except LimitError as exc:
            raise StartupError(str(exc)) from None
        if isinstance(self.idle_timeout, bool) or not isinstance(self.idle_timeout, int) or self.idle_timeout <= 0:
            raise StartupError(f"--idle-timeout `{self.idle_timeout}` must be a whole number of seconds greater than 0")
        out = {f"egresslaw_{k}": v for k, v in values.items()}
        out.update(egresslaw_max_head_bytes=checked.max_head_bytes, egresslaw_max_request_line=checked.max_request_line,
                   egresslaw_max_body=checked.max_body, egresslaw_header_timeout=checked.header_timeout)
        out.update({f"egresslaw_{name}": getattr(checked, name) for name in self.bounds})
        return out


def preflight(config: EdgeConfig, *, policy: bool = True, artifact: Any = None) -> None:
    """Every start-up check that needs no listener: limits, artifact + proof (unless `policy=False`: the caller
    verified them and passes the `artifact`), keys, store, every connection's credential sealed, routing options,
    CA file."""
    config.limit_options()
    if policy:
        artifact = gate(config).artifact
    parse_resolve(config.resolve)
    parse_connect_to(config.connect_to)
    check_export(config)

    load_lease_key_file(config.keys)
    load_audit_key_file(config.keys)
    if artifact is not None:
        check_budget_store(config.budget_store, artifact)  # the ledger, when the artifact declares a budget
    store = open_custody(config.store, config.keys, artifact)
    try:
        if artifact is not None:
            check_credentials_sealed(artifact, store, allow_missing=config.allow_missing_credentials)
    finally:
        with contextlib.suppress(Exception):
            store.close()
    if config.upstream_ca is not None and not Path(config.upstream_ca).is_file():
        raise StartupError(f"--upstream-ca `{config.upstream_ca}` is not a readable file")


class Edge:
    """The running egress proxy: mitmproxy master + egresslaw addon + admin listener + artifact watcher."""

    def __init__(self, config: EdgeConfig, *, resolver: Resolver | None = None, custody: Any = None, metrics: Any = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.addon = EgressLaw(resolver=resolver, custody=custody, metrics=self.metrics)
        self._owns_custody = custody is None  # the store it opens itself, it closes (a pool would go on reconnecting)
        self.master: Any = None
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._admin: Any = None
        self.listen_addrs: list[tuple[str, int]] = []
        self.admin_addr: tuple[str, int] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._drained = False
        self._stopping: asyncio.Future | None = None
        self._starting = False
        self._stop_asked = False  # shutdown() while start() runs: honoured when it ends
        self._deferred: list[asyncio.Server] = []  # reuse_port listeners bound, not yet accepting (serve())
        self.exporter: ExporterChild | None = None  # --export-to: the audit exporter (a worker of --workers N has none: its supervisor's ships every chain)

    async def start(self, *, serve: bool = True) -> None:
        """Start listening; StartupError (and nothing left listening) on any failure. With `serve=False` (a worker
        of `--workers N`, whose listener is SO_REUSEPORT) the listener is bound but accepts nothing until `serve()`."""
        self._starting = True
        try:
            await self._start(serve)
        finally:
            self._starting = False
        if self._stop_asked:  # a SIGTERM while starting: drain now, like any other stop
            self.shutdown()

    async def _start(self, serve: bool) -> None:
        from mitmproxy import exceptions, master, options
        from mitmproxy.addons import core, next_layer, proxyserver, tlsconfig


        cfg = self.config
        preflight(cfg)
        confdir = Path(cfg.confdir).expanduser()
        try:
            confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create confdir `{confdir}`: {exc.strerror}") from None
        self.loop = asyncio.get_running_loop()
        # hpack logs every decoded HTTP/2 header at DEBUG: leases, and the injected credential on an HTTP/2 upstream.
        logging.getLogger("hpack").setLevel(max(logging.INFO, logging.getLogger("hpack").level))
        opts = options.Options(listen_host=cfg.listen[0], listen_port=cfg.listen[1], confdir=str(confdir))
        self.master = master.Master(opts, event_loop=self.loop)
        ps = proxyserver.Proxyserver()
        if cfg.reuse_port:
            _listen_beside_workers(ps, self._deferred)
        elif not serve:
            raise ValueError("serve=False needs reuse_port")
        # Our addon runs before TlsConfig so it can refuse a client handshake first.
        self.master.addons.add(core.Core(), ps, next_layer.NextLayer(), self.addon, tlsconfig.TlsConfig())
        mitm: dict[str, Any] = dict(REQUIRED_OPTIONS)
        mitm["http2"] = True
        mitm["tcp_timeout"] = cfg.idle_timeout  # the idle timeout: no byte either way for this long closes a connection
        mitm["ssl_verify_upstream_trusted_ca"] = upstream_bundle(confdir, cfg.upstream_ca) if cfg.upstream_ca else None
        mitm.update(cfg.extra_options)
        ours = {
            "egresslaw_artifact": cfg.artifact,
            "egresslaw_proof": cfg.proof,
            "egresslaw_keys": cfg.keys,
            "egresslaw_store": cfg.store,
            "egresslaw_budget_store": cfg.budget_store,
            "egresslaw_audit_log": cfg.audit_log,
            "egresslaw_allow_unproven": cfg.allow_unproven,
            "egresslaw_trust_proofs": cfg.trust_proofs,
            "egresslaw_allow_unsigned_proofs": cfg.allow_unsigned_proofs,
            "egresslaw_require_within": cfg.require_within,
            "egresslaw_resolve": list(cfg.resolve),
            "egresslaw_connect_to": list(cfg.connect_to),
            "egresslaw_upstream_ca": cfg.upstream_ca,
            "egresslaw_nameservers": list(cfg.nameservers),
            "egresslaw_dns_timeout": float(cfg.dns_timeout),
            "egresslaw_dns_concurrency": int(cfg.dns_concurrency),
            **cfg.limit_options(),
            "egresslaw_audit_max_bytes": cfg.audit_max_bytes,
            "egresslaw_audit_max_age": cfg.audit_max_age,
            "egresslaw_audit_sync": str(cfg.audit_sync),
        }
        try:
            opts.update(**mitm, **ours)
        except exceptions.OptionsError as exc:
            raise StartupError(str(exc)) from None
        if cfg.admin is not None:
            try:
                token = admin_token(confdir)
            except OSError as exc:
                raise StartupError(f"admin token: {exc}") from None
            self._admin = AdminServer(self.metrics, token, ready=self.not_ready)
            try:
                self.admin_addr = await self._admin.start(*cfg.admin)
            except OSError as exc:
                self._admin = None
                self.addon.done()
                raise StartupError(
                    f"cannot listen on admin address `{cfg.admin[0]}:{cfg.admin[1]}`: {exc.strerror}",
                    "free it or choose another with `--admin HOST:PORT` (or EGRESSLAW_ADMIN); `ss -ltnp` shows who holds a port",
                ) from None
            self.addon.own_addresses.add(self.admin_addr)
        self._task = asyncio.create_task(self.master.run())
        deadline = self.loop.time() + START_TIMEOUT
        while not ps.listen_addrs():
            if self._task.done() or self.addon.is_running or self.loop.time() > deadline:
                await self._abort()
                raise StartupError(
                    f"cannot listen on `{cfg.listen[0]}:{cfg.listen[1]}`: {bind_error(cfg.listen)}",
                    "free it or choose another with `--listen HOST:PORT` (or EGRESSLAW_LISTEN); `ss -ltnp` shows who holds a port",
                )
            await asyncio.sleep(0.01)
        self.listen_addrs = [(str(a[0]), int(a[1])) for a in ps.listen_addrs()]
        for addr in self.listen_addrs:
            self.addon.own_addresses.add(addr)
        if self.addon.policy is not None:
            self.metrics.serving(self.addon.policy.artifact.digest, self.addon.policy.proved)
        self.metrics.watch_audit(self.addon.audit)
        if cfg.export_to and not cfg.reuse_port:
            self.exporter = ExporterChild(cfg, front="edge")
            self.metrics.registry.register(ExportCollector(self.exporter))
            self.exporter.start()
        if cfg.watch_interval > 0:
            self._watch = asyncio.create_task(self._watch_artifact())
        if serve:
            await self.serve()

    async def serve(self) -> None:
        """Start accepting on listeners that `start(serve=False)` left bound (idempotent; nothing to do otherwise)."""
        deferred, self._deferred = self._deferred, []
        for server in deferred:
            await server.start_serving()

    async def _abort(self) -> None:
        with contextlib.suppress(Exception):
            self.master.shutdown()
            if self._task is not None:
                await asyncio.wait_for(self._task, 5)
        if self._admin is not None:
            await self._admin.stop()
        self.addon.done()

    def reload(self) -> bool:
        """Reload the artifact and proof now (also what SIGHUP does)."""
        return self.addon.reload()

    def install_sighup(self) -> None:
        """Reload on SIGHUP (main thread only)."""
        assert self.loop is not None
        self.loop.add_signal_handler(signal.SIGHUP, self.reload)

    async def _watch_artifact(self) -> None:
        while True:
            await asyncio.sleep(self.config.watch_interval)
            try:
                if self.addon.artifact_changed():
                    log.info("artifact file changed; reloading")
                    self.addon.reload()
            except Exception as exc:  # the watcher must never die; a failed reload keeps the old artifact
                log.error("artifact watch failed (%s)", exc.__class__.__name__)

    async def wait(self) -> None:
        """Until the proxy stops (shutdown or a fatal error)."""
        assert self._task is not None
        await self._task

    def not_ready(self) -> list[str]:
        """Why the edge should get no traffic now, as short codes (empty: ready). `/readyz` serves this."""
        addon, why = self.addon, []
        if addon.draining:
            why.append("draining")
        if addon.policy is None:
            why.append("no-artifact")
        if addon.custody is None:
            why.append("custody-closed")
        elif not getattr(addon.custody, "healthy", lambda: True)():
            why.append("custody-unavailable")  # a shared (PostgreSQL) store that cannot be reached: it recovers by itself
        self.metrics.custody("custody-closed" not in why and "custody-unavailable" not in why)
        if addon.audit is None or not addon.audit.writable:
            why.append("audit-unwritable")
        if self._task is None or self._task.done():
            why.append("not-serving")
        return why

    def shutdown(self) -> None:
        """What SIGTERM and SIGINT do: drain, then stop the master. A second signal stops at once. Before the
        start has ended (a signal during start-up) the stop is kept and `start()` honours it as it ends."""
        if self._starting:
            self._stop_asked = True
            return
        if self._stopping is not None or self.master is None:
            if self.master is not None:
                self.master.shutdown()
            return

        async def drain_then_stop() -> None:
            try:
                await self.drain()
            finally:
                self.master.shutdown()

        self._stopping = asyncio.ensure_future(drain_then_stop())

    async def drain(self) -> None:
        """Stop accepting connections, answer new allowed requests 503 `draining`, give the requests in flight up to
        `drain_grace` seconds, then close every client connection (whatever is still open gets its closing event)."""
        if self._drained or self.master is None:
            return
        self._drained = True
        self.addon.start_draining()
        loop = asyncio.get_running_loop()
        ps = self.master.addons.get("proxyserver")
        try:
            await ps.servers.update([])  # listeners closed; connections already accepted keep being served
        except Exception as exc:
            log.error("drain: cannot close the listeners (%s)", exc.__class__.__name__)
        deadline = loop.time() + self.config.drain_grace
        while self.addon.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if left := self.addon.in_flight():
            log.warning("drain: %d request(s) still in flight after %g s; closing their connections", left, self.config.drain_grace)
        for handler in list(ps.connections.values()):
            io = handler.transports.get(handler.client)
            if io is not None and io.handler is not None:
                io.handler.cancel("egresslaw shutdown")
        deadline = loop.time() + 5
        while ps.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Graceful shutdown: drain, stop the master, write the last events and close the audit log."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.master is not None and self._task is not None and not self._task.done():
            await self.drain()
        if self._admin is not None:
            await self._admin.stop()
        if self.master is not None:
            self.master.shutdown()
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._task, 10)
        self.addon.done()  # idempotent: the last events, a closing checkpoint, fsync
        if self.exporter is not None:  # after the closing checkpoint: it ships the last lines, then its checkpoint
            await self.exporter.stop()
        if self._owns_custody and self.addon.custody is not None:
            with contextlib.suppress(Exception):
                self.addon.custody.close()


_BESIDE_WORKERS: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()


def _listen_beside_workers(proxyserver: Any, deferred: list) -> None:
    """Make this proxyserver's regular-mode listener bind with SO_REUSEPORT and wait for `Edge.serve()` to accept.

    mitmproxy binds with `asyncio.start_server(handler, host, port)` and offers no hook for socket options; its
    per-mode server classes cannot be subclassed (one class per mode, asserted at class creation), so the method is
    wrapped once per process and applies only to proxyservers registered here (other edges in the process bind as
    usual)."""
    from mitmproxy.proxy import mode_servers

    _BESIDE_WORKERS[proxyserver] = deferred
    cls = mode_servers.RegularInstance
    if getattr(cls.listen, "_egresslaw_workers", False):
        return
    original = cls.listen

    async def listen(self, host: str, port: int):
        held = _BESIDE_WORKERS.get(self.manager)
        if held is None:
            return await original(self, host, port)
        server = await asyncio.start_server(self.handle_stream, host, port, reuse_port=True, start_serving=False)
        held.append(server)
        return [server]

    listen._egresslaw_workers = True  # type: ignore[attr-defined]
    cls.listen = listen


class ThreadedEdge:
    """An Edge on its own event loop in a daemon thread (for tests and benchmarks)."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="egresslaw-edge", daemon=True)

    def start(self) -> ThreadedEdge:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.edge.start(), self.loop).result(START_TIMEOUT + 5)
        return self

    def call(self, fn, *args):
        """Run `fn(*args)` on the edge's loop and return its result."""
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.edge.stop(), self.loop).result(20)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def start_in_thread(config: EdgeConfig, *, resolver: Resolver | None = None, custody: Any = None) -> ThreadedEdge:
    """Start an Edge in a background thread; StartupError if it cannot serve."""
    return ThreadedEdge(Edge(config, resolver=resolver, custody=custody)).start()
