"""OCSF 1.3.0 records projected from audit log lines (docs/audit-export.md, the class table in docs/ocsf.md).

    project(line, log_id=...)  # a parsed `egresslaw.audit/2` line (a dict) -> one OCSF record (a dict, JSON-ready)
    log_name(log_id)           # `metadata.log_name` of a chain: `egresslaw.audit/<log id>`

A projection, never a new source: every record keeps the line's `mac` (`metadata.uid`), `seq`
(`metadata.sequence`), log id (`metadata.log_name`), event id (`metadata.correlation_uid`) and reason code
(`status_code`), and holds nothing the line does not hold. Every field of the line that no OCSF attribute carries
goes to `unmapped.egresslaw` (a null field is absent); the chain's verification material (`prev`, `sig`, `pub`,
`digest`) stays in the line the uid finds.

The exporter calls `project` for every line at the lane's full rate: plain dict building from tables made at
import, no schema work (the tests validate the output against the 1.3.0 schema).
"""

from __future__ import annotations

import calendar
import functools
import ipaddress
import re
import time
from typing import Any

from egress_proxy.decision.provenance import egresslaw_version

OCSF_VERSION = "1.3.0"

# -- classes, activities and enums (OCSF 1.3.0) ------------------------------------------------------------------

_HTTP, _NETWORK, _AUTH, _LIFECYCLE = 4002, 4001, 3002, 6002
_CLASS = {  # class_uid: (class_name, category_uid, category_name)
    _HTTP: ("HTTP Activity", 4, "Network Activity"),
    _NETWORK: ("Network Activity", 4, "Network Activity"),
    _AUTH: ("Authentication", 3, "Identity & Access Management"),
    _LIFECYCLE: ("Application Lifecycle", 6, "Application Activity"),
}
# HTTP Activity's activity is the method (1.3.0 has no PATCH: it is Other, named by activity_name)
_METHODS = {"CONNECT": (1, "Connect"), "DELETE": (2, "Delete"), "GET": (3, "Get"), "HEAD": (4, "Head"),
            "OPTIONS": (5, "Options"), "POST": (6, "Post"), "PUT": (7, "Put"), "TRACE": (8, "Trace")}
_OPEN, _CLOSE, _REFUSE = (1, "Open"), (2, "Close"), (5, "Refuse")
_START, _STOP, _UPDATE = (3, "Start"), (4, "Stop"), (8, "Update")
_UNKNOWN = (0, "Unknown")
SUCCESS, FAILURE = 1, 2
INFO, LOW, MEDIUM, HIGH, CRITICAL = 1, 2, 3, 4, 5
# decision -> (action_id, action, disposition_id, disposition): the security_control profile of 4001/4002
_ACTION = {"allow": (1, "Allowed", 1, "Allowed"), "deny": (2, "Denied", 2, "Blocked"),
           "would-deny": (1, "Allowed", 15, "Detected"), "info": (1, "Allowed", 1, "Allowed")}
_SEVERITY = {"allow": INFO, "info": INFO, "would-deny": MEDIUM, "deny": LOW}
_SEVERITY_NAME = {INFO: "Informational", LOW: "Low", MEDIUM: "Medium", HIGH: "High", CRITICAL: "Critical"}
_HIGH_REASONS = frozenset({"internal-error", "reload-failed"})  # a deny the operator must look at
_STATUS_NAME = {SUCCESS: "Success", FAILURE: "Failure"}

# Line fields no record repeats: the chain's own (seq -> sequence, mac -> uid, v -> log_version) and its
# verification material, which stays in the line the uid finds.
_CHAIN = frozenset({"v", "ts", "seq", "mac", "prev", "sig", "pub", "digest"})
_COMMON = _CHAIN | {"kind", "id", "decision", "reason", "detail", "subject", "peer", "duration_ms"}
# Per class, the fields an OCSF attribute carries (the rest goes to unmapped.egresslaw)
_CARRIED_HTTP = _COMMON | {"method", "scheme", "host", "port", "path", "status", "bytes_up", "bytes_down", "failure"}
_CARRIED_NETWORK = _COMMON | {"host", "port", "bytes_up", "bytes_down", "failure"}
_CARRIED_AUTH = _COMMON | {"connection", "host", "port", "path"}
_CARRIED_LIFECYCLE = _COMMON | {"log", "error", "end"}

