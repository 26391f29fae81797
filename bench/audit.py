"""What the write-ahead audit costs: throughput and latency of `egresslaw proxy` against bare `mitmdump`
(and, with `--baseline REF`, against egresslaw at a git ref, e.g. one from before the write-ahead), in
interleaved rounds so the machine's load moves every proxy alike; medians and ratios are printed.

    .venv/bin/python bench/audit.py [--rounds 3] [--requests 1200] [--baseline main]

Reuses bench/proxy.py's upstream, clients and 32-rule artifact. Afterwards the audit log is checked: one
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


def _egresslaw(tree: Path, env, port: int, audit: Path, up: int, pki) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof),
         "--keys", str(env.keys), "--store", str(env.store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{free_port()}",
         "--confdir", str(audit.parent / f"conf-{port}"), "--audit-log", str(audit), "--resolve", f"{bp.HOST}={bp.PUBLIC}",
         "--connect-to", f"{bp.HOST}:443:127.0.0.1:{up + 1}", "--upstream-ca", str(pki.ca_pem)],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.DEVNULL, stderr=open(audit.parent.parent / f"err-{port}", "wb"),
    )  # fmt: skip


def _ca(conf: Path) -> ssl.SSLContext:
    deadline = time.time() + 10
    while not (conf / "mitmproxy-ca-cert.pem").exists() and time.time() < deadline:
        time.sleep(0.05)
    return ssl.create_default_context(cafile=str(conf / "mitmproxy-ca-cert.pem"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
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
    from egress_proxy.custody import Address, CustodyStore

    env = make_env(tmp / "edge", bp._artifact_32_rules())
    with CustodyStore(env.store, env.keys) as cs:
        cs.put(Address("acme", "bench", "bench-cred"), b"bench-" + base64.b32encode(os.urandom(20)))
    lease = env.lease(connection="bench", ttl=3600)

    ports = {"mitmdump": free_port(), "egresslaw": free_port()}
    procs = {"mitmdump": subprocess.Popen(
        [str(ROOT / ".venv/bin/mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port", str(ports["mitmdump"]),
         "--set", f"confdir={tmp / 'bare-conf'}", "--set", f"ssl_verify_upstream_trusted_ca={pki.ca_pem}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)}  # fmt: skip
    audit = tmp / "logs" / "audit.jsonl"
    audit.parent.mkdir()
    (tmp / "logs-baseline").mkdir()
    procs["egresslaw"] = _egresslaw(ROOT, env, ports["egresslaw"], audit, up, pki)
    if args.baseline:
        tree = tmp / "baseline"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        ports["baseline"] = free_port()
        procs["baseline"] = _egresslaw(tree, env, ports["baseline"], tmp / "logs-baseline" / "audit.jsonl", up, pki)
    rps: dict[tuple[str, str], list[float]] = {}
    p50: dict[tuple[str, str], list[float]] = {}
    try:
        for name, proc in procs.items():
            bp._wait_listening(ports[name], proc)
        cas = {"mitmdump": _ca(tmp / "bare-conf"), "egresslaw": _ca(audit.parent / f"conf-{ports['egresslaw']}")}
        if "baseline" in procs:
            cas["baseline"] = _ca(tmp / "logs-baseline" / f"conf-{ports['baseline']}")
        for rnd in range(args.rounds):
            order = list(procs)[rnd % len(procs):] + list(procs)[: rnd % len(procs)]
            for transport in ("absolute-form", "connect+tls"):
                for name in order:
                    bare = name == "mitmdump"
                    if transport == "absolute-form":
                        url = f"https://127.0.0.1:{up + 1}/v1/ping" if bare else f"https://{bp.HOST}/v1/ping"
                        make = bp._client_absolute(ports[name], url, None if bare else lease)
                    else:
                        host, port = ("127.0.0.1", up + 1) if bare else (bp.HOST, 443)
                        make = bp._client_connect(ports[name], host, port, cas[name], None if bare else lease)
                    thr = bp._run(make, args.requests, bp.CONCURRENCY)
                    lat = bp._run(make, args.latency_requests, 1)
                    assert thr["errors"] == lat["errors"] == 0, (name, transport, thr, lat)
                    rps.setdefault((name, transport), []).append(thr["rps"])
                    p50.setdefault((name, transport), []).append(lat["p50_ms"])
                    print(f"round {rnd + 1} {name:9s} {transport:13s} {thr['rps']:6.0f} req/s (c={bp.CONCURRENCY})  p50 {lat['p50_ms']:5.2f} ms (c=1)", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)
        server.terminate()
    print()
    for transport in ("absolute-form", "connect+tls"):
        bare_rps, bare_p50 = statistics.median(rps[("mitmdump", transport)]), statistics.median(p50[("mitmdump", transport)])
        for name in [n for n in procs if n != "mitmdump"]:
            ours, lat = statistics.median(rps[(name, transport)]), statistics.median(p50[(name, transport)])
            print(f"{name:9s}/mitmdump {transport:13s}: median throughput {ours:5.0f} / {bare_rps:5.0f} req/s = {ours / bare_rps:6.1%}"
                  f"   p50 {lat:5.2f} vs {bare_p50:5.2f} ms ({lat - bare_p50:+.2f} ms)")
    from egress_proxy.audit import OWN_KINDS, verify
    from egress_proxy.keys import load_audit_key

    events = [e for e in map(json.loads, audit.read_bytes().splitlines()) if e["kind"] not in OWN_KINDS]
    decisions = [e for e in events if e["kind"] == "request"]
    allows = {e["id"] for e in decisions if e["decision"] == "allow"}
    outcomes = [e["id"] for e in events if e["kind"] == "outcome" and e["of"] == "request"]
    result = verify(audit.parent, key=load_audit_key(env.keys))
    print(f"egresslaw audit log: {len(decisions)} request decisions ({len(allows)} allow), {len(outcomes)} outcomes, "
          f"unlinked {len(allows ^ set(outcomes))}, verify: {result.status}")
    return 0 if result.status == "intact" and allows == set(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
