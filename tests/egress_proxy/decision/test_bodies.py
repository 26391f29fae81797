"""The body readers: each refuses what could read two ways (asserting the reason and where), hostile inputs cost
bounded time and memory, and the tools/list filter gives the same bytes however the stream is cut."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from mcp import types as mcp_types

from egress_proxy.decision.bodies import (
    EVENT_LIMIT,
    ZERO_OIDS,
    BodyError,
    GqlRequest,
    Message,
    Operation,
    RefUpdate,
    ToolsFilter,
    document_hash,
    expect_json,
    expect_media,
    graphql_get,
    graphql_requests,
    mcp_messages,
    media_type,
    operation_of,
    push_commands,
    read_json,
    tool_call,
    tools_list_ids,
)
from egress_proxy.decision.reasons import REASONS
from egress_proxy.errors import EgressError


def refused(call, *args) -> BodyError:
    with pytest.raises(BodyError) as caught:
        call(*args)
    assert caught.value.reason in REASONS
    assert len(caught.value.detail) <= 80
    return caught.value


# ---------------------------------------------------------------------------------------------------- read_json


def test_read_json_keeps_numbers_as_written():
    value = read_json(b' {"a": [1, 2.5, -0, 12345678901234567890], "b": {"c": null, "d": true}} ')
    assert value == {"a": [1, 2.5, 0, 12345678901234567890], "b": {"c": None, "d": True}}
    assert type(value["a"][0]) is int and type(value["a"][1]) is float


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b'{"params":{"arguments":{"repo":"a","repo":"b"}}}', "duplicate key at $.params.arguments.repo"),
        (b'[{"a":1},{"b":[0,{"x":1,"x":1}]}]', "duplicate key at $[1].b[1].x"),
        (b'{"a b":{"\\"":1,"\\"":2}}', 'duplicate key at $["a b"]["\\""]'),
        (b"\xef\xbb\xbf{}", "a byte order mark before the JSON"),
        (b'{"a":"\xff"}', "invalid utf-8 at byte 6"),
        (b'{"a":"\xed\xa0\x80"}', "invalid utf-8 at byte 6"),  # a surrogate encoded in UTF-8
        (b'{"k":["\\ud800"]}', "a lone surrogate escape at $.k[0]"),
        (b'{"\\udc00x":1}', "a lone surrogate escape at $"),
        (b"[NaN]", "NaN is not JSON"),
        (b"-Infinity", "-Infinity is not JSON"),
        (b"[1e400]", "a number too large for a float"),
        (b"1" * 5000, "a number too long to read"),
        (b'{"a":1,}', "invalid json at line 1 column 8"),
        (b"{} {}", "invalid json at line 1 column 4"),
        (b"", "invalid json at line 1 column 1"),
        (b'"a\tb"', "invalid json at line 1 column 3"),  # a raw control character in a string
    ],
)
def test_read_json_refuses_what_reads_two_ways(body, detail):
    error = refused(read_json, body)
    assert (error.reason, error.detail) == ("body-malformed", detail)


def test_a_paired_surrogate_escape_is_one_character():
    assert read_json(b'["\\ud83d\\ude00", "\\\\ud800"]') == ["\U0001f600", "\\ud800"]


def test_depth_is_bounded_at_the_limit():
    assert read_json(b"[" * 64 + b"]" * 64) is not None
    assert refused(read_json, b"[" * 65 + b"]" * 65).detail == "nesting deeper than 64"
    assert refused(read_json, b'{"a":' * 65 + b"1" + b"}" * 65).detail == "nesting deeper than 64"
    # brackets inside strings are not nesting, and escaped quotes do not end a string
    deep_string = b'["\\"' + b"[" * 1000 + b'"]'
    assert read_json(deep_string) == ['"' + "[" * 1000]
    assert read_json(b"[1]", max_depth=1) == [1]
    assert refused(read_json, b"[[1]]", 1).detail == "nesting deeper than 1"


@pytest.mark.parametrize("body", [b"[" * 10_000 + b"]" * 10_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000])
def test_ten_thousand_deep_is_refused_not_a_recursion_error(body):
    assert refused(read_json, body).detail == "nesting deeper than 64"


def test_a_hundred_mib_of_brackets_is_refused_in_bounded_memory():
    body = b"[" * (100 << 20)
    tracemalloc.start()
    try:
        error = refused(read_json, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.detail == "nesting deeper than 64"
    assert peak < 1 << 20  # no copy, no decode, no parse of the 100 MiB


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_read_json_agrees_with_json_loads_on_valid_documents(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # hypothesis's text() holds lone surrogates: refused, whichever way they are written
        assert refused(read_json, text.encode("utf-8", "surrogatepass")).reason == "body-malformed"
        return
    assert read_json(text.encode("utf-8")) == json.loads(text)


def depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=0, max_value=6))
def test_the_depth_limit_is_exactly_the_documents_depth(value, limit):
    try:  # raw text: brackets and quotes inside strings stay as they are, for the pre-scan to skip
        data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate: its own test
    if depth(value) <= limit:
        assert read_json(data, limit) == value
    else:
        assert refused(read_json, data, limit).detail == f"nesting deeper than {limit}"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | st.text(alphabet='[]{}"\\:,0a ', max_size=64).map(str.encode))
def test_read_json_raises_only_body_errors(data):
    try:
        value = read_json(data)
    except BodyError as error:
        assert error.reason == "body-malformed"
    else:
        assert value == json.loads(data)


def test_body_error_is_the_edge_error_and_carries_no_value():
    error = refused(read_json, b'{"token":"s3cr3t-value","token":"s3cr3t-value"}')
    assert isinstance(error, EgressError)
    assert "s3cr3t" not in str(error) and "s3cr3t" not in repr(error)
    long_key = refused(read_json, b'{"' + b"k" * 500 + b'":1,"' + b"k" * 500 + b'":1}')
    assert len(long_key.detail) <= 80


# ------------------------------------------------------------------------------------------------- the head


def test_media_type_and_expect_json():
    assert media_type(()) == ""
    assert media_type((("Content-Type", "Application/JSON ; charset=UTF-8"),)) == "application/json"
    expect_json((("content-type", "application/json"),))
    expect_json((("content-type", 'application/json; charset="utf-8"'),))
    expect_media((("Content-Type", "application/x-git-receive-pack-request"),), "application/x-git-receive-pack-request")


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ((), "content-type-mismatch"),
        ((("Content-Type", "text/plain"),), "content-type-mismatch"),
        ((("Content-Type", "application/json-patch+json"),), "content-type-mismatch"),
        ((("Content-Type", "application/json; charset=latin-1"),), "content-type-mismatch"),
        ((("Content-Type", "application/json; charset=utf-8; charset=latin-1"),), "content-type-mismatch"),
        ((("Content-Type", "application/json"), ("content-type", "application/json")), "content-type-mismatch"),
        ((("Content-Type", "application/json;;x"),), "content-type-mismatch"),
        ((("Content-Type", "application json"),), "content-type-mismatch"),
        ((("Content-Type", "application/json"), ("Content-Encoding", "gzip")), "body-malformed"),
        ((("Content-Type", "application/json"), ("Content-Encoding", "identity, br")), "body-malformed"),
    ],
)
def test_expect_json_refuses(headers, reason):
    assert refused(expect_json, headers).reason == reason


def test_identity_coding_is_no_coding():
    expect_json((("Content-Type", "application/json"), ("Content-Encoding", "Identity")))


# ------------------------------------------------------------------------------------------------------- MCP


def test_mcp_messages_from_the_sdks_own_serialization():
    call = mcp_types.JSONRPCRequest(
        jsonrpc="2.0", id=7, method="tools/call", params={"name": "get_issue", "arguments": {"repo": "acme/app"}}
    )
    note = mcp_types.JSONRPCNotification(jsonrpc="2.0", method="notifications/initialized")
    answer = mcp_types.JSONRPCResponse(jsonrpc="2.0", id="s-1", result={})
    body = "[" + ",".join(m.model_dump_json(by_alias=True, exclude_none=True) for m in (call, note, answer)) + "]"
    messages, batch = mcp_messages(read_json(body.encode()))
    assert batch
    assert messages[0] == Message("request", "tools/call", "7", {"name": "get_issue", "arguments": {"repo": "acme/app"}})
    assert messages[1] == Message("notification", "notifications/initialized", None, None)
    assert messages[2] == Message("response", None, '"s-1"', None)
    assert tool_call(messages[0]) == ("get_issue", {"repo": "acme/app"})


def test_an_id_keeps_its_type():
    (number,), _ = mcp_messages({"jsonrpc": "2.0", "id": 1, "method": "ping"})
    (text,), _ = mcp_messages({"jsonrpc": "2.0", "id": "1", "method": "ping"})
    assert (number.id, text.id) == ("1", '"1"')


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ([], "an empty batch"),
        ("x", "a json-rpc message is not an object"),
        ({"jsonrpc": "1.0", "id": 1, "method": "ping"}, '"jsonrpc" is not "2.0"'),
        ({"id": 1, "method": "ping"}, '"jsonrpc" is not "2.0"'),
        ({"jsonrpc": "2.0", "id": 1, "method": 5}, "method is not a string"),
        ({"jsonrpc": "2.0", "id": None, "method": "ping"}, "a request id that is not a string or an integer"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "ping"}, "a request id that is not a string or an integer"),
        ({"jsonrpc": "2.0", "id": True, "method": "ping"}, "a request id that is not a string or an integer"),
        ({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": "x"}, "params is neither an object nor an array"),
        ({"jsonrpc": "2.0", "id": 1, "method": "ping", "result": {}}, "a request with member result"),
        ({"jsonrpc": "2.0", "id": 1}, "neither a request nor a response (result xor error)"),
        ({"jsonrpc": "2.0", "id": 1, "result": {}, "error": {"code": 1, "message": "m"}}, "neither a request nor a response (result xor error)"),
        ({"jsonrpc": "2.0", "result": {}}, "a response without id"),
        ({"jsonrpc": "2.0", "id": 1, "error": {"code": "x", "message": "m"}}, "an error that is not {code, message}"),
        ([{"jsonrpc": "2.0", "method": "ping"}, {"jsonrpc": "2.0", "method": "ping"}, {"jsonrpc": "2.0"}],
         "index=2: neither a request nor a response (result xor error)"),
    ],
)
def test_mcp_messages_refuses_what_is_not_json_rpc(value, detail):
    error = refused(mcp_messages, value)
    assert (error.reason, error.detail) == ("body-malformed", detail)


def test_an_error_answer_may_carry_a_null_id():
    (message,), batch = mcp_messages({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse"}})
    assert (message.kind, message.id, batch) == ("response", "null", False)


@pytest.mark.parametrize(
    "params",
    [None, [], {"arguments": {}}, {"name": 1}, {"name": "t", "arguments": []}, {"name": "t", "arguments": None}],
)
def test_tool_call_refuses_a_malformed_call(params):
    message = Message("request", "tools/call", "1", params)
    assert refused(tool_call, message).reason == "body-malformed"


def test_tool_call_without_arguments_has_none():
    assert tool_call(Message("request", "tools/call", "1", {"name": "t"})) == ("t", {})


# --------------------------------------------------------------------------------------------------- GraphQL


def fields(document: str, name: str | None = None) -> Operation:
    return operation_of(GqlRequest(document, name, None))


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("{ viewer { login } }", Operation("query", ("viewer",))),
        ("{ a: deleteRepo }", Operation("query", ("deleteRepo",))),  # an alias renames nothing
        ("query { ...F } fragment F on Query { deleteRepo }", Operation("query", ("deleteRepo",))),
        ("mutation M { ... on Mutation { ... @include(if: true) { b: x } } y }", Operation("mutation", ("x", "y"))),
        ("query { ...A } fragment A on Query { a ...B } fragment B on Query { b ...A }", Operation("query", ("a", "b"))),
        ("query { ...A a } fragment A on Query { a ...A }", Operation("query", ("a",))),
        ("subscription { __typename s t s }", Operation("subscription", ("__typename", "s", "t"))),
        ("{ x ...F y } fragment F on Query { z x }", Operation("query", ("x", "z", "y"))),
    ],
)
def test_root_fields_through_aliases_and_fragments(document, expected):
    assert fields(document) == expected


@pytest.mark.parametrize(
    ("document", "name", "reason", "detail"),
    [
        ("query A { a } query B { b }", "A", "graphql-multiple-operations", "2 operations in one document"),
        ("{ a } { b }", None, "graphql-multiple-operations", "2 operations in one document"),
        ("query A { a }", "B", "graphql-multiple-operations", "operationName does not name the operation"),
        ("{ a }", "A", "graphql-multiple-operations", "operationName does not name the operation"),
        ("{ ...Missing }", None, "body-malformed", "unknown fragment Missing"),
        ("{ a ", None, "body-malformed", "graphql syntax error at line 1 column 5"),
        ("fragment F on Q { a }", None, "body-malformed", "no operation in the document"),
        ("{ a } fragment F on Q { a } fragment F on Q { b }", None, "body-malformed", "fragment F defined twice"),
        ("type Query { a: Int } { a }", None, "body-malformed", "a definition that is not an operation or a fragment"),
        ("{ " + "a " * 30_000 + "}", None, "body-malformed", "a graphql document of more than 20000 tokens"),
    ],
)
def test_operation_of_refuses(document, name, reason, detail):
    error = refused(operation_of, GqlRequest(document, name, None))
    assert (error.reason, error.detail) == (reason, detail)


@pytest.mark.parametrize(
    "document",
    ["{ " + "... on Query { " * 3000 + "deep" + " }" * 3000 + " }", "{" + " a {" * 5000 + " deep" + " }" * 5000 + " }"],
)
def test_deep_documents_are_bounded(document):
    # the walk over fragments is a loop, not a recursion; the parser's own bound (tokens, nesting) may refuse first
    try:
        assert fields(document).fields in (("deep",), ("a",))
    except BodyError as error:
        assert error.reason == "body-malformed"


SHA = hashlib.sha256(b"{ viewer { login } }").hexdigest()


def test_graphql_requests_post_and_batch():
    one = {"query": "{ viewer { login } }", "operationName": None, "variables": {"a": 1}}
    assert graphql_requests(one) == ((GqlRequest("{ viewer { login } }", None, None),), False)
    persisted = {"extensions": {"persistedQuery": {"version": 1, "sha256Hash": SHA}}}
    requests, batch = graphql_requests([one, persisted])
    assert batch and requests[1] == GqlRequest(None, None, SHA)
    assert document_hash("{ viewer { login } }") == SHA


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ([], "an empty batch"),
        ({}, "neither a query nor a persisted query"),
        ({"query": 1}, "query is not a string"),
        ({"query": "{a}", "operationName": 1}, "operationName is not a string"),
        ({"query": "{a}", "variables": []}, "variables is not an object"),
        ({"query": "{a}", "id": "stored"}, "a graphql request with member id"),
        ({"doc_id": "1"}, "a graphql request with member doc_id"),
        ({"query": "{a}", "extensions": {"other": 1}}, "extension other is not judged"),
        ({"extensions": {"persistedQuery": {"version": 1, "sha256Hash": SHA.upper()}}}, "sha256Hash is not lowercase sha256 hex"),
        ({"extensions": {"persistedQuery": {"version": 2, "sha256Hash": SHA}}}, "persistedQuery version is not 1"),
        ({"extensions": {"persistedQuery": {"sha256Hash": SHA}}}, "persistedQuery is not {version, sha256Hash}"),
        ([{"query": "{a}"}, {"query": "{a}", "x": 1}], "index=1: a graphql request with member x"),
    ],
)
def test_graphql_requests_refuses(value, detail):
    error = refused(graphql_requests, value)
    assert (error.reason, error.detail) == ("body-malformed", detail)


def test_graphql_get():
    extensions = json.dumps({"persistedQuery": {"version": 1, "sha256Hash": SHA}})
    pairs = (("query", "{ viewer { login } }"), ("operationName", "V"), ("extensions", extensions))
    assert graphql_get(pairs) == GqlRequest("{ viewer { login } }", "V", SHA)
    assert refused(graphql_get, (("query", "{a}"), ("query", "{b}"))).detail == "query parameter query given twice"
    assert refused(graphql_get, (("query", "{a}"), ("foo", "1"))).detail == "a graphql query parameter foo"
    bad = refused(graphql_get, (("query", "{a}"), ("extensions", '{"a":1,"a":2}')))
    assert bad.detail == "extensions: duplicate key at $.a"
    assert refused(graphql_get, (("query", "{a}"), ("variables", "[]"))).detail == "variables is not an object"


# ------------------------------------------------------------------------------------------------------- git


def pkt(payload: bytes) -> bytes:
    return b"%04x" % (len(payload) + 4) + payload


OLD, NEW = "a" * 40, "b" * 40


def test_push_commands_reads_the_command_list_only():
    body = (
        pkt(f"{'0' * 40} {NEW} refs/heads/agent/x\0 report-status side-band-64k agent=git/2.45\n".encode())
        + pkt(f"{OLD} {'0' * 40} refs/heads/old\n".encode())
        + pkt(f"{OLD} {NEW} refs/tags/v1".encode())  # a missing LF is allowed
        + b"0000"
        + b"PACK\x00\x00\x00\x02 anything, not read"
    )
    assert push_commands(body) == (
        RefUpdate("0" * 40, NEW, "refs/heads/agent/x"),
        RefUpdate(OLD, "0" * 40, "refs/heads/old"),
        RefUpdate(OLD, NEW, "refs/tags/v1"),
    )
    assert "0" * 40 in ZERO_OIDS and "0" * 64 in ZERO_OIDS


def test_push_commands_sha256_and_shallow():
    old, new = "c" * 64, "d" * 64
    body = pkt(f"shallow {'e' * 64}\n".encode()) + pkt(f"{old} {new} refs/heads/m\0object-format=sha256\n".encode()) + b"0000"
    assert push_commands(body) == (RefUpdate(old, new, "refs/heads/m"),)
    assert push_commands(b"0000") == ()


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"", "pkt-lines end before a flush-pkt"),
        (pkt(f"{OLD} {NEW} refs/heads/m".encode()), "pkt-lines end before a flush-pkt"),
        (b"00zz" + b"0000", "a pkt-line length that is not hex at byte 0"),
        (b"0001" + b"0000", "a pkt-line length out of range at byte 0"),
        (b"0003" + b"0000", "a pkt-line length out of range at byte 0"),
        (b"fff5" + b"x" * 70000 + b"0000", "a pkt-line length out of range at byte 0"),
        (b"00ff" + f"{OLD} {NEW} refs/heads/m".encode() + b"0000", "a pkt-line cut short at byte 0"),
        (pkt(b"0004") + b"0000", "not a push command at line=0"),
        (pkt(b"") + b"0000", "not a push command at line=0"),
        (pkt(f"{OLD.upper()} {NEW} refs/heads/m".encode()) + b"0000", "not a push command at line=0"),
        (pkt(f"{OLD} {NEW} refs/heads/a b".encode()) + b"0000", "not a push command at line=0"),
        (pkt(f"{OLD} {NEW} refs/heads/m\n\n".encode()) + b"0000", "not a push command at line=0"),
        (pkt(f"{OLD} {NEW}  refs/heads/m".encode()) + b"0000", "not a push command at line=0"),
        (pkt(f"{OLD} {NEW} refs/heads/\xff".encode("latin-1")) + b"0000", "a ref name that is not utf-8 at line=0"),
        (pkt(f"{OLD} {'b' * 64} refs/heads/m".encode()) + b"0000", "object ids of two lengths at line=0"),
        (pkt(f"{'c' * 64} {'d' * 64} refs/heads/m\0report-status".encode()) + b"0000", "object ids that do not match the object-format"),
        (pkt(f"{OLD} {NEW} refs/heads/m\0caps".encode()) + pkt(f"{OLD} {NEW} refs/heads/n\0caps".encode()) + b"0000",
         "capabilities after the first command at line=1"),
        (pkt(b"push-cert\0report-status\n") + pkt(b"certificate version 0.1\n") + b"0000", "push certificates are not judged"),
        (pkt(f"{OLD} {NEW} refs/heads/m".encode()) + pkt(f"shallow {OLD}".encode()) + b"0000", "a malformed shallow line at line=1"),
    ],
)
def test_push_commands_refuses(body, detail):
    error = refused(push_commands, body)
    assert (error.reason, error.detail) == ("body-malformed", detail)


def git(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    base = {"PATH": os.environ["PATH"], "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "protocol.ext.allow=always",
         "-c", "protocol.version=0", *args],
        cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=120, check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("object_format", ["sha1", "sha256"])
def test_push_commands_reads_what_real_git_sends(tmp_path, object_format):
    # The real client pushes to a real receive-pack through the ext transport; the bytes it sends are teed aside.
    # They are what a smart-HTTP POST to git-receive-pack carries: the command list, a flush-pkt, the pack.
    helper = tmp_path / "helper.sh"
    helper.write_text('#!/bin/sh\ntee "$CAPTURE" | git receive-pack "$REPO"\n')
    helper.chmod(0o755)
    upstream, work, capture = tmp_path / "up.git", tmp_path / "work", tmp_path / "capture"
    git(tmp_path, "init", "-q", "--bare", f"--object-format={object_format}", str(upstream))
    git(tmp_path, "init", "-q", f"--object-format={object_format}", str(work))
    env = {"CAPTURE": str(capture), "REPO": str(upstream)}
    remote = f"ext::{helper} %S"
    zero = "0" * (40 if object_format == "sha1" else 64)

    git(work, "commit", "-q", "--allow-empty", "-m", "one")
    first = git(work, "rev-parse", "HEAD")
    git(work, "push", "-q", remote, "HEAD:refs/heads/agent/x", "HEAD:refs/heads/main", env=env)
    assert push_commands(capture.read_bytes()) == (
        RefUpdate(zero, first, "refs/heads/agent/x"),
        RefUpdate(zero, first, "refs/heads/main"),
    )
    git(work, "commit", "-q", "--allow-empty", "-m", "two")
    second = git(work, "rev-parse", "HEAD")
    git(work, "push", "-q", remote, "HEAD:refs/heads/agent/x", ":refs/heads/main", env=env)
    assert push_commands(capture.read_bytes()) == (
        RefUpdate(first, second, "refs/heads/agent/x"),
        RefUpdate(first, zero, "refs/heads/main"),
    )
    assert zero in ZERO_OIDS


# ------------------------------------------------------------------------------------------ the tools/list filter

TOOLS = ToolsFilter(frozenset({"1", '"a"'}), frozenset({"get_issue"}))


def listing(ident: object, *names: str) -> dict:
    return {"jsonrpc": "2.0", "id": ident, "result": {"tools": [{"name": n, "inputSchema": {}} for n in names]}}


def names(message: dict) -> list[str]:
    return [tool["name"] for tool in message["result"]["tools"]]


def test_json_filter_cuts_the_listing_answer_only():
    body = json.dumps([listing(1, "get_issue", "delete_repo"), listing(2, "delete_repo"), listing("1", "delete_repo")])
    out = json.loads(TOOLS.json(body.encode()))
    assert [names(m) for m in out] == [["get_issue"], ["delete_repo"], ["delete_repo"]]  # id 1, not "1"
    single = json.loads(TOOLS.json(json.dumps(listing("a", "x", "get_issue", {"no": "name"} and "y")).encode()))
    assert names(single) == ["get_issue"]


def test_json_filter_passes_other_answers_byte_for_byte():
    body = b'{ "jsonrpc": "2.0", "id": 1, "error": {"code": -1, "message": "no"} }'
    assert TOOLS.json(body) == body
    assert TOOLS.json(json.dumps(listing(1, "get_issue")).encode()) == json.dumps(listing(1, "get_issue")).encode()


def test_json_filter_drops_entries_without_a_name():
    message = {"jsonrpc": "2.0", "id": 1, "result": {"tools": [{"name": "get_issue"}, {}, "get_issue", {"name": 1}]}}
    assert json.loads(TOOLS.json(json.dumps(message).encode()))["result"]["tools"] == [{"name": "get_issue"}]


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"get_issue"}],"tools":[{"name":"delete_repo"}]}}',
        b"not json",
        b"[" * 100,
    ],
)
def test_json_filter_refuses_what_it_cannot_read(body):
    assert refused(TOOLS.json, body).reason == "body-malformed"


def sse_event(message: dict, eol: str = "\n", extra: str = "") -> bytes:
    return f"{extra}event: message{eol}data: {json.dumps(message)}{eol}{eol}".encode()


def run(stream: bytes, cuts: list[int] | None = None) -> bytes:
    sse = TOOLS.sse()
    if cuts is None:
        return sse.feed(stream) + sse.close()
    out, at = bytearray(), 0
    for cut in sorted(cuts) + [len(stream)]:
        out += sse.feed(stream[at:cut])
        at = max(at, cut)
    return bytes(out + sse.close())


def test_sse_filter_rewrites_the_listing_and_passes_the_rest():
    other = sse_event({"jsonrpc": "2.0", "method": "notifications/message", "params": {}}, "\r\n", ": keep\r\n")
    listed = sse_event(listing(1, "get_issue", "delete_repo"), "\r")
    # "\r\r\n": the CR ends the data line and the CRLF is the blank line (not CR, CR, then an empty LF line)
    out = run(other + listed + b"\n: tail\n\n")
    assert out.startswith(other) and out.endswith(b"}\n\n: tail\n\n")
    rewritten = out[len(other):]
    assert rewritten.startswith(b"event: message\r")
    data = [line[6:] for line in rewritten.splitlines() if line.startswith(b"data: ")]
    assert [names(json.loads(d)) for d in data] == [["get_issue"]]


def test_sse_data_over_several_lines_and_fields_as_clients_read_them():
    message = json.dumps(listing(1, "get_issue", "delete_repo"), indent=1)
    lines = "".join(f"data:{line}\n" for line in message.split("\n"))  # no space after the colon
    out = run(b"\xef\xbb\xbf" + lines.encode() + b"Data: ignored\nid: 9\n\n")
    data = [line[6:] for line in out.splitlines() if line.startswith(b"data: ")]
    assert [names(json.loads(d)) for d in data] == [["get_issue"]]
    assert b"id: 9\n" in out and b"Data: ignored\n" in out


def test_sse_comments_and_empty_events_pass_unchanged():
    stream = b": ping\n\n\n\nretry: 10\n\nevent: x\ndata\n\n"
    assert run(stream) == stream


def test_sse_last_event_without_its_blank_line_is_still_filtered():
    out = run(f"data: {json.dumps(listing(1, 'delete_repo'))}".encode())
    assert names(json.loads(out.split(b"data: ")[1])) == []


@pytest.mark.parametrize("end", [b"\r\r", b"\r", b"", b"\r\n: tail"])
def test_sse_stream_ending_inside_an_event(end):
    # the stream ends on a CR that may be the start of a CRLF, or on a line with no end: one event, as a client reads
    stream = f"event: message\r: c\rdata: {json.dumps(listing(1, 'get_issue', 'delete_repo'))}".encode() + end
    out = run(stream)
    assert [names(json.loads(d)) for d in client_view(out + b"\n\n")] == [["get_issue"]]


def test_sse_event_that_does_not_read_cuts_the_stream():
    sse = TOOLS.sse()
    assert refused(sse.feed, b'data: {"a":1,"a":2}\n\n').reason == "body-malformed"


def test_an_endless_sse_event_is_refused_at_one_mib_in_bounded_memory():
    sse = TOOLS.sse()
    chunk = b"data: " + b"x" * 65530 + b"\n"
    tracemalloc.start()
    try:
        with pytest.raises(BodyError) as caught:
            for _ in range(10_000):  # 640 MiB if nothing stopped it
                assert sse.feed(chunk) == b""
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.reason == "response-event-too-large"
    assert peak < 4 * EVENT_LIMIT
    endless_line = TOOLS.sse()
    assert refused(endless_line.feed, b"x" * (EVENT_LIMIT + 1)).reason == "response-event-too-large"


def test_an_event_of_exactly_the_limit_passes():
    head = b"data: "
    stream = head + b"y" * (EVENT_LIMIT - len(head) - 2) + b"\n\n"
    with pytest.raises(BodyError):  # held whole, then read: "yyy..." is not JSON
        run(stream)
    comment = b":" + b"y" * (EVENT_LIMIT - 3) + b"\n\n"
    assert run(comment) == comment


STREAM = (
    b": hello\r\n\r\n"
    + sse_event(listing(1, "get_issue", "delete_repo"), "\r\n")
    + sse_event({"jsonrpc": "2.0", "id": 2, "result": {}}, "\r")
    + sse_event(listing("a", "delete_repo", "get_issue"), "\n", "id: 5\n")
    + b"data: {\"jsonrpc\":\"2.0\",\"method\":\"ping\"}\r\n"
)


def test_sse_one_byte_chunks_equal_the_whole_stream():
    whole = run(STREAM)
    assert run(STREAM, list(range(len(STREAM)))) == whole
    assert whole.count(b"delete_repo") == 0 and whole.count(b"get_issue") == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_sse_any_chunking_equals_the_whole_stream(cuts):
    assert run(STREAM, cuts) == run(STREAM)


line_ends = st.sampled_from(["\n", "\r", "\r\n"])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["comment", "other", "listing"]), line_ends, st.lists(st.integers(0, 200), max_size=6)
        ),
        min_size=1,
        max_size=6,
    )
)
def test_sse_line_endings_and_cuts_never_change_the_outcome(events):
    stream = b""
    for kind, eol, _ in events:
        if kind == "comment":
            stream += f": c{eol}{eol}".encode()
        elif kind == "other":
            stream += sse_event({"jsonrpc": "2.0", "id": 3, "result": {"x": 1}}, eol)
        else:
            stream += sse_event(listing(1, "get_issue", "delete_repo"), eol)
    cuts = [cut for _, _, cs in events for cut in cs if cut <= len(stream)]
    whole = run(stream)
    assert run(stream, cuts) == whole
    assert b"delete_repo" not in whole
    assert whole.count(b"get_issue") == sum(kind == "listing" for kind, _, _ in events)
    if all(kind != "listing" for kind, _, _ in events):
        assert whole == stream


def test_tools_list_ids_and_a_filter_for_any_id():
    messages, _ = mcp_messages(
        [{"jsonrpc": "2.0", "id": 4, "method": "tools/list"}, {"jsonrpc": "2.0", "id": "x", "method": "ping"},
         {"jsonrpc": "2.0", "method": "tools/list"}]
    )
    assert tools_list_ids(messages) == frozenset({"4"})
    every = ToolsFilter(None, frozenset({"get_issue"}))
    body = json.dumps([listing(9, "get_issue", "delete_repo"), listing("z", "delete_repo")]).encode()
    assert [names(m) for m in json.loads(every.json(body))] == [["get_issue"], []]
    assert ToolsFilter(frozenset(), frozenset()).json(b"not even json") == b"not even json"  # nothing to cut


def client_view(stream: bytes) -> list[str]:
    """The data of each event as the MCP client's SSE reader (httpx-sse) dispatches it."""
    lines, events = SSELineDecoder(), SSEDecoder()
    out = []
    for line in lines.decode(stream.decode("utf-8")) + lines.flush():
        event = events.decode(line)
        if event is not None:
            out.append(event.data)
    return out


