"""deploy/prometheus/egresslaw-rules.yaml: valid for Prometheus, every alert tested both ways, only real metrics.

`promtool check rules` (syntax, PromQL, templates) and `promtool test rules` (the unit tests in
egresslaw-rules.test.yaml, rendered from the cases in build_tests.py) run for real. Then what promtool cannot see: every alert has a case where it fires
and one where it stays silent, every metric a rule names is one the product serves, every alert says how bad it
is and what to do, and the runbook table in docs/operations.md names exactly these alerts.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.metric_names import PROMTOOL, check_expressions, exposed, metric_names

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "egresslaw-rules.yaml"
TESTS = ROOT / "deploy" / "prometheus" / "egresslaw-rules.test.yaml"
BUILD_TESTS = ROOT / "deploy" / "prometheus" / "build_tests.py"
OPERATIONS = ROOT / "docs" / "operations.md"

ALERTS = {rule["alert"]: rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule}
CASES = [case for test in yaml.safe_load(TESTS.read_text())["tests"] for case in test.get("alert_rule_test", [])]

pytestmark = pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool is not installed")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=RULES.parent, check=False, capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules():
    done = _promtool("check", "rules", RULES.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def test_the_unit_tests_pass():
    done = _promtool("test", "rules", TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_unit_tests_are_what_their_cases_render():
    spec = importlib.util.spec_from_file_location("egresslaw_rules_build_tests", BUILD_TESTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert TESTS.read_text() == module.render(), "run: python deploy/prometheus/build_tests.py > deploy/prometheus/egresslaw-rules.test.yaml"


def test_a_broken_expectation_fails_the_unit_tests(tmp_path):
    """The unit tests compare what fires (promtool passes a test file whose cases expect nothing only if nothing fires)."""
    broken = yaml.safe_load(TESTS.read_text())
    for test in broken["tests"]:
        for case in test["alert_rule_test"]:
            case["exp_alerts"] = []
    broken["rule_files"] = [str(RULES)]
    path = tmp_path / "broken.test.yaml"
    path.write_text(yaml.safe_dump(broken))
    done = _promtool("test", "rules", str(path))
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_every_alert_fires_in_a_case_and_stays_silent_in_another(name):
    mine = [case for case in CASES if case["alertname"] == name]
    assert any(case.get("exp_alerts") for case in mine), f"{name}: no test case where it fires"
    assert any(not case.get("exp_alerts") for case in mine), f"{name}: no test case where it stays silent"


def test_the_tests_name_only_alerts_that_exist():
    assert {case["alertname"] for case in CASES} <= set(ALERTS)


def test_every_metric_a_rule_names_is_served():
    served = exposed()
    for name, rule in ALERTS.items():
        used = metric_names(rule["expr"])
        assert used, f"{name}: no metric found in {rule['expr']!r}"
        assert used <= served, f"{name}: {sorted(used - served)} is not a metric egresslaw serves"


def test_the_metric_check_sees_a_wrong_name():
    assert metric_names('increase(egresslaw_reloads{result="failed"}[5m]) > 0') == {"egresslaw_reloads"}  # no `_total`
    assert "egresslaw_reloads" not in exposed() and "egresslaw_reloads_total" in exposed()
    assert metric_names("count(count by (artifact) (egresslaw_build_info)) > 1") == {"egresslaw_build_info"}
    assert not check_expressions(["rate(egresslaw_bytes_total[5m]"]).returncode == 0


def test_every_alert_says_how_bad_and_what_to_do():
    for name, rule in ALERTS.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        annotations = rule["annotations"]
        assert annotations["summary"] and len(annotations["description"]) > 80, name
        assert "docs/operations.md#alerts" in annotations["description"], name


def test_the_runbook_table_names_every_alert():
    section = OPERATIONS.read_text().split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    assert rows == set(ALERTS)
