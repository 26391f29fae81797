"""Proxy throughput and latency on loopback, in one run:

  1. direct to the upstream (HTTP and TLS);
  2. through bare `mitmdump` (absolute-form `GET https://…` and CONNECT+TLS);
  3. through `egresslaw proxy --workers 1` with a 32-rule connection (same two transports), audit log fsync'd;
  4. through `egresslaw proxy --workers 2` (the same, two worker processes on one address).

Each scenario runs twice: one client (latency: p50/p99) and `--clients` clients (default 16) on keep-alive
connections (throughput: requests/s), the clients spread over `--client-procs` processes so the load
generator is not one GIL. The load generator, the upstream and the proxies share this machine's cores:
on 2 cores, 2 workers compete with the clients (the run prints the load average before and after).
`--rounds N` repeats the proxy throughput scenarios N times, interleaved, and reports each round's ratios
and their median. The upstream is a small asyncio HTTP/1.1 server in its own process; every address is
loopback. Usage: `.venv/bin/python bench/proxy.py [--requests N] [--rounds N] [--large-mb 0]`.

4. A large download (`--large-mb`, 300 by default; 0 skips it) through egresslaw, CONNECT+TLS: once with
   a sandbox-profile lease (streamed as is) and once with a connection lease (decoded, scanned and
   redacted as it streams; the upstream echoes the credential at the start and the end of the body).
   Reported: the proxy's RSS growth (sampled from /proc), time to first body byte, throughput of the
   credentialed download against the profile one, and the p99 latency of another client's small
   requests made while the credentialed download runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import multiprocessing
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.egress_proxy import builders as b  # noqa: E402
from tests.egress_proxy.conftest import _issue, free_port, make_env  # noqa: E402
from tests.proxy_harness import proof_signing_key  # noqa: E402

HOST = "api.acme-test.dev"
PUBLIC = "93.184.216.34"  # never dialled: --connect-to sends the vetted connection to 127.0.0.1
CONCURRENCY = 16
CLIENT_PROCS = 1  # one process of 16 threads drives ~5k req/s direct: more processes only take CPU from the proxies
BODY = b'{"ok":true}'


# -- upstream ------------------------------------------------------------------------------------


BLOCK = os.urandom(1 << 20)  # the large body: this block repeated (incompressible, as a package or an image is)


def _serve(port: int, cert: str, key: str, ready) -> None:
    async def handle(reader, writer):
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length, auth = 0, b""
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                    if line.lower().startswith(b"authorization:"):
                        auth = line.split(b":", 1)[1].strip()
                if length:
                    await reader.readexactly(length)
                target = head.split(b" ", 2)[1]
                if target.startswith(b"/v1/big/"):
                    await _big(writer, int(target.rsplit(b"/", 1)[1]) << 20, auth)
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _big(writer, size: int, auth: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % size)
        tail = auth + b"\n"
        left = size
        writer.write(tail)  # the credential echoed at the start (and the end): the scan has work to do
        left -= len(tail)
        while left > len(tail):
            piece = BLOCK[: min(len(BLOCK), left - len(tail))]
            writer.write(piece)
            left -= len(piece)
            await writer.drain()
        writer.write(tail[:left])
        await writer.drain()

    async def main():
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        plain_srv = await asyncio.start_server(handle, "127.0.0.1", port)
        tls_srv = await asyncio.start_server(handle, "127.0.0.1", port + 1, ssl=tls)
        ready.set()
        async with plain_srv, tls_srv:
            await asyncio.gather(plain_srv.serve_forever(), tls_srv.serve_forever())

    asyncio.run(main())


def _two_free_ports() -> int:
    for _ in range(50):
        p = free_port()
        if p < 65000:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 1))
                    return p
                except OSError:
                    continue
    raise RuntimeError("no free port pair")


# -- clients -------------------------------------------------------------------------------------


def _client_direct(port: int, tls: ssl.SSLContext | None):
    def make():
        if tls is None:
            return http.client.HTTPConnection("127.0.0.1", port, timeout=10), "/v1/ping"
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls), "/v1/ping"

    return make


def _client_absolute(proxy_port: int, url: str, lease: str | None):
    headers = {"Proxy-Authorization": f"Bearer {lease}"} if lease else {}

    def make():
        return http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=10), (url, headers)

    return make


def _client_connect(proxy_port: int, host: str, port: int, ctx: ssl.SSLContext, lease: str | None):
    def make():
        conn = http.client.HTTPSConnection("127.0.0.1", proxy_port, timeout=10, context=ctx)
        conn.set_tunnel(host, port, headers={"Proxy-Authorization": f"Bearer {lease}"} if lease else None)
        return conn, "/v1/ping"

    return make


def _run(make, requests: int, concurrency: int, procs: int = 1) -> dict[str, float]:
    """`requests` GETs over `concurrency` keep-alive clients (threads, in `procs` forked processes)."""
    if procs > 1 and concurrency >= procs:
        return _run_forked(make, requests, concurrency, procs)
    return _summary(*_clients(make, requests, concurrency))


def _run_forked(make, requests: int, concurrency: int, procs: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("fork")  # the client factories are closures: inherited, not pickled
    go = ctx.Event()
    pipes, children = [], []
    for i in range(procs):
        receive, send = ctx.Pipe(duplex=False)
        share = concurrency // procs + (1 if i < concurrency % procs else 0)

        def child(send=send, share=share):
            go.wait()
            send.send(_clients(make, requests * share // concurrency, share, warm=False))

        children.append(ctx.Process(target=child, daemon=True))
        pipes.append(receive)
    warm, target = make()  # one warm-up request (TLS handshakes, first decision, CA cert generation)
    url, headers = (target if isinstance(target, tuple) else (target, {}))
    warm.request("GET", url, headers=headers)
    warm.getresponse().read()
    warm.close()
    for c in children:
        c.start()
    start = time.perf_counter()
    go.set()
    results = [p.recv() for p in pipes]
    elapsed = time.perf_counter() - start
    for c in children:
        c.join(10)
    latencies = sorted(x for lat, _, _ in results for x in lat)
    return _summary(latencies, sum(e for _, e, _ in results), elapsed)


def _summary(lat: list[float], errors: int, elapsed: float) -> dict[str, float]:
    lat = sorted(lat)
    return {
        "rps": len(lat) / elapsed,
        "p50_ms": statistics.median(lat) * 1000 if lat else float("nan"),
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000 if lat else float("nan"),
        "errors": errors,
        "n": len(lat),
    }


def _clients(make, requests: int, concurrency: int, warm: bool = True) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    lock = threading.Lock()
    errors = [0]
    per = max(1, requests // concurrency)

    def worker():
        conn, target = make()
        local = []
        for _ in range(per):
            url, headers = (target if isinstance(target, tuple) else (target, {}))
            t0 = time.perf_counter()
            try:
                conn.request("GET", url, headers=headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    errors[0] += 1
            except (OSError, http.client.HTTPException):
                errors[0] += 1
                conn.close()
                conn, _ = make()
                continue
            local.append(time.perf_counter() - t0)
        conn.close()
        with lock:
            latencies.extend(local)

    if warm:  # one warm-up request per scenario (TLS handshakes, first decision, CA cert generation)
        conn, target = make()
        url, headers = (target if isinstance(target, tuple) else (target, {}))
        conn.request("GET", url, headers=headers)
        conn.getresponse().read()
        conn.close()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors[0], time.perf_counter() - start


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("proxy did not start")


def _artifact_32_rules():
    rules = [b.rule(f"filler-{i:02d}", HOST, f"/v0/area-{i:02d}", ["GET", "POST"], ["accept", "content-type"]) for i in range(31)]
    rules.append(b.rule("ping", HOST, "/v1", ["GET"], ["accept"]))
    return b.artifact(connections=[b.connection("bench", rules, credential="bench-cred")], profiles=[b.profile("dl", [(HOST, 443)])],
                      workspace="acme")


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its children (a supervisor's workers), from /proc."""
    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return total
    return total + sum(_cpu_seconds(int(child)) for child in children)


