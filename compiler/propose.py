"""Denials become a proposed policy change: audit events -> the smallest edit of the `.egress` sources that admits them.

Pipeline: `audit_files` / `read_denials` (the evidence, exact: a line that does not read is an error naming file
and line) -> `propose` (classify each denial against the compiled policy, group, edit the source text, format with
`fmt`'s layout, compile the result in memory) -> `Proposal` (changes with their evidence, what cannot be proposed
and why, what only a reviewer can decide, the new sources and their unified diff). Only what a policy change can fix
is proposed: a profile's `host:port`, a connection's exact path and method, and the exact name a rule's request shape
refused (an MCP tool or method, a GraphQL root field, a git ref, a query parameter, a path segment's value).
Everything else (leases, addresses, framing, credentials, plain-HTTP connection traffic) is listed as not proposable
and never turned into a widening; a value a shape refused is not in the audit, so it is only named for review.

The smallest change: a profile gets the exact `host:port` entries it was denied. A connection carries a credential, so
its change is never wider than what was denied: each denied (host, port, path) becomes a rule of its own whose
`path` template is that path, literal segment by literal segment, with exactly the methods seen on it; paths that
differ in one segment only and were denied the same methods and header names share one rule whose variable is an
enum of exactly the values seen. New rules are appended after the connection's (rule order is semantic: an appended
rule never changes which rule admits a request admitted before). A shape denial adds exactly the refused name to the
rule that refused it. Verifying the log's chain (`--keys`) is the CLI's job: this module reads files, never keys.
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
from compiler.artifact import Connection, Rule, Segment, Value
from compiler.normalize import PathError, normalize_path, normalize_prefix, prefix_matches
from compiler.parser import parse_source
from compiler.passes import GRAPHQL_NAME, MCP_DEFAULT_METHODS, MCP_METHODS, admit_host, ref_pattern_problem
from compiler.patterns import PatternError, matches, parse_pattern
from compiler.secrets_scan import SECRET_PREFIXES, secret_kind
from compiler.syntax import NO_SPAN, ListV, Named, Obj, SourceFile, Str
from compiler.template import TemplateError, parse_template, template_parser

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

# Shape denials (egress_proxy/decision/shapes.py) whose `detail` names exactly what to add to the rule that refused:
# the name is in the audit, so the addition is exact. A brokered profile's request is judged by its carrier
# connection's rule, so the change goes to that connection.
SHAPE_PROPOSABLE = frozenset({
    "mcp-tool-not-allowed", "mcp-method-not-allowed", "graphql-field-not-allowed", "git-ref-not-allowed",
    "path-template-mismatch", "query-parameter-not-allowed",
})

# Shape denials a policy change could fix but the audit cannot say how: the refused value is never logged, or the
# fix is a switch that admits a whole class of requests. Each is named (rule and place) for a reviewer to decide.
REVIEW: dict[str, str] = {
    "mcp-argument-refused": "the audit holds no argument value; if it should be admitted, write the tool's `arguments` "
                            "constraint for that key yourself (an exact value, an enum, a pattern)",
    "query-value-refused": "the audit holds no query value; widen that parameter's constraint yourself if it should be admitted",
    "header-value-refused": "the audit holds no header value; widen that header's `header_values` constraint yourself if it "
                            "should be admitted",
    "git-create-refused": "`create = true` lets a push create every ref the rule's patterns match: decide it for the rule",
    "git-delete-refused": "`delete = true` lets a push delete every ref the rule's patterns match: decide it for the rule",
    "git-service-not-allowed": "`fetch = true` (or a `push` pattern) admits the service for the whole repository: decide "
                               "it for the rule",
    "graphql-operation-not-allowed": "the operation type has no root field list and the audit names none of its fields; "
                                     "list the fields it needs yourself",
    "graphql-introspection-refused": "`introspection = true` admits the whole schema's description: decide it for the rule",
    "graphql-persisted-query-not-allowed": "the audit holds at most 16 characters of the hash; list the full sha256 "
                                           "of the reviewed query yourself",
    "body-too-large-to-judge": "a larger `max_body` (at most 64 MiB) lets the edge read and judge the body: decide it for the rule",
}
QUERY_MAX_LENGTH = 256  # a query parameter proposed by name: the audit holds no value, so only its length is bounded

# Why the other denials are never proposed, by reason family (first match: exact code, then prefix).
_NOT_PROPOSABLE: tuple[tuple[str, str], ...] = (
    ("query-parameter-repeated", "a parameter given twice is parameter pollution: never admitted, whatever the rule lists"),
    ("body-malformed", "the body does not read one way (JSON, UTF-8, duplicate keys, depth, the protocol's form): the "
                       "caller is fixed, never the policy"),
    ("content-type-mismatch", "the request's content type is not its protocol's: the caller is fixed, never the policy"),
    ("graphql-multiple-operations", "a document with more than one operation (or an `operationName` naming none) is never "
                                    "admitted: send one operation per request"),
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

    @property
    def summary(self) -> str:
        """One line saying what the change adds."""
        add = self.add
        if "allowed_hosts" in add:
            return f"allowed_hosts += {add['allowed_hosts'][0]}"
        if "egress" in add:
            r = add["egress"]
            return f"egress `{r['name']}`: {' '.join(r['methods'])} {r['host']}:{r['port']} path `{r['path']}`"
        rule = add["rule"]
        if "mcp" in add and "tools" in add["mcp"]:
            (tool,) = add["mcp"]["tools"]
            return f"rule `{rule}`: mcp.tools += `{tool}` (no argument admitted until its `arguments` list them)"
        if "mcp" in add:
            return f"rule `{rule}`: mcp.methods += `{add['mcp']['methods'][0]}`"
        if "graphql" in add:
            ((kind, (name,)),) = add["graphql"].items()
            return f"rule `{rule}`: graphql.{kind} += `{name}`"
        if "git" in add:
            return f"rule `{rule}`: git.push += `{add['git']['push'][0]}` (exactly this ref)"
        if "query" in add:
            ((name, value),) = add["query"].items()
            return f"rule `{rule}`: query += `{name}` (max_length {value['max_length']}: the audit holds no value)"
        segment = add["path"]
        return f"rule `{rule}`: path segment {segment['segment']} enum += {', '.join(f'`{v}`' for v in segment['enum'])}"

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
class Review:
    """Shape denials a policy change could fix but the audit cannot say how (the refused value is never logged):
    the rule and the place, for a reviewer to decide. Never turned into a change."""

    reason: str
    subject: str | None  # `connection:C`
    rule: str | None
    where: str  # the place the denial's detail names (`tool=get_issue path=$.repo: not one of the allowed values`)
    why: str
    evidence: Evidence

    def to_dict(self) -> dict:
        return {"reason": self.reason, "subject": self.subject, "rule": self.rule, "where": self.where, "why": self.why,
                "count": self.evidence.count, "events": list(self.evidence.events[:JSON_EVENTS]),
                "subjects": list(self.evidence.subjects)}


@dataclass(frozen=True)
class Proposal:
    changes: tuple[Change, ...]
    not_proposable: tuple[Refusal, ...]
    admitted: Evidence  # denials the current policy already admits (an old log, or a policy already fixed)
    old_sources: dict[str, str]
    new_sources: dict[str, str]  # every policy file, edited or not
    result: CompileResult  # the proposed policy, compiled
    review: tuple[Review, ...] = ()  # shape denials named for a reviewer (a value the audit does not hold)

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
                "review": [r.to_dict() for r in self.review],
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
    """A profile's denied `host:port`, or a connection's denied requests to one (host, port) it already names."""

    kind: str
    subject: str
    host: str
    port: int
    denials: list[Denial] = field(default_factory=list)
    requests: list[tuple[str, str, tuple[str, ...] | None, Denial]] = field(default_factory=list)  # (path, method, headers, denial)


@dataclass(frozen=True)
class _Addition:
    """One exact name a rule's shape refused, to add to it: `place` is `mcp.tools`, `mcp.methods`, `graphql.query`
    (`.mutation`, `.subscription`), `git.push`, `query` or `path` (`segment` then says which, 1-based)."""

    connection: str
    rule: str
    place: str
    item: str
    segment: int = 0


@dataclass
class _Reviewed:
    denials: list[Denial] = field(default_factory=list)


_AT = re.compile(r"index=\d+ ")
_DETAIL = re.compile(r"rule `([^`]*)`: (.*)", re.S)
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")  # canonical decimal, as the core reads a text integer


def exact_name(shown: str) -> str | None:
    """The name a denial's `where` shows (escaped with `unicode_escape`, cut to 80 characters with `...`), when that is
    exactly the name the request carried; None when it was escaped or may have been cut."""
    if not shown or "\\" in shown or (len(shown) >= 80 and shown.endswith("...")):
        return None
    if not shown.isascii() or not shown.isprintable():
        return None
    return shown


def _text_admits(value: Value, text: str) -> bool:
    """Whether a text value (a path segment) is inside `value`, as the core judges it; conservative (False) for a
    constraint it does not read."""
    if value.type == "integer":
        if not _INTEGER.fullmatch(text) or value.pattern is not None or value.max_length is not None:
            return False
        x = int(text)
        return ((value.enum is None or x in [e for e in value.enum if type(e) is int])
                and (value.minimum is None or x >= value.minimum) and (value.maximum is None or x <= value.maximum))
    if value.type not in ("string", "any"):
        return False
    if value.enum is not None and text not in [e for e in value.enum if type(e) is str]:
        return False
    if value.max_length is not None and len(text) > value.max_length:
        return False
    if value.pattern is not None:
        try:
            return matches(parse_pattern(value.pattern), text)
        except PatternError:
            return False
    return True


def template_admits(template: Sequence[Segment], path: str, skip: int = 0) -> bool:
    """Whether the normalized `path` fits `template` segment by segment (segment `skip`, 1-based, not judged)."""
    segments = path.split("/")[1:]
    if len(segments) != len(template):
        return False
    for i, (text, seg) in enumerate(zip(segments, template), start=1):
        if i == skip:
            continue
        if seg.value is None:
            if text != seg.literal:
                return False
        elif text == "" or not _text_admits(seg.value, text):
            return False
    return True


def rule_admits(rule: Rule, host: str, port: int, method: str, path: str) -> bool:
    """Whether `rule`'s host, port, method and path (its template, else its segment-bounded prefix) admit the
    request; its query and header shapes are not judged (the audit holds neither)."""
    if (rule.host, rule.port) != (host, port) or method not in rule.methods:
        return False
    if rule.template is not None:
        return template_admits(rule.template, path)
    return prefix_matches(normalize_prefix(rule.path_prefix), path)


def _only_enum(value: Value | None) -> bool:
    """A variable segment constrained by an enum alone (`{name:a|b}`): the one a value can be added to exactly."""
    return value is not None and value.enum is not None and value == Value(type="string", enum=value.enum)


class _Sorter:
    """Puts every denial in exactly one place: a group (a change), an addition, a review, a refusal, or `admitted`."""

    def __init__(self, policy: CompileResult) -> None:
        self.artifact = policy.artifact
        self.groups: dict[tuple[str, str, str, int], _Group] = {}
        self.additions: dict[_Addition, list[Denial]] = {}
        self.reviewed: dict[tuple[str, str, str, str, str], list[Denial]] = {}  # (reason, subject, rule, where, why)
        self.refused: dict[tuple[str, str, str | None], list[Denial]] = {}
        self.admitted: list[Denial] = []
        self.tunnels: list[tuple[Denial, str, str, int]] = []  # connection CONNECTs, judged once the rules are grouped

    def refuse(self, d: Denial, why: str, subject: str | None = None) -> None:
        self.refused.setdefault((d.reason, why, subject), []).append(d)

    def review(self, d: Denial, subject: str, rule: str, where: str, why: str) -> None:
        self.reviewed.setdefault((d.reason, subject, rule, where, why), []).append(d)

    def field(self, d: Denial, name: str, kind: type, *, optional: bool = False):
        value = d.event.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ProposeError(f"`{d.file}` line {d.line}: a `{d.reason}` event whose `{name}` is not a {kind.__name__}",
                               "evidence must be exact: restore the log")
        return value

    def add(self, d: Denial) -> None:
        shaped = d.reason in SHAPE_PROPOSABLE or d.reason in REVIEW or d.reason == "mcp-method-not-allowed"
        wanted = PROPOSABLE.get(d.reason) or ("connection" if shaped else None)
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
        if kind != wanted and not (shaped and kind == "profile"):  # a brokered profile's request meets a connection's shape
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
        if shaped:
            if d.decision != "deny":  # INVARIANT (the core): observe mode is a profile's, and an observed profile brokers nothing
                self.refuse(d, "a shape is judged only on a connection's rule, and a connection is never in observe mode: "
                            f"a `{d.decision}` shape event does not read as the proxy writes it", label)
                return
            self._shape(d, kind, name, host, port, label)
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
        self._request(d, target, host, port, label)

    def _request(self, d: Denial, conn: Connection, host: str, port: int, label: str | None) -> None:
        """A connection's request to a path or with a method no rule admits: evidence for an exact rule."""
        name = conn.name
        method = self.field(d, "method", str)
        if method not in METHODS:
            self.refuse(d, f"a rule may name only {', '.join(METHODS)}", label)
            return
        path = self._path(d, label)
        if path is None:
            return
        if any(rule_admits(rule, host, port, method, path) for rule in conn.rules):
            self.admitted.append(d)
            return
        if not any((r.host, r.port) == (host, port) for r in conn.rules):
            self.refuse(d, f"no rule of connection `{name}` names this host and port: a rule there would send its credential "
                        "to a destination the connection never reached; add it by hand after review, never from an agent's "
                        "request", label)
            return
        headers = d.event.get("headers")
        if headers is not None and not (isinstance(headers, list) and all(isinstance(h, str) for h in headers)):
            raise ProposeError(f"`{d.file}` line {d.line}: `headers` is not a list of header names", "evidence must be exact: restore the log")
        group = self._group("connection", name, host, port)
        group.denials.append(d)
        group.requests.append((path, method, tuple(sorted({h.lower() for h in headers})) if headers is not None else None, d))

    def _path(self, d: Denial, label: str | None) -> str | None:
        raw_path = self.field(d, "path", str).split("?", 1)[0]
        try:
            path = normalize_path(raw_path)
        except PathError as exc:
            self.refuse(d, f"the path has no canonical form ({exc.reason})", label)
            return None
        if looks_secret(path):
            self.refuse(d, "the path looks like it carries a secret; a policy never holds one (not shown)", label)
            return None
        return path

    def _shape(self, d: Denial, kind: str, name: str, host: str, port: int, label: str | None) -> None:
        """A request shape's denial: the rule its `detail` names, and exactly what that rule refused."""
        detail = d.event.get("detail")
        found = _DETAIL.fullmatch(detail) if isinstance(detail, str) else None
        if found is None:
            self.refuse(d, "the event names no rule and place (`detail`: rule `NAME`: …); a shape denial is proposed only "
                        "from the rule and the exact place it names", label)
            return
        rule_name, where = found.group(1), _AT.sub("", found.group(2), count=1)
        if looks_secret(rule_name) or looks_secret(where):
            self.refuse(d, "the denial's detail looks like it carries a secret (not shown)", label)
            return
        carriers = [self.artifact.connection(name)] if kind == "connection" else [
            self.artifact.connection(b) for b in self.artifact.profile(name).brokers]
        matches_ = [(c, r) for c in carriers if c is not None for r in c.rules if r.name == rule_name]
        logged = d.event.get("rule")
        if len(matches_) != 1 or (isinstance(logged, str) and logged != rule_name):
            self.refuse(d, f"rule `{rule_name}` is not one rule of {'connection' if kind == 'connection' else 'a connection the profile brokers through'} "
                        "in this policy (a log of another policy?)", label)
            return
        conn, rule = matches_[0]
        label = f"connection:{conn.name}"
        if (rule.host, rule.port) != (host, port):
            self.refuse(d, f"rule `{rule_name}` names another host or port than the event (a log of another policy?)", label)
            return
        if d.reason in REVIEW or where.startswith("method=(a response)"):
            why = REVIEW.get(d.reason, "`responses = true` lets the client answer every request the server makes (sampling, "
                                       "roots, elicitation): decide it for the rule")
            self.review(d, label, rule_name, where, why)
            return
        handler = {"mcp-tool-not-allowed": self._tool, "mcp-method-not-allowed": self._mcp_method,
                   "graphql-field-not-allowed": self._graphql_field, "git-ref-not-allowed": self._git_ref,
                   "query-parameter-not-allowed": self._query_name, "path-template-mismatch": self._segment}[d.reason]
        handler(d, conn, rule, where, label)

    def _named(self, d: Denial, where: str, key: str, label: str) -> str | None:
        """The exact name after `key=` in `where` (the rest of it), or a refusal."""
        if not where.startswith(f"{key}="):
            self.refuse(d, f"the denial's detail does not name the {key} (`{key}=…`)", label)
            return None
        name = exact_name(where[len(key) + 1:])
        if name is None:
            self.refuse(d, f"the {key} the denial names was escaped or cut short in the audit (not printable ASCII, or longer "
                        "than 80 characters): add it by hand, exactly", label)
        return name

    def _added(self, d: Denial, conn: Connection, rule: Rule, place: str, item: str, present: bool, segment: int = 0) -> None:
        if present:
            self.admitted.append(d)
        else:
            self.additions.setdefault(_Addition(conn.name, rule.name, place, item, segment), []).append(d)

    def _tool(self, d: Denial, conn: Connection, rule: Rule, where: str, label: str) -> None:
        tool = self._named(d, where, "tool", label)
        if tool is None:
            return
        if rule.mcp is None:
            self.refuse(d, f"rule `{rule.name}` has no `mcp` shape in this policy (a log of another policy?)", label)
            return
        self._added(d, conn, rule, "mcp.tools", tool, any(t.name == tool for t in rule.mcp.tools))

    def _mcp_method(self, d: Denial, conn: Connection, rule: Rule, where: str, label: str) -> None:
        method = self._named(d, where, "method", label)
        if method is None:
            return
        if rule.mcp is None:
            self.refuse(d, f"rule `{rule.name}` has no `mcp` shape in this policy (a log of another policy?)", label)
        elif method not in MCP_METHODS:
            self.refuse(d, f"MCP method `{method}` is not one egresslaw knows (one of: {', '.join(MCP_METHODS)})", label)
        else:
            self._added(d, conn, rule, "mcp.methods", method, method in rule.mcp.methods)

    def _graphql_field(self, d: Denial, conn: Connection, rule: Rule, where: str, label: str) -> None:
        kind, _, rest = where.partition(" ")
        if kind not in ("query", "mutation", "subscription"):
            self.refuse(d, "the denial's detail does not name the operation type (`query field=…`)", label)
            return
        name = self._named(d, rest, "field", label)
        if name is None:
            return
        if rule.graphql is None:
            self.refuse(d, f"rule `{rule.name}` has no `graphql` shape in this policy (a log of another policy?)", label)
        elif not GRAPHQL_NAME.fullmatch(name) or name.startswith("__"):
            self.refuse(d, f"`{name}` is not a root field a rule lists (introspection is `introspection = true`)", label)
        else:
            self._added(d, conn, rule, f"graphql.{kind}", name, name in getattr(rule.graphql, kind))

    def _git_ref(self, d: Denial, conn: Connection, rule: Rule, where: str, label: str) -> None:
        ref = self._named(d, where, "ref", label)
        if ref is None:
            return
        if rule.git is None:
            self.refuse(d, f"rule `{rule.name}` has no `git` shape in this policy (a log of another policy?)", label)
            return
        problem = "holds `*`, which a push pattern reads as a wildcard" if "*" in ref else ref_pattern_problem(ref)
        if problem:
            self.refuse(d, f"ref `{ref}` {problem}: it cannot be listed exactly", label)
            return
        self._added(d, conn, rule, "git.push", ref, any(_ref_matches(p, ref) for p in rule.git.push))

    def _query_name(self, d: Denial, conn: Connection, rule: Rule, where: str, label: str) -> None:
        name = self._named(d, where, "name", label)
        if name is None:
            return
        if rule.query is None:
            self.refuse(d, f"rule `{rule.name}` has no `query` shape in this policy (a log of another policy?)", label)
            return
        self._added(d, conn, rule, "query", name, any(p.name == name for p in rule.query))

    def _segment(self, d: Denial, conn: Connection, rule: Rule, where: str, label: str) -> None:
        """`segment N: …`: the value is the path's own segment N; it joins the template's enum when that segment is
        an enum variable and every other segment already fits. Any other mismatch (a literal, the number of segments)
        is a request to another path: an exact rule of its own, as for `path-not-allowed`."""
        if rule.template is None:
            self.refuse(d, f"rule `{rule.name}` has no `path` template in this policy (a log of another policy?)", label)
            return
        path = self._path(d, label)
        if path is None:
            return
        at = re.match(r"segment (\d+): ", where)
        index = int(at.group(1)) if at else 0
        segments = path.split("/")[1:]
        if at and 1 <= index <= len(rule.template) and rule.template[index - 1].value is not None:
            seg = rule.template[index - 1]
            if not template_admits(rule.template, path, skip=index):  # another segment misses too: another path
                self._request(d, conn, rule.host, rule.port, label)
                return
            if not _only_enum(seg.value):
                self.review(d, label, rule.name, where, f"segment {index} of the template is `{{{seg.name}}}` with a type, range "
                            "or pattern: extend that constraint yourself if the value should be admitted")
                return
            value = segments[index - 1]
            self._added(d, conn, rule, "path", value, _text_admits(seg.value, value), segment=index)  # type: ignore[arg-type]
            return
        self._request(d, conn, rule.host, rule.port, label)

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




