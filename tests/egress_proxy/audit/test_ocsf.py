"""The OCSF projection of the audit log (egress_proxy/audit/ocsf.py, docs/ocsf.md).

Every line of two real logs becomes one record that validates against the OCSF 1.3.0 class schema of the
`ocsf-json-schema` package (with the profiles the record declares), traces back to its line (`metadata.uid` is
the line's `mac`, with the same seq and reason) and holds no secret: (a) an `AuditLog` fed every event kind and
decision through the `Event` constructors, rotated, failed and recovered, closed; (b) a real in-process edge that
allowed a request, denied one and refused a CONNECT.
"""

from __future__ import annotations

import errno
import http.client
import json
import ssl
from datetime import datetime

import httpx
import pytest
from jsonschema import Draft202012Validator
from ocsf_json_schema import OcsfJsonSchema, get_ocsf_schema
from referencing import Registry, Resource

from egress_proxy.audit import log as audit
from egress_proxy.audit.event import Event
from egress_proxy.audit.ocsf import OCSF_VERSION, log_name, project
from egress_proxy.custody.keys import init_keys, load_audit_key
from egress_proxy.decision.types import Lease
from tests.proxy_harness import assert_no_canary, free_port, make_env, start_proxy, stop_proxy

SCHEMA = OcsfJsonSchema(get_ocsf_schema(version=OCSF_VERSION))
CLASSES = {4001: "network_activity", 4002: "http_activity", 3002: "authentication", 6002: "application_lifecycle"}
REGISTRY = Registry(retrieve=lambda uri: Resource.from_contents(SCHEMA.get_schema_from_uri(uri)))  # type: ignore[call-arg]
_VALIDATORS: dict[tuple[int, tuple[str, ...]], Draft202012Validator] = {}
# verification material, the time (as epoch ms) and the decision (as action, disposition and status: the class table)
CHAIN_ONLY = {"prev", "sig", "pub", "digest", "ts", "decision"}
SEEDED = "hdr-Value-SeededSecret-7f3a9c"  # a header value a client sends: the edge judges it, no line holds it


def validate(record: dict) -> None:
    """The record against its class schema, with the profiles it declares (built once per class and profiles)."""
    key = (record["class_uid"], tuple(record["metadata"].get("profiles", ())))
    if key not in _VALIDATORS:
        _VALIDATORS[key] = Draft202012Validator(SCHEMA.get_class_schema(CLASSES[key[0]], list(key[1])), registry=REGISTRY)
    errors = [f"{e.json_path}: {e.message[:200]}" for e in _VALIDATORS[key].iter_errors(record)]
    assert not errors, (record["metadata"]["event_code"], record["status_code"], errors)


def chain(path) -> list[dict]:
    """Every line of a log, its rotated segments first."""
    files, n = [], 1
    while (segment := audit.segment_path(path, n)).exists():
        files.append(segment)
        n += 1
    return [json.loads(line) for p in [*files, path] for line in p.read_bytes().splitlines()]


def projected(lines: list[dict]) -> list[dict]:
    """Each line's record, with the chain's log id (the `log` of its `audit-open`), validated and traced back."""
    log_id = next(line["log"] for line in lines if line["kind"] == "audit-open")
    by_mac = {line["mac"]: line for line in lines}
    records = []
    for line in lines:
        record = project(line, log_id=log_id)
        validate(record)
        source = by_mac[record["metadata"]["uid"]]  # (d) the trace-back: the line the uid names is in the log
        assert (source["seq"], source["reason"]) == (record["metadata"]["sequence"], record["status_code"])
        assert record["metadata"]["log_name"] == log_name(log_id) and record["metadata"].get("correlation_uid") == line.get("id")
        assert record["type_uid"] == record["class_uid"] * 100 + record["activity_id"]
        text = json.dumps(record)
        for name, value in line.items():  # no field dropped: every text, list and object of the line is in its record
            if isinstance(value, (str, list, dict)) and name not in CHAIN_ONLY:
                assert json.dumps(value)[1:-1] in text, (line["kind"], name)
        records.append(record)
    return records


