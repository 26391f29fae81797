"""What each profile may reach through the lane, from the artifact alone (the translation check's expected side).

Stated from docs/lane.md, not from the generator: these tables must hold whatever `envoy.py` does."""

from __future__ import annotations

import pytest

from egress_proxy.lane.reach import reach
from tests.egress_proxy import builders as b


def _artifact(*profiles):
    rules = [b.rule("read", "api.example.dev", "/", ["GET"])]
    return b.artifact(connections=[b.connection("gh", rules, credential="h")], profiles=profiles)


def test_a_served_profile_reaches_exactly_its_allowlist():
    got = reach(_artifact(b.profile("ci", [("pypi.org", 443), ("deb.debian.org", 80), ("pypi.org", 8443)]), b.profile("offline")))
    assert got.profiles == {"ci": {("pypi.org", 443), ("deb.debian.org", 80), ("pypi.org", 8443)}, "offline": frozenset()}
    assert got.left == {}
    assert got.hosts() == {"pypi.org", "deb.debian.org"}


@pytest.mark.parametrize("profile, why", [
    (b.profile("agent", [("pypi.org", 443)], brokers=["gh"]), "it brokers connections"),
    (b.profile("watch", [("pypi.org", 443)]).model_copy(update={"enforce": "observe"}), "it is in observe mode"),
    (b.profile("literal", [("pypi.org", 443), ("93.184.216.34", 443)]), "its allowlist names an IP literal"),
    (b.profile("literal6", [("[2001:db8::1]", 443)]), "its allowlist names an IP literal"),
])
def test_a_profile_the_lane_does_not_serve_stays_on_the_edge_with_why(profile, why):
    got = reach(_artifact(b.profile("ci", [("pypi.org", 443)]), profile))
    assert set(got.profiles) == {"ci"}
    assert got.left[profile.name].startswith(why)
    assert got.hosts() == {"pypi.org"}


def test_without_the_worker_that_judges_profiles_nothing_is_served():
    art = _artifact(b.profile("ci", [("pypi.org", 443)]))
    art = art.model_copy(update={"workers": tuple(w for w in art.workers if w.name != "default")})
    got = reach(art)
    assert got.profiles == {} and "`default`" in got.left["ci"]
