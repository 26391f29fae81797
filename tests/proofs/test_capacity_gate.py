"""The capacity gate (docs/budget.md, "The gate"): `prove --max-bits N[/WINDOW]` through the CLI, `capacity-within`, the
report's capacity section (loaded and signed), and how capacity moves in `diff` and `prove --against`.

The artifacts are small (two or three connections of one rule): each `prove` here takes a few seconds."""

from __future__ import annotations

import json
import math

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compiler.artifact import Budget
from egress_proxy.decision.adapter import decide, judge_body
from egress_proxy.decision.types import Lease, Request
from egresslaw.cli import main
from proofs.capacity import capacities, capacity, ceil2
from proofs.model import Ceiling
from proofs.report import load_report
from proofs.runner import MaxBits, capacity_checks, prove
from proofs.signing import sign_document, verify_document
from tests.proofs.helpers import artifact, connection, only, profile, rule

WITNESS_IPS = ["93.184.216.34"]


def _read(cap=None):
    c = connection("read", [rule("items", "api.example.com", "/items/", ["GET"])])
    return c.model_copy(update={"budget": cap}) if cap is not None else c


def _upload(cap=None):
    c = connection("upload", [rule("put", "up.example.com", "/u/", ["PUT"])])
    return c.model_copy(update={"budget": cap}) if cap is not None else c


def _write(tmp_path, name, art) -> str:
    path = tmp_path / name
    path.write_text(art.to_json())
    return str(path)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    done = capsys.readouterr()
    return code, done.out, done.err


def _replayed(art, result) -> None:
    """Both requests of a refutation's witness are admitted again by decide() (and judge_body for a judged body),
    under the rule the witness names, and they differ in the field it names."""
    w = result.counterexample["witness"]
    kind, _, name = result.subject.partition(":")
    lease = Lease(subject="test", profile=name if kind == "profile" else None,
                  connection=name if kind == "connection" else None, exp=2**62)
    seen = []
    for one in w["requests"]:
        body = one["body"].encode() if one["body"] is not None else None
        req = Request(method=one["method"], scheme=one["scheme"], host=one["host"], port=one["port"], target=one["target"],
                      headers=tuple(tuple(h) for h in one["headers"]), has_body=body is not None)
        d = decide(art, lease, req, WITNESS_IPS)
        if d.allowed and d.body_shape is not None:
            d = judge_body(art, lease, req, d, body or b"")
        assert d.allowed, (one, d.reason)
        assert d.rule == one["rule"]
        seen.append((req, body))
    assert seen[0] != seen[1]
    if w["field"] == "body":
        assert seen[0][0] == seen[1][0] and seen[0][1] != seen[1][1]


def test_max_bits_refutes_the_subject_over_budget_with_a_replayed_witness_and_proves_the_rest(tmp_path, capsys):
    sealed = profile("sealed")  # network none: admits no request, 0 bits
    art = artifact(connections=[_read(), _upload()], profiles=[sealed])
    read = capacity(art, "connection", "read")
    assert 0 < read.bits < math.inf and math.isinf(capacity(art, "connection", "upload").bits)
    budget = math.ceil(read.bits)
    path, out = _write(tmp_path, "a.json", art), str(tmp_path / "proof.json")
    code, stdout, _ = _cli(capsys, "prove", path, "-o", out, "--max-bits", str(budget), "-v")
    assert code == 1, stdout
    assert "refuted  max-bits          connection:upload (worker `default`)" in stdout
    assert "two admitted requests that differ in the body of rule `put`" in stdout
    assert "PUT https://up.example.com:443/u/" in stdout
    report = load_report(open(out).read())
    verdicts = {r.subject: r.verdict for r in report.results if r.property == "max-bits"}
    assert verdicts == {"connection:read": "proved", "connection:upload": "refuted", "profile:sealed": "proved"}
    refuted = only(report, "connection:upload", "max-bits")
    assert refuted.counterexample["field"] == "body" and refuted.counterexample["capacity"] == "unbounded"
    _replayed(art, refuted)
    # every other check is still proved: the gate adds results, it changes none
    assert all(r.verdict == "proved" for r in report.results if r.property != "max-bits")

    # one bit less and the read connection is over too, its witness in its path (the field carrying the most)
    _, results = capacity_checks(art, MaxBits(budget - 1), None)
    over = {r.subject: r for r in results if r.verdict == "refuted"}
    assert set(over) == {"connection:read", "connection:upload"}
    assert over["connection:read"].counterexample["field"] == read.top[1].name
    _replayed(art, over["connection:read"])

    # under budget: exit 0
    small = _write(tmp_path, "small.json", artifact(connections=[_read()], profiles=[sealed]))
    code, stdout, _ = _cli(capsys, "prove", small, "-o", str(tmp_path / "p2.json"), "--max-bits", str(budget))
    assert code == 0, stdout


