"""Sealed credential records: what a custody store holds, however it stores it (SQLite, PostgreSQL).

Records are AES-256-GCM sealed and addressed by `(workspace, connection, handle)`.

Each record is sealed under a custody key id with a fresh 96-bit nonce; the associated data
binds the format version, the exact address and the key id, so a record moved, copied or
edited fails to open. Plaintext exists only in memory, inside a `Secret`. The proxy depends on
`CredentialSource.open(address) -> Secret` alone, so another backend (KMS, Vault transit) can
replace this one without touching it (see docs/custody.md).
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from egress_proxy.custody.keys import KeyFileError
from egress_proxy.custody.secret import Secret
from egress_proxy.errors import EgressError

RECORD_VERSION: Final = 1
STORE_FORMAT: Final = "egresslaw.custody/1"
MAX_SECRET_BYTES: Final = 16 * 1024
MAX_NAME: Final = 256
NONCE_BYTES: Final = 12
LOCK_TIMEOUT_S: Final = 10.0  # how long an operation waits for a lock another process holds
_AD_PREFIX: Final = b"egresslaw.custody\x00"
DATABASE_SCHEMES = ("postgresql://", "postgres://")
_MASK = "***"

__all__ = [
    "Address",
    "CredentialSource",
    "CustodyError",
    "CustodyUnavailable",
    "KeyFileError",
    "Record",
    "Rotation",
    "associated_data",
    "check_secret",
    "decode_fields",
    "decode_record",
    "encode_fields",
    "lock_key",
    "record_grant",
    "is_database_url",
    "shown",
]


class CustodyError(EgressError):
    """A custody operation that was refused or failed. Never carries a secret.

    `io` is true when the store itself cannot be used (unreadable, not a store, keys missing for
    it): the CLI exits 2 for those and 1 for a refused operation.
    """

    def __init__(self, message: str, help: str | None = None, *, io: bool = False) -> None:
        super().__init__(message, help)
        self.io = io


class OpenedRecords:
    """The records a store opened, kept by address with their sealed row and the keyring that opened them.

    The same row (version, key id, nonce, ciphertext and tag) under the same keyring opens to the same plaintext:
    AES-GCM is a function of the key, the nonce, the associated data (the address, version and key id) and the
    ciphertext, and the tag was checked when it was first opened. So `open` still reads the row on every request
    (a changed, re-sealed, rotated or deleted record is seen at once, and an unreachable database still fails
    closed) and skips only the decryption, and the `Secret` it returns is the same object, so what it derives
    (its needles) is derived once. The plaintext was already held in memory per request; this keeps one copy per
    address, dropped when its record changes, is deleted or fails to open (bounded: the oldest goes first)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._memo: dict[Address, tuple[object, tuple, Secret]] = {}
        self._lock = threading.Lock()

    def open(self, address: Address, row: tuple, ring: Callable[[], object], unseal_row: Callable[[], bytes]) -> Secret:
        """The Secret of `row` at `address`: the one opened before if the row and the keyring are the same."""
        with self._lock:
            hit = self._memo.pop(address, None)
        if hit is not None and hit[1] == row and hit[0] is ring():
            secret = hit[2]
        else:
            secret = Secret(unseal_row())  # CustodyError: the entry stays dropped
        with self._lock:
            if len(self._memo) >= self.size:
                del self._memo[next(iter(self._memo))]  # the oldest
            self._memo[address] = (ring(), row, secret)  # the keyring after unseal_row (it may have re-read it)
        return secret

    def forget(self, address: Address) -> None:
        with self._lock:
            self._memo.pop(address, None)

    def __repr__(self) -> str:
        return f"OpenedRecords({len(self._memo)} of {self.size})"


def _check_name(kind: str, value: object) -> str:
    # INVARIANT: a refused name is never echoed; it may be a secret pasted into the wrong argument.
    if not isinstance(value, str):
        raise CustodyError(f"{kind} must be a string")
    if not value:
        raise CustodyError(f"{kind} is empty")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME:
        raise CustodyError(f"{kind} is longer than {MAX_NAME} bytes")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or 0xD800 <= ord(c) < 0xE000 for c in value):
        raise CustodyError(f"{kind} contains a control character")
    if value != value.strip():
        raise CustodyError(f"{kind} has leading or trailing whitespace")
    return value


@dataclass(frozen=True, slots=True, order=True)
class Address:
    """Where a sealed record lives: the policy's workspace, the connection name, the custody handle."""

    workspace: str
    connection: str
    handle: str

    def __post_init__(self) -> None:
        _check_name("workspace", self.workspace)
        _check_name("connection", self.connection)
        _check_name("handle", self.handle)

    def __str__(self) -> str:
        return f"{self.workspace}/{self.connection}/{self.handle}"