_HOSTNAME = re.compile(r"(([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9\-]*[a-zA-Z0-9])\.)*([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9\-]*[A-Za-z0-9])")  # hostname_t


def log_name(log_id: str | None) -> str:
    """`metadata.log_name` of a chain: `egresslaw.audit/<log id>`."""
    return f"egresslaw.audit/{log_id or 'unknown'}"


# -- the record ---------------------------------------------------------------------------------------------------

_product: dict[str, str] | None = None


def _the_product() -> dict[str, str]:
    global _product
    if _product is None:  # (after import: the installed version is looked up once, on first use)
        _product = {"name": "egresslaw", "vendor_name": "egresslaw", "version": egresslaw_version()}
    return _product


def project(line: dict[str, Any], *, log_id: str | None = None) -> dict[str, Any]:
    """The OCSF record of one audit line (`log_id`: the chain's, the `log` of its segment's `audit-open` and of
    every checkpoint; an own record's `log` is used when it is not given)."""
    kind = line.get("kind")
    if kind == "outcome":
        build = _http if line.get("of") == "request" else _network
    else:
        build = _BUILDERS.get(kind, _lifecycle)  # type: ignore[arg-type]
    return build(line, log_id if log_id is not None else line.get("log"))


def _base(line: dict[str, Any], class_uid: int, activity: tuple[int, str], status_id: int, severity_id: int,
          log: str | None, carried: frozenset[str] | set[str], profiles: list[str] | None) -> dict[str, Any]:
    class_name, category_uid, category_name = _CLASS[class_uid]
    get = line.get
    metadata: dict[str, Any] = {"uid": get("mac"), "sequence": get("seq"), "log_name": f"egresslaw.audit/{log or 'unknown'}",
                                "log_version": get("v"), "event_code": get("kind"),
                                "product": dict(_product or _the_product()), "version": OCSF_VERSION}
    if (uid := get("id")) is not None:
        metadata["correlation_uid"] = uid
    if profiles:
        metadata["profiles"] = profiles
    activity_id = activity[0]
    record: dict[str, Any] = {
        "class_uid": class_uid, "class_name": class_name, "category_uid": category_uid, "category_name": category_name,
        "activity_id": activity_id, "activity_name": activity[1], "type_uid": class_uid * 100 + activity_id,
        "time": millis(get("ts")), "metadata": metadata,
        "severity_id": severity_id, "severity": _SEVERITY_NAME[severity_id],
        "status_id": status_id, "status": _STATUS_NAME[status_id], "status_code": get("reason"),
    }
    if (detail := get("detail")) is not None:
        record["status_detail"] = detail
    if (duration := get("duration_ms")) is not None:
        record["duration"] = round(duration)
    rest = {k: v for k, v in line.items() if k not in carried and v is not None}
    if rest:
        record["unmapped"] = {"egresslaw": rest}
    return record


def _decided(line: dict[str, Any], record: dict[str, Any]) -> None:
    """The security_control and host profile attributes of a 4001/4002 record: action, disposition, actor, source."""
    get = line.get
    action_id, action, disposition_id, disposition = _ACTION.get(get("decision"), _ACTION["info"])  # type: ignore[arg-type]
    record["action_id"], record["action"] = action_id, action
    record["disposition_id"], record["disposition"] = disposition_id, disposition
    if (subject := get("subject")) is not None:
        record["actor"] = {"user": {"name": subject}}
    if (peer := get("peer")) is not None:
        record["src_endpoint"] = _endpoint_of_peer(peer)
    up, down = get("bytes_up"), get("bytes_down")
    if up is not None or down is not None:
        traffic = {}
        if up is not None:
            traffic["bytes_out"] = up  # source (the agent) to destination
        if down is not None:
            traffic["bytes_in"] = down
        traffic["bytes"] = (up or 0) + (down or 0)
        record["traffic"] = traffic


