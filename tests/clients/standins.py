"""Local TLS stand-ins for the public services real clients talk to, served under the real names.

One threaded HTTPS server on 127.0.0.1 with one certificate (from a test CA) for every name below; it
answers by the `Host` header:

  pypi.org                 a PEP 503 simple index: /simple/egresslaw-demo/ links to the wheel
  files.pythonhosted.org   the wheel the stand-in built (a pure-Python py3-none-any wheel)
  registry.npmjs.org       packuments and tarballs for `el-demo-plain` and `@acme/el-demo-scoped` (which
                           depends on the plain one), packed with `npm pack`; the audit endpoints answer `{}`
  registry.yarnpkg.com     the same registry (yarn 1's default): packuments as the npm registry has them,
                           tarball URLs on registry.npmjs.org, which yarn 1 rewrites to its own registry
  github.com               `git http-backend` (CGI) serving acme/demo.git, a one-commit repository, and
                           acme/private.git, which answers 401 unless the request carries the credential given
                           to `start(git_auth=…)` (the exact `Authorization` value, Basic or Bearer)
  api.github.com           an echo: the request's Authorization, plain and base64, in the body and a header

The proxy reaches it through test routing: `--resolve NAME=<public-looking address>` (never dialled)
and `--connect-to NAME:443:127.0.0.1:<port>`, with `--upstream-ca` = this CA. Every request is
recorded (host, method, path, headers) so tests can say what reached the "internet".

`python -m tests.clients.standins DIR [--git-auth FILE]` builds everything in DIR, prints one JSON line
(port, CA, routing options), and serves until killed (examples/clients-demo.sh uses it).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

NAMES = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "github.com", "api.github.com", "registry.yarnpkg.com")
# Public-looking answers for --resolve: judged like real ones by the proxy, never dialled (--connect-to wins).
PUBLIC = {name: f"93.184.216.{60 + i}" for i, name in enumerate(NAMES)}
WHEEL_NAME = "egresslaw-demo"
WHEEL_FILE = "egresslaw_demo-1.0.0-py3-none-any.whl"
WHEEL_VALUE = "installed through the egress proxy"
NPM_PLAIN = "el-demo-plain"
NPM_SCOPED = "@acme/el-demo-scoped"
GIT_REPO = "acme/demo.git"
GIT_FILE = "README.md"
GIT_TEXT = "cloned through the egress proxy\n"
GIT_PRIVATE = "acme/private.git"
GIT_PRIVATE_TEXT = "a private repository, cloned with a brokered credential the sandbox never held\n"


@dataclass
class Hit:
    host: str
    method: str
    path: str
    headers: list[tuple[str, str]]

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


@dataclass
class StandIns:
    root: Path
    ca_pem: Path
    port: int = 0
    hits: list[Hit] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    npm: dict[str, dict] = field(default_factory=dict)  # package name -> {"file", "bytes", "deps"}
    server: object = None
    git_auth: str | None = None  # the `Authorization` value acme/private.git requires (None: it refuses everyone)

    def connect_to(self) -> list[str]:
        return [f"{name}:443:127.0.0.1:{self.port}" for name in NAMES]

    def resolve(self) -> list[str]:
        return [f"{name}={ip}" for name, ip in PUBLIC.items()]

    def requests_to(self, host: str) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if h.host == host]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------------
# What the stand-ins serve, built once
# ---------------------------------------------------------------------------------------------


def build_wheel(directory: Path) -> Path:
    """A pure-Python wheel (PEP 427) built by hand: one module, METADATA, WHEEL and a RECORD with hashes."""
    files = {
        "egresslaw_demo/__init__.py": f"VALUE = {WHEEL_VALUE!r}\n".encode(),
        "egresslaw_demo-1.0.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {WHEEL_NAME}\nVersion: 1.0.0\nSummary: a test wheel\n".encode(),
        "egresslaw_demo-1.0.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: egresslaw-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}" for name, data in files.items()]
    files["egresslaw_demo-1.0.0.dist-info/RECORD"] = ("\n".join([*record, "egresslaw_demo-1.0.0.dist-info/RECORD,,"]) + "\n").encode()
    path = directory / WHEEL_FILE
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def _tool_env(home: Path) -> dict[str, str]:
    """A clean environment for the tools that build the fixtures (no proxy, a throwaway HOME and npm cache)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "npm_config_cache": str(home / ".npm"), "npm_config_update_notifier": "false"}


