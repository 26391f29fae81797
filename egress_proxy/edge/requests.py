"""The request path: a CONNECT or a request head read into the one admission (`egress_proxy.front.admit`), its
body held to its limit, its credential attached, its decision event written ahead of anything going upstream.

`RequestPath` answers mitmproxy's `http_connect`, `requestheaders` and `request`, and the layers' `owns` and
`protocol_error` (rows of `EgressLaw`'s hook table); `limits.py` calls back `refuse_mid_body` (a body over its limit
after the decision) and `stalled` (a stream whose client took nothing). Every hook is guarded: an exception denies
(`internal-error`), never forwards.

It takes from the addon, at construction: the flow states and client records (and the record maker), the limits,
`policy` and `clock` (read live: a reload swaps the policy, tests swap the clock), `now`, the `LeaseBinding` (the
admission's hooks of a client connection), the `Attacher`, and the audit trail's `write_ahead` and `finish`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mitmproxy import http

from egress_proxy.audit.log import strip_query
from egress_proxy.credentials.base import MAX_HASHED_BODY, Attached, CredentialError
from egress_proxy.custody.records import CustodyError, CustodyUnavailable
from egress_proxy.decision.adapter import judge_body
from egress_proxy.decision.reasons import REASONS, SHAPE_REASONS
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.edge.denials import denial, denial_response
from egress_proxy.edge.flows import (
    AUDITED,
    Client,
    FlowState,
    Tunnel,
    carrier_of,
    deny,
    has_body,
    log_internal,
    printable,
    tunnel_of,
)
from egress_proxy.edge.limits import declared_length, request_problem
from egress_proxy.front.admit import Admission, Ask, admit
from egress_proxy.front.startup import Policy

log = logging.getLogger("egresslaw.proxy")

JUDGE_INLINE = 64 * 1024  # a body judged on the event loop; a longer one is judged in a worker thread (parsing takes time)


class RequestPath:
    """CONNECTs and requests: admitted, bodies bounded, credentials attached, decisions written ahead."""

    def __init__(self, *, flows: dict[str, FlowState], clients: Mapping[str, Client], record: Callable[[Any], Client], limits: Any,
                 policy: Callable[[], Policy | None], clock: Callable[[], float], now: Callable[[], float], binding: Any,
                 attacher: Any, write_ahead: Callable[..., Awaitable[None]], finish: Callable[..., None]) -> None:
        self._flows = flows  # the addon's flow states: a hook makes one, the closing event (`finish`) forgets it
        self._clients, self._record = clients, record
        self.limits = limits  # edge.limits.Limits: the head's bounds, the body's limit
        self._policy, self._clock, self._now = policy, clock, now
        self.binding = binding  # edge.binding.LeaseBinding: the admission's hooks of a client connection
        self.attacher = attacher  # edge.attach.Attacher: the credential, the head upstream, its signature
        self._write_ahead, self._finish = write_ahead, finish

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        state = FlowState(started=self._now())
        self._flows[flow.id] = state
        try:
            await self._connect(flow, state)
            if flow.response is None and not state.denied:
                state.reason = "allowed"
                await self._write_ahead(flow, state, "connect")
        except Exception:
            log_internal("internal error in http_connect; denying")
            deny(flow, state, "internal-error")
        if flow.response is not None and state.tunnel:
            self._record(flow.client_conn).tunnel = None  # refused after this CONNECT recorded its tunnel
        self._finish(flow, kind="connect")

    async def _connect(self, flow: http.HTTPFlow, state: FlowState) -> None:
        client = self._record(flow.client_conn)
        if client.tunnel is not None:
            return deny(flow, state, "connect-in-tunnel")
        state.policy = policy = self._policy()
        host, port = flow.request.host, flow.request.port
        state.host, state.port = host, port  # known before the lease is judged: a lease denial names its target
        # Judged as sent: mitmproxy has already dropped brackets (`[name]:443`) and leading zeros of the port (`:0443`)
        # from host/port, so its view would admit non-canonical spellings.
        ask = Ask(authority=flow.request.authority or f"{host}:{port}", host=host, port=port,
                  headers=tuple(flow.request.headers.items(multi=True)), has_body=has_body(flow.request),
                  credentials=tuple(flow.request.headers.get_all("proxy-authorization")))
        got = await self._admit(flow, state, policy, ask)
        if got is None:
            return
        name, lease, ips = got.host or host, got.lease, got.answers
        assert lease is not None
        flow.request.host = name  # mitmproxy takes the tunnel's server address from here: the normalized name
        client.tunnel = Tunnel(name, port, lease, ips)
        state.tunnel = True

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        state = FlowState(started=self._now(), flow=flow)
        self._flows[flow.id] = state
        try:
            if flow.error is not None:
                # mitmproxy refused the request itself (framing it will not forward); record why.
                tunnel = tunnel_of(self._clients, flow.client_conn.id)
                state.reason = "connect-in-tunnel" if (tunnel and flow.request.method == "CONNECT") else "smuggling"
                state.denied = True
                return
            await self._request(flow, state)
            if flow.response is None and not state.denied and state.judging is None:
                await self._write_ahead(flow, state, "request")  # INVARIANT: the last step before anything goes upstream
            # (a body a request shape judges: its decision event is written ahead in `request`, once it is judged)
        except Exception:
            log_internal("internal error in requestheaders; denying")
            deny(flow, state, "internal-error")
        if flow.response is not None:
            # Refused: the answer goes out at once and the body is dropped unread (egress_proxy/edge/limits.py); no
            # `100 Continue` invites it, and nothing streams.
            flow.request.stream = False
            flow.request.headers.pop("expect", None)

    async def _request(self, flow: http.HTTPFlow, state: FlowState) -> None:
        client = self._record(flow.client_conn)
        if client.refused is not None:
            return deny(flow, state, client.refused)
        tunnel = client.tunnel
        state.tunnel = tunnel is not None
        req = flow.request
        state.path = strip_query(req.path)
        too_big = request_problem(req, self.limits.config)  # before the lease: what the head costs is not its sender's
        if too_big is not None:
            return self._deny_limit(flow, state, too_big[1], too_big[0])
        if len(self._flows) > self.limits.config.max_streams_total:  # (this one included: every request in flight)
            return self._deny_limit(flow, state, "streams-at-capacity", 503)
        state.policy = policy = self._policy()
        if tunnel is not None:
            state.lease = tunnel.lease
            state.host, state.port = tunnel.host, tunnel.port
            if tunnel.lease.exp <= self._clock():
                return deny(flow, state, "lease-expired")  # (before anything else it says, as admit() would)
            if self.binding.offers_other_lease(flow, tunnel.lease):
                return deny(flow, state, "lease-mismatch")
            if req.method == "CONNECT":
                return deny(flow, state, "connect-in-tunnel")
        else:
            state.host, state.port = req.host, req.port  # known before the lease is judged
        if policy is not None and not policy.proved:
            log.warning("serving an unproven artifact (--allow-unproven)")
        host, port = (tunnel.host, tunnel.port) if tunnel else (req.host, req.port)
        request = Request(
            # As sent: mitmproxy's `method` property upper-cases, but the wire (and so the upstream) keeps `get`.
            method=req.data.method.decode("utf-8", "surrogateescape"),
            scheme=req.scheme,  # type: ignore[arg-type]
            host=host,
            port=port,
            target=req.path,
            headers=tuple(req.headers.items(multi=True)),  # (name, value) text pairs
            # Inside a tunnel mitmproxy keeps an absolute-form target as sent (and would forward it so): its
            # authority must name the tunnel's host and port exactly like a Host header.
            host_header=req.authority if (tunnel is not None and req.authority) else req.host_header,
            tunnel=tunnel is not None,
            has_body=has_body(req, self.limits.ended(req)),
            inner_port=req.port if tunnel is not None else None,
        )
        ask = Ask(request=request, headers=request.headers, has_body=request.has_body,
                  credentials=() if tunnel is not None else tuple(req.headers.get_all("proxy-authorization")))
        got = await self._admit(flow, state, policy, ask, tunnel)
        if got is None:
            return
        lease, decision, host = got.lease, got.decision, got.host or host
        assert lease is not None and decision is not None
        state.path = decision.path or state.path
        if decision.answer_filter is not None:
            req.headers["accept-encoding"] = "identity"  # the answer is filtered (an MCP GET stream): it must come uncoded
        if tunnel is None:
            req.data.host = host  # the normalized name the pin is keyed on (the Host header is left alone)
        try:
            attached = await self.attacher.attach(state)
        except CustodyUnavailable:
            # The shared custody database is unreachable: fail closed with its own reason, nothing goes upstream.
            return deny(flow, state, "custody-unavailable")
        except CustodyError as exc:
            if exc.io:
                raise  # the store itself failed (a corrupt file): internal-error, fail closed
            # No record at the connection's address (or one that does not open): its message names the address, never a value.
            log.warning("deny credential-unavailable connection `%s`: %s", printable(carrier_of(lease, decision) or "-"), exc.message)
            return deny(flow, state, "credential-unavailable")
        except CredentialError as exc:
            # Nothing to attach (a mint refused, a record that does not fit its kind): nothing goes upstream. The
            # denial names the provider's status, never its body.
            log.warning("deny %s connection `%s`: %s", exc.reason, printable(carrier_of(lease, decision) or "-"), exc.message)
            state.provider_status, state.cause = exc.provider_status, exc.cause
            return deny(flow, state, exc.reason)
        if flow.client_conn.timestamp_end is not None:
            return deny(flow, state, "client-disconnected")  # it left while the credential was minted
        if not self._admit_body(flow, state, lease, decision, attached, request):
            return
        try:
            refused = self.attacher.prepare(flow, state, attached, has_body(req, self.limits.ended(req)))
        except CredentialError as exc:
            state.cause = exc.cause
            return deny(flow, state, exc.reason)
        if refused is not None:
            return deny(flow, state, refused)
        if flow.response is not None:
            return
        state.reason = "allowed"
        # WRITE-AHEAD POINT: the decision is final here; a streamed request's head goes upstream as soon as this
        # hook returns, anything else after `request`. The one await for the decision event's durability goes here.

    async def _admit(self, flow: http.HTTPFlow, state: FlowState, policy: Policy | None, ask: Ask, tunnel: Tunnel | None = None) -> Admission | None:
        """The one admission (`egress_proxy.front.admit`) with this client connection's hooks; None after a denial."""
        if policy is None:
            deny(flow, state, "internal-error")
            return None
        hooks = self.binding.hooks(flow.client_conn)
        if tunnel is not None:
            got = await admit(policy.artifact, ask, hooks, lease=tunnel.lease, answers=tunnel.ips)
        else:
            got = await admit(policy.artifact, ask, hooks)
        state.auth = got.auth if tunnel is None else state.auth
        if got.lease is not None:
            state.lease = got.lease
        if got.host is not None:
            state.host = got.host
        if got.decision is not None:
            state.decision = got.decision
        if not got.allowed:
            if got.reason in SHAPE_REASONS and got.decision is not None and got.decision.reason == got.reason:
                state.detail = got.decision.detail  # a head shape refused: the rule and the place
            if got.budget is not None:  # a budget with no room: the cap, its window, when it resets
                state.budget, state.detail, state.retry_after = got.budget, got.budget.detail(), got.budget.retry_after(self._clock())
            deny(flow, state, got.reason, got.decision)
            return None
        return got

    def _admit_body(self, flow: http.HTTPFlow, state: FlowState, lease: Lease, decision: Decision, attached: Attached | None,
                    request: Request) -> bool:
        """Hold the request's body to its limit (413 for a declared size over it) and stream it instead of buffering
        (unless its credential signs the body's hash, or a request shape judges it: then it is held whole, to the
        smaller limit, and signed or judged in `request`)."""
        req = flow.request
        if decision.body_shape is not None:
            state.judging = request  # judged in `request`, a bodyless one too (an empty body is no message)
        if not has_body(req, self.limits.ended(req)):
            return True
        limit = self.limits.config.body_limit(lease.connection or lease.profile, decision.rule)
        if decision.broker is not None:
            # Brokered: the connection's traffic, so its (rule's) limit holds too, as does the profile's own.
            limit = min(limit, self.limits.config.body_limit(decision.broker, decision.rule))
        hashed = attached is not None and attached.hash_body
        if hashed:
            limit = min(limit, MAX_HASHED_BODY)
        length = declared_length(req)
        over = "body-too-large"
        if decision.body_shape is not None:
            judged = decision.body_limit if decision.body_limit is not None else limit
            if length is not None and length > judged:
                # Never read: the shape could not judge it whole (no `100 Continue` invites it).
                state.detail = f"rule `{decision.rule}`: {length} bytes declared, the rule judges at most {judged}"
                self._deny_limit(flow, state, "body-too-large-to-judge", 413)
                return False
            if judged <= limit:
                limit, over = judged, "body-too-large-to-judge"
        if length is not None and length > limit:
            self._deny_limit(flow, state, "body-too-large", 413)
            return False
        self.limits.set_body_limit(flow, limit, over)  # egress_proxy/edge/limits.py cuts a body that goes over it
        if hashed or state.judging is not None or (length is None and not req.headers.get("transfer-encoding")):
            # HTTP/2 without content-length, or a body a signature hashes: held (to the limit), framed in `request`
            state.buffered = True
            return True

        def count(chunk: bytes) -> bytes:
            state.uploaded += len(chunk)
            return chunk

        state.streaming = True
        req.stream = count
        return True

    def _deny_limit(self, flow: http.HTTPFlow, state: FlowState, reason: str, status: int) -> None:
        """A limit refusal (408/413/414/431): our JSON with its own status; the connection closes after it."""
        tunnel = tunnel_of(self._clients, flow.client_conn.id)
        if tunnel is not None and state.lease is None:
            state.lease, state.host, state.port = tunnel.lease, tunnel.host, tunnel.port
        state.denied = True
        state.reason = reason
        flow.response = denial_response(status, reason)
        state.injected = ()

    def stalled(self, flow: http.HTTPFlow) -> None:
        """limits.py reset a stream whose client took nothing for --stall-timeout: that is the outcome's failure."""
        state = self._flows.get(flow.id)
        if state is not None and state.failure is None:
            state.failure = "client-stalled"
            log.warning("reset a stream from %s: its client took nothing queued for it in %gs", printable(state.host or "-"),
                        self.limits.config.stall_timeout)

    def refuse_mid_body(self, flow: http.HTTPFlow, reason: str, status: int) -> http.Response | None:
        """limits.py found a body over its limit (or trailers) after the decision: the flow becomes that refusal."""
        state = self._flows.get(flow.id)
        if state is None:
            return None  # already answered and audited
        if reason == "body-too-large-to-judge" and state.decision is not None:
            state.detail = f"rule `{state.decision.rule}`: the body grew past {self.limits.body_limit(flow)} bytes, the most the rule judges"
        self._deny_limit(flow, state, reason, status)
        return flow.response

    async def request(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None:
            if flow.response is None and not flow.metadata.get(AUDITED):
                # INVARIANT: nothing goes upstream that requestheaders did not decide.
                try:
                    state = FlowState(started=self._now(), flow=flow)
                    self._flows[flow.id] = state
                    deny(flow, state, "internal-error")
                except Exception:  # the backstop itself must not fail open
                    log_internal("internal error in request; denying without state")
                    flow.response = denial("internal-error")
            return
        if flow.response is not None or state.denied or state.streaming:
            return  # a streamed request went upstream as it came: limits.py held its body and trailers
        try:
            req = flow.request
            if req.trailers:
                return deny(flow, state, "trailers-denied")
            if state.buffered:
                req.headers["content-length"] = str(len(req.raw_content or b""))
                if "transfer-encoding" in req.headers:
                    del req.headers["transfer-encoding"]  # a chunked body held whole goes upstream with its length
            judged = state.judging is not None
            if judged and not await self._judge(flow, state):
                return
            if state.signing is not None:
                self.attacher.sign(flow, state, req.raw_content or b"")  # the body is whole: its hash is signed
            if judged:
                await self._write_ahead(flow, state, "request")  # INVARIANT: the last step before anything goes upstream
        except CredentialError as exc:
            deny(flow, state, exc.reason)
        except Exception:
            log_internal("internal error in request; denying")
            deny(flow, state, "internal-error")

    async def _judge(self, flow: http.HTTPFlow, state: FlowState) -> bool:
        """Judge the whole body by its rule's shape (`adapter.judge_body`); False once the flow is denied (a refused
        body is answered like every other denial: nothing of it has gone upstream). An allowed body's decision takes
        its answer filter (the upstream is then asked for an uncoded answer, which `responses.py` filters)."""
        asked, decision, lease, policy = state.judging, state.decision, state.lease, state.policy
        if decision is None or lease is None or policy is None:
            deny(flow, state, "internal-error")
            return False
        body = flow.request.raw_content or b""
        if len(body) <= JUDGE_INLINE:
            verdict = judge_body(policy.artifact, lease, asked, decision, body)
        else:
            verdict = await asyncio.to_thread(judge_body, policy.artifact, lease, asked, decision, body)
        if self._flows.get(flow.id) is not state or flow.client_conn.timestamp_end is not None:
            deny(flow, state, "client-disconnected")  # it left while its body was judged: nothing goes upstream
            return False
        if not verdict.allowed:
            state.detail = verdict.detail
            deny(flow, state, verdict.reason, verdict)
            return False
        state.decision, state.judging = verdict, None
        if verdict.answer_filter is not None:
            flow.request.headers["accept-encoding"] = "identity"  # the answer is filtered: it must come uncoded
        return True

    def owns(self, flow: Any) -> bool:
        return flow.id in self._flows

    def protocol_error(self, flow: Any, code: Any, to_client: bool, reason: str | None = None) -> str | None:
        """A protocol error reached this flow's stream (its error hook comes next): remember mitmproxy's code,
        whether mitmproxy answers it to the client and the reason egresslaw's layers gave it (a bound the upstream
        broke, a stall); the reason that answer names (None: the default)."""
        state = self._flows.get(flow.id)
        if state is None:
            return None
        state.error_code, state.error_to_client = code, to_client
        if reason is not None and reason != "upstream-error" and state.failure is None:
            state.failure = reason
        if state.failure is not None:
            return state.failure
        return state.reason if state.denied and state.reason in REASONS else None
