"""Hostile upstreams for the response path, and a raw reader for what the client is shown.

Both upstreams answer from the credential they received (the `Authorization` of the request), so any
byte of their answer that reaches the client unredacted is a leak of the credential.

`HostileHttp1` (TLS, ALPN http/1.1) writes raw bytes scripted by the request path:

    /h/code/<framing>/<codings>   an echo of the credential in every encoding the scanner knows, in the
                                  status reason and a header too, under a framing (`length`, `chunked`,
                                  `gzip-chunked`, `deflate-chunked`, `gzip-close`, `deflate-close`,
                                  `close`, `compress-chunked`) and content codings (`none`, or names
                                  joined by `+`, in the order applied: gzip, deflate, rawdeflate, br,
                                  zstd, x-custom); chunked bodies go out in 5-byte chunks
    /h/cut/<where>                the answer broken at `where` (see CUTS), then the connection closed
    /h/interim/<codes>            interim heads (`103`, `100`, `100+103`) carrying the credential, a pause,
                                  then the final 200 echoing it; the connection stays open
    /h/switch                     a 101 nobody asked for, then the credential
    /h/extra                      a complete answer followed by the credential as stray bytes
    /h/big/<n>/<framing>          n bytes of body (`length` or `chunked`), the credential at the start
    /h/bomb/<n>                   a gzip body that decodes to n MiB of zeros
    /h/echo, anything else        200, a JSON echo of the path and the credential

`HostileH2` (TLS, ALPN h2, hyper-h2 with validation off) answers by `:path`:

    /h2/bad-value   a header value that ends in NUL (illegal), holding the credential
    /h2/bad-name    an upper-case header name holding the credential
    /h2/echo        the credential in a header and across DATA frames, empty DATA frames between them
    /h2/gzip        the same, gzip-coded
    /h2/interim     a 103 carrying the credential, then the final 200
    /h2/trailers    a body, then trailers holding the credential

Every connection and request is recorded (`requests`: connection number, path, Authorization).
"""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import threading
import time
import zlib
from dataclasses import dataclass, field

from egress_proxy.custody.secret import encodings_of
from tests.proxy_harness import Pki

FRAMINGS = ("length", "chunked", "gzip-chunked", "deflate-chunked", "gzip-close", "deflate-close", "close")
CUTS = {
    "status-line": "the status line is cut before its end (holding the credential)",
    "bad-status": "a status line whose code is not a number",
    "mid-head": "the head ends before its blank line",
    "mid-header": "a header line is cut before its end",
    "bad-header": "a header line without a colon",
    "bad-chunk-header": "a chunk-size line that is not hex",
    "mid-chunk-header": "the connection closes inside a chunk-size line",
    "mid-chunk": "the connection closes inside a chunk's data",
    "short-length": "fewer bytes than a small Content-Length (a buffered body), then close",
    "long-length": "fewer bytes than a large Content-Length (a streamed body), then close",
    "cl-and-te": "both Content-Length and Transfer-Encoding (ambiguous framing)",
}


def echo_body(token: bytes) -> bytes:
    """JSON quoting the credential in every encoding the scanner looks for (as is: a JSON-escaped copy decodes
    to the credential itself), and plain once more."""
    return b'{"echo": ["' + b'", "'.join(encodings_of(token)) + b'"], "plain": "' + token + b'"}'


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


def _encoders():
    import brotli

    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd  # type: ignore[no-redef]
    return {"gzip": gzip.compress, "deflate": zlib.compress, "rawdeflate": _raw_deflate, "br": brotli.compress, "zstd": zstd.compress,
            "x-custom": lambda d: d[::-1]}


def apply_codings(body: bytes, names: list[str]) -> bytes:
    encoders = _encoders()
    for name in names:
        body = encoders[name](body)
    return body


def chunked(data: bytes, size: int = 5) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i : i + size]), data[i : i + size]) for i in range(0, len(data), size)) + b"0\r\n\r\n"


@dataclass
class Hostile:
    port: int = 0
    requests: list[tuple[int, str, str]] = field(default_factory=list)  # (connection number, path, Authorization)
    connections: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    pause: float = 0.4  # seconds between an interim answer and the final one
    _sock: socket.socket | None = None

    def seen(self, path: str) -> list[tuple[int, str, str]]:
        with self.lock:
            return [r for r in self.requests if r[1] == path]

    def stop(self) -> None:
        self.stopping.set()
        if self._sock is not None:
            self._sock.close()

    def _start(self, pki: Pki, alpn: str) -> Hostile:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki.cert_pem, pki.key_pem)
        ctx.set_alpn_protocols([alpn])
        self._ctx = ctx
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self._sock, self.port = sock, sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name=f"hostile-{self.port}").start()
        return self

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                number = self.connections
            threading.Thread(target=self._serve_tls, args=(raw, number), daemon=True).start()

    def _serve_tls(self, raw: socket.socket, number: int) -> None:
        try:
            raw.settimeout(10)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._ctx.wrap_socket(raw, server_side=True) as conn:
                self.serve(conn, number)
        except (OSError, ssl.SSLError):
            pass

    def serve(self, conn: ssl.SSLSocket, number: int) -> None:
        raise NotImplementedError


