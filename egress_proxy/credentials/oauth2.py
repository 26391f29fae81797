"""`oauth2`: an access token minted from a refresh token or client credentials (RFC 6749 §6 and §4.4).

The record holds `client_id`, `client_secret` (a confidential client; required for `client_credentials`) and
`refresh_token` (for the `refresh_token` grant), and optionally `auth_method`: `client_secret_basic` (the default,
§2.3.1: id and secret form-encoded, then HTTP Basic) or `client_secret_post` (both in the body). A public client
(no secret) sends its `client_id` in the body. A refresh token the provider rotates (§6: "MAY issue a new refresh
token") comes back in `Minted.rotated` and the broker writes it to custody before the new access token is used.
"""

from __future__ import annotations

import base64
import math
from urllib.parse import quote, urlencode

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

DEFAULT_LIFETIME = 300.0  # `expires_in` is RECOMMENDED only (§5.1): without it, assume a short life and refresh early
AUTH_METHODS = ("client_secret_basic", "client_secret_post")


class OAuth2:
    name = "oauth2"
    fields = (
        FieldSpec("client_id", True, False, "the OAuth client id"),
        FieldSpec("client_secret", False, True, "the client secret (confidential clients; required for client_credentials)"),
        FieldSpec("refresh_token", False, True, "the refresh token (the refresh_token grant)"),
        FieldSpec("auth_method", False, False, "client_secret_basic (default) or client_secret_post"),
    )
    mints = True

    def check(self, fields: Fields) -> None:
        method = fields.plain.get("auth_method")
        if method is not None and method not in AUTH_METHODS:
            raise RecordInvalid(f"`auth_method` must be one of {', '.join(AUTH_METHODS)}")
        if "refresh_token" not in fields.secret and "client_secret" not in fields.secret:
            raise RecordInvalid("an `oauth2` record needs `refresh_token` (refresh_token grant) or `client_secret` "
                                "(client_credentials grant)")

    def token_request(self, conn: Connection, fields: Fields, now: float) -> TokenRequest:
        mint = conn.mint
        assert mint is not None
        form: list[tuple[str, str]] = [("grant_type", mint.grant or "")]
        if mint.grant == "refresh_token":
            if "refresh_token" not in fields.secret:
                raise RecordInvalid("the connection's grant is `refresh_token` and the custody record has no `refresh_token`")
            form.append(("refresh_token", fields.text("refresh_token")))
        elif "client_secret" not in fields.secret:
            raise RecordInvalid("the connection's grant is `client_credentials` and the custody record has no `client_secret`")
        if mint.scopes:
            form.append(("scope", " ".join(mint.scopes)))
        if mint.audience:
            form.append(("audience", mint.audience))
        headers = [("Content-Type", "application/x-www-form-urlencoded"), ("Accept", "application/json")]
        client_id = fields.plain["client_id"]
        if "client_secret" in fields.secret and fields.plain.get("auth_method", "client_secret_basic") == "client_secret_basic":
            # §2.3.1: each of id and secret form-urlencoded (Appendix B), then joined by ":" and base64-encoded.
            pair = f"{quote(client_id, safe='')}:{quote(fields.text('client_secret'), safe='')}"
            headers.append(("Authorization", "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")))
        else:
            form.append(("client_id", client_id))
            if "client_secret" in fields.secret:
                form.append(("client_secret", fields.text("client_secret")))
        return TokenRequest(headers=tuple(headers), body=urlencode(form).encode("ascii"))

    def token_reply(self, conn: Connection, fields: Fields, reply: Reply, now: float) -> Minted:
        if reply.status != 200:
            raise MintFailed(f"the token endpoint answered {reply.status}", provider_status=reply.status)
        doc = reply_json(reply)
        token = doc.get("access_token")
        kind = doc.get("token_type", "Bearer")
        if not isinstance(kind, str) or kind.lower() != "bearer":
            raise MintFailed("the token endpoint issued a token that is not a Bearer token", provider_status=reply.status)
        minted = reply_token(token, reply)
        lifetime = doc.get("expires_in", DEFAULT_LIFETIME)
        if isinstance(lifetime, str) and lifetime.isdigit():
            lifetime = int(lifetime)  # some providers send it as a string
        if not isinstance(lifetime, (int, float)) or isinstance(lifetime, bool) or not math.isfinite(lifetime) or lifetime <= 0:
            raise MintFailed("the token endpoint's `expires_in` is not a positive number", provider_status=reply.status)
        rotated = {}
        new_refresh = doc.get("refresh_token")
        if new_refresh is not None:
            reply_token(new_refresh, reply)
            if "refresh_token" in fields.secret and new_refresh.encode("utf-8") != fields.secret["refresh_token"].reveal():
                rotated["refresh_token"] = new_refresh
        return Minted(token=minted, expires_at=now + float(lifetime), rotated=rotated)

    def attach(self, conn: Connection, fields: Fields, token: Secret | None) -> Attached:
        assert token is not None
        return bearer(conn, fields, token)


KIND = OAuth2()
