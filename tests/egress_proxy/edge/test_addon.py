"""The addon in-process with mitmproxy's `taddons.context`: options, each hook's adaptation, fail-closed guards.

Real parts throughout (artifact, proof, keys, custody store, audit log); flows are mitmproxy's test flows.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import socket
import ssl
from http.client import HTTPConnection, HTTPSConnection
from types import SimpleNamespace

import pytest
from mitmproxy import connection, exceptions, http, tls
from mitmproxy.addons import proxyserver
from mitmproxy.proxy import context, server_hooks
from mitmproxy.test import taddons, tflow, tutils

from compiler.artifact import load_artifact
from egress_proxy.audit.log import OWN_KINDS, verify
from egress_proxy.custody.keys import load_audit_key
from egress_proxy.edge import addon as addon_mod
from egress_proxy.front import admit as admit_mod
from egress_proxy.edge import responses as responses_mod
from egress_proxy.edge.addon import REQUIRED_OPTIONS, EgressLaw
from tests.egress_proxy.conftest import CANARY, HOSTS, assert_no_canary, free_port, make_env
from tests.proxy_harness import proof_for, proof_signing_key, settle, start_proxy, stop_proxy, wait_for

PUBLIC_IP = "93.184.216.34"


def run(coro):
    return asyncio.run(coro)


class Resolver:
    def __init__(self, answers=None):
        self.answers = answers or {"api.acme-test.dev": [[PUBLIC_IP]]}
        self.calls: list[str] = []

    async def __call__(self, host, port):
        self.calls.append(host)
        seq = self.answers.get(host)
        if seq is None:
            raise OSError("nxdomain")
        return seq[min(self.calls.count(host) - 1, len(seq) - 1)]


@pytest.fixture(autouse=True)
def _restore_mitmproxy_ctx():
    """taddons.context replaces mitmproxy's global ctx; put it back for an in-process proxy in this worker."""
    from mitmproxy import ctx

    saved = (getattr(ctx, "master", None), getattr(ctx, "options", None), getattr(ctx, "log", None))
    yield
    ctx.master, ctx.options, ctx.log = saved


@pytest.fixture
def env(tmp_path):
    return make_env(tmp_path / "env")


@pytest.fixture
def edge(env):
    """(addon, tctx) configured with the real artifact, proof, keys, store and audit log."""
    resolver = Resolver()
    ad = EgressLaw(resolver=resolver)
    with taddons.context(proxyserver.Proxyserver(), ad) as tctx:
        tctx.configure(ad, **_options(env))
        ad.resolver_for_tests = resolver
        yield ad, tctx
        ad.done()


def _options(env, **over):
    opts = dict(REQUIRED_OPTIONS)
    opts.update(
        egresslaw_artifact=str(env.artifact),
        egresslaw_proof=str(env.proof),
        egresslaw_trust_proofs=str(proof_signing_key()[1]),
        egresslaw_keys=str(env.keys),
        egresslaw_store=str(env.store),
        egresslaw_audit_log=str(env.audit),
    )
    opts.update(over)
    return opts


def _flow(url="https://api.acme-test.dev/repos/acme/x", method="GET", lease=None, headers=(), content=b""):
    f = tflow.tflow()
    f.client_conn.timestamp_end = None  # a connected client (tflow's test client has already disconnected)
    f.request = http.Request.make(method, url, content, headers=list(headers))
    if lease:
        f.request.headers["Proxy-Authorization"] = f"Bearer {lease}"
    f.response = None
    f.error = None
    return f


