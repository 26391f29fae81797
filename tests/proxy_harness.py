"""Shared harness for tests that run the real egress proxy: a test PKI, counting loopback upstreams
(HTTP and TLS), keys, custody holding a canary credential, artifacts, proofs, a scripted resolver.

Used by tests/egress_proxy (unit and end-to-end) and tests/conformance (adversarial corpus, faults,
load, fuzz). Every address used here is loopback. Upstream names are ordinary (non-special-use) names
that the proxy resolves through an injected resolver (or `--resolve`) to public-looking addresses that
are never dialled: `--connect-to` sends the vetted connection to 127.0.0.1.

The upstream counts raw TCP accepts (before any TLS byte), the request bytes it read and the requests
it parsed, so "zero bytes reached the upstream" is `since(mark) == (0, 0, 0)`.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import http.server
import ipaddress
import json
import logging
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from egress_proxy.secret import encodings_of
from tests.egress_proxy import builders as b

CANARY = "ghp_CanarySecret0123456789abcdefZZ"
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


def wait_for(predicate, timeout: float = 8.0) -> bool:
    """Poll `predicate` every 50 ms until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def proof_for(artifact, verdict: str = "proved") -> str:
    """A real proof report for `artifact`: the prover's own, run once per artifact and decision core and cached
    (in this process and in the temp directory, so parallel test workers prove it once). `verdict` other than
    "proved" rewrites every verdict (for tests of the gate's refusals)."""
    import os
    import tempfile

    from egress_proxy.provenance import core_digest, egresslaw_version

    key = f"{artifact.digest}-{core_digest()[:16]}-{egresslaw_version()}"
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
        return text
    doc = json.loads(text)
    for result in doc["results"]:
        result["verdict"] = verdict
    return json.dumps(doc)


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

        from egress_proxy.lease import mint

        return mint(self.lease_key, subject, profile=profile, connection=connection, ttl=ttl, now=time.time())


def make_env(root: Path, artifact=None) -> Env:
    from egress_proxy.custody import Address, CustodyStore
    from egress_proxy.keys import init_keys, load_lease_key

    root.mkdir(parents=True, exist_ok=True)
    keys = root / "keys"
    init_keys(keys)
    store = root / "custody.db"
    with CustodyStore(store, keys) as cs:
        cs.put(Address(WORKSPACE, "github", "gh-prod"), CANARY.encode())
    art = artifact or build_artifact()
    (root / "egresslaw.json").write_text(art.to_json())
    (root / "proof.json").write_text(proof_for(art))
    return Env(root, keys, store, root / "egresslaw.json", root / "proof.json", root / "audit.jsonl", root / "conf", load_lease_key(keys))




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
        from egress_proxy.audit import OWN_KINDS, segment_path

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
        return (len(self.events()), [u.mark() for u in self.ups])

    def new_events(self, mark) -> list[dict]:
        return self.events()[mark[0] :]

    def upstream_delta(self, mark):
        return [u.since(m) for u, m in zip(self.ups, mark[1])]

    def assert_nothing_leaked(self) -> None:
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
    from egress_proxy.server import EdgeConfig, start_in_thread

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
    try:
        p.threaded.stop()
    finally:
        root = logging.getLogger()
        root.removeHandler(p.logs)
        root.setLevel(getattr(p.logs, "old_level", logging.WARNING))
