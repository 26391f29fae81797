"""The authorizer Envoy asks, once per CONNECT and once per plain-HTTP request, before anything goes upstream.

The front listener's Lua filter POSTs the request's header fields (pseudo-headers included, one `name: value` per
line) to `/check` on a Unix socket in the lane's private run directory. The answer is the decision of the same code
the mitmproxy edge runs and the prover proves:

1. the lease (`Proxy-Authorization`, Bearer or Basic), verified against the current lease key set;
2. a subject the lane serves (a lease for a connection, or for a profile the lane leaves to the edge, is refused
   `lane-not-served`);
3. `decide_connect` (a CONNECT) or `decide_without_addresses` (a plain request), before any lookup;
4. the name's resolver answers, judged by `judge_answers` (CONNECT) or `decide` (plain request): the same answers
   the DNS front will give Envoy for the name;
5. the decision event written to the chained audit log (an allow waits for it, as on the edge: nothing is
   forwarded unaudited), then `200` with `x-egresslaw-lane-profile`, or the refusal with its reason.

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
from pathlib import Path
from typing import Any

import h11

from compiler.artifact import Artifact
from egress_proxy.audit.log import AuditLog, AuditUnavailable, strip_query
from egress_proxy.custody import lease as leases
from egress_proxy.custody.keys import KeyFileError
from egress_proxy.decision.adapter import decide, decide_connect, decide_without_addresses, judge_answers
from egress_proxy.decision.answers import DENY_HEADER, denial_body, policy_status, printable
from egress_proxy.decision.reasons import ALLOWED
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.errors import EgressError
from egress_proxy.lane.envoy import AUTHORITY_HEADER, LANE_HEADER, split_authority

log = logging.getLogger("egresslaw.lane")

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

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    @property
    def has_body(self) -> bool:
        length = self.values("content-length")
        return bool(self.values("transfer-encoding")) or any(v.strip() not in ("", "0") for v in length)


class CheckError(EgressError):
    """A check body that is not what the lane's Lua filter sends."""


def parse_check(body: bytes) -> Check:
    """The lines the Lua filter sends (`name: value`, CRLF-separated, pseudo-headers first among them)."""
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
        elif key.lower() not in ENVOY_ADDED:
            fields.append((key.lower(), value))
        elif key.lower() == "x-request-id":
            pseudo["x-request-id"] = value
    if ":method" not in pseudo:
        raise CheckError("the check names no :method")
    return Check(method=pseudo[":method"], authority=pseudo.get(":authority", ""), scheme=pseudo.get(":scheme", "http"),
                 path=pseudo.get(":path", ""), headers=tuple(fields), request_id=pseudo.get("x-request-id") or uuid.uuid4().hex)


