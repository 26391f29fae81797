"""Loopback TLS stand-ins for the request-shape tests: an MCP server (the `mcp` SDK's FastMCP over Streamable HTTP,
served by uvicorn), a GraphQL server (graphql-core behind a small HTTP handler) and a git server (`git http-backend`
with `http.receivepack` on). Each serves one name of `tests.shapes.world.NAMES` with the shapes PKI and records
every request that reached it (its head, and its body as far as it arrived), so "the upstream saw no byte of a
refused request" is `server.since(mark) == []`.

The MCP stand-in serves, on one uvicorn listener:

  /json/mcp     FastMCP, stateful (Mcp-Session-Id, the GET stream, DELETE), answers as JSON (`json_response=True`)
  /sse/mcp      FastMCP, stateless, answers as SSE streams (`json_response=False`)
  /endless/mcp  a POSTed `tools/list` answered by an SSE stream that never ends: ENDLESS_BEFORE notifications, the
                answer (every tool, delete_repo too), then notifications until the client leaves
  /huge/mcp     a POSTed `tools/list` answered by an SSE stream whose second event is HUGE_EVENT bytes long

Tools (all three on every FastMCP endpoint): get_issue(repo, number), delete_repo(repo), search(q).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

import uvicorn
from graphql import build_schema, graphql_sync
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.clients.standins import QuietHandler, TlsServer, run_git_backend

TOOLS = ("delete_repo", "get_issue", "search")
ENDLESS_BEFORE = 3  # notifications the endless stream sends before its answer
NOTE_PAD = 4096  # bytes of padding in each notification of the endless stream
HUGE_EVENT = 2 * 1024 * 1024  # one SSE event over the edge's 1 MiB limit


@dataclass
class Received:
    """One request as it reached a stand-in: recorded when its head arrived, its body filled in as it came."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    complete: bool = False

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


@dataclass
class Recorder:
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, seen: Received) -> Received:
        with self.lock:
            self.requests.append(seen)
        return seen

    def mark(self) -> int:
        with self.lock:
            return len(self.requests)

    def since(self, mark: int) -> list[Received]:
        with self.lock:
            return list(self.requests[mark:])


def _server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["http/1.1"])
    return context


# ---------------------------------------------------------------------------------------------
# MCP: FastMCP over Streamable HTTP, uvicorn with TLS in a thread
# ---------------------------------------------------------------------------------------------


def _fastmcp(path: str, *, json_response: bool, stateless: bool) -> FastMCP:
    server = FastMCP("acme-tools", streamable_http_path=path, json_response=json_response, stateless_http=stateless,
                     log_level="WARNING", transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))

    @server.tool()
    def get_issue(repo: str, number: int) -> str:
        """An issue of a repository."""
        return f"issue {number} of {repo}: it works"

    @server.tool()
    def delete_repo(repo: str) -> str:
        """Delete a repository (the rule never admits it)."""
        return f"deleted {repo}"

    @server.tool()
    def search(q: str) -> str:
        """Search issues."""
        return f"results for {q}"

    return server


class _Recording:
    """ASGI middleware: every HTTP request is recorded the moment its head reaches the app, its body as it arrives."""

    def __init__(self, app, recorder: Recorder) -> None:
        self.app, self.recorder = app, recorder

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
        seen = self.recorder.add(Received(scope["method"], path, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]))

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                seen.body += message.get("body", b"")
                seen.complete = not message.get("more_body", False)
            return message

        return await self.app(scope, recording_receive, send)


def _sse(message: dict) -> bytes:
    return b"event: message\r\ndata: " + json.dumps(message).encode() + b"\r\n\r\n"


def _tools_result(request_id) -> dict:
    tools = [{"name": name, "description": name, "inputSchema": {"type": "object", "properties": {}}} for name in TOOLS]
    return {"jsonrpc": "2.0", "id": request_id, "result": {"tools": tools}}


