"""The provider stand-ins on their own (no egress proxy): each accepts the right credentials and refuses the wrong ones.

Clients reach the stand-in directly on 127.0.0.1 with SNI and Host set to the real names: http.client over a socket
wrapped for NAME, git with `http.curloptResolve`, boto3 with `socket.getaddrinfo` patched inside the test only.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import time
import zlib
from dataclasses import dataclass
from urllib.parse import quote_plus, urlencode

import boto3
import jwt
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.credentials.providers import (
    GIT_FILE,
    GIT_PRIVATE_TEXT,
    NAMES,
    PUBLIC,
    Providers,
    decode_aws_chunked,
    start_providers,
)

OAUTH = "oauth2.googleapis.com"
GAPI = "www.googleapis.com"
GH_API = "api.github.com"
GH = "github.com"
S3 = "s3.us-east-1.amazonaws.com"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def providers(tmp_path_factory) -> Providers:
    p = start_providers(tmp_path_factory.mktemp("providers"))
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def _no_stand_in_failures(providers):
    yield
    assert providers.errors == []


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self):
        return json.loads(self.body)


def call(p: Providers, name: str, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None) -> Reply:
    """One request to the stand-in as NAME: TLS to 127.0.0.1:port with SNI NAME, the CA trusted, Host NAME."""
    context = ssl.create_default_context(cafile=str(p.ca_pem))
    conn = http.client.HTTPSConnection(name, 443, context=context, timeout=10)
    conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", p.port), timeout=10), server_hostname=name)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        conn.close()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ---------------------------------------------------------------------------------------------
# OAuth 2.0
# ---------------------------------------------------------------------------------------------


def token(p: Providers, form: dict, client: tuple[str, str] | None = None, headers: dict | None = None) -> Reply:
    """POST /token; `client`: client_secret_basic, id and secret form-urlencoded first (RFC 6749 §2.3.1)."""
    h = {**FORM, **(headers or {})}
    if client:
        h["Authorization"] = basic(quote_plus(client[0]), quote_plus(client[1]))
    return call(p, OAUTH, "POST", "/token", urlencode(form), h)


def test_refresh_with_rotation_retires_the_presented_refresh_token(providers):
    o = providers.oauth
    secret = "s3cr+t/with:colon%&="  # needs the §2.3.1 encoding
    rt = o.add_client("rotating-client", secret)
    o.rotate_refresh = True
    try:
        mints = o.mints
        r = token(providers, {"grant_type": "refresh_token", "refresh_token": rt, "scope": "a b"}, ("rotating-client", secret))
        assert r.status == 200, r.body
        assert r.headers["Cache-Control"] == "no-store"
        doc = r.json()
        assert doc["token_type"] == "Bearer" and doc["expires_in"] == 2 and doc["scope"] == "a b"
        assert doc["access_token"].startswith("ya29.") and doc["access_token"] in o.access_tokens
        new = doc["refresh_token"]
        assert new != rt and rt not in o.refresh_tokens and o.refresh_tokens[new] == "rotating-client" and o.rotated[rt] == new
        assert o.mints == mints + 1 and o.token_auth[-1] == "client_secret_basic" and o.token_requests[-1]["refresh_token"] == rt

        again = token(providers, {"grant_type": "refresh_token", "refresh_token": rt}, ("rotating-client", secret))
        assert again.status == 400 and again.json()["error"] == "invalid_grant" and rt.encode() in again.body
        assert token(providers, {"grant_type": "refresh_token", "refresh_token": new}, ("rotating-client", secret)).status == 200
        # The secret sent in Basic without the form-urlencoding is another secret.
        raw = {**FORM, "Authorization": basic("rotating-client", secret)}
        assert call(providers, OAUTH, "POST", "/token", urlencode({"grant_type": "client_credentials"}), raw).status == 401
        assert o.mints == mints + 2
    finally:
        o.rotate_refresh = False


def test_client_credentials_with_client_secret_post_records_scope_and_audience(providers):
    o = providers.oauth
    form = {"grant_type": "client_credentials", "client_id": o.client_id, "client_secret": o.client_secret,
            "scope": "https://www.googleapis.com/auth/cloud-platform", "audience": "https://api.example.test"}
    r = token(providers, form)
    assert r.status == 200, r.body
    doc = r.json()
    assert "refresh_token" not in doc and doc["scope"] == form["scope"] and o.access_valid(doc["access_token"])
    assert o.token_requests[-1] == form and o.token_auth[-1] == "client_secret_post"


def test_wrong_client_secret_is_invalid_client_401(providers):
    o = providers.oauth
    form = {"grant_type": "refresh_token", "refresh_token": o.initial_refresh_token}
    r = token(providers, form, (o.client_id, "not-the-secret"))
    assert r.status == 401 and r.json()["error"] == "invalid_client" and r.headers["WWW-Authenticate"].startswith("Basic")
    assert r.json()["error_description"] == f"stand-in detail {o.initial_refresh_token}"
    r = token(providers, {**form, "client_id": o.client_id, "client_secret": "not-the-secret"})
    assert r.status == 401 and r.json()["error"] == "invalid_client"
    assert token(providers, {**form, "client_id": "nobody", "client_secret": "x"}).status == 401
    assert token(providers, {**form, "client_id": o.client_id}).status == 401  # a confidential client must authenticate
    assert o.initial_refresh_token in o.refresh_tokens  # refusals change nothing


def test_revoked_refresh_token_is_invalid_grant_and_the_body_names_it(providers):
    o = providers.oauth
    rt = o.add_client(o.client_id, o.client_secret)
    assert token(providers, {"grant_type": "refresh_token", "refresh_token": rt}, (o.client_id, o.client_secret)).status == 200
    o.revoke(rt)
    r = token(providers, {"grant_type": "refresh_token", "refresh_token": rt}, (o.client_id, o.client_secret))
    assert r.status == 400 and r.headers["Cache-Control"] == "no-store"
    assert r.json() == {"error": "invalid_grant", "error_description": f"stand-in detail {rt}"}
    other = o.add_client("other-client", "other-secret")  # another client's refresh token is no grant either
    assert token(providers, {"grant_type": "refresh_token", "refresh_token": other}, (o.client_id, o.client_secret)).status == 400


def test_public_client_may_refresh_but_not_use_client_credentials(providers):
    o = providers.oauth
    rt = o.add_client("public-cli", None)
    r = token(providers, {"grant_type": "refresh_token", "refresh_token": rt, "client_id": "public-cli"})
    assert r.status == 200 and o.token_auth[-1] == "none"
    r = token(providers, {"grant_type": "client_credentials", "client_id": "public-cli"})
    assert r.status == 400 and r.json()["error"] == "unauthorized_client"


def test_malformed_token_requests(providers):
    o = providers.oauth
    client = (o.client_id, o.client_secret)
    assert token(providers, {"grant_type": "password", "username": "u", "password": "p"}, client).json()["error"] == "unsupported_grant_type"
    assert token(providers, {"refresh_token": o.initial_refresh_token}, client).json()["error"] == "invalid_request"
    assert token(providers, {"grant_type": "refresh_token"}, client).json()["error"] == "invalid_request"
    both = {"grant_type": "client_credentials", "client_secret": o.client_secret}
    assert token(providers, both, client).json()["error"] == "invalid_request"  # two client authentication methods
    twice = "grant_type=client_credentials&grant_type=refresh_token"
    r = call(providers, OAUTH, "POST", "/token", twice, {**FORM, "Authorization": basic(quote_plus(o.client_id), quote_plus(o.client_secret))})
    assert r.status == 400 and r.json()["error"] == "invalid_request"
    r = token(providers, {"grant_type": "client_credentials"}, client, {"Content-Type": "application/json"})
    assert r.status == 400 and r.json()["error"] == "invalid_request"
    assert call(providers, OAUTH, "GET", "/token").status == 405


def test_google_api_takes_only_issued_unexpired_access_tokens(providers):
    o = providers.oauth
    o.lifetime = 0.5
    try:
        doc = token(providers, {"grant_type": "client_credentials"}, (o.client_id, o.client_secret)).json()
    finally:
        o.lifetime = 2.0
    assert doc["expires_in"] == 0.5
    access = doc["access_token"]
    ok, refused = o.api_ok, o.api_refused
    r = call(providers, GAPI, "GET", "/drive/v3/files", headers={"Authorization": f"Bearer {access}"})
    assert r.status == 200 and r.json()["files"][0]["name"] == "plan.txt"
    r = call(providers, GAPI, "GET", "/drive/v3/files", headers={"Authorization": "Bearer ya29.forged"})
    assert r.status == 401 and "invalid_token" in r.headers["WWW-Authenticate"]
    assert call(providers, GAPI, "GET", "/drive/v3/files").status == 401
    with o.lock:
        o.access_tokens[access] = time.time() - 1
    assert call(providers, GAPI, "GET", "/drive/v3/files", headers={"Authorization": f"Bearer {access}"}).status == 401
    assert (o.api_ok, o.api_refused) == (ok + 1, refused + 3)
    echo = call(providers, GAPI, "GET", "/echo", headers={"Authorization": f"Bearer {access}"})
    assert echo.status == 200 and f"Bearer {access}".encode() in echo.body


# ---------------------------------------------------------------------------------------------
# GitHub App
# ---------------------------------------------------------------------------------------------


def app_jwt(p: Providers, *, key_pem: str | None = None, iat: int | None = None, exp: int | None = None,
            iss: object = None, algorithm: str = "RS256") -> str:
    iat = int(time.time()) - 30 if iat is None else iat
    claims = {"iat": iat, "exp": iat + 540 if exp is None else exp, "iss": str(p.github.app_id) if iss is None else iss}
    # PyJWT's encode refuses a non-string `iss`; the JWS layer signs any payload (GitHub takes the App ID as a number).
    return jwt.PyJWS().encode(json.dumps(claims).encode(), key_pem or p.github.app_private_key_pem, algorithm=algorithm)


def mint(p: Providers, jwt_token: str, body: dict | None = None, installation: int | None = None) -> Reply:
    path = f"/app/installations/{installation or p.github.installation_id}/access_tokens"
    headers = {"Authorization": f"Bearer {jwt_token}", "Accept": "application/vnd.github+json", "Content-Type": "application/json"}
    return call(p, GH_API, "POST", path, json.dumps(body) if body is not None else None, headers)


def test_app_jwt_mints_an_installation_token(providers):
    gh = providers.github
    assert "BEGIN RSA PRIVATE KEY" in gh.app_private_key_pem
    mints = gh.installation_mints
    asked = {"repositories": ["private"], "permissions": {"contents": "read"}}
    r = mint(providers, app_jwt(providers), asked)
    assert r.status == 201, r.body
    doc = r.json()
    assert re.fullmatch(r"ghs_[A-Za-z0-9]{36}", doc["token"]) and doc["permissions"] == {"contents": "read"}
    expires = datetime.datetime.strptime(doc["expires_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    assert abs(expires.timestamp() - time.time() - 3600) < 5
    assert gh.installation_requests[-1]["body"] == asked
    for iss in (gh.app_id, gh.app_client_id):  # GitHub takes the App ID as an int too, and the client ID
        assert mint(providers, app_jwt(providers, iss=iss)).status == 201
    assert gh.installation_mints == mints + 3

    tok = doc["token"]
    for scheme in ("Bearer", "token"):
        r = call(providers, GH_API, "GET", "/installation/repositories", headers={"Authorization": f"{scheme} {tok}"})
        assert r.status == 200 and r.json()["repositories"][0]["full_name"] == "acme/private"
    assert call(providers, GH_API, "GET", "/installation/repositories", headers={"Authorization": "token ghs_forged"}).status == 401
    assert call(providers, GH_API, "GET", "/installation/repositories").status == 401


def test_bad_app_jwts_are_refused(providers):
    gh = providers.github
    now = int(time.time())
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    other_pem = other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    bad = {
        "expired": app_jwt(providers, iat=now - 700, exp=now - 100),
        "wrong key": app_jwt(providers, key_pem=other_pem),
        "over 10 minutes": app_jwt(providers, iat=now - 30, exp=now + 870),
        "iat in the future": app_jwt(providers, iat=now + 300, exp=now + 500),
        "another App": app_jwt(providers, iss="654321"),
        "HS256": jwt.encode({"iat": now, "exp": now + 60, "iss": str(gh.app_id)}, "x" * 32, algorithm="HS256"),
        "not a JWT": "not.a.jwt",
    }
    mints, failures = gh.installation_mints, len(gh.jwt_failures)
    for why, token_ in bad.items():
        r = mint(providers, token_)
        assert r.status == 401, why
        assert r.json()["message"] == "A JSON web token could not be decoded", why
    assert call(providers, GH_API, "POST", f"/app/installations/{gh.installation_id}/access_tokens").status == 401
    assert gh.installation_mints == mints and len(gh.jwt_failures) == failures + len(bad) + 1
    assert mint(providers, app_jwt(providers), installation=111).status == 404


def test_private_repository_takes_a_current_installation_token(providers):
    gh = providers.github
    tok = mint(providers, app_jwt(providers)).json()["token"]
    refs = "/acme/private.git/info/refs?service=git-upload-pack"
    r = call(providers, GH, "GET", refs)
    assert r.status == 401 and r.headers["WWW-Authenticate"] == 'Basic realm="GitHub"'
    for auth in (f"Bearer {tok}", basic("x-access-token", tok)):
        r = call(providers, GH, "GET", refs, headers={"Authorization": auth})
        assert r.status == 200 and r.headers["Content-Type"] == "application/x-git-upload-pack-advertisement"
    for auth in (basic("someone", tok), f"Bearer {tok}x", "Bearer ghs_" + "a" * 36):
        assert call(providers, GH, "GET", refs, headers={"Authorization": auth}).status == 401
    assert call(providers, GH, "GET", "/acme/demo.git/info/refs?service=git-upload-pack").status == 200  # public
    assert call(providers, GH_API, "DELETE", "/installation/token", headers={"Authorization": f"token {tok}"}).status == 204
    assert not gh.token_valid(tok)
    assert call(providers, GH, "GET", refs, headers={"Authorization": f"Bearer {tok}"}).status == 401


def test_git_clones_the_private_repository_with_an_installation_token(providers, tmp_path):
    tok = mint(providers, app_jwt(providers)).json()["token"]
    port = providers.port
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "LANG": "C", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_TERMINAL_PROMPT": "0", "GIT_SSL_CAINFO": str(providers.ca_pem)}
    git = ["git", "-c", f"http.curloptResolve=github.com:{port}:127.0.0.1", "-c", "credential.helper="]
    url = f"https://github.com:{port}/acme/private.git"

    def clone(*args: str, dest: str, source: str = url) -> subprocess.CompletedProcess:
        return subprocess.run([*git, *args, "clone", "-q", source, str(tmp_path / dest)], env=env, capture_output=True, text=True, timeout=30, check=False)

    r = clone("-c", f"http.extraHeader=Authorization: Bearer {tok}", dest="bearer")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bearer" / GIT_FILE).read_text() == GIT_PRIVATE_TEXT
    r = clone(dest="basic", source=f"https://x-access-token:{tok}@github.com:{port}/acme/private.git")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "basic" / GIT_FILE).read_text() == GIT_PRIVATE_TEXT
    r = clone(dest="anonymous")
    assert r.returncode != 0 and not (tmp_path / "anonymous" / GIT_FILE).exists()


# ---------------------------------------------------------------------------------------------
# S3 with SigV4
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def s3_client(providers, monkeypatch, tmp_path):
    """A factory of boto3 S3 clients that reach the stand-in: `s3.us-east-1.amazonaws.com:<port>` resolves to 127.0.0.1
    (only inside this test), no proxy, no AWS configuration from the environment."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        return real("127.0.0.1" if host in NAMES else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for var in list(os.environ):
        if var.upper().startswith("AWS_") or var.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "absent-credentials"))

    def make(*, key: str | None = None, secret: str | None = None, session_token: str | None = None, s3: dict | None = None, **config):
        return boto3.session.Session().client(
            "s3", region_name="us-east-1", endpoint_url=f"https://{S3}:{providers.port}", verify=str(providers.ca_pem),
            aws_access_key_id=key or providers.s3.access_key_id, aws_secret_access_key=secret or providers.s3.secret_access_key,
            aws_session_token=session_token,
            config=Config(s3={"addressing_style": "path", **(s3 or {})}, retries={"total_max_attempts": 1}, **config))

    return make


