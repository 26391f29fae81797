"""The decision function: the adapter from a `Request` and resolver answers to the decision core.

Pure and deterministic: no I/O, no DNS, no clock, no mitmproxy. This module reads the request
(host and path normalizers, the header scan) into a `core.Observation`, asks `egress_proxy.decision.core`
for the verdict, and turns it into a `Decision` with a reason code and a human `detail`. The
semantics — which check, in which order, with which reason — live in `egress_proxy.decision.core`, which
the prover runs symbolically; nothing here decides anything the core does not. docs/decision.md
states the order of the checks.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from catalog import CatalogError, SpecialPurposeTable, load_catalog
from compiler.artifact import Artifact, Connection, SandboxProfile, Worker
from compiler.constants import DEFAULT_WORKER
from compiler.normalize import (
    HostError,
    HostForm,
    PathError,
    check_target,
    normalize_host,
    normalize_path,
    normalize_prefix,
)
from egress_proxy.decision import core
from egress_proxy.decision.addresses import (
    WorkerJudge,
    answers_of,
    refusal_detail,
    worker_judge,
)
from egress_proxy.decision.bodies import (
    BodyError,
    GqlRequest,
    ToolsFilter,
    expect_json,
    graphql_get,
    graphql_requests,
    mcp_messages,
    media_type,
    operation_of,
    push_commands,
    read_json,
    tool_call,
)
from egress_proxy.decision.reasons import ALLOWED
from egress_proxy.decision.shapes import (
    Shape,
    body_to_judge,
    judge_git,
    judge_graphql,
    judge_head,
    judge_mcp,
    query_gap,
    query_pairs,
    shape_of,
)
from egress_proxy.decision.types import Decision, Lease, Request

SCHEMES = core.SCHEMES
CONNECTION_SCHEMES = core.CONNECTION_SCHEMES
DEFAULT_PORTS = {"http": 80, "https": 443}
_PORT = re.compile(r"^[0-9]{1,5}$")
_CANONICAL_PORT = re.compile(r"[1-9][0-9]{0,4}")
_FIELD_BREAK = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # a control character: CR, LF, NUL, ESC ... (RFC 9110 §5.5 allows only HTAB)
# Headers the scan looks at (the last two ask for a different protocol on this connection).
_FRAMING_HEADERS = frozenset({"host", "connection", "content-length", "transfer-encoding", "upgrade", "http2-settings"})


@functools.lru_cache(maxsize=16384)
def _host_form(raw: str) -> HostForm | HostError:
    """normalize_host, memoized (hosts repeat); a refusal is returned, not raised."""
    try:
        return normalize_host(raw)
    except HostError as exc:
        return exc


# ---------------------------------------------------------------------------------------------
# The per-artifact index: built once per artifact object, so a decision costs the same for an
# artifact of 10 or 10,000 connections.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class View:
    """One subject: the core's table, the worker's judge (memo and explanations), profile grants for `detail`."""

    subject: core.Subject
    judge: WorkerJudge
    granted_by: dict[tuple[str, int], str]
    # Request shapes (docs/shapes.md): `shapes[i]` is rule i's (None: it has none); `shaped` maps (connection, rule)
    # to its shape for the body's judgement. Both empty when no rule of the subject has a shape.
    shapes: tuple[Shape | None, ...] = ()
    shaped: dict[tuple[str, str], Shape] | None = None


class ArtifactIndex:
    """Lookups for one artifact, built lazily per subject and kept for the artifact's lifetime."""

    __slots__ = ("artifact", "table", "error", "_views", "_judges", "_by_name", "names")

    def __init__(self, artifact: Artifact, table: SpecialPurposeTable | None = None) -> None:
        self.artifact = artifact
        self.error: str | None = None
        # Built from the tuples, not Artifact's cached lookups: `model_copy(update=...)` copies those
        # cached dicts, so a mutated copy would answer with its original's subjects.
        self._by_name: tuple[dict[str, Worker], dict[str, Connection], dict[str, SandboxProfile]] = (
            {w.name: w for w in artifact.workers},
            {c.name: c for c in artifact.connections},
            {p.name: p for p in artifact.sandbox_profiles},
        )
        # Every rule/profile host that is already in normal form, mapped to its HostForm: the common
        # request names one exactly, and then needs no normalizing (normalize_host is idempotent).
        self.names: dict[str, HostForm] = {}
        hosts = {r.host for c in artifact.connections for r in c.rules}
        hosts.update(h.host for p in artifact.sandbox_profiles for h in p.network.allowed_hosts)
        for h in hosts:
            form = _host_form(h)
            if isinstance(form, HostForm) and form.value == h:
                self.names[h] = form
        self._views: dict[tuple[str, str], View | None] = {}
        self._judges: dict[str, WorkerJudge | None] = {}
        self.table: SpecialPurposeTable | None = table
        if table is None:
            try:
                self.table = load_catalog(artifact.catalog.version).special_purpose
            except CatalogError as exc:
                self.error = str(exc)

    def judge(self, worker_name: str) -> WorkerJudge | None:
        """The worker's judge; None when the worker is missing or its settings are malformed (fail closed)."""
        if worker_name not in self._judges:
            worker = self._by_name[0].get(worker_name)
            judge = None
            if worker is not None and self.table is not None:
                try:
                    judge = worker_judge(worker, self.table)
                except (ValueError, CatalogError):
                    judge = None
            self._judges[worker_name] = judge
        return self._judges[worker_name]

    def view(self, lease: Lease) -> tuple[View | None, str, str | None]:
        """(view, reason, detail): the lease's subject, or why there is none."""
        kind, name = ("connection", lease.connection) if lease.connection is not None else ("profile", lease.profile or "")
        key = (kind, name)
        if key not in self._views:
            self._views[key] = self._build(kind, name)
        view = self._views[key]
        if view is not None:
            return view, ALLOWED, None
        if (name not in self._by_name[1]) if kind == "connection" else (name not in self._by_name[2]):
            return None, "lease-unknown-subject", f"{kind} `{_show(name)}` is not in the artifact"
        return None, "worker-unknown", "the worker of this subject is missing or malformed in the artifact"

    def _build(self, kind: str, name: str) -> View | None:
        try:
            subject = self.subject_table(kind, name)
        except (ValueError, CatalogError):  # a malformed worker, or a brokered connection missing or unusable: fail closed
            return None
        judge = self.judge(subject.worker.name) if subject is not None else None
        if subject is None or judge is None:
            return None
        granted: dict[tuple[str, int], str] = {}
        prof = self._by_name[2].get(name) if kind == "profile" else None
        if prof is not None and prof.network.mode == "allowlist":
            for entry in prof.network.allowed_hosts:
                granted.setdefault((entry.host, entry.port), entry.granted_by)
        try:
            shapes = self._shapes(subject)
        except ValueError:  # a pattern that does not parse: the subject is unusable (fail closed)
            return None
        shaped = {key: s for key, s in shapes.items() if s is not None}
        if not shaped:
            return View(subject, judge, granted)
        owners = subject.owners or (subject,) * len(subject.rules)
        return View(subject, judge, granted, tuple(shapes[(o.name, r.name)] for o, r in zip(owners, subject.rules)), shaped)

    def _shapes(self, subject: core.Subject) -> dict[tuple[str, str], Shape | None]:
        """(connection, rule) -> the rule's shape, for every rule of `subject` (a profile's: its brokered rules)."""
        out: dict[tuple[str, str], Shape | None] = {}
        for owner in {o.name for o in subject.owners} if subject.kind == "profile" else {subject.name}:
            conn = self._by_name[1].get(owner)
            for rule in conn.rules if conn is not None else ():
                out[(owner, rule.name)] = shape_of(rule)
        return out

    def subject_table(self, kind: str, name: str) -> core.Subject | None:
        """The core's table of one subject: the one construction the proxy and the prover share.

        None when the subject, or its worker, is not in the artifact. ValueError or CatalogError when a worker
        setting is malformed, a brokered connection is unusable or the catalog does not load. Which worker
        judges the subject is decided here and nowhere else: a connection's own, a profile's the `default`.
        """
        if self.table is None:
            raise CatalogError(self.error or "the catalog does not load")
        if kind == "connection":
            conn = self._by_name[1].get(name)
            worker = self._by_name[0].get(conn.worker) if conn is not None else None
            if conn is None or worker is None:
                return None
            return core.connection_subject(conn, worker_judge(worker, self.table).tables, normalize_prefix)
        prof = self._by_name[2].get(name)
        worker = self._by_name[0].get(DEFAULT_WORKER)
        if prof is None or worker is None:
            return None
        return core.profile_subject(prof, worker_judge(worker, self.table).tables, ConnectionTables(self))

    def token_view(self, connection: str) -> View | None:
        """The view whose table judges connection `connection`'s token endpoint (`core.mint_verdict` on its subject): the
        connection's own, whoever's request made the edge mint; None when it is missing or unusable. The prover
        evaluates `core.mint_verdict` on this very table, so a wrong worker chosen here is refuted."""
        return self.view(Lease(subject="", profile=None, connection=connection, exp=0))[0]

    def connection_table(self, name: str) -> core.Subject | None:
        """The core's table of connection `name` (None when it is missing or its worker is unusable)."""
        view = self.view(Lease(subject="", profile=None, connection=name, exp=0))[0]
        return view.subject if view is not None else None


