"""dns-confined's statement on concrete values: the destinations as declared, observe mode not confined."""

from __future__ import annotations

from proofs.spec import resolution
from tests.proofs.helpers import connection, github, profile, rule


def test_the_statement_reads_the_artifact_as_declared():
    hooks = connection("hooks", [rule("post", "hooks.example.org", "/", ["POST"])])
    ci = profile("ci", [("api.github.com", 443), ("pypi.org", 443)], brokers=("github", "hooks"))
    assert resolution.destinations(ci) == {("api.github.com", 443), ("pypi.org", 443)}
    assert resolution.destinations(profile("sealed")) == frozenset()  # network none
    assert resolution.destinations(github()) == {("api.github.com", 443)}
    assert resolution.destinations(hooks) == {("hooks.example.org", 443)}
    assert resolution.resolvable_text(ci, "pypi.org", 443)
    assert not resolution.resolvable_text(ci, "pypi.org", 80)
    assert not resolution.resolvable_text(ci, "hooks.example.org", 443)  # brokered, but not on its allowlist: not its own
    assert not resolution.resolvable_text(ci, None, 443)


def test_observe_mode_is_not_confined():
    watch = profile("watch", [("pypi.org", 443)]).model_copy(update={"enforce": "observe"})
    assert not resolution.confined(watch)
    assert resolution.confined(profile("ci", [("pypi.org", 443)])) and resolution.confined(github())
    # declared observe but adversarial: enforced (trust-lane refutes the declaration), so confined
    assert resolution.confined(watch.model_copy(update={"trust": "adversarial"}))
