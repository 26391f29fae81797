"""Shared fixtures for the proxy tests: a test PKI, real loopback upstreams, keys, custody, artifact, proof.

Every address used here is loopback. Upstream names are ordinary (non-special-use) names that the
proxy resolves through an injected resolver (or `--resolve`) to public-looking addresses that are
never dialled: `--connect-to` sends the vetted connection to 127.0.0.1.
"""

from __future__ import annotations

import pytest

# The fixture code lives in tests/proxy_harness.py (shared with tests/conformance); re-exported here
# so `from tests.egress_proxy.conftest import …` keeps working.
from tests.proxy_harness import (  # noqa: F401
    CANARY,
    HOSTS,
    PUBLIC,
    WORKSPACE,
    Env,
    Pki,
    Seen,
    Upstream,
    _issue,
    assert_no_canary,
    build_artifact,
    canary_needles,
    free_port,
    make_env,
    proof_for,
    start_upstream,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    return make_env(tmp_path_factory.mktemp("edge"))