def _note(n: int, pad: int = NOTE_PAD) -> dict:
    return {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": {"n": n, "pad": "p" * pad}}}


async def _endless(request: Request) -> StreamingResponse:
    ask = json.loads(await request.body())

    async def events():
        n = 0
        for n in range(ENDLESS_BEFORE):
            yield _sse(_note(n))
        yield _sse(_tools_result(ask.get("id")))
        while True:  # never ends: Starlette stops it when the client leaves
            n += 1
            yield _sse(_note(n))
            await asyncio.sleep(0)

    return StreamingResponse(events(), media_type="text/event-stream")


async def _huge(request: Request) -> StreamingResponse:
    ask = json.loads(await request.body())

    async def events():
        yield _sse(_note(0, pad=16))
        yield _sse(_note(1, pad=HUGE_EVENT))
        yield _sse(_tools_result(ask.get("id")))

    return StreamingResponse(events(), media_type="text/event-stream")


@dataclass
class McpServer:
    port: int
    recorder: Recorder
    server: uvicorn.Server
    thread: threading.Thread

    def mark(self) -> int:
        return self.recorder.mark()

    def since(self, mark: int) -> list[Received]:
        return self.recorder.since(mark)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_mcp(cert: Path, key: Path) -> McpServer:
    """FastMCP's Streamable HTTP apps (JSON and SSE answers) and the hostile SSE routes, on one TLS listener."""
    as_json = _fastmcp("/json/mcp", json_response=True, stateless=False)
    as_sse = _fastmcp("/sse/mcp", json_response=False, stateless=True)
    apps = (as_json.streamable_http_app(), as_sse.streamable_http_app())  # each makes its session manager

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async with as_json.session_manager.run(), as_sse.session_manager.run():
            yield

    routes = [*apps[0].routes, *apps[1].routes, Route("/endless/mcp", _endless, methods=["POST"]),
              Route("/huge/mcp", _huge, methods=["POST"])]
    recorder = Recorder()
    app = _Recording(Starlette(routes=routes, lifespan=lifespan), recorder)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, ssl_certfile=str(cert), ssl_keyfile=str(key), log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=2, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="mcp-standin")
    thread.start()
    deadline = 0
    while not server.started and thread.is_alive() and deadline < 600:  # started within 30 s (600 x 50 ms)
        threading.Event().wait(0.05)
        deadline += 1
    if not server.started:
        raise RuntimeError("the MCP stand-in did not start")
    return McpServer(sock.getsockname()[1], recorder, server, thread)


# ---------------------------------------------------------------------------------------------
# The GraphQL and git stand-ins: a recording handler and server (tests/clients/standins.py's QuietHandler, TlsServer)
# ---------------------------------------------------------------------------------------------


class _Handler(QuietHandler):
    recorder: Recorder

    def _read(self) -> Received:
        seen = self.recorder.add(Received(self.command, self.path, list(self.headers.items())))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                seen.body += self.rfile.read(size + 2)[:size]
        else:
            length = int(self.headers.get("Content-Length") or 0)
            seen.body = self.rfile.read(length) if length else b""
        seen.complete = True
        return seen


@dataclass
class HttpServer:
    port: int
    recorder: Recorder
    server: TlsServer
    root: Path | None = None

    def mark(self) -> int:
        return self.recorder.mark()

    def since(self, mark: int) -> list[Received]:
        return self.recorder.since(mark)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _serve(handler: type[_Handler], cert: Path, key: Path, recorder: Recorder, name: str) -> tuple[TlsServer, int]:
    handler.recorder = recorder
    server = TlsServer(handler, _server_context(cert, key))
    threading.Thread(target=server.serve_forever, daemon=True, name=name).start()
    return server, server.server_address[1]


# ---------------------------------------------------------------------------------------------
# GraphQL: graphql-core executes what reaches it (POST JSON, GET ?query=)
# ---------------------------------------------------------------------------------------------

SCHEMA = build_schema("""
type Query { repository(name: String!): Repository  viewer: User }
type Mutation { deleteRepository(name: String!): Boolean }
type Repository { name: String!  private: Boolean! }
type User { login: String! }
""")
DELETED: list[str] = []  # what deleteRepository was asked to delete (only ever through a refused request: stays empty)


