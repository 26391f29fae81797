"""Admission passes: the syntax tree of a whole policy -> admitted declarations, or diagnostics.

Each pass is a pure function of the policy (and the catalog); `PASSES` lists them in order. Every
error is collected, so one run reports everything that is wrong.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Callable

from catalog import ECOSYSTEMS, Catalog, CatalogError, load_catalog
from compiler.artifact import (
    AllowedHost,
    Budget,
    Connection,
    Git,
    GraphQL,
    Inject,
    Mcp,
    Mint,
    Network,
    Param,
    Rule,
    SandboxProfile,
    Segment,
    Tool,
    Worker,
    network_policy_hash,
)
from compiler.artifact import Value as ShapeValue
from compiler.budget import CAP_MAX, BudgetValueError, parse_size, parse_window
from compiler.constants import (
    CREDENTIAL_KINDS,
    DEFAULT_WORKER,
    EDGE_HEADERS,
    INJECT_HEADER_FORBIDDEN,
    LANGUAGE_VERSION,
    MAX_RULES_PER_CONNECTION,
    METHODS,
    SPECIAL_USE_NAMES,
    SPECIAL_USE_SUFFIXES,
    header_is_denylisted,
)
from compiler.diagnostics import Diagnostic, error, warning
from compiler.normalize import HostError, PathError, normalize_host, normalize_prefix
from compiler.patterns import PatternError, matches, parse_pattern
from compiler.secrets_scan import redact, secret_kind
from compiler.syntax import (
    Bool,
    ListV,
    Named,
    Null,
    Num,
    Obj,
    Pair,
    Ref,
    SourceFile,
    Span,
    Str,
    Value,
)
from compiler.template import TemplateError, parse_template, template_prefix

TOP_KINDS = ("workspace", "catalog", "worker", "sandbox_profile", "connection")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # with fullmatch: `^…$` admitted a trailing newline (header splitting)
_HANDLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")


@dataclass
class Policy:
    """Everything the passes read and write: the files, the catalog, and what has been admitted so far."""

    files: tuple[SourceFile, ...]
    diagnostics: list[Diagnostic] = field(default_factory=list)
    workspace: str | None = None
    catalog: Catalog | None = None
    workers: dict[str, Worker] = field(default_factory=dict)
    profiles: dict[str, SandboxProfile] = field(default_factory=dict)
    connections: dict[str, Connection] = field(default_factory=dict)
    worker_refs: list[tuple[str, Span]] = field(default_factory=list)
    broker_refs: list[tuple[str, str, Span]] = field(default_factory=list)  # (profile, connection, span)

    @property
    def decls(self) -> list[Named]:
        return [d for f in self.files for d in f.decls]

    def of_kind(self, kind: str) -> list[Named]:
        return [d for d in self.decls if d.kind == kind]

    def add(self, diag: Diagnostic) -> None:
        self.diagnostics.append(diag)


def _code(text: str) -> str:
    """User input inside backticks in a message: escaped, shortened, and never a secret."""
    shown = redact(text).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _suggest(word: str, options) -> str | None:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.7)
    return f"did you mean `{match[0]}`?" if match else None


# ---------------------------------------------------------------------------------------------
# Typed access to blocks


class Block:
    """Reads one `{ … }` block against its schema: unknown, duplicate, missing and mistyped keys."""

    def __init__(self, policy: Policy, obj: Obj, what: str, keys: dict[str, str], aliases: dict[str, str] | None = None):
        self.policy = policy
        self.obj = obj
        self.what = what
        self.pairs: dict[str, Pair] = {}
        aliases = aliases or {}
        for block in obj.blocks:
            policy.add(error("EL0007", f"{what} does not take a `{block.kind}` block", block.kind_span, None))
        for pair in obj.pairs:
            key = aliases.get(pair.key, pair.key)
            if key not in keys:
                help = _suggest(pair.key, keys) or f"{what} accepts: {', '.join(sorted(keys))}"
                policy.add(error("EL0007", f"unknown key `{_code(pair.key)}` in {what}", pair.key_span, help))
                continue
            if key in self.pairs:
                policy.add(error("EL0032", f"key `{key}` is given twice in {what}", pair.key_span, "keep one of them"))
                continue
            self.pairs[key] = pair

    def _wrong(self, pair: Pair, expected: str) -> None:
        self.policy.add(error("EL0008", f"`{pair.key}` must be {expected}", _span_of(pair.value), None))

    def has(self, key: str) -> bool:
        return key in self.pairs

    def span(self, key: str) -> Span:
        return _span_of(self.pairs[key].value)

    def require(self, key: str, span: Span) -> bool:
        if key not in self.pairs:
            self.policy.add(error("EL0009", f"{self.what} is missing `{key}`", span, f"add `{key} = …`"))
            return False
        return True

    def string(self, key: str, default: str | None = None) -> str | None:
        pair = self.pairs.get(key)
        if pair is None:
            return default
        if isinstance(pair.value, Str):
            return pair.value.value
        self._wrong(pair, "a string")
        return None

    def name_ref(self, key: str, default: str | None = None) -> str | None:
        """A reference: a bare name or a string."""
        pair = self.pairs.get(key)
        if pair is None:
            return default
        if isinstance(pair.value, (Str, Ref)):
            return pair.value.value if isinstance(pair.value, Str) else pair.value.name
        self._wrong(pair, "a name")
        return None

    def boolean(self, key: str, default: bool) -> bool:
        pair = self.pairs.get(key)
        if pair is None:
            return default
        if isinstance(pair.value, Bool):
            return pair.value.value
        self._wrong(pair, "`true` or `false`")
        return default

    def integer(self, key: str, default: int, low: int, high: int, help: str | None = None) -> int | None:
        pair = self.pairs.get(key)
        if pair is None:
            return default
        if not isinstance(pair.value, Num) or not isinstance(pair.value.value, int):
            self._wrong(pair, "a whole number")
            return None
        if not low <= pair.value.value <= high:
            code = "EL0023"
            self.policy.add(error(code, f"`{pair.key}` is {pair.value.value}, outside {low}-{high}", _span_of(pair.value), help))
            return None
        return pair.value.value

    def strings(self, key: str, default: tuple = ()) -> list[Str] | None:
        """A list of strings, each kept with its span."""
        pair = self.pairs.get(key)
        if pair is None:
            return [Str(v) for v in default]
        if not isinstance(pair.value, ListV):
            self._wrong(pair, "a list of strings")
            return None
        out = []
        for item in pair.value.items:
            if isinstance(item, Str):
                out.append(item)
            else:
                self.policy.add(error("EL0008", f"items of `{pair.key}` must be strings", _span_of(item)))
        return out

    def names(self, key: str) -> list[tuple[str, Span]] | None:
        """A list of references (bare names or strings), each with its span."""
        pair = self.pairs.get(key)
        if pair is None:
            return []
        if not isinstance(pair.value, ListV):
            self._wrong(pair, "a list of names")
            return None
        out = []
        for item in pair.value.items:
            if isinstance(item, (Str, Ref)):
                out.append((item.value if isinstance(item, Str) else item.name, item.span))
            else:
                self.policy.add(error("EL0008", f"items of `{pair.key}` must be names", _span_of(item)))
        return out

    def object(self, key: str) -> Obj | None:
        pair = self.pairs.get(key)
        if pair is None:
            return None
        if isinstance(pair.value, Obj):
            return pair.value
        self._wrong(pair, "an object `{ … }`")
        return None


def _span_of(value: Value) -> Span:
    return value.span


# ---------------------------------------------------------------------------------------------
# Hosts


_HOST_CODES = {
    "host-wildcard": "EL0010",
    "host-scheme": "EL0011",
    "host-userinfo": "EL0011",
    "host-path": "EL0011",
    "host-port": "EL0011",
    "host-noncanonical-ip": "EL0012",
    "host-zone-id": "EL0012",
    "host-bracket": "EL0012",
}


def admit_host(raw: str, span: Span) -> tuple[str | None, Diagnostic | None]:
    """An exact public FQDN, or the diagnostic that explains why `raw` is not one."""
    try:
        form = normalize_host(raw)
    except HostError as exc:
        code = _HOST_CODES.get(exc.reason, "EL0014")
        message = exc.message if not secret_kind(raw) else "host is not a valid name"
        return None, error(code, message, span, exc.help or "write an exact, fully qualified host name")
    if form.is_ip:
        return None, error(
            "EL0012",
            f"`{_code(raw)}` is an IP literal",
            span,
            "name the host; addresses are judged at run time by the worker's public-only check",
        )
    host = form.value
    labels = host.split(".")
    if host in SPECIAL_USE_NAMES or any(host == s or host.endswith("." + s) for s in SPECIAL_USE_SUFFIXES):
        return None, error(
            "EL0013",
            f"`{_code(host)}` is a special-use or internal name",
            span,
            "egress goes to public hosts only; internal services are reached another way",
        )
    if len(labels) < 2:
        return None, error("EL0014", f"`{_code(host)}` is a single-label name", span, "write the fully qualified name")
    return host, None


def split_host_port(raw: str, default_port: int) -> tuple[str, int | None]:
    """`host` or `host:port` (port None when malformed). IPv6 brackets, and anything with a scheme,
    userinfo or path (`https://host`, `user:pw@host`), are left whole to the host check, which names
    the real problem instead of calling what follows a `:` a port."""
    if raw.startswith("[") or raw.count(":") != 1 or "/" in raw or "@" in raw:
        return raw, default_port
    host, _, port = raw.partition(":")
    if not port.isdigit() or port.startswith("0") or not 1 <= int(port) <= 65535:
        return host, None
    return host, int(port)


# ---------------------------------------------------------------------------------------------
# Passes


def check_headers(policy: Policy) -> None:
    """Every file declares language version 1."""
    for f in policy.files:
        if f.version != LANGUAGE_VERSION:
            policy.add(
                error("EL0002", f"language version {f.version} is not supported", f.version_span, "write `egresslaw 1`")
            )


def check_declarations(policy: Policy) -> None:
    """Known kinds, bodies where they belong, valid and unique names, one workspace and one catalog."""
    seen: dict[str, Named] = {}
    for d in policy.decls:
        if d.kind not in TOP_KINDS:
            policy.add(
                error(
                    "EL0007",
                    f"unknown declaration `{_code(d.kind)}`",
                    d.kind_span,
                    _suggest(d.kind, TOP_KINDS) or f"declarations are: {', '.join(TOP_KINDS)}",
                )
            )
            continue
        if d.kind in ("workspace", "catalog"):
            if d.body is not None:
                policy.add(error("EL0008", f"`{d.kind}` takes a string, not a block", d.body.span, f'write `{d.kind} "…"`'))
            continue
        if d.body is None:
            policy.add(error("EL0009", f"{d.kind} `{_code(d.name)}` has no `{{ … }}` block", d.span, "add its settings in braces"))
        if not _NAME.match(d.name):
            policy.add(
                error("EL0033", f"name `{_code(d.name)}` is not a simple identifier", d.name_span, "use letters, digits, `.`, `_` and `-`")
            )
        if d.name in seen:
            first = seen[d.name]
            where = f"{first.span.path}:{first.span.line}"
            policy.add(error("EL0006", f"`{_code(d.name)}` is already declared ({first.kind} at {where})", d.name_span, "rename one of them"))
        else:
            seen[d.name] = d
    for kind, code in (("workspace", "EL0003"), ("catalog", "EL0004")):
        found = policy.of_kind(kind)
        if not found:
            first = policy.files[0]
            policy.add(error(code, f"the policy has no `{kind}`", first.version_span, f'add `{kind} "…"` once'))
        for extra in found[1:]:
            policy.add(error(code, f"a second `{kind}`", extra.span, f"a policy has exactly one `{kind}`"))
    workspaces = policy.of_kind("workspace")
    if len(workspaces) == 1:
        ws = workspaces[0]
        if _HANDLE.match(ws.name) and "/" not in ws.name:
            policy.workspace = ws.name
        else:
            policy.add(error("EL0033", f"workspace `{_code(ws.name)}` is not a simple identifier", ws.name_span, "use letters, digits, `.`, `_` and `-`"))
    catalogs = policy.of_kind("catalog")
    if len(catalogs) == 1:
        try:
            policy.catalog = load_catalog(catalogs[0].name)
        except CatalogError as exc:
            policy.add(error("EL0005", str(exc), catalogs[0].name_span, "pin a published catalog version"))


def check_secrets(policy: Policy) -> None:
    """No string literal anywhere in the policy may look like a credential."""

    def visit(value: Value) -> None:
        if isinstance(value, Str):
            kind = secret_kind(value.value)
            if kind:
                policy.add(
                    error(
                        "EL0029",
                        f"a string literal {kind}: secrets are referenced by custody handle, never written into policy",
                        value.span,
                        "store it with `egresslaw custody put` and write its handle in `credential`",
                    )
                )
        elif isinstance(value, ListV):
            for item in value.items:
                visit(item)
        elif isinstance(value, Obj):
            visit_obj(value)

    def visit_obj(obj: Obj) -> None:
        for pair in obj.pairs:
            if pair.quoted and secret_kind(pair.key):
                policy.add(error("EL0029", "a key looks like a secret", pair.key_span, "remove it"))
            visit(pair.value)
        for block in obj.blocks:
            visit(Str(block.name, block.name_span))
            if block.body:
                visit_obj(block.body)

    for d in policy.decls:
        visit(Str(d.name, d.name_span))
        if d.body is not None:
            visit_obj(d.body)
    for f in policy.files:
        for line, column, text in f.comments:
            kind = secret_kind(text.lstrip("# "))
            if kind:
                span = Span(f.path, line, column, line, column + len(text))
                policy.add(error("EL0029", f"a comment {kind}: secrets never belong in policy files", span, "delete it and rotate the credential"))


def admit_workers(policy: Policy) -> None:
    """Workers with every default resolved; the built-in `default` exists unless redeclared."""
    policy.workers[DEFAULT_WORKER] = Worker(name=DEFAULT_WORKER)
    keys = {
        "follow_redirects": "bool",
        "max_redirects": "int",
        "ipv6": "bool",
        "ip_literals": "bool",
        "deny_cidrs": "list",
        "allow_cidrs": "list",
        "nat64_prefixes": "list",
    }
    for d in policy.of_kind("worker"):
        if d.body is None:
            continue
        b = Block(policy, d.body, f"worker `{d.name}`", keys)
        values = {
            "name": d.name,
            "follow_redirects": b.boolean("follow_redirects", False),
            "max_redirects": b.integer("max_redirects", 0, 0, 20),
            "ipv6": b.boolean("ipv6", True),
            "ip_literals": b.boolean("ip_literals", False),
        }
        for key in ("deny_cidrs", "allow_cidrs"):
            values[key] = _cidrs(policy, b, key, ())
        values["nat64_prefixes"] = _cidrs(policy, b, "nat64_prefixes", ("64:ff9b::/96",), nat64=True)
        if any(v is None for v in values.values()):
            continue
        policy.workers[d.name] = Worker(**values)


def _cidrs(policy: Policy, b: Block, key: str, default: tuple[str, ...], nat64: bool = False) -> tuple[str, ...] | None:
    items = b.strings(key, default)
    if items is None:
        return None
    out = []
    ok = True
    for item in items:
        try:
            net = ipaddress.ip_network(item.value, strict=True)
        except ValueError:
            help = None
            try:
                help = f"did you mean `{ipaddress.ip_network(item.value, strict=False)}`?"
            except ValueError:
                help = "write an address block such as `203.0.113.0/24` or `2001:db8::/32`"
            policy.add(error("EL0031", f"`{_code(item.value)}` is not a valid CIDR block", item.span, help))
            ok = False
            continue
        if nat64 and (net.version != 6 or net.prefixlen != 96):
            policy.add(error("EL0031", f"NAT64 prefix `{net}` must be an IPv6 /96", item.span, "RFC 6052 /96 prefixes only, e.g. `64:ff9b::/96`"))
            ok = False
            continue
        out.append(str(net))
    return tuple(sorted(set(out), key=lambda c: (ipaddress.ip_network(c).version, ipaddress.ip_network(c)))) if ok else None


_NETWORK_KEYS = {"type": "str", "allowed_hosts": "list", "allow_package_managers": "bool", "allow_mcp_servers": "bool"}
_PROFILE_KEYS = {
    "trust": "str",
    "provider": "str",
    "required_egress_certification": "str",
    "network": "obj",
    "package_managers": "list",
    "brokers": "list",
    "enforce": "str",
    "budget": "obj",
}


def admit_profiles(policy: Policy) -> None:
    """Sandbox profiles: exact host sets (package-manager flags expanded), certification and trust lanes."""
    for d in policy.of_kind("sandbox_profile"):
        if d.body is None:
            continue
        profile = _admit_profile(policy, d)
        if profile is not None:
            policy.profiles[d.name] = profile


def _enum(policy: Policy, b: Block, key: str, allowed: tuple[str, ...], default: str) -> str | None:
    value = b.string(key, default)
    if value is None:
        return None
    if value not in allowed:
        help = _suggest(value, allowed) or f"one of: {', '.join(allowed)}"
        policy.add(error("EL0021", f"`{key}` is `{_code(value)}`, not one of {', '.join(allowed)}", b.span(key), help))
        return None
    return value


def _admit_profile(policy: Policy, d: Named) -> SandboxProfile | None:
    what = f"sandbox_profile `{d.name}`"
    b = Block(policy, d.body, what, _PROFILE_KEYS, aliases={"networking": "network"})
    ok = True
    trust = _enum(policy, b, "trust", ("trusted", "adversarial"), "adversarial")
    certification = _enum(policy, b, "required_egress_certification", ("advisory_filter", "security_boundary"), "advisory_filter")
    ok &= b.require("provider", d.name_span) & b.require("network", d.name_span)
    provider_ref = b.string("provider")
    provider = None
    if provider_ref is not None and policy.catalog is not None:
        provider = policy.catalog.provider(provider_ref)
        if provider is None:
            known = [p.ref for p in policy.catalog.providers]
            help = _suggest(provider_ref, known) or f"the catalog `{policy.catalog.version}` lists: {', '.join(known)}"
            policy.add(error("EL0020", f"provider `{_code(provider_ref)}` is not in the catalog", b.span("provider"), help))
    ecosystems = _ecosystems(policy, b)
    network = _admit_network(policy, b, what, ecosystems)
    brokers = _brokers(policy, b, d, trust)
    enforce = _enforce(policy, b, d, trust, network, brokers)
    budget_ok, budget = admit_budget(policy, b, what)
    if None in (trust, certification, provider, network, ecosystems, brokers, enforce) or not ok or not budget_ok or policy.catalog is None:
        return None
    missing_axes = tuple(a for a in policy.catalog.axes if a not in provider.axes)
    if certification == "security_boundary" and provider.egress_certification != "security_boundary":
        policy.add(
            error(
                "EL0018",
                f"provider `{provider.ref}` advertises `{provider.egress_certification}`, not `security_boundary`",
                b.span("required_egress_certification"),
                "no shipped provider revision is certified `security_boundary`; the profile is refused rather than downgraded",
            )
        )
        return None
    if trust == "adversarial":
        where = b.span("trust") if b.has("trust") else d.name_span
        lane_help = 'set `trust = "trusted"` only if the workload\'s author is trusted'
        if missing_axes:
            policy.add(
                error(
                    "EL0019",
                    f"adversarial profile on provider `{provider.ref}`, which lacks {', '.join(missing_axes)}",
                    where,
                    "pick a provider revision that realizes every enforcement axis",
                )
            )
            return None
        if network.mode == "allowlist" and provider.egress_certification != "security_boundary":
            policy.add(
                error(
                    "EL0019",
                    f"adversarial profile with allowlist egress on `{provider.ref}` ({provider.egress_certification})",
                    where,
                    'an adversarial workload gets `{"type": "none"}` unless its provider is certified `security_boundary`; '
                    + lane_help,
                )
            )
            return None
    return SandboxProfile(
        name=d.name,
        version=1,
        trust=trust,
        provider=provider.ref,
        provider_certification=provider.egress_certification,
        provider_missing_axes=missing_axes,
        required_egress_certification=certification,
        catalog_version=policy.catalog.version,
        network=network,
        network_policy_hash=network_policy_hash(network.allowed_hosts),
        brokers=brokers,
        enforce=enforce,
        budget=budget,
    )


def _enforce(policy: Policy, b: Block, d: Named, trust: str | None, network, brokers) -> str | None:
    """`enforce = "observe"`: requests outside the allowlist are forwarded as plain profile traffic and audited
    `would-deny`. Only where that cannot leak: a trusted workload (an adversary would get the open internet), that
    brokers nothing (a credential is never attached outside a rule) and has a network (`none` is not a trial run)."""
    mode = _enum(policy, b, "enforce", ("enforce", "observe"), "enforce")
    if mode != "observe" or trust is None or network is None or brokers is None:
        return mode
    why = None
    if trust == "adversarial":
        why = ("an adversarial workload would reach any public host", 'an adversarial profile is always enforced; set '
               '`trust = "trusted"` only if the workload\'s author is trusted')
    elif brokers:
        why = (f"it brokers `{_code(brokers[0])}`: observe mode forwards requests no rule admits, and a brokered credential "
               "is attached only under a rule", "observe a profile that brokers nothing, then add `brokers` once it is enforced")
    elif network.mode == "none":
        why = ("its network is `none`", "give it a limited network to observe, e.g. `{\"type\": \"limited\", \"allowed_hosts\": []}`")
    if why is None:
        return mode
    policy.add(error("EL0043", f"profile `{_code(d.name)}` cannot be observed: {why[0]}", b.span("enforce"), why[1]))
    return None


def _brokers(policy: Policy, b: Block, d: Named, trust: str | None) -> tuple[str, ...] | None:
    """The connections a profile brokers, in the order written (the first with a matching rule wins).

    An adversarial profile brokers nothing: a brokered credential rides on requests the workload makes,
    so whoever controls the workload could spend it (though never read it).
    """
    refs = b.names("brokers")
    if refs is None:
        return None
    out: list[str] = []
    for name, span in refs:
        if name in out:
            policy.add(warning("W0002", f"connection `{_code(name)}` is listed twice in `brokers`", span, "remove the duplicate"))
            continue
        out.append(name)
        policy.broker_refs.append((d.name, name, span))
    if out and trust == "adversarial":
        policy.add(
            error(
                "EL0039",
                f"adversarial profile `{_code(d.name)}` cannot broker `{_code(out[0])}`: the credential would ride on requests "
                "the adversary's code makes, so the adversary could use it",
                b.span("brokers"),
                "remove `brokers` and let the trusted side call the connection on the workload's behalf; set "
                '`trust = "trusted"` only if the workload\'s author is trusted',
            )
        )
        return None
    return tuple(out)


_BUDGET_KEYS = ("requests", "bytes", "window")
_BUDGET_EXAMPLE = 'e.g. `budget = {requests = 10000, bytes = "64MiB", window = "1h"}`'


def admit_budget(policy: Policy, b: Block, what: str) -> tuple[bool, Budget | None]:
    """`budget = {requests = N, bytes = SIZE, window = DURATION}` (docs/budget.md): (admitted, the budget or None
    when the block has none). Every refusal is EL0049, at the key or value it is about."""
    pair = b.pairs.get("budget")
    if pair is None:
        return True, None
    obj = pair.value
    if not isinstance(obj, Obj):
        policy.add(error("EL0049", f"the `budget` of {what} must be an object", obj.span, _BUDGET_EXAMPLE))
        return False, None
    ok = True
    for block in obj.blocks:
        policy.add(error("EL0049", f"a budget does not take a `{_code(block.kind)}` block", block.kind_span,
                         "a budget holds `requests`, `bytes` and `window`"))
        ok = False
    values: dict[str, int] = {}
    seen: set[str] = set()
    unknown = False
    for item in obj.pairs:
        if item.key not in _BUDGET_KEYS:
            help = _suggest(item.key, _BUDGET_KEYS) or "a budget holds `requests`, `bytes` and `window`"
            policy.add(error("EL0049", f"unknown key `{_code(item.key)}` in the budget of {what}", item.key_span, help))
            ok, unknown = False, True
            continue
        if item.key in seen:
            policy.add(error("EL0049", f"`{item.key}` is given twice in the budget of {what}", item.key_span, "keep one of them"))
            ok = False
            continue
        seen.add(item.key)
        value = _budget_value(policy, item)
        if value is None:
            ok = False
        else:
            values[item.key] = value
    if unknown:  # a misspelt key (its fix named above) is likely the key that seems missing
        return False, None
    if "window" not in seen:
        policy.add(error("EL0049", f"the budget of {what} has no `window`", pair.key_span,
                         'add `window = "1h"` (the caps hold per window: `"30s"`, `"15m"`, `"1h"`, `"1d"`)'))
        ok = False
    if "requests" not in seen and "bytes" not in seen:
        policy.add(error("EL0049", f"the budget of {what} caps nothing", pair.key_span,
                         'add `requests = N`, `bytes = "64MiB"` or both'))
        ok = False
    if not ok:
        return False, None
    return True, Budget(**values)


def _budget_value(policy: Policy, item: Pair) -> int | None:
    """One budget entry as a whole number (seconds, requests or bytes), or None after an EL0049."""
    raw = item.value
    if isinstance(raw, Num) and not isinstance(raw.value, int):
        policy.add(error("EL0049", f"`{item.key}` is `{_code(raw.text)}`, not a whole number", raw.span, _BUDGET_EXAMPLE))
        return None
    scalar = raw.value if isinstance(raw, (Num, Str)) else None
    if item.key == "requests":
        if not isinstance(raw, Num):
            policy.add(error("EL0049", "`requests` must be a whole number", raw.span, "e.g. `requests = 10000`"))
            return None
        if raw.value < 1:
            policy.add(error("EL0049", f"`requests` is {raw.value}: a cap admits at least 1 request", raw.span,
                             "leave `requests` out to cap bytes only; a profile that may send nothing has `network = {\"type\": \"none\"}`"))
            return None
        if raw.value > CAP_MAX:
            policy.add(error("EL0049", f"`requests` is {raw.value}, over {CAP_MAX:,}", raw.span, "leave `requests` out: no window holds that many"))
            return None
        return raw.value
    try:
        if scalar is None:
            raise BudgetValueError(f"`{item.key}` must be a {'duration' if item.key == 'window' else 'size'}", _BUDGET_EXAMPLE)
        return parse_window(scalar) if item.key == "window" else parse_size(scalar)
    except BudgetValueError as exc:
        policy.add(error("EL0049", exc.message, raw.span, exc.help))
        return None


def _ecosystems(policy: Policy, b: Block) -> tuple[str, ...] | None:
    items = b.strings("package_managers", ECOSYSTEMS)
    if items is None:
        return None
    out = []
    for item in items:
        if item.value not in ECOSYSTEMS:
            help = _suggest(item.value, ECOSYSTEMS) or f"one of: {', '.join(ECOSYSTEMS)}"
            policy.add(error("EL0021", f"unknown package ecosystem `{_code(item.value)}`", item.span, help))
            return None
        out.append(item.value)
    return tuple(sorted(set(out)))


def _admit_network(policy: Policy, parent: Block, what: str, ecosystems) -> Network | None:
    obj = parent.object("network")
    if obj is None:
        return None
    b = Block(policy, obj, f"the network of {what}", _NETWORK_KEYS)
    if not b.require("type", obj.span):
        return None
    kind = b.string("type")
    if kind == "unrestricted":
        policy.add(
            error(
                "EL0015",
                "unrestricted network is refused",
                b.span("type"),
                'use `{"type": "limited", "allowed_hosts": [...]}` with the exact hosts the sandbox needs',
            )
        )
        return None
    if kind not in ("none", "limited"):
        if kind is not None:
            policy.add(error("EL0016", f"network type `{_code(kind)}` is unknown", b.span("type"), 'use `"none"` or `"limited"`'))
        return None
    hosts = b.strings("allowed_hosts")
    pms = b.boolean("allow_package_managers", False)
    mcp = b.boolean("allow_mcp_servers", False)
    if hosts is None:
        return None
    if kind == "none":
        if hosts or pms or mcp:
            policy.add(
                error("EL0016", "a network of type `none` grants nothing", obj.span, 'remove the grants or use `"type": "limited"`')
            )
            return None
        return Network(mode="none")
    granted: dict[tuple[str, int, str], None] = {}
    seen: dict[tuple[str, int], Span] = {}
    ok = True
    for item in hosts:
        raw_host, port = split_host_port(item.value, 443)
        if port is None:
            policy.add(error("EL0023", f"`{_code(item.value)}` has an invalid port", item.span, "ports are 1-65535, e.g. `deb.debian.org:80`"))
            ok = False
            continue
        host, diag = admit_host(raw_host, item.span)
        if diag:
            policy.add(diag)
            ok = False
            continue
        if (host, port) in seen:
            policy.add(warning("W0002", f"`{host}:{port}` is listed twice", item.span, "remove the duplicate"))
            continue
        seen[(host, port)] = item.span
        granted[(host, port, "allowed_hosts")] = None
    if pms and policy.catalog is not None:
        for eco in ecosystems:
            for entry in policy.catalog.package_managers[eco]:
                granted[(entry.host, entry.port, f"allow_package_managers:{eco}")] = None
    if not ok:
        return None
    if not granted:
        if mcp:
            policy.add(
                error(
                    "EL0017",
                    "`allow_mcp_servers` is the only grant: it expands to no workload host, so this allowlist reaches nothing",
                    b.span("allow_mcp_servers"),
                    "MCP calls cross the platform gateway; name the hosts the sandbox itself needs, or use `{\"type\": \"none\"}`",
                )
            )
            return None
        policy.add(warning("W0001", "a limited network with no hosts reaches nothing", obj.span, 'write `{"type": "none"}`'))
        return Network(mode="none")
    allowed = tuple(AllowedHost(host=h, port=p, granted_by=g) for h, p, g in sorted(granted))
    return Network(mode="allowlist", allowed_hosts=allowed, allow_mcp_servers=mcp)


_CONNECTION_KEYS = {"credential": "str", "inject": "obj", "worker": "ref", "kind": "str",
                    "oauth2": "obj", "github_app": "obj", "aws_sigv4": "obj", "budget": "obj"}
# Each kind's settings object: its keys and their types (`static` takes none).
_KIND_KEYS = {
    "oauth2": {"token_url": "str", "grant": "str", "scopes": "list", "audience": "str"},
    "github_app": {"token_url": "str", "repositories": "list", "permissions": "obj"},
    "aws_sigv4": {"region": "str", "service": "str"},
}
_GRANTS = ("refresh_token", "client_credentials")
_AWS_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_SCOPE = re.compile(r"^[\x21\x23-\x5b\x5d-\x7e]+$")  # RFC 6749 §3.3 scope-token
_INSTALLATION_PATH = re.compile(r"^(/api/v3)?/app/installations/[0-9]{1,20}/access_tokens$")
_PERMISSION_LEVELS = ("read", "write", "admin")
_RULE_KEYS = {"host": "str", "port": "int", "path_prefix": "str", "methods": "list", "headers": "list",
              "path": "str", "query": "obj", "header_values": "obj", "mcp": "obj", "graphql": "obj", "git": "obj",
              "max_body": "int"}


def admit_connections(policy: Policy) -> None:
    """Connections: custody handle, inject target, worker reference and 1-32 exact rules."""
    for d in policy.of_kind("connection"):
        if d.body is None:
            continue
        what = f"connection `{d.name}`"
        b = Block(policy, Obj(d.body.pairs, (), d.body.span), what, _CONNECTION_KEYS)
        ok = b.require("credential", d.name_span)
        handle = b.string("credential")
        if handle is not None and not secret_kind(handle) and not _HANDLE.match(handle):
            policy.add(error("EL0033", f"credential handle `{_code(handle)}` is not a simple identifier", b.span("credential"), "a handle names a custody record: letters, digits, `.`, `_`, `-`, `/`"))
            ok = False
        kind, mint = _admit_kind(policy, b, what)
        if kind == "aws_sigv4" and b.has("inject"):
            policy.add(error("EL0041", f"{what} signs its requests with SigV4, which takes no `inject`", b.span("inject"),
                             "remove `inject`: the edge writes `Authorization` and the `X-Amz-*` signing headers itself"))
            ok = False
        inject = _admit_inject(policy, b, what) if kind != "aws_sigv4" else Inject(header="Authorization", format="{secret}")
        budget_ok, budget = admit_budget(policy, b, what)
        ok &= budget_ok
        worker = b.name_ref("worker", DEFAULT_WORKER)
        if worker is not None and b.has("worker"):
            policy.worker_refs.append((worker, b.span("worker")))
        egress = [blk for blk in d.body.blocks if blk.kind == "egress"]
        for other in d.body.blocks:
            if other.kind != "egress":
                policy.add(error("EL0007", f"{what} does not take a `{_code(other.kind)}` block", other.kind_span, _suggest(other.kind, ["egress"]) or "rules are `egress \"name\" { … }`"))
        if not 1 <= len(egress) <= MAX_RULES_PER_CONNECTION:
            policy.add(
                error(
                    "EL0022",
                    f"{what} has {len(egress)} egress rules; a connection needs 1 to {MAX_RULES_PER_CONNECTION}",
                    d.name_span,
                    "add an `egress \"name\" { … }` rule" if not egress else "split it into several connections",
                )
            )
            ok = False
        rules = []
        names: dict[str, Span] = {}
        for blk in egress:
            if blk.name in names:
                policy.add(error("EL0006", f"rule `{_code(blk.name)}` is declared twice in {what}", blk.name_span, "rename one of them"))
                ok = False
            names.setdefault(blk.name, blk.name_span)
            if not _NAME.match(blk.name):
                policy.add(error("EL0033", f"rule name `{_code(blk.name)}` is not a simple identifier", blk.name_span, "use letters, digits, `.`, `_` and `-`"))
                ok = False
                continue
            if blk.body is None:
                policy.add(error("EL0009", f"rule `{_code(blk.name)}` has no `{{ … }}` block", blk.span))
                ok = False
                continue
            rule = _admit_rule(policy, blk, inject.header if inject else None, what, kind or "static")
            if rule is None:
                ok = False
            else:
                rules.append(rule)
        if ok and kind is not None and None not in (handle, inject, worker):
            policy.connections[d.name] = Connection(
                name=d.name, version=1, credential_handle=handle, inject=inject, worker=worker, rules=tuple(rules), mint=mint,
                budget=budget,
            )


def _admit_kind(policy: Policy, b: Block, what: str) -> tuple[str | None, Mint | None]:
    """The credential kind and its settings object (named after the kind); (None, None) after an error."""
    kind = b.string("kind", "static")
    if kind is None:
        return None, None
    if kind not in CREDENTIAL_KINDS:
        help = _suggest(kind, CREDENTIAL_KINDS) or f"one of: {', '.join(CREDENTIAL_KINDS)}"
        policy.add(error("EL0041", f"credential kind `{_code(kind)}` is unknown", b.span("kind"), help))
        return None, None
    ok = True
    for other in _KIND_KEYS:
        if other != kind and b.has(other):
            policy.add(error("EL0041", f"`{other}` settings belong to a connection of kind `{other}`, and {what} is `{kind}`", b.span(other),
                             f'write `kind = "{other}"`, or remove `{other}`'))
            ok = False
    if kind == "static":
        return (kind, None) if ok else (None, None)
    obj = b.object(kind)
    if obj is None:
        if not b.has(kind):
            policy.add(error("EL0009", f"{what} is of kind `{kind}` and is missing its `{kind}` settings", b.span("kind"),
                             _KIND_EXAMPLE[kind]))
        return None, None
    kb = Block(policy, obj, f"the `{kind}` settings of {what}", _KIND_KEYS[kind])
    fields: dict[str, object] = {"kind": kind}
    if kind in ("oauth2", "github_app"):
        ok &= kb.require("token_url", obj.span)
        endpoint = _token_endpoint(policy, kb, kind)
        if endpoint is None:
            return None, None
        fields.update(endpoint)
    if kind == "oauth2":
        ok &= kb.require("grant", obj.span)
        grant = kb.string("grant")
        if grant is not None and grant not in _GRANTS:
            help = _suggest(grant, _GRANTS) or f"one of: {', '.join(_GRANTS)} (the edge never sees a user's browser)"
            policy.add(error("EL0021", f"OAuth 2.0 grant `{_code(grant)}` is not supported", kb.span("grant"), help))
            ok = False
        scopes = kb.strings("scopes")
        for item in scopes or ():
            if not _SCOPE.match(item.value):
                policy.add(error("EL0041", f"scope `{_code(item.value)}` is not an RFC 6749 scope token", item.span,
                                 "one scope per list item, no spaces or quotes"))
                ok = False
        audience = kb.string("audience")
        if audience is not None and (not audience or any(c in audience for c in "\r\n\x00")):
            policy.add(error("EL0041", "`audience` is empty or holds a line break", kb.span("audience")))
            ok = False
        fields.update(grant=grant, scopes=tuple(i.value for i in scopes or ()), audience=audience)
        ok &= scopes is not None
    elif kind == "github_app":
        repos = kb.strings("repositories")
        for item in repos or ():
            if not _NAME.match(item.value):
                policy.add(error("EL0041", f"repository `{_code(item.value)}` is not a repository name", item.span,
                                 "name repositories of the installation's owner without the owner (`app`, not `acme/app`)"))
                ok = False
        perms = _permissions(policy, kb)
        ok &= repos is not None and perms is not None
        fields.update(repositories=tuple(sorted({i.value for i in repos or ()})), permissions=perms or ())
    else:
        ok &= kb.require("region", obj.span) & kb.require("service", obj.span)
        for key in ("region", "service"):
            value = kb.string(key)
            if value is not None and not _AWS_NAME.match(value):
                policy.add(error("EL0041", f"`{key}` `{_code(value)}` is not an AWS {key} name", kb.span(key),
                                 "lowercase letters, digits and `-`, e.g. `us-east-1`, `s3`"))
                ok = False
            fields[key] = value
    if not ok:
        return None, None
    return kind, Mint(**fields)  # type: ignore[arg-type]


_KIND_EXAMPLE = {
    "oauth2": 'add `oauth2 = { token_url: "https://auth.example.com/oauth/token", grant: "refresh_token" }`',
    "github_app": 'add `github_app = { token_url: "https://api.github.com/app/installations/<id>/access_tokens" }`',
    "aws_sigv4": 'add `aws_sigv4 = { region: "us-east-1", service: "s3" }`',
}


def _token_endpoint(policy: Policy, kb: Block, kind: str) -> dict[str, object] | None:
    """`token_url`: an exact https URL (exact host, optional port, normalized path, no query, userinfo or fragment)."""
    raw = kb.string("token_url")
    if raw is None:
        return None
    span = kb.span("token_url")
    if secret_kind(raw):
        return None  # check_secrets refused it (EL0029) and masks it wherever the source is shown: never echoed here
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme.lower() != "https":
        policy.add(error("EL0042", f"token endpoint `{_code(raw)}` is not an https URL", span,
                         "the edge sends the connection's secrets there: write `https://host/path`"))
        return None
    authority, slash, tail = rest.partition("/")
    path = slash + tail
    if any(c in raw for c in "?#@") or not path:
        policy.add(error("EL0042", f"token endpoint `{_code(raw)}` must be an exact URL with a path and no query, fragment or userinfo",
                         span, "write `https://host/path`; the edge sends the grant's parameters in the body"))
        return None
    raw_host, port = split_host_port(authority, 443)
    if port is None:
        policy.add(error("EL0023", f"token endpoint `{_code(raw)}` has an invalid port", span, "ports are 1-65535"))
        return None
    host, diag = admit_host(raw_host, span)
    if diag:
        policy.add(diag)
        return None
    try:
        normalized = normalize_prefix(path)
    except PathError as exc:
        policy.add(error("EL0042", f"token endpoint path `{_code(path)}`: {exc.message}", span, "write the path in normal form"))
        return None
    if normalized != path or normalized.endswith("/") and normalized != "/":
        policy.add(error("EL0042", f"token endpoint path `{_code(path)}` is not in normal form", span, f"write `{_code(normalized.rstrip('/') or '/')}`"))
        return None
    if kind == "github_app" and not _INSTALLATION_PATH.match(path):
        policy.add(error("EL0042", f"`{_code(path)}` is not a GitHub App installation-token endpoint", span,
                         "write `https://api.github.com/app/installations/<installation id>/access_tokens` "
                         "(GitHub Enterprise: `https://HOST/api/v3/app/installations/<id>/access_tokens`)"))
        return None
    url = f"https://{host}{'' if port == 443 else f':{port}'}{path}"
    return {"token_url": url, "token_host": host, "token_port": port, "token_path": path}


def _permissions(policy: Policy, kb: Block) -> tuple[tuple[str, str], ...] | None:
    """A GitHub App installation token's `permissions`: `{ name: "read" | "write" | "admin" }`."""
    obj = kb.object("permissions")
    if obj is None:
        return None if kb.has("permissions") else ()
    out: dict[str, str] = {}
    for pair in obj.pairs:
        value = pair.value.value if isinstance(pair.value, Str) else None
        if not re.match(r"^[a-z][a-z_]{0,63}$", pair.key):
            policy.add(error("EL0041", f"permission `{_code(pair.key)}` is not a GitHub permission name", pair.key_span, "e.g. `contents`, `issues`"))
            return None
        if value not in _PERMISSION_LEVELS:
            policy.add(error("EL0021", f"permission `{pair.key}` must be one of {', '.join(_PERMISSION_LEVELS)}", pair.value.span,
                             'e.g. `contents: "read"`'))
            return None
        if pair.key in out:
            policy.add(error("EL0032", f"permission `{pair.key}` is given twice", pair.key_span, "keep one of them"))
            return None
        out[pair.key] = value
    return tuple(sorted(out.items()))


