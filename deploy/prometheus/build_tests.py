"""The cases of egresslaw-rules.test.yaml (promtool's unit tests), written once here; the file is their rendering.

    python deploy/prometheus/build_tests.py > deploy/prometheus/egresslaw-rules.test.yaml

Each case gives input series, when to evaluate, and which label sets must fire then (an empty list: silence). promtool
compares annotations too, so the expected ones are the rules' own, rendered for each case's labels: editing a
description needs only this command again. tests/deploy/test_alerts.py checks the committed file is this output.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parent / "egresslaw-rules.yaml"
rules = yaml.safe_load(RULES.read_text())
alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}

INSTANCE = {"instance": "egresslaw-0:9090", "job": "egresslaw"}  # every series' target unless a case says otherwise
AGGREGATED = {"__aggregated__": ""}  # an alert of an aggregation: it carries the rule's labels only, no target's


def fill(text: str, labels: dict) -> str:
    """An annotation rendered for `labels` (the rules' templates use `{{ $labels.NAME }}` only)."""
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)


def expected(name: str, labels: dict) -> dict:
    rule = alerts[name]
    labels = dict(rule["labels"]) if "__aggregated__" in labels else {**INSTANCE, **labels, **rule["labels"]}
    return {"exp_labels": labels, "exp_annotations": {k: fill(v, labels) for k, v in rule["annotations"].items()}}


def s(metric: str, labels: dict, values: str) -> dict:
    """One input series of `metric` on the default target (labels override), in promtool's expanding notation."""
    labels = {**INSTANCE, **labels}
    return {"series": metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", "values": values}


tests: list[dict] = []


def case(name: str, series: list[dict], evals: list[tuple[str, str, list[dict]]]) -> None:
    """`evals`: (eval time, alert, the label sets that must fire then; [] for silence)."""
    tests.append({"name": name, "interval": "1m", "input_series": series,
                  "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": [expected(alert, labels) for labels in fire]}
                                      for at, alert, fire in evals]})


case("a refused reload fires; reloads that succeed do not",
     [s("egresslaw_reloads_total", {"result": "failed"}, "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1"),
      s("egresslaw_reloads_total", {"result": "ok", "instance": "egresslaw-1:9090"}, "0 1 2 3 4 5")],
     [("2m", "EgresslawReloadRefused", []), ("5m", "EgresslawReloadRefused", [{"result": "failed"}]),
      ("20m", "EgresslawReloadRefused", [])])
BI = {"version": "0.1.0", "core": "c0ffee", "artifact": "a1"}
case("an unproved artifact fires after a minute; a proved one never",
     [s("egresslaw_build_info", {**BI, "proved": "false"}, "1x10"),
      s("egresslaw_build_info", {**BI, "proved": "true", "instance": "egresslaw-1:9090"}, "1x10")],
     [("0m", "EgresslawUnprovedArtifact", []), ("2m", "EgresslawUnprovedArtifact", [{**BI, "proved": "false"}])])
case("two artifacts for 30 minutes fire; one artifact everywhere does not",
     [s("egresslaw_build_info", {**BI, "proved": "true"}, "1x45"),
      s("egresslaw_build_info", {**BI, "artifact": "a2", "proved": "true", "instance": "egresslaw-1:9090"}, "_x10 1x35"),
      s("egresslaw_build_info", {**BI, "artifact": "a2", "proved": "true", "instance": "egresslaw-2:9090"}, "1x45")],
     [("5m", "EgresslawArtifactSkew", []), ("25m", "EgresslawArtifactSkew", []), ("41m", "EgresslawArtifactSkew", [AGGREGATED])])
case("custody down for 2 minutes fires; a blip does not",
     [s("egresslaw_custody_reachable", {}, "1 0 1 1 0 0 0 0 0"),
      s("egresslaw_custody_reachable", {"instance": "egresslaw-1:9090"}, "1x8")],
     [("1m", "EgresslawCustodyUnreachable", []), ("3m", "EgresslawCustodyUnreachable", []),
      ("7m", "EgresslawCustodyUnreachable", [{}])])
case("a mint denial fires, also as a new series' first sample; old denials, allowed mints and other denials do not",
     [s("egresslaw_decisions_total", {"kind": "mint", "decision": "deny", "reason": "credential-mint-failed"}, "_ _ _ 1x40"),
      s("egresslaw_decisions_total", {"kind": "mint", "decision": "deny", "reason": "credential-record-invalid", "instance": "egresslaw-1:9090"}, "3x20 5x20"),
      s("egresslaw_decisions_total", {"kind": "mint", "decision": "allow", "reason": "minted"}, "0+5x40"),
      s("egresslaw_decisions_total", {"kind": "request", "decision": "deny", "reason": "host-not-allowed"}, "0+5x40")],
     [("4m", "EgresslawMintFailing", [{"kind": "mint", "decision": "deny", "reason": "credential-mint-failed"},
                                       {"kind": "mint", "decision": "deny", "reason": "credential-record-invalid", "instance": "egresslaw-1:9090"}]),
      ("18m", "EgresslawMintFailing", []),
      ("22m", "EgresslawMintFailing", [{"kind": "mint", "decision": "deny", "reason": "credential-record-invalid", "instance": "egresslaw-1:9090"}])])
