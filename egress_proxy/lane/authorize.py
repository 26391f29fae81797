"""The authorizer Envoy asks, once per CONNECT and once per plain-HTTP request, before anything goes upstream.

The front listener's Lua filter POSTs the request's header fields (pseudo-headers included, one `name: value` per
line) to `/check` on a Unix socket in the lane's private run directory. The answer is the decision of the same code
the mitmproxy edge runs and the prover proves:

1. the admission both front ends share (`egress_proxy.front.admit`): the lease, its subject, a subject the lane
   serves (a lease for a connection, or for a profile the lane leaves to the edge, is refused `lane-not-served`),
   the decision before any lookup, the name's answers from the lane's resolver (the same the DNS front gives Envoy),
   every answer judged, then the budget (docs/budget.md): the request charged to `ledger` (the lane's `--budget-store`,
   shared with the edge when they name one), refused as the edge refuses it: 429 `budget-exceeded` with `Retry-After`
   and the cap's `detail` in the body and the event (with `budget`), 411 `budget-length-required`, 503
   `budget-unavailable`;
2. the decision event written to the chained audit log (an allow waits for it, as on the edge: nothing is
   forwarded unaudited), then `200` with `x-egresslaw-lane-profile`, or the refusal with its reason.

An admitted CONNECT is recorded as a tunnel (`egress_proxy.lane.tunnels`). Each request inside it comes from the
inner listener's Lua filter with the tunnel's id (`TUNNEL_HEADER`, from the filter state Envoy carried across) and
is admitted as the edge admits a request in a tunnel: the tunnel's lease (expired since the CONNECT:
`lease-expired`), another lease offered (`lease-mismatch`), a CONNECT (`connect-in-tunnel`), then the same
`admit(..., lease=, answers=)` on the tunnel's answers (no lookup); its event says `tunnel: true`.

Only header names and values that decide something are read; a value is never logged or put in an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from compiler.artifact import Artifact
from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditLog, AuditUnavailable, strip_query
from egress_proxy.custody import lease as leases
from egress_proxy.decision.answers import DENY_HEADER, denial_body, policy_status, printable
from egress_proxy.decision.reasons import ALLOWED
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.errors import EgressError
from egress_proxy.front.admit import Ask, Hooks, admit
from egress_proxy.front.budget import Charged, Ledger
from egress_proxy.lane.envoy import AUTHORITY_HEADER, FRAMING_HEADER, LANE_HEADER, split_authority
from egress_proxy.lane.ingest import Admissions
from egress_proxy.lane.tunnels import Tunnel

log = logging.getLogger("egresslaw.lane")

DEADLINE_HEADER = "x-egresslaw-deadline"  # on the Lua filter's call: when Envoy stops waiting for the answer (unix ms)
TUNNEL_HEADER = "x-egresslaw-tunnel"  # on the inner listener's call: the id of the CONNECT whose tunnel the request is in
MAX_CHECK_BYTES = 160 * 1024  # a check carries a request head Envoy accepted (at most 64 KiB by default) and its framing
ENVOY_ADDED = frozenset({"x-request-id", "x-forwarded-proto", "x-forwarded-for", "x-envoy-internal", "x-envoy-external-address",
                         "x-envoy-expected-rq-timeout-ms"})

Resolve = Callable[[str, int], Awaitable[Sequence[str]]]


@dataclass(frozen=True)
class Check:
    """One request as Envoy's front listener saw it."""

    method: str
    authority: str
    scheme: str
    path: str
    headers: tuple[tuple[str, str], ...] = field(repr=False)  # the client's own fields, lowercased names (Envoy's additions
    # left out); the lease is among them, so never in a repr
    request_id: str
    peer: str | None = None
    deadline: float | None = None  # unix seconds: Envoy stops waiting for the answer then (`DEADLINE_HEADER` of the call)
    tunnel: str | None = None  # inside a tunnel: its CONNECT's id (`TUNNEL_HEADER` of the call; "" when Envoy carried none)

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def expired(self, now: float) -> bool:
        """Envoy has given up on this check by `now` (unix seconds): it must not be recorded as allowed."""
        return self.deadline is not None and now >= self.deadline

    @property
    def has_body(self) -> bool:
        # Exact because every lane listener speaks HTTP/1 only (`envoy.CODEC`, the translation check requires it): a
        # body is framed in the head, by `Content-Length` or `Transfer-Encoding` (the early mutation's copy).
        length = self.values("content-length")
        return bool(self.values("transfer-encoding")) or any(v.strip() not in ("", "0") for v in length)


