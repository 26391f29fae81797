"""Ask Z3 one question with fixed seeds under a deterministic budget: `sat` with a model, `unsat`, or `unknown`.

The budget is Z3's `rlimit` (a count of solver steps, the same on every machine and under any load),
given to every solver call afresh: the limit is relative to the context's count when the call starts,
so a call's budget does not depend on what was asked before it. The wall clock (`timeout_ms`) is only
an outer safety bound, far above what any shipped check needs; a check it stops says so
(`wall-clock limit`), never mistaken for an exhausted `rlimit`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import z3

DEFAULT_TIMEOUT_MS = 600_000  # the wall-clock safety bound per solver call: 10 minutes
DEFAULT_RLIMIT = 50_000_000  # per solver call; the shipped demo's costliest call uses ~1/40 of it (docs/proofs.md)
SEED = 0
WALL_REASONS = ("timeout", "canceled")  # the timer cancels the call; an exhausted rlimit also reads `canceled`


@dataclass(frozen=True)
class Limits:
    timeout_ms: int = DEFAULT_TIMEOUT_MS  # wall-clock safety bound, not the budget
    rlimit: int = DEFAULT_RLIMIT  # the deterministic budget; 0: none

    def budget(self) -> dict[str, int | str]:
        """What the report records so two machines can compare runs."""
        return {"rlimit": self.rlimit, "rlimit_scope": "solver call", "wall_clock_ms": self.timeout_ms, "seed": SEED}


@dataclass(frozen=True)
class Outcome:
    status: str  # "sat" | "unsat" | "unknown"
    model: z3.ModelRef | None = None
    reason: str = ""
    rlimit_used: int = 0  # solver steps the costlier call consumed (deterministic)


def make_solver(ctx: z3.Context, limits: Limits, strings: bool = False) -> z3.Solver:
    """A solver with fixed seed, timeout and rlimit. Bit-vector questions go straight to bit-blasting and SAT
    (measured 2x faster than the default portfolio); questions over header names need the general solver."""
    s = z3.Solver(ctx=ctx) if strings else z3.Then("simplify", "propagate-values", "solve-eqs", "bit-blast", "sat", ctx=ctx).solver()
    s.set("random_seed", SEED)
    s.set("timeout", max(1, int(limits.timeout_ms)))
    if limits.rlimit > 0:
        s.set("rlimit", int(limits.rlimit))
    return s


def rlimit_count(s: z3.Solver) -> int:
    """The context's cumulative step count (Z3 keeps one per context, across solvers)."""
    stats = s.statistics()
    return int(stats.get_key_value("rlimit count")) if "rlimit count" in stats.keys() else 0


def why_unknown(reason: str, used: int, elapsed_ms: float, limits: Limits) -> str:
    """Which limit stopped the call: the rlimit (deterministic) or the wall clock (load-dependent), else Z3's reason."""
    if limits.rlimit > 0 and (used >= limits.rlimit or reason == "max. resource limit exceeded"):
        return f"rlimit exhausted (budget {limits.rlimit:,})"
    if reason in WALL_REASONS or elapsed_ms >= limits.timeout_ms:
        return f"wall-clock limit ({limits.timeout_ms / 1000:g} s)"
    return reason or "unknown"


def check(ctx: z3.Context, assertions: list, limits: Limits, prefer: list | None = None, strings: bool = False) -> Outcome:
    """Solve `assertions`; on `sat`, also try to satisfy `prefer` (readability only) and keep that model if so."""
    s = make_solver(ctx, limits, strings)
    s.add(*assertions)
    before, start = rlimit_count(s), time.perf_counter()
    result = s.check()
    used = rlimit_count(s) - before
    if result == z3.unsat:
        return Outcome("unsat", rlimit_used=used)
    if result == z3.unknown:
        return Outcome("unknown", reason=why_unknown(s.reason_unknown(), used, (time.perf_counter() - start) * 1000, limits),
                       rlimit_used=used)
    model = s.model()
    if prefer:
        s.push()
        s.add(*prefer)
        middle = rlimit_count(s)
        if s.check() == z3.sat:
            model = s.model()
        s.pop()
        used = max(used, rlimit_count(s) - middle)
    return Outcome("sat", model, rlimit_used=used)
