"""Known-bad configurations: each must be refuted with the expected counterexample (mutants of the code: test_mutants.py)."""

from __future__ import annotations

import pytest

from egress_proxy.decision.adapter import decide
from proofs.decode import request_from_dict
from proofs.gate import required_checks
from proofs.properties import subject_lease
from tests.proofs.helpers import (
    artifact,
    connection,
    github,
    only,
    profile,
    prove_one,
    rule,
    worker,
)


def test_shipped_shape_proves_clean():
    art = artifact(connections=[github("edge")], profiles=[profile("ci", [("pypi.org", 443)])], workers=[worker("edge")])
    report = prove_one(art)
    assert report.exit_code() == 0, report.render_text()
    assert {r.property for r in report.results} == {"vacuity", "public-only", "deny-cidrs", "no-redirect",
                                                    "credential-scope", "header-safety", "profile-scope", "trust-lane",
                                                    "worker-switches", "dns-confined"}
    assert {r.key for r in report.results} == required_checks(art)


@pytest.mark.parametrize(
    ("hole", "address", "range_cidr", "reference"),
    [
        ("100.64.0.0/10", "100.64.0.1", "100.64.0.0/10", "RFC 6598"),
        ("169.254.169.254/32", "169.254.169.254", "169.254.169.254/32", "provider documentation"),
    ],
)
def test_private_allow_cidr_is_refuted(hole, address, range_cidr, reference):
    art = artifact(connections=[github("edge")], workers=[worker("edge", allow_cidrs=(hole,))])
    report = prove_one(art)
    assert report.exit_code() == 1
    res = only(report, "worker:edge", "public-only")
    assert res.verdict == "refuted"
    cex = res.counterexample
    assert cex["resolved_ips"] == [address]
    assert cex["ip_range"]["cidr"] == range_cidr and cex["ip_range"]["reference"] == reference
    assert cex["setting"] == f"allow_cidrs = ['{hole}']"
    assert f"allow_cidrs admits {address}" in cex["summary"]
    # the subject-level result carries a whole request that decide() admits to that address
    sub = only(report, "connection:github", "public-only")
    assert sub.verdict == "refuted"
    req = request_from_dict(sub.counterexample["request"])
    d = decide(art, subject_lease("connection", "github"), req, sub.counterexample["resolved_ips"])
    assert d.allowed and d.reason == "allowed" and d.rule == "read-repos"
    # the default worker (no hole) still proves
    assert only(report, "worker:default", "public-only").verdict == "proved"


def test_follow_redirects_is_refuted_with_a_chain():
    art = artifact(connections=[github("legacy")], workers=[worker("legacy", follow_redirects=True)])
    report = prove_one(art)
    res = only(report, "worker:legacy", "no-redirect")
    assert res.verdict == "refuted"
    chain = res.counterexample["redirect_chain"]
    assert chain and 300 <= chain[0]["status"] <= 399 and chain[0]["issued"] is True
    assert "follow_redirects = true" in res.counterexample["setting"]
    assert "second request issued" in res.counterexample["summary"]
    sub = only(report, "connection:github", "no-redirect")
    assert sub.verdict == "refuted" and sub.counterexample["request"]["line"].startswith(("GET", "HEAD"))


def test_max_redirects_alone_is_refuted():
    art = artifact(workers=[worker("w", max_redirects=3)])
    res = only(prove_one(art), "worker:w", "no-redirect")
    assert res.verdict == "refuted" and len(res.counterexample["redirect_chain"]) >= 1


def test_real_decide_proves_credential_scope():
    report = prove_one(artifact(connections=[github()]))
    assert only(report, "connection:github", "credential-scope").verdict == "proved"


def test_smuggled_x_forwarded_host_is_refuted():
    art = artifact(connections=[github(extra_headers=("X-Forwarded-Host",))])
    res = only(prove_one(art), "connection:github", "header-safety")
    assert res.verdict == "refuted"
    cex = res.counterexample
    assert cex["header"] == "x-forwarded-host" and cex["rule"] == "read-repos"
    assert "X-Forwarded-Host" in cex["summary"]
    assert any(n.lower() == "x-forwarded-host" for n, _ in cex["request"]["headers"])


def test_widened_connection_is_refuted_against_its_previous_version():
    old = artifact(connections=[github(version=1)])
    new = artifact(connections=[github(version=2, admin=True)])
    report = prove_one(new, old)
    res = only(report, "connection:github", "no-widening")
    assert res.verdict == "refuted"
    cex = res.counterexample
    assert cex["request"]["method"] == "POST" and cex["request"]["target"].startswith("/v2/admin")
    assert cex["old_decision"]["allowed"] is False and cex["old_decision"]["reason"] == "path-not-allowed"
    assert cex["decision"]["allowed"] is True and cex["rule"] == "admin"
    # the same artifact against itself does not widen
    assert only(prove_one(old, old), "connection:github", "no-widening").verdict == "proved"