class CheckError(EgressError):
    """A check body that is not what the lane's Lua filter sends."""


def parse_check(body: bytes, deadline: bytes | None = None, tunnel: bytes | None = None) -> Check:
    """The lines the Lua filter sends (`name: value`, CRLF-separated, pseudo-headers first among them); `deadline`:
    the call's `x-egresslaw-deadline` (unix milliseconds), absent or unreadable: none; `tunnel`: the inner
    listener's `x-egresslaw-tunnel` (absent: a check of the front listener)."""
    # A value is whatever bytes Envoy's codec let through (obs-text included), read as the edge reads header bytes
    # (mitmproxy: UTF-8, any other byte kept as a lone surrogate): the decision judges the same text on both front
    # ends, and a byte that is not UTF-8 is never mistaken for an authorizer failure.
    text = body.decode("utf-8", "surrogateescape")
    pseudo: dict[str, str] = {}
    fields: list[tuple[str, str]] = []
    for line in text.split("\r\n"):
        if not line:
            continue
        key, sep, value = line.partition(": ")
        if not sep:
            key, value = line.rstrip(":"), ""
        if key.startswith(":"):
            pseudo[key] = value
        elif key.lower() == FRAMING_HEADER:  # the client's Transfer-Encoding, kept by the listener's early mutation
            fields.append(("transfer-encoding", value))
        elif key.lower() not in ENVOY_ADDED:
            fields.append((key.lower(), value))
        elif key.lower() == "x-request-id":
            pseudo["x-request-id"] = value
    if ":method" not in pseudo:
        raise CheckError("the check names no :method")
    return Check(method=pseudo[":method"], authority=pseudo.get(":authority", ""), scheme=pseudo.get(":scheme", "http"),
                 path=pseudo.get(":path", ""), headers=tuple(fields), request_id=pseudo.get("x-request-id") or uuid.uuid4().hex,
                 deadline=int(deadline) / 1000 if deadline is not None and deadline.isdigit() and len(deadline) <= 15 else None,
                 tunnel=None if tunnel is None else tunnel[:64].decode("ascii", "replace"))


