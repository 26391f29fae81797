"""Envoy's access log, turned into events of the lane's chained audit log as it is written.

Envoy writes one JSON line per request on the front listener, per request inside a tunnel, and per tunnel
connection no filter chain took (`egress_proxy.lane.envoy`). The reader follows the file (`poll`), and for each
complete line writes:

- front, decided by the authorizer and admitted: the **outcome** of that decision (`of`: connect or request, the
  same `id` as the decision event the authorizer wrote ahead), with status, bytes, duration and a `failure`;
- front, decided and refused: nothing (the authorizer's event is the final one);
- front, not decided (the authorizer did not answer: `authorizer-unavailable`; or Envoy refused the request before
  asking: a malformed head, a limit): a **denial** with its reason;
- inside a tunnel, as on the front: the authorizer decided each request (its event says `tunnel: true`); the
  reader writes the outcome of an admitted one (its `failure`: a refusal route, no admitted address, an upstream
  failure), nothing for a refused one, and a denial for one Envoy refused without the authorizer's verdict;
- a tunnel whose TLS client hello named another host or none: a `tls` denial (`sni-mismatch`, `sni-missing`).

The position read up to is saved (inode and offset) after the events of a batch are written, so after a stop or a
crash of this process the next reader resumes there: a line is ingested at least once (a crash between the write
and the save ingests the batch again, with the same ids). Paths are logged by Envoy without their query.

The file is bounded: once it is read to its end past `rotate_bytes`, it is renamed `access.log.1`, Envoy is told to
reopen its log (`reopen()`), the renamed file is read to its end (what Envoy wrote before reopening) and deleted.
A start that finds `access.log.1` still holding the saved position (a crash mid-rotation) reads it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditLog, AuditUnavailable
from egress_proxy.decision.answers import printable
from egress_proxy.decision.reasons import REASONS
from egress_proxy.lane.envoy import split_authority
from egress_proxy.lane.tunnels import Tunnels

log = logging.getLogger("egresslaw.lane")

MAX_LINE = 64 * 1024  # a longer line (Envoy's are far shorter) is skipped, never held whole
ROTATE_BYTES = 64 * 1024 * 1024  # the access log is rotated once read past this size
BATCH = 512
ADMISSIONS_BOUND = 65536  # request ids the authorizer's record holds (oldest forgotten first)
BUSY_INTERVAL = 0.05  # the poll interval while Envoy is writing (it flushes its access log every 100 ms)
SETTLE_SECONDS = 30.0  # the longest the reader waits for a check still in the authorizer when Envoy's line arrives
SEED_BYTES = 4 * 1024 * 1024  # at start, the record is rebuilt from this much of the audit log's end
_PENDING, _CLOSED = "pending", "closed"
_UPSTREAM_FAILED = frozenset({"UF", "URX", "UC", "UR", "UO", "UPE", "UT", "UMSDR", "UDNS"})
_CLIENT_GONE = frozenset({"DC", "DR", "DPE"})


def _flags(line: dict[str, Any]) -> set[str]:
    raw = line.get("flags") or ""
    return {f for f in str(raw).split(",") if f and f != "-"}


def _int(value: Any) -> int:
    if type(value) is int:  # Envoy's numbers (status, bytes, duration) are JSON numbers
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _text(value: Any, limit: int = 2048) -> str | None:
    """A field of Envoy's line as an event shows it (None where Envoy had nothing: null, `-`, empty)."""
    if value is None or value == "-" or value == "":
        return None
    if type(value) is str and len(value) <= limit and value.isascii() and value.isprintable() and "\\" not in value:
        return value  # what `printable` would return unchanged (the common case, without its escaping round trip)
    return printable(value, limit)


@functools.lru_cache(maxsize=4096)
def _tunnel(profile: Any, connect: Any) -> tuple[str | None, str | None, int | None]:
    """(profile, host, port) of an inner listener's static tag (one of a few per profile: cached)."""
    host, port = _split(_text(connect, 300), 443) if type(connect) is str else (None, None)
    return _text(profile, 200) if type(profile) is str else None, host, port


def _split(authority: str | None, default_port: int) -> tuple[str | None, int | None]:
    return split_authority(authority, default_port) if authority else (None, None)


