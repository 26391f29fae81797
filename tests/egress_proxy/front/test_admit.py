"""The one admission both front ends await (egress_proxy/front/admit.py): its steps in order, each refusal before
anything after it runs (a refused request resolves nothing), the hooks that are a front end's only say."""

from __future__ import annotations

import asyncio
import time

import pytest

from egress_proxy.custody.lease import VerifiedLeases
from egress_proxy.decision.adapter import judge_answers
from egress_proxy.decision.types import Request
from egress_proxy.front.admit import Ask, Hooks, admit
from tests.proxy_harness import build_artifact, make_env

PUBLIC = "93.184.215.14"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    env = make_env(tmp_path_factory.mktemp("admit"))
    return env, build_artifact()


class Front:
    """A front end's hooks, recording what the admission asked of it."""

    def __init__(self, env, answers=(PUBLIC,), bind=None, serves=None):
        self.resolved: list[tuple[str, int]] = []
        self.pins: list[tuple[str, int, tuple[str, ...]]] = []
        self.answers = answers
        self.hooks = Hooks(lease_keys=lambda: env.lease_key, verified=VerifiedLeases(), clock=time.time, resolve=self.resolve,
                           bind=bind, serves=serves, pinned=self.pin)

    async def resolve(self, lease, host, port):
        self.resolved.append((host, port))
        return self.answers

    def pin(self, lease, host, port, ips):
        self.pins.append((host, port, ips))
        return None


def connect(env, authority, **lease):
    host, _, port = authority.rpartition(":")
    token = env.lease(**lease) if lease else None
    return Ask(authority=authority, host=host, port=int(port), credentials=(f"Bearer {token}",) if token else ())


def run(coro):
    return asyncio.run(coro)


def test_an_allowed_connect_is_resolved_once_judged_and_pinned(world):
    env, artifact = world
    front = Front(env)
    got = run(admit(artifact, connect(env, "API.acme-test.dev:443", profile="ci"), front.hooks))
    assert got.allowed and got.host == "api.acme-test.dev" and got.port == 443 and got.answers == (PUBLIC,)
    assert front.resolved == [("api.acme-test.dev", 443)]  # the normalized name, once
    assert front.pins == [("api.acme-test.dev", 443, (PUBLIC,))]
    assert got.lease is not None and got.lease.profile == "ci" and got.auth == "bearer"


@pytest.mark.parametrize("authority, lease, reason", [
    ("api.acme-test.dev:443", {}, "lease-missing"),
    ("api.acme-test.dev:443", {"profile": "nope"}, "lease-unknown-subject"),
    ("evil.example:443", {"profile": "ci"}, None),  # the decision's own reason
    ("api.acme-test.dev:80", {"profile": "ci"}, None),
])
def test_a_refusal_before_the_lookup_resolves_nothing(world, authority, lease, reason):
    env, artifact = world
    front = Front(env)
    got = run(admit(artifact, connect(env, authority, **lease), front.hooks))
    assert not got.allowed and front.resolved == [] and front.pins == []
    if reason is not None:
        assert got.reason == reason
    else:
        assert got.decision is not None and got.decision.reason == got.reason


def test_the_front_ends_claims_come_after_the_subject_and_before_the_decision(world):
    env, artifact = world
    asked = []
    front = Front(env, bind=lambda lease: asked.append("bind") or "lease-mismatch", serves=lambda lease: asked.append("serves") or None)
    got = run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks))
    assert got.reason == "lease-mismatch" and asked == ["bind"] and front.resolved == []
    front = Front(env, serves=lambda lease: "lane-not-served")
    got = run(admit(artifact, connect(env, "api.acme-test.dev:443", connection="github"), front.hooks))
    assert got.reason == "lane-not-served" and front.resolved == []


def test_every_answer_is_judged_and_a_refused_answer_is_never_pinned(world):
    env, artifact = world
    front = Front(env, answers=(PUBLIC, "127.0.0.1"))
    got = run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks))
    lease = got.lease
    assert not got.allowed and got.reason == judge_answers(artifact, lease, (PUBLIC, "127.0.0.1")).reason
    assert front.pins == []
    front = Front(env, answers=())
    assert run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks)).reason == "resolve-failed"


