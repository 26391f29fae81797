"""Denials become a proposed policy change: audit events -> the smallest edit of the `.egress` sources that admits them.

Pipeline: `audit_files` / `read_denials` (the evidence, exact: a line that does not read is an error naming file
and line) -> `propose` (classify each denial against the compiled policy, group, edit the source text, format with
`fmt`'s layout, compile the result in memory) -> `Proposal` (changes with their evidence, what cannot be proposed
and why, the new sources and their unified diff). Only what a policy change can fix is proposed: a profile's
`host:port`, a connection's host, port, method or path. Everything else (leases, addresses, framing, credentials,
plain-HTTP connection traffic) is listed as not proposable and never turned into a widening.

The smallest change: a profile gets the exact `host:port` entries it was denied; a connection gets one new rule per
(host, port), appended after its rules (rule order is semantic: an appended rule never changes which rule admits a
request admitted before), with the observed methods, the narrowest segment-bounded prefix covering every observed
path, and the observed header names the language allows. Verifying the log's chain (`--keys`) is the CLI's job: this
module reads files, never keys.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from compiler.compile import CompileResult, compile_sources
from compiler.constants import MAX_RULES_PER_CONNECTION, METHODS, header_is_denylisted
from compiler.diagnostics import render_text
from compiler.errors import CompilerError
from compiler.fmt import FormatError, format_source
from compiler.normalize import PathError, normalize_path, normalize_prefix, prefix_matches
from compiler.parser import parse_source
from compiler.passes import admit_host
from compiler.secrets_scan import SECRET_PREFIXES, secret_kind
from compiler.syntax import NO_SPAN, ListV, Named, Obj, SourceFile

DENIED = ("deny", "would-deny")  # `would-deny`: an observe-mode profile forwarded it, but would have denied it
DECISION_KINDS = ("request", "connect")

# The denial reasons a policy change can fix, and the kind of subject that can be denied with each
# (egress_proxy/decision/reasons.py holds every code; these are the core's destination and rule misses).
PROPOSABLE = {
    "profile-host-not-allowed": "profile",
    "no-matching-rule": "connection",
    "path-not-allowed": "connection",
    "method-not-allowed": "connection",
}

# Why the other denials are never proposed, by reason family (first match: exact code, then prefix).
_NOT_PROPOSABLE: tuple[tuple[str, str], ...] = (
    ("scheme-not-allowed", "connection traffic is https only: a credential is only ever attached over TLS, so a "
                           "plain-HTTP request is fixed in the caller (use https), never in the policy"),
    ("lease-", "a lease problem (who is asking), not where the request went: mint a valid lease on the trusted side"),
    ("address-", "the worker refused the destination's addresses; an allowlist never admits a non-public or denied "
                 "address (a worker's `allow_cidrs` is a separate, proved decision)"),
    ("ipv6-disabled", "the worker refuses IPv6 answers; that is a worker setting, not an allowlist entry"),
    ("ip-literal-refused", "the request named an IP literal; policies name hosts"),
    ("resolve-failed", "the host did not resolve; nothing in the policy changes that"),
    ("self-connection", "the destination is the proxy itself"),
    ("credential-", "a credential problem: fixed in custody, not in policy"),
    ("custody-", "a credential problem: fixed in custody, not in policy"),
    ("host-", "the request's host is malformed or non-canonical; the request is fixed, not the policy"),
    ("path-", "the request's path is malformed or non-canonical; the request is fixed, not the policy"),
    ("worker-unknown", "the artifact the proxy ran is inconsistent; recompile and prove it"),
    ("lease-unknown-subject", "the lease names a subject the artifact does not contain"),
)
_DEFAULT_WHY = "a refusal of the request's framing, headers, size or the proxy's state: no policy entry admits it"

JSON_EVENTS = 50  # event ids kept per change in the JSON form (the count is always exact)
_LEASE = re.compile(r"\bel\d\.[A-Za-z0-9_\-.]{12,}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # with fullmatch: `$` would admit a trailing newline


class ProposeError(CompilerError):
    """The evidence cannot be read exactly (a malformed line, a missing directory), or the proposal does not compile."""


@dataclass(frozen=True, slots=True)
class Denial:
    """One denied (or would-deny) `request`/`connect` event, where it was read, and the fields a proposal reads."""

    id: str
    file: str
    line: int
    kind: str
    decision: str
    reason: str
    event: dict = field(compare=False, repr=False)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Evidence:
    """What admitted a change: every event id, the agents (lease subjects) that made them, notes for the reviewer."""

    events: tuple[str, ...]
    subjects: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.events)

    def to_dict(self) -> dict:
        return {"events": list(self.events[:JSON_EVENTS]), "count": self.count, "subjects": list(self.subjects),
                "notes": list(self.notes)}


@dataclass(frozen=True)
class Change:
    """One edit: `add` is `{"allowed_hosts": [entry]}` for a profile, `{"egress": rule}` for a connection."""

    file: str
    kind: str  # "profile" | "connection"
    subject: str
    add: dict
    evidence: Evidence

    @property
    def key(self) -> str:
        """The subject in the lock's form (`sandbox_profile:P`, `connection:C`)."""
        return f"{'sandbox_profile' if self.kind == 'profile' else 'connection'}:{self.subject}"

    def to_dict(self) -> dict:
        return {"file": self.file, "subject": self.subject, "kind": self.kind, "add": self.add,
                "evidence": self.evidence.to_dict()}