class ConnectionTables(Mapping):
    """Every connection's core table by name, built on first use (what `core.profile_subject` brokers from)."""

    def __init__(self, index: ArtifactIndex) -> None:
        self.index = index

    def __getitem__(self, name: str) -> core.Subject | None:
        if name not in self.index._by_name[1]:
            raise KeyError(name)
        return self.index.connection_table(name)

    def __iter__(self):
        return iter(self.index._by_name[1])

    def __len__(self) -> int:
        return len(self.index._by_name[1])


_INDEXES: dict[tuple[int, int], ArtifactIndex] = {}
_INDEXES_MAX = 16


def artifact_index(artifact: Artifact, table: SpecialPurposeTable | None = None) -> ArtifactIndex:
    """The cached index of this artifact object (identity-keyed: a rebuilt or mutated artifact gets its own), over
    its catalog's special-purpose table, or over `table` (the prover's, when it judges with another)."""
    key = (id(artifact), id(table))
    index = _INDEXES.get(key)
    # INVARIANT: the index holds a reference to its artifact and table, so neither id is reused while cached.
    if index is None or index.artifact is not artifact or (table is not None and index.table is not table):
        if len(_INDEXES) >= _INDEXES_MAX:
            _INDEXES.pop(next(iter(_INDEXES)))
        index = _INDEXES[key] = ArtifactIndex(artifact, table)
    return index


