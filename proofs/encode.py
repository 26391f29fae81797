"""Encode `egress_proxy.decide.decide` for one subject over a symbolic request and a symbolic resolved address.

The request is abstracted into finite pieces, each one exact for what `decide()` can observe:

- host: an integer id over the subject's exact rule/allowlist host strings, plus "another name" and
  "another IP literal" (with its own symbolic address); `host_err` stands for any HostError;
- method: an id over `compiler.constants.METHODS` plus "another method";
- path: an id over the classes of the constant-prefix partition (see `PathSpace`), `path_err` for
  any PathError. The decision function refuses encoded and dot-segment paths, so only normalized
  paths are ever matched, and every matcher that depends on constant prefixes is exact over the
  partition. The matcher table is computed with the function `decide` actually calls;
- headers: a presence bit (and a "named in Connection" bit) per header name in the universe
  (every allowlisted name, the inject header, the framing headers, and one stand-in for any other);
  the Host-header agreement and framing checks are booleans with their side conditions.

Every check of `decide()` appears in its order, each denial with its reason code, so the same
terms answer both "is it allowed" and "with which reason" (the differential test compares both).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import z3

from catalog import SpecialPurposeTable
from compiler.artifact import Artifact, Connection, SandboxProfile, Worker
from compiler.constants import (
    BODYLESS_METHODS,
    DEFAULT_WORKER,
    HEADER_DENYLIST,
    HEADER_DENYLIST_PREFIXES,
    METHODS,
    header_is_denylisted,
)
from compiler.normalize import HostError, PathError, normalize_host, normalize_path, normalize_prefix
from compiler.normalize import prefix_matches as spec_prefix_matches
from proofs.addr import ADDRESS_REASONS, Addr, AddressModel, fresh_addr

OTHER_NAME = "other.example.net"  # the stand-in for any name no rule mentions (decoded counterexamples use it)
OTHER_IP = "another IP literal"
OTHER_HEADER = "x-other-header"
OTHER_METHOD = "TRACE"
FRAMING_HEADERS = ("upgrade", "http2-settings", "connection", "transfer-encoding", "content-length")
SCHEMES = ("https", "http", "other")
# Extensions tried, in order, to find a path in a partition class; "x" first so that the raw-prefix
# counterexample reads `/repos/acmex`.
_EXT_CHARS = "xqzjkvw0123456789abcdefghilmnoprstuy-_~"

# Reason codes as integers inside Z3; the strings are decide()'s codes (host-*/path-* grouped).
REASONS = (
    "allowed",
    "worker-unknown",
    "scheme-not-allowed",
    "port-invalid",
    "host-error",
    "ip-literal-refused",
    "ipv6-disabled",
    "address-denied",
    "address-not-public",
    "no-matching-rule",
    "profile-host-not-allowed",
    "method-not-allowed",
    "smuggling",
    "host-header-mismatch",
    "upgrade-denied",
    "body-on-bodyless-method",
    "path-error",
    "path-not-allowed",
)
RID = {r: i for i, r in enumerate(REASONS)}


def reason_class(code: str) -> str:
    """decide()'s reason code folded the way the encoding distinguishes them."""
    if code.startswith("host-") and code not in ("host-header-mismatch",):
        return "host-error"
    if code.startswith("path-") and code != "path-not-allowed":
        return "path-error"
    return code


# ---------------------------------------------------------------------------------------------
# Paths: the constant-prefix partition
# ---------------------------------------------------------------------------------------------


def _is_normal_path(p: str) -> bool:
    try:
        return normalize_path(p) == p
    except PathError:
        return False