def test_a_front_ends_refusal_while_resolving_is_the_answer(world):
    env, artifact = world
    front = Front(env)

    async def gone(lease, host, port):
        return "client-disconnected"

    front.hooks.resolve = gone
    assert run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks)).reason == "client-disconnected"


def test_inside_a_tunnel_the_tunnels_lease_and_answers_are_used_and_an_expired_lease_refused(world):
    env, artifact = world
    front = Front(env)
    tunnel = run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks))
    request = Request(method="GET", scheme="https", host="api.acme-test.dev", port=443, target="/anything", host_header="api.acme-test.dev",
                      tunnel=True, inner_port=443)
    got = run(admit(artifact, Ask(request=request), front.hooks, lease=tunnel.lease, answers=tunnel.answers))
    assert got.allowed and front.resolved == [("api.acme-test.dev", 443)]  # the CONNECT's lookup only
    lapsed = type(tunnel.lease)(subject=tunnel.lease.subject, profile="ci", connection=None, exp=int(time.time()) - 1)
    assert run(admit(artifact, Ask(request=request), front.hooks, lease=lapsed, answers=tunnel.answers)).reason == "lease-expired"


def test_the_ask_never_shows_a_lease(world):
    env, _ = world
    ask = connect(env, "api.acme-test.dev:443", profile="ci")
    token = ask.credentials[0].split()[1]
    assert token not in repr(ask)


# --- step 9: the budget ------------------------------------------------------------------------------------------


def budgeted(profile_budget=None, github_budget=None):
    """The harness's artifact with `ci` brokering `github`, each with the budget given."""
    from compiler.artifact import Budget
    from tests.egress_proxy import builders as b

    base = build_artifact()
    ci = b.profile("ci", [("pkgs.acme-test.dev", 80), ("api.acme-test.dev", 443)], brokers=["github"])
    ci = ci.model_copy(update={"budget": Budget(**profile_budget) if profile_budget else None})
    github = base.connection("github").model_copy(update={"budget": Budget(**github_budget) if github_budget else None})
    return b.artifact(connections=[github], profiles=[ci], workspace=base.workspace)


class Untouchable:
    """A ledger no request may reach."""

    def charge(self, charges, cost, now):
        raise AssertionError("a subject without a budget touched the ledger")

    def close(self):
        pass


def inside(env, front, artifact, target="/repos/acme/app", method="GET", headers=(), has_body=False, **lease):
    """A request inside a tunnel the CONNECT of `lease` opened (the CONNECT admitted and charged first)."""
    tunnel = run(admit(artifact, connect(env, "api.acme-test.dev:443", **lease), front.hooks))
    assert tunnel.allowed, tunnel.reason
    request = Request(method=method, scheme="https", host="api.acme-test.dev", port=443, target=target, host_header="api.acme-test.dev",
                      headers=tuple(headers), tunnel=True, inner_port=443, has_body=has_body)
    return run(admit(artifact, Ask(request=request), front.hooks, lease=tunnel.lease, answers=tunnel.answers))


def test_the_request_over_a_requests_cap_is_refused_with_its_window_and_a_refused_request_costs_nothing(world, tmp_path):
    from egress_proxy.front.budget import SqliteLedger, window_start

    env, _ = world
    artifact = budgeted(profile_budget={"requests": 2, "window": 86400})
    ledger = SqliteLedger(tmp_path / "budget.db")
    front = Front(env)
    front.hooks.ledger = ledger
    for _ in range(3):  # refused by the decision: nothing charged
        assert run(admit(artifact, connect(env, "evil.example:443", profile="ci"), front.hooks)).reason != "allowed"
    now = time.time()
    assert ledger.used("profile:ci", 86400, now) == (0, 0)
    assert [run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks)).reason for _ in range(2)] == ["allowed"] * 2
    got = run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks))
    start = window_start(time.time(), 86400)
    assert got.reason == "budget-exceeded" and got.lease is not None and got.lease.profile == "ci"
    assert got.budget is not None and (got.budget.subject, got.budget.cap, got.budget.limit, got.budget.window) == ("profile:ci", "requests", 2, 86400)
    assert (got.budget.start, got.budget.resets) == (start, start + 86400) or start != window_start(now, 86400)
    assert got.budget.detail().startswith("profile `ci`: 2 requests per 1d window used; resets at ")
    assert ledger.used("profile:ci", 86400, time.time())[0] == 2 or start != window_start(now, 86400)  # the refusal added nothing


