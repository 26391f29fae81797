"""Credential brokering under the prover: a brokering profile proves credential-scope (and the gate requires it),
trust-lane refutes an adversarial broker written into an artifact by hand, and adding a broker is a widening."""

from __future__ import annotations

from compiler.artifact import load_artifact
from egress_proxy.decision.adapter import decide
from egress_proxy.decision.types import Lease, Request
from proofs.decode import request_from_dict
from proofs.diff import semantic_diff, widenings
from proofs.gate import required_checks
from proofs.properties import subject_lease
from tests.proofs.helpers import (
    artifact,
    connection,
    only,
    profile,
    prove_one,
    rule,
    worker,
)
from tests.proofs.mutants import artifact_json

GH = connection("gh", [rule("refs", "github.com", "/acme", ["GET", "HEAD"], ["accept"])], worker="edge")
EDGE = worker("edge", deny_cidrs=("8.8.8.0/24",))
HOSTS = [("github.com", 443), ("pypi.org", 443)]


def _request(method: str, url_path: str, host: str = "github.com") -> Request:
    return Request(method, "https", host, 443, url_path, (("Accept", "x"), ("Authorization", "Bearer sandbox-own")))


def test_a_brokering_profile_proves_clean_and_the_gate_requires_credential_scope():
    art = load_artifact(artifact_json("broker"))
    report = prove_one(art)
    assert report.exit_code() == 0, report.render_text()
    assert {r.key for r in report.results} == required_checks(art)
    assert ("default", "profile:ci", "credential-scope") in required_checks(art)  # it brokers `gh` and `keyed`
    assert not any(k[1] == "profile:plain" and k[2] == "credential-scope" for k in required_checks(art))
    assert only(report, "profile:ci", "credential-scope").verdict == "proved"


def test_trust_lane_refutes_an_adversarial_broker_built_by_hand():
    # The compiler refuses this (EL0039); an artifact written by hand bypasses it, and the prover refutes it.
    adv = profile("runner", (), trust="adversarial", brokers=("gh",))
    art = artifact(connections=[GH], profiles=[adv], workers=[EDGE])
    report = prove_one(art)
    res = only(report, "profile:runner", "trust-lane")
    assert res.verdict == "refuted" and report.exit_code() == 1
    assert "adversarial and brokers `gh`" in res.counterexample["summary"]
    assert "the adversary could use it" in res.counterexample["summary"]


def test_the_core_never_brokers_for_an_adversarial_profile():
    """Defence in depth: even an artifact that says so (and a proof gate bypassed) attaches no credential."""
    adv = profile("runner", HOSTS, trust="adversarial", brokers=("gh",))
    art = artifact(connections=[GH], profiles=[adv], workers=[EDGE])
    d = decide(art, Lease("s", "runner", None, 0), _request("GET", "/acme/app"), ["93.184.216.34"])
    assert d.allowed and d.broker is None and d.inject_header is None and d.rule is None


def test_adding_a_broker_to_a_published_profile_is_a_widening():
    # `gh` on the default worker here: with `edge`'s deny list, removing the broker would also admit (plain, judged by
    # `default`) a request the brokered path denied, a true widening of its own
    gh = GH.model_copy(update={"worker": "default"})
    old = artifact(connections=[gh], profiles=[profile("ci", HOSTS)])
    new = artifact(connections=[gh], profiles=[profile("ci", HOSTS, version=2, brokers=("gh",))])
    report = prove_one(new, old)
    res = only(report, "profile:ci", "no-widening")
    assert res.verdict == "refuted"
    cex = res.counterexample
    assert "old ALLOW, new ALLOW (brokered by `gh`, rule `refs`)" in cex["summary"], cex["summary"]
    # replayed: the same request, admitted by both, carries the credential only under the new version
    req = request_from_dict(cex["request"])
    d_old, d_new = (decide(a, subject_lease("profile", "ci"), req, cex["resolved_ips"]) for a in (old, new))
    assert d_old.allowed and d_old.broker is None and d_new.allowed and d_new.broker == "gh"
    # the semantic diff (and so `compile`'s widening check) says the same; removing the broker only narrows
    assert [k for k, _ in widenings(old, new)] == ["sandbox_profile:ci"]
    back = semantic_diff(new, old)
    assert not back.widened and {e.direction for e in back.examples} == {"narrowed"}
    assert only(prove_one(old, new), "profile:ci", "no-widening").verdict == "proved"


def test_a_broker_whose_host_the_profile_does_not_allow_brokers_nothing():
    """By hand (the compiler refuses it, EL0040): the destination check comes first, so no credential ever attaches."""
    art = artifact(connections=[GH], profiles=[profile("ci", [("pypi.org", 443)], brokers=("gh",))], workers=[EDGE])
    d = decide(art, Lease("s", "ci", None, 0), _request("GET", "/acme/app"), ["93.184.216.34"])
    assert (d.allowed, d.reason) == (False, "profile-host-not-allowed")
    report = prove_one(art)
    assert only(report, "profile:ci", "credential-scope").verdict == "proved"


def test_a_dangling_broker_makes_the_profile_unusable():
    """By hand (the compiler refuses it, EL0030): the profile is refused whole, and the prover says it admits nothing."""
    art = artifact(profiles=[profile("ci", HOSTS, brokers=("missing",))])
    d = decide(art, Lease("s", "ci", None, 0), _request("GET", "/simple/", "pypi.org"), ["93.184.216.34"])
    assert (d.allowed, d.reason) == (False, "worker-unknown")
    report = prove_one(art)
    assert only(report, "profile:ci", "vacuity").verdict == "refuted"
    # a version whose broker is fixed widens it (the unusable side admits nothing; the other side is still compared)
    fixed = artifact(connections=[GH.model_copy(update={"worker": "default"})], profiles=[profile("ci", HOSTS, brokers=("gh",))])
    assert [k for k, _ in widenings(art, fixed)] == ["sandbox_profile:ci"]
