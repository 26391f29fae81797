"""The decision core: the enforcement semantics, written once, run two ways.

The proxy runs these functions natively on Python values (`egress_proxy.decision.adapter` and
`egress_proxy.decision.addresses` are the adapters that turn a request and resolver answers into the
plain inputs below and the verdict back into a `Decision`). The prover runs the *same source*
symbolically: `proofs.symexec` evaluates these function bodies on Z3 terms (an address is a
128-bit vector, a host or method a guarded choice over a finite set, a header name a Z3 string),
merging both sides of every branch. So a change here changes what the proxy does and what the
prover proves at once; `proofs/spec/` states each property independently of this file.

Rules for code in this module (so the symbolic evaluator can run it): functions take and return
plain values (bool, int, str, tuples) and the frozen tables built by `worker_table` /
`connection_subject` / `profile_subject`; statements are `if`/`for` over concrete tables/`return`/
assignment (no `while`, `break`, `try`, f-strings). Symbolic values are only ever compared and
combined with `and`/`or`/`not` and bit operators; a host, method or path is compared for equality
with table entries only (a path also by `startswith` with a rule's prefix), and resolver answers are
only ever iterated whole by one `for` whose body carries no state but flags set to a constant
(docs/proofs.md, "Inputs", says why each abstraction is exact and how the evaluator enforces it: any
other operation makes the proof `unknown`). There are no primitives with a second, symbolic
implementation: `within` and `is_token` below are evaluated as written.

Check order and reasons: docs/decision.md. Every reason is a code of `egress_proxy.decision.reasons`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from catalog import CatalogError, SpecialPurposeTable
from compiler.artifact import Connection, Rule, SandboxProfile, Worker
from compiler.constants import BODYLESS_METHODS, METHODS, header_is_denylisted

V4_MAX = (1 << 32) - 1
NAT64_FORM = "nat64"  # the catalog form that a worker's `nat64_prefixes` replace
RFC6052_LENGTHS = (32, 40, 48, 56, 64, 96)
SCHEMES = ("http", "https")
CONNECTION_SCHEMES = ("https",)  # connection traffic carries a credential, so it rides TLS only


# ---------------------------------------------------------------------------------------------
# Intervals and tokens: plain code, evaluated as written by the prover too
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Intervals:
    """A set of integers as aligned blocks `(shift, top)`: the integers `x` with `x >> shift == top`.

    `intervals` builds them from CIDRs, merged and cut into the fewest aligned blocks, in ascending order.
    """

    blocks: tuple[tuple[int, int], ...]


def within(x: int, spans: Intervals) -> bool:
    """Is `x` in one of the blocks?"""
    for shift, top in spans.blocks:
        if x >> shift == top:
            return True
    return False


TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def is_token(name: str) -> bool:
    """Is `name` an HTTP token (RFC 9110 section 5.6.2): one or more tchar?"""
    return name != "" and name.strip(TOKEN_CHARS) == ""


# ---------------------------------------------------------------------------------------------
# Tables: built once per artifact and worker, natively, by the proxy and the prover alike
# ---------------------------------------------------------------------------------------------


def intervals(cidrs: Iterable[str], version: int) -> Intervals:
    """The addresses of the `version` CIDRs among `cidrs` (others ignored) as merged intervals."""
    spans = []
    for cidr in cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        if net.version == version:
            spans.append((int(net.network_address), int(net.broadcast_address)))
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    blocks: list[tuple[int, int]] = []
    for lo, hi in merged:
        while lo <= hi:  # the largest aligned block that starts at `lo` and fits (a table builder: run natively only)
            shift = min((lo & -lo).bit_length() - 1 if lo else 128, (hi - lo + 1).bit_length() - 1)
            blocks.append((shift, lo >> shift))
            lo += 1 << shift
    return Intervals(tuple(blocks))


@dataclass(frozen=True, slots=True)
class Form:
    """One IPv6 form that embeds an IPv4 address: `x & mask == network` (and the marker), then extract.

    The embedded address is the concatenation of `slices` (each `(shift, width)`: bits
    `shift .. shift + width - 1` counted from the least significant bit), xor `xor`.
    `judge_container` false ("embedded only"): the IPv6 address itself is not judged when this form matches.
    """

    name: str
    prefix: str
    network: int
    mask: int
    marker_mask: int  # 0: no interface-id marker
    marker: int
    slices: tuple[tuple[int, int], ...]
    xor: int
    judge_container: bool


def rfc6052_slices(prefixlen: int) -> tuple[tuple[int, int], ...]:
    """RFC 6052 section 2.2: the IPv4 bits follow the prefix and skip bits 64-71 (the "u" octet)."""
    if prefixlen == 96:
        return ((0, 32),)
    before = 64 - prefixlen  # IPv4 bits between the prefix and bit 64
    after = 32 - before  # the rest, from bit 72 on
    out = []
    if before:
        out.append((64, before))
    if after:
        out.append((56 - after, after))
    return tuple(out)


# How the catalog's `unwrap[].ipv4` text reads: (slices, xor, marker mask, marker) or "rfc6052".
# ISATAP (RFC 5214 section 6.1): the interface id is 00-00-5E-FE with the "u" and "g" bits free,
# so the marker is compared with those two bits masked (0000, 0100, 0200 and 0300:5efe).
_EXTRACTIONS: dict[str, object] = {
    "low 32 bits": (((0, 32),), 0, 0, 0),
    "bits 48-63 and 72-87 (RFC 6052 /48 layout)": "rfc6052",
    "bits 16-47": (((80, 32),), 0, 0, 0),
    "low 32 bits xor 0xffffffff": (((0, 32),), V4_MAX, 0, 0),
    "low 32 bits when bits 64-95 are 0000:5efe or 0200:5efe": (((0, 32),), 0, 0xFCFFFFFF, 0x00005EFE),
}


def unwrap_forms(worker: Worker, table: SpecialPurposeTable) -> tuple[Form, ...]:
    """The forms this worker unwraps: the catalog's, its `nat64` entry replaced by the worker's prefixes."""
    forms: list[Form] = []
    for entry in table.unwrap:
        how = _EXTRACTIONS.get(entry.ipv4)
        if how is None:
            raise CatalogError(f"unwrap form `{entry.form}` has an unknown extraction `{entry.ipv4}`")
        container = entry.judge == "container and embedded"
        prefixes = worker.nat64_prefixes if entry.form == NAT64_FORM else (entry.prefix,)
        for prefix in prefixes:
            net = ipaddress.IPv6Network(prefix)
            if entry.form == NAT64_FORM or how == "rfc6052":
                if net.prefixlen not in RFC6052_LENGTHS:
                    raise CatalogError(f"nat64 prefix `{prefix}` is not /32, /40, /48, /56, /64 or /96 (RFC 6052)")
                slices, xor, marker_mask, marker = rfc6052_slices(net.prefixlen), 0, 0, 0
            else:
                slices, xor, marker_mask, marker = how  # type: ignore[misc]
            forms.append(Form(entry.form, net.compressed, int(net.network_address), int(net.netmask),
                              marker_mask, marker, slices, xor, container))
    return tuple(forms)


@dataclass(frozen=True, slots=True)
class WorkerTable:
    """A worker's settings as the core reads them."""

    name: str
    ipv6: bool
    ip_literals: bool
    follow_redirects: bool
    max_redirects: int
    deny4: Intervals
    deny6: Intervals
    allow4: Intervals
    allow6: Intervals
    special4: Intervals
    special6: Intervals
    forms: tuple[Form, ...]


