"""Leases: HMAC-SHA256-signed claim sets `{sub, profile | connection, exp}` minted on the trusted side.

Token form: `el2.<key id>.<base64url(claims JSON)>.<base64url(HMAC-SHA256(key, "el2.<key id>.<claims>"))>`.
The key id names the lease key that signed it, so keys rotate with an overlap: the old key keeps
verifying until its retirement time while the new one mints. The proxy verifies the MAC in
constant time before it parses any claim, so a forged token never reaches the JSON parser.
`el1` tokens (minted before key ids) are refused as `lease-key-unknown`: mint a new lease.

A client presents the lease in `Proxy-Authorization`, either `Bearer <lease>` or, from a proxy
URL (`http://user:LEASE@proxy:port`), `Basic base64(user:LEASE)`; the lease is the password, or
the user name when the password is empty. Both go through `authenticate`, one code path.
Error messages never contain the token, the header value or the key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from egress_proxy.decision.types import Lease
from egress_proxy.errors import EgressError

PREFIX = "el2"
LEGACY_PREFIX = "el1"  # no key id: refused (lease-key-unknown)
MAX_TTL = 7 * 24 * 3600
MAX_TOKEN = 4096
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$")
_KEY_ID = re.compile(r"^lk-[0-9a-f]{16}$")
_B64URL = re.compile(r"^[A-Za-z0-9_-]+$")
# The schemes a client may offer, as recorded in events and logs (never the header value itself).
SCHEMES = ("none", "bearer", "basic", "other")


class LeaseError(EgressError):
    """A lease that cannot be used; `reason` is the stable reason code the proxy answers 407 with."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class LeaseKey:
    """One lease HMAC key; `retires` (unix seconds) ends its overlap window after a rotation. `repr` shows the id only."""

    id: str
    material: bytes
    created: str = ""
    retires: int | None = None

    def __repr__(self) -> str:
        return f"LeaseKey(id={self.id!r}, retires={self.retires!r})"

    def retired(self, now: float) -> bool:
        return self.retires is not None and self.retires <= now


def key_id(material: bytes) -> str:
    """A lease key's id: derived from the key itself (an HMAC of a fixed label), so it never disagrees with it."""
    return "lk-" + hmac.new(material, b"egresslaw lease key id", hashlib.sha256).hexdigest()[:16]


class LeaseKeys:
    """The lease keys by id: `active` mints, every key not yet retired verifies."""

    __slots__ = ("_keys", "active")

    def __init__(self, keys: Iterable[LeaseKey], active: str) -> None:
        self._keys = {k.id: k for k in keys}
        if active not in self._keys:
            raise ValueError("the active lease key is not in the key set")
        self.active = self._keys[active]

    @classmethod
    def single(cls, material: bytes) -> LeaseKeys:
        key = LeaseKey(key_id(material), material)
        return cls([key], key.id)

    def get(self, kid: str) -> LeaseKey | None:
        return self._keys.get(kid)

    def keys(self) -> tuple[LeaseKey, ...]:
        return tuple(self._keys.values())

    def __repr__(self) -> str:
        return f"LeaseKeys(active={self.active.id!r}, ids={tuple(self._keys)!r})"


def _key_set(keys: bytes | LeaseKeys) -> LeaseKeys:
    return keys if isinstance(keys, LeaseKeys) else LeaseKeys.single(keys)


def mint(key: bytes | LeaseKeys, subject: str, *, profile: str | None = None, connection: str | None = None, ttl: int = 3600, now: float) -> str:
    """A lease token naming exactly one profile or one connection, valid for `ttl` seconds from `now`, signed by
    the active key (a bare key is a key set of one)."""
    signer = _key_set(key).active
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
    signed = f"{PREFIX}.{signer.id}.{body}"
    return f"{signed}.{_b64(_mac(signer.material, signed))}"


