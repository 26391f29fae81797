"""The embedded custody store: one SQLite file (WAL) of sealed records (`egress_proxy.custody.records`).

Safe to share between threads (one connection behind a lock) and between processes (SQLite locking,
`BEGIN IMMEDIATE`, a busy timeout). The proxy depends on `CredentialSource.open(address) -> Secret`
alone, so another backend (PostgreSQL, KMS, Vault transit) can replace this one (docs/custody.md).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from egress_proxy.custody import keys as keyfiles
from egress_proxy.custody.keys import CustodyKey, Keyring
from egress_proxy.custody.records import (
    LOCK_TIMEOUT_S,
    RECORD_VERSION,
    STORE_FORMAT,
    Address,
    CustodyError,
    OpenedRecords,
    Record,
    Rotation,
    check_secret,
    lock_key,
    now_stamp,
    open_for_rotation,
    seal,
    sealing_key,
    unseal,
)
from egress_proxy.custody.secret import Secret

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS records (
    workspace  TEXT    NOT NULL,
    connection TEXT    NOT NULL,
    handle     TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    key_id     TEXT    NOT NULL,
    nonce      BLOB    NOT NULL,
    sealed     BLOB    NOT NULL,  -- ciphertext || 16-byte GCM tag
    created    TEXT    NOT NULL,
    updated    TEXT    NOT NULL,
    PRIMARY KEY (workspace, connection, handle)
) STRICT;
"""


