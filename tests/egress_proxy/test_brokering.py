"""Credential brokering through the real proxy: a sandbox-profile lease, a request that matches a brokered rule.

The profile `ci` brokers connection `github` (its credential in custody is the canary). A request of `ci` that
matches one of `github`'s rules goes upstream as `github`'s traffic: exactly one credential, only the rule's
allowlisted headers, `github`'s worker judging the answers; its response is scanned and redacted like a
connection's; its audit events name the profile, the connection and the rule. Every other request of `ci`, and
every request of `plain` (same hosts, no brokers), is plain sandbox traffic: no credential, ever.
"""

from __future__ import annotations

import json
import ssl

import httpx
import pytest

from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    CANARY,
    ScriptedResolver,
    assert_no_canary,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
)

pytestmark = pytest.mark.slow

API = "api.acme-test.dev"
DENIED = "other.acme-test.dev"  # resolves into `edge`'s deny list: a brokered request there is refused


def _artifact():
    github = b.connection("github", [
        b.rule("read", API, "/repos/acme", ["GET", "HEAD"], ["accept", "user-agent"]),
        b.rule("echo", API, "/echo", ["GET"]),
        b.rule("leak", API, "/leak", ["GET"]),
        b.rule("edge-only", DENIED, "/repos", ["GET"]),
    ], credential="gh-prod", worker="edge")
    hosts = [(API, 443), (DENIED, 443)]
    return b.artifact(
        connections=[github],
        profiles=[b.profile("ci", hosts, brokers=("github",)), b.profile("plain", hosts)],
        workers=[b.worker("edge", deny_cidrs=("93.184.216.38/32",))],
        workspace="acme",
    )


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, tls_upstream, pki):
    env = make_env(tmp_path_factory.mktemp("broker"), artifact=_artifact())
    connect_to = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in (API, DENIED)]
    p = start_proxy(env, pki, (tls_upstream,), connect_to, listen=free_port(), resolver=ScriptedResolver())
    yield p
    stop_proxy(p)
    p.assert_nothing_leaked()


def _client(p, lease: str) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(p.ca))
    proxy = httpx.Proxy(f"http://{p.host}:{p.port}", headers={"Proxy-Authorization": f"Bearer {lease}"})
    return httpx.Client(proxy=proxy, verify=ctx, trust_env=False, timeout=10)


def _get(p, profile: str, path: str, host: str = API, headers: dict | None = None) -> httpx.Response:
    with _client(p, p.lease(profile=profile, subject=f"sandbox-{profile}")) as c:
        r = c.get(f"https://{host}{path}", headers={"Authorization": "Bearer sandbox-own", **(headers or {})})
    p.record(repr(list(r.headers.items())).encode() + r.content)
    return r


def _requests(p, mark) -> list[dict]:
    return [e for e in p.settled(mark) if e["kind"] == "request"]


def test_a_matching_request_gets_exactly_one_credential_and_only_the_rules_headers(proxy, tls_upstream):
    mark = proxy.mark()
    r = _get(proxy, "ci", "/repos/acme/app", headers={"Accept": "application/json", "User-Agent": "git/2", "X-Other": "1",
                                                      "X-Forwarded-Host": "evil.example"})
    assert r.status_code == 200
    seen = tls_upstream.requests[-1]
    assert seen.path == "/repos/acme/app"
    assert seen.all("Authorization") == [f"Bearer {CANARY}"]  # the brokered one; the sandbox's own is gone
    assert seen.all("Accept") == ["application/json"] and seen.all("User-Agent") == ["git/2"]
    assert not seen.all("X-Other") and not seen.all("X-Forwarded-Host")  # not on the rule's allowlist
    [event] = _requests(proxy, mark)
    assert (event["profile"], event["connection"], event["broker"], event["rule"]) == ("ci", None, "github", "read")
    assert (event["decision"], event["status"]) == ("allow", 200)


def test_the_response_is_scanned_and_redacted_like_a_connections(proxy):
    mark = proxy.mark()
    echo = _get(proxy, "ci", "/echo")
    body = echo.json()
    assert body["authorization"] == "Bearer [REDACTED]" and body["b64"] == "[REDACTED]" and body["hex"] == "[REDACTED]"
    assert echo.headers["x-echo-auth"] == "Bearer [REDACTED]"
    leak = _get(proxy, "ci", "/leak/b64/gzip")
    assert leak.status_code == 200 and b"[REDACTED]" in leak.content
    for r in (echo, leak):
        assert_no_canary(r.content + repr(list(r.headers.items())).encode(), "a brokered response")
    events = _requests(proxy, mark)
    assert [(e["broker"], e["rule"]) for e in events] == [("github", "echo"), ("github", "leak")]
    assert all(e["redactions"] > 0 for e in events)


