"""The public-only predicate: is a resolved address one a worker may dial? Judged over the catalog's table.

Never `ipaddress.is_global`/`is_private`: they are wrong for NAT64, 6to4, IPv4-compatible, CGNAT,
`192.0.0.192` and more. The definition is the catalog's special-purpose table plus its `unwrap`
forms, with the worker's `deny_cidrs`, `allow_cidrs`, `ipv6` and `nat64_prefixes`. The exact
semantics (which the prover encodes) are in docs/decision.md, section "addresses".
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from catalog import CatalogError, SpecialPurposeTable, load_catalog
from compiler.artifact import Artifact, Worker
from egress_proxy.reasons import ALLOWED
from egress_proxy.types import Decision

V4_MAX = (1 << 32) - 1
V6_MAX = (1 << 128) - 1
IID_MASK = ((1 << 32) - 1) << 32  # bits 64-95 of an IPv6 address (MSB = bit 0)
ISATAP_MARKERS = (0x00005EFE << 32, 0x02005EFE << 32)
MEMO_MAX = 4096  # judgements kept per worker judge
NAT64_FORM = "nat64"  # the catalog form that the worker's `nat64_prefixes` replace
RFC6052_LENGTHS = (32, 40, 48, 56, 64, 96)

# How the catalog's `unwrap[].ipv4` text maps to an extraction. An unknown text fails closed at load.
Extraction = Literal["low32", "rfc6052", "6to4", "teredo", "isatap"]
_EXTRACTIONS: dict[str, Extraction] = {
    "low 32 bits": "low32",
    "bits 48-63 and 72-87 (RFC 6052 /48 layout)": "rfc6052",
    "bits 16-47": "6to4",
    "low 32 bits xor 0xffffffff": "teredo",
    "low 32 bits when bits 64-95 are 0000:5efe or 0200:5efe": "isatap",
}

Judgement = tuple[bool, str, str]


@dataclass(frozen=True, slots=True)
class UnwrapRule:
    """One IPv6 form that embeds an IPv4 address: match `addr & mask == network`, then extract.

    `judge_container` false ("embedded only"): the IPv6 address itself is not judged against the
    table when this form matches; true ("container and embedded"): both are judged.
    """

    form: str
    prefix: str
    network: int
    mask: int
    prefixlen: int
    extraction: Extraction
    judge_container: bool

    def embedded(self, x: int) -> int | None:
        """The embedded IPv4 as an int, or None when `x` is not in this form."""
        if x & self.mask != self.network:
            return None
        return extract(self.extraction, self.prefixlen, x)


def extract(kind: Extraction, prefixlen: int, x: int) -> int | None:
    """Extract the embedded IPv4 from the 128-bit `x` (bit 0 = most significant), or None (isatap marker absent)."""
    if kind == "low32":
        return x & V4_MAX
    if kind == "teredo":
        return (x & V4_MAX) ^ V4_MAX
    if kind == "6to4":
        return (x >> 80) & V4_MAX
    if kind == "isatap":
        return x & V4_MAX if (x & IID_MASK) in ISATAP_MARKERS else None
    # RFC 6052 section 2.2: the IPv4 bits follow the prefix and skip bits 64-71 (the "u" octet).
    if prefixlen == 96:
        return x & V4_MAX
    stream = ((x >> 64) << 56) | (x & ((1 << 56) - 1))  # 120 bits: the address without bits 64-71
    return (stream >> (120 - prefixlen - 32)) & V4_MAX


def unwrap_rules(worker: Worker, table: SpecialPurposeTable) -> tuple[UnwrapRule, ...]:
    """The unwrap forms this worker applies: the catalog's, with its `nat64` entry replaced by the worker's prefixes."""
    rules: list[UnwrapRule] = []
    for form in table.unwrap:
        kind = _EXTRACTIONS.get(form.ipv4)
        if kind is None:
            raise CatalogError(f"unwrap form `{form.form}` has an unknown extraction `{form.ipv4}`")
        container = form.judge == "container and embedded"
        if form.form == NAT64_FORM:
            for prefix in worker.nat64_prefixes:
                rules.append(_rule(NAT64_FORM, prefix, "rfc6052", container))
            continue
        rules.append(_rule(form.form, form.prefix, kind, container))
    return tuple(rules)


def _rule(form: str, prefix: str, kind: Extraction, container: bool) -> UnwrapRule:
    net = ipaddress.IPv6Network(prefix)
    if kind == "rfc6052" and net.prefixlen not in RFC6052_LENGTHS:
        raise CatalogError(f"nat64 prefix `{prefix}` is not /32, /40, /48, /56, /64 or /96 (RFC 6052)")
    return UnwrapRule(
        form=form,
        prefix=net.compressed,
        network=int(net.network_address),
        mask=int(net.netmask),
        prefixlen=net.prefixlen,
        extraction=kind,
        judge_container=container,
    )


def _intervals(cidrs: Iterable[str], version: int) -> tuple[tuple[int, int, str], ...]:
    out = []
    for cidr in cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        if net.version == version:
            out.append((int(net.network_address), int(net.broadcast_address), net.compressed))
    return tuple(out)


def _merged(intervals: Iterable[tuple[int, int, str]]) -> tuple[list[int], list[int]]:
    starts: list[int] = []
    ends: list[int] = []
    for lo, hi, _ in sorted(intervals):
        if ends and lo <= ends[-1] + 1:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def _within(intervals: tuple[tuple[int, int, str], ...], x: int) -> str | None:
    for lo, hi, cidr in intervals:
        if lo <= x <= hi:
            return cidr
    return None


class WorkerJudge:
    """The public-only predicate of one worker over one table, precomputed (build once, judge many)."""

    __slots__ = ("worker", "table", "rules", "_deny4", "_deny6", "_allow4", "_allow6", "_special", "_memo")

    def __init__(self, worker: Worker, table: SpecialPurposeTable) -> None:
        self.worker = worker
        self.table = table
        self.rules = unwrap_rules(worker, table)
        self._deny4 = _intervals(worker.deny_cidrs, 4)
        self._deny6 = _intervals(worker.deny_cidrs, 6)
        self._allow4 = _intervals(worker.allow_cidrs, 4)
        self._allow6 = _intervals(worker.allow_cidrs, 6)
        self._special = {
            v: _merged((int(r.network.network_address), int(r.network.broadcast_address), r.cidr)
                       for r in table.ranges if r.network.version == v)
            for v in (4, 6)
        }
        self._memo: dict[str, Judgement] = {}  # answer text -> judgement (answers repeat: memoize, bounded)

    def _special_hit(self, version: int, x: int) -> bool:
        starts, ends = self._special[version]
        i = bisect.bisect_right(starts, x) - 1
        return i >= 0 and x <= ends[i]

    def judge(self, ip: object) -> Judgement:
        """(public, reason, detail) for one resolved address; reason is "" when public."""
        if type(ip) is str:
            hit = self._memo.get(ip)
            if hit is None:
                if len(self._memo) >= MEMO_MAX:
                    self._memo.clear()
                hit = self._memo[ip] = self._judge(ip)
            return hit
        return self._judge(ip)

    def _judge(self, ip: object) -> Judgement:
        addr = parse_address(ip)
        if addr is None:
            return False, "address-invalid", f"`{_show(ip)}` is not a plain IPv4 or IPv6 address"
        x = int(addr)
        if addr.version == 4:
            judged = [(4, x, "")]
            cidr = _within(self._deny4, x)
            if cidr is not None:
                return False, "address-denied", f"`{addr}` is in deny_cidrs `{cidr}`"
        else:
            if not self.worker.ipv6:
                return False, "ipv6-disabled", f"`{addr.compressed}` is an IPv6 answer and the worker has ipv6 = false"
            cidr = _within(self._deny6, x)
            if cidr is not None:
                return False, "address-denied", f"`{addr.compressed}` is in deny_cidrs `{cidr}`"
            judged = []
            container = True
            for rule in self.rules:
                v4 = rule.embedded(x)
                if v4 is None:
                    continue
                container = container and rule.judge_container
                cidr = _within(self._deny4, v4)
                if cidr is not None:
                    return False, "address-denied", (
                        f"`{addr.compressed}` embeds `{ipaddress.IPv4Address(v4)}` ({rule.form}), in deny_cidrs `{cidr}`"
                    )
                judged.append((4, v4, rule.form))
            if container:
                judged.insert(0, (6, x, ""))
        for version, value, form in judged:
            allow = self._allow4 if version == 4 else self._allow6
            if _within(allow, value) is not None:
                continue
            if self._special_hit(version, value):
                return False, "address-not-public", self._explain(addr, version, value, form)
        return True, "", f"`{ip if type(ip) is str else addr}` is public"

    def _explain(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address, version: int, value: int, form: str) -> str:
        inner = ipaddress.IPv4Address(value) if version == 4 else ipaddress.IPv6Address(value)
        entry = self.table.lookup(inner)
        where = f"{entry.cidr} ({entry.name})" if entry is not None else "the special-purpose table"
        if form:
            return f"`{addr.compressed}` embeds `{inner}` ({form}), which is in {where}"
        return f"`{addr.compressed}` is in {where}"


def parse_address(ip: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A plain address from a string or ipaddress object; None for anything else (zone ids included)."""
    if isinstance(ip, (ipaddress.IPv4Address, ipaddress.IPv6Address)):
        addr = ip
    elif isinstance(ip, str):
        try:
            addr = ipaddress.IPv6Address(ip) if ":" in ip else ipaddress.IPv4Address(ip)
        except ValueError:
            return None
    else:
        return None
    if addr.version == 6 and addr.scope_id is not None:
        return None
    return addr


