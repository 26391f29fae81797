"""Minted and signed credentials through the real proxy, against independent provider stand-ins.

The stand-ins (tests/credentials/providers.py) serve the real names: an RFC 6749 token endpoint and an API that takes
only a current token (Google's names), a GitHub App installation-token endpoint that verifies the edge's JWT with PyJWT
plus `git http-backend`, and S3 verifying every request's SigV4 with botocore. The proxy runs in-process with test
routing; the clients are real (requests, `git`, boto3 in a subprocess with placeholder keys). After the module, every
secret field and every token the stand-ins minted is searched for, in every encoding the scanner knows, in everything
the clients were shown, the proxy's logs, the audit log and the custody file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from compiler.compile import compile_paths
from egress_proxy.credentials import KINDS
from egress_proxy.credentials.base import needles_of, open_fields
from egress_proxy.custody.records import Address, decode_fields, encode_fields
from egress_proxy.custody.secret import Secret, encodings_of
from egress_proxy.custody.stores import open_store
from tests.credentials.providers import (
    GITHUB_API_HOST,
    GOOGLE_API_HOST,
    OAUTH_HOST,
    PUBLIC,
    S3_HOST,
    start_providers,
)
from tests.proxy_harness import (
    TEST_WORKERS,
    Pki,
    ScriptedResolver,
    make_env,
    start_proxy,
    stop_proxy,
    wait_for,
)

pytestmark = pytest.mark.slow

POLICY = """egresslaw 1
workspace "acme"
catalog "2026.11"

connection "drive" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "refresh_token",
                 scopes: ["https://www.googleapis.com/auth/drive.readonly"] }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
  egress "echo"  { host = "www.googleapis.com" path_prefix = "/echo" methods = ["GET"] }
}

connection "drive-revoked" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "refresh_token" }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "drive-private" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "client_credentials" }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "drive-moved" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/redirect", grant: "client_credentials" }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "drive-badcert" {
  credential = "drive-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://auth.badcert-test.dev/token", grant: "client_credentials" }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "reports" {
  credential = "reports-oauth"
  kind       = "oauth2"
  oauth2     = { token_url: "https://oauth2.googleapis.com/token", grant: "client_credentials", audience: "reports" }
  egress "files" { host = "www.googleapis.com" path_prefix = "/drive/v3" methods = ["GET"] }
}

connection "app" {
  credential = "gh-app"
  kind       = "github_app"
  github_app = { token_url: "https://api.github.com/app/installations/987654/access_tokens",
                 repositories: ["private"], permissions: { contents: "read" } }
  egress "api" { host = "api.github.com" path_prefix = "/installation" methods = ["GET"] headers = ["accept"] }
}

connection "app-rejected" {
  credential = "gh-app"
  kind       = "github_app"
  github_app = { token_url: "https://api.github.com/app/installations/987654/access_tokens" }
  egress "api" { host = "api.github.com" path_prefix = "/installation" methods = ["GET"] }
}

# GitHub's git endpoint takes HTTP Basic with `x-access-token` as the user: the edge encodes the minted token so
connection "app-git" {
  credential = "gh-app"
  kind       = "github_app"
  github_app = { token_url: "https://api.github.com/app/installations/987654/access_tokens", repositories: ["private"] }
  inject     = { header: "Authorization", format: "Basic {secret}", basic_user: "x-access-token" }
  egress "git" {
    host = "github.com" path_prefix = "/acme/private.git" methods = ["GET", "POST"]
    headers = ["accept", "content-type", "git-protocol", "accept-encoding", "content-encoding"]
  }
}

