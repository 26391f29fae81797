"""The proof report: load/round-trip, exit codes, renderings (the gate: test_gate.py)."""

import json

import pytest

from proofs.report import REPORT_FORMAT, Report, ReportError, Result, load_report


def _report(*verdicts: str, digest: str = "d" * 64) -> Report:
    results = [
        Result("edge", f"connection:c{i}", "public-only", v, 3, None if v != "refuted" else {"summary": "x"}, "")
        for i, v in enumerate(verdicts)
    ]
    return Report(digest, "4.15.0", "2026.11", "2026-10-14", tuple(results), egresslaw_version="0.1.0", core_digest="c" * 64)


def test_round_trip_and_format_fields():
    report = _report("proved", "proved")
    doc = json.loads(report.to_json())
    assert doc["format"] == REPORT_FORMAT
    assert doc["catalog"] == {"version": "2026.11", "special_purpose_date": "2026-10-14"}
    assert doc["summary"] == {"total": 2, "proved": 2, "refuted": 0, "unknown": 0}
    assert load_report(report.to_json()) == report


def test_exit_codes():
    assert _report("proved").exit_code() == 0
    assert _report("proved", "unknown").exit_code() == 4
    assert _report("unknown", "refuted").exit_code() == 1


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", '{"format": "other"}', json.dumps({"format": REPORT_FORMAT}),
     json.dumps({"format": "egresslaw.proof/1", "artifact_digest": "d", "z3_version": "x", "results": [],
                 "catalog": {"version": "v", "special_purpose_date": "s"}}),
     json.dumps({"format": REPORT_FORMAT, "artifact_digest": "d", "z3_version": "x", "results": [],
                 "catalog": {"version": "v", "special_purpose_date": "s"}}),
     json.dumps({"format": REPORT_FORMAT, "artifact_digest": "d", "z3_version": "x", "egresslaw_version": "0.1.0",
                 "core_digest": "c",
                 "catalog": {"version": "v", "special_purpose_date": "s"},
                 "results": [{"worker": "w", "subject": "s", "property": "p", "verdict": "maybe"}]})],
)
def test_malformed_reports_are_refused(text):
    with pytest.raises(ReportError):
        load_report(text)


def test_sarif_rule_ids_and_stable_fingerprints():
    a = json.loads(_report("refuted", "proved").to_sarif())
    b = json.loads(Report("d" * 64, "4.15.0", "2026.11", "2026-10-14",
                          tuple(Result(r.worker, r.subject, r.property, r.verdict, 999, r.counterexample, r.detail)
                                for r in _report("refuted", "proved").results), egresslaw_version="0.1.0",
                          core_digest="c" * 64).to_sarif())
    assert a["version"] == "2.1.0"
    res = a["runs"][0]["results"]
    assert [r["ruleId"] for r in res] == ["public-only", "public-only"]
    assert res[0]["level"] == "error" and res[1]["kind"] == "pass"
    assert [r["partialFingerprints"] for r in res] == [r["partialFingerprints"] for r in b["runs"][0]["results"]]


def test_json_is_deterministic_apart_from_time():
    a = _report("proved", "refuted")
    b = Report(a.artifact_digest, a.z3_version, a.catalog_version, a.special_purpose_date, tuple(reversed(a.results)),
               egresslaw_version="0.1.0", core_digest="c" * 64)
    assert a.to_json() == b.to_json()