# ---------------------------------------------------------------------------------------------
# Reading the request into the core's Observation
# ---------------------------------------------------------------------------------------------


def _destination_reading(index: ArtifactIndex, scheme: object, host: object, port: object) -> tuple[core.Observation, str | None]:
    """The observation of (scheme, host, port), and the normalized host (None when refused)."""
    scheme_ = scheme if type(scheme) is str else ""
    port_ = port if type(port) is int else -1
    if type(host) is not str:
        return core.Observation(scheme_, port_, "host-empty", ""), None
    form = index.names.get(host) or _host_form(host)
    if isinstance(form, HostError):
        return core.Observation(scheme_, port_, form.reason, ""), None
    name = form.value
    if form.is_ip:
        ip = ipaddress.ip_address(name)
        return core.Observation(scheme_, port_, "", name, True, ip.version == 6, int(ip)), name
    return core.Observation(scheme_, port_, "", name), name


def _read_request(view: View, o: core.Observation, req: Request, host: str | None) -> tuple[list[str], set[str], str]:
    """Fill the request fields of `o` (method, header scan, path); (lowercased names, `Connection` names, path message)."""
    o.method = req.method if type(req.method) is str else ""
    lowers: list[str] = []
    hosts: list[object] = []
    hop: set[str] = set()
    content_lengths = 0
    chunked = upgrade = False
    for item in req.headers:
        if type(item) is not tuple or len(item) != 2 or type(item[0]) is not str or type(item[1]) is not str:
            # an adapter bug (e.g. bytes from mitmproxy's raw fields): never skip a header we cannot read
            o.unreadable_headers = True
            return lowers, hop, "request headers must be (name, value) text pairs"
        name, value = item
        if not (value.isprintable() and name.isprintable()) and (_FIELD_BREAK.search(value) or _FIELD_BREAK.search(name)):
            # mitmproxy keeps a bare CR (or an HTTP/2 value's CR/LF/NUL, or an ESC) inside a header and would write it
            # upstream as is, where a lenient parser reads a second header line (e.g. its own Authorization) or a
            # terminal reads an escape. RFC 9110 §5.5 allows no control character but HTAB in a field. isprintable()
            # is the fast path: no control character is printable, so only an odd value is searched.
            o.field_break = True
        lower = name.lower()
        lowers.append(lower)
        if lower in _FRAMING_HEADERS:
            if lower == "host":
                hosts.append(value)
            elif lower == "connection":
                hop.update(_tokens(value))
            elif lower == "content-length":
                content_lengths += 1
            elif lower == "transfer-encoding":
                chunked = True
            else:
                upgrade = True
    o.duplicate_host = len(hosts) > 1
    # Declared trailers would arrive after the decision (HTTP/1 trailers also crash mitmproxy's reader).
    o.trailers = "trailer" in lowers
    o.port_mismatch = bool(req.tunnel) and req.inner_port is not None and req.inner_port != o.port
    if req.host_header is not None:
        hosts.append(req.host_header)
    if host is not None:
        default_port = DEFAULT_PORTS.get(req.scheme, 0) if type(req.scheme) is str else 0
        for v in hosts:
            if v == host and o.port == default_port:
                continue  # what _authority_agrees answers for the normal form itself (normalize_host is idempotent)
            if type(v) is not str or not _authority_agrees(v, host, o.port, default_port):
                o.host_mismatch = True
                break
    o.upgrade = upgrade or "upgrade" in hop
    o.framing = (chunked and content_lengths > 0) or content_lengths > 1
    o.body = bool(req.has_body)
    target = req.target if type(req.target) is str else ""
    try:
        # A connection's rules match paths, so its paths must read one way (normalize_path refuses
        # the rest); a profile grants whole host:port pairs, so only malformed targets are refused.
        o.path = normalize_path(target) if view.subject.kind == "connection" else check_target(target)
    except PathError as exc:
        o.path_error = exc.reason
        o.path = ""
        return lowers, hop, exc.message
    if view.subject.rules and view.subject.kind == "profile":
        # A brokering profile matches its brokered rules on the normalized path; a target without one is
        # still plain profile traffic, which no rule (and so no credential) ever matches.
        try:
            o.path = normalize_path(target)
        except PathError:
            o.path_odd = True
    return lowers, hop, ""