connection "artifacts" {
  credential = "aws-ci"
  kind       = "aws_sigv4"
  aws_sigv4  = { region: "us-east-1", service: "s3" }
  egress "bucket" {
    host = "s3.us-east-1.amazonaws.com" path_prefix = "/acme-artifacts" methods = ["GET", "PUT", "HEAD"]
    headers = ["content-type", "content-md5", "content-encoding", "x-amz-decoded-content-length", "x-amz-trailer",
               "x-amz-sdk-checksum-algorithm", "x-amz-checksum-crc32", "x-amz-checksum-mode"]
  }
}
"""

PROCESSES = max(1, TEST_WORKERS)  # edge processes (EGRESSLAW_TEST_WORKERS: `egresslaw proxy --workers N`)
PLACEHOLDER_KEY = "AKIAPLACEHOLDER00000"
BADCERT = "auth.badcert-test.dev"
PLACEHOLDER_SECRET = "placeholder-secret-never-used-upstream"


class World:
    def __init__(self, root: Path, providers, env, proxy) -> None:
        self.root, self.p, self.env, self.proxy = root, providers, env, proxy
        self.records: dict[str, Address] = {}

    def session(self, connection: str) -> requests.Session:
        lease = self.env.lease(connection=connection, subject=f"agent-{connection}")
        s = requests.Session()
        s.trust_env = False
        s.proxies = {"https": f"http://agent:{lease}@{self.proxy.host}:{self.proxy.port}"}
        s.verify = str(self.proxy.ca)
        return s

    def get(self, connection: str, url: str, **kw) -> requests.Response:
        r = self.session(connection).get(url, timeout=30, **kw)
        self.proxy.record(r.content + json.dumps(dict(r.headers)).encode())
        return r

    def secrets(self) -> list[bytes]:
        """Every value a leak would show: the record's secret fields (as custody holds them now), every token minted."""
        out: list[bytes] = []
        with open_store(self.env.store, self.env.keys, create=False) as store:
            for name, address in self.records.items():
                fields = open_fields(KINDS[name], store.open(address))
                out += [s.reveal() for s in fields.secret.values()]
        p = self.p
        with p.oauth.lock:
            out += [t.encode() for t in (*p.oauth.access_tokens, *p.oauth.refresh_tokens, *p.oauth.rotated, *p.oauth.revoked,
                                         p.oauth.client_secret)]
        with p.github.lock:
            out += [t.encode() for t in p.github.installation_tokens]
        out += [p.github.app_private_key_pem.encode(), p.s3.secret_access_key.encode()]
        return out


def _seal(env, connection: str, handle: str, kind: str, fields: dict[str, str]) -> Address:
    address = Address("acme", connection, handle)
    with open_store(env.store, env.keys, create=True) as store:
        store.put(address, encode_fields(kind, fields))
    return address


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("minted")
    p = start_providers(root / "providers", oauth_lifetime=2.0, rotate_refresh=True)
    policy = root / "policy"
    policy.mkdir()
    (policy / "main.egress").write_text(POLICY)
    result = compile_paths([policy])
    assert result.artifact is not None, result.diagnostics
    env = make_env(root / "edge", artifact=result.artifact)
    w = World(root, p, env, None)
    oauth = {"client_id": p.oauth.client_id, "client_secret": p.oauth.client_secret, "refresh_token": p.oauth.initial_refresh_token}
    w.records["oauth2"] = _seal(env, "drive", "drive-oauth", "oauth2", oauth)
    revoked = p.oauth.add_client("revoked-client", "revoked-secret-0123456789")
    _seal(env, "drive-revoked", "drive-oauth", "oauth2", {"client_id": "revoked-client", "client_secret": "revoked-secret-0123456789",
                                                         "refresh_token": revoked})
    p.oauth.revoke(revoked)
    for name in ("drive-private", "drive-moved", "drive-badcert"):
        _seal(env, name, "drive-oauth", "oauth2", {"client_id": p.oauth.client_id, "client_secret": p.oauth.client_secret})
    p.oauth.add_client("reports-client", "reports-secret-9876543210abc")
    _seal(env, "reports", "reports-oauth", "oauth2", {"client_id": "reports-client", "client_secret": "reports-secret-9876543210abc",
                                                      "auth_method": "client_secret_post"})
    w.records["github_app"] = _seal(env, "app", "gh-app", "github_app", {"app_id": str(p.github.app_id),
                                                                       "private_key": p.github.app_private_key_pem})
    for name in ("app-git", "app-rejected"):
        _seal(env, name, "gh-app", "github_app", {"app_id": str(p.github.app_id), "private_key": p.github.app_private_key_pem})
    w.records["aws_sigv4"] = _seal(env, "artifacts", "aws-ci", "aws_sigv4", {"access_key_id": p.s3.access_key_id,
                                                                           "secret_access_key": p.s3.secret_access_key})
    pki = Pki(p.ca_pem, p.ca_pem, p.ca_pem, p.ca_pem)  # only the CA is read: --upstream-ca
    # BADCERT: a name the stand-ins' certificate does not carry, routed to them (the edge must refuse the handshake)
    resolver = ScriptedResolver({**{name: [[ip]] for name, ip in PUBLIC.items()}, BADCERT: [["93.184.217.99"]]})
    w.proxy = start_proxy(env, pki, (), [*p.connect_to(), f"{BADCERT}:443:127.0.0.1:{p.port}"], resolver=resolver)
    yield w
    stop_proxy(w.proxy)
    p.stop()
    assert not p.errors, p.errors
    shown = [*w.proxy.seen, w.proxy.logs.text().encode(), w.proxy.audit_bytes()]
    if isinstance(env.store, Path):  # the SQLite file (EGRESSLAW_TEST_STORE=postgresql keeps custody in a database)
        shown.append(env.store.read_bytes())
    for value in w.secrets():
        for needle in encodings_of(value):
            if len(needle) >= 8:
                assert not any(needle in blob for blob in shown), "a secret field or a minted token leaked"
    w.proxy.assert_nothing_leaked()