@dataclass
class Answer:
    """What the authorizer tells Envoy, and the event it wrote."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    event: Event | None = None


class Authorizer:
    """The lane's decisions. `policy()` gives the artifact in force (swapped on reload); `lease_keys()` the key set."""

    def __init__(self, *, policy: Callable[[], Any], lease_keys: Callable[[], leases.LeaseKeys], served: Callable[[], frozenset[str]],
                 resolve: Resolve, resolve_timeout: float, audit: AuditLog, clock: Callable[[], float] = time.time,
                 test_routing: dict[str, Any] | None = None, metrics: Any = None, admissions: Admissions | None = None,
                 ledger: Ledger | None = None) -> None:
        self.policy = policy
        self.lease_keys = lease_keys
        self.served = served
        self.resolve = resolve
        self.resolve_timeout = resolve_timeout
        self.audit = audit
        self.clock = clock
        self.test_routing = test_routing or {}
        self.metrics = metrics
        self.draining = False
        self._verified = leases.VerifiedLeases()
        self.in_flight = 0
        self.admissions = admissions if admissions is not None else Admissions()  # what the access-log reader consults
        self._hooks = Hooks(lease_keys=lambda: self.lease_keys(), verified=self._verified, clock=lambda: self.clock(), resolve=self._answers,
                            serves=self._serves, ledger=ledger)

    def _serves(self, lease: Lease) -> str | None:
        return None if lease.profile is not None and lease.profile in self.served() else "lane-not-served"

    async def _answers(self, lease: Lease, name: str, port: int) -> Sequence[str]:
        """The name's answers from the lane's resolver (the same its DNS front gives Envoy); none on any failure."""
        try:
            return tuple(await asyncio.wait_for(self.resolve(name, port), self.resolve_timeout))
        except Exception as exc:  # any resolver failure denies (resolve-failed)
            log.info("resolve of `%s` failed: %s", printable(name), exc.__class__.__name__)
            return ()

    async def check(self, c: Check) -> Answer:
        """The answer to one check, its event written, and what it decided recorded in `admissions` for the reader.
        A check Envoy has already given up on (past its deadline, or its access-log line already read) is never
        admitted: refused `authorizer-unavailable`, as Envoy answered the client."""
        started = time.monotonic()
        if not self.admissions.begin(c.request_id):  # the reader has written this request's one decision already
            return Answer(503, [(DENY_HEADER.lower(), "authorizer-unavailable"), ("content-type", "application/json")],
                          denial_body("authorizer-unavailable"))
        self.in_flight += 1
        answer: Answer | None = None
        try:
            if c.expired(time.time()):
                answer = self._refuse(c, None, "authorizer-unavailable", None, started, None)
            elif c.tunnel is not None:
                answer = await self._check_inner(c, started)
            else:
                answer = await self._check(c, started)
            return answer
        except Exception:
            log.exception("internal error in the lane authorizer; denying")
            answer = self._refuse(c, None, "internal-error", None, started, None)
            return answer
        finally:
            self.in_flight -= 1
            self.admissions.end(c.request_id, answer.event.get("decision") if answer is not None and answer.event is not None else None)

    def too_late(self, c: Check) -> bool:
        """Right before an allow's write-ahead event: Envoy no longer waits for this answer (its deadline passed, or
        the reader already closed the request). The caller refuses it `authorizer-unavailable` instead."""
        return c.expired(time.time()) or self.admissions.closed(c.request_id)

    async def _check(self, c: Check, started: float) -> Answer:
        policy = self.policy()
        connect = c.method == "CONNECT"
        values = tuple(c.values("proxy-authorization"))
        if policy is None:
            return self._refuse(c, None, "internal-error", None, started, leases.scheme_of(values[0] if values else None))
        artifact: Artifact = policy.artifact
        if connect:
            host, port = split_authority(c.authority, -1)
            ask = Ask(authority=c.authority, host=host, port=port, headers=c.headers, has_body=c.has_body, credentials=values)
        else:
            host, port = split_authority(c.authority, 443 if c.scheme == "https" else 80)
            request = Request(method=c.method, scheme="https" if c.scheme == "https" else "http", host=host, port=port, target=c.path or "/",
                              headers=c.headers, has_body=c.has_body, host_header=c.authority)  # Envoy's `Host` is `:authority`
            ask = Ask(request=request, headers=c.headers, has_body=c.has_body, credentials=values)
        got = await admit(artifact, ask, self._hooks)
        lease, decision, auth = got.lease, got.decision, got.auth
        name, port = got.host or host, got.port if got.port is not None else port
        if not got.allowed:
            return self._refuse(c, lease, got.reason, decision, started, auth, name, port, got.budget)
        assert lease is not None and lease.profile is not None
        if self.draining:
            return self._refuse(c, lease, "draining", decision, started, auth, name, port)
        if self.too_late(c):  # Envoy answered the client already (authorizer-unavailable): never an allow after that
            return self._refuse(c, lease, "authorizer-unavailable", decision, started, auth, name, port)
        event = self._event(c, lease, decision, "allow", ALLOWED, None, started, name, port)
        try:
            ticket = self.audit.emit(event, durable=True)
            await self.audit.written(ticket)
        except AuditUnavailable:
            return self._refuse(c, lease, "audit-unavailable", decision, started, auth, name, port)
        self._count(c, "allow", ALLOWED, started)
        if connect:  # its requests are judged with what this CONNECT was (Envoy carries the id to the inner listener)
            self.admissions.tunnels.open(c.request_id, Tunnel(lease, got.answers, name, port))
        return Answer(200, [(LANE_HEADER, lease.profile), (AUTHORITY_HEADER, f"{name}:{port}")], b"", event)

    async def _check_inner(self, c: Check, started: float) -> Answer:
        """A request inside a tunnel, admitted as the edge admits it (`edge.requests.RequestPath._request` with a tunnel): the
        tunnel's lease, then the same admission on the tunnel's answers; nothing is resolved."""
        tunnel = self.admissions.tunnels.get(c.tunnel)
        policy = self.policy()
        if tunnel is None or policy is None:
            # No tunnel by that id: Envoy carried none, or it was pushed out of the bounded record (fail closed).
            log.warning("a request inside a tunnel the authorizer does not know; denying")
            return self._refuse(c, None, "internal-error", None, started, None)
        lease, host, port = tunnel.lease, tunnel.host, tunnel.port
        if lease.exp <= self.clock():
            return self._refuse(c, lease, "lease-expired", None, started, None, host, port)  # first, as on the edge
        if self._offers_other_lease(c, lease):
            return self._refuse(c, lease, "lease-mismatch", None, started, None, host, port)
        if c.method == "CONNECT":
            return self._refuse(c, lease, "connect-in-tunnel", None, started, None, host, port)
        request = Request(method=c.method, scheme="https", host=host, port=port, target=c.path or "/", headers=c.headers,
                          has_body=c.has_body, host_header=c.authority, tunnel=True,
                          inner_port=split_authority(c.authority, port)[1] if c.authority else port)
        got = await admit(policy.artifact, Ask(request=request, headers=c.headers, has_body=c.has_body), self._hooks,
                          lease=lease, answers=tunnel.answers)
        if not got.allowed:
            return self._refuse(c, lease, got.reason, got.decision, started, None, host, port, got.budget)
        if self.draining:
            return self._refuse(c, lease, "draining", got.decision, started, None, host, port)
        if self.too_late(c):
            return self._refuse(c, lease, "authorizer-unavailable", got.decision, started, None, host, port)
        event = self._event(c, lease, got.decision, "allow", ALLOWED, None, started, host, port)
        try:
            ticket = self.audit.emit(event, durable=True)
            await self.audit.written(ticket)
        except AuditUnavailable:
            return self._refuse(c, lease, "audit-unavailable", got.decision, started, None, host, port)
        self._count(c, "allow", ALLOWED, started)
        return Answer(200, [(LANE_HEADER, lease.profile or ""), (AUTHORITY_HEADER, f"{host}:{port}")], b"", event)

    def _offers_other_lease(self, c: Check, lease: Lease) -> bool:
        """Inside a tunnel, a `Proxy-Authorization` carrying another valid lease (the edge's `binding.offers_other_lease`:
        one that is no lease at all is only stripped)."""
        values = c.values("proxy-authorization")
        if not values:
            return False
        try:
            other = self._verified.authenticate(self.lease_keys(), values, now=self.clock())
        except Exception:  # not a lease (or no key set): stripped like any client header
            return False
        return (other.subject, other.profile, other.connection) != (lease.subject, lease.profile, lease.connection)

    def _refuse(self, c: Check, lease: Lease | None, reason: str, decision: Decision | None, started: float, auth: str | None,
                host: str | None = None, port: int | None = None, budget: Charged | None = None) -> Answer:
        # A CONNECT inside a tunnel: the edge's HTTP layer (mitmproxy) refuses it before any hook, 400.
        status = 400 if reason == "connect-in-tunnel" else policy_status(reason)
        if host is None:
            tunnel = self.admissions.tunnels.get(c.tunnel) if c.tunnel is not None else None
            host, port = (tunnel.host, tunnel.port) if tunnel is not None else split_authority(
                c.authority, 443 if (c.method == "CONNECT" or c.scheme == "https") else 80)
        event = self._event(c, lease, decision, "deny", reason, status, started, host, port)
        if auth is not None and reason.startswith("lease-"):
            event = event.with_(auth=auth)
        if budget is not None:  # budget-exceeded: the cap, its window and when it resets (never a value of the request)
            event = event.with_(detail=budget.detail(), budget=budget.event())
        try:
            self.audit.emit(event)
        except AuditUnavailable as exc:
            log.error("audit event lost: %s", exc)
        self._count(c, "deny", reason, started)
        log.info("deny %s %s %s (lane)", reason, printable(c.method), printable(c.authority))
        headers = [(DENY_HEADER.lower(), reason), ("content-type", "application/json")]
        if status == 407:
            headers.append(("proxy-authenticate", 'Basic realm="egresslaw"'))
        if budget is not None:
            headers.append(("retry-after", str(budget.retry_after(self.clock()))))  # to the end of the window
        elif status == 503:
            headers.append(("retry-after", "1"))
        return Answer(status, headers, denial_body(reason, detail=budget.detail() if budget is not None else None), event)

    def _event(self, c: Check, lease: Lease | None, decision: Decision | None, verdict: str, reason: str, status: int | None,
               started: float, host: str | None, port: int | None) -> Event:
        """The decision event, spelled as the edge spells its own (`Event.decided`), with `lane: envoy`."""
        inner = c.tunnel is not None
        connect = c.method == "CONNECT" and not inner
        policy = self.policy()
        return Event.decided(
            "connect" if connect else "request", c.request_id, lease, verdict, reason,
            method=printable(c.method, 32),
            scheme="https" if (connect or inner) else ("https" if c.scheme == "https" else "http"),
            host=decision.host if decision is not None and decision.host else host,
            port=port,
            path=None if connect else strip_query(decision.path if decision is not None and decision.path else printable(c.path, 2048)),
            tunnel=inner, rule=None, broker=None, status=status, bytes_up=0, bytes_down=0,
            duration_ms=round((time.monotonic() - started) * 1000, 3), redactions=0, lane="envoy",
            artifact=policy.artifact.digest if policy is not None else None,
            **({"unproven": True} if policy is not None and not policy.proved else {}),
            **({"test_routing": self.test_routing} if self.test_routing else {}),
        )

    def _count(self, c: Check, decision: str, reason: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.observe("connect" if c.method == "CONNECT" and c.tunnel is None else "request", decision, reason,
                                 time.monotonic() - started)

    # -- the HTTP/1.1 server Envoy's authorizer cluster talks to ---------------------------------

    async def serve_unix(self, path: Path) -> asyncio.AbstractServer:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return await asyncio.get_running_loop().create_unix_server(lambda: _CheckServer(self), path=str(path))

    async def _answer(self, body: bytes, deadline: bytes | None = None, tunnel: bytes | None = None) -> Answer:
        try:
            check = parse_check(body, deadline, tunnel)
        except CheckError:
            # Not the Lua filter's shape: refused without an event (no request to name); Envoy answers 503 for it.
            return Answer(400, [("content-type", "text/plain")], b"malformed check\n")
        return await self.check(check)


_CHECK_LINE = b"POST /check HTTP/1.1"
_REASONS = {s.value: s.phrase.encode("ascii") for s in HTTPStatus}


def answer_bytes(answer: Answer) -> bytes:
    """`answer` as one HTTP/1.1 response, its length declared; a header that could split the head is refused."""
    head = "".join(f"{k}: {v}\r\n" for k, v in answer.headers)
    if head.count("\n") != len(answer.headers) or head.count("\r") != len(answer.headers):
        raise CheckError("an answer header holds a line break")
    return b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n\r\n%s" % (answer.status, _REASONS.get(answer.status, b""),
                                                                 head.encode("ascii"), len(answer.body), answer.body)