case("would-deny fires in an enforced fleet, not where observe mode is declared",
     [s("egresslaw_would_deny_total", {"kind": "request", "reason": "host-not-allowed"}, "_ _ 1 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2"),
      s("egresslaw_would_deny_total", {"kind": "request", "reason": "host-not-allowed", "egresslaw_mode": "observe", "instance": "egresslaw-1:9090"}, "_ _ 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23")],
     [("1m", "EgresslawWouldDeny", []),
      ("3m", "EgresslawWouldDeny", [{"kind": "request", "reason": "host-not-allowed"}]),
      ("24m", "EgresslawWouldDeny", [])])
case("an audit write failure fires; a healthy writer does not",
     [s("egresslaw_audit_write_failures_total", {"op": "fsync"}, "0 0 0 1 1 1 1 1 1 1 1 1"),
      s("egresslaw_audit_write_failures_total", {"op": "write"}, "0x11")],
     [("2m", "EgresslawAuditWriteFailing", []), ("4m", "EgresslawAuditWriteFailing", [{"op": "fsync"}]),
      ("11m", "EgresslawAuditWriteFailing", [])])
case("an exporter down for 5 minutes fires; a restart does not",
     [s("egresslaw_audit_export_up", {}, "1 0 1 1 0 0 0 0 0 0 0"),
      s("egresslaw_audit_export_up", {"instance": "egresslaw-1:9090"}, "1x10")],
     [("2m", "EgresslawAuditExportDown", []), ("9m", "EgresslawAuditExportDown", [{}])])
case("a lag over 15 minutes for 10 minutes fires; a short lag does not",
     [s("egresslaw_audit_export_lag_seconds", {}, "0 0 0+60x30"),
      s("egresslaw_audit_export_lag_seconds", {"instance": "egresslaw-1:9090"}, "0 30 0 45 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0")],
     [("20m", "EgresslawAuditExportLagging", []), ("29m", "EgresslawAuditExportLagging", [{}])])
case("a backlog past 16 MiB that grows for 30 minutes fires; one that drains, or grows with traffic below the floor, does not",
     [s("egresslaw_audit_export_backlog_bytes", {}, "0+1000000x70"),
      s("egresslaw_audit_export_backlog_bytes", {"instance": "egresslaw-1:9090"}, "5000 0 4000 0 3000 0 2000 0 1000 0 0x60"),
      s("egresslaw_audit_export_backlog_bytes", {"instance": "egresslaw-2:9090"}, "0+20000x70")],
     [("20m", "EgresslawAuditExportBacklogGrowing", []), ("65m", "EgresslawAuditExportBacklogGrowing", [{}])])
case("a broken chain fires at once; an intact one does not",
     [s("egresslaw_audit_export_broken", {}, "0 0 1 1"),
      s("egresslaw_audit_export_broken", {"instance": "egresslaw-1:9090"}, "0 0 0 0")],
     [("1m", "EgresslawAuditExportBroken", []), ("2m", "EgresslawAuditExportBroken", [{}])])
NEW_POD = {"instance": "egresslaw-2:9090"}  # a restarted pod: a new series whose first sample holds a gap found at start-up
case("a gap fires for an hour, also in a new series' first sample; no gap never",
     [s("egresslaw_audit_export_gaps_total", {}, "0 0 1 1x120"),
      s("egresslaw_audit_export_gaps_total", {"instance": "egresslaw-1:9090"}, "0x120"),
      s("egresslaw_audit_export_gaps_total", NEW_POD, "_x40 1x80")],
     [("1m", "EgresslawAuditExportGap", []), ("3m", "EgresslawAuditExportGap", [{}]), ("42m", "EgresslawAuditExportGap", [{}, NEW_POD]),
      ("110m", "EgresslawAuditExportGap", [])])
case("rejected records fire, also in a new series' first sample; none rejected does not",
     [s("egresslaw_audit_export_rejected_total", {}, "0 0 4 4x120"),
      s("egresslaw_audit_export_rejected_total", {"instance": "egresslaw-1:9090"}, "0x120"),
      s("egresslaw_audit_export_rejected_total", NEW_POD, "_x40 3x80")],
     [("1m", "EgresslawAuditExportRejected", []), ("3m", "EgresslawAuditExportRejected", [{}]),
      ("42m", "EgresslawAuditExportRejected", [{}, NEW_POD]), ("110m", "EgresslawAuditExportRejected", [])])

head = """# promtool unit tests for egresslaw-rules.yaml: `promtool test rules deploy/prometheus/egresslaw-rules.test.yaml`.
# Generated by build_tests.py (the cases are written there): edit that, then
#   python deploy/prometheus/build_tests.py > deploy/prometheus/egresslaw-rules.test.yaml
# Every alert fires in at least one case and stays silent in a healthy one (tests/deploy/test_alerts.py checks both).
# The expected annotations are the rules' own, rendered for the case's labels.
"""
out = {"rule_files": ["egresslaw-rules.yaml"], "evaluation_interval": "1m", "tests": tests}


def render() -> str:
    return head + yaml.safe_dump(out, sort_keys=False, width=200, allow_unicode=True)


if __name__ == "__main__":
    sys.stdout.write(render())