def _rss(pid: int) -> int:
    """Resident set size of a process, in bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _download(make, path: str, size_mb: int) -> dict[str, float]:
    """One large GET: time to the first body byte, bytes read, seconds."""
    conn, _ = make()
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    first = resp.read(1)
    ttfb = time.perf_counter() - t0
    got = len(first)
    while True:
        data = resp.read(1 << 20)
        if not data:
            break
        got += len(data)
    elapsed = time.perf_counter() - t0
    conn.close()
    return {"status": resp.status, "ttfb_s": ttfb, "bytes": got, "seconds": elapsed, "mb_s": got / elapsed / 1e6}


def _other_client(small_make, stop, out) -> None:
    """Small requests one after another until `stop` is set; their latencies go to `out` (its own process:
    in the downloader's process it would wait for the GIL, not for the proxy)."""
    conn, target = small_make()
    small: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            conn.request("GET", target)
            conn.getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn, _ = small_make()
            continue
        small.append(time.perf_counter() - t0)
        time.sleep(0.01)
    conn.close()
    out.send(small)


def _while(egress_pid: int, small_make, work) -> tuple[dict, float, list[float]]:
    """Run `work()` while sampling the proxy's RSS and timing another client's small requests."""
    base = _rss(egress_pid)
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss(egress_pid))
            time.sleep(0.05)

    stop = multiprocessing.Event()
    receive, send = multiprocessing.Pipe(duplex=False)
    other = multiprocessing.Process(target=_other_client, args=(small_make, stop, send), daemon=True)
    other.start()
    sampler = threading.Thread(target=sample)
    sampler.start()
    result = work()
    done.set()
    stop.set()
    small = receive.recv()
    other.join(10)
    sampler.join()
    return result, (peak[0] - base) / (1 << 20), sorted(small)


