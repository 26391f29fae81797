"""Per-flow and per-connection state of the edge, and the small readings of a flow every part of it shares.

`Client` is everything the edge keeps about one client connection (its tunnel, the lease it is bound to, its
refusal, its vetted answers and pins), one record from `client_connected` to `client_disconnected`; `Tunnel` is a
CONNECT the decision admitted (its name, port, lease and vetted answers); `FlowState` is one request's or CONNECT's
life in the addon (decision, lease, audit ticket, bytes, the injected credential's encodings for the response scan);
the functions read a mitmproxy flow (does a body follow, which framing goes upstream, whose credential it carries).
No secret is ever in a record's repr or in flow metadata.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mitmproxy import http

from egress_proxy.custody.records import Address
from egress_proxy.decision.answers import printable  # noqa: F401  (re-exported: the edge's modules import it from here)
from egress_proxy.decision.types import Decision, Lease
from egress_proxy.edge.denials import denial
from egress_proxy.edge.limits import (
    declared_length,
)
from egress_proxy.edge.scanner import (
    Needles,
)
from egress_proxy.front.startup import Policy

log = logging.getLogger("egresslaw.proxy")


AUDITED = "egresslaw.audited"


@dataclass(slots=True)
class Tunnel:
    host: str
    port: int
    lease: Lease
    ips: tuple[str, ...]
    refused: str | None = None  # a reason found at the TLS client hello


@dataclass(slots=True)
class Client:
    """One client connection, all the edge keeps of it: made at `client_connected` (or by the first hook that needs
    it), forgotten with one pop at `client_disconnected`. `vetted` and `pins` are keyed by the (host, port) judged."""

    id: str
    peername: Any = None  # set once the connection is accepted: a refusal mitmproxy only logs names it by peername
    counted: bool = False  # egresslaw_open_connections counts it
    tunnel: Tunnel | None = None  # the CONNECT it made, once admitted
    bound: tuple[str, str | None, str | None] | None = None  # the lease identity (`identity`) its first lease bound
    refused: str | None = None  # refused for good: every later request, handshake and dial gets this reason
    vetted: dict[tuple[str, int], tuple[str, ...]] = field(default_factory=dict)  # the first vetted answers per name
    pins: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)  # the address a dial to a name must use
    dialing: dict[str, tuple[str, int]] = field(default_factory=dict)  # server id -> the name its pinned dial restores


@dataclass(slots=True)
class FlowState:
    started: float
    flow: Any = None
    policy: Policy | None = None
    lease: Lease | None = None
    host: str | None = None
    port: int | None = None
    path: str | None = None
    decision: Decision | None = None
    reason: str | None = None
    denied: bool = False
    tunnel: bool = False
    redactions: int = 0
    streamed: int = 0  # body bytes the client was sent (decoded and redacted for connection traffic)
    auth: str | None = None  # the Proxy-Authorization scheme offered (none|bearer|basic|other), never its value
    uploaded: int = 0  # bytes of a streamed request body
    streaming: bool = False  # the request body goes upstream as it arrives (head sent after requestheaders)
    buffered: bool = False  # an HTTP/2 body without content-length: held (to its limit) and framed in `request`
    failed: bool = False  # a response-side hook failed: the response is replaced by a denial
    audit_ticket: int | None = None  # set once the allow decision event is queued: from then on only an outcome follows
    client_status: int | None = None  # the status the client got, when no flow.response says it
    # What the client got, once known (the audit's status), and what failed on the response side.
    status: int | None = None
    answered: bool = False  # `status` and `streamed` are final
    head_sent: bool = False  # the response head went out before the body (streaming)
    head_scanned: bool = False
    failure: str | None = None  # what went wrong after an allow (a reason code: the outcome event's `failure`)
    aborted: bool = False  # the client got a head and a cut body
    error_code: Any = None  # mitmproxy's ErrorCode of a protocol error on this flow's stream
    error_to_client: bool = False  # mitmproxy answers that error to the client (our JSON, egress_proxy.edge.layers)
    needles: Needles | None = None  # the credential's encodings, prepared once for this response
    injected: tuple[bytes, ...] = field(default=(), repr=False)  # the encodings of the credential this flow carries
    signing: Any = None  # (Attached, the client's payload mode): a signature still to write, once the body is whole
    attached: Any = None  # what the flow's credential attached (a minted token the upstream may refuse: 401)
    address: Any = None  # its custody address
    provider_status: int | None = None  # a refused mint: the token endpoint's status (the denial names it)
    cause: str | None = None  # a refused mint or signature: the class of problem (CredentialError.cause; the denial names it)
    # Request shapes (docs/shapes.md): the request as decided, while its body waits to be judged whole in `request`
    # (`adapter.judge_body`; its decision event is written ahead only then), and where a shape's denial names the place.
    judging: Any = None  # decision.types.Request, or None: no body to judge (or judged)
    detail: str | None = None  # a shape's denial: the rule and the place; a budget's: the cap (the denial event's `detail`)
    budget: Any = None  # budget-exceeded: the front.budget.Charged cap with no room (the event's `budget`)
    retry_after: int | None = None  # budget-exceeded: seconds to the end of its window (the answer's Retry-After)


# -- what the addon's mixin takes from it --------------------------------------------------------------------
#
# `events.AuditTrail` is mixed into `addon.EgressLaw` and uses its state and helpers through `self`. Everything it
# takes from the class it is mixed into is declared below: tests/egress_proxy/edge/test_flows.py reads its source and
# holds it to exactly this list, and holds `EgressLaw` to providing every name on it. (The collaborators, `gate`,
# `upstreams`, `binding`, `attach`, `requests` and `responses`, are given what they take at construction instead:
# the same test holds each to reading through `self` only what it was given or made.)


@runtime_checkable
class AuditHost(Protocol):
    """What `AuditTrail` (the decision and closing events, the metrics) takes from its host."""

    _flows: dict[str, FlowState]  # popped by the closing event: the flow is forgotten with it
    audit: Any  # audit.log.AuditLog | None
    policy: Policy | None  # the artifact every event names
    test_routing: dict[str, Any]  # what every event says of test routing in force
    draining_since: float | None  # an allow that arrived after it is refused `draining`
    metrics: Any  # run.metrics.Metrics | None
    limits: Any  # edge.limits.Limits: an HTTP/2 flow's meter (the bytes its client was framed)

    def _now(self) -> float: ...


def deny(flow: http.HTTPFlow, state: FlowState, reason: str, decision: Decision | None = None) -> None:
    """Answer `flow` with our own response (403, or 407 for lease problems; `edge.denials`): nothing goes upstream, and
    its state records the denial (and no credential encodings: nothing was injected)."""
    state.denied = True
    state.reason = reason
    if decision is not None:
        state.decision = decision
    flow.response = denial(reason, state.provider_status, state.cause, detail=state.detail if state.budget is not None else None,
                           retry_after=state.retry_after)
    state.injected = ()


def tunnel_of(clients: Mapping[str, Client], cid: str | None) -> Tunnel | None:
    """The tunnel client connection `cid` made, if any (no record is made for it)."""
    record = clients.get(cid) if cid is not None else None
    return record.tunnel if record is not None else None


@functools.lru_cache(maxsize=1024)
def ip_of(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an IP address (None if it is not one), memoized: the same few addresses are checked on every request."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def log_internal(what: str) -> None:
    """Log an unexpected exception by type and location only: messages may carry header values or input."""
    import sys
    import traceback

    exc = sys.exc_info()[1]
    where = ""
    if exc is not None and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" at {Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    log.error("%s (%s%s)", what, exc.__class__.__name__ if exc is not None else "unknown", where)


def has_body(req: http.Request, ended: bool | None = None) -> bool:
    """Does a body follow the head? Framing headers say so in HTTP/1; in HTTP/2 a head that did not end its stream
    (HEADERS without END_STREAM: DATA frames or trailers follow, content-length or not) counts as a body too.
    `ended` is what the HTTP layer saw (None: unknown, taken as a body for HTTP/2)."""
    cl = req.headers.get("content-length")
    if req.headers.get("transfer-encoding"):
        return True
    try:
        if cl is not None and int(cl) > 0:
            return True
    except ValueError:
        return True
    if req.is_http2 or req.is_http3:
        return ended is not True
    return False


def upstream_framing(req: http.Request, has_body: bool) -> list[tuple[bytes, bytes]]:
    """The framing headers of the head sent upstream: the declared length, HTTP/1 chunking (re-chunked by
    mitmproxy as the body streams), `content-length: 0` for a bodyless POST/PUT/PATCH; none for an HTTP/2 body
    without content-length (held and framed in `request`)."""
    if not has_body:
        return [(b"content-length", b"0")] if req.method in ("POST", "PUT", "PATCH") else []
    length = declared_length(req)
    if length is not None:
        return [(b"content-length", str(length).encode("ascii"))]
    chunked = req.headers.get("transfer-encoding")
    return [(b"transfer-encoding", chunked.encode("ascii", "replace"))] if chunked else []


def upstream_subject(lease: Lease, carrier: str | None = None) -> tuple:
    """Who an upstream connection served, and whose credential it carried (a brokered request's differs from its
    profile's plain traffic, so such an upstream connection is never reused for the other)."""
    return (lease.subject, lease.connection, lease.profile, carrier)


def carrier_of(lease: Lease, decision: Decision | None) -> str | None:
    """The connection whose credential this flow carries: the lease's, or the one a profile's request is brokered to."""
    if lease.connection is not None:
        return lease.connection
    return decision.broker if decision is not None and decision.allowed else None


def authority(host: str, port: int, scheme: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    default = 443 if scheme == "https" else 80
    return shown if port == default else f"{shown}:{port}"


@functools.lru_cache(maxsize=1024)
def custody_address(workspace: str, connection: str, handle: str) -> Any:
    """The custody Address of a connection's credential, built (and its names checked) once."""
    return Address(workspace, connection, handle)


def identity(lease: Lease) -> tuple[str, str | None, str | None]:
    """What binds a client connection: who, and the one profile or connection (a re-minted lease of the same is the same)."""
    return (lease.subject, lease.profile, lease.connection)

