"""Observe mode (`enforce = "observe"` on a sandbox profile), where it is decided, admitted and proved.

- the core: an observed profile admits a host:port outside its allowlist as plain profile traffic, marked with the
  reason an enforced profile would give (`observed`); everything else is judged as before (addresses, IP literals,
  schemes, framing), and no credential ever rides on it;
- the core enforces a profile whose artifact declares observe mode where the language refuses it (adversarial,
  brokering, no network), whatever the artifact says;
- the compiler refuses those declarations with EL0043, located on `enforce`;
- the prover: an observed profile proves clean, and `trust-lane` refutes a hand-made artifact that declares observe
  mode where it is refused.
"""

from __future__ import annotations

import pytest

from compiler.compile import compile_text
from egress_proxy.decision.adapter import decide, decide_connect
from egress_proxy.decision.types import Lease, Request
from proofs.runner import prove
from tests.egress_proxy.builders import artifact, connection, profile, rule

LEASE = Lease(subject="agent-1", profile="builder", connection=None, exp=2**40)


def _observed(**changes):
    return profile("builder", [("pypi.org", 443)]).model_copy(update={"enforce": "observe", **changes})


def _art(prof, connections=()):
    return artifact(profiles=[prof], connections=list(connections))


def _get(host: str, port: int = 443, scheme: str = "https", target: str = "/simple/x/", **kw) -> Request:
    return Request(method="GET", scheme=scheme, host=host, port=port, target=target, **kw)  # type: ignore[arg-type]


def test_an_observed_profile_forwards_outside_its_allowlist_and_says_what_enforcement_would_do():
    art = _art(_observed())
    inside = decide(art, LEASE, _get("pypi.org"), ["93.184.216.34"])
    assert inside.allowed and inside.observed is None
    outside = decide(art, LEASE, _get("files.example.net"), ["93.184.216.34"])
    assert outside.allowed and outside.observed == "profile-host-not-allowed"
    assert outside.broker is None and outside.inject_header is None and outside.rule is None
    assert "would deny" in (outside.detail or "") and "files.example.net:443" in (outside.detail or "")
    plain = decide(art, LEASE, _get("files.example.net", 80, "http"), ["93.184.216.34"])
    assert plain.allowed and plain.observed == "profile-host-not-allowed"
    tunnel = decide_connect(art, LEASE, "files.example.net:8443")
    assert tunnel.allowed and tunnel.observed == "profile-host-not-allowed"
    # the same profile enforced denies exactly what observe mode marks
    enforced = _art(profile("builder", [("pypi.org", 443)]))
    assert decide(enforced, LEASE, _get("files.example.net"), ["93.184.216.34"]).reason == "profile-host-not-allowed"


@pytest.mark.parametrize(("request_", "answers", "reason"), [
    (_get("files.example.net"), ["10.0.0.5"], "address-not-public"),  # still judged by its worker
    (_get("files.example.net"), ["169.254.169.254"], "address-not-public"),
    (_get("93.184.216.34"), ["93.184.216.34"], "ip-literal-refused"),  # the default worker takes no IP literal
    (_get("files.example.net", scheme="ftp"), ["93.184.216.34"], "scheme-not-allowed"),
    (_get("files.example.net", headers=(("Transfer-Encoding", "chunked"), ("Content-Length", "3"))), ["93.184.216.34"], "smuggling"),
])
def test_observe_mode_relaxes_the_allowlist_and_nothing_else(request_, answers, reason):
    assert decide(_art(_observed()), LEASE, request_, answers).reason == reason


def test_an_ip_literal_a_worker_admits_is_still_judged_for_an_observed_profile():
    from tests.egress_proxy.builders import worker

    art = artifact(profiles=[_observed()], workers=[worker("default", ip_literals=True)])
    assert decide(art, LEASE, _get("10.0.0.5"), ["10.0.0.5"]).reason == "address-not-public"
    public = decide(art, LEASE, _get("93.184.216.34"), ["93.184.216.34"])
    assert public.allowed and public.observed == "profile-host-not-allowed"


