"""What enforcing caps costs: the edge's and the lane's CPU per request with a budget, against the same front end
serving the same profile without one, in one run.

Four front ends, each in its own process, in front of one upstream (bench/proxy.py's small TLS HTTP/1.1 server,
in its own process):

  edge                 `egresslaw proxy --workers 1`, the profile without a budget
  edge + budget        the same, the profile with `budget = {requests = 1000000000, bytes = "1TiB", window = "1d"}`
                       (caps that never refuse: every request is charged, one SQLite transaction in
                       `--budget-store`, none is refused)
  lane                 `egresslaw lane` (the authorizer's process and its Envoy), the profile without a budget
  lane + budget        the same, with the budget

Each is given its own artifact (the same profile, `dl`: `api.acme-test.dev:443`, no credential; the one with a
budget differs in `budget` only), proof, keys, audit log and budget store. The clients are bench/proxy.py's:
`--clients` keep-alive CONNECT+TLS clients (default 16) holding a lease of the profile, `--requests` GETs per window
(default 2000); a CONNECT and every request in its tunnel is charged. Each round runs the four windows, in an order
that alternates (edge, edge + budget, lane + budget, lane, then the reverse), so a load change mid-round hits both
sides of a ratio alike. Around each window the front end's CPU is read from /proc (user + system of its process
and every descendant: the lane's Envoy is its child; the edge with `--workers 1` is one process) and divided by
the requests answered; a lane window lasts until its access-log reader has caught up (bench/lane.py's `_caught_up`).

Printed: every window's CPU per request, then for each front end the ratio with/without the budget, the median of
the rounds' ratios and the ratio pooled over every round (CPU summed, requests summed); the lane's split into Envoy
and its Python process; then one `SqliteLedger.charge` alone (a process's reservation spent, a block taken every 64
requests), and admit's whole step 9 with the budget and without, timed in this process and set against the CPU of a
lane and an edge request (the budget's share, free of the window-to-window noise of a shared machine). Target: each pooled ratio <= 1.05. At the end the budget stores are read back: the rows
charged must count every request answered (a check that the budget side did charge), and no request may have been
refused (errors are counted and printed: a request that failed is not in a window's count). Every address is loopback; the load generator, the upstream and the front ends share this machine's cores.

Usage: `.venv/bin/python bench/budget.py [--requests N] [--rounds N] [--clients N]`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lane import _caught_up, _own_cpu, _started, _tree_cpu, _wait_ca  # noqa: E402
from bench.proxy import CLIENT_PROCS, CONCURRENCY, _client_connect, _run, _serve, _two_free_ports  # noqa: E402
from compiler.artifact import Budget  # noqa: E402
from egress_proxy.front.budget import SqliteLedger  # noqa: E402
from tests.egress_proxy import builders as b  # noqa: E402
from tests.egress_proxy.conftest import _issue, free_port, make_env  # noqa: E402
from tests.proxy_harness import proof_signing_key  # noqa: E402

HOST = "api.acme-test.dev"
PUBLIC = "93.184.216.34"  # never dialled: --connect-to sends the vetted connection to 127.0.0.1
PROFILE = "dl"
HIGH = Budget(window=86400, requests=10**9, bytes=2**40)  # never refuses in a bench run; both caps, so both are charged
ROUNDS = 5
FRONTS = ("edge", "edge + budget", "lane + budget", "lane")  # a round's order; every other round the reverse


def _artifact(budget: Budget | None):
    prof = b.profile(PROFILE, [(HOST, 443)])
    if budget is not None:
        prof = prof.model_copy(update={"budget": budget})
    return b.artifact(profiles=[prof], workspace="acme")


def _window(make, pid: int, args, run_dir: Path | None) -> dict[str, float]:
    cpu0, own0 = _tree_cpu(pid), _own_cpu(pid)
    thr = _run(make, args.requests, args.clients, args.client_procs)
    if run_dir is not None:
        _caught_up(run_dir)
    cpu, own = _tree_cpu(pid) - cpu0, _own_cpu(pid) - own0
    return {"n": thr["n"], "errors": thr["errors"], "rps": thr["rps"], "cpu": cpu, "own": own, "cpu_ms": cpu * 1000 / max(1, thr["n"])}


def _charged(store: Path) -> tuple[int, int] | None:
    """(rows, requests charged) in a budget store, summed over every table with a `requests` column; None unreadable."""
    try:
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        rows = requests = 0
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            columns = {c[1] for c in db.execute(f'PRAGMA table_info("{table}")')}
            if "requests" in columns:
                r, n = db.execute(f'SELECT count(*), coalesce(sum(requests), 0) FROM "{table}"').fetchone()
                rows, requests = rows + r, requests + n
        return rows, requests
    except sqlite3.Error:
        return None
    finally:
        db.close()


def _charge_alone(directory: Path, n: int = 5000) -> float:
    """CPU microseconds of one `SqliteLedger.charge` of the budget above, in this process, on a file of its own
    (what the front ends add per request, besides computing the cost): after 200 untimed charges."""
    ledger = SqliteLedger(directory / "alone.db")
    charges = [("profile:" + PROFILE, HIGH)]
    try:
        for _ in range(200):
            ledger.charge(charges, 300, time.time())
        start = time.process_time()
        for _ in range(n):
            ledger.charge(charges, 300, time.time())
        return (time.process_time() - start) * 1e6 / n
    finally:
        ledger.close()


def _step9_alone(directory: Path, n: int = 20000) -> tuple[float, float]:
    """CPU microseconds of admit's step 9 (`front.admit.charged`: who is charged, the cost, the charge) for one GET in
    a tunnel as the clients send it, in this process: the profile with the budget, and without (nothing to charge)."""
    # Imported here: only this measurement needs admit's types.
    from egress_proxy.decision.types import Decision, Lease, Request
    from egress_proxy.front.admit import Admission, Ask, Hooks, charged
    from egress_proxy.front.budget import LazyLedger

    ledger = LazyLedger(directory / "step9.db")
    ledger.open()
    hooks = Hooks(lease_keys=lambda: None, verified=None, clock=time.time, resolve=None, ledger=ledger)  # type: ignore[arg-type]
    ask = Ask(request=Request(method="GET", scheme="https", host=HOST, port=443, target="/", has_body=False, host_header=HOST,
                              headers=(("Host", HOST), ("Accept-Encoding", "identity"))))
    got = Admission("allowed", Lease("bench", PROFILE, None, 2**40), Decision(True, "allowed"), HOST, 443, ("127.0.0.1",))
    out = []
    try:
        for artifact in (_artifact(HIGH), _artifact(None)):
            best = float("inf")
            for _ in range(5):
                start = time.process_time()
                for _ in range(n):
                    charged(artifact, ask, hooks, got)
                best = min(best, (time.process_time() - start) * 1e6 / n)
            out.append(best)
    finally:
        ledger.close()
    return out[0], out[1]


def _pooled(windows: list[dict[str, float]], key: str = "cpu") -> float:
    return sum(w[key] for w in windows) * 1000 / max(1, sum(w["n"] for w in windows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per window (default 2000)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds of the four windows (default {ROUNDS})")
    parser.add_argument("--clients", type=int, default=CONCURRENCY, help=f"keep-alive clients (default {CONCURRENCY})")
    parser.add_argument("--client-procs", type=int, default=CLIENT_PROCS, help=f"processes the clients run in (default {CLIENT_PROCS})")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores, shared by the clients, the upstream and the front ends)",
          flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-bench-budget-"))
    pki = _issue(tmp / "pki", (HOST,), ("127.0.0.1",))
    up = _two_free_ports()  # up: plain HTTP (unused), up + 1: TLS
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=_serve, args=(up, str(pki.cert_pem), str(pki.key_pem), ready), daemon=True)
    server.start()
    ready.wait(10)

    envs = {False: make_env(tmp / "plain", _artifact(None)), True: make_env(tmp / "budget", _artifact(HIGH))}
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}
    confs: dict[str, Path] = {}
    stores: dict[str, Path] = {}
    logs: dict[str, Path] = {}
    windows: dict[str, list[dict[str, float]]] = {name: [] for name in FRONTS}
    try:
        for name in FRONTS:
            lane, budget = name.startswith("lane"), name.endswith("budget")
            env, slug = envs[budget], name.replace(" + ", "-")
            ports[name], admin, confs[name] = free_port(), free_port(), tmp / f"{slug}-conf"
            stores[name], logs[name] = tmp / f"{slug}-budget.db", tmp / f"{slug}.log"
            given = ["--artifact", env.artifact, "--proof", env.proof, "--trust-proofs", proof_signing_key()[1], "--keys", env.keys,
                     "--resolve", f"{HOST}={PUBLIC}", "--connect-to", f"{HOST}:443:127.0.0.1:{up + 1}", "--upstream-ca", pki.ca_pem,
                     "--listen", f"127.0.0.1:{ports[name]}", "--admin", f"127.0.0.1:{admin}", "--confdir", confs[name],
                     "--audit-log", tmp / f"{slug}-audit" / "audit.jsonl", "--budget-store", stores[name]]
            command = ["lane"] if lane else ["proxy", "--store", env.store, "--workers", "1"]
            procs[name] = subprocess.Popen([sys.executable, "-m", "egresslaw", *command, *(str(x) for x in given)], cwd=tmp,
                                           stdout=subprocess.DEVNULL, stderr=logs[name].open("w"))
        for name, proc in procs.items():
            _started(name, ports[name], proc, logs[name], 90)
        makes = {name: _client_connect(ports[name], HOST, 443, _wait_ca(confs[name]), envs[name.endswith("budget")].lease(profile=PROFILE, ttl=3600))
                 for name in FRONTS}
        for r in range(args.rounds):
            order = FRONTS if r % 2 == 0 else tuple(reversed(FRONTS))
            for name in order:
                w = _window(makes[name], procs[name].pid, args, confs[name] / "lane" if name.startswith("lane") else None)
                windows[name].append(w)
                split = f" (Envoy {(w['cpu'] - w['own']) * 1000 / max(1, w['n']):.3f} + Python {w['own'] * 1000 / max(1, w['n']):.3f})" \
                    if name.startswith("lane") else ""
                print(f"round {r + 1} {name:14s} {w['rps']:7.0f} req/s  CPU {w['cpu_ms']:.3f} ms/request{split}  errors {w['errors']}",
                      flush=True)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        server.terminate()

    print()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"one SqliteLedger.charge alone, in this process: {_charge_alone(tmp):.1f} us CPU")
    with_budget, without = _step9_alone(tmp)
    lane_cpu = _pooled(windows["lane"]) * 1000
    print(f"admit's step 9 alone, in this process (best of 5): {with_budget:.1f} us with the budget, {without:.1f} us without: "
          f"+{with_budget - without:.1f} us, {(with_budget - without) / max(lane_cpu, 1e-9) * 100:.1f}% of a lane request "
          f"({lane_cpu:.0f} us here), {(with_budget - without) / max(_pooled(windows['edge']) * 1000, 1e-9) * 100:.1f}% of an edge one")
    failed = False
    for front in ("edge", "lane"):
        base, capped = windows[front], windows[f"{front} + budget"]
        rounds = [c["cpu_ms"] / p["cpu_ms"] for c, p in zip(capped, base)]
        pooled = _pooled(capped) / _pooled(base)
        split = ""
        if front == "lane":
            split = (f"; Python {_pooled(base, 'own'):.3f} -> {_pooled(capped, 'own'):.3f} ms, Envoy "
                     f"{_pooled(base) - _pooled(base, 'own'):.3f} -> {_pooled(capped) - _pooled(capped, 'own'):.3f} ms")
        print(f"{front} with a budget / without, CPU per request: pooled {pooled:.3f}x ({_pooled(base):.3f} -> {_pooled(capped):.3f} ms"
              f"{split}); median of rounds {statistics.median(rounds):.3f}x (rounds {' '.join(f'{x:.3f}' for x in rounds)}) "
              f"(target <= 1.05x)")
        errors = sum(w["errors"] for w in base + capped)
        answered = sum(w["n"] for w in capped)
        charged = _charged(stores[f"{front} + budget"])
        print(f"  {front}: errors {errors}; budget store rows, requests charged: {charged} (answered in the windows: {answered}, "
              f"plus warm-ups and CONNECTs)")
        if charged is None or charged[1] < answered:
            failed = True
            print(f"  {front}: the budget side did not charge every request answered: see {logs[f'{front} + budget']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
