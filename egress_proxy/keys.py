"""The keys directory: `custody.key` (AEAD master keys by key id), `lease.key` (HMAC key for leases) and
`audit.key` (the audit log's HMAC chain key and Ed25519 checkpoint signing key; `audit.pub` is its public half).

Both files are JSON, mode 0600, owned by the user running egresslaw, in a directory no one
else can write. A file that anyone else could read is refused rather than used: the fix is a
`chmod`, never a silent downgrade. No message raised here ever contains key bytes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import json
import os
import secrets
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

CUSTODY_FILE: Final = "custody.key"
LEASE_FILE: Final = "lease.key"
CUSTODY_FORMAT: Final = "egresslaw.custody-keys/1"
LEASE_FORMAT: Final = "egresslaw.lease-key/1"
AUDIT_FILE: Final = "audit.key"
AUDIT_PUBLIC_FILE: Final = "audit.pub"
AUDIT_FORMAT: Final = "egresslaw.audit-key/1"
AUDIT_PUBLIC_FORMAT: Final = "egresslaw.audit-pub/1"
KEY_BYTES: Final = 32  # AES-256-GCM and HMAC-SHA256 both take 32 bytes
_MAX_FILE: Final = 1 << 20


class KeyFileError(Exception):
    """A keys directory or key file that cannot be used; the message names the file and the fix."""

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.help = help


@dataclass(frozen=True, slots=True)
class CustodyKey:
    """One custody master key; `repr` shows the id only."""

    id: str
    created: str
    material: bytes

    def __repr__(self) -> str:
        return f"CustodyKey(id={self.id!r}, created={self.created!r})"


class Keyring:
    """The custody keys of a keys directory by id; `active` seals new records in a fresh store."""

    __slots__ = ("_keys", "active", "path")

    def __init__(self, keys: Mapping[str, CustodyKey], active: str, path: Path) -> None:
        if active not in keys:
            raise KeyFileError(f"active key id `{active}` is not in `{path}`")
        self._keys = dict(keys)
        self.active = active
        self.path = path

    @property
    def ids(self) -> tuple[str, ...]:
        """Every key id in the file, oldest first."""
        return tuple(self._keys)

    def __contains__(self, key_id: object) -> bool:
        return key_id in self._keys

    def material(self, key_id: str) -> bytes:
        """The key bytes for `key_id` (KeyError if absent)."""
        return self._keys[key_id].material

    def keys(self) -> tuple[CustodyKey, ...]:
        return tuple(self._keys.values())

    def __repr__(self) -> str:
        return f"Keyring(path={str(self.path)!r}, ids={self.ids!r}, active={self.active!r})"


def new_key_id() -> str:
    """A fresh custody key id: `ck-` + UTC date + 8 random hex digits (readable, never reused)."""
    return f"ck-{time.strftime('%Y%m%d', time.gmtime())}-{secrets.token_hex(4)}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def init_keys(directory: str | os.PathLike[str]) -> Keyring:
    """Create `custody.key`, `lease.key` and `audit.key` (0600) in `directory` (created 0700); never overwrite a key."""
    root = Path(directory)
    for name in (CUSTODY_FILE, LEASE_FILE, AUDIT_FILE, AUDIT_PUBLIC_FILE):
        if (root / name).exists() or (root / name).is_symlink():
            raise KeyFileError(
                f"key file `{root / name}` already exists; refusing to overwrite it",
                help="keys are never replaced by `keys init`; use `egresslaw custody rotate` for a new custody key",
            )
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise KeyFileError(f"cannot create keys directory `{root}`: {exc.strerror or exc.__class__.__name__}") from None
    _check_directory(root)
    os.chmod(root, 0o700)  # an existing directory (say 0755) is tightened: only its owner lists the keys
    key = CustodyKey(new_key_id(), _now(), secrets.token_bytes(KEY_BYTES))
    _write_new(root / CUSTODY_FILE, _custody_document([key]))
    lease = {"format": LEASE_FORMAT, "created": _now(), "key": _b64(secrets.token_bytes(KEY_BYTES))}
    _write_new(root / LEASE_FILE, json.dumps(lease, indent=2) + "\n")
    init_audit_key(root)
    return load_custody_keys(root)


def load_custody_keys(directory: str | os.PathLike[str]) -> Keyring:
    """Read `KEYS/custody.key`; refuse it unless it is private to the current user."""
    path = Path(directory) / CUSTODY_FILE
    doc = _read_private_json(path, CUSTODY_FORMAT)
    entries = doc.get("keys")
    if not isinstance(entries, list) or not entries:
        raise _malformed(path, "no keys")
    keys: dict[str, CustodyKey] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"id", "created", "key"}:
            raise _malformed(path, "a key entry needs exactly `id`, `created` and `key`")
        key_id, created = entry["id"], entry["created"]
        if not isinstance(key_id, str) or not _valid_key_id(key_id) or not isinstance(created, str):
            raise _malformed(path, "a key id is not of the form `ck-…`")
        if key_id in keys:
            raise _malformed(path, f"key id `{key_id}` appears twice")
        keys[key_id] = CustodyKey(key_id, created, _decode_key(path, entry["key"]))
    active = doc.get("active", entries[-1]["id"])
    if not isinstance(active, str):
        raise _malformed(path, "`active` is not a key id")
    return Keyring(keys, active, path)


def load_lease_key(directory: str | os.PathLike[str]) -> bytes:
    """The 32-byte HMAC-SHA256 key from `KEYS/lease.key`; refused unless private to the current user."""
    path = Path(directory) / LEASE_FILE
    doc = _read_private_json(path, LEASE_FORMAT)
    if set(doc) != {"format", "created", "key"}:
        raise _malformed(path, "expected exactly `format`, `created` and `key`")
    return _decode_key(path, doc["key"])


def write_custody_keys(directory: str | os.PathLike[str], keys: list[CustodyKey], active: str) -> None:
    """Replace `custody.key` atomically (temp file 0600, fsync, rename, fsync directory)."""
    root = Path(directory)
    _check_directory(root)
    if active not in {k.id for k in keys}:
        raise KeyFileError(f"active key id `{active}` is not among the keys to write")
    path = root / CUSTODY_FILE
    tmp = root / f".{CUSTODY_FILE}.{secrets.token_hex(4)}.tmp"
    _write_new(tmp, _custody_document(keys, active), sync_dir=False)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise KeyFileError(f"cannot replace `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    _fsync_dir(root)


@contextlib.contextmanager
def locked(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive lock on the keys directory (serializes `custody.key` read-modify-write)."""
    root = Path(directory)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise KeyFileError(f"cannot open keys directory `{root}`: {exc.strerror or exc.__class__.__name__}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _custody_document(keys: list[CustodyKey], active: str | None = None) -> str:
    doc = {
        "format": CUSTODY_FORMAT,
        "active": active or keys[-1].id,
        "keys": [{"id": k.id, "created": k.created, "key": _b64(k.material)} for k in keys],
    }
    return json.dumps(doc, indent=2) + "\n"


def _valid_key_id(key_id: str) -> bool:
    return key_id.startswith("ck-") and 4 <= len(key_id) <= 64 and all(c.isascii() and (c.isalnum() or c in "-_") for c in key_id)


def _decode_key(path: Path, value: object) -> bytes:
    if not isinstance(value, str):
        raise _malformed(path, "a key is not a base64 string")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise _malformed(path, "a key is not valid base64") from None
    if len(raw) != KEY_BYTES:
        raise _malformed(path, f"a key is not {KEY_BYTES} bytes")
    return raw


def _malformed(path: Path, why: str) -> KeyFileError:
    # INVARIANT: `why` is written by this module, never taken from the file (which holds key bytes).
    return KeyFileError(f"key file `{path}` is malformed: {why}", help="recreate the keys directory with `egresslaw keys init --dir DIR`")


def _check_directory(root: Path) -> None:
    """The directory must be ours and writable by no one else (or a key file could be swapped)."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise KeyFileError(f"keys directory `{root}` does not exist", help=f"create it with `egresslaw keys init --dir {root}`") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read keys directory `{root}`: {exc.strerror or exc.__class__.__name__}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise KeyFileError(f"keys directory `{root}` is not a directory")
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"keys directory `{root}` is not owned by the current user", help=f"run as its owner, or `chown` it to uid {os.geteuid()}")
    if st.st_mode & 0o022:
        raise KeyFileError(f"keys directory `{root}` is writable by group or others", help=f"run `chmod 700 {root}`")


def _read_private_json(path: Path, expected_format: str) -> dict:
    """Open without following links, check owner and mode on the open descriptor, then parse."""
    _check_directory(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeyFileError(f"key file `{path}` does not exist", help=f"create it with `egresslaw keys init --dir {path.parent}`") from None
    except OSError as exc:
        raise KeyFileError(f"cannot open key file `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file `{path}` is not a regular file")
        if st.st_uid != os.geteuid():
            raise KeyFileError(f"key file `{path}` is not owned by the current user", help=f"run as its owner, or `chown` it to uid {os.geteuid()}")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"key file `{path}` is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                help=f"run `chmod 600 {path}`",
            )
        if st.st_size > _MAX_FILE:
            raise _malformed(path, "file is too large")
        with os.fdopen(os.dup(fd), "rb") as fh:
            raw = fh.read(_MAX_FILE + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _malformed(path, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != expected_format:
        raise _malformed(path, f"expected format `{expected_format}`")
    return doc


def _write_new(path: Path, text: str, *, sync_dir: bool = True) -> None:
    """Create `path` exclusively with mode 0600 (whatever the umask), write, fsync."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise KeyFileError(f"key file `{path}` already exists; refusing to overwrite it") from None
    except OSError as exc:
        raise KeyFileError(f"cannot create key file `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    try:
        os.fchmod(fd, 0o600)
        data = memoryview(text.encode("utf-8"))
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    except OSError as exc:
        raise KeyFileError(f"cannot write key file `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    finally:
        os.close(fd)
    if sync_dir:
        _fsync_dir(path.parent)


def _fsync_dir(root: Path) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the audit key ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuditKey:
    """The audit log's keys: `mac_key` chains the lines (HMAC-SHA256), `signing` (an Ed25519 seed) signs the
    checkpoints, `public` verifies them. A key read from `audit.pub` has no `mac_key` and no `signing`."""

    id: str
    public: bytes
    mac_key: bytes | None = None
    signing: bytes | None = None

    def __repr__(self) -> str:
        return f"AuditKey(id={self.id!r}, secret={self.mac_key is not None})"


def audit_key_id(public: bytes) -> str:
    """`ak-` + the first 16 hex digits of sha256(public key): names the key in every signed audit record."""
    import hashlib

    return "ak-" + hashlib.sha256(public).hexdigest()[:16]


def init_audit_key(directory: str | os.PathLike[str]) -> AuditKey:
    """Create `audit.key` (0600) and `audit.pub` in an existing keys directory; never overwrite either."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    root = Path(directory)
    _check_directory(root)
    for name in (AUDIT_FILE, AUDIT_PUBLIC_FILE):
        if (root / name).exists() or (root / name).is_symlink():
            raise KeyFileError(f"key file `{root / name}` already exists; refusing to overwrite it")
    seed = secrets.token_bytes(KEY_BYTES)
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    key = AuditKey(audit_key_id(public), public, secrets.token_bytes(KEY_BYTES), seed)
    doc = {"format": AUDIT_FORMAT, "created": _now(), "id": key.id, "mac_key": _b64(key.mac_key), "signing_key": _b64(seed)}
    _write_new(root / AUDIT_FILE, json.dumps(doc, indent=2) + "\n")
    pub = {"format": AUDIT_PUBLIC_FORMAT, "id": key.id, "public_key": _b64(public)}
    _write_new(root / AUDIT_PUBLIC_FILE, json.dumps(pub, indent=2) + "\n")
    return key


def load_audit_key(directory: str | os.PathLike[str]) -> AuditKey:
    """The audit chain and checkpoint keys from `KEYS/audit.key`; refused unless private to the current user."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(directory) / AUDIT_FILE
    try:
        doc = _read_private_json(path, AUDIT_FORMAT)
    except KeyFileError as exc:
        if "does not exist" in exc.message:
            raise KeyFileError(
                f"key file `{path}` does not exist (a keys directory made before audit keys existed)",
                help=f"create it with `egresslaw keys add-audit-key --dir {path.parent}` (the other keys are kept)",
            ) from None
        raise
    if set(doc) != {"format", "created", "id", "mac_key", "signing_key"}:
        raise _malformed(path, "expected exactly `format`, `created`, `id`, `mac_key` and `signing_key`")
    seed = _decode_key(path, doc["signing_key"])
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    if doc["id"] != audit_key_id(public):
        raise _malformed(path, "`id` does not name its signing key")
    return AuditKey(doc["id"], public, _decode_key(path, doc["mac_key"]), seed)


def load_audit_public_key(path: str | os.PathLike[str]) -> AuditKey:
    """The checkpoint verification key from an `audit.pub` file (public: no permission check)."""
    where = Path(path)
    try:
        raw = where.read_bytes()[:_MAX_FILE]
        doc = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise KeyFileError(f"public key file `{where}` does not exist") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read public key file `{where}`: {exc.strerror or exc.__class__.__name__}") from None
    except (UnicodeDecodeError, ValueError):
        raise KeyFileError(f"public key file `{where}` is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != AUDIT_PUBLIC_FORMAT:
        raise KeyFileError(f"public key file `{where}` is not in format `{AUDIT_PUBLIC_FORMAT}`")
    public = _decode_key(where, doc.get("public_key"))
    if doc.get("id") != audit_key_id(public):
        raise KeyFileError(f"public key file `{where}`: `id` does not name its key")
    return AuditKey(doc["id"], public)
