"""The proxy's own answers: one builder, JSON with a reason code, the status that fits, never upstream bytes."""

from __future__ import annotations

import json

import pytest

from egress_proxy.decision.reasons import REASONS
from egress_proxy.edge.denials import DENY_HEADER, denial, denial_response, error_answer, policy_status, raw_denial


@pytest.mark.parametrize(
    "reason, status",
    [("path-not-allowed", 403), ("lease-missing", 407), ("lease-expired", 407), ("audit-unavailable", 503),
     ("draining", 503), ("smuggling", 403)],
)
def test_a_decision_refusal(reason: str, status: int) -> None:
    resp = denial(reason)
    assert resp.status_code == status == policy_status(reason)
    assert json.loads(resp.content) == {"error": "egress_denied", "reason": reason, "rule": None}
    assert resp.headers[DENY_HEADER] == reason and resp.headers["content-type"] == "application/json"
    lease = reason.startswith("lease-")
    assert sorted(resp.headers.get_all("proxy-authenticate")) == (['Basic realm="egresslaw"', 'Bearer realm="egresslaw"'] if lease else [])
    assert resp.headers["connection"] == ("close" if lease or reason == "draining" else "keep-alive")
    assert ("retry-after" in resp.headers) == (status == 503)


def test_a_limit_refusal_closes_the_connection_with_its_status_text() -> None:
    resp = denial_response(431, "head-too-large")
    assert (resp.status_code, resp.reason, resp.headers["connection"]) == (431, "Request Header Fields Too Large", "close")
    assert json.loads(resp.content)["reason"] == "head-too-large"


def test_the_raw_answer_is_one_well_formed_http1_response() -> None:
    raw = raw_denial(408, "header-timeout")
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    assert lines[0] == "HTTP/1.1 408 Request Timeout"
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert int(fields["Content-Length"]) == len(body) and fields[DENY_HEADER] == "header-timeout"
    assert json.loads(body)["reason"] == "header-timeout"


def test_an_upstream_error_is_told_apart_from_a_refusal() -> None:
    body, headers = error_answer(502, "upstream-error")
    assert json.loads(body) == {"error": "upstream_error", "reason": "upstream-error"}
    assert headers[DENY_HEADER] == "upstream-error" and "upstream-error" in REASONS
    assert json.loads(error_answer(400, "malformed-request")[0])["error"] == "egress_denied"
