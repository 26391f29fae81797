"""Fixtures shared by every test directory that runs the real proxy (tests/egress_proxy, tests/conformance)."""

from __future__ import annotations

import os

import pytest

from tests.proxy_harness import (
    HOSTS,
    Pki,
    Upstream,
    _issue,
    proof_signing_key,
    start_upstream,
)


def pytest_configure(config) -> None:
    # Every `egresslaw proxy` a test starts runs the production gate: reports signed by the test run's key
    # (tests/proxy_harness.proof_for signs them), and this key trusted.
    os.environ.setdefault("EGRESSLAW_TRUST_PROOFS", str(proof_signing_key()[1]))


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    """A test CA and a certificate for every test host name (loopback upstreams present it)."""
    return _issue(tmp_path_factory.mktemp("pki"), HOSTS)


@pytest.fixture(scope="module")
def tls_upstream(pki) -> Upstream:
    upstream = start_upstream(pki)
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def http_upstream() -> Upstream:
    upstream = start_upstream(None)
    yield upstream
    upstream.stop()