def test_narrowing_is_not_a_widening():
    old = artifact(connections=[github(admin=True)])
    new = artifact(connections=[github(version=2)])
    assert only(prove_one(new, old), "connection:github", "no-widening").verdict == "proved"


def test_widened_profile_is_refuted():
    old = artifact(profiles=[profile("ci", [("pypi.org", 443)])])
    new = artifact(profiles=[profile("ci", [("pypi.org", 443), ("files.pythonhosted.org", 443)], version=2)])
    res = only(prove_one(new, old), "profile:ci", "no-widening")
    assert res.verdict == "refuted" and res.counterexample["request"]["host"] == "files.pythonhosted.org"


def test_adversarial_allowlist_on_advisory_provider_is_refuted():
    art = artifact(profiles=[profile("build", [("pypi.org", 443)], trust="adversarial")])
    res = only(prove_one(art), "profile:build", "trust-lane")
    assert res.verdict == "refuted"
    assert "adversarial with advisory_filter provider" in res.counterexample["summary"]
    assert res.counterexample["request"]["host"] == "pypi.org"
    # adversarial with no network is fine
    ok = artifact(profiles=[profile("build", [], trust="adversarial")])
    assert only(prove_one(ok), "profile:build", "trust-lane").verdict == "proved"


def test_vacuity_catches_a_worker_that_reaches_nothing():
    art = artifact(workers=[worker("dead", deny_cidrs=("0.0.0.0/0",), ipv6=False)])
    res = only(prove_one(art), "worker:dead", "vacuity")
    assert res.verdict == "refuted" and "reaches no public address" in res.counterexample["summary"]


def test_vacuity_catches_a_connection_that_admits_nothing():
    conn = connection("dead", [rule("r", "api.example.org", "/a", ["GET"])], worker="v4")
    art = artifact(connections=[conn], workers=[worker("v4", deny_cidrs=("0.0.0.0/0",), ipv6=False)])
    res = only(prove_one(art), "connection:dead", "vacuity")
    assert res.verdict == "refuted"


def test_a_counterexample_that_does_not_replay_is_unknown_never_refuted_or_proved():
    """If decide() disagrees with the encoding, the check says so (unknown) instead of claiming either verdict."""
    from egress_proxy.decision.types import Decision
    from proofs.runner import prove

    art = artifact(connections=[github("edge")], workers=[worker("edge", allow_cidrs=("100.64.0.0/10",))])
    report = prove(art, decide=lambda *args: Decision())  # a "decision function" that denies everything
    res = only(report, "connection:github", "public-only")
    assert res.verdict == "unknown" and "did not replay" in res.detail
    assert res.counterexample["decision"]["allowed"] is False
    assert report.exit_code() == 1  # the worker-level refutation still stands (judged by the address predicate)


def test_nat64_prefix_in_special_space_is_refuted_like_a_hole():
    art = artifact(connections=[github("edge")], workers=[worker("edge", nat64_prefixes=("fd00::/96",))])
    res = only(prove_one(art), "worker:edge", "public-only")
    assert res.verdict == "refuted"
    cex = res.counterexample
    assert cex["setting"] == "nat64_prefixes = ['fd00::/96']"
    assert cex["resolved_ips"][0].startswith("fd00::") and cex["ip_range"]["cidr"] == "fc00::/7"
    # a worker that narrows NAT64 (none at all) only refuses more and still proves
    strict = artifact(workers=[worker("edge", nat64_prefixes=())])
    assert only(prove_one(strict), "worker:edge", "public-only").verdict == "proved"


def _observed(name: str = "ci"):
    return profile(name, [("pypi.org", 443)]).model_copy(update={"enforce": "observe"})


@pytest.mark.parametrize("literals", [False, True])
def test_worker_switches_hold_for_a_profile_in_observe_mode(literals):
    """Observe mode widens the hosts a profile reaches, never its worker's switches: no IP literal with
    `ip_literals = false`, and only a public one otherwise."""
    art = artifact(profiles=[_observed()], workers=[worker("default", ip_literals=literals)])
    res = only(prove_one(art), "profile:ci", "worker-switches")
    assert res.verdict == "proved", res.detail


def test_an_ip_literal_in_an_allow_cidrs_hole_is_refuted_by_worker_switches():
    """A worker that takes IP literals and has a hole in `allow_cidrs`: an observed profile reaches `10.x` by its literal
    (its resolver answers are public-only's; the literal is this property's). Replayed through decide()."""
    art = artifact(profiles=[_observed()], workers=[worker("default", ip_literals=True, allow_cidrs=("10.0.0.0/8",))])
    res = only(prove_one(art), "profile:ci", "worker-switches")
    assert res.verdict == "refuted", res.detail
    cex = res.counterexample
    assert cex["request"]["host"].startswith("10.") and "(observe mode)" in cex["summary"] and "not public" in cex["summary"]
    assert "ip_literals = true" in cex["setting"]
    d = decide(art, subject_lease("profile", "ci"), request_from_dict(cex["request"]), cex["resolved_ips"])
    assert d.allowed and d.observed == "profile-host-not-allowed"