def _admit_inject(policy: Policy, b: Block, what: str) -> Inject | None:
    obj = b.object("inject")
    if obj is None:
        return None if b.has("inject") else Inject()
    ib = Block(policy, obj, f"`inject` of {what}", {"header": "str", "format": "str", "basic_user": "str"})
    header = ib.string("header", "Authorization")
    fmt = ib.string("format", "Bearer {secret}")
    user = ib.string("basic_user")
    if header is None or fmt is None:
        return None
    ok = True
    if not _TOKEN.fullmatch(header):
        policy.add(error("EL0028", f"`{_code(header)}` is not a valid header name", ib.span("header"), "a header name is an HTTP token"))
        ok = False
    elif header.lower() in INJECT_HEADER_FORBIDDEN or header.lower().startswith(("x-forwarded-", "proxy-", "x-egresslaw-")):
        policy.add(error("EL0028", f"`{header}` routes the request and cannot carry the credential", ib.span("header"), "use `Authorization` or a provider-specific header such as `X-Api-Key`"))
        ok = False
    if fmt.count("{secret}") != 1:
        policy.add(error("EL0027", f"`inject.format` contains `{{secret}}` {fmt.count('{secret}')} times", ib.span("format") if ib.has("format") else obj.span, "write it exactly once, e.g. `Bearer {secret}`"))
        ok = False
    elif any(c in fmt for c in "\r\n\x00"):
        policy.add(error("EL0027", "`inject.format` contains a line break or NUL", ib.span("format")))
        ok = False
    if user is not None and ok:
        if fmt != "Basic {secret}":
            policy.add(error("EL0027", "`basic_user` needs `format = \"Basic {secret}\"`", ib.span("basic_user"),
                             'write `format: "Basic {secret}"`: the edge sends base64(basic_user ":" credential)'))
            ok = False
        elif not user or ":" in user or any(ord(c) < 0x21 or ord(c) == 0x7F for c in user):
            policy.add(error("EL0027", "`basic_user` is empty or holds `:`, a space or a control character", ib.span("basic_user"),
                             'e.g. `basic_user: "x-access-token"`'))
            ok = False
    return Inject(header=header, format=fmt, basic_user=user) if ok else None


