"""Reason codes: one table, documented exactly, every code the decision and the edge give is in it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from egress_proxy.decision.reasons import ALLOWED, REASONS, describe

ROOT = Path(__file__).resolve().parents[3]


def test_the_readme_reason_table_is_every_reason_as_the_proxy_says_it():
    """The `| reason | meaning |` table of docs/reference.md is REASONS exactly: no reason a denial can carry is undocumented,
    none is documented that the proxy no longer gives, and each meaning is the text the proxy uses."""
    readme = (ROOT / "docs" / "reference.md").read_text()  # the reason table
    table = readme.split("| reason | meaning |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| (.+) \|$", table, flags=re.M)
    assert len(rows) == len(table.splitlines())  # every line of the table is a reason row
    assert dict(rows) == REASONS


def test_every_reason_the_core_returns_is_a_code():
    """Each string constant the decision core returns (or hands on as a reason) is a reason code."""
    tree = ast.parse((ROOT / "egress_proxy" / "decision" / "core.py").read_text())
    returned = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            returned |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value}
    returned |= {"no-matching-rule", "profile-host-not-allowed"}  # the subjects' `miss`
    assert returned and returned <= set(REASONS), returned - set(REASONS)


def test_describe():
    assert describe("smuggling") == REASONS["smuggling"]
    assert ALLOWED == "allowed" and ALLOWED not in REASONS
