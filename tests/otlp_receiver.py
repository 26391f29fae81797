"""A real OTLP logs receiver for the tests, built on `opentelemetry-proto`: gRPC (`LogsService/Export`, the generated
servicer) or HTTP/protobuf (`POST /v1/logs`), on 127.0.0.1, plaintext or TLS, with an optional required header.

    with Receiver("grpc") as rx:                       # or "http"; auth=("authorization", "Bearer x"); tls=make_tls(dir)
        ...export to rx.url...
        rx.stop(); rx.start()                          # down and up again on the same port
        rx.fail_next(3); rx.slow = 2.0                 # answer 503 / UNAVAILABLE three times; wait before answering
        rx.uids(), rx.records(), rx.count_by_uid()

It keeps every LogRecord it acknowledged (thread-safe), so a test sees duplicates as they arrive.
"""

from __future__ import annotations

import collections
import datetime
import ipaddress
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls(directory: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 and localhost, as PEM files in `directory`."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("otlp test CA")).issuer_name(name("otlp test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
            .public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    return files


class Receiver:
    """An OTLP logs receiver (`kind` "grpc" or "http") that stores what it acknowledges."""

    def __init__(self, kind: str, *, auth: tuple[str, str] | None = None, tls: TlsFiles | None = None) -> None:
        assert kind in ("grpc", "http")
        self.kind, self.auth, self.tls = kind, auth, tls
        self.port = 0
        self.slow = 0.0  # seconds to wait before answering
        self.reject = 0  # records each acknowledged export reports as rejected (partial_success; stored all the same)
        self.lock = threading.Lock()
        self.log_records: list = []  # every LogRecord acknowledged, in arrival order
        self.resources: list = []  # the Resource of every acknowledged request
        self.instances: list[str] = []  # service.instance.id of the request each LogRecord came in (parallel to log_records)
        self.refused = 0  # requests answered 401 / UNAUTHENTICATED
        self._fail = 0
        self._server = None
        self._conns: set[socket.socket] = set()
        self._running = False

    # -- control

    @property
    def url(self) -> str:
        scheme = {("grpc", False): "grpc", ("grpc", True): "grpcs", ("http", False): "http", ("http", True): "https"}[(self.kind, self.tls is not None)]
        return f"{scheme}://127.0.0.1:{self.port}"

    def fail_next(self, n: int) -> None:
        """Answer the next `n` exports with 503 (HTTP) / UNAVAILABLE (gRPC), storing nothing."""
        with self.lock:
            self._fail = n

    def start(self) -> Receiver:
        """Listen (again, on the same port once one was chosen)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self._start_grpc() if self.kind == "grpc" else self._start_http()
                break
            except (OSError, RuntimeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)  # the port may linger for a moment after stop()
        self._running = True
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection (a collector that went away)."""
        self._running = False
        server, self._server = self._server, None
        if server is None:
            return
        if self.kind == "grpc":
            server.stop(grace=None).wait(10)
        else:
            server.shutdown()
            server.server_close()
            with self.lock:
                conns, self._conns = set(self._conns), set()
            for conn in conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what arrived

    @staticmethod
    def attribute(record, key: str):
        for kv in record.attributes:
            if kv.key == key:
                value = kv.value
                return value.int_value if value.WhichOneof("value") == "int_value" else value.string_value
        return None

    def uids(self) -> list[str]:
        with self.lock:
            return [self.attribute(r, "log.record.uid") for r in self.log_records]

    def records(self) -> list[dict]:
        """The OCSF records (decoded bodies), in arrival order."""
        with self.lock:
            return [json.loads(r.body.string_value) for r in self.log_records]

    def count_by_uid(self) -> collections.Counter:
        return collections.Counter(self.uids())

    # -- one export

    def _admit(self, headers: dict[str, str]) -> str | None:
        """None: accept; "auth": refuse as unauthenticated; "fail": refuse as unavailable."""
        if self.auth is not None and headers.get(self.auth[0].lower()) != self.auth[1]:
            with self.lock:
                self.refused += 1
            return "auth"
        with self.lock:
            if self._fail > 0:
                self._fail -= 1
                return "fail"
        if self.slow:
            time.sleep(self.slow)
        return None

    def _store(self, request) -> None:
        with self.lock:
            for resource_logs in request.resource_logs:
                self.resources.append(resource_logs.resource)
                instance = self.attribute(resource_logs.resource, "service.instance.id")
                for scope_logs in resource_logs.scope_logs:
                    self.log_records.extend(scope_logs.log_records)
                    self.instances.extend([instance] * len(scope_logs.log_records))

    def _response(self):
        answer = logs_service_pb2.ExportLogsServiceResponse()
        if self.reject:
            answer.partial_success.rejected_log_records = self.reject
            answer.partial_success.error_message = "rejected on purpose"
        return answer

    # -- gRPC

    def _start_grpc(self) -> None:
        receiver = self

        class Servicer(logs_service_pb2_grpc.LogsServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the generated name)
                verdict = receiver._admit({k.lower(): v for k, v in context.invocation_metadata()})
                if verdict == "auth":
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong credentials")
                if verdict == "fail":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "failing on purpose")
                if not context.is_active():  # the client went away (killed, timed out) before the answer: it never saw one
                    context.abort(grpc.StatusCode.CANCELLED, "the client is gone")
                receiver._store(request)
                return receiver._response()

        server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", 64 << 20),
                                                                         ("grpc.so_reuseport", 0)])
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(Servicer(), server)
        address = f"127.0.0.1:{self.port}"
        if self.tls is not None:
            creds = grpc.ssl_server_credentials([(self.tls.key.read_bytes(), self.tls.cert.read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"cannot bind {address}")
        self.port = port
        server.start()
        self._server = server

    # -- HTTP

    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with receiver.lock:
                    receiver._conns.add(self.connection)

            def finish(self) -> None:
                with receiver.lock:
                    receiver._conns.discard(self.connection)
                super().finish()

            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not receiver._running:
                    self.close_connection = True
                    return
                if self.path != "/v1/logs":
                    return self._answer(404, b"not found")
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    return self._answer(415, b"protobuf only")
                verdict = receiver._admit({k.lower(): v for k, v in self.headers.items()})
                if verdict == "auth":
                    return self._answer(401, b"unauthenticated")
                if verdict == "fail":
                    return self._answer(503, b"failing on purpose")
                request = logs_service_pb2.ExportLogsServiceRequest()
                request.ParseFromString(body)
                receiver._store(request)
                self._answer(200, receiver._response().SerializeToString(), "application/x-protobuf")

        class Server(ThreadingHTTPServer):
            allow_reuse_address = True
            daemon_threads = True

        server = Server(("127.0.0.1", self.port), Handler)
        if self.tls is not None:
            import ssl  # Imported here: only the TLS receiver needs it

            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
            server.socket = context.wrap_socket(server.socket, server_side=True)
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="otlp-http").start()
        self._server = server
