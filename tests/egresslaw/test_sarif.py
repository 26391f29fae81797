"""Every SARIF document egresslaw writes validates against the official 2.1.0 schema and places every
result on a line; `--format github` writes workflow annotations for the same results."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"
SCHEMA = ROOT / "tests" / "schemas" / "sarif-schema-2.1.0.json"
VALIDATOR = jsonschema.Draft4Validator(json.loads(SCHEMA.read_text()), format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)
ANNOTATION = re.compile(r"^::(error|warning|notice) file=([^,]+),line=(\d+),endLine=\d+,col=\d+(,endColumn=\d+)?,title=[^:]+::.+$")


def placed(doc: dict, *, on_policy: bool = True) -> list[tuple[str, int, dict]]:
    """Validate `doc` against the schema; return (uri, start line, result) for every result, each of which must be placed."""
    errors = sorted(VALIDATOR.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    out = []
    for result in doc["runs"][0]["results"]:
        physical = result["locations"][0]["physicalLocation"]
        uri, line = physical["artifactLocation"]["uri"], physical.get("region", {}).get("startLine", 0)
        if on_policy:
            assert uri.endswith(".egress") and line >= 1, result
        out.append((uri, line, result))
    return out


def line_of(uri: str, line: int) -> str:
    return Path(uri).read_text().splitlines()[line - 1]


@pytest.fixture
def policy(tmp_path, monkeypatch):
    """The demo, compiled from a working directory (as CI runs it), so SARIF paths are relative."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(DEMO, tmp_path / "policy")
    return Path("policy")


def test_the_shipped_schema_is_the_recorded_one():
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == "c3b4bb2d6093897483348925aaa73af03b3e3f4bd4ca38cef26dcb4212a2682e"
    assert json.loads(SCHEMA.read_text())["id"].endswith("/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json")


def test_the_validator_catches_what_prove_used_to_write():
    bad = {"version": "2.1.0", "runs": [{"tool": {"driver": {"name": "x"}}, "results": [
        {"message": {"text": "m"}, "logicalLocations": [{"fullyQualifiedName": "w/s"}]}]}]}
    assert list(VALIDATOR.iter_errors(bad))  # `logicalLocations` directly on a result is invalid


def test_check_sarif_for_errors_and_io(cli, tmp_path):
    code, out, _ = cli("check", ROOT / "tests" / "golden" / "many-errors" / "input.egress", "--format", "sarif")
    assert code == 1 and len(placed(json.loads(out))) > 5
    code, out, _ = cli("check", tmp_path / "missing", "--format", "sarif")
    (uri, line, result), = placed(json.loads(out), on_policy=False)
    assert code == 2 and result["ruleId"] == "EL0035" and uri == str(tmp_path / "missing")


def test_prove_sarif_places_every_check_on_its_policy_line(cli, policy):
    assert cli("compile", policy, "-o", "a.json")[0] == 0
    code, out, _ = cli("prove", "a.json", "-o", "p.json", "--format", "sarif")
    results = placed(json.loads(out))
    assert code == 0 and len(results) == 92
    for uri, line, result in results:
        assert result["kind"] == "pass" and "logicalLocations" not in result
        name = result["properties"]["subject"].split(":", 1)[1]
        text = line_of(uri, line)
        assert name in text or "=" in text or "workspace" in text, (result["properties"], text)


def test_a_refutation_points_at_the_setting_at_fault(cli, policy):
    workers = policy / "workers.egress"
    workers.write_text(workers.read_text().replace('deny_cidrs = ["192.0.2.0/24"]', 'deny_cidrs = ["192.0.2.0/24"]\n  allow_cidrs = ["100.64.0.0/10"]'))
    assert cli("compile", policy, "-o", "a.json", "--allow-widening")[0] == 0
    code, out, _ = cli("prove", "a.json", "-o", "p.json", "--format", "sarif")
    refuted = [(u, n, r) for u, n, r in placed(json.loads(out)) if r["kind"] == "fail"]
    assert code == 1 and refuted
    for uri, line, result in refuted:
        if result["ruleId"] == "public-only":
            assert uri == str(workers) and "allow_cidrs" in line_of(uri, line)
    code, out, _ = cli("prove", "a.json", "-o", "p.json", "--format", "github")
    lines = out.splitlines()
    assert code == 1 and lines and all(ANNOTATION.match(x) for x in lines)
    assert any(x.startswith(f"::error file={workers},line=") and "title=public-only refuted::" in x for x in lines)


