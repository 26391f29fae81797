"""The response path of the addon: heads judged and cleaned, bodies of credentialed traffic scanned as they
stream (`egress_proxy.edge.scanner`), failures answered with our own JSON, never upstream bytes.

`ResponsePath` answers mitmproxy's `responseheaders`, `response` and `error` (rows of `EgressLaw`'s hook table). It
takes from the addon, at construction: the flow states (it records on them, and `error` makes one for a flow no hook
saw), the limits (an HTTP/2 flow's meter), the `Attacher` (told of a minted token an upstream refused), `Upstreams`
(closes an upstream connection it doubts), and two of the addon's functions: `now` and `finish` (the flow's closing
audit event). Its caps (`caps`) are set by the addon's
`configure`; the needles it prepares are cached here, per credential.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mitmproxy import flow as flow_module
from mitmproxy import http
from mitmproxy.net.http.http1 import expected_http_body_size

from egress_proxy.decision.bodies import BodyError, media_type
from egress_proxy.edge import layers
from egress_proxy.edge.denials import (
    error_answer,
)
from egress_proxy.edge.flowcontrol import when_settled
from egress_proxy.edge.flows import (
    AUDITED,
    FlowState,
    carrier_of,
    deny,
    log_internal,
    printable,
)
from egress_proxy.edge.scanner import (
    BodyScanner,
    Needles,
    Redactor,
    ScanError,
    codings,
    redact,
    scan_whole,
)

log = logging.getLogger("egresslaw.proxy")


REDIRECT_HEADER = "X-Egresslaw-Redirect"

SMALL_BODY = 64 * 1024  # a credentialed body declared this small is buffered and scanned whole, not streamed

HELD_ANSWER = 64 * 1024 * 1024  # a filtered JSON answer is held whole to at most this (less when its response cap is less)

OUR_PREFIX = b"x-egresslaw-"

FIELD_BREAK = re.compile(rb"[\r\n\x00]")


def mark_response_headers(resp: http.Response) -> None:
    """Strip `X-Egresslaw-*` an upstream sent (they are ours to set), make every CR, LF or NUL inside a header value or
    the reason phrase a SP (an obs-fold, or a bare CR many clients end a line at: RFC 9112 §2.2, §5.2), and mark a 3xx
    as not followed."""
    fields = [(k, v) for k, v in resp.headers.fields if not k.lower().startswith(OUR_PREFIX)]
    broken = any(FIELD_BREAK.search(v) for _, v in fields)
    if broken:
        fields = [(k, FIELD_BREAK.sub(b" ", v)) for k, v in fields]
    if broken or len(fields) != len(resp.headers.fields):
        resp.headers = http.Headers(fields)
    if resp.data.reason and FIELD_BREAK.search(resp.data.reason):
        resp.data.reason = FIELD_BREAK.sub(b" ", resp.data.reason)
    if 300 <= resp.status_code < 400:
        resp.headers[REDIRECT_HEADER] = "not-followed"


@dataclass(frozen=True, slots=True)
class ResponseCaps:
    """The caps on a credentialed response body (None: none): as received (`--max-response`, overridden for one
    CONNECTION/RULE by `--rule-max-response`) and once decoded (`--max-decoded`)."""

    received: int | None
    decoded: int | None
    per_rule: Mapping[str, int | None] = MappingProxyType({})

    def received_for(self, state: FlowState) -> int | None:
        """The cap on what this flow's response may bring, as received."""
        rule = state.decision.rule if state.decision is not None else None
        connection = carrier_of(state.lease, state.decision) if state.lease is not None else None
        return self.per_rule.get(f"{connection}/{rule}", self.received)


def filter_of(state: FlowState) -> Any:
    """What a flow's answer must go through (`bodies.ToolsFilter`), None when it passes as the upstream sent it."""
    decision = state.decision
    return decision.answer_filter if (decision is not None and decision.allowed) else None


def has_response_body(req: http.Request, resp: http.Response) -> bool:
    try:
        return expected_http_body_size(req, resp) != 0
    except ValueError:
        return True


