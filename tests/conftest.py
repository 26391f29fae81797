"""Fixtures shared by every test directory that runs the real proxy (tests/egress_proxy, tests/conformance)."""

from __future__ import annotations

import pytest

from tests.proxy_harness import HOSTS, Pki, Upstream, _issue, start_upstream


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