class HostileHttp1(Hostile):
    def serve(self, conn: ssl.SSLSocket, number: int) -> None:
        buf = b""
        while not self.stopping.is_set():
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.split(b"\r\n")
            path = lines[0].split(b" ")[1].decode("latin-1")
            auth = next((line.split(b":", 1)[1].strip() for line in lines[1:] if line.lower().startswith(b"authorization:")), b"")
            with self.lock:
                self.requests.append((number, path, auth.decode("latin-1")))
            token = auth.removeprefix(b"Bearer ") or b"no-credential"
            if not self.answer(conn, path, token):
                return

    def answer(self, conn: ssl.SSLSocket, path: str, token: bytes) -> bool:
        """Write the scripted answer; False closes the connection."""
        parts = path.strip("/").split("/")
        kind = parts[1] if len(parts) > 1 else "echo"
        if kind == "code":
            conn.sendall(self._coded(parts[2], [] if parts[3] == "none" else parts[3].split("+"), token))
            return parts[2] in ("length", "chunked", "gzip-chunked", "deflate-chunked", "compress-chunked")
        if kind == "cut":
            conn.sendall(self._cut(parts[2], token))
            time.sleep(0.05)
            return False
        if kind == "interim":
            for code in parts[2].split("+"):
                if code == "100":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\nX-Leak: " + token + b"\r\n\r\n")
                else:
                    conn.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css?t=" + token + b">; rel=preload\r\nX-Leak: " + token + b"\r\n\r\n")
            time.sleep(self.pause)
            body = b'{"late": "' + token + b'"}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            return True
        if kind == "switch":
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x-" + token + b"\r\nConnection: upgrade\r\n\r\n" + token)
            time.sleep(0.05)
            return False
        if kind == "extra":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}stray " + token + b"\r\n\r\n")
            time.sleep(0.05)
            return False
        if kind == "big":
            n, framing = int(parts[2]), parts[3]
            body = token + b"x" * (n - len(token))
            if framing == "length":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n + body)
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body, 16384))
            return True
        if kind == "bomb":
            body = gzip.compress(bytes(int(parts[2]) << 20), 9)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            return True
        body = json.dumps({"path": path, "token": token.decode("latin-1")}).encode("latin-1")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True

    def _coded(self, framing: str, names: list[str], token: bytes) -> bytes:
        body = apply_codings(echo_body(token), names)
        head = [b"HTTP/1.1 200 OK " + token, b"Content-Type: application/json", b"X-Echo: " + token]
        if names:
            head.append(b"Content-Encoding: " + ", ".join(n if n != "rawdeflate" else "deflate" for n in names).encode())
        if framing == "length":
            head.append(b"Content-Length: %d" % len(body))
        elif framing == "chunked":
            head.append(b"Transfer-Encoding: chunked")
            body = chunked(body)
        elif framing in ("gzip-chunked", "deflate-chunked", "compress-chunked"):
            coding = framing.split("-")[0]
            head.append(b"Transfer-Encoding: " + coding.encode() + b", chunked")
            body = chunked(gzip.compress(body) if coding == "gzip" else zlib.compress(body) if coding == "deflate" else body[::-1])
        elif framing in ("gzip-close", "deflate-close"):
            coding = framing.split("-")[0]
            head.append(b"Transfer-Encoding: " + coding.encode())
            head.append(b"Connection: close")
            body = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
        else:  # close-delimited, no coding on the transfer
            head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    def _cut(self, where: str, token: bytes) -> bytes:
        ok = b"HTTP/1.1 200 OK\r\n"
        return {
            "status-line": b"HTTP/1.1 200 OK " + token,
            "bad-status": b"HTTP/1.1 2x0 " + token + b"\r\nContent-Length: 0\r\n\r\n",
            "mid-head": ok + b"X-Echo: " + token + b"\r\nContent-Type: text/plain\r\n",
            "mid-header": ok + b"X-Echo: " + token,
            "bad-header": ok + b"X-Echo " + token + b"\r\nContent-Length: 0\r\n\r\n",
            "bad-chunk-header": ok + b"Transfer-Encoding: chunked\r\n\r\nzz" + token + b"\r\n",
            "mid-chunk-header": ok + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (20, token[:20]) + b"1",
            "mid-chunk": ok + b"Transfer-Encoding: chunked\r\n\r\n1000\r\n" + token[:20],
            "short-length": ok + b"Content-Length: 1000\r\n\r\n" + token[:20],
            "long-length": ok + b"Content-Length: 100000\r\n\r\n" + token[:20],
            "cl-and-te": ok + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\nX-Echo: " + token + b"\r\n\r\n0\r\n\r\n",
        }[where]