def _admit_rule(policy: Policy, blk: Named, inject_header: str | None, what: str, kind: str = "static") -> Rule | None:
    where = f"rule `{blk.name}` of {what}"
    b = Block(policy, blk.body, where, _RULE_KEYS)
    ok = b.require("host", blk.name_span) & b.require("methods", blk.name_span)
    host = None
    raw = b.string("host")
    if raw is not None:
        host, diag = admit_host(raw, b.span("host"))
        if diag:
            policy.add(diag)
    port = b.integer("port", 443, 1, 65535)
    prefix = None
    raw_prefix = b.string("path_prefix", "/")
    if raw_prefix is not None:
        try:
            prefix = normalize_prefix(raw_prefix)
        except PathError as exc:
            policy.add(error("EL0024", f"path prefix `{_code(raw_prefix)}`: {exc.message}", b.span("path_prefix") if b.has("path_prefix") else blk.name_span, "start with `/`, no `.`/`..` segments, no `//`, no `%2f`/`%2e`, no `;`, no query"))
    methods = _methods(policy, b)
    headers = _headers(policy, b, inject_header, kind)
    template = _template(policy, b)
    if template is not None:
        prefix = template_prefix(template) if template else None
    shapes = _shapes(policy, b, blk, headers, methods, inject_header, kind)
    if not ok or None in (host, port, prefix, methods, headers, shapes) or (b.has("path") and not template):
        return None
    return Rule(name=blk.name, host=host, port=port, path_prefix=prefix, methods=methods, headers=headers,
                template=template, **shapes)