@dataclass(frozen=True, slots=True)
class Record:
    """What `list()` shows about a record: never its value."""

    address: Address
    key_id: str
    version: int
    created: str  # ISO 8601 UTC, seconds
    updated: str


@dataclass(frozen=True, slots=True)
class Rotation:
    """The outcome of `rotate()`."""

    key_id: str  # the key every record is now sealed under
    resealed: int
    retired: tuple[str, ...]  # key ids removed from custody.key


@runtime_checkable
class CredentialSource(Protocol):
    """All the proxy needs from custody: the credential for one address, or a CustodyError."""

    def open(self, address: Address) -> Secret: ...


# A structured record (a credential kind's fields: client id and secret, refresh token, private key, key pair) is this
# line, then the canonical JSON of `{"kind": K, "fields": {name: text}}`. A static secret never holds LF, so the
# two never collide; a record without the line is a `static` one (every record sealed before kinds existed).
FIELDS_MARK: Final = b"egresslaw.fields/1\n"
MAX_RECORD_BYTES: Final = 64 * 1024


def encode_fields(kind: str, fields: dict[str, str], grant: str | None = None) -> bytes:
    """The sealed form of a structured record (check it first: `egress_proxy.credentials.check_record`). `grant`: the
    lineage a rotation keeps (`record_grant`), so a record the edge rewrote with a rotated refresh token is still the
    same grant to every process that reads it; a record sealed by `custody put` starts a new one."""
    import json

    doc: dict[str, object] = {"kind": kind, "fields": dict(sorted(fields.items()))}
    if grant is not None:
        doc["grant"] = grant
    return FIELDS_MARK + json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def lock_key(address: Address) -> int:
    """A stable 31-bit number for `address` (the same in every process): the slot of its cross-process mint lock."""
    import zlib

    return zlib.crc32(str(address).encode("utf-8")) & 0x7FFFFFFF


def record_grant(value: bytes) -> str:
    """Which grant a record is: the lineage a rotation wrote into it, else a digest of the record as sealed (a record
    sealed again by hand is another grant: tokens minted from the old one are dropped)."""
    try:
        decoded = decode_record(value)
    except CustodyError:
        decoded = None
    return decoded[2] if decoded is not None else _digest(value)


def decode_fields(value: bytes) -> tuple[str, dict[str, str]] | None:
    """(kind, fields) of a structured record; None for a static one. CustodyError (naming no value) when malformed."""
    decoded = decode_record(value)
    return decoded[:2] if decoded is not None else None


def decode_record(value: bytes) -> tuple[str, dict[str, str], str] | None:
    """(kind, fields, grant) of a structured record, parsed once; None for a static one. CustodyError (naming no value)
    when malformed."""
    import json

    if not value.startswith(FIELDS_MARK):
        return None
    try:
        doc = json.loads(value[len(FIELDS_MARK):])
    except (ValueError, UnicodeDecodeError):
        raise CustodyError("the structured record is not JSON") from None
    if (not isinstance(doc, dict) or not {"kind", "fields"} <= set(doc) <= {"kind", "fields", "grant"}
            or not isinstance(doc["kind"], str) or not isinstance(doc["fields"], dict) or not isinstance(doc.get("grant", ""), str)):
        raise CustodyError('the structured record is not `{"kind": …, "fields": {…}}`')
    fields = doc["fields"]
    for name, text in fields.items():
        if not isinstance(text, str) or not text:
            raise CustodyError(f"field `{name if name.isidentifier() else '?'}` of the record is not a non-empty string")
        if "\x00" in text:
            raise CustodyError(f"field `{name if name.isidentifier() else '?'}` of the record contains NUL")
    return doc["kind"], fields, doc.get("grant") or _digest(value)


def _digest(value: bytes) -> str:
    import hashlib

    return hashlib.sha256(value).hexdigest()


def check_secret(value: bytes) -> bytes:
    """Return `value` if it may be sealed; refuse empty, over 16 KiB, or containing CR, LF or NUL (a structured
    record: well-formed and at most 64 KiB)."""
    if not isinstance(value, (bytes, bytearray)):
        raise CustodyError("a secret is bytes")
    if bytes(value[: len(FIELDS_MARK)]) == FIELDS_MARK:
        if len(value) > MAX_RECORD_BYTES:
            raise CustodyError(f"the record is longer than {MAX_RECORD_BYTES} bytes")
        decode_fields(bytes(value))
        return bytes(value)
    if not value:
        raise CustodyError("the secret is empty", help="pipe the credential on stdin, e.g. `printf %s \"$TOKEN\" | egresslaw custody put …`")
    if len(value) > MAX_SECRET_BYTES:
        raise CustodyError(f"the secret is longer than {MAX_SECRET_BYTES} bytes", help="pipe the credential alone on stdin")
    for byte, name in ((b"\r", "CR"), (b"\n", "LF"), (b"\x00", "NUL")):
        if byte in value:
            # header injection: a CR/LF in a header value splits the request
            raise CustodyError(f"the secret contains {name}, which could split the header it is injected into",
                               help="pipe the credential alone on stdin, with at most one trailing newline")
    return bytes(value)