def _events(ad, env):
    """The events about flows and operations (not the log's own open and checkpoint records)."""
    ad.audit.flush()
    return [e for e in map(json.loads, env.audit.read_bytes().splitlines()) if e["kind"] not in OWN_KINDS]


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"connection_strategy": "eager"}, "connection_strategy"),
        ({"rawtcp": True}, "rawtcp"),
        ({"http3": True}, "http3"),
        ({"ssl_insecure": True}, "ssl_insecure"),
        ({"validate_inbound_headers": False}, "validate_inbound_headers"),
        ({"ignore_hosts": ["api.acme-test.dev"]}, "ignore_hosts"),
        ({"egresslaw_proof": "/nonexistent/proof.json"}, "does not exist"),
        ({"egresslaw_resolve": ["api.acme-test.dev"]}, "HOST=IP"),
        ({"egresslaw_connect_to": ["a:1:b"]}, "HOST:PORT:ADDR:APORT"),
        ({"egresslaw_store": ""}, "custody store"),
        ({"egresslaw_max_response": "lots"}, "--max-response `lots` is not a size"),
        ({"egresslaw_max_decoded": "-1"}, "--max-decoded"),
        ({"egresslaw_rule_max_response": ["github=1m"]}, "CONNECTION/RULE=SIZE"),
        ({"egresslaw_rule_max_response": ["github/read=big"]}, "is not a size"),
        ({"egresslaw_rule_max_response": ["github/nosuchrule=1m"]}, "names no rule of the artifact"),
    ],
)
def test_bad_configuration_raises_options_error(env, over, message):
    ad = EgressLaw()
    with taddons.context(proxyserver.Proxyserver(), ad) as tctx:
        with pytest.raises(exceptions.OptionsError, match=message.replace("(", r"\(")):
            tctx.configure(ad, **_options(env, **over))
        ad.done()


def test_response_caps_are_options(env):
    ad = EgressLaw()
    with taddons.context(proxyserver.Proxyserver(), ad) as tctx:
        tctx.configure(ad, **_options(env, egresslaw_max_response="2m", egresslaw_max_decoded="", egresslaw_rule_max_response=["github/read=10k"]))
        caps = ad.responses.caps
        assert (caps.received, caps.decoded, dict(caps.per_rule)) == (2 << 20, None, {"github/read": 10 << 10})
        ad.done()


def test_unproven_artifact_refused_unless_allowed(env, caplog):
    env.proof.write_text(proof_for(load_artifact(env.artifact.read_text()), verdict="refuted"))  # signed, every check refuted
    ad = EgressLaw(resolver=Resolver())
    with taddons.context(proxyserver.Proxyserver(), ad) as tctx:
        with pytest.raises(exceptions.OptionsError, match="does not prove"):
            tctx.configure(ad, **_options(env))
        tctx.configure(ad, **_options(env, egresslaw_allow_unproven=True))
        assert ad.policy is not None and not ad.policy.proved
        caplog.set_level(logging.WARNING, logger="egresslaw.proxy")
        for _ in range(2):
            f = _flow(lease=env.lease(connection="github"))
            run(ad.requestheaders(f))
        assert sum(r.getMessage() == "serving an unproven artifact (--allow-unproven)" for r in caplog.records) == 2
        ad.done()


# -- requests -------------------------------------------------------------------------------------


def test_allowed_request_gets_exactly_one_credential_and_a_pin(edge, env):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"), headers=[(b"Authorization", b"Bearer mine"), (b"Accept", b"a"), (b"X-Other", b"1")])
    run(ad.requestheaders(f))
    assert f.response is None
    run(ad.request(f))
    assert f.request.headers.get_all("authorization") == [f"Bearer {CANARY}"]
    assert f.request.headers.get_all("accept") == ["a"] and "x-other" not in f.request.headers
    assert not any(k.lower().startswith("proxy-") for k in f.request.headers)
    assert_no_canary(repr(f.metadata), "flow metadata")
    # The server connection dials the vetted address with SNI = the name; afterwards the label is the name again.
    server = connection.Server(address=("api.acme-test.dev", 443))
    server.tls = True
    data = server_hooks.ServerConnectionHookData(server=server, client=f.client_conn)
    ad.server_connect(data)
    assert (server.address, server.sni, server.error) == ((PUBLIC_IP, 443), "api.acme-test.dev", None)
    f.response = tutils.tresp(content=f"echo {CANARY}".encode(), headers=http.Headers(x_egresslaw_deny="forged", x_echo=CANARY))
    ad.response(f)
    assert f.response.content == b"echo [REDACTED]" and f.response.headers["x-echo"] == "[REDACTED]"
    assert "x-egresslaw-deny" not in f.response.headers
    assert_no_canary(json.dumps(f.get_state(), default=repr), "the finished flow")
    # The allow was written before the request went upstream; what happened after is its outcome.
    [decision, outcome] = _events(ad, env)
    assert (decision["kind"], decision["decision"], decision["rule"], decision["status"]) == ("request", "allow", "read", None)
    assert (outcome["kind"], outcome["id"], outcome["status"], outcome["redactions"], outcome["failure"]) == ("outcome", f.id, 200, 2, None)