# ---------------------------------------------------------------------------------------------
# Request shapes (docs/shapes.md): a path template, the query, header values, and the MCP, GraphQL or git body


def _template(policy: Policy, b: Block) -> tuple[Segment, ...] | None:
    """`path`: the rule's whole path as a template; None when absent, () after an error (reported)."""
    raw = b.string("path")
    if raw is None:
        return () if b.has("path") else None
    span = b.span("path")
    if b.has("path_prefix"):
        policy.add(error("EL0044", "a rule has `path` or `path_prefix`, not both", b.span("path_prefix"),
                         "remove `path_prefix`: the template's literal segments are its prefix"))
        return ()
    try:
        return parse_template(raw)
    except TemplateError as exc:
        policy.add(error("EL0044", f"path template: {exc.message}", _inner_span(span, exc.offset), exc.help))
    except PatternError as exc:
        policy.add(error("EL0045", f"pattern in the path template: {exc.message}", _inner_span(span, exc.offset), exc.help))
    return ()


def _inner_span(span: Span, offset: int, width: int = 1) -> Span:
    """The span of one character `offset` characters into a one-line string literal (its opening quote excluded).
    Exact when the literal holds no escape before that character; otherwise near it, and never past the literal."""
    if span.line != span.end_line:
        return span
    column = min(span.column + 1 + offset, max(span.column, span.end_column - 1))
    return Span(span.path, span.line, column, span.line, min(column + width, span.end_column))


