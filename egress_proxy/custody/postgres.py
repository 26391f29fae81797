"""The shared custody backend: the SQLite store's sealed records, kept in PostgreSQL so that a fleet
of proxy processes and machines reads one store (`--store postgresql://…`).

Sealing is `egress_proxy.custody.sqlite`'s, unchanged: AES-256-GCM, a fresh nonce per seal, associated
data binding the format version, the exact address and the key id. The database only ever holds
ciphertext; keys stay in the keys directory. Connections come from a psycopg_pool pool.

When the database is unreachable the store fails closed: every operation raises
`CustodyUnavailable` (the proxy denies `custody-unavailable`, forwarding nothing), `healthy()` turns
false, and a monitor thread probes the database until it answers again, then serving resumes by
itself. See docs/custody.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from egress_proxy.custody import keys as keyfiles
from egress_proxy.custody.keys import CustodyKey, Keyring
from egress_proxy.custody.records import (
    RECORD_VERSION,
    STORE_FORMAT,
    Address,
    CustodyError,
    CustodyUnavailable,
    OpenedRecords,
    Record,
    Rotation,
    check_secret,
    lock_key,
    now_stamp,
    open_for_rotation,
    seal,
    sealing_key,
    shown,
    unseal,
)
from egress_proxy.custody.secret import Secret

log = logging.getLogger("egresslaw.custody")

META: Final = "egresslaw_custody_meta"
RECORDS: Final = "egresslaw_custody_records"
CONNECT_TIMEOUT: Final = 3.0  # seconds to open one database connection
CHECKOUT_TIMEOUT: Final = 2.0  # seconds an operation waits for a pooled connection before it fails closed
PROBE_INTERVAL: Final = 2.0  # seconds between health probes (and between reconnection attempts when down)
POOL_MAX: Final = 4  # the proxy opens credentials on its one event-loop thread; the rest is CLI and probes
_SCHEMA_LOCK: Final = 0x6567_7265_7373_6C77  # pg_advisory_xact_lock key ("egresslw"): serializes schema creation

_SCHEMA: Final = (
    f"""CREATE TABLE IF NOT EXISTS {META} (
        name  TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
    f"""CREATE TABLE IF NOT EXISTS {RECORDS} (
        workspace  TEXT    NOT NULL,
        connection TEXT    NOT NULL,
        handle     TEXT    NOT NULL,
        version    INTEGER NOT NULL,
        key_id     TEXT    NOT NULL,
        nonce      BYTEA   NOT NULL,
        sealed     BYTEA   NOT NULL,  -- ciphertext || 16-byte GCM tag
        created    TEXT    NOT NULL,
        updated    TEXT    NOT NULL,
        PRIMARY KEY (workspace, connection, handle)
    )""",
)

# The libpq errors that mean "the database cannot be reached or went away", as opposed to a refused statement.
_UNREACHABLE = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)


