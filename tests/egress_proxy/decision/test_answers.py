"""The wire shape of a refusal, shared by the mitmproxy edge and the Envoy lane."""

from __future__ import annotations

import json

import pytest

from egress_proxy.decision.answers import denial_body, policy_status
from egress_proxy.decision.reasons import REASONS


@pytest.mark.parametrize("reason, status", [("lease-expired", 407), ("audit-unavailable", 503), ("draining", 503),
                                            ("authorizer-unavailable", 503), ("profile-host-not-allowed", 403), ("lane-no-route", 403)])
def test_each_reason_has_its_status_and_a_body_naming_it(reason, status):
    assert reason in REASONS
    assert policy_status(reason) == status
    assert json.loads(denial_body(reason)) == {"error": "egress_denied", "reason": reason, "rule": None}