def test_unvetted_destination_is_never_dialled(edge, env):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    server = connection.Server(address=("elsewhere.acme-test.dev", 443))
    data = server_hooks.ServerConnectionHookData(server=server, client=f.client_conn)
    ad.server_connect(data)
    assert server.error == "egresslaw: destination not vetted" and server.address == ("elsewhere.acme-test.dev", 443)


def test_one_lookup_per_client_connection_and_a_rebinding_answer_is_denied(edge, env):
    ad, _ = edge
    resolver = ad.resolver_for_tests
    resolver.answers["api.acme-test.dev"] = [[PUBLIC_IP], ["127.0.0.1"]]
    lease = env.lease(connection="github")
    first, second, elsewhere = _flow(lease=lease), _flow(lease=lease), _flow(lease=lease)
    second.client_conn = first.client_conn
    run(ad.requestheaders(first))
    run(ad.requestheaders(second))
    assert first.response is None and second.response is None
    assert resolver.calls == ["api.acme-test.dev"]  # the same client connection reuses the vetted answer
    assert ad._clients[first.client_conn.id].pins[("api.acme-test.dev", 443)] == (PUBLIC_IP, 443)
    run(ad.requestheaders(elsewhere))  # a new client connection looks up again and gets loopback
    assert elsewhere.response.status_code == 403 and elsewhere.response.headers["x-egresslaw-deny"] == "address-not-public"
    assert ("api.acme-test.dev", 443) not in ad._clients[elsewhere.client_conn.id].pins


@pytest.mark.parametrize(
    ("which", "status", "reason"),
    [(None, 407, "lease-missing"), ("bogus", 407, "lease-malformed"), ("forged", 407, "lease-invalid"), ("GH", 403, "path-not-allowed")],
)
def test_denials_answer_json_with_the_reason(edge, env, which, status, reason):
    ad, _ = edge
    good = env.lease(connection="github")
    lease = {"GH": good, "bogus": "el2.x.y.z", "forged": good[:-2] + ("AA" if not good.endswith("AA") else "BB"), None: None}[which]
    f = _flow("https://api.acme-test.dev/admin", lease=lease)
    run(ad.requestheaders(f))
    assert f.response.status_code == status
    assert json.loads(f.response.content) == {"error": "egress_denied", "reason": reason, "rule": None}
    assert f.response.headers["x-egresslaw-deny"] == reason
    run(ad.request(f))  # mitmproxy still calls the later hooks for a flow we answered: they must not undo it
    ad.response(f)
    ad.error(f)  # and an error after the answer adds no second event
    assert [e["reason"] for e in _events(ad, env)] == [reason]


def test_exception_in_the_decision_denies(edge, env, monkeypatch, caplog):
    ad, _ = edge
    caplog.set_level(logging.DEBUG)
    def boom(*a, **k):
        raise RuntimeError(f"boom {CANARY}")

    monkeypatch.setattr(admit_mod, "decide", boom)  # the name the one admission calls
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    assert f.response.status_code == 403 and f.response.headers["x-egresslaw-deny"] == "internal-error"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "RuntimeError" in logged and "requestheaders" in logged
    assert_no_canary(logged, "the log of an internal error")  # messages of exceptions are never logged