def last(p: Providers, method: str) -> object:
    return next(h for h in reversed(p.requests_to(S3)) if h.method == method)


def test_boto3_round_trip_with_default_checksums(providers, s3_client):
    s3 = providers.s3
    ok, failed = s3.sigv4_ok, s3.sigv4_failed
    c = s3_client()
    assert [b["Name"] for b in c.list_buckets()["Buckets"]] == ["acme-artifacts"]
    data = b"artifact bytes\n" * 100
    put = c.put_object(Bucket="acme-artifacts", Key="dir/hello world+1.txt", Body=data)
    assert put["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'
    # botocore 1.44's default for PutObject: a CRC32 trailer, aws-chunked inside HTTP chunked, the payload unsigned.
    hit = last(providers, "PUT")
    assert hit.header("x-amz-content-sha256") == "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
    assert hit.header("Content-Encoding") == "aws-chunked" and hit.header("Transfer-Encoding") == "chunked"
    assert hit.header("X-Amz-Trailer") == "x-amz-checksum-crc32" and hit.header("X-Amz-Decoded-Content-Length") == str(len(data))
    assert hit.header("Content-Length") is None
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert decode_aws_chunked(hit.body) == (data, {"x-amz-checksum-crc32": crc}) and s3.trailers_seen[-1] == {"x-amz-checksum-crc32": crc}

    got = c.get_object(Bucket="acme-artifacts", Key="dir/hello world+1.txt")
    assert got["Body"].read() == data and got["ETag"] == put["ETag"]
    assert c.head_object(Bucket="acme-artifacts", Key="dir/hello world+1.txt")["ContentLength"] == len(data)
    listed = c.list_objects_v2(Bucket="acme-artifacts", Prefix="dir/")
    assert [o["Key"] for o in listed["Contents"]] == ["dir/hello world+1.txt"] and listed["KeyCount"] == 1
    assert c.list_objects_v2(Bucket="acme-artifacts", Prefix="nothing/")["KeyCount"] == 0
    with pytest.raises(ClientError) as missing:
        c.get_object(Bucket="acme-artifacts", Key="absent")
    assert missing.value.response["Error"]["Code"] == "NoSuchKey"
    assert (s3.sigv4_ok, s3.sigv4_failed) == (ok + 7, failed)


def test_boto3_with_a_signed_payload_hash(providers, s3_client):
    c = s3_client(request_checksum_calculation="when_required", s3={"payload_signing_enabled": True})
    data = b"signed payload"
    c.put_object(Bucket="acme-artifacts", Key="signed.bin", Body=data)
    hit = last(providers, "PUT")
    assert hit.header("x-amz-content-sha256") == hashlib.sha256(data).hexdigest() and hit.header("Content-Encoding") is None
    assert providers.s3.buckets["acme-artifacts"]["signed.bin"].data == data


def test_boto3_with_a_wrong_secret_or_an_unknown_key_is_refused(providers, s3_client):
    s3 = providers.s3
    failed = s3.sigv4_failed
    with pytest.raises(ClientError) as wrong:
        s3_client(secret="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY").list_objects_v2(Bucket="acme-artifacts")
    assert wrong.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert wrong.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError) as unknown:
        s3_client(key="AKIAPLACEHOLDER00000").put_object(Bucket="acme-artifacts", Key="x", Body=b"x")
    assert unknown.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    assert "AKIAPLACEHOLDER00000" in s3.key_ids_seen and s3.sigv4_failed == failed + 2
    assert "x" not in s3.buckets["acme-artifacts"]