def test_a_profile_with_no_network_declared_observed_is_enforced():
    prof = profile("builder").model_copy(update={"enforce": "observe"})  # network none: a hand-made artifact
    d = decide(_art(prof), LEASE, _get("files.example.net"), ["93.184.216.34"])
    assert not d.allowed and d.reason == "profile-host-not-allowed" and d.observed is None


@pytest.mark.parametrize("changes", [{"trust": "adversarial"}, {"brokers": ("github",)}], ids=["adversarial", "brokering"])
def test_the_core_enforces_a_profile_declared_observed_where_the_language_refuses_it(changes):
    github = connection("github", [rule("read", "api.github.com", "/repos/acme")])
    prof = _observed(**changes)
    d = decide(_art(prof, [github]), LEASE, _get("files.example.net"), ["93.184.216.34"])
    assert not d.allowed and d.reason == "profile-host-not-allowed" and d.observed is None


POLICY = """egresslaw 1
workspace "acme"
catalog "2026.11"

connection "github" {{
  credential = "gh"
  egress "read" {{
    host = "api.github.com"
    path_prefix = "/repos/acme/"
    methods = ["GET"]
  }}
}}

sandbox_profile "builder" {{
  trust = "{trust}"
  provider = "gvisor@2026.10.1"
  enforce = "{mode}"
  network = {network}
{extra}}}
"""
LIMITED = '{"type": "limited", "allowed_hosts": ["pypi.org", "api.github.com"], "allow_package_managers": false, "allow_mcp_servers": false}'


def _compile(trust="trusted", mode="observe", network=LIMITED, extra=""):
    return compile_text(POLICY.format(trust=trust, mode=mode, network=network, extra=extra), "p.egress")


def test_the_compiler_admits_observe_mode_and_leaves_enforce_out_of_the_artifact():
    observed = _compile()
    assert observed.ok and observed.artifact.profile("builder").enforce == "observe"
    assert '"enforce":"observe"' in observed.artifact.to_json()
    enforced = _compile(mode="enforce")
    assert enforced.ok and '"enforce"' not in enforced.artifact.to_json()  # digests of enforced profiles are as before
    bad = _compile(mode="watch")
    assert [d.code for d in bad.diagnostics if d.severity == "error"] == ["EL0021"]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"trust": "adversarial"}, "an adversarial workload would reach any public host"),
    ({"extra": "  brokers = [github]\n"}, "it brokers `github`"),
    ({"network": '{"type": "none"}'}, "its network is `none`"),
], ids=["adversarial", "brokering", "no-network"])
def test_observe_mode_is_refused_where_it_could_leak(kwargs, words):
    result = _compile(**kwargs)
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert [d.code for d in errors] == ["EL0043"], [(d.code, d.message) for d in errors]
    (diag,) = errors
    assert words in diag.message and diag.help
    line = POLICY.format(trust="t", mode="observe", network="n", extra="").splitlines().index('  enforce = "observe"') + 1
    assert diag.span.line == line and diag.span.column == 13


def test_the_prover_proves_an_observed_profile_and_refutes_a_declaration_the_language_refuses():
    report = prove(_compile().artifact, jobs=1)
    assert report.exit_code() == 0, report.render_text()
    hand_made = artifact(profiles=[_observed(trust="adversarial")])
    report = prove(hand_made, jobs=1)
    (lane,) = [r for r in report.results if r.subject == "profile:builder" and r.property == "trust-lane"]
    assert lane.verdict == "refuted" and 'declared `enforce = "observe"`, but adversarial' in lane.counterexample["summary"]
    # the core enforced it, so the allowlist statement holds: the declaration is what is refuted, not the traffic
    (scope,) = [r for r in report.results if r.subject == "profile:builder" and r.property == "profile-scope"]
    assert scope.verdict == "proved"
