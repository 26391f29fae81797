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
    Git,
    GraphQL,
    Mcp,
    Param,
    Rule,
    SandboxProfile,
    Segment,
    Tool,
    Value,
    Worker,
    canonical_json,
    sha256_hex,
)
from compiler.budget import budget_widening
from compiler.errors import CompilerError
from compiler.patterns import matches, parse_pattern

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


# ---------------------------------------------------------------------------------------------
# Request shapes and widening. The prover takes a rule's shapes as free inputs (docs/shapes.md, "Left out"), so its
# semantic diff cannot see a shape change; this check does, syntactically and conservatively: a change to a rule's
# shapes counts as widening unless it is proved narrower here. Narrower: a shape added; a tool, field, method, ref
# pattern, persisted hash, query parameter or enum value removed; a constraint added or tightened; a smaller
# max_body. Widening: a shape removed, and any change this code does not prove narrower (a new pattern, a pattern
# beside a former enum, a template of another length, ...), even when it happens to admit nothing new.


def shape_widenings(previous: Artifact, current: Artifact) -> list[tuple[str, str]]:
    """(subject, what widened) for each connection of `current` whose rule shapes admit what `previous`'s did not
    (or what this check cannot prove they did not). A rule is compared with the published rule of its name, or,
    when there is none, with the published rules on its host and port (it must be narrower than one of them)."""
    found = []
    for conn in current.connections:
        old = previous.connection(conn.name)
        if old is None:
            continue
        by_name = {r.name: r for r in old.rules}
        for rule in conn.rules:
            same_host = [r for r in old.rules if (r.host, r.port) == (rule.host, rule.port)]
            candidates = [by_name[rule.name]] if rule.name in by_name else same_host
            if not candidates:
                continue  # a new destination: the prover's diff names it
            reasons = [_rule_widens(o, rule) for o in candidates]
            if all(reasons):
                found.append((f"connection:{conn.name}", f"rule `{rule.name}` {reasons[0]}"))
    return found


def budget_widenings(previous: Artifact, current: Artifact) -> list[tuple[str, str]]:
    """(subject, what widened) for each profile and connection of `current` whose budget (docs/budget.md) may admit
    more in a published window than its published version's: a budget or a cap dropped, a cap raised, or a window
    shortened with its cap kept (`compiler.budget.budget_widening`). Lowering a cap is not a widening."""
    found = []
    for kind, subjects, published in (
        ("sandbox_profile", current.sandbox_profiles, previous.profile),
        ("connection", current.connections, previous.connection),
    ):
        for subject in subjects:
            old = published(subject.name)
            why = budget_widening(old.budget, subject.budget) if old is not None else None
            if why:
                found.append((f"{kind}:{subject.name}", why))
    return found


def _rule_widens(old: Rule, new: Rule) -> str | None:
    """Why `new`'s shapes may admit a request `old`'s refuse (None: proved narrower or equal)."""
    if old.template is not None and (new.template is None or not _template_narrower(old.template, new.template)):
        return "drops or changes its path template" if new.template is not None else "drops its path template"
    if old.query is not None and (new.query is None or not _params_narrower(old.query, new.query, keep=False)):
        return "drops or loosens its `query` shape"
    if old.header_values and not _params_narrower(old.header_values, new.header_values, keep=True):
        return "drops or loosens a `header_values` entry"
    for kind, narrower in (("mcp", _mcp_narrower), ("graphql", _graphql_narrower), ("git", _git_narrower)):
        before, after = getattr(old, kind), getattr(new, kind)
        if before is not None and (after is None or not narrower(before, after)):
            return f"drops or loosens its `{kind}` shape"
    if (new.max_body or DEFAULT_MAX_BODY) > (old.max_body or DEFAULT_MAX_BODY) and (old.mcp or old.graphql or old.git):
        return "reads larger bodies (`max_body`)"
    return None


DEFAULT_MAX_BODY = 1024 * 1024


def _template_narrower(old: tuple[Segment, ...], new: tuple[Segment, ...]) -> bool:
    if len(old) != len(new):
        return False
    for o, n in zip(old, new):
        if o == n:
            continue
        if o.value is None or (n.value is not None and not value_narrower(o.value, n.value)):
            return False  # a literal became something else, or a variable loosened
        if n.value is None and not _admits_segment(o.value, n.literal or ""):
            return False
    return True