def _severity(line: dict[str, Any], decision: str | None) -> int:
    if line.get("reason") in _HIGH_REASONS:
        return HIGH
    return _SEVERITY.get(decision, INFO)  # type: ignore[arg-type]


def _profiles(line: dict[str, Any]) -> list[str]:
    return ["security_control", "host"] if line.get("subject") is not None else ["security_control"]


_CONTROL, _WITH_HOST = ["security_control"], ["security_control", "host"]  # (shared: a record is written, never changed)


def _http(line: dict[str, Any], log: str | None) -> dict[str, Any]:
    get = line.get
    decision, failure = get("decision"), get("failure")
    failed = decision == "deny" or failure is not None or get("aborted") is True
    method = get("method")
    activity = _METHODS.get(method, (99, method.title())) if method else _UNKNOWN
    severity = HIGH if get("reason") in _HIGH_REASONS else _SEVERITY.get(decision, INFO)  # type: ignore[arg-type]
    if failure is not None and severity == INFO:
        severity = LOW
    record = _base(line, _HTTP, activity, FAILURE if failed else SUCCESS, severity, log, _CARRIED_HTTP,
                   _WITH_HOST if get("subject") is not None else _CONTROL)
    if failure is not None and "status_detail" not in record:
        record["status_detail"] = failure
    _decided(line, record)
    host, port, path, scheme = get("host"), get("port"), get("path"), get("scheme")
    request: dict[str, Any] = {}
    if method in _METHODS:
        request["http_method"] = method
    elif method:  # (1.3.0's http_method enum has no PATCH and no other method: it stays with the line's fields)
        record.setdefault("unmapped", {"egresslaw": {}})["egresslaw"]["method"] = method
    if host is not None or path is not None:
        url: dict[str, Any] = {}
        if scheme:
            url["scheme"] = scheme
        if host is not None:
            if _hostname_ok(host):
                url["hostname"] = host
            if port is not None:
                url["port"] = port
            url["url_string"] = f"{scheme or 'http'}://{_bracketed(host)}{'' if port is None else f':{port}'}{path or ''}"
        if path is not None:
            url["path"] = path
        elif host is None:
            url["url_string"] = path
        request["url"] = url
    record["http_request"] = request
    # required by the class: the status the client got, 0 while the line has none (an allowed request's decision
    # is written before its response; its outcome, same correlation_uid, has the status)
    record["http_response"] = {"code": line.get("status") or 0}
    record["dst_endpoint"] = _endpoint(host, port)
    return record


def _network(line: dict[str, Any], log: str | None) -> dict[str, Any]:
    decision = line.get("decision")
    kind = line.get("kind")
    failed = decision == "deny" or line.get("failure") is not None or line.get("aborted") is True
    activity = _CLOSE if kind == "outcome" else _REFUSE if decision == "deny" else _OPEN
    severity = _severity(line, decision)
    if line.get("failure") is not None and severity == INFO:
        severity = LOW
    record = _base(line, _NETWORK, activity, FAILURE if failed else SUCCESS, severity, log, _CARRIED_NETWORK, _profiles(line))
    if line.get("failure") is not None and "status_detail" not in record:
        record["status_detail"] = line["failure"]
    _decided(line, record)
    record["dst_endpoint"] = _endpoint(line.get("host"), line.get("port"))
    return record