_JUDGES: dict[tuple[Worker, int], WorkerJudge] = {}
_JUDGES_MAX = 256


def worker_judge(worker: Worker, table: SpecialPurposeTable) -> WorkerJudge:
    """The cached WorkerJudge for (worker, table)."""
    key = (worker, id(table))
    judge = _JUDGES.get(key)
    # INVARIANT: the cached judge holds `table`, so its id cannot be reused while the entry lives.
    if judge is None or judge.table is not table:
        if len(_JUDGES) >= _JUDGES_MAX:
            _JUDGES.clear()
        judge = _JUDGES[key] = WorkerJudge(worker, table)
    return judge


def judge_ip(ip: object, worker: Worker, table: SpecialPurposeTable) -> Judgement:
    """(public, reason, detail) for one address under `worker`'s settings; reason is "" when public."""
    return worker_judge(worker, table).judge(ip)


def first_refusal(judge: WorkerJudge, ips: Iterable[object]) -> tuple[str, str] | None:
    """(reason, detail) of the first answer that is not public, `resolve-failed` for no answers, else None."""
    count = 0
    for ip in ips:
        count += 1
        public, reason, detail = judge.judge(ip)
        if not public:
            return reason, detail
    if count == 0:
        return "resolve-failed", "the name resolved to no address"
    return None