def _tokens(value: object) -> list[str]:
    """The lowercased names listed in one `Connection` header value (a non-string lists none)."""
    return [t.strip().lower() for t in value.split(",")] if type(value) is str else []


@functools.lru_cache(maxsize=4096)
def _authority_agrees(value: object, host: str, port: int, default_port: int) -> bool:
    """Does a Host header value name exactly (host, port)? A missing port means the scheme's default."""
    if not isinstance(value, str):
        return False
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return False
        name, rest = value[: end + 1], value[end + 1 :]
    elif ":" in value:
        name, _, port_text = value.partition(":")
        rest = ":" + port_text
    else:
        name, rest = value, ""
    if rest == "":
        given = default_port
    elif rest.startswith(":") and _PORT.match(rest[1:]):
        given = int(rest[1:])
    else:
        return False
    form = _host_form(name)
    return not isinstance(form, HostError) and form.value == host and given == port


# ---------------------------------------------------------------------------------------------
# Stage 1: the destination (CONNECT time and before resolving)
# ---------------------------------------------------------------------------------------------


def _subject_of(index: ArtifactIndex, lease: Lease) -> tuple[View | None, Decision | None]:
    """The lease's subject in the artifact (checks 0-2 of docs/decision.md), or None and the denial that says why."""
    if index.error is not None:
        return None, Decision(reason="internal-error", detail=index.error)
    view, reason, detail = index.view(lease)
    if view is None:
        return None, Decision(reason=reason, detail=detail)
    return view, None  # no Decision built on the way in: a frozen dataclass costs microseconds


