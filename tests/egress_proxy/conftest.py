"""Shared fixtures for the proxy tests: a test PKI, real loopback upstreams, keys, custody, artifact, proof.

Every address used here is loopback. Upstream names are ordinary (non-special-use) names that the
proxy resolves through an injected resolver (or `--resolve`) to public-looking addresses that are
never dialled: `--connect-to` sends the vetted connection to 127.0.0.1.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import http.server
import ipaddress
import json
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return _issue(tmp_path_factory.mktemp("pki"), HOSTS)


# ---------------------------------------------------------------------------------------------
# Upstream: a real HTTP/1.1 server (plain or TLS) that records what reaches it
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
    connections: int = 0
    bytes_in: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: object = None

    def mark(self) -> tuple[int, int, int]:
        with self.lock:
            return (self.connections, self.bytes_in, len(self.requests))

    def since(self, mark: tuple[int, int, int]) -> tuple[int, int, int]:
        now = self.mark()
        return (now[0] - mark[0], now[1] - mark[1], now[2] - mark[2])


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


def _handler(upstream: Upstream):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with upstream.lock:
                upstream.connections += 1
            self.rfile = _Counting(self.rfile, upstream)

        def log_message(self, *args):  # keep the test output quiet
            pass

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with upstream.lock:
                upstream.requests.append(Seen(self.command, self.path, list(self.headers.items()), body))
            path = self.path.split("?")[0]
            status, headers, out = 200, [("Content-Type", "application/json")], b""
            auth = self.headers.get("Authorization", "")
            if path.endswith("/echo"):
                token = auth.removeprefix("Bearer ").encode()
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
                headers += [("X-Egresslaw-Deny", "forged"), ("X-Egresslaw-Redirect", "followed")]
                out = b'{"forged": true}'
            else:
                out = json.dumps({"method": self.command, "path": self.path, "tls": upstream.tls}).encode()
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_HEAD = do_CONNECT = _handle

    return Handler


def start_upstream(pki: Pki | None) -> Upstream:
    upstream = Upstream(port=0, tls=pki is not None)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(upstream))
    server.daemon_threads = True
    if pki is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.cert_pem, pki.key_pem)
        context.set_alpn_protocols(["http/1.1"])
        server.socket = context.wrap_socket(server.socket, server_side=True)
    upstream.port = server.server_address[1]
    upstream.server = server
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return upstream


@pytest.fixture(scope="module")
def tls_upstream(pki) -> Upstream:
    upstream = start_upstream(pki)
    yield upstream
    upstream.server.shutdown()


@pytest.fixture(scope="module")
def http_upstream() -> Upstream:
    upstream = start_upstream(None)
    yield upstream
    upstream.server.shutdown()


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


def proof_for(artifact, verdict: str = "proved") -> str:
    results = [
        {"worker": "default", "subject": "connection:github", "property": p, "verdict": verdict, "time_ms": 1}
        for p in ("credential-scope", "header-safety", "no-redirect", "public-only")
    ]
    return json.dumps(
        {
            "format": "egresslaw.proof/1",
            "artifact_digest": artifact.digest,
            "z3_version": "test",
            "catalog": {"version": artifact.catalog.version, "special_purpose_date": artifact.catalog.special_purpose_date},
            "results": results,
        }
    )


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


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    return make_env(tmp_path_factory.mktemp("edge"))
