"""`prove --within CEILING`: a candidate inside the ceiling is proved; one step outside it, on any axis, is refuted
with a counterexample the real `decide()` replays (the property reports `unknown`, never `refuted`, when it does not).

The ceiling is a policy an operator owns; each candidate below is the ceiling with one thing widened.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from compiler.compile import compile_text
from egress_proxy.decision.adapter import decide
from proofs.decode import request_from_dict
from proofs.model import Ceiling
from proofs.properties import subject_lease
from proofs.runner import prove

CEILING = """egresslaw 1

workspace "acme"
catalog "2026.11"

worker "edge" {
  follow_redirects = false
  max_redirects = 0
  ipv6 = false
  deny_cidrs = ["192.0.2.0/24"]
}

connection "github" {
  credential = "gh"
  inject = {"header": "Authorization", "format": "Bearer {secret}"}
  worker = edge

  egress "read" {
    host = "api.github.com"
    port = 443
    path_prefix = "/repos/acme/"
    methods = ["GET", "HEAD"]
    headers = ["Accept", "User-Agent"]
  }
}

sandbox_profile "builder" {
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {
    "type": "limited",
    "allowed_hosts": ["pypi.org", "files.pythonhosted.org", "api.github.com"],
    "allow_package_managers": false,
    "allow_mcp_servers": false
  }
}
"""


def _artifact(text: str):
    result = compile_text(text, "policy.egress")
    assert result.ok, [d.message for d in result.diagnostics]
    return result.artifact


CEILING_ARTIFACT = _artifact(CEILING)


def _within(candidate_text: str, mapping: tuple[tuple[str, str], ...] = ()) -> dict[str, object]:
    """The `within` result of every subject: {subject: Result}; every other property must still be proved."""
    candidate = _artifact(candidate_text)
    report = prove(candidate, ceiling=Ceiling(CEILING_ARTIFACT, mapping), jobs=1)
    assert report.within_digest == CEILING_ARTIFACT.digest
    # capacity-within (tests/proofs/test_capacity_gate.py) refutes most widenings below too: more requests, more bits
    others = [r for r in report.results if r.property not in ("within", "capacity-within") and r.verdict != "proved"]
    assert others == [], [(r.subject, r.property, r.verdict) for r in others]
    return {r.subject: r for r in report.results if r.property == "within"}, candidate


def _replays(result, candidate, kind: str, name: str, ceiling_name: str | None = None) -> None:
    """The counterexample is real: decide() admits it under the candidate and not (or not so) under the ceiling."""
    cex = result.counterexample
    req = request_from_dict(cex["request"])
    ips = list(cex["resolved_ips"])
    mine = decide(candidate, subject_lease(kind, name), req, ips)
    theirs = decide(CEILING_ARTIFACT, subject_lease(kind, ceiling_name or name), req, ips)
    assert mine.allowed, cex
    assert cex["decision"]["allowed"] is True and cex["old_decision"]["allowed"] == theirs.allowed
    if cex.get("header"):
        assert cex["header"] in {n.lower() for n, _ in mine.forward_headers}
        assert not theirs.allowed or cex["header"] not in {n.lower() for n, _ in theirs.forward_headers}
    elif theirs.allowed:  # admitted by both: the candidate attaches a credential the ceiling does not
        assert mine.broker is not None and mine.broker != theirs.broker


def test_the_ceiling_itself_and_a_narrower_candidate_are_within():
    results, _ = _within(CEILING)
    assert {s: r.verdict for s, r in results.items()} == {"connection:github": "proved", "profile:builder": "proved"}
    narrower = (CEILING.replace('"/repos/acme/"', '"/repos/acme/app/"').replace('["GET", "HEAD"]', '["GET"]')
                .replace('["Accept", "User-Agent"]', '["Accept"]').replace('"files.pythonhosted.org", ', "")
                .replace("deny_cidrs = [\"192.0.2.0/24\"]", 'deny_cidrs = ["192.0.2.0/24", "203.0.113.0/24"]'))
    results, _ = _within(narrower)
    assert {r.verdict for r in results.values()} == {"proved"}, {s: r.counterexample for s, r in results.items()}


WIDER = [
    # (what is widened, candidate edit, the subject that exceeds, words of its counterexample)
    ("one host", ('"api.github.com"]', '"api.github.com", "evil.example.net"]'), "profile:builder", "evil.example.net"),
    ("one port", ('"pypi.org", ', '"pypi.org", "pypi.org:8443", '), "profile:builder", ":8443"),
    ("one method", ('["GET", "HEAD"]', '["GET", "HEAD", "POST"]'), "connection:github", "POST https://api.github.com/repos/acme/"),
    ("one path segment wider", ('"/repos/acme/"', '"/repos/"'), "connection:github", "https://api.github.com/repos/"),
    ("one extra header", ('["Accept", "User-Agent"]', '["Accept", "User-Agent", "X-Debug"]'), "connection:github", "X-Debug"),
    ("one extra credential attachment", ('"allow_mcp_servers": false\n  }\n', '"allow_mcp_servers": false\n  }\n  brokers = [github]\n'),
     "profile:builder", "the `github` credential here, none under the ceiling"),
    ("a laxer worker: allow_cidrs", ('deny_cidrs = ["192.0.2.0/24"]', 'deny_cidrs = ["192.0.2.0/24"]\n  allow_cidrs = ["100.64.0.0/10"]'),
     "connection:github", "ceiling DENY"),
    ("a laxer worker: ipv6", ("ipv6 = false", "ipv6 = true"), "connection:github", "ceiling DENY"),
]


@pytest.mark.parametrize(("what", "edit", "subject", "words"), WIDER, ids=[w[0] for w in WIDER])
def test_one_step_outside_the_ceiling_is_refuted_with_a_counterexample_that_replays(what, edit, subject, words):
    old, new = edit
    assert old in CEILING
    text = CEILING.replace(old, new, 1)
    if what == "a laxer worker: allow_cidrs":  # public-only refutes this too; here only `within` is asked about
        results = {r.subject: r for r in prove(_artifact(text), ceiling=Ceiling(CEILING_ARTIFACT), jobs=1).results
                   if r.property == "within"}
        candidate = _artifact(text)
    else:
        results, candidate = _within(text)
    result = results[subject]
    assert result.verdict == "refuted", (result.verdict, result.detail, result.counterexample)
    assert words in result.counterexample["summary"] + json.dumps(result.counterexample), result.counterexample["summary"]
    kind, name = subject.split(":")
    _replays(result, candidate, kind, name)
    # the other subject is untouched by the edit (except a worker change, which both may feel)
    untouched = [r for s, r in results.items() if s != subject and "worker" not in what]
    assert all(r.verdict == "proved" for r in untouched), [(r.subject, r.counterexample) for r in untouched]
    if kind == "connection" and "worker" not in what:  # placed on the rule that exceeds: SARIF and --format github
        assert result.counterexample["rule"] == "read"


def test_a_subject_the_ceiling_lacks_is_refuted_unless_mapped_onto_one():
    text = CEILING.replace('connection "github" {', 'connection "github-bot" {')
    results, candidate = _within(text)
    result = results["connection:github-bot"]
    assert result.verdict == "refuted" and "the ceiling has no connection `github-bot`" in result.counterexample["summary"]
    _replays(result, candidate, "connection", "github-bot", "github-bot")
    results, _ = _within(text, (("connection:github-bot", "github"),))
    assert results["connection:github-bot"].verdict == "proved", results["connection:github-bot"].counterexample


def test_the_cli_compiles_a_ceiling_directory_and_places_the_excess_on_its_line(tmp_path):
    ceiling, candidate = tmp_path / "ceiling", tmp_path / "candidate"
    ceiling.mkdir()
    candidate.mkdir()
    (ceiling / "policy.egress").write_text(CEILING)
    (candidate / "policy.egress").write_text(CEILING.replace('["GET", "HEAD"]', '["GET", "HEAD", "DELETE"]'))
    cli = [sys.executable, "-m", "egresslaw"]
    subprocess.run([*cli, "compile", str(candidate), "-o", str(tmp_path / "c.json")], check=True, capture_output=True)
    proc = subprocess.run([*cli, "prove", str(tmp_path / "c.json"), "-o", str(tmp_path / "p.json"), "--within", str(ceiling),
                           "--format", "github"], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if "within" in x and "capacity-within" not in x]
    methods_line = (candidate / "policy.egress").read_text().splitlines().index('    methods = ["GET", "HEAD", "DELETE"]') + 1
    assert line.startswith("::error file=") and "policy.egress" in line, line
    assert "DELETE https://api.github.com/repos/acme/" in line
    egress_line = (candidate / "policy.egress").read_text().splitlines().index('  egress "read" {') + 1
    assert f"line={egress_line}," in line or f"line={methods_line}," in line, line
    report = json.loads((tmp_path / "p.json").read_text())
    # within, and capacity-within: a third method is more a request can say
    assert report["within_digest"] and report["summary"]["refuted"] == 2
    assert {r["property"] for r in report["results"] if r["verdict"] == "refuted"} == {"within", "capacity-within"}
    # usage errors are located and say what to do, never a traceback
    for args, words in ((["--map", "connection:github=github"], "--within"),
                        (["--within", str(ceiling), "--map", "nope"], "KIND:NAME=CEILING_NAME"),
                        (["--within", str(ceiling), "--map", "connection:github=missing"], "the ceiling has no connection `missing`"),
                        (["--within", str(tmp_path / "absent.json")], "absent.json")):
        bad = subprocess.run([*cli, "prove", str(tmp_path / "c.json"), "-o", "", *args], capture_output=True, text=True)
        assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, (args, bad.stderr)


# -- the gate: --require-within DIGEST -----------------------------------------------------------------------------


def _report_text(candidate, ceiling=None) -> str:
    return prove(candidate, ceiling=Ceiling(ceiling) if ceiling is not None else None, jobs=1).to_json()


def test_the_gate_requires_within_proved_for_every_subject_against_that_ceiling():
    from proofs.gate import GateError, check_report, required_checks

    digest = CEILING_ARTIFACT.digest
    within = _report_text(CEILING_ARTIFACT, CEILING_ARTIFACT)
    report = check_report(within, CEILING_ARTIFACT, allow_unsigned=True, require_within=digest[:12])
    checked = {r.subject for r in report.results if r.property == "within"}
    assert checked == {s for w, s, p in required_checks(CEILING_ARTIFACT) if not s.startswith("worker:")}
    plain = _report_text(CEILING_ARTIFACT)
    check_report(plain, CEILING_ARTIFACT, allow_unsigned=True)  # without the requirement it is enough
    with pytest.raises(GateError, match="proves no ceiling"):
        check_report(plain, CEILING_ARTIFACT, allow_unsigned=True, require_within=digest)
    with pytest.raises(GateError, match=f"was checked within ceiling `{digest[:12]}`, not `{'0' * 12}`"):
        check_report(within, CEILING_ARTIFACT, allow_unsigned=True, require_within="0" * 64)
    # a within result dropped (the summary made to agree) is a missing required check
    doc = json.loads(within)
    doc["results"] = [r for r in doc["results"] if not (r["property"] == "within" and r["subject"] == "profile:builder")]
    doc["summary"] = {"total": len(doc["results"]), "proved": len(doc["results"]), "refuted": 0, "unknown": 0}
    with pytest.raises(GateError, match="lacks 1 required check: within for profile:builder"):
        check_report(json.dumps(doc), CEILING_ARTIFACT, allow_unsigned=True, require_within=digest)
    # a candidate that exceeds the ceiling: its honest report does not prove within
    wider = _artifact(CEILING.replace('["GET", "HEAD"]', '["GET", "HEAD", "POST"]'))
    with pytest.raises(GateError, match=r"does not prove capacity-within for connection:github \(refuted\), within for connection:github"):
        check_report(_report_text(wider, CEILING_ARTIFACT), wider, allow_unsigned=True, require_within=digest)


@pytest.mark.slow
def test_the_proxy_starts_only_with_a_report_proved_within_the_required_ceiling(tmp_path):
    import os
    import signal
    import time

    from tests.proofs.test_gate import _listening, _proxy
    from tests.proxy_harness import free_port, make_env

    env = make_env(tmp_path / "env")
    from compiler.artifact import load_artifact

    art = load_artifact(env.artifact.read_text())
    ceiling = tmp_path / "ceiling.json"
    ceiling.write_text(art.to_json())  # the operator's ceiling: here the very policy, so every subject is within
    plain, within = tmp_path / "plain.json", tmp_path / "within.json"
    plain.write_text(_report_text(art))
    within.write_text(_report_text(art, art))
    environ = {k: v for k, v in os.environ.items() if k != "EGRESSLAW_TRUST_PROOFS"}
    port, admin = free_port(), free_port()
    dev = ("--allow-unsigned-proofs",)
    for proof, extra, message in (
        (plain, ("--require-within", art.digest), "proves no ceiling, and --require-within asks for one"),
        (within, ("--require-within", "1" * 64), f"was checked within ceiling `{art.digest[:12]}`, not `111111111111`"),
        (within, ("--require-within", "xyz"), "--require-within `xyz` is not an artifact digest"),
    ):
        r = _proxy(env, port, admin, proof, *dev, *extra, environ=environ)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr)
        assert not _listening(port)
    args = [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(within), "--keys",
            str(env.keys), "--store", str(env.store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
            "--confdir", str(env.confdir), "--audit-log", str(env.audit), *dev, "--require-within", art.digest[:16]]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=environ)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "never listened"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