def decide_destination(artifact: Artifact, lease: Lease, scheme: str, host: str, port: int) -> Decision:
    """May this lease reach `scheme://host:port` at all? The destination checks alone (`core.destination`)."""
    index = artifact_index(artifact)
    view, refusal = _subject_of(index, lease)
    if view is None:
        return refusal  # type: ignore[return-value]
    o, name = _destination_reading(index, scheme, host, port)
    reason = core.destination(view.subject, o)
    if reason:
        return Decision(reason=reason, detail=_detail(reason, view, o, scheme, host, port), host=name)
    return Decision(allowed=True, reason=ALLOWED, host=name, observed=core.observed_miss(view.subject, o) or None)


def decide_connect(artifact: Artifact, lease: Lease, authority: str, headers: tuple[tuple[str, str], ...] = (),
                   has_body: bool = False) -> Decision:
    """May this lease open a tunnel to `authority` (`host:port` as sent on the CONNECT line)? Before DNS.

    The authority is judged as sent: a port spelled non-canonically (`:0443`, `:+443`, none) is `port-invalid`,
    and the host goes through the one host normalizer (brackets included). The CONNECT's own headers are read as
    a request's are, for the body and upgrade findings `core.connect_verdict` refuses."""
    index = artifact_index(artifact)
    view, refusal = _subject_of(index, lease)
    if view is None:
        return refusal  # type: ignore[return-value]
    text = authority if type(authority) is str else ""
    raw_host, _, raw_port = text.rpartition(":")
    port = int(raw_port) if _CANONICAL_PORT.fullmatch(raw_port) else -1
    o, name = _destination_reading(index, "https", raw_host, port)
    request = Request(method="CONNECT", scheme="https", host=raw_host, port=port, target="/", headers=headers, has_body=has_body)
    _read_request(view, o, request, None)
    reason = core.connect_verdict(view.subject, o)
    if reason:
        return Decision(reason=reason, detail=_detail(reason, view, o, "https", raw_host, raw_port or port), host=name)
    return Decision(allowed=True, reason=ALLOWED, host=name, observed=core.observed_miss(view.subject, o) or None)


def judge_answers(artifact: Artifact, lease: Lease, ips: Iterable[object]) -> Decision:
    """Are all of a name's resolver answers dialable by the lease's subject's own worker? (`core.answers_verdict`:
    the proxy asks when it resolves a name for a tunnel or a plain request; `decide` judges them again with the
    worker of the request's carrier.)"""
    index = artifact_index(artifact)
    view, refusal = _subject_of(index, lease)
    if view is None:
        return refusal  # type: ignore[return-value]
    ips = list(ips)
    reason = core.answers_verdict(view.subject.worker, answers_of(ips))
    if reason:
        return Decision(reason=reason, detail=refusal_detail(view.judge, ips, reason))
    return Decision(allowed=True, reason=ALLOWED)


def judge_token_answers(artifact: Artifact, connection: str, ips: Iterable[object]) -> Decision:
    """Are the resolver answers of `connection`'s token endpoint dialable? (`core.mint_verdict`: judged by the
    connection's own worker, whoever's request made the edge mint; the edge dials the first answer.)"""
    index = artifact_index(artifact)
    view = index.token_view(connection) if index.error is None else None
    if view is None:
        return Decision(reason="worker-unknown", detail=f"connection `{_show(connection)}` or its worker is not usable")
    ips = list(ips)
    reason = core.mint_verdict(view.subject, answers_of(ips))
    if reason:
        return Decision(reason=reason, detail=refusal_detail(view.judge, ips, reason))
    return Decision(allowed=True, reason=ALLOWED)


# ---------------------------------------------------------------------------------------------
# Stage 2: the full request
# ---------------------------------------------------------------------------------------------


def decide(artifact: Artifact, lease: Lease, request: Request, resolved_ips: Iterable[object]) -> Decision:
    """The full decision for one HTTP request: destination, request checks, rule, then every resolved address."""
    return _request(artifact_index(artifact), lease, request, resolved_ips)


