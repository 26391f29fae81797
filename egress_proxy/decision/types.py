"""The values that cross between the proxy adapter and the pure decision function (no mitmproxy here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class Lease:
    """A verified lease: who is asking, and the one profile or connection that applies (exactly one is set)."""

    subject: str
    profile: str | None
    connection: str | None
    exp: int  # unix seconds

    def __post_init__(self) -> None:
        if (self.profile is None) == (self.connection is None):
            raise ValueError("a lease names exactly one profile or one connection")


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the proxy saw it, before any normalization.

    `host`/`port` are the CONNECT target (tunnel) or the absolute-form URL's authority, never the
    Host header; `host_header` is the Host header (or HTTP/2 :authority) as sent, for the agreement check.
    """

    method: str
    scheme: Literal["http", "https"]
    host: str
    port: int
    target: str  # the request-target path with its query, as on the wire
    headers: tuple[tuple[str, str], ...] = ()
    host_header: str | None = None
    tunnel: bool = False  # arrived inside a CONNECT tunnel
    has_body: bool = False
    inner_port: int | None = None  # inside a tunnel: the port the request itself names (must be the tunnel's `port`)


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict. `allowed` starts false: every early return in `decide()` is a denial with a reason."""

    allowed: bool = False
    reason: str = "default-deny"
    rule: str | None = None
    host: str | None = None  # normalized host that was judged
    path: str | None = None  # normalized path that was judged (no query)
    forward_headers: tuple[tuple[str, str], ...] = ()  # caller headers that survive the allowlist
    inject_header: str | None = None  # the one header that receives the credential
    broker: str | None = None  # a profile's request: the connection whose credential it carries (brokered), else None
    detail: str | None = None  # human explanation (never a header value or secret)
    observed: str | None = None  # observe mode: admitted, but an enforced profile would deny it for this reason
    # Request shapes (docs/shapes.md): the protocol whose body the edge must hold (to `body_limit` bytes) and judge
    # with `adapter.judge_body` before anything goes upstream; None: no body to judge.
    body_shape: str | None = None
    body_limit: int | None = None
    # After `judge_body`: what the answer must go through (`bodies.ToolsFilter`: MCP `tools/list` results cut to the
    # rule's tools); None: the answer passes as the upstream sent it.
    answer_filter: object | None = None
    extra: dict[str, str] = field(default_factory=dict)
