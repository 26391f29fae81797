"""Resolver under load: N concurrent CONNECTs to N distinct names through the real proxy, with a real
DNS server on 127.0.0.1 (tests/dns_standin.py) answering every query after 0.25 s.

The proxy runs in this process (as in the tests); the DNS server and the N clients run in a child
process, so they do not compete with the proxy for this interpreter's lock.

    .venv/bin/python bench/resolve.py [--connects 1500] [--delay 0.25]

Three runs in the same process, same names, same nameserver, same 5 s lookup timeout:
- baseline: what the proxy did before, blocking lookups in asyncio's default thread pool
  (as `loop.getaddrinfo` does; emulated with dnspython's blocking resolver, since getaddrinfo cannot be
  pointed at a loopback nameserver);
- instant: an injected resolver that answers at once, i.e. the proxy's own time for N CONNECTs (the
  floor: a lookup cannot finish sooner than the event loop gets back to it);
- async: the proxy's own resolver (egress_proxy/edge/resolver.py, `--nameserver` pointed at the stand-in).
Prints allowed / resolve-failed / other per run, the wall time and the load average. Exits 1 if the
asynchronous resolver let any CONNECT fail.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dns.resolver  # noqa: E402

from tests.dns_standin import DnsStandin  # noqa: E402
from tests.egress_proxy.test_resolver import connect_all, proxy_for_names  # noqa: E402
from tests.proxy_harness import HOSTS, _issue, stop_proxy  # noqa: E402

TIMEOUT = 5.0


def thread_pool_resolver(nameserver: tuple[str, int]):
    """The old behaviour: each lookup is a blocking call in the loop's default executor."""
    sync = dns.resolver.Resolver(configure=False)
    sync.nameservers = [nameserver[0]]
    sync.port = nameserver[1]
    sync.lifetime = TIMEOUT

    def lookup(host: str) -> tuple[str, ...]:
        out: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                out += [r.address for r in sync.resolve(host, rdtype, search=False)]
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                pass
        return tuple(out)

    async def resolve(host: str, port: int):
        return await asyncio.get_running_loop().run_in_executor(None, lookup, host)

    return resolve


def child(connects: int, delay: float) -> int:
    """The DNS stand-in and the clients: print the stand-in's port, read `HOST PORT LEASE`, CONNECT to every name."""
    import json

    names = [f"b{i}.fleet.acme-test.dev" for i in range(connects)]
    dns = DnsStandin({n: ["93.184.216.34"] for n in names}, delay=delay, ttl=0)
    print(dns.address[1], flush=True)
    host, port, lease = sys.stdin.readline().split()
    started = time.monotonic()
    results = asyncio.run(connect_all(host, int(port), lease, names))
    elapsed = time.monotonic() - started
    counts = collections.Counter("allowed" if status == 200 else (reason or f"status-{status}") for status, reason in results)
    print(json.dumps({"counts": counts, "elapsed": elapsed, "peak": dns.max_waiting}), flush=True)
    dns.stop()
    return 0


def run(tmp: Path, pki, names: list[str], mode: str, delay: float) -> tuple[collections.Counter, float, int]:
    import json
    import subprocess

    proc = subprocess.Popen([sys.executable, __file__, "--child", "--connects", str(len(names)), "--delay", str(delay)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    nameserver = ("127.0.0.1", int(proc.stdout.readline()))
    p = proxy_for_names(tmp / mode, pki, names, f"{nameserver[0]}:{nameserver[1]}", dns_timeout=TIMEOUT,
                        config={"max_connections_per_client": 2 * len(names)})
    try:
        if mode == "baseline":
            p.addon._resolver = thread_pool_resolver(nameserver)  # injected: replaces the proxy's own resolver
        elif mode == "instant":
            async def instant(host: str, port: int):
                return ("93.184.216.34",)

            p.addon._resolver = instant
        proc.stdin.write(f"{p.host} {p.port} {p.lease(connection='github')}\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        proc.wait(60)
    finally:
        stop_proxy(p)
        proc.kill()
    return collections.Counter(out["counts"]), out["elapsed"], out["peak"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connects", type=int, default=1500)
    parser.add_argument("--delay", type=float, default=0.25)
    parser.add_argument("--modes", default="baseline,instant,async", help="which runs, in order (default baseline,instant,async)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8 * args.connects)), hard))
    if args.child:
        return child(args.connects, args.delay)
    names = [f"b{i}.fleet.acme-test.dev" for i in range(args.connects)]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="egresslaw-resolve-") as tmp:
        pki = _issue(Path(tmp) / "pki", HOSTS)
        for mode in args.modes.split(","):
            counts, elapsed, peak = run(Path(tmp), pki, names, mode, args.delay)
            other = sum(v for k, v in counts.items() if k not in ("allowed", "resolve-failed"))
            print(f"{mode:8}  {args.connects} CONNECTs: allowed {counts['allowed']:5}  resolve-failed {counts['resolve-failed']:5}  "
                  f"other {other:3}  in {elapsed:5.1f} s  (nameserver peak {peak} queries waiting)")
            if mode == "async":
                failed = args.connects - counts["allowed"]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"nameserver delay {args.delay} s, lookup timeout {TIMEOUT:g} s, {os.cpu_count()} cores, load average {load}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