def decide_without_addresses(artifact: Artifact, lease: Lease, request: Request) -> Decision:
    """`decide` minus the address check: `egresslaw explain` without `--resolve`, and the proxy before it resolves
    a plain request's name (so nothing is resolved for a request refused anyway). Never a reason to forward."""
    return _request(artifact_index(artifact), lease, request, None)


def observe(artifact: Artifact, lease: Lease, request: Request) -> tuple[core.Subject, core.Observation, set[str]] | None:
    """What the core sees of `request` (its subject, the Observation, the names listed in `Connection`); None when
    the lease has no usable subject. For the prover's differential test and replays; the proxy never calls this."""
    index = artifact_index(artifact)
    view = index.view(lease)[0] if index.error is None else None
    if view is None:
        return None
    o, host = _destination_reading(index, request.scheme, request.host, request.port)
    _, hop, _ = _read_request(view, o, request, host)
    return view.subject, o, hop


def _request(index: ArtifactIndex, lease: Lease, req: Request, ips: Iterable[object] | None) -> Decision:
    view, refusal = _subject_of(index, lease)
    if view is None:
        return refusal  # type: ignore[return-value]
    s = view.subject
    o, host = _destination_reading(index, req.scheme, req.host, req.port)
    lowers, hop, message = _read_request(view, o, req, host)
    query = _query(req.target)
    if view.shapes and not o.path_error:
        o.shapes = _head_shapes(view, o, req, query)
    path = o.path or None
    ips = list(ips) if ips is not None else None
    reason, rule, admitted = core.verdict(s, o, answers_of(ips) if ips is not None else None)
    if reason and not admitted:
        if reason in HEAD_SHAPE_REASONS:
            return _shape_refusal(view, o, req, query, reason, host, path)
        detail = message if reason in ("internal-error", o.path_error) else _detail(reason, view, o, req.scheme, req.host, req.port)
        return Decision(reason=reason, detail=detail, host=host, path=path if reason.endswith("-not-allowed") else None)
    if reason:  # the request was admitted and one of its answers refused, by the worker of its carrier
        judge = index.judge(core.request_worker(s, rule).name)
        detail = refusal_detail(judge, ips or (), reason) if judge is not None else ""
        return Decision(reason=reason, detail=detail, host=host, path=path)
    carrier = core.carrier(s, rule)
    forward = tuple(h for h, lower in zip(req.headers, lowers) if core.forwarded(s, rule, lower, lower in hop))
    inject = core.credential_header(s, rule)
    if s.kind == "profile":
        granted = f"granted by {view.granted_by.get((host, o.port), 'the profile')}"
        observed = core.observed_miss(s, o)
        if observed:  # INVARIANT: the core gives an observed profile no brokered rules, so no credential rides here
            return Decision(allowed=True, reason=ALLOWED, host=host, path=path, forward_headers=forward, inject_header=inject,
                            observed=observed, detail=f"would deny: {_detail(observed, view, o, req.scheme, req.host, req.port)} (observe mode)")
        if carrier is None:
            return Decision(allowed=True, reason=ALLOWED, host=host, path=path, forward_headers=forward,
                            inject_header=inject, detail=granted)
        name = s.rules[rule].name
        brokered = Decision(allowed=True, reason=ALLOWED, rule=name, host=host, path=path, forward_headers=forward,
                            inject_header=inject, broker=carrier.name,
                            detail=f"brokered by connection `{carrier.name}`, rule `{name}` ({granted})")
        return _with_body(view, rule, o, req, query, brokered)
    decision = Decision(allowed=True, reason=ALLOWED, rule=s.rules[rule].name, host=host, path=path,
                        forward_headers=forward, inject_header=inject)
    return _with_body(view, rule, o, req, query, decision)


# ---------------------------------------------------------------------------------------------
# Request shapes (docs/shapes.md): the head judged into `Observation.shapes`, the body after admission
# ---------------------------------------------------------------------------------------------

# The reasons a rule's head shapes give (`shapes.judge_head`): the core returns one when only shapes refused.
HEAD_SHAPE_REASONS = frozenset({"path-template-mismatch", "query-parameter-not-allowed", "query-parameter-repeated",
                           "query-value-refused", "header-value-refused", "git-service-not-allowed"})


