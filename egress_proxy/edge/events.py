"""The audit trail of the addon: one decision event written ahead of forwarding, one closing event per flow,
counted for `/metrics`; never a header value or a credential in either.

`AuditTrail` is mixed into `EgressLaw` (`egress_proxy.edge.addon`); what it takes from it is declared, all of it, by
`egress_proxy.edge.flows.AuditHost`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from mitmproxy import http

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditUnavailable
from egress_proxy.decision.core import is_token
from egress_proxy.decision.types import Lease
from egress_proxy.edge.flows import (
    AUDITED,
    FlowState,
    carrier_of,
    deny,
    log_internal,
    printable,
)

log = logging.getLogger("egresslaw.proxy")

# The fields of a per-request log line (JSON logs carry them as keys; text logs keep the one-line message): an
# operator filters on them, and `event_id` is the `id` of the audit event the line reports. Never a header value,
# a lease or a credential: only what the audit event itself holds.
LOG_FIELDS = ("kind", "decision", "reason", "failure", "subject", "profile", "connection", "rule", "broker", "host", "port",
              "method", "path", "status", "duration_ms", "bytes_up", "bytes_down", "redactions")


MAX_HEADER_NAMES = 32


def header_names(request: http.Request) -> list[str]:
    """The distinct header names of `request`, lowercased and sorted (HTTP tokens of at most 64 characters only)."""
    names = {name.lower() for name in request.headers.keys()}
    return sorted(n for n in names if len(n) <= 64 and is_token(n))[:MAX_HEADER_NAMES]


def lease_detail(state: FlowState) -> dict[str, Any]:
    """What a lease denial's event adds: the scheme offered (never the token)."""
    return {"auth": state.auth} if (state.auth is not None and (state.reason or "").startswith("lease-")) else {}


def event_id() -> str:
    """An id for an event that has no flow (a TLS, TCP or head-level refusal): its log line names the same one."""
    return uuid.uuid4().hex


