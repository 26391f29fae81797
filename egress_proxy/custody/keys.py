"""The keys directory: `custody.key` (AEAD master keys by key id), `lease.key` (HMAC keys for leases, by key id)
and `audit.key` (the audit log's HMAC chain key and Ed25519 checkpoint signing key; `audit.pub` is its public half).

Both files are JSON, mode 0600, owned by the user running egresslaw, in a directory no one
else can write. A file that anyone else could read is refused rather than used: the fix is a
`chmod`, never a silent downgrade. No message raised here ever contains key bytes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from egress_proxy.custody.lease import MAX_TTL, LeaseKey, LeaseKeys, key_id
from egress_proxy.errors import EgressError

CUSTODY_FILE: Final = "custody.key"
LEASE_FILE: Final = "lease.key"
CUSTODY_FORMAT: Final = "egresslaw.custody-keys/1"
LEASE_FORMAT: Final = "egresslaw.lease-key/1"  # one key, as `keys init` writes it
LEASE_KEYS_FORMAT: Final = "egresslaw.lease-keys/2"  # a key set after `keys rotate --lease`
AUDIT_FILE: Final = "audit.key"
AUDIT_PUBLIC_FILE: Final = "audit.pub"
AUDIT_FORMAT: Final = "egresslaw.audit-key/1"
AUDIT_PUBLIC_FORMAT: Final = "egresslaw.audit-pub/1"
KEY_BYTES: Final = 32  # AES-256-GCM and HMAC-SHA256 both take 32 bytes
_MAX_FILE: Final = 1 << 20
log = logging.getLogger("egresslaw.keys")


class KeyFileError(EgressError):
    """A keys directory or key file that cannot be used; the message names the file and the fix."""


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
    check_directory(root)
    os.chmod(root, 0o700)  # an existing directory (say 0755) is tightened: only its owner lists the keys
    key = CustodyKey(new_key_id(), _now(), secrets.token_bytes(KEY_BYTES))
    write_new(root / CUSTODY_FILE, _custody_document([key]))
    lease = {"format": LEASE_FORMAT, "created": _now(), "key": _b64(secrets.token_bytes(KEY_BYTES))}
    write_new(root / LEASE_FILE, json.dumps(lease, indent=2) + "\n")
    init_audit_key(root)
    return load_custody_keys(root)


def load_custody_keys(directory: str | os.PathLike[str]) -> Keyring:
    """Read `KEYS/custody.key`; refuse it unless it is private to the current user."""
    path = Path(directory) / CUSTODY_FILE
    doc = read_private_json(path, CUSTODY_FORMAT)
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
    """The 32-byte HMAC-SHA256 key that mints leases (the active one) from `KEYS/lease.key`."""
    return load_lease_keys(directory).active.material


def load_lease_keys(directory: str | os.PathLike[str]) -> LeaseKeys:
    """Every lease key of `KEYS/lease.key` by id (the single key of `keys init`, or the set `keys rotate --lease`
    writes); refused unless private to the current user."""
    path = Path(directory) / LEASE_FILE
    doc = read_private_json(path, (LEASE_FORMAT, LEASE_KEYS_FORMAT))
    if doc["format"] == LEASE_FORMAT:
        if set(doc) != {"format", "created", "key"}:
            raise _malformed(path, "expected exactly `format`, `created` and `key`")
        material = _decode_key(path, doc["key"])
        created = doc["created"] if isinstance(doc["created"], str) else ""
        return LeaseKeys([LeaseKey(key_id(material), material, created)], key_id(material))
    entries = doc.get("keys")
    if set(doc) != {"format", "active", "keys"} or not isinstance(entries, list) or not entries:
        raise _malformed(path, "expected `format`, `active` and a non-empty list of `keys`")
    keys: list[LeaseKey] = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"id", "created", "key", "retires"}:
            raise _malformed(path, "a lease key entry needs exactly `id`, `created`, `key` and `retires`")
        material = _decode_key(path, entry["key"])
        if entry["id"] != key_id(material):
            raise _malformed(path, "a lease key id does not match its key")
        retires = entry["retires"]
        if retires is not None and (not isinstance(retires, str) or _parse_time(retires) is None):
            raise _malformed(path, "`retires` is not null or a UTC time `YYYY-MM-DDTHH:MM:SSZ`")
        created = entry["created"] if isinstance(entry["created"], str) else ""
        keys.append(LeaseKey(key_id(material), material, created, None if retires is None else _parse_time(retires)))
    if len({k.id for k in keys}) != len(keys):
        raise _malformed(path, "a lease key appears twice")
    active = doc["active"]
    if not isinstance(active, str) or active not in {k.id for k in keys}:
        raise _malformed(path, "`active` is not the id of one of its keys")
    if next(k for k in keys if k.id == active).retires is not None:
        raise _malformed(path, "the active lease key has a retirement time")
    return LeaseKeys(keys, active)


def rotate_lease_key(directory: str | os.PathLike[str], *, overlap: int, now: float) -> tuple[LeaseKeys, LeaseKey]:
    """A new active lease key; the old one keeps verifying for `overlap` seconds (0: it stops now). No older key
    verifies longer than that either (`--overlap 0` after a compromise cuts every old key); a key retired for
    longer than the longest lease lifetime is dropped. Returns the new key set and the key it replaced."""
    root = Path(directory)
    if not isinstance(overlap, int) or overlap < 0:
        raise KeyFileError("the overlap must be a whole number of seconds, 0 or more")
    with locked(root):
        current = load_lease_keys(root)
        old = current.active
        until = int(now) + overlap
        kept = [
            LeaseKey(k.id, k.material, k.created, min(k.retires if k.retires is not None else until, until))
            for k in current.keys()
            if k.id != old.id and (k.retires is None or k.retires + MAX_TTL > now)
        ]
        retiring = LeaseKey(old.id, old.material, old.created, until)
        material = secrets.token_bytes(KEY_BYTES)
        new = LeaseKey(key_id(material), material, _now())
        keys = [*kept, retiring, new]
        doc = {
            "format": LEASE_KEYS_FORMAT,
            "active": new.id,
            "keys": [
                {"id": k.id, "created": k.created, "key": _b64(k.material), "retires": None if k.retires is None else _format_time(k.retires)}
                for k in keys
            ],
        }
        _replace(root, LEASE_FILE, json.dumps(doc, indent=2) + "\n")
    return LeaseKeys(keys, new.id), retiring


class LeaseKeyFile:
    """`KEYS/lease.key` as the proxy reads it: read again whenever the file changes (a rotation), so a new key
    verifies and a retired one stops without a restart. A file that changed and no longer loads fails closed:
    `current()` raises KeyFileError until the file changes again."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._path = os.fspath(self.directory / LEASE_FILE)  # stat'd on every lease check: joined once
        self._stamp = self._stat()
        self._keys: LeaseKeys | None = load_lease_keys(self.directory)
        self._error: KeyFileError | None = None

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self._path)  # the target: a mounted secret is swapped by relinking
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)  # ctime: a chmod counts as a change

    def current(self) -> LeaseKeys:
        """The key set in force; KeyFileError while a changed file does not load (logged once per change)."""
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._keys, self._error = load_lease_keys(self.directory), None
                log.info("lease keys read again: active `%s`, %d key(s)", self._keys.active.id, len(self._keys.keys()))
            except KeyFileError as exc:
                self._keys, self._error = None, exc
                log.error("lease keys cannot be read again, refusing every lease until the file is fixed: %s", exc.message)
        if self._keys is None:
            assert self._error is not None
            raise self._error
        return self._keys

    def __repr__(self) -> str:
        return f"LeaseKeyFile(directory={str(self.directory)!r})"