class PathSpace:
    """Finite partition of all normalized paths by the constants `p` and `p + "/"` of every prefix `p`.

    For constants K, a path's relation to every `PrefixOf(k, path)` and `path == k` is fixed by the
    longest k in K that prefixes it and whether the path equals it; one witness per realizable
    (longest, equal) pair therefore covers every behaviour of a constant-prefix matcher.
    """

    def __init__(self, prefixes: list[str]) -> None:
        consts: set[str] = set()
        for p in prefixes:
            consts.add(p)
            if p != "/":
                consts.add(p + "/")
        self.consts = sorted(consts)
        witnesses: list[str] = []
        seen: set[tuple[str | None, bool]] = set()
        for c in [""] + self.consts:
            for w in self._members(c):
                sig = self.signature(w)
                if sig not in seen:
                    seen.add(sig)
                    witnesses.append(w)
        self.witnesses = tuple(witnesses)
        self._index = {self.signature(w): i for i, w in enumerate(self.witnesses)}

    def longest(self, path: str) -> str | None:
        best = None
        for k in self.consts:
            if path.startswith(k) and (best is None or len(k) > len(best)):
                best = k
        return best

    def signature(self, path: str) -> tuple[str | None, bool]:
        k = self.longest(path)
        return (k, k is not None and path == k)

    def classify(self, path: str) -> int:
        """The class id of a normalized path."""
        return self._index[self.signature(path)]

    def _members(self, c: str) -> list[str]:
        out = []
        if c and _is_normal_path(c) and self.longest(c) == c:
            out.append(c)
        base = c or "/"
        exts = list(_EXT_CHARS) + [a + b for a in _EXT_CHARS for b in _EXT_CHARS]
        if not c:
            exts = [""] + exts
        for ext in exts:
            cand = base + ext if c else "/" + ext
            if not _is_normal_path(cand):
                continue
            sig = self.signature(cand)
            if sig[0] == (c or None) and not sig[1]:
                out.append(cand)
                break
        return out


# ---------------------------------------------------------------------------------------------
# The symbolic request
# ---------------------------------------------------------------------------------------------


@dataclass
class Universe:
    """The finite domains of one subject (union over the artifacts compared)."""

    hosts: list[str]  # exact host strings as rules/allowlists write them; then OTHER_NAME, OTHER_IP
    host_lits: dict[int, ipaddress.IPv4Address | ipaddress.IPv6Address]  # id -> literal for IP hosts
    headers: list[str]  # lowercase names; OTHER_HEADER last
    paths: PathSpace
    ports: list[int] = field(default_factory=list)

    @property
    def other_name(self) -> int:
        return len(self.hosts) - 2

    @property
    def other_ip(self) -> int:
        return len(self.hosts) - 1

    @classmethod
    def build(cls, subjects: list[Connection | SandboxProfile]) -> Universe:
        hosts: set[str] = set()
        prefixes: set[str] = set()
        headers: set[str] = set(FRAMING_HEADERS) | {"authorization"}
        ports: set[int] = {443, 80}
        for s in subjects:
            if isinstance(s, Connection):
                headers.add(s.inject.header.lower())
                for r in s.rules:
                    hosts.add(r.host)
                    ports.add(r.port)
                    headers.update(h.lower() for h in r.headers)
                    try:
                        prefixes.add(normalize_prefix(r.path_prefix))
                    except PathError:
                        pass
            else:
                # profile traffic forwards every header that is not denylisted: the denylist itself (and one name
                # per denylisted prefix) must be in the universe for header-safety to range over it
                headers.update(HEADER_DENYLIST)
                headers.update(p + "example" for p in HEADER_DENYLIST_PREFIXES)
                for h in s.network.allowed_hosts:
                    hosts.add(h.host)
                    ports.add(h.port)
        host_list = sorted(hosts) + [OTHER_NAME, OTHER_IP]
        lits = {}
        for i, h in enumerate(host_list[:-2]):
            try:
                form = normalize_host(h)
            except HostError:
                continue
            if form.is_ip and form.value == h:
                lits[i] = ipaddress.ip_address(h)
        other = OTHER_HEADER
        while other in headers:
            other = "x-" + other
        return cls(host_list, lits, sorted(headers) + [other], PathSpace(sorted(prefixes)), sorted(ports))


