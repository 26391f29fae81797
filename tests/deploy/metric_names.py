"""What the alert rules and the dashboard may name: the product's metric names, and the ones a PromQL expression uses.

The exposition is the product's own: the families of a real `Metrics` registry for each role (a counter `x` is
served as `x_total`, a histogram as `x_bucket`/`x_sum`/`x_count`), plus the audit exporter's metrics as the
contract's table names them (docs/audit-export.md "Metrics"; the front ends serve them from `state.json`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from egress_proxy.run.metrics import ROLES, Metrics

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "docs" / "audit-export.md"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "inf", "nan"}


def exposed() -> set[str]:
    """Every sample name a front end serves on /metrics."""
    names: set[str] = set()
    for role in ROLES:
        for family in Metrics(role).registry.collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
            else:
                names.add(family.name)
    return names | contract_exporter_metrics()


def contract_exporter_metrics() -> set[str]:
    """The exporter's metrics, from the contract's table (its rows start with a metric name in backquotes)."""
    section = CONTRACT.read_text().split("**Metrics**", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"^\| `(egresslaw_[a-z0-9_]+)` \|", section, re.MULTILINE))
    assert len(names) >= 8, names  # the table is where this list comes from: a reworded table must not empty it
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, grouping labels, functions and numbers removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    words = re.findall(r"(?<![\w.])([a-zA-Z_:][\w:]*)\s*(\()?", text)
    return {word for word, call in words if not call and word.lower() not in KEYWORDS}


def check_expressions(exprs: list[str]) -> subprocess.CompletedProcess:
    """`promtool check rules` on a rules file holding each expression as a recording rule: every one must parse."""
    rules = {"groups": [{"name": "expressions", "rules": [{"record": f"egresslaw:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "exprs.yaml")
        path.write_text(yaml.safe_dump(rules))
        return subprocess.run([PROMTOOL, "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=60)