class CustodyStore:
    """The embedded custody backend: sealed records in one SQLite file, keys from a keys directory.

    Safe to share between threads (one connection behind a lock) and between processes
    (SQLite locking, `BEGIN IMMEDIATE`, a busy timeout).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys_dir: str | os.PathLike[str],
        *,
        create: bool = True,
        lock_timeout: float = LOCK_TIMEOUT_S,
    ) -> None:
        self.path = Path(path)
        self.keys_dir = Path(keys_dir)
        self.lock_timeout = lock_timeout
        self._lock = threading.RLock()
        self._mint_fd: int | None = None  # custody.db.mint.lock, opened on the first try_mint_lock
        self._ring: Keyring = keyfiles.load_custody_keys(self.keys_dir)
        self._db = self._connect(create)
        self._opened = OpenedRecords()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def lock_path(self) -> Path:
        """The sidecar file whose lock serializes opening (WAL switch, schema): `<store>.lock`."""
        return self.path.with_name(self.path.name + ".lock")

    def _connect(self, create: bool) -> sqlite3.Connection:
        where = f"`{self.path}`"
        if not self.path.exists():
            if not create:
                raise CustodyError(f"custody store {where} does not exist", help="create it with `egresslaw custody put`", io=True)
            try:  # create it 0600 ourselves: SQLite gives -wal/-shm the main file's mode
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            except FileExistsError:
                pass
            except OSError as exc:
                raise CustodyError(f"cannot create custody store {where}: {exc.strerror or exc.__class__.__name__}",
                                   help="point `--store` at a file in an existing, writable directory", io=True) from None
        elif not self.path.is_file():
            raise CustodyError(f"custody store {where} is not a regular file",
                               help="point `--store` at the SQLite file `egresslaw custody put` creates, or a postgresql:// URL", io=True)
        # INVARIANT: every open runs the WAL switch and the schema under the sidecar lock. SQLite answers a
        # journal-mode change that meets another connection with SQLITE_BUSY without calling the busy
        # handler, so two processes opening a new store at once would otherwise fail instead of queueing.
        with _file_lock(self.lock_path, self.lock_timeout, f"the open lock `{self.lock_path}` of custody store {where}"):
            try:
                db = sqlite3.connect(self.path, timeout=self.lock_timeout, isolation_level=None, check_same_thread=False)
            except sqlite3.Error as exc:
                raise CustodyError(f"cannot open custody store {where}: {exc.__class__.__name__}", io=True) from None
            try:
                self._initialize(db, where)
            except CustodyError:
                db.close()
                raise
            except sqlite3.Error as exc:
                db.close()
                if _is_busy(exc):
                    raise self._locked_error() from None
                raise CustodyError(
                    f"{where} is not a usable custody store ({exc.__class__.__name__})",
                    help="point `--store` at a file created by `egresslaw custody put`",
                    io=True,
                ) from None
        return db

    def _initialize(self, db: sqlite3.Connection, where: str) -> None:
        db.execute(f"PRAGMA busy_timeout = {int(self.lock_timeout * 1000)}")
        mode = _retry_busy(lambda: db.execute("PRAGMA journal_mode = WAL").fetchone()[0], self.lock_timeout)
        if str(mode).lower() != "wal":
            raise CustodyError(f"custody store {where} cannot use WAL mode (got `{mode}`)", io=True)
        db.execute("PRAGMA synchronous = FULL")
        # Deleted and re-sealed records are overwritten with zeros, so ciphertext under a
        # retired key does not linger in free pages.
        db.execute("PRAGMA secure_delete = ON")
        if self._format(db) == STORE_FORMAT:
            return  # an initialized store opens with reads only: no writer can hold the start-up up
        with self._transaction(db):
            for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE name = 'format'").fetchone()
            if row is None:
                if db.execute("SELECT count(*) FROM records").fetchone()[0]:
                    raise CustodyError(f"custody store {where} has records but no format marker", io=True)
                db.execute("INSERT INTO meta(name, value) VALUES ('format', ?)", (STORE_FORMAT,))
            elif row[0] != STORE_FORMAT:
                raise CustodyError(f"custody store {where} has unsupported format `{row[0]}`", io=True)

    @staticmethod
    def _format(db: sqlite3.Connection) -> str | None:
        """The store's format marker, or None when the schema is not there yet."""
        if db.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'meta'").fetchone() is None:
            return None
        row = db.execute("SELECT value FROM meta WHERE name = 'format'").fetchone()
        return row[0] if row else None

    def _locked_error(self) -> CustodyError:
        return CustodyError(
            f"custody store `{self.path}` is locked by another process: its SQLite write lock was not released "
            f"within {self.lock_timeout:g} s",
            help="another `egresslaw custody put|delete|rotate` is writing to it, or a process holds a transaction open; "
            f"retry when it is done, or wait longer with `--lock-timeout` (find the holder with `fuser {self.path}`)",
            io=True,
        )

    def close(self) -> None:
        """Close the database connection (and the mint-lock file: its locks go with it)."""
        with self._lock:
            self._db.close()
            fd, self._mint_fd = getattr(self, "_mint_fd", None), None
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> CustodyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CustodyStore(path={str(self.path)!r}, keys_dir={str(self.keys_dir)!r})"

    @contextmanager
    def _transaction(self, db: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """`BEGIN IMMEDIATE` … `COMMIT`: takes the write lock up front, so concurrent writers queue, never lose."""
        db = db or self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- keys ----------------------------------------------------------------------------------

    def _key(self, key_id: str) -> bytes | None:
        """Key bytes for `key_id`, re-reading custody.key once if it is unknown (another process rotated)."""
        if key_id not in self._ring:
            self._ring = keyfiles.load_custody_keys(self.keys_dir)
        return self._ring.material(key_id) if key_id in self._ring else None

    def _seal_key_id(self, db: sqlite3.Connection) -> str:
        """The key id new records are sealed under. Lives in the store (set by `rotate` in its transaction),
        so a process holding an old keyring never seals under a key a rotation just retired."""
        row = db.execute("SELECT value FROM meta WHERE name = 'seal_key_id'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta(name, value) VALUES ('seal_key_id', ?)", (self._ring.active,))
            return self._ring.active
        return row[0]

    # -- operations ------------------------------------------------------------------------------

    def put(self, address: Address, secret: bytes | Secret) -> Record:
        """Seal `secret` at `address`, replacing any record there."""
        value = check_secret(secret.reveal() if isinstance(secret, Secret) else secret)
        with self._lock, self._guard(), self._transaction() as db:
            key_id = self._seal_key_id(db)
            nonce, sealed = seal(sealing_key(self._key, self._ring.path, key_id), address, key_id, value)
            now = now_stamp()
            db.execute(
                """INSERT INTO records (workspace, connection, handle, version, key_id, nonce, sealed, created, updated)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (workspace, connection, handle) DO UPDATE SET
                     version = excluded.version, key_id = excluded.key_id, nonce = excluded.nonce,
                     sealed = excluded.sealed, updated = excluded.updated""",
                (address.workspace, address.connection, address.handle, RECORD_VERSION, key_id, nonce, sealed, now, now),
            )
            created = db.execute(
                "SELECT created FROM records WHERE workspace = ? AND connection = ? AND handle = ?",
                (address.workspace, address.connection, address.handle),
            ).fetchone()[0]
        return Record(address, key_id, RECORD_VERSION, created, now)

    def try_mint_lock(self, address: Address) -> Callable[[], None] | None:
        """The fleet's lock on minting `address`'s credential (a byte of `custody.db.mint.lock`, POSIX record locks):
        its release, or None when another process holds it. Serializes refreshes across `--workers` processes, so a
        refresh token one rotated is the one the next reads (never two processes spending the same one)."""
        import fcntl

        with self._lock:
            if self._mint_fd is None:
                self._mint_fd = os.open(self.path.with_name(self.path.name + ".mint.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fd, offset = self._mint_fd, lock_key(address)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        except OSError:
            return None

        def release() -> None:
            try:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)
            except OSError:
                pass

        return release

    def open(self, address: Address) -> Secret:
        """The credential at `address`; CustodyError (naming the address, never the value) if it is absent or does not open."""
        with self._lock, self._guard():
            row = self._db.execute(
                "SELECT version, key_id, nonce, sealed FROM records WHERE workspace = ? AND connection = ? AND handle = ?",
                (address.workspace, address.connection, address.handle),
            ).fetchone()
            if row is None:
                self._opened.forget(address)
                raise CustodyError(f"no credential at `{address}`", help="seal one with `egresslaw custody put`")
            return self._opened.open(address, tuple(row), lambda: self._ring, lambda: self._unseal(address, *row))

    def _unseal(self, address: Address, version: object, key_id: object, nonce: object, sealed: object) -> bytes:
        return unseal(self._key, self._ring.path, address, version, key_id, nonce, sealed)

    def list(self) -> tuple[Record, ...]:
        """Every record's address, key id and timestamps, sorted by address; never a value."""
        with self._lock, self._guard():
            rows = self._db.execute(
                "SELECT workspace, connection, handle, key_id, version, created, updated FROM records "
                "ORDER BY workspace, connection, handle"
            ).fetchall()
        return tuple(Record(Address(w, c, h), k, v, cr, up) for w, c, h, k, v, cr, up in rows)

    def delete(self, address: Address) -> None:
        """Remove the record at `address` (CustodyError if there is none)."""
        with self._lock, self._guard(), self._transaction() as db:
            cur = db.execute(
                "DELETE FROM records WHERE workspace = ? AND connection = ? AND handle = ?",
                (address.workspace, address.connection, address.handle),
            )
            if cur.rowcount == 0:
                raise CustodyError(f"no credential at `{address}`")
        self._checkpoint()

    def rotate(self, on_wait: Callable[[str], None] | None = None) -> Rotation:
        """Re-seal every record under a new key id, then retire the key ids no record uses.

        The keys directory is locked for the whole rotation; if another process holds that lock,
        `on_wait(message)` is called once and the wait is bounded by `lock_timeout` (KeyFileError after).

        Crash safety, step by step: (1) the new key is added to custody.key (atomic rename)
        before any record uses it; (2) one SQLite transaction re-seals every record and makes
        the new key the sealing key — a crash before COMMIT leaves every record under its old,
        still present key; (3) only after COMMIT are unused keys removed from custody.key, and
        a crash before that leaves an extra key that the next rotation removes.
        """
        with self._lock, self._guard(), keyfiles.locked(self.keys_dir, self.lock_timeout, on_wait):
            ring = keyfiles.load_custody_keys(self.keys_dir)
            new = CustodyKey(keyfiles.new_key_id(), now_stamp(), secrets.token_bytes(keyfiles.KEY_BYTES))
            keyfiles.write_custody_keys(self.keys_dir, [*ring.keys(), new], active=new.id)  # step 1
            self._ring = keyfiles.load_custody_keys(self.keys_dir)
            resealed = self._reseal_all(new)  # step 2
            with self._transaction() as db:
                in_use = {row[0] for row in db.execute("SELECT DISTINCT key_id FROM records")}
            keep = [k for k in self._ring.keys() if k.id in in_use or k.id == new.id]
            retired = tuple(k.id for k in self._ring.keys() if k not in keep)
            keyfiles.write_custody_keys(self.keys_dir, keep, active=new.id)  # step 3
            self._ring = keyfiles.load_custody_keys(self.keys_dir)
        self._checkpoint()
        return Rotation(new.id, resealed, retired)

    def _reseal_all(self, new: CustodyKey) -> int:
        count = 0
        with self._transaction() as db:
            rows = db.execute("SELECT workspace, connection, handle, version, key_id, nonce, sealed FROM records").fetchall()
            plain = open_for_rotation(self._key, self._ring.path, rows)
            for address, value in plain:
                nonce, sealed = seal(new.material, address, new.id, value)
                db.execute(
                    "UPDATE records SET version = ?, key_id = ?, nonce = ?, sealed = ?, updated = ? "
                    "WHERE workspace = ? AND connection = ? AND handle = ?",
                    (RECORD_VERSION, new.id, nonce, sealed, now_stamp(), address.workspace, address.connection, address.handle),
                )
                count += 1
            db.execute(
                "INSERT INTO meta(name, value) VALUES ('seal_key_id', ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (new.id,),
            )
        return count

    def _checkpoint(self) -> None:
        """Fold the WAL into the main file so replaced ciphertext does not linger in `-wal`."""
        try:
            with self._lock:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass  # best effort: another reader may hold the WAL; SQLite checkpoints later

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn SQLite failures into CustodyError (the type only: messages can quote SQL)."""
        try:
            yield
        except sqlite3.Error as exc:
            if _is_busy(exc):
                raise self._locked_error() from None
            raise CustodyError(f"custody store `{self.path}` failed: {exc.__class__.__name__}", io=True) from None


def _is_busy(exc: sqlite3.Error) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED (any extended form): another connection holds a lock we need."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _retry_busy(step, timeout: float):
    """Run `step`, retrying while SQLite answers BUSY (it may do so without calling the busy handler)."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            return step()
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


@contextmanager
def _file_lock(path: Path, timeout: float, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created 0600), waiting at most `timeout` seconds; CustodyError naming `what` otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise CustodyError(f"cannot open {what}: {exc.strerror or exc.__class__.__name__}", io=True) from None
    try:
        keyfiles.flock_within(fd, timeout, lambda: CustodyError(
            f"{what} is held by another process; not released within {timeout:g} s",
            help="another egresslaw process is opening the store and is stuck; find it with "
            f"`fuser {path}`, or wait longer with `--lock-timeout`",
            io=True,
        ))
        yield
    finally:
        os.close(fd)  # closing releases the lock
