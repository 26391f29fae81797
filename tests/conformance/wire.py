"""Raw clients: bytes to the proxy over a plain or TLS socket, answers parsed without fixing anything."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import struct
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Answer:
    status: int | None
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    raw: bytes = b""  # everything shown to the client (for the leak checks)
    error: str | None = None

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return values[0] if values else None

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


def read_answer(sock, method: str = "GET") -> Answer:
    """One HTTP/1 response from `sock` (None status if the peer closed or sent no valid response)."""
    resp = http.client.HTTPResponse(sock, method=method)
    try:
        resp.begin()
        body = resp.read() if method != "CONNECT" or resp.status != 200 else b""
    except (http.client.HTTPException, OSError, ssl.SSLError, ValueError) as exc:
        return Answer(None, error=f"{exc.__class__.__name__}: {exc}")
    headers = list(resp.getheaders())
    raw = f"HTTP {resp.status} {resp.reason}\r\n".encode("latin-1", "replace") + "".join(f"{k}: {v}\r\n" for k, v in headers).encode("latin-1", "replace") + b"\r\n" + body
    return Answer(resp.status, headers, body, raw)


def open_socket(host: str, port: int, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def insert_after_request_line(wire: bytes, lines: list[str]) -> bytes:
    """Add header lines right after the request line (keeping the request's own line ending)."""
    if not lines:
        return wire
    end = wire.find(b"\n")
    if end < 0:
        return wire
    eol = b"\r\n" if wire[end - 1 : end] == b"\r" else b"\n"
    extra = b"".join(line.encode("latin-1") + eol for line in lines)
    return wire[: end + 1] + extra + wire[end + 1 :]


def tls_client(sock: socket.socket, ca: Path, sni: str | None, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(list(alpn))
    if sni is None:
        ctx.check_hostname = False
    return ctx.wrap_socket(sock, server_hostname=sni)


def client_hello(sni: str | bytes, ech_type: int | None) -> bytes:
    """A TLS 1.3 ClientHello record with `sni`, and an encrypted_client_hello extension of `ech_type`."""

    def ext(kind: int, data: bytes) -> bytes:
        return struct.pack("!HH", kind, len(data)) + data

    name = sni.encode() if isinstance(sni, str) else sni
    exts = ext(0, struct.pack("!HBH", len(name) + 3, 0, len(name)) + name)
    exts += ext(0x2B, b"\x02\x03\x04")  # supported_versions: TLS 1.3
    exts += ext(0x0A, b"\x00\x02\x00\x1d")  # supported_groups: x25519
    exts += ext(0x0D, b"\x00\x04\x04\x03\x08\x04")  # signature_algorithms
    exts += ext(0x33, struct.pack("!HHH", 36, 0x1D, 32) + os.urandom(32))  # key_share
    if ech_type is not None:
        payload = b"\x00" + b"\x00\x01\x00\x01" + b"\x07" + struct.pack("!H", 32) + os.urandom(32) + struct.pack("!H", 48) + os.urandom(48)
        exts += ext(ech_type, payload)
    body = b"\x03\x03" + os.urandom(32) + b"\x20" + os.urandom(32) + b"\x00\x04\x13\x01\x13\x02" + b"\x01\x00"
    body += struct.pack("!H", len(exts)) + exts
    handshake = b"\x01" + struct.pack("!I", len(body))[1:] + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


def h2_exchange(tls: ssl.SSLSocket, headers, body: bytes = b"", trailers=()) -> Answer:
    """One HTTP/2 request on an established TLS socket (ALPN h2), sent without client-side validation."""
    import h2.config
    import h2.connection
    import h2.events

    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8", validate_outbound_headers=False,
                                       normalize_outbound_headers=False, validate_inbound_headers=False)
    conn = h2.connection.H2Connection(config=config)
    conn.initiate_connection()
    stream = conn.get_next_available_stream_id()
    end_after_headers = not body and not trailers
    conn.send_headers(stream, list(headers), end_stream=end_after_headers)
    if body:
        conn.send_data(stream, body, end_stream=not trailers)
    if trailers:
        conn.send_headers(stream, list(trailers), end_stream=True)
    tls.sendall(conn.data_to_send())
    status, out_headers, out_trailers, data, raw = None, [], [], b"", b""
    done = False
    error = None
    while not done:
        try:
            chunk = tls.recv(65536)
        except (OSError, ssl.SSLError) as exc:
            error = exc.__class__.__name__
            break
        if not chunk:
            error = "closed"
            break
        raw += chunk
        for event in conn.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream:
                for k, v in event.headers:
                    k = k.decode() if isinstance(k, bytes) else k
                    v = v.decode() if isinstance(v, bytes) else v
                    if k == ":status":
                        status = int(v)
                    else:
                        out_headers.append((k, v))
            elif isinstance(event, h2.events.TrailersReceived) and event.stream_id == stream:
                out_trailers.extend(event.headers)  # decoded: in `raw` HPACK may have Huffman-coded them
            elif isinstance(event, h2.events.DataReceived) and event.stream_id == stream:
                data += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, stream)
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)) and event.stream_id == stream:
                done = True
            elif isinstance(event, h2.events.ConnectionTerminated):
                done = True
        pending = conn.data_to_send()
        if pending:
            tls.sendall(pending)
    shown = repr((status, out_headers, out_trailers)).encode() + data
    return Answer(status, out_headers, data, shown + raw, error)
