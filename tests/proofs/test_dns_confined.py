"""dns-confined: a front end resolves only a subject's own declared destinations, proved over the core (a request's
`request_verdict`, a CONNECT's `connect_verdict`); observe mode said as it is; a seeded bug refuted and replayed."""

from __future__ import annotations

from compiler.artifact import load_artifact
from egress_proxy.decision.adapter import decide_connect
from proofs.gate import required_checks
from proofs.properties import subject_lease
from proofs.spec import resolution
from tests.egress_proxy.builders import oauth2
from tests.proofs.helpers import artifact, connection, github, only, profile, prove_one, rule
from tests.proofs.mutants import MUTANTS, artifact_json, baseline, judge, run_child


def _brokering():
    hooks = connection("hooks", [rule("post", "hooks.example.org", "/", ["POST"], ["content-type"])])
    drive = connection("drive", [rule("files", "www.googleapis.com", "/drive/v3", ["GET"])],
                       mint=oauth2("https://oauth2.googleapis.com/token"))
    return artifact(
        connections=[github(), hooks, drive],
        profiles=[profile("ci", [("api.github.com", 443), ("pypi.org", 443)], brokers=("github",)),
                  profile("sealed"),  # network none
                  profile("watch", [("pypi.org", 443)]).model_copy(update={"enforce": "observe"})],
    )


def test_every_subject_resolves_only_its_declared_destinations_and_the_gate_requires_it():
    art = _brokering()
    report = prove_one(art)
    assert report.exit_code() == 0, report.render_text()
    for subject in ("connection:github", "connection:hooks", "connection:drive", "profile:ci", "profile:sealed", "profile:watch"):
        assert only(report, subject, "dns-confined").verdict == "proved"
        assert ("default", subject, "dns-confined") in required_checks(art)
    # the names it may resolve, said: the brokered rule's host is the profile's own allowlist entry, nothing more
    assert only(report, "profile:ci", "dns-confined").detail == "resolves only `api.github.com`, `pypi.org`"
    assert only(report, "connection:hooks", "dns-confined").detail == "resolves only `hooks.example.org`"
    assert "token endpoint `oauth2.googleapis.com` is the artifact's own" in only(report, "connection:drive", "dns-confined").detail
    assert only(report, "profile:sealed", "dns-confined").detail.startswith("resolves no name")


def test_observe_mode_is_reported_as_not_confined():
    """A profile in observe mode resolves whatever its workload names: the result says so, rather than a bare `proved`
    that would read as confinement (what holds: a name outside its allowlist is resolved only as observed)."""
    res = only(prove_one(_brokering()), "profile:watch", "dns-confined")
    assert "observe mode: resolves the names it observes" in res.detail and "DNS is not confined" in res.detail
    assert not resolution.confined(_brokering().profile("watch"))
    assert resolution.confined(_brokering().profile("ci")) and resolution.confined(_brokering().connection("hooks"))


def test_a_connect_to_any_host_is_refuted_and_replayed(tmp_path):
    """The seeded bug: a connection's destination check skipped. Its plain requests still need a rule (no other property
    moves), but a CONNECT to any host is admitted and its name resolved: dns-confined refutes it, with the CONNECT
    replayed through the mutated `decide_connect` (admitted) and the real one (refused)."""
    mutant = next(m for m in MUTANTS if m.id == "connect-any-host")
    path, verdicts, _ = baseline(mutant.artifact, tmp_path)
    code, doc = run_child(mutant, path, tmp_path)
    outcome = judge(mutant, code, doc, verdicts, path.read_text())
    assert code == 1 and outcome.ok, outcome.detail
    refuted = {(r["subject"], r["property"]) for r in doc["results"] if r["verdict"] == "refuted"}
    assert refuted == {("connection:github", "dns-confined"), ("connection:uploads", "dns-confined")}
    cex = next(r["counterexample"] for r in doc["results"] if r["verdict"] == "refuted" and r["subject"] == "connection:github")
    connect = cex["extra"]["connect"]
    assert cex["request"]["method"] == "CONNECT" and "is admitted before any address" in cex["summary"]
    assert connect.rsplit(":", 1)[0] != "api.github.com" and cex["extra"]["resolves"] == connect
    art = load_artifact(artifact_json("basic"))
    assert not decide_connect(art, subject_lease("connection", "github"), connect).allowed  # the real core refuses it
