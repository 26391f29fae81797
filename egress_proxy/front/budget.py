"""The exfiltration budget's enforcement (docs/budget.md), shared by both front ends: what a request costs
(`request_cost`), which subjects one admitted request is charged to (`subjects_charged`), and the ledger that keeps
the counters per aligned window (`Ledger`: a SQLite file shared by every process on a host, or a PostgreSQL table
shared by a fleet). A PostgreSQL ledger writes every admitted request (one short transaction); a SQLite one reserves:
each process takes a block of a window's requests and bytes in one transaction and spends it locally (small caps
exactly: with little left, a block is the one request that takes it), giving back what it did not spend at `close`.

A charge is all or nothing across the subjects it names: every key has room (its requests cap and its bytes cap) or
nothing is added and the answer (`Charged`) names the first cap that would be passed, its window and when it resets.
Nothing here sees a header value beyond its length, or logs one.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from compiler.artifact import Artifact, Budget
from compiler.budget import describe_window
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.errors import EgressError

log = logging.getLogger("egresslaw.budget")

TABLE: Final = "egresslaw_budget"
BUSY_TIMEOUT: Final = 2.0  # seconds a SQLite charge waits for another process's write lock before it fails closed
CONNECT_TIMEOUT: Final = 3  # seconds to open a PostgreSQL connection
RECONNECT_AFTER: Final = 2.0  # seconds a PostgreSQL ledger that failed answers budget-unavailable before it reconnects
PRUNE_EVERY: Final = 300.0  # seconds between prunes of ended windows (per process)
PRUNE_GRACE: Final = 60  # seconds a window's row outlives its end (a replica whose clock is behind still charges it)
_SCHEMA_LOCK: Final = 0x6567_6C62_7564_6774  # pg_advisory_xact_lock key ("eglbudgt"): serializes schema creation
_SUBJECT_LOCK: Final = 0x6567_6C62  # pg_advisory_xact_lock(_SUBJECT_LOCK, hashtext(subject)): one charge of a subject at a time
_DATABASE_SCHEMES: Final = ("postgresql://", "postgres://")
_URL: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # anything shaped `scheme://...`: never a file path here


class LedgerError(EgressError):
    """The budget ledger cannot be opened, read or written (never carries a request's value)."""


# ---------------------------------------------------------------------------------------------
# What a request costs
# ---------------------------------------------------------------------------------------------


def _length(text: str) -> int:
    """`text`'s length in UTF-8 (a surrogate escape counts as the byte it stands for); an ASCII string's is its len."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogateescape"))


def declared_length(headers: Sequence[tuple[str, str]], has_body: bool) -> int | None:
    """The body's declared length: its `Content-Length` (every one agreeing), 0 without a body, else None."""
    values = {v.strip() for k, v in headers if k.lower() == "content-length"}
    return _declared(values, has_body)


def _declared(values: set[str], has_body: bool) -> int | None:
    if not values:
        return None if has_body else 0
    if len(values) != 1:
        return None
    value = values.pop()
    return int(value) if value.isdigit() and value.isascii() else None


# The fixed bytes around what a request names: `CONNECT ` + ` HTTP/1.1 CRLF CRLF`; `METHOD SP target SP HTTP/1.1 CRLF`;
# `host: ` + `:` + CRLF, and the blank line that ends the head.
_CONNECT_LINE: Final = len("CONNECT  HTTP/1.1\r\n\r\n")
_REQUEST_LINE: Final = len("  HTTP/1.1\r\n")
_HOST_LINE: Final = len("host: :\r\n") + len("\r\n")


class Ask(Protocol):
    """What `request_cost` reads of an `admit.Ask` (which imports this module): a CONNECT's authority, or its request."""

    @property
    def authority(self) -> str: ...

    @property
    def request(self) -> Request | None: ...


def request_cost(ask: Ask) -> int | None:
    """The bytes one request is charged (docs/budget.md, "What a request costs"): its HTTP/1.1 serialization as the
    client sent it (request line, `host: HOST:PORT`, every other header, the blank line, the body's declared length);
    a CONNECT: `CONNECT AUTHORITY HTTP/1.1` and the blank line. None: a body of undeclared length."""
    request = ask.request
    if request is None:
        return _length(ask.authority) + _CONNECT_LINE
    # One pass over the header fields: `name: value CRLF` each (4 bytes besides the two), the Host and pseudo-headers
    # excepted; the Content-Length values kept for the body's declared length.
    head = _length(request.method) + _length(request.target) + _REQUEST_LINE + _length(request.host) + len(str(request.port)) + _HOST_LINE
    lengths: set[str] = set()
    for name, value in request.headers:
        size = len(name)
        if size == 14 and name.lower() == "content-length":
            lengths.add(value.strip())
        elif (size == 4 and name.lower() == "host") or name[:1] == ":":
            continue
        head += (size if name.isascii() else _length(name)) + (len(value) if value.isascii() else _length(value)) + 4
    body = _declared(lengths, request.has_body)
    return None if body is None else head + body


# ---------------------------------------------------------------------------------------------
# Who is charged
# ---------------------------------------------------------------------------------------------


def profile_key(name: str) -> str:
    return f"profile:{name}"


def connection_key(name: str) -> str:
    return f"connection:{name}"


@dataclass(frozen=True, slots=True)
class _Subjects:
    """One artifact's charged subjects, built once: (key, budget) per profile and per connection that declares one."""

    artifact: Artifact
    profiles: dict[str, tuple[str, Budget]]
    connections: dict[str, tuple[str, Budget]]


_subjects: _Subjects | None = None  # the last artifact's (a reload brings a new artifact object; artifacts are frozen)


def _subjects_of(artifact: Artifact) -> _Subjects:
    global _subjects
    got = _subjects
    if got is None or got.artifact is not artifact:
        profiles = {p.name: p.budget for p in artifact.sandbox_profiles}  # a name given twice: the last, as artifact.profile()
        connections = {c.name: c.budget for c in artifact.connections}
        got = _Subjects(artifact, {n: (profile_key(n), b) for n, b in profiles.items() if b is not None},
                        {n: (connection_key(n), b) for n, b in connections.items() if b is not None})
        _subjects = got
    return got


def subjects_charged(artifact: Artifact, lease: Lease, decision: Decision | None) -> list[tuple[str, Budget]]:
    """The (key, budget) pairs an admitted request of `lease` is charged to: its subject's budget, and for a brokered
    request (`decision.broker`) the carrier connection's too. Only subjects that declare a budget."""
    subjects = _subjects_of(artifact)
    own = subjects.profiles.get(lease.profile) if lease.profile is not None else subjects.connections.get(lease.connection or "")
    broker = decision.broker if decision is not None else None
    carrier = subjects.connections.get(broker) if broker is not None else None
    if carrier is None:
        return [] if own is None else [own]
    return [carrier] if own is None or own[0] == carrier[0] else [own, carrier]


def has_budget(artifact: Artifact) -> bool:
    """True when any subject of `artifact` declares a budget (then a front end needs its ledger)."""
    return any(p.budget is not None for p in artifact.sandbox_profiles) or any(c.budget is not None for c in artifact.connections)


# ---------------------------------------------------------------------------------------------
# The answer
# ---------------------------------------------------------------------------------------------


def window_start(now: float, window: int) -> int:
    """The start of the aligned window of `window` seconds that holds `now` (Unix time)."""
    t = int(now)
    return t - t % window


def subject_text(key: str) -> str:
    """`profile:builder` -> profile `builder`."""
    kind, _, name = key.partition(":")
    return f"{kind} `{name}`"


@dataclass(frozen=True, slots=True)
class Charged:
    """What a charge answered: `ok`, or the cap that has no room: the subject's key, `cap` (requests or bytes), its
    `limit`, the window (`window` seconds from `start`) and when it `resets` (epoch seconds); `used` is what the window
    had counted against that cap, `cost` what this request would have added."""

    ok: bool
    subject: str = ""
    cap: Literal["requests", "bytes", ""] = ""
    limit: int = 0
    window: int = 0
    start: int = 0
    resets: int = 0
    used: int = 0
    cost: int = 0

    def retry_after(self, now: float) -> int:
        """Whole seconds to the end of the window (at least 1)."""
        return max(1, math.ceil(self.resets - now))

    def detail(self) -> str:
        """`profile \\`builder\\`: 10,000 requests per 1h window used; resets at 2026-12-06T11:00:00Z`."""
        if self.ok:
            return ""
        resets = datetime.datetime.fromtimestamp(self.resets, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        per = f"per {describe_window(self.window)} window"
        if self.cap == "requests":
            said = f"{self.limit:,} requests {per} used"
        else:
            said = f"{self.limit:,} bytes {per}: {self.used:,} used, this request costs {self.cost:,}"
        return f"{subject_text(self.subject)}: {said}; resets at {resets}"

    def event(self) -> dict[str, object]:
        """The audit event's `budget` (never a value of the request)."""
        return {"window": self.window, "start": self.start, "resets": self.resets, "cap": self.cap, "limit": self.limit}


OK: Final = Charged(True)


def _refusal(key: str, budget: Budget, now: float, requests: int, bytes_: int, cost: int) -> Charged | None:
    """The cap `cost` more bytes and one more request would pass, given what the window counted; None if room."""
    start = window_start(now, budget.window)
    where = {"subject": key, "window": budget.window, "start": start, "resets": start + budget.window, "cost": cost}
    if budget.requests is not None and requests + 1 > budget.requests:
        return Charged(False, cap="requests", limit=budget.requests, used=requests, **where)  # type: ignore[arg-type]
    if budget.bytes is not None and bytes_ + cost > budget.bytes:
        return Charged(False, cap="bytes", limit=budget.bytes, used=bytes_, **where)  # type: ignore[arg-type]
    return None


def _distinct(charges: Sequence[tuple[str, Budget]]) -> list[tuple[str, Budget]]:
    """Each key once, in key order (every process takes the rows' locks in one order: no deadlock)."""
    return sorted(dict(charges).items())


# ---------------------------------------------------------------------------------------------
# The ledgers
# ---------------------------------------------------------------------------------------------


class Ledger(Protocol):
    """Where the counters live. `charge` is one transaction over every key in `charges`; LedgerError when it cannot
    be done (the caller refuses budget-unavailable)."""

    shown: str

    def charge(self, charges: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged: ...

    def close(self) -> None: ...


# One statement per key: insert the window's row, or add to it only while every cap keeps room. A fresh row starts at
# one request and `cost` bytes, which a cap refuses only if `cost` alone passes the bytes cap (checked before).
_UPSERT: Final = (
    f"INSERT INTO {TABLE} (subject, span, start, ends, requests, bytes) VALUES (?, ?, ?, ?, 1, ?) "
    f"ON CONFLICT (subject, span, start) DO UPDATE SET requests = {TABLE}.requests + 1, bytes = {TABLE}.bytes + excluded.bytes "
    f"WHERE (CAST(? AS BIGINT) IS NULL OR {TABLE}.requests + 1 <= CAST(? AS BIGINT)) "
    f"AND (CAST(? AS BIGINT) IS NULL OR {TABLE}.bytes + excluded.bytes <= CAST(? AS BIGINT)) "
    "RETURNING requests"
)
_READ: Final = f"SELECT requests, bytes FROM {TABLE} WHERE subject = ? AND span = ? AND start = ?"
# What the subject's rows of other window lengths counted in windows that overlap [start, ends): it counts against this
# window too (a reload that changes the window's length keeps what the old windows counted; docs/budget.md).
_OTHERS: Final = (f"SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(bytes), 0) FROM {TABLE} "
                  "WHERE subject = ? AND span <> ? AND start < ? AND ends > ?")
# A window's row that is there counts nothing more than a fresh one: it keeps the rows of other lengths it overlaps.
_MARK: Final = f"INSERT INTO {TABLE} (subject, span, start, ends, requests, bytes) VALUES (?, ?, ?, ?, 0, 0) ON CONFLICT DO NOTHING"
# Rows of windows that ended over PRUNE_GRACE ago, except one a row of another length still live (not ended PRUNE_GRACE
# ago) overlaps: a window counts what the other lengths' rows it overlaps counted, ended or not.
_PRUNE: Final = (f"DELETE FROM {TABLE} WHERE ends < ? AND NOT EXISTS (SELECT 1 FROM {TABLE} AS live "
                 f"WHERE live.subject = {TABLE}.subject AND live.span <> {TABLE}.span AND live.ends >= ? AND live.start < {TABLE}.ends)")
_CREATE: Final = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    " subject  TEXT    NOT NULL,"
    " span     INTEGER NOT NULL,"  # the window's length (seconds)
    " start    BIGINT  NOT NULL,"
    " ends     BIGINT  NOT NULL,"
    " requests BIGINT  NOT NULL,"
    " bytes    BIGINT  NOT NULL,"
    " PRIMARY KEY (subject, span, start))"
)


def _too_big(charges: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged | None:
    """The first cap no window could hold this request under, even empty (refused before any row), or None."""
    for key, budget in charges:
        if (budget.bytes is not None and cost > budget.bytes) or (budget.requests is not None and budget.requests < 1):
            return _refusal(key, budget, now, 0, 0, cost)
    return None


def _upsert(execute: Any, key: str, budget: Budget, cost: int, now: float) -> Charged | None:
    """One key's charge, inside a transaction that holds the subject's lock (no other charge of the subject reads or
    writes its rows meanwhile): None when charged, else the cap that had no room. What the subject's rows of other
    window lengths counted in windows overlapping this one is taken off its caps first. `execute(sql, params)` returns
    a cursor."""
    start = int(now) - int(now) % budget.window
    ends = start + budget.window
    others = execute(_OTHERS, (key, budget.window, ends, start)).fetchone() or (0, 0)
    other_r, other_b = int(others[0]), int(others[1])
    if other_r or other_b:
        refused = _refusal(key, budget, now, other_r, other_b, cost)
        if refused is not None:  # the others alone leave no room (this window's row may not be there yet)
            used = execute(_READ, (key, budget.window, start)).fetchone() or (0, 0)
            return _refusal(key, budget, now, other_r + int(used[0]), other_b + int(used[1]), cost) or refused
    caps = (None if budget.requests is None else budget.requests - other_r), (None if budget.bytes is None else budget.bytes - other_b)
    row = execute(_UPSERT, (key, budget.window, start, ends, cost, caps[0], caps[0], caps[1], caps[1])).fetchone()
    if row is not None:
        return None
    # the row is there and had no room: which cap (the subject's lock is held: the counts are the ones the upsert saw)
    used = execute(_READ, (key, budget.window, start)).fetchone() or (0, 0)
    return _refusal(key, budget, now, other_r + int(used[0]), other_b + int(used[1]), cost) or Charged(
        False, key, "requests", budget.requests or 0, budget.window, start, ends)


def _charge_in(execute: Any, charges: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged:
    """The body of one charge transaction over several keys (the caller begins it, commits on `ok` and rolls back
    otherwise). `execute(sql, params)` returns a cursor."""
    refused = _too_big(charges, cost, now)
    if refused is not None:
        return refused
    for key, budget in charges:
        execute(f"SELECT pg_advisory_xact_lock({_SUBJECT_LOCK}, hashtext(?))", (key,))  # keys in order: no lock cycle
        refused = _upsert(execute, key, budget, cost, now)
        if refused is not None:
            return refused
    return OK


# A SQLite ledger's reservation: a process takes a block of a window's requests and bytes in one transaction and spends
# it locally (docs/budget.md, "The ledger"). A block is at most 1/BLOCK_SHARE of what the window has left, at most
# BLOCK_REQUESTS requests (and BLOCK_REQUESTS times the cost of the request that takes it in bytes), never less than
# the request that takes it needs: with less than 2 × BLOCK_SHARE left, every block is that one request (exact).
BLOCK_REQUESTS: Final = 64
BLOCK_SHARE: Final = 8

# A reservation's row: add what a block takes (or, negative, give back what a process did not spend).
_ADD: Final = (
    f"INSERT INTO {TABLE} (subject, span, start, ends, requests, bytes) VALUES (?, ?, ?, ?, ?, ?) "
    f"ON CONFLICT (subject, span, start) DO UPDATE SET requests = {TABLE}.requests + excluded.requests, "
    f"bytes = {TABLE}.bytes + excluded.bytes"
)
_GIVE_BACK: Final = f"UPDATE {TABLE} SET requests = requests - ?, bytes = bytes - ? WHERE subject = ? AND span = ? AND start = ?"


@dataclass(slots=True)
class _Held:
    """One key's window as this process holds it: `requests` and `bytes` written to its row and not spent yet. A
    capped count never goes below 0 (the request that would need more takes a block first); an uncapped one is not
    reserved: it goes negative as requests are spent, and is written with the next block or the release."""

    budget: Budget  # the budget the block was taken under (a reload that changes it gives the block back)
    start: int
    requests: int = 0
    bytes: int = 0


class SqliteLedger:
    """The counters in a SQLite file (WAL, `synchronous=NORMAL`), shared by every process that names it. One
    connection, used under a lock (any thread). A charge spends this process's reservation of each key's window; when
    one has no room left, one `BEGIN IMMEDIATE` transaction reads the rows and takes a block for every key short of
    room (or refuses, taking nothing); `close` gives back what was not spent."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = BUSY_TIMEOUT) -> None:
        self.path = Path(path)
        self.shown = str(self.path)
        self._lock = threading.Lock()
        self._pruned = 0.0
        self._held: dict[tuple[str, int], _Held] = {}
        try:
            if not self.path.exists():
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise LedgerError(f"cannot open the budget ledger `{self.shown}`: {exc.__class__.__name__}: {exc}",
                              help="make the file (and its directory) readable and writable by the proxy, or pass another `--budget-store`") from None
        try:
            self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            if self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise sqlite3.OperationalError("the file does not take WAL mode")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.execute(_CREATE)
            self._db.execute(f"CREATE INDEX IF NOT EXISTS {TABLE}_ends ON {TABLE} (ends)")
        except sqlite3.Error as exc:
            self._db.close()
            raise LedgerError(f"the budget ledger `{self.shown}` cannot be used: {exc}",
                              help="make the file (and its directory) writable by the proxy, or pass `--budget-store` a file that is a ledger or does not exist yet") from None

    def charge(self, charges: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged:
        with self._lock:
            held = self._held
            spend = []
            for key, budget in (charges if len(charges) == 1 else _distinct(charges)):  # a key named twice: charged once
                h = held.get((key, budget.window))
                if (h is None or h.budget != budget or h.start != int(now) - int(now) % budget.window
                        or (budget.requests is not None and h.requests < 1) or (budget.bytes is not None and h.bytes < cost)):
                    break
                spend.append(h)
            else:  # every key has room in what this process holds: spent here, nothing written
                for h in spend:
                    h.requests -= 1
                    h.bytes -= cost
                return OK
            try:
                got = _too_big(charges, cost, now) or self._take(_distinct(charges), cost, now)
                if now - self._pruned > PRUNE_EVERY:
                    self._pruned = now
                    cut = int(now) - PRUNE_GRACE
                    self._db.execute(_PRUNE, (cut, cut))
            except sqlite3.Error as exc:
                raise LedgerError(f"the budget ledger `{self.shown}` failed: {exc}") from None
        return got

    def _take(self, keys: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged:
        """One transaction: for each key short of room, what its row counted (less what this process holds) and what
        the key's rows of other window lengths counted in windows overlapping this one must leave room for this
        request, then a block is added to the row; the request is spent from the blocks once committed. A refusal
        takes nothing and gives nothing back; it only leaves the refused window's row (empty if new), which keeps the
        rows it overlaps from the prune."""
        db, held = self._db, self._held
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("SAVEPOINT take")
            after: list[tuple[tuple[str, int], _Held]] = []
            dropped: list[tuple[str, int]] = []
            for key, budget in keys:
                start = int(now) - int(now) % budget.window
                ends = start + budget.window
                h = held.get((key, budget.window))
                if h is not None and (h.budget != budget or h.start != start):  # another window or budget: give it back
                    db.execute(_GIVE_BACK, (h.requests, h.bytes, key, budget.window, h.start))
                    h = None
                for (k, window), o in held.items():  # a block of another length (a reload changed it): given back
                    if k == key and window != budget.window:
                        db.execute(_GIVE_BACK, (o.requests, o.bytes, key, window, o.start))
                        dropped.append((k, window))
                h = h or _Held(budget, start)
                row = db.execute(_READ, (key, budget.window, start)).fetchone() or (0, 0)
                others = db.execute(_OTHERS, (key, budget.window, ends, start)).fetchone()
                counted_r, counted_b = int(row[0]) + int(others[0]), int(row[1]) + int(others[1])
                # what the others took (this window and the overlapping ones of other lengths), and this one spent
                refused = _refusal(key, budget, now, counted_r - h.requests, counted_b - h.bytes, cost)
                if refused is not None:
                    db.execute("ROLLBACK TO take")
                    db.execute(_MARK, (key, budget.window, start, ends))
                    db.execute("COMMIT")
                    return refused
                add_r = add_b = 0
                if budget.requests is None:
                    add_r = 1 - h.requests  # what was spent and not written yet, and this request
                elif h.requests < 1:
                    add_r = max(1, min(BLOCK_REQUESTS, (budget.requests - counted_r) // BLOCK_SHARE))
                if budget.bytes is None:
                    add_b = cost - h.bytes
                elif h.bytes < cost:
                    add_b = max(cost - h.bytes, min(BLOCK_REQUESTS * cost, (budget.bytes - counted_b) // BLOCK_SHARE))
                if add_r or add_b:
                    db.execute(_ADD, (key, budget.window, start, ends, add_r, add_b))
                after.append(((key, budget.window), _Held(budget, start, h.requests + add_r - 1, h.bytes + add_b - cost)))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        for gone in dropped:
            held.pop(gone, None)
        held.update(after)
        return OK

    def used(self, key: str, window: int, now: float) -> tuple[int, int]:
        """What the window holding `now` counted for `key` (requests, bytes): its row, less what this process holds
        and has not spent (what other processes hold is counted)."""
        start = window_start(now, window)
        with self._lock:
            row = self._db.execute(_READ, (key, window, start)).fetchone() or (0, 0)
            h = self._held.get((key, window))
            mine = (h.requests, h.bytes) if h is not None and h.start == start else (0, 0)
        return int(row[0]) - mine[0], int(row[1]) - mine[1]

    def release(self) -> None:
        """Give back what this process holds and has not spent (and write what it spent uncapped), in one transaction."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        held = [(key, h) for key, h in self._held.items() if h.requests or h.bytes]
        if held:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for (key, window), h in held:
                    self._db.execute(_GIVE_BACK, (h.requests, h.bytes, key, window, h.start))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        self._held.clear()

    def close(self) -> None:
        """Give back what is held (a failure to: logged, the block stays counted: a smaller budget), then close."""
        with self._lock:
            try:
                self._release()
            except sqlite3.Error as exc:
                log.warning("the budget ledger `%s` kept this process's unspent reservation: %s", self.shown, exc)
            finally:
                self._held.clear()
                self._db.close()


def is_database_url(address: str | os.PathLike[str]) -> bool:
    return isinstance(address, str) and address.lower().startswith(_DATABASE_SCHEMES)


def is_url(address: str | os.PathLike[str]) -> bool:
    """True for anything shaped `scheme://...`, whatever the scheme (a `--budget-store` never names such a file)."""
    return isinstance(address, str) and _URL.match(address) is not None


def shown(address: str | os.PathLike[str]) -> str:
    """`address` for a message: a URL (any scheme) without its password or query. Everything up to the last `@` is
    the user information (a password may hold `/`, `?`, `#` or `@`): of a `postgresql://` URL the user's name is
    kept when it is plain; of any other scheme none of it (a name alone may be a token)."""
    text = os.fspath(address)
    if not is_url(text):
        return text
    scheme, _, rest = text.partition("://")
    userinfo, at, rest = rest.rpartition("@")
    user = userinfo.partition(":")[0]
    where = rest.partition("?")[0].partition("#")[0]
    keep = at and user and is_database_url(text) and not any(c in user for c in "/?#[]")
    return f"{scheme}://{user}@{where}" if keep else f"{scheme}://{where}"


class PostgresLedger:
    """The counters in one table of a PostgreSQL database, shared by a fleet. One connection under a lock; each charge
    is one transaction (an upsert per key, rows locked in key order; one key: its upsert alone, in autocommit); no
    reservation (a fleet's replicas would each hold a block). A connection that fails is dropped: charges
    fail closed for `RECONNECT_AFTER` seconds, then the next one reconnects."""

    def __init__(self, url: str) -> None:
        # Imported here: psycopg costs an embedded (SQLite) front end's start-up for nothing.
        import psycopg

        self._psycopg = psycopg
        self.url = url
        self.shown = shown(url)
        self._lock = threading.Lock()
        self._conn: Any = None
        self._failed = 0.0
        self._pruned = 0.0
        try:
            conn = self._connect()
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                conn.execute(_CREATE)
                conn.execute(f"CREATE INDEX IF NOT EXISTS {TABLE}_ends ON {TABLE} (ends)")
        except psycopg.Error as exc:
            raise LedgerError(f"cannot open the budget ledger `{self.shown}`: {exc.__class__.__name__}",
                              help="check that the database is reachable and the user may create a table in it") from None

    def _connect(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = self._psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT, autocommit=True,
                                               application_name="egresslaw-budget")
        return self._conn

    def charge(self, charges: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged:
        keys = _distinct(charges)
        with self._lock:
            if self._conn is None and time.monotonic() - self._failed < RECONNECT_AFTER:
                raise LedgerError(f"the budget ledger `{self.shown}` is unreachable")
            try:
                conn = self._connect()
                execute = lambda sql, params: conn.execute(sql.replace("?", "%s"), params)  # noqa: E731
                # Always a transaction holding each subject's lock: a charge reads the rows of the subject's other
                # window lengths (a replica whose reload changed the length writes those), so two charges of one
                # subject must not interleave between that read and the upsert.
                with conn.transaction():
                    got = _charge_in(execute, keys, cost, now)
                    if not got.ok:
                        raise self._psycopg.Rollback()
                if not got.ok:  # the refused window's row kept (empty if new): the prune keeps what it overlaps
                    execute(_MARK, (got.subject, got.window, got.start, got.resets))
                if now - self._pruned > PRUNE_EVERY:
                    self._pruned = now
                    cut = int(now) - PRUNE_GRACE
                    execute(_PRUNE, (cut, cut))
            except self._psycopg.Error as exc:
                self._drop()
                raise LedgerError(f"the budget ledger `{self.shown}` failed: {exc.__class__.__name__}") from None
        return got

    def _drop(self) -> None:
        self._failed = time.monotonic()
        if self._conn is not None:
            try:
                self._conn.close()
            except self._psycopg.Error:
                pass
        self._conn = None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class LazyLedger:
    """The ledger a front end charges, opened by `open()` (at start-up, when the artifact declares a budget) or else at
    its first charge (a reload brought a budget): one object for the process's life, so a reload keeps it."""

    def __init__(self, address: str | os.PathLike[str]) -> None:
        self.address = address
        self.shown = shown(address)
        self._opened: SqliteLedger | PostgresLedger | None = None
        self._lock = threading.Lock()

    def open(self) -> SqliteLedger | PostgresLedger:
        """The ledger itself; LedgerError if it cannot be opened (tried again at the next call)."""
        with self._lock:
            if self._opened is None:
                self._opened = open_ledger(self.address)
            return self._opened

    @property
    def opened(self) -> bool:
        return self._opened is not None

    def charge(self, charges: Sequence[tuple[str, Budget]], cost: int, now: float) -> Charged:
        opened = self._opened  # once opened, no lock to take (the ledger takes its own)
        return (opened if opened is not None else self.open()).charge(charges, cost, now)

    def close(self) -> None:
        with self._lock:
            if self._opened is not None:
                self._opened.close()
                self._opened = None


def open_ledger(address: str | os.PathLike[str]) -> SqliteLedger | PostgresLedger:
    """The ledger `address` names: a `postgresql://` URL or a SQLite file path. LedgerError if it cannot be used."""
    if not os.fspath(address):
        raise LedgerError("no budget ledger given", help="pass `--budget-store budget.db` or `--budget-store postgresql://…`")
    if is_database_url(address):
        return PostgresLedger(str(address))
    if is_url(address):
        raise LedgerError(f"the budget ledger `{shown(address)}` is neither a file path nor a `postgresql://` URL",
                          help="pass `--budget-store` a SQLite file path (`budget.db`) or a `postgresql://USER@HOST/DBNAME` URL")
    return SqliteLedger(address)
