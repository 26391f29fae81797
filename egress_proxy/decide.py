"""The decision function: the enforcement semantics the proxy applies and the prover encodes.

Pure and deterministic: no I/O, no DNS, no clock, no mitmproxy. Every early return is a denial with
a reason code from `egress_proxy.reasons`. The order of the checks is part of the contract and is
written down in docs/decision.md; change both together.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from catalog import CatalogError, load_catalog
from compiler.artifact import Artifact, Connection, Rule, SandboxProfile, Worker
from compiler.constants import BODYLESS_METHODS, DEFAULT_WORKER, METHODS, header_is_denylisted
from compiler.normalize import (
    HostError,
    HostForm,
    PathError,
    check_target,
    normalize_host,
    normalize_path,
    normalize_prefix,
    prefix_matches,
)
from egress_proxy.addresses import WorkerJudge, first_refusal, worker_judge
from egress_proxy.reasons import ALLOWED
from egress_proxy.types import Decision, Lease, Request

SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}
# Connection traffic carries a credential, so it rides TLS only.
CONNECTION_SCHEMES = ("https",)
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_PORT = re.compile(r"^[0-9]{1,5}$")
# Headers the request checks look at (the last two ask for a different protocol on this connection).
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
class RuleView:
    """A rule as the decision function reads it: prefix canonical, methods and headers as sets."""

    rule: Rule
    prefix: str | None  # normalize_prefix(rule.path_prefix); None if the prefix is invalid (never matches)
    methods: frozenset[str]
    headers: frozenset[str]  # lowercased allowlist minus anything denylisted (inject header included)

    def matches(self, method: str, path: str) -> bool:
        return self.prefix is not None and method in self.methods and prefix_matches(self.prefix, path)


@dataclass(frozen=True, slots=True)
class ConnectionView:
    connection: Connection
    inject_header: str
    by_hostport: dict[tuple[str, int], tuple[RuleView, ...]]  # rules in artifact order
    judge: WorkerJudge | None  # None: the connection names an unknown worker


@dataclass(frozen=True, slots=True)
class ProfileView:
    profile: SandboxProfile
    allowed: dict[tuple[str, int], str]  # (host, port) -> granted_by
    judge: WorkerJudge | None


class ArtifactIndex:
    """Lookups for one artifact, built lazily per subject and kept for the artifact's lifetime."""

    __slots__ = ("artifact", "table", "error", "_connections", "_profiles", "_judges", "_by_name", "names")

    def __init__(self, artifact: Artifact) -> None:
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
        self._connections: dict[str, ConnectionView | None] = {}
        self._profiles: dict[str, ProfileView | None] = {}
        self._judges: dict[str, WorkerJudge | None] = {}
        try:
            self.table = load_catalog(artifact.catalog.version).special_purpose
        except CatalogError as exc:
            self.table = None
            self.error = str(exc)

    def judge(self, worker_name: str) -> WorkerJudge | None:
        if worker_name not in self._judges:
            worker = self._by_name[0].get(worker_name)
            judge = None
            if worker is not None and self.table is not None:
                try:
                    judge = worker_judge(worker, self.table)
                except (ValueError, CatalogError):
                    judge = None  # a malformed CIDR or prefix: fail closed
            self._judges[worker_name] = judge
        return self._judges[worker_name]

    def connection(self, name: str) -> ConnectionView | None:
        if name not in self._connections:
            conn = self._by_name[1].get(name)
            self._connections[name] = None if conn is None else self._connection_view(conn)
        return self._connections[name]

    def profile(self, name: str) -> ProfileView | None:
        if name not in self._profiles:
            prof = self._by_name[2].get(name)
            view = None
            if prof is not None:
                allowed: dict[tuple[str, int], str] = {}
                if prof.network.mode == "allowlist":
                    for entry in prof.network.allowed_hosts:
                        allowed.setdefault((entry.host, entry.port), entry.granted_by)
                view = ProfileView(prof, allowed, self.judge(DEFAULT_WORKER))
            self._profiles[name] = view
        return self._profiles[name]

    def _connection_view(self, conn: Connection) -> ConnectionView:
        inject = conn.inject.header
        by: dict[tuple[str, int], list[RuleView]] = {}
        for rule in conn.rules:
            try:
                prefix: str | None = normalize_prefix(rule.path_prefix)
            except PathError:
                prefix = None
            headers = frozenset(h.lower() for h in rule.headers if not header_is_denylisted(h, inject))
            by.setdefault((rule.host, rule.port), []).append(RuleView(rule, prefix, frozenset(rule.methods), headers))
        return ConnectionView(conn, inject, {k: tuple(v) for k, v in by.items()}, self.judge(conn.worker))