def worker_table(worker: Worker, table: SpecialPurposeTable) -> WorkerTable:
    """Precompute a worker over the catalog's table; ValueError/CatalogError on a malformed setting."""
    special = [r.cidr for r in table.ranges]
    return WorkerTable(
        name=worker.name,
        ipv6=worker.ipv6,
        ip_literals=worker.ip_literals,
        follow_redirects=worker.follow_redirects,
        max_redirects=worker.max_redirects,
        deny4=intervals(worker.deny_cidrs, 4),
        deny6=intervals(worker.deny_cidrs, 6),
        allow4=intervals(worker.allow_cidrs, 4),
        allow6=intervals(worker.allow_cidrs, 6),
        special4=intervals(special, 4),
        special6=intervals(special, 6),
        forms=unwrap_forms(worker, table),
    )


@dataclass(frozen=True, slots=True)
class RuleTable:
    """A rule as the core reads it: prefix canonical (None: invalid, never matches), headers effective."""

    name: str
    host: str
    port: int
    prefix: str | None
    methods: frozenset[str]
    headers: frozenset[str]  # lowercased allowlist minus every denylisted name (the inject header included)
    # Request shapes (docs/shapes.md), as keys: sha256 of what the rule's head shapes (prefix, template, query, header
    # values, git) and its body shape (mcp, graphql, git) judge; "" when it has none. Equal keys judge alike: the
    # prover's free shape inputs are shared by rules with equal keys (`proofs.model.outcome`). The core never reads them.
    head_shape: str = ""
    body_shape: str = ""