class HostileH2(Hostile):
    def serve(self, conn: ssl.SSLSocket, number: int) -> None:
        import h2.config
        import h2.connection
        import h2.events

        config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_outbound_headers=False,
                                           normalize_outbound_headers=False, validate_inbound_headers=False)
        h2c = h2.connection.H2Connection(config=config)
        h2c.initiate_connection()
        conn.sendall(h2c.data_to_send())
        while not self.stopping.is_set():
            data = conn.recv(65536)
            if not data:
                return
            for event in h2c.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    headers = dict(event.headers)
                    path = headers.get(b":path", b"").decode("latin-1")
                    auth = headers.get(b"authorization", b"")
                    with self.lock:
                        self.requests.append((number, path, auth.decode("latin-1")))
                    self._answer(h2c, event.stream_id, path, auth.removeprefix(b"Bearer ") or b"no-credential")
            out = h2c.data_to_send()
            if out:
                conn.sendall(out)

    def _answer(self, h2c, stream: int, path: str, token: bytes) -> None:
        body = echo_body(token)
        if path.endswith("/bad-value"):
            h2c.send_headers(stream, [(b":status", b"200"), (b"x-echo", token + b"\x00")], end_stream=True)
        elif path.endswith("/bad-name"):
            h2c.send_headers(stream, [(b":status", b"200"), (b"X-" + token, b"1")], end_stream=True)
        elif path.endswith("/interim"):
            h2c.send_headers(stream, [(b":status", b"103"), (b"link", b"</x?t=" + token + b">")])
            h2c.send_headers(stream, [(b":status", b"200"), (b"x-echo", token)])
            h2c.send_data(stream, body, end_stream=True)
        elif path.endswith("/trailers"):
            h2c.send_headers(stream, [(b":status", b"200")])
            h2c.send_data(stream, b"{}")
            h2c.send_headers(stream, [(b"x-leak", token)], end_stream=True)
        else:
            coded = path.endswith("/gzip")
            data = gzip.compress(body) if coded else body
            headers = [(b":status", b"200"), (b"x-echo", token)] + ([(b"content-encoding", b"gzip")] if coded else [])
            h2c.send_headers(stream, headers)
            for i in range(0, len(data), 7):
                h2c.send_data(stream, data[i : i + 7])
                h2c.send_data(stream, b"")  # an empty DATA frame between the pieces
            h2c.end_stream(stream)


def start_http1(pki: Pki) -> HostileHttp1:
    return HostileHttp1()._start(pki, "http/1.1")


def start_h2(pki: Pki) -> HostileH2:
    return HostileH2()._start(pki, "h2")


# -- the client's side ----------------------------------------------------------------------------


@dataclass
class Shown:
    """Everything one response put on the client's wire, and how it ended."""

    raw: bytes = b""
    status: int | None = None  # of the first head (None: no head at all)
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""  # de-chunked
    complete: bool = False  # the framing said the body was whole
    closed: bool = False  # the proxy closed the connection

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


def read_response(sock, timeout: float = 10.0) -> Shown:
    """Read one HTTP/1 response as raw bytes, without fixing anything up: stops when its framing says it is
    whole, or when the proxy closes the connection (then `complete` tells whether it was cut)."""
    shown = Shown()
    sock.settimeout(timeout)
    buf = b""

    def more() -> bool:
        nonlocal buf
        try:
            data = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            return False
        except (OSError, ssl.SSLError):
            data = b""
        if not data:
            shown.closed = True
            return False
        buf += data
        shown.raw += data
        return True

    while b"\r\n\r\n" not in buf:
        if not more():
            return shown
    head, buf = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    try:
        shown.status = int(lines[0].split(" ")[1])
    except (IndexError, ValueError):
        return shown
    shown.headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:])]
    te = (shown.header("transfer-encoding") or "").lower()
    length = shown.header("content-length")
    if shown.status in (204, 304) or 100 <= shown.status < 200:
        shown.complete = True
    elif "chunked" in te:
        body = b""
        while True:
            while b"\r\n" not in buf:
                if not more():
                    shown.body = body
                    return shown
            size_line, rest = buf.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                if not more():
                    shown.body = body + rest[:size]
                    return shown
                size_line, rest = buf.split(b"\r\n", 1)
            body += rest[:size]
            buf = rest[size + 2 :]
            if size == 0:
                shown.body, shown.complete = body, True
                return shown
    elif length is not None:
        while len(buf) < int(length):
            if not more():
                break
        shown.body, shown.complete = buf[: int(length)], len(buf) >= int(length)
    else:
        while more():
            pass
        shown.body, shown.complete = buf, shown.closed
    return shown
