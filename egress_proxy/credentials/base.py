"""What every credential kind shares: its record's fields, what it attaches, and how it fails.

A kind is one module with one object implementing `Kind` (egress_proxy/credentials/__init__.py lists them). The
edge asks the broker (egress_proxy/credentials/broker.py) for an `Attached` per request and never looks inside a
kind: it gets either a header value to set or a signer to call once the head (and, when hashed, the body) is final.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from compiler.artifact import Connection, Inject
from egress_proxy.custody.records import decode_record, record_grant
from egress_proxy.custody.secret import Secret
from egress_proxy.errors import EgressError


class CredentialError(EgressError):
    """A credential that cannot be attached. `reason` is the denial's code; the message names fields and statuses, never
    a value, a provider's body or a token. `cause` is what the client's denial says about why (None: the reason alone)."""

    reason = "credential-record-invalid"
    shown_to_client = False  # the record's problems are the operator's (the log and the audit event name them)

    def __init__(self, message: str, help: str | None = None, *, provider_status: int | None = None) -> None:
        super().__init__(message, help)
        self.provider_status = provider_status

    @property
    def cause(self) -> str | None:
        """The class of problem, for the denial the client sees: a token endpoint's failure (`the token endpoint answered
        200 with a body that is not JSON`), never its body, a value or a token."""
        # INVARIANT: the messages of the kinds shown to the client are fixed phrases with at most a status, a size, a
        # timeout or an exception's class name in them (every `raise MintFailed(...)` / `SigningUnsupported(...)`).
        return self.message if self.shown_to_client else None


class RecordInvalid(CredentialError):
    """The custody record does not fit the connection's kind: another kind, a missing field, a key that does not parse."""


class MintFailed(CredentialError):
    """The token endpoint refused, failed, redirected, or could not be dialled under the connection's worker."""

    reason = "credential-mint-failed"
    shown_to_client = True


class SigningUnsupported(CredentialError):
    """A request the kind cannot sign as sent (SigV4 with signed streaming chunks)."""

    reason = "credential-sign-unsupported"
    shown_to_client = True


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    required: bool
    secret: bool  # scanned for in every response (all of its encodings), never shown anywhere
    help: str = ""


@dataclass(frozen=True, slots=True)
class Fields:
    """A record's fields, opened: the plain ones as text, the secret ones as `Secret` (never shown)."""

    kind: str
    plain: Mapping[str, str]
    secret: Mapping[str, Secret]
    grant: str = ""  # which grant the record is (`records.record_grant`): what a minted token belongs to

    def __repr__(self) -> str:
        return f"Fields({self.kind}, plain={sorted(self.plain)}, secret={sorted(self.secret)})"

    def text(self, name: str) -> str:
        """A secret field's text, for the one place that sends it (a token request, a signature)."""
        return self.secret[name].reveal().decode("utf-8")


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """What a minting kind sends its token endpoint (the connection's `token_url`, POST, HTTP/1.1)."""

    headers: tuple[tuple[str, str], ...]
    body: bytes

    def __repr__(self) -> str:
        return f"TokenRequest({[k for k, _ in self.headers]}, {len(self.body)} bytes)"


@dataclass(frozen=True, slots=True)
class Reply:
    """The token endpoint's answer, held by the broker only (never logged, never relayed)."""

    status: int
    body: bytes

    def __repr__(self) -> str:
        return f"Reply({self.status}, {len(self.body)} bytes)"


@dataclass(frozen=True, slots=True)
class Minted:
    """A token a minting kind read from a successful reply: its life, and fields the provider rotated (a new refresh
    token: written back to custody before the token is used)."""

    token: Secret
    expires_at: float
    rotated: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Minted(expires_at={self.expires_at:.0f}, rotated={sorted(self.rotated)})"


@dataclass(frozen=True, slots=True)
class SignView:
    """The request a signing kind signs, as it leaves: method, the upstream authority, origin-form target, the headers
    that will be forwarded (the caller's copies of the signing headers already removed) and the client's payload mode."""

    method: str
    host: str
    port: int
    target: str
    headers: Sequence[tuple[str, str]]
    client_payload: str | None  # what the client declared in x-amz-content-sha256 (a marker, a hash, or None)


@dataclass(frozen=True, slots=True)
class Attached:
    """What the edge puts on one request: a header value (`value`, bytes of the inject format filled in), or a signer
    it calls with the final request and the body's hash (`sign`); and the needles the response scan redacts."""

    needles: tuple[bytes, ...]
    value: bytes | None = None
    sign: Callable[[SignView, bytes | None, float], list[tuple[str, str]]] | None = None  # (request, body, now)
    hash_body: bool = False  # `sign` needs the whole body (buffered to a limit) to hash it

    def __repr__(self) -> str:
        return f"Attached({'value' if self.value is not None else 'signer'}, {len(self.needles)} needles)"


MAX_TOKEN = 16 * 1024
MAX_HASHED_BODY = 8 * 1024 * 1024  # a body a signature hashes is held whole by the edge, up to this (or the rule's limit)


def header_value(inject: Inject, credential: bytes) -> bytes:
    """The inject format filled in: the credential itself, or with `basic_user` base64(user ":" credential)."""
    prefix, _, suffix = inject.format.partition("{secret}")
    if inject.basic_user is not None:
        credential = base64.b64encode(inject.basic_user.encode("utf-8") + b":" + credential)
    return prefix.encode("utf-8") + credential + suffix.encode("utf-8")


def bearer(conn: Connection, fields: Fields, token: Secret) -> Attached:
    """A minted token in the connection's inject format, with every secret of the record and the token as needles."""
    return Attached(needles=needles_of(fields, (token, conn.inject.format)), value=header_value(conn.inject, token.reveal()))


def reply_json(reply: Reply) -> dict:
    try:
        doc = json.loads(reply.body)
    except (ValueError, UnicodeDecodeError):
        raise MintFailed(f"the token endpoint answered {reply.status} with a body that is not JSON", provider_status=reply.status) from None
    if not isinstance(doc, dict):
        raise MintFailed(f"the token endpoint answered {reply.status} with JSON that is not an object", provider_status=reply.status)
    return doc


def reply_token(value: object, reply: Reply) -> Secret:
    """A token the edge may put in a header: a non-empty string of visible ASCII (RFC 6750's b64token and more), bounded."""
    if not isinstance(value, str) or not value or len(value) > MAX_TOKEN or not all("\x21" <= c <= "\x7e" for c in value):
        raise MintFailed(f"the token endpoint answered {reply.status} without a usable token", provider_status=reply.status)
    return Secret(value.encode("ascii"))


Fetch = Callable[[Connection, TokenRequest], Awaitable[Reply]]  # may have `report(conn, reply, error | None)`: the outcome


class Kind(Protocol):
    """One credential kind. A new kind (HMAC request signing, a GCP service account) is one module with one of these,
    added to `KINDS`; the compiler learns its settings, the edge nothing."""

    name: str
    fields: tuple[FieldSpec, ...]
    mints: bool  # tokens from `token_url` (the broker caches, refreshes and single-flights them)

    def check(self, fields: Fields) -> None:
        """Refuse a record that cannot work (a PEM that does not parse): RecordInvalid naming the field, never its value."""

    def token_request(self, conn: Connection, fields: Fields, now: float) -> TokenRequest:
        """Minting kinds: the request that mints a token."""

    def token_reply(self, conn: Connection, fields: Fields, reply: Reply, now: float) -> Minted:
        """Minting kinds: the token in a reply (MintFailed for a refusal, naming its status only)."""

    def attach(self, conn: Connection, fields: Fields, token: Secret | None) -> Attached:
        """What a request carries: the token (minting kinds), the record's value (static) or a signer."""


def open_fields(kind: Kind, record: Secret) -> Fields:
    """The record's fields, checked against the kind: RecordInvalid names what is wrong, never a value."""
    raw = record.reveal()
    try:
        decoded = decode_record(raw)
    except EgressError as exc:
        raise RecordInvalid(f"the custody record is malformed: {exc.message}") from None
    if decoded is None:
        decoded = ("static", {"secret": raw.decode("utf-8", "surrogateescape")}, record_grant(raw))
    found, values, grant = decoded
    if found != kind.name:
        raise RecordInvalid(f"the custody record holds a `{found}` credential and the connection is of kind `{kind.name}`",
                            f"seal the connection's credential with `egresslaw custody put --kind {kind.name}`")
    specs = {f.name: f for f in kind.fields}
    unknown = sorted(set(values) - set(specs))
    if unknown:
        shown = [n if n.isidentifier() and len(n) <= 40 else "(a name that is not an identifier)" for n in unknown]
        raise RecordInvalid(f"the custody record has fields a `{kind.name}` credential does not take: {', '.join(shown)}",
                            f"its fields: {', '.join(specs)}")
    missing = [f.name for f in kind.fields if f.required and f.name not in values]
    if missing:
        raise RecordInvalid(f"the custody record lacks `{'`, `'.join(missing)}` for a `{kind.name}` credential")
    plain = {k: v for k, v in values.items() if not specs[k].secret}
    secret = {k: Secret(v.encode("utf-8", "surrogateescape")) for k, v in values.items() if specs[k].secret}
    fields = Fields(kind.name, plain, secret, grant)
    kind.check(fields)
    return fields


def needles_of(fields: Fields, *extra: tuple[Secret, str]) -> tuple[bytes, ...]:
    """Every encoding of every secret field, then of each (secret, inject format) in `extra` (a minted token)."""
    seen: dict[bytes, None] = {}
    for secret, fmt in extra:
        seen.update(dict.fromkeys(secret.needles(fmt)))
    for name in sorted(fields.secret):
        secret = fields.secret[name]
        value = secret.reveal()
        if b"\n" in value:
            seen.update(dict.fromkeys(_pem_needles(value)))
        else:
            seen.update(dict.fromkeys(secret.needles()))
    return tuple(seen)


def _pem_needles(value: bytes) -> list[bytes]:
    """A multi-line secret (a PEM private key): each long base64 line as it is and URL-encoded (a leak of any line,
    however the key was wrapped, re-encoded or JSON-escaped, shows a whole line), and the body joined. Not every
    encoding of the whole 1.7 KB text: hundreds of long needles would cost every response scan (bench/credentials.py)
    and add nothing a line does not already catch."""
    from urllib.parse import quote

    lines = [line.strip() for line in value.splitlines() if line.strip() and not line.startswith(b"-----")]
    out = [b"".join(lines)]
    for line in lines:
        if len(line) >= 16:
            out += [line, quote(line, safe="").encode("ascii")]
    return out