def judge_all(judge: WorkerJudge, ips: Iterable[object]) -> Decision:
    """Every answer must be public: the first one that is not refuses the name; no answers -> resolve-failed."""
    refusal = first_refusal(judge, ips)
    if refusal is not None:
        return Decision(allowed=False, reason=refusal[0], detail=refusal[1])
    return Decision(allowed=True, reason=ALLOWED)


def judge_ips(artifact: Artifact, worker_name: str, ips: Iterable[object]) -> Decision:
    """Judge every resolved answer with the named worker of `artifact` (allowed only when all are public)."""
    # Not artifact.worker(): its cached lookup survives model_copy(update=...) and could be stale.
    worker = next((w for w in artifact.workers if w.name == worker_name), None)
    if worker is None:
        return Decision(allowed=False, reason="worker-unknown", detail=f"worker `{_show(worker_name)}` is not in the artifact")
    try:
        table = load_catalog(artifact.catalog.version).special_purpose
    except CatalogError as exc:
        return Decision(allowed=False, reason="internal-error", detail=str(exc))
    try:
        judge = worker_judge(worker, table)
    except (ValueError, CatalogError):  # a malformed CIDR or NAT64 prefix: fail closed, as decide() does
        return Decision(allowed=False, reason="worker-unknown", detail=f"worker `{_show(worker_name)}` has malformed settings")
    return judge_all(judge, ips)


def _show(value: object) -> str:
    shown = str(value).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 80 else shown[:77] + "..."