def one(records: list[dict], **match) -> dict:
    found = [r for r in records if all(_at(r, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, len(found))
    return found[0]


def _at(record: dict, dotted: str):
    for part in dotted.split("__"):
        record = record.get(part) if isinstance(record, dict) else None  # type: ignore[assignment]
    return record


# -- (a) every event kind and decision through a real AuditLog ---------------------------------------------------


@pytest.fixture
def key(tmp_path):
    init_keys(tmp_path / "keys")
    return load_audit_key(tmp_path / "keys")


def test_every_kind_and_decision_projects_to_a_valid_record_that_traces_back(tmp_path, key):
    path = tmp_path / "logs" / "audit.jsonl"
    lease = Lease(subject="agent-7", profile="ci", connection=None, exp=2_000_000_000)
    conn_lease = Lease(subject="agent-7", profile=None, connection="github", exp=2_000_000_000)
    budget = {"window": 86400, "start": 1_765_000_000, "resets": 1_765_086_400, "cap": "requests", "limit": 3}
    web = dict(scheme="https", host="api.acme-test.dev", port=443, tunnel=True, rule=None, status=None, bytes_up=0, bytes_down=0,
               duration_ms=1.25)
    events = [
        Event.of({"kind": "worker", "decision": "info", "reason": "started", "worker": 0, "workers": 2, "pid": 4242}),
        Event.decided("connect", "c1", conn_lease, "allow", "allowed", method="CONNECT", **{**web, "tunnel": False}),
        Event.decided("connect", "c2", lease, "deny", "host-not-allowed", method="CONNECT", scheme="https", host="10.9.8.7", port=443,
                      status=403),
        Event.decided("connect", "c3", lease, "would-deny", "host-not-allowed", method="CONNECT", scheme="https", host="evil.example",
                      port=443),
        Event.outcome("connect", "c1", status=200, failure=None, bytes_up=812, bytes_down=9120, duration_ms=40.5),
        Event.decided("request", "r1", conn_lease, "allow", "allowed", method="GET", path="/repos/acme/app", **web),
        Event.outcome("request", "r1", status=200, failure=None, aborted=False, bytes_up=0, bytes_down=77, duration_ms=3.0,
                      redactions=1, rule="read"),
        Event.decided("request", "r2", lease, "deny", "path-not-allowed", method="POST", path="/admin", headers=["x-leak"],
                      **{**web, "status": 403}),
        Event.decided("request", "r3", lease, "would-deny", "method-not-allowed", method="PATCH", path="/repos/acme/app",
                      headers=["content-type"], **web),
        Event.decided("request", "r4", lease, "deny", "budget-exceeded", method="GET", path="/x", budget=budget,
                      detail="requests cap of 3 a day reached", **{**web, "status": 429}),
        Event.outcome("request", "r5", status=502, failure="upstream-error", aborted=True, error="connection-refused", bytes_up=0,
                      bytes_down=0, duration_ms=2.0),
        Event.decided("tls", "t1", lease, "deny", "sni-mismatch", host="api.acme-test.dev", port=443, rule=None, status=None),
        Event.decided("tcp", "p1", lease, "deny", "non-http-in-tunnel", host="api.acme-test.dev", port=443, rule=None, status=None),
        Event.decided("connection", "n1", None, "deny", "fd-exhausted", method=None, host=None, port=None, path=None, tunnel=False,
                      rule=None, status=None),
        Event.of({"kind": "mint", "connection": "github", "credential_kind": "oauth2-client", "host": "token.acme-test.dev",
                  "port": 443, "path": "/oauth/token", "decision": "allow", "reason": "minted", "status": 200}),
        Event.of({"kind": "mint", "connection": "github", "credential_kind": "oauth2-client", "host": "token.acme-test.dev",
                  "port": 443, "path": "/oauth/token", "decision": "deny", "reason": "mint-refused", "status": 401,
                  "detail": "the token endpoint answered 401", "answer_reason": None}),
        Event.of({"kind": "reload", "decision": "allow", "reason": "reloaded", "artifact": "sha256:" + "ab" * 32}),
        Event.of({"kind": "reload", "decision": "deny", "reason": "reload-failed", "detail": "the proof does not match the artifact"}),
    ]
    log = audit.AuditLog(path, key, rotate_bytes=3000, retry_seconds=0.05)
    for event in events[:8]:
        log.emit(event)
        assert log.flush()
    real_write = log._os_write  # the injection point for a failing disk: the next write fails, then the disk is back

    def failing(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    log._os_write = failing
    log.emit(events[8])
    assert not log.flush(0.5)
    log._os_write = real_write
    assert log.flush(30)
    for event in events[9:]:
        log.emit(event)
        assert log.flush()
    assert log.close()
    assert audit.verify(path.parent, key=key).status == "intact"

    lines = chain(path)
    records = projected(lines)
    assert len(records) == len(lines)
    kinds = {(line["kind"], line["decision"], line.get("end")) for line in lines}
    assert {("checkpoint", "info", "rotated"), ("checkpoint", "info", "shutdown"), ("audit-resumed", "info", None)} <= kinds
    assert {line["kind"] for line in lines} == set(audit.OWN_KINDS) | {e.kind for e in events}

    # the class table (docs/ocsf.md)
    connect = one(records, metadata__correlation_uid="c2")
    assert (connect["class_uid"], connect["activity_name"], connect["action"], connect["disposition"]) == (4001, "Refuse", "Denied", "Blocked")
    assert connect["dst_endpoint"] == {"ip": "10.9.8.7", "port": 443} and connect["actor"]["user"]["name"] == "agent-7"
    observed = one(records, metadata__correlation_uid="c3")
    assert (observed["activity_name"], observed["action_id"], observed["disposition"], observed["severity"]) == ("Open", 1, "Detected", "Medium")
    closed = one(records, metadata__correlation_uid="c1", metadata__event_code="outcome")
    assert (closed["class_uid"], closed["activity_name"], closed["traffic"]) == (4001, "Close", {"bytes_out": 812, "bytes_in": 9120, "bytes": 9932})
    denied = one(records, metadata__correlation_uid="r2")
    assert (denied["class_uid"], denied["activity_name"], denied["http_response"]["code"], denied["status"]) == (4002, "Post", 403, "Failure")
    assert denied["http_request"]["url"] == {"scheme": "https", "hostname": "api.acme-test.dev", "port": 443, "path": "/admin",
                                             "url_string": "https://api.acme-test.dev:443/admin"}
    assert denied["unmapped"]["egresslaw"]["headers"] == ["x-leak"] and denied["unmapped"]["egresslaw"]["profile"] == "ci"
    patch = one(records, metadata__correlation_uid="r3")
    assert (patch["activity_id"], patch["activity_name"], patch["action"], patch["disposition"]) == (99, "Patch", "Allowed", "Detected")
    assert patch["unmapped"]["egresslaw"]["method"] == "PATCH"
    over = one(records, status_code="budget-exceeded")
    assert (over["class_uid"], over["action"], over["http_response"]["code"]) == (4002, "Denied", 429)
    assert over["unmapped"]["egresslaw"]["budget"] == budget and over["status_detail"] == "requests cap of 3 a day reached"
    ok = one(records, metadata__correlation_uid="r1", metadata__event_code="outcome")
    assert (ok["class_uid"], ok["http_response"]["code"], ok["status"], ok["unmapped"]["egresslaw"]["rule"]) == (4002, 200, "Success", "read")
    failed = one(records, metadata__correlation_uid="r5")
    assert (failed["status"], failed["status_detail"], failed["unmapped"]["egresslaw"]["error"]) == ("Failure", "upstream-error", "connection-refused")
    minted = one(records, status_code="minted")
    assert (minted["class_uid"], minted["activity_name"], minted["user"]["name"], minted["status"]) == (3002, "Service Ticket Request", "github", "Success")
    refused = one(records, status_code="mint-refused")
    assert (refused["status"], refused["dst_endpoint"]["hostname"]) == ("Failure", "token.acme-test.dev")
    reload_failed = one(records, status_code="reload-failed")
    assert (reload_failed["class_uid"], reload_failed["activity_name"], reload_failed["status"], reload_failed["severity"]) == (
        6002, "Update", "Failure", "High")
    resumed = one(records, metadata__event_code="audit-resumed")
    assert (resumed["status"], resumed["severity"], resumed["unmapped"]["egresslaw"]["held"]) == ("Failure", "High", 1)
    stop = one(records, status_code="shutdown")
    assert (stop["activity_name"], stop["app"]["name"]) == ("Stop", "egresslaw")
    assert {r["activity_name"] for r in records if r["metadata"]["event_code"] == "checkpoint" and r["status_code"] != "shutdown"} == {"Checkpoint"}
    opened = [r for r in records if r["metadata"]["event_code"] == "audit-open"]
    assert len(opened) >= 2 and {r["activity_name"] for r in opened} == {"Start"}  # the first segment's and each rotation's
    # the chain's verification material stays in the line; nothing of the line is dropped unnoticed
    text = json.dumps(records)
    assert '"sig"' not in text and '"prev"' not in text and '"pub"' not in text
    assert all(r["time"] == round(datetime.fromisoformat(line["ts"]).timestamp() * 1000) for r, line in zip(records, lines))


# -- (b) a real edge, (c) the canary -----------------------------------------------------------------------------


def test_a_real_edges_log_projects_validly_and_leaks_nothing(tmp_path_factory, pki, tls_upstream, http_upstream):
    env = make_env(tmp_path_factory.mktemp("ocsf-edge"))
    listen = free_port()
    connect_to = [f"api.acme-test.dev:443:127.0.0.1:{tls_upstream.port}", f"pkgs.acme-test.dev:80:127.0.0.1:{http_upstream.port}"]
    p = start_proxy(env, pki, (tls_upstream, http_upstream), connect_to, listen=listen)
    lease = p.lease(connection="github")
    try:
        ctx = ssl.create_default_context(cafile=str(p.ca))
        proxy = httpx.Proxy(f"http://127.0.0.1:{listen}", headers={"Proxy-Authorization": f"Bearer {lease}"})
        with httpx.Client(proxy=proxy, verify=ctx, trust_env=False, timeout=30) as client:
            allowed = client.get("https://api.acme-test.dev/repos/acme/app?token=" + SEEDED, headers={"X-Custom": SEEDED})
            denied = client.post("https://api.acme-test.dev/nowhere", headers={"X-Leak": SEEDED}, content=b"body")
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=30)
        conn.request("CONNECT", "elsewhere.example:443", headers={"Proxy-Authorization": f"Bearer {lease}", "Host": "elsewhere.example:443"})
        refused = conn.getresponse().status
        conn.close()
    finally:
        stop_proxy(p)  # closes the log: its shutdown checkpoint is the last line
    assert (allowed.status_code, denied.status_code, refused) == (200, 403, 403), (allowed.status_code, denied.status_code, refused)

    lines = chain(env.audit)
    records = projected(lines)
    assert (lines[-1]["kind"], lines[-1]["end"]) == ("checkpoint", "shutdown")
    ok = one(records, metadata__event_code="outcome", http_response__code=200, class_uid=4002)
    assert ok["status"] == "Success"
    no = one(records, metadata__event_code="request", action="Denied")
    assert (no["activity_name"], no["http_request"]["url"]["path"], no["dst_endpoint"]["hostname"]) == ("Post", "/nowhere", "api.acme-test.dev")
    assert "x-leak" in no["unmapped"]["egresslaw"]["headers"]
    tunnel = one(records, metadata__event_code="connect", activity_name="Refuse")
    assert tunnel["dst_endpoint"]["hostname"] == "elsewhere.example" and tunnel["class_uid"] == 4001
    text = json.dumps(records)
    assert_no_canary(text, "the OCSF records")  # the credential the edge injected upstream
    for secret in (SEEDED, lease, lease.split(".")[-1]):  # a header value, a query value, the lease and its signature
        assert secret not in text
