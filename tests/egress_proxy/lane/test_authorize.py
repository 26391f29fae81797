"""What the lane's Lua filter sends the authorizer, read back (the decisions themselves: tests/egress_proxy/run/test_lane.py)."""

from __future__ import annotations

import pytest

from egress_proxy.lane.authorize import CheckError, parse_check

LEASE = "el2.lk-0123456789abcdef.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"


def test_the_check_is_the_clients_fields_and_never_shows_the_lease():
    body = "\r\n".join([":method: CONNECT", ":authority: pypi.org:443", f"proxy-authorization: Bearer {LEASE}",
                        "x-request-id: 5f0c", "x-forwarded-proto: http", "Content-Length: 0", "x-envoy-internal: true"]).encode()
    check = parse_check(body)
    assert (check.method, check.authority, check.request_id) == ("CONNECT", "pypi.org:443", "5f0c")
    assert check.headers == (("proxy-authorization", f"Bearer {LEASE}"), ("content-length", "0"))  # Envoy's own left out
    assert not check.has_body
    assert LEASE not in repr(check)


@pytest.mark.parametrize("fields, has_body", [(["content-length: 5"], True), (["transfer-encoding: chunked"], True), ([], False)])
def test_a_declared_body_is_seen(fields, has_body):
    assert parse_check("\r\n".join([":method: POST", ":authority: pypi.org", *fields]).encode()).has_body is has_body


@pytest.mark.parametrize("body", [b"\xff\xfe", b"proxy-authorization: x"])
def test_a_body_the_filter_never_sends_is_refused(body):
    with pytest.raises(CheckError):
        parse_check(body)


def test_a_check_carries_the_deadline_of_its_call():
    body = b":method: CONNECT\r\n:authority: pypi.org:443\r\nx-egresslaw-deadline: 1"  # a client's own field is not the deadline
    check = parse_check(body, b"1765000000250")
    assert check.deadline == 1765000000.25
    assert not check.expired(1765000000.2) and check.expired(1765000000.25)
    assert parse_check(body).deadline is None and not parse_check(body).expired(1e12)
    assert parse_check(body, b"-5").deadline is None and parse_check(body, b"9" * 40).deadline is None
