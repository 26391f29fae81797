"""What a refusal looks like on the wire, for every edge that answers one (the mitmproxy edge and the Envoy lane),
and how text a client sent is shown in a log line or an event (`printable`):
`{"error": "egress_denied", "reason": <code>, "rule": null}` with `X-Egresslaw-Deny: <code>`; 407 for a lease
problem, 503 when the proxy (not the policy) said no, 429 for a budget with no room in its window (its `detail`
in the body, `Retry-After` to the window's end), 411 for a body of undeclared length under a bytes cap, else 403.
Plain data and functions: no HTTP library.
"""

from __future__ import annotations

import json

DENY_HEADER = "X-Egresslaw-Deny"
# denials that answer 503: the proxy, not the policy, said no
UNAVAILABLE = frozenset({"audit-unavailable", "draining", "authorizer-unavailable", "budget-unavailable"})
# the budget's own statuses (docs/budget.md, "The denial"; budget-unavailable is one of UNAVAILABLE)
BUDGET_STATUS = {"budget-exceeded": 429, "budget-length-required": 411}


def denial_body(reason: str, provider_status: int | None = None, cause: str | None = None, detail: str | None = None) -> bytes:
    """The JSON body of a refusal (`credential-mint-failed` names the token endpoint's status and the class of its
    failure as `cause`, never its body; `budget-exceeded` names the subject, the cap and the window as `detail`)."""
    body: dict[str, object] = {"error": "egress_denied", "reason": reason, "rule": None}
    if provider_status is not None:
        body["provider_status"] = provider_status
    if cause is not None:
        body["cause"] = cause
    if detail is not None:
        body["detail"] = detail
    return json.dumps(body).encode("ascii")


def printable(text: object, limit: int = 200) -> str:
    """User input for a log line or an event: control and non-ASCII characters escaped (no forged log lines),
    at most `limit` characters."""
    shown = str(text).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def policy_status(reason: str) -> int:
    """The status of a decision's refusal: 407 for a lease problem, 503 when unavailable, 429/411 for a budget, else 403."""
    return 407 if reason.startswith("lease-") else 503 if reason in UNAVAILABLE else BUDGET_STATUS.get(reason, 403)