@dataclass
class Answer:
    """What the authorizer tells Envoy, and the event it wrote."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes
    event: dict[str, Any] | None = None


class Authorizer:
    """The lane's decisions. `policy()` gives the artifact in force (swapped on reload); `lease_keys()` the key set."""

    def __init__(self, *, policy: Callable[[], Any], lease_keys: Callable[[], leases.LeaseKeys], served: Callable[[], frozenset[str]],
                 resolve: Resolve, resolve_timeout: float, audit: AuditLog, clock: Callable[[], float] = time.time,
                 test_routing: dict[str, Any] | None = None, metrics: Any = None) -> None:
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

    async def check(self, c: Check) -> Answer:
        started = time.monotonic()
        self.in_flight += 1
        try:
            return await self._check(c, started)
        except Exception:
            log.exception("internal error in the lane authorizer; denying")
            return self._refuse(c, None, "internal-error", None, started, None)
        finally:
            self.in_flight -= 1

    async def _check(self, c: Check, started: float) -> Answer:
        policy = self.policy()
        connect = c.method == "CONNECT"
        values = c.values("proxy-authorization")
        auth = leases.scheme_of(values[0] if values else None)
        if policy is None:
            return self._refuse(c, None, "internal-error", None, started, auth)
        try:
            keys = self.lease_keys()
            lease = self._verified.authenticate(keys, values, now=self.clock())
        except KeyFileError:
            return self._refuse(c, None, "internal-error", None, started, auth)
        except leases.LeaseError as exc:
            return self._refuse(c, None, exc.reason, None, started, auth)
        artifact: Artifact = policy.artifact
        if (lease.profile and artifact.profile(lease.profile) is None) or (lease.connection and artifact.connection(lease.connection) is None):
            return self._refuse(c, lease, "lease-unknown-subject", None, started, auth)
        if lease.profile is None or lease.profile not in self.served():
            return self._refuse(c, lease, "lane-not-served", None, started, auth)
        if connect:
            decision = decide_connect(artifact, lease, c.authority, c.headers, c.has_body)
            host, port = split_authority(c.authority, -1)
        else:
            host, port = split_authority(c.authority, 443 if c.scheme == "https" else 80)
            request = Request(method=c.method, scheme="https" if c.scheme == "https" else "http", host=host, port=port, target=c.path or "/",
                              headers=c.headers, has_body=c.has_body)
            decision = decide_without_addresses(artifact, lease, request)
        if not decision.allowed:
            return self._refuse(c, lease, decision.reason, decision, started, auth, host, port)
        name = decision.host or host
        try:
            ips = tuple(await asyncio.wait_for(self.resolve(name, port), self.resolve_timeout))
        except Exception as exc:  # any resolver failure denies
            log.info("resolve of `%s` failed: %s", name, exc.__class__.__name__)
            ips = ()
        if not ips:
            return self._refuse(c, lease, "resolve-failed", decision, started, auth, name, port)
        judged = judge_answers(artifact, lease, ips) if connect else decide(artifact, lease, request, ips)
        if not judged.allowed:
            return self._refuse(c, lease, judged.reason, judged, started, auth, name, port)
        if self.draining:
            return self._refuse(c, lease, "draining", decision, started, auth, name, port)
        event = self._event(c, lease, decision if connect else judged, "allow", ALLOWED, None, started, name, port)
        try:
            ticket = self.audit.emit(event, durable=True)
            await self.audit.written(ticket)
        except AuditUnavailable:
            return self._refuse(c, lease, "audit-unavailable", decision, started, auth, name, port)
        self._count(c, "allow", ALLOWED, started)
        return Answer(200, [(LANE_HEADER, lease.profile), (AUTHORITY_HEADER, f"{name}:{port}")], b"", event)

    def _refuse(self, c: Check, lease: Lease | None, reason: str, decision: Decision | None, started: float, auth: str | None,
                host: str | None = None, port: int | None = None) -> Answer:
        status = policy_status(reason)
        if host is None:
            host, port = split_authority(c.authority, 443 if (c.method == "CONNECT" or c.scheme == "https") else 80)
        event = self._event(c, lease, decision, "deny", reason, status, started, host, port)
        if auth is not None and reason.startswith("lease-"):
            event["auth"] = auth
        try:
            self.audit.emit(event)
        except AuditUnavailable as exc:
            log.error("audit event lost: %s", exc)
        self._count(c, "deny", reason, started)
        log.info("deny %s %s %s (lane)", reason, printable(c.method), printable(c.authority))
        headers = [(DENY_HEADER.lower(), reason), ("content-type", "application/json")]
        if status == 407:
            headers.append(("proxy-authenticate", 'Basic realm="egresslaw"'))
        if status == 503:
            headers.append(("retry-after", "1"))
        return Answer(status, headers, denial_body(reason), event)

    def _event(self, c: Check, lease: Lease | None, decision: Decision | None, verdict: str, reason: str, status: int | None,
               started: float, host: str | None, port: int | None) -> dict[str, Any]:
        connect = c.method == "CONNECT"
        policy = self.policy()
        event: dict[str, Any] = {
            "kind": "connect" if connect else "request",
            "id": c.request_id,
            "subject": lease.subject if lease else None,
            "profile": lease.profile if lease else None,
            "connection": lease.connection if lease else None,
            "method": printable(c.method, 32),
            "scheme": "https" if connect else ("https" if c.scheme == "https" else "http"),
            "host": (decision.host if decision is not None and decision.host else host),
            "port": port,
            "path": None if connect else strip_query(decision.path if decision is not None and decision.path else printable(c.path, 2048)),
            "tunnel": False,
            "decision": verdict,
            "reason": reason,
            "rule": None,
            "broker": None,
            "status": status,
            "bytes_up": 0,
            "bytes_down": 0,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
            "redactions": 0,
            "lane": "envoy",
            "artifact": policy.artifact.digest if policy is not None else None,
        }
        if policy is not None and not policy.proved:
            event["unproven"] = True
        if self.test_routing:
            event["test_routing"] = self.test_routing
        return event

    def _count(self, c: Check, decision: str, reason: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.observe("connect" if c.method == "CONNECT" else "request", decision, reason, time.monotonic() - started)

    # -- the HTTP/1.1 server Envoy's authorizer cluster talks to ---------------------------------

    async def serve_unix(self, path: Path) -> asyncio.AbstractServer:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return await asyncio.start_unix_server(self._connection, path=str(path))

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_CHECK_BYTES)
        body = bytearray()
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    body.clear()
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_CHECK_BYTES:
                        raise CheckError("the check is too large")
                elif isinstance(event, h11.EndOfMessage):
                    answer = await self._answer(bytes(body))
                    headers = [*answer.headers, ("content-length", str(len(answer.body)))]
                    writer.write(conn.send(h11.Response(status_code=answer.status, headers=headers)) + conn.send(h11.Data(data=answer.body))
                                 + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    conn.start_next_cycle()
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    break
        except (h11.ProtocolError, CheckError, ConnectionError) as exc:
            log.warning("the lane authorizer dropped a connection: %s", exc.__class__.__name__)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, body: bytes) -> Answer:
        try:
            check = parse_check(body)
        except CheckError:
            # Not the Lua filter's shape: refused without an event (no request to name); Envoy answers 503 for it.
            return Answer(400, [("content-type", "text/plain")], b"malformed check\n")
        return await self.check(check)


