"""Memory soak: every abusive pattern of issue 19 at once, many connections each, against `egresslaw proxy`.

    .venv/bin/python bench/abuse.py [--seconds 30] [--connections 4] [--streams 8]

For `--seconds`, in parallel (each attacker reconnects when the proxy cuts it):
  - HTTP/2 clients that never send WINDOW_UPDATE, `--streams` 96 MiB downloads per connection;
  - HTTP/2 clients that POST bodies without `content-length` that never end, `--streams` per connection;
  - HTTP/1 clients that never read a 96 MiB download;
  - requests to hostile upstreams: an endless header line, an endless chunk-size line, endless trailers;
while one well-behaved client fetches a small body over and over. Printed: the proxy's peak RSS growth next to
the bound the formula in docs/proxy.md ("Bounds") gives for this many connections and streams, the upstream bytes
the attackers managed to get sent, and the well-behaved client's median and p99 latency during the attack as a
ratio of the same client's latency on the idle proxy, measured first in the same run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conformance.test_bounds import (  # noqa: E402
    API,
    PKGS,
    H2Client,
    Hostile,
    plain_get,
    server_context,
    start_proxy,
)
from tests.conformance.wire import open_socket, read_answer, tls_client  # noqa: E402
from tests.proxy_harness import HOSTS, _issue  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
STREAM_BUFFER, STALL, HELD_CONN, HELD_ALL = 256 * KiB, 10.0, 16 * MiB, 64 * MiB
PER_STREAM = STREAM_BUFFER + MiB  # the buffer, and what else a stream in flight costs (docs/proxy.md "Bounds")
PER_CONNECTION = 512 * KiB  # heads at their limits and the connection's protocol state (docs/proxy.md "Bounds")


def latencies(port: int, lease: str, ca: str, seconds: float, out) -> None:
    """The well-behaved client, in a process of its own: a CONNECT tunnel and one small GET at a time, through the
    upstream process the floods do not use (the stalls there are paused, the held bodies never reach it)."""
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        with open_socket("127.0.0.1", port, timeout=30) as raw:
            raw.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
            if read_answer(raw, "CONNECT").status == 200:
                with tls_client(raw, Path(ca), API) as tls:
                    tls.sendall(f"GET /ok HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
                    if read_answer(tls).status == 200:
                        got.append(time.perf_counter() - t)
        time.sleep(0.02)
    out.put(got)


def measured(port: int, lease: str, ca: Path, seconds: float) -> multiprocessing.Process:
    queue = multiprocessing.Queue()
    proc = multiprocessing.Process(target=latencies, args=(port, lease, str(ca), seconds, queue), daemon=True)
    proc.start()
    proc.queue = queue  # type: ignore[attr-defined]
    return proc


def upstream(pki, ports, stop, totals) -> None:
    """A hostile upstream in a process of its own (its sending threads share no interpreter with anyone's); TLS
    when given the test PKI."""
    server = Hostile(server_context(pki, "http/1.1") if pki is not None else None).start()
    ports.put(server.port)
    stop.wait()
    totals.put((dict(server.sent), len([r for r in server.requests if r.startswith("/big")])))


def start_upstream(pki, stop):
    ports, totals = multiprocessing.Queue(), multiprocessing.Queue()
    multiprocessing.Process(target=upstream, args=(pki, ports, stop, totals), daemon=True).start()
    return ports.get(timeout=30), totals


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--only", default="h2_stall,h2_held,h1_stall,heads", help="the attacks to run (comma-separated; default: all)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-abuse-"))
    pki = _issue(tmp / "pki", HOSTS)
    upstream_stop = multiprocessing.Event()
    tls_port, tls_totals = start_upstream(pki, upstream_stop)
    plain_port, plain_totals = start_upstream(None, upstream_stop)
    p = start_proxy(tmp / "proxy", pki, tls_port, plain_port, "--stream-buffer", str(STREAM_BUFFER), "--stall-timeout", str(STALL),
                    "--max-held-per-connection", str(HELD_CONN), "--max-held", str(HELD_ALL), "--max-connections-per-client", "1024")
    stop = threading.Event()
    lease = p.env.lease(profile="ci")
    try:
        idle = measured(p.port, lease, p.ca, 10.0)
        baseline = idle.queue.get(timeout=60)
        rss0 = p.rss()

        def h2_stall() -> None:
            while not stop.is_set():
                try:
                    c = H2Client(p, lease)
                    for _ in range(args.streams):
                        c.request("GET", f"/big?n={96 * MiB}")
                    c.pump(STALL + 2, until=stop.is_set)
                    c.close()
                except (OSError, AssertionError):
                    time.sleep(0.2)

        def h2_held() -> None:
            chunk = b"h" * (16 * KiB)
            while not stop.is_set():
                try:
                    c = H2Client(p, lease)
                    sids = [c.request("POST", f"/held-{i}", end=False) for i in range(args.streams)]
                    offered = 0
                    while not stop.is_set() and len(c.reset) + len(c.status) < len(sids) and offered < 2 * HELD_CONN:
                        for sid in sids:
                            if sid not in c.reset and sid not in c.status and c.conn.local_flow_control_window(sid) >= len(chunk):
                                c.conn.send_data(sid, chunk)
                                offered += len(chunk)
                        c.flush()
                        c.pump(0.01)
                    c.pump(STALL, until=stop.is_set)  # then hold what the proxy kept, as an attacker after memory would
                    c.close()
                except (OSError, AssertionError, Exception):
                    time.sleep(0.2)

        def h1_stall() -> None:
            while not stop.is_set():
                try:
                    with open_socket("127.0.0.1", p.port, timeout=30) as s:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
                        s.sendall(f"GET http://{PKGS}/big?n={96 * MiB} HTTP/1.1\r\nHost: {PKGS}\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
                        stop.wait(STALL)
                except OSError:
                    time.sleep(0.2)

        def heads() -> None:
            paths = [f"/pad-header?n={96 * MiB}", f"/chunk-line?n={96 * MiB}", f"/trailers?n={96 * MiB}", f"/many-headers?n={4 * MiB}"]
            i = 0
            while not stop.is_set():
                try:
                    plain_get(p, paths[i % len(paths)])
                except OSError:
                    pass
                i += 1
                time.sleep(0.1)  # a memory soak, not a CPU flood: each hostile answer costs the upstream's loopback MiB

        attacks = {"h2_stall": h2_stall, "h2_held": h2_held, "h1_stall": h1_stall, "heads": heads}
        chosen = [attacks[name] for name in args.only.split(",")]
        threads = [threading.Thread(target=f, daemon=True) for f in chosen for _ in range(args.connections)]
        for t in threads:
            t.start()
        peak = 0
        time.sleep(2.0)  # the attacks under way
        good = measured(p.port, lease, p.ca, args.seconds)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            peak = max(peak, p.rss())
            time.sleep(0.2)
        during = good.queue.get(timeout=60)
        stop.set()
    finally:
        stop.set()
        p.proc.terminate()
        p.proc.wait(20)
        upstream_stop.set()
    streams = 2 * args.connections * args.streams + args.connections  # HTTP/2 stalls and held bodies, HTTP/1 stalls
    connections = len(threads) + 1  # attackers and the well-behaved client
    bound = streams * PER_STREAM + min(HELD_ALL, args.connections * HELD_CONN) * 9 // 8 + connections * PER_CONNECTION
    (tls_sent, tls_big), (plain_sent, plain_big) = tls_totals.get(timeout=30), plain_totals.get(timeout=30)
    stalled_sent = sum(v for k, v in {**tls_sent, **plain_sent}.items() if k.startswith("/big"))
    heads_sent = sum(v for k, v in plain_sent.items() if not k.startswith("/big") and k != "/ok")
    med = statistics.median(during) / statistics.median(baseline) if during and baseline else float("nan")
    p99 = (statistics.quantiles(during, n=100)[98] / statistics.quantiles(baseline, n=100)[98]
           if len(during) > 100 and len(baseline) > 100 else float("nan"))
    print(f"attack: {args.seconds:g} s, {len(threads)} attacking connections at a time, {args.streams} streams each (HTTP/2)")
    print(f"peak RSS growth: {(peak - rss0) / MiB:.1f} MiB; formula bound for these peers: {bound / MiB:.1f} MiB "
          f"({(peak - rss0) / bound:.2f} of it)")
    print(f"upstream bytes sent for stalled downloads: {stalled_sent / MiB:.1f} MiB for {tls_big + plain_big} of them "
          f"({stalled_sent / max(1, tls_big + plain_big) / MiB:.2f} MiB each; each asked for 96 MiB)")
    print(f"hostile heads: {heads_sent / MiB:.1f} MiB written by the upstream before the proxy cut it (loopback socket buffers)")
    print(f"well-behaved client: {len(during)} requests during the attack; median {statistics.median(during) * 1000:.1f} ms "
          f"({med:.2f}x idle {statistics.median(baseline) * 1000:.1f} ms), p99 ratio {p99:.2f}x" if during else "well-behaved client: no answer")
    return 0 if during and peak - rss0 <= bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