class SymRequest:
    """The symbolic request variables of one universe in one Z3 context, with their well-formedness."""

    def __init__(self, ctx: z3.Context, uni: Universe, tag: str = "r") -> None:
        self.ctx, self.uni = ctx, uni
        I, B = (lambda n: z3.Int(f"{tag}_{n}", ctx)), (lambda n: z3.Bool(f"{tag}_{n}", ctx))  # noqa: E731
        self.scheme = I("scheme")
        self.port = I("port")
        self.host = I("host")
        self.host_err = B("host_err")
        self.method = I("method")
        self.hh_n = I("host_headers")  # how many Host headers in the list: 0, 1 or 2 (= more than one)
        self.auth_given = B("authority_given")  # req.host_header is set
        self.auth_bad = B("authority_bad")  # some Host value does not name (host, port)
        self.cl_multi = B("content_length_multi")
        self.has_body = B("has_body")
        self.path_err = B("path_err")  # normalize_path refuses the target (connections)
        self.target_err = B("target_err")  # check_target refuses it (profiles); implies path_err
        self.path = I("path")
        self.present = {h: B(f"hdr_{h}") for h in uni.headers}
        self.hop = {h: B(f"hop_{h}") for h in uni.headers}  # named in a Connection header
        self.ip, ip_wf = fresh_addr(ctx, f"{tag}_ip")
        self.lit, lit_wf = fresh_addr(ctx, f"{tag}_lit")
        n_hosts, n_methods, n_paths = len(uni.hosts), len(METHODS) + 1, len(uni.paths.witnesses)
        conn = self.present["connection"]
        self.wf = z3.And(
            [
                ip_wf,
                lit_wf,
                self.scheme >= 0, self.scheme < len(SCHEMES),
                self.host >= 0, self.host < n_hosts,
                self.method >= 0, self.method < n_methods,
                self.path >= 0, self.path < n_paths,
                self.hh_n >= 0, self.hh_n <= 2,
                z3.Implies(self.auth_bad, z3.Or(self.hh_n >= 1, self.auth_given)),
                z3.Implies(self.cl_multi, self.present["content-length"]),
                z3.Implies(self.target_err, self.path_err),
                self.port >= -1, self.port <= 65536,
                *[z3.Implies(self.hop[h], conn) for h in uni.headers],
            ]
        )

    def iv(self, v: int) -> z3.ArithRef:
        return z3.IntVal(v, self.ctx)

    def method_in(self, methods) -> z3.BoolRef:
        ids = [METHODS.index(m) for m in methods if m in METHODS]
        return z3.Or([self.method == i for i in ids]) if ids else z3.BoolVal(False, self.ctx)

    def path_in(self, classes: list[int]) -> z3.BoolRef:
        return z3.Or([self.path == j for j in classes]) if classes else z3.BoolVal(False, self.ctx)

    def hostport(self, host: str, port: int) -> z3.BoolRef:
        if host not in self.uni.hosts[:-2]:
            return z3.BoolVal(False, self.ctx)
        return z3.And(self.host == self.uni.hosts.index(host), self.port == port)

    def literal_addr(self) -> Addr:
        """The address an IP-literal host names: a constant for literal rule hosts, else symbolic."""
        is6, x = self.lit.is6, self.lit.x
        for i, ip in self.uni.host_lits.items():
            is6 = z3.If(self.host == i, z3.BoolVal(ip.version == 6, self.ctx), is6)
            x = z3.If(self.host == i, z3.BitVecVal(int(ip), 128, self.ctx), x)
        return Addr(is6, x)

    def is_ip_host(self) -> z3.BoolRef:
        return z3.Or([self.host == self.uni.other_ip] + [self.host == i for i in self.uni.host_lits])


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """decide()'s verdict as terms: `allowed`, `reason` (an index into REASONS) and `rule` (-1 when none)."""

    pre: z3.BoolRef  # the request is admitted before the address check
    allowed: z3.BoolRef
    reason: z3.ArithRef
    rule: z3.ArithRef
    forwarded: dict[str, z3.BoolRef]  # header -> forwarded by decide()
    requested: dict[str, z3.BoolRef]  # header -> the artifact's allowlist (as written) asks to forward it
    worker: Worker | None
    addr: AddressModel | None


def _chain(ctx: z3.Context, steps: list[tuple[z3.BoolRef, str]], final: z3.ArithRef) -> z3.ArithRef:
    out = final
    for cond, reason in reversed(steps):
        out = z3.If(cond, z3.IntVal(RID[reason], ctx), out)
    return out