_INDEXES: dict[int, ArtifactIndex] = {}
_INDEXES_MAX = 16


def artifact_index(artifact: Artifact) -> ArtifactIndex:
    """The cached index of this artifact object (identity-keyed: a rebuilt or mutated artifact gets its own)."""
    index = _INDEXES.get(id(artifact))
    # INVARIANT: the index holds a reference to its artifact, so the id cannot be reused while cached.
    if index is None or index.artifact is not artifact:
        if len(_INDEXES) >= _INDEXES_MAX:
            _INDEXES.pop(next(iter(_INDEXES)))
        index = _INDEXES[id(artifact)] = ArtifactIndex(artifact)
    return index


# ---------------------------------------------------------------------------------------------
# Stage 1: the destination (CONNECT time and before resolving)
# ---------------------------------------------------------------------------------------------


def decide_destination(artifact: Artifact, lease: Lease, scheme: str, host: str, port: int) -> Decision:
    """May this lease reach `scheme://host:port` at all? The pre-DNS check (no method, path or headers yet)."""
    reason, detail, name, _ = _destination(artifact_index(artifact), lease, scheme, host, port)
    return Decision(allowed=reason == ALLOWED, reason=reason, host=name, detail=detail)


# Internal stage results are plain tuples (building a Decision per stage costs more than the checks).
_Subject = ConnectionView | ProfileView | None


def _destination(index: ArtifactIndex, lease: Lease, scheme: object, host: object, port: object) -> tuple[str, str | None, str | None, _Subject]:
    """(reason, detail, normalized host, subject view); reason is ALLOWED when the destination is admitted."""
    if index.error is not None:
        return "internal-error", index.error, None, None
    view: _Subject
    if lease.connection is not None:
        view = index.connection(lease.connection)
        if view is None:
            return "lease-unknown-subject", f"connection `{_show(lease.connection)}` is not in the artifact", None, None
        allowed_schemes = CONNECTION_SCHEMES
    else:
        view = index.profile(lease.profile or "")
        if view is None:
            return "lease-unknown-subject", f"profile `{_show(lease.profile)}` is not in the artifact", None, None
        allowed_schemes = SCHEMES
    if view.judge is None:
        return "worker-unknown", "the worker of this subject is missing or malformed in the artifact", None, view
    if scheme not in allowed_schemes:
        return "scheme-not-allowed", f"scheme `{_show(scheme)}` (allowed: {', '.join(allowed_schemes)})", None, view
    if type(port) is not int or not 1 <= port <= 65535:
        return "port-invalid", f"port `{_show(port)}`", None, view
    if type(host) is not str:
        return "host-empty", "host is not a string", None, view
    form = index.names.get(host) or _host_form(host)
    if isinstance(form, HostError):
        return form.reason, form.message, None, view
    name = form.value
    if form.is_ip:
        if not view.judge.worker.ip_literals:
            return "ip-literal-refused", f"`{name}` is an IP literal", name, view
        public, reason, detail = view.judge.judge(name)
        if not public:
            return reason, detail, name, view
    if isinstance(view, ProfileView):
        if (name, port) not in view.allowed:
            return "profile-host-not-allowed", f"`{name}:{port}` is not in profile `{view.profile.name}`", name, view
    elif (name, port) not in view.by_hostport:
        return "no-matching-rule", f"no rule of connection `{view.connection.name}` names `{name}:{port}`", name, view
    return ALLOWED, None, name, view