def _query(target: object) -> str | None:
    """The raw query of a request target (after the first `?`), None when it has none."""
    if type(target) is not str or "?" not in target:
        return None
    return target.split("?", 1)[1]


def _head_shapes(view: View, o: core.Observation, req: Request, query: str | None) -> tuple[str, ...]:
    """Each rule's head-shape reason for this request ("" : admitted or no shape); judged only for the rules whose
    host, port, method and path prefix admit it (no other rule's shapes can matter)."""
    out = []
    for rule, shape in zip(view.subject.rules, view.shapes):
        if shape is None or not shape.head or not core.admits(rule, o):
            out.append("")
        else:
            out.append(judge_head(shape, o.method, o.path, query, req.headers)[0])
    return tuple(out)


def _shape_refusal(view: View, o: core.Observation, req: Request, query: str | None, reason: str, host: str | None,
                   path: str | None) -> Decision:
    """The denial when only head shapes refused: the first such rule names the place."""
    for rule, shape, shaped in zip(view.subject.rules, view.shapes, o.shapes):
        if shaped == reason and shape is not None:
            where = judge_head(shape, o.method, o.path, query, req.headers)[1]
            return Decision(reason=reason, rule=rule.name, host=host, path=path, detail=f"rule `{rule.name}`: {where}")
    return Decision(reason=reason, host=host, path=path, detail="a request shape refused the request")


def _with_body(view: View, rule: int, o: core.Observation, req: Request, query: str | None, decision: Decision) -> Decision:
    """An admitted decision under a rule with a body shape: what the edge must hold and judge (a GraphQL GET is
    judged here, from its query)."""
    shape = view.shapes[rule] if view.shapes and rule >= 0 else None
    if shape is None:
        return decision
    if shape.graphql is not None and o.method in ("GET", "HEAD"):
        # `?` alone or an empty `&` component: another request upstream that no pair shows
        reason, where = ("query-parameter-not-allowed", query_gap(query)) if query is not None else ("", "")
        if not where:
            try:
                request = graphql_get(tuple(query_pairs(query or "") or ()))
                reason, where = _judge_graphql(shape, (request,))
            except BodyError as exc:
                reason, where = exc.reason, exc.detail
        if reason:
            return Decision(reason=reason, rule=decision.rule, host=decision.host, path=decision.path,
                            detail=f"rule `{shape.rule}`: {where}")
        return decision
    body = body_to_judge(shape, o.method, o.path, query)
    if shape.mcp is not None and o.method == "GET":
        # The server's own SSE stream (resumed with Last-Event-ID, it may replay an earlier answer): every `tools/list`
        # result on it is cut to the rule's tools, whatever its id.
        return replace(decision, answer_filter=ToolsFilter(None, frozenset(shape.tools)))
    if not body:
        return decision
    return replace(decision, body_shape=body, body_limit=shape.max_body)


def _judge_graphql(shape: Shape, requests: Iterable[GqlRequest]) -> tuple[str, str]:
    items = []
    for request in requests:
        if request.document is None:
            items.append((None, request.persisted, None, ()))
        else:
            op = operation_of(request)
            items.append((request.document, request.persisted, op.type, op.fields))
    return judge_graphql(shape, items)


