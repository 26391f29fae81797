"""Independent stand-ins for the providers whose credentials the egress proxy brokers, served under the real names.

One threaded HTTPS (HTTP/1.1, keep-alive) server on 127.0.0.1 with one certificate from a test CA for every name
below; it answers by the `Host` header (any `:port` in it is ignored). Every credential is checked here with code
that shares nothing with the proxy's: the form and Basic parsing of RFC 6749 by hand, GitHub App JWTs with PyJWT,
SigV4 recomputed with botocore from what arrived on the wire.

  oauth2.googleapis.com        OAuth 2.0 token endpoint `POST /token`: grants refresh_token (RFC 6749 §6, optional
                               rotation) and client_credentials (§4.4); client_secret_basic (§2.3.1, the id and the
                               secret form-urlencoded before base64), client_secret_post, or a public client (only
                               `client_id`) for refresh_token; errors per §5.2 with an `error_description` that carries
                               the presented refresh token (a proxy that relayed the body would leak it)
  www.googleapis.com           `GET /drive/v3/files` (a Bearer access token issued above and unexpired, else 401);
                               `GET /echo` (the received Authorization value, verbatim, in a JSON body)
  api.github.com               GitHub App: `POST /app/installations/{id}/access_tokens` with an RS256 App JWT (201,
                               a `ghs_` installation token), `GET /installation/repositories` (`Bearer` or `token`
                               installation token), `DELETE /installation/token` (revokes the presented token)
  github.com                   `git http-backend` over acme/demo.git (public) and acme/private.git (an installation
                               token as `Bearer <token>` or `Basic base64("x-access-token:<token>")`, else 401 with
                               `WWW-Authenticate: Basic realm="GitHub"`)
  s3.us-east-1.amazonaws.com   S3, path-style: ListBuckets, ListObjects(V2), Put/Get/Head/DeleteObject, Head/CreateBucket;
                               every request's SigV4 verified (key id, scope, x-amz-date skew, every x-amz-* header
                               signed, the signature, the payload hash or the aws-chunked trailer checksum)

The proxy reaches it through test routing: `--resolve NAME=<public-looking address>` (`Providers.resolve()`, never
dialled) and `--connect-to NAME:443:127.0.0.1:<port>` (`Providers.connect_to()`), with this CA (`ca_pem`) trusted for
upstream. Every request is recorded as a `Hit` (host, method, path, headers, de-framed body).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import email.utils
import hashlib
import hmac
import http.server
import json
import re
import secrets
import ssl
import string
import threading
import time
import traceback
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, unquote_plus

import jwt
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.compat import HTTPHeaders
from botocore.credentials import Credentials
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.clients.standins import (
    GIT_FILE,
    GIT_PRIVATE,
    GIT_PRIVATE_TEXT,
    GIT_REPO,
    GIT_TEXT,
    TlsServer,
    make_git_repo,
    run_git_backend,
)

__all__ = [
    "GIT_FILE", "GIT_PRIVATE", "GIT_PRIVATE_TEXT", "GIT_REPO", "GIT_TEXT", "NAMES", "PUBLIC", "S3_NS",
    "GitHubAppState", "Hit", "OAuthState", "Providers", "S3Object", "S3State", "start_providers",
]

OAUTH_HOST = "oauth2.googleapis.com"
GOOGLE_API_HOST = "www.googleapis.com"
GITHUB_API_HOST = "api.github.com"
GITHUB_HOST = "github.com"
S3_HOST = "s3.us-east-1.amazonaws.com"
NAMES = (OAUTH_HOST, GOOGLE_API_HOST, GITHUB_API_HOST, GITHUB_HOST, S3_HOST)
# Public-looking answers for --resolve: judged like real ones by the proxy, never dialled (--connect-to wins).
PUBLIC = {name: f"93.184.217.{10 + i}" for i, name in enumerate(NAMES)}
S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
MAX_BODY = 64 << 20

Answer = tuple[int, bytes, str, tuple[tuple[str, str], ...]]  # status, body, content type, other headers
_ALNUM = string.ascii_letters + string.digits


def _random(n: int, alphabet: str = _ALNUM) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


# Token endpoint paths that answer 200 with something that is not a token response; each body carries a marker a
# denial must never relay.
BROKEN_200_MARKER = "stand-in-body-7f3a"
BROKEN_200 = {
    "/html": f"<html><body>Sign in to continue ({BROKEN_200_MARKER})</body></html>".encode(),
    "/list": json.dumps([BROKEN_200_MARKER]).encode(),
    "/no-token": json.dumps({"token_type": "Bearer", "note": BROKEN_200_MARKER}).encode(),
}


def _json(status: int, doc: object, extra: tuple[tuple[str, str], ...] = ()) -> Answer:
    return status, json.dumps(doc).encode(), "application/json; charset=utf-8", extra


@dataclass
class Hit:
    host: str
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def header(self, name: str) -> str | None:
        values = self.all(name)
        return values[0] if values else None


@dataclass
class Request:
    """One request as the services see it: the body is already de-framed (Content-Length or chunked)."""

    host: str
    method: str
    path: str  # as sent, still percent-encoded, without the query
    query: str
    headers: object  # http.client.HTTPMessage (case-insensitive, repeatable)
    body: bytes
    handler: http.server.BaseHTTPRequestHandler

    def header(self, name: str, default: str = "") -> str:
        value = self.headers.get(name)
        return default if value is None else value


# ---------------------------------------------------------------------------------------------
# OAuth 2.0 (RFC 6749): oauth2.googleapis.com and www.googleapis.com
# ---------------------------------------------------------------------------------------------


@dataclass
class OAuthState:
    lifetime: float = 2.0  # seconds an access token lives (expires_in: an int when whole, else a float)
    rotate_refresh: bool = False  # refresh_token grants answer a new refresh token; the presented one dies at once
    default_scope: str = "https://www.googleapis.com/auth/drive.readonly"
    clients: dict[str, str | None] = field(default_factory=dict)  # client_id -> secret (None: a public client)
    refresh_tokens: dict[str, str] = field(default_factory=dict)  # the valid ones: token -> client_id
    rotated: dict[str, str] = field(default_factory=dict)  # rotated-away refresh token -> its successor
    revoked: set[str] = field(default_factory=set)
    access_tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry (time.time())
    token_requests: list[dict[str, str]] = field(default_factory=list)  # every form POSTed to /token, secrets kept
    token_auth: list[str] = field(default_factory=list)  # per token request: client_secret_basic|client_secret_post|none|invalid
    mints: int = 0  # successful token responses
    api_ok: int = 0
    api_refused: int = 0
    client_id: str = ""  # the confidential client start_providers registers
    client_secret: str = ""
    initial_refresh_token: str = ""  # its first refresh token (after a rotation, see refresh_tokens)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def add_client(self, client_id: str, secret: str | None = None, refresh_token: str | None = None) -> str:
        """Register a client (secret None: public) and issue it a refresh token (`refresh_token` or a new one)."""
        with self.lock:
            self.clients[client_id] = secret
            token = refresh_token or self.new_refresh_token()
            self.refresh_tokens[token] = client_id
            return token

    @staticmethod
    def new_refresh_token() -> str:
        return "1//0g" + secrets.token_urlsafe(48)

    def revoke(self, refresh_token: str) -> None:
        with self.lock:
            self.refresh_tokens.pop(refresh_token, None)
            self.revoked.add(refresh_token)

    def access_valid(self, token: str) -> bool:
        with self.lock:
            expiry = self.access_tokens.get(token)
        return expiry is not None and time.time() < expiry

    # -- the token endpoint ----------------------------------------------------------------------

    def token_endpoint(self, req: Request) -> Answer:
        if req.path == "/redirect":  # a token endpoint that moved: a client that follows sends the grant elsewhere
            return _json(302, {"error": "moved"}, (("Location", f"https://{OAUTH_HOST}/token"),))
        if req.path in BROKEN_200:  # a 200 that is no token response: a login page, a JSON list, JSON without a token
            return 200, BROKEN_200[req.path], "text/html" if req.path == "/html" else "application/json", ()
        if req.path != "/token":
            return _json(404, {"error": "not_found"})
        presented = ""
        no_store = (("Cache-Control", "no-store"), ("Pragma", "no-cache"))

        def error(status: int, code: str, extra: tuple[tuple[str, str], ...] = ()) -> Answer:
            return _json(status, {"error": code, "error_description": f"stand-in detail {presented}"}, (*no_store, *extra))

        if req.method != "POST":
            return error(405, "invalid_request", (("Allow", "POST"),))
        try:
            pairs = parse_qsl(req.body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(req.body))
        except (UnicodeDecodeError, ValueError):
            pairs = None
        form = dict(pairs or ())
        presented = form.get("refresh_token", "")
        with self.lock:
            self.token_requests.append(dict(form))
            self.token_auth.append("invalid")
            index = len(self.token_auth) - 1
        ctype = req.header("Content-Type").split(";")[0].strip().lower()
        if ctype != "application/x-www-form-urlencoded" or pairs is None or len(form) != len(pairs):
            return error(400, "invalid_request")  # §3.2: parameters MUST NOT be included more than once

        # Client authentication (§2.3): exactly one method.
        authorization = req.header("Authorization")
        challenge = (("WWW-Authenticate", 'Basic realm="oauth2"'),)
        if authorization:
            scheme, _, credentials = authorization.partition(" ")
            if scheme.lower() != "basic":
                return error(401, "invalid_client", challenge)
            try:
                raw = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return error(401, "invalid_client", challenge)
            user, sep, password = raw.partition(":")
            if not sep:
                return error(401, "invalid_client", challenge)
            client_id, secret = unquote_plus(user), unquote_plus(password)  # §2.3.1: form-urlencoded, then Basic
            if "client_secret" in form or form.get("client_id", client_id) != client_id:
                return error(400, "invalid_request")
            method = "client_secret_basic"
        elif "client_secret" in form:
            client_id, secret, method = form.get("client_id", ""), form["client_secret"], "client_secret_post"
        elif "client_id" in form:
            client_id, secret, method = form["client_id"], None, "none"
        else:
            return error(401, "invalid_client")
        with self.lock:
            known, expected = client_id in self.clients, self.clients.get(client_id)
        if not known:
            return error(401, "invalid_client", challenge if method == "client_secret_basic" else ())
        if method == "none":
            if expected is not None:  # a confidential client must authenticate
                return error(401, "invalid_client")
        elif expected is None or secret is None or not hmac.compare_digest(secret.encode(), expected.encode()):
            return error(401, "invalid_client", challenge if method == "client_secret_basic" else ())
        with self.lock:
            self.token_auth[index] = method

        grant = form.get("grant_type", "")
        if not grant:
            return error(400, "invalid_request")
        if grant == "client_credentials" and method == "none":
            return error(400, "unauthorized_client")  # §4.4: confidential clients only
        if grant not in ("refresh_token", "client_credentials"):
            return error(400, "unsupported_grant_type")
        if grant == "refresh_token" and not presented:
            return error(400, "invalid_request")
        with self.lock:
            answer: dict[str, object] = {}
            if grant == "refresh_token":
                if self.refresh_tokens.get(presented) != client_id:  # unknown, revoked, rotated away or another client's
                    return error(400, "invalid_grant")
                if self.rotate_refresh:
                    successor = self.new_refresh_token()
                    del self.refresh_tokens[presented]
                    self.refresh_tokens[successor] = client_id
                    self.rotated[presented] = successor
                    answer["refresh_token"] = successor
            access = "ya29." + secrets.token_urlsafe(48)
            lifetime = float(self.lifetime)
            self.access_tokens[access] = time.time() + lifetime
            self.mints += 1
        expires_in: float = int(lifetime) if lifetime == int(lifetime) else lifetime
        doc = {"access_token": access, "token_type": "Bearer", "expires_in": expires_in,
               "scope": form.get("scope") or self.default_scope, **answer}
        return _json(200, doc, no_store)

    # -- the API -----------------------------------------------------------------------------------

    def api(self, req: Request) -> Answer:
        authorization = req.header("Authorization")
        if req.path == "/echo":
            return _json(200, {"authorization": authorization, "path": req.path})
        if req.path == "/drive/v3/files" and req.method in ("GET", "HEAD"):
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() == "bearer" and self.access_valid(token.strip()):
                with self.lock:
                    self.api_ok += 1
                files = [{"kind": "drive#file", "id": "1aBcDeF", "name": "plan.txt", "mimeType": "text/plain"}]
                return _json(200, {"kind": "drive#fileList", "incompleteSearch": False, "files": files})
            with self.lock:
                self.api_refused += 1
            doc = {"error": {"code": 401, "message": "Request had invalid authentication credentials.", "status": "UNAUTHENTICATED"}}
            return _json(401, doc, (("WWW-Authenticate", 'Bearer realm="https://accounts.google.com/", error="invalid_token"'),))
        return _json(404, {"error": {"code": 404, "message": "Not Found", "status": "NOT_FOUND"}})


# ---------------------------------------------------------------------------------------------
# GitHub App: api.github.com and github.com
# ---------------------------------------------------------------------------------------------


@dataclass
class GitHubAppState:
    app_private_key_pem: str  # PKCS#1 ("BEGIN RSA PRIVATE KEY"), as GitHub hands it out
    git_root: Path
    app_id: int = 123456
    installation_id: int = 987654
    app_client_id: str = field(default_factory=lambda: "Iv1." + secrets.token_hex(8))  # GitHub also accepts it as `iss`
    token_lifetime: float = 3600.0
    max_skew: float = 60.0  # how far in the future `iat` may be
    installation_tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry (time.time())
    installation_requests: list[dict] = field(default_factory=list)  # {"claims", "body"} per successful mint
    jwt_failures: list[str] = field(default_factory=list)  # why each refused App JWT was refused
    installation_mints: int = 0
    api_ok: int = 0
    api_refused: int = 0
    git_ok: int = 0
    git_refused: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    _public: tuple[str, object] = field(default=("", None), init=False, repr=False)

    @property
    def app_public_key(self) -> rsa.RSAPublicKey:
        """The public half of `app_private_key_pem` (follows it if a test swaps the key)."""
        if self._public[0] != self.app_private_key_pem:
            self._public = (self.app_private_key_pem, serialization.load_pem_private_key(self.app_private_key_pem.encode(), None).public_key())
        return self._public[1]

    def token_valid(self, token: str) -> bool:
        with self.lock:
            expiry = self.installation_tokens.get(token)
        return expiry is not None and time.time() < expiry

    def revoke(self, token: str) -> None:
        with self.lock:
            self.installation_tokens.pop(token, None)

    def verify_jwt(self, authorization: str) -> tuple[dict | None, str]:
        """The App JWT's claims, or None and why not (GitHub's rules: RS256, exp and iat, exp - iat <= 600 s, iat not
        in the future beyond the skew, iss the App ID as an int or a string, or the client ID)."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "no Bearer JWT"
        try:
            claims = jwt.decode(token.strip(), self.app_public_key, algorithms=["RS256"],
                                options={"require": ["exp", "iat", "iss"], "verify_iat": False})
        except jwt.PyJWTError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        iat, exp = claims["iat"], claims["exp"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (iat, exp)):
            return None, "iat/exp not numeric"
        if iat > time.time() + self.max_skew:
            return None, "iat in the future"
        if exp - iat > 600:
            return None, "exp more than 10 minutes after iat"
        if str(claims["iss"]) not in (str(self.app_id), self.app_client_id):
            return None, f"iss {claims['iss']!r} is not the App"
        return claims, ""

    def api(self, req: Request) -> Answer:
        documentation = "https://docs.github.com/rest"
        m = re.fullmatch(r"/app/installations/(\d+)/access_tokens", req.path)
        if m and req.method == "POST":
            claims, why = self.verify_jwt(req.header("Authorization"))
            if claims is None:
                with self.lock:
                    self.jwt_failures.append(why)
                return _json(401, {"message": "A JSON web token could not be decoded", "documentation_url": documentation})
            if int(m[1]) != self.installation_id:
                return _json(404, {"message": "Not Found", "documentation_url": documentation})
            try:
                body = json.loads(req.body) if req.body.strip() else {}
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return _json(400, {"message": "Problems parsing JSON", "documentation_url": documentation})
            permissions = body.get("permissions") or {"contents": "read", "metadata": "read"}
            token = "ghs_" + _random(36)
            with self.lock:
                expiry = time.time() + float(self.token_lifetime)
                self.installation_tokens[token] = expiry
                self.installation_requests.append({"claims": claims, "body": body})
                self.installation_mints += 1
            doc: dict[str, object] = {
                "token": token,
                "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expiry)),
                "permissions": permissions,
                "repository_selection": "selected" if body.get("repositories") else "all",
            }
            if body.get("repositories"):
                doc["repositories"] = [{"name": r, "full_name": f"acme/{r}", "private": True} for r in body["repositories"]]
            return _json(201, doc)
        scheme, _, token = req.header("Authorization").partition(" ")
        authorized = scheme.lower() in ("bearer", "token") and self.token_valid(token.strip())
        if req.path == "/installation/repositories" and req.method in ("GET", "HEAD"):
            with self.lock:
                if authorized:
                    self.api_ok += 1
                else:
                    self.api_refused += 1
            if not authorized:
                return _json(401, {"message": "Bad credentials", "documentation_url": documentation})
            repo = {"id": 1296269, "name": "private", "full_name": "acme/private", "private": True, "owner": {"login": "acme"}}
            return _json(200, {"total_count": 1, "repository_selection": "all", "repositories": [repo]})
        if req.path == "/installation/token" and req.method == "DELETE":
            if not authorized:
                return _json(401, {"message": "Bad credentials", "documentation_url": documentation})
            self.revoke(token.strip())
            return 204, b"", "application/json; charset=utf-8", ()
        return _json(404, {"message": "Not Found", "documentation_url": documentation})

    def git_authorized(self, authorization: str) -> bool:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return self.token_valid(value.strip())
        if scheme.lower() == "basic":
            try:
                user, sep, password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            return bool(sep) and user == "x-access-token" and self.token_valid(password)
        return False

    def git(self, req: Request) -> Answer:
        if not req.path.startswith(("/acme/demo.git/", f"/{GIT_PRIVATE}/")):
            return 404, b"Not Found\n", "text/plain", ()
        if req.path.startswith(f"/{GIT_PRIVATE}/"):
            allowed = self.git_authorized(req.header("Authorization"))
            with self.lock:
                if allowed:
                    self.git_ok += 1
                else:
                    self.git_refused += 1
            if not allowed:
                return 401, b"Authentication required\n", "text/plain", (("WWW-Authenticate", 'Basic realm="GitHub"'),)
        return run_git_backend(req.handler, self.git_root, req.path, req.query, req.body)