def test_exception_while_injecting_denies(edge, env):
    ad, _ = edge

    class BrokenCustody:
        def open(self, address):
            raise RuntimeError("store unavailable")

    ad.custody = BrokenCustody()
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    run(ad.request(f))
    assert f.response.status_code == 403 and f.response.headers["x-egresslaw-deny"] == "internal-error"
    assert "authorization" not in f.request.headers


def test_exception_in_the_response_scan_replaces_the_response(edge, env, monkeypatch):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    run(ad.request(f))
    monkeypatch.setattr(responses_mod, "redact", lambda *a: 1 / 0)  # the name the response path calls
    f.response = tutils.tresp(content=CANARY.encode())
    ad.response(f)
    assert f.response.status_code == 403 and f.response.headers["x-egresslaw-deny"] == "internal-error"
    assert_no_canary(f.response.content, "the replaced response")


def test_http2_trailers_are_denied(edge, env):
    ad, _ = edge
    f = _flow("https://api.acme-test.dev/repos/acme/app/issues", "POST", env.lease(connection="github"), content=b"{}")
    # HTTP/2 without content-length: the body is held and framed in `request` (a streamed body's trailers are cut
    # in the HTTP layer instead: tests/conformance/test_limits.py).
    f.request.http_version = "HTTP/2.0"
    del f.request.headers["content-length"]
    run(ad.requestheaders(f))
    f.request.trailers = http.Headers(x_sneak="1")
    run(ad.request(f))
    assert f.response.headers["x-egresslaw-deny"] == "trailers-denied"


# -- tunnels --------------------------------------------------------------------------------------


def _tunnel(ad, env):
    f = _flow(lease=env.lease(connection="github"))
    f.request.method = "CONNECT"
    f.request.path = ""
    run(ad.http_connect(f))
    assert f.response is None
    return f


def _hello(f, sni, extensions=()):
    ctx = context.Context(f.client_conn, taddons_options())
    ctx.server = connection.Server(address=("api.acme-test.dev", 443))
    return tls.ClientHelloData(ctx, SimpleNamespace(sni=sni, extensions=list(extensions)))


def taddons_options():
    from mitmproxy import ctx

    return ctx.options


@pytest.mark.parametrize(
    ("sni", "extensions", "reason"),
    [("other.acme-test.dev", (), "sni-mismatch"), (None, (), "sni-missing"), ("api.acme-test.dev", ((0xFE0D, b""),), "ech-refused")],
)
def test_client_hello_refusals_fail_the_handshake(edge, env, sni, extensions, reason):
    ad, _ = edge
    f = _tunnel(ad, env)
    data = _hello(f, sni, extensions)
    ad.tls_clienthello(data)
    start = tls.TlsData(f.client_conn, data.context)
    ad.tls_start_client(start)
    assert start.ssl_conn is not None  # our certificate-less context: the handshake cannot succeed
    assert ad._clients[f.client_conn.id].refused == reason
    server = connection.Server(address=("api.acme-test.dev", 443))
    hook = server_hooks.ServerConnectionHookData(server=server, client=f.client_conn)
    ad.server_connect(hook)
    assert server.error == f"egresslaw: {reason}"
    assert [e["reason"] for e in _events(ad, env) if e["kind"] == "tls"] == [reason]


def test_matching_sni_is_left_to_tlsconfig(edge, env):
    ad, _ = edge
    f = _tunnel(ad, env)
    data = _hello(f, "API.acme-test.dev.")
    ad.tls_clienthello(data)
    start = tls.TlsData(f.client_conn, data.context)
    ad.tls_start_client(start)
    assert start.ssl_conn is None and ad._clients[f.client_conn.id].refused is None


def test_raw_tcp_in_a_tunnel_is_refused(edge, env):
    ad, _ = edge
    f = _tunnel(ad, env)
    t = tflow.ttcpflow(client_conn=f.client_conn)
    ad.tcp_start(t)
    server = connection.Server(address=("api.acme-test.dev", 443))
    ad.server_connect(server_hooks.ServerConnectionHookData(server=server, client=f.client_conn))
    assert server.error == "egresslaw: non-http-in-tunnel"
    assert [e["reason"] for e in _events(ad, env) if e["kind"] == "tcp"] == ["non-http-in-tunnel"]


