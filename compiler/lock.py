"""`egresslaw.lock`: the published version of every profile and connection, pinned by hash.

A subject's hash covers its compiled model and the worker that judges its addresses, so a catalog
or worker change reaches a published subject only as a new version, visible in review.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from compiler.artifact import (
    Artifact,
    Connection,
    SandboxProfile,
    Worker,
    canonical_json,
    sha256_hex,
)
from compiler.errors import CompilerError

LOCK_FORMAT = "egresslaw.lock/1"
LOCK_NAME = "egresslaw.lock"


class LockError(CompilerError):
    """The lock file is unreadable or malformed."""


@dataclass(frozen=True)
class Change:
    """One subject whose published state differs from what the policy now compiles to."""

    key: str  # "connection:<name>" or "sandbox_profile:<name>"
    kind: str  # "new" | "changed" | "removed"
    old_version: int | None
    new_version: int | None
    hosts_added: tuple[str, ...] = ()
    hosts_removed: tuple[str, ...] = ()


@dataclass
class LockResult:
    artifact: Artifact  # with published versions filled in
    lock: dict  # the lock to write
    changes: list[Change] = field(default_factory=list)
    previous: Artifact | None = None  # the published state, rebuilt from the lock (None without a lock)


def lock_path(policy_path: str | Path) -> Path:
    """The lock lives next to the policy: `egresslaw.lock` inside a policy directory; `<file>.lock`
    beside a single-file policy (which shares its directory with other policies, so a shared
    `egresslaw.lock` would tombstone their subjects)."""
    p = Path(policy_path)
    return p / LOCK_NAME if p.is_dir() else p.with_name(p.name + ".lock")


def read_lock(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LockError(f"`{path}` is not a readable lock file ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or data.get("format") != LOCK_FORMAT or not isinstance(data.get("subjects"), dict):
        raise LockError(f"`{path}` is not an `{LOCK_FORMAT}` lock file")
    return data


def render_lock(lock: dict) -> str:
    return json.dumps(lock, indent=2, sort_keys=True) + "\n"


def _hosts(subject: Connection | SandboxProfile) -> list[str]:
    if isinstance(subject, Connection):
        return sorted({f"{r.host}:{r.port}" for r in subject.rules})
    return sorted({f"{h.host}:{h.port}" for h in subject.network.allowed_hosts})


def _worker_of(artifact: Artifact, subject: Connection | SandboxProfile) -> Worker:
    name = subject.worker if isinstance(subject, Connection) else "default"
    return artifact.worker(name)


def _entry(artifact: Artifact, key: str, subject: Connection | SandboxProfile) -> dict:
    model = subject.model_dump(mode="json", exclude={"version"})
    worker = _worker_of(artifact, subject).model_dump(mode="json")
    hashed = {"subject": model, "worker": worker}
    if isinstance(subject, SandboxProfile) and subject.brokers:
        # What a brokering profile's requests may carry is part of what it is: a brokered connection (or its
        # worker) that changes makes the profile a new version too.
        hashed["brokered"] = {name: _brokered(artifact, name) for name in subject.brokers}
    return {
        "hash": sha256_hex(canonical_json(hashed)),
        "catalog": artifact.catalog.version,
        "hosts": _hosts(subject),
        "model": model,
        "worker": worker,
    }


def _brokered(artifact: Artifact, name: str) -> dict | None:
    conn = artifact.connection(name)
    if conn is None:
        return None
    worker = artifact.worker(conn.worker)
    return {"subject": conn.model_dump(mode="json", exclude={"version"}), "worker": worker.model_dump(mode="json") if worker else None}


def apply_lock(artifact: Artifact, lock: dict | None) -> LockResult:
    """Fill in published versions, bumping where a subject's hash changed, and list every change."""
    old_subjects = (lock or {}).get("subjects", {})
    subjects: dict[str, dict] = {}
    changes: list[Change] = []
    new_profiles = []
    new_connections = []
    for kind, items, out in (
        ("sandbox_profile", artifact.sandbox_profiles, new_profiles),
        ("connection", artifact.connections, new_connections),
    ):
        for subject in items:
            key = f"{kind}:{subject.name}"
            entry = _entry(artifact, key, subject)
            old = old_subjects.get(key)
            if old is None or old.get("removed"):
                version = int(old["version"]) + 1 if old else 1
                changes.append(Change(key, "new", None, version, tuple(entry["hosts"]), ()))
            elif old.get("hash") == entry["hash"]:
                version = int(old["version"])
            else:
                version = int(old["version"]) + 1
                before, after = set(old.get("hosts", ())), set(entry["hosts"])
                changes.append(Change(key, "changed", int(old["version"]), version, tuple(sorted(after - before)), tuple(sorted(before - after))))
            entry["version"] = version
            subjects[key] = entry
            out.append(subject.model_copy(update={"version": version}))
    for key, old in sorted(old_subjects.items()):
        if key not in subjects and not old.get("removed"):
            changes.append(Change(key, "removed", int(old["version"]), None, (), tuple(old.get("hosts", ()))))
            subjects[key] = {"removed": True, "version": int(old["version"]), "hash": old.get("hash"), "hosts": []}
        elif key not in subjects:
            subjects[key] = old
    versioned = artifact.model_copy(
        update={"sandbox_profiles": tuple(new_profiles), "connections": tuple(new_connections), "digest": ""}
    ).sealed()
    new_lock = {"format": LOCK_FORMAT, "catalog": artifact.catalog.version, "subjects": subjects}
    previous = _previous_artifact(artifact, lock) if lock is not None else None
    return LockResult(versioned, new_lock, sorted(changes, key=lambda c: c.key), previous)


def _previous_artifact(current: Artifact, lock: dict) -> Artifact | None:
    """The published state as an artifact (for the semantic widening check); None if the lock can't say."""
    try:
        profiles, connections, workers = [], [], {}
        for key, entry in sorted(lock["subjects"].items()):
            if entry.get("removed"):
                continue
            kind, _, _ = key.partition(":")
            worker = Worker.model_validate(entry["worker"])
            if kind == "connection":
                conn = Connection.model_validate({**entry["model"], "version": entry["version"]})
                connections.append(conn)
                workers.setdefault(conn.worker, worker)
            else:
                profiles.append(SandboxProfile.model_validate({**entry["model"], "version": entry["version"]}))
                workers.setdefault("default", worker)
        workers.setdefault("default", Worker(name="default"))
        return current.model_copy(
            update={
                "workers": tuple(workers[n] for n in sorted(workers)),
                "sandbox_profiles": tuple(profiles),
                "connections": tuple(connections),
                "source_digest": "published-lock",
                "digest": "",
            }
        ).sealed()
    except Exception:  # an old or hand-edited lock without models: no semantic comparison possible
        return None
