"""The audit event log: append-only JSONL, hash-chained, written by group commit with fsync.

Each line is one canonical JSON object whose `prev` field is the sha256 (hex) of the previous
line's bytes (without its newline); the first line's `prev` is 64 zeros. `verify()` walks the
chain. Events never carry a header value or a credential, and paths never carry their query.

Durability (group commit): `emit()` only enqueues the event; one writer thread takes every
event queued so far, appends them with a single `write`, then `fsync`s once for the whole
batch. Under load batches grow instead of events being dropped: the queue is unbounded and
`emit()` never discards. An event is durable once the batch holding it has been fsync'd,
normally within one fsync of the response (a few milliseconds); `flush()` waits for that and
`close()` drains the queue, so a graceful shutdown loses nothing. A crash can lose at most the
batch that was not yet fsync'd. A partial last line left by a crash is cut off at the next
start, and the cut is itself recorded as an `audit-recovered` event in the chain.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = "egresslaw.audit/1"
GENESIS = "0" * 64
MAX_PATH = 2048


class AuditError(Exception):
    """The audit log cannot be opened or written."""


def line_hash(line: bytes) -> str:
    """sha256 hex of one line's bytes, without its trailing newline."""
    return hashlib.sha256(line).hexdigest()


def encode(event: dict, prev: str) -> bytes:
    """The canonical line for `event` chained to `prev` (no newline)."""
    record = dict(event)
    record["prev"] = prev
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def strip_query(path: str | None) -> str | None:
    """The path part of a request target, bounded in length: queries never reach the log."""
    if path is None:
        return None
    path = path.split("?", 1)[0].split("#", 1)[0]
    return path if len(path) <= MAX_PATH else path[: MAX_PATH - 3] + "..."


class AuditLog:
    """An open, append-only audit log with a group-commit writer thread."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self._fsync = fsync
        self._cond = threading.Condition()
        self._queue: list[dict] = []
        self._enqueued = 0
        self._written = 0
        self._closing = False
        self._error: str | None = None
        self.seq = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot open audit log `{self.path}`: {exc.strerror or exc.__class__.__name__}") from None
        self._prev, self.seq, cut = self._recover()
        self._thread = threading.Thread(target=self._run, name="egresslaw-audit", daemon=True)
        self._thread.start()
        if cut:
            self.emit({"kind": "audit-recovered", "decision": "info", "reason": "partial-line-removed", "bytes": cut})

    def _recover(self) -> tuple[str, int, int]:
        """The hash of the last complete line, its seq, and how many bytes of a partial last line were cut."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return GENESIS, 0, 0
        # Read backwards until the last two newlines are found (lines are small).
        chunk = 1 << 16
        data = b""
        pos = size
        while pos > 0:
            step = min(chunk, pos)
            pos -= step
            data = os.pread(self._fd, step, pos) + data
            if data.count(b"\n") >= 2 or pos == 0:
                break
        cut = 0
        if not data.endswith(b"\n"):
            last_nl = data.rfind(b"\n")
            cut = len(data) - (last_nl + 1)
            os.ftruncate(self._fd, size - cut)
            if self._fsync:
                os.fsync(self._fd)
            data = data[: last_nl + 1]
        lines = data.rstrip(b"\n").split(b"\n")
        last = lines[-1] if lines and lines[-1] else b""
        if not last:
            return GENESIS, 0, cut
        try:
            seq = int(json.loads(last).get("seq", 0))
        except (ValueError, AttributeError):
            seq = 0
        return line_hash(last), seq, cut

    def emit(self, event: dict) -> None:
        """Queue one event (never blocks on disk, never drops); `ts` and `seq` are added here."""
        with self._cond:
            if self._closing:
                raise AuditError("audit log is closed")
            self.seq += 1
            record = {"v": FORMAT, "seq": self.seq, "ts": _now(), **event}
            self._queue.append(record)
            self._enqueued += 1
            self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event emitted so far is written and fsync'd; False on timeout or write error."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while self._written < target and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._error is None

    def close(self) -> None:
        """Drain the queue, fsync, stop the writer and close the file."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        os.close(self._fd)

    @property
    def error(self) -> str | None:
        return self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                if not batch and self._closing:
                    return
            lines = []
            prev = self._prev
            for record in batch:
                line = encode(record, prev)
                prev = line_hash(line)
                lines.append(line)
            try:
                os.write(self._fd, b"\n".join(lines) + b"\n")
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as exc:
                with self._cond:
                    self._error = f"cannot write audit log `{self.path}`: {exc.strerror or exc.__class__.__name__}"
                    self._cond.notify_all()
                continue
            self._prev = prev
            with self._cond:
                self._written += len(batch)
                self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class VerifyResult:
    ok: bool
    lines: int
    broken_line: int | None = None
    message: str = ""


def verify(path: str | os.PathLike[str]) -> VerifyResult:
    """Walk the hash chain of an audit log; the first broken line is reported (1-based)."""
    prev = GENESIS
    count = 0
    with open(path, "rb") as fh:
        data = fh.read()
    if data and not data.endswith(b"\n"):
        last = data.count(b"\n") + 1
        return VerifyResult(False, last - 1, last, f"line {last} is incomplete (no newline)")
    for number, line in enumerate(data.split(b"\n")[:-1] if data else [], start=1):
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return VerifyResult(False, count, number, f"line {number} is not JSON")
        if not isinstance(record, dict) or record.get("prev") != prev:
            return VerifyResult(False, count, number, f"line {number} does not chain to line {number - 1}" if number > 1 else "line 1 does not start the chain")
        if encode({k: v for k, v in record.items() if k != "prev"}, prev) != line:
            return VerifyResult(False, count, number, f"line {number} is not in canonical form (edited?)")
        prev = line_hash(line)
        count += 1
    return VerifyResult(True, count, None, f"{count} events, chain intact")


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