def _ref_matches(pattern: str, ref: str) -> bool:
    """A push pattern against a ref (`*` is any run of characters other than `/`)."""
    return re.fullmatch("[^/]*".join(re.escape(part) for part in pattern.split("*")), ref) is not None


# ---------------------------------------------------------------------------------------------
# Exact rules for a connection
# ---------------------------------------------------------------------------------------------


@dataclass
class _Exact:
    """One proposed rule: the template's segments (one may hold several values), its methods, headers and evidence."""

    segments: list[list[str]]
    methods: tuple[str, ...]
    headers: tuple[str, ...] | None
    denials: list[Denial]

    @property
    def variable(self) -> int:
        """The 1-based segment that holds several values (0: none)."""
        return next((i for i, values in enumerate(self.segments, start=1) if len(values) > 1), 0)


def exact_rules(requests: Sequence[tuple[str, str, tuple[str, ...] | None, Denial]]) -> list[_Exact]:
    """The rules that admit exactly the denied requests of one (host, port): one per path, with the methods seen on
    it; paths denied the same methods and header names that differ in one segment only share a rule whose variable
    is an enum of exactly the values seen (the set of paths it admits is exactly the set seen, so no wider)."""
    by_path: dict[str, tuple[set[str], set[str] | None, list[Denial]]] = {}
    for path, method, headers, d in requests:
        methods, seen, denials = by_path.setdefault(path, (set(), None, []))
        methods.add(method)
        if headers is not None:
            seen = (seen or set()) | set(headers)
        denials.append(d)
        by_path[path] = (methods, seen, denials)
    kinds: dict[tuple, list[str]] = {}
    for path, (methods, seen, _) in sorted(by_path.items()):
        key = (tuple(m for m in METHODS if m in methods), tuple(sorted(seen)) if seen is not None else None, path.count("/"))
        kinds.setdefault(key, []).append(path)
    out: list[_Exact] = []
    for (methods, headers, _), paths in kinds.items():
        left = list(paths)
        while left:
            best: list[str] = [left[0]]
            for i in range(len(left[0].split("/")) - 1):
                buckets: dict[tuple[str, ...], list[str]] = {}
                for p in left:
                    parts = p.split("/")[1:]
                    if parts[i] != "":  # an empty segment is never an enum option
                        buckets.setdefault(tuple(parts[:i] + ["\0"] + parts[i + 1:]), []).append(p)
                for bucket in buckets.values():
                    if len(bucket) > len(best):
                        best = bucket
            parts = [p.split("/")[1:] for p in best]
            segments = [sorted(set(column)) for column in zip(*parts)]
            denials = [d for p in best for d in by_path[p][2]]
            out.append(_Exact(segments, methods, headers, denials))
            left = [p for p in left if p not in best]
    return out


