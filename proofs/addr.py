"""Z3 encoding of the public-only predicate (`egress_proxy.addresses.WorkerJudge.judge`) over symbolic addresses.

An address is a pair (is6: Bool, x: BitVec 128). An IPv4 address lives in the low 32 bits with the
high 96 bits zero. Ranges are encoded as "the top `prefixlen` bits equal the network's", which is
exact for CIDRs; no signed comparison is used anywhere (there is no `<` on bit-vectors here).
The unwrap forms are read from the same data the implementation uses (`unwrap_rules`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import z3

from catalog import SpecialPurposeTable
from compiler.artifact import Worker
from egress_proxy.addresses import ISATAP_MARKERS, V4_MAX, UnwrapRule, unwrap_rules

# Reason codes of an address judgement, in the order the implementation checks them.
R_OK, R_DISABLED, R_DENIED, R_NOT_PUBLIC = 0, 1, 2, 3
ADDRESS_REASONS = {R_OK: "", R_DISABLED: "ipv6-disabled", R_DENIED: "address-denied", R_NOT_PUBLIC: "address-not-public"}


_TEMPLATES: dict = {}


@dataclass(frozen=True)
class Addr:
    """A symbolic resolved address."""

    is6: z3.BoolRef
    x: z3.BitVecRef  # 128 bits; for IPv4 only the low 32 are used

    @property
    def v4(self) -> z3.BitVecRef:
        return z3.Extract(31, 0, self.x)


def fresh_addr(ctx: z3.Context, name: str = "ip") -> tuple[Addr, z3.BoolRef]:
    """A fresh address and its well-formedness constraint (an IPv4 address has its high 96 bits zero)."""
    a = Addr(z3.Bool(f"{name}_is6", ctx), z3.BitVec(f"{name}_x", 128, ctx))
    wf = z3.Or(a.is6, z3.Extract(127, 32, a.x) == z3.BitVecVal(0, 96, ctx), ctx)
    return a, wf


def concrete_addr(ctx: z3.Context, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Addr:
    return Addr(z3.BoolVal(ip.version == 6, ctx), z3.BitVecVal(int(ip), 128, ctx))


def decode_addr(model: z3.ModelRef, a: Addr) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The concrete address a model assigns."""
    is6 = z3.is_true(model.eval(a.is6, model_completion=True))
    x = model.eval(a.x, model_completion=True).as_long()
    return ipaddress.IPv6Address(x) if is6 else ipaddress.IPv4Address(x & V4_MAX)