def test_diff_sarif_and_github(cli, policy):
    assert cli("compile", policy, "-o", "old.json")[0] == 0
    github = policy / "github.egress"
    github.write_text(github.read_text().replace('path_prefix = "/repos/acme/"', 'path_prefix = "/repos/"', 1).replace('connection "status-hook"', 'connection "status-hook-2"'))
    assert cli("compile", policy, "-o", "new.json", "--allow-widening")[0] == 0
    code, out, _ = cli("diff", "old.json", "new.json", "--format", "sarif")
    results = placed(json.loads(out))
    assert code == 1
    kinds = {r["ruleId"] for _, _, r in results}
    assert {"widened", "subject-added", "subject-removed"} <= kinds
    for uri, line, result in results:
        if result["ruleId"] == "widened":
            assert 'egress "read-repos"' in line_of(uri, line)
    code, out, _ = cli("diff", "old.json", "new.json", "--format", "github")
    assert code == 1 and all(ANNOTATION.match(x) for x in out.splitlines())
    assert any(x.startswith("::warning file=policy/github.egress,line=") and "title=widened::" in x for x in out.splitlines())


def test_locked_drift_is_reported_as_results(cli, policy):
    assert cli("compile", policy, "-o", "a.json")[0] == 0
    sandboxes = policy / "sandboxes.egress"
    sandboxes.write_text(sandboxes.read_text().replace('"codeload.github.com"', '"codeload.github.com", "objects.githubusercontent.com"'))
    github = policy / "github.egress"
    text = github.read_text()
    github.write_text(text[: text.index('connection "status-hook"')])  # remove a published connection
    for fmt in ("json", "sarif", "github"):
        code, out, err = cli("compile", policy, "-o", "a.json", "--locked", "--format", fmt)
        assert code == 3 and out.strip(), (fmt, err)
        if fmt == "json":
            found = {(d["code"], Path(d["path"]).name, d["line"] > 0) for d in json.loads(out)["diagnostics"]}
            assert found == {("EL0038", "sandboxes.egress", True), ("EL0038", "egresslaw.lock", True)}
        elif fmt == "sarif":
            results = placed(json.loads(out), on_policy=False)
            by_file = {Path(uri).name: (line, r) for uri, line, r in results}
            line, result = by_file["sandboxes.egress"]
            assert 'sandbox_profile "package-builder"' in line_of(str(sandboxes), line)
            assert "+objects.githubusercontent.com:443" in result["message"]["text"]
            line, result = by_file["egresslaw.lock"]
            assert '"connection:status-hook": {' in line_of(str(policy / "egresslaw.lock"), line)
        else:
            assert all(ANNOTATION.match(x) for x in out.splitlines()) and out.count("::error ") == 2


def test_an_unapproved_widening_is_placed_on_its_subject(cli, policy):
    assert cli("compile", policy, "-o", "a.json")[0] == 0
    github = policy / "github.egress"
    github.write_text(github.read_text().replace('path_prefix = "/repos/acme/"', 'path_prefix = "/repos/"', 1))
    code, out, _ = cli("compile", policy, "-o", "a.json", "--format", "sarif")
    ((uri, line, result),) = placed(json.loads(out))
    assert code == 1 and result["ruleId"] == "EL0037" and 'connection "github"' in line_of(uri, line)


def test_check_github_annotations(cli):
    code, out, err = cli("check", ROOT / "policies" / "examples" / "EL0010-host-wildcard.egress", "--format", "github")
    assert code == 1 and err == ""
    assert out == (
        "::error file=" + str(ROOT / "policies/examples/EL0010-host-wildcard.egress")
        + ",line=8,endLine=8,col=12,endColumn=26,title=EL0010 host-wildcard::wildcard host `*.github.com`%0Ahelp: list each exact host you need\n"
    )
