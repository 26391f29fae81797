"""Leases: HMAC-SHA256-signed claim sets `{sub, profile | connection, exp}` minted on the trusted side.

Token form: `el1.<base64url(claims JSON)>.<base64url(HMAC-SHA256(key, "el1." + claims part))>`.
The proxy verifies the MAC in constant time before it parses anything, so a forged token
never reaches the JSON parser. Error messages never contain the token or the key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re

from egress_proxy.types import Lease

PREFIX = "el1"
MAX_TTL = 7 * 24 * 3600
MAX_TOKEN = 4096
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")


class LeaseError(Exception):
    """A lease that cannot be used; `reason` is the stable reason code the proxy answers 407 with."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def mint(key: bytes, subject: str, *, profile: str | None = None, connection: str | None = None, ttl: int = 3600, now: float) -> str:
    """A signed lease token naming exactly one profile or one connection, valid for `ttl` seconds from `now`."""
    if (profile is None) == (connection is None):
        raise LeaseError("lease-invalid", "a lease names exactly one profile or one connection")
    if not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL:
        raise LeaseError("lease-invalid", f"lease ttl must be between 1 and {MAX_TTL} seconds")
    for what, value in (("subject", subject), ("profile", profile), ("connection", connection)):
        if value is not None and not _NAME.match(value):
            raise LeaseError("lease-invalid", f"lease {what} `{value}` is not a plain name")
    claims: dict[str, object] = {"sub": subject, "exp": int(now) + ttl, "iat": int(now)}
    if profile is not None:
        claims["profile"] = profile
    else:
        claims["connection"] = connection
    body = _b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode("ascii"))
    signed = f"{PREFIX}.{body}"
    return f"{signed}.{_b64(_mac(key, signed))}"


def verify(key: bytes, token: str | None, *, now: float) -> Lease:
    """The lease a token carries; LeaseError with reason lease-missing, lease-invalid or lease-expired."""
    if not token:
        raise LeaseError("lease-missing", "no lease: send `Proxy-Authorization: Bearer <lease>`")
    if len(token) > MAX_TOKEN or not token.isascii():
        raise LeaseError("lease-invalid", "lease is not a valid token")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise LeaseError("lease-invalid", "lease is not a valid token")
    try:
        given = _unb64(parts[2])
    except ValueError:
        raise LeaseError("lease-invalid", "lease is not a valid token") from None
    expected = _mac(key, f"{parts[0]}.{parts[1]}")
    # INVARIANT: the MAC is checked, in constant time, before any claim is parsed or trusted.
    if not hmac.compare_digest(given, expected):
        raise LeaseError("lease-invalid", "lease signature does not verify")
    try:
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError):
        raise LeaseError("lease-invalid", "lease claims are malformed") from None
    if not isinstance(claims, dict):
        raise LeaseError("lease-invalid", "lease claims are malformed")
    sub, exp = claims.get("sub"), claims.get("exp")
    profile, connection = claims.get("profile"), claims.get("connection")
    if not isinstance(sub, str) or not isinstance(exp, int) or isinstance(exp, bool):
        raise LeaseError("lease-invalid", "lease claims are malformed")
    if not set(claims) <= {"sub", "exp", "iat", "profile", "connection"}:
        raise LeaseError("lease-invalid", "lease claims are malformed")
    if (profile is None) == (connection is None) or not all(v is None or isinstance(v, str) for v in (profile, connection)):
        raise LeaseError("lease-invalid", "a lease names exactly one profile or one connection")
    if exp <= now:
        raise LeaseError("lease-expired", "lease has expired; mint a new one")
    return Lease(subject=sub, profile=profile, connection=connection, exp=exp)


def bearer(header_value: str | None) -> str | None:
    """The token of a `Bearer <token>` header value, None when the header is absent or another scheme."""
    if header_value is None:
        return None
    scheme, _, token = header_value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _mac(key: bytes, signed: str) -> bytes:
    return hmac.new(key, signed.encode("ascii"), hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not base64url") from None