_SHAPE_KINDS = ("mcp", "graphql", "git")


def _shapes(policy: Policy, b: Block, blk: Named, headers, methods, inject_header: str | None, kind: str) -> dict | None:
    """The rule's optional shapes as Rule fields (absent ones left out), or None after an error (reported)."""
    out: dict[str, object] = {}
    ok = True
    if b.has("query"):
        params = _params(policy, b, "query", lambda name, span: True)
        out["query"] = params
        ok &= params is not None
    if b.has("header_values"):
        def listed(name: str, span: Span) -> bool:
            if header_is_denylisted(name, inject_header, kind):
                reason = "carries the credential" if inject_header and name.lower() == inject_header.lower() else "is denylisted"
                policy.add(error("EL0048", f"header `{_code(name)}` {reason}: its value is the edge's, never shaped", span,
                                 "remove it from `header_values`"))
                return False
            if headers is not None and name.lower() not in headers:
                policy.add(error("EL0048", f"header `{_code(name)}` is not in the rule's `headers`", span,
                                 f"add `{_code(name)}` to `headers`, or remove it from `header_values`"))
                return False
            return True

        params = _params(policy, b, "header_values", listed, lowercase=True)
        out["header_values"] = params
        ok &= params is not None
    present = [k for k in _SHAPE_KINDS if b.has(k)]
    for extra in present[1:]:
        policy.add(error("EL0047", f"a rule has at most one of `mcp`, `graphql` and `git`; this one also has `{present[0]}`",
                         b.pairs[extra].key_span, "split it into one rule per protocol"))
        ok = False
    if present and ok:
        shape_kind = present[0]
        admit = {"mcp": _mcp, "graphql": _graphql, "git": _git}[shape_kind]
        shape = admit(policy, b)
        ok &= shape is not None
        out[shape_kind] = shape
        if shape_kind in ("mcp", "graphql") and methods is not None and "POST" not in methods:
            policy.add(error("EL0047", f"an `{shape_kind}` rule must allow POST (its requests are POSTed)",
                             b.pairs[shape_kind].key_span, 'add `"POST"` to `methods`'))
            ok = False
        if shape_kind == "git" and (b.has("path") or not b.has("path_prefix")):
            message = "takes `path_prefix` (the repository), not a `path` template" if b.has("path") else "needs `path_prefix` (the repository)"
            policy.add(error("EL0047", f"a `git` rule {message}", b.pairs["path" if b.has("path") else "git"].key_span,
                             'write `path_prefix = "/OWNER/REPO.git"`: its smart-HTTP endpoints are below it'))
            ok = False
    if b.has("max_body"):
        size = b.integer("max_body", 0, 1, MAX_BODY, "bytes of a body read before it is judged: 1 to 64 MiB (default 1 MiB)")
        if size is not None and not present:
            policy.add(error("EL0047", "`max_body` bounds an `mcp`, `graphql` or `git` body, and this rule has none",
                             b.pairs["max_body"].key_span, "remove `max_body`"))
            ok = False
        ok &= size is not None
        out["max_body"] = size
    return out if ok else None


