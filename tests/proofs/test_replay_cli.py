"""Replay every printed counterexample through decide(); the CLI's exit codes, formats and the forced timeout."""

from __future__ import annotations

import ipaddress
import json

import pytest

from catalog import load_catalog
from compiler.artifact import load_artifact
from egress_proxy.decision.adapter import decide
from egress_proxy.decision.addresses import judge_ip
from egresslaw.cli import main
from proofs.decode import request_from_dict
from proofs.diff import semantic_diff
from proofs.gate import GateError, check_report
from proofs.properties import subject_lease
from proofs.report import load_report
from tests.proofs.helpers import (
    artifact,
    connection,
    github,
    profile,
    prove_one,
    rule,
    worker,
)

TABLE = load_catalog("2026.11").special_purpose


def _bad_artifact():
    return artifact(
        connections=[
            github("edge", extra_headers=("X-Forwarded-Host",)),
            connection("hooks", [rule("post", "hooks.example.org", "/v1", ["POST"], ["content-type"])], worker="legacy"),
        ],
        profiles=[profile("build", [("pypi.org", 443)], trust="adversarial")],
        workers=[worker("edge", allow_cidrs=("100.64.0.0/10", "fd00::/8")), worker("legacy", follow_redirects=True)],
    )


def test_every_counterexample_replays_through_decide(tmp_path):
    """Feed each refuted result's request back through the real decide() (via the JSON report) and see the violation."""
    old = artifact(connections=[github("edge")], workers=[worker("edge")])
    art = _bad_artifact()
    report = load_report(prove_one(art, old).to_json())
    refuted = [r for r in report.results if r.verdict == "refuted"]
    assert {r.property for r in refuted} == {"public-only", "no-redirect", "header-safety", "trust-lane", "no-widening"}
    for res in refuted:
        cex = res.counterexample
        kind, name = res.subject.split(":", 1)
        if kind == "worker":
            if res.property == "public-only":
                ip = cex["resolved_ips"][0]
                w = art.worker(name)
                assert judge_ip(ip, w, TABLE)[0]  # the worker admits it ...
                assert cex["ip_range"] is not None  # ... and it (or what it embeds) is in the table
                assert TABLE.lookup(ipaddress.ip_address(cex["ip_range"]["address"])) is not None
            else:
                assert art.worker(name).follow_redirects and cex["redirect_chain"]
            continue
        req = request_from_dict(cex["request"])
        d = decide(art, subject_lease(kind, name), req, cex["resolved_ips"])
        assert d.allowed and d.reason == "allowed", (res, d)
        if res.property == "public-only":
            ip = ipaddress.ip_address(cex["resolved_ips"][0])
            assert TABLE.lookup(ip) is not None or cex["ip_range"]["address"] != str(ip)
        elif res.property == "header-safety":
            assert d.rule == cex["rule"] and cex["header"] in {h.lower() for h in art.connection(name).rules[0].headers}
        elif res.property == "no-widening":
            assert not decide(old, subject_lease(kind, name), req, cex["resolved_ips"]).allowed
        elif res.property == "no-redirect":
            assert cex["redirect_chain"][0]["issued"]


def test_semantic_diff_examples_replay():
    old = artifact(connections=[github()])
    new = artifact(connections=[github(version=2, admin=True)], profiles=[profile("ci", [("pypi.org", 443)])])
    diff = semantic_diff(old, new)
    assert not diff.same and diff.added == ("profile:ci",)
    assert diff.widened and all(e.direction == "widened" for e in diff.examples)
    for e in diff.examples:
        assert decide(new, subject_lease("connection", "github"), e.request, list(e.resolved_ips)).allowed
        assert not decide(old, subject_lease("connection", "github"), e.request, list(e.resolved_ips)).allowed
        assert e.new["rule"] == "admin" and e.request.method == "POST"
    assert semantic_diff(old, old).same


def _write(tmp_path, name, art):
    p = tmp_path / name
    p.write_text(art.to_json())
    return str(p)


