"""Limits that need the proxy as a process of its own (`egresslaw proxy`): its memory and its descriptors.

- A request line plus an endless 64 MiB header line, from a client with no lease: cut at the head limit, and the
  proxy's resident memory does not grow by what was sent.
- A 48 MiB upload streams through: the proxy's resident memory grows by a fraction of it (buffered, it would grow
  by the whole body at least once).
- At the descriptor ceiling (RLIMIT_NOFILE lowered for the process, the connection cap lifted so it is reached),
  an established client keeps being served, the log has one line about it and no traceback, and once
  descriptors are free again new clients are served.

Sandbox-profile traffic over plain HTTP to the loopback upstream: no TLS needed on either side.
"""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conformance.wire import open_socket, read_answer
from tests.proxy_harness import PUBLIC, Env, free_port, make_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PKGS = "pkgs.acme-test.dev"
MiB = 1 << 20


@dataclass
class Process:
    proc: subprocess.Popen
    port: int
    env: Env
    stderr: Path

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")

    def lease(self) -> str:
        return self.env.lease(profile="ci")


def start(tmp: Path, upstream_port: int, *flags: str, nofile: int | None = None) -> Process:
    env = make_env(tmp)
    port = free_port()
    args = [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--keys", str(env.keys),
            "--store", str(env.store), "--audit-log", str(env.audit), "--listen", f"127.0.0.1:{port}", "--admin", "127.0.0.1:0",
            "--confdir", str(env.confdir), "--workers", "1", "--resolve", f"{PKGS}={PUBLIC[PKGS]}", "--connect-to", f"{PKGS}:80:127.0.0.1:{upstream_port}", *flags]

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    stderr = tmp / "stderr.log"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr.open("wb"), preexec_fn=lower if nofile else None)
    deadline = time.time() + 30
    while time.time() < deadline:
        assert proc.poll() is None, stderr.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Process(proc, port, env, stderr)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the proxy did not start: " + stderr.read_text())


def stop(p: Process) -> None:
    p.proc.terminate()
    try:
        p.proc.wait(15)
    except subprocess.TimeoutExpired:
        p.proc.kill()


def get(p: Process, sock: socket.socket, path: str = "/simple/") -> int | None:
    sock.sendall(f"GET http://{PKGS}{path} HTTP/1.1\r\nHost: {PKGS}\r\nProxy-Authorization: Bearer {p.lease()}\r\n\r\n".encode())
    return read_answer(sock).status


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, http_upstream):
    p = start(tmp_path_factory.mktemp("limits-process"), http_upstream.port)
    yield p
    stop(p)


def settle(p: Process) -> int:
    """The proxy's RSS once it has served a few requests (allocator warmed up)."""
    for _ in range(3):
        with open_socket("127.0.0.1", p.port) as sock:
            assert get(p, sock) == 200
    return p.rss()


def test_endless_header_is_cut_and_costs_no_memory(proxy, http_upstream):
    before = settle(proxy)
    mark = http_upstream.mark()
    sent = 0
    with open_socket("127.0.0.1", proxy.port, timeout=10) as sock:
        sock.sendall(f"GET http://{PKGS}/simple/ HTTP/1.1\r\nHost: {PKGS}\r\nX-Big: ".encode())
        chunk = b"a" * MiB
        try:
            while sent < 64 * MiB:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # cut by the proxy
        try:
            answer = sock.recv(4096)
        except OSError:
            answer = b""  # the reset can overtake the answer
    assert sent < 32 * MiB, f"the proxy read {sent} bytes of one header line"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert http_upstream.since(mark) == (0, 0, 0)
    time.sleep(0.5)
    grown = proxy.rss() - before
    assert grown < 16 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"


def test_upload_streams_without_buffering(proxy, http_upstream):
    size = 48 * MiB
    before = settle(proxy)
    with open_socket("127.0.0.1", proxy.port, timeout=60) as sock:
        sock.sendall(f"POST http://{PKGS}/upload HTTP/1.1\r\nHost: {PKGS}\r\nContent-Type: application/octet-stream\r\n"
                     f"Content-Length: {size}\r\nProxy-Authorization: Bearer {proxy.lease()}\r\n\r\n".encode())
        chunk = b"u" * MiB
        for _ in range(size // MiB):
            sock.sendall(chunk)
        answer = read_answer(sock)
    assert answer.status == 200, answer
    seen = http_upstream.raw_requests()[-1]
    assert (seen.method, seen.path, len(seen.body)) == ("POST", "/upload", size)
    grown = proxy.rss() - before
    assert grown < size // 3, f"RSS grew by {grown / MiB:.1f} MiB for a {size // MiB} MiB upload"


def test_descriptor_ceiling_keeps_serving_and_logs_one_line(tmp_path, http_upstream):
    nofile = 96
    p = start(tmp_path, http_upstream.port, "--max-connections", "100000", "--max-connections-per-client", "100000",
              "--header-timeout", "120", nofile=nofile)
    extra: list[socket.socket] = []
    try:
        established = open_socket("127.0.0.1", p.port, timeout=10)
        assert get(p, established) == 200  # its upstream connection stays open (keep-alive)
        for _ in range(nofile + 40):
            try:
                extra.append(socket.create_connection(("127.0.0.1", p.port), timeout=0.5))
            except OSError:
                break
        deadline = time.time() + 15
        while "out of file descriptors" not in p.log() and time.time() < deadline:
            time.sleep(0.1)
        assert "out of file descriptors" in p.log(), p.log()
        time.sleep(2.5)  # asyncio retries the accept every second: each retry used to log a traceback
        assert get(p, established) == 200  # an established client is still served
        log = p.log()
        assert log.count("out of file descriptors") == 1, log
        assert "Traceback" not in log and "out of system resource" not in log, log
        for sock in extra:
            sock.close()
        extra.clear()
        established.close()
        deadline = time.time() + 15
        while True:  # descriptors free again: new clients are served
            try:
                with open_socket("127.0.0.1", p.port, timeout=5) as sock:
                    if get(p, sock) == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, p.log()
            time.sleep(0.2)
        assert p.proc.poll() is None
    finally:
        for sock in extra:
            sock.close()
        stop(p)
    events = [json.loads(line) for line in p.env.audit.read_text().splitlines()]
    assert [e["decision"] for e in events if e.get("reason") == "fd-exhausted"] == ["deny"]