def test_connect_inside_a_tunnel_is_denied(edge, env):
    ad, _ = edge
    f = _tunnel(ad, env)
    inner = _flow("https://other.acme-test.dev/", "CONNECT")
    inner.client_conn = f.client_conn
    run(ad.http_connect(inner))
    assert inner.response.headers["x-egresslaw-deny"] == "connect-in-tunnel"


def test_reload_failure_keeps_the_old_policy(edge, env):
    ad, _ = edge
    old = ad.policy
    env.artifact.write_text("{}")
    assert ad.reload() is False and ad.policy is old
    events = _events(ad, env)
    assert events[-1]["kind"] == "reload" and events[-1]["decision"] == "deny"
    ad.done()  # closes the log with its signed checkpoint
    assert verify(env.audit, key=load_audit_key(env.keys)).ok


def test_a_request_dropped_without_response_still_gets_one_event(edge, env):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    assert f.response is None
    ad.client_disconnected(f.client_conn)
    ad.error(f)  # a late error hook adds nothing
    events = _events(ad, env)
    assert [(e["kind"], e["decision"], e.get("failure")) for e in events] == [("request", "allow", None), ("outcome", "allow", "client-disconnected")]
    assert not ad._flows and not ad._clients


def test_exception_in_responseheaders_replaces_the_buffered_response(edge, env, monkeypatch):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    run(ad.request(f))
    f.response = tutils.tresp(content=b"upstream body")
    monkeypatch.setattr(responses_mod, "mark_response_headers", lambda resp: 1 / 0)
    ad.responseheaders(f)
    assert f.response.stream is False  # never streamed unscanned
    ad.response(f)
    assert f.response.status_code == 403 and f.response.headers["x-egresslaw-deny"] == "internal-error"


def test_connection_responses_stream_through_the_scanner_and_sandbox_responses_stream_as_is(edge, env):
    ad, _ = edge
    conn, sandbox = _flow(lease=env.lease(connection="github")), _flow(lease=env.lease(profile="ci"))
    for f in (conn, sandbox):
        run(ad.requestheaders(f))
        assert f.response is None
        run(ad.request(f))
        f.response = tutils.tresp(content=b"x")
        del f.response.headers["content-length"]  # a body of unknown length: streamed
        ad.responseheaders(f)
    # connection traffic: decoded and redacted as it streams, a needle split across chunks included
    secret = CANARY.encode()
    chunks = [b"a " + secret[:7], secret[7:] + b" b", b""]
    out = b"".join(b"".join(conn.response.stream(c)) for c in chunks)
    assert out == b"a [REDACTED] b"
    assert "content-length" not in conn.response.headers and conn.response.headers["transfer-encoding"] == "chunked"
    assert callable(sandbox.response.stream) and sandbox.response.stream(b"abc") == b"abc"
    conn.response.raw_content = None  # mitmproxy keeps no copy of a streamed body
    ad.response(conn)
    [event] = [e for e in settle(_events(ad, env)) if e["kind"] == "request" and e["id"] == conn.id]  # outcome folded in
    assert (event["decision"], event["status"], event["redactions"], event["bytes_down"]) == ("allow", 200, 1, len(out))


def _answered(ad, env):
    """A connection flow decided and sent upstream, with an empty 200 from the upstream."""
    f = _flow(lease=env.lease(connection="github"))
    run(ad.requestheaders(f))
    run(ad.request(f))
    f.response = tutils.tresp(content=b"")
    return f


