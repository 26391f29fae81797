"""The decision code's digest: over the source of every module a proof depends on, so a change to any of them (the core,
the adapter's composition, the table builders, the normalizers) makes every old proof report stale."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from egress_proxy.decision import provenance

ROOT = Path(__file__).resolve().parents[3]


def test_the_digest_is_over_every_module_of_the_proofs_scope() -> None:
    files = sorted(p for p in (ROOT / "egress_proxy/decision").glob("*.py")) + sorted((ROOT / "catalog").glob("*.py"))
    files += [ROOT / "compiler" / f for f in ("constants.py", "normalize.py", "artifact.py", "patterns.py")]
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in files}
    assert set(provenance.digest_modules()) == names  # every file of the package, none forgotten
    h = hashlib.sha256()
    for name in provenance.digest_modules():
        path = ROOT / (name.replace(".", "/") + ("/__init__.py" if (ROOT / name.replace(".", "/")).is_dir() else ".py"))
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    assert provenance.core_digest() == h.hexdigest()


@pytest.mark.parametrize("module", ["egress_proxy.decision.core", "egress_proxy.decision.adapter",
                                    "egress_proxy.decision.addresses", "compiler.normalize", "compiler.constants",
                                    "compiler.artifact", "compiler.patterns", "egress_proxy.decision.shapes", "catalog.model"])
def test_a_change_to_any_module_in_scope_changes_the_digest(monkeypatch, module) -> None:
    before = provenance.core_digest()
    real = provenance.module_source
    monkeypatch.setattr(provenance, "module_source", lambda name: real(name) + ("\n# x" if name == module else ""))
    assert provenance.core_digest() != before
