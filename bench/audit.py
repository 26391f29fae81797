"""What the write-ahead audit costs: throughput and latency of `egresslaw proxy` against bare `mitmdump`, in both
audit sync modes (`--audit-sync 1`, the default: the decision event is written before forwarding and fsync'd
within a second; `--audit-sync request`: fsync'd before forwarding), and with `--baseline REF` egresslaw at a git
ref too (e.g. `main`). Interleaved rounds (the order rotates) so the machine's load moves every proxy alike; per
round and transport each proxy gets a throughput run (8 clients) and a latency run (1 client). Printed: every run
with the load average, then medians, the median of the per-round ratios against mitmdump, and each proxy's CPU
time per request (from /proc: what the audit adds, independent of how busy the other core is).

    .venv/bin/python bench/audit.py [--rounds 5] [--requests 1200] [--baseline main]

Reuses bench/proxy.py's upstream, clients and 32-rule artifact. Afterwards each egresslaw audit log is checked: one
decision event per request, one linked outcome per allow, every line verifying under the audit key.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import multiprocessing
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("bench_proxy", ROOT / "bench" / "proxy.py")
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)  # type: ignore[union-attr]

from tests.egress_proxy.conftest import _issue, free_port, make_env  # noqa: E402
from tests.proxy_harness import proof_signing_key  # noqa: E402

TRANSPORTS = ("absolute-form", "connect+tls")


def _egresslaw(tree: Path, env, port: int, logs: Path, up: int, pki, *extra: str) -> subprocess.Popen:
    logs.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--trust-proofs", str(proof_signing_key()[1]),
         "--keys", str(env.keys), "--store", str(env.store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{free_port()}",
         "--confdir", str(logs / "conf"), "--audit-log", str(logs / "audit.jsonl"), "--resolve", f"{bp.HOST}={bp.PUBLIC}",
         "--connect-to", f"{bp.HOST}:443:127.0.0.1:{up + 1}", "--upstream-ca", str(pki.ca_pem), *extra],
        # one process (one audit file to read); an environment variable, so a baseline tree without --workers ignores it
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "EGRESSLAW_WORKERS": "1"}, stdout=subprocess.DEVNULL, stderr=open(logs / "stderr", "wb"),
    )  # fmt: skip


def _ca(conf: Path) -> ssl.SSLContext:
    deadline = time.time() + 10
    while not (conf / "mitmproxy-ca-cert.pem").exists() and time.time() < deadline:
        time.sleep(0.05)
    return ssl.create_default_context(cafile=str(conf / "mitmproxy-ca-cert.pem"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _check_log(logs: Path, keys: Path) -> str:
    from egress_proxy.audit.log import OWN_KINDS, verify
    from egress_proxy.custody.keys import load_audit_key

    events = [e for e in map(json.loads, (logs / "audit.jsonl").read_bytes().splitlines()) if e["kind"] not in OWN_KINDS]
    decisions = [e for e in events if e["kind"] == "request"]
    allows = {e["id"] for e in decisions if e["decision"] == "allow"}
    outcomes = {e["id"] for e in events if e["kind"] == "outcome" and e["of"] == "request"}
    result = verify(logs, key=load_audit_key(keys))
    ok = result.status == "intact" and allows == outcomes
    return (f"{'ok' if ok else 'FAILED'}: {len(decisions)} request decisions ({len(allows)} allow), {len(outcomes)} outcomes, "
            f"unlinked {len(allows ^ outcomes)}, verify: {result.status}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1200, help="requests per throughput run (default 1200)")
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--baseline", metavar="REF", help="also run egresslaw at this git ref (git archive into a temp dir)")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="egresslaw-bench-audit-"))
    pki = _issue(tmp / "pki", (bp.HOST,), ("127.0.0.1",))
    up = bp._two_free_ports()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=bp._serve, args=(up, str(pki.cert_pem), str(pki.key_pem), ready), daemon=True)
    server.start()
    ready.wait(10)
    from egress_proxy.custody.records import Address
    from egress_proxy.custody.sqlite import CustodyStore

    env = make_env(tmp / "edge", bp._artifact_32_rules())
    with CustodyStore(env.store, env.keys) as cs:
        cs.put(Address("acme", "bench", "bench-cred"), b"bench-" + base64.b32encode(os.urandom(20)))
    lease = env.lease(connection="bench", ttl=3600)

    ports = {"mitmdump": free_port()}
    procs = {"mitmdump": subprocess.Popen(
        [str(ROOT / ".venv/bin/mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port", str(ports["mitmdump"]),
         "--set", f"confdir={tmp / 'bare-conf'}", "--set", f"ssl_verify_upstream_trusted_ca={pki.ca_pem}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)}  # fmt: skip
    confs = {"mitmdump": tmp / "bare-conf"}
    variants = {"sync-1s": (ROOT, ()), "sync-request": (ROOT, ("--audit-sync", "request"))}
    if args.baseline:
        tree = tmp / "baseline-tree"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        variants[f"{args.baseline}"[:12]] = (tree, ())
    for name, (tree, extra) in variants.items():
        ports[name] = free_port()
        procs[name] = _egresslaw(tree, env, ports[name], tmp / name, up, pki, *extra)
        confs[name] = tmp / name / "conf"
    rps: dict[tuple[str, str], list[float]] = {}
    p50: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    try:
        for name, proc in procs.items():
            bp._wait_listening(ports[name], proc)
        cas = {name: _ca(conf) for name, conf in confs.items()}
        names = list(procs)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[: rnd % len(names)]
            for transport in TRANSPORTS:
                for name in order:
                    bare = name == "mitmdump"
                    if transport == "absolute-form":
                        url = f"https://127.0.0.1:{up + 1}/v1/ping" if bare else f"https://{bp.HOST}/v1/ping"
                        make = bp._client_absolute(ports[name], url, None if bare else lease)
                    else:
                        host, port = ("127.0.0.1", up + 1) if bare else (bp.HOST, 443)
                        make = bp._client_connect(ports[name], host, port, cas[name], None if bare else lease)
                    before = _cpu_seconds(procs[name].pid)
                    thr = bp._run(make, args.requests, bp.CONCURRENCY)
                    used = (_cpu_seconds(procs[name].pid) - before) / max(1, thr["n"]) * 1000
                    lat = bp._run(make, args.latency_requests, 1)
                    assert thr["errors"] == lat["errors"] == 0, (name, transport, thr, lat)
                    rps.setdefault((name, transport), []).append(thr["rps"])
                    p50.setdefault((name, transport), []).append(lat["p50_ms"])
                    cpu.setdefault((name, transport), []).append(used)
                    print(f"round {rnd + 1} {name:12s} {transport:13s} {thr['rps']:6.0f} req/s (c={bp.CONCURRENCY}), {used:4.2f} ms CPU/req"
                          f"   p50 {lat['p50_ms']:5.2f} ms (c=1)   load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
        server.terminate()
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for transport in TRANSPORTS:
        bare = ("mitmdump", transport)
        print(f"{transport}: mitmdump {statistics.median(rps[bare]):5.0f} req/s, {statistics.median(cpu[bare]):4.2f} ms CPU/req, "
              f"p50 {statistics.median(p50[bare]):5.2f} ms")
        for name in variants:
            ours = (name, transport)
            ratio = statistics.median(a / b for a, b in zip(rps[ours], rps[bare]))
            added = statistics.median(a - b for a, b in zip(p50[ours], p50[bare]))
            print(f"  {name:12s} {statistics.median(rps[ours]):5.0f} req/s = {ratio:6.1%} of mitmdump (median of per-round ratios), "
                  f"{statistics.median(cpu[ours]):4.2f} ms CPU/req, p50 {statistics.median(p50[ours]):5.2f} ms ({added:+.2f} ms)")
    failed = False
    for name in variants:
        verdict = _check_log(tmp / name, env.keys)
        failed = failed or not verdict.startswith("ok")
        print(f"audit log of {name}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