def verify(keys: bytes | LeaseKeys, token: str | None, *, now: float) -> Lease:
    """The lease a token carries; LeaseError with reason lease-missing, -malformed, -key-unknown, -invalid,
    -key-retired or -expired."""
    if not token:
        raise LeaseError("lease-missing", "no lease: send `Proxy-Authorization: Bearer <lease>` or use a proxy URL `http://user:<lease>@proxy`")
    if len(token) > MAX_TOKEN or not token.isascii():
        raise LeaseError("lease-malformed", "the credential offered is not a lease token")
    parts = token.split(".")
    if len(parts) == 3 and parts[0] == LEGACY_PREFIX and all(_B64URL.match(p) for p in parts[1:]):
        raise LeaseError("lease-key-unknown", "the lease carries no key id (minted before key ids); mint a new one with `egresslaw lease`")
    if len(parts) != 4 or parts[0] != PREFIX or not _KEY_ID.match(parts[1]) or not all(_B64URL.match(p) for p in parts[2:]):
        raise LeaseError("lease-malformed", "the credential offered is not a lease token")
    key = _key_set(keys).get(parts[1])
    if key is None:
        raise LeaseError("lease-key-unknown", "the lease's key id is not in the proxy's lease key set")
    try:
        given = _unb64(parts[3])
    except ValueError:
        raise LeaseError("lease-malformed", "the credential offered is not a lease token") from None
    expected = _mac(key.material, f"{parts[0]}.{parts[1]}.{parts[2]}")
    # INVARIANT: the MAC is checked, in constant time, before any claim is parsed or trusted.
    if not hmac.compare_digest(given, expected):
        raise LeaseError("lease-invalid", "lease signature does not verify")
    if key.retired(now):
        raise LeaseError("lease-key-retired", "the lease's key was rotated out and its overlap window has ended; mint a new lease")
    try:
        claims = json.loads(_unb64(parts[2]))
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


def scheme_of(header_value: str | None) -> str:
    """The scheme a `Proxy-Authorization` value offers, as one of SCHEMES (a value is never echoed)."""
    if header_value is None:
        return "none"
    scheme = header_value.strip().partition(" ")[0].lower()
    return scheme if scheme in ("bearer", "basic") else "other"


def token_of(header_value: str | None) -> str | None:
    """The lease a `Proxy-Authorization` value carries: `Bearer <lease>`, or `Basic base64(user:pass)` where the
    lease is the password, or the user name when the password is empty. None when nothing is offered;
    LeaseError(lease-malformed) for another scheme or a value that does not decode."""
    if header_value is None:
        return None
    scheme, _, rest = header_value.strip().partition(" ")
    scheme, rest = scheme.lower(), rest.strip()
    if scheme == "bearer":
        return rest or None
    if scheme != "basic":
        raise LeaseError("lease-malformed", "`Proxy-Authorization` must use the `Bearer` or `Basic` scheme")
    if not rest:
        return None
    try:
        decoded = base64.b64decode(rest.encode("ascii"), validate=True).decode("ascii")
    except (binascii.Error, ValueError):
        raise LeaseError("lease-malformed", "`Proxy-Authorization: Basic` is not base64 of ASCII `user:password`") from None
    user, colon, password = decoded.partition(":")
    if not colon:
        raise LeaseError("lease-malformed", "`Proxy-Authorization: Basic` is not base64 of ASCII `user:password`")
    return password or user or None


def authenticate(keys: bytes | LeaseKeys, header_values: Sequence[str], *, now: float) -> Lease:
    """The lease of a request from its `Proxy-Authorization` header values, whatever the scheme (one code path)."""
    if len(header_values) > 1:
        raise LeaseError("lease-malformed", "more than one `Proxy-Authorization` header")
    return verify(keys, token_of(header_values[0] if header_values else None), now=now)


class VerifiedLeases:
    """`authenticate` that does the work of `verify` once per token: a bounded memo of the header values that verified.

    Only what `verify` accepted is kept, with the key set and the key that verified it. A hit is used only while that
    key set is still the one in force (`LeaseKeyFile` hands out a new object when the file changes), its key is not
    retired and the lease not expired (the time-dependent checks of `verify`, the rest being a function of the token
    and the key set); otherwise the token is verified again in full and refused with `verify`'s own reason. A token
    not seen before goes through `verify`, MAC compared in constant time before any claim is parsed; a hit needs the
    whole header value to equal one that verified (a dict lookup under Python's keyed string hash: no timing tells
    an attacker anything about a valid token's bytes). Refusals are never kept."""

    __slots__ = ("_memo", "size")

    def __init__(self, size: int = 1024) -> None:
        self._memo: dict[str, tuple[LeaseKeys, LeaseKey, Lease]] = {}
        self.size = size

    def authenticate(self, keys: bytes | LeaseKeys, header_values: Sequence[str], *, now: float) -> Lease:
        """The same result as `authenticate(keys, header_values, now=now)`."""
        value = header_values[0] if len(header_values) == 1 else None
        hit = self._memo.get(value) if value is not None else None
        if hit is not None and hit[0] is keys and not hit[1].retired(now) and hit[2].exp > now:
            return hit[2]
        lease = authenticate(keys, header_values, now=now)
        if value is not None and isinstance(keys, LeaseKeys):
            key = keys.get(str(token_of(value)).split(".")[1])
            if key is not None:
                if len(self._memo) >= self.size:
                    del self._memo[next(iter(self._memo))]  # the oldest entry
                self._memo[value] = (keys, key, lease)
        return lease

    def __repr__(self) -> str:
        return f"VerifiedLeases({len(self._memo)} of {self.size})"


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