def associated_data(address: Address, key_id: str, version: int = RECORD_VERSION) -> bytes:
    """AEAD associated data: prefix, u16 version, then u32-length-prefixed workspace, connection, handle, key id."""
    parts = [_AD_PREFIX, struct.pack(">H", version)]
    for text in (address.workspace, address.connection, address.handle, key_id):
        raw = text.encode("utf-8")
        parts.append(struct.pack(">I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def seal(key: bytes, address: Address, key_id: str, value: bytes) -> tuple[bytes, bytes]:
    nonce = secrets.token_bytes(NONCE_BYTES)  # fresh per seal: GCM must never reuse (key, nonce)
    return nonce, AESGCM(key).encrypt(nonce, value, associated_data(address, key_id))


def unseal(
    key_for: Callable[[str], bytes | None], keys_path: object, address: Address, version: object, key_id: object, nonce: object, sealed: object
) -> bytes:
    """Open one stored record (any backend's row): check its version, types, key id and nonce, then AES-GCM with its associated data."""
    if version != RECORD_VERSION:
        raise CustodyError(f"record `{address}` has unsupported format version `{version}`")
    if not isinstance(key_id, str) or not isinstance(nonce, bytes) or not isinstance(sealed, bytes):
        raise CustodyError(f"record `{address}` is malformed")
    key = key_for(key_id)
    if key is None:
        raise CustodyError(
            f"record `{address}` is sealed under key id `{key_id}`, which is not in `{keys_path}`",
            help="use the keys directory this store was sealed with",
        )
    if len(nonce) != NONCE_BYTES:
        raise CustodyError(f"record `{address}` does not open: its nonce has been altered")
    try:
        return AESGCM(key).decrypt(nonce, sealed, associated_data(address, key_id, version))
    except InvalidTag:
        raise CustodyError(
            f"record `{address}` does not open: authentication failed",
            help="it was moved, copied or edited, or the key changed; seal the credential again with `egresslaw custody put`",
        ) from None


def sealing_key(key_for: Callable[[str], bytes | None], keys_path: object, key_id: str) -> bytes:
    """The key a store seals new records under (its `seal_key_id`), or an io CustodyError if the keys directory lacks it."""
    key = key_for(key_id)
    if key is None:
        raise CustodyError(
            f"the store seals under key id `{key_id}`, which is not in `{keys_path}`",
            help="use the keys directory this store was created with",
            io=True,
        )
    return key


def open_for_rotation(key_for: Callable[[str], bytes | None], keys_path: object, rows: object) -> list[tuple[Address, bytes]]:
    """Open every `(workspace, connection, handle, version, key_id, nonce, sealed)` row, or refuse the rotation naming each one that fails."""
    broken: list[str] = []
    plain: list[tuple[Address, bytes]] = []
    for w, c, h, version, key_id, nonce, sealed in rows:  # type: ignore[attr-defined]
        address = Address(w, c, h)
        try:
            plain.append((address, unseal(key_for, keys_path, address, version, key_id, nonce, sealed)))
        except CustodyError:
            broken.append(f"`{address}`")
    if broken:
        raise CustodyError(
            f"rotation aborted, no record changed: {len(broken)} record(s) do not open: {', '.join(broken)}",
            help="delete or re-put those records with `egresslaw custody delete|put`, then rotate again",
        )
    return plain


def now_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class CustodyUnavailable(CustodyError):
    """The custody store cannot be reached right now (its database is down or unreachable).

    The proxy denies the request with `custody-unavailable` and forwards nothing; the store
    reconnects by itself. Never carries a secret or a database password.
    """

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message, help, io=True)


def is_database_url(store: str | os.PathLike[str]) -> bool:
    """True when `store` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(store, str) and store.lower().startswith(DATABASE_SCHEMES)


def shown(store: str | os.PathLike[str]) -> str:
    """`store` as it may appear in a message or log line: a database URL with its password masked."""
    text = os.fspath(store)
    if not is_database_url(text):
        return text
    try:
        parts = urlsplit(text)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, sep, _password = userinfo.partition(":")
            netloc = f"{user}{':' + _MASK if sep else ''}@{hostport}"
        query = urlencode(
            [(k, _MASK if "password" in k.lower() else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="/"
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return f"{text.split(':', 1)[0]}://{_MASK}"  # unparseable: show the scheme only