def pack_npm(directory: Path) -> dict[str, dict]:
    """Two packages packed with `npm pack`: a plain one and a scoped one that depends on it."""
    out: dict[str, dict] = {}
    env = _tool_env(directory / "home")
    for name, deps in ((NPM_PLAIN, {}), (NPM_SCOPED, {NPM_PLAIN: "^1.0.0"})):
        src = directory / "src" / name.replace("/", "__")
        src.mkdir(parents=True)
        (src / "package.json").write_text(json.dumps({"name": name, "version": "1.0.0", "main": "index.js", "license": "MIT", "dependencies": deps}))
        (src / "index.js").write_text(f"module.exports = {json.dumps(name + ' through the egress proxy')};\n")
        result = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(directory)], cwd=src, env=env, capture_output=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"npm pack failed: {result.stderr.decode(errors='replace')[-500:]}")
        filename = json.loads(result.stdout)[0]["filename"]
        data = (directory / filename).read_bytes()
        out[name] = {"file": filename, "bytes": data, "deps": deps}
    return out


def make_git_repo(directory: Path) -> Path:
    """Bare repositories `acme/demo.git` and `acme/private.git`, one commit each, for `git http-backend` (project
    root returned)."""
    root = directory / "git"
    env = {**_tool_env(directory / "home"), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_NOSYSTEM": "1"}
    for repo, text in ((GIT_REPO, GIT_TEXT), (GIT_PRIVATE, GIT_PRIVATE_TEXT)):
        work = directory / "git-work" / repo
        work.mkdir(parents=True)
        (work / GIT_FILE).write_text(text)
        for cmd in (["git", "init", "-q", "-b", "main", str(work)], ["git", "-C", str(work), "add", GIT_FILE],
                    ["git", "-C", str(work), "commit", "-q", "-m", "first"],
                    ["git", "clone", "-q", "--bare", str(work), str(root / repo)]):
            subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)
    return root


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _git_http_backend() -> Path:
    return Path(subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True).stdout.strip()) / "git-http-backend"