@dataclass(frozen=True)
class Refusal:
    """Denials of one reason (and subject) that no policy change fixes, with why."""

    reason: str
    why: str
    subject: str | None
    evidence: Evidence

    def to_dict(self) -> dict:
        return {"reason": self.reason, "why": self.why, "subject": self.subject, "count": self.evidence.count,
                "events": list(self.evidence.events[:JSON_EVENTS]), "subjects": list(self.evidence.subjects)}


@dataclass(frozen=True)
class Proposal:
    changes: tuple[Change, ...]
    not_proposable: tuple[Refusal, ...]
    admitted: Evidence  # denials the current policy already admits (an old log, or a policy already fixed)
    old_sources: dict[str, str]
    new_sources: dict[str, str]  # every policy file, edited or not
    result: CompileResult  # the proposed policy, compiled

    @property
    def changed_files(self) -> list[str]:
        return [p for p in self.new_sources if self.new_sources[p] != self.old_sources.get(p)]

    @property
    def reformatted(self) -> list[str]:
        """Edited files that were not in `fmt`'s layout before: their diff reformats them too."""
        out = []
        for path in self.changed_files:
            tree, _ = parse_source(self.old_sources[path], path)
            try:
                same = tree is not None and format_source(tree) == self.old_sources[path]
            except FormatError:
                same = False
            if not same:
                out.append(path)
        return out

    @property
    def diff(self) -> str:
        """A unified diff of every edited file (`a/PATH`, `b/PATH`)."""
        out = []
        for path in self.changed_files:
            out += difflib.unified_diff(self.old_sources[path].splitlines(keepends=True),
                                        self.new_sources[path].splitlines(keepends=True), f"a/{path}", f"b/{path}")
        return "".join(out)

    def to_dict(self, policy: str) -> dict:
        return {"policy": policy, "changes": [c.to_dict() for c in self.changes],
                "not_proposable": [r.to_dict() for r in self.not_proposable],
                "already_admitted": {"count": self.admitted.count, "events": list(self.admitted.events[:JSON_EVENTS])},
                "reformatted": self.reformatted, "diff": self.diff}


# ---------------------------------------------------------------------------------------------
# The evidence
# ---------------------------------------------------------------------------------------------


def audit_files(directory: str | Path) -> list[Path]:
    """The audit logs directly in `directory`: `*.jsonl` and their rotated segments (`NAME.jsonl.000001`), in order."""
    root = Path(directory)
    if not root.exists():
        raise ProposeError(f"audit directory `{directory}` does not exist", "pass the directory holding the proxy's `*.jsonl` logs")
    if not root.is_dir():
        raise ProposeError(f"`{directory}` is not a directory", "pass the directory holding the proxy's `*.jsonl` logs")
    # a log's numbered segments (oldest first) come before its active file
    files = sorted((p for p in root.iterdir() if p.is_file() and re.fullmatch(r".+\.jsonl(\.\d{6,})?", p.name)),
                   key=lambda p: (p.name.split(".jsonl")[0], p.name.endswith(".jsonl"), len(p.name), p.name))
    if not files:
        raise ProposeError(f"`{directory}` holds no audit log (`*.jsonl`)", "pass the directory the proxy's `--audit-log` writes into")
    return files