def _outcome(of: str, rid: str, status: int | None, failure: str | None, common: dict[str, Any]) -> dict[str, Any]:
    """The outcome of an admitted CONNECT or plain request (`failure`: how it ended if not as forwarded)."""
    return {"kind": "outcome", "of": of, "id": rid, "decision": "allow", "reason": "allowed", "rule": None, "broker": None,
            "status": status, "failure": failure, "aborted": False, "error": None, "bytes_up": common["bytes_up"],
            "bytes_down": common["bytes_down"], "duration_ms": common["duration_ms"], "redactions": 0, "lane": "envoy"}


def local_reason(line: dict[str, Any]) -> str:
    """The reason of a request Envoy refused without asking the authorizer."""
    status, details, flags = _int(line.get("status")), str(line.get("details") or ""), _flags(line)
    if line.get("method") == "CONNECT" and line.get("lane") == "inner":
        return "connect-in-tunnel"
    if "upgrade" in details:
        return "upgrade-denied"
    if status == 431 or "too_large" in details and "header" in details:
        return "head-too-large"
    if status == 408 or "request_header_timeout" in details:
        return "header-timeout"
    if status == 413:
        return "body-too-large"
    if "DC" in flags or "DR" in flags:
        return "client-disconnected"
    if "overload" in details or status == 503:
        return "proxy-at-capacity"
    if status == 400 or "codec" in details or "protocol_error" in details:
        return "malformed-request"
    return "internal-error"


class Admissions:
    """What the authorizer decided, by request id, for the reader of Envoy's access log (the same process).

    The authorizer calls `begin(id)` when a check starts and `end(id, decision)` once its event is written
    (`allow`, `deny`, or None: no event). A front line that Envoy wrote without the authorizer's verdict
    (`decided` empty: its Lua timed out, or it reset the stream, e.g. a malformed body, while the check was out)
    is settled by `settle(id)`: it waits for a check still running, then says what the authorizer wrote. `allow`:
    the reader writes this request's **outcome** (the refusal Envoy made after admission), never a second decision;
    `deny`: the authorizer's event stands alone; None: the reader writes the denial, and the id is closed so a
    check for it that starts later is refused without an event (`begin` says False).

    Bounded: `bound` ids (the oldest forgotten first; an id is forgotten as soon as its line is read). A restart
    loses the record: `seed()` rebuilds it from the last `SEED_BYTES` of the audit log, which holds the decisions
    of every line the previous run had not read yet as long as those lines are fewer than about `SEED_BYTES` /
    600 (7,000) events behind (the reader's backlog is far below that: docs/lane.md).
    """

    def __init__(self, bound: int = ADMISSIONS_BOUND) -> None:
        self.bound = bound
        self._state: OrderedDict[str, str] = OrderedDict()
        self._waiters: dict[str, list[asyncio.Future]] = {}
        self.tunnels = Tunnels()  # the admitted CONNECTs, for the requests inside them (forgotten with the CONNECT's line)

    def __len__(self) -> int:
        return len(self._state)

    def _put(self, rid: str, state: str) -> None:
        self._state[rid] = state
        self._state.move_to_end(rid)
        while len(self._state) > self.bound:
            self._state.popitem(last=False)

    def begin(self, rid: str) -> bool:
        """A check starts; False when the reader has already closed `rid` (Envoy's line was read: no event now)."""
        if self._state.get(rid) == _CLOSED:
            return False
        self._put(rid, _PENDING)
        return True

    def end(self, rid: str, decision: str | None) -> None:
        """The check's event is written (`decision`), or none was (None)."""
        if self._state.get(rid) == _PENDING:
            if decision is None:
                del self._state[rid]
            else:
                self._put(rid, decision)
        for waiter in self._waiters.pop(rid, ()):
            if not waiter.done():
                waiter.set_result(None)

    def closed(self, rid: str) -> bool:
        return self._state.get(rid) == _CLOSED

    def forget(self, rid: str) -> None:
        """The request's line was read with the authorizer's verdict on it (a CONNECT's: its tunnel is closed)."""
        self._state.pop(rid, None)
        self.tunnels.close(rid)

    async def settle(self, rid: str, timeout: float = SETTLE_SECONDS) -> str | None:
        """`allow` / `deny`: the event the authorizer wrote for `rid` (after waiting up to `timeout` for a check
        still running); None: it wrote none, and `rid` is closed from now on."""
        if self._state.get(rid) == _PENDING:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(rid, []).append(waiter)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waiter, timeout)
        state = self._state.get(rid)
        self.tunnels.close(rid)
        if state in ("allow", "deny"):
            del self._state[rid]
            return state
        self._put(rid, _CLOSED)
        return None

    def seed(self, audit_path: Path, limit: int = SEED_BYTES) -> int:
        """Rebuild the record from the end of the audit log (after a restart): the lane's decisions there whose
        outcome is not; the number of ids recorded."""
        try:
            with open(audit_path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - limit))
                data = fh.read(limit)
        except OSError:
            return 0
        if size > limit:
            data = data[data.find(b"\n") + 1 :]  # the first line is cut
        seen = 0
        for raw in data.splitlines():
            if b'"envoy"' not in raw:
                continue
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            rid = event.get("id") if isinstance(event, dict) else None
            if not isinstance(rid, str) or event.get("lane") != "envoy":
                continue
            if event.get("kind") == "outcome":
                self._state.pop(rid, None)
            elif event.get("kind") in ("connect", "request") and event.get("decision") in ("allow", "deny"):
                self._put(rid, event["decision"])
                seen += 1
        return seen