def test_cli_prove_exit_codes_and_formats(tmp_path, capsys):
    good = _write(tmp_path, "good.json", artifact(connections=[github()]))
    out = tmp_path / "proof.json"
    assert main(["prove", good, "-o", str(out)]) == 0
    check_report(out.read_text(), load_artifact(open(good).read()), allow_unsigned=True)  # the gate accepts it (in development)
    assert "0 refuted, 0 unknown" in capsys.readouterr().out
    bad = _write(tmp_path, "bad.json", _bad_artifact())
    assert main(["prove", bad, "-o", str(tmp_path / "bad-proof.json"), "--format", "sarif"]) == 1
    sarif = json.loads(capsys.readouterr().out)
    assert sarif["version"] == "2.1.0"
    assert {r["ruleId"] for r in sarif["runs"][0]["results"] if r["level"] == "error"} >= {"public-only", "trust-lane"}
    assert main(["prove", bad, "-o", "", "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out)["format"] == "egresslaw.proof/2"


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "egresslaw.artifact/1"}')
    assert main(["prove", str(broken), "-o", ""]) == 2
    assert "artifact is malformed" in capsys.readouterr().err
    assert main(["prove", str(tmp_path / "missing.json")]) == 2
    good = _write(tmp_path, "good.json", artifact())
    assert main(["prove", good, "--jobs", "0"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["prove"])
    assert exc.value.code == 2


def test_forced_wall_clock_limit_is_unknown_and_exit_4(tmp_path, capsys):
    cidrs = tuple(str(ipaddress.IPv4Network((0x08000000 + i * 256, 24))) for i in range(400))
    art = artifact(connections=[github("edge")], workers=[worker("edge", deny_cidrs=cidrs)])
    path = _write(tmp_path, "slow.json", art)
    out = tmp_path / "proof.json"
    assert main(["prove", path, "-o", str(out), "--timeout-ms", "1"]) == 4
    report = load_report(out.read_text())
    unknown = [r for r in report.results if r.verdict == "unknown"]
    assert unknown and all(r.detail == "solver gave no answer: wall-clock limit (0.001 s)" for r in unknown)
    assert "wall-clock limit (0.001 s)" in capsys.readouterr().out
    with pytest.raises(GateError, match="does not prove"):
        check_report(out.read_text(), art, allow_unsigned=True)


def test_resource_limit_is_unknown_never_proved(tmp_path):
    path = _write(tmp_path, "a.json", artifact(connections=[github()]))
    out = tmp_path / "proof.json"
    assert main(["prove", path, "-o", str(out), "--rlimit", "1"]) == 4
    report = load_report(out.read_text())
    unknown = [r for r in report.results if r.verdict == "unknown"]
    assert unknown and all(r.detail == "solver gave no answer: rlimit exhausted (budget 1)" for r in unknown)
    assert report.budget == {"rlimit": 1, "rlimit_scope": "solver call", "wall_clock_ms": 600_000, "seed": 0}


def test_cli_diff(tmp_path, capsys):
    a = _write(tmp_path, "a.json", artifact(connections=[github()]))
    b = _write(tmp_path, "b.json", artifact(connections=[github(version=2, admin=True)]))
    assert main(["diff", a, a]) == 0
    assert "same requests" in capsys.readouterr().out
    assert main(["diff", a, b]) == 1
    text = capsys.readouterr().out
    assert "POST https://api.github.com/v2/admin" in text and "old DENY (path-not-allowed)" in text
    assert main(["diff", a, b, "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out)["examples"][0]["new"]["rule"] == "admin"


def test_jobs_do_not_change_the_report(tmp_path):
    art = _bad_artifact()
    from proofs.runner import prove

    one, two = prove(art, jobs=1), prove(art, jobs=2)
    strip = lambda r: [(x.key, x.verdict, x.counterexample, x.detail) for x in r.results]  # noqa: E731
    assert strip(one) == strip(two)


def test_against_a_lock_file_proves_no_widening_against_the_published_state(tmp_path):
    from compiler.lock import apply_lock, render_lock

    published = artifact(connections=[github()])
    lock = tmp_path / "egresslaw.lock"
    lock.write_text(render_lock(apply_lock(published, None).lock))
    new = _write(tmp_path, "new.json", artifact(connections=[github(admin=True)]))
    out = tmp_path / "proof.json"
    assert main(["prove", new, "--against", str(lock), "-o", str(out)]) == 1
    res = [r for r in load_report(out.read_text()).results if r.property == "no-widening"]
    assert [r.verdict for r in res] == ["refuted"] and res[0].counterexample["rule"] == "admin"


def test_widenings_for_compile_use_the_lock_keys():
    from proofs.diff import widenings

    old = artifact(connections=[github()], profiles=[profile("ci", [("pypi.org", 443)])])
    new = artifact(connections=[github(admin=True)], profiles=[profile("ci", [("pypi.org", 443), ("files.pythonhosted.org", 443)])])
    found = dict(widenings(old, new))
    assert set(found) == {"connection:github", "sandbox_profile:ci"}
    assert "new ALLOW (rule `admin`)" in found["connection:github"]
    assert "files.pythonhosted.org" in found["sandbox_profile:ci"]
    assert widenings(old, old) == []
