"""Compile-time benchmark: whole compile vs a bare Lark parse of the same text, and growth with size.

Run: `.venv/bin/python bench/compile.py` (or `make bench`). Prints ratios measured in this run;
targets: compile <= 3x bare parse at 1,000 connections x 32 rules + 200 profiles; 10x input <= 12x time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.compile import compile_text  # noqa: E402
from compiler.parser import lark_parser  # noqa: E402


def policy(connections: int, rules: int, profiles: int) -> str:
    out = ['egresslaw 1\nworkspace "bench"\ncatalog "2026.11"\n\nworker "edge" {\n  deny_cidrs = ["203.0.113.0/24"]\n}\n']
    for c in range(connections):
        out.append(f'connection "conn-{c}" {{\n  credential = "handle-{c}"\n  worker = edge\n')
        for r in range(rules):
            out.append(
                f'  egress "rule-{r}" {{\n    host = "api{c}.service{r % 7}.io"\n    port = 443\n'
                f'    path_prefix = "/v{r % 3}/org-{c}/items-{r}"\n    methods = ["GET", "POST"]\n'
                f'    headers = ["Accept", "Content-Type", "X-Request-Id"]\n  }}\n'
            )
        out.append("}\n")
    for p in range(profiles):
        out.append(
            f'sandbox_profile "profile-{p}" {{\n  trust = "trusted"\n  provider = "gvisor@2026.10.1"\n'
            f'  network = {{"type": "limited", "allowed_hosts": ["h{p}.builds.io", "cache{p}.builds.io:8443"], '
            f'"allow_package_managers": {"true" if p % 2 else "false"}}}\n}}\n'
        )
    return "".join(out)


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(connections: int, rules: int, profiles: int, repeat: int) -> tuple[int, float, float]:
    text = policy(connections, rules, profiles)
    parser = lark_parser()
    parse = best_of(lambda: parser.parse(text), repeat)
    result = None

    def full():
        nonlocal result
        result = compile_text(text, "bench.egress")

    compile_time = best_of(full, repeat)
    assert result.ok, result.diagnostics[:3]
    assert len(result.artifact.connections) == connections
    return len(text.splitlines()), parse, compile_time


def main() -> None:
    print(f"{'policy':<34} {'lines':>8} {'bare parse s':>13} {'compile s':>10} {'ratio':>6}")
    rows = {}
    for label, shape, repeat in (
        ("100 conn x 32 rules + 20 prof", (100, 32, 20), 3),
        ("1,000 conn x 32 rules + 200 prof", (1000, 32, 200), 2),
    ):
        lines, parse, comp = measure(*shape, repeat)
        rows[shape] = comp
        print(f"{label:<34} {lines:>8} {parse:>13.3f} {comp:>10.3f} {comp / parse:>6.2f}x")
    growth = rows[(1000, 32, 200)] / rows[(100, 32, 20)]
    print(f"growth for 10x input: {growth:.2f}x time (target <= 12x)")
    _ = statistics


if __name__ == "__main__":
    main()