def test_outside_the_rules_and_without_brokers_no_credential_reaches_the_upstream(proxy, tls_upstream):
    mark = proxy.mark()
    outside = _get(proxy, "ci", "/repos/acmex", headers={"X-Other": "1"})  # same host, no rule admits the path
    plain = _get(proxy, "plain", "/echo")  # a rule would admit it, but `plain` brokers nothing
    assert outside.status_code == plain.status_code == 200
    first, second = tls_upstream.requests[-2:]
    assert first.path == "/repos/acmex" and not first.all("Authorization") and first.all("X-Other") == ["1"]
    assert second.path == "/echo" and not second.all("Authorization")
    assert plain.json()["authorization"] == ""
    events = _requests(proxy, mark)
    assert [(e["profile"], e["broker"], e["rule"]) for e in events] == [("ci", None, None), ("plain", None, None)]
    assert all(e["decision"] == "allow" for e in events)


def test_brokered_traffic_is_judged_by_the_connections_worker(proxy, tls_upstream):
    before = len(tls_upstream.requests)
    mark = proxy.mark()
    brokered = _get(proxy, "ci", "/repos/x", host=DENIED)  # brokered: `edge` denies the answer
    plain = _get(proxy, "plain", "/repos/x", host=DENIED)  # plain traffic: `default` admits it
    assert brokered.status_code == 403 and brokered.headers["x-egresslaw-deny"] == "address-denied"
    assert plain.status_code == 200
    assert [s.path for s in tls_upstream.requests[before:]] == ["/repos/x"]
    assert not tls_upstream.requests[-1].all("Authorization")
    assert [(e["profile"], e["reason"]) for e in _requests(proxy, mark)] == [("ci", "address-denied"), ("plain", "allowed")]


def test_an_upstream_connection_that_carried_the_credential_is_not_reused_for_plain_traffic(proxy, tls_upstream):
    lease = proxy.lease(profile="ci", subject="sandbox-reuse")
    mark = proxy.mark()
    with _client(proxy, lease) as c:
        for path in ("/repos/acme/a", "/repos/acme/b", "/repos/acmex", "/repos/acme/c"):
            r = c.get(f"https://{API}{path}")
            proxy.record(r.content)
            assert r.status_code == 200
    brokered = [e["broker"] for e in _requests(proxy, mark)]
    assert brokered == ["github", "github", None, "github"]
    # one upstream connection for the first two; it is closed before the plain request, which opens a second (that
    # one carried no credential, so the brokered request after it may use it): reused throughout, it would be one
    assert proxy.upstream_delta(mark)[0][0] == 2, proxy.upstream_delta(mark)
    auth = [s.all("Authorization") for s in tls_upstream.requests[-4:]]
    assert auth == [[f"Bearer {CANARY}"], [f"Bearer {CANARY}"], [], [f"Bearer {CANARY}"]]


def test_the_audit_log_names_profile_broker_and_rule_and_never_the_secret(proxy):
    mark = proxy.mark()
    _get(proxy, "ci", "/repos/acme/app")
    events = proxy.new_events(mark)
    decision = next(e for e in events if e["kind"] == "request")
    outcome = proxy.outcome(decision)
    assert outcome is not None and (outcome["broker"], outcome["rule"]) == ("github", "read")
    assert_no_canary(json.dumps(events), "the audit events")


def test_an_absolute_form_https_request_in_the_clear_is_brokered_over_tls(proxy, tls_upstream):
    import http.client

    conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=10)
    conn.request("GET", f"https://{API}/repos/acme/clear", headers={
        "Proxy-Authorization": f"Bearer {proxy.lease(profile='ci', subject='sandbox-clear')}", "Authorization": "Basic eDp5"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    proxy.record(body)
    assert resp.status == 200 and json.loads(body)["tls"] is True  # the upstream leg is TLS
    seen = tls_upstream.requests[-1]
    assert seen.path == "/repos/acme/clear" and seen.all("Authorization") == [f"Bearer {CANARY}"]