@dataclass(frozen=True, slots=True)
class Subject:
    """One connection or sandbox profile, with its worker, as the core reads it.

    A profile's `rules` are the rules of the connections it brokers, in `brokers` order and then rule
    order (the first that admits a request wins), and `owners[i]` is the connection rule `i` belongs to.
    """

    kind: str  # "connection" | "profile"
    name: str
    worker: WorkerTable
    schemes: tuple[str, ...]
    destinations: frozenset[tuple[str, int]]  # the exact (host, port) pairs it may reach
    miss: str  # the reason when (host, port) is not one of them
    rules: tuple[RuleTable, ...]  # artifact order; for a profile, its brokered rules
    inject_header: str | None  # the one header that carries the credential; None for a profile
    owners: tuple[Subject, ...] = ()  # a profile's: the brokered connection of each rule
    observe: bool = False  # a profile in observe mode: a (host, port) outside `destinations` is admitted, `observed_miss`


def shape_keys(rule: Rule) -> tuple[str, str]:
    """(head key, body key) of a rule's request shapes ("" : none); a table builder, run natively only."""
    head = rule.model_dump(include={"path_prefix", "template", "query", "header_values", "git"}, exclude_defaults=True)
    body = rule.model_dump(include={"mcp", "graphql", "git", "max_body"}, exclude_defaults=True)
    keys = []
    for shape, present in ((head, rule.template is not None or rule.query is not None or bool(rule.header_values) or rule.git is not None),
                           (body, rule.mcp is not None or rule.graphql is not None or rule.git is not None)):
        keys.append(hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest() if present else "")
    return keys[0], keys[1]


def connection_subject(conn: Connection, worker: WorkerTable, normalize_prefix) -> Subject:
    """A connection's table; `normalize_prefix` is the shared path normalizer (PathError: never matches)."""
    inject = conn.inject.header
    rules = []
    for rule in conn.rules:
        try:
            prefix: str | None = normalize_prefix(rule.path_prefix)
        except ValueError:
            prefix = None
        headers = frozenset(h.lower() for h in rule.headers if not header_is_denylisted(h, inject, conn.kind))
        rules.append(RuleTable(rule.name, rule.host, rule.port, prefix, frozenset(rule.methods), headers, *shape_keys(rule)))
    return Subject("connection", conn.name, worker, CONNECTION_SCHEMES,
                   frozenset((r.host, r.port) for r in conn.rules), "no-matching-rule", tuple(rules), inject)


def profile_subject(prof: SandboxProfile, worker: WorkerTable, connections: Mapping[str, Subject | None]) -> Subject:
    """A sandbox profile's table: its exact host:port allowlist (none when its network is `none`) and the rules of
    the connections it brokers. `connections` maps a name to that connection's table (None: unusable, and then
    the whole profile is: ValueError). An adversarial profile never brokers, whatever its artifact says; observe mode
    holds only for a trusted profile with a network that brokers nothing (any other is enforced, whatever its artifact
    says), so a request admitted because it is observed never carries a credential."""
    hosts = prof.network.allowed_hosts if prof.network.mode == "allowlist" else ()
    observe = prof.enforce == "observe" and prof.trust == "trusted" and not prof.brokers and prof.network.mode == "allowlist"
    names = prof.brokers if prof.trust == "trusted" else ()
    rules: list[RuleTable] = []
    owners: list[Subject] = []
    for name in names:
        conn = connections.get(name)
        if conn is None:
            raise ValueError(f"brokered connection `{name}` is missing or its worker is unusable")
        rules.extend(conn.rules)
        owners.extend([conn] * len(conn.rules))
    return Subject("profile", prof.name, worker, SCHEMES, frozenset((h.host, h.port) for h in hosts),
                   "profile-host-not-allowed", tuple(rules), None, tuple(owners), observe)


