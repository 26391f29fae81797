"""The compiled artifact: frozen pydantic models and their canonical JSON. `proofs` and `egress_proxy` read only this."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compiler.constants import ARTIFACT_FORMAT
from compiler.errors import CompilerError

Trust = Literal["trusted", "adversarial"]
Certification = Literal["advisory_filter", "security_boundary"]


class ArtifactError(CompilerError):
    """An artifact file that cannot be used: unreadable, wrong format, malformed, or a digest mismatch."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Worker(Frozen):
    """The effective settings of one worker (every default resolved)."""

    name: str
    follow_redirects: bool = False
    max_redirects: int = 0
    ipv6: bool = True
    ip_literals: bool = False
    deny_cidrs: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()
    nat64_prefixes: tuple[str, ...] = ("64:ff9b::/96",)


class AllowedHost(Frozen):
    host: str
    port: int
    granted_by: str  # "allowed_hosts" | "allow_package_managers:<ecosystem>"


class Network(Frozen):
    mode: Literal["none", "allowlist"]
    allowed_hosts: tuple[AllowedHost, ...] = ()
    allow_mcp_servers: bool = False  # expands to no workload host; recorded for readers


class Budget(Frozen):
    """What one subject may send out per window (docs/budget.md), enforced by the edge and the lane alike: at most
    `requests` admitted requests (a CONNECT included) and at most `bytes` counted bytes (each request's cost:
    `egress_proxy.front.budget.request_cost`) in each aligned window of `window` seconds (`start = now - now % window`).
    A cap left out is not enforced; at least one is present."""

    window: int  # seconds, 1 .. 2,592,000 (30 days)
    requests: int | None = Field(default=None, exclude_if=lambda v: v is None)
    bytes: int | None = Field(default=None, exclude_if=lambda v: v is None)


class SandboxProfile(Frozen):
    name: str
    version: int
    trust: Trust
    provider: str  # name@revision
    provider_certification: Certification  # what the catalog says the provider revision advertises
    provider_missing_axes: tuple[str, ...]  # enforcement axes the catalog defines that the provider lacks
    required_egress_certification: Certification
    catalog_version: str
    network: Network
    network_policy_hash: str
    # Connections whose credential this profile's matching requests carry, in precedence order (the first
    # brokered connection with a matching rule wins). Left out of the JSON when empty, so the digests and
    # lock hashes of profiles that broker nothing are what they were before brokering existed.
    brokers: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    # `observe`: requests outside the allowlist go upstream as plain profile traffic, audited `would-deny` (only a
    # trusted profile that brokers nothing; the core enforces any other). Left out of the JSON when `enforce`.
    enforce: Literal["enforce", "observe"] = Field(default="enforce", exclude_if=lambda v: v == "enforce")
    # Caps per window (docs/budget.md); left out of the JSON when none, so digests are what they were before budgets.
    budget: Budget | None = Field(default=None, exclude_if=lambda v: v is None)


class Inject(Frozen):
    header: str = "Authorization"
    format: str = "Bearer {secret}"
    # `Basic {secret}` with a user: `{secret}` becomes base64(user ":" credential), as GitHub's git endpoint wants
    # (`x-access-token:TOKEN`) for a token the edge minted. Left out of the JSON when unset (digests unchanged).
    basic_user: str | None = Field(default=None, exclude_if=lambda v: v is None)


Scalar = str | bool | int | None  # a JSON scalar a value may be pinned to (bool before int: `true` stays a bool)
ValueType = Literal["string", "integer", "boolean", "null", "array", "object", "any"]


class Value(Frozen):
    """What one value may be (docs/shapes.md, "Values"): a path segment, a query or header value, an MCP argument.

    Every present constraint must hold. `type`: the JSON type (text: a path segment, query or header value is a
    string, and `integer` reads it as canonical decimal digits). `enum`: one of these exact values (sorted,
    canonical). `pattern`: an anchored pattern of egresslaw's pattern subset (`egress_proxy.decision.patterns`),
    matched against the whole text. `max_length`: at most this many characters (a string) or elements (an array).
    `minimum`/`maximum`: an integer's inclusive range. `array` and `object` values are not looked into: a rule that
    admits one admits any (the prover and the budget count it as free).
    """

    type: ValueType = "string"
    enum: tuple[Scalar, ...] | None = Field(default=None, exclude_if=lambda v: v is None)
    pattern: str | None = Field(default=None, exclude_if=lambda v: v is None)
    max_length: int | None = Field(default=None, exclude_if=lambda v: v is None)
    minimum: int | None = Field(default=None, exclude_if=lambda v: v is None)
    maximum: int | None = Field(default=None, exclude_if=lambda v: v is None)