def test_an_encoded_body_that_cannot_be_decoded_is_not_passed_back(edge, env):
    ad, _ = edge
    f = _answered(ad, env)
    f.response.headers["content-encoding"] = "gzip"
    del f.response.headers["content-length"]
    ad.responseheaders(f)
    shown = b"".join(f.response.stream(b"not gzip " + CANARY.encode())) + b"".join(f.response.stream(b""))
    assert shown == b""
    ad.response(f)
    assert f.error is not None and f.error.msg == f.error.KILLED_MESSAGE  # the client connection is cut
    event = [e for e in settle(_events(ad, env)) if e["kind"] == "request"][-1]  # allowed and sent, then cut
    assert (event["decision"], event["told"], event["failure"], event["aborted"], event["status"]) == (
        "allow", "response-decode-failed", "response-decode-failed", True, 200)


def test_a_small_declared_body_is_buffered_and_scanned_whole(edge, env):
    import gzip

    ad, _ = edge
    f = _answered(ad, env)
    body = gzip.compress(b"token=" + CANARY.encode())
    f.response.headers["content-encoding"] = "gzip"
    f.response.headers["content-length"] = str(len(body))
    ad.responseheaders(f)
    assert f.response.stream is False
    f.response.raw_content = body
    ad.response(f)
    assert f.response.content == b"token=[REDACTED]" and "content-encoding" not in f.response.headers
    assert f.response.headers["content-length"] == str(len(b"token=[REDACTED]"))


def test_a_buffered_body_that_cannot_be_decoded_is_replaced(edge, env):
    ad, _ = edge
    f = _answered(ad, env)
    f.response.headers["content-encoding"] = "gzip"
    f.response.raw_content = b"not gzip " + CANARY.encode()
    ad.response(f)
    assert f.response.status_code == 502 and f.response.headers["x-egresslaw-deny"] == "response-decode-failed"
    assert json.loads(f.response.content) == {"error": "upstream_error", "reason": "response-decode-failed"}
    assert_no_canary(f.response.raw_content, "the replaced response")


def test_an_unknown_coding_is_refused_before_the_head_goes_out(edge, env):
    ad, _ = edge
    f = _answered(ad, env)
    f.response.headers["content-encoding"] = "x-custom"
    ad.responseheaders(f)
    assert f.response.stream is False
    ad.response(f)
    assert f.response.status_code == 502 and f.response.headers["x-egresslaw-deny"] == "response-coding-unsupported"


def test_compressed_echo_is_decoded_then_redacted(edge, env):
    import gzip

    ad, _ = edge
    f = _answered(ad, env)
    f.response.headers["content-encoding"] = "gzip"
    del f.response.headers["content-length"]
    ad.responseheaders(f)
    assert "content-encoding" not in f.response.headers  # the client gets the decoded body
    body = gzip.compress(b"token=" + CANARY.encode())
    shown = b"".join(b"".join(f.response.stream(body[i : i + 5])) for i in range(0, len(body), 5)) + b"".join(f.response.stream(b""))
    ad.response(f)
    assert f.response.status_code == 200 and shown == b"token=[REDACTED]"


def test_log_lines_escape_control_characters(edge, env, caplog):
    ad, _ = edge
    caplog.set_level(logging.INFO, logger="egresslaw.proxy")
    f = _flow("https://api.acme-test.dev/admin%0a", lease=env.lease(connection="github"))
    f.request.path = "/admin\nforged log line"
    run(ad.requestheaders(f))
    ad.response(f)
    assert any(r.getMessage().startswith("deny path-") for r in caplog.records)
    assert all("\n" not in r.getMessage() for r in caplog.records)


def test_two_proxy_authorization_headers_are_malformed(edge, env):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"))
    f.request.headers.add("Proxy-Authorization", f"Bearer {env.lease(profile='ci')}")
    run(ad.requestheaders(f))
    assert f.response.status_code == 407 and f.response.headers["x-egresslaw-deny"] == "lease-malformed"


def test_a_flow_that_skipped_requestheaders_is_denied(edge, env):
    ad, _ = edge
    f = _flow(lease=env.lease(connection="github"))
    run(ad.request(f))  # no requestheaders first
    assert f.response.status_code == 403 and f.response.headers["x-egresslaw-deny"] == "internal-error"
    assert "authorization" not in f.request.headers
    ad.response(f)
    assert [e["reason"] for e in _events(ad, env)] == ["internal-error"]


