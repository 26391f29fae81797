"""The audit exporter: every chain of an audit log, as OCSF records in OTLP logs, to a collector (docs/audit-export.md).

    exporter = Exporter(Path("audit.jsonl"), parse_target("grpc://otel:4317"), headers=read_headers("auth"))
    exporter.run(stop_event, follow=True)

It reads the files the log has written (never the writer's memory), one batch at a time (`MAX_LINES` lines,
`MAX_BYTES` of lines), checking the chain as it goes (`seq` follows, `prev` is the previous `mac`), and advances its
durable checkpoint (`DIR/state.json`) only after the collector acknowledged a batch: a killed exporter sends the last
batch again, with the same `log.record.uid`s. A collector that is down, slow or answers anything but 2xx is retried
with backoff (`BACKOFF_FIRST` doubling to `BACKOFF_MAX`), forever when following.

Header values (the collector's credentials) are kept in the senders only: no repr, log line, error or state field
holds them.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import logging
import os
import re
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from egress_proxy.audit import ocsf
from egress_proxy.audit.log import GENESIS, SEGMENT_NAME, segment_path
from egress_proxy.audit.verify import worker_audit_path
from egress_proxy.errors import EgressError

log = logging.getLogger("egresslaw.audit.export")

MAX_LINES = 512
MAX_BYTES = 1 << 20
MAX_LINE = 16 << 20  # a line longer than this is no audit line (they are a few KiB): the chain is broken there
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 5.0
POLL_SECONDS = 0.2  # how often a caught-up follower looks for new lines
LINGER_SECONDS = 0.5  # following: after a batch that was not full, a chain is read again this much later (batches fill)
STATE_SECONDS = 1.0  # the state file is rewritten about this often (and at stop); never ahead of what was acknowledged
SEND_TIMEOUT = 10.0
REJECTED_LOG_SECONDS = 60.0  # records a collector rejects are logged at most this often (and counted always)
STATE_VERSION = 1
HTTP_PATH = "/v1/logs"
SCHEMES = ("grpc", "grpcs", "http", "https")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)
_VALUE = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")  # a header value: visible ASCII, inner spaces
_METADATA = re.compile(r"[0-9a-z_.-]+")  # a gRPC metadata key (headers are lower-cased for gRPC)
_FAILURES = frozenset({"reload-failed"})


class ExportError(EgressError):
    """The exporter cannot start: a bad target, headers file, TLS file or state directory. The CLI exits 2."""


class SendFailed(EgressError):
    """One export attempt failed (unreachable, timeout, non-2xx); the message names the cause, never a header."""


# -- the target and the headers ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """Where the records go: `scheme` grpc|grpcs|http|https, `host`, `port`, `path` (HTTP only)."""

    scheme: str
    host: str
    port: int
    path: str = ""

    @property
    def grpc(self) -> bool:
        return self.scheme.startswith("grpc")

    @property
    def tls(self) -> bool:
        return self.scheme in ("grpcs", "https")

    def __str__(self) -> str:
        """`scheme://host:port`: what logs, errors and the state show (never the path, which may hold a token)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


_TARGET_HELP = ("give `grpc://HOST:PORT` (gRPC), `grpcs://HOST:PORT` (gRPC over TLS), `http://HOST:PORT[/PATH]` or "
                "`https://HOST:PORT[/PATH]` (HTTP/protobuf; the path defaults to /v1/logs)")


def parse_target(url: str) -> Target:
    """`--to URL` as a Target; ExportError (with the forms that work) for anything else."""
    text = (url or "").strip()
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        raise ExportError(f"`--to` is not a URL with a valid port: `{_shown(text)}`", _TARGET_HELP) from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ExportError(f"`--to` scheme `{scheme or '(none)'}` is not one of grpc, grpcs, http, https", _TARGET_HELP)
    if parts.username is not None or parts.password is not None:
        raise ExportError("`--to` carries a user name or password; credentials go in the `--headers` file, never in the URL",
                          "put e.g. `Authorization: Basic …` in a file given by `--headers`, and the URL without `user@`")
    if not parts.hostname:
        raise ExportError(f"`--to` `{_shown(text)}` names no host", _TARGET_HELP)
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ExportError(f"`--to` `{_shown(text)}` has a query or a fragment", _TARGET_HELP)
    if scheme.startswith("grpc"):
        if port is None:
            raise ExportError(f"`--to` `{_shown(text)}` names no port (gRPC collectors usually listen on 4317)", _TARGET_HELP)
        if parts.path not in ("", "/"):
            raise ExportError(f"`--to` `{_shown(text)}`: a gRPC target has no path", _TARGET_HELP)
        return Target(scheme, parts.hostname, port)
    path = parts.path or HTTP_PATH
    return Target(scheme, parts.hostname, port if port is not None else (443 if scheme == "https" else 80), path)


