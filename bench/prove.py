"""Prover benchmark: all properties for policies of 100 and 1,000 connections over 3 workers.

Run: `.venv/bin/python bench/prove.py [--sizes 100,1000] [--rules 4]`. Prints total time, per-check
median and p99 (from the report's `time_ms`), the 1,000/100 time ratio and the `--jobs 2` vs
`--jobs 1` speed-up (measured on the smaller size). Targets: median <= 50 ms, ratio <= 12, speed-up >= 1.6.
For each size it also times the capacity of every subject (`proofs.capacity.capacities`, docs/budget.md) and the
`max-bits` checks with a witness for every subject (`--max-bits 0`: each one refuted, two requests built and replayed),
on the same artifact right after its proof, and prints each against the prove time (target: capacity <= 2x prove).

`.venv/bin/python bench/prove.py --load [--connections 1000]` instead proves one policy twice, quiet and
under two CPU burners, and prints whether the two reports are identical but for `time_ms` (the budget
is Z3's rlimit, so they must be), with both times and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proofs.capacity import capacities  # noqa: E402
from proofs.runner import MaxBits, capacity_checks, prove  # noqa: E402
from tests.egress_proxy.builders import artifact, connection, profile, rule, worker  # noqa: E402
from tests.proofs.helpers import cpu_burners, without_timings  # noqa: E402

WORKERS = ("edge", "ipv4-only", "default")


def policy(n: int, rules: int):
    conns = []
    for c in range(n):
        rs = [
            rule(f"rule-{r}", f"api{c}.service{r % 7}.io", f"/v{r % 3}/org-{c}/items-{r}", ["GET", "POST"],
                 ["accept", "content-type", "x-request-id"])
            for r in range(rules)
        ]
        conns.append(connection(f"conn-{c}", rs, worker=WORKERS[c % 3]))
    workers = [worker("edge", deny_cidrs=("203.0.113.0/24",)), worker("ipv4-only", ipv6=False)]
    profiles = [profile("ci", [("pypi.org", 443), ("deb.debian.org", 80)])]
    return artifact(connections=conns, profiles=profiles, workers=workers)


def run(n: int, rules: int, jobs: int) -> tuple[float, list[int], int]:
    total, times, checks, _ = run_with_capacity(n, rules, jobs, False)
    return total, times, checks


def run_with_capacity(n: int, rules: int, jobs: int, capacity: bool = True):
    """The proof's total time, per-check times and count; with `capacity`, also (seconds to count every subject's
    capacity, seconds for the max-bits checks with a witness each, subjects), timed on the same artifact right after."""
    art = policy(n, rules)
    start = time.perf_counter()
    report = prove(art, jobs=jobs)
    total = time.perf_counter() - start
    assert report.exit_code() == 0, report.render_text()
    figures = None
    if capacity:
        start = time.perf_counter()
        caps = capacities(art)
        counted = time.perf_counter() - start
        start = time.perf_counter()
        _, results = capacity_checks(art, MaxBits(0), None)
        witnessed = time.perf_counter() - start
        assert len(results) == len(caps) and all(r.verdict != "unknown" for r in results), [r.detail for r in results][:3]
        figures = (counted, witnessed, len(caps))
    return total, [r.time_ms for r in report.results], len(report.results), figures


def pct(values: list[int], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def under_load(n: int, rules: int) -> int:
    """Quiet, then under two CPU burners: the same report but for timings (exit 1 if not)."""
    art = policy(n, rules)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    quiet = prove(art)
    t_quiet = time.perf_counter() - start
    with cpu_burners(2):
        start = time.perf_counter()
        loaded = prove(art)
        t_loaded = time.perf_counter() - start
        load = os.getloadavg()[0]
    same = without_timings(quiet) == without_timings(loaded) and quiet.render_text() == loaded.render_text()
    print(f"{n} connections x {rules} rules, {len(quiet.results)} checks ({quiet.summary['proved']} proved): quiet {t_quiet:.1f} s, "
          f"under 2 CPU burners {t_loaded:.1f} s (load {load:.2f}), ratio {t_loaded / t_quiet:.2f}")
    print(f"reports identical but for time_ms: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--rules", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--load", action="store_true", help="prove one policy quiet and under two CPU burners; compare the reports")
    ap.add_argument("--connections", type=int, default=1000, help="with --load: the policy's size (default 1000)")
    args = ap.parse_args()
    if args.load:
        return under_load(args.connections, args.rules)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores; the jobs speed-up needs an idle machine)")
    totals = {}
    for n in sizes:
        total, times, checks, (counted, witnessed, subjects) = run_with_capacity(n, args.rules, args.jobs)
        totals[n] = total
        print(f"{n:>5} connections x {args.rules} rules, 3 workers, --jobs {args.jobs}: {checks} checks in {total:.1f} s;"
              f" per check median {statistics.median(times):.0f} ms, p99 {pct(times, 0.99):.0f} ms")
        print(f"      capacity of {subjects} subjects {counted * 1000:.0f} ms ({counted / total:.4f}x the prove time, "
              f"target <= 2x); --max-bits 0 with {subjects} witnesses {witnessed * 1000:.0f} ms ({witnessed / total:.4f}x)")
    if len(sizes) >= 2:
        print(f"ratio {sizes[-1]}/{sizes[0]}: {totals[sizes[-1]] / totals[sizes[0]]:.1f} (target <= 12)")
    n = sizes[0] if len(sizes) == 1 else sizes[-1] // 2 if sizes[-1] >= 400 else sizes[0]
    t1, _, _ = run(n, args.rules, 1)
    t2, _, _ = run(n, args.rules, 2)
    print(f"{n} connections: --jobs 1 {t1:.1f} s, --jobs 2 {t2:.1f} s, speed-up {t1 / t2:.2f}x (target >= 1.6)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