def _p99_ms(lat: list[float]) -> float:
    return lat[max(0, int(len(lat) * 0.99) - 1)] * 1000 if lat else float("nan")


def _large(egress_pid: int, profile_make, conn_make, small_make, size_mb: int) -> dict[str, float]:
    """The large-body scenario: another client alone, then during the profile download, then during the scanned one."""
    path = f"/v1/big/{size_mb}"
    _, _, idle = _while(egress_pid, small_make, lambda: time.sleep(3))
    profile, profile_rss, during_profile = _while(egress_pid, small_make, lambda: _download(profile_make, path, size_mb))
    scanned, scanned_rss, during_scanned = _while(egress_pid, small_make, lambda: _download(conn_make, path, size_mb))
    return {
        "profile": profile,
        "scanned": scanned,
        "profile_rss_mib": profile_rss,
        "scanned_rss_mib": scanned_rss,
        "idle_p99_ms": _p99_ms(idle),
        "profile_p99_ms": _p99_ms(during_profile),
        "scanned_p99_ms": _p99_ms(during_scanned),
        "scanned_n": len(during_scanned),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1200, help="requests per throughput scenario (default 1200)")
    parser.add_argument("--latency-requests", type=int, default=300, help="requests per latency scenario (default 300)")
    parser.add_argument("--large-mb", type=int, default=300, help="size of the large download in MiB (default 300; 0 skips it)")
    parser.add_argument("--clients", type=int, default=CONCURRENCY, help=f"keep-alive clients of a throughput scenario (default {CONCURRENCY})")
    parser.add_argument("--client-procs", type=int, default=CLIENT_PROCS, help=f"processes the clients run in (default {CLIENT_PROCS})")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of the proxy throughput scenarios (default 1)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores, shared by the clients, the upstream and the proxies)")

    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-bench-"))
    pki = _issue(tmp / "pki", (HOST,), ("127.0.0.1",))
    up = _two_free_ports()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(up, str(pki.cert_pem), str(pki.key_pem), ready), daemon=True)
    server.start()
    ready.wait(10)

    from egress_proxy.custody.records import Address
    from egress_proxy.custody.sqlite import CustodyStore

    env = make_env(tmp / "edge", _artifact_32_rules())
    with CustodyStore(env.store, env.keys) as cs:
        cs.put(Address("acme", "bench", "bench-cred"), b"bench-" + base64.b32encode(os.urandom(20)))
    lease = env.lease(connection="bench", ttl=3600)
    profile_lease = env.lease(profile="dl", ttl=3600)
    upstream_ca = ssl.create_default_context(cafile=str(pki.ca_pem))

    bare_port, egress_port, admin_port, fleet_port, fleet_admin = free_port(), free_port(), free_port(), free_port(), free_port()
    bare_conf, egress_conf = tmp / "bare-conf", tmp / "egress-conf"
    procs = []
    bare = subprocess.Popen(
        [str(ROOT / ".venv/bin/mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port", str(bare_port),
         "--set", f"confdir={bare_conf}", "--set", f"ssl_verify_upstream_trusted_ca={pki.ca_pem}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(bare)
    egress = subprocess.Popen(
        [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--trust-proofs", str(proof_signing_key()[1]),
         "--keys", str(env.keys), "--store", str(env.store), "--listen", f"127.0.0.1:{egress_port}",
         "--admin", f"127.0.0.1:{admin_port}", "--confdir", str(egress_conf), "--audit-log", str(env.audit), "--workers", "1",
         "--resolve", f"{HOST}={PUBLIC}", "--connect-to", f"{HOST}:443:127.0.0.1:{up + 1}", "--upstream-ca", str(pki.ca_pem)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(egress)
    fleet_audit = tmp / "fleet-audit" / "audit.jsonl"
    fleet = subprocess.Popen(
        [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--trust-proofs", str(proof_signing_key()[1]),
         "--keys", str(env.keys), "--store", str(env.store), "--listen", f"127.0.0.1:{fleet_port}",
         "--admin", f"127.0.0.1:{fleet_admin}", "--confdir", str(egress_conf), "--audit-log", str(fleet_audit), "--workers", "2",
         "--resolve", f"{HOST}={PUBLIC}", "--connect-to", f"{HOST}:443:127.0.0.1:{up + 1}", "--upstream-ca", str(pki.ca_pem)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(fleet)
    results: dict[str, dict[str, dict[str, float]]] = {}
    try:
        _wait_listening(bare_port, bare)
        _wait_listening(egress_port, egress)
        _wait_listening(fleet_port, fleet, 90)
        for conf in (bare_conf, egress_conf):
            deadline = time.time() + 10
            while not (conf / "mitmproxy-ca-cert.pem").exists() and time.time() < deadline:
                time.sleep(0.05)
        bare_ca = ssl.create_default_context(cafile=str(bare_conf / "mitmproxy-ca-cert.pem"))
        egress_ca = ssl.create_default_context(cafile=str(egress_conf / "mitmproxy-ca-cert.pem"))
        scenarios = {
            "direct http": _client_direct(up, None),
            "direct tls": _client_direct(up + 1, upstream_ca),
            "mitmdump absolute-form": _client_absolute(bare_port, f"https://127.0.0.1:{up + 1}/v1/ping", None),
            "mitmdump connect+tls": _client_connect(bare_port, "127.0.0.1", up + 1, bare_ca, None),
            "egresslaw absolute-form": _client_absolute(egress_port, f"https://{HOST}/v1/ping", lease),
            "egresslaw connect+tls": _client_connect(egress_port, HOST, 443, egress_ca, lease),
            "egresslaw -w2 absolute-form": _client_absolute(fleet_port, f"https://{HOST}/v1/ping", lease),
            "egresslaw -w2 connect+tls": _client_connect(fleet_port, HOST, 443, egress_ca, lease),
        }
        owner = {"mitmdump": bare.pid, "egresslaw": egress.pid, "egresslaw -w2": fleet.pid}
        for name, make in scenarios.items():
            lat = _run(make, args.latency_requests, 1)
            pid = owner.get(name.rsplit(" ", 1)[0])
            cpu0, t0 = (_cpu_seconds(pid) if pid else 0.0), time.perf_counter()
            thr = _run(make, args.requests, args.clients, args.client_procs)
            cpu, wall = (_cpu_seconds(pid) - cpu0 if pid else 0.0), time.perf_counter() - t0
            results[name] = {"latency": lat, "throughput": thr}
            used = f"   proxy CPU {cpu / wall:4.2f} cores, {cpu * 1000 / max(1, thr['n']):4.2f} ms/request" if pid else ""
            print(
                f"{name:28s} {thr['rps']:8.0f} req/s (c={args.clients})   p50 {lat['p50_ms']:6.2f} ms   p99 {lat['p99_ms']:6.2f} ms (c=1)"
                f"   errors {lat['errors'] + thr['errors']}{used}",
                flush=True,
            )
        rounds = [{name: results[name]["throughput"]["rps"] for name in scenarios}]
        for _ in range(args.rounds - 1):  # interleaved: every proxy once per round, so a load change hits all of them
            rounds.append({name: _run(make, args.requests, args.clients, args.client_procs)["rps"]
                           for name, make in scenarios.items() if not name.startswith("direct")})
        if args.large_mb:
            large = _large(egress.pid, _client_connect(egress_port, HOST, 443, egress_ca, profile_lease),
                           _client_connect(egress_port, HOST, 443, egress_ca, lease), scenarios["egresslaw connect+tls"], args.large_mb)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        server.terminate()
    print()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    for transport in ("absolute-form", "connect+tls"):
        bare_r, ours, two = results[f"mitmdump {transport}"], results[f"egresslaw {transport}"], results[f"egresslaw -w2 {transport}"]
        ratio = ours["throughput"]["rps"] / bare_r["throughput"]["rps"]
        added = ours["latency"]["p50_ms"] - bare_r["latency"]["p50_ms"]
        print(
            f"egresslaw/mitmdump {transport:13s}: throughput {ratio:6.1%} (target >= 85%)   added p50 {added:+.2f} ms (target <= 1 ms)"
        )
        ratios = [r[f"egresslaw -w2 {transport}"] / r[f"mitmdump {transport}"] for r in rounds]
        scaling = [r[f"egresslaw -w2 {transport}"] / r[f"egresslaw {transport}"] for r in rounds]
        added = two["latency"]["p50_ms"] - bare_r["latency"]["p50_ms"]
        print(
            f"egresslaw --workers 2/mitmdump {transport:13s}: throughput {statistics.median(ratios):5.2f}x (target >= 1.5x; rounds "
            f"{' '.join(f'{x:.2f}' for x in ratios)})   added p50 {added:+.2f} ms (target <= 1 ms)"
        )
        print(f"egresslaw --workers 2/--workers 1 {transport:13s}: throughput {statistics.median(scaling):5.2f}x (rounds "
              f"{' '.join(f'{x:.2f}' for x in scaling)}); the CPU the proxies got is printed per scenario above")
    if args.large_mb:
        pr, sc = large["profile"], large["scanned"]
        print()
        print(f"large download, {args.large_mb} MiB, CONNECT+TLS (status {sc['status']}; {sc['bytes']} bytes scanned, {pr['bytes']} as is)")
        print(f"  sandbox profile (streamed as is)   {pr['mb_s']:7.1f} MB/s   first byte {pr['ttfb_s'] * 1000:7.1f} ms"
              f"   RSS +{large['profile_rss_mib']:.1f} MiB   another client's p99 {large['profile_p99_ms']:.1f} ms")
        print(f"  connection (decoded, scanned)      {sc['mb_s']:7.1f} MB/s   first byte {sc['ttfb_s'] * 1000:7.1f} ms"
              f"   RSS +{large['scanned_rss_mib']:.1f} MiB   another client's p99 {large['scanned_p99_ms']:.1f} ms")
        print(f"  another client alone: p99 {large['idle_p99_ms']:.1f} ms")
        print(f"scanned/profile throughput {sc['mb_s'] / pr['mb_s']:6.1%} (target >= 50%)   first byte {sc['ttfb_s'] * 1000:.0f} ms (target <= 1000 ms)"
              f"   RSS growth {large['scanned_rss_mib']:.1f} MiB (target <= 128 MiB)   another client's p99 {large['scanned_p99_ms']:.1f} ms"
              f" over {large['scanned_n']} requests (target <= 50 ms)")
    audit_lines = len(env.audit.read_bytes().splitlines()) if env.audit.exists() else 0
    print(f"audit events written by egresslaw: {audit_lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