def test_session_token_required_and_signed(providers, s3_client):
    s3 = providers.s3
    s3.session_token = "FwoGZXIvYXdzEStandInSessionToken=="
    try:
        assert s3_client(session_token=s3.session_token).list_buckets()["Buckets"]
        for token_ in (None, "FwoGZXIvYXdzEAnotherToken=="):
            with pytest.raises(ClientError) as refused:
                s3_client(session_token=token_).list_buckets()
            assert refused.value.response["Error"]["Code"] == "InvalidToken"
        headers = sign(providers, "GET", "/")
        headers["X-Amz-Security-Token"] = s3.session_token  # present, but not signed
        r = call(providers, S3, "GET", "/", headers=headers)
        assert r.status == 403 and b"HeadersNotSigned" in r.body
    finally:
        s3.session_token = None


def sign(p: Providers, method: str, path: str, body: bytes = b"", *, payload: str | None = None, when: datetime.datetime | None = None,
         token_: str | None = None, headers: dict | None = None) -> dict:
    """SigV4 headers for a request to the stand-in, signed by hand (chosen date and payload hash)."""
    request = AWSRequest(method=method, url=f"https://{S3}{path}", data=body, headers={"Host": S3, **(headers or {})})
    request.context["timestamp"] = (when or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%SZ")
    request.headers["X-Amz-Date"] = request.context["timestamp"]
    request.headers["X-Amz-Content-SHA256"] = payload or hashlib.sha256(body).hexdigest()
    if token_:
        request.headers["X-Amz-Security-Token"] = token_
    auth = S3SigV4Auth(Credentials(p.s3.access_key_id, p.s3.secret_access_key, token_), "s3", "us-east-1")
    signature = auth.signature(auth.string_to_sign(request, auth.canonical_request(request)), request)
    auth._inject_signature_to_request(request, signature)
    return dict(request.headers.items())


def test_hand_signed_requests(providers):
    s3 = providers.s3
    r = call(providers, S3, "PUT", "/acme-artifacts/unsigned.txt", b"abc", sign(providers, "PUT", "/acme-artifacts/unsigned.txt", payload="UNSIGNED-PAYLOAD"))
    assert r.status == 200 and s3.buckets["acme-artifacts"]["unsigned.txt"].data == b"abc"
    r = call(providers, S3, "GET", "/acme-artifacts?list-type=2&prefix=uns", headers=sign(providers, "GET", "/acme-artifacts?list-type=2&prefix=uns"))
    assert r.status == 200 and b"<Key>unsigned.txt</Key>" in r.body

    def refused(method: str, path: str, body: bytes, headers: dict) -> tuple[int, str]:
        r = call(providers, S3, method, path, body, headers)
        return r.status, re.search(rb"<Code>(\w+)</Code>", r.body)[1].decode()

    path = "/acme-artifacts/k"
    skewed = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=16)
    assert refused("PUT", path, b"abc", sign(providers, "PUT", path, b"abc", when=skewed)) == (403, "RequestTimeTooSkewed")
    assert refused("PUT", path, b"abd", sign(providers, "PUT", path, b"abc")) == (400, "XAmzContentSHA256Mismatch")
    streaming = sign(providers, "PUT", path, b"x", payload="STREAMING-AWS4-HMAC-SHA256-PAYLOAD", headers={"Content-Encoding": "aws-chunked"})
    assert refused("PUT", path, b"x", streaming)[0] == 400
    unsigned_header = {**sign(providers, "PUT", path, b"abc"), "x-amz-meta-added": "later"}
    assert refused("PUT", path, b"abc", unsigned_header) == (403, "AccessDenied")
    tampered = sign(providers, "PUT", path, b"abc")
    assert refused("PUT", "/acme-artifacts/other", b"abc", tampered) == (403, "SignatureDoesNotMatch")

    trailer = {"Content-Encoding": "aws-chunked", "X-Amz-Trailer": "x-amz-checksum-crc32", "X-Amz-Decoded-Content-Length": "5"}
    crc = base64.b64encode(zlib.crc32(b"hello").to_bytes(4, "big")).decode()
    good = f"5\r\nhello\r\n0\r\nx-amz-checksum-crc32:{crc}\r\n\r\n".encode()
    headers = sign(providers, "PUT", path, payload="STREAMING-UNSIGNED-PAYLOAD-TRAILER", headers=trailer)
    assert call(providers, S3, "PUT", path, good, headers).status == 200 and s3.buckets["acme-artifacts"]["k"].data == b"hello"
    bad = good.replace(crc.encode(), b"AAAAAA==")
    assert refused("PUT", path, bad, headers) == (400, "BadDigest")