def read_denials(files: Iterable[Path]) -> list[Denial]:
    """Every denied `request`/`connect` event of `files`, in order. Any line that is not one JSON object is an error
    naming its file and line: evidence is read exactly or not at all."""
    found: list[Denial] = []
    seen: set[str] = set()
    for path in files:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ProposeError(f"cannot read audit log `{path}`: {exc.strerror or exc.__class__.__name__}") from None
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for number, raw in enumerate(lines, start=1):
            where = f"`{path}` line {number}"
            try:
                event = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise ProposeError(f"{where} is not a JSON event", "evidence must be exact: restore the log, or move the "
                                   "damaged file out of the directory") from None
            if not isinstance(event, dict):
                raise ProposeError(f"{where} is not a JSON object", "evidence must be exact: restore the log")
            if event.get("kind") not in DECISION_KINDS or event.get("decision") not in DENIED:
                continue
            reason, ident = event.get("reason"), event.get("id")
            if not isinstance(reason, str) or not isinstance(ident, str) or not ident:
                raise ProposeError(f"{where}: a `{event['decision']}` event without a `reason` and an `id`",
                                   "evidence must be exact: restore the log")
            if ident in seen:  # a copy of a log (or a rotated segment read twice) must not count twice
                continue
            seen.add(ident)
            found.append(Denial(ident, str(path), number, event["kind"], event["decision"], reason, event))
    return found


def looks_secret(text: str, entropy: bool = True) -> bool:
    """Does `text` look like a credential or a lease (then it is never echoed)? `entropy` false: token prefixes and
    lease shapes only (event ids are 32 hex characters, which the entropy test would flag)."""
    if _LEASE.search(text):
        return True
    if entropy:
        return secret_kind(text) is not None
    return any(prefix in text for prefix in SECRET_PREFIXES)


def _shown_id(d: Denial) -> str:
    return d.id if not looks_secret(d.id, entropy=False) else "[redacted]"


def _agent(d: Denial) -> str | None:
    agent = d.event.get("subject")
    if not isinstance(agent, str):
        return None
    return agent if not looks_secret(agent) else "[redacted]"


def _evidence(denials: Sequence[Denial], notes: Iterable[str] = ()) -> Evidence:
    agents = sorted({a for a in (_agent(d) for d in denials) if a is not None})
    return Evidence(tuple(_shown_id(d) for d in denials), tuple(agents), tuple(notes))


def why_not(reason: str) -> str:
    """Why a denial with this reason is never turned into a policy change."""
    for code, why in _NOT_PROPOSABLE:
        if reason == code or (code.endswith("-") and reason.startswith(code)):
            return why
    return _DEFAULT_WHY


# ---------------------------------------------------------------------------------------------
# Classifying and grouping
# ---------------------------------------------------------------------------------------------


@dataclass
class _Group:
    kind: str
    subject: str
    host: str
    port: int
    denials: list[Denial] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    methods: set[str] = field(default_factory=set)
    headers: set[str] = field(default_factory=set)
    headers_seen: bool = False