def test_a_subject_without_a_budget_never_touches_the_ledger(world):
    env, _ = world
    artifact = budgeted(github_budget={"requests": 1, "window": 60})  # `ci` has none; only its brokered requests charge github
    front = Front(env)
    front.hooks.ledger = Untouchable()
    assert run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks)).allowed
    got = run(admit(artifact, connect(env, "pkgs.acme-test.dev:80", profile="ci"), front.hooks))
    assert got.allowed


def test_a_brokered_request_is_charged_to_the_profile_and_the_carrier_in_one_transaction(world, tmp_path):
    from egress_proxy.front.budget import SqliteLedger

    env, _ = world
    artifact = budgeted(profile_budget={"requests": 10, "window": 86400}, github_budget={"requests": 1, "window": 86400})
    ledger = SqliteLedger(tmp_path / "budget.db")
    front = Front(env)
    front.hooks.ledger = ledger
    first = inside(env, front, artifact, profile="ci")
    assert first.allowed and first.decision is not None and first.decision.broker == "github"
    second = inside(env, front, artifact, profile="ci")
    assert second.reason == "budget-exceeded" and second.budget is not None and second.budget.subject == "connection:github"
    now = time.time()
    # two CONNECTs and one brokered request on the profile; the refused one charged to neither
    assert ledger.used("profile:ci", 86400, now)[0] == 3 and ledger.used("connection:github", 86400, now)[0] == 1
    assert inside(env, front, artifact, target="/", profile="ci").allowed  # plain profile traffic: the profile's budget only


def test_a_body_of_undeclared_length_under_a_bytes_cap_is_refused_and_a_declared_one_is_charged_its_length(world, tmp_path):
    from egress_proxy.front.budget import SqliteLedger

    env, _ = world
    artifact = budgeted(profile_budget={"bytes": 100_000, "window": 86400})
    ledger = SqliteLedger(tmp_path / "budget.db")
    front = Front(env)
    front.hooks.ledger = ledger
    chunked = inside(env, front, artifact, target="/", method="POST", headers=[("transfer-encoding", "chunked")], has_body=True, profile="ci")
    assert chunked.reason == "budget-length-required"
    before = ledger.used("profile:ci", 86400, time.time())[1]
    sized = inside(env, front, artifact, target="/", method="POST", headers=[("content-length", "5000")], has_body=True, profile="ci")
    assert sized.allowed
    connect_cost = len(b"CONNECT api.acme-test.dev:443 HTTP/1.1\r\n\r\n")
    head = len(b"POST / HTTP/1.1\r\nhost: api.acme-test.dev:443\r\ncontent-length: 5000\r\n\r\n")
    assert ledger.used("profile:ci", 86400, time.time())[1] - before == connect_cost + head + 5000
    requests_only = budgeted(profile_budget={"requests": 100, "window": 86400})
    assert inside(env, front, requests_only, target="/", method="POST", headers=[("transfer-encoding", "chunked")], has_body=True, profile="ci").allowed


def test_no_ledger_or_a_failing_one_refuses_a_subject_with_a_budget(world, tmp_path):
    from egress_proxy.front.budget import SqliteLedger

    env, _ = world
    artifact = budgeted(profile_budget={"requests": 5, "window": 60})
    front = Front(env)
    assert run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks)).reason == "budget-unavailable"
    ledger = SqliteLedger(tmp_path / "budget.db")
    ledger.close()  # every charge now fails
    front.hooks.ledger = ledger
    got = run(admit(artifact, connect(env, "api.acme-test.dev:443", profile="ci"), front.hooks))
    assert got.reason == "budget-unavailable" and front.pins  # refused after everything else admitted it