def _option(value: str) -> str:
    """An enum option as the template grammar reads it back (quoted unless plainly a word)."""
    return value if re.fullmatch(r"[A-Za-z0-9_.~-]+", value) and not value.startswith("int") else json.dumps(value)


def template_text(segments: Sequence[Sequence[str]]) -> str:
    """`/a/b/{segmentN:x|y}`: literal segments, and one enum variable where several values were seen."""
    out = []
    for i, values in enumerate(segments, start=1):
        out.append(values[0] if len(values) == 1 else "{segment%d:%s}" % (i, "|".join(_option(v) for v in values)))
    return "/" + "/".join(out)


def expected_template(segments: Sequence[Sequence[str]]) -> tuple[Segment, ...]:
    """The artifact segments `template_text(segments)` must compile to."""
    return tuple(Segment(literal=v[0]) if len(v) == 1 else Segment(name=f"segment{i}", value=Value(type="string", enum=tuple(sorted(v))))
                 for i, v in enumerate(segments, start=1))


def rule_name(host: str, taken: set[str]) -> str:
    """`proposed-<n>`, unique among `taken`. Not derived from the host: a long host with its dots turned into dashes
    reads as a high-entropy token to the secret scan (EL0029), and the rule names its host anyway."""
    n = 1
    while f"proposed-{n}" in taken:
        n += 1
    return f"proposed-{n}"