field_lines = st.sampled_from(
    [": comment", ":", "event: message", "event:message", "id: 7", "id", "retry: 10", "Data: {]", "data : x", "x"]
)


@st.composite
def sse_events(draw):
    kind = draw(st.sampled_from(["listing", "listing-other-id", "response", "request", "none"]))
    message = {
        "listing": listing(1, "get_issue", "delete_repo"),
        "listing-other-id": listing(2, "get_issue", "delete_repo"),
        "response": {"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "a\nb"}]}},
        "request": {"jsonrpc": "2.0", "id": 5, "method": "sampling/createMessage", "params": {}},
    }.get(kind)
    lines = []
    if message is not None:
        text = json.dumps(message, indent=draw(st.sampled_from([None, 1])))
        lines = [draw(st.sampled_from(["data: ", "data:"])) + piece for piece in text.split("\n")]
    for field in draw(st.lists(field_lines, max_size=3)):  # other fields anywhere between the data lines
        lines.insert(draw(st.integers(0, len(lines))), field)
    eol = draw(st.sampled_from(["\n", "\r", "\r\n"]))
    return kind, "".join(line + eol for line in lines) + eol


@settings(max_examples=300, deadline=None)
@given(st.lists(sse_events(), min_size=1, max_size=5), st.lists(st.integers(0, 2000), max_size=10))
def test_what_the_mcp_client_reads_from_the_filtered_stream(events, cuts):
    stream = "".join(text for _, text in events).encode()
    out = run(stream, [c for c in cuts if c <= len(stream)])
    before, after = client_view(stream), client_view(out)
    assert len(before) == len(after)
    for was, now in zip(before, after):
        if not was:
            assert now == was
            continue
        message = json.loads(was)
        if message.get("id") == 1 and "tools" in message.get("result", {}):
            assert names(json.loads(now)) == ["get_issue"]
        else:
            assert now == was
    if all(kind != "listing" for kind, _ in events):
        assert out == stream