MAX_BODY = 64 * 1024 * 1024


def _params(policy: Policy, b: Block, key: str, accept: Callable[[str, Span], bool], lowercase: bool = False) -> tuple[Param, ...] | None:
    """`{ name = VALUE, … }`: names unique (case-insensitively when `lowercase`), values of text (string or integer)."""
    obj = b.object(key)
    if obj is None:
        return None
    for block in obj.blocks:
        policy.add(error("EL0007", f"`{key}` does not take a `{_code(block.kind)}` block", block.kind_span))
    return _named_values(policy, obj, key, accept, lowercase, text=True)


def _named_values(policy: Policy, obj: Obj, what: str, accept: Callable[[str, Span], bool], lowercase: bool, text: bool) -> tuple[Param, ...] | None:
    out: dict[str, Param] = {}
    ok = not obj.blocks
    for pair in obj.pairs:
        name = pair.key.lower() if lowercase else pair.key
        if not name or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
            policy.add(error("EL0046", f"`{_code(pair.key)}` is not a name `{what}` can hold", pair.key_span,
                             "names are non-empty and hold no control character"))
            ok = False
            continue
        if name in out:
            policy.add(error("EL0032", f"`{_code(pair.key)}` is given twice in `{what}`", pair.key_span, "keep one of them"))
            ok = False
            continue
        if not accept(pair.key, pair.key_span):
            ok = False
            continue
        value = _shape_value(policy, pair.value, f"`{_code(pair.key)}` in `{what}`", text)
        if value is None:
            ok = False
            continue
        out[name] = Param(name=name, value=value)
    return tuple(out[n] for n in sorted(out)) if ok else None


_VALUE_TYPES = ("string", "integer", "boolean", "null", "array", "object", "any")
_TEXT_TYPES = ("string", "integer")
_VALUE_KEYS = {"type": "str", "enum": "list", "pattern": "str", "max_length": "int", "minimum": "int", "maximum": "int"}
_TYPE_RANK = {"null": 0, "boolean": 1, "integer": 2, "string": 3}


def _scalar_type(value: Value) -> str | None:
    """The JSON type of a scalar syntax value (None: not a scalar, or a fraction)."""
    if isinstance(value, Str):
        return "string"
    if isinstance(value, Bool):
        return "boolean"
    if isinstance(value, Null):
        return "null"
    if isinstance(value, Num) and isinstance(value.value, int):
        return "integer"
    return None


def _scalar(value: Value):
    return None if isinstance(value, Null) else value.value  # type: ignore[union-attr]


def _enum_key(item) -> tuple:
    """Canonical enum order: by type (null, boolean, integer, string), then value."""
    rank = 0 if item is None else 1 if isinstance(item, bool) else 2 if isinstance(item, int) else 3
    return (rank, item if item is not None else 0)