def _rule_of(group: _Group, exact: _Exact, conn: Connection, taken: set[str]) -> tuple[dict, list[str]]:
    notes: list[str] = []
    kept, dropped = [], []
    for name in exact.headers or ():
        if header_is_denylisted(name, conn.inject.header, conn.kind) or not _TOKEN.fullmatch(name) or looks_secret(name):
            dropped.append(name)
        else:
            kept.append(name)
    if dropped:
        shown = [n if not looks_secret(n) else "[redacted]" for n in dropped]
        notes.append("headers the language refuses to allowlist were left out: " + ", ".join(f"`{n}`" for n in shown))
    if exact.headers is None:
        notes.append("the events name no headers: the rule forwards none (add the ones the caller needs)")
    if exact.variable:
        notes.append(f"segment {exact.variable} is an enum of exactly the {len(exact.segments[exact.variable - 1])} values seen "
                     "(each denied with the same methods and header names)")
    name = rule_name(group.host, taken)
    taken.add(name)
    rule = {"name": name, "host": group.host, "port": group.port, "path": template_text(exact.segments),
            "methods": list(exact.methods), "headers": kept}
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
            f'    path = {q(rule["path"])}\n    methods = {q(rule["methods"])}\n'
            f'    headers = {q(rule["headers"])}\n  }}\n')