class _Sorter:
    """Puts every denial in exactly one place: a group (a change), a refusal, or `admitted`."""

    def __init__(self, policy: CompileResult) -> None:
        self.artifact = policy.artifact
        self.groups: dict[tuple[str, str, str, int], _Group] = {}
        self.refused: dict[tuple[str, str, str | None], list[Denial]] = {}
        self.admitted: list[Denial] = []
        self.tunnels: list[tuple[Denial, str, str, int]] = []  # connection CONNECTs, judged once the rules are grouped

    def refuse(self, d: Denial, why: str, subject: str | None = None) -> None:
        self.refused.setdefault((d.reason, why, subject), []).append(d)

    def field(self, d: Denial, name: str, kind: type, *, optional: bool = False):
        value = d.event.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProposeError(f"`{d.file}` line {d.line}: a `{d.reason}` event whose `{name}` is not a {kind.__name__}",
                               "evidence must be exact: restore the log")
        return value

    def add(self, d: Denial) -> None:
        wanted = PROPOSABLE.get(d.reason)
        if wanted is None:
            self.refuse(d, why_not(d.reason))
            return
        profile = self.field(d, "profile", str, optional=True)
        connection = self.field(d, "connection", str, optional=True)
        if (profile is None) == (connection is None):
            raise ProposeError(f"`{d.file}` line {d.line}: a `{d.reason}` event must name exactly one profile or connection",
                               "evidence must be exact: restore the log")
        kind, name = ("profile", profile) if profile is not None else ("connection", connection)
        label = f"{kind}:{name}" if not looks_secret(name) else None
        if kind != wanted:
            self.refuse(d, f"`{d.reason}` is not a {kind}'s denial; this event does not read as the proxy writes it", label)
            return
        target = self.artifact.profile(name) if kind == "profile" else self.artifact.connection(name)
        if target is None:
            shown = name if label is not None else "[redacted]"
            self.refuse(d, f"this policy declares no {kind} `{shown}` (a log of another policy?)", label)
            return
        raw_host = self.field(d, "host", str)
        port = self.field(d, "port", int)
        host, problem = admit_host(raw_host, NO_SPAN)
        if problem is not None or host is None:
            self.refuse(d, "the host cannot be written in a policy: " + (problem.message if problem else "not a host name"), label)
            return
        if looks_secret(host):
            self.refuse(d, "the host looks like it carries a secret; a policy never holds one (not shown)", label)
            return
        if not 1 <= port <= 65535:
            self.refuse(d, f"port {port} is not from 1 to 65535", label)
            return
        if kind == "profile":
            if target.network.mode != "allowlist":
                self.refuse(d, f"profile `{name}` has no network (`{{\"type\": \"none\"}}`); opening one is a trust decision "
                            "(trust lane, provider), not an allowlist entry", label)
            elif any((h.host, h.port) == (host, port) for h in target.network.allowed_hosts):
                self.admitted.append(d)
            else:
                self._group("profile", name, host, port).denials.append(d)
            return
        scheme = self.field(d, "scheme", str)
        if scheme != "https":
            self.refuse(d, why_not("scheme-not-allowed"), label)
            return
        if d.kind == "connect":
            self.tunnels.append((d, name, host, port))
            return
        method = self.field(d, "method", str)
        if method not in METHODS:
            self.refuse(d, f"a rule may name only {', '.join(METHODS)}", label)
            return
        raw_path = self.field(d, "path", str).split("?", 1)[0]
        try:
            path = normalize_path(raw_path)
        except PathError as exc:
            self.refuse(d, f"the path has no canonical form ({exc.reason})", label)
            return
        if looks_secret(path):
            self.refuse(d, "the path looks like it carries a secret; a policy never holds one (not shown)", label)
            return
        for rule in target.rules:
            if rule.host == host and rule.port == port and method in rule.methods and prefix_matches(normalize_prefix(rule.path_prefix), path):
                self.admitted.append(d)
                return
        if not any((r.host, r.port) == (host, port) for r in target.rules):
            self.refuse(d, f"no rule of connection `{name}` names this host and port: a rule there would send its credential "
                        "to a destination the connection never reached; add it by hand after review, never from an agent's "
                        "request", label)
            return
        headers = d.event.get("headers")
        if headers is not None and not (isinstance(headers, list) and all(isinstance(h, str) for h in headers)):
            raise ProposeError(f"`{d.file}` line {d.line}: `headers` is not a list of header names", "evidence must be exact: restore the log")
        group = self._group("connection", name, host, port)
        group.denials.append(d)
        group.paths.append(path)
        group.methods.add(method)
        if headers is not None:
            group.headers_seen = True
            group.headers.update(h.lower() for h in headers)

    def _group(self, kind: str, name: str, host: str, port: int) -> _Group:
        return self.groups.setdefault((kind, name, host, port), _Group(kind, name, host, port))

    def settle_tunnels(self) -> None:
        """A connection's CONNECT names only host:port: admitted once a rule names them (proposed or existing), else
        not proposable (the requests inside the tunnel were never seen, so no method or path is known)."""
        for d, name, host, port in self.tunnels:
            group = self.groups.get(("connection", name, host, port))
            conn = self.artifact.connection(name)
            if group is not None:
                group.denials.append(d)
            elif any((r.host, r.port) == (host, port) for r in conn.rules):
                self.admitted.append(d)
            else:
                self.refuse(d, "a CONNECT names only host:port; a rule needs the methods and paths of the requests inside "
                            "the tunnel, which were never seen (send them absolute-form, or observe them first)", f"connection:{name}")


def segment_prefix(paths: Sequence[str]) -> str:
    """The narrowest segment-bounded prefix that covers every path: the path itself when there is one, else the
    longest common run of whole segments, ending in `/`."""
    distinct = sorted(set(paths))
    if len(distinct) == 1:
        return distinct[0]
    split = [p.split("/")[1:] for p in distinct]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1 or parts[0] == "":
            break
        common.append(parts[0])
    return "/" + "".join(f"{s}/" for s in common)