class _CheckServer(asyncio.Protocol):
    """One connection of Envoy's authorizer cluster: `POST /check` HTTP/1.1 requests, each with its Content-Length,
    kept alive, answered in turn. Anything else (another request line, a transfer coding, a head or body over
    MAX_CHECK_BYTES, a field that is not `name: value`) closes the connection unanswered; Envoy answers 503 for it."""

    __slots__ = ("authorizer", "transport", "buf", "busy", "task")

    def __init__(self, authorizer: Authorizer) -> None:
        self.authorizer = authorizer
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False  # a check is being answered: what arrives meanwhile waits (Envoy does not pipeline)
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > 2 * MAX_CHECK_BYTES + 4:
            self._drop("the check is too large")
        elif not self.busy:
            self._next()

    def _drop(self, why: str) -> None:
        log.warning("the lane authorizer dropped a connection: %s", why)
        self.buf.clear()
        if self.transport is not None:
            self.transport.close()

    def _next(self) -> None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_CHECK_BYTES:
                self._drop("the check's head is too large")
            return
        if end > MAX_CHECK_BYTES:
            return self._drop("the check's head is too large")
        lines = bytes(buf[:end]).split(b"\r\n")
        if lines[0] != _CHECK_LINE:
            return self._drop("not a check")
        length = 0
        deadline: bytes | None = None
        tunnel: bytes | None = None
        close = False
        seen_length = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or b"\n" in line or b"\r" in line:
                return self._drop("a malformed field")
            name = name.lower()
            value = value.strip(b" \t")
            if name == b"content-length":
                if seen_length or not value.isdigit() or len(value) > 9:
                    return self._drop("a malformed Content-Length")
                seen_length, length = True, int(value)
            elif name == b"x-egresslaw-deadline":
                deadline = value
            elif name == b"x-egresslaw-tunnel":
                tunnel = value
            elif name == b"transfer-encoding":
                return self._drop("a transfer coding")
            elif name == b"connection":
                close = value.lower() == b"close"
        if length > MAX_CHECK_BYTES:
            return self._drop("the check is too large")
        start = end + 4
        if len(buf) < start + length:
            return  # the body is still on its way
        body = bytes(buf[start:start + length])
        del buf[:start + length]
        self.busy = True
        self.task = asyncio.get_running_loop().create_task(self._serve(body, deadline, tunnel, close))

    async def _serve(self, body: bytes, deadline: bytes | None, tunnel: bytes | None, close: bool) -> None:
        try:
            out = answer_bytes(await self.authorizer._answer(body, deadline, tunnel))
        except CheckError as exc:
            return self._drop(str(exc))
        except Exception as exc:  # fail closed: Envoy answers 503 authorizer-unavailable for a dropped call
            return self._drop(f"{exc.__class__.__name__} answering a check")
        finally:
            self.busy = False
            self.task = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(out)
        if close:
            transport.close()
        elif self.buf:
            self._next()
