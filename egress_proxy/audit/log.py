"""The audit event log: append-only JSONL, chained under a key, checkpointed, rotated, written ahead.

Format (`egresslaw.audit/2`): one canonical JSON object per line (sorted keys, ASCII, no spaces).
Every line carries `seq` (1, 2, … across segments), `prev` (the previous line's `mac`; 64 zeros
before the very first line) and `mac` = HMAC-SHA256 under the audit key of the line without its
`mac`. So an edited, inserted, deleted or reordered line is found at its own line by anyone holding
`KEYS/audit.key`, and no one without it can write a line that verifies.

Two kinds of records are also signed (Ed25519, `sig`, so an auditor holding only `audit.pub` can
check them): `audit-open`, the first line of every segment and of every run, and `checkpoint`,
written every few seconds (or events), at rotation (`end: "rotated"`) and at shutdown
(`end: "shutdown"`). A checkpoint records how many lines precede it in its segment (`count`) and
the sha256 (`digest`) of the lines since the previous signed record, and its `prev` is the head it
vouches for. A log that does not end with a closing checkpoint was truncated, is still being
written, or its writer was killed; `verify` says which lines no signature covers.

Rotation: when the active file reaches a size or an age, a `rotated` checkpoint closes it, it is
renamed `<name>.<segment:06d>`, and a new file at the same path starts with an `audit-open` whose
`prev` is the previous segment's head.

Durability (write-ahead): `emit()` seals an event onto the chain and appends it with one `write()` in the
caller's thread, under the log's lock, before it returns its ticket: from then on the line is in the file,
and a killed or crashed proxy keeps it. Only when that cannot be done at once (the log is failing, a segment
is being rotated, or events are already queued) is the event queued for the writer thread, and a request
waiting for it (`written(ticket)`, bounded) waits for that append. The writer thread owns everything slow:
`fdatasync`, retries, checkpoints, rotation. (Why the append is not handed to the thread as well: the hand-off,
a wake-up and GIL switches per batch, cost several times the append itself, ≈ 40-80 µs; the price is that a
`write()` that blocks, on a hung disk, blocks the caller, i.e. the proxy's event loop, and nothing is forwarded
or answered meanwhile.) Two sync modes (`sync_requests`):
- interval (the default): every line is fdatasync'd at most `sync_seconds` after it was appended, so a
  power loss or a kernel crash (not a killed proxy) may lose the lines of the last `sync_seconds` plus one
  fsync; `written(ticket)` returns once the line is appended. An fsync stuck longer than `WAIT_SECONDS`
  makes the log unwritable, so that window stays bounded.
- per request: `written(ticket)` returns only after an fsync covering the line (group commit: one fsync
  covers every line before it, so concurrent requests share it); lines nobody waits for are still synced
  within `SYNC_SECONDS`.
`flush()`, checkpoints and `close()` always sync. When a write fails (ENOSPC, EIO, EFBIG, a short write, a
failed fsync) the file is cut back to its last durable size (never a torn line left to append to), the
events not known durable are held in memory (bounded: beyond `max_held` they are counted as dropped),
`writable` turns false, one ERROR line is logged, and the writer retries every `retry_seconds`; the first
successful write records an `audit-resumed` line (when, why, how many held and dropped) and logs once more.
Events never carry a header value or a credential, and paths never carry their query.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from egress_proxy.audit.event import Event, EventError
from egress_proxy.custody.keys import AuditKey, audit_key_id, fsync_dir
from egress_proxy.errors import EgressError

log = logging.getLogger("egresslaw.audit")

FORMAT = "egresslaw.audit/2"
GENESIS = "0" * 64
MAX_PATH = 2048
SIGNED = ("audit-open", "checkpoint")
OWN_KINDS = frozenset({"audit-open", "checkpoint", "audit-resumed"})  # records the log writes about itself
CHECKPOINT_SECONDS = 10.0
CHECKPOINT_EVENTS = 10_000
ROTATE_BYTES = 64 << 20
ROTATE_SECONDS = 24 * 3600
RETRY_SECONDS = 1.0
SYNC_SECONDS = 1.0  # the longest an appended line waits for an fsync (interval mode: the default interval)
MAX_SYNC_SECONDS = 60.0
MAX_HELD = 100_000  # events held in memory while the log cannot be written
WAIT_SECONDS = 5.0  # the longest a request waits for its decision event, and an fsync may take before the log refuses
SEGMENT_NAME = re.compile(r"(.+)\.(\d{6,})")


class AuditError(EgressError):
    """The audit log cannot be opened or written."""


class AuditUnavailable(AuditError):
    """The audit log cannot take or make durable an event right now (write failing, too slow, closed)."""


def parse_sync(value: str | float) -> tuple[bool, float]:
    """`--audit-sync`: `request` (fsync before each request is forwarded) or SECONDS (fsync every line within that
    interval; the request waits only for its line to be written). Returns (sync_requests, sync_seconds)."""
    text = str(value).strip().lower()
    if text == "request":
        return True, SYNC_SECONDS
    try:
        seconds = float(text.removesuffix("s"))
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= MAX_SYNC_SECONDS:  # (also refuses nan)
        raise ValueError(f"audit sync `{value}` is neither `request` nor a number of seconds in (0, {MAX_SYNC_SECONDS:g}]; "
                         "help: `request` fsyncs before each request is forwarded, `1` fsyncs every line within a second")
    return False, seconds


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)  # built once: emit() is hot
_PLACEHOLDER = secrets.token_hex(32)  # `seal`: stands in for a MAC (64 hex digits, like one) while a record is encoded
_PLACEHOLDER_FIELD = b'"mac":"%s"' % _PLACEHOLDER.encode("ascii")


def canonical(record: dict) -> bytes:
    """The one byte form of a record: sorted keys, no spaces, ASCII."""
    return _CANONICAL.encode(record).encode("ascii")


def strip_query(path: str | None) -> str | None:
    """The path part of a request target, bounded in length: queries never reach the log."""
    if path is None:
        return None
    path = path.split("?", 1)[0].split("#", 1)[0]
    return path if len(path) <= MAX_PATH else path[: MAX_PATH - 3] + "..."


def segment_path(active: Path, segment: int) -> Path:
    """Where segment `segment` of the log whose active file is `active` goes when it is rotated."""
    return active.with_name(f"{active.name}.{segment:06d}")


class _Keys:
    """MAC, sign and check with one audit key (the MAC and signing halves may be absent: verify only)."""

    def __init__(self, key: AuditKey) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import (
            Ed25519PrivateKey,
            Ed25519PublicKey,
        )

        self.id = key.id
        self.public = key.public
        self._mac = key.mac_key
        self._signer = Ed25519PrivateKey.from_private_bytes(key.signing) if key.signing else None
        self._verifier = Ed25519PublicKey.from_public_bytes(key.public)

    @property
    def has_mac(self) -> bool:
        return self._mac is not None

    def mac(self, body: bytes) -> str:
        assert self._mac is not None
        return hmac.digest(self._mac, body, "sha256").hex()

    def seal(self, record: dict) -> tuple[str, bytes]:
        """The MAC of `record` and its line (`canonical` of it with its `mac`, and a newline), from one encoding: the
        record is encoded once with a placeholder `mac` (a per-process random value, so no input can spell that field:
        strings are escaped and nested objects are ours), the MAC is taken over that encoding without the field (what
        `canonical` gives for the record without `mac`), and the placeholder is replaced by the MAC (same length)."""
        marked = canonical({**record, "mac": _PLACEHOLDER})
        at = marked.find(_PLACEHOLDER_FIELD)
        if at > 0 and marked.count(_PLACEHOLDER_FIELD) == 1:
            end = at + len(_PLACEHOLDER_FIELD)
            if marked[end : end + 1] == b",":
                body = marked[:at] + marked[end + 1 :]
            elif marked[at - 1 : at] == b",":
                body = marked[: at - 1] + marked[end:]
            else:
                body = marked[:at] + marked[end:]
            mac = self.mac(body)
            return mac, b"%s\"mac\":\"%s\"%s\n" % (marked[:at], mac.encode("ascii"), marked[end:])
        return self._seal_halves(record)  # never expected: the placeholder cannot come from outside

    def _seal_halves(self, record: dict) -> tuple[str, bytes]:
        """`seal` from two encodings: every other key sorts before `mac` or after it, so the canonical form is two
        halves joined there."""
        low = canonical({k: v for k, v in record.items() if k < "mac"})
        high = canonical({k: v for k, v in record.items() if k > "mac"})
        mac = self.mac(_joined(low, high))
        return mac, _joined(_joined(low, b'{"mac":"%s"}' % mac.encode("ascii")), high) + b"\n"

    def sign(self, body: bytes) -> str:
        assert self._signer is not None
        return base64.b64encode(self._signer.sign(body)).decode("ascii")

    def signature_ok(self, body: bytes, sig: object) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._verifier.verify(base64.b64decode(str(sig), validate=True), body)
        except (InvalidSignature, ValueError):
            return False
        return True


@dataclass(slots=True)
class _Head:
    """Where the active segment stands after its last durable write (writer thread only)."""

    prev: str
    size: int = 0
    lines: int = 0
    events: int = 0  # emitted events in this segment (an idle segment is not rotated by age)
    digest: Any = field(default_factory=hashlib.sha256)  # of the lines since the last signed record
    unsigned: int = 0
    signed_at: float = field(default_factory=time.monotonic)


class AuditLog:
    """An open audit log: appends in the caller's thread, a writer thread for fsync (group commit), retries,
    checkpoints and rotation; write-ahead tickets; fail-closed state."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        key: AuditKey,
        *,
        fsync: bool = True,
        sync_requests: bool = False,
        sync_seconds: float = SYNC_SECONDS,
        rotate_bytes: int = ROTATE_BYTES,
        rotate_seconds: float = ROTATE_SECONDS,
        checkpoint_seconds: float = CHECKPOINT_SECONDS,
        checkpoint_events: int = CHECKPOINT_EVENTS,
        retry_seconds: float = RETRY_SECONDS,
        max_held: int = MAX_HELD,
    ) -> None:
        if key.mac_key is None or key.signing is None:
            raise AuditError("writing an audit log needs the secret audit key (`audit.key`), not `audit.pub`")
        self.path = Path(path)
        self._keys = _Keys(key)
        self._fsync = fsync
        self.sync_requests = sync_requests  # a request waits for the fsync of its line, not only for its write
        self.sync_seconds = sync_seconds
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds
        self.checkpoint_seconds = checkpoint_seconds
        self.checkpoint_events = checkpoint_events
        self.retry_seconds = retry_seconds
        self.max_held = max_held
        # Injection points for fault tests (a failing disk without a full disk).
        self._os_write = os.write
        self._os_fsync = os.fdatasync  # the lines and the file size (what a reader needs), not the mtime
        # INVARIANT: every field below, the head and the file's end change only under this (re-entrant) lock; the
        # writer thread releases it for fsync and for a segment switch (emit queues while a switch is due).
        self._cond = threading.Condition()
        self._pending: list[dict] = []  # emitted, not yet appended, in emit order (appended before any newer event)
        self._emitted = 0  # tickets handed out
        self._appended = 0  # tickets appended to the file (a killed process keeps them)
        self._written = 0  # tickets durable (fsync'd)
        self._urgent = 0  # the highest ticket someone will wait for
        self._sync_wanted = False  # flush() asks for an fsync
        self._unsynced: list[bytes] = []  # the lines of emitted events appended since the last fsync (bytes: no GC work)
        self._dirty_since: float | None = None
        self._failures = 0  # write failures so far: a recovery clears only the failure it retried
        self._waiters: list[tuple[int, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._error: str | None = None
        self._failed_at = 0.0
        self._retry_at = 0.0
        self._dropped = 0
        self._writing_since: float | None = None
        self._closing = False
        self._closed = False
        self.close_ok: bool | None = None
        self.seq = 0  # the last seq written
        self._torn = False
        self._need_open: str | None = "started"
        self._open_info: dict[str, Any] = {}
        self._rotate_due = False
        self._switch_due = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = self._claim()
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot open audit log `{self.path}`: {exc.strerror or exc.__class__.__name__}") from None
        try:
            self._head = self._recover()
            self._synced = (self._head, self.seq, self._need_open, dict(self._open_info))
            self._append(self._compose([], None))  # the `audit-open` line is durable before anything is served
            if self._fsync:
                self._os_fsync(self._fd)
            self._synced, self._dirty_since = (self._head, self.seq, None, {}), None
        except OSError as exc:
            os.close(self._fd)
            os.close(self._writer)
            raise AuditError(f"cannot write audit log `{self.path}`: {_why(exc)}") from None
        except AuditError:
            os.close(self._fd)
            os.close(self._writer)
            raise
        self._thread = threading.Thread(target=self._run, name="egresslaw-audit", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------

    def emit(self, event: Event, *, durable: bool = False) -> int:
        """Append one event (an `Event`: nothing else is accepted, so no event is spelled outside its type) to the file now (one `write()`, no fsync) or, when the log cannot take it at once, queue it
        for the writer thread; its ticket for `written()`. `durable`: a request will wait for it (per-request sync:
        its fsync starts at once). Raises AuditUnavailable when the log is closed, or failing with `max_held` events
        already held (the event is counted as dropped)."""
        if not isinstance(event, Event):
            raise EventError(f"the audit log takes an egress_proxy.audit.event.Event, not a {type(event).__name__}")
        fields = event.record()
        with self._cond:
            if self._closing:
                raise AuditUnavailable("the audit log is closed")
            if self._error is not None and len(self._pending) >= self.max_held:
                if not self._dropped:
                    log.error("audit log `%s`: %d events held in memory; dropping further ones until it can be written", self.path, self.max_held)
                self._dropped += 1
                raise AuditUnavailable(self._error)
            record = {"v": FORMAT, "ts": _now(), **fields}
            self._emitted += 1
            wake = durable and self.sync_requests
            if wake:
                self._urgent = self._emitted
            if self._error is None and not self._pending and self._need_open is None and not (self._switch_due or self._rotate_due or self._torn):
                clean = self._dirty_since is None
                try:
                    lines = self._append([record])
                except OSError as exc:
                    self._failed(exc, False)  # cut back, logged once; held below, retried by the writer
                else:
                    self._appended += 1
                    self._unsynced += lines
                    head = self._head
                    if head.size >= self.rotate_bytes:
                        self._rotate_due = True
                    if wake or clean or self._rotate_due or head.unsigned == self.checkpoint_events:
                        self._cond.notify_all()  # an fsync, a first sync timer, a rotation or a checkpoint is due
                    return self._emitted
            self._pending.append(record)
            self._cond.notify_all()
            return self._emitted

    async def written(self, ticket: int, timeout: float = WAIT_SECONDS) -> None:
        """Return once the event of `ticket` is as safe as the sync mode promises before a request is forwarded
        (appended; per-request sync: fsync'd); AuditUnavailable if the log fails first or `timeout` passes."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if (self._written if self.sync_requests else self._appended) >= ticket:
                return
            if self._error is not None:
                raise AuditUnavailable(self._error)
            future = loop.create_future()
            self._waiters.append((ticket, future, loop))
            if self.sync_requests and ticket > self._urgent:
                self._urgent = ticket
                self._cond.notify_all()
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise AuditUnavailable(f"the audit log did not write an event within {timeout:g} s") from None

    @property
    def writable(self) -> bool:
        """False while writes fail, while one write or fsync of the writer thread has been stuck longer than a request
        may wait, and once closing."""
        with self._cond:
            stuck = self._writing_since is not None and time.monotonic() - self._writing_since > WAIT_SECONDS
            return self._error is None and not self._closing and not stuck

    @property
    def error(self) -> str | None:
        """Why the log cannot be written right now (None when it can)."""
        return self._error

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event emitted so far is durable (through failed writes and retries); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._emitted
            self._sync_wanted = True
            self._cond.notify_all()
            while self._written < target and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._written >= target

    def close(self, timeout: float = 10.0) -> bool:
        """Write every queued event and a closing checkpoint, fsync, stop the writer; False if that failed."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._retry_at = 0.0  # one last attempt now, even while failing
                self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            if self.close_ok is None:
                self.close_ok = False
                log.error("audit log `%s`: %d event(s) could not be written before shutdown", self.path, len(self._pending))
            if not self._thread.is_alive() and self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
                os.close(self._writer)  # the chain is free for the next writer
                self._writer = -1
        return bool(self.close_ok)

    def _claim(self) -> int:
        """One writer per chain: an exclusive lock on `.<name>.writer` beside the log, held while it is open (released by
        the kernel however the process ends; a process that already holds it may open the chain again, as a restart
        in-process does). A second writer (the proxy and the lane given one `--audit-log`, say)
        would interleave two chains in one file: it is refused at start-up instead."""
        fd = os.open(self.path.parent / f".{self.path.name}.writer", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a POSIX lock: per process (a process may reopen its own chain)
        except OSError:
            os.close(fd)
            raise AuditError(f"audit log `{self.path}` is open for writing by another process: one writer per chain",
                             "give each proxy and lane its own --audit-log (EGRESSLAW_AUDIT_LOG is read by both)") from None
        return fd

    # -- start-up recovery ------------------------------------------------------------------------

    def _recover(self) -> _Head:
        """Find where the active segment stands; cut a torn last line; finish a rotation a crash interrupted."""
        size = os.fstat(self._fd).st_size
        first, last, end, lines = _scan(self._fd) if size else (None, None, 0, 0)
        if end < size:
            os.ftruncate(self._fd, end)
            if self._fsync:
                os.fsync(self._fd)
            self._open_info["cut"] = size - end
            log.warning("audit log `%s`: cut %d byte(s) of an incomplete last line", self.path, size - end)
        if last is None:
            return self._start_segment(*self._previous_segment())
        head_rec, tail_rec = self._parse_own(first, "first"), self._parse_own(last, "last")
        if head_rec.get("kind") != "audit-open":
            raise AuditError(f"audit log `{self.path}` does not start with an `audit-open` record; move it aside and start again")
        if not hmac.compare_digest(self._keys.mac(canonical({k: v for k, v in tail_rec.items() if k != "mac"})), str(tail_rec.get("mac"))):
            raise AuditError(
                f"the last line of audit log `{self.path}` does not verify under the audit key (edited, or written under another key); "
                f"check it with `egresslaw audit verify`, then move it aside"
            )
        self._segment = int(head_rec.get("segment", 1))
        self._log_id = str(head_rec.get("log", ""))
        self._opened_at = _parse_ts(head_rec.get("ts"))
        self.seq = int(tail_rec.get("seq", 0))
        head = _Head(prev=str(tail_rec["mac"]), size=end, lines=lines)
        end_kind = tail_rec.get("end") if tail_rec.get("kind") == "checkpoint" else None
        if end_kind == "rotated":  # a crash between the rotation checkpoint and the rename
            self._head = head
            self._switch()
            self._need_open = "started"
            return self._head
        self._open_info["previous"] = "closed" if end_kind == "shutdown" else "not-closed"
        if end_kind != "shutdown":
            log.warning("audit log `%s`: the previous run did not close it (killed or crashed); continuing the chain", self.path)
        return head

    def _parse_own(self, line: bytes, which: str) -> dict:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get("v") != FORMAT or "mac" not in record:
            raise AuditError(f"the {which} line of audit log `{self.path}` is not an `{FORMAT}` record; move the file aside and start again")
        return record

    def _previous_segment(self) -> tuple[int, str, str, int, str]:
        """(segment, log id, head, seq, previous) for a new active file: continues the newest rotated segment, if any."""
        numbered = [(int(m.group(2)), p) for p in self.path.parent.glob(self.path.name + ".*")
                    if (m := SEGMENT_NAME.fullmatch(p.name)) and m.group(1) == self.path.name]
        if not numbered:
            return 1, secrets.token_hex(8), GENESIS, 0, "none"
        number, newest = max(numbered)
        fd = os.open(newest, os.O_RDONLY | os.O_CLOEXEC)
        try:
            first, last, _, _ = _scan(fd)
        finally:
            os.close(fd)
        if first is None or last is None:
            raise AuditError(f"rotated audit segment `{newest}` is empty or torn; check it with `egresslaw audit verify`")
        head_rec, tail_rec = self._parse_own(first, "first"), self._parse_own(last, "last")
        ended = tail_rec.get("kind") == "checkpoint" and tail_rec.get("end") == "rotated"
        return number + 1, str(head_rec.get("log", "")), str(tail_rec["mac"]), int(tail_rec.get("seq", 0)), "rotated" if ended else "not-closed"

    def _start_segment(self, segment: int, log_id: str, prev: str, seq: int, previous: str) -> _Head:
        self._segment, self._log_id, self.seq = segment, log_id, seq
        self._opened_at = time.time()
        self._open_info["previous"] = previous
        return _Head(prev=prev)

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                go = self._next(time.monotonic())
                while go is False:
                    self._cond.wait(self._sleep(time.monotonic()))
                    go = self._next(time.monotonic())
                if go is None:
                    return
                self._writing_since = time.monotonic()
                closing_attempt = self._closing
                switch = self._switch_due
            if switch:  # outside the lock: emit() queues meanwhile, never writes past the rotation checkpoint
                try:
                    self._switch()
                except OSError as exc:
                    self._failed(exc, closing_attempt)
                    continue
            with self._cond:
                failing, failures = self._error is not None, self._failures
                try:
                    if self._torn:
                        self._cut_back(raise_on_failure=True)
                    batch = list(self._pending)
                    records = self._compose(batch, self._resumed_record() if failing else None)
                    if records:
                        lines = self._append(records)
                        del self._pending[: len(batch)]
                        self._appended += len(batch)
                        self._unsynced += [line for r, line in zip(records, lines) if r["kind"] not in OWN_KINDS]
                except OSError as exc:
                    self._failed(exc, closing_attempt)
                    continue
                sync = failing or self._sync_due(time.monotonic(), 0) or any(r["kind"] in OWN_KINDS for r in records)
                mark = None
                if sync and self._dirty_since is not None:
                    # What this fsync will cover: everything appended so far (emit() may append more meanwhile).
                    mark = (self._head, self.seq, self._need_open, dict(self._open_info), len(self._unsynced), self._appended, time.monotonic())
                    self._sync_wanted = False
            if mark is not None:
                try:
                    if self._fsync:
                        self._os_fsync(self._fd)
                except OSError as exc:
                    with self._cond:  # one step: no emit() appends between the cut and the failing state
                        self._lost_sync()
                        self._failed(exc, closing_attempt)
                    continue
            self._succeeded(records, mark, recovered=failures if failing and sync else None)

    def _next(self, now: float) -> bool | None:
        """True: write (or sync) now; False: sleep; None: the writer is done."""
        if self._closed:
            return None
        if self._error is not None:
            return now >= self._retry_at
        if self._pending or self._closing or self._rotate_due or self._switch_due or self._need_open is not None:
            return True
        if self._dirty_since is not None and self._sync_due(now, 0):
            return True
        return self._checkpoint_due(now) or self._age_due()

    def _sync_due(self, now: float, taking: int) -> bool:
        """An fsync is owed: (per-request sync) someone waits for a ticket in the file or in this batch, or lines
        waited long enough."""
        wanted = self.sync_requests and self._urgent > self._written and self._urgent <= self._appended + taking
        late = self._dirty_since is not None and now - self._dirty_since >= self.sync_seconds
        return wanted or self._sync_wanted or self._closing or late

    def _sleep(self, now: float) -> float | None:
        if self._error is not None:
            return max(0.0, self._retry_at - now)
        waits = [self.rotate_seconds - (time.time() - self._opened_at)] if self._head.events else []
        if self._head.unsigned:
            waits.append(self.checkpoint_seconds - (now - self._head.signed_at))
        if self._dirty_since is not None:
            waits.append(self.sync_seconds - (now - self._dirty_since))
        return max(0.01, min(waits)) if waits else None

    def _checkpoint_due(self, now: float) -> bool:
        head = self._head
        return bool(head.unsigned) and (now - head.signed_at >= self.checkpoint_seconds or head.unsigned >= self.checkpoint_events)

    def _age_due(self) -> bool:
        return bool(self._head.events) and time.time() - self._opened_at >= self.rotate_seconds

    def _compose(self, batch: list[dict], resumed: dict | None) -> list[dict]:
        """The records of one write: an `audit-open` if a segment (or run) starts, the resumption note, the
        queued events, and a checkpoint when one is due (closing, rotating, or by time or count)."""
        records: list[dict] = []
        if self._need_open is not None:
            records.append({"v": FORMAT, "ts": _now(), "kind": "audit-open", "decision": "info", "reason": self._need_open,
                            "segment": self._segment, "log": self._log_id, "key": self._keys.id,
                            "pub": base64.b64encode(self._keys.public).decode("ascii"), **self._open_info})
        if resumed is not None:
            records.append(resumed)
        records += batch
        end = "shutdown" if self._closing else "rotated" if (self._rotate_due or self._age_due()) else None
        if end is not None or self._checkpoint_due(time.monotonic()) or (batch and self._head.unsigned + len(batch) >= self.checkpoint_events):
            records.append({"v": FORMAT, "ts": _now(), "kind": "checkpoint", "decision": "info", "reason": end or "periodic", "end": end})
        return records

    def _append(self, records: list[dict]) -> list[bytes]:
        """Seal `records` onto the chain and append them with one write; the head moves only if all of it landed.
        Returns their lines."""
        head = self._head
        prev, lines, unsigned, digest, seq = head.prev, head.lines, head.unsigned, head.digest.copy(), self.seq
        chunks = []
        signed = False
        events = 0
        for template in records:
            seq += 1
            kind = template["kind"]
            record = {**template, "seq": seq, "prev": prev}
            if kind == "checkpoint":
                record.update(segment=self._segment, log=self._log_id, key=self._keys.id, count=lines, digest=digest.hexdigest())
            if kind in SIGNED:
                record["sig"] = self._keys.sign(canonical(record))
            prev, line = self._keys.seal(record)
            chunks.append(line)
            lines += 1
            if kind in SIGNED:
                digest, unsigned, signed = hashlib.sha256(), 0, True
            else:
                digest.update(line)
                unsigned += 1
            if kind not in OWN_KINDS:
                events += 1
        data = b"".join(chunks)
        try:
            written = self._os_write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")
        except OSError:
            self._cut_back(raise_on_failure=False)
            raise
        self._head = _Head(prev, head.size + len(data), lines, head.events + events, digest, unsigned,
                           time.monotonic() if signed else head.signed_at)
        self.seq = seq
        self._need_open = None
        self._open_info = {}
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        if records[-1]["kind"] == "checkpoint" and records[-1]["end"] == "rotated":
            self._switch_due = True
            self._rotate_due = False
        return chunks

    def _lost_sync(self) -> None:
        """A failed fsync: what was appended since the last good one may or may not be on disk. Cut it off (the head
        goes back to the last durable line) and hold its events again, in front of the queue, to be written again."""
        self._head, self.seq, self._need_open, self._open_info = self._synced
        self._cut_back(raise_on_failure=False)
        self._pending[:0] = [_unsealed(line) for line in self._unsynced]
        self._appended = self._written
        self._unsynced = []
        self._dirty_since = None
        if self._switch_due:  # the rotation checkpoint was cut off with the rest: rotate again, never rename without it
            self._switch_due, self._rotate_due = False, True

    def _cut_back(self, *, raise_on_failure: bool) -> None:
        """Remove whatever part of a failed write reached the file: never append to a torn line."""
        try:
            os.ftruncate(self._fd, self._head.size)
            self._torn = False
        except OSError:
            self._torn = True
            if raise_on_failure:
                raise

    def _switch(self) -> None:
        """Rename the closed active segment to its numbered name and open a fresh active file."""
        target = segment_path(self.path, self._segment)
        if not target.exists():
            os.rename(self.path, target)
        elif not os.path.samestat(os.fstat(self._fd), os.stat(target)):  # (else: renamed by an earlier attempt)
            raise OSError(errno.EEXIST, f"`{target.name}` already exists")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fsync_dir(self.path.parent)
        with self._cond:
            old, self._fd = self._fd, fd
            self._segment += 1
            self._opened_at = time.time()
            self._head = _Head(prev=self._head.prev)
            self._need_open = "rotated"
            self._open_info = {"previous": "rotated"}
            self._synced = (self._head, self.seq, self._need_open, dict(self._open_info))
            self._switch_due = False
        os.close(old)
        log.info("audit log rotated: segment %d is `%s`", self._segment - 1, target.name)

    def _resumed_record(self) -> dict:
        return {"v": FORMAT, "ts": _now(), "kind": "audit-resumed", "decision": "info", "reason": "write-failed",
                "error": self._error, "failed_for_ms": round((time.monotonic() - self._failed_at) * 1000),
                "held": len(self._pending), "dropped": self._dropped}

    def _failed(self, exc: OSError, closing_attempt: bool) -> None:
        with self._cond:
            first = self._error is None
            self._failures += 1
            self._error = f"cannot write audit log `{self.path}`: {_why(exc)}"
            if first:
                self._failed_at = time.monotonic()
                self._dropped = 0
                log.error("%s; allowed requests are refused (503 audit-unavailable) until it can be written again", self._error)
            self._retry_at = time.monotonic() + self.retry_seconds
            self._writing_since = None
            waiters, self._waiters = self._waiters, []
            if closing_attempt:
                self.close_ok = False
                self._closed = True
            self._cond.notify_all()
        _settle(waiters, AuditUnavailable(self._error))

    def _succeeded(self, records: list[dict], mark: tuple | None, *, recovered: int | None) -> None:
        """After a good append (and fsync, if `mark` says what it covered): advance, wake whoever waited, and end the
        failing state if this was the retry of the failure that is still current (`recovered`: its count)."""
        with self._cond:
            if mark is not None:
                head, seq, need_open, open_info, covered, appended, started = mark
                self._synced = (head, seq, need_open, open_info)
                del self._unsynced[:covered]
                self._written = max(self._written, appended)
                self._dirty_since = started if self._unsynced else None  # lines appended during the fsync are owed one
            if recovered is not None and recovered == self._failures and self._error is not None:
                log.warning("audit log `%s` is writable again (%d held event(s) written, %d dropped)", self.path,
                            sum(1 for r in records if r["kind"] not in OWN_KINDS), self._dropped)
                self._error = None
                self._dropped = 0
            self._writing_since = None
            done = self._written if self.sync_requests else self._appended
            ready = [w for w in self._waiters if w[0] <= done]
            self._waiters = [w for w in self._waiters if w[0] > done]
            if records and records[-1]["kind"] == "checkpoint" and records[-1]["end"] == "shutdown":
                self.close_ok = True
                self._closed = True
            elif self._head.size >= self.rotate_bytes and self._head.events:
                self._rotate_due = True
            self._cond.notify_all()
        _settle(ready, None)


def _unsealed(line: bytes) -> dict:
    """The event a line was sealed from (to be sealed again at another place in the chain)."""
    record = json.loads(line)
    for sealed in ("seq", "prev", "mac"):
        del record[sealed]
    return record


def _joined(left: bytes, right: bytes) -> bytes:
    """Two canonical objects whose keys all sort left before right, as one canonical object."""
    if left == b"{}":
        return right
    return left if right == b"{}" else left[:-1] + b"," + right[1:]


def _settle(waiters: list[tuple[int, asyncio.Future, asyncio.AbstractEventLoop]], exc: BaseException | None) -> None:
    """Wake the requests waiting on these tickets, each on its own event loop (one call per loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for _, future, loop in waiters:
        by_loop.setdefault(loop, []).append(future)

    def wake(futures: list[asyncio.Future]) -> None:
        for future in futures:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(None)

    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(wake, futures)
        except RuntimeError:  # that loop is closed: nobody is waiting any more
            pass


def _scan(fd: int) -> tuple[bytes | None, bytes | None, int, int]:
    """First line, last complete line, the size up to the end of the last complete line, complete lines."""
    first = last = None
    pos = end = lines = 0
    carry = b""
    while chunk := os.pread(fd, 1 << 20, pos):
        pos += len(chunk)
        parts = (carry + chunk).split(b"\n")
        carry = parts.pop()
        if parts:
            lines += len(parts)
            first = parts[0] if first is None else first
            last = parts[-1]
            end = pos - len(carry)
    return first, last, end, lines


def _why(exc: OSError) -> str:
    if exc.errno is not None and exc.strerror:
        return f"{errno.errorcode.get(exc.errno, exc.errno)} ({exc.strerror})"
    return str(exc) or exc.__class__.__name__


_SECOND: tuple[int, str] = (0, "")  # the last whole second formatted (one tuple: read and replaced atomically)


def _now() -> str:
    global _SECOND
    t = time.time()
    second = _SECOND
    if second[0] != int(t):
        second = _SECOND = (int(t), time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(t))))
    return f"{second[1]}.{int(t % 1 * 1000):03d}Z"


def _parse_ts(ts: object) -> float:
    import calendar

    try:
        return calendar.timegm(time.strptime(str(ts)[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return time.time()


# -- verification ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """`intact`: every line checks and the log ends with a closing checkpoint. `open`: every line checks but the
    log does not end with one (still written, writer killed, or truncated). `broken`: `file` line `line` is wrong."""

    status: str
    lines: int
    segments: int
    file: str | None = None
    line: int | None = None
    message: str = ""
    checked: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "intact"

    @property
    def broken_line(self) -> int | None:
        return self.line


class _Stop(EgressError):
    def __init__(self, status: str, line: int | None, message: str) -> None:
        super().__init__(message)
        self.status, self.line, self.message = status, line, message


def segment_files(path: str | os.PathLike[str]) -> list[tuple[Path, int | None]]:
    """The segments to walk, in order, each with the segment number its name gives (None: the active file).

    A file is one segment. A directory holds one log: `NAME.000001`, `NAME.000002`, … and the active `NAME`;
    with no numbered file, the one file in it that starts like an audit log."""
    root = Path(path)
    if not root.is_dir():
        return [(root, None)]
    files = sorted(p for p in root.iterdir() if p.is_file())
    numbered: dict[str, dict[int, Path]] = {}
    for p in files:
        if m := SEGMENT_NAME.fullmatch(p.name):
            numbered.setdefault(m.group(1), {})[int(m.group(2))] = p
    if len(numbered) > 1:
        raise AuditError(f"`{root}` holds segments of several logs ({', '.join(sorted(numbered))}); give one log per directory")
    if numbered:
        base, parts = next(iter(numbered.items()))
        out: list[tuple[Path, int | None]] = [(parts[n], n) for n in sorted(parts)]
        return out + ([(root / base, None)] if (root / base).is_file() else [])
    logs = [p for p in files if looks_like_audit(p)]
    if len(logs) != 1:
        raise AuditError(f"`{root}` holds {'no' if not logs else len(logs)} audit logs; give the file, or a directory holding one log")
    return [(logs[0], None)]


def looks_like_audit(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.readline(8192)
    except OSError:
        return False
    return head.startswith(b"{") and f'"v":"{FORMAT}"'.encode() in head


def verify(path: str | os.PathLike[str], *, key: AuditKey | None = None) -> VerifyResult:
    """Walk a log (a file, or a directory of segments) line by line, streaming: the first wrong line, exactly.

    With the secret key (`audit.key`) every line's MAC is checked. With a public key (`audit.pub`) or none (then
    the key the log names is used, and the result says so) only the signed records are: an edit is then located
    between two of them, and lines after the last one are covered by nothing."""
    return verify_segments(segment_files(path), key=key)


def verify_segments(segments: list[tuple[Path, int | None]], *, key: AuditKey | None = None) -> VerifyResult:
    """Walk one chain given as its segments in order (`segment_files`), as `verify` does."""
    return _Verifier(key).run(segments)


class _Verifier:
    def __init__(self, key: AuditKey | None) -> None:
        self.keys = _Keys(key) if key is not None else None
        self.pinned = key is not None
        self.prev: str | None = None
        self.seq: int | None = None
        self.segment: int | None = None
        self.log_id: str | None = None
        self.lines = 0
        self.signed = 0
        self.notes: list[str] = []
        self.file = ""
        self.last_signed = 0  # line (in the current file) of the last signed record
        self.last_kind: tuple[str | None, str | None] = (None, None)  # (kind, end) of the previous line

    def run(self, segments: list[tuple[Path, int | None]]) -> VerifyResult:
        status, line, message = "intact", None, ""
        try:
            for index, (path, number) in enumerate(segments):
                self.file = str(path)
                self._segment(path, number, first=index == 0, last=index == len(segments) - 1)
            message = f"{self.lines} lines in {len(segments)} segment(s), every line checks, closed by its checkpoint"
        except _Stop as stop:
            status, line, message = stop.status, stop.line, stop.message
        except OSError as exc:
            raise AuditError(f"cannot read `{self.file}`: {exc.strerror or exc.__class__.__name__}") from None
        checked = ["JSON and canonical form of every line", "sequence numbers and chain links (`prev`)",
                   f"{self.signed} signed record(s): signature, key id, line count and digest of the lines before"]
        if len(segments) > 1:
            checked.append("segment order and each segment's start at the previous segment's head")
        unchecked = []
        if self.keys is not None and self.keys.has_mac:
            checked.append(f"every line's MAC under audit key `{self.keys.id}`")
        else:
            unchecked.append("line MACs (they need `audit.key`): an edit is located only between two signed records, "
                             "and lines after the last signed record are covered by nothing")
        if not self.pinned:
            named = self.keys.id if self.keys is not None else "-"
            unchecked.append(f"whose key signed: signatures were checked against the key the log names (`{named}`); "
                             "compare it with your `audit.pub` (`--public-key`)")
        return VerifyResult(status, self.lines, len(segments), self.file, line, message, tuple(checked), tuple(unchecked), tuple(self.notes))

    def _segment(self, path: Path, number: int | None, *, first: bool, last: bool) -> None:
        lineno = 0
        digest = hashlib.sha256()
        self.last_signed = 0
        with open(path, "rb") as fh:
            for raw in fh:
                lineno += 1
                if not raw.endswith(b"\n"):
                    raise _Stop("open", lineno, "incomplete (no newline): the proxy stopped while writing it "
                                                "(it cuts such a line at its next start), or the file was cut")
                record = self._line(raw[:-1], lineno, number, first)
                if record["kind"] in SIGNED:
                    self._signed(record, lineno, digest)
                    digest = hashlib.sha256()
                    self.last_signed = lineno
                else:
                    digest.update(raw)
                self.last_kind = (record["kind"], record.get("end"))
                self.lines += 1
        if lineno == 0:
            raise _Stop("broken", 1, "the file is empty: every segment starts with its signed `audit-open` record (truncated to 0 bytes?)")
        kind, end = self.last_kind
        if kind == "checkpoint" and end == "rotated":
            if last and number is not None:
                raise _Stop("broken", lineno + 1, f"segment {self.segment} ends with its rotation checkpoint but the next segment is missing")
            if last:
                self.notes.append(f"segment {self.segment} was rotated: the segment after it was not given")
            return
        if not last:
            raise _Stop("broken", lineno + 1, f"segment {self.segment} ends at line {lineno} without its rotation checkpoint (truncated?)")
        if kind != "checkpoint" or end != "shutdown":
            covered = f"lines {self.last_signed + 1}-{lineno} are covered by no signed checkpoint" if lineno > self.last_signed else "no closing checkpoint"
            raise _Stop("open", self.last_signed + 1,
                        f"the log ends at line {lineno} without a closing checkpoint: {covered} "
                        "(the proxy is still writing it or was killed, or the file was truncated)")

    def _line(self, line: bytes, lineno: int, number: int | None, first_file: bool) -> dict:
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise _Stop("broken", lineno, "not JSON") from None
        if not isinstance(record, dict) or record.get("v") != FORMAT or not isinstance(record.get("mac"), str):
            raise _Stop("broken", lineno, f"not an `{FORMAT}` record")
        if canonical(record) != line:
            raise _Stop("broken", lineno, "not in canonical form (edited?)")
        if lineno == 1:
            self._open_segment(record, number, first_file)
        mac = record.pop("mac")
        if self.keys is not None and self.keys.has_mac and not hmac.compare_digest(self.keys.mac(canonical(record)), mac):
            raise _Stop("broken", lineno, "its MAC does not verify under the audit key (edited or forged)")
        if self.seq is not None and record.get("seq") != self.seq:
            raise _Stop("broken", lineno, f"sequence number {record.get('seq')}, expected {self.seq}: a line was deleted or inserted")
        if self.prev is not None and record.get("prev") != self.prev:
            raise _Stop("broken", lineno, "does not chain to the line before it (deleted, inserted or reordered lines)")
        kind = record.get("kind")
        before, end = self.last_kind
        if lineno > 1 and before == "checkpoint" and end == "rotated":
            raise _Stop("broken", lineno, f"follows the rotation checkpoint that ends segment {self.segment}")
        if lineno > 1 and before == "checkpoint" and end == "shutdown" and kind != "audit-open":
            raise _Stop("broken", lineno, f"follows the closing checkpoint at line {lineno - 1} but is not a restart (appended after the log was closed)")
        if lineno > 1 and kind == "audit-open":
            closed = before == "checkpoint" and end == "shutdown"
            if record.get("previous") != ("closed" if closed else "not-closed"):
                raise _Stop("broken", lineno, "a restart that misstates how the run before it ended")
            if not closed:
                self.notes.append(f"`{self.file}` line {lineno - 1}: the run ending there was not closed (killed or crashed); "
                                  f"lines {self.last_signed + 1}-{lineno - 1} were never covered by a checkpoint")
        self.prev, self.seq = mac, int(record.get("seq", 0)) + 1
        return record

    def _open_segment(self, record: dict, number: int | None, first_file: bool) -> None:
        if record.get("kind") != "audit-open":
            raise _Stop("broken", 1, "not an `audit-open` record: every segment starts with one")
        segment = record.get("segment")
        if number is not None and segment != number:
            raise _Stop("broken", 1, f"names segment {segment}, but the file name says segment {number}")
        if self.log_id is not None and record.get("log") != self.log_id:
            raise _Stop("broken", 1, "belongs to another log (its `log` id differs)")
        if first_file:
            if segment == 1:
                self.prev = GENESIS
                if record.get("seq") != 1:
                    raise _Stop("broken", 1, "segment 1 does not start with sequence number 1")
            else:
                self.notes.append(f"starts at segment {segment}: the segments before it were not given, so its link to their head is not checked")
        elif segment != self.segment + 1:  # type: ignore[operator]
            raise _Stop("broken", 1, f"segment {segment}, expected {self.segment + 1}: a segment is missing")  # type: ignore[operator]
        self.segment = segment if isinstance(segment, int) else None
        self.log_id = record.get("log")

    def _signed(self, record: dict, lineno: int, digest: Any) -> None:
        sig = record.pop("sig", None)
        if record["kind"] == "audit-open" and self.keys is None:
            try:
                public = base64.b64decode(str(record.get("pub")), validate=True)

                self.keys = _Keys(AuditKey(audit_key_id(public), public))
            except ValueError:
                raise _Stop("broken", lineno, "its public key is not a key") from None
        assert self.keys is not None
        if record.get("key") != self.keys.id:
            raise _Stop("broken", lineno, f"signed by key `{record.get('key')}`, not `{self.keys.id}`")
        if not self.keys.signature_ok(canonical(record), sig):
            raise _Stop("broken", lineno, "its signature does not verify (forged or edited)")
        if record["kind"] == "checkpoint":
            if record.get("count") != lineno - 1:
                raise _Stop("broken", lineno, f"the checkpoint counts {record.get('count')} lines before it, the file has {lineno - 1}")
            if record.get("digest") != digest.hexdigest():
                start = self.last_signed + 1
                raise _Stop("broken", start, f"lines {start}-{lineno - 1} do not match the digest signed at line {lineno}: "
                                             "one of them was edited (the audit key names which)")
        self.signed += 1
