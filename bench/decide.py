"""Benchmark the decision function alone: median and p99 µs per decide() for 10 … 10,000 connections.

    .venv/bin/python bench/decide.py [--calls N]

Each connection has three rules on its own host; each timed call is an allowed request (the longest
path: destination, Host header, framing, path, rule match, header filter, one IPv4 answer) or, for
the "deny" row, a request refused at the path stage. Targets: median ≤ 20 µs, 10,000/10 ratio ≤ 1.5.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from egress_proxy.decision.adapter import decide  # noqa: E402
from egress_proxy.decision.types import Lease, Request  # noqa: E402
from tests.egress_proxy.builders import artifact, connection, rule, worker  # noqa: E402

SIZES = (10, 100, 1_000, 10_000)
HEADERS = (("Accept", "application/json"), ("User-Agent", "agent/1.0"), ("Authorization", "Bearer x"), ("X-Trace", "1"))


def build(n: int):
    conns = [
        connection(
            f"c{i}",
            [
                rule("read", f"api{i}.example.com", "/v1/repos/acme", ["GET", "HEAD"], ["accept", "user-agent"]),
                rule("write", f"api{i}.example.com", "/v1/repos/acme/issues", ["POST"], ["accept", "content-type"]),
                rule("meta", f"meta{i}.example.com", "/", ["GET"]),
            ],
            worker="edge" if i % 2 else "default",
        )
        for i in range(n)
    ]
    return artifact(connections=conns, workers=[worker("edge", deny_cidrs=("203.0.113.0/24",))])


def calls(n: int, count: int, deny: bool) -> list[tuple[Lease, Request, tuple[str, ...]]]:
    rng = random.Random(n)
    out = []
    for _ in range(count):
        i = rng.randrange(n)
        target = f"/v1/repos/acmex/{rng.randrange(100)}" if deny else f"/v1/repos/acme/app/pulls/{rng.randrange(100)}?page=2"
        out.append(
            (
                Lease("bench", None, f"c{i}", 2_000_000_000),
                Request("GET", "https", f"api{i}.example.com", 443, target, HEADERS, host_header=f"api{i}.example.com"),
                ("140.82.112.6",),
            )
        )
    return out


def measure(cases: dict[str, tuple[object, list]], rounds: int) -> dict[str, list[float]]:
    """Per-call µs for each case. Cases are interleaved chunk by chunk, so load from other processes
    on the machine falls on every size alike instead of on whichever ran at a busy moment."""
    for art, work in cases.values():  # warm: every subject's view is built before timing
        for lease, req, ips in work:
            decide(art, lease, req, ips)
    samples: dict[str, list[float]] = {key: [] for key in cases}
    clock = time.perf_counter_ns
    chunk = 250
    gc.disable()
    try:
        for _ in range(rounds):
            for start in range(0, max(len(w) for _, w in cases.values()), chunk):
                for key, (art, work) in cases.items():
                    out = samples[key]
                    for lease, req, ips in work[start : start + chunk]:
                        t0 = clock()
                        decide(art, lease, req, ips)
                        out.append((clock() - t0) / 1000)
    finally:
        gc.enable()
    return samples


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(len(samples) * 0.99)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5_000, help="distinct requests per size and kind (default 5000)")
    parser.add_argument("--rounds", type=int, default=3, help="times each request is timed (default 3)")
    args = parser.parse_args()
    cases: dict[str, tuple[object, list]] = {}
    built: dict[int, float] = {}
    for n in SIZES:
        t0 = time.perf_counter()
        art = build(n)
        built[n] = time.perf_counter() - t0
        cases[f"{n}-allow"] = (art, calls(n, args.calls, deny=False))
        cases[f"{n}-deny"] = (art, calls(n, args.calls, deny=True))
    samples = measure(cases, args.rounds)
    medians: dict[int, float] = {}
    print(f"{'connections':>11}  {'build s':>7}  {'allow median µs':>15}  {'allow p99 µs':>12}  {'deny median µs':>14}  {'deny p99 µs':>11}")
    for n in SIZES:
        allow, deny = samples[f"{n}-allow"], samples[f"{n}-deny"]
        medians[n] = statistics.median(allow)
        print(f"{n:>11}  {built[n]:>7.2f}  {medians[n]:>15.2f}  {p99(allow):>12.2f}  {statistics.median(deny):>14.2f}  {p99(deny):>11.2f}")
    ratio = medians[SIZES[-1]] / medians[SIZES[0]]
    print(f"median ratio {SIZES[-1]:,}/{SIZES[0]}: {ratio:.2f} (target ≤ 1.5); worst median {max(medians.values()):.2f} µs (target ≤ 20)")
    return 0 if ratio <= 1.5 and max(medians.values()) <= 20 else 1


if __name__ == "__main__":
    sys.exit(main())
