"""The request-shape tests' world: one artifact (the harness's policy plus one shaped rule per protocol, so the prover
runs once for every module), a PKI for the stand-ins' names, and the real edge in front of them with test routing.

Names resolve (scripted resolver) to public-looking addresses that are never dialled; `--connect-to` sends each to its
stand-in on 127.0.0.1. The credential is the harness's canary (connection `github`, `Authorization: Bearer …`).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from compiler.artifact import GraphQL, Git, Mcp, Param, Rule, Tool, Value
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    CANARY,
    Pki,
    RunningProxy,
    ScriptedResolver,
    _issue,
    build_artifact,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
    wait_for,
)

MCP = "mcp.acme-test.dev"
GRAPHQL = "graphql.acme-test.dev"
GIT = "git.acme-test.dev"
NAMES = (MCP, GRAPHQL, GIT)
PUBLIC = {MCP: "93.184.216.81", GRAPHQL: "93.184.216.82", GIT: "93.184.216.83"}
BEARER = f"Bearer {CANARY}"  # what the edge attaches (the harness's `github` connection)
MCP_METHODS = ("initialize", "notifications/initialized", "ping", "tools/call", "tools/list")
ALLOWED_TOOLS = ("get_issue", "search")


def shape_rules() -> tuple[Rule, ...]:
    """The shaped rules the tests enforce (docs/shapes.md's examples, on the stand-ins' names)."""
    get_issue = Tool(
        name="get_issue",
        arguments=(Param(name="number", value=Value(type="integer", minimum=1, maximum=1000)),
                   Param(name="repo", value=Value(enum=("acme/app",)))),
        required=("number", "repo"),
    )
    search = Tool(name="search", arguments=(Param(name="q", value=Value(pattern="[a-z ]+", max_length=20)),))
    mcp = b.rule("mcp", MCP, "/", ["DELETE", "GET", "POST"],
                 ["accept", "content-type", "mcp-session-id", "mcp-protocol-version", "last-event-id"])
    graphql = b.rule("graphql", GRAPHQL, "/graphql", ["GET", "POST"], ["accept", "content-type"])
    git = b.rule("push", GIT, "/acme/app.git", ["GET", "POST"], ["accept", "content-type", "git-protocol"])
    return (
        mcp.model_copy(update={"mcp": Mcp(methods=MCP_METHODS, tools=(get_issue, search))}),
        graphql.model_copy(update={"graphql": GraphQL(query=("repository", "viewer"))}),
        git.model_copy(update={"git": Git(fetch=True, push=("refs/heads/agent/*",), create=True, delete=False)}),
    )


def shapes_artifact(*names: str):
    """The harness's artifact plus the shaped rules named (all of them when none is named)."""
    return build_artifact(extra_rules=tuple(r for r in shape_rules() if not names or r.name in names))


def shapes_pki(root: Path) -> Pki:
    """A test CA and one certificate for every stand-in name (the harness's own issuer)."""
    return _issue(root, NAMES)


