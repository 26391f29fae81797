"""What the audit exporter (docs/audit-export.md, `egresslaw audit export`) costs and whether it keeps pace, in one run:

  1. Keeping pace: `egresslaw lane` (started as bench/lane.py starts it) twice, once without `--export-to` and once with
     `--export-to grpc://…` (a real OTLP receiver, tests/otlp_receiver.py, in a process of its own so its CPU is not
     the exporter's), `--clients` keep-alive CONNECT+TLS clients for `--seconds` per window. The exporter's
     `state.json` (`<LOG>.export/state.json`) is sampled every 0.5 s: the backlog's maximum, its slope over the last
     half of the window (against the rate the audit log grows), the backlog 2 s after the clients stop, the seconds
     until it is 0; at the end every line of the lane's chains (their `mac`s) is looked up among the uids received.
  2. CPU per request: the lane's process tree (the lane, its Envoy, the exporter: user + system, from /proc) per
     request answered, with the exporter and without; the exporter's own CPU per request and its share. A window
     lasts until the lane's access-log reader has caught up and, with the exporter, until its backlog is 0 (the
     lines of the window's requests are exported inside it). `--rounds N` interleaved; medians and pooled.
  3. The collector down: the receiver stops for `--down-seconds` while the load goes on; the exporter's RSS
     (/proc/PID/status VmRSS) and the backlog every 0.5 s; then the load stops, the receiver starts again on the
     same port, and the seconds until the backlog is 0 (the exporter's backoff reaches 5 s) and nothing missing.
  4. Batch throughput: `egresslaw audit export LOG --to …` (no --follow) over a prepared log of `--lines` lines
     (a real AuditLog, Event constructors), over gRPC and HTTP/protobuf: lines/s (the process's start included),
     and its headroom against the lane's rate from 1 (lines per request × requests/s).

If `egresslaw lane` cannot start here, the same runs use `egresslaw proxy --workers 1` (said so in the output).
The receiver keeps only the uids it acknowledged (a subclass whose `_store` counts them): its answers are the
real receiver's. The load generator, the upstream, the receiver and the proxies share this machine's cores.

Usage: `.venv/bin/python bench/export.py [--seconds 20] [--rounds 3] [--down-seconds 30] [--lines 200000]`
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lane import HOST, PROFILE, PUBLIC, _caught_up, _started, _tree_cpu, _wait_ca  # noqa: E402
from bench.proxy import CONCURRENCY, _client_connect, _serve, _two_free_ports  # noqa: E402
from egress_proxy.audit import export  # noqa: E402
from egress_proxy.audit.event import Event  # noqa: E402
from egress_proxy.audit.log import AuditLog, segment_path  # noqa: E402
from egress_proxy.custody.keys import init_keys, load_audit_key  # noqa: E402
from tests.egress_proxy import builders as b  # noqa: E402
from tests.egress_proxy.conftest import _issue, free_port, make_env  # noqa: E402
from tests.otlp_receiver import Receiver  # noqa: E402
from tests.proxy_harness import proof_signing_key  # noqa: E402

SAMPLE = 0.5  # seconds between samples of state.json and the RSS
DRAIN_TIMEOUT = 120.0


# -- the receiver, in a process of its own ---------------------------------------------------------


class CountingReceiver(Receiver):
    """The real receiver (its servicer, its answers) keeping only the uids it acknowledged, not every LogRecord."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.seen: set[str] = set()
        self.acknowledged = 0
        self.requests = 0  # export requests acknowledged (the exporter's batches)

    def _store(self, request) -> None:
        uids = [self.attribute(r, "log.record.uid") for rl in request.resource_logs for sl in rl.scope_logs for r in sl.log_records]
        with self.lock:
            self.seen.update(uids)
            self.acknowledged += len(uids)
            self.requests += 1


def _receiver_main(kind: str, conn) -> None:
    rx = CountingReceiver(kind).start()
    conn.send(rx.url)
    while True:
        op, arg = conn.recv()
        if op == "stop":
            rx.stop()
            conn.send(None)
        elif op == "start":
            rx.start()
            conn.send(rx.url)
        elif op == "count":
            with rx.lock:
                conn.send((len(rx.seen), rx.acknowledged, rx.requests))
        elif op == "missing":  # arg: the macs of the chain lines; answers how many were never received
            with rx.lock:
                conn.send(sum(1 for mac in arg if mac not in rx.seen))
        elif op == "quit":
            rx.stop()
            conn.send(None)
            return