@pytest.mark.parametrize("nameservers, closed", [([], True), (["127.0.0.1:5399"], False)])
def test_test_routing_without_a_nameserver_is_a_closed_world(env, nameservers, closed):
    """--resolve with no --nameserver: a name it does not list is never looked up (NXDOMAIN, resolve-failed)."""
    from egress_proxy.front.resolver import NoAddress

    asked = []

    async def system(host, port):
        asked.append(host)
        return ("93.184.215.14",)

    ad = EgressLaw()
    with taddons.context(proxyserver.Proxyserver(), ad) as tctx:
        tctx.configure(ad, **_options(env, egresslaw_resolve=["api.acme-test.dev=127.0.0.1"], egresslaw_nameservers=nameservers))
        ad.dns = system
        assert run(ad._resolve("api.acme-test.dev", 443)) == ("127.0.0.1",)
        if closed:
            with pytest.raises(NoAddress):
                run(ad._resolve("pkgs.acme-test.dev", 80))
            assert asked == []
        else:
            assert run(ad._resolve("pkgs.acme-test.dev", 80)) == ("93.184.215.14",) and asked == ["pkgs.acme-test.dev"]


# -- the hook table ----------------------------------------------------------------------------------


def test_the_hook_table_hands_each_hook_to_the_collaborator_that_answers_it():
    """Every mitmproxy hook (or method the layers ask their `Listener`) a collaborator defines is a row of EgressLaw's
    hook table naming that collaborator, and the addon's hook is the collaborator's own bound method; a collaborator's
    module never imports the addon (each is given what it takes, not the addon)."""
    from mitmproxy import hooks

    from egress_proxy.edge import attach, binding, gate, layers, requests, responses, upstreams

    ad = EgressLaw()
    table = {name: row.via for name, row in vars(EgressLaw).items() if isinstance(row, addon_mod.Hook)}
    hook_names = set(hooks.all_hooks) | {n for n in vars(layers.Listener) if not n.startswith("_")}
    answered = {name: via for via in ("gate", "upstreams", "binding", "attacher", "requests", "responses") for name in hook_names & set(dir(getattr(ad, via)))}
    assert table == answered
    assert {"tls_clienthello", "tls_start_client", "tcp_start", "udp_start", "server_connect", "server_connected",
            "server_connect_error", "server_disconnected", "reuse_key", "audit_malformed", "responseheaders", "response",
            "error", "http_connect", "requestheaders", "request", "owns", "protocol_error"} <= set(table)
    for name, via in table.items():
        assert getattr(ad, name) == getattr(getattr(ad, via), name), name
        assert name not in {n for klass in EgressLaw.__mro__[1:] for n in vars(klass)}, f"{name} is answered twice"
    for module in (attach, binding, gate, requests, responses, upstreams):
        imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(module))) if isinstance(node, ast.ImportFrom)}
        assert "egress_proxy.edge.addon" not in imported, module.__name__


# -- one record per client connection ------------------------------------------------------------


# Every dict- or set-valued attribute of the addon. A client's state lives in `_clients` only and a flow's in `_flows`
# only; the rest is configuration or a cache of prepared needles (keyed by credential, shared by clients). A new map
# keyed by a client or a flow must not be added beside them: it would need clearing by hand when its client goes.
MAPS = {"_clients", "_flows", "resolve_map", "test_routing", "own_addresses"}
# The collaborators' own maps (test routing's dial table, prepared needles per credential); the addon's `_clients`,
# `_flows` and `own_addresses` they hold are the addon's very objects, not copies.
COLLABORATOR_MAPS = {"upstreams": {"connect_to"}, "gate": set(), "binding": set(), "attacher": set(), "requests": set(),
                     "responses": {"_needle_sets"}}


def _maps(ad: object) -> set[str]:
    return {name for name, value in vars(ad).items() if isinstance(value, (dict, set, frozenset, list))}


def _own_maps(ad: EgressLaw, name: str) -> set[str]:
    shared = {id(value) for value in vars(ad).values()}
    part = getattr(ad, name)
    return {n for n in _maps(part) if id(getattr(part, n)) not in shared}


