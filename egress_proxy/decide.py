"""The decision function: the enforcement semantics the proxy applies and the prover encodes.

Pure and deterministic: no I/O, no DNS, no clock, no mitmproxy. Every early return is a denial with
a reason code from `egress_proxy.reasons`. The order of the checks is part of the contract and is
written down in docs/decision.md; change both together.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from catalog import CatalogError, load_catalog
from compiler.artifact import Artifact, Connection, Rule, SandboxProfile, Worker
from compiler.constants import BODYLESS_METHODS, DEFAULT_WORKER, METHODS, header_is_denylisted
from compiler.normalize import HostError, PathError, normalize_host, normalize_path, normalize_prefix, prefix_matches
from egress_proxy.addresses import WorkerJudge, judge_all, worker_judge
from egress_proxy.reasons import ALLOWED
from egress_proxy.types import Decision, Lease, Request

SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}
# Connection traffic carries a credential, so it rides TLS only.
CONNECTION_SCHEMES = ("https",)
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_PORT = re.compile(r"^[0-9]{1,5}$")
# Headers that ask for a different protocol on this connection.
_UPGRADE_HEADERS = frozenset({"upgrade", "http2-settings"})


def _deny(reason: str, detail: str | None = None, **fields: object) -> Decision:
    return Decision(allowed=False, reason=reason, detail=detail, **fields)  # type: ignore[arg-type]


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

    __slots__ = ("artifact", "table", "error", "_connections", "_profiles", "_judges", "_by_name")

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
    return _destination(artifact_index(artifact), lease, scheme, host, port)[0]


def _destination(
    index: ArtifactIndex, lease: Lease, scheme: object, host: object, port: object
) -> tuple[Decision, ConnectionView | ProfileView | None]:
    if index.error is not None:
        return _deny("internal-error", index.error), None
    view: ConnectionView | ProfileView | None
    if lease.connection is not None:
        view = index.connection(lease.connection)
        if view is None:
            return _deny("lease-unknown-subject", f"connection `{_show(lease.connection)}` is not in the artifact"), None
        allowed_schemes = CONNECTION_SCHEMES
    else:
        view = index.profile(lease.profile or "")
        if view is None:
            return _deny("lease-unknown-subject", f"profile `{_show(lease.profile)}` is not in the artifact"), None
        allowed_schemes = SCHEMES
    if view.judge is None:
        return _deny("worker-unknown", "the worker of this subject is missing or malformed in the artifact"), view
    if scheme not in allowed_schemes:
        return _deny("scheme-not-allowed", f"scheme `{_show(scheme)}` (allowed: {', '.join(allowed_schemes)})"), view
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        return _deny("port-invalid", f"port `{_show(port)}`"), view
    if not isinstance(host, str):
        return _deny("host-empty", "host is not a string"), view
    try:
        form = normalize_host(host)
    except HostError as exc:
        return _deny(exc.reason, exc.message), view
    name = form.value
    if form.is_ip:
        if not view.judge.worker.ip_literals:
            return _deny("ip-literal-refused", f"`{name}` is an IP literal", host=name), view
        public, reason, detail = view.judge.judge(name)
        if not public:
            return _deny(reason, detail, host=name), view
    if isinstance(view, ProfileView):
        if (name, port) not in view.allowed:
            return _deny("profile-host-not-allowed", f"`{name}:{port}` is not in profile `{view.profile.name}`", host=name), view
    elif (name, port) not in view.by_hostport:
        return _deny("no-matching-rule", f"no rule of connection `{view.connection.name}` names `{name}:{port}`", host=name), view
    return Decision(allowed=True, reason=ALLOWED, host=name), view


# ---------------------------------------------------------------------------------------------
# Stage 2: the full request
# ---------------------------------------------------------------------------------------------


def decide(artifact: Artifact, lease: Lease, request: Request, resolved_ips: Iterable[object]) -> Decision:
    """The full decision for one HTTP request: destination, request checks, rule, then every resolved address."""
    index = artifact_index(artifact)
    verdict, view = _request(index, lease, request)
    if not verdict.allowed:
        return verdict
    assert view is not None  # an allowed request always has a subject view
    addresses = judge_all(view.judge, resolved_ips)  # type: ignore[arg-type]
    if not addresses.allowed:
        return _deny(addresses.reason, addresses.detail, host=verdict.host, path=verdict.path)
    return verdict


def decide_without_addresses(artifact: Artifact, lease: Lease, request: Request) -> Decision:
    """`decide` minus the address check, for `egresslaw explain` without `--resolve`. The proxy never calls this."""
    return _request(artifact_index(artifact), lease, request)[0]


def _request(index: ArtifactIndex, lease: Lease, req: Request) -> tuple[Decision, ConnectionView | ProfileView | None]:
    dest, view = _destination(index, lease, req.scheme, req.host, req.port)
    if not dest.allowed:
        return dest, view
    assert view is not None
    host = dest.host
    method = req.method
    if method not in METHODS:
        return _deny("method-not-allowed", f"method `{_show(method)}` is never allowed", host=host), view
    names = [(n.lower() if isinstance(n, str) else "", v) for n, v in req.headers]
    problem = _host_header_problem(req, host, names)
    if problem is not None:
        return _deny(problem[0], problem[1], host=host), view
    problem = _framing_problem(req, names)
    if problem is not None:
        return _deny(problem[0], problem[1], host=host), view
    try:
        path = normalize_path(req.target) if isinstance(req.target, str) else normalize_path("")
    except PathError as exc:
        return _deny(exc.reason, exc.message, host=host), view
    if isinstance(view, ProfileView):
        forward = _profile_headers(req.headers, names)
        return Decision(
            allowed=True,
            reason=ALLOWED,
            host=host,
            path=path,
            forward_headers=forward,
            detail=f"granted by {view.allowed[(host, req.port)]}",
        ), view
    # INVARIANT: _destination admitted (host, port), so the key exists.
    candidates = view.by_hostport[(host, req.port)]
    for rv in candidates:
        if rv.matches(method, path):
            forward = _connection_headers(req.headers, names, rv.headers)
            return Decision(
                allowed=True,
                reason=ALLOWED,
                rule=rv.rule.name,
                host=host,
                path=path,
                forward_headers=forward,
                inject_header=view.inject_header,
            ), view
    if any(rv.prefix is not None and prefix_matches(rv.prefix, path) for rv in candidates):
        return _deny("method-not-allowed", f"no rule for this path admits `{method}`", host=host, path=path), view
    return _deny("path-not-allowed", f"no rule of `{host}:{req.port}` admits path `{_show(path)}`", host=host, path=path), view


def _host_header_problem(req: Request, host: str, names: list[tuple[str, str]]) -> tuple[str, str] | None:
    values = [v for n, v in names if n == "host"]
    if len(values) > 1:
        return "smuggling", "more than one `Host` header"
    if req.host_header is not None:
        values.append(req.host_header)
    for value in values:
        if not _authority_agrees(value, host, req.port, DEFAULT_PORTS.get(req.scheme, 0)):
            return "host-header-mismatch", f"`Host: {_show(value)}` does not name `{host}:{req.port}`"
    return None


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
    try:
        form = normalize_host(name)
    except HostError:
        return False
    return form.value == host and given == port


def _framing_problem(req: Request, names: list[tuple[str, str]]) -> tuple[str, str] | None:
    present = {n for n, _ in names}
    if present & _UPGRADE_HEADERS:
        return "upgrade-denied", "the request asks for a protocol upgrade"
    if "upgrade" in _connection_tokens(names):
        return "upgrade-denied", "`Connection: upgrade`"
    if "transfer-encoding" in present and "content-length" in present:
        return "smuggling", "both `Transfer-Encoding` and `Content-Length`"
    if sum(1 for n, _ in names if n == "content-length") > 1:
        return "smuggling", "more than one `Content-Length`"
    if req.has_body and req.method in BODYLESS_METHODS:
        return "body-on-bodyless-method", f"`{req.method}` with a body"
    return None


def _connection_tokens(names: list[tuple[str, str]]) -> set[str]:
    tokens: set[str] = set()
    for n, v in names:
        if n == "connection" and isinstance(v, str):
            tokens.update(t.strip().lower() for t in v.split(","))
    return tokens


def _connection_headers(
    headers: tuple[tuple[str, str], ...], names: list[tuple[str, str]], allow: frozenset[str]
) -> tuple[tuple[str, str], ...]:
    """Caller headers in the rule's allowlist; never a denylisted one, the inject header, Authorization or Proxy-*."""
    if not allow:
        return ()
    hop = _connection_tokens(names)
    out = []
    for (name, value), (lower, _) in zip(headers, names):
        # INVARIANT: `allow` already excludes every denylisted name and the inject header (see RuleView).
        if lower in allow and lower not in hop and lower != "authorization" and not lower.startswith("proxy-"):
            out.append((name, value))
    return tuple(out)


def _profile_headers(headers: tuple[tuple[str, str], ...], names: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Sandbox traffic keeps its end-to-end headers; every denylisted header (hop-by-hop, proxy, routing,
    Authorization, Cookie), any header named in `Connection` and any name that is not a token are dropped."""
    hop = _connection_tokens(names)
    out = []
    for (name, value), (lower, _) in zip(headers, names):
        if _TOKEN.match(lower) and lower not in hop and not header_is_denylisted(lower):
            out.append((name, value))
    return tuple(out)


def _show(value: object) -> str:
    shown = str(value).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 80 else shown[:77] + "..."