def _mint_events(w: World, connection: str) -> list[dict]:
    return [e for e in w.proxy.events() if e.get("kind") == "mint" and e.get("connection") == connection]


# -- oauth2 ------------------------------------------------------------------------------------------


def test_oauth2_tokens_are_refreshed_for_ten_seconds_one_mint_at_a_time(world):
    w, p = world, world.p
    url = f"https://{GOOGLE_API_HOST}/drive/v3/files"
    statuses: list[int] = []
    lock = threading.Lock()
    deadline = time.monotonic() + 10

    def client() -> None:
        s = w.session("drive")
        while time.monotonic() < deadline:
            r = s.get(url, timeout=30)
            w.proxy.record(r.content)
            with lock:
                statuses.append(r.status_code)
            time.sleep(0.05)

    before, audited = p.oauth.mints, len(_mint_events(w, "drive"))
    with ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(client) for _ in range(4)]:
            f.result()
    mints = p.oauth.mints - before
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert mints >= 4  # 2-second tokens, refreshed before they expire
    assert mints <= PROCESSES * (10 / 1.0 + 2)  # once per token life (half of it before expiry) per process, not per request
    assert p.oauth.api_refused == 0
    assert wait_for(lambda: len(_mint_events(w, "drive")) - audited == mints)  # each mint is one audited event
    events = _mint_events(w, "drive")[audited:]
    assert all(e["decision"] == "allow" and e["status"] == 200 and e["host"] == OAUTH_HOST for e in events)

    # eight requests at once with no token cached: one mint
    time.sleep(2.2)
    before = p.oauth.mints
    barrier = threading.Barrier(8)

    def burst() -> int:
        s = w.session("drive")
        barrier.wait()
        return s.get(url, timeout=30).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: burst(), range(8)))
    assert codes == [200] * 8
    assert 1 <= p.oauth.mints - before <= PROCESSES  # one per edge process at most (`--workers N` mints in each)