def test_max_bits_over_a_window_counts_the_caps(tmp_path, capsys):
    """N/WINDOW bounds the figure over any interval that long: the windows it overlaps times each one's bound; a
    subject without caps is unbounded over any interval."""
    capped = _upload(Budget(window=3600, bytes=4096))
    art = artifact(connections=[capped])
    cap = capacity(art, "connection", "upload")
    hour = math.ceil(cap.over(3600))
    assert cap.over(3600) == pytest.approx(2 * cap.window_bits()) and cap.over(7200) > hour
    path = _write(tmp_path, "w.json", art)
    code, stdout, _ = _cli(capsys, "prove", path, "-o", str(tmp_path / "p.json"), "--max-bits", f"{hour}/1h")
    assert code == 0, stdout
    code, stdout, _ = _cli(capsys, "prove", path, "-o", str(tmp_path / "p.json"), "--max-bits", f"{hour}/7200")
    assert code == 1 and "over the budget of " + f"{hour} bits over any 2h" in stdout, stdout
    _replayed(art, only(load_report(open(tmp_path / "p.json").read()), "connection:upload", "max-bits"))
    # the same figure per request is unbounded without caps
    _, (uncapped,) = capacity_checks(artifact(connections=[_upload()]), MaxBits(hour, 3600), None)
    assert uncapped.verdict == "refuted" and uncapped.counterexample["capacity"] == "unbounded"


@pytest.mark.parametrize("bad", ["abc", "-1", "1e3", "nan", "inf", "", "5/", "5/0", "5/1w", "5/h", "5/-1h", "5/1h/2",
                                 "5/99999999999d"])
def test_a_bad_budget_is_a_usage_error(tmp_path, capsys, bad):
    path = _write(tmp_path, "a.json", artifact(connections=[_read()]))
    code, stdout, stderr = _cli(capsys, "prove", path, "-o", str(tmp_path / "p.json"), "--max-bits", bad)
    assert code == 2 and stdout == "", stdout
    assert stderr.startswith("error: `--max-bits") and "\nhelp: " in stderr, stderr
    assert not (tmp_path / "p.json").exists()


def test_the_report_keeps_every_subjects_capacity_and_loads_and_verifies_signed():
    art = artifact(connections=[_read(), _upload(Budget(window=900, requests=50))], profiles=[profile("ci", [("pypi.org", 443)])])
    report = prove(art, jobs=1, max_bits=MaxBits(10))
    section = report.capacity
    assert section["limits"] == {"max_head_bytes": 65536, "max_request_line": 8192, "max_headers": 100}
    assert section["clock_resolution"] == 0.001
    assert [(s["kind"], s["name"]) for s in section["subjects"]] == [("profile", "ci"), ("connection", "read"), ("connection", "upload")]
    assert [s["text"] for s in section["subjects"]] == [c.text() for c in capacities(art)]
    text = report.to_json()
    assert load_report(text) == report and load_report(text).to_json() == text
    rendered = report.render_text()
    assert "\nCapacity (" in rendered and all(f"\n  {c.text()}\n" in rendered for c in capacities(art))

    key = Ed25519PrivateKey.generate()
    doc = {**report.to_dict(), "signature": sign_document(report.to_dict(), key)}
    verify_document(json.loads(json.dumps(doc)), key.public_key())
    tampered = json.loads(json.dumps(doc))
    tampered["capacity"]["subjects"][1]["bits"] = 1
    with pytest.raises(Exception, match="signature"):
        verify_document(tampered, key.public_key())
    # a report made before capacity was counted still loads
    older = json.loads(text)
    del older["capacity"]
    assert load_report(json.dumps(older)).capacity is None