class _Root:
    def repository(self, _info, name: str) -> dict:
        return {"name": name, "private": True}

    def viewer(self, _info) -> dict:
        return {"login": "acme-bot"}

    def deleteRepository(self, _info, name: str) -> bool:  # noqa: N802 (the schema's field name)
        DELETED.append(name)
        return True


def _execute(query: str, variables: dict | None = None, operation: str | None = None) -> dict:
    result = graphql_sync(SCHEMA, query, root_value=_Root(), variable_values=variables, operation_name=operation)
    out: dict = {"data": result.data}
    if result.errors:
        out["errors"] = [{"message": e.message} for e in result.errors]
    return out


class _GraphQLHandler(_Handler):
    def do_POST(self):
        seen = self._read()
        try:
            doc = json.loads(seen.body)
        except ValueError:
            return self._send(400, b'{"errors": [{"message": "not JSON"}]}')
        if isinstance(doc, list):
            out = [_execute(d.get("query", ""), d.get("variables"), d.get("operationName")) for d in doc]
        else:
            out = _execute(doc.get("query", ""), doc.get("variables"), doc.get("operationName"))
        self._send(200, json.dumps(out).encode())

    def do_GET(self):
        self._read()
        query = parse_qs(self.path.partition("?")[2])
        self._send(200, json.dumps(_execute(query.get("query", [""])[0], None, query.get("operationName", [None])[0])).encode())


def start_graphql(cert: Path, key: Path) -> HttpServer:
    recorder = Recorder()
    handler = type("GraphQLHandler", (_GraphQLHandler,), {})
    server, port = _serve(handler, cert, key, recorder, "graphql-standin")
    return HttpServer(port, recorder, server)


# ---------------------------------------------------------------------------------------------
# git: `git http-backend`, pushes on, the credential demanded
# ---------------------------------------------------------------------------------------------

GIT_REPO = "acme/app.git"


def git_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_TERMINAL_PROMPT": "0"}


def make_bare_repo(root: Path) -> Path:
    """`acme/app.git` under `root/git` (one commit on main, pushes admitted); the project root returned."""
    env = git_env(root / "home")
    (root / "home").mkdir(parents=True, exist_ok=True)
    work, bare = root / "seed", root / "git" / GIT_REPO
    work.mkdir(parents=True)
    (work / "README.md").write_text("the upstream's main\n")
    for cmd in (["git", "init", "-q", "-b", "main", str(work)], ["git", "-C", str(work), "add", "README.md"],
                ["git", "-C", str(work), "commit", "-q", "-m", "first"], ["git", "clone", "-q", "--bare", str(work), str(bare)],
                ["git", "-C", str(bare), "config", "http.receivepack", "true"]):
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)
    return root / "git"


def start_git(cert: Path, key: Path, root: Path, auth: str) -> HttpServer:
    """`git http-backend` over `make_bare_repo(root)`; a request without exactly `auth` as its Authorization gets 401."""
    git_root = make_bare_repo(root)

    class Handler(_Handler):
        def _git(self):
            seen = self._read()
            if self.headers.get("Authorization") != auth:
                return self._send(401, b"Authentication required\n", "text/plain", (("WWW-Authenticate", 'Basic realm="git"'),))
            path, _, query = self.path.partition("?")
            return self._send(*run_git_backend(self, git_root, path, query, seen.body))

        do_GET = do_POST = _git

    recorder = Recorder()
    server, port = _serve(Handler, cert, key, recorder, "git-standin")
    return HttpServer(port, recorder, server, git_root)


def ref(git_root: Path, name: str) -> str | None:
    """The id `name` points at in the upstream repository (None: no such ref)."""
    done = subprocess.run(["git", "-C", str(git_root / GIT_REPO), "rev-parse", "--verify", "-q", name], capture_output=True, text=True,
                          timeout=30, env=git_env(git_root.parent / "home"))
    return done.stdout.strip() or None