def test_a_rotated_refresh_token_is_written_back_to_custody(world):
    """The token may be due when the GET comes: it is answered with the current token while a refresh runs in the
    background (the broker's `refresh_at`), so the provider can rotate after the answer. The write-back must follow
    within the wait: custody then holds the provider's current refresh token, and no rotation is left unwritten."""
    w, p = world, world.p
    assert w.get("drive", f"https://{GOOGLE_API_HOST}/drive/v3/files").status_code == 200

    def custody_holds_the_current_token() -> bool:
        with open_store(w.env.store, w.env.keys, create=False) as store:
            kind, fields = decode_fields(store.open(w.records["oauth2"]).reveal())
        assert kind == "oauth2"
        with p.oauth.lock:
            return fields["refresh_token"] in p.oauth.refresh_tokens  # the provider's current one

    assert wait_for(custody_holds_the_current_token)
    with p.oauth.lock:
        assert p.oauth.initial_refresh_token in p.oauth.rotated


def test_a_revoked_refresh_token_is_credential_mint_failed_and_nothing_is_forwarded(world):
    w, p = world, world.p
    api_before = len(p.requests_to(GOOGLE_API_HOST))
    r = w.get("drive-revoked", f"https://{GOOGLE_API_HOST}/drive/v3/files")
    assert r.status_code == 403 and r.headers["X-Egresslaw-Deny"] == "credential-mint-failed"
    assert r.json() == {"error": "egress_denied", "reason": "credential-mint-failed", "rule": None, "provider_status": 400,
                        "cause": "the token endpoint answered 400"}
    assert b"stand-in detail" not in r.content  # the provider's body is never relayed
    assert len(p.requests_to(GOOGLE_API_HOST)) == api_before  # zero API requests forwarded
    # a second request inside the failure hold does not call the provider again
    token_calls = len(p.requests_to(OAUTH_HOST))
    for _ in range(4):
        assert w.get("drive-revoked", f"https://{GOOGLE_API_HOST}/drive/v3/files").status_code == 403
    assert len(p.requests_to(OAUTH_HOST)) - token_calls <= PROCESSES - 1  # each process calls it once, then holds
    denied = [e for e in _mint_events(w, "drive-revoked") if e["decision"] == "deny"]
    assert denied and denied[0]["status"] == 400 and denied[0]["reason"] == "credential-mint-failed"


def test_client_credentials_with_the_secret_in_the_body(world):
    w, p = world, world.p
    r = w.get("reports", f"https://{GOOGLE_API_HOST}/drive/v3/files")
    assert r.status_code == 200, r.text
    with p.oauth.lock:
        form = next(f for f in reversed(p.oauth.token_requests) if f.get("client_id") == "reports-client")
        auth = p.oauth.token_auth[p.oauth.token_requests.index(form)]
    assert form["grant_type"] == "client_credentials" and form["audience"] == "reports" and auth == "client_secret_post"


def test_the_minted_token_is_redacted_from_responses(world):
    r = world.get("drive", f"https://{GOOGLE_API_HOST}/echo")
    assert r.status_code == 200
    assert b"[REDACTED]" in r.content and b"ya29." not in r.content


def test_a_token_endpoint_that_resolves_to_a_private_address_is_never_dialled(world):
    w, p = world, world.p
    w.proxy.resolver.table[OAUTH_HOST] = [["10.1.2.3"]]
    try:
        calls = len(p.requests_to(OAUTH_HOST))
        r = w.get("drive-private", f"https://{GOOGLE_API_HOST}/drive/v3/files")
        assert r.status_code == 403 and r.headers["X-Egresslaw-Deny"] == "credential-mint-failed"
        assert "provider_status" not in r.json()
        assert len(p.requests_to(OAUTH_HOST)) == calls
        event = _mint_events(w, "drive-private")[-1]
        assert event["answer_reason"] == "address-not-public" and event["status"] is None
    finally:
        w.proxy.resolver.table[OAUTH_HOST] = [[PUBLIC[OAUTH_HOST]]]