class RemoteReceiver:
    def __init__(self, kind: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this process's threads or sockets
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(kind, theirs), daemon=True)
        self.proc.start()
        self.url = self._conn.recv()

    def call(self, op: str, arg=None):
        self._conn.send((op, arg))
        return self._conn.recv()

    def close(self) -> None:
        try:
            self.call("quit")
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# -- reading the exporter --------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except OSError:
        return out
    for child in children:
        out += [child, *_descendants(child)]
    return out


def _exporter_pid(front_pid: int, timeout: float = 30.0) -> int | None:
    """The front end's child whose command line is `… audit export …` (after the die-with-parent shim's execv)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in _descendants(front_pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"audit" in argv and b"export" in argv and b"-c" not in argv:
                return pid
        time.sleep(0.1)
    return None


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _state(state_dir: Path) -> dict | None:
    return export.read_state(state_dir)


def _backlog(state: dict | None) -> int | None:
    if state is None:
        return None
    return sum(c.get("backlog_bytes") or 0 for c in state.get("chains", {}).values())


def _chain_files(audit_log: Path) -> list[Path]:
    return [f for active in export.chains(audit_log)
            for f in [*(segment_path(active, n) for n in export.segment_numbers(active)), active] if f.exists()]


def _chain_bytes(audit_log: Path) -> int:
    return sum(f.stat().st_size for f in _chain_files(audit_log))


def _chain_macs(audit_log: Path) -> list[str]:
    return [json.loads(line)["mac"] for f in _chain_files(audit_log) for line in f.read_bytes().splitlines() if line.strip()]


def _wait_backlog_zero(state_dir: Path, timeout: float = DRAIN_TIMEOUT) -> float | None:
    """Seconds until the state says nothing is behind (twice, 0.3 s apart), or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _backlog(_state(state_dir)) == 0:
            time.sleep(0.3)
            if _backlog(_state(state_dir)) == 0:
                return time.monotonic() - start
        time.sleep(0.05)
    return None


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y)."""
    if len(points) < 2:
        return 0.0
    mt, my = statistics.fmean(t for t, _ in points), statistics.fmean(y for _, y in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


# -- load ------------------------------------------------------------------------------------------


class Load:
    """`clients` keep-alive clients (threads) sending GETs until `stop()`; counts answers and errors."""

    def __init__(self, make, clients: int) -> None:
        self.make, self.stopping = make, threading.Event()
        self.ok = self.errors = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(clients)]

    def _worker(self) -> None:
        conn, target = self.make()
        ok = errors = 0
        while not self.stopping.is_set():
            try:
                conn.request("GET", target)
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    ok += 1
                else:
                    errors += 1
            except (OSError, http.client.HTTPException):
                errors += 1
                conn.close()
                conn, _ = self.make()
        conn.close()
        with self._lock:
            self.ok += ok
            self.errors += errors

    def start(self) -> Load:
        self.t0 = time.perf_counter()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> float:
        self.stopping.set()
        for t in self._threads:
            t.join(30)
        self.elapsed = time.perf_counter() - self.t0
        return self.elapsed


class Sampler:
    """Every SAMPLE seconds: (t, backlog bytes, exporter RSS MiB) until `stop()`; t from `t0`."""

    def __init__(self, state_dir: Path | None, exporter: int | None) -> None:
        self.state_dir, self.exporter = state_dir, exporter
        self.samples: list[tuple[float, int | None, float | None]] = []
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self.t0
            backlog = _backlog(_state(self.state_dir)) if self.state_dir else None
            rss = _rss_mib(self.exporter) if self.exporter else None
            self.samples.append((t, backlog, rss))
            self._stop.wait(SAMPLE)

    def stop(self) -> list[tuple[float, int | None, float | None]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


def _window(front: dict, make, args, rx: RemoteReceiver) -> dict:
    """One window of `args.seconds` of load on `front`; CPU per request, and with an exporter its backlog."""
    pid, state_dir, exp = front["pid"], front.get("state"), front.get("exporter")
    cpu0, exp0 = _tree_cpu(pid), (_tree_cpu(exp) if exp else 0.0)
    exported0 = (_state(state_dir) or {}).get("exported", 0) if state_dir else 0
    bytes0 = _chain_bytes(front["log"])
    batches0 = rx.call("count")[2] if state_dir else 0
    sampler = Sampler(state_dir, exp)
    load = Load(make, args.clients).start()
    time.sleep(args.seconds)
    elapsed = load.stop()
    t_end = time.monotonic() - sampler.t0
    grew = (_chain_bytes(front["log"]) - bytes0) / elapsed
    ingest = _caught_up(front["run_dir"]) if front.get("run_dir") else {}
    drain = None
    if state_dir:
        time.sleep(max(0.0, t_end + 2.0 + SAMPLE - (time.monotonic() - sampler.t0)))  # the sample 2 s after the clients stop
        drain = _wait_backlog_zero(state_dir)
    else:
        time.sleep(max(0.0, t_end + 2.0 - (time.monotonic() - sampler.t0)))  # the same tail, so both windows idle alike
    samples = sampler.stop()
    cpu, exp_cpu = _tree_cpu(pid) - cpu0, (_tree_cpu(exp) - exp0 if exp else 0.0)
    n = max(1, load.ok)
    out = {"n": load.ok, "errors": load.errors, "rps": load.ok / elapsed, "cpu": cpu, "cpu_ms": cpu * 1000 / n,
           "exp_cpu": exp_cpu, "exp_ms": exp_cpu * 1000 / n, "grew_bps": grew, **ingest}
    if state_dir:
        during = [(t, bl) for t, bl, _ in samples if bl is not None and t <= t_end]
        last_half = [(t, bl) for t, bl in during if t >= t_end / 2]
        after = [bl for t, bl, _ in samples if bl is not None and t >= t_end + 2.0]
        out.update(max_backlog=max((bl for _, bl in during), default=0), slope_bps=_slope(last_half),
                   backlog_2s=after[0] if after else None, drain_s=drain,
                   lines=(_state(state_dir) or {}).get("exported", 0) - exported0, batches=rx.call("count")[2] - batches0,
                   exporter_alive=_rss_mib(exp) is not None)
    return out


# -- the front ends --------------------------------------------------------------------------------


def _start_front(kind: str, name: str, tmp: Path, env, up: int, pki, export_to: str | None) -> tuple[subprocess.Popen, dict]:
    port, admin, conf = free_port(), free_port(), tmp / f"{name}-conf"
    log, audit = tmp / f"{name}.log", tmp / f"{name}-audit" / "audit.jsonl"
    tmp.mkdir(parents=True, exist_ok=True)
    given = ["--artifact", env.artifact, "--proof", env.proof, "--trust-proofs", proof_signing_key()[1], "--keys", env.keys,
             "--resolve", f"{HOST}={PUBLIC}", "--connect-to", f"{HOST}:443:127.0.0.1:{up + 1}", "--upstream-ca", pki.ca_pem,
             "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}", "--confdir", conf, "--audit-log", audit]
    if export_to:
        given += ["--export-to", export_to]
    command = ["lane"] if kind == "lane" else ["proxy", "--store", env.store, "--workers", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "egresslaw", *command, *(str(x) for x in given)], cwd=tmp,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    return proc, {"port": port, "conf": conf, "stderr": log, "log": audit, "pid": proc.pid,
                  "run_dir": conf / "lane" if kind == "lane" else None,
                  "state": export.default_state_dir(audit) if export_to else None}


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


# -- the batch throughput --------------------------------------------------------------------------


def _prepared_log(tmp: Path, lines: int) -> tuple[Path, float]:
    keys = tmp / "batch-keys"
    init_keys(keys)
    path = tmp / "batch-audit" / "audit.jsonl"
    log = AuditLog(path, load_audit_key(keys), fsync=False)
    t0 = time.perf_counter()
    web = dict(scheme="https", host=HOST, port=443, tunnel=True, rule=None, status=None, bytes_up=0, bytes_down=0, duration_ms=1.25)
    for i in range(lines // 2):
        log.emit(Event.decided("request", f"r{i}", None, "allow", "allowed", method="GET", path=f"/v1/items/{i}", **web))
        log.emit(Event.outcome("request", f"r{i}", status=200, failure=None, aborted=False, bytes_up=0, bytes_down=11, duration_ms=0.8,
                               redactions=0, rule="read"))
        if i % 500 == 499:
            log.flush()
    assert log.close(), "the prepared audit log did not close cleanly"
    return path, time.perf_counter() - t0


def _batch(path: Path, kind: str, tmp: Path) -> dict:
    rx = RemoteReceiver(kind)
    try:
        state = tmp / f"batch-state-{kind}"
        rx_cpu0, t0 = _tree_cpu(rx.proc.pid), time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "egresslaw", "audit", "export", str(path), "--to", rx.url, "--state", str(state),
                                 "--timeout", "600"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)  # the exporter's own CPU (user + system), as the kernel counted it
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall, rx_cpu = time.perf_counter() - t0, _tree_cpu(rx.proc.pid) - rx_cpu0
        exported = (_state(state) or {}).get("exported", 0)
        macs = _chain_macs(path)
        distinct, acknowledged, batches = rx.call("count")
        missing = rx.call("missing", macs)
    finally:
        rx.close()
    cpu = usage.ru_utime + usage.ru_stime
    return {"rc": proc.returncode, "stderr": stderr.strip()[-400:], "wall": wall, "exported": exported, "lines": len(macs),
            "distinct": distinct, "acknowledged": acknowledged, "missing": missing, "lps": exported / wall, "cpu": cpu,
            "us_per_line": cpu * 1e6 / max(1, exported), "rx_cpu": rx_cpu, "batches": batches}


# -- main ------------------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20, help="seconds of load per window (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the two windows (default 3)")
    parser.add_argument("--clients", type=int, default=CONCURRENCY, help=f"keep-alive clients (default {CONCURRENCY})")
    parser.add_argument("--down-seconds", type=float, default=30, help="seconds the collector is down under load (default 30)")
    parser.add_argument("--lines", type=int, default=200_000, help="lines of the prepared log of the batch runs (default 200000)")
    parser.add_argument("--front", choices=("lane", "proxy"), default="lane", help="the front end (default lane; proxy is the fallback)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores, shared by the clients, the upstream, the "
          f"receiver and the front ends)", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-bench-export-"))
    pki = _issue(tmp / "pki", (HOST,), ("127.0.0.1",))
    up = _two_free_ports()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(up, str(pki.cert_pem), str(pki.key_pem), ready), daemon=True)
    server.start()
    ready.wait(10)
    env = make_env(tmp / "edge", b.artifact(profiles=[b.profile(PROFILE, [(HOST, 443)])], workspace="acme"))
    lease = env.lease(profile=PROFILE, ttl=3600)
    rx = RemoteReceiver("grpc")
    print(f"receiver: gRPC at {rx.url} (pid {rx.proc.pid})", flush=True)

    attempts, procs, fronts = (("lane", "proxy") if args.front == "lane" else ("proxy",)), [], {}
    try:
        for kind in attempts:
            procs, fronts = [], {}
            try:
                for name, to in (("plain", None), ("export", rx.url)):
                    proc, fronts[name] = _start_front(kind, name, tmp / kind, env, up, pki, to)
                    procs.append(proc)
                for proc, (name, front) in zip(procs, fronts.items()):
                    _started(f"{kind} {name}", front["port"], proc, front["stderr"], 90)
                break
            except RuntimeError as exc:
                _stop(procs)
                if kind == attempts[-1]:
                    raise
                print(f"egresslaw lane could not start ({str(exc).splitlines()[0]}): falling back to `egresslaw proxy --workers 1`",
                      flush=True)
        front_name = "egresslaw lane" if kind == "lane" else "egresslaw proxy --workers 1"
        exp = _exporter_pid(fronts["export"]["pid"])
        if exp is None:
            raise RuntimeError(f"{front_name} --export-to: no `audit export` child process found\n"
                               f"{fronts['export']['stderr'].read_text()[-3000:]}")
        fronts["export"]["exporter"] = exp
        print(f"{front_name}: without the exporter pid {fronts['plain']['pid']}, with it pid {fronts['export']['pid']} "
              f"(exporter pid {exp}, state {fronts['export']['state']})", flush=True)
        makes = {name: _client_connect(f["port"], HOST, 443, _wait_ca(f["conf"]), lease) for name, f in fronts.items()}

        # 1 and 2: interleaved windows
        windows: dict[str, list[dict]] = {"plain": [], "export": []}
        for r in range(args.rounds):
            for name in (("plain", "export") if r % 2 == 0 else ("export", "plain")):
                w = _window(fronts[name], makes[name], args, rx)
                windows[name].append(w)
                extra = ""
                if name == "export":
                    extra = (f"  exporter {w['exp_ms']:.3f} ms/request ({w['exp_cpu'] / max(w['cpu'], 1e-9):.1%} of the tree); "
                             f"backlog max {w['max_backlog'] / 1024:.1f} KiB, slope over the last half {w['slope_bps'] / 1024:+.2f} KiB/s "
                             f"(the log grew {w['grew_bps'] / 1024:.1f} KiB/s), 2 s after the clients "
                             f"{(w['backlog_2s'] or 0) / 1024:.1f} KiB, 0 after {w['drain_s'] if w['drain_s'] is None else round(w['drain_s'], 2)} s; "
                             f"{w['lines'] / max(1, w['batches']):.1f} lines per batch")
                print(f"round {r + 1} {name:6s} {w['rps']:7.0f} req/s  tree CPU {w['cpu_ms']:.3f} ms/request  errors {w['errors']}{extra}",
                      flush=True)
            if fronts["export"]["exporter"] and _rss_mib(fronts["export"]["exporter"]) is None:
                print("  the exporter process is gone (restarted by the front end?)", flush=True)
                fronts["export"]["exporter"] = _exporter_pid(fronts["export"]["pid"])

        # 3: the collector down
        f = fronts["export"]
        exp = f["exporter"]
        load = Load(makes["export"], args.clients).start()
        time.sleep(2.0)
        backlog_before = _backlog(_state(f["state"])) or 0
        rx.call("stop")
        sampler = Sampler(f["state"], exp)
        time.sleep(args.down_seconds)
        load.stop()
        down = sampler.stop()
        if f.get("run_dir"):
            _caught_up(f["run_dir"])
        state_down = _state(f["state"]) or {}
        rx.call("start")
        recovery = _wait_backlog_zero(f["state"], timeout=300)
        recovered_rss = _rss_mib(exp)
        rss = [m for _, _, m in down if m is not None]
        backlogs = [bl for _, bl, _ in down if bl is not None]
        outage = {"rss_start": rss[0] if rss else None, "rss_max": max(rss, default=None), "rss_end": rss[-1] if rss else None,
                  "backlog_start": backlog_before, "backlog_max": max(backlogs, default=0), "recovery_s": recovery,
                  "rps": load.ok / load.elapsed, "failures": state_down.get("failures"), "last_error": state_down.get("last_error"),
                  "rss_after": recovered_rss, "exporter_same": _rss_mib(exp) is not None, "errors": load.errors}
        print(f"collector down {args.down_seconds:.0f} s under load ({outage['rps']:.0f} req/s): exporter RSS "
              f"{outage['rss_start']:.1f} MiB at the start, max {outage['rss_max']:.1f} MiB, {outage['rss_end']:.1f} MiB at the end; "
              f"backlog {backlog_before / 2**20:.2f} -> {outage['backlog_max'] / 2**20:.2f} MiB; failures {outage['failures']} "
              f"({outage['last_error']}); receiver up again: backlog 0 after "
              f"{'never (300 s)' if recovery is None else f'{recovery:.2f} s'}; RSS then {recovered_rss} MiB", flush=True)

        # every line of both phases reached the receiver
        macs = _chain_macs(f["log"])
        distinct, acknowledged, _ = rx.call("count")
        missing = rx.call("missing", macs)
        print(f"chain lines {len(macs)}, distinct uids received {distinct} ({acknowledged} acknowledged, "
              f"{acknowledged - distinct} duplicates), missing {missing}", flush=True)
        exporter_log = f["stderr"].read_text().splitlines()
        noted = [line for line in exporter_log if "audit export" in line and ("ERROR" in line or "WARNING" in line)]
    finally:
        _stop(procs)
        rx.close()
        server.terminate()

    # 4: batch throughput
    path, write_s = _prepared_log(tmp, args.lines)
    print(f"prepared log: {args.lines} events ({_chain_bytes(path) / 2**20:.1f} MiB) written in {write_s:.1f} s", flush=True)
    batch = {k: _batch(path, k, tmp) for k in ("grpc", "http")}
    for k, r in batch.items():
        print(f"batch export over {k}: exit {r['rc']}, {r['exported']} lines in {r['wall']:.2f} s = {r['lps']:,.0f} lines/s "
              f"(process start included); exporter CPU {r['cpu']:.1f} s = {r['us_per_line']:.0f} us/line, the receiver's "
              f"{r['rx_cpu']:.1f} s; {r['exported'] / max(1, r['batches']):.0f} lines per batch; receiver: {r['distinct']} distinct of {r['lines']} chain lines, missing {r['missing']}"
              f"{'; stderr: ' + r['stderr'] if r['rc'] else ''}", flush=True)

    # summary
    plain, with_exp = windows["plain"], windows["export"]
    ratios = [e["cpu_ms"] / p["cpu_ms"] for p, e in zip(plain, with_exp)]
    pooled = (sum(w["cpu"] for w in with_exp) / sum(max(1, w["n"]) for w in with_exp)) / \
             (sum(w["cpu"] for w in plain) / sum(max(1, w["n"]) for w in plain))
    exp_ms = sum(w["exp_cpu"] for w in with_exp) * 1000 / sum(max(1, w["n"]) for w in with_exp)
    share = sum(w["exp_cpu"] for w in with_exp) / max(1e-9, sum(w["cpu"] for w in with_exp))
    lines_per_req = sum(w["lines"] for w in with_exp) / sum(max(1, w["n"]) for w in with_exp)
    rps = _med([w["rps"] for w in with_exp])
    need = lines_per_req * rps
    print()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"summary ({front_name}, {args.clients} clients, {args.seconds:.0f} s windows, {args.rounds} rounds, exporter over gRPC):")
    print(f"  req/s without / with the exporter: {_med([w['rps'] for w in plain]):.0f} / {rps:.0f}; "
          f"{lines_per_req:.2f} audit lines per request = {need:,.0f} lines/s to export")
    print(f"  keeps pace: backlog max {max(w['max_backlog'] for w in with_exp) / 1024:.1f} KiB; slope over the last half "
          f"{' '.join(f'{w['slope_bps'] / 1024:+.2f}' for w in with_exp)} KiB/s against the log's growth "
          f"{' '.join(f'{w['grew_bps'] / 1024:.0f}' for w in with_exp)} KiB/s; 2 s after the clients "
          f"{' '.join(f'{(w['backlog_2s'] or 0) / 1024:.1f}' for w in with_exp)} KiB; backlog 0 after "
          f"{' '.join('never' if w['drain_s'] is None else f'{w['drain_s']:.2f}' for w in with_exp)} s")
    print(f"  exporter batches while following: {sum(w['lines'] for w in with_exp) / max(1, sum(w['batches'] for w in with_exp)):.1f} "
          f"lines per batch (each one export call; state.json written at most once a second)")
    print(f"  tree CPU per request with / without: median {_med(ratios):.3f}x (rounds {' '.join(f'{x:.3f}' for x in ratios)}), "
          f"pooled {pooled:.3f}x (target <= 1.10x); exporter {exp_ms:.3f} ms/request = {share:.1%} of the tree "
          f"(tree {_med([w['cpu_ms'] for w in plain]):.3f} -> {_med([w['cpu_ms'] for w in with_exp]):.3f} ms median)")
    print(f"  the exporter's own CPU per request against the tree's without it: {exp_ms / _med([w['cpu_ms'] for w in plain]):.1%} "
          f"(target <= 10%; the rest of the ratio above is the lane and Envoy slowed by sharing the two cores)")
    print(f"  collector down {args.down_seconds:.0f} s: exporter RSS {outage['rss_start']:.1f} MiB at the start, max "
          f"{outage['rss_max']:.1f} MiB (+{outage['rss_max'] - outage['rss_start']:.1f}) while the backlog grew by "
          f"{(outage['backlog_max'] - outage['backlog_start']) / 2**20:.2f} MiB; backlog 0 "
          f"{'never' if outage['recovery_s'] is None else f'{outage['recovery_s']:.2f} s'} after the receiver came back")
    print(f"  complete: {len(macs)} chain lines, {distinct} distinct uids received, {missing} missing, "
          f"{acknowledged - distinct} duplicates")
    for k, r in batch.items():
        print(f"  batch {k}: {r['lps']:,.0f} lines/s = {r['lps'] / max(need, 1e-9):.1f}x the lane's {need:,.0f} lines/s (headroom); "
              f"exporter CPU {r['us_per_line']:.0f} us/line (one core: {1e6 / max(r['us_per_line'], 1e-9):,.0f} lines/s); "
              f"missing {r['missing']}")
    if noted:
        print(f"  the exporter's warnings and errors in the front end's log: {len(noted)}, the first: {noted[0][:240]}")
    failed = missing or any(r["missing"] or r["rc"] for r in batch.values()) or outage["recovery_s"] is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