def _shape_value(policy: Policy, value: Value, what: str, text: bool) -> ShapeValue | None:
    """A value constraint (docs/shapes.md, "Values"): `"x"` exactly, `[…]` one of, or `{type, enum, pattern, …}`.
    `text`: a query or header value, which is text (only `string` and `integer` read there)."""
    allowed = _TEXT_TYPES if text else _VALUE_TYPES
    if isinstance(value, (Str, Num, Bool, Null)):
        kind = _scalar_type(value)
        if kind not in allowed:
            policy.add(error("EL0046", f"{what}: a {kind or 'fraction'} is not a value it can take", value.span,
                             "query and header values are text: a string, or a whole number" if text else "write a string, whole number, boolean or null"))
            return None
        return ShapeValue(type=kind, enum=(_scalar(value),))
    if isinstance(value, ListV):
        return _enum_value(policy, value, what, None, allowed)
    if isinstance(value, Ref):
        policy.add(error("EL0008", f"{what} must be a string, a list or an object", value.span, f'quote it: `"{value.name}"`'))
        return None
    vb = Block(policy, value, what, _VALUE_KEYS)
    ok = True
    kind = vb.string("type", "string")
    if kind is None:
        return None
    if kind not in allowed:
        help = "query and header values are text: `string` or `integer`" if text and kind in _VALUE_TYPES else (
            _suggest(kind, allowed) or f"one of: {', '.join(allowed)}")
        policy.add(error("EL0046", f"{what}: type `{_code(kind)}` is not one it can take", vb.span("type"), help))
        return None
    fields: dict[str, object] = {"type": kind}
    if vb.has("enum"):
        enum_list = vb.pairs["enum"].value
        if not isinstance(enum_list, ListV):
            vb._wrong(vb.pairs["enum"], "a list")
            return None
        enum = _enum_value(policy, enum_list, what, kind, allowed)
        ok &= enum is not None
        fields["enum"] = enum.enum if enum is not None else None
    for key, types in (("pattern", ("string",)), ("max_length", ("string", "array")), ("minimum", ("integer",)),
                       ("maximum", ("integer",))):
        if vb.has(key) and kind not in types:
            policy.add(error("EL0046", f"{what}: `{key}` constrains {' or '.join(types)} values, and this one is `{kind}`",
                             vb.pairs[key].key_span, f'write `type = "{types[0]}"`, or remove `{key}`'))
            ok = False
    pattern = vb.string("pattern")
    if pattern is not None:
        try:
            compiled = parse_pattern(pattern)
        except PatternError as exc:
            policy.add(error("EL0045", f"{what}: pattern: {exc.message}", _inner_span(vb.span("pattern"), exc.offset), exc.help))
            ok = False
        else:
            fields["pattern"] = compiled.text
    if vb.has("max_length"):
        fields["max_length"] = vb.integer("max_length", 0, 1, 1 << 30, "at least 1; an empty value is `\"\"` exactly")
        ok &= fields["max_length"] is not None
    for key in ("minimum", "maximum"):
        if vb.has(key):
            fields[key] = vb.integer(key, 0, -(1 << 53), 1 << 53, "an integer every JSON reader holds exactly (at most 2**53)")
            ok &= fields[key] is not None
    if not ok:
        return None
    if fields.get("minimum") is not None and fields.get("maximum") is not None and fields["minimum"] > fields["maximum"]:
        policy.add(error("EL0046", f"{what}: `minimum` {fields['minimum']} is above `maximum` {fields['maximum']}",
                         vb.span("minimum"), "no value could satisfy it; swap them"))
        return None
    result = ShapeValue(**{k: v for k, v in fields.items() if v is not None})  # type: ignore[arg-type]
    for item in result.enum or ():
        why = _fails(result, item)
        if why:
            policy.add(error("EL0046", f"{what}: enum value `{_code(str(item))}` {why}", vb.span("enum"),
                             "every listed value must satisfy the value's other constraints"))
            return None
    return result


def _fails(value: ShapeValue, item) -> str | None:
    """Why an enum value breaks its own value's other constraints (None: it does not)."""
    if value.pattern is not None and isinstance(item, str) and not matches(parse_pattern(value.pattern), item):
        return "does not match its `pattern`"
    if value.max_length is not None and isinstance(item, str) and len(item) > value.max_length:
        return "is longer than its `max_length`"
    if isinstance(item, int) and not isinstance(item, bool):
        if value.minimum is not None and item < value.minimum:
            return "is below its `minimum`"
        if value.maximum is not None and item > value.maximum:
            return "is above its `maximum`"
    return None


def _enum_value(policy: Policy, items: ListV, what: str, kind: str | None, allowed) -> ShapeValue | None:
    """A list of scalars of one type (`kind`, or the first item's when None) -> an enum, deduplicated and sorted."""
    if not items.items:
        policy.add(error("EL0046", f"{what}: an empty list admits nothing", items.span, "list at least one value"))
        return None
    found: dict[object, None] = {}
    for item in items.items:
        item_kind = _scalar_type(item)
        if item_kind is None or item_kind not in allowed:
            policy.add(error("EL0046", f"{what}: list items are {'strings or whole numbers' if allowed == _TEXT_TYPES else 'scalars'}",
                             item.span, "one value per item"))
            return None
        kind = kind or item_kind
        if item_kind != kind:
            policy.add(error("EL0046", f"{what}: `{_code(str(_scalar(item)))}` is a {item_kind}, and the value is `{kind}`",
                             item.span, "list values of one type"))
            return None
        found[(item_kind, _scalar(item))] = None
    enum = tuple(sorted((v for _, v in found), key=_enum_key))
    return ShapeValue(type=kind, enum=enum)


MCP_METHODS = (
    "initialize", "ping", "tools/list", "tools/call", "resources/list", "resources/read", "resources/templates/list",
    "prompts/list", "prompts/get", "completion/complete", "logging/setLevel", "notifications/initialized",
    "notifications/cancelled", "notifications/progress", "notifications/roots/list_changed",
)
MCP_DEFAULT_METHODS = ("initialize", "notifications/initialized", "ping", "tools/list", "tools/call")
_MCP_KEYS = {"methods": "list", "tools": "obj", "responses": "bool"}
_TOOL_KEYS = {"arguments": "obj", "required": "list", "forbidden": "list", "additional": "bool"}


def _mcp(policy: Policy, b: Block) -> Mcp | None:
    obj = b.object("mcp")
    if obj is None:
        return None
    mb = Block(policy, obj, "`mcp`", _MCP_KEYS)
    ok = not obj.blocks
    items = mb.strings("methods", MCP_DEFAULT_METHODS)
    methods: set[str] = set()
    for item in items or ():
        if item.value not in MCP_METHODS:
            help = _suggest(item.value, MCP_METHODS) or f"one of: {', '.join(MCP_METHODS)}"
            policy.add(error("EL0047", f"MCP method `{_code(item.value)}` is not one egresslaw knows", item.span, help))
            ok = False
        methods.add(item.value)
    ok &= items is not None
    tools: list[Tool] = []
    tools_obj = mb.object("tools")
    if mb.has("tools") and tools_obj is None:
        ok = False
    for pair in tools_obj.pairs if tools_obj else ():
        if any(t.name == pair.key for t in tools):
            policy.add(error("EL0032", f"tool `{_code(pair.key)}` is given twice", pair.key_span, "keep one of them"))
            ok = False
            continue
        tool = _tool(policy, pair)
        ok &= tool is not None
        if tool is not None:
            tools.append(tool)
    if tools_obj is not None and tools_obj.pairs and "tools/call" not in methods and items is not None:
        policy.add(error("EL0047", "`mcp` lists tools but not the method `tools/call` that calls them", mb.pairs["tools"].key_span,
                         'add `"tools/call"` to `methods`'))
        ok = False
    responses = mb.boolean("responses", False)
    if not ok:
        return None
    return Mcp(methods=tuple(sorted(methods)), tools=tuple(sorted(tools, key=lambda t: t.name)), responses=responses)