class AuditTrail:
    """Writing the addon's events (a mixin of `EgressLaw`: `self` is the addon, a `flows.AuditHost`)."""

    async def _write_ahead(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> None:
        """Write this allowed flow's decision event before anything goes upstream: appended to the file by `emit`
        itself (with `--audit-sync request`, also fsync'd: a bounded wait); deny with 503 when the proxy is draining
        or the audit log cannot be written, so nothing is ever forwarded unaudited."""
        audit = self.audit
        if self.draining_since is not None and state.started >= self.draining_since:
            return deny(flow, state, "draining")
        if audit is None or not audit.writable:
            return deny(flow, state, "audit-unavailable")
        event = self._event(flow, state, kind)
        state.audit_ticket = self._emit(event, durable=True)
        if state.audit_ticket is None:
            return deny(flow, state, "audit-unavailable")
        try:
            await audit.written(state.audit_ticket)
        except AuditUnavailable:
            state.failure = "audit-unavailable"
            return deny(flow, state, "audit-unavailable")
        if event["decision"] == "would-deny":  # observe mode: written, so forwarded; and said so on every request
            self._log_event(logging.WARNING, event, "would-deny %s %s %s:%s%s (profile `%s` in observe mode)", event["reason"],
                            printable(flow.request.method), printable(state.host), state.port, printable(state.path or ""),
                            printable(event["profile"] or "-"))
            if self.metrics is not None:
                self.metrics.would_deny(kind, event["reason"])

    def _fail(self, state: FlowState, failure: str, reason: str) -> None:
        """A flow that ends without its response: `failure` for the outcome of an allow, `reason` for an undecided flow."""
        if state.audit_ticket is not None:
            state.failure = state.failure or failure
        elif not state.denied:
            state.denied = True
            state.reason = reason

    def _finish(self, flow: http.HTTPFlow, *, kind: str) -> None:
        """Queue this flow's closing event (its denial, or the outcome of its allow), count it, forget its state."""
        state = self._flows.pop(flow.id, None)
        if state is None:
            return
        flow.metadata[AUDITED] = True  # a flag only: no lease, no credential in metadata
        try:
            self._scrub(flow, state)
            if state.audit_ticket is None:
                event = self._event(flow, state, kind)
                if event["decision"] == "deny":
                    self._log_event(logging.INFO, event, "deny %s %s %s:%s%s%s", event["reason"], printable(flow.request.method),
                                    printable(state.host), state.port, printable(state.path or ""),
                                    "".join(f" (offered {v})" for v in lease_detail(state).values()))
            else:
                event = self._outcome(flow, state, kind)
                if log.isEnabledFor(logging.DEBUG) or event["failure"]:
                    whole = {**self._who(state.lease), "method": flow.request.method, "host": state.host, "port": state.port,
                             "path": None if kind == "connect" else state.path, **event.record(), "kind": kind}
                    self._log_event(logging.INFO if event["failure"] else logging.DEBUG, whole, "allow %s %s:%s%s -> %s%s",
                                    printable(flow.request.method), printable(state.host), state.port, printable(state.path or ""),
                                    event["status"] if event["status"] is not None else "-",
                                    f" ({event['failure']})" if event["failure"] else "")
            self._count(event["decision"], event["reason"], event["duration_ms"] / 1000, kind)
            if self.metrics is not None:
                self.metrics.closed(kind, event)
        except Exception:
            log_internal("internal error while auditing a flow")
            self._count("deny", "internal-error", 0.0, kind)
            event = Event.decided(kind, flow.id, None, "deny", "internal-error")
            if state.audit_ticket is not None:
                event = Event.outcome(kind, flow.id, failure="internal-error")
        self._emit(event)

    def _log_event(self, level: int, event: Event | dict[str, Any], message: str, *args: Any) -> None:
        """One per-request log line for `event`: the message as text, and in JSON logs `event_id` plus LOG_FIELDS."""
        if not log.isEnabledFor(level):
            return
        fields = {key: event.get(key) for key in LOG_FIELDS if event.get(key) is not None}
        log.log(level, message, *args, extra={"event_id": event.get("id"), **fields})

    def _event(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> Event:
        observed = state.decision.observed if (state.decision is not None and not state.denied) else None
        decision = "deny" if state.denied else ("would-deny" if observed else "allow")
        reason = observed or state.reason or ("internal-error" if state.denied else "allowed")
        final = state.denied  # an allow's status, bytes and redactions come in its outcome event
        up, down = self._bytes(flow, state, kind) if final else (0, 0)
        return Event.decided(
            kind, flow.id, state.lease, decision, reason,
            method=flow.request.method,
            scheme="https" if kind == "connect" else flow.request.scheme,
            host=state.host,
            port=state.port,
            path=None if kind == "connect" else state.path,
            tunnel=state.tunnel,
            rule=state.decision.rule if (state.decision is not None and not state.denied) else None,
            broker=state.decision.broker if (state.decision is not None and not state.denied) else None,
            status=self._client_status(flow, state) if final else None,
            bytes_up=up,
            bytes_down=down,
            duration_ms=self._elapsed_ms(state),
            redactions=state.redactions if final else 0,
            **lease_detail(state),
            **({"detail": state.detail} if (final and state.detail) else {}),  # a request shape's denial: the rule and the place
            **({"budget": state.budget.event()} if (final and state.budget is not None) else {}),  # the cap, never a request value
            # what `egresslaw propose` needs to write a rule's header allowlist: the names (never a value) a denied or
            # observed request sent, lowercased, token names only, at most MAX_HEADER_NAMES of at most 64 characters
            **({"headers": header_names(flow.request)} if kind == "request" and decision != "allow" else {}),
        )

    def _outcome(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> Event:
        failure = state.failure or (state.reason if state.denied else None)
        status = self._client_status(flow, state)
        if kind == "connect" and status is None and failure is None:
            status = 200  # mitmproxy answers an accepted CONNECT itself
        up, down = self._bytes(flow, state, kind)
        return Event.outcome(
            kind, flow.id,
            rule=state.decision.rule if state.decision is not None else None,
            broker=state.decision.broker if state.decision is not None else None,
            status=status,
            failure=failure,
            aborted=state.aborted,  # the client got a head and a cut body
            error=state.error_code.name.lower().replace("_", "-") if state.error_code is not None else None,  # mitmproxy's code
            bytes_up=up,
            bytes_down=down,
            duration_ms=self._elapsed_ms(state),
            redactions=state.redactions,
        )

    def _client_status(self, flow: http.HTTPFlow, state: FlowState) -> int | None:
        if state.answered:  # the response side recorded what the client got (a cut body, our 502, nothing)
            return state.status
        if state.client_status is not None:
            return state.client_status
        return flow.response.status_code if flow.response is not None else None

    def _bytes(self, flow: http.HTTPFlow, state: FlowState, kind: str) -> tuple[int, int]:
        if kind == "connect":
            return 0, 0
        meter = self.limits.meter_of(flow)
        if meter is not None:
            down = meter.sent  # HTTP/2: the body bytes framed for the client, what its flow control let it take
        else:
            down = (len(flow.response.raw_content or b"") + state.streamed) if flow.response is not None else state.streamed
        return len(flow.request.raw_content or b"") + state.uploaded, down

    def _elapsed_ms(self, state: FlowState) -> float:
        return round(max(0.0, self._now() - state.started) * 1000, 3)

    def _scrub(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """Remove the injected credential from the flow object once it has been sent (or not)."""
        carrier = carrier_of(state.lease, state.decision) if state.lease is not None else None
        if carrier is None or state.policy is None:
            return
        connection = state.policy.artifact.connection(carrier)
        if connection is not None and connection.inject.header in flow.request.headers:
            flow.request.headers[connection.inject.header] = "[REDACTED]"

    def _who(self, lease: Lease | None) -> dict[str, Any]:
        return {
            "subject": lease.subject if lease else None,
            "profile": lease.profile if lease else None,
            "connection": lease.connection if lease else None,
        }

    def _emit(self, event: Event, *, durable: bool = False) -> int | None:
        """Queue one event (`durable`: a request will wait for it) with what every event says of the policy in force;
        its ticket, or None when the log is closed or already holds too much."""
        if self.audit is None:
            return None
        policy = self.policy
        context: dict[str, Any] = {} if "artifact" in event else {"artifact": policy.artifact.digest if policy else None}
        if policy is not None and not policy.proved:
            context["unproven"] = True
        if self.test_routing:
            context["test_routing"] = self.test_routing
        event = event.with_(**context)
        try:
            return self.audit.emit(event, durable=durable)
        except AuditUnavailable as exc:  # held events beyond the bound are counted by the log (audit-resumed)
            if self.audit.error is None:
                log.error("audit event lost: %s", exc)
            return None

    def _count(self, decision: str, reason: str, elapsed: float, kind: str = "request") -> None:
        if self.metrics is not None:
            self.metrics.observe(kind, decision, reason, elapsed)