# ---------------------------------------------------------------------------------------------
# Addresses
# ---------------------------------------------------------------------------------------------


def in_form(form: Form, x: int) -> bool:
    """Is the IPv6 address `x` of this form?"""
    return (x & form.mask) == form.network and (form.marker_mask == 0 or ((x >> 32) & form.marker_mask) == form.marker)


def embedded(form: Form, x: int) -> int:
    """The IPv4 address a `form` address embeds."""
    v = 0
    for shift, width in form.slices:
        v = (v << width) | ((x >> shift) & ((1 << width) - 1))
    return v ^ form.xor


def public4(w: WorkerTable, v4: int) -> bool:
    """An IPv4 address is public for `w` when an `allow_cidrs` hole covers it or no table range does."""
    return within(v4, w.allow4) or not within(v4, w.special4)


def judge_address(w: WorkerTable, is6: bool, x: int) -> str:
    """The reason worker `w` refuses to dial this address, or "" when it may (docs/decision.md section 3).

    Precedence: `ipv6-disabled`, then `address-denied` (the address or any IPv4 it embeds is in
    `deny_cidrs`: deny beats allow), then `address-not-public`.
    """
    if not is6:
        if within(x, w.deny4):
            return "address-denied"
        if not public4(w, x):
            return "address-not-public"
        return ""
    if not w.ipv6:
        return "ipv6-disabled"
    if within(x, w.deny6):
        return "address-denied"
    for form in w.forms:
        if in_form(form, x) and within(embedded(form, x), w.deny4):
            return "address-denied"
    container = True
    for form in w.forms:
        if in_form(form, x):
            if not form.judge_container:
                container = False
            if not public4(w, embedded(form, x)):
                return "address-not-public"
    if container and not within(x, w.allow6) and within(x, w.special6):
        return "address-not-public"
    return ""


def answers_verdict(w: WorkerTable, answers: tuple[tuple[bool, bool, int], ...]) -> str:
    """Every resolver answer must be dialable by `w`: the first refusal decides; no answer is `resolve-failed`.

    Each answer is `(valid, is6, x)`: `valid` false for text that is no plain address (`address-invalid`). The
    prover hands this function a list of any length (`proofs.symexec.AnswerList`).
    """
    seen = False
    for valid, is6, x in answers:
        seen = True
        if not valid:
            return "address-invalid"
        reason = judge_address(w, is6, x)
        if reason:
            return reason
    if not seen:
        return "resolve-failed"
    return ""


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class Observation:
    """A request as the core sees it: the adapter's normalized reading of what the caller sent.

    `host_error`/`path_error` are the normalizers' reason codes ("" when none); `host` is the
    normalized host; `is_ip`/`ip6`/`ip` describe an IP-literal host; the booleans are the header
    scan's findings (a header it cannot read, duplicate Host, a CR/LF/NUL inside a header, declared trailers,
    a tunnelled request naming another port than its tunnel's, a Host that disagrees, an upgrade, TE with
    CL or two CL, a body). `path_odd`: a profile's path that is a valid target but has no normalized
    form (`/a/%2e/b`, `//x`): it is plain profile traffic, and no rule ever matches it. `shapes[i]`: the reason rule
    `i`'s head shapes (its path template, query, header values; docs/shapes.md) refuse the request, "" when they admit
    it or the rule has none (the adapter judges them with `egress_proxy.decision.shapes`; the prover takes each as a
    free input, so what it proves holds for any verdict of the shapes). Empty: no rule has a head shape.
    """

    __slots__ = ("scheme", "port", "host_error", "host", "is_ip", "ip6", "ip", "method", "unreadable_headers",
                 "duplicate_host", "field_break", "trailers", "port_mismatch", "host_mismatch", "upgrade", "framing", "body",
                 "path_error", "path", "path_odd", "shapes")

    def __init__(self, scheme: str, port: int, host_error: str, host: str, is_ip: bool = False, ip6: bool = False,
                 ip: int = 0) -> None:
        self.scheme, self.port, self.host_error, self.host = scheme, port, host_error, host
        self.is_ip, self.ip6, self.ip = is_ip, ip6, ip
        self.method = ""
        self.unreadable_headers = self.duplicate_host = self.field_break = self.trailers = self.port_mismatch = False
        self.host_mismatch = self.upgrade = self.framing = self.body = False
        self.path_error = ""
        self.path = "/"
        self.path_odd = False
        self.shapes: tuple[str, ...] = ()