def _tool(policy: Policy, pair: Pair) -> Tool | None:
    what = f"tool `{_code(pair.key)}`"
    if not pair.key:
        policy.add(error("EL0047", "a tool's name is empty", pair.key_span))
        return None
    if not isinstance(pair.value, Obj):
        policy.add(error("EL0008", f"{what} must be an object `{{ arguments = …, required = […] }}`", pair.value.span))
        return None
    tb = Block(policy, pair.value, what, _TOOL_KEYS)
    ok = not pair.value.blocks
    arguments: tuple[Param, ...] = ()
    args_obj = tb.object("arguments")
    if tb.has("arguments") and args_obj is None:
        ok = False
    if args_obj is not None:
        found = _named_values(policy, args_obj, f"arguments of {what}", lambda name, span: True, False, text=False)
        ok &= found is not None
        arguments = found or ()
    names = {a.name for a in arguments}
    additional = tb.boolean("additional", False)
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("required", "forbidden"):
        items = tb.strings(key)
        ok &= items is not None
        lists[key] = tuple(sorted({i.value for i in items or ()}))
        for item in items or ():
            if key == "required" and item.value not in names and not additional and ok:
                policy.add(error("EL0047", f"{what} requires `{_code(item.value)}`, which is not among its `arguments`", item.span,
                                 f"add `{_code(item.value)}` to `arguments` (a key not listed is refused)"))
                ok = False
            if key == "forbidden" and (item.value in names or item.value in lists.get("required", ())):
                policy.add(error("EL0047", f"{what} forbids `{_code(item.value)}`, which it also admits or requires", item.span,
                                 "a key is admitted or forbidden, not both"))
                ok = False
    if not ok:
        return None
    return Tool(name=pair.key, arguments=arguments, required=lists["required"], forbidden=lists["forbidden"], additional=additional)


_GRAPHQL_KEYS = {"query": "list", "mutation": "list", "subscription": "list", "persisted": "list", "introspection": "bool"}
GRAPHQL_NAME = re.compile(r"[_A-Za-z][_0-9A-Za-z]*")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _graphql(policy: Policy, b: Block) -> GraphQL | None:
    obj = b.object("graphql")
    if obj is None:
        return None
    gb = Block(policy, obj, "`graphql`", _GRAPHQL_KEYS)
    ok = not obj.blocks
    fields: dict[str, object] = {}
    for key in ("query", "mutation", "subscription"):
        items = gb.strings(key)
        ok &= items is not None
        for item in items or ():
            if not GRAPHQL_NAME.fullmatch(item.value):
                policy.add(error("EL0047", f"`{_code(item.value)}` is not a GraphQL field name", item.span, "a root field's name, e.g. `repository`"))
                ok = False
            elif item.value.startswith("__"):
                help = "`__typename` is always admitted" if item.value == "__typename" else "write `introspection = true`"
                policy.add(error("EL0047", f"`{item.value}` is not listed among root fields", item.span, help))
                ok = False
        fields[key] = tuple(sorted({i.value for i in items or ()}))
    hashes = gb.strings("persisted")
    ok &= hashes is not None
    for item in hashes or ():
        if not _SHA256.fullmatch(item.value):
            policy.add(error("EL0047", f"persisted query `{_code(item.value)}` is not a sha256 hash", item.span, "64 hexadecimal digits"))
            ok = False
    fields["persisted"] = tuple(sorted({i.value.lower() for i in hashes or ()}))
    fields["introspection"] = gb.boolean("introspection", False)
    return GraphQL(**fields) if ok else None  # type: ignore[arg-type]


_GIT_KEYS = {"fetch": "bool", "push": "list", "create": "bool", "delete": "bool"}
_REF_REFUSED = set(" ~^:?[\\\x7f")


def _git(policy: Policy, b: Block) -> Git | None:
    obj = b.object("git")
    if obj is None:
        return None
    gb = Block(policy, obj, "`git`", _GIT_KEYS)
    ok = not obj.blocks
    items = gb.strings("push")
    ok &= items is not None
    for item in items or ():
        why = ref_pattern_problem(item.value)
        if why:
            policy.add(error("EL0047", f"push ref pattern `{_code(item.value)}` {why}", item.span,
                             "e.g. `refs/heads/agent/*` (`*` is any run of characters other than `/`)"))
            ok = False
    shape = Git(fetch=gb.boolean("fetch", False), push=tuple(sorted({i.value for i in items or ()})),
                create=gb.boolean("create", False), delete=gb.boolean("delete", False))
    return shape if ok else None


def ref_pattern_problem(ref: str) -> str | None:
    """Why git would refuse a ref this pattern names (git check-ref-format), `*` aside; None when it is fine."""
    if not ref.startswith("refs/"):
        return "does not start with `refs/`"
    if ".." in ref or "//" in ref or "@{" in ref:
        return "holds `..`, `//` or `@{`"
    if any(c in _REF_REFUSED or ord(c) < 0x20 for c in ref):
        return "holds a character git refuses in a ref name"
    if ref.endswith(("/", ".")) or ref == "refs/":
        return "ends with `/` or `.`"
    if any(part.startswith(".") or part.endswith(".lock") for part in ref.split("/")):
        return "has a component that starts with `.` or ends with `.lock`"
    return None


def _methods(policy: Policy, b: Block) -> tuple[str, ...] | None:
    items = b.strings("methods")
    if items is None or not b.has("methods"):
        return None
    if not items:
        policy.add(error("EL0025", "`methods` is empty", b.span("methods"), f"name at least one of {', '.join(METHODS)}"))
        return None
    out = set()
    ok = True
    for item in items:
        m = item.value
        if m in METHODS:
            out.add(m)
            continue
        ok = False
        if m.upper() in METHODS:
            help = f"methods are uppercase: `{m.upper()}`"
        elif m in ("*", "ANY", "ALL"):
            help = "list each method the rule needs"
        elif m.upper() in ("CONNECT", "TRACE"):
            help = f"`{m.upper()}` is never allowed through the egress edge"
        else:
            help = f"one of {', '.join(METHODS)}"
        policy.add(error("EL0025", f"method `{_code(m)}` is not allowed", item.span, help))
    return tuple(m for m in METHODS if m in out) if ok else None


def _headers(policy: Policy, b: Block, inject_header: str | None, kind: str = "static") -> tuple[str, ...] | None:
    items = b.strings("headers")
    if items is None:
        return None
    out = set()
    ok = True
    for item in items:
        name = item.value
        if not _TOKEN.fullmatch(name):
            policy.add(error("EL0034", f"`{_code(name)}` is not a valid header name", item.span, "a header name is an HTTP token"))
            ok = False
        elif header_is_denylisted(name, inject_header, kind):
            if inject_header and name.lower() == inject_header.lower():
                reason = "carries the credential"
            elif name.lower() in EDGE_HEADERS.get(kind, ()):
                reason = f"is written by the edge when it signs ({kind})"
            else:
                reason = "routes or authorizes the request"
            policy.add(error("EL0026", f"header `{name}` {reason} and can never be allowlisted", item.span, "remove it from `headers`; the proxy sets what it must"))
            ok = False
        else:
            out.add(name.lower())
    return tuple(sorted(out)) if ok else None


def check_references(policy: Policy) -> None:
    """Every worker a connection names is declared (or is the built-in `default`)."""
    declared = {d.name for d in policy.of_kind("worker")} | set(policy.workers)
    for name, span in policy.worker_refs:
        if name not in declared:
            help = _suggest(name, declared) or f"declared workers: {', '.join(sorted(declared))}"
            policy.add(error("EL0030", f"worker `{_code(name)}` is not declared", span, help))


def check_brokers(policy: Policy) -> None:
    """Every brokered name is a declared connection, and every host:port its rules reach is already in the
    profile's allowlist (brokering attaches a credential to requests the profile may make; it never widens
    where the profile may go)."""
    declared = {d.name: d.kind for d in policy.decls if d.kind in ("worker", "sandbox_profile", "connection")}
    for profile, name, span in policy.broker_refs:
        kind = declared.get(name)
        if kind != "connection":
            if kind is not None:
                policy.add(error("EL0030", f"`{_code(name)}` is a {kind}, not a connection", span, "`brokers` lists connections"))
            else:
                connections = sorted(n for n, k in declared.items() if k == "connection")
                help = _suggest(name, connections) or f"declared connections: {', '.join(connections) or 'none'}"
                policy.add(error("EL0030", f"connection `{_code(name)}` is not declared", span, help))
            continue
        prof, conn = policy.profiles.get(profile), policy.connections.get(name)
        if prof is None or conn is None:
            continue  # its own errors are reported where it is declared
        allowed = {(h.host, h.port) for h in prof.network.allowed_hosts}
        missing: dict[tuple[str, int], str] = {}
        for rule in conn.rules:
            if (rule.host, rule.port) not in allowed:
                missing.setdefault((rule.host, rule.port), rule.name)
        for (host, port), rule_name in missing.items():
            entry = host if port == 443 else f"{host}:{port}"
            policy.add(
                error(
                    "EL0040",
                    f"profile `{_code(profile)}` brokers `{_code(name)}`, whose rule `{_code(rule_name)}` reaches `{host}:{port}`, "
                    "which is not in the profile's allowlist",
                    span,
                    f'add `"{entry}"` to `allowed_hosts`: brokering adds a credential to requests the profile may already make, '
                    "it never adds a destination",
                )
            )


PASSES: tuple[Callable[[Policy], None], ...] = (
    check_headers,
    check_declarations,
    check_secrets,
    admit_workers,
    admit_profiles,
    admit_connections,
    check_references,
    check_brokers,
)


def run_passes(policy: Policy) -> Policy:
    """Run every pass in order; all diagnostics are collected on the policy."""
    for p in PASSES:
        p(policy)
    return policy
