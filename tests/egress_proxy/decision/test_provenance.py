"""The core's digest: over the decision core's own source, so a changed core makes every old proof report stale."""

from __future__ import annotations

import hashlib
from pathlib import Path

from egress_proxy.decision import provenance

ROOT = Path(__file__).resolve().parents[3]


def test_the_digest_is_over_the_decision_core_and_the_policy_data_it_reads() -> None:
    assert provenance.CORE_SOURCES == ("egress_proxy.decision.core", "compiler.constants")
    h = hashlib.sha256()
    for name, path in zip(provenance.CORE_SOURCES, ("egress_proxy/decision/core.py", "compiler/constants.py")):
        h.update(name.encode() + b"\0" + (ROOT / path).read_bytes() + b"\0")
    assert provenance.core_digest() == h.hexdigest()


def test_a_changed_core_changes_the_digest(monkeypatch) -> None:
    before = provenance.core_digest()
    real = provenance.module_source
    monkeypatch.setattr(provenance, "module_source", lambda name: real(name) + ("\n# x" if name.endswith(".core") else ""))
    assert provenance.core_digest() != before


def test_the_version() -> None:
    assert provenance.egresslaw_version()