def rule_name(host: str, taken: set[str]) -> str:
    """`proposed-<n>`, unique among `taken`. Not derived from the host: a long host with its dots turned into dashes
    reads as a high-entropy token to the secret scan (EL0029), and the rule names its host anyway."""
    n = 1
    while f"proposed-{n}" in taken:
        n += 1
    return f"proposed-{n}"


def _rule_of(group: _Group, conn, taken: set[str]) -> tuple[dict, list[str]]:
    notes: list[str] = []
    prefix = segment_prefix(group.paths)
    if normalize_prefix(prefix) == "/":
        notes.append(f"path prefix `/` admits every path of {group.host}:{group.port}: the observed paths share no segment")
    kept, dropped = [], []
    for name in sorted(group.headers):
        if header_is_denylisted(name, conn.inject.header, conn.kind) or not _TOKEN.fullmatch(name) or looks_secret(name):
            dropped.append(name)
        else:
            kept.append(name)
    if dropped:
        shown = [n if not looks_secret(n) else "[redacted]" for n in dropped]
        notes.append("headers the language refuses to allowlist were left out: " + ", ".join(f"`{n}`" for n in shown))
    if not group.headers_seen:
        notes.append("the events name no headers: the rule forwards none (add the ones the caller needs)")
    name = rule_name(group.host, taken)
    taken.add(name)
    rule = {"name": name, "host": group.host, "port": group.port, "path_prefix": prefix,
            "methods": [m for m in METHODS if m in group.methods], "headers": kept}
    return rule, notes


# ---------------------------------------------------------------------------------------------
# Editing the source text
# ---------------------------------------------------------------------------------------------


def _offset(text: str, line: int, column: int) -> int:
    starts = [0]
    for i, c in enumerate(text):
        if c == "\n":
            starts.append(i + 1)
    return starts[line - 1] + column - 1


def _closing(text: str, span) -> int:
    """The offset of the closing bracket of a node (`end_column` is exclusive)."""
    return _offset(text, span.end_line, span.end_column) - 1


def _needs_comma(text: str, after: int, closing: int) -> bool:
    """Between the last item (ending at `after`) and the closing bracket: no comma yet, comments aside?"""
    between = re.sub(r"#[^\n]*", "", text[after:closing])
    return "," not in between


def _find(files: Sequence[SourceFile], kind: str, name: str) -> tuple[SourceFile, Named] | None:
    for f in files:
        for d in f.decls:
            if d.kind == kind and d.name == name:
                return f, d
    return None


def _render_rule(rule: dict) -> str:
    q = json.dumps
    return (f'\n  egress {q(rule["name"])} {{\n    host = {q(rule["host"])}\n    port = {rule["port"]}\n'
            f'    path_prefix = {q(rule["path_prefix"])}\n    methods = {q(rule["methods"])}\n'
            f'    headers = {q(rule["headers"])}\n  }}\n')


def _host_entry(host: str, port: int) -> str:
    return host if port == 443 else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------
# The proposal
# ---------------------------------------------------------------------------------------------


