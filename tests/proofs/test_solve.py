"""The budget: Z3's rlimit, deterministic and given to each solver call afresh; the wall clock only a safety bound,
and which of the two stopped a call is said, never confused."""

from __future__ import annotations

import z3

import proofs.properties as properties
from egresslaw.commands import prove as prove_command
from proofs.runner import prove
from proofs.solve import DEFAULT_RLIMIT, DEFAULT_TIMEOUT_MS, Limits, check
from tests.proofs.helpers import demo_artifact


def _factor(ctx: z3.Context) -> list:
    """Factor a product of two primes: minutes for bit-blasting, so some limit always stops it first."""
    x, y = z3.BitVec("x", 64, ctx), z3.BitVec("y", 64, ctx)
    return [x * y == 1_000_000_007 * 998_244_353, z3.ULT(1, x), z3.ULT(x, y), z3.ULT(y, 2**32)]


def test_an_exhausted_rlimit_and_the_wall_clock_are_told_apart():
    ctx = z3.Context()
    out = check(ctx, _factor(ctx), Limits(timeout_ms=600_000, rlimit=200_000))
    assert (out.status, out.reason) == ("unknown", "rlimit exhausted (budget 200,000)")
    assert out.rlimit_used >= 200_000
    out = check(ctx, _factor(ctx), Limits(timeout_ms=200, rlimit=0))
    assert (out.status, out.reason) == ("unknown", "wall-clock limit (0.2 s)")
    out = check(ctx, _factor(ctx), Limits(timeout_ms=200, rlimit=4_000_000_000))
    assert (out.status, out.reason) == ("unknown", "wall-clock limit (0.2 s)")


def test_each_solver_call_has_its_own_budget():
    """Z3 counts steps per context, cumulatively; the rlimit of a call is relative to its start, so what was asked
    before in the same context changes neither its verdict nor the steps it uses."""
    limits = Limits(rlimit=3_000_000)
    fresh = z3.Context()
    x = z3.BitVec("x", 32, fresh)
    alone = check(fresh, [x * 3 == 7], limits)
    used = z3.Context()
    for _ in range(3):
        assert check(used, _factor(used), Limits(rlimit=1_500_000)).status == "unknown"  # 4.5M steps spent before
    y = z3.BitVec("x", 32, used)
    after = check(used, [y * 3 == 7], limits)
    assert (after.status, after.rlimit_used) == (alone.status, alone.rlimit_used) == ("sat", alone.rlimit_used)


def test_the_default_budget_proves_the_demo_with_room_to_spare(monkeypatch):
    """Measured: the demo's costliest solver call uses about 320,000 steps (the tests' costliest, 400 deny_cidrs,
    about 1,170,000): the default budget of 50,000,000 leaves more than 40x for a slower Z3 or a larger policy."""
    used: list[int] = []

    def measured(*args, **kwargs):
        out = check(*args, **kwargs)
        used.append(out.rlimit_used)
        return out

    monkeypatch.setattr(properties, "check", measured)
    report = prove(demo_artifact())
    assert report.exit_code() == 0, report.render_text()
    assert used and max(used) * 40 < DEFAULT_RLIMIT


def test_the_cli_defaults_are_the_solver_defaults():
    assert (prove_command.DEFAULT_RLIMIT, prove_command.DEFAULT_TIMEOUT_MS) == (DEFAULT_RLIMIT, DEFAULT_TIMEOUT_MS)
    assert DEFAULT_TIMEOUT_MS >= 10 * 60 * 1000  # a safety bound, not the budget
