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
