"""Policy data that the compiler, the decision function and the prover share. One place, versioned with the code."""

from __future__ import annotations

ARTIFACT_FORMAT = "egresslaw.artifact/1"
LANGUAGE_VERSION = 1

# Methods a rule may name. CONNECT and TRACE are never allowed, and there is no wildcard.
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
# Methods whose requests carry no body by definition; a body on one of them is denied.
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})

# Routing- or authorization-bearing request headers: never allowlisted, never forwarded from a caller.
HEADER_DENYLIST = frozenset(
    {
        "host",
        "authorization",
        "proxy-authorization",
        "proxy-connection",
        "proxy-authenticate",
        "cookie",
        "forwarded",
        "x-real-ip",
        "via",
        "x-original-url",
        "x-rewrite-url",
        "x-http-method-override",
        "x-http-method",
        "x-method-override",
        "connection",
        "upgrade",
        "te",
        "transfer-encoding",
        "content-length",
        "keep-alive",
        "trailer",
        "http2-settings",
    }
)
# Any header starting with one of these is denylisted too.
HEADER_DENYLIST_PREFIXES = ("x-forwarded-", "proxy-", "x-egresslaw-")


# Credential kinds (egress_proxy/credentials): `static` pastes the record's value into `inject`; the others mint a
# token (`oauth2`, `github_app`) or sign the request (`aws_sigv4`) at the edge.
CREDENTIAL_KINDS = ("static", "oauth2", "github_app", "aws_sigv4")
# Headers a kind's edge writes itself besides the inject header: a caller's copies are never forwarded, and no rule
# may allowlist them (SigV4's signature covers them, so a caller's value would be signed as the edge's).
EDGE_HEADERS = {"aws_sigv4": ("x-amz-date", "x-amz-security-token", "x-amz-content-sha256")}


def header_is_denylisted(name: str, inject_header: str | None = None, kind: str = "static") -> bool:
    """True when `name` may never be allowlisted or forwarded from the caller (case-insensitive): a routing header,
    the inject header, or a header the connection's credential kind writes at the edge."""
    lowered = name.lower()
    if inject_header is not None and lowered == inject_header.lower():
        return True
    if lowered in EDGE_HEADERS.get(kind, ()):
        return True
    return lowered in HEADER_DENYLIST or lowered.startswith(HEADER_DENYLIST_PREFIXES)


# The header the proxy attaches the credential to may not be one that routes the request.
# `authorization` is the normal target and is allowed here on purpose.
INJECT_HEADER_FORBIDDEN = (HEADER_DENYLIST - {"authorization"}) | {"cookie"}

# Special-use names (RFC 6761, RFC 6762, RFC 8375, RFC 9476 and cloud metadata names).
SPECIAL_USE_NAMES = frozenset(
    {
        "localhost",
        "metadata",
        "metadata.google.internal",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.azure.com",
        "kubernetes.default",
        "kubernetes.default.svc",
    }
)
SPECIAL_USE_SUFFIXES = (
    "localhost",
    "local",
    "internal",
    "home.arpa",
    "test",
    "invalid",
    "example",
    "onion",
    "alt",
    "lan",
    "intranet",
    "corp",
    "private",
    "in-addr.arpa",
    "ip6.arpa",
    "cluster.local",
    "svc",
)

# Literals that look like secrets; matched against every string value in a policy.
SECRET_PREFIXES = (
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "glpat-",
    "sk-",
    "sk_live_",
    "rk_live_",
    "xoxb-",
    "xoxp-",
    "xoxa-",
    "xoxs-",
    "AKIA",
    "ASIA",
    "AIza",
    "ya29.",
    "npm_",
    "pypi-",
    "hf_",
    "-----BEGIN",
)
HIGH_ENTROPY_MIN_LENGTH = 32
HIGH_ENTROPY_BITS_PER_CHAR = 3.5

MAX_RULES_PER_CONNECTION = 32
DEFAULT_WORKER = "default"
