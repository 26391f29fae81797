"""Soak: the conformance load (tests/conformance/loadgen.py) for longer, through the real proxy.

    .venv/bin/python bench/soak.py [--requests 20000] [--concurrency 50]

Starts the proxy in-process (test CA, loopback upstreams, custody holding a canary, scripted resolver,
every name routed to 127.0.0.1), sends mixed allowed and denied requests over both transports, then
prints: requests, errors, events, leaks (and the audited reasons next to the expected ones). Exits 1
if there is an error, a missing or extra event, an allow without its linked outcome, a line that does not
verify under the audit key, or a leak.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conformance.conftest import launch  # noqa: E402
from tests.conformance.loadgen import run_load, summary  # noqa: E402
from tests.proxy_harness import HOSTS, _issue, start_upstream, stop_proxy  # noqa: E402


class _Dirs:
    """Just enough of pytest's tmp_path_factory for `launch`."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def mktemp(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="egresslaw-soak-") as tmp:
        dirs = _Dirs(Path(tmp))
        pki = _issue(dirs.mktemp("pki"), HOSTS)
        tls_up, http_up = start_upstream(pki), start_upstream(None)
        proxy = launch(dirs, pki, tls_up, http_up, name="soak", log_level=logging.INFO)
        try:
            figures = run_load(proxy, args.requests, args.concurrency, settle=30.0)
        finally:
            stop_proxy(proxy)
            tls_up.stop()
            http_up.stop()
    print(f"requests {figures.requests}")
    print(f"errors   {figures.errors}")
    print(f"events   {figures.events} (request {figures.request_events}, connect {figures.connect_events}, tunnels {figures.tunnels}, "
          f"outcome {figures.outcome_events}, unlinked {figures.unlinked})")
    print(f"leaks    {figures.leaks}")
    print(summary(figures))
    for sample in figures.error_samples[:10]:
        print("error:", sample)
    bad = (figures.errors or figures.leaks or not figures.chain_ok or figures.request_events != figures.requests or figures.unlinked
           or figures.audited != figures.sent or figures.connect_events != figures.tunnels)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