def _mint(line: dict[str, Any], log: str | None) -> dict[str, Any]:
    decision = line.get("decision")
    failed = decision == "deny"
    record = _base(line, _AUTH, (4, "Service Ticket Request"), FAILURE if failed else SUCCESS, MEDIUM if failed else INFO,
                   log, _CARRIED_AUTH, None)
    connection = line.get("connection") or "unknown"
    record["user"] = {"name": connection}  # whose long-lived secret authenticates to the issuer
    record["service"] = {"name": connection}  # what the short-lived token is for
    host, port, path = line.get("host"), line.get("port"), line.get("path")
    record["dst_endpoint"] = _endpoint(host, port)
    if host is not None:
        url: dict[str, Any] = {"scheme": "https", "url_string": f"https://{_bracketed(host)}{'' if port is None else f':{port}'}{path or ''}"}
        if _hostname_ok(host):
            url["hostname"] = host
        if port is not None:
            url["port"] = port
        if path is not None:
            url["path"] = path
        record["http_request"] = {"http_method": "POST", "url": url}
    return record


def _lifecycle(line: dict[str, Any], log: str | None) -> dict[str, Any]:
    kind, decision = line.get("kind"), line.get("decision")
    status, severity = SUCCESS, INFO
    if kind == "audit-open":
        activity = _START
        if line.get("cut") is not None:
            severity = MEDIUM  # a torn last line was cut off
        elif line.get("previous") == "not-closed":
            severity = LOW  # the previous run was killed or crashed
    elif kind == "checkpoint":
        activity = _STOP if line.get("end") == "shutdown" else (99, "Checkpoint")
    elif kind == "audit-resumed":
        activity, status = (99, "Resume"), FAILURE  # writes failed for a while: the record of that failure
        severity = CRITICAL if line.get("dropped") else HIGH
    elif kind == "reload":
        activity = _UPDATE
        if decision == "deny":
            status, severity = FAILURE, HIGH
    elif kind == "worker":
        activity = _START
    else:
        activity = (99, str(kind))
    record = _base(line, _LIFECYCLE, activity, status, severity, log, _CARRIED_LIFECYCLE, None)
    if line.get("error") is not None and "status_detail" not in record:
        record["status_detail"] = line["error"]
    record["app"] = dict(_product or _the_product())
    return record


_BUILDERS = {"request": _http, "connect": _network, "tls": _network, "tcp": _network, "connection": _network, "mint": _mint}


# -- values -------------------------------------------------------------------------------------------------------

_second: tuple[str, int] = ("", 0)  # the last whole second parsed (one tuple: read and replaced atomically)


def millis(ts: object) -> int:
    """Epoch milliseconds of the log's `ts` (`2026-12-06T12:29:53.123Z`); 0 when it is not one."""
    global _second
    if not isinstance(ts, str):
        return 0
    head = ts[:19]
    second = _second
    if second[0] != head:
        try:
            second = _second = (head, calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S")))
        except ValueError:
            return 0
    frac = ts[20:23]
    return second[1] * 1000 + (int(frac) if frac.isdigit() else 0)


@functools.lru_cache(maxsize=4096)
def _hostname_ok(host: str) -> bool:
    """`host` fits OCSF's hostname_t (a name that does not, an address or one with `_`, goes elsewhere)."""
    return _HOSTNAME.fullmatch(host) is not None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _endpoint(host: str | None, port: int | None) -> dict[str, Any]:
    """A network endpoint (`dst_endpoint` is required by its classes: `name: unknown` when the line has no host,
    as an outcome's does; its decision, same correlation_uid, has it)."""
    if host is None:
        out: dict[str, Any] = {"name": "unknown"}
    elif _hostname_ok(host) and not host.replace(".", "").isdigit():
        out = {"hostname": host}
    else:
        out = {"ip": host} if _is_ip(host) else {"name": host}
    if port is not None:
        out["port"] = port
    return out


def _endpoint_of_peer(peer: str) -> dict[str, Any]:
    """`src_endpoint` from a `peer` (`ADDR:PORT`, `[V6]:PORT` or an address)."""
    addr, _, port = peer.rpartition(":") if (peer.count(":") == 1 or peer.startswith("[")) else ("", "", "")
    addr = addr.strip("[]") if addr else peer
    out: dict[str, Any] = {"ip": addr} if _is_ip(addr) else {"name": peer}
    if "ip" in out and port.isdigit() and int(port) <= 65535:
        out["port"] = int(port)
    return out


@functools.lru_cache(maxsize=4096)
def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