def _rule_block(files: Sequence[SourceFile], connection: str, rule: str) -> tuple[SourceFile, Named] | None:
    found = _find(files, "connection", connection)
    if found is None or found[1].body is None:
        return None
    blocks = [b for b in found[1].body.blocks if b.kind == "egress" and b.name == rule]
    return (found[0], blocks[0]) if len(blocks) == 1 and blocks[0].body is not None else None


def _end(text: str, span) -> int:
    return _offset(text, span.end_line, span.end_column)


def _append(text: str, items: ListV, values: Sequence[str]) -> tuple[int, int, str]:
    """An insert that appends `values` (strings) to a list."""
    closing = _closing(text, items.span)
    comma = ", " if items.items and _needs_comma(text, _end(text, items.items[-1].span), closing) else ""
    return closing, closing, (comma if items.items else "") + ", ".join(json.dumps(v) for v in values)


def _pair(text: str, obj: Obj, key: str, value: str) -> tuple[int, int, str]:
    """An insert that adds `key = value` to an object (entries need no comma; `fmt` lays them out)."""
    closing = _closing(text, obj.span)
    return closing, closing, f" {json.dumps(key)} = {value} "


def _shape_edits(text: str, block: Named, place: str, items: Sequence[str], segment: int) -> list[tuple[int, int, str]] | str:
    """The inserts that add `items` at `place` of a rule's block, or why the source cannot take them."""
    body = block.body
    assert body is not None
    head, _, tail = place.partition(".")
    outer = body.get(head)
    if outer is None:
        return f"the rule's `{head}` is not written in its block"
    if head == "path":
        if not isinstance(outer.value, Str):
            return "the rule's `path` is not a string"
        template = outer.value.value
        part = template_parser().parse(template).children[segment - 1]
        at = part.meta.end_pos - 1  # the variable's closing `}`
        new = template[:at] + "".join(f"|{_option(v)}" for v in items) + template[at:]
        start = _offset(text, outer.value.span.line, outer.value.span.column)
        return [(start, _end(text, outer.value.span), json.dumps(new))]
    if not isinstance(outer.value, Obj):
        return f"the rule's `{head}` is not an object"
    obj = outer.value
    if head == "query":
        return [_pair(text, obj, name, "{ max_length = %d }" % QUERY_MAX_LENGTH) for name in items]
    if place == "mcp.tools":
        tools = obj.get("tools")
        entries = " ".join(f"{json.dumps(t)} = {{ arguments = {{}} }}" for t in items)
        # fmt keeps a comment above a rule's entry, never inside an object: say it there
        key_at = _offset(text, outer.key_span.line, outer.key_span.column)
        many = len(items) > 1
        note = (f"# proposed: tool{'s' if many else ''} {', '.join(f'`{t}`' for t in items)} admit{'' if many else 's'} no "
                f"argument until {'their' if many else 'its'} `arguments` list it\n    ")
        if tools is None:
            return [(key_at, key_at, note), _pair(text, obj, "tools", "{ " + entries + " }")]
        if not isinstance(tools.value, Obj):
            return "the rule's `mcp.tools` is not an object"
        closing = _closing(text, tools.value.span)
        return [(key_at, key_at, note), (closing, closing, f" {entries} ")]
    current = obj.get(tail)
    if current is None:
        start = list(MCP_DEFAULT_METHODS) if place == "mcp.methods" else []
        return [_pair(text, obj, tail, json.dumps(start + list(items)))]
    if not isinstance(current.value, ListV):
        return f"the rule's `{place}` is not a list"
    return [_append(text, current.value, items)]


