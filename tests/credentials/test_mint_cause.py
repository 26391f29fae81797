"""A token endpoint that answers 200 with no token response: the client's denial says why, not only `provider_status: 200`.

The OAuth stand-in (tests/credentials/providers.py) answers 200 on three paths with something that is not a token
response: an HTML login page, a JSON list, JSON without `access_token`. Each is a connection's `token_url`; a real
client (requests) asks the real proxy (in-process, test routing) for the API behind it. The denial names the reason,
the provider's status and the class of problem (`cause`), and never the provider's body; the audit event agrees.
"""

from __future__ import annotations

import json

import pytest
import requests

from compiler.compile import compile_paths
from egress_proxy.custody.records import Address, encode_fields
from egress_proxy.custody.stores import open_store
from tests.credentials.providers import (
    BROKEN_200_MARKER,
    GOOGLE_API_HOST,
    OAUTH_HOST,
    PUBLIC,
    start_providers,
)
from tests.proxy_harness import Pki, ScriptedResolver, make_env, start_proxy, stop_proxy

pytestmark = pytest.mark.slow

CASES = {  # connection -> (token endpoint path, the cause the client is told)
    "drive-html": ("/html", "the token endpoint answered 200 with a body that is not JSON"),
    "drive-list": ("/list", "the token endpoint answered 200 with JSON that is not an object"),
    "drive-no-token": ("/no-token", "the token endpoint answered 200 without a usable token"),
}
POLICY = 'egresslaw 1\nworkspace "acme"\ncatalog "2026.11"\n' + "".join(f"""
connection "{name}" {{
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = {{ token_url: "https://{OAUTH_HOST}{path}", grant: "client_credentials" }}
  egress "files" {{ host = "{GOOGLE_API_HOST}" path_prefix = "/drive/v3" methods = ["GET"] }}
}}
""" for name, (path, _) in CASES.items())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("mint-cause")
    p = start_providers(root / "providers")
    (root / "policy").mkdir()
    (root / "policy" / "main.egress").write_text(POLICY)
    result = compile_paths([root / "policy"])
    assert result.artifact is not None, result.diagnostics
    env = make_env(root / "edge", artifact=result.artifact)
    with open_store(env.store, env.keys, create=True) as store:
        for name in CASES:
            store.put(Address("acme", name, "drive-oauth"),
                      encode_fields("oauth2", {"client_id": p.oauth.client_id, "client_secret": p.oauth.client_secret}))
    pki = Pki(p.ca_pem, p.ca_pem, p.ca_pem, p.ca_pem)  # only the CA is read: --upstream-ca
    resolver = ScriptedResolver({name: [[ip]] for name, ip in PUBLIC.items()})
    proxy = start_proxy(env, pki, (), p.connect_to(), resolver=resolver)
    yield env, proxy, p
    stop_proxy(proxy)
    p.stop()
    assert not p.errors, p.errors


@pytest.mark.parametrize("connection", list(CASES))
def test_the_denial_names_the_class_of_the_token_endpoints_failure(world, connection):
    env, proxy, p = world
    path, cause = CASES[connection]
    api_before = len(p.requests_to(GOOGLE_API_HOST))
    s = requests.Session()
    s.trust_env = False
    s.proxies = {"https": f"http://agent:{env.lease(connection=connection, subject='agent-1')}@{proxy.host}:{proxy.port}"}
    s.verify = str(proxy.ca)
    r = s.get(f"https://{GOOGLE_API_HOST}/drive/v3/files", timeout=60)
    proxy.record(r.content + json.dumps(dict(r.headers)).encode())
    assert r.status_code == 403 and r.headers["X-Egresslaw-Deny"] == "credential-mint-failed"
    assert r.json() == {"error": "egress_denied", "reason": "credential-mint-failed", "rule": None, "provider_status": 200,
                        "cause": cause}
    assert BROKEN_200_MARKER.encode() not in r.content  # the provider's body is never relayed
    assert len(p.requests_to(GOOGLE_API_HOST)) == api_before  # nothing went to the API
    assert [h.path for h in p.requests_to(OAUTH_HOST)].count(path) >= 1  # the endpoint really was asked
    mints = [e for e in proxy.events() if e.get("kind") == "mint" and e.get("connection") == connection]
    assert mints and mints[-1]["decision"] == "deny" and mints[-1]["status"] == 200 and cause in mints[-1]["detail"]
    assert BROKEN_200_MARKER not in proxy.logs.text() and BROKEN_200_MARKER.encode() not in proxy.audit_bytes()
    proxy.assert_nothing_leaked()
