"""Embedding: a mitmproxy Master with only the addons the edge needs, the admin listener, reload.

    edge = Edge(EdgeConfig(artifact=..., proof=..., keys=..., store=..., audit_log=...))
    await edge.start()        # StartupError: nothing is listening
    ...
    await edge.stop()         # drains the audit log (fsync) before returning

`start_in_thread(config)` runs the same thing on its own loop in a background thread (tests, bench).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egress_proxy.addon import REQUIRED_OPTIONS, EgressLaw, Resolver, StartupError, load_policy, parse_connect_to, parse_resolve

log = logging.getLogger("egresslaw.proxy")

START_TIMEOUT = 15.0
WATCH_INTERVAL = 1.0


@dataclass(frozen=True)
class EdgeConfig:
    """Everything `egresslaw proxy` takes; addresses as (host, port). `admin=None` disables the admin port."""

    artifact: str
    proof: str
    keys: str
    store: str
    audit_log: str
    listen: tuple[str, int] = ("127.0.0.1", 8080)
    admin: tuple[str, int] | None = ("127.0.0.1", 9090)
    confdir: str = "~/.egresslaw"
    allow_unproven: bool = False
    resolve: Sequence[str] = ()
    connect_to: Sequence[str] = ()
    upstream_ca: str | None = None
    trust_proofs: str | None = None  # accept only proof reports signed by this Ed25519 public key
    watch_interval: float = WATCH_INTERVAL
    extra_options: dict[str, Any] = field(default_factory=dict)


def preflight(config: EdgeConfig) -> None:
    """Every start-up check that needs no listener: artifact + proof, keys, store, routing options, CA file."""
    load_policy(config.artifact, config.proof, allow_unproven=config.allow_unproven, trust_proofs=config.trust_proofs)
    parse_resolve(config.resolve)
    parse_connect_to(config.connect_to)
    from egress_proxy.addon import _load_lease_key, _open_store

    _load_lease_key(config.keys)
    store = _open_store(config.store, config.keys)
    with contextlib.suppress(Exception):
        store.close()
    if config.upstream_ca is not None and not Path(config.upstream_ca).is_file():
        raise StartupError(f"--upstream-ca `{config.upstream_ca}` is not a readable file")


def upstream_bundle(confdir: Path, extra_ca: str) -> str:
    """The default trust store plus `extra_ca`, written to `<confdir>/upstream-ca-bundle.pem`."""
    import certifi

    try:
        extra = Path(extra_ca).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise StartupError(f"cannot read --upstream-ca `{extra_ca}`: {exc.__class__.__name__}") from None
    if "-----BEGIN CERTIFICATE-----" not in extra:
        raise StartupError(f"--upstream-ca `{extra_ca}` holds no PEM certificate")
    bundle = confdir / "upstream-ca-bundle.pem"
    bundle.write_text(Path(certifi.where()).read_text(encoding="ascii") + "\n" + extra, encoding="ascii")
    return str(bundle)


class Edge:
    """The running egress proxy: mitmproxy master + egresslaw addon + admin listener + artifact watcher."""

    def __init__(self, config: EdgeConfig, *, resolver: Resolver | None = None, custody: Any = None) -> None:
        from egress_proxy.metrics import Metrics

        self.config = config
        self.metrics = Metrics()
        self.addon = EgressLaw(resolver=resolver, custody=custody, metrics=self.metrics)
        self.master: Any = None
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._admin: Any = None
        self.listen_addrs: list[tuple[str, int]] = []
        self.admin_addr: tuple[str, int] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Start listening; StartupError (and nothing left listening) on any failure."""
        from mitmproxy import exceptions, master, options
        from mitmproxy.addons import core, next_layer, proxyserver, tlsconfig

        from egress_proxy.metrics import AdminServer, admin_token

        cfg = self.config
        preflight(cfg)
        confdir = Path(cfg.confdir).expanduser()
        try:
            confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"cannot create confdir `{confdir}`: {exc.strerror}") from None
        self.loop = asyncio.get_running_loop()
        opts = options.Options(listen_host=cfg.listen[0], listen_port=cfg.listen[1], confdir=str(confdir))
        self.master = master.Master(opts, event_loop=self.loop)
        ps = proxyserver.Proxyserver()
        # Our addon runs before TlsConfig so it can refuse a client handshake first.
        self.master.addons.add(core.Core(), ps, next_layer.NextLayer(), self.addon, tlsconfig.TlsConfig())
        mitm: dict[str, Any] = dict(REQUIRED_OPTIONS)
        mitm["http2"] = True
        mitm["ssl_verify_upstream_trusted_ca"] = upstream_bundle(confdir, cfg.upstream_ca) if cfg.upstream_ca else None
        mitm.update(cfg.extra_options)
        ours = {
            "egresslaw_artifact": cfg.artifact,
            "egresslaw_proof": cfg.proof,
            "egresslaw_keys": cfg.keys,
            "egresslaw_store": cfg.store,
            "egresslaw_audit_log": cfg.audit_log,
            "egresslaw_allow_unproven": cfg.allow_unproven,
            "egresslaw_trust_proofs": cfg.trust_proofs,
            "egresslaw_resolve": list(cfg.resolve),
            "egresslaw_connect_to": list(cfg.connect_to),
            "egresslaw_upstream_ca": cfg.upstream_ca,
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
            self._admin = AdminServer(self.metrics, token)
            try:
                self.admin_addr = await self._admin.start(*cfg.admin)
            except OSError as exc:
                self._admin = None
                self.addon.done()
                raise StartupError(f"cannot listen on admin address `{cfg.admin[0]}:{cfg.admin[1]}`: {exc.strerror}") from None
            self.addon.own_addresses.add(self.admin_addr)
        self._task = asyncio.create_task(self.master.run())
        deadline = self.loop.time() + START_TIMEOUT
        while not ps.listen_addrs():
            if self._task.done() or self.addon.is_running or self.loop.time() > deadline:
                await self._abort()
                raise StartupError(f"cannot listen on `{cfg.listen[0]}:{cfg.listen[1]}` (address in use or not permitted)")
            await asyncio.sleep(0.01)
        self.listen_addrs = [(str(a[0]), int(a[1])) for a in ps.listen_addrs()]
        for addr in self.listen_addrs:
            self.addon.own_addresses.add(addr)
        if cfg.watch_interval > 0:
            self._watch = asyncio.create_task(self._watch_artifact())

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

    async def stop(self) -> None:
        """Graceful shutdown: stop listening, finish, flush and close the audit log."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._admin is not None:
            await self._admin.stop()
        if self.master is not None:
            self.master.shutdown()
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._task, 10)
        self.addon.done()  # idempotent: drains and fsyncs the audit queue


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
