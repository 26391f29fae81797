"""The values that cross between the edge and the decision: a lease names one subject, a decision starts denied."""

from __future__ import annotations

import dataclasses

import pytest

from egress_proxy.decision.types import Decision, Lease, Request


def test_a_lease_names_exactly_one_profile_or_connection() -> None:
    Lease("s", "p", None, 0)
    Lease("s", None, "c", 0)
    for profile, conn in (("p", "c"), (None, None)):
        with pytest.raises(ValueError, match="exactly one"):
            Lease("s", profile, conn, 0)


def test_a_decision_starts_denied_and_carries_nothing() -> None:
    d = Decision()
    assert (d.allowed, d.reason, d.rule, d.forward_headers, d.inject_header, d.broker) == (False, "default-deny", None, (), None, None)


def test_they_are_frozen() -> None:
    r = Request("GET", "https", "api.github.com", 443, "/")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.host = "evil.example.org"  # type: ignore[misc]
    assert (r.tunnel, r.inner_port, r.has_body) == (False, None, False)