def destination(s: Subject, o: Observation) -> str:
    """The reason `s` may not reach (scheme, host, port) at all, or "" (checks 3-7 of docs/decision.md)."""
    if o.scheme not in s.schemes:
        return "scheme-not-allowed"
    if not 1 <= o.port <= 65535:
        return "port-invalid"
    if o.host_error:
        return o.host_error
    if o.is_ip:
        if not s.worker.ip_literals:
            return "ip-literal-refused"
        reason = judge_address(s.worker, o.ip6, o.ip)
        if reason:
            return reason
    if (o.host, o.port) not in s.destinations and not s.observe:
        return s.miss
    return ""


def observed_miss(s: Subject, o: Observation) -> str:
    """Observe mode: the reason an admitted request would have been denied if its profile were enforced ("": none).
    An annotation for the audit (`would-deny`), never a reason to forward or refuse."""
    if s.observe and (o.host, o.port) not in s.destinations:
        return s.miss
    return ""


def connect_verdict(s: Subject, o: Observation) -> str:
    """The reason `s` may not open a tunnel to (host, port), or "": the bytes after a CONNECT's head are the tunnel's,
    so a declared body or an upgrade on it would be read two ways; then the destination (a non-canonical port
    spelling is read as port -1 by the adapter: `port-invalid`)."""
    if o.body:
        return "body-on-bodyless-method"
    if o.upgrade:
        return "upgrade-denied"
    return destination(s, o)


def segment_prefix(prefix: str | None, path: str) -> bool:
    """Segment-bounded prefix match of a normalized path: `/repos/acme` admits `/repos/acme/x`, never `/repos/acmex`."""
    if prefix is None:
        return False
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def admits(rule: RuleTable, o: Observation) -> bool:
    """Does `rule` admit the request: its exact host and port, one of its methods, the path at or below its prefix?"""
    return rule.host == o.host and rule.port == o.port and o.method in rule.methods and segment_prefix(rule.prefix, o.path)


def head_shape(o: Observation, i: int) -> str:
    """The reason rule `i`'s head shapes refuse the request ("" : they admit it, or it has none)."""
    j = 0
    for reason in o.shapes:  # empty when no rule has a head shape, else one per rule
        if j == i:
            return reason
        j = j + 1
    return ""


def match_rule(s: Subject, o: Observation) -> tuple[str, int]:
    """("", index) of the first rule in artifact order that admits the request (its head shapes included), or the
    reason none does: the first such rule's shape refusal when only shapes refused, else the method or the path."""
    refused = ""
    for i, rule in enumerate(s.rules):
        if admits(rule, o):
            shaped = head_shape(o, i)
            if shaped == "":
                return "", i
            if refused == "":
                refused = shaped
    if refused != "":
        return refused, -1
    for rule in s.rules:
        if rule.host == o.host and rule.port == o.port and segment_prefix(rule.prefix, o.path):
            return "method-not-allowed", -1
    return "path-not-allowed", -1