class ShapesProxy(RunningProxy):
    """The harness's running edge plus the clients these tests drive it with."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def lease_url(self) -> str:
        """The proxy URL with a `github` connection lease as its password (Basic proxy credentials: git, requests)."""
        return f"http://agent:{self.lease(connection='github')}@{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def _hooks(self) -> dict:
        return {"response": [lambda r: self.record(repr((r.status_code, list(r.headers.items()))).encode())]}

    def client(self, **kw) -> httpx.Client:
        """httpx through the edge with a connection lease; every answer's head kept for the leak scan."""
        proxy = httpx.Proxy(self.url, headers={"Proxy-Authorization": f"Bearer {self.lease(connection='github')}"})
        return httpx.Client(proxy=proxy, verify=self.ssl_context(), trust_env=False, timeout=30, event_hooks=self._hooks(), **kw)

    def async_client(self, **kw) -> httpx.AsyncClient:
        proxy = httpx.Proxy(self.url, headers={"Proxy-Authorization": f"Bearer {self.lease(connection='github')}"})

        async def keep(r: httpx.Response) -> None:
            self.record(repr((r.status_code, list(r.headers.items()))).encode())
            if r.status_code >= 400:
                # A refusal's body is read here, while its stream is open: the SDK's transport raises and closes the
                # stream without reading it, and the tests read the body of the response the SDK raised with.
                self.record(await r.aread())

        return httpx.AsyncClient(proxy=proxy, verify=self.ssl_context(), trust_env=False,
                                 timeout=httpx.Timeout(30, read=60), event_hooks={"response": [keep]}, **kw)

    def decisions(self, mark) -> list[dict]:
        """The `request` events since `mark`."""
        return [e for e in self.new_events(mark) if e["kind"] == "request"]

    def refused(self, mark, reason: str, timeout: float = 30.0) -> dict:
        """The one denial since `mark`, for `reason` (waits for it; fails on none, on another denial, or on two)."""
        wait_for(lambda: any(e["reason"] == reason for e in self.decisions(mark)), timeout)
        denials = [e for e in self.decisions(mark) if e["decision"] == "deny"]
        assert [e["reason"] for e in denials] == [reason], denials
        return denials[0]


def assert_denied_answer(status: int, headers, body: bytes, reason: str) -> None:
    """The edge's own refusal: 4xx, `X-Egresslaw-Deny: reason`, a JSON body naming it."""
    pairs = headers.items() if hasattr(headers, "items") else headers
    lowered = {k.lower(): v for k, v in pairs}
    assert 400 <= status < 500, (status, body[:500])
    assert lowered.get("x-egresslaw-deny") == reason, (status, lowered, body[:500])
    answer = json.loads(body)
    assert answer["error"] == "egress_denied" and answer["reason"] == reason, answer


@dataclass
class World:
    root: Path
    pki: Pki
    proxy: ShapesProxy


def start_world(root: Path, pki: Pki, routes: dict[str, int], rules: tuple[str, ...] = (), config: dict | None = None) -> World:
    """Keys, custody (the canary), the shapes artifact with `rules` (all when empty) and its proof, and the edge with
    `routes` (name -> local port), trusting `pki`'s CA upstream. Each module proves only the rules it uses, so a
    protocol the prover cannot take yet fails its own module only."""
    env = make_env(root / "edge", artifact=shapes_artifact(*rules))
    connect_to = [f"{name}:443:127.0.0.1:{port}" for name, port in routes.items()]
    resolver = ScriptedResolver({name: [[ip]] for name, ip in PUBLIC.items()})
    proxy = start_proxy(env, pki, (), connect_to, resolver=resolver, listen=free_port(), proxy_class=ShapesProxy, config=config)
    return World(root, pki, proxy)


def close_world(world: World) -> None:
    stop_proxy(world.proxy)
    world.proxy.assert_nothing_leaked()


@contextlib.contextmanager
def serving(root: Path, name: str, start_server, rules: tuple[str, ...], config: dict | None = None) -> Iterator[World]:
    """A module's world: the stand-in `start_server(cert_pem, key_pem)` starts (its certificate from a PKI made in `root`
    for every stand-in name) as `world.server`, and the edge (`start_world`: `rules`, `config`) routing `name` to it. On
    leaving: the edge stops and must have leaked nothing, then the stand-in stops."""
    pki = shapes_pki(root / "pki")
    server = start_server(pki.cert_pem, pki.key_pem)
    world = start_world(root, pki, {name: server.port}, rules=rules, config=config)
    world.server = server
    yield world
    try:
        close_world(world)
    finally:
        server.stop()


def settle(servers, quiet: float = 0.5, timeout: float = 15.0) -> None:
    """Until no stand-in has seen a new request for `quiet` seconds: a refused request that slipped through would
    land late (a lower bound on what arrived, never the behaviour under test)."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        now = [s.mark() for s in servers]
        if now == last:
            return
        last = now
        time.sleep(quiet)