def judge_body(artifact: Artifact, lease: Lease, request: Request, decision: Decision, body: bytes) -> Decision:
    """The body of a request `decide` admitted with a `body_shape`, read whole (`body`), judged by its rule's shape.

    Returns the decision (its `answer_filter` set when MCP `tools/list` answers must be cut to the rule's tools) or
    a denial that names the rule and the place. Never raises for anything the body holds."""
    if decision.body_shape is None or not decision.allowed:
        return decision
    view = artifact_index(artifact).view(lease)[0]
    carrier = decision.broker or lease.connection
    shape = view.shaped.get((carrier or "", decision.rule or "")) if view is not None and view.shaped else None
    if shape is None:  # INVARIANT: `decide` named a shaped rule of this very artifact; anything else fails closed
        return Decision(reason="internal-error", rule=decision.rule, host=decision.host, path=decision.path,
                        detail="the rule's shape is not in the artifact")
    answer_filter = None
    try:
        if len(body) > shape.max_body:
            raise BodyError("body-too-large-to-judge", f"{len(body)} bytes, the rule judges at most {shape.max_body}")
        coded = [v for n, v in request.headers if n.lower() == "content-encoding" and v.strip().lower() != "identity"]
        if coded:
            raise BodyError("body-malformed", "a coded body (`Content-Encoding`) cannot be judged")
        if decision.body_shape == "git":
            if media_type(request.headers) != "application/x-git-receive-pack-request":
                raise BodyError("content-type-mismatch", "a push takes `application/x-git-receive-pack-request`")
            reason, where = judge_git(shape, tuple((u.old, u.new, u.ref) for u in push_commands(body)))
        elif decision.body_shape == "graphql":
            expect_json(request.headers)
            reason, where = _judge_graphql(shape, graphql_requests(read_json(body))[0])
        else:
            expect_json(request.headers)
            messages, _ = mcp_messages(read_json(body))
            calls = []
            for m in messages:
                tool, arguments = tool_call(m) if m.kind == "request" and m.method == "tools/call" else (None, None)
                calls.append((m.kind, m.method, tool, arguments))
            reason, where, lists = judge_mcp(shape, calls)
            if not reason and lists:
                ids = frozenset(messages[int(i)].id for i in lists if messages[int(i)].id is not None)
                answer_filter = ToolsFilter(ids, frozenset(shape.tools))
    except BodyError as exc:
        reason, where = exc.reason, exc.detail
    if reason:
        return Decision(reason=reason, rule=decision.rule, host=decision.host, path=decision.path, broker=decision.broker,
                        detail=f"rule `{shape.rule}`: {where}")
    return replace(decision, body_shape=None, answer_filter=answer_filter)


def _detail(reason: str, view: View, o: core.Observation, scheme: object, host: object, port: object) -> str:
    """Words for a denial (never a header value): what was judged and why."""
    s = view.subject
    if reason == "scheme-not-allowed":
        return f"scheme `{_show(scheme)}` (allowed: {', '.join(s.schemes)})"
    if reason == "port-invalid":
        return f"port `{_show(port)}`"
    if reason.startswith("host-") and reason != "host-header-mismatch":
        form = _host_form(host) if type(host) is str else None
        return form.message if isinstance(form, HostError) else "host is not a string"
    if reason == "ip-literal-refused":
        return f"`{o.host}` is an IP literal"
    if reason in ("ipv6-disabled", "address-denied", "address-not-public"):
        return view.judge.judge(o.host)[2]
    if reason == "profile-host-not-allowed":
        return f"`{o.host}:{o.port}` is not in profile `{s.name}`"
    if reason == "no-matching-rule":
        return f"no rule of connection `{s.name}` names `{o.host}:{o.port}`"
    if reason == "method-not-allowed":
        return f"method `{_show(o.method)}` is not allowed here"
    if reason == "smuggling":
        if o.duplicate_host:
            return "more than one `Host` header"
        if o.field_break:
            return "a control character (CR, LF, NUL, ESC ...; only HTAB is allowed) inside a header: a lenient upstream would read a second header line"
        return "ambiguous `Transfer-Encoding`/`Content-Length` framing"
    if reason == "trailers-denied":
        return "the request declares trailers (`Trailer`): they would arrive after the decision"
    if reason == "host-header-mismatch":
        if o.port_mismatch and not o.host_mismatch:
            return f"the request names another port than its tunnel's `{o.host}:{o.port}`"
        return f"the `Host` header does not name `{o.host}:{o.port}`"
    if reason == "upgrade-denied":
        return "the request asks for a protocol upgrade"
    if reason == "body-on-bodyless-method":
        return f"`{_show(o.method)}` with a body"
    if reason == "path-not-allowed":
        return f"no rule of `{o.host}:{o.port}` admits path `{_show(o.path)}`"
    return f"the path is refused ({reason})"


def _show(value: object) -> str:
    shown = str(value).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 80 else shown[:77] + "..."
