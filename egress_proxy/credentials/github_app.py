"""`github_app`: an installation token minted with the App's private key.

The edge signs a JWT (RS256, `iss` = the App id, `iat` 60 s in the past for clock drift, `exp` 9 minutes ahead: GitHub
refuses more than 10) and POSTs it to the connection's `token_url`
(`https://api.github.com/app/installations/<id>/access_tokens`), narrowed to the declared `repositories` and
`permissions` when the policy names them. GitHub answers 201 with `token` and `expires_at` (an hour).
The record holds `app_id` and `private_key` (the PEM GitHub issued, PKCS#1 or PKCS#8).
"""

from __future__ import annotations

import base64
import datetime
import json

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from compiler.artifact import Connection
from egress_proxy.credentials.base import (
    Attached,
    Fields,
    FieldSpec,
    Minted,
    MintFailed,
    RecordInvalid,
    Reply,
    TokenRequest,
    bearer,
    reply_json,
    reply_token,
)
from egress_proxy.custody.secret import Secret

JWT_LIFETIME = 540  # seconds after `now`; GitHub allows at most 600 after `iat`
JWT_BACKDATE = 60


class GitHubApp:
    name = "github_app"
    fields = (
        FieldSpec("app_id", True, False, "the App's numeric id"),
        FieldSpec("private_key", True, True, "the App's private key (PEM)"),
    )
    mints = True

    def check(self, fields: Fields) -> None:
        app_id = fields.plain["app_id"]
        if not (app_id.isascii() and app_id.isdigit()):
            raise RecordInvalid("`app_id` is not the App's numeric id")
        _key(fields)

    def token_request(self, conn: Connection, fields: Fields, now: float) -> TokenRequest:
        mint = conn.mint
        assert mint is not None
        claims = {"iat": int(now) - JWT_BACKDATE, "exp": int(now) + JWT_LIFETIME, "iss": fields.plain["app_id"]}
        signing_input = _b64(json.dumps({"alg": "RS256", "typ": "JWT"}, separators=(",", ":")).encode()) + b"." + _b64(
            json.dumps(claims, separators=(",", ":")).encode())
        signature = _key(fields).sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
        jwt = signing_input + b"." + _b64(signature)
        body: dict[str, object] = {}
        if mint.repositories:
            body["repositories"] = list(mint.repositories)
        if mint.permissions:
            body["permissions"] = dict(mint.permissions)
        headers = (("Authorization", "Bearer " + jwt.decode("ascii")), ("Accept", "application/vnd.github+json"),
                   ("X-GitHub-Api-Version", "2022-11-28"), ("User-Agent", "egresslaw"), ("Content-Type", "application/json"))
        return TokenRequest(headers=headers, body=json.dumps(body, separators=(",", ":")).encode("ascii"))

    def token_reply(self, conn: Connection, fields: Fields, reply: Reply, now: float) -> Minted:
        if reply.status not in (200, 201):
            raise MintFailed(f"the installation-token endpoint answered {reply.status}", provider_status=reply.status)
        doc = reply_json(reply)
        token = reply_token(doc.get("token"), reply)
        expires = doc.get("expires_at")
        try:
            when = datetime.datetime.fromisoformat(str(expires).replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise MintFailed("the installation token's `expires_at` is not a date", provider_status=reply.status) from None
        if when <= now:
            raise MintFailed("the installation token is already expired", provider_status=reply.status)
        return Minted(token=token, expires_at=when)

    def attach(self, conn: Connection, fields: Fields, token: Secret | None) -> Attached:
        assert token is not None
        return bearer(conn, fields, token)


def _key(fields: Fields) -> rsa.RSAPrivateKey:
    try:
        key = serialization.load_pem_private_key(fields.secret["private_key"].reveal(), password=None)
    except (ValueError, TypeError):
        raise RecordInvalid("`private_key` is not an unencrypted PEM private key",
                            "seal the PEM GitHub issued for the App (`-----BEGIN RSA PRIVATE KEY-----`)") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise RecordInvalid("`private_key` is not an RSA key (GitHub Apps sign with RS256)")
    return key


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


KIND = GitHubApp()
