"""public-only and deny-cidrs, stated from the RFCs and the catalog's special-purpose table.

An address is `(is6, x)`: `x` a 128-bit vector, an IPv4 address in its low 32 bits. Bits are
numbered as the RFCs draw them, 0 = most significant. Every IPv6 form that carries an IPv4
address is written out here from its RFC, not read from the catalog's `unwrap` entries nor from
`egress_proxy`:

| form | RFC | where the IPv4 address is | the IPv6 address itself |
|---|---|---|---|
| IPv4-mapped `::ffff:0:0/96` | 4291 §2.5.5.2 | bits 96-127 | a handle for the IPv4 address: not judged |
| IPv4-compatible `::/96` | 4291 §2.5.5.1 | bits 96-127 | not judged |
| NAT64 well-known `64:ff9b::/96` | 6052 §2.1 | bits 96-127 | not judged |
| NAT64 local-use `64:ff9b:1::/48` | 8215, layout 6052 §2.2 | bits 48-63, 72-87 | not judged |
| a worker's declared `nat64_prefixes` | 6052 §2.2 (u octet, bits 64-71, skipped) | by prefix length | judged |
| 6to4 `2002::/16` | 3056 §2 | bits 16-47 | judged |
| Teredo `2001:0::/32` | 4380 §4 | bits 96-127, each bit inverted (the client) | judged |
| ISATAP, any prefix | 5214 §6.1 | bits 96-127 when bits 64-95 are `000000ug 00000000 01011110 11111110` (u, g free) | judged |

public(a): `a` is in no range of the table, unless it is a handle form above, and every IPv4
address it carries is in no IPv4 range of the table.
denied(a, worker): `a`, or an IPv4 address it carries, is in the worker's `deny_cidrs`; or `a`
is IPv6 and the worker says `ipv6 = false`.
"""

from __future__ import annotations

import ipaddress

import z3

from catalog import SpecialPurposeTable
from compiler.artifact import Worker

# RFC 6052 section 2.2, figure 1: for each prefix length, the address bits that hold the IPv4 address.
RFC6052_LAYOUT: dict[int, tuple[tuple[int, int], ...]] = {
    32: ((32, 63),),
    40: ((40, 63), (72, 79)),
    48: ((48, 63), (72, 87)),
    56: ((56, 63), (72, 95)),
    64: ((72, 103),),
    96: ((96, 127),),
}
HANDLES = {  # form -> prefix, for the forms whose IPv6 address only names the IPv4 one
    "ipv4-mapped": "::ffff:0:0/96",
    "ipv4-compatible": "::/96",
    "nat64-well-known": "64:ff9b::/96",
    "nat64-local-use": "64:ff9b:1::/48",
}
SIX_TO_FOUR = "2002::/16"
TEREDO = "2001::/32"
ISATAP_IDS = tuple((0x00 | u << 1 | g) << 24 | 0x00005EFE for u in (0, 1) for g in (0, 1))


def bits(x: z3.BitVecRef, first: int, last: int) -> z3.BitVecRef:
    """Bits `first`..`last` of a 128-bit address, numbered from the most significant (bit 0)."""
    return z3.Extract(127 - first, 127 - last, x)