def write_custody_keys(directory: str | os.PathLike[str], keys: list[CustodyKey], active: str) -> None:
    """Replace `custody.key` atomically (temp file 0600, fsync, rename, fsync directory)."""
    root = Path(directory)
    check_directory(root)
    if active not in {k.id for k in keys}:
        raise KeyFileError(f"active key id `{active}` is not among the keys to write")
    path = root / CUSTODY_FILE
    tmp = root / f".{CUSTODY_FILE}.{secrets.token_hex(4)}.tmp"
    write_new(tmp, _custody_document(keys, active), sync_dir=False)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise KeyFileError(f"cannot replace `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    fsync_dir(root)


LOCK_TIMEOUT_S: Final = 10.0


@contextlib.contextmanager
def locked(
    directory: str | os.PathLike[str], timeout: float = LOCK_TIMEOUT_S, on_wait: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold an exclusive lock on the keys directory (serializes `custody.key` read-modify-write).

    Waits at most `timeout` seconds for another process's lock, calling `on_wait(message)` once if it has to
    wait, then raises KeyFileError naming the lock: never blocks silently or forever.
    """
    root = Path(directory)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise KeyFileError(f"cannot open keys directory `{root}`: {exc.strerror or exc.__class__.__name__}") from None
    try:
        flock_within(
            fd,
            timeout,
            lambda: KeyFileError(
                f"keys directory `{root}` is locked by another process (its `flock`, held while `custody.key` is "
                f"rewritten); not released within {timeout:g} s",
                help=f"another `egresslaw custody rotate` is running; retry when it is done (find it with `fuser {root}`)",
            ),
            lambda: on_wait(f"waiting up to {timeout:g} s for the lock on keys directory `{root}` (held by another process)")
            if on_wait
            else None,
        )
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _replace(root: Path, name: str, text: str) -> None:
    """Replace `root/name` atomically with a new 0600 file (temp file, fsync, rename, fsync directory)."""
    check_directory(root)
    tmp = root / f".{name}.{secrets.token_hex(4)}.tmp"
    write_new(tmp, text, sync_dir=False)
    try:
        os.replace(tmp, root / name)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise KeyFileError(f"cannot replace `{root / name}`: {exc.strerror or exc.__class__.__name__}") from None
    fsync_dir(root)


def _format_time(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _parse_time(text: str) -> int | None:
    import calendar

    try:
        return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, OverflowError):
        return None


def flock_within(
    fd: int, timeout: float, error: Callable[[], Exception], on_wait: Callable[[], object] | None = None
) -> None:
    """`flock(fd, LOCK_EX)`, retried for at most `timeout` seconds; raises `error()` when it does not come."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            raise error()
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.1)


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


def _read_only(path: Path) -> bool:
    """True when `path` is on a read-only mount (a Kubernetes Secret volume is one): no one can swap its files."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_directory(root: Path) -> None:
    """The directory must be ours and writable by no one else (or a key file could be swapped).

    A directory on a read-only mount cannot be written by anyone, so its owner and mode do not matter
    (a Kubernetes Secret volume is mounted read-only, owned by root, often mode 1777).
    """
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise KeyFileError(f"keys directory `{root}` does not exist", help=f"create it with `egresslaw keys init --dir {root}`") from None
    except OSError as exc:
        raise KeyFileError(f"cannot read keys directory `{root}`: {exc.strerror or exc.__class__.__name__}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise KeyFileError(f"keys directory `{root}` is not a directory", help="pass the directory made by `egresslaw keys init --dir KEYS`")
    if _read_only(root):
        return
    if st.st_uid != os.geteuid():
        raise KeyFileError(f"keys directory `{root}` is not owned by the current user", help=f"run as its owner, or `chown` it to uid {os.geteuid()}")
    if st.st_mode & 0o022:
        raise KeyFileError(f"keys directory `{root}` is writable by group or others", help=f"run `chmod 700 {root}`")


_MOUNT_HELP: Final = (
    "for a Kubernetes Secret, mount it with `defaultMode: 0440` and set the pod's `securityContext.fsGroup` "
    "to the proxy's group (see deploy/kubernetes.yaml)"
)


def _resolve_key_file(path: Path) -> Path:
    """The file `path` names, following symlinks only inside the keys directory (a Kubernetes Secret
    mounts `KEY -> ..data/KEY`, `..data -> ..2026_01_01_…/`); the final file is what gets checked."""
    if not path.is_symlink():
        return path
    root = Path(os.path.realpath(path.parent))
    target = Path(os.path.realpath(path))
    if target != root and root not in target.parents:
        raise KeyFileError(
            f"key file `{path}` is a symlink to `{target}`, outside the keys directory",
            help=f"key files may be symlinks only within `{path.parent}` (as a mounted Kubernetes Secret makes them); "
            f"copy the key into `{path.parent}`",
        )
    if target.parent != root:
        check_directory(target.parent)
    return target


def _check_key_file(path: Path, shown: Path, st: os.stat_result) -> None:
    """Owner and mode of the final key file (`shown` is the name the user gave, `path` the file it resolved to)."""
    where = f"`{shown}`" if shown == path else f"`{shown}` (-> `{path}`)"
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"key file {where} is not a regular file", help="point at the key file `egresslaw keys init` wrote")
    mode = stat.S_IMODE(st.st_mode)
    if _read_only(path):
        # Read-only mount: no one can replace the file, and the kubelet writes Secret files as root with the
        # pod's fsGroup; group access is how a non-root proxy reads them. Others must never read a key.
        if mode & 0o007:
            raise KeyFileError(f"key file {where} is readable by others (mode {mode:04o})", help=_MOUNT_HELP)
        return
    if st.st_uid != os.geteuid():
        raise KeyFileError(
            f"key file {where} is not owned by the current user",
            help=f"run as its owner, or `chown` it to uid {os.geteuid()}",
        )
    if mode & 0o077:
        raise KeyFileError(
            f"key file {where} is accessible by group or others (mode {mode:04o})",
            help=f"run `chmod 600 {path}`",
        )


def read_private_json(path: Path, expected_format: str | tuple[str, ...]) -> dict:
    """Resolve symlinks within the keys directory, open the final file without following links, check
    owner and mode on the open descriptor, then parse."""
    check_directory(path.parent)
    target = _resolve_key_file(path)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block: refused below
    except FileNotFoundError:
        raise KeyFileError(f"key file `{path}` does not exist", help=f"create it with `egresslaw keys init --dir {path.parent}`") from None
    except PermissionError:
        raise KeyFileError(
            f"key file `{path}` is not readable by uid {os.geteuid()}",
            help=f"make it owned by the user running egresslaw (`chown`, mode 0600); {_MOUNT_HELP}",
        ) from None
    except OSError as exc:
        raise KeyFileError(f"cannot open key file `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    try:
        st = os.fstat(fd)
        _check_key_file(target, path, st)
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
    formats = (expected_format,) if isinstance(expected_format, str) else expected_format
    if not isinstance(doc, dict) or doc.get("format") not in formats:
        raise _malformed(path, f"expected format `{formats[-1]}`")
    return doc


def write_new(path: Path, text: str, *, sync_dir: bool = True) -> None:
    """Create `path` exclusively with mode 0600 (whatever the umask), write, fsync."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise KeyFileError(f"key file `{path}` already exists; refusing to overwrite it") from None
    except OSError as exc:
        help = None
        if exc.errno == errno.EROFS:
            help = "the keys directory is a read-only mount (a Kubernetes Secret?): change the keys where they are managed, then update the Secret"
        raise KeyFileError(f"cannot create key file `{path}`: {exc.strerror or exc.__class__.__name__}", help=help) from None
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
        fsync_dir(path.parent)


def fsync_dir(root: Path) -> None:
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
    check_directory(root)
    for name in (AUDIT_FILE, AUDIT_PUBLIC_FILE):
        if (root / name).exists() or (root / name).is_symlink():
            raise KeyFileError(f"key file `{root / name}` already exists; refusing to overwrite it")
    seed = secrets.token_bytes(KEY_BYTES)
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()
    key = AuditKey(audit_key_id(public), public, secrets.token_bytes(KEY_BYTES), seed)
    doc = {"format": AUDIT_FORMAT, "created": _now(), "id": key.id, "mac_key": _b64(key.mac_key), "signing_key": _b64(seed)}
    write_new(root / AUDIT_FILE, json.dumps(doc, indent=2) + "\n")
    pub = {"format": AUDIT_PUBLIC_FORMAT, "id": key.id, "public_key": _b64(public)}
    write_new(root / AUDIT_PUBLIC_FILE, json.dumps(pub, indent=2) + "\n")
    return key


def load_audit_key(directory: str | os.PathLike[str]) -> AuditKey:
    """The audit chain and checkpoint keys from `KEYS/audit.key`; refused unless private to the current user."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(directory) / AUDIT_FILE
    try:
        doc = read_private_json(path, AUDIT_FORMAT)
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