def propose(policy: CompileResult, denials: Sequence[Denial], enforce: bool = False) -> Proposal:
    """The smallest change of `policy` (compiled, ok) that admits every proposable denial, compiled in memory; with
    `enforce`, every changed profile in observe mode is also set back to `enforce = "enforce"` (what was observed is
    now allowed, the rest denied again). ProposeError when the edited policy does not compile (a bug here: the
    evidence is never trusted that far)."""
    # INVARIANT: `policy.ok`; the CLI refuses a policy that does not compile before asking.
    sorter = _Sorter(policy)
    for d in denials:
        sorter.add(d)
    sorter.settle_tunnels()

    edits: dict[str, list[tuple[int, int, str]]] = {}  # (start, end, text): an insert when start == end
    changes: list[Change] = []
    new_rules: dict[str, list[tuple[_Group, dict, list[str]]]] = {}
    profile_hosts: dict[str, list[_Group]] = {}
    for key in sorted(sorter.groups):
        group = sorter.groups[key]
        (profile_hosts if group.kind == "profile" else new_rules).setdefault(group.subject, []).append(group)  # type: ignore[arg-type]

    for name, groups in profile_hosts.items():
        found = _find(policy.files, "sandbox_profile", name)
        net = found[1].body.get("network") or found[1].body.get("networking") if found and found[1].body else None
        if found is None or net is None or not isinstance(net.value, Obj):
            for g in groups:
                for d in g.denials:
                    sorter.refuse(d, "its `network` is not an object written in this policy's source", f"profile:{name}")
            continue
        source, _ = found
        text = policy.sources[source.path]
        entries = [_host_entry(g.host, g.port) for g in groups]
        hosts = net.value.get("allowed_hosts")
        if hosts is not None and isinstance(hosts.value, ListV):
            closing = _closing(text, hosts.value.span)
            items = hosts.value.items
            comma = ", " if items and _needs_comma(text, _offset(text, items[-1].span.end_line, items[-1].span.end_column), closing) else " "
            insert = (comma if items else "") + ", ".join(json.dumps(e) for e in entries)
        elif hosts is None:
            closing = _closing(text, net.value.span)
            pairs = net.value.pairs
            last = pairs[-1].value.span if pairs else None
            comma = ", " if last is not None and _needs_comma(text, _offset(text, last.end_line, last.end_column), closing) else " "
            insert = (comma if pairs else "") + '"allowed_hosts": ' + json.dumps(entries)
        else:
            for g in groups:
                for d in g.denials:
                    sorter.refuse(d, "its `allowed_hosts` is not a list", f"profile:{name}")
            continue
        edits.setdefault(source.path, []).append((closing, closing, insert))
        notes: tuple[str, ...] = ()
        mode = found[1].body.get("enforce") if found[1].body else None
        if mode is not None and policy.artifact.profile(name).enforce == "observe":
            if enforce:
                start = _offset(text, mode.value.span.line, mode.value.span.column)
                edits[source.path].append((start, _offset(text, mode.value.span.end_line, mode.value.span.end_column), '"enforce"'))
                notes = ("observe mode ends: `enforce = \"enforce\"` (--enforce)",)
            else:
                notes = ("the profile stays in observe mode (any host is forwarded, audited would-deny); --enforce ends it",)
        for g, entry in zip(groups, entries):
            changes.append(Change(source.path, "profile", name, {"allowed_hosts": [entry]}, _evidence(g.denials, notes)))

    for name, groups in new_rules.items():
        conn = policy.artifact.connection(name)
        found = _find(policy.files, "connection", name)
        room = MAX_RULES_PER_CONNECTION - len(conn.rules)
        if found is None or len(groups) > room:
            why = (f"connection `{name}` would exceed {MAX_RULES_PER_CONNECTION} rules" if found is not None
                   else "its declaration is not in this policy's source")
            for g in groups:
                for d in g.denials:
                    sorter.refuse(d, why, f"connection:{name}")
            continue
        source, decl = found
        taken = {r.name for r in conn.rules}
        blocks = []
        for g in groups:
            rule, notes = _rule_of(g, conn, taken)
            blocks.append(_render_rule(rule))
            changes.append(Change(source.path, "connection", name, {"egress": rule}, _evidence(g.denials, notes)))
        at = _closing(policy.sources[source.path], decl.span)
        edits.setdefault(source.path, []).append((at, at, "".join(blocks)))

    new_sources = dict(policy.sources)
    for path, inserts in edits.items():
        text = policy.sources[path]
        for start, end, insert in sorted(inserts, reverse=True):  # INVARIANT: edits of one file never overlap
            text = text[:start] + insert + text[end:]
        tree, problems = parse_source(text, path)
        if tree is None:
            raise ProposeError(f"the proposed `{path}` does not parse: {problems[0].message}", "please report this")
        try:
            new_sources[path] = format_source(tree)
        except FormatError as exc:
            raise ProposeError(f"the proposed `{path}` cannot be formatted: {exc}", "please report this") from None
    result = compile_sources(new_sources, [])
    if not result.ok:
        raise ProposeError("the proposed policy does not compile:\n" + render_text(result.diagnostics, new_sources).rstrip(),
                           "please report this with the audit events")
    refusals = [Refusal(reason, why, subject, _evidence(ds))
                for (reason, why, subject), ds in sorted(sorter.refused.items(), key=lambda kv: (kv[0][0], kv[0][2] or "", kv[0][1]))]
    changes.sort(key=lambda c: (c.file, c.kind, c.subject))
    return Proposal(tuple(changes), tuple(refusals), _evidence(sorter.admitted), dict(policy.sources), new_sources, result)