def test_a_token_endpoint_that_redirects_is_refused_and_not_followed(world):
    w, p = world, world.p
    before = [(h.path, h.method) for h in p.requests_to(OAUTH_HOST)]
    r = w.get("drive-moved", f"https://{GOOGLE_API_HOST}/drive/v3/files")
    assert r.status_code == 403 and r.headers["X-Egresslaw-Deny"] == "credential-mint-failed"
    assert r.json()["provider_status"] == 302
    after = [(h.path, h.method) for h in p.requests_to(OAUTH_HOST)]
    assert after[len(before):] == [("/redirect", "POST")]  # the grant went to the declared URL only, once


def test_a_token_endpoint_whose_certificate_is_not_for_its_name_is_refused(world):
    w, p = world, world.p
    r = w.get("drive-badcert", f"https://{GOOGLE_API_HOST}/drive/v3/files")
    assert r.status_code == 403 and r.headers["X-Egresslaw-Deny"] == "credential-mint-failed"
    assert "provider_status" not in r.json()
    assert p.requests_to(BADCERT) == []  # no request was sent over the unverified connection
    event = _mint_events(w, "drive-badcert")[-1]
    assert event["status"] is None and "certificate" in event["detail"]


# -- github_app ------------------------------------------------------------------------------------


def test_github_app_token_for_an_api_call_and_a_real_git_clone_with_basic_x_access_token(world):
    w, p = world, world.p
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    before = p.github.installation_mints
    r = w.get("app", f"https://{GITHUB_API_HOST}/installation/repositories", headers={"Accept": "application/vnd.github+json"})
    assert r.status_code == 200, r.text
    assert p.github.installation_mints == before + 1 and not p.github.jwt_failures
    request = p.github.installation_requests[-1]
    assert request["body"] == {"repositories": ["private"], "permissions": {"contents": "read"}}
    assert request["claims"]["iss"] == str(p.github.app_id)
    lease = w.env.lease(connection="app-git", subject="agent-git")
    home = w.root / "git-home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "GIT_TERMINAL_PROMPT": "0",
           "HTTPS_PROXY": f"http://agent:{lease}@{w.proxy.host}:{w.proxy.port}", "GIT_SSL_CAINFO": str(w.proxy.ca),
           "GIT_CONFIG_NOSYSTEM": "1"}
    done = subprocess.run([git, "clone", "-q", "https://github.com/acme/private.git", str(home / "private")], env=env,
                          capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    w.proxy.record(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert (home / "private" / "README.md").exists()
    assert p.github.git_ok >= 2 and p.github.installation_mints == before + 2  # one token per connection, cached
    sent = {h.header("authorization").split()[0] for h in p.requests_to("github.com") if h.header("authorization")}
    assert sent == {"Basic"}  # base64("x-access-token:" + the minted token), which the stand-in decodes and checks


def test_a_minted_token_the_upstream_refuses_is_minted_again(world):
    """Revoked at the provider before it expired: that request gets the provider's 401 (redacted, as any response), the
    edge forgets the token, and the next request carries a new one."""
    if PROCESSES > 1:
        pytest.skip("each `--workers` process caches its own token, and which one answers is the kernel's choice")
    w, p = world, world.p
    url = f"https://{GITHUB_API_HOST}/installation/repositories"
    before = p.github.installation_mints
    assert w.get("app-rejected", url).status_code == 200
    with p.github.lock:
        token = list(p.github.installation_tokens)[-1]
    p.github.revoke(token)
    assert w.get("app-rejected", url).status_code == 401
    assert w.get("app-rejected", url).status_code == 200
    assert p.github.installation_mints - before == 2


# -- aws_sigv4 -------------------------------------------------------------------------------------

BOTO = """
import json, sys
import boto3
from botocore.config import Config
s3 = boto3.client("s3", region_name="us-east-1", endpoint_url="https://s3.us-east-1.amazonaws.com",
                  aws_access_key_id=sys.argv[1], aws_secret_access_key=sys.argv[2], config=Config(s3={"addressing_style": "path"}))
s3.put_object(Bucket="acme-artifacts", Key="reports/q4 summary.txt", Body=b"built through the egress proxy\\n")
listed = s3.list_objects_v2(Bucket="acme-artifacts", Prefix="reports/")
body = s3.get_object(Bucket="acme-artifacts", Key="reports/q4 summary.txt")["Body"].read()
print(json.dumps({"keys": [o["Key"] for o in listed.get("Contents", [])], "body": body.decode()}))
"""


def test_boto3_with_placeholder_keys_is_resigned_at_the_edge(world):
    w, p = world, world.p
    lease = w.env.lease(connection="artifacts", subject="agent-aws")
    home = w.root / "aws-home"
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "HTTPS_PROXY": f"http://agent:{lease}@{w.proxy.host}:{w.proxy.port}", "AWS_CA_BUNDLE": str(w.proxy.ca),
           "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", BOTO, PLACEHOLDER_KEY, PLACEHOLDER_SECRET], env=env, capture_output=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    w.proxy.record(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stderr.decode(errors="replace")[-2000:], p.s3.failures)
    out = json.loads(done.stdout)
    assert out == {"keys": ["reports/q4 summary.txt"], "body": "built through the egress proxy\n"}
    assert p.s3.sigv4_ok >= 3 and p.s3.sigv4_failed == 0, p.s3.failures
    assert set(p.s3.key_ids_seen) == {p.s3.access_key_id}
    for hit in p.requests_to(S3_HOST):  # the placeholder never reached the upstream, in any header
        assert not any(PLACEHOLDER_KEY in v or PLACEHOLDER_SECRET in v for _, v in hit.headers)
    assert "STREAMING-UNSIGNED-PAYLOAD-TRAILER" in p.s3.payload_hashes_seen  # the upload streamed, unsigned payload


def test_a_client_signing_header_is_never_forwarded(world):
    w, p = world, world.p
    mark = len(p.requests_to(S3_HOST))
    r = w.get("artifacts", f"https://{S3_HOST}/acme-artifacts?list-type=2",
              headers={"X-Amz-Date": "20200101T000000Z", "X-Amz-Content-Sha256": "deadbeef", "X-Amz-Security-Token": "forged",
                       "Authorization": "AWS4-HMAC-SHA256 Credential=AKIAFORGED/20200101/us-east-1/s3/aws4_request"})
    assert r.status_code == 200, r.text
    hit = p.requests_to(S3_HOST)[mark]
    assert hit.all("x-amz-date") != ["20200101T000000Z"] and hit.all("x-amz-security-token") == []
    assert hit.all("x-amz-content-sha256") == ["UNSIGNED-PAYLOAD"] and len(hit.all("authorization")) == 1
    assert "AKIAFORGED" not in hit.header("authorization")


def test_a_record_of_another_kind_is_credential_record_invalid(world):
    w = world
    _seal(w.env, "reports", "reports-oauth", "aws_sigv4", {"access_key_id": "AKIAX", "secret_access_key": "not-this-kind-secret"})
    try:
        r = w.get("reports", f"https://{GOOGLE_API_HOST}/drive/v3/files")
        assert r.status_code == 403 and r.headers["X-Egresslaw-Deny"] == "credential-record-invalid"
    finally:
        _seal(w.env, "reports", "reports-oauth", "oauth2", {"client_id": "reports-client", "client_secret": "reports-secret-9876543210abc",
                                                            "auth_method": "client_secret_post"})


def test_needles_cover_every_secret_field():
    """The scanner's needles for a record: each secret field in each encoding, plain fields not (a client id may appear)."""
    fields = open_fields(KINDS["oauth2"], Secret(encode_fields("oauth2", {"client_id": "visible-client-id",
                                                                          "client_secret": "s3cr3t-value-123",
                                                                          "refresh_token": "1//refresh-abcdef"})))
    needles = needles_of(fields, (Secret(b"ya29.minted-token"), "Bearer {secret}"))
    for value in (b"s3cr3t-value-123", b"1//refresh-abcdef", b"ya29.minted-token"):
        assert set(encodings_of(value)) <= set(needles)
    assert not any(b"visible-client-id" in n for n in needles)
