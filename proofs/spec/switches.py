"""worker-switches, stated from the worker's settings as declared (SPEC section 3) and `proofs/spec/addresses.py`.

The request's own host, when it is an IP literal, is an address the proxy dials without asking DNS, so every switch
of the worker that judges the request holds for it as for a resolver answer: with `ip_literals = false` no literal is
admitted at all; otherwise the literal is public per the catalog's table (an `allow_cidrs` hole counts as a
violation, as in public-only), neither it nor an IPv4 address it carries is in `deny_cidrs`, and with `ipv6 = false`
it is IPv4. Stated for every subject, a profile in observe mode included (observe mode widens the hosts a profile
may reach, never the worker's switches). The resolver answers are public-only's and deny-cidrs'.
"""

from __future__ import annotations

from typing import Any

import z3

from compiler.artifact import Worker
from proofs.spec.addresses import AddressSpec


def literal_refused(spec: AddressSpec, worker: Worker, is_ip: Any, ip6: Any, ip: Any) -> z3.BoolRef:
    """The request names an IP-literal host `(ip6, ip)` that `worker`'s switches refuse (`spec` is that worker's)."""
    ctx = spec.ctx
    is_ip, ip6 = _bool(is_ip, ctx), _bool(ip6, ctx)
    if not worker.ip_literals:
        return is_ip
    return z3.And(is_ip, z3.Or(z3.Not(spec.public(ip6, ip)), spec.denied(ip6, ip)))


def _bool(v: Any, ctx: z3.Context) -> z3.BoolRef:
    return v if isinstance(v, z3.BoolRef) else z3.BoolVal(bool(v), ctx)