class Ingester:
    """Follows `path` (Envoy's access log) from the saved position; `poll()` ingests what is complete."""

    def __init__(self, path: Path, position: Path, audit: AuditLog, *, refusal: Callable[[str], tuple[str, str | None] | None],
                 policy: Callable[[], Any], metrics: Any = None, test_routing: dict[str, Any] | None = None,
                 reopen: Callable[[], Awaitable[object]] | None = None, rotate_bytes: int = ROTATE_BYTES,
                 admissions: Admissions | None = None) -> None:
        self.path = path
        self.rotated = path.with_name(path.name + ".1")
        self.reopen = reopen
        self.rotate_bytes = rotate_bytes
        self.rotations = 0
        self._lock = asyncio.Lock()  # one reader at a time: a poll between a rename and its reopen would restart the new file
        self.position_path = position
        self.audit = audit
        self.refusal = refusal
        self.policy = policy
        self.metrics = metrics
        self.test_routing = test_routing or {}
        self.admissions = admissions if admissions is not None else Admissions()
        self.inode, self.offset = self._load_position()
        self.ingested = 0
        self.skipped = 0

    def _load_position(self) -> tuple[int | None, int]:
        try:
            saved = json.loads(self.position_path.read_text())
            return int(saved["inode"]), int(saved["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, 0

    def _save_position(self) -> None:
        tmp = self.position_path.with_name(self.position_path.name + ".tmp")
        tmp.write_text(json.dumps({"inode": self.inode, "offset": self.offset}))
        os.replace(tmp, self.position_path)

    async def recover(self) -> None:
        """Before the first poll: rebuild the authorizer's record from the audit log (the previous run's, if this
        is a restart), and finish a rotated file that still holds the saved position (a crash mid-rotation)."""
        if not self.admissions:
            self.admissions.seed(self.audit.path)
        async with self._lock:
            try:
                same = os.stat(self.rotated).st_ino == self.inode
            except FileNotFoundError:
                return
            if same:
                await self._read(self.rotated)
            self._switch()

    async def rotate(self) -> bool:
        """Rotate the file once it is read to its end past `rotate_bytes` (see the module's docstring)."""
        if self.reopen is None:
            return False
        async with self._lock:
            return await self._rotate()

    async def _rotate(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        if st.st_size < self.rotate_bytes or st.st_ino != self.inode or self.offset < st.st_size:
            return False
        os.replace(self.path, self.rotated)  # Envoy keeps writing to this inode until it reopens
        try:
            await self.reopen()
        except Exception as exc:  # Envoy still writes to the renamed file: give it its name back, try again later
            os.replace(self.rotated, self.path)
            log.error("the lane's access log could not be rotated (%s); it is kept and read as it is", exc.__class__.__name__)
            return False
        await self._read(self.rotated)  # what Envoy wrote before reopening
        self._switch()
        self.rotations += 1
        return True

    def _switch(self) -> None:
        """Forget the rotated file: the next poll starts the new one from its beginning."""
        self.inode, self.offset = None, 0
        self._save_position()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.rotated)

    async def poll(self) -> int:
        """Ingest every complete line written since the last poll; the number of events written."""
        async with self._lock:
            return await self._read(self.path)

    async def _read(self, path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        written = 0
        try:
            st = os.fstat(fd)
            if self.inode != st.st_ino or st.st_size < self.offset:  # a new file (first run, or rotated): from its start
                self.inode, self.offset = st.st_ino, 0
            while True:
                os.lseek(fd, self.offset, os.SEEK_SET)
                chunk = os.read(fd, 1 << 20)
                end = chunk.rfind(b"\n")
                if end < 0:
                    if len(chunk) > MAX_LINE:  # a line longer than any Envoy writes: skip it whole
                        self.offset += len(chunk)
                        self.skipped += 1
                        continue
                    break
                lines = chunk[: end + 1].split(b"\n")[:-1]
                ticket = None
                for line in self._parse(lines):
                    event = self._event(line)
                    if event is not None and event.get("undecided"):
                        event = await self._settle(event)
                    if event is None:
                        continue
                    ticket = self._emit(event)
                    written += 1
                if ticket is not None:
                    with contextlib.suppress(AuditUnavailable, TimeoutError):
                        await self.audit.written(ticket)
                self.offset += end + 1
                self._save_position()
                if len(chunk) < (1 << 20):
                    break
        finally:
            os.close(fd)
        self.ingested += written
        return written

    async def run(self, interval: float = 0.2) -> None:
        """Poll every `interval` while Envoy writes nothing, every `BUSY_INTERVAL` while it does (the backlog
        bound, docs/lane.md: what Envoy wrote in its last flush interval plus this, and one batch)."""
        while True:
            wrote = 0
            try:
                wrote = await self.poll()
                await self.rotate()
            except Exception:
                log.exception("the lane's access-log reader failed; retrying")
            await asyncio.sleep(min(interval, BUSY_INTERVAL) if wrote else interval)

    def _emit(self, event: dict[str, Any]) -> int | None:
        policy = self.policy()
        event.setdefault("artifact", policy.artifact.digest if policy is not None else None)
        if self.test_routing:
            event["test_routing"] = self.test_routing
        if self.metrics is not None:
            if event["kind"] == "outcome":
                self.metrics.closed(event["of"], event)
            else:
                self.metrics.observe(event["kind"], event["decision"], event["reason"], (event.get("duration_ms") or 0) / 1000)
        # The typed event straight from the dict (what `Event.of` does, without its copy of every field: one line
        # of Envoy's log is one event, and this runs for every request inside a tunnel).
        kind, decision, reason, rid = event.pop("kind"), event.pop("decision"), event.pop("reason"), event.pop("id", None)
        try:
            return self.audit.emit(Event(kind=kind, decision=decision, reason=reason, id=rid, fields=event))
        except AuditUnavailable as exc:
            log.error("audit event lost: %s", exc)
            return None

    def _parse(self, lines: list[bytes]) -> list[Any]:
        """Each line's JSON value (None for a line skipped: too long, or not JSON). The lines of a batch are parsed
        as one array (a third of the cost of a call per line); one that is not JSON sends the batch line by line."""
        if all(len(raw) <= MAX_LINE for raw in lines):
            try:
                values = json.loads(b"[" + b",".join(lines) + b"]")
            except ValueError:
                pass
            else:
                if len(values) == len(lines):
                    return values
        return [self._parse_one(raw) for raw in lines]

    def _parse_one(self, raw: bytes) -> Any:
        if len(raw) > MAX_LINE:
            self.skipped += 1
            return None
        try:
            return json.loads(raw)
        except ValueError:
            self.skipped += 1
            return None

    def _event(self, line: Any) -> dict[str, Any] | None:
        if not isinstance(line, dict):
            return None
        lane = line.get("lane")
        if lane == "front":
            return self._front(line)
        if lane == "inner":
            return self._inner(line)
        if lane == "tls":
            return self._tls(line)
        return None

    def _common(self, line: dict[str, Any], default_port: int) -> dict[str, Any]:
        host, port = _split(_text(line.get("authority"), 300), default_port)
        return {"host": host, "port": port, "method": _text(line.get("method"), 32),
                "bytes_up": _int(line.get("bytes_up")), "bytes_down": _int(line.get("bytes_down")),
                "duration_ms": float(_int(line.get("duration_ms"))), "lane": "envoy"}

    def _failure(self, line: dict[str, Any], host: str | None) -> str | None:
        flags = _flags(line)
        if "UH" in flags:
            hit = self.refusal(host) if host else None
            return hit[0] if hit is not None else "resolve-failed"
        if flags & _UPSTREAM_FAILED:
            return "upstream-error"
        if flags & _CLIENT_GONE and _int(line.get("status")) == 0:
            return "client-disconnected"
        return None

    def _front(self, line: dict[str, Any]) -> dict[str, Any] | None:
        decided = line.get("decided")
        connect = line.get("method") == "CONNECT"
        kind = "connect" if connect else "request"
        scheme = "https" if (connect or line.get("scheme") == "https") else "http"
        common = self._common(line, 443 if scheme == "https" else 80)
        status = _int(line.get("status")) or None
        rid = _text(line.get("id"), 64)
        if decided == "deny" or decided == "allow":
            if rid is not None:
                self.admissions.forget(rid)
            if decided == "deny":
                return None
            failure = "lane-no-route" if str(line.get("route") or "").startswith("deny:") else self._failure(line, common["host"])
            return _outcome(kind, rid or uuid.uuid4().hex, status, failure, common)
        reason = _text(line.get("deny"), 64)
        if reason not in REASONS:
            reason = local_reason(line)
        event = {"kind": kind, "id": rid or uuid.uuid4().hex, "subject": None, "profile": None, "connection": None,
                 **common, "scheme": scheme, "path": None if connect else _text(line.get("path")), "tunnel": False,
                 "decision": "deny", "reason": reason, "rule": None, "broker": None, "status": status, "redactions": 0}
        if rid is not None:  # the Lua filter asked the authorizer: what it wrote decides what this line is
            event["undecided"] = True
        return event

    async def _settle(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """A front line without the authorizer's verdict (Envoy refused the request itself, or stopped waiting):
        its outcome if the authorizer admitted it, nothing if the authorizer refused it, else Envoy's denial."""
        del event["undecided"]
        verdict = await self.admissions.settle(event["id"])
        if verdict == "deny":
            return None
        if verdict == "allow":
            return _outcome(event["kind"], event["id"], event["status"], event["reason"], event)
        return event

    def _inner(self, line: dict[str, Any]) -> dict[str, Any] | None:
        """A request inside a tunnel. The authorizer decided it (`decided`) and wrote its decision event: its
        outcome when admitted (with how it ended: a refusal route, no admitted address, an upstream failure),
        nothing when refused. Envoy refused it without the authorizer's verdict (its codec, a CONNECT in the
        tunnel, a check that timed out): settled like a front line, so a request is never decided twice."""
        profile, host, port = _tunnel(line.get("profile"), line.get("connect"))
        common = {"host": host, "port": port, "method": _text(line.get("method"), 32), "bytes_up": _int(line.get("bytes_up")),
                  "bytes_down": _int(line.get("bytes_down")), "duration_ms": float(_int(line.get("duration_ms"))), "lane": "envoy"}
        rid = _text(line.get("id"), 64)
        status = _int(line.get("status")) or None
        decided = line.get("decided")
        route = line.get("route")
        route = route if type(route) is str else ""
        if decided == "allow" or decided == "deny":
            if rid is not None:
                self.admissions.forget(rid)
            if decided == "deny":
                return None
            failure = route.removeprefix("deny:") if route.startswith("deny:") else (
                self._failure(line, host) if line.get("flags") != "-" else None)
            return _outcome("request", rid or uuid.uuid4().hex, status, failure, common)
        reason = _text(line.get("deny"), 64)
        if reason not in REASONS:
            reason = route.removeprefix("deny:") if route.startswith("deny:") else local_reason(line)
        event = {"kind": "request", "id": rid or uuid.uuid4().hex, "subject": None, "profile": profile, "connection": None, **common,
                 "scheme": "https", "path": _text(line.get("path")), "tunnel": True, "decision": "deny", "reason": reason, "rule": None,
                 "broker": None, "status": status, "redactions": 0}
        if rid is not None:  # the inner Lua filter may have asked the authorizer: what it wrote decides what this line is
            event["undecided"] = True
        return event

    def _tls(self, line: dict[str, Any]) -> dict[str, Any]:
        host, port = _split(_text(line.get("connect"), 300), 443)
        sni = line.get("sni")
        return {"kind": "tls", "id": uuid.uuid4().hex, "subject": None, "profile": _text(line.get("profile"), 200), "connection": None,
                "host": host, "port": port, "decision": "deny", "reason": "sni-missing" if sni in (None, "", "-") else "sni-mismatch",
                "duration_ms": float(_int(line.get("duration_ms"))), "lane": "envoy"}