def _admits_segment(value: Value, segment: str) -> bool:
    if not segment:
        return False
    if value.type == "integer":
        canonical = segment == str(int(segment)) if segment.lstrip("-").isdigit() else False
        return canonical and admits(value, int(segment))
    return admits(value, segment)


def _params_narrower(old: tuple[Param, ...], new: tuple[Param, ...], keep: bool) -> bool:
    """`keep`: every old name must stay constrained (header values: an unlisted header value is free); otherwise a
    name dropped is narrower (the query: an unlisted parameter is refused)."""
    before = {p.name: p.value for p in old}
    after = {p.name: p.value for p in new}
    if keep:
        return all(name in after and value_narrower(v, after[name]) for name, v in before.items())
    return all(name in before and value_narrower(before[name], v) for name, v in after.items())


def value_narrower(old: Value, new: Value) -> bool:
    """Whether every value `new` admits, `old` admits too (False when not proved)."""
    if old == new:
        return True
    if new.enum is not None:  # the enum is all `new` admits: each value must be one `old` admits
        return all(admits(old, v) for v in new.enum)
    if old.type != "any" and new.type != old.type or old.enum is not None:
        return False
    if old.pattern is not None and new.pattern != old.pattern:
        return False
    if old.max_length is not None and (new.max_length is None or new.max_length > old.max_length):
        return False
    if old.minimum is not None and (new.minimum is None or new.minimum < old.minimum):
        return False
    return old.maximum is None or new.maximum is not None and new.maximum <= old.maximum


def admits(value: Value, item: object) -> bool:
    """Whether the scalar `item` satisfies `value` (`compiler.patterns` for a pattern)."""
    kinds = {"string": str, "boolean": bool, "null": type(None)}
    if value.type == "integer":
        if not isinstance(item, int) or isinstance(item, bool):
            return False
    elif value.type in kinds:
        if not isinstance(item, kinds[value.type]):
            return False
    elif value.type != "any":
        return False  # an array or object is never an enum's scalar
    if value.enum is not None and not any(type(item) is type(e) and item == e for e in value.enum):
        return False
    if isinstance(item, str):
        if value.pattern is not None and not matches(parse_pattern(value.pattern), item):
            return False
        if value.max_length is not None and len(item) > value.max_length:
            return False
    if isinstance(item, int) and not isinstance(item, bool):
        if value.minimum is not None and item < value.minimum or value.maximum is not None and item > value.maximum:
            return False
    return True


def _tool_narrower(old: Tool, new: Tool) -> bool:
    before = {a.name: a.value for a in old.arguments}
    for arg in new.arguments:
        if arg.name in before:
            if not value_narrower(before[arg.name], arg.value):
                return False
        elif not old.additional or arg.name in old.forbidden:
            return False
    after = {a.name for a in new.arguments}
    if new.additional:
        # keys outside `arguments` take any value: old must have let them, and constrained none of them
        if not old.additional or not set(old.forbidden) <= set(new.forbidden):
            return False
        if any(name not in after and name not in new.forbidden for name in before):
            return False
    for name in old.forbidden:  # a forbidden key stays refused
        if name in after:
            return False
    return set(old.required) <= set(new.required)


def _mcp_narrower(old: Mcp, new: Mcp) -> bool:
    tools = {t.name: t for t in old.tools}
    return (set(new.methods) <= set(old.methods) and (old.responses or not new.responses)
            and all(t.name in tools and _tool_narrower(tools[t.name], t) for t in new.tools))


def _graphql_narrower(old: GraphQL, new: GraphQL) -> bool:
    return (all(set(getattr(new, k)) <= set(getattr(old, k)) for k in ("query", "mutation", "subscription", "persisted"))
            and (old.introspection or not new.introspection))


def _git_narrower(old: Git, new: Git) -> bool:
    # Ref patterns compare as text: a new pattern, even one a published pattern covers, is not proved narrower.
    return (set(new.push) <= set(old.push) and (old.fetch or not new.fetch) and (old.create or not new.create)
            and (old.delete or not new.delete))
