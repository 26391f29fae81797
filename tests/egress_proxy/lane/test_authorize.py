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


@pytest.mark.parametrize("fields, has_body", [(["content-length: 5"], True), (["transfer-encoding: chunked"], True), ([], False),
                                              (["x-egresslaw-transfer-encoding: chunked"], True)])  # Envoy removed it; the listener kept it
def test_a_declared_body_is_seen(fields, has_body):
    check = parse_check("\r\n".join([":method: POST", ":authority: pypi.org", *fields]).encode())
    assert check.has_body is has_body
    assert not any(k.startswith("x-egresslaw-") for k, _ in check.headers)  # read back as the client's `transfer-encoding`


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


def test_a_check_whose_deadline_passes_while_it_resolves_is_refused_never_allowed(tmp_path):
    """The deadline is judged again right before the allow's write-ahead event: a lookup that outlived Envoy's wait
    ends in a refusal (`authorizer-unavailable`, as Envoy answered), and no `allow` is ever written for it."""
    import asyncio
    import json
    import time
    from types import SimpleNamespace

    from egress_proxy.audit.log import AuditLog
    from egress_proxy.custody.keys import load_audit_key
    from tests.proxy_harness import build_artifact, make_env

    env = make_env(tmp_path / "env")
    audit = AuditLog(tmp_path / "lane.jsonl", load_audit_key(str(env.keys)))
    deadline_in = 0.3

    async def slow(host, port):
        await asyncio.sleep(deadline_in * 2)
        return ("93.184.215.14",)

    from egress_proxy.lane.authorize import Authorizer

    policy = SimpleNamespace(artifact=build_artifact(), proved=True)
    authorizer = Authorizer(policy=lambda: policy, lease_keys=lambda: env.lease_key, served=lambda: frozenset({"ci"}), resolve=slow,
                            resolve_timeout=30, audit=audit)
    lease = env.lease(profile="ci")
    body = f":method: CONNECT\r\n:authority: api.acme-test.dev:443\r\nproxy-authorization: Bearer {lease}".encode()
    check = parse_check(body, str(int((time.time() + deadline_in) * 1000)).encode())
    answer = asyncio.run(authorizer.check(check))
    assert answer.status == 503 and ("x-egresslaw-deny", "authorizer-unavailable") in answer.headers
    assert audit.close()
    decisions = [r["decision"] for r in map(json.loads, (tmp_path / "lane.jsonl").read_text().splitlines())
                 if r.get("id") == check.request_id]
    assert decisions == ["deny"]
    timely = parse_check(body, str(int((time.time() + 60) * 1000)).encode())  # the same check with time to spare is allowed
    audit2 = AuditLog(tmp_path / "lane2.jsonl", load_audit_key(str(env.keys)))
    authorizer.audit = audit2
    assert asyncio.run(authorizer.check(timely)).status == 200
    assert audit2.close()


def _served(tmp_path, exchange):
    """`exchange(reader, writer)` against a real authorizer on its Unix socket; what it returns."""
    import asyncio
    from types import SimpleNamespace

    from egress_proxy.audit.log import AuditLog
    from egress_proxy.custody.keys import load_audit_key
    from egress_proxy.lane.authorize import Authorizer
    from tests.proxy_harness import build_artifact, make_env

    env = make_env(tmp_path / "env")
    audit = AuditLog(tmp_path / "lane.jsonl", load_audit_key(str(env.keys)))

    async def resolve(host, port):
        return ("93.184.215.14",)

    policy = SimpleNamespace(artifact=build_artifact(), proved=True)
    authorizer = Authorizer(policy=lambda: policy, lease_keys=lambda: env.lease_key, served=lambda: frozenset({"ci"}),
                            resolve=resolve, resolve_timeout=30, audit=audit)

    async def run():
        server = await authorizer.serve_unix(tmp_path / "a.sock")
        try:
            reader, writer = await asyncio.open_unix_connection(str(tmp_path / "a.sock"))
            try:
                return await asyncio.wait_for(exchange(reader, writer), 60)
            finally:
                writer.close()
        finally:
            server.close()

    try:
        return asyncio.run(run()), env
    finally:
        audit.close()


def _call(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /check HTTP/1.1\r\nhost: egresslaw-authorizer\r\ncontent-type: text/plain\r\nx-egresslaw-deadline: "
            + str(int((__import__("time").time() + 60) * 1000)).encode() + b"\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(body) + body)


async def _response(reader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
    return head, await reader.readexactly(length)


def test_the_authorizer_answers_checks_in_turn_on_one_connection(tmp_path):
    """Envoy's calls, kept alive, each answered with its length: a check split in any chunks, a malformed body (400,
    the connection kept), a refusal with its reason."""
    import asyncio

    async def exchange(reader, writer):
        out = []
        call = _call(b":method: CONNECT\r\n:authority: api.acme-test.dev:443\r\nproxy-authorization: Bearer nope")
        for i in range(0, len(call), 7):  # a check that arrives in pieces
            writer.write(call[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        out.append(await _response(reader))
        writer.write(_call(b"no method here"))
        out.append(await _response(reader))
        writer.write(_call(b":method: CONNECT\r\n:authority: api.acme-test.dev:443", b"x-egresslaw-tunnel: \r\n"))
        out.append(await _response(reader))
        return out

    (refused, malformed, in_tunnel), _ = _served(tmp_path, exchange)
    assert refused[0].startswith(b"HTTP/1.1 407 ") and b"x-egresslaw-deny: " in refused[0] and b"egress_denied" in refused[1]
    assert malformed[0].startswith(b"HTTP/1.1 400 ") and malformed[1] == b"malformed check\n"
    assert in_tunnel[0].startswith(b"HTTP/1.1 403 ") and b"x-egresslaw-deny: " in in_tunnel[0]


@pytest.mark.parametrize("sent", [
    b"GET /check HTTP/1.1\r\ncontent-length: 0\r\n\r\n",  # not a check
    b"POST /check HTTP/1.0\r\ncontent-length: 0\r\n\r\n",
    b"POST /check HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"POST /check HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nab",
    b"POST /check HTTP/1.1\r\ncontent-length: -1\r\n\r\n",
    b"POST /check HTTP/1.1\r\nno colon\r\n\r\n",
    b"POST /check HTTP/1.1\r\ncontent-length : 0\r\n\r\n",
    b"POST /check HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % (160 * 1024 + 1),  # a body over MAX_CHECK_BYTES
    b"POST /check HTTP/1.1\r\nx-pad: " + b"a" * (160 * 1024 + 1),  # a head over it, never ended
])
def test_anything_but_a_check_closes_the_connection_unanswered(tmp_path, sent):
    from egress_proxy.lane.authorize import MAX_CHECK_BYTES

    assert MAX_CHECK_BYTES == 160 * 1024

    async def exchange(reader, writer):
        writer.write(sent)
        await writer.drain()
        return await reader.read()

    answered, _ = _served(tmp_path, exchange)
    assert answered == b""
