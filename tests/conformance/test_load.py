"""A short bounded load through the real proxy (bench/soak.py runs the long one).

2,000 requests from 20 threads, mixed allowed and denied, over both transports. Afterwards the audit
log holds exactly one request decision event per request (and one connect event per tunnel), with the
expected reason for each, one linked outcome event per allow, every line verifies under the audit key, and the canary (in any of its encodings) appears nowhere: not
in the audit log, not in the proxy's log output, not in any answer a client got.
"""

from __future__ import annotations

import logging
import os

import pytest

from tests.conformance.conftest import launch
from tests.conformance.loadgen import run_load, summary
from tests.proxy_harness import stop_proxy

pytestmark = pytest.mark.slow

TOTAL = int(os.environ.get("EGRESSLAW_LOAD_REQUESTS", "2000"))
CONCURRENCY = int(os.environ.get("EGRESSLAW_LOAD_CONCURRENCY", "20"))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, pki, tls_upstream, http_upstream):
    # INFO, as in production: DEBUG would log every hook and dominate the run.
    p = launch(tmp_path_factory, pki, tls_upstream, http_upstream, name="load", log_level=logging.INFO)
    yield p
    stop_proxy(p)


def test_bounded_load_one_event_per_request_chain_intact_no_leak(proxy, tls_upstream):
    before = tls_upstream.mark()
    figures = run_load(proxy, TOTAL, CONCURRENCY)
    print("\nload:", summary(figures))
    assert figures.errors == 0, figures.error_samples
    assert figures.request_events == figures.requests == TOTAL
    assert figures.audited == figures.sent  # the expected reason for every request, no more, no less
    assert figures.connect_events == figures.tunnels > 0
    assert figures.unlinked == 0 and figures.outcome_events > 0  # every allow has its outcome, linked by id
    assert figures.chain_ok
    assert figures.leaks == 0
    # Exactly the allowed connection requests to the TLS upstream reached it.
    allowed_upstream = sum(1 for s in tls_upstream.raw_requests()[before[2]:])
    assert allowed_upstream <= figures.sent["allowed"]
    assert any(line for line in proxy.logs.lines)  # the capture saw the proxy's output