def in_net(bits: z3.BitVecRef, width: int, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> z3.BoolRef:
    """`bits` (a `width`-bit vector) lies in `net` (same width): top prefixlen bits equal."""
    ctx = bits.ctx
    plen = net.prefixlen
    if plen == 0:
        return z3.BoolVal(True, ctx)
    top = int(net.network_address) >> (width - plen)
    return z3.Extract(width - 1, width - plen, bits) == z3.BitVecVal(top, plen, ctx)


def _any(ctx: z3.Context, terms: list[z3.BoolRef]) -> z3.BoolRef:
    if not terms:
        return z3.BoolVal(False, ctx)
    return terms[0] if len(terms) == 1 else z3.Or(*terms)


def _nets(cidrs, version: int):
    out = []
    for c in cidrs:
        net = ipaddress.ip_network(c, strict=False)
        if net.version == version:
            out.append(net)
    return out


def _embedded(rule: UnwrapRule, x: z3.BitVecRef) -> tuple[z3.BoolRef, z3.BitVecRef]:
    """(matches, embedded IPv4) for one unwrap rule, mirroring `egress_proxy.addresses.extract`."""
    ctx = x.ctx
    net = ipaddress.IPv6Network((rule.network, rule.prefixlen))
    match = in_net(x, 128, net)
    kind = rule.extraction
    if kind == "low32" or (kind == "rfc6052" and rule.prefixlen == 96):
        v4 = z3.Extract(31, 0, x)
    elif kind == "teredo":
        v4 = ~z3.Extract(31, 0, x)
    elif kind == "6to4":
        v4 = z3.Extract(111, 80, x)
    elif kind == "isatap":
        v4 = z3.Extract(31, 0, x)
        iid = z3.Extract(63, 32, x)
        match = z3.And(match, z3.Or(*[iid == z3.BitVecVal(m >> 32, 32, ctx) for m in ISATAP_MARKERS]))
    elif kind == "rfc6052":
        stream = z3.Concat(z3.Extract(127, 64, x), z3.Extract(55, 0, x))  # 120 bits, the u octet dropped
        lo = 120 - rule.prefixlen - 32
        v4 = z3.Extract(lo + 31, lo, stream)
    else:  # pragma: no cover - unwrap_rules refuses unknown extractions
        raise ValueError(f"unknown extraction `{kind}`")
    return match, v4


def spec_worker(worker: Worker, table: SpecialPurposeTable) -> Worker:
    """The worker the public-only property is stated against: the catalog's table and unwrap forms only.

    No `allow_cidrs` holes, no extra `deny_cidrs`, IPv6 on, and the catalog's own NAT64 prefix instead of
    the worker's `nat64_prefixes`: a worker prefix inside special-purpose space (say `fd00::/96`) makes
    addresses there reachable, which is a hole like an `allow_cidrs` entry and is refuted as one.
    """
    catalog_nat64 = tuple(f.prefix for f in table.unwrap if f.form == "nat64") or worker.nat64_prefixes
    return worker.model_copy(update={"allow_cidrs": (), "deny_cidrs": (), "ipv6": True, "nat64_prefixes": catalog_nat64})


class AddressModel:
    """The judge of one worker as Z3 terms: `public(a)` and `reason(a)` mirror `WorkerJudge.judge`."""

    def __init__(self, ctx: z3.Context, worker: Worker, table: SpecialPurposeTable, *, holes: bool = True,
                 denies: bool = True, v6_switch: bool = True) -> None:
        self.ctx = ctx
        self.worker = worker
        self.table = table
        self.rules = unwrap_rules(worker, table)
        self.special4 = [r.network for r in table.ranges if r.network.version == 4]
        self.special6 = [r.network for r in table.ranges if r.network.version == 6]
        self.deny4 = _nets(worker.deny_cidrs, 4) if denies else []
        self.deny6 = _nets(worker.deny_cidrs, 6) if denies else []
        self.allow4 = _nets(worker.allow_cidrs, 4) if holes else []
        self.allow6 = _nets(worker.allow_cidrs, 6) if holes else []
        self.ipv6 = worker.ipv6 if v6_switch else True
        self._parts: dict[tuple[int, int], tuple[z3.BoolRef, z3.BoolRef, z3.BoolRef]] = {}
        self._spec: AddressModel | None = None

    def spec(self) -> AddressModel:
        """The catalog-only predicate the property is stated against: same unwrap forms, no holes, no extra denies."""
        if self._spec is None:
            self._spec = AddressModel(self.ctx, spec_worker(self.worker, self.table), self.table, holes=False,
                                      denies=False, v6_switch=False)
        return self._spec

    def _judged4(self, v4: z3.BitVecRef) -> z3.BoolRef:
        ok = z3.Not(_any(self.ctx, [in_net(v4, 32, n) for n in self.special4]))
        return z3.Or(_any(self.ctx, [in_net(v4, 32, n) for n in self.allow4]), ok)

    def _deny4(self, v4: z3.BitVecRef) -> z3.BoolRef:
        return _any(self.ctx, [in_net(v4, 32, n) for n in self.deny4])

    def parts(self, a: Addr) -> tuple[z3.BoolRef, z3.BoolRef, z3.BoolRef]:
        """(disabled, denied, not_public) as independent conditions; reason precedence is in that order."""
        key = (a.is6.get_id(), a.x.get_id())
        if key not in self._parts:
            tvars, tparts = self._template()
            is6, x = (v.translate(self.ctx) for v in tvars)
            terms = [t.translate(self.ctx) for t in tparts]
            self._parts[key] = tuple(z3.substitute(t, (is6, a.is6), (x, a.x)) for t in terms)  # type: ignore[assignment]
        return self._parts[key]

    def _template(self):
        """The three terms over template variables, built once per process in a private context and translated.

        Building the terms is the expensive part (hundreds of range tests); translating and substituting is
        done inside Z3, so every subject of a worker pays for it once per process, not once per check.
        """
        key = (self.worker, id(self.table), bool(self.allow4 or self.allow6), bool(self.deny4 or self.deny6), self.ipv6)
        cached = _TEMPLATES.get(key)
        if cached is None or cached[0] is not self.table:
            tctx = z3.Context()
            clone = AddressModel.__new__(AddressModel)
            clone.__dict__.update(self.__dict__)
            clone.ctx = tctx
            a, _ = fresh_addr(tctx, "tmpl")
            parts = clone._build_parts(a)
            cached = _TEMPLATES[key] = (self.table, tctx, (a.is6, a.x), parts)
        return cached[2], cached[3]

    def _build_parts(self, a: Addr) -> tuple[z3.BoolRef, z3.BoolRef, z3.BoolRef]:
        ctx = self.ctx
        x = a.x
        v4 = a.v4
        forms = [_embedded(r, x) for r in self.rules]
        container = z3.And([z3.Not(m) for (m, _), r in zip(forms, self.rules) if not r.judge_container] or
                           [z3.BoolVal(True, ctx)])
        deny6 = _any(ctx, [in_net(x, 128, n) for n in self.deny6])
        disabled = z3.And(a.is6, z3.BoolVal(not self.ipv6, ctx))
        denied = z3.If(
            a.is6,
            z3.Or(deny6, _any(ctx, [z3.And(m, self._deny4(e)) for m, e in forms])),
            self._deny4(v4),
        )
        allow6 = _any(ctx, [in_net(x, 128, n) for n in self.allow6])
        special6 = _any(ctx, [in_net(x, 128, n) for n in self.special6])
        v6_bad = z3.Or(
            z3.And(container, z3.Not(allow6), special6),
            _any(ctx, [z3.And(m, z3.Not(self._judged4(e))) for m, e in forms]),
        )
        not_public = z3.If(a.is6, v6_bad, z3.Not(self._judged4(v4)))
        return disabled, denied, not_public

    def public(self, a: Addr) -> z3.BoolRef:
        disabled, denied, not_public = self.parts(a)
        return z3.And(z3.Not(disabled), z3.Not(denied), z3.Not(not_public))

    def reason(self, a: Addr) -> z3.ArithRef:
        """The reason code (R_*) of the judgement as an integer term."""
        disabled, denied, not_public = self.parts(a)
        iv = lambda v: z3.IntVal(v, self.ctx)  # noqa: E731
        return z3.If(disabled, iv(R_DISABLED), z3.If(denied, iv(R_DENIED), z3.If(not_public, iv(R_NOT_PUBLIC), iv(R_OK))))

    def responsible_allow(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[str]:
        """The allow_cidrs that contain `ip` or an IPv4 address embedded in it (for counterexample text)."""
        found = []
        candidates = [ip]
        if ip.version == 6:
            for r in self.rules:
                v4 = r.embedded(int(ip))
                if v4 is not None:
                    candidates.append(ipaddress.IPv4Address(v4))
        for c in self.worker.allow_cidrs:
            net = ipaddress.ip_network(c, strict=False)
            if any(cand.version == net.version and cand in net for cand in candidates):
                found.append(c)
        return found