def _addition_dict(a: _Addition) -> dict:
    head, _, tail = a.place.partition(".")
    if a.place == "mcp.tools":
        return {"rule": a.rule, "mcp": {"tools": {a.item: {"arguments": {}}}}}
    if head == "query":
        return {"rule": a.rule, "query": {a.item: {"max_length": QUERY_MAX_LENGTH}}}
    if head == "path":
        return {"rule": a.rule, "path": {"segment": a.segment, "enum": [a.item]}}
    return {"rule": a.rule, head: {tail: [a.item]}}


def _added_in(rule: Rule | None, a: _Addition) -> bool:
    """Whether the compiled proposal holds the addition (a check of this module, not of the evidence)."""
    if rule is None:
        return False
    if a.place == "mcp.tools":
        return rule.mcp is not None and any(t.name == a.item and not t.arguments and not t.additional for t in rule.mcp.tools)
    if a.place == "mcp.methods":
        return rule.mcp is not None and a.item in rule.mcp.methods
    if a.place.startswith("graphql."):
        return rule.graphql is not None and a.item in getattr(rule.graphql, a.place.split(".")[1])
    if a.place == "git.push":
        return rule.git is not None and a.item in rule.git.push
    if a.place == "query":
        return rule.query is not None and any(p.name == a.item for p in rule.query)
    value = rule.template[a.segment - 1].value if rule.template is not None and len(rule.template) >= a.segment else None
    return value is not None and value.enum is not None and a.item in value.enum


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
        planned = []
        for g in groups:
            exacts = exact_rules(g.requests)
            requested = {id(d) for e in exacts for d in e.denials}
            tunnels = [d for d in g.denials if id(d) not in requested]  # CONNECTs to this host:port: the first rule's evidence
            if exacts and tunnels:
                exacts[0].denials.extend(tunnels)
            for e in exacts:
                if expected_template(e.segments) != _parsed_template(template_text(e.segments)):
                    for d in e.denials:
                        sorter.refuse(d, "the path cannot be written as a template exactly", f"connection:{name}")
                else:
                    planned.append((g, e))
        room = MAX_RULES_PER_CONNECTION - len(conn.rules)
        if found is None or len(planned) > room:
            why = (f"connection `{name}` would exceed {MAX_RULES_PER_CONNECTION} rules (one exact rule per denied path)"
                   if found is not None else "its declaration is not in this policy's source")
            for _, e in planned:
                for d in e.denials:
                    sorter.refuse(d, why, f"connection:{name}")
            continue
        source, decl = found
        taken = {r.name for r in conn.rules}
        blocks = []
        for g, e in planned:
            rule, notes = _rule_of(g, e, conn, taken)
            blocks.append(_render_rule(rule))
            changes.append(Change(source.path, "connection", name, {"egress": rule}, _evidence(e.denials, notes)))
        if blocks:
            at = _closing(policy.sources[source.path], decl.span)
            edits.setdefault(source.path, []).append((at, at, "".join(blocks)))

    # shape additions: exactly the refused name, in the rule that refused it
    places: dict[tuple[str, str, str, int], list[_Addition]] = {}
    for a in sorted(sorter.additions, key=lambda a: (a.connection, a.rule, a.place, a.segment, a.item)):
        places.setdefault((a.connection, a.rule, a.place, a.segment), []).append(a)
    added: list[_Addition] = []
    for (conn_name, rule_name_, place, segment), items in places.items():
        found_rule = _rule_block(policy.files, conn_name, rule_name_)
        text = policy.sources[found_rule[0].path] if found_rule else ""
        inserts = (_shape_edits(text, found_rule[1], place, [a.item for a in items], segment) if found_rule
                   else "its rule's block is not in this policy's source")
        if isinstance(inserts, str):
            for a in items:
                for d in sorter.additions[a]:
                    sorter.refuse(d, inserts, f"connection:{conn_name}")
            continue
        source = found_rule[0]  # type: ignore[index]
        edits.setdefault(source.path, []).extend(inserts)
        for a in items:
            notes = []
            if place == "path":
                others = [s_ for i, s_ in enumerate(_rule_named(policy.artifact.connection(conn_name), rule_name_).template or (), start=1)
                          if i != segment and s_.value is not None and not (s_.value.enum is not None and len(s_.value.enum) == 1)]
                if others:
                    notes.append(f"the value joins segment {segment}'s enum: it is admitted with every value the template's other "
                                 f"variables admit ({', '.join(f'`{{{o.name}}}`' for o in others)})")
            elif place == "query":
                notes.append(f"the audit holds the parameter's name, never its value: any value up to {QUERY_MAX_LENGTH} "
                             "characters is admitted; narrow it (an enum, a pattern) if you know it")
            elif place == "mcp.tools":
                notes.append("the tool is admitted with no argument (`arguments = {}`, `additional = false`): a call that "
                             "carries one is refused `mcp-argument-refused` until its `arguments` list it")
            changes.append(Change(source.path, "connection", conn_name, _addition_dict(a), _evidence(sorter.additions[a], notes)))
            added.append(a)

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
    for a in added:
        conn = result.artifact.connection(a.connection)
        if not _added_in(_rule_named(conn, a.rule) if conn is not None else None, a):
            raise ProposeError(f"the proposed policy does not hold `{a.item}` in rule `{a.rule}` ({a.place})", "please report this")
    refusals = [Refusal(reason, why, subject, _evidence(ds))
                for (reason, why, subject), ds in sorted(sorter.refused.items(), key=lambda kv: (kv[0][0], kv[0][2] or "", kv[0][1]))]
    reviews = [Review(reason, subject, rule, where, why, _evidence(ds))
               for (reason, subject, rule, where, why), ds in sorted(sorter.reviewed.items())]
    changes.sort(key=lambda c: (c.file, c.kind, c.subject))
    return Proposal(tuple(changes), tuple(refusals), _evidence(sorter.admitted), dict(policy.sources), new_sources, result,
                    tuple(reviews))


def _rule_named(conn: Connection, name: str) -> Rule:
    (rule,) = [r for r in conn.rules if r.name == name]  # INVARIANT: rule names are unique in a connection
    return rule


def _parsed_template(text: str) -> tuple[Segment, ...] | None:
    try:
        return parse_template(text)
    except (TemplateError, PatternError):
        return None
