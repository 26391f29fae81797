"""Resolver answers: the adapter between answer text and the core's address judgement (`egress_proxy.decision.core`).

Parses each answer (a zone id or a non-canonical spelling is `address-invalid`), asks
`core.judge_address` for the reason, memoizes it per answer text, and explains a refusal in
words (which CIDR, which embedded form, which table entry). The semantics are the core's;
never `ipaddress.is_global`/`is_private` (wrong for NAT64, 6to4, IPv4-compatible, CGNAT,
`192.0.0.192` and more). docs/decision.md, section "addresses", states them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from catalog import CatalogError, SpecialPurposeTable, load_catalog
from compiler.artifact import Artifact, Worker
from egress_proxy.decision import core
from egress_proxy.decision.reasons import ALLOWED
from egress_proxy.decision.types import Decision

MEMO_MAX = 4096  # judgements kept per worker judge

Judgement = tuple[bool, str, str]


def unwrap_rules(worker: Worker, table: SpecialPurposeTable) -> tuple[core.Form, ...]:
    """The embedded-IPv4 forms this worker unwraps (the core's `unwrap_forms`)."""
    return core.unwrap_forms(worker, table)


class WorkerJudge:
    """The public-only predicate of one worker over one table: the core's tables, built once, judged many times."""

    __slots__ = ("worker", "table", "tables", "_memo")

    def __init__(self, worker: Worker, table: SpecialPurposeTable) -> None:
        self.worker = worker
        self.table = table
        self.tables = core.worker_table(worker, table)
        self._memo: dict[str, Judgement] = {}  # answer text -> judgement (answers repeat: memoize, bounded)

    @property
    def rules(self) -> tuple[core.Form, ...]:
        return self.tables.forms

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
        reason = core.judge_address(self.tables, addr.version == 6, int(addr))
        if not reason:
            return True, "", f"`{ip if type(ip) is str else addr}` is public"
        return False, reason, self.explain(addr, reason)

    def explain(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address, reason: str) -> str:
        """Words for a refusal: the address, what it embeds, and the CIDR or table entry responsible."""
        shown = addr.compressed
        if reason == "ipv6-disabled":
            return f"`{shown}` is an IPv6 answer and the worker has ipv6 = false"
        judged: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, str]] = [(addr, "")]
        if addr.version == 6:
            judged += [(ipaddress.IPv4Address(core.embedded(f, int(addr))), f.name)
                       for f in self.tables.forms if core.in_form(f, int(addr))]
        if reason == "address-denied":
            for inner, form in judged:
                for cidr in self.worker.deny_cidrs:
                    net = ipaddress.ip_network(cidr, strict=False)
                    if net.version == inner.version and inner in net:
                        via = f"embeds `{inner}` ({form}), " if form else "is "
                        return f"`{shown}` {via}in deny_cidrs `{cidr}`"
            return f"`{shown}` is in deny_cidrs"
        for inner, form in reversed(judged) if addr.version == 6 else judged:
            entry = self.table.lookup(inner)
            if entry is not None:
                where = f"{entry.cidr} ({entry.name})"
                return f"`{shown}` embeds `{inner}` ({form}), which is in {where}" if form else f"`{shown}` is in {where}"
        return f"`{shown}` is in the special-purpose table"


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


Answer = tuple[bool, bool, int]  # the core's reading of one answer: (valid, is6, x)
_INVALID: Answer = (False, False, 0)
_ANSWERS: dict[object, Answer] = {}


def answer_of(ip: object) -> Answer:
    """One resolver answer as the core reads it (answers repeat: parsed once per text, bounded)."""
    try:
        hit = _ANSWERS.get(ip)
    except TypeError:  # unhashable: not an address at all
        return _INVALID
    if hit is None:
        addr = parse_address(ip)
        hit = _INVALID if addr is None else (True, addr.version == 6, int(addr))
        if len(_ANSWERS) >= MEMO_MAX:
            _ANSWERS.clear()
        _ANSWERS[ip] = hit
    return hit


def answers_of(ips: Iterable[object]) -> tuple[Answer, ...]:
    """Every resolver answer as the core reads it, in order."""
    return tuple(map(answer_of, ips))


def refusal_detail(judge: WorkerJudge, ips: Iterable[object], reason: str) -> str:
    """Words for the core's refusal of a set of answers: the first answer refused for `reason`, explained."""
    if reason == "resolve-failed":
        return "the name resolved to no address"
    return next((d for _, r, d in (judge.judge(ip) for ip in ips) if r == reason), "")


def first_refusal(judge: WorkerJudge, ips: Iterable[object]) -> tuple[str, str] | None:
    """(reason, detail) of the refusing answer (`core.answers_verdict` decides), `resolve-failed` for none, else None."""
    ips = list(ips)
    reason = core.answers_verdict(judge.tables, answers_of(ips))
    if not reason:
        return None
    return reason, refusal_detail(judge, ips, reason)


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
