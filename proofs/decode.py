"""Counterexamples as domain objects: a request line, resolved addresses, the header, rule and setting responsible.

`proofs.inputs.concretize` turns a model into the `Request` and answers; this module holds the
counterexample record and the renderings every report, diff and replay shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from egress_proxy.decision.types import Request


@dataclass(frozen=True)
class Counterexample:
    """A violation in domain terms. Every field is plain data; `summary` is the one-line story."""

    summary: str
    request: Request | None = None
    resolved_ips: tuple[str, ...] = ()
    ip_range: dict[str, str] | None = None  # the special-purpose entry the address (or its embedding) falls in
    header: str | None = None
    redirect_chain: tuple[dict[str, Any], ...] = ()
    rule: str | None = None
    setting: str | None = None
    decision: dict[str, Any] | None = None  # what decide() answered on replay
    old_decision: dict[str, Any] | None = None  # no-widening: what the previous artifact answered
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "request": request_dict(self.request) if self.request is not None else None,
            "resolved_ips": list(self.resolved_ips),
            "ip_range": self.ip_range,
            "header": self.header,
            "redirect_chain": list(self.redirect_chain),
            "rule": self.rule,
            "setting": self.setting,
            "decision": self.decision,
            "old_decision": self.old_decision,
            **({"extra": self.extra} if self.extra else {}),
        }


def request_line(req: Request) -> str:
    default = {"https": 443, "http": 80}.get(req.scheme)
    host = f"[{req.host}]" if ":" in req.host else req.host
    port = "" if req.port == default else f":{req.port}"
    return f"{req.method} {req.scheme}://{host}{port}{req.target}"


def request_dict(req: Request) -> dict[str, Any]:
    return {
        "line": request_line(req),
        "method": req.method,
        "scheme": req.scheme,
        "host": req.host,
        "port": req.port,
        "target": req.target,
        "headers": [[n, v] for n, v in req.headers],
        "host_header": req.host_header,
        "has_body": req.has_body,
    }


def request_from_dict(d: dict[str, Any]) -> Request:
    return Request(
        method=d["method"],
        scheme=d["scheme"],
        host=d["host"],
        port=d["port"],
        target=d["target"],
        headers=tuple((n, v) for n, v in d.get("headers", ())),
        host_header=d.get("host_header"),
        has_body=bool(d.get("has_body", False)),
    )


def decision_dict(decision) -> dict[str, Any]:
    return {
        "allowed": decision.allowed,
        "reason": decision.reason,
        "rule": decision.rule,
        "broker": decision.broker,
        "forward_headers": [n for n, _ in decision.forward_headers],
        "inject_header": decision.inject_header,
    }


def side(d: dict[str, Any]) -> str:
    """One decision (as `decision_dict`), in words: `DENY (reason)`, `ALLOW (rule r)`, `ALLOW (brokered by c, rule r)`."""
    if not d["allowed"]:
        return f"DENY ({d['reason']})"
    if d.get("broker"):
        return f"ALLOW (brokered by `{d['broker']}`, rule `{d['rule']}`)"
    return f"ALLOW (rule `{d['rule']}`)" if d["rule"] else "ALLOW"


def decision_side(decision) -> str:
    return side(decision_dict(decision))


def decision_widens(new, old) -> bool:
    """`proofs.model.widens` on two replayed decisions of one request (a connection's `broker` is None on both)."""
    if not new.allowed:
        return False
    return not (old.allowed and (new.broker is None or new.broker == old.broker))
