"""`egresslaw audit verify`: every log at a path, the chains of a proxy's workers checked as one record.

A file is one log; a directory holds one log or several (the chains of `--workers N`, `audit.wI.jsonl`);
with `recursive`, so do its subdirectories (several replicas shipped side by side). Without it a
subdirectory is never read: another run's logs there (under another audit key) are not this run's. Each chain is walked by
`egress_proxy.audit.log.verify_segments`; a worker's chain missing beside the others is a broken result.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from egress_proxy.audit.log import (
    FORMAT,
    SEGMENT_NAME,
    AuditError,
    VerifyResult,
    looks_like_audit,
    segment_files,
    verify_segments,
)

WORKER_EVENT = "worker"  # audit event a worker writes first in each run: its number and how many workers there are
AUDIT_MARKER = f'"v":"{FORMAT}"'.encode()  # on every line of an audit log (canonical JSON: no spaces)
DAMAGE_SCAN_BYTES = 1 << 16  # how far into a file whose first line is damaged the marker is looked for
JSONL_NAME = re.compile(r".+\.jsonl(?:\.\d{6,})?")  # `audit.jsonl` and its rotated segments


# -- audit logs: one chain per worker --------------------------------------------------------------


def worker_audit_path(audit_log: str | os.PathLike[str], index: int) -> Path:
    """Where worker `index` writes its chain: `audit.jsonl` -> `audit.w2.jsonl` (`audit` -> `audit.w2`)."""
    path = Path(audit_log)
    return path.with_name(f"{path.stem}.w{index}{path.suffix}") if path.suffix else path.with_name(f"{path.name}.w{index}")


def _worker_log_name(audit_log: Path) -> re.Pattern[str]:
    stem, suffix = (audit_log.stem, audit_log.suffix) if audit_log.suffix else (audit_log.name, "")
    return re.compile(re.escape(stem) + r"\.w(\d+)" + re.escape(suffix) + r"(?:\.\d{6,})?")


def audit_logs(path: str | os.PathLike[str], *, recursive: bool = False) -> list[list[tuple[Path, int | None]]]:
    """The logs at `path`, each as the segments to walk in order (see `audit.segment_files`).

    A file is one log. A directory holds one log or several (the chains of a proxy's workers), grouped by name;
    with `recursive`, so do its subdirectories (the directories of several replicas, shipped side by side). A path that does
    not exist but names an `--audit-log` whose workers wrote `NAME.wI.SUFFIX` files beside it means those logs."""
    root = Path(path)
    if root.is_file():
        return [segment_files(root)]
    if root.is_dir():
        subdirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: _natural(str(p)))
        folders = [root, *subdirs] if recursive else [root]
        found = [log for folder in folders for log in _logs_in(folder, [p for p in folder.iterdir() if p.is_file()])]
        if not found:
            more = (" (its subdirectories hold logs: `--recursive` checks them too)"
                    if not recursive and any(_logs_in(d, [p for p in d.iterdir() if p.is_file()]) for d in subdirs) else "")
            raise AuditError(f"`{root}` holds no audit log{more}; give the file, or a directory holding audit logs")
        return found
    pattern = _worker_log_name(root)
    files = [p for p in root.parent.iterdir() if p.is_file() and pattern.fullmatch(p.name)] if root.parent.is_dir() else []
    if not files:
        raise AuditError(f"audit log `{root}` does not exist, and no worker logs (`{worker_audit_path(root, 1).name}`, …) are beside it")
    return _logs_in(root.parent, files)


def _logs_in(folder: Path, files: list[Path]) -> list[list[tuple[Path, int | None]]]:
    """The logs among `files` (all in `folder`): numbered segments grouped under their active file's name."""
    numbered: dict[str, dict[int, Path]] = {}
    for p in files:
        if m := SEGMENT_NAME.fullmatch(p.name):
            numbered.setdefault(m.group(1), {})[int(m.group(2))] = p
    groups: dict[str, list[tuple[Path, int | None]]] = {}
    for base, parts in numbered.items():
        segments: list[tuple[Path, int | None]] = [(parts[n], n) for n in sorted(parts)]
        if _audit_like(segments[0][0]):
            groups[base] = segments + ([(folder / base, None)] if (folder / base).is_file() else [])
    for p in files:
        if p.name not in groups and not SEGMENT_NAME.fullmatch(p.name) and _audit_like(p):
            groups[p.name] = [(p, None)]
    return [groups[name] for name in sorted(groups, key=_natural)]


def _audit_like(path: Path) -> bool:
    """An audit log, intact or damaged: one is recognised by its first line, so a log whose first line was damaged
    (not JSON, a flipped bit, cut short, the file emptied) is recognised by what remains, and then verified, which
    names the file, the line and what is wrong, instead of being passed over as "no audit log"."""
    return looks_like_audit(path) or _damaged_audit(path)


def _damaged_audit(path: Path) -> bool:
    """The audit format's marker on a later line (every line carries it), or a `*.jsonl` name (the name the docs and
    `propose` give audit logs) on a file whose first line is no JSON object: empty, cut short or unparseable."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(DAMAGE_SCAN_BYTES)
    except OSError:
        return False
    first, newline, rest = head.partition(b"\n")
    if newline and AUDIT_MARKER in rest:
        return True
    if not JSONL_NAME.fullmatch(path.name):
        return False
    try:
        return not isinstance(json.loads(first), dict)
    except ValueError:  # not JSON, not UTF-8, cut in the middle, or no line at all
        return True


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def verify_logs(path: str | os.PathLike[str], *, key: Any = None, recursive: bool = False) -> list[tuple[str, Any]]:
    """Verify every log at `path` (`audit_logs`), each on its own chain: [(log name, VerifyResult)].

    The chains of one proxy's workers are one record: each worker's run starts with a `worker` event naming
    how many workers there are, so a chain missing beside the others (deleted, or not shipped) is reported
    as a broken result of its own (unless `path` is one file: then only that chain is checked)."""
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    out = []
    expected: dict[Path, int] = {}  # active file of worker 1's chain -> how many workers its proxy ran
    present: set[Path] = set()
    for segments in audit_logs(path, recursive=recursive):
        active = segments[-1][0] if segments[-1][1] is None else segments[-1][0].with_suffix("")
        name = str(active.relative_to(root)) if active.is_relative_to(root) else active.name
        out.append((name, verify_segments(segments, key=key)))
        present.add(active)
        said = None if Path(path).is_file() else _workers_said(segments)  # one file given: that chain only
        if said is not None:
            index, workers = said
            base = _base_log(active, index)
            if base is not None:
                expected[base] = max(expected.get(base, 0), workers)
    for base, workers in expected.items():
        for index in range(1, workers + 1):
            missing = worker_audit_path(base, index)
            if missing not in present:
                name = str(missing.relative_to(root)) if missing.is_relative_to(root) else missing.name
                out.append((name, VerifyResult("broken", 0, 0, str(missing), None,
                                               f"missing: the chains beside it say their proxy ran {workers} workers, and worker {index}'s "
                                               "chain is not here (deleted, or not shipped)")))
    return out


def _workers_said(segments: list[tuple[Path, int | None]]) -> tuple[int, int] | None:
    """(worker, workers) of the last `worker` event in a chain (None: not a worker's chain)."""
    found = None
    needle = f'"kind":"{WORKER_EVENT}"'.encode()
    for path, _ in segments:
        with contextlib.suppress(OSError), open(path, "rb") as fh:
            for line in fh:
                if needle in line:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        record = json.loads(line)
                        found = (int(record["worker"]), int(record["workers"]))
    return found


def _base_log(active: Path, index: int) -> Path | None:
    """The configured `--audit-log` path a worker's chain file belongs to (`audit.w2.jsonl` -> `audit.jsonl`)."""
    m = re.fullmatch(rf"(.+)\.w{index}(\.[^.]*)?", active.name)
    if m is None:
        return None
    return active.with_name(m.group(1) + (m.group(2) or ""))
