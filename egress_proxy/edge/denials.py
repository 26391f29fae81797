"""The proxy's own answers, built in one place: every refusal is JSON naming a reason code, nothing else.

`{"error": "egress_denied", "reason": <code>, "rule": null}` with `X-Egresslaw-Deny: <code>` for a refusal
(403; 407 with both `Proxy-Authenticate` schemes for a lease problem; 503 with `Retry-After` when the proxy,
not the policy, said no; 429 with `Retry-After` and a `detail` for a budget with no room, 411 for a body of undeclared
length under a bytes cap; 408/413/414/429/431 for a limit), `{"error": "upstream_error", …}` for a 5xx the
proxy writes about an upstream. No answer built here ever carries a byte of an upstream or of a request.
"""

from __future__ import annotations

import json

from mitmproxy import http

from egress_proxy.decision.answers import DENY_HEADER, UNAVAILABLE, denial_body, policy_status

__all__ = ["DENY_HEADER", "STATUS_TEXT", "UNAVAILABLE", "denial", "denial_body", "denial_response", "error_answer", "policy_status", "raw_denial"]
STATUS_TEXT = {
    403: "Forbidden",
    411: "Length Required",
    407: "Proxy Authentication Required",
    408: "Request Timeout",
    413: "Content Too Large",
    414: "URI Too Long",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def error_answer(status: int, reason: str) -> tuple[bytes, dict[str, str]]:
    """Body and headers of an error answer: a refusal below 500, an upstream error from 500 on."""
    if status >= 500:
        body = json.dumps({"error": "upstream_error", "reason": reason}).encode("ascii")
    else:
        body = denial_body(reason)
    return body, {"Content-Type": "application/json", DENY_HEADER: reason}


def denial(reason: str, provider_status: int | None = None, cause: str | None = None, *, detail: str | None = None,
           retry_after: int | None = None) -> http.Response:
    """A decision's refusal as a flow response (the connection stays open unless the lease or a drain is the cause);
    `detail` goes in the body, `retry_after` (seconds) in a `Retry-After` header."""
    lease_problem = reason.startswith("lease-")
    headers = [("Content-Type", "application/json"), (DENY_HEADER, reason),
               ("Connection", "close" if (lease_problem or reason == "draining") else "keep-alive")]
    if lease_problem:
        # Both schemes: a client configured from a proxy URL (pip, npm, git's libcurl) answers a Basic challenge.
        headers += [("Proxy-Authenticate", 'Basic realm="egresslaw"'), ("Proxy-Authenticate", 'Bearer realm="egresslaw"')]
    if retry_after is not None:
        headers.append(("Retry-After", str(retry_after)))
    elif reason in UNAVAILABLE:
        headers.append(("Retry-After", "1"))
    resp = http.Response.make(policy_status(reason), denial_body(reason, provider_status, cause, detail),
                              [(k.encode(), v.encode()) for k, v in headers])
    # The reason in the status line too: curl prints no body of a refused CONNECT, but `curl -v` shows this line.
    resp.reason = f"{STATUS_TEXT.get(resp.status_code, resp.reason)} (egresslaw: {reason})"
    return resp


def denial_response(status: int, reason: str) -> http.Response:
    """A limit refusal as a flow response; the connection is closed after it (the rest of the request is unread)."""
    resp = http.Response.make(status, denial_body(reason), {"Content-Type": "application/json", DENY_HEADER: reason, "Connection": "close"})
    resp.reason = STATUS_TEXT.get(status, resp.reason)
    return resp


def raw_denial(status: int, reason: str) -> bytes:
    """The same answer as bytes, for refusals made before mitmproxy has a request (no flow exists yet)."""
    body = denial_body(reason)
    head = (
        f"HTTP/1.1 {status} {STATUS_TEXT.get(status, 'Error')}\r\nContent-Type: application/json\r\n{DENY_HEADER}: {reason}\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body