class Encoder:
    """Encodes decide() for the subjects of one artifact; `matcher` is the prefix function decide() calls."""

    def __init__(self, ctx: z3.Context, artifact: Artifact, table: SpecialPurposeTable, matcher=None) -> None:
        self.ctx = ctx
        self.artifact = artifact
        self.table = table
        if matcher is None:
            import egress_proxy.decide as decide_module

            matcher = decide_module.prefix_matches  # INVARIANT: looked up at encode time, so a patched decide is modelled
        self.matcher = matcher
        self._addr: dict[str, AddressModel | None] = {}

    def address_model(self, worker_name: str) -> AddressModel | None:
        if worker_name not in self._addr:
            w = self.artifact.worker(worker_name)
            model = None
            if w is not None:
                try:
                    model = AddressModel(self.ctx, w, self.table)
                except ValueError:
                    model = None
            self._addr[worker_name] = model
        return self._addr[worker_name]

    def _common(self, r: SymRequest, schemes_ok: z3.BoolRef, am: AddressModel, admitted_hostport: z3.BoolRef,
                host_reason: str, path_error: z3.BoolRef) -> tuple[list[tuple[z3.BoolRef, str]], z3.BoolRef]:
        """The checks shared by both subject kinds up to the path, as (condition, reason) steps and `all pass`.

        `path_error` is the subject kind's path refusal: `path_err` (normalize_path) for connections,
        `target_err` (check_target) for profiles.
        """
        ctx = self.ctx
        lit = r.literal_addr()
        ip_host = r.is_ip_host()
        lit_reason = am.reason(lit)
        steps: list[tuple[z3.BoolRef, str]] = [
            (z3.Not(schemes_ok), "scheme-not-allowed"),
            (z3.Or(r.port < 1, r.port > 65535), "port-invalid"),
            (r.host_err, "host-error"),
            (z3.And(ip_host, z3.BoolVal(not am.worker.ip_literals, ctx)), "ip-literal-refused"),
        ]
        for code, name in ADDRESS_REASONS.items():
            if code:
                steps.append((z3.And(ip_host, lit_reason == code), name))
        bodyless = r.method_in(sorted(BODYLESS_METHODS))
        upgrade = z3.Or(r.present["upgrade"], r.present["http2-settings"], r.hop["upgrade"])
        framing = z3.Or(z3.And(r.present["transfer-encoding"], r.present["content-length"]), r.cl_multi)
        steps += [
            (z3.Not(admitted_hostport), host_reason),
            (r.method == len(METHODS), "method-not-allowed"),
            (r.hh_n >= 2, "smuggling"),
            (r.auth_bad, "host-header-mismatch"),
            (upgrade, "upgrade-denied"),
            (framing, "smuggling"),
            (z3.And(r.has_body, bodyless), "body-on-bodyless-method"),
            (path_error, "path-error"),
        ]
        passed = z3.And([z3.Not(c) for c, _ in steps])
        return steps, passed

    def connection(self, conn: Connection, r: SymRequest) -> Outcome:
        ctx = self.ctx
        am = self.address_model(conn.worker)
        false = z3.BoolVal(False, ctx)
        if am is None:
            return Outcome(false, false, r.iv(RID["worker-unknown"]), r.iv(-1), {}, {}, None, None)
        uni = r.uni
        admitted_hp = z3.Or([r.hostport(rule.host, rule.port) for rule in conn.rules] or [false])
        steps, passed = self._common(r, r.scheme == 0, am, admitted_hp, "no-matching-rule", r.path_err)
        # first matching rule in artifact order among those for this (host, port)
        prefixes = []
        matched = []
        for rule in conn.rules:
            try:
                p: str | None = normalize_prefix(rule.path_prefix)
            except PathError:
                p = None
            prefixes.append(p)
            classes = [] if p is None else [j for j, w in enumerate(uni.paths.witnesses) if self.matcher(p, w)]
            matched.append((r.hostport(rule.host, rule.port), r.path_in(classes)))
        chosen = r.iv(-1)
        for i in reversed(range(len(conn.rules))):
            hp, pm = matched[i]
            chosen = z3.If(z3.And(hp, pm, r.method_in(conn.rules[i].methods)), r.iv(i), chosen)
        some_prefix = z3.Or([z3.And(hp, pm) for hp, pm in matched] or [false])
        pre = z3.And(passed, chosen >= 0)
        ip_reason = am.reason(r.ip)
        final = z3.If(
            chosen >= 0,
            _chain(ctx, [(ip_reason == c, n) for c, n in ADDRESS_REASONS.items() if c], r.iv(RID["allowed"])),
            z3.If(some_prefix, r.iv(RID["method-not-allowed"]), r.iv(RID["path-not-allowed"])),
        )
        reason = _chain(ctx, steps, final)
        allowed = z3.And(pre, am.public(r.ip))
        forwarded: dict[str, z3.BoolRef] = {}
        requested: dict[str, z3.BoolRef] = {}
        effective = self._effective_headers(conn)
        for h in uni.headers:
            eff = [i for i, names in enumerate(effective) if h in names]
            asked = [i for i, rule in enumerate(conn.rules) if h in {x.lower() for x in rule.headers}]
            base = z3.And(allowed, r.present[h], z3.Not(r.hop[h]))
            fwd_ok = h != "authorization" and not h.startswith("proxy-")
            forwarded[h] = z3.And(base, z3.Or([chosen == i for i in eff] or [false])) if fwd_ok else false
            requested[h] = z3.And(base, z3.Or([chosen == i for i in asked] or [false]))
        return Outcome(pre, allowed, reason, z3.If(allowed, chosen, r.iv(-1)), forwarded, requested, am.worker, am)

    def _effective_headers(self, conn: Connection) -> list[frozenset[str]]:
        """Per rule, the allowlist as decide()'s own index holds it (so a change there is modelled, not assumed)."""
        import egress_proxy.decide as decide_module

        view = decide_module.ArtifactIndex(self.artifact).connection(conn.name)
        if view is None:  # pragma: no cover - the subject exists
            return [frozenset() for _ in conn.rules]
        by_rule = {id(rv.rule): rv.headers for rvs in view.by_hostport.values() for rv in rvs}
        out = []
        for rule in conn.rules:
            names = by_rule.get(id(rule))
            if names is None:  # the index copies nothing today; fall back to the documented filter
                names = frozenset(x.lower() for x in rule.headers if not header_is_denylisted(x, conn.inject.header))
            out.append(frozenset(names))
        return out

    def profile(self, prof: SandboxProfile, r: SymRequest) -> Outcome:
        ctx = self.ctx
        am = self.address_model(DEFAULT_WORKER)
        false = z3.BoolVal(False, ctx)
        if am is None:
            return Outcome(false, false, r.iv(RID["worker-unknown"]), r.iv(-1), {}, {}, None, None)
        hosts = prof.network.allowed_hosts if prof.network.mode == "allowlist" else ()
        admitted_hp = z3.Or([r.hostport(h.host, h.port) for h in hosts] or [false])
        steps, passed = self._common(r, z3.Or(r.scheme == 0, r.scheme == 1), am, admitted_hp, "profile-host-not-allowed",
                                     r.target_err)
        ip_reason = am.reason(r.ip)
        final = _chain(ctx, [(ip_reason == c, n) for c, n in ADDRESS_REASONS.items() if c], r.iv(RID["allowed"]))
        reason = _chain(ctx, steps, final)
        allowed = z3.And(passed, am.public(r.ip))
        forwarded = {
            h: z3.And(allowed, r.present[h], z3.Not(r.hop[h]), z3.BoolVal(not header_is_denylisted(h), ctx))
            for h in r.uni.headers
        }
        return Outcome(passed, allowed, reason, r.iv(-1), forwarded, dict(forwarded), am.worker, am)

    def subject(self, kind: str, name: str, r: SymRequest) -> Outcome | None:
        if kind == "connection":
            conn = self.artifact.connection(name)
            return None if conn is None else self.connection(conn, r)
        prof = self.artifact.profile(name)
        return None if prof is None else self.profile(prof, r)


def spec_rule_match(conn: Connection, index: int, r: SymRequest) -> z3.BoolRef:
    """SPEC §5 credential-scope: exact host and port, https, the method, segment-bounded prefix of the path."""
    rule = conn.rules[index]
    try:
        p = normalize_prefix(rule.path_prefix)
    except PathError:
        return z3.BoolVal(False, r.ctx)
    classes = [j for j, w in enumerate(r.uni.paths.witnesses) if spec_prefix_matches(p, w)]
    return z3.And(r.hostport(rule.host, rule.port), r.scheme == 0, r.method_in(rule.methods), r.path_in(classes),
                  z3.Not(r.path_err), z3.Not(r.host_err))