# ---------------------------------------------------------------------------------------------
# Stage 2: the full request
# ---------------------------------------------------------------------------------------------


def decide(artifact: Artifact, lease: Lease, request: Request, resolved_ips: Iterable[object]) -> Decision:
    """The full decision for one HTTP request: destination, request checks, rule, then every resolved address."""
    return _request(artifact_index(artifact), lease, request, resolved_ips, check_addresses=True)


def decide_without_addresses(artifact: Artifact, lease: Lease, request: Request) -> Decision:
    """`decide` minus the address check, for `egresslaw explain` without `--resolve`. The proxy never calls this."""
    return _request(artifact_index(artifact), lease, request, (), check_addresses=False)


def _request(index: ArtifactIndex, lease: Lease, req: Request, ips: Iterable[object], check_addresses: bool) -> Decision:
    reason, detail, host, view = _destination(index, lease, req.scheme, req.host, req.port)
    if reason != ALLOWED:
        return Decision(reason=reason, detail=detail, host=host)
    assert view is not None and view.judge is not None  # INVARIANT: an admitted destination has a subject and a worker
    method = req.method
    if method not in METHODS:
        return Decision(reason="method-not-allowed", detail=f"method `{_show(method)}` is never allowed", host=host)
    problem, lowers, hop = _scan_headers(req, host)
    if problem is not None:
        return Decision(reason=problem[0], detail=problem[1], host=host)
    target = req.target if type(req.target) is str else ""
    try:
        # A connection's rules match paths, so its paths must read one way (normalize_path refuses
        # the rest); a profile grants whole host:port pairs, so only malformed targets are refused.
        path = normalize_path(target) if isinstance(view, ConnectionView) else check_target(target)
    except PathError as exc:
        return Decision(reason=exc.reason, detail=exc.message, host=host)
    rule_view: RuleView | None = None
    if isinstance(view, ConnectionView):
        # INVARIANT: _destination admitted (host, port), so the key exists.
        candidates = view.by_hostport[(host, req.port)]
        for rv in candidates:  # first match in the artifact's rule order
            if rv.matches(method, path):
                rule_view = rv
                break
        else:
            if any(rv.prefix is not None and prefix_matches(rv.prefix, path) for rv in candidates):
                return Decision(reason="method-not-allowed", detail=f"no rule for this path admits `{method}`", host=host, path=path)
            return Decision(reason="path-not-allowed", detail=f"no rule of `{host}:{req.port}` admits path `{_show(path)}`", host=host, path=path)
    if check_addresses:
        refusal = first_refusal(view.judge, ips)
        if refusal is not None:
            return Decision(reason=refusal[0], detail=refusal[1], host=host, path=path)
    if rule_view is None:
        assert isinstance(view, ProfileView)
        return Decision(
            allowed=True,
            reason=ALLOWED,
            host=host,
            path=path,
            forward_headers=_profile_headers(req.headers, lowers, hop),
            detail=f"granted by {view.allowed[(host, req.port)]}",
        )
    assert isinstance(view, ConnectionView)
    return Decision(
        allowed=True,
        reason=ALLOWED,
        rule=rule_view.rule.name,
        host=host,
        path=path,
        forward_headers=_connection_headers(req.headers, lowers, hop, rule_view.headers),
        inject_header=view.inject_header,
    )