def request_verdict(s: Subject, o: Observation) -> tuple[str, int]:
    """(reason, rule index) before the address check: ("", i) admits under rule i (-1 for a profile)."""
    reason = destination(s, o)
    if reason:
        return reason, -1
    if o.method not in METHODS:
        return "method-not-allowed", -1
    if o.unreadable_headers:
        return "internal-error", -1
    if o.duplicate_host:
        return "smuggling", -1
    if o.field_break:
        return "smuggling", -1
    if o.trailers:
        return "trailers-denied", -1
    if o.host_mismatch or o.port_mismatch:
        return "host-header-mismatch", -1
    if o.upgrade:
        return "upgrade-denied", -1
    if o.framing:
        return "smuggling", -1
    if o.body and o.method in BODYLESS_METHODS:
        return "body-on-bodyless-method", -1
    if o.path_error:
        return o.path_error, -1
    if s.kind == "profile":
        return "", brokered_rule(s, o)
    return match_rule(s, o)


def brokered_rule(s: Subject, o: Observation) -> int:
    """The first brokered rule that admits a profile's (already admitted) request, or -1: plain profile traffic.

    Brokered traffic is connection traffic: https only, and a path that reads one way.
    """
    if o.scheme not in CONNECTION_SCHEMES or o.path_odd:
        return -1
    for i, rule in enumerate(s.rules):
        if admits(rule, o) and head_shape(o, i) == "":
            return i
    return -1


def forwarded(s: Subject, rule: int, name: str, listed_in_connection: bool) -> bool:
    """May the caller's header `name` (lowercased) travel upstream on a request admitted under `rule`?

    Connection and brokered traffic: only the rule's allowlist, never `authorization` or `proxy-*`.
    Plain profile traffic: every token name that is not denylisted. Neither: a name listed in `Connection`.
    """
    if listed_in_connection:
        return False
    if s.kind == "profile" and rule < 0:
        return is_token(name) and not header_is_denylisted(name)
    allow = s.rules[rule].headers
    return name in allow and name != "authorization" and not name.startswith("proxy-")


def carrier(s: Subject, rule: int) -> Subject | None:
    """The connection whose credential, header allowlist and worker a request admitted under `rule` gets:
    the connection itself, or the one a profile brokers under that rule; None for plain profile traffic."""
    if s.kind == "connection":
        return s
    if rule < 0:
        return None
    return s.owners[rule]


def credential_header(s: Subject, rule: int) -> str | None:
    """The one header the credential rides in (set by the proxy, replacing any caller copy); None: no credential."""
    c = carrier(s, rule)
    if c is None:
        return None
    return c.inject_header


def request_worker(s: Subject, rule: int) -> WorkerTable:
    """The worker that judges the resolver answers of a request admitted under `rule`: its carrier's, else the subject's."""
    c = carrier(s, rule)
    if c is None:
        return s.worker
    return c.worker


def verdict(s: Subject, o: Observation, answers: tuple[tuple[bool, bool, int], ...] | None) -> tuple[str, int, bool]:
    """The whole decision on one request: (reason, rule index, admitted). The request checks (`request_verdict`),
    then every resolver answer judged by the worker of the request's carrier (the subject's when it has none).

    `reason` "" admits the request under rule `rule` (-1: plain profile traffic). `admitted` true: the request
    checks admitted it, so a reason is its answers'. `answers` None skips the address check (`egresslaw explain`
    without `--resolve`, and the proxy before it resolves a name); the proxy forwards only on a verdict with answers.
    """
    reason, rule = request_verdict(s, o)
    if reason:
        return reason, -1, False
    if answers is None:
        return "", rule, True
    return answers_verdict(request_worker(s, rule), answers), rule, True


def mint_verdict(s: Subject, answers: tuple[tuple[bool, bool, int], ...]) -> str:
    """The resolver answers of connection `s`'s token endpoint, judged by `s`'s own worker: the edge's call to mint a
    credential obeys the connection's worker like any request the connection makes ("" : dial the first)."""
    return answers_verdict(s.worker, answers)


def follows_redirect(w: WorkerTable, status: int, hop: int) -> bool:
    """Would worker `w`, as configured, issue request `hop + 1` after answer `status`? (the proxy itself never does)."""
    if not (w.follow_redirects or w.max_redirects > 0):
        return False
    return hop < max(w.max_redirects, 1) and 300 <= status <= 399
