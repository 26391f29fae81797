"""Credential attachment: what a request carrying a connection's credential carries, and the mints behind it.

`Attacher` holds the process's `Broker` (minted tokens, in memory only) and, for an admitted request:
- `attach`: the credential from custody (a minting kind's token through the broker, whose call to the token endpoint
  is the edge's own `MintCall`: resolved here, every answer judged by the connection's worker
  (`decision.adapter.judge_token_answers`), pinned, TLS verified for the endpoint's name, audited once as a `mint`
  event with its status, never a token or a body);
- `prepare`: the head the upstream gets (the headers the decision kept, framing recomputed, the one credential
  header written, origin-form);
- `sign`: a signing kind's headers once the head (and, when it hashes it, the body) is final.

It takes from the addon, at construction: `custody` (the current custody store, read on every call: it may be
replaced while serving), `resolve` (the addon's bounded lookup), `dial` (`upstreams.Upstreams.dial`: where a name is
dialled, never this proxy), `now` and `clock` (timing and signatures), and the audit trail's `count` and `emit`. The
token endpoints' TLS context and the clock the broker keeps come with `setup`, from the addon's `configure`.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mitmproxy import http

from egress_proxy.audit.event import Event
from egress_proxy.credentials.base import Attached, CredentialError, MintFailed, Reply, SignView, TokenRequest
from egress_proxy.credentials.broker import Broker
from egress_proxy.credentials.exchange import exchange
from egress_proxy.decision.adapter import judge_token_answers
from egress_proxy.edge.flows import FlowState, authority, carrier_of, custody_address, upstream_framing
from egress_proxy.front.startup import Policy


class MintCall:
    """One mint's call to its token endpoint (the broker's `fetch`): made by the edge, audited once its outcome is known."""

    __slots__ = ("attacher", "policy", "started", "answer_reason", "reported")

    def __init__(self, attacher: Attacher, policy: Policy) -> None:
        self.attacher, self.policy = attacher, policy
        self.started, self.answer_reason, self.reported = 0.0, None, False

    async def __call__(self, conn: Any, request: TokenRequest) -> Reply:
        return await self.attacher.fetch(self.policy, conn, request, self)

    def report(self, conn: Any, reply: Reply | None, error: CredentialError | None) -> None:
        if not self.reported:  # one event per call
            self.reported = True
            self.attacher.audit(self, conn, reply, error)


class Attacher:
    """The credential a request carries: attached from custody or minted, written into the head, signed."""

    def __init__(self, *, custody: Callable[[], Any], resolve: Callable[[str, int], Awaitable[Sequence[str]]],
                 dial: Callable[[str, int, tuple[str, ...]], tuple[str, int] | None], now: Callable[[], float],
                 clock: Callable[[], float], count: Callable[..., None], emit: Callable[[Event], Any]) -> None:
        self._custody, self._resolve, self._dial = custody, resolve, dial
        self._now, self._clock, self._count, self._emit = now, clock, count, emit
        self.broker: Broker | None = None  # minted tokens, in this process's memory only (egress_proxy/credentials)
        self._tls: ssl.SSLContext | None = None  # the token endpoints' TLS: verified, for the endpoint's name

    def setup(self, *, tls: ssl.SSLContext, clock: Callable[[], float]) -> None:
        """The token endpoints' TLS context; the broker, made once (with the clock it keeps)."""
        if self.broker is None:
            self.broker = Broker(self._custody, clock=clock)
        self._tls = tls

    # -- attach ----------------------------------------------------------------------------------

    async def attach(self, state: FlowState) -> Attached | None:
        """What a request carrying a connection's credential carries (None: sandbox traffic carries nothing)."""
        decision, lease, policy = state.decision, state.lease, state.policy
        carrier = carrier_of(lease, decision) if decision is not None and lease is not None else None
        if carrier is None or policy is None:
            return None
        connection = policy.artifact.connection(carrier)
        if connection is None or self.broker is None:
            return None  # prepare() denies it
        address = custody_address(policy.artifact.workspace, connection.name, connection.credential_handle)
        attached = await self.broker.attach(address, connection, MintCall(self, policy))
        state.attached, state.address = attached, address
        return attached

    def rejected(self, state: FlowState) -> None:
        """The upstream answered 401 to what this flow carried: a minted token is forgotten (the next request mints)."""
        if state.attached is not None and state.address is not None and self.broker is not None:
            self.broker.rejected(state.address, state.attached)

    async def fetch(self, policy: Policy, conn: Any, request: TokenRequest, call: MintCall) -> Reply:
        """The edge's own request to a connection's token endpoint, held to that connection's worker like any request of
        it: the name resolved here, every answer judged (`core.mint_verdict`), the first one dialled (pinned: no second
        lookup), TLS verified for the name, no redirect followed. A call that gets no reply is audited here; one that
        does, once the kind has read it (`MintCall.report`): one `mint` event either way, its status, never a token or
        a body."""
        mint = conn.mint
        host, port, path = mint.token_host, mint.token_port, mint.token_path
        call.started = self._now()
        try:
            try:
                ips = tuple(await self._resolve(host, port))
            except Exception as exc:
                raise MintFailed(f"the token endpoint `{host}` did not resolve ({exc.__class__.__name__})") from None
            judged = judge_token_answers(policy.artifact, conn.name, ips)
            if not judged.allowed:
                call.answer_reason = judged.reason
                raise MintFailed(f"the token endpoint `{host}` resolved to an address the connection's worker refuses ({judged.reason})")
            dial = self._dial(host, port, ips)
            if dial is None:
                raise MintFailed("the token endpoint is this proxy")
            assert self._tls is not None
            return await exchange(dial=dial, host=host, port=port, path=path, request=request, context=self._tls)
        except MintFailed as exc:
            call.report(conn, None, exc)
            raise

    def audit(self, call: MintCall, conn: Any, reply: Reply | None, error: CredentialError | None) -> None:
        """One mint call's `mint` event: its endpoint, status and outcome (never a token or a body)."""
        mint = conn.mint
        event = Event.of({"kind": "mint", "connection": conn.name, "credential_kind": conn.kind, "host": mint.token_host,
                          "port": mint.token_port, "path": mint.token_path, "decision": "deny" if error else "allow",
                          "reason": error.reason if error else "minted", "status": reply.status if reply else None,
                          **({"detail": error.message} if error is not None else {}),
                          **({"answer_reason": call.answer_reason} if call.answer_reason is not None else {})})
        self._count(event["decision"], event["reason"], self._now() - call.started, "mint")
        self._emit(event)

    # -- the head that goes upstream -------------------------------------------------------------

    def prepare(self, flow: http.HTTPFlow, state: FlowState, attached: Attached | None, body: bool) -> str | None:
        """The head the upstream gets (called at the end of requestheaders: a streamed head leaves right after); `body`:
        a body follows. The reason to deny it instead, or None. Raises CredentialError from a signature."""
        req = flow.request
        decision, lease, policy = state.decision, state.lease, state.policy
        if decision is None or lease is None or policy is None or not decision.allowed:
            return "internal-error"  # INVARIANT: only decided flows go upstream
        framing = upstream_framing(req, body)
        # `Expect: 100-continue` is answered by mitmproxy right after this hook (and removed, so it never goes upstream):
        # kept on the rebuilt head, or a client that waits for the 100 before its body would wait for nothing.
        if (req.headers.get("expect") or "").strip().lower() == "100-continue" and body:
            framing.append((b"expect", b"100-continue"))
        carrier = carrier_of(lease, decision)
        if carrier is None:
            # Sandbox traffic: the end-to-end headers decide() kept, framing recomputed. No credential.
            fields = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape")) for k, v in decision.forward_headers]
            req.headers = http.Headers(fields)
            req.host_header = authority(state.host or req.host, state.port or req.port, req.scheme)
            if not req.is_http2:
                req.authority = ""  # origin-form upstream, as for connection traffic
            req.headers.fields = (*req.headers.fields, *framing)
            return None
        # Connection traffic, or a profile's request brokered as that connection's traffic (decision.broker): its
        # allowlisted headers, its one credential from custody, and below, its needles for the response scan.
        connection = policy.artifact.connection(carrier)
        if connection is None:
            return "lease-unknown-subject"
        inject = decision.inject_header or connection.inject.header
        if attached is None:
            return "internal-error"  # INVARIANT: connection traffic carries its credential
        client_payload = req.headers.get("x-amz-content-sha256")  # the client's payload mode, for a re-signing kind
        fields = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape")) for k, v in decision.forward_headers
                  if k.lower() != inject.lower() and k.lower() not in ("host", "content-length", "transfer-encoding")]
        state.injected = attached.needles
        if attached.value is not None:
            # INVARIANT: the only place the credential's bytes are revealed; it lives in this header until sent.
            fields.append((inject.encode("ascii"), attached.value))
        req.headers = http.Headers(fields)
        req.host_header = authority(state.host or req.host, state.port or req.port, "https")
        if not req.is_http2:
            req.authority = ""  # origin-form upstream: the judged Host is the only authority the upstream sees
        req.headers.fields = (*req.headers.fields, *framing)
        if attached.sign is not None:
            state.signing = (attached, client_payload)
            if not state.buffered:
                self.sign(flow, state, None)  # nothing to hash (no body, or a payload the service takes unsigned)
        return None

    def sign(self, flow: http.HTTPFlow, state: FlowState, body: bytes | None) -> None:
        """A signing kind's headers on the request as it leaves (its head final; `body` when the signature hashes it)."""
        attached, client_payload = state.signing
        state.signing = None
        req = flow.request
        view = SignView(method=req.data.method.decode("ascii", "replace"), host=state.host or req.host, port=state.port or req.port,
                        target=req.path, headers=[(k, v) for k, v in req.headers.items(multi=True)], client_payload=client_payload)
        signed = attached.sign(view, body if attached.hash_body else None, self._clock())
        # INVARIANT: the signature and the signing headers the edge wrote are the only ones the upstream gets.
        req.headers.fields = (*req.headers.fields, *((k.encode("ascii"), v.encode("ascii")) for k, v in signed))