def _scan_headers(req: Request, host: str) -> tuple[tuple[str, str] | None, list[str], set[str]]:
    """One pass over the caller's headers: (problem, lowercased names, names listed in `Connection`).

    The problem is the first of, in this order: duplicate `Host` (smuggling), a `Host` (header or
    `host_header`) that does not agree (host-header-mismatch), `Upgrade`/`HTTP2-Settings` or
    `Connection: upgrade` (upgrade-denied), `Transfer-Encoding` with `Content-Length` or two
    `Content-Length` (smuggling), a body on a bodyless method (body-on-bodyless-method).
    """
    lowers: list[str] = []
    hosts: list[str] = []
    hop: set[str] = set()
    content_lengths = 0
    chunked = upgrade = False
    for item in req.headers:
        if type(item) is not tuple or len(item) != 2 or type(item[0]) is not str or type(item[1]) is not str:
            # an adapter bug (e.g. bytes from mitmproxy's raw fields): never skip a header we cannot read
            return ("internal-error", "request headers must be (name, value) text pairs"), lowers, hop
        name, value = item
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
    return _header_problem(req, host, hosts, hop, upgrade, chunked, content_lengths), lowers, hop


def _header_problem(
    req: Request, host: str, hosts: list[object], hop: set[str], upgrade: bool, chunked: bool, content_lengths: int
) -> tuple[str, str] | None:
    if len(hosts) > 1:
        return "smuggling", "more than one `Host` header"
    if req.host_header is not None:
        hosts.append(req.host_header)
    default_port = DEFAULT_PORTS.get(req.scheme, 0)  # type: ignore[call-overload]
    for v in hosts:
        if v == host and req.port == default_port:
            continue  # what _authority_agrees answers for the normal form itself (normalize_host is idempotent)
        if type(v) is not str or not _authority_agrees(v, host, req.port, default_port):
            return "host-header-mismatch", f"the `Host` header does not name `{host}:{req.port}`"
    if upgrade:
        return "upgrade-denied", "the request asks for a protocol upgrade"
    if "upgrade" in hop:
        return "upgrade-denied", "`Connection: upgrade`"
    if chunked and content_lengths:
        return "smuggling", "both `Transfer-Encoding` and `Content-Length`"
    if content_lengths > 1:
        return "smuggling", "more than one `Content-Length`"
    if req.has_body and req.method in BODYLESS_METHODS:
        return "body-on-bodyless-method", f"`{req.method}` with a body"
    return None


def _tokens(value: object) -> list[str]:
    """The lowercased names listed in one `Connection` header value (a non-string lists none)."""
    return [t.strip().lower() for t in value.split(",")] if type(value) is str else []


def _connection_tokens(names: list[tuple[str, object]]) -> set[str]:
    """Every name listed in the `Connection` headers of (lowercased name, value) pairs (used by proofs/decode.py)."""
    return {t for n, v in names if n == "connection" for t in _tokens(v)}


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


def _connection_headers(
    headers: tuple[tuple[str, str], ...], lowers: list[str], hop: set[str], allow: frozenset[str]
) -> tuple[tuple[str, str], ...]:
    """Caller headers in the rule's allowlist; never a denylisted one, the inject header, Authorization or Proxy-*."""
    if not allow:
        return ()
    out = []
    for header, lower in zip(headers, lowers):
        # INVARIANT: `allow` already excludes every denylisted name and the inject header (see RuleView).
        if lower in allow and lower not in hop and lower != "authorization" and not lower.startswith("proxy-"):
            out.append(header)
    return tuple(out)


def _profile_headers(headers: tuple[tuple[str, str], ...], lowers: list[str], hop: set[str]) -> tuple[tuple[str, str], ...]:
    """Sandbox traffic keeps its end-to-end headers; every denylisted header (hop-by-hop, proxy, routing,
    Authorization, Cookie), any header named in `Connection` and any name that is not a token are dropped."""
    out = []
    for header, lower in zip(headers, lowers):
        if _TOKEN.match(lower) and lower not in hop and not header_is_denylisted(lower):
            out.append(header)
    return tuple(out)


def _show(value: object) -> str:
    shown = str(value).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 80 else shown[:77] + "..."
