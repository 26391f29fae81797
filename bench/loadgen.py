"""The client side of the benchmarks that time requests through the edge from a process of their own
(bench/credentials.py, bench/shapes.py); not a benchmark itself.

The client process answers jobs over a pipe (`serve`): `open` (one keep-alive `requests.Session` per client, through the
proxy or pinned to a stand-in's loopback port, and one untimed warm-up request on each, all at once), `run` (the timed
requests, one thread per session, started together), `close`, `stop`, and whatever other operations the script adds.
A job is a dict: `host` and `path`, `headers` (optional), `clients`, and either `proxy` with `proxy_ca` (through the
edge) or `port` with `upstream_ca` (direct to the stand-in). What a request is (GET, POST, its body, a signature) is the
script's: `serve` takes a function from a job to `send(session) -> status` (an int, or the name of the exception that
ended the request; `outcome` makes one from a call to `requests`).

The process that runs the proxy uses `Peer` (a child process and its pipe, stopped however it ended up), `row` (a
timed run's figures per request) and the formatting (`g`, `signed`, `p99`). Scripts import this module as `loadgen`:
a script's own folder is the first entry of `sys.path`, in the spawned processes too.
"""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time


# -- the clients, in their own process -------------------------------------------------------------------------------


def each(n: int, fn) -> None:
    """`fn(0)` … `fn(n - 1)`, each on a thread of its own, all started before any is joined."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def outcome(request) -> object:
    """`request()` (a call of `requests` that returns a response), the whole body read: its status (an int), or the
    name of the exception that ended it."""
    import requests

    try:
        r = request()
        r.content  # noqa: B018 - the whole body is read
        return r.status_code
    except requests.RequestException as exc:
        return type(exc).__name__


@functools.cache
def _pinned():
    from requests.adapters import HTTPAdapter

    class Pinned(HTTPAdapter):
        """To the stand-in's 127.0.0.1 port, with SNI and the certificate check on the real name."""

        def __init__(self, name: str) -> None:
            self.name = name
            super().__init__()

        def init_poolmanager(self, *args, **kwargs):
            kwargs["server_hostname"] = self.name
            kwargs["assert_hostname"] = self.name
            super().init_poolmanager(*args, **kwargs)

    return Pinned


def session(job: dict):
    """A keep-alive `requests.Session` for `job`: through the proxy (`proxy`, `proxy_ca`), or to the stand-in's loopback
    port (`upstream_ca`) with SNI and the certificate check on `host`."""
    import requests

    s = requests.Session()
    s.trust_env = False
    if job.get("proxy"):
        s.proxies = {"https": job["proxy"]}
        s.verify = job["proxy_ca"]
    else:
        s.verify = job["upstream_ca"]
        s.mount("https://127.0.0.1:", _pinned()(job["host"]))
    return s


def target(job: dict) -> tuple[str, dict[str, str]]:
    """The URL and headers of `job`'s requests: `https://host/path` through the proxy, the stand-in's port and a `Host`
    field direct."""
    headers = dict(job.get("headers", {}))
    if job.get("proxy"):
        return f"https://{job['host']}{job['path']}", headers
    return f"https://127.0.0.1:{job['port']}{job['path']}", {"Host": job["host"], **headers}


def warm_up(sessions: list, send) -> list[object]:
    """One untimed request on each session, all at once: TLS handshakes, the proxy's leaf certificate, a first mint."""
    warm: list[object] = []
    each(len(sessions), lambda i: warm.append(send(sessions[i])))
    return warm


def timed(sessions: list, send, n: int, min_seconds: float = 0.0) -> dict:
    """`n` requests spread over the sessions (one thread each), started together; each thread goes on until
    `min_seconds` have passed. The latencies of the 200s, the other outcomes counted, wall and client CPU seconds."""
    clients = len(sessions)
    shares = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    others: dict[object, int] = {}
    lock = threading.Lock()
    gate = threading.Barrier(clients + 1)
    start = [0.0]

    def worker(i: int) -> None:
        local, done = latencies[i], 0
        gate.wait()
        while done < shares[i] or time.perf_counter() - start[0] < min_seconds:
            done += 1
            t0 = time.perf_counter()
            status = send(sessions[i])
            elapsed = time.perf_counter() - t0
            if status == 200:
                local.append(elapsed)
            else:
                with lock:
                    others[status] = others.get(status, 0) + 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    start[0] = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start[0]
    return {"lat": [x for lat in latencies for x in lat], "errors": others, "wall": wall, "cpu": time.process_time() - cpu0}


