"""The front ends' audit exporter: `egresslaw audit export --follow` as a child process (docs/audit-export.md).

    check_export(config)                       # at start-up, before anything listens: StartupError on a bad option
    child = ExporterChild(config, front="edge")
    child.start()                              # after the audit log is open
    metrics.registry.register(ExportCollector(child))
    await child.stop()                         # after the audit log is closed: the exporter ships its last lines

The exporter reads the chain the audit log has written (the source of truth) and keeps its own checkpoint, so the
proxy never waits on a collector: a slow or absent one is a backlog on disk, a metric and a log line. It runs in
its own process (its CPU, memory and a crash stay its own), is restarted when it exits (backoff to 30 s), and dies
with the front end (it asks the kernel for SIGTERM at its parent's death): a restarted front end's exporter
resumes at the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from egress_proxy.front.startup import StartupError

log = logging.getLogger("egresslaw.export")

# The child is forked with SIGTERM and SIGINT blocked (the watcher thread blocks them for itself, and a child starts
# with the mask of the thread that forked it, kept across execve): a blocked signal waits, and the exporter unblocks
# them once its handlers are in place, so a stop that comes while it starts is a drain, not a kill. It asks the kernel
# for SIGTERM when that thread dies (prctl PR_SET_PDEATHSIG, also kept across execve), checks its parent did not die
# before that, then becomes the exporter: a front end killed with SIGKILL takes its exporter with it (the exporter
# drains and writes its checkpoint on SIGTERM), and the restarted one resumes there.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
                   "os.getppid() == int(sys.argv[1]) or sys.exit(0)\n"
                   "os.execv(sys.argv[2], sys.argv[2:])\n")
RESTART_MIN, RESTART_MAX = 0.5, 30.0
FRESH_SECONDS = 30.0  # `egresslaw_audit_export_up` is 1 while the state was written this recently
CHILD_ENVIRONMENT = frozenset({"PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR"})
STOP_SECONDS = 15.0  # SIGTERM, then the exporter's last attempt (its send timeout) and its checkpoint


def check_export(config: Any) -> None:
    """The export options of a front end's config, checked before anything listens (a bad one stops start-up)."""
    if not getattr(config, "export_to", None):
        for flag, value in (("--export-headers", config.export_headers), ("--export-ca", config.export_ca),
                            ("--export-cert", config.export_cert), ("--export-key", config.export_key)):
            if value:
                raise StartupError(f"{flag} is set but --export-to is not", "give --export-to URL (or EGRESSLAW_EXPORT_TO), or drop " + flag)
        return
    # Imported here: only a front end that exports loads the exporter (it never loads grpc: check_options connects nothing)
    from egress_proxy.audit.export import ExportError, check_options

    try:
        check_options(config.export_to, headers=config.export_headers, ca=config.export_ca, cert=config.export_cert, key=config.export_key)
    except ExportError as exc:  # its words name `audit export`'s flags: say the front end's
        said = [_front_flags(text) if text else text for text in (exc.message, exc.help)]
        raise StartupError(*said) from None


_THEIR_FLAG = re.compile(r"(?<![\w-])--(to|headers|ca|cert|key)\b")


def _front_flags(text: str) -> str:
    """`audit export`'s flags named in a message, as the front end spells them (`--ca` is `--export-ca`)."""
    return _THEIR_FLAG.sub(r"--export-\1", text)


def state_dir(config: Any) -> Path:
    # Imported here: only a front end that exports loads grpc and protobuf
    from egress_proxy.audit.export import default_state_dir

    return Path(config.export_state) if config.export_state else default_state_dir(Path(config.audit_log))


