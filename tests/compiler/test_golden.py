"""Golden files: every broken example -> its exact diagnostics; every valid case -> its exact artifact.

Regenerate after an intended change with `EGRESSLAW_UPDATE_GOLDEN=1 make test`, then review the diff.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from compiler.codes import CODES
from compiler.compile import compile_paths
from compiler.diagnostics import render_text

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "policies" / "examples").glob("*.egress"))
GOLDEN = ROOT / "tests" / "golden"
CASES = sorted(p for p in GOLDEN.iterdir() if p.is_dir() and p.name != "examples")
UPDATE = os.environ.get("EGRESSLAW_UPDATE_GOLDEN") == "1"
# Codes raised by the CLI around the compiler rather than by a policy file; tests/egresslaw covers them.
CLI_CODES = {"EL0035", "EL0036", "EL0037", "EL0038"}


def _check(expected: Path, actual: str) -> None:
    if UPDATE:
        expected.parent.mkdir(parents=True, exist_ok=True)
        expected.write_text(actual)
    assert expected.exists(), f"missing golden file {expected}; run with EGRESSLAW_UPDATE_GOLDEN=1"
    assert actual == expected.read_text()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_broken_example_diagnostics(example: Path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rel = example.relative_to(ROOT)
    result = compile_paths([rel])
    code = example.stem.split("-")[0]
    assert code in {d.code for d in result.diagnostics}, f"{rel} does not raise {code}"
    _check(GOLDEN / "examples" / f"{example.stem}.err", render_text(result.diagnostics, result.sources) + "\n")


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_golden_case(case: Path, monkeypatch):
    monkeypatch.chdir(ROOT)
    inputs = case / "input"
    if (case / "source").exists():  # a case that compiles a shipped policy in place
        rel = Path((case / "source").read_text().strip())
    else:
        rel = (inputs if inputs.is_dir() else case / "input.egress").relative_to(ROOT)
    result = compile_paths([rel])
    if (case / "expected.json").exists() or (UPDATE and result.ok):
        assert result.ok, render_text(result.diagnostics, result.sources)
        _check(case / "expected.json", result.artifact.to_json())
    else:
        assert not result.ok
        _check(case / "expected.err", render_text(result.diagnostics, result.sources) + "\n")


def test_every_code_has_an_example():
    covered = {p.stem.split("-")[0] for p in EXAMPLES}
    missing = {c.id for c in CODES} - covered - CLI_CODES
    assert not missing, f"codes without a broken example in policies/examples: {sorted(missing)}"


def test_readme_documents_every_code():
    readme = (ROOT / "docs" / "language.md").read_text()  # the code table
    documented = set(re.findall(r"^\| `?((?:EL|W)\d{4})`? \|", readme, flags=re.M))
    assert documented == {c.id for c in CODES}
