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


# The few tests that take minutes (they build virtualenvs and images, or run the whole walk-through): started first,
# so that on a loaded 2-core machine none of them begins when the rest of the suite is nearly done (`make test` runs
# with `--dist worksteal`: the other worker takes the remaining tests while these run).
HEAVIEST = (
    "tests/egresslaw/test_pre_commit.py::test_the_python_hook_builds_its_own_python3_12_env",
    "tests/test_packaging.py::test_a_wheel_built_from_the_sdist_installs",
    "tests/deploy/test_image_build.py::test_the_build_stage_makes_a_venv",
    "tests/test_readme.py::test_the_walkthrough_runs_as_written",
    "tests/proofs/test_gate.py::test_the_proxy_refuses_partial_foreign",
    "tests/egress_proxy/test_proxy_e2e.py::test_cli_real_pipeline",
    "tests/egress_proxy/run/test_exporter.py::test_every_line_arrives",  # a 30 s collector outage, waited out
)


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item) -> int:
        for i, prefix in enumerate(HEAVIEST):
            if item.nodeid.startswith(prefix):
                return i
        return len(HEAVIEST)

    items.sort(key=rank)  # stable: every other test keeps its collection order