class ExporterChild:
    """`egresslaw audit export --follow` for one front end's audit log, kept running until `stop()`."""

    def __init__(self, config: Any, *, front: str, instance: str | None = None) -> None:
        self.config = config
        self.front = front
        self.instance = instance
        self.state = state_dir(config)
        self._proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0

    def command(self) -> list[str]:
        cfg = self.config
        cmd = [sys.executable, "-c", DIE_WITH_PARENT, str(os.getpid()), sys.executable, "-m", "egresslaw", "audit", "export",
               str(cfg.audit_log), "--to", cfg.export_to, "--follow", "--state", str(self.state), "--front", self.front]
        for flag, value in (("--headers", cfg.export_headers), ("--ca", cfg.export_ca), ("--cert", cfg.export_cert),
                            ("--key", cfg.export_key), ("--instance", self.instance)):
            if value:
                cmd += [flag, str(value)]
        return cmd

    @property
    def running(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self) -> None:
        """Spawn the exporter and watch it (a thread that lives until `stop()`: the child's parent-death signal is
        tied to the thread that forked it)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="egresslaw-export", daemon=True)
        self._thread.start()

    def environment(self) -> dict[str, str]:
        """The child's whole environment: what a Python process needs, and this process's log format and level. Nothing
        else: the proxy's environment may hold a store URL with its password, or EGRESSLAW_* settings the exporter has
        no use for."""
        env = {k: v for k, v in os.environ.items() if k in CHILD_ENVIRONMENT}
        root = logging.getLogger()
        level = logging.getLevelName(root.getEffectiveLevel()).lower()
        env["EGRESSLAW_LOG_LEVEL"] = level if level in ("debug", "info", "warning", "error") else "info"
        json_lines = any(type(h.formatter).__name__ == "JsonFormatter" for h in root.handlers)  # egresslaw.logs's (a room above)
        env["EGRESSLAW_LOG_FORMAT"] = "json" if json_lines else "text"
        return env

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, env=self.environment(), close_fds=True)

    def _watch(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # this thread only (signals are the main thread's): its children start with them blocked
        delay = RESTART_MIN
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self._proc = self._spawn()
            except OSError as exc:
                log.error("cannot start the audit exporter: %s; retrying in %.0f s", exc.strerror or exc, delay)
            else:
                if self._stopping.is_set():  # stop_now() ran while this child was being started: it signalled the one before
                    self._proc.send_signal(signal.SIGTERM)
                code = self._proc.wait()
                if self._stopping.is_set():
                    return
                if time.monotonic() - started > 60:
                    delay = RESTART_MIN
                self.restarts += 1
                log.error("the audit exporter exited (code %s); restarting it in %.1f s (it resumes at its checkpoint)", code, delay)
            if self._stopping.wait(delay):
                return
            delay = min(RESTART_MAX, delay * 2)

    def stop_now(self, timeout: float = STOP_SECONDS) -> None:
        """SIGTERM the exporter (it drains what is written, at most its send timeout, and writes its checkpoint), then
        wait; SIGKILL if it lingers."""
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("the audit exporter did not stop within %.0f s; killed (it resumes at its checkpoint)", timeout)
                proc.kill()
                proc.wait()
        if self._thread is not None:
            self._thread.join(timeout)

    async def stop(self, timeout: float = STOP_SECONDS) -> None:
        await asyncio.to_thread(self.stop_now, timeout)


class ExportCollector:
    """The exporter's metrics, read from its `state.json` at each scrape (docs/audit-export.md, "Metrics")."""

    def __init__(self, child: ExporterChild) -> None:
        self.child = child

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._families())
        except (TypeError, ValueError, AttributeError) as exc:  # a state file of the right version but the wrong shape
            log.error("audit export state `%s` cannot be read (%s); the exporter's metrics say it is down", self.child.state, exc.__class__.__name__)
            families = [_gauge("egresslaw_audit_export_up", "1 while the audit exporter runs and its state is fresh (written in the last 30 s).", 0)]
        yield from families

    def _families(self) -> Iterator[Metric]:
        # Imported here: only a front end that exports loads grpc and protobuf
        from egress_proxy.audit.export import read_state

        state = read_state(self.child.state) or {}
        chains = state.get("chains") or {}
        fresh = isinstance(state.get("updated"), (int, float)) and time.time() - state["updated"] < FRESH_SECONDS
        yield _gauge("egresslaw_audit_export_up", "1 while the audit exporter runs and its state is fresh (written in the last 30 s).",
                     1 if self.child.running and fresh else 0)
        yield _gauge("egresslaw_audit_export_backlog_bytes", "Bytes of the audit chains not yet acknowledged by the collector.",
                     sum(int(c.get("backlog_bytes") or 0) for c in chains.values()))
        yield _gauge("egresslaw_audit_export_lag_seconds", "Age of the oldest audit line not yet acknowledged by the collector (0: caught up).",
                     max((float(c.get("lag_seconds") or 0) for c in chains.values()), default=0.0))
        yield _gauge("egresslaw_audit_export_broken", "Audit chains whose export stopped at a break in the chain.",
                     sum(1 for c in chains.values() if c.get("broken")))
        for name, key, text in (("egresslaw_audit_exported_records", "exported", "Audit lines the collector acknowledged."),
                                ("egresslaw_audit_export_failures", "failures", "Export attempts that failed (unreachable, timeout, not 2xx)."),
                                ("egresslaw_audit_export_rejected", "rejected", "Records the collector acknowledged as rejected."),
                                ("egresslaw_audit_export_gaps", "gaps", "Audit segments deleted before they were exported.")):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], float(state.get(key) or 0))
            yield counter


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, text)
    gauge.add_metric([], value)
    return gauge
