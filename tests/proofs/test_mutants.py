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

from tests.proofs.mutants import CRASHED, MUTANTS, baseline, judge, run_child

SUBSET = ("rfc6052-u-octet-forgotten", "deny6-skipped", "raw-string-prefix", "x-forwarded-forwarded",
          "answers-stop-at-the-first", "every-container-judged", "broker-outside-rules", "host-dns-suffix",
          "method-case-folded", "answers-first-three", "within-block-end-open", "connection-judged-by-default",
          "normalize-prefix-drops-last-segment", "x-http-method-forwarded", "mint-answers-unjudged", "observe-every-profile",
          "profile-answers-skipped-in-core", "observe-skips-ip-literals", "token-endpoint-default-worker")
BY_ID = {m.id: m for m in MUTANTS}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mutants")
    return workdir, {name: baseline(name, workdir) for name in ("basic", "workers", "broker", "minted", "observed")}


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


INDEX_ERROR = ("Traceback (most recent call last):\n  File \"proofs/properties.py\", line 1, in vacuity\n"
               "IndexError: tuple index out of range\n")


@pytest.mark.parametrize(("mutant_id", "code", "stderr", "shown"), [
    ("profile-answers-skipped-in-core", 1, INDEX_ERROR, "IndexError: tuple index out of range"),  # exit 1 is no verdict here
    ("profile-answers-skipped-in-core", CRASHED, INDEX_ERROR, "prove raised (exit 70)"),
    ("profile-answers-skipped-in-core", 2, "error: something\n", "prove exited 2: error: something"),
    ("ip-literal-not-judged", -9, "", "prove exited -9"),  # an equivalent mutant whose child died changed nothing only in appearance
    ("answers-first-three", 4, INDEX_ERROR, "IndexError"),
])
def test_a_crash_fails_the_mutant_whatever_it_expects(mutant_id, code, stderr, shown):
    """A traceback, an exit code other than 0/1/4 or a dead child is a failure, reported as a crash (never a verdict)."""
    doc = {"results": [], "mutant_replays": {}, "stderr": stderr}
    outcome = judge(BY_ID[mutant_id], code, doc, {}, "")
    assert not outcome.ok and outcome.crashed
    assert outcome.detail.startswith("CRASHED: ") and shown in outcome.detail


def test_a_clean_run_is_no_crash():
    """The same report without a traceback is judged on its verdicts (here: an equivalent mutant that changed nothing)."""
    outcome = judge(BY_ID["ip-literal-not-judged"], 0, {"results": [], "mutant_replays": {}, "stderr": ""}, {}, "")
    assert outcome.ok and not outcome.crashed
