"""Mutation score of `egresslaw prove` (and of the tests, for the adapter and the edge) over tests/proofs/mutants.py.

Run: `.venv/bin/python bench/mutants.py [--jobs 2] [--only ID,ID]`. Each mutant runs in its own
process (the mutated core served by an import hook; no file changes) and proves its exercising
artifact with the real CLI. Prints one line per mutant and ends with
`mutation score: C/B property-breaking mutants caught (R refuted by prove, U unknown with the operation
named, S failing the tests; M mutants, E equivalent)`; exits 0 only when every property-breaking mutant is
caught as its kind expects and every equivalent one changes nothing.
Target: the whole set in under 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.proofs.mutants import MUTANTS, evaluate, score_line  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    start = time.perf_counter()

    def show(o) -> None:
        m = o.mutant
        kind = ("adapter/edge: tests" if m.expect == "suite" else f"breaks {m.breaks}") if m.breaks else "equivalent"
        caught = {"refuted": "REFUTED ", "unknown": "UNKNOWN ", "suite": "FAILS   "}[m.expect] if m.breaks else "same    "
        verdict = caught if o.ok else "CRASHED " if o.crashed else "MISSED  "
        print(f"{verdict} {o.mutant.id:<32} {kind:<27} {o.detail}", flush=True)

    outcomes = evaluate(chosen, jobs=args.jobs, progress=show)
    print(f"{len(outcomes)} mutants in {time.perf_counter() - start:.0f} s (--jobs {args.jobs})")
    print("equivalent mutants (no property changes):")
    for m in chosen:
        if m.breaks is None:
            print(f"  {m.id}: {m.why}")
    print(score_line(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