def serve(pipe, sender, extra: dict | None = None) -> None:
    """Answer `(op, arg)` jobs on `pipe` until `stop`: `open` (`arg` a job: its sessions, and the warm-up's outcomes
    `{"warm": [...]}`), `run` (`arg`: `requests`, `min_seconds`: the figures of `timed`), `close`, and each of `extra`,
    `op: fn(arg) -> answer`. `sender(job)` is the job's `send(session) -> status`."""
    sessions: list = []
    send = None
    try:
        while True:
            op, arg = pipe.recv()
            if op == "stop":
                break
            if op == "open":
                send, sessions = sender(arg), [session(arg) for _ in range(arg["clients"])]
                pipe.send({"warm": warm_up(sessions, send)})
            elif op == "run":
                pipe.send(timed(sessions, send, arg["requests"], arg.get("min_seconds", 0.0)))
            elif op == "close":
                for s in sessions:
                    s.close()
                sessions = []
                pipe.send({})
            elif extra and op in extra:
                pipe.send(extra[op](arg))
    except EOFError:
        pass


# -- in the process that runs the proxy ------------------------------------------------------------------------------


class Peer:
    """A child process (spawned, a daemon) and this end of its pipe; `target(child_end, *args)` runs in it."""

    def __init__(self, spawn, target, args: tuple, name: str) -> None:
        self.pipe, child = spawn.Pipe()
        self.process = spawn.Process(target=target, args=(*args, child), daemon=True, name=name)

    def start(self) -> None:
        self.process.start()

    def ask(self, message) -> object:
        """Send `message`, return the answer."""
        self.pipe.send(message)
        return self.pipe.recv()

    def stop(self, message) -> None:
        """Send `message` (the child's stop command) if it still runs, wait up to 10 s, then terminate it."""
        if self.process.is_alive():
            try:
                self.pipe.send(message)
            except OSError:
                pass
            self.process.join(10)
            if self.process.is_alive():
                self.process.terminate()


def row(result: dict, warm: list, proxy_cpu: float | None) -> dict:
    """The figures of a timed run (`timed`'s result, the warm-up's outcomes, this process's CPU seconds over the run,
    None for a row without the proxy): req/s, p50, p99, counts and CPU per request."""
    lat = sorted(result["lat"])
    done = len(lat) + sum(result["errors"].values())
    return {
        "rps": len(lat) / result["wall"], "p50": statistics.median(lat) if lat else float("nan"), "p99": p99(lat),
        "n": len(lat), "done": done, "errors": dict(result["errors"]), "bad_warm": [w for w in warm if w != 200],
        "wall": result["wall"], "proxy_cpu": proxy_cpu / max(1, done) if proxy_cpu is not None else None,
        "client_cpu": result["cpu"] / max(1, done),
    }


def g(x: float, digits: int = 3) -> str:
    """`x` with `digits` significant digits, never in exponent form."""
    if math.isnan(x) or math.isinf(x):
        return "nan"
    if x == 0:
        return "0"
    places = digits - 1 - math.floor(math.log10(abs(x)))
    if math.floor(math.log10(abs(round(x, places)))) > math.floor(math.log10(abs(x))):
        places -= 1  # 0.9996 rounds up to 1.00, not 1.000
    return f"{round(x, places):.{max(0, places)}f}"


def signed(x: float, digits: int = 2) -> str:
    return ("+" if x >= 0 else "-") + g(abs(x), digits)


def p99(lat: list[float]) -> float:
    """The 99th percentile of sorted latencies (nan for none)."""
    return lat[max(0, math.ceil(len(lat) * 0.99) - 1)] if lat else float("nan")