class ResponsePath:
    """The response hooks: heads judged and cleaned, credentialed bodies scanned, failures answered and recorded.

    Connection traffic streams through egress_proxy.edge.scanner: every coding undone, the credential redacted (a
    window catches a needle split across chunks), sizes capped. Headers, the reason phrase and the codings are judged
    in responseheaders, before the head goes out; a response refused there gets our JSON 502 instead (its upstream
    connection is closed). A failure after the head went out (a cap, a corrupt coding) cuts the client connection:
    the client sees a truncated body, never a clean end and never an unredacted byte. What the client got is recorded
    on FlowState."""

    def __init__(self, *, flows: dict[str, FlowState], limits: Any, attacher: Any, upstreams: Any, now: Callable[[], float],
                 finish: Callable[..., None], caps: ResponseCaps) -> None:
        self._flows = flows  # the addon's flow states (a flow's closing event, `finish`, forgets it)
        self.limits = limits  # edge.limits.Limits: an HTTP/2 flow's meter (what its client was framed)
        self.attacher = attacher  # edge.attach.Attacher: told when an upstream refuses a minted token (401)
        self.upstreams = upstreams  # edge.upstreams.Upstreams: closes an upstream connection this side doubts
        self._now, self._finish = now, finish
        self.caps = caps  # the caps on a credentialed body, as received (per rule) and once decoded
        self._needle_sets: collections.OrderedDict[tuple[bytes, ...], Needles] = collections.OrderedDict()  # a few credentials' prepared needles

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        resp = flow.response
        if resp is None or (state is not None and state.denied):
            return  # our own denial: nothing to clean, and its X-Egresslaw-Deny must stay
        try:
            mark_response_headers(resp)
            if state is None:
                resp.stream = False
                return
            if state.lease is not None and carrier_of(state.lease, state.decision) is None:
                # Sandbox traffic carries no credential: stream it (package downloads can be large), counting bytes.
                def count(chunk: bytes) -> bytes:
                    state.streamed += len(chunk)
                    return chunk

                resp.stream = count
                state.head_sent = True
                return
            if resp.status_code == 401:
                self.attacher.rejected(state)  # a minted token refused: the next request mints
            self._scan_head(flow, state)
            self._start_body_scan(flow, state)
        except Exception:
            log_internal("internal error in responseheaders; the response will be replaced by a denial")
            resp.stream = False  # INVARIANT: never streamed unscanned
            if state is not None:
                state.failed = True
                self.upstreams.close_upstream(flow)

    def _scan_head(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Redact the credential from header names, values and the reason phrase."""
        resp = flow.response
        assert resp is not None
        state.head_scanned = True
        needles = self._prepared(flow, state)
        if not needles:
            return
        cleaned, hits = [], 0
        for k, v in resp.headers.fields:
            k2, hits_k = redact(k, needles)
            v2, hits_v = redact(v, needles)
            hits += hits_k + hits_v
            cleaned.append((k2, v2))
        if hits:
            resp.headers = http.Headers(cleaned)
        reason, hits_r = redact(resp.data.reason or b"", needles)
        if hits_r:
            resp.data.reason = reason
        state.redactions += hits + hits_r

    def _start_body_scan(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Stream the body through a BodyScanner, or refuse the response before its head goes out."""
        resp, req = flow.response, flow.request
        assert resp is not None
        if not has_response_body(req, resp):
            return  # HEAD, 1xx, 204, 304, Content-Length 0: nothing to stream
        limit = self.caps.received_for(state)
        declared = resp.headers.get("content-length", "")
        answer_filter = filter_of(state)
        try:
            order = codings(resp.headers.get("transfer-encoding"), ", ".join(resp.headers.get_all("content-encoding")))
            if limit is not None and declared.isdigit() and int(declared) > limit:
                raise ScanError("response-too-large")
            if answer_filter is not None and order:
                raise ScanError("response-coding-unsupported")  # asked for `identity`: a coded answer cannot be filtered
            scan = BodyScanner(self._prepared(flow, state), order, max_received=limit, max_decoded=self.caps.decoded)
        except ScanError as exc:
            return self._refuse(flow, state, exc.reason)
        sse = None
        if answer_filter is not None:
            try:
                media = media_type(tuple(resp.headers.items(multi=True)))
            except BodyError:
                return self._refuse(flow, state, "response-coding-unsupported")  # two content types: read neither way
            if media == "application/json":
                # Held whole (to HELD_ANSWER or the smaller response cap), filtered and scanned in `response`: a failure is still our refusal.
                resp.stream = False
                self.limits.hold_response(flow, min(limit if limit is not None else (self.caps.decoded or HELD_ANSWER), HELD_ANSWER))
                return
            if media == "text/event-stream":
                sse = answer_filter.sse()  # event by event, as they come: the filter first, then the scanner
        if sse is None and declared.isdigit() and int(declared) <= SMALL_BODY:
            resp.stream = False  # small: buffered, scanned whole in `response` (one write fewer, and a failure is still a 502)
            return
        # The client gets the decoded, redacted body: no coding, and a length nobody knows in advance.
        for name in ("content-length", "content-encoding", "transfer-encoding"):
            if name in resp.headers:
                del resp.headers[name]
        if not (req.is_http2 or req.is_http3):
            if req.http_version == "HTTP/1.0":
                resp.headers["connection"] = "close"  # close-delimited, as an HTTP/1.0 client expects
            else:
                resp.headers["transfer-encoding"] = "chunked"
                if resp.http_version == "HTTP/1.0":
                    resp.http_version = "HTTP/1.1"
        head_hits = state.redactions

        def stream(chunk: bytes) -> list[bytes]:
            # mitmproxy calls this per received chunk, and once with b"" at the end of the message.
            if state.failure is not None:
                return []
            try:
                out = scan.feed(chunk) if chunk else scan.finish()
            except ScanError as exc:
                self._abort(flow, state, exc.reason)
                return []
            except Exception:
                log_internal("internal error in the response scan; aborting the response")
                self._abort(flow, state, "internal-error")
                return []
            state.streamed = scan.delivered
            state.redactions = head_hits + scan.redactions
            return [out] if out else []  # never b"": mitmproxy would frame it as the last chunk

        resp.stream = stream if sse is None else self._filtered_stream(flow, state, sse, limit, head_hits)
        state.head_sent = True

    def _filtered_stream(self, flow: http.HTTPFlow, state: FlowState, sse: Any, limit: int | None, head_hits: int) -> Callable[[bytes], list[bytes]]:
        """The stream function of an SSE answer the rule filters: each chunk through the filter (`bodies.SseFilter`:
        whole events out, one event held, 1 MiB at most), then every byte it lets out through the credential
        scanner (the filter re-serializes what it rewrites: the scanner must see its output, not its input). The
        answer is uncoded (refused otherwise), so the scanner is the redactor alone; it is flushed at each event's
        end when no needle holds a line break (then none can span the blank line that ends an event), so an event
        reaches the client whole as soon as it came. A `BodyError` (an event over 1 MiB) cuts the stream."""
        redactor = Redactor(self._prepared(flow, state))
        flushable = not any(b"\r" in n or b"\n" in n for n in state.injected)
        received = 0

        def stream(chunk: bytes) -> list[bytes]:
            nonlocal received
            if state.failure is not None:
                return []
            try:
                received += len(chunk)
                if limit is not None and received > limit:
                    raise ScanError("response-too-large")
                passed = sse.feed(chunk) if chunk else sse.close()
                out = redactor.feed(passed) if passed else b""
                if (passed and flushable) or not chunk:
                    out += redactor.flush()
            except (ScanError, BodyError) as exc:
                self._abort(flow, state, exc.reason)
                return []
            except Exception:
                log_internal("internal error in the filtered response; aborting the response")
                self._abort(flow, state, "internal-error")
                return []
            state.streamed += len(out)
            state.redactions = head_hits + redactor.hits
            return [out] if out else []  # never b"": mitmproxy would frame it as the last chunk

        return stream

    def refuse_held(self, flow: http.HTTPFlow, reason: str) -> None:
        """limits.py cut an answer held whole past its limit (its head never went out): `response` answers `reason`."""
        state = self._flows.get(flow.id)
        if state is not None and state.failure is None:
            state.failure = reason
            log.warning("refused a response from %s: %s", printable(state.host), reason)

    def _prepared(self, flow: http.HTTPFlow, state: FlowState) -> Needles:
        if state.needles is None:
            key = state.injected
            prepared = self._needle_sets.get(key)
            if prepared is None:
                prepared = self._needle_sets[key] = Needles(key)
                if len(self._needle_sets) > 64:
                    self._needle_sets.popitem(last=False)
            state.needles = prepared
        return state.needles

    def _refuse(self, flow: http.HTTPFlow, state: FlowState, reason: str) -> None:
        """Refuse a response before its head goes out: buffer nothing more, answer 502 with `reason`."""
        state.failure = reason
        if flow.response is not None:
            flow.response.stream = False
        self.upstreams.close_upstream(flow)
        log.warning("refused a response from %s: %s", printable(state.host), reason)

    def _abort(self, flow: http.HTTPFlow, state: FlowState, reason: str) -> None:
        """A streamed response failed after its head went out: stop, close upstream, cut the client off."""
        state.failure = reason
        state.aborted = True
        self.upstreams.close_upstream(flow)
        log.warning("aborted a response from %s after %d bytes: %s", printable(state.host), state.streamed, reason)

    def response(self, flow: http.HTTPFlow) -> None:
        state = self._flows.get(flow.id)
        if state is None:
            return
        streamed = flow.response is not None and bool(flow.response.stream)
        try:
            if state.failed:
                raise RuntimeError("responseheaders failed")
            if state.aborted:
                self._cut(flow, state)
            elif state.denied:
                pass  # our own answer (a denial, or a 503 after the decision event could not be written) stays
            elif state.failure is not None:
                self._answer_failure(flow, state, state.failure)
            elif not self._filter_whole(flow, state):
                self._clean_response(flow, state)
            if flow.server_conn is not None and layers.doubtful(flow.server_conn.id):
                self.upstreams.close_upstream(flow)  # it sent an interim answer: never reused
        except Exception:
            if streamed:
                log_internal("internal error in response after streaming; cutting the connection")
                state.failure = state.failure or "internal-error"
                self._cut(flow, state)
            else:
                log_internal("internal error in response; replacing it with a denial")
                state.denied = False
                deny(flow, state, "internal-error")
        try:
            state.status = flow.response.status_code if flow.response is not None else None
            state.answered = True
        except Exception:
            log_internal("internal error while recording a response")
        meter = self.limits.meter_of(flow)
        if meter is None or not when_settled(meter, lambda complete: self._delivered(flow, complete)):
            self._finish(flow, kind="request")

    def _delivered(self, flow: http.HTTPFlow, complete: bool) -> None:
        """An HTTP/2 response's end went out (`complete`) or its stream was reset first: its outcome is written now,
        with what was framed for the client (egress_proxy.edge.flowcontrol)."""
        state = self._flows.get(flow.id)
        if state is not None and not complete:
            state.aborted = True  # the client has the head and part of the body at most
            state.failure = state.failure or "client-disconnected"
        self._finish(flow, kind="request")

    def _cut(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """The head went out, the body cannot be completed: kill the flow (no last chunk, connection closed)."""
        state.aborted = True
        state.denied = True
        state.reason = state.failure or "internal-error"
        self.upstreams.close_upstream(flow)
        if flow.killable:
            flow.kill()

    def _answer_failure(self, flow: http.HTTPFlow, state: FlowState, reason: str) -> None:
        """Our JSON 502 in place of an upstream answer we refused (nothing of it went out)."""
        state.denied = True
        state.reason = reason
        body, headers = error_answer(502, reason)
        headers["Connection"] = "close"
        flow.response = http.Response.make(502, body, headers)
        state.injected = ()

    def _filter_whole(self, flow: http.HTTPFlow, state: FlowState) -> bool:
        """A JSON answer held for its filter (`bodies.ToolsFilter.json`): rewritten before the scan sees it, its length
        set; True when it was refused instead (a `BodyError`: the client gets our refusal naming it)."""
        resp = flow.response
        answer_filter = filter_of(state)
        if answer_filter is None or resp is None or resp.stream or not resp.raw_content:
            return False
        try:
            if media_type(tuple(resp.headers.items(multi=True))) != "application/json":
                return False
            if resp.headers.get_all("content-encoding") and codings(None, ", ".join(resp.headers.get_all("content-encoding"))):
                raise ScanError("response-coding-unsupported")  # (refused at its head already; never filtered coded)
            body = answer_filter.json(resp.raw_content)
        except (BodyError, ScanError) as exc:
            log.warning("refused a response from %s: %s", printable(state.host), exc.reason)
            self._answer_failure(flow, state, exc.reason)
            return True
        if body is not resp.raw_content:
            resp.raw_content = body
        if "transfer-encoding" in resp.headers:
            del resp.headers["transfer-encoding"]
        resp.headers["content-length"] = str(len(body))
        return False

    def _clean_response(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """A response that was not streamed (no body, or a whole one): the same scan, in one go."""
        resp = flow.response
        assert resp is not None
        if resp.trailers:
            resp.trailers = None  # never passed on (HTTP/2 trailers of a streamed response are sent after this hook)
        if resp.stream:
            return  # streamed: cleaned in responseheaders and as it went
        mark_response_headers(resp)
        needles = self._prepared(flow, state)
        if needles and not state.head_scanned:
            self._scan_head(flow, state)
        if resp.raw_content and (needles or resp.headers.get("content-encoding")):
            try:
                order = codings(resp.headers.get("transfer-encoding"), ", ".join(resp.headers.get_all("content-encoding")))
                body, hits = scan_whole(needles, order, resp.raw_content, max_received=self.caps.received_for(state), max_decoded=self.caps.decoded)
            except ScanError as exc:
                return self._answer_failure(flow, state, exc.reason)
            changed = bool(hits)
            for name in ("content-encoding", "transfer-encoding"):
                if name in resp.headers:
                    del resp.headers[name]
                    changed = True
            if changed or body is not resp.raw_content or resp.headers.get_all("content-length") != [str(len(body))]:
                resp.set_content(body)  # (otherwise it would set the same bytes and the same content-length)
            state.redactions += hits
        if state.redactions:
            log.warning("redacted %d credential occurrence(s) in a response from %s", state.redactions, printable(state.host))

    def error(self, flow: http.HTTPFlow) -> None:
        try:
            if flow.metadata.get(AUDITED):
                return
            state = self._flows.get(flow.id)
            if state is None:
                state = FlowState(started=self._now(), flow=flow)
                self._flows[flow.id] = state
            if state.reason in (None, "allowed"):
                # A request-side error: the client went (closed, reset its stream), not the upstream; unless mitmproxy's
                # inactivity timeout closed the client connection, reported the same way: then the upstream hung.
                cid = flow.client_conn.id
                left = state.error_code is not None and not state.error_to_client and not layers.timed_out(cid)
                # A body a request shape waits for (held, nothing of it upstream): whatever ended it, the client did not
                # send its request (it left, or the inactivity timeout found its body stalled); never the upstream.
                left = left or state.judging is not None
                state.reason = state.failure or ("client-stalled" if layers.stalled(cid) else "client-disconnected" if left else "upstream-error")
                state.denied = True
            self._record_error_answer(flow, state)
        except Exception:
            log_internal("internal error in error")
        self._finish(flow, kind="request")

    def _record_error_answer(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """What the client gets after a protocol error: the head already sent and a cut body, our JSON page
        (mitmproxy writes it right after this hook, see egress_proxy.edge.layers), or nothing at all."""
        resp = flow.response
        killed = flow.error is not None and flow.error.msg == flow_module.Error.KILLED_MESSAGE
        if state.head_sent and resp is not None:
            state.status, state.aborted = resp.status_code, True
        elif state.error_code is not None and state.error_to_client and not killed:
            state.status = state.error_code.http_status_code()
        else:
            state.status = None  # killed, or the client went away: it gets no answer
        state.answered = True

