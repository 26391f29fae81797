"""Bounded under abuse: what one client or one upstream can make the proxy hold, measured on the proxy as a process.

Each pattern is driven from outside (raw sockets, HTTP/2 frames from the h2 library, hostile upstreams that count
what they managed to send) against `egresslaw proxy`, with the bounds small enough to see (`--stream-buffer
256k`, `--stall-timeout 3`, `--max-held-per-connection 24m`):

- an HTTP/2 client that stops reading a 96 MiB download: the upstream is stopped after a few MiB (its socket fills:
  the proxy no longer reads it), the proxy's RSS grows a few MiB, the stream is reset after the stall timeout and
  audited `client-stalled` with `bytes_down` = what the client got; the same stall over HTTP/1 is as bounded;
- `bytes_down` is what the client received: for a stall, a reset, and a completed download;
- HTTP/2 request bodies held whole (no `content-length`) on four streams: the one that would pass the connection's
  cap gets 503 `held-bodies-at-capacity`, nothing is forwarded, the memory stays under the cap;
- hostile upstream heads: an endless header line, an endless chunk-size line, endless trailers: our JSON 502
  (`response-line-too-long`, `response-head-too-large`), the upstream cut off after a bounded count, RSS flat;
- a raw ESC in a request header value: refused as `smuggling`, nothing upstream;
- meanwhile a well-behaved client on another connection is served.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest

from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.proxy_harness import CANARY, PUBLIC, Env, Pki, free_port, make_env, wait_for, whole_lines

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API, PKGS = "api.acme-test.dev", "pkgs.acme-test.dev"
KiB, MiB = 1 << 10, 1 << 20
STALL = 3.0
HELD_PER_CONNECTION = 24 * MiB


# -- hostile upstreams: each answer chosen by the request's path, each counting what it sent --------------------------


@dataclass
class Hostile:
    """A loopback upstream (TLS or plain) whose answers are chosen by path and which counts the bytes it sent."""

    context: ssl.SSLContext | None
    sock: socket.socket = field(default_factory=lambda: socket.create_server(("127.0.0.1", 0)))
    sent: dict[str, int] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    delay: float = 0.0  # seconds before the TLS handshake of a new connection

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> Hostile:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            time.sleep(self.delay)
            conn = self.context.wrap_socket(raw, server_side=True) if self.context else raw
            head = b""
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
            path = head.split(b" ", 2)[1].decode()
            with self.lock:
                self.requests.append(path)
            self._answer(conn, path)
        except (OSError, ssl.SSLError):
            pass
        finally:
            raw.close()

    def _send(self, conn, path: str, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), 64 * KiB):
            conn.sendall(view[start : start + 64 * KiB])
            with self.lock:
                self.sent[path] = self.sent.get(path, 0) + min(64 * KiB, len(view) - start)

    def _answer(self, conn, path: str) -> None:
        name, _, query = path.partition("?")
        name = name.removeprefix("/repos/acme")  # (a connection lease's rule admits paths under /repos/acme)
        size = int(query.removeprefix("n=")) if query.startswith("n=") else 0
        if name == "/big":
            self._send(conn, path, b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % size)
            self._send(conn, path, b"b" * size)
        elif name == "/pad-header":
            self._send(conn, path, b"HTTP/1.1 200 OK\r\nX-Pad: ")
            self._send(conn, path, b"p" * size)
        elif name == "/many-headers":
            self._send(conn, path, b"HTTP/1.1 200 OK\r\n" + b"X-Many: 1\r\n" * (size // 11))
        elif name == "/chunk-line":
            self._send(conn, path, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            self._send(conn, path, b"f" * size)
        elif name == "/trailers":
            self._send(conn, path, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n")
            self._send(conn, path, b"X-Trailer-Pad: 1\r\n" * (size // 18))
        else:
            self._send(conn, path, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def stop(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def hostile_tls(pki: Pki):
    server = Hostile(server_context(pki, "http/1.1")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hostile_plain():
    server = Hostile(None).start()
    yield server
    server.stop()


@dataclass
class ShutWindowH2(Hostile):
    """A TLS upstream speaking HTTP/2 that never gives a window back: it takes 65,535 body bytes and no more."""

    received: int = 0

    def _serve(self, raw: socket.socket) -> None:
        try:
            conn = self.context.wrap_socket(raw, server_side=True)
            h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            h2c.initiate_connection()
            conn.sendall(h2c.data_to_send())
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                for event in h2c.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        self.received += len(event.data)  # never acknowledged
                out = h2c.data_to_send()
                if out:
                    conn.sendall(out)
        except (OSError, ssl.SSLError, h2.exceptions.ProtocolError):
            pass
        finally:
            raw.close()


def server_context(pki: Pki, alpn: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pki.cert_pem), str(pki.key_pem))
    ctx.set_alpn_protocols([alpn])
    return ctx


# -- the proxy as a process -----------------------------------------------------------------------------------------


@dataclass
class Proxy:
    proc: subprocess.Popen
    port: int
    env: Env
    stderr: Path
    ca: Path

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def events(self) -> list[dict]:
        out = []
        for path in sorted(self.env.audit.parent.glob(self.env.audit.name + "*")):
            out += [json.loads(line) for line in whole_lines(path.read_bytes())]  # the proxy may be writing
        return out

    def event_for(self, path: str, timeout: float = 15.0) -> tuple[dict, dict | None]:
        """The request event of the (last) request for `path` and its outcome event (None for a denial)."""
        found: list = []

        def look() -> bool:
            events = self.events()
            requests = [e for e in events if e.get("kind") == "request" and e.get("path") == path.partition("?")[0]]
            if not requests:
                return False
            request = requests[-1]
            if request["decision"] == "deny":
                found[:] = [request, None]
                return True
            outcomes = [e for e in events if e.get("kind") == "outcome" and e.get("id") == request["id"]]
            if outcomes:
                found[:] = [request, outcomes[-1]]
            return bool(outcomes)

        assert wait_for(look, timeout), f"no audit event for {path}"
        return found[0], found[1]


def start_proxy(tmp: Path, pki: Pki, tls_port: int, plain_port: int, *flags: str) -> Proxy:
    env = make_env(tmp)
    port = free_port()
    args = [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--keys", str(env.keys),
            "--store", str(env.store), "--audit-log", str(env.audit), "--listen", f"127.0.0.1:{port}", "--admin", "127.0.0.1:0",
            "--confdir", str(env.confdir), "--workers", "1", "--audit-sync", "0.2",
            "--resolve", f"{API}={PUBLIC[API]}", "--resolve", f"{PKGS}={PUBLIC[PKGS]}",
            "--connect-to", f"{API}:443:127.0.0.1:{tls_port}", "--connect-to", f"{PKGS}:80:127.0.0.1:{plain_port}",
            "--upstream-ca", str(pki.ca_pem), *flags]
    stderr = tmp / "stderr.log"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr.open("wb"))
    deadline = time.time() + 30
    while time.time() < deadline:
        assert proc.poll() is None, stderr.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return Proxy(proc, port, env, stderr, env.confdir / "mitmproxy-ca-cert.pem")
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the proxy did not start: " + stderr.read_text())


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, hostile_tls, hostile_plain):
    p = start_proxy(tmp_path_factory.mktemp("bounds"), pki, hostile_tls.port, hostile_plain.port,
                    "--stream-buffer", "256k", "--stall-timeout", str(STALL), "--max-held-per-connection", str(HELD_PER_CONNECTION),
                    "--max-response-head", "64k", "--max-response-line", "16k")
    yield p
    p.proc.terminate()
    try:
        p.proc.wait(15)
    except subprocess.TimeoutExpired:
        p.proc.kill()
    log = p.stderr.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def settle(p: Proxy) -> int:
    """The proxy's RSS once it has served a few requests (allocator warmed up)."""
    for _ in range(3):
        assert plain_get(p, "/ok").status == 200
    return p.rss()