class Segment(Frozen):
    """One segment of a path template: a literal (`value` None) or a named, constrained variable."""

    literal: str | None = Field(default=None, exclude_if=lambda v: v is None)  # the exact (normalized) segment
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    value: Value | None = Field(default=None, exclude_if=lambda v: v is None)


class Param(Frozen):
    """A named value: a query parameter or a header (lowercase name) and what its value may be."""

    name: str
    value: Value


class Tool(Frozen):
    """One MCP tool a rule admits by exact name, and its arguments (an object's top-level keys)."""

    name: str
    arguments: tuple[Param, ...] = ()  # sorted by name: the keys it may carry and what each may be
    required: tuple[str, ...] = ()  # sorted: keys that must be present
    forbidden: tuple[str, ...] = ()  # sorted: keys that must not be present (even when `additional`)
    additional: bool = False  # keys not in `arguments` admitted (any value)


class Mcp(Frozen):
    """An MCP (JSON-RPC 2.0 over Streamable HTTP) rule's shape: the methods, and the tools `tools/call` may name."""

    methods: tuple[str, ...]  # sorted: JSON-RPC methods (requests and notifications) the client may send
    tools: tuple[Tool, ...] = ()  # sorted by name
    responses: bool = False  # the client may POST JSON-RPC responses (answers to a server's own requests)


class GraphQL(Frozen):
    """A GraphQL rule's shape: root fields per operation type, persisted-query hashes, introspection."""

    query: tuple[str, ...] = ()  # sorted: the root fields a `query` may select (none: no query admitted)
    mutation: tuple[str, ...] = ()
    subscription: tuple[str, ...] = ()
    persisted: tuple[str, ...] = ()  # sorted lowercase sha256 hex of admitted persisted queries
    introspection: bool = False  # `__schema` / `__type` root fields admitted


class Git(Frozen):
    """A git smart-HTTP rule's shape: fetch and push judged apart; push only to refs its patterns match."""

    fetch: bool = False
    push: tuple[str, ...] = ()  # ref patterns (`refs/heads/agent/*`: `*` is any run of non-`/` characters)
    create: bool = False  # a push may create a ref (old id all zeros)
    delete: bool = False  # a push may delete a ref (new id all zeros)


class Rule(Frozen):
    name: str
    host: str
    port: int = 443
    path_prefix: str = "/"
    methods: tuple[str, ...]
    headers: tuple[str, ...] = ()  # lowercase, sorted
    # Request shapes (docs/shapes.md): each optional, each default-deny once present; left out of the JSON when
    # absent, so an artifact without shapes keeps its digest.
    template: tuple[Segment, ...] | None = Field(default=None, exclude_if=lambda v: v is None)  # the whole path
    query: tuple[Param, ...] | None = Field(default=None, exclude_if=lambda v: v is None)  # () : no query at all
    header_values: tuple[Param, ...] = Field(default=(), exclude_if=lambda v: not v)  # names among `headers`
    mcp: Mcp | None = Field(default=None, exclude_if=lambda v: v is None)
    graphql: GraphQL | None = Field(default=None, exclude_if=lambda v: v is None)
    git: Git | None = Field(default=None, exclude_if=lambda v: v is None)
    max_body: int | None = Field(default=None, exclude_if=lambda v: v is None)  # bytes a body shape reads (None: 1 MiB)


CredentialKind = Literal["oauth2", "github_app", "aws_sigv4"]
Grant = Literal["refresh_token", "client_credentials"]


class Mint(Frozen):
    """How the edge turns a connection's custody record into what its requests carry, for every kind but `static`
    (egress_proxy/credentials): `oauth2` and `github_app` mint a token at `token_url` (an exact https URL the
    connection's worker judges like any destination); `aws_sigv4` signs each request (no token endpoint)."""

    kind: CredentialKind
    token_url: str | None = None  # oauth2, github_app: exact https URL, normalized
    token_host: str | None = None  # its host, port and path, as the edge dials and the prover judges them
    token_port: int | None = None
    token_path: str | None = None
    grant: Grant | None = None  # oauth2
    scopes: tuple[str, ...] = ()  # oauth2: sent as `scope`, space-separated
    audience: str | None = None  # oauth2
    repositories: tuple[str, ...] = ()  # github_app: narrow the installation token to these repositories
    permissions: tuple[tuple[str, str], ...] = ()  # github_app: (permission, level), sorted
    region: str | None = None  # aws_sigv4
    service: str | None = None  # aws_sigv4


class Connection(Frozen):
    name: str
    version: int
    credential_handle: str
    inject: Inject = Inject()
    worker: str
    rules: tuple[Rule, ...]
    # The credential kind (None: `static`, the record's value pasted into `inject`). Left out of the JSON when
    # static, so the digests and lock hashes of static connections are what they were before kinds existed.
    mint: Mint | None = Field(default=None, exclude_if=lambda v: v is None)
    # Caps per window (docs/budget.md); left out of the JSON when none, so digests are what they were before budgets.
    budget: Budget | None = Field(default=None, exclude_if=lambda v: v is None)

    @property
    def kind(self) -> str:
        return self.mint.kind if self.mint is not None else "static"