def test_the_only_per_client_map_is_clients(edge):
    assert _maps(EgressLaw()) == MAPS
    ad, _ = edge
    assert _maps(ad) == MAPS  # configured, too
    for fresh in (EgressLaw(), ad):
        assert {name: _own_maps(fresh, name) for name in COLLABORATOR_MAPS} == COLLABORATOR_MAPS
    assert ad.upstreams._clients is ad._clients and ad.upstreams._flows is ad._flows
    assert ad.upstreams.own_addresses is ad.own_addresses  # the runner adds its admin address to the addon's set


@pytest.mark.slow
def test_a_clients_state_is_gone_after_it_disconnects(env, pki, tls_upstream, http_upstream):
    """A real proxy: tunnels with requests, plain requests, a connection refused for good (another lease) and a
    malformed head; each open client connection is one record, and once they close nothing of them is left."""
    connect_to = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in HOSTS if h != "self.acme-test.dev"]
    connect_to.append(f"pkgs.acme-test.dev:80:127.0.0.1:{http_upstream.port}")
    p = start_proxy(env, pki, (tls_upstream, http_upstream), connect_to, listen=free_port())
    opened: list = []
    try:
        addon = p.addon
        state = lambda: p.threaded.call(lambda: (dict(addon._clients), dict(addon._flows)))  # noqa: E731
        mark = p.mark()
        tls_context = ssl.create_default_context(cafile=str(p.ca))
        for _ in range(3):  # a tunnel, two requests in it
            tunnel = HTTPSConnection(p.host, p.port, timeout=30, context=tls_context)
            tunnel.set_tunnel("api.acme-test.dev", 443, headers={"Proxy-Authorization": f"Bearer {env.lease(connection='github')}"})
            opened.append(tunnel)
            for _ in range(2):
                tunnel.request("GET", "/repos/acme/x")
                answer = tunnel.getresponse()
                answer.read()
                assert answer.status == 200
        plain = HTTPConnection(p.host, p.port, timeout=30)
        opened.append(plain)
        for _ in range(2):  # plain HTTP, two requests on one connection
            plain.request("GET", "http://pkgs.acme-test.dev/simple/pip/", headers={"Proxy-Authorization": f"Bearer {env.lease(profile='ci')}"})
            answer = plain.getresponse()
            answer.read()
            assert answer.status == 200
        refused = HTTPConnection(p.host, p.port, timeout=30)
        opened.append(refused)
        for subject, reason in (("agent-1", None), ("agent-2", "lease-mismatch")):  # another lease on it: refused for good
            refused.request("GET", "http://pkgs.acme-test.dev/simple/pip/", headers={"Proxy-Authorization": f"Bearer {env.lease(profile='ci', subject=subject)}"})
            answer = refused.getresponse()
            answer.read()
            assert answer.getheader("x-egresslaw-deny") == reason
        malformed = socket.create_connection((p.host, p.port), timeout=30)
        opened.append(malformed)
        malformed.sendall(b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n")
        assert malformed.recv(4096).startswith(b"HTTP/1.1 400")
        assert wait_for(lambda: any(e.get("reason") == "malformed-request" for e in p.new_events(mark)), 60)  # found by peername
        # One record per open connection: the proxy closed the refused and the malformed ones (and forgot them).
        assert wait_for(lambda: len(state()[0]) == 4, 60), state()
        clients = state()[0]
        assert sum(c.tunnel is not None for c in clients.values()) == 3
        assert all(c.pins and c.vetted and c.bound and c.refused is None for c in clients.values())
    finally:
        for conn in opened:
            conn.close()
    try:
        assert wait_for(lambda: state() == ({}, {}), 60), state()
        decided = p.settled(mark, timeout=30)
        assert sum(v["decision"] == "allow" for v in decided) == 3 + 6 + 2 + 1  # CONNECTs, tunnelled, plain, the first lease
    finally:
        stop_proxy(p)