def run_git_backend(handler: http.server.BaseHTTPRequestHandler, git_root: Path, path: str, query: str,
                    body: bytes) -> tuple[int, bytes, str, tuple[tuple[str, str], ...]]:
    """Answer one smart-HTTP request with `git http-backend` (CGI) over the repositories under `git_root`: the
    request line and headers come from `handler`, `body` is the request body already read (de-chunked). Returns
    (status, payload, content type, other headers), the arguments of the handlers' `_send`."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": str(git_root), "GIT_HTTP_EXPORT_ALL": "1",
        "REQUEST_METHOD": handler.command, "PATH_INFO": unquote(path), "QUERY_STRING": query,
        "CONTENT_TYPE": handler.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
        "REMOTE_ADDR": "127.0.0.1", "GIT_PROTOCOL": handler.headers.get("Git-Protocol", ""),
        "HTTP_CONTENT_ENCODING": handler.headers.get("Content-Encoding", ""), "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(git_root),
    }
    result = subprocess.run([str(_git_http_backend())], check=False, input=body, env=env, capture_output=True, timeout=60)
    head, sep, payload = result.stdout.partition(b"\r\n\r\n")
    if not sep:
        head, _, payload = result.stdout.partition(b"\n\n")
    status, headers = 200, []
    for line in head.decode("latin-1").splitlines():
        key, _, value = line.partition(":")
        if key.lower() == "status":
            status = int(value.strip().split()[0])
        elif key:
            headers.append((key.strip(), value.strip()))
    ctype = next((v for k, v in headers if k.lower() == "content-type"), "application/octet-stream")
    return status, payload, ctype, tuple((k, v) for k, v in headers if k.lower() not in ("content-type", "content-length"))


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive, no log lines; `_send` answers with a whole body (none to HEAD) of a Content-Length."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json", extra: tuple = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _handler(s: StandIns, git_root: Path, wheel: bytes):
    wheel_sha = hashlib.sha256(wheel).hexdigest()

    class Handler(QuietHandler):
        def setup(self):
            self.request.settimeout(30)
            super().setup()

        def _handle(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].lower()
            with s.lock:
                s.hits.append(Hit(host, self.command, self.path, list(self.headers.items())))
            path, _, query = self.path.partition("?")
            if host == "pypi.org":
                return self._pypi(path)
            if host == "files.pythonhosted.org":
                if path == f"/packages/ab/cd/{WHEEL_FILE}":
                    return self._send(200, wheel, "application/octet-stream")
                return self._send(404, b"{}")
            if host in ("registry.npmjs.org", "registry.yarnpkg.com"):
                return self._npm(path)
            if host == "github.com":
                return self._git(path, query, body)
            if host == "api.github.com":
                auth = self.headers.get("Authorization", "")
                token = auth.removeprefix("Bearer ").encode()
                echo = {"path": self.path, "authorization": auth, "b64": base64.b64encode(token).decode()}
                return self._send(200, json.dumps(echo).encode(), extra=(("X-Echo-Auth", auth),))
            return self._send(421, b'{"error": "misdirected"}')

        def _pypi(self, path: str):
            if path.rstrip("/") == f"/simple/{WHEEL_NAME}":
                link = f'<a href="https://files.pythonhosted.org/packages/ab/cd/{WHEEL_FILE}#sha256={wheel_sha}">{WHEEL_FILE}</a>'
                page = f"<!DOCTYPE html><html><body>{link}</body></html>".encode()
                return self._send(200, page, "text/html")
            return self._send(404, b"not found", "text/plain")

        def _npm(self, path: str):
            if path.startswith("/-/npm/v1/security/"):
                return self._send(200, b"{}")
            name = unquote(path.lstrip("/"))
            if name in s.npm:
                meta = s.npm[name]
                data = meta["bytes"]
                base = name.rsplit("/", 1)[-1]
                version = {
                    "name": name, "version": "1.0.0", "dependencies": meta["deps"],
                    "dist": {
                        "tarball": f"https://registry.npmjs.org/{name}/-/{base}-1.0.0.tgz",
                        "shasum": hashlib.sha1(data).hexdigest(),
                        "integrity": "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode(),
                    },
                }
                doc = {"name": name, "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": version}}
                return self._send(200, json.dumps(doc).encode())
            for name, meta in s.npm.items():
                if path == f"/{name}/-/{name.rsplit('/', 1)[-1]}-1.0.0.tgz":
                    return self._send(200, meta["bytes"], "application/octet-stream")
            return self._send(404, b'{"error": "not found"}')

        def _git(self, path: str, query: str, body: bytes):
            if path.startswith(f"/{GIT_PRIVATE}/") and (s.git_auth is None or self.headers.get("Authorization") != s.git_auth):
                return self._send(401, b"Authentication required\n", "text/plain", (("WWW-Authenticate", 'Basic realm="GitHub"'),))
            return self._send(*run_git_backend(self, git_root, path, query, body))

        do_GET = do_POST = do_HEAD = do_PUT = _handle

    return Handler


class TlsServer(http.server.ThreadingHTTPServer):
    """A threaded HTTPS server on 127.0.0.1 (an ephemeral port): each connection's TLS handshake on its own thread,
    with TCP_NODELAY; failed handshakes and resets are not reported."""

    daemon_threads = True

    def __init__(self, handler, context: ssl.SSLContext) -> None:
        self.context = context
        super().__init__(("127.0.0.1", 0), handler)

    def get_request(self):
        sock, addr = self.socket.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def finish_request(self, request, client_address):
        try:
            request.settimeout(30)
            request.do_handshake()
        except (OSError, ssl.SSLError):
            return
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass


def start(root: Path, git_auth: str | None = None) -> StandIns:
    """Build the fixtures in `root` (wheel, npm tarballs, git repositories, PKI) and start the server; `git_auth`: the
    exact `Authorization` value acme/private.git requires."""
    from tests.proxy_harness import _issue

    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    pki = _issue(root / "pki", NAMES)
    s = StandIns(root=root, ca_pem=pki.ca_pem, git_auth=git_auth)
    wheel = build_wheel(root).read_bytes()
    s.npm = pack_npm(root / "npm")
    git_root = make_git_repo(root)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert_pem, pki.key_pem)
    context.set_alpn_protocols(["http/1.1"])
    server = TlsServer(_handler(s, git_root, wheel), context)
    s.server, s.port = server, server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True, name="standins").start()
    return s


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--git-auth"):
        print("usage: python -m tests.clients.standins DIR [--git-auth FILE]  (FILE: the Authorization value acme/private.git requires)",
              file=sys.stderr)
        return 2
    root = Path(argv[0])
    git_auth = Path(argv[2]).read_text().strip() if len(argv) == 3 else None
    if root.exists():
        shutil.rmtree(root)
    s = start(root, git_auth)
    print(json.dumps({"port": s.port, "ca": str(s.ca_pem), "resolve": s.resolve(), "connect_to": s.connect_to()}), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