def in_net(x: z3.BitVecRef, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> z3.BoolRef | bool:
    """`x` (32 bits for an IPv4 network, 128 for IPv6) lies in `net`: its top `prefixlen` bits are the network's."""
    width = 32 if net.version == 4 else 128
    if net.prefixlen == 0:
        return True
    top = int(net.network_address) >> (width - net.prefixlen)
    return z3.Extract(width - 1, width - net.prefixlen, x) == z3.BitVecVal(top, net.prefixlen, x.ctx)


def _any(ctx: z3.Context, terms) -> z3.BoolRef:
    terms = [z3.BoolVal(t, ctx) if isinstance(t, bool) else t for t in terms]
    return z3.Or(*terms) if terms else z3.BoolVal(False, ctx)


def networks(cidrs, version: int) -> list:
    """The `version` networks among `cidrs` (ValueError on a malformed one)."""
    return [n for n in (ipaddress.ip_network(c, strict=False) for c in cidrs) if n.version == version]


def carried(x: z3.BitVecRef, nat64_prefixes=()) -> list[tuple[z3.BoolRef | bool, z3.BitVecRef, bool]]:
    """(x is of the form, the 32-bit IPv4 address it carries, the form is a handle) for every form above."""
    ctx = x.ctx
    out = []
    for name, prefix in HANDLES.items():
        net = ipaddress.IPv6Network(prefix)
        layout = RFC6052_LAYOUT[48] if name == "nat64-local-use" else ((96, 127),)
        out.append((in_net(x, net), z3.Concat(*[bits(x, a, b) for a, b in layout]) if len(layout) > 1 else bits(x, *layout[0]), True))
    for prefix in nat64_prefixes:
        net = ipaddress.IPv6Network(prefix)
        layout = RFC6052_LAYOUT.get(net.prefixlen)
        if layout is None:
            continue  # not an RFC 6052 length: the worker cannot use it (the proxy refuses such a worker)
        v4 = z3.Concat(*[bits(x, a, b) for a, b in layout]) if len(layout) > 1 else bits(x, *layout[0])
        out.append((in_net(x, net), v4, False))
    out.append((in_net(x, ipaddress.IPv6Network(SIX_TO_FOUR)), bits(x, 16, 47), False))
    out.append((in_net(x, ipaddress.IPv6Network(TEREDO)), ~bits(x, 96, 127), False))
    iid = bits(x, 64, 95)
    out.append((_any(ctx, [iid == z3.BitVecVal(m, 32, ctx) for m in ISATAP_IDS]), bits(x, 96, 127), False))
    return out


# Both statements of a worker, built once per process over placeholder variables in a private context
# (hundreds of range tests), then translated into each question's context and instantiated.
_BUILT: dict[tuple, tuple[z3.Context, z3.BoolRef, z3.BitVecRef, z3.BoolRef, z3.BoolRef, SpecialPurposeTable]] = {}


class AddressSpec:
    """public(a) and denied(a) for one worker, over the catalog's table."""

    def __init__(self, ctx: z3.Context, table: SpecialPurposeTable, worker: Worker) -> None:
        self.ctx = ctx
        self.worker = worker
        self.deny4 = networks(worker.deny_cidrs, 4)  # ValueError here for a malformed CIDR
        self.deny6 = networks(worker.deny_cidrs, 6)
        key = (worker, id(table))
        built = _BUILT.get(key)
        if built is None or built[5] is not table:
            tctx = z3.Context()
            t6, tx = z3.Bool("spec_is6", tctx), z3.BitVec("spec_x", 128, tctx)
            statements = _Statements(tctx, table, worker, self.deny4, self.deny6)
            built = _BUILT[key] = (tctx, t6, tx, statements.public(t6, tx), statements.denied(t6, tx), table)
        _, t6, tx, public, denied, _ = built
        self._vars = (t6.translate(ctx), tx.translate(ctx))
        self._public, self._denied = public.translate(ctx), denied.translate(ctx)

    def public(self, is6: z3.BoolRef, x: z3.BitVecRef) -> z3.BoolRef:
        """`(is6, x)` is public per the table and every IPv4 address it carries."""
        return z3.substitute(self._public, (self._vars[0], is6), (self._vars[1], x))

    def denied(self, is6: z3.BoolRef, x: z3.BitVecRef) -> z3.BoolRef:
        """`(is6, x)` is excluded by the worker's deny_cidrs (itself or what it carries) or its ipv6 switch."""
        return z3.substitute(self._denied, (self._vars[0], is6), (self._vars[1], x))


class _Statements:
    def __init__(self, ctx: z3.Context, table: SpecialPurposeTable, worker: Worker, deny4, deny6) -> None:
        self.ctx = ctx
        self.worker = worker
        self.special4 = [ipaddress.ip_network(r.cidr) for r in table.ranges if ipaddress.ip_network(r.cidr).version == 4]
        self.special6 = [ipaddress.ip_network(r.cidr) for r in table.ranges if ipaddress.ip_network(r.cidr).version == 6]
        self.deny4, self.deny6 = deny4, deny6

    def public4(self, v4: z3.BitVecRef) -> z3.BoolRef:
        return z3.Not(_any(self.ctx, [in_net(v4, n) for n in self.special4]))

    def public(self, is6: z3.BoolRef, x: z3.BitVecRef) -> z3.BoolRef:
        forms = carried(x, self.worker.nat64_prefixes)
        handle = _any(self.ctx, [m for m, _, is_handle in forms if is_handle])
        container = z3.Or(handle, z3.Not(_any(self.ctx, [in_net(x, n) for n in self.special6])))
        inside = z3.And([z3.Implies(m, self.public4(v4)) if not isinstance(m, bool) else self.public4(v4)
                         for m, v4, _ in forms if m is not False])
        return z3.If(is6, z3.And(container, inside), self.public4(z3.Extract(31, 0, x)))

    def denied(self, is6: z3.BoolRef, x: z3.BitVecRef) -> z3.BoolRef:
        forms = carried(x, self.worker.nat64_prefixes)
        deny4 = lambda v: _any(self.ctx, [in_net(v, n) for n in self.deny4])  # noqa: E731
        v6 = z3.Or(z3.BoolVal(not self.worker.ipv6, self.ctx), _any(self.ctx, [in_net(x, n) for n in self.deny6]),
                   _any(self.ctx, [z3.And(m, deny4(v4)) if not isinstance(m, bool) else deny4(v4) for m, v4, _ in forms]))
        return z3.If(is6, v6, deny4(z3.Extract(31, 0, x)))
