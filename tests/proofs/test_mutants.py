"""A representative subset of the mutation set (bench/mutants.py runs all of it): one bug per area of the decision code.

Each mutant is planted in memory in a child process (import hook; no file changes) and must be caught: refuted by
the real `egresslaw prove` with a counterexample that shows the violation on the mutated code and not on the real
code, or (where the finite model cannot decide) `unknown` with exit 4 naming the operation; the equivalent one must
change no verdict. The suite mutants (the adapter and the edge, outside the proof) run in bench/mutants.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.proofs.mutants import MUTANTS, baseline, judge, run_child

SUBSET = ("rfc6052-u-octet-forgotten", "deny6-skipped", "raw-string-prefix", "x-forwarded-forwarded",
          "answers-stop-at-the-first", "every-container-judged", "broker-outside-rules", "host-dns-suffix",
          "method-case-folded", "answers-first-three", "within-block-end-open", "connection-judged-by-default",
          "normalize-prefix-drops-last-segment", "x-http-method-forwarded", "mint-answers-unjudged", "observe-every-profile")
BY_ID = {m.id: m for m in MUTANTS}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mutants")
    return workdir, {name: baseline(name, workdir) for name in ("basic", "workers", "broker", "minted")}


@pytest.mark.parametrize("mutant_id", SUBSET)
def test_prove_catches_the_mutant(mutant_id, bases):
    workdir, base = bases
    mutant = BY_ID[mutant_id]
    path, verdicts, doc = base[mutant.artifact]
    assert all(r["verdict"] == "proved" for r in doc["results"] if r["property"] != "public-only" or "teredo" not in r["subject"])
    code, report = run_child(mutant, path, workdir)
    outcome = judge(mutant, code, report, verdicts, path.read_text())
    assert outcome.ok, outcome.detail
    assert code == {"refuted": 1, "unknown": 4}[mutant.expect] if mutant.breaks else code == 0


def test_the_mutant_set():
    """Every snippet present exactly once in its module, every area and every property covered, equivalents explained."""
    sources = {m.module: Path(importlib.util.find_spec(m.module).origin).read_text() for m in MUTANTS}
    assert len(MUTANTS) >= 30 and len({m.id for m in MUTANTS}) == len(MUTANTS)
    for m in MUTANTS:
        assert sources[m.module].count(m.original) == 1, m.id
        assert m.why
        assert (m.expect == "suite") == bool(m.tests) == (m.artifact == ""), m.id
    from proofs.statements import PROPERTIES

    proved = {m.breaks for m in MUTANTS if m.breaks and m.expect != "suite"}
    assert proved == set(PROPERTIES) - {"vacuity", "trust-lane", "no-widening", "within"}  # the last two compare two artifacts
    assert {m.expect for m in MUTANTS} == {"refuted", "unknown", "suite"}