def test_diff_and_against_print_how_capacity_moved(tmp_path, capsys):
    old = artifact(connections=[_read(), _upload()])
    wider = connection("read", [rule("items", "api.example.com", "/items/", ["GET", "HEAD"])])
    new = artifact(connections=[wider, connection("extra", [rule("x", "x.example.com", "/x/", ["GET"])])])
    a, b = ceil2(capacity(old, "connection", "read").bits), ceil2(capacity(new, "connection", "read").bits)
    assert b > a
    moved = f"connection `read`: {a:,.2f} -> {b:,.2f} bits per request (+{b - a:,.2f})"
    new_line = f"connection `extra`: new, {capacity(new, 'connection', 'extra').text().split(': ', 1)[1]}"
    removed = "connection `upload`: removed (was unbounded per request (body of rule `put` (PUT; declare budget.bytes)))"
    old_path, new_path = _write(tmp_path, "old.json", old), _write(tmp_path, "new.json", new)
    code, stdout, _ = _cli(capsys, "diff", old_path, new_path)
    assert code == 1
    assert "Capacity (bits an admitted request can carry, old -> new)" in stdout
    assert f"  {moved}\n" in stdout and f"  {new_line}\n" in stdout and f"  {removed}\n" in stdout, stdout
    code, stdout, _ = _cli(capsys, "prove", new_path, "--against", old_path, "-o", str(tmp_path / "p.json"))
    assert code == 1  # no-widening refutes the HEAD
    assert f"  {moved}\n" in stdout and f"  {new_line}\n" in stdout, stdout


def test_within_refutes_a_subject_that_carries_more_than_its_ceiling(tmp_path, capsys):
    ceiling = artifact(connections=[_read(Budget(window=3600, requests=100))])
    # one more method: within and capacity-within both refute it, through the CLI
    wider = artifact(connections=[connection("read", [rule("items", "api.example.com", "/items/", ["GET", "HEAD"])]).model_copy(
        update={"budget": Budget(window=3600, requests=100)})])
    code, stdout, _ = _cli(capsys, "prove", _write(tmp_path, "c.json", wider), "--within", _write(tmp_path, "ceil.json", ceiling),
                           "-o", str(tmp_path / "p.json"))
    assert code == 1 and "refuted  capacity-within   connection:read" in stdout, stdout
    result = only(load_report(open(tmp_path / "p.json").read()), "connection:read", "capacity-within")
    assert "per request, the ceiling's `read`" in result.counterexample["summary"]
    _replayed(wider, result)
    # the same requests without the ceiling's caps: within holds, capacity-within refutes the window
    uncapped = artifact(connections=[_read()])
    report = prove(uncapped, jobs=1, ceiling=Ceiling(ceiling))
    assert only(report, "connection:read", "within").verdict == "proved"
    result = only(report, "connection:read", "capacity-within")
    assert result.verdict == "refuted" and "unbounded over any 1h" in result.counterexample["summary"], result
    _replayed(uncapped, result)
    # the ceiling itself is within
    assert only(prove(ceiling, jobs=1, ceiling=Ceiling(ceiling)), "connection:read", "capacity-within").verdict == "proved"