def test_routing_and_records(providers):
    assert providers.names == NAMES and providers.public == PUBLIC
    assert providers.resolve()[0] == f"{OAUTH}={PUBLIC[OAUTH]}" and all(ip.startswith("93.184.217.") for ip in PUBLIC.values())
    assert f"{S3}:443:127.0.0.1:{providers.port}" in providers.connect_to()
    r = call(providers, GAPI, "GET", "/", headers={"Host": "elsewhere.example"})
    assert r.status == 421
    hit = providers.hits[-1]
    assert (hit.host, hit.method, hit.path, hit.body) == ("elsewhere.example", "GET", "/", b"")
    r = call(providers, GAPI, "POST", "/echo", b"payload", {"Authorization": "Bearer abc"})
    assert r.status == 200 and providers.hits[-1].body == b"payload" and providers.hits[-1].header("authorization") == "Bearer abc"


def test_one_keep_alive_connection_carries_many_answers(providers):
    """Every answer is framed (Content-Length, or none for 204/HEAD), so one connection carries them all; a chunked
    request body arrives de-chunked."""
    context = ssl.create_default_context(cafile=str(providers.ca_pem))
    conn = http.client.HTTPSConnection(GAPI, 443, context=context, timeout=10)
    conn.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", providers.port), timeout=10), server_hostname=GAPI)
    sock = conn.sock
    try:
        for method, path, expected in (("GET", "/drive/v3/files", 401), ("HEAD", "/drive/v3/files", 401), ("GET", "/echo", 200),
                                       ("GET", "/nothing", 404)):
            conn.request(method, path, headers={"Authorization": "Bearer nope"})
            response = conn.getresponse()
            assert response.status == expected and (method == "HEAD" or response.getheader("Content-Length") is not None)
            response.read()
        conn.request("POST", "/echo", body=iter([b"chunk one, ", b"chunk two"]), headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 200
        response.read()
        assert providers.hits[-1].body == b"chunk one, chunk two"
        assert conn.sock is sock  # still the first connection
    finally:
        conn.close()
