"""The audit event: one typed, frozen value, the only thing `AuditLog.emit` accepts.

Both front ends (the edge's addon, the lane's authorizer and access-log reader), the minting of credentials, the
reloads and the workers write their events through the constructors here, so an event has one spelling wherever
it is made: a `kind` from `KINDS`, a `decision` from `DECISIONS`, a `reason` code, and fields from `FIELDS` only,
each of its declared type. What an event may hold is a header *name*, never a value; a lease or a credential has
no field to go in (a `str` field longer than `MAX_TEXT` is refused too: no blob rides in a name).

    Event.decided("request", flow.id, lease, "deny", "host-not-allowed", host=..., port=..., status=403)
    Event.outcome("request", flow.id, status=200, failure=None, bytes_up=..., ...)
    Event.of({"kind": "reload", "decision": "allow", "reason": "reloaded", "artifact": digest})

The JSON line is `record()`: the same keys and values as before this type existed (verifiers and the SOC's
parsers see the same lines).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from egress_proxy.decision.types import Lease
from egress_proxy.errors import EgressError

KINDS = frozenset({"connect", "request", "tls", "tcp", "connection", "outcome", "mint", "reload", "worker"})
DECISIONS = frozenset({"allow", "deny", "would-deny", "info"})
MAX_TEXT = 4096

_TEXT, _INT, _NUM, _BOOL = (str,), (int,), (int, float), (bool,)
# Every field an event may carry besides kind, id, decision and reason, and the types its value may have (None is
# always allowed). A new field is declared here first: an undeclared one is a programming error, refused at once.
FIELDS: Mapping[str, tuple[type, ...]] = MappingProxyType({
    "subject": _TEXT, "profile": _TEXT, "connection": _TEXT, "method": _TEXT, "scheme": _TEXT, "host": _TEXT, "port": _INT,
    "path": _TEXT, "tunnel": _BOOL, "rule": _TEXT, "broker": _TEXT, "status": _INT, "bytes_up": _INT, "bytes_down": _INT,
    "duration_ms": _NUM, "redactions": _INT, "auth": _TEXT, "headers": (list, tuple), "of": _TEXT, "failure": _TEXT,
    "aborted": _BOOL, "error": _TEXT, "lane": _TEXT, "detail": _TEXT, "artifact": _TEXT, "unproven": _BOOL,
    "test_routing": (dict,), "credential_kind": _TEXT, "answer_reason": _TEXT, "worker": _INT, "workers": _INT, "pid": _INT,
    "peer": _TEXT, "upstream": _TEXT, "sni": _TEXT, "websocket": _BOOL, "undecided": _BOOL, "budget": (dict,),
})
# `budget` (a budget-exceeded denial, docs/budget.md): the cap that had no room, exactly these keys (no request value)
BUDGET_KEYS = {"window": int, "start": int, "resets": int, "cap": str, "limit": int}
BUDGET_CAPS = frozenset({"requests", "bytes"})


class EventError(EgressError, TypeError):
    """An event that does not fit the type: a programming error, never a runtime condition."""


def _checked(name: str, value: Any) -> Any:
    if value is None:
        return None
    kinds = FIELDS.get(name)
    if kinds is None:
        raise EventError(f"audit event field `{name}` is not declared in egress_proxy.audit.event.FIELDS")
    kind = type(value)
    if kind in kinds:  # the exact type declared (the usual case): the checks below without the isinstance walk
        if kind is str:
            if len(value) > MAX_TEXT:
                raise EventError(f"audit event field `{name}` holds {len(value)} characters (at most {MAX_TEXT})")
            return value
        if kind is int or kind is bool or kind is float:
            return value
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise EventError(f"audit event field `{name}` is a {type(value).__name__}, not {'/'.join(k.__name__ for k in kinds)}")
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise EventError(f"audit event field `{name}` holds {len(value)} characters (at most {MAX_TEXT})")
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, str) and len(v) <= 64 for v in value):
            raise EventError(f"audit event field `{name}` must list short names")
        return list(value)
    if isinstance(value, dict):
        if name == "budget" and (set(value) != set(BUDGET_KEYS) or any(type(value[k]) is not t for k, t in BUDGET_KEYS.items())
                                 or value["cap"] not in BUDGET_CAPS):
            raise EventError(f"audit event field `budget` holds exactly {sorted(BUDGET_KEYS)} (cap: requests or bytes)")
        return dict(value)
    return value


@dataclass(frozen=True, slots=True)
class Event:
    """One audit event. Read it like a mapping (`event["reason"]`, `event.get("status")`); change it never: `with_`
    gives a new one."""

    kind: str
    decision: str
    reason: str
    id: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise EventError(f"audit event kind `{self.kind}` is not one of {sorted(KINDS)}")
        if self.decision not in DECISIONS:
            raise EventError(f"audit event decision `{self.decision}` is not one of {sorted(DECISIONS)}")
        if not isinstance(self.reason, str) or not self.reason or len(self.reason) > 64:
            raise EventError("an audit event's reason is a reason code")
        if self.id is not None and (not isinstance(self.id, str) or len(self.id) > 128):
            raise EventError("an audit event's id is a short string")
        object.__setattr__(self, "fields", MappingProxyType({k: _checked(k, v) for k, v in self.fields.items()}))

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Event:
        """From a record's fields (kind, id, decision, reason and declared fields), in their order."""
        rest = {k: v for k, v in record.items() if k not in ("kind", "id", "decision", "reason")}
        return cls(kind=record.get("kind"), decision=record.get("decision"), reason=record.get("reason"),  # type: ignore[arg-type]
                   id=record.get("id"), fields=rest)

    @classmethod
    def decided(cls, kind: str, id: str | None, lease: Lease | None, decision: str, reason: str, **fields: Any) -> Event:
        """A decision about a CONNECT, a request, a TLS hello or a TCP stream, naming who asked (never the lease)."""
        who = {"subject": lease.subject if lease else None, "profile": lease.profile if lease else None,
               "connection": lease.connection if lease else None}
        return cls(kind=kind, decision=decision, reason=reason, id=id, fields={**who, **fields})

    @classmethod
    def outcome(cls, of: str, id: str, **fields: Any) -> Event:
        """How an admitted CONNECT or request ended (`status`, `failure`, bytes), linked to its decision by `id`."""
        return cls(kind="outcome", decision="allow", reason="allowed", id=id, fields={"of": of, **fields})

    def with_(self, **more: Any) -> Event:
        """This event with more (or other) fields: the artifact, `unproven`, the test routing in force."""
        return Event(kind=self.kind, decision=self.decision, reason=self.reason, id=self.id, fields={**self.fields, **more})

    # -- reading --------------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The JSON object of the line (the log writes its keys sorted)."""
        out: dict[str, Any] = {"kind": self.kind, "decision": self.decision, "reason": self.reason}
        if self.id is not None or self.kind in ("connect", "request", "outcome", "tls", "tcp"):
            out["id"] = self.id
        out.update(self.fields)
        return out

    def __getitem__(self, key: str) -> Any:
        if key in ("kind", "id", "decision", "reason"):
            return getattr(self, key)
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in ("kind", "id", "decision", "reason") or key in self.fields
