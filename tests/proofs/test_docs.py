"""The docs say what the code says: the property statements, the scope of "proved" and the mutant list are rendered
from the modules that use them (proofs/statements.py, tests/proofs/mutants.py) into docs/walkthrough.md and docs/proofs.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proofs.statements import render_properties, render_scope
from tests.proofs.mutants import render_markdown

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = {
    "properties": render_properties,
    "scope": render_scope,
    "mutants": render_markdown,
}


def block(text: str, name: str) -> str | None:
    found = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    return found.group(1) if found else None


@pytest.mark.parametrize(("doc", "names"), [("docs/proofs.md", ("properties", "scope", "mutants")),
                                            ("docs/walkthrough.md", ("properties", "scope"))])
def test_rendered_blocks_are_current(doc, names):
    text = (ROOT / doc).read_text()
    for name in names:
        expected = BLOCKS[name]()
        assert block(text, name) == expected, f"{doc}: the `{name}` block is stale; replace it with:\n{expected}"