def _shown(text: str) -> str:
    """A URL as an error may show it: its scheme and host part only (no user info, path, query or fragment, any of
    which may hold a credential), bounded."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    hidden = len(netloc) < len(rest)
    if "@" in netloc:
        netloc = "…@" + netloc.rpartition("@")[2]
    shown = (f"{scheme}://" if sep else "") + netloc + ("/…" if hidden else "")
    return shown if len(shown) <= 200 else shown[:197] + "..."


def read_headers(path: str | os.PathLike[str]) -> tuple[tuple[str, str], ...]:
    """`--headers FILE`: `Name: value` lines (blank and `#` lines skipped). Errors name the file and the line number,
    never a value."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ExportError(f"headers file `{path}` does not exist", "check the path given to `--headers`") from None
    except IsADirectoryError:
        raise ExportError(f"headers file `{path}` is a directory", "give the file of `Name: value` lines") from None
    except OSError as exc:
        raise ExportError(f"cannot read headers file `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ExportError(f"headers file `{path}` is not UTF-8 text", "write it as `Name: value` lines in UTF-8") from None
    out = []
    help_ = "each line is `Name: value` (a header name, a colon, the value); blank lines and `#` comments are skipped"
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, colon, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not colon or not _TOKEN.fullmatch(name):
            raise ExportError(f"headers file `{path}` line {number} is not a `Name: value` line (the value is not shown)", help_)
        if not _VALUE.fullmatch(value):
            raise ExportError(f"headers file `{path}` line {number}: header `{name}` has an empty value, or a character that is "
                              "not visible ASCII (the value is not shown)", help_)
        out.append((name, value))
    return tuple(out)


def check_headers(target: Target, headers: tuple[tuple[str, str], ...]) -> None:
    """Headers `target` can carry: over gRPC each name, lower-cased, is metadata (`[0-9a-z_.-]`, not `grpc-`, not
    `-bin`). ExportError names the header, never its value."""
    if not target.grpc:
        return
    for name, _ in headers:
        key = name.lower()
        if not _METADATA.fullmatch(key) or key.startswith("grpc-") or key.endswith("-bin"):
            raise ExportError(f"header `{name}` cannot be sent as gRPC metadata to `{target}`",
                              "gRPC metadata names are lower-case letters, digits, `_`, `.` and `-`, not starting with `grpc-` "
                              "and not ending with `-bin`; rename it, or use an http:// or https:// target")


def check_tls(target: Target, ca: str | os.PathLike[str] | None, cert: str | os.PathLike[str] | None,
              key: str | os.PathLike[str] | None) -> ssl.SSLContext | None:
    """The TLS options for `target`, loaded as the senders load them (PEM files: the CA, a client certificate with its
    key); the context for an https target (None for a plaintext one). ExportError for anything the child would fail on."""
    if (cert is None) != (key is None):
        raise ExportError("`--cert` and `--key` go together (a client certificate and its key)", "give both, or neither")
    if not target.tls and (ca or cert):
        raise ExportError(f"`--ca`/`--cert` are for TLS targets, and `{target}` is plaintext", "use grpcs:// or https://")
    for path, what in ((ca, "--ca"), (cert, "--cert"), (key, "--key")):
        if path is not None and not Path(path).is_file():
            raise ExportError(f"`{what}` file `{path}` does not exist", "check the path")
    if not target.tls:
        return None
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
        if cert is not None:
            context.load_cert_chain(str(cert), str(key) if key else None)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ExportError(f"cannot load the TLS files (`--ca`, `--cert`, `--key`): {exc.__class__.__name__}",
                          "give PEM files: the collector's CA, and a client certificate with its key") from None
    return context


def check_options(url: str, *, headers: str | None, ca: str | None, cert: str | None, key: str | None) -> None:
    """What `egresslaw audit export --to URL [--headers FILE] [--ca …] [--cert … --key …]` checks at its start, without
    connecting: the target, the headers file (and its names as gRPC metadata), the TLS files as PEM. ExportError
    (message and help, never a header value) for what would stop the exporter; the front ends call it at start-up."""
    target = parse_target(url)
    check_headers(target, read_headers(headers) if headers else ())
    check_tls(target, ca, cert, key)


# -- the chains -------------------------------------------------------------------------------------


_LISTINGS: dict[str, tuple[int, int, frozenset[str], dict[str, list[int]]]] = {}
_SETTLED_NS = 1_000_000_000  # a listing taken this long after the directory's mtime is reused until the mtime changes
_CHAINS: dict[str, tuple[frozenset[str], list[Path]]] = {}


def _listing(folder: Path) -> tuple[frozenset[str], dict[str, list[int]]] | None:
    """The names in `folder` and, per active file name, its rotated segments' numbers in order; listed again only when
    the directory's st_mtime_ns changes (or changed less than a second before the listing: a coarse timestamp could
    hide a second change within the same tick). None: the directory cannot be read."""
    key = str(folder)
    try:
        mtime = os.stat(key).st_mtime_ns
    except OSError:
        return None
    cached = _LISTINGS.get(key)
    if cached is not None and cached[0] == mtime and cached[1] - mtime >= _SETTLED_NS:
        return cached[2], cached[3]
    listed_at = time.time_ns()
    try:
        names = frozenset(os.listdir(key))
    except OSError:
        return None
    segments: dict[str, list[int]] = {}
    for name in names:
        if m := SEGMENT_NAME.fullmatch(name):
            segments.setdefault(m.group(1), []).append(int(m.group(2)))
    for numbers in segments.values():
        numbers.sort()
    _LISTINGS[key] = (mtime, listed_at, names, segments)
    return names, segments


def _folder(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def chains(audit_log: str | os.PathLike[str]) -> list[Path]:
    """The chains `--audit-log LOG` stands for, as their active files (which may not exist for a moment, mid-rotation):
    LOG itself, then the worker chains `LOG.wI` beside it, by worker number; each only if it or a segment of it exists."""
    root = Path(audit_log)
    listing = _listing(_folder(root))
    if listing is None:
        return []
    names, segments = listing
    cached = _CHAINS.get(str(root))
    if cached is not None and cached[0] is names:
        return list(cached[1])

    def present(active: Path) -> bool:
        return active.name in names or active.name in segments

    found = [root] if present(root) else []
    probe = worker_audit_path(root, 7919).name  # the worker name pattern, from the one function that names them
    head, _, tail = probe.rpartition(".w7919")
    pattern = re.compile(re.escape(head) + r"\.w(\d+)" + re.escape(tail) + r"(?:\.\d{6,})?")
    workers = sorted({int(m.group(1)) for n in names if (m := pattern.fullmatch(n))})
    found += [w for i in workers if present(w := worker_audit_path(root, i))]
    _CHAINS[str(root)] = (names, found)
    return list(found)


def segment_numbers(active: Path) -> list[int]:
    """The numbers of the rotated segments beside `active`, in order."""
    listing = _listing(_folder(active))
    return list(listing[1].get(active.name, ())) if listing is not None else []


@dataclass(slots=True)
class Line:
    """One complete line read from a chain, with the cursor after it."""

    raw: bytes
    record: dict
    segment: int
    end: int
    log_id: str | None


@dataclass(slots=True)
class Cursor:
    """Where a chain's export stands: the next byte to read is `offset` in segment `segment`; `seq`/`mac` are the last
    exported line's (None: nothing exported yet, or the line before was lost in a gap)."""

    log: str | None = None
    segment: int | None = None
    offset: int = 0
    seq: int | None = None
    mac: str | None = None
    broken: str | None = None

    def state(self) -> dict[str, Any]:
        return {"log": self.log, "segment": self.segment, "offset": self.offset, "seq": self.seq, "mac": self.mac, "broken": self.broken}


class _Gone(EgressError):
    """The chain no longer matches the cursor (replaced or cut back): export it again (`ChainReader.restart`)."""


def _parse(raw: bytes) -> Any:
    """One line as JSON (orjson; the stdlib for what orjson refuses and json reads, e.g. an integer beyond 64 bits).
    ValueError when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


class ChainReader:
    """Reads one chain's complete lines from its cursor on, across rotations, checking the links."""

    def __init__(self, active: Path, cursor: Cursor) -> None:
        self.active = active
        self.cursor = cursor
        self.gaps = 0
        self.not_before = 0.0  # following: not read again before this time.monotonic() (a batch fills meanwhile)
        self._head: tuple[int, int, bytes, dict | None] | None = None  # (st_dev, st_ino, first line, parsed) of a file

    @property
    def name(self) -> str:
        return self.active.name

    # -- which file holds segment N

    def _first_line(self, fd: int) -> dict | None:
        """The first line of the file `fd` is open on, parsed (None: not a complete JSON object yet). The last file's is
        kept: its first line is checked by a read of its length, not parsed again."""
        st = os.fstat(fd)
        head = self._head
        if head is not None and head[0] == st.st_dev and head[1] == st.st_ino and head[3] is not None:
            raw = head[2]
            if os.pread(fd, len(raw) + 1, 0) == raw + b"\n":
                return head[3]
        data = os.pread(fd, 65536, 0)
        line, newline, _ = data.partition(b"\n")
        if not newline:
            return None
        try:
            record = _parse(line)
        except ValueError:
            return None
        if not isinstance(record, dict):
            return None
        self._head = (st.st_dev, st.st_ino, line, record)
        return record

    def _active_first(self) -> dict | None:
        """The active file's first line (None: no file, or no complete first line yet)."""
        try:
            fd = os.open(self.active, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self._first_line(fd)
        finally:
            os.close(fd)

    def _open(self, segment: int) -> tuple[int | None, str]:
        """An fd on the file holding `segment` ("ok"), or None with "wait" (not written yet) or "missing" (deleted).
        The active file is opened first: if it already holds a later segment, `segment` was renamed before it was made."""
        active_segment = None
        try:
            fd = os.open(self.active, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            first = self._first_line(fd)
            active_segment = first.get("segment") if first is not None else None
            if isinstance(active_segment, int) and active_segment == segment:
                if self.cursor.log is not None and first.get("log") != self.cursor.log and self.cursor.segment == segment:  # type: ignore[union-attr]
                    os.close(fd)
                    raise _Gone("the chain was replaced")
                return fd, "ok"
            os.close(fd)
            if isinstance(active_segment, int) and active_segment < segment:
                raise _Gone("the chain was replaced")  # the active file starts an earlier segment than we have read: a new log in its place
        try:
            return os.open(segment_path(self.active, segment), os.O_RDONLY | os.O_CLOEXEC), "ok"
        except FileNotFoundError:
            pass
        later = [n for n in segment_numbers(self.active) if n > segment]
        if later or (isinstance(active_segment, int) and active_segment > segment):
            return None, "missing"
        return None, "wait"

    def first_segment(self) -> int | None:
        """The first segment present (a numbered one, else the active file's). The active file is read BEFORE the
        directory is listed: a segment renamed in between is then in the listing (the active file that replaced it
        starts a later segment), never skipped."""
        first = self._active_first()
        numbers = segment_numbers(self.active)
        if numbers:
            return numbers[0]
        segment = first.get("segment") if first else None
        return segment if isinstance(segment, int) else None

    def _next_present(self, after: int) -> int | None:
        first = self._active_first()  # before the listing, as in first_segment
        active = first.get("segment") if first else None
        later = [n for n in segment_numbers(self.active) if n > after]
        candidates = later + ([active] if isinstance(active, int) and active > after else [])
        return min(candidates) if candidates else None

    # -- reading

    def restart(self, why: str) -> None:
        """Export the chain again: from the start of the cursor's segment when the active file still holds that segment
        of the same log (only the active file was cut back: rotated segments never change), else from the first
        segment present (a replaced chain). Same uids for the same lines."""
        c = self.cursor
        first = self._active_first()
        if (c.segment is not None and c.log is not None and first is not None and first.get("kind") == "audit-open"
                and first.get("segment") == c.segment and first.get("log") == c.log):
            log.warning("audit export: chain `%s` %s: exporting its active segment %s again from its start", self.name, why, c.segment)
            self.cursor = Cursor(segment=c.segment)
            return
        segment = self.first_segment()
        log.warning("audit export: chain `%s` %s: exporting it again from segment %s", self.name, why, segment)
        self.cursor = Cursor(segment=segment)

    def anchored(self) -> bool:
        """The line ending at the cursor's offset is still the one the cursor names (its `mac`)."""
        c = self.cursor
        if c.offset == 0 or c.mac is None or c.segment is None:
            return True
        try:
            fd, status = self._open(c.segment)
        except _Gone:
            return False
        if fd is None:
            return status == "missing"  # a gap, counted by read()
        try:
            back = min(c.offset, 1 << 20)
            data = os.pread(fd, back, c.offset - back)
        finally:
            os.close(fd)
        if len(data) != back or not data.endswith(b"\n"):
            return False
        line = data[:-1].rsplit(b"\n", 1)[-1]
        return b'"mac":"%s"' % c.mac.encode("ascii", "replace") in line

    def read(self, max_lines: int = MAX_LINES, max_bytes: int = MAX_BYTES) -> list[Line]:
        """The next complete lines (at most `max_lines` and, unless one line is longer, `max_bytes`), all of one segment,
        each linked to the one before; [] when there is nothing new (or the chain stopped). Moves the cursor only past
        segments that were read to their end, past gaps, and back to the start of a replaced chain."""
        for _ in range(8):  # a few segment ends or gaps in a row, then the caller comes back
            c = self.cursor
            if c.broken is not None:
                return []
            if c.segment is None:
                c.segment = self.first_segment()
                if c.segment is None:
                    return []
                if c.segment > 1:
                    self._gap(1, c.segment - 1)
            try:
                fd, status = self._open(c.segment)
            except _Gone:
                self.restart("was replaced (its active file starts another log or an earlier segment)")
                continue
            if fd is None:
                if status == "missing":
                    after = self._next_present(c.segment)
                    if after is None:
                        return []
                    self._gap(c.segment, after - 1)
                    self.cursor = Cursor(segment=after)  # the line before is gone: the next one starts unlinked
                    continue
                return []
            try:
                data = self._pread_lines(fd, c.offset, max_bytes)
                if data is not None:
                    return self._lines(data, max_lines)
                # Still the active file? Decided BEFORE the size is taken: a renamed segment never grows again, so
                # its size read after is final (the writer may append its last lines and rename in between).
                try:
                    active = os.path.samestat(os.fstat(fd), os.stat(self.active))
                except FileNotFoundError:
                    active = False
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size < c.offset:
                self.restart("was cut back below the exported checkpoint")
                continue
            if not active and size == c.offset:  # a rotated segment read to its end: on to the next
                c.segment, c.offset = c.segment + 1, 0
                continue
            return []
        return []

    def _pread_lines(self, fd: int, offset: int, max_bytes: int) -> bytes | None:
        """The complete lines from `offset`: up to `max_bytes` worth (more only when one line is longer)."""
        want = max_bytes
        while True:
            data = os.pread(fd, want, offset)
            end = data.rfind(b"\n")
            if end >= 0:
                return data[: end + 1]
            if len(data) < want or want >= MAX_LINE:
                return None
            want *= 4

    def _lines(self, data: bytes, max_lines: int) -> list[Line]:
        c = self.cursor
        out: list[Line] = []
        offset, seq, mac, log_id = c.offset, c.seq, c.mac, c.log
        segment = c.segment
        pos = 0
        size = len(data)
        while pos < size and len(out) < max_lines:
            end = data.index(b"\n", pos)
            raw = data[pos:end]
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError:
                try:
                    record = json.loads(raw)
                except ValueError:
                    record = None
            problem = None
            if type(record) is not dict or type(record.get("mac")) is not str or type(record.get("seq")) is not int:
                problem = "is not an audit record"
            elif seq is None and mac is None and segment == 1 and offset == 0 and (record["seq"] != 1 or record.get("prev") != GENESIS):
                problem = "does not start the chain (seq 1, prev 64 zeros)"
            elif seq is not None and record["seq"] != seq + 1:
                problem = f"has seq {record['seq']}, expected {seq + 1}"
            elif mac is not None and record.get("prev") != mac:
                problem = "does not chain to the line before it (prev)"
            if problem is not None:
                if out:
                    return out  # send what links; the next read stops at this line
                if not self.anchored():
                    self.restart("no longer holds the line its checkpoint names (replaced or cut back)")
                    return []
                c.broken = f"segment {c.segment} byte {offset}: the line {problem}"
                log.error("audit export: chain `%s` is broken at segment %s byte %d: the line %s; its export stops here "
                          "(check it with `egresslaw audit verify`)", self.name, c.segment, offset, problem)
                return []
            if offset == 0 and record.get("kind") == "audit-open":
                log_id = str(record.get("log")) if record.get("log") is not None else None
            offset += end - pos + 1
            seq, mac = record["seq"], record["mac"]
            out.append(Line(raw, record, segment, offset, log_id))  # type: ignore[arg-type]
            pos = end + 1
        return out

    def advance(self, lines: list[Line]) -> None:
        """The collector acknowledged `lines` (the last read): the cursor moves past them."""
        last = lines[-1]
        self.cursor = Cursor(last.log_id, last.segment, last.end, last.record["seq"], last.record["mac"])

    def _gap(self, first: int, last: int) -> None:
        count = last - first + 1
        self.gaps += count
        which = f"segment {first}" if count == 1 else f"segments {first}-{last}"
        log.error("audit export: chain `%s`: %s deleted before they were exported (%s); going on with the next",
                  self.name, which, ", ".join(segment_path(self.active, n).name for n in range(first, min(last, first + 2) + 1))
                  + (", …" if count > 3 else ""))

    # -- what is behind

    def backlog(self) -> tuple[int, float]:
        """(bytes not yet acknowledged, age in seconds of the oldest of them): the sizes of the files from the cursor's
        segment to the active file (stat-ed; the directory listing is the cached one)."""
        c = self.cursor
        if c.broken is not None or c.segment is None:
            return 0, 0.0
        total = 0
        files = [segment_path(self.active, n) for n in segment_numbers(self.active) if n >= c.segment] + [self.active]
        for path in files:
            with contextlib.suppress(OSError):
                total += os.stat(path).st_size
        total = max(total - c.offset, 0)  # the cursor's segment is one of those files
        if not total:
            return 0, 0.0
        oldest = None
        with contextlib.suppress(OSError, _Gone, ValueError, AttributeError):
            fd, _ = self._open(c.segment)
            if fd is not None:
                try:
                    head = os.pread(fd, 65536, c.offset)
                finally:
                    os.close(fd)
                line, newline, _ = head.partition(b"\n")
                if newline:
                    oldest = ocsf.millis(_parse(line).get("ts"))
        return total, max(0.0, time.time() - oldest / 1e3) if oldest else 0.0


# -- encoding ---------------------------------------------------------------------------------------


def severity(record: dict) -> tuple[int, str]:
    """The OTLP severity of a line: a failure ERROR (17), a denial or would-be denial WARN (13), else INFO (9)."""
    if record.get("kind") == "audit-resumed" or record.get("reason") in _FAILURES:
        return 17, "ERROR"
    if record.get("decision") in ("deny", "would-deny"):
        return 13, "WARN"
    return 9, "INFO"


# The request is written in protobuf's wire format here, field by field in field-number order (as the generated
# classes serialize it: the tests compare the bytes with theirs). ExportLogsServiceRequest{1: ResourceLogs{1: Resource
# {1: KeyValue…}, 2: ScopeLogs{1: InstrumentationScope{1: name}, 2: LogRecord…}}}; LogRecord{1: time_unix_nano fixed64,
# 2: severity_number, 3: severity_text, 5: body AnyValue{1: string}, 6: KeyValue{1: key, 2: AnyValue{1: string | 3: int}},
# 11: observed_time_unix_nano fixed64}.

_FIXED64 = struct.Struct("<Q")


def _varint(n: int) -> bytes:
    if 0 <= n < 16384:
        return _VARINTS[n]
    return _varint_slow(n)


def _varint_slow(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64: ten bytes of two's complement
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_VARINTS = [_varint_slow(n) for n in range(16384)]  # every length a line's fields have, looked up


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string, bytes or a message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _text_attribute(key: str, value: str) -> bytes:
    return _field(1, key.encode()) + _field(2, _field(1, value.encode()))


def _int_attribute(key: str, value: int) -> bytes:
    return _field(1, key.encode()) + _field(2, b"\x18" + _varint(value))


_SEVERITY_BYTES = {s: b"\x10" + _varint(s[0]) + _field(3, s[1].encode()) for s in ((17, "ERROR"), (13, "WARN"), (9, "INFO"))}
_UID_KEY = _field(1, b"log.record.uid")
_SEQ_KEY = _field(1, b"egresslaw.seq")
_UID_64 = b"\x32" + _varint(len(_UID_KEY) + 68) + _UID_KEY + b"\x12\x42\x0a\x40"  # KeyValue{log.record.uid: 64 hex digits}
_SEQ_PREFIX = {k: b"\x32" + _varint(len(_SEQ_KEY) + 3 + k) + _SEQ_KEY + b"\x12" + _varint(1 + k) + b"\x18" for k in range(1, 11)}
_LOG_ATTRIBUTES: dict[str | None, bytes] = {}  # per log id: the egresslaw.log attribute, whole
_CLASS_ATTRIBUTES: dict[int, bytes] = {}  # per class_uid: the ocsf.class_uid attribute, whole
_BODY_ASCII = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def body(projected: dict[str, Any]) -> bytes:
    """An OCSF record as the LogRecord's body: compact JSON, keys sorted, UTF-8 (the same record, the same bytes). A
    record orjson cannot write (an integer beyond 64 bits, a lone surrogate) is written by the stdlib, ASCII-escaped."""
    try:
        return orjson.dumps(projected, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # orjson.JSONEncodeError
        return _BODY_ASCII.encode(projected).encode("ascii")


def _log_record(line: Line, observed: bytes) -> bytes:
    record = line.record
    log_id = line.log_id
    projected = ocsf.project(record, log_id=log_id)
    text = body(projected)
    size = len(text)
    head = _VARINTS[size] if size < 16384 else _varint(size)
    mac = record["mac"].encode()
    uid = _UID_64 + mac if len(mac) == 64 else _field(6, _UID_KEY + _field(2, _field(1, mac)))
    seq = _varint(record["seq"])
    chain = _LOG_ATTRIBUTES.get(log_id)
    if chain is None:
        chain = _LOG_ATTRIBUTES[log_id] = _field(6, _text_attribute("egresslaw.log", ocsf.log_name(log_id)))
    class_uid = projected.get("class_uid")
    kind = _CLASS_ATTRIBUTES.get(class_uid)  # type: ignore[arg-type]
    if kind is None:
        kind = _field(6, _int_attribute("ocsf.class_uid", class_uid if type(class_uid) is int else 0))
        if type(class_uid) is int:
            _CLASS_ATTRIBUTES[class_uid] = kind
    ts = projected["time"] * 1_000_000  # the line's `ts`, parsed once, by the projection (0: not a time)
    value = size + len(head) + 1  # AnyValue{1: body}
    return b"".join((b"\x09" + _FIXED64.pack(ts) if ts else b"", _SEVERITY_BYTES[severity(record)],
                     b"\x2a", _VARINTS[value] if value < 16384 else _varint(value), b"\x0a", head, text,
                     uid, _SEQ_PREFIX[len(seq)], seq, chain, kind, observed))


def encode(lines: list[Line], *, front: str, instance: str) -> bytes:
    """The ExportLogsServiceRequest of one batch, serialized: one LogRecord per line, the OCSF record as its JSON body."""
    observed = b"\x59" + _FIXED64.pack(time.time_ns())
    scope = _field(1, _field(1, b"egresslaw.audit.export"))
    records = [_log_record(line, observed) for line in lines]
    scope_logs = scope + b"".join(b"\x12" + _varint(len(r)) + r for r in records)
    resource = b"".join(_field(1, _text_attribute(k, v)) for k, v in
                        (("service.name", "egresslaw"), ("service.instance.id", instance), ("egresslaw.front", front)))
    return _field(1, _field(1, resource) + _field(2, scope_logs))


# -- senders ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS files for grpcs/https: `ca` (trust), `cert`/`key` (a client certificate)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None


def _tls_bytes(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ExportError(f"cannot read {what} `{path}`: {exc.strerror or exc.__class__.__name__}", "check the path") from None


class HttpSender:
    """OTLP/HTTP protobuf over one persistent connection (made again after any failure)."""

    def __init__(self, target: Target, headers: tuple[tuple[str, str], ...], tls: Tls, timeout: float) -> None:
        self.target, self.timeout = target, timeout
        self._headers = {"Content-Type": "application/x-protobuf", **dict(headers)}
        self._context = check_tls(target, tls.ca, tls.cert, tls.key)
        self._conn: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:
        return f"HttpSender({self.target})"

    def send(self, body: bytes, *, timeout: float | None = None) -> tuple[int, str]:
        """Send one serialized request (within `timeout`, default the sender's); (rejected records, the collector's
        message about them). SendFailed otherwise, also for a 2xx answer that is no OTLP response (an auth gateway's
        page, say): its Content-Type must be application/x-protobuf or application/json, and its body parse."""
        for fresh in (False, True):
            reused = self._conn is not None
            if self._conn is None:
                if self._context is not None:
                    self._conn = http.client.HTTPSConnection(self.target.host, self.target.port, timeout=self.timeout, context=self._context)
                else:
                    self._conn = http.client.HTTPConnection(self.target.host, self.target.port, timeout=self.timeout)
            if timeout is not None:
                self._conn.timeout = min(timeout, self.timeout)
                if self._conn.sock is not None:
                    self._conn.sock.settimeout(self._conn.timeout)
            try:
                self._conn.request("POST", self.target.path, body=body, headers=self._headers)
                response = self._conn.getresponse()
                payload = response.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                if reused and not fresh and not isinstance(exc, TimeoutError):
                    continue  # the collector closed an idle kept-alive connection: once more on a new one
                raise SendFailed(f"collector unreachable: {_cause(exc)}") from None
        if response.will_close:
            self.close()
        if not 200 <= response.status < 300:
            raise SendFailed(f"collector answered HTTP {response.status}")
        return _otlp_answer(response.status, (response.getheader("Content-Type") or "").partition(";")[0].strip().lower(), payload)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


class GrpcSender:
    """OTLP/gRPC (`LogsService/Export`, the request serialized by `encode`): plaintext or TLS; headers as metadata."""

    def __init__(self, target: Target, headers: tuple[tuple[str, str], ...], tls: Tls, timeout: float) -> None:
        # Imported here: grpc loads only in the exporter process.
        import grpc
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

        self.target, self.timeout = target, timeout
        self._grpc = grpc
        self._metadata = tuple((name.lower(), value) for name, value in headers)
        address = f"[{target.host}]:{target.port}" if ":" in target.host else f"{target.host}:{target.port}"
        options = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", int(BACKOFF_MAX * 1000)), ("grpc.enable_retries", 0)]
        if target.tls:
            credentials = grpc.ssl_channel_credentials(root_certificates=_tls_bytes(tls.ca, "CA file"),
                                                       private_key=_tls_bytes(tls.key, "client key"),
                                                       certificate_chain=_tls_bytes(tls.cert, "client certificate"))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._export = self._channel.unary_unary("/opentelemetry.proto.collector.logs.v1.LogsService/Export",
                                                 request_serializer=None,  # the request is serialized already (encode)
                                                 response_deserializer=ExportLogsServiceResponse.FromString)

    def __repr__(self) -> str:
        return f"GrpcSender({self.target})"

    def send(self, body: bytes, *, timeout: float | None = None) -> tuple[int, str]:
        try:
            answer = self._export(body, timeout=min(timeout, self.timeout) if timeout is not None else self.timeout,
                                       metadata=self._metadata)
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else "UNKNOWN"
            raise SendFailed("collector unreachable: gRPC UNAVAILABLE" if name == "UNAVAILABLE" else f"collector answered gRPC {name}") from None
        return int(answer.partial_success.rejected_log_records), answer.partial_success.error_message[:200]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._channel.close()


def _otlp_answer(status: int, content_type: str, payload: bytes) -> tuple[int, str]:
    """(rejected records, message) of a 2xx answer's ExportLogsServiceResponse; SendFailed when it is none."""
    if content_type == "application/x-protobuf":
        # Imported here: the generated protobuf modules load only in the exporter process, never in the proxy's.
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

        answer = ExportLogsServiceResponse()
        try:
            answer.ParseFromString(payload)
        except DecodeError:
            raise SendFailed(f"collector answered HTTP {status} with a body that is no OTLP response") from None
        return int(answer.partial_success.rejected_log_records), answer.partial_success.error_message[:200]
    if content_type == "application/json":
        try:
            answer = _parse(payload) if payload.strip() else {}
            partial = answer.get("partialSuccess") or answer.get("partial_success") or {}
            rejected = int(partial.get("rejectedLogRecords") or partial.get("rejected_log_records") or 0)
            message = str(partial.get("errorMessage") or partial.get("error_message") or "")
        except (ValueError, TypeError, AttributeError):
            raise SendFailed(f"collector answered HTTP {status} with a body that is no OTLP response") from None
        return rejected, message[:200]
    raise SendFailed(f"collector answered HTTP {status} with Content-Type `{content_type[:60] or '(none)'}`, not an OTLP "
                     "response (is a gateway or a login page in the way?)")


def _cause(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failure ({exc.reason or exc.__class__.__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return exc.__class__.__name__


# -- the state file ---------------------------------------------------------------------------------


def default_state_dir(audit_log: str | os.PathLike[str]) -> Path:
    """`--state` by default: `<LOG>.export` beside the log."""
    root = Path(audit_log)
    return root.with_name(root.name + ".export")


def read_state(state_dir: str | os.PathLike[str]) -> dict | None:
    """The exporter's `state.json` (None: none yet, or unreadable)."""
    try:
        state = json.loads((Path(state_dir) / "state.json").read_bytes())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("v") == STATE_VERSION else None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# -- the exporter -----------------------------------------------------------------------------------


@dataclass
class _Counters:
    exported: int = 0
    rejected: int = 0
    failures: int = 0
    gaps: int = 0
    last_success: float | None = None
    last_error: str | None = None


class Exporter:
    """Exports every chain of `audit_log` to `target`, one acknowledged batch at a time, from its checkpoint on."""

    def __init__(self, audit_log: str | os.PathLike[str], target: Target, *, state_dir: str | os.PathLike[str] | None = None,
                 headers: tuple[tuple[str, str], ...] = (), ca: str | os.PathLike[str] | None = None,
                 cert: str | os.PathLike[str] | None = None, key: str | os.PathLike[str] | None = None,
                 front: str = "edge", instance: str | None = None, timeout: float = SEND_TIMEOUT) -> None:
        if front not in ("edge", "lane"):
            raise ExportError(f"`--front` `{front}` is neither `edge` nor `lane`")
        check_tls(target, ca, cert, key)  # what check_options checks, on the parsed target and headers
        check_headers(target, tuple(headers))
        for name, value in headers:
            if not _TOKEN.fullmatch(name) or not _VALUE.fullmatch(value):
                raise ExportError(f"header `{name if _TOKEN.fullmatch(name) else '?'}` is not a header name with a visible-ASCII value "
                                  "(the value is not shown)", "see `--headers`")
        self.log_path = Path(audit_log)
        self.target = target
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir(audit_log)
        self._headers = tuple(headers)
        self._tls = Tls(Path(ca) if ca else None, Path(cert) if cert else None, Path(key) if key else None)
        self.front = front
        self.instance = instance or socket.gethostname()
        self.timeout = timeout
        self.readers: dict[str, ChainReader] = {}
        self.counters = _Counters()
        self._down_since: float | None = None
        self._behind_after_outage = False
        self._state_at = 0.0
        self._rejected_said = -REJECTED_LOG_SECONDS
        self._drain_until: float | None = None  # set when `stop` is seen: the end of the last attempts
        self._lock_fd: int | None = None

    def __repr__(self) -> str:
        return f"Exporter({str(self.log_path)!r}, {str(self.target)!r}, headers={len(self._headers)})"

    # -- start and stop

    def _make_sender(self) -> HttpSender | GrpcSender:
        if self.target.grpc:
            return GrpcSender(self.target, self._headers, self._tls, self.timeout)
        return HttpSender(self.target, self._headers, self._tls, self.timeout)

    def _lock(self, stop: threading.Event) -> bool:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.state_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ExportError(f"cannot use state directory `{self.state_dir}`: {exc.strerror or exc.__class__.__name__}",
                              "give a writable directory with `--state`") from None
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
                return True
            except BlockingIOError:
                if not said:
                    log.info("audit export: another exporter holds `%s`; waiting for it", self.state_dir / "lock")
                    said = True
                if stop.wait(0.5):
                    os.close(fd)
                    return False

    def _load(self) -> None:
        state = read_state(self.state_dir) or {}
        c = self.counters
        for name in ("exported", "rejected", "failures", "gaps"):
            value = state.get(name)
            setattr(c, name, value if isinstance(value, int) else 0)
        c.last_success = state.get("last_success") if isinstance(state.get("last_success"), (int, float)) else None
        c.last_error = state.get("last_error") if isinstance(state.get("last_error"), str) else None
        for name, saved in (state.get("chains") or {}).items():
            if not isinstance(saved, dict) or "/" in name:
                continue
            cursor = Cursor(saved.get("log"), saved.get("segment"), int(saved.get("offset") or 0), saved.get("seq"), saved.get("mac"),
                            saved.get("broken"))
            reader = ChainReader(self.log_path.with_name(name), cursor)
            if not reader.anchored():
                reader.restart("no longer holds the line its checkpoint names (replaced or cut back)")
            self.readers[name] = reader

    def _discover(self) -> list[ChainReader]:
        for active in chains(self.log_path):
            if active.name not in self.readers:
                self.readers[active.name] = ChainReader(active, Cursor())
        return list(self.readers.values())

    def state(self) -> dict[str, Any]:
        """The state as `state.json` holds it (backlog and lag measured now)."""
        out: dict[str, Any] = {}
        for name, reader in self.readers.items():
            behind, lag = reader.backlog()
            out[name] = {**reader.cursor.state(), "backlog_bytes": behind, "lag_seconds": round(lag, 3)}
            out[name] = {k: out[name][k] for k in ("log", "segment", "offset", "seq", "mac", "backlog_bytes", "lag_seconds", "broken")}
        c = self.counters
        return {"v": STATE_VERSION, "chains": out, "exported": c.exported, "rejected": c.rejected, "failures": c.failures,
                "gaps": c.gaps + sum(r.gaps for r in self.readers.values()), "last_success": c.last_success,
                "last_error": c.last_error, "updated": time.time(), "pid": os.getpid()}

    def _save(self) -> dict[str, Any]:
        state = self.state()
        _write_atomic(self.state_dir / "state.json", json.dumps(state, sort_keys=True).encode())
        self._state_at = time.monotonic()
        return state

    def _behind(self) -> int:
        return sum(r.backlog()[0] for r in self.readers.values())

    # -- the loop

    def run(self, stop: threading.Event, *, follow: bool, deadline: float | None = None) -> int:
        """Export until caught up (`follow`: until `stop`); 0 done or stopped, 1 not caught up by `deadline`
        (a `time.monotonic()` value)."""
        if not follow and not chains(self.log_path):
            raise ExportError(f"audit log `{self.log_path}` does not exist, and no worker chains "
                              f"(`{worker_audit_path(self.log_path, 1).name}`, …) are beside it",
                              "give the path the proxy's `--audit-log` names (with `--follow`, the exporter waits for it)")
        if not self._lock(stop):
            return 0
        try:
            self._load()
            for reader in self.readers.values():  # fold the gaps counted so far into the cumulative counter
                self.counters.gaps += reader.gaps
                reader.gaps = 0
            with contextlib.suppress(OSError):
                self._save()  # at once: the state (and the front end's `up`) says this exporter runs before its first send
            sender = self._make_sender()
            if self._headers and not self.target.tls:
                log.warning("audit export: header(s) %s are sent in plaintext to `%s` (use grpcs:// or https:// to protect them)",
                            ", ".join(sorted({name for name, _ in self._headers})), self.target)
            try:
                return self._loop(sender, stop, follow=follow, deadline=deadline)
            finally:
                sender.close()
                with contextlib.suppress(OSError):
                    self._save()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _loop(self, sender: HttpSender | GrpcSender, stop: threading.Event, *, follow: bool, deadline: float | None) -> int:
        while True:
            progressed = False
            now = time.monotonic()
            wake = now + POLL_SECONDS
            for reader in self._discover():
                if follow and reader.not_before > now and not stop.is_set():  # let its next batch fill
                    wake = min(wake, reader.not_before)
                    continue
                lines = reader.read()
                if not lines:
                    continue
                result = self._deliver(sender, lines, stop, follow=follow, deadline=deadline)
                if result is None:
                    return 0 if follow or stop.is_set() else 1
                rejected, message = result
                reader.advance(lines)
                full = len(lines) >= MAX_LINES or sum(len(line.raw) + 1 for line in lines) >= MAX_BYTES // 2
                reader.not_before = 0.0 if full else time.monotonic() + LINGER_SECONDS
                c = self.counters
                c.exported += len(lines)
                c.last_success = time.time()
                if rejected:
                    c.rejected += rejected
                    if time.monotonic() - self._rejected_said >= REJECTED_LOG_SECONDS:  # a collector refusing every batch: not a line each
                        self._rejected_said = time.monotonic()
                        log.warning("audit export: the collector acknowledged but rejected %d of %d record(s) (%d so far; not sent again)%s",
                                    rejected, len(lines), c.rejected, f": {message}" if message else "")
                if time.monotonic() - self._state_at >= STATE_SECONDS:  # (and at the end: run's finally)
                    self._save()
                progressed = True
            if self._behind_after_outage and not progressed:  # every chain read to its end (a lingering one was, at its last read)
                self._behind_after_outage = False
                log.info("audit export: caught up with the audit log again (collector `%s`)", self.target)
            if stop.is_set():
                # Stopping: what is written is sent (one attempt per batch) until done, a send fails, or the send timeout
                # since the signal has passed; then the checkpoint (run's finally).
                if self._drain_until is None:
                    self._drain_until = time.monotonic() + self.timeout
                if not progressed or time.monotonic() >= self._drain_until:
                    return 0
                continue
            if not progressed:
                if not follow:
                    return 0
                if time.monotonic() - self._state_at >= STATE_SECONDS:
                    self._save()
                stop.wait(max(0.0, wake - time.monotonic()))
            if deadline is not None and not follow and time.monotonic() > deadline:
                return 1

    def _deliver(self, sender: HttpSender | GrpcSender, lines: list[Line], stop: threading.Event, *, follow: bool,
                 deadline: float | None) -> tuple[int, str] | None:
        """Send one batch until it is acknowledged; None if `stop` (after one last attempt) or `deadline` came first."""
        request = encode(lines, front=self.front, instance=self.instance)
        delay = BACKOFF_FIRST
        while True:
            last = stop.is_set()
            timeout = None
            if last:  # one last attempt, within what is left of the send timeout since the signal
                if self._drain_until is None:
                    self._drain_until = time.monotonic() + self.timeout
                timeout = self._drain_until - time.monotonic()
                if timeout <= 0:
                    return None
            try:
                result = sender.send(request, timeout=timeout)
            except SendFailed as exc:
                c = self.counters
                c.failures += 1
                c.last_error = exc.message
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    log.warning("audit export: %s (`%s`); %d byte(s) of audit log behind, retrying with backoff up to %g s",
                                exc.message, self.target, self._behind(), BACKOFF_MAX)
                if last or (deadline is not None and time.monotonic() >= deadline):
                    return None
                if time.monotonic() - self._state_at >= STATE_SECONDS:
                    with contextlib.suppress(OSError):
                        self._save()
                stop.wait(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            if self._down_since is not None:
                self._down_since = None
                self._behind_after_outage = True
            return result