def settled_count(count, at_least: int = 0, timeout: float = 30.0) -> int:
    """A byte count once it stopped moving for two seconds (the sender's socket buffers full), or at the timeout. Half a
    second was not enough on a loaded machine: a proxy left without the CPU that long looked settled, then read on."""
    last, since, deadline = count(), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = count()
        if now != last or now < at_least:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 2.0:
            break
    return last


def plain_get(p: Proxy, path: str, extra: str = "") -> object:
    lease = p.env.lease(profile="ci")
    with open_socket("127.0.0.1", p.port, timeout=20) as sock:
        sock.sendall(f"GET http://{PKGS}{path} HTTP/1.1\r\nHost: {PKGS}\r\n{extra}Proxy-Authorization: Bearer {lease}\r\n\r\n".encode())
        return read_answer(sock)


# -- an HTTP/2 client in a tunnel ------------------------------------------------------------------------------------


class H2Client:
    """CONNECT api.acme-test.dev:443 through the proxy, TLS to the proxy's certificate with ALPN h2, then frames."""

    def __init__(self, p: Proxy, lease: str, window: int = 65535) -> None:
        raw = open_socket("127.0.0.1", p.port, timeout=30)
        raw.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
        assert read_answer(raw, "CONNECT").status == 200
        self.tls = tls_client(raw, p.ca, API, alpn=("h2",))
        assert self.tls.selected_alpn_protocol() == "h2"
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.lease = lease
        self.received: dict[int, int] = {}
        self.status: dict[int, int] = {}
        self.reset: dict[int, int] = {}
        self.ended: set[int] = set()
        self.goaway: int | None = None
        self.closed = False
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.tls.sendall(data)

    def request(self, method: str, path: str, end: bool = True, extra=()) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", method), (":scheme", "https"), (":authority", API), (":path", path), *extra],
                               end_stream=end)
        self.flush()
        return sid

    def pump(self, seconds: float, ack: bool = False, until=None) -> None:
        """Read what arrives for `seconds` (or until `until()`); `ack`: give the window back (a reading client)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until()):
            self.tls.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
            try:
                data = self.tls.recv(256 * KiB)
            except (TimeoutError, socket.timeout):
                continue
            except (OSError, ssl.SSLError):
                self.closed = True
                return
            if not data:
                self.closed = True
                return
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.status[event.stream_id] = int(dict(event.headers)[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    self.received[event.stream_id] = self.received.get(event.stream_id, 0) + len(event.data)
                    if ack:
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    self.reset[event.stream_id] = event.error_code
                elif isinstance(event, h2.events.StreamEnded):
                    self.ended.add(event.stream_id)
                elif isinstance(event, h2.events.ConnectionTerminated) and self.goaway is None:
                    self.goaway = event.error_code  # the first GOAWAY
            self.flush()

    def close(self) -> None:
        try:
            self.tls.close()
        except OSError:
            pass


# -- the tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lease", ["profile", "connection"])
def test_h2_client_that_stops_reading_stops_the_upstream_and_is_reset_as_stalled(proxy, hostile_tls, lease):
    before = settle(proxy)
    client = H2Client(proxy, proxy.env.lease(profile="ci") if lease == "profile" else proxy.env.lease(connection="github"))
    # A connection's answer is credentialed: scanned as it streams (the canary is injected upstream, never shown).
    path = f"/big?n={96 * MiB}" if lease == "profile" else f"/repos/acme/big?n={96 * MiB + 1}"
    sid = client.request("GET", path)
    # Never a WINDOW_UPDATE: 65,535 body bytes is all the client may take.
    client.pump(15.0, until=lambda: client.received.get(sid, 0) >= 65535)
    assert client.status.get(sid) == 200 and client.received.get(sid) == 65535
    sent = settled_count(lambda: hostile_tls.sent.get(path, 0))
    assert sent < 24 * MiB, f"the upstream sent {sent / MiB:.1f} MiB to a client that took 64 KiB"
    grown = proxy.rss() - before
    assert grown < 24 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"
    time.sleep(1.0)
    assert hostile_tls.sent.get(path, 0) == sent, "the upstream kept sending while the client took nothing"
    # A well-behaved client on another connection is served meanwhile.
    assert plain_get(proxy, "/ok").status == 200
    client.pump(STALL + 30, until=lambda: sid in client.reset)  # the reset's timer, plus a loaded machine's delay
    assert sid in client.reset, "the stalled stream was not reset"
    request, outcome = proxy.event_for(path)
    assert outcome is not None and outcome["failure"] == "client-stalled", outcome
    assert outcome["bytes_down"] == client.received[sid] == 65535, outcome
    assert request["connection" if lease == "connection" else "profile"] is not None
    client.close()


def test_the_settings_a_client_sees_are_the_bounds(proxy):
    """What the proxy advertises to an HTTP/2 client: streams and receive window as configured (mitmproxy's own
    window was 2^31-1), and an HPACK table of at most 64 KiB however large the client allows."""
    client = H2Client(proxy, proxy.env.lease(profile="ci"))
    client.conn.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 1 << 30})
    client.flush()
    sid = client.request("GET", "/ok")
    client.pump(10.0, ack=True, until=lambda: sid in client.ended)
    assert client.status.get(sid) == 200
    assert client.conn.remote_settings.max_concurrent_streams == 100
    assert client.conn.remote_settings.initial_window_size == HELD_PER_CONNECTION
    assert client.conn.outbound_flow_control_window <= HELD_PER_CONNECTION
    assert client.conn.decoder.header_table_size == 64 * KiB  # the size update our encoder sent with the answer
    client.close()


def test_h2_outcome_bytes_down_is_what_the_client_received(proxy):
    lease = proxy.env.lease(profile="ci")
    # A reset after part of the body: the outcome says so, with the bytes the client had.
    client = H2Client(proxy, lease)
    path = f"/big?n={8 * MiB}"
    sid = client.request("GET", path)
    client.pump(15.0, until=lambda: client.received.get(sid, 0) >= 65535)
    assert client.received.get(sid) == 65535
    client.conn.reset_stream(sid)
    client.flush()
    client.pump(1.0)
    _, outcome = proxy.event_for(path)
    assert outcome is not None and outcome["bytes_down"] == 65535 and outcome["failure"] == "client-disconnected", outcome
    client.close()
    # A completed download: all of it, no failure.
    client = H2Client(proxy, lease, window=1 << 24)
    path = f"/big?n={3 * MiB}"
    sid = client.request("GET", path)
    client.pump(20, ack=True, until=lambda: sid in client.ended)
    assert client.received.get(sid) == 3 * MiB
    _, outcome = proxy.event_for(path)
    assert outcome is not None and outcome["bytes_down"] == 3 * MiB and outcome["failure"] is None and not outcome["aborted"], outcome
    client.close()


def test_h2_stream_reset_before_the_upstream_answers_is_client_disconnected(proxy, hostile_tls):
    client = H2Client(proxy, proxy.env.lease(profile="ci"))
    hostile_tls.delay = 2.0  # the upstream's handshake is slow: the stream is reset while it is being dialled
    try:
        sid = client.request("GET", "/early-reset")
        time.sleep(0.7)
        client.conn.reset_stream(sid)
        client.flush()
        _, outcome = proxy.event_for("/early-reset")
    finally:
        hostile_tls.delay = 0.0
    assert outcome is not None and outcome["failure"] == "client-disconnected" and outcome["bytes_down"] == 0, outcome
    client.close()


def test_rapid_resets_close_the_connection_and_are_audited(proxy):
    client = H2Client(proxy, proxy.env.lease(profile="ci"))
    for i in range(150):  # HEADERS then RST_STREAM, as fast as it can (CVE-2023-44487)
        sid = client.conn.get_next_available_stream_id()
        client.conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", API), (":path", f"/rr-{i}")], end_stream=True)
        client.conn.reset_stream(sid)
        try:
            client.flush()
        except (OSError, ssl.SSLError):
            break
    client.pump(20.0, until=lambda: client.closed)
    assert client.closed and client.goaway in (None, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)  # (the GOAWAY is best effort)
    assert wait_for(lambda: any(e.get("reason") == "rapid-reset" and e.get("kind") == "connection" for e in proxy.events()))
    assert plain_get(proxy, "/ok").status == 200
    client.close()


def test_http1_client_that_stops_reading_holds_the_upstream(proxy, hostile_plain):
    before = settle(proxy)
    lease = proxy.env.lease(profile="ci")
    path = f"/big?n={96 * MiB}"
    with open_socket("127.0.0.1", proxy.port, timeout=20) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
        sock.sendall(f"GET http://{PKGS}{path} HTTP/1.1\r\nHost: {PKGS}\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
        sent = settled_count(lambda: hostile_plain.sent.get(path, 0), at_least=1)
        assert sent < 32 * MiB, f"the upstream sent {sent / MiB:.1f} MiB to a client that read nothing"
        assert proxy.rss() - before < 24 * MiB
        assert plain_get(proxy, "/ok").status == 200


def test_http1_client_that_stops_reading_is_cut_at_the_idle_timeout_as_stalled(tmp_path, pki, hostile_tls, hostile_plain):
    p = start_proxy(tmp_path, pki, hostile_tls.port, hostile_plain.port, "--idle-timeout", "3")
    try:
        with open_socket("127.0.0.1", p.port, timeout=30) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
            sock.sendall(f"GET http://{PKGS}/big?n={96 * MiB} HTTP/1.1\r\nHost: {PKGS}\r\n"
                         f"Proxy-Authorization: Bearer {p.env.lease(profile='ci')}\r\n\r\n".encode())
            _, outcome = p.event_for("/big", timeout=20)
        assert outcome is not None and (outcome["failure"], outcome["aborted"]) == ("client-stalled", True), outcome
        assert outcome["bytes_down"] < 96 * MiB
    finally:
        p.proc.terminate()
        p.proc.wait(15)


def test_an_h2_upstream_that_takes_no_body_stops_the_proxy_reading_the_client(tmp_path, pki, hostile_plain):
    upstream = ShutWindowH2(server_context(pki, "h2")).start()
    p = start_proxy(tmp_path, pki, upstream.port, hostile_plain.port, "--stream-buffer", "256k")
    try:
        before = settle(p)
        client = H2Client(p, p.env.lease(profile="ci"))
        size = 48 * MiB
        sid = client.request("POST", "/upload", end=False, extra=[("content-length", str(size))])
        chunk, pushed = b"u" * (16 * KiB), 0
        client.tls.settimeout(0.5)
        deadline = time.monotonic() + 4.0
        try:
            while pushed < size and time.monotonic() < deadline:
                if client.conn.local_flow_control_window(sid) < len(chunk):
                    client.pump(0.05)
                    continue
                client.conn.send_data(sid, chunk)
                client.tls.sendall(client.conn.data_to_send())
                pushed += len(chunk)
        except (TimeoutError, socket.timeout, ssl.SSLError):
            pass  # the proxy stopped reading us: our socket is full
        assert upstream.received <= 65535
        assert pushed < 24 * MiB, f"the proxy took {pushed / MiB:.1f} MiB of a body its upstream would not take"
        assert p.rss() - before < 24 * MiB
        client.close()
    finally:
        p.proc.terminate()
        p.proc.wait(15)


def test_h2_bodies_held_whole_stop_at_the_connection_cap(proxy, hostile_tls):
    before = settle(proxy)
    client = H2Client(proxy, proxy.env.lease(profile="ci"))
    streams = [client.request("POST", f"/held-{i}", end=False, extra=[("content-type", "application/octet-stream")]) for i in range(4)]
    chunk = b"h" * (16 * KiB)
    for _ in range(8 * MiB // len(chunk)):  # 8 MiB on each of the four streams, in turn: 32 MiB offered, 24 MiB allowed
        for sid in streams:
            if sid in client.reset or client.status.get(sid):
                continue
            while client.conn.local_flow_control_window(sid) < len(chunk):
                client.pump(0.2)
            client.conn.send_data(sid, chunk)
        client.flush()
        client.pump(0.001)
    client.pump(30.0, until=lambda: any(client.status.get(s) == 503 for s in streams))  # a loaded proxy's backlog
    refused = [sid for sid in streams if client.status.get(sid) == 503]
    assert len(refused) >= 1, (client.status, client.reset)
    assert not any(r.startswith("/held-") for r in hostile_tls.requests), "a held body went upstream"
    grown = proxy.rss() - before
    assert grown < HELD_PER_CONNECTION + 16 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"
    # Allowed before their bodies came, so the refusal is the outcome's failure, with the status the client got.
    assert wait_for(lambda: any(e.get("failure") == "held-bodies-at-capacity" and e["status"] == 503 for e in proxy.events())), \
        [(e.get("kind"), e.get("decision"), e.get("failure"), e.get("status")) for e in proxy.events()][-8:]
    client.close()


def push(client: H2Client, sid: int, size: int, timeout: float = 20.0) -> None:
    """Send `size` body bytes on a stream (as its window allows), or stop early once the stream is answered."""
    chunk, sent, deadline = b"h" * (16 * KiB), 0, time.monotonic() + timeout
    while sent < size and time.monotonic() < deadline and sid not in client.status and sid not in client.reset:
        if client.conn.local_flow_control_window(sid) < len(chunk):
            client.pump(0.1)
            continue
        client.conn.send_data(sid, chunk)
        client.flush()
        sent += len(chunk)
    client.pump(1.0, until=lambda: sid in client.status or sid in client.reset)


def test_the_process_caps_hold_across_connections(tmp_path, pki, hostile_tls, hostile_plain):
    """`--max-held` across two connections, and `--max-streams-total` across streams: each refusal names its cap."""
    p = start_proxy(tmp_path, pki, hostile_tls.port, hostile_plain.port, "--max-held", "12m", "--max-streams-total", "3")
    try:
        lease = p.env.lease(profile="ci")
        a, b = H2Client(p, lease), H2Client(p, lease)
        first = a.request("POST", "/held-a", end=False)
        push(a, first, 8 * MiB)
        assert first not in a.status  # held: 8 MiB of 12
        other = b.request("POST", "/held-b", end=False)
        push(b, other, 8 * MiB)
        b.pump(30.0, until=lambda: other in b.status or other in b.reset)  # the proxy may lag by MiB of socket buffers
        assert b.status.get(other) == 503, (b.status, b.reset)  # 16 MiB would pass the process's 12
        more = [a.request("POST", f"/held-{i}", end=False) for i in "cde"]  # in flight: held-a and these three
        a.pump(30.0, until=lambda: any(sid in a.status for sid in more))
        assert [a.status.get(sid) for sid in more] == [None, None, 503], a.status
        def audited() -> bool:
            events = p.events()
            return any(e.get("kind") == "request" and e.get("reason") == "streams-at-capacity" for e in events) and \
                any(e.get("kind") == "outcome" and e.get("failure") == "held-bodies-at-capacity" for e in events)

        assert wait_for(audited), [(e.get("kind"), e.get("reason"), e.get("failure")) for e in p.events()][-10:]
        assert not any(r.startswith("/held-") for r in hostile_tls.requests), "a held body went upstream"
        a.close()
        b.close()
    finally:
        p.proc.terminate()
        p.proc.wait(15)


@pytest.mark.parametrize(("path", "reason"), [
    (f"/pad-header?n={96 * MiB}", "response-line-too-long"),
    (f"/many-headers?n={4 * MiB}", "response-head-too-large"),
])
def test_hostile_response_heads_are_cut_as_they_arrive(proxy, hostile_plain, path, reason):
    before = settle(proxy)
    answer = plain_get(proxy, path)
    assert answer.status == 502 and answer.header("X-Egresslaw-Deny") == reason, answer
    assert b"p" * 64 not in answer.body
    assert settled_count(lambda: hostile_plain.sent.get(path, 0)) < 16 * MiB
    assert proxy.rss() - before < 16 * MiB
    _, outcome = proxy.event_for(path)
    assert outcome is not None and outcome["failure"] == reason and outcome["status"] == 502, outcome


def test_hostile_heads_of_credentialed_answers_are_cut_too(proxy, hostile_tls):
    """The same bound on connection traffic (HTTP/1 in a TLS tunnel, the credential injected upstream)."""
    before = settle(proxy)
    path = f"/repos/acme/pad-header?n={96 * MiB}"
    lease = proxy.env.lease(connection="github")
    with open_socket("127.0.0.1", proxy.port, timeout=30) as raw:
        raw.sendall(f"CONNECT {API}:443 HTTP/1.1\r\nHost: {API}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
        assert read_answer(raw, "CONNECT").status == 200
        with tls_client(raw, proxy.ca, API) as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
            answer = read_answer(tls)
    assert answer.status == 502 and answer.header("X-Egresslaw-Deny") == "response-line-too-long", answer
    assert CANARY.encode() not in answer.raw and b"p" * 64 not in answer.raw
    assert settled_count(lambda: hostile_tls.sent.get(path, 0)) < 16 * MiB
    assert proxy.rss() - before < 16 * MiB
    request, outcome = proxy.event_for(path)
    assert request["connection"] == "github" and outcome is not None and outcome["failure"] == "response-line-too-long", outcome


@pytest.mark.parametrize(("path", "reason"), [
    (f"/chunk-line?n={96 * MiB}", "response-line-too-long"),
    (f"/trailers?n={96 * MiB}", "response-head-too-large"),
])
def test_hostile_chunk_lines_and_trailers_are_cut_as_they_arrive(proxy, hostile_plain, path, reason):
    before = settle(proxy)
    lease = proxy.env.lease(profile="ci")
    with open_socket("127.0.0.1", proxy.port, timeout=20) as sock:
        sock.sendall(f"GET http://{PKGS}{path} HTTP/1.1\r\nHost: {PKGS}\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
        got = b""
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            got += data
    assert got.startswith(b"HTTP/1.1 200 ") and not got.endswith(b"0\r\n\r\n"), got[:200]  # the head went out; the body is cut
    assert settled_count(lambda: hostile_plain.sent.get(path, 0)) < 16 * MiB
    assert proxy.rss() - before < 16 * MiB
    _, outcome = proxy.event_for(path)
    assert outcome is not None and outcome["failure"] == reason and outcome["aborted"], outcome


def test_a_control_character_in_a_header_value_is_smuggling(proxy, hostile_plain):
    before = len(hostile_plain.requests)
    answer = plain_get(proxy, "/esc", extra="X-Note: a\x1b[31mb\r\n")
    assert answer.status == 403 and answer.header("X-Egresslaw-Deny") == "smuggling", answer
    assert len(hostile_plain.requests) == before
