"""Upload streaming: concurrent large request bodies through `egresslaw proxy`, in one run.

  1. direct to a sink upstream (the baseline: what the machine does without a proxy);
  2. through `egresslaw proxy`, sandbox-profile traffic (absolute-form `POST http://…`);
  3. through `egresslaw proxy`, connection traffic (CONNECT + TLS, credential injected, TLS upstream).

Each scenario sends CLIENTS bodies of SIZE MiB at once. Printed: throughput (MiB/s), its ratio to
the direct baseline, and the proxy's resident-memory growth (peak VmHWM minus RSS before), also as a
fraction of what was uploaded. Buffered bodies (before issue 9) cost about 3x the body each: three
500 MiB uploads peaked at 4.9 GB. The upstream is a sink in its own process; every address is
loopback. Usage: `.venv/bin/python bench/uploads.py [--size-mb 500] [--clients 3]`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.proxy_harness import HOSTS, PUBLIC, _issue, free_port, make_env, proof_signing_key  # noqa: E402

MiB = 1 << 20
API, PKGS = "api.acme-test.dev", "pkgs.acme-test.dev"
CHUNK = b"u" * MiB


def _sink(port: int, cert: str | None, key: str | None, ready) -> None:
    """A threaded HTTP/1.1 upstream that reads each request body (Content-Length) and drops it."""
    context = None
    if cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", port), backlog=64)
    ready.set()

    def serve(conn: socket.socket) -> None:
        try:
            if context is not None:
                conn = context.wrap_socket(conn, server_side=True)
            f = conn.makefile("rb", buffering=MiB)
            while True:
                length = 0
                line = f.readline()
                if not line:
                    return
                while line not in (b"\r\n", b"\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                    line = f.readline()
                while length:
                    length -= len(f.read(min(length, MiB)))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}")
        except (OSError, ValueError):
            pass
        finally:
            conn.close()

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _post(sock, target: str, host: str, size: int, lease: str | None) -> int:
    head = f"POST {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n"
    if lease:
        head += f"Proxy-Authorization: Bearer {lease}\r\n"
    sock.sendall(head.encode() + b"\r\n")
    for _ in range(size // MiB):
        sock.sendall(CHUNK)
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(4096)
        if not data:
            break
        answer += data
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def _run(clients: int, one) -> float:
    """Seconds for `clients` concurrent calls of `one()`; each must answer 200."""
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda: statuses.append(one())) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if statuses != [200] * clients:
        raise SystemExit(f"uploads failed: {statuses}")
    return elapsed


def _mem(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=500)
    parser.add_argument("--clients", type=int, default=3)
    args = parser.parse_args()
    size, clients = args.size_mb * MiB, args.clients
    total = size * clients
    with tempfile.TemporaryDirectory(prefix="egresslaw-uploads-") as tmp:
        root = Path(tmp)
        pki = _issue(root / "pki", HOSTS)
        ready_plain, ready_tls = multiprocessing.Event(), multiprocessing.Event()
        plain_port, tls_port = free_port(), free_port()
        sinks = [multiprocessing.Process(target=_sink, args=(plain_port, None, None, ready_plain), daemon=True),
                 multiprocessing.Process(target=_sink, args=(tls_port, str(pki.cert_pem), str(pki.key_pem), ready_tls), daemon=True)]
        for p in sinks:
            p.start()
        ready_plain.wait(10)
        ready_tls.wait(10)
        env = make_env(root / "env")
        listen = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--trust-proofs", str(proof_signing_key()[1]), "--keys", str(env.keys),
             "--store", str(env.store), "--audit-log", str(env.audit), "--listen", f"127.0.0.1:{listen}", "--admin", "127.0.0.1:0",
             "--confdir", str(env.confdir), "--workers", "1", "--max-body", f"{args.size_mb + 1}m", "--upstream-ca", str(pki.ca_pem),
             "--resolve", f"{PKGS}={PUBLIC[PKGS]}", "--resolve", f"{API}={PUBLIC[API]}",
             "--connect-to", f"{PKGS}:80:127.0.0.1:{plain_port}", "--connect-to", f"{API}:443:127.0.0.1:{tls_port}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", listen), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline or proxy.poll() is not None:
                        raise SystemExit("the proxy did not start") from None
                    time.sleep(0.1)
            ci, gh = env.lease(profile="ci", ttl=3600), env.lease(connection="github", ttl=3600)

            def direct() -> int:
                with socket.create_connection(("127.0.0.1", plain_port)) as s:
                    return _post(s, "/upload", PKGS, size, None)

            def sandbox() -> int:
                with socket.create_connection(("127.0.0.1", listen)) as s:
                    return _post(s, f"http://{PKGS}/upload", PKGS, size, ci)

            def connection() -> int:
                with socket.create_connection(("127.0.0.1", listen)) as s:
                    s.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {gh}\r\n\r\n".encode())
                    reply = s.recv(4096)
                    if not reply.startswith(b"HTTP/1.1 200"):
                        return 0
                    ctx = ssl.create_default_context(cafile=str(env.confdir / "mitmproxy-ca-cert.pem"))
                    with ctx.wrap_socket(s, server_hostname=API) as t:
                        return _post(t, "/repos/acme/app/issues", API, size, None)

            rows = []
            base = _run(clients, direct)
            rows.append(("direct to the sink", base, None))
            for name, one in (("egresslaw, sandbox profile (http)", sandbox), ("egresslaw, connection (CONNECT+TLS)", connection)):
                before = _mem(proxy.pid)["VmRSS"]
                elapsed = _run(clients, one)
                rows.append((name, elapsed, _mem(proxy.pid)["VmHWM"] - before))
        finally:
            proxy.terminate()
            proxy.wait(15)
            for p in sinks:
                p.terminate()
    print(f"{clients} concurrent uploads of {args.size_mb} MiB ({total // MiB} MiB in all)")
    print(f"{'scenario':40} {'MiB/s':>8} {'vs direct':>10} {'RSS growth':>12} {'of uploaded':>12}")
    for name, elapsed, grown in rows:
        rate = total / MiB / elapsed
        ratio = base / elapsed
        mem = f"{grown / MiB:10.1f} MiB {grown / total:11.2%}" if grown is not None else f"{'-':>12} {'-':>12}"
        print(f"{name:40} {rate:8.1f} {ratio:10.2f} {mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