# ---------------------------------------------------------------------------------------------
# S3 with SigV4: s3.us-east-1.amazonaws.com
# ---------------------------------------------------------------------------------------------


@dataclass
class S3Object:
    data: bytes
    etag: str  # quoted MD5 hex, as S3 answers it
    last_modified: float
    content_type: str = "binary/octet-stream"
    content_encoding: str = ""


class _S3Error(Exception):
    def __init__(self, status: int, code: str, message: str, **extra: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message, self.extra = status, code, message, extra


class _Recompute(S3SigV4Auth):
    """botocore's S3 SigV4 over exactly the headers the request says it signed and the payload hash it carried."""

    def __init__(self, credentials: Credentials, region: str, signed: HTTPHeaders, payload_hash: str) -> None:
        super().__init__(credentials, "s3", region)
        self._signed, self._payload_hash = signed, payload_hash

    def headers_to_sign(self, request):
        return self._signed

    def payload(self, request):
        return self._payload_hash


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _checksum(algorithm: str, data: bytes) -> str | None:
    """The base64 checksum S3 would compute (x-amz-checksum-<algorithm>), or None for one the stand-in lacks."""
    if algorithm == "crc32":
        raw = zlib.crc32(data).to_bytes(4, "big")
    elif algorithm == "crc32c":
        raw = _crc32c(data).to_bytes(4, "big")
    elif algorithm in ("sha1", "sha256"):
        raw = hashlib.new(algorithm, data).digest()
    else:  # crc64nvme needs awscrt
        return None
    return base64.b64encode(raw).decode()


def decode_aws_chunked(data: bytes) -> tuple[bytes, dict[str, str]]:
    """An aws-chunked body (unsigned chunks: `hex-size[;ext]\\r\\ndata\\r\\n` ... `0\\r\\n`, trailers, `\\r\\n`):
    the payload and the trailers (lower-cased names). ValueError when malformed."""
    out, pos = bytearray(), 0
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            raise ValueError("aws-chunked: no chunk-size line")
        size_field = data[pos:eol].split(b";", 1)[0].strip()
        if not size_field or any(c not in b"0123456789abcdefABCDEF" for c in size_field):
            raise ValueError("aws-chunked: bad chunk size")
        size, pos = int(size_field, 16), eol + 2
        if size == 0:
            break
        if len(data) < pos + size + 2 or data[pos + size:pos + size + 2] != b"\r\n":
            raise ValueError("aws-chunked: truncated chunk")
        out += data[pos:pos + size]
        pos += size + 2
    trailers: dict[str, str] = {}
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            raise ValueError("aws-chunked: unterminated trailer section")
        line, pos = data[pos:eol], eol + 2
        if not line:
            break
        name, sep, value = line.partition(b":")
        if not sep:
            raise ValueError("aws-chunked: bad trailer line")
        trailers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if pos != len(data):
        raise ValueError("aws-chunked: bytes after the trailers")
    return bytes(out), trailers


def _query_pairs(query: str) -> list[tuple[str, str]]:
    pairs = []
    for part in query.split("&") if query else ():
        key, _, value = part.partition("=")
        pairs.append((unquote(key), unquote(value)))
    return pairs


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _xml(root: ET.Element) -> bytes:
    return ET.tostring(root, encoding="UTF-8", xml_declaration=True)


def _sub(parent: ET.Element, tag: str, text: object = None) -> ET.Element:
    element = ET.SubElement(parent, tag)
    if text is not None:
        element.text = str(text).lower() if isinstance(text, bool) else str(text)
    return element


@dataclass
class S3State:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None  # when set, every request must carry it as a signed X-Amz-Security-Token
    region: str = "us-east-1"
    max_skew: float = 900.0  # x-amz-date must be within this many seconds of now
    buckets: dict[str, dict[str, S3Object]] = field(default_factory=dict)
    key_ids_seen: list[str] = field(default_factory=list)  # the key id of every request that named one, known or not
    payload_hashes_seen: list[str] = field(default_factory=list)  # x-amz-content-sha256 of every signed request
    trailers_seen: list[dict[str, str]] = field(default_factory=list)  # aws-chunked trailers, per request
    failures: list[str] = field(default_factory=list)  # "Code: why" for every request refused by authentication
    sigv4_ok: int = 0
    sigv4_failed: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    # -- authentication ------------------------------------------------------------------------

    def authenticate(self, req: Request) -> bytes:
        """The request's payload (aws-chunked decoded) once its SigV4 checks out; _S3Error otherwise."""
        authorization = req.header("Authorization")
        if not authorization:
            if any(k.lower() == "x-amz-algorithm" for k, _ in _query_pairs(req.query)):
                raise _S3Error(403, "AccessDenied", "presigned URLs are not supported by the stand-in")
            raise _S3Error(403, "AccessDenied", "Access Denied")
        algorithm, _, rest = authorization.partition(" ")
        if algorithm != "AWS4-HMAC-SHA256":
            raise _S3Error(400, "InvalidRequest", "The authorization mechanism you have provided is not supported. Please use AWS4-HMAC-SHA256.")
        fields = {}
        for part in rest.split(","):
            key, _, value = part.strip().partition("=")
            fields[key] = value
        scope = fields.get("Credential", "").split("/")
        if scope[0]:
            with self.lock:
                self.key_ids_seen.append(scope[0])
        signed_names = [n for n in fields.get("SignedHeaders", "").split(";") if n]
        if len(scope) != 5 or not signed_names or not fields.get("Signature"):
            raise _S3Error(400, "AuthorizationHeaderMalformed", "The authorization header is malformed.")
        key_id, date, region, service, terminator = scope
        if key_id != self.access_key_id:
            raise _S3Error(403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.", AWSAccessKeyId=key_id)
        if region != self.region or service != "s3" or terminator != "aws4_request":
            raise _S3Error(400, "AuthorizationHeaderMalformed", f"The authorization header is malformed; the scope {'/'.join(scope[1:])} is wrong.", Region=self.region)
        amz_date = req.header("X-Amz-Date")
        try:
            when = datetime.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
        except ValueError:
            raise _S3Error(403, "AccessDenied", "AWS authentication requires a valid Date or x-amz-date header") from None
        if amz_date[:8] != date:
            raise _S3Error(400, "AuthorizationHeaderMalformed", "Invalid credential date. Date is not the same as X-Amz-Date.")
        if abs(time.time() - when.timestamp()) > self.max_skew:
            raise _S3Error(403, "RequestTimeTooSkewed", "The difference between the request time and the current time is too large.", RequestTime=amz_date)
        signed = {n.lower() for n in signed_names}
        present = {k.lower() for k in req.headers}
        if "host" not in signed or "x-amz-date" not in signed:
            raise _S3Error(403, "AccessDenied", "host and x-amz-date must be signed")
        unsigned = sorted(n for n in present if n.startswith("x-amz-") and n not in signed)
        if unsigned:
            raise _S3Error(403, "AccessDenied", "There were headers present in the request which were not signed", HeadersNotSigned=", ".join(unsigned))
        if signed - present:
            raise _S3Error(403, "AccessDenied", f"signed headers absent from the request: {', '.join(sorted(signed - present))}")
        token = req.headers.get("X-Amz-Security-Token")
        if self.session_token is not None:
            if token is None or not hmac.compare_digest(token.encode(), self.session_token.encode()):
                raise _S3Error(403, "InvalidToken", "The provided token is malformed or otherwise invalid.")
        elif token is not None:
            raise _S3Error(403, "InvalidToken", "The provided token is malformed or otherwise invalid.")
        payload_hash = req.header("X-Amz-Content-SHA256")
        with self.lock:
            self.payload_hashes_seen.append(payload_hash)
        if not payload_hash:
            raise _S3Error(400, "InvalidRequest", "Missing required header for this request: x-amz-content-sha256")
        if payload_hash.startswith("STREAMING-") and payload_hash != "STREAMING-UNSIGNED-PAYLOAD-TRAILER":
            raise _S3Error(400, "NotImplemented", f"the stand-in does not support x-amz-content-sha256 {payload_hash}")
        if payload_hash not in ("UNSIGNED-PAYLOAD", "STREAMING-UNSIGNED-PAYLOAD-TRAILER") and not re.fullmatch(r"[0-9a-f]{64}", payload_hash):
            raise _S3Error(400, "InvalidArgument", "x-amz-content-sha256 must be UNSIGNED-PAYLOAD, STREAMING-UNSIGNED-PAYLOAD-TRAILER, or a valid sha256 value.")

        # The signature, recomputed over what arrived.
        headers = HTTPHeaders()
        for name in sorted(signed):
            for value in req.headers.get_all(name) or ():
                headers[name] = value
        canonical_path = quote(unquote(req.path), safe="/~")
        request = AWSRequest(method=req.method, url=f"https://{S3_HOST}{canonical_path}")
        request.headers = headers
        request.params = _query_pairs(req.query)
        request.context["timestamp"] = amz_date
        signer = _Recompute(Credentials(self.access_key_id, self.secret_access_key, self.session_token), self.region, headers, payload_hash)
        canonical = signer.canonical_request(request)
        string_to_sign = signer.string_to_sign(request, canonical)
        expected = signer.signature(string_to_sign, request)
        if not hmac.compare_digest(expected.encode(), fields["Signature"].encode()):
            raise _S3Error(403, "SignatureDoesNotMatch", "The request signature we calculated does not match the signature you provided. Check your key and signing method.",
                           AWSAccessKeyId=key_id, StringToSign=string_to_sign, SignatureProvided=fields["Signature"], CanonicalRequest=canonical)

        # The payload.
        body = req.body
        if payload_hash == "STREAMING-UNSIGNED-PAYLOAD-TRAILER":
            encodings = [e.strip().lower() for e in req.header("Content-Encoding").split(",") if e.strip()]
            if "aws-chunked" not in encodings:
                raise _S3Error(400, "InvalidRequest", "STREAMING-UNSIGNED-PAYLOAD-TRAILER without Content-Encoding: aws-chunked")
            try:
                body, trailers = decode_aws_chunked(req.body)
            except ValueError as exc:
                raise _S3Error(400, "IncompleteBody", str(exc)) from None
            with self.lock:
                self.trailers_seen.append(trailers)
            declared = {n.strip().lower() for n in req.header("X-Amz-Trailer").split(",") if n.strip()}
            if declared != set(trailers):
                raise _S3Error(400, "MalformedTrailerError", f"trailers {sorted(trailers)} are not the declared {sorted(declared)}")
            for name, value in trailers.items():
                self._check_checksum(name, value, body)
            decoded = req.headers.get("X-Amz-Decoded-Content-Length")
            if decoded is not None and decoded.strip() != str(len(body)):
                raise _S3Error(400, "IncompleteBody", "x-amz-decoded-content-length is not the decoded length")
        elif payload_hash != "UNSIGNED-PAYLOAD" and not hmac.compare_digest(hashlib.sha256(body).hexdigest(), payload_hash):
            raise _S3Error(400, "XAmzContentSHA256Mismatch", "The provided 'x-amz-content-sha256' header does not match what was computed.")
        for name in present:
            if name.startswith("x-amz-checksum-") and name != "x-amz-checksum-mode":
                self._check_checksum(name, req.header(name), body)
        md5 = req.headers.get("Content-MD5")
        if md5 is not None and base64.b64encode(hashlib.md5(body).digest()).decode() != md5.strip():
            raise _S3Error(400, "BadDigest", "The Content-MD5 you specified did not match what we received.")
        return body

    @staticmethod
    def _check_checksum(name: str, value: str, body: bytes) -> None:
        if not name.startswith("x-amz-checksum-"):
            raise _S3Error(400, "MalformedTrailerError", f"unexpected trailer {name}")
        algorithm = name.removeprefix("x-amz-checksum-")
        computed = _checksum(algorithm, body)
        if computed is not None and computed != value.strip():
            raise _S3Error(400, "BadDigest", f"The {algorithm.upper()} you specified did not match the calculated checksum.")

    # -- the operations ------------------------------------------------------------------------

    def answer(self, req: Request) -> Answer:
        request_id = secrets.token_hex(8).upper()
        ids = (("x-amz-request-id", request_id), ("x-amz-id-2", base64.b64encode(secrets.token_bytes(24)).decode()))
        try:
            body = self.authenticate(req)
        except _S3Error as exc:
            with self.lock:
                self.sigv4_failed += 1
                self.failures.append(str(exc))
            return self._error(exc, request_id, ids)
        with self.lock:
            self.sigv4_ok += 1
        try:
            status, payload, ctype, extra = self._operate(req, body)
        except _S3Error as exc:
            return self._error(exc, request_id, ids)
        return status, payload, ctype, (*extra, *ids)

    @staticmethod
    def _error(exc: _S3Error, request_id: str, ids: tuple[tuple[str, str], ...]) -> Answer:
        root = ET.Element("Error")
        _sub(root, "Code", exc.code)
        _sub(root, "Message", exc.message)
        for key, value in exc.extra.items():
            _sub(root, key, value)
        _sub(root, "RequestId", request_id)
        _sub(root, "HostId", ids[1][1])
        return exc.status, _xml(root), "application/xml", ids

    def _operate(self, req: Request, body: bytes) -> Answer:
        raw_bucket, _, raw_key = req.path.lstrip("/").partition("/")
        bucket, key = unquote(raw_bucket), unquote(raw_key)
        params = dict(_query_pairs(req.query))
        params.pop("x-id", None)
        method = req.method
        if not bucket:
            if method != "GET":
                raise _S3Error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")
            return self._list_buckets()
        with self.lock:
            exists = bucket in self.buckets
        if not key:
            if method == "PUT" and not params:
                with self.lock:
                    self.buckets.setdefault(bucket, {})
                return 200, b"", "application/xml", (("Location", f"/{bucket}"),)
            if not exists:
                raise _S3Error(404, "NoSuchBucket", "The specified bucket does not exist", BucketName=bucket)
            if method == "HEAD" and not params:
                return 200, b"", "application/xml", (("x-amz-bucket-region", self.region),)
            if method == "GET" and set(params) <= {"list-type", "prefix", "delimiter", "max-keys", "encoding-type",
                                                   "continuation-token", "start-after", "marker", "fetch-owner"}:
                return self._list_objects(bucket, params)
            raise _S3Error(501, "NotImplemented", "A header or query you provided implies functionality that is not implemented.")
        if not exists:
            raise _S3Error(404, "NoSuchBucket", "The specified bucket does not exist", BucketName=bucket)
        if params or req.headers.get("x-amz-copy-source") is not None:
            raise _S3Error(501, "NotImplemented", "A header or query you provided implies functionality that is not implemented.")
        if method == "PUT":
            encoding = ",".join(e.strip() for e in req.header("Content-Encoding").split(",") if e.strip() and e.strip().lower() != "aws-chunked")
            obj = S3Object(body, f'"{hashlib.md5(body).hexdigest()}"', time.time(),
                           req.header("Content-Type") or "binary/octet-stream", encoding)
            with self.lock:
                self.buckets[bucket][key] = obj
            extra = [("ETag", obj.etag)]
            for name in req.headers:
                if name.lower().startswith("x-amz-checksum-") and name.lower() != "x-amz-checksum-mode":
                    extra.append((name.lower(), req.header(name)))
            for name in req.header("X-Amz-Trailer").split(","):
                if name.strip() and (value := _checksum(name.strip().lower().removeprefix("x-amz-checksum-"), body)):
                    extra.append((name.strip().lower(), value))
            return 200, b"", "application/xml", tuple(extra)
        if method == "DELETE":
            with self.lock:
                self.buckets[bucket].pop(key, None)
            return 204, b"", "application/xml", ()
        if method in ("GET", "HEAD"):
            with self.lock:
                obj = self.buckets[bucket].get(key)
            if obj is None:
                if method == "HEAD":
                    raise _S3Error(404, "NotFound", "Not Found")
                raise _S3Error(404, "NoSuchKey", "The specified key does not exist.", Key=key)
            extra = [("ETag", obj.etag), ("Last-Modified", email.utils.formatdate(obj.last_modified, usegmt=True)), ("Accept-Ranges", "bytes")]
            if obj.content_encoding:
                extra.append(("Content-Encoding", obj.content_encoding))
            if req.header("x-amz-checksum-mode").upper() == "ENABLED":
                extra += [("x-amz-checksum-crc32", _checksum("crc32", obj.data) or ""), ("x-amz-checksum-type", "FULL_OBJECT")]
            return 200, obj.data, obj.content_type, tuple(extra)
        raise _S3Error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")

    def _list_buckets(self) -> Answer:
        root = ET.Element("ListAllMyBucketsResult", xmlns=S3_NS)
        owner = _sub(root, "Owner")
        _sub(owner, "ID", "75aa57f09aa0c8caeab4f8c24e99d10f8e7faeebf76c078efc7c6caea54ba06a")
        _sub(owner, "DisplayName", "acme")
        buckets = _sub(root, "Buckets")
        with self.lock:
            names = sorted(self.buckets)
        for name in names:
            bucket = _sub(buckets, "Bucket")
            _sub(bucket, "Name", name)
            _sub(bucket, "CreationDate", _iso(0))
        return 200, _xml(root), "application/xml", ()

    def _list_objects(self, bucket: str, params: dict[str, str]) -> Answer:
        v2 = params.get("list-type") == "2"
        prefix, delimiter = params.get("prefix", ""), params.get("delimiter", "")
        try:
            max_keys = max(0, min(1000, int(params.get("max-keys", "1000"))))
        except ValueError:
            raise _S3Error(400, "InvalidArgument", "Provided max-keys not an integer or within integer range") from None
        after = (params.get("continuation-token") or params.get("start-after", "")) if v2 else params.get("marker", "")
        url = params.get("encoding-type") == "url"

        def enc(text: str) -> str:
            return quote(text, safe="/") if url else text

        with self.lock:
            objects = sorted((k, o) for k, o in self.buckets[bucket].items() if k.startswith(prefix) and k > after)
        contents: list[tuple[str, S3Object]] = []
        common: list[str] = []
        truncated, last = False, ""
        for key, obj in objects:
            rolled = ""
            if delimiter and delimiter in key[len(prefix):]:
                rolled = key[:len(prefix) + key[len(prefix):].index(delimiter) + len(delimiter)]
                if rolled in common:
                    last = key
                    continue
            if len(contents) + len(common) >= max_keys:
                truncated = True
                break
            if rolled:
                common.append(rolled)
            else:
                contents.append((key, obj))
            last = key
        root = ET.Element("ListBucketResult", xmlns=S3_NS)
        _sub(root, "Name", bucket)
        _sub(root, "Prefix", enc(prefix))
        if delimiter:
            _sub(root, "Delimiter", enc(delimiter))
        if url:
            _sub(root, "EncodingType", "url")
        if v2:
            _sub(root, "KeyCount", len(contents) + len(common))
            if params.get("continuation-token"):
                _sub(root, "ContinuationToken", params["continuation-token"])
            if params.get("start-after"):
                _sub(root, "StartAfter", enc(params["start-after"]))
        else:
            _sub(root, "Marker", enc(params.get("marker", "")))
        _sub(root, "MaxKeys", max_keys)
        _sub(root, "IsTruncated", truncated)
        if truncated:
            _sub(root, "NextContinuationToken" if v2 else "NextMarker", last)
        for key, obj in contents:
            item = _sub(root, "Contents")
            _sub(item, "Key", enc(key))
            _sub(item, "LastModified", _iso(obj.last_modified))
            _sub(item, "ETag", obj.etag)
            _sub(item, "Size", len(obj.data))
            _sub(item, "StorageClass", "STANDARD")
        for rolled in common:
            _sub(_sub(root, "CommonPrefixes"), "Prefix", enc(rolled))
        return 200, _xml(root), "application/xml", ()


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


@dataclass
class Providers:
    root: Path
    ca_pem: Path
    oauth: OAuthState
    github: GitHubAppState
    s3: S3State
    port: int = 0
    names: tuple[str, ...] = NAMES
    public: dict[str, str] = field(default_factory=lambda: dict(PUBLIC))
    hits: list[Hit] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # tracebacks of stand-in failures (answered 500)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: object = None

    def resolve(self) -> list[str]:
        return [f"{name}={self.public[name]}" for name in self.names]

    def connect_to(self) -> list[str]:
        return [f"{name}:443:127.0.0.1:{self.port}" for name in self.names]

    def requests_to(self, host: str) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if h.host == host]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _BadFraming(Exception):
    pass


def _handler(p: Providers):
    routes = {
        OAUTH_HOST: p.oauth.token_endpoint,
        GOOGLE_API_HOST: p.oauth.api,
        GITHUB_API_HOST: p.github.api,
        GITHUB_HOST: p.github.git,
        S3_HOST: p.s3.answer,
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def version_string(self) -> str:
            return "stand-in"

        def setup(self):
            self.request.settimeout(30)
            super().setup()

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json", extra: tuple = ()) -> None:
            self.send_response(status)
            if status != 204:
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
            for k, v in extra:
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD" and status != 204:
                self.wfile.write(body)

        def _read_body(self) -> bytes:
            te = self.headers.get("Transfer-Encoding")
            if te is not None:
                if te.strip().lower() != "chunked" or self.headers.get("Content-Length") is not None:
                    raise _BadFraming
                out = bytearray()
                while True:
                    line = self.rfile.readline(1024)
                    size_field = line.split(b";", 1)[0].strip()
                    if not line.endswith(b"\n") or not size_field or any(c not in b"0123456789abcdefABCDEF" for c in size_field):
                        raise _BadFraming
                    size = int(size_field, 16)
                    if size == 0:
                        break
                    if len(out) + size > MAX_BODY:
                        raise _BadFraming
                    chunk = self.rfile.read(size)
                    if len(chunk) != size or self.rfile.read(2) != b"\r\n":
                        raise _BadFraming
                    out += chunk
                for _ in range(100):  # the trailer section, discarded
                    line = self.rfile.readline(8192)
                    if line in (b"\r\n", b"\n"):
                        return bytes(out)
                    if not line.endswith(b"\n"):
                        break
                raise _BadFraming
            length = self.headers.get("Content-Length")
            if length is None:
                return b""
            if not length.strip().isdigit() or int(length) > MAX_BODY:
                raise _BadFraming
            body = self.rfile.read(int(length))
            if len(body) != int(length):
                raise _BadFraming
            return body

        def _handle(self):
            try:
                body = self._read_body()
            except (_BadFraming, OSError, ValueError):
                self.close_connection = True
                return self._send(400, b'{"error": "bad framing"}', extra=(("Connection", "close"),))
            host = (self.headers.get("Host") or "").strip().lower()
            host = host.rsplit(":", 1)[0] if ":" in host else host
            with p.lock:
                p.hits.append(Hit(host, self.command, self.path, list(self.headers.items()), body))
            path, _, query = self.path.partition("?")
            route = routes.get(host)
            if route is None:
                return self._send(421, b'{"error": "misdirected"}')
            try:
                answer = route(Request(host, self.command, path, query, self.headers, body, self))
            except Exception:  # noqa: BLE001 - a stand-in bug answers 500 and is kept for the test to see
                with p.lock:
                    p.errors.append(traceback.format_exc())
                answer = _json(500, {"error": "stand-in failure"})
            return self._send(*answer)

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = _handle

    return Handler


def start_providers(root: Path, *, oauth_lifetime: float = 2.0, rotate_refresh: bool = False,
                    buckets: tuple[str, ...] = ("acme-artifacts",), s3_session_token: str | None = None,
                    github_token_lifetime: float = 3600.0) -> Providers:
    """Build the fixtures in `root` (PKI, the App key, git repositories) and start the server on 127.0.0.1.

    Registered from the start: one confidential OAuth client (`oauth.client_id`/`client_secret`) with one refresh token
    (`oauth.initial_refresh_token`); the GitHub App (`github.app_id`, `installation_id`, `app_private_key_pem`); the S3
    key pair (`s3.access_key_id`, `secret_access_key`, `session_token` = `s3_session_token`) and `buckets`, empty."""
    from tests.proxy_harness import _issue

    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    pki = _issue(root / "pki", NAMES)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    oauth = OAuthState(lifetime=oauth_lifetime, rotate_refresh=rotate_refresh)
    oauth.client_id = f"{secrets.randbelow(10**12):012d}-standin.apps.googleusercontent.com"
    oauth.client_secret = "GOCSPX-" + secrets.token_urlsafe(21)
    oauth.initial_refresh_token = oauth.add_client(oauth.client_id, oauth.client_secret)
    github = GitHubAppState(app_private_key_pem=pem.decode(), git_root=make_git_repo(root), token_lifetime=github_token_lifetime)
    s3 = S3State(access_key_id="AKIA" + _random(16, string.ascii_uppercase + "234567"),
                 secret_access_key=_random(40, _ALNUM + "+/"), session_token=s3_session_token)
    s3.buckets = {name: {} for name in buckets}
    p = Providers(root=root, ca_pem=pki.ca_pem, oauth=oauth, github=github, s3=s3)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert_pem, pki.key_pem)
    context.set_alpn_protocols(["http/1.1"])
    server = TlsServer(_handler(p), context)
    p.server, p.port = server, server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True, name="credential-providers").start()
    return p