class CatalogRef(Frozen):
    version: str
    digest: str
    special_purpose_date: str


class SourceSpan(NamedTuple):
    """A source range in a policy file: 1-based lines and columns, `end_column` exclusive."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int


class SourceMap(Frozen):
    """Where each worker, subject, rule and setting was declared, so proofs, diffs and lock drift can
    point at `.egress` lines. Advisory: outside the digest and the lock hashes, so formatting (which
    moves lines) never changes what an artifact means, its digest, or its proofs.

    Keys: `workspace`, `catalog`, `worker:W`, `connection:C`, `profile:P`, `rule:C/R`, and
    `worker:W.<key>`, `connection:C.<key>`, `profile:P.<key>` for each key written in those
    blocks (`worker:edge.allow_cidrs`).
    """

    files: tuple[str, ...] = ()
    spans: tuple[tuple[str, int, int, int, int, int], ...] = ()  # (key, file index, line, column, end line, end column)

    @functools.cached_property
    def _by_key(self) -> dict[str, tuple[str, int, int, int, int, int]]:
        return {entry[0]: entry for entry in self.spans}

    def span(self, key: str) -> SourceSpan | None:
        """The span recorded for `key`, or None."""
        entry = self._by_key.get(key)
        if entry is None or not 0 <= entry[1] < len(self.files):
            return None
        return SourceSpan(self.files[entry[1]], *entry[2:])

    def first(self, *keys: str) -> SourceSpan | None:
        """The span of the first of `keys` that has one."""
        for key in keys:
            found = self.span(key)
            if found is not None:
                return found
        return None


class Artifact(Frozen):
    """One compiled policy. `digest` is sha256 over the canonical JSON of every other field except `locations`."""

    format: Literal["egresslaw.artifact/1"] = Field(default=ARTIFACT_FORMAT)
    workspace: str
    catalog: CatalogRef
    source_digest: str
    workers: tuple[Worker, ...]
    sandbox_profiles: tuple[SandboxProfile, ...]
    connections: tuple[Connection, ...]
    locations: SourceMap = SourceMap()  # advisory source spans; not covered by `digest`
    digest: str = ""

    @functools.cached_property
    def _workers(self) -> dict[str, Worker]:
        return {w.name: w for w in self.workers}

    @functools.cached_property
    def _profiles(self) -> dict[str, SandboxProfile]:
        return {p.name: p for p in self.sandbox_profiles}

    @functools.cached_property
    def _connections(self) -> dict[str, Connection]:
        return {c.name: c for c in self.connections}

    def worker(self, name: str) -> Worker | None:
        return self._workers.get(name)

    def profile(self, name: str) -> SandboxProfile | None:
        return self._profiles.get(name)

    def connection(self, name: str) -> Connection | None:
        return self._connections.get(name)

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> Artifact:  # type: ignore[override]
        """pydantic's copy, minus the cached name lookups (copied as-is they would describe the original)."""
        copy = super().model_copy(update=update, deep=deep)
        for cached in ("_workers", "_profiles", "_connections"):
            copy.__dict__.pop(cached, None)
        return copy

    def body_digest(self) -> str:
        """sha256 of the canonical JSON of everything except `digest` and the advisory `locations`."""
        return sha256_hex(canonical_json(self.model_dump(mode="json", exclude={"digest", "locations"})))

    def sealed(self) -> Artifact:
        """This artifact with `digest` filled in."""
        return self.model_copy(update={"digest": self.body_digest()})

    def to_json(self) -> str:
        """The canonical JSON text (sorted keys, fixed separators, trailing newline)."""
        return canonical_json(self.model_dump(mode="json")) + "\n"


def canonical_json(value: object) -> str:
    """Sorted keys, no insignificant whitespace, ASCII only: the byte form every digest is taken over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def network_policy_hash(hosts: tuple[AllowedHost, ...]) -> str:
    """sha256 of the canonical sorted exact `host:port` set (what grants it does not change the hash)."""
    return sha256_hex(canonical_json(sorted({f"{h.host}:{h.port}" for h in hosts})))


def load_artifact(text: str | bytes) -> Artifact:
    """Parse and verify an artifact: format, schema and digest. Raises ArtifactError."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"artifact is not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != ARTIFACT_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ArtifactError(f"artifact format is `{found}`, expected `{ARTIFACT_FORMAT}`")
    try:
        artifact = Artifact.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ArtifactError(f"artifact is malformed at `{where}`: {first['msg']}") from None
    if artifact.digest != artifact.body_digest():
        raise ArtifactError("artifact digest does not match its content (edited after compiling?)")
    return artifact