class PostgresCustodyStore:
    """Sealed records in PostgreSQL, keys from a keys directory. Thread-safe; any number of processes.

    `create=True` creates the two tables (and the format marker) if they are missing; otherwise a
    database without them is refused. A database that cannot be reached at construction is a
    CustodyError(io=True) (the proxy exits 2); one lost later is `CustodyUnavailable` per operation.
    """

    def __init__(
        self,
        url: str,
        keys_dir: str | os.PathLike[str],
        *,
        create: bool = True,
        connect_timeout: float = CONNECT_TIMEOUT,
        checkout_timeout: float = CHECKOUT_TIMEOUT,
        probe_interval: float = PROBE_INTERVAL,
        pool_max: int = POOL_MAX,
    ) -> None:
        self.url = url
        self.shown = shown(url)
        self.keys_dir = Path(keys_dir)
        self.checkout_timeout = checkout_timeout
        self.probe_interval = probe_interval
        self._ring: Keyring = keyfiles.load_custody_keys(self.keys_dir)
        self._ring_lock = threading.Lock()
        self._opened = OpenedRecords()
        try:
            psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.Error:
            raise CustodyError(f"`{self.shown}` is not a valid PostgreSQL URL", help="use `postgresql://USER@HOST:PORT/DBNAME`", io=True) from None
        self._connect_args: dict[str, Any] = {"connect_timeout": max(2, round(connect_timeout)), "application_name": "egresslaw-custody"}
        self._prepare(create)
        self._healthy = threading.Event()
        self._healthy.set()
        self._closed = threading.Event()
        # INVARIANT: every pooled connection is checked on checkout, so a connection the server dropped
        # (restart, failover) is replaced instead of failing a request after the database is back.
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_max,
            kwargs=self._connect_args,
            timeout=checkout_timeout,
            check=ConnectionPool.check_connection,
            name="egresslaw-custody",
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
        except PoolTimeout:
            self._pool.close()
            raise CustodyError(f"cannot reach custody database `{self.shown}`: no pooled connection within {connect_timeout:g} s", io=True) from None
        self._monitor = threading.Thread(target=self._watch, name="egresslaw-custody-probe", daemon=True)
        self._monitor.start()

    # -- lifecycle ---------------------------------------------------------------------------

    def _prepare(self, create: bool) -> None:
        """One direct connection at start-up: reachable, tables present (or created), format ours."""
        try:
            with psycopg.connect(self.url, **self._connect_args) as conn:
                with conn.transaction():
                    if create:
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                        for statement in _SCHEMA:
                            conn.execute(statement)
                    elif conn.execute("SELECT to_regclass(%s), to_regclass(%s)", (META, RECORDS)).fetchone() != (META, RECORDS):
                        raise CustodyError(
                            f"custody database `{self.shown}` holds no custody store (no `{RECORDS}` table)",
                            help=f"create it with `egresslaw custody put --store {self.shown} …`",
                            io=True,
                        )
                    row = conn.execute(f"SELECT value FROM {META} WHERE name = 'format'").fetchone()
                    if row is None:
                        if conn.execute(f"SELECT count(*) FROM {RECORDS}").fetchone()[0]:
                            raise CustodyError(f"custody database `{self.shown}` has records but no format marker", io=True)
                        conn.execute(f"INSERT INTO {META} (name, value) VALUES ('format', %s)", (STORE_FORMAT,))
                    elif row[0] != STORE_FORMAT:
                        raise CustodyError(f"custody database `{self.shown}` has unsupported format `{row[0]}`", io=True)
                    # The sealing key id lives in the store from the start, so `put` can lock it (see rotate).
                    conn.execute(
                        f"INSERT INTO {META} (name, value) VALUES ('seal_key_id', %s) ON CONFLICT (name) DO NOTHING", (self._ring.active,)
                    )
        except CustodyError:
            raise
        except _UNREACHABLE as exc:
            raise CustodyError(
                f"cannot reach custody database `{self.shown}`: {self._why(exc)}",
                help="check that PostgreSQL is running and that the URL's host, port, user and database are right",
                io=True,
            ) from None
        except psycopg.Error as exc:
            raise CustodyError(f"custody database `{self.shown}` refused the store set-up: {self._why(exc)}", io=True) from None

    def _why(self, exc: BaseException) -> str:
        """A libpq error's first line, with the URL's password (if any) masked; never SQL parameters."""
        text = (str(exc).strip().splitlines() or [exc.__class__.__name__])[0][:300]
        password = psycopg.conninfo.conninfo_to_dict(self.url).get("password")
        return text.replace(str(password), "***") if password else text

    def close(self) -> None:
        """Stop the health probe and close every pooled connection."""
        self._closed.set()
        self._pool.close()
        if self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)

    def __enter__(self) -> PostgresCustodyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresCustodyStore(url={self.shown!r}, keys_dir={str(self.keys_dir)!r})"

    # -- health --------------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Whether the database answered the last probe or operation; no I/O (for a readiness check)."""
        return self._healthy.is_set()

    def _watch(self) -> None:
        while not self._closed.wait(self.probe_interval):
            self.probe()

    def probe(self) -> bool:
        """Ask the database `SELECT 1` now; update and return the health flag."""
        try:
            with self._pool.connection(timeout=max(self.checkout_timeout, CONNECT_TIMEOUT)) as conn:
                conn.execute("SELECT 1")
        except Exception as exc:  # any failure of the probe means not ready
            self._down(exc)
            return False
        if not self._healthy.is_set():
            log.warning("custody database `%s` is reachable again; credentials are served", self.shown)
            self._healthy.set()
        return True

    def _down(self, exc: BaseException) -> None:
        if self._healthy.is_set() and not self._closed.is_set():
            log.error("custody database `%s` is unreachable (%s); requests needing a credential are denied `custody-unavailable`",
                      self.shown, exc.__class__.__name__)
        self._healthy.clear()

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        """A pooled connection, or CustodyUnavailable at once while the database is known to be down."""
        # Fail fast while down: the proxy calls open() on its event loop, which must not wait on a dead server.
        if not self._healthy.is_set():
            raise CustodyUnavailable(f"custody database `{self.shown}` is unreachable", help="it is retried every few seconds")
        try:
            with self._pool.connection() as conn:
                yield conn
        except CustodyError:
            raise
        except _UNREACHABLE as exc:
            self._down(exc)
            raise CustodyUnavailable(f"custody database `{self.shown}` is unreachable", help="it is retried every few seconds") from None
        except psycopg.Error as exc:  # the type only: a message can quote SQL
            raise CustodyError(f"custody database `{self.shown}` failed: {exc.__class__.__name__}", io=True) from None

    # -- keys ----------------------------------------------------------------------------------

    def _key(self, key_id: str) -> bytes | None:
        """Key bytes for `key_id`, re-reading custody.key once if it is unknown (another process rotated)."""
        with self._ring_lock:
            if key_id not in self._ring:
                self._ring = keyfiles.load_custody_keys(self.keys_dir)
            return self._ring.material(key_id) if key_id in self._ring else None

    # -- operations ------------------------------------------------------------------------------

    def put(self, address: Address, secret: bytes | Secret) -> Record:
        """Seal `secret` at `address`, replacing any record there."""
        value = check_secret(secret.reveal() if isinstance(secret, Secret) else secret)
        with self._connection() as conn, conn.transaction():
            # FOR SHARE: waits for a rotation in flight (which holds this row FOR UPDATE), then seals under its new key.
            row = conn.execute(f"SELECT value FROM {META} WHERE name = 'seal_key_id' FOR SHARE").fetchone()
            if row is None:
                raise CustodyError(f"custody database `{self.shown}` has no sealing key id", io=True)
            key_id = row[0]
            nonce, sealed = seal(sealing_key(self._key, self._ring.path, key_id), address, key_id, value)
            now = now_stamp()
            created = conn.execute(
                f"""INSERT INTO {RECORDS} (workspace, connection, handle, version, key_id, nonce, sealed, created, updated)
                    VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)
                    ON CONFLICT (workspace, connection, handle) DO UPDATE SET
                      version = excluded.version, key_id = excluded.key_id, nonce = excluded.nonce,
                      sealed = excluded.sealed, updated = excluded.updated
                    RETURNING created""",
                (address.workspace, address.connection, address.handle, RECORD_VERSION, key_id, nonce, sealed, now, now),
            ).fetchone()[0]
        return Record(address, key_id, RECORD_VERSION, created, now)

    def try_mint_lock(self, address: Address) -> Callable[[], None] | None:
        """The fleet's lock on minting `address`'s credential (a session advisory lock on a connection held until the
        release): its release, or None when another process holds it. See `CustodyStore.try_mint_lock`."""
        if not self._healthy.is_set():
            raise CustodyUnavailable(f"custody database `{self.shown}` is unreachable", help="it is retried every few seconds")
        try:
            conn = self._pool.getconn(timeout=2.0)
        except Exception:
            raise CustodyUnavailable(f"custody database `{self.shown}` is unreachable", help="it is retried every few seconds") from None
        key = (0x65676C << 32) | lock_key(address)  # "egl" in the high bits: apart from anyone else's advisory locks
        try:
            got = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.commit()
        except psycopg.Error:
            self._pool.putconn(conn)
            raise CustodyUnavailable(f"custody database `{self.shown}` could not take a lock") from None
        if not got:
            self._pool.putconn(conn)
            return None

        def release() -> None:
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    conn.commit()
            except psycopg.Error:
                pass  # a connection that lost its session lost the lock with it
            finally:
                self._pool.putconn(conn)

        return release

    def open(self, address: Address) -> Secret:
        """The credential at `address`; CustodyError naming the address (never the value) if absent or not opening,
        CustodyUnavailable if the database cannot be reached."""
        with self._connection() as conn:
            row = conn.execute(
                f"SELECT version, key_id, nonce, sealed FROM {RECORDS} WHERE workspace = %s AND connection = %s AND handle = %s",
                (address.workspace, address.connection, address.handle),
            ).fetchone()
        if row is None:
            self._opened.forget(address)
            raise CustodyError(f"no credential at `{address}`", help="seal one with `egresslaw custody put`")
        return self._opened.open(address, tuple(row), lambda: self._ring, lambda: unseal(self._key, self._ring.path, address, *row))

    def list(self) -> tuple[Record, ...]:
        """Every record's address, key id and timestamps, sorted by address; never a value."""
        with self._connection() as conn:
            rows = conn.execute(
                f"SELECT workspace, connection, handle, key_id, version, created, updated FROM {RECORDS} "
                "ORDER BY workspace, connection, handle"
            ).fetchall()
        return tuple(Record(Address(w, c, h), k, v, cr, up) for w, c, h, k, v, cr, up in rows)

    def delete(self, address: Address) -> None:
        """Remove the record at `address` (CustodyError if there is none)."""
        with self._connection() as conn, conn.transaction():
            cur = conn.execute(
                f"DELETE FROM {RECORDS} WHERE workspace = %s AND connection = %s AND handle = %s",
                (address.workspace, address.connection, address.handle),
            )
            if cur.rowcount == 0:
                raise CustodyError(f"no credential at `{address}`")

    def rotate(self, on_wait: Callable[[str], None] | None = None) -> Rotation:
        """Re-seal every record under a new key id in ONE database transaction, then retire unused key ids.

        The same three crash-safe steps as the SQLite store: (1) the new key is added to custody.key
        before any record uses it; (2) one transaction locks the sealing key id (puts wait), re-seals
        every record and makes the new key the sealing key, so readers see all old or all new; (3) only
        after COMMIT are unused key ids removed from custody.key.
        """
        with keyfiles.locked(self.keys_dir, on_wait=on_wait):
            ring = keyfiles.load_custody_keys(self.keys_dir)
            new = CustodyKey(keyfiles.new_key_id(), now_stamp(), secrets.token_bytes(keyfiles.KEY_BYTES))
            keyfiles.write_custody_keys(self.keys_dir, [*ring.keys(), new], active=new.id)  # step 1
            with self._ring_lock:
                self._ring = keyfiles.load_custody_keys(self.keys_dir)
            with self._connection() as conn, conn.transaction():  # step 2
                conn.execute(f"SELECT value FROM {META} WHERE name = 'seal_key_id' FOR UPDATE")
                rows = conn.execute(
                    f"SELECT workspace, connection, handle, version, key_id, nonce, sealed FROM {RECORDS} "
                    "ORDER BY workspace, connection, handle FOR UPDATE"
                ).fetchall()
                plain = open_for_rotation(self._key, self._ring.path, rows)
                now = now_stamp()
                with conn.cursor() as cur:
                    cur.executemany(
                        f"UPDATE {RECORDS} SET version = %s, key_id = %s, nonce = %s, sealed = %s, updated = %s "
                        "WHERE workspace = %s AND connection = %s AND handle = %s",
                        [
                            (RECORD_VERSION, new.id, *seal(new.material, address, new.id, value), now, *_where(address))
                            for address, value in plain
                        ],
                    )
                conn.execute(f"UPDATE {META} SET value = %s WHERE name = 'seal_key_id'", (new.id,))
                in_use = {row[0] for row in conn.execute(f"SELECT DISTINCT key_id FROM {RECORDS}")}
            with self._ring_lock:
                keep = [k for k in self._ring.keys() if k.id in in_use or k.id == new.id]
                retired = tuple(k.id for k in self._ring.keys() if k not in keep)
                keyfiles.write_custody_keys(self.keys_dir, keep, active=new.id)  # step 3
                self._ring = keyfiles.load_custody_keys(self.keys_dir)
        return Rotation(new.id, len(plain), retired)


def _where(address: Address) -> tuple[str, str, str]:
    return (address.workspace, address.connection, address.handle)
