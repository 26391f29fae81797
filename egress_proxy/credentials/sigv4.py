"""AWS Signature Version 4, header form: the edge re-signs a request the sandbox signed with placeholder keys.

The sandbox's AWS client never holds real keys; it signs with placeholders, the caller strips what that signature wrote
(`EDGE_HEADERS` and `host`) and `sign` returns the headers that make the request valid with the custody's keys.

Pure by design: no I/O, no clock (the caller passes `now`), no imports from the rest of the project, so the signer can
be checked in isolation against botocore's `SigV4Auth` / `S3SigV4Auth` (tests/egress_proxy/credentials/test_sigv4.py).
Where AWS's prose and botocore disagree, botocore wins: AWS accepts what botocore sends, and botocore is what runs in
most sandboxes. Secrets never reach an exception: errors name the argument, never its value.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final
from urllib.parse import quote, unquote_to_bytes

UNSIGNED_PAYLOAD: Final = "UNSIGNED-PAYLOAD"
STREAMING_UNSIGNED_TRAILER: Final = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
# What the edge writes; a caller's copies are never forwarded (nor signed, if they slip through).
EDGE_HEADERS: Final = ("authorization", "x-amz-date", "x-amz-security-token", "x-amz-content-sha256")

_ALGORITHM: Final = "AWS4-HMAC-SHA256"
_TIMESTAMP: Final = "%Y%m%dT%H%M%SZ"
_UNRESERVED: Final = "-_.~"  # with A-Z a-z 0-9, which quote() never encodes

_HEX_SHA256: Final = re.compile(r"[0-9a-f]{64}")
_METHOD: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token
_SCOPE_PART: Final = re.compile(r"[A-Za-z0-9._-]+")  # region and service: they sit between the scope's slashes
_KEY_ID: Final = re.compile(r"[!-+\--.0-~]+")  # printable ASCII but ',' and '/': it sits in `Credential=id/scope, `
_TOKEN: Final = re.compile(r"[!-~]+")  # printable ASCII, no space: a header value that cannot split the header block
_HOST: Final = re.compile(r"[!-~]+")

# Signed besides host and the edge's own: what AWS requires signed when present. Others (user-agent, accept, ...) are
# deliberately left out, so a middlebox that rewrites them cannot invalidate the signature.
_SIGNED_NAMES: Final = frozenset({"content-type", "content-md5"})
_SIGNED_PREFIX: Final = "x-amz-"
_NEVER_FROM_CALLER: Final = frozenset(EDGE_HEADERS) | {"host"}

_BAD_PAYLOAD: Final = (f"payload must be a lowercase hex SHA-256, {UNSIGNED_PAYLOAD} or {STREAMING_UNSIGNED_TRAILER} "
                       "(signed streaming, STREAMING-AWS4-…, cannot be re-signed)")


def payload_hash(body: bytes) -> str:
    """The hashed-payload value of a body held whole: lowercase hex SHA-256 (AWS compares it as a string)."""
    return hashlib.sha256(body).hexdigest()


def sign(
    *,
    method: str,
    host: str,
    port: int,
    target: str,
    headers: Sequence[tuple[str, str]],
    payload: str,
    access_key_id: str,
    secret_access_key: str,
    session_token: str | None,
    region: str,
    service: str,
    now: float,
) -> list[tuple[str, str]]:
    """Return the headers to ADD to the request: ("x-amz-date", …), ("x-amz-content-sha256", payload),
    ("x-amz-security-token", …) when session_token, and ("authorization", "AWS4-HMAC-SHA256 Credential=…,
    SignedHeaders=…, Signature=…").

    `target` is the origin-form request-target as sent upstream (path and optional `?query`); `headers` are the
    other headers forwarded with it. `payload` is a lowercase hex SHA-256 of the body, UNSIGNED_PAYLOAD, or
    STREAMING_UNSIGNED_TRAILER; signed streaming (STREAMING-AWS4-HMAC-SHA256-PAYLOAD) is refused, since every chunk
    chains its signature from the seed signature and the edge would have to re-sign the body chunk by chunk.
    """
    verb = _checked_method(method)
    host_value = _host_header(host, port)
    path, _, query = target.partition("?")
    if path and not path.startswith("/"):
        raise ValueError("target must be origin-form: a path starting with '/' and an optional '?query'")
    if payload not in (UNSIGNED_PAYLOAD, STREAMING_UNSIGNED_TRAILER):
        _check(payload, _HEX_SHA256, _BAD_PAYLOAD)
    _check(access_key_id, _KEY_ID, "access_key_id must be printable ASCII without spaces, ',' or '/'")
    _check(region, _SCOPE_PART, "region must be letters, digits, '.', '_' or '-'")
    _check(service, _SCOPE_PART, "service must be letters, digits, '.', '_' or '-'")
    if session_token:
        _check(session_token, _TOKEN, "session_token must be printable ASCII without spaces")
    if not isinstance(secret_access_key, str) or not secret_access_key:
        raise TypeError("secret_access_key must be a non-empty str")
    secret = _utf8(secret_access_key, "secret_access_key")

    amz_date = _amz_date(now)
    day = amz_date[:8]
    added = [("x-amz-date", amz_date), ("x-amz-content-sha256", payload)]
    if session_token:
        added.append(("x-amz-security-token", session_token))

    canonical_headers, signed_headers = _canonical_headers([("host", host_value), *added], headers)
    canonical_request = "\n".join((
        verb,
        _canonical_uri(path, service),
        _canonical_query(query),
        canonical_headers,
        signed_headers,
        payload,
    ))
    scope = f"{day}/{region}/{service}/aws4_request"
    # The canonical request carries the session token: encoded through _utf8 so a failure cannot hold it.
    digest = hashlib.sha256(_utf8(canonical_request, "a header value or the target")).hexdigest()
    string_to_sign = f"{_ALGORITHM}\n{amz_date}\n{scope}\n{digest}"
    key = _signing_key(secret, day, region, service)
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    authorization = f"{_ALGORITHM} Credential={access_key_id}/{scope}, SignedHeaders={signed_headers}, Signature={signature}"
    return [*added, ("authorization", authorization)]


def _canonical_uri(path: str, service: str) -> str:
    """The path line of the canonical request.

    S3 signs the path exactly as sent (it neither normalizes nor double-encodes). Every other service signs the path
    with dot segments and empty segments removed, then URI-encoded once more ('/' and '~' kept) — botocore's
    `quote(normalize_url_path(path), safe='/~')`. For a path already encoded the AWS way (as SDKs send it) that is
    AWS's "encode each segment twice"; a '%XX' on the wire becomes '%25XX', as the service computes it.
    """
    if not path:
        return "/"
    if service == "s3":
        return path
    return quote(_remove_dot_segments(path), safe="/~")


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4, plus what AWS adds (and botocore does): consecutive slashes collapse to one."""
    kept: list[str] = []
    for segment in path.split("/"):
        if segment == "..":
            if kept:
                kept.pop()
        elif segment and segment != ".":
            kept.append(segment)
    leading = "/" if path.startswith("/") else ""
    trailing = "/" if path.endswith("/") and kept else ""
    return leading + "/".join(kept) + trailing


def _canonical_query(query: str) -> str:
    """The query line: each `k=v` (a bare `k` has an empty value) decoded and re-encoded the AWS way, then sorted.

    Decoding works on bytes so a `%FF` that is not UTF-8 survives as `%FF`, and a lowercase `%2f` becomes `%2F`; '+' is
    a literal plus, not a space (AWS does not read form encoding here). Empty pieces (`a=1&&b=2`, a trailing '&')
    carry no parameter and are skipped. Sorting is by encoded key, then encoded value.
    """
    pairs: list[tuple[str, str]] = []
    for piece in query.split("&"):
        if not piece:
            continue
        key, _, value = piece.partition("=")
        pairs.append((_aws_encode(key), _aws_encode(value)))
    return "&".join(f"{key}={value}" for key, value in sorted(pairs))


def _aws_encode(component: str) -> str:
    """Percent-decode, then URI-encode keeping only the unreserved characters (AWS's UriEncode)."""
    return quote(unquote_to_bytes(component), safe=_UNRESERVED)


def _canonical_headers(own: list[tuple[str, str]], forwarded: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """The canonical header block (with its closing blank line) and the SignedHeaders list.

    Values are trimmed with runs of whitespace collapsed to one space (botocore's `' '.join(value.split())`); several
    headers of one name are joined with ',' in the order they are sent. The caller's copies of host and of the edge's
    own headers are ignored: what the edge writes is what is signed.
    """
    values: dict[str, list[str]] = {}
    for name, value in own:
        values.setdefault(name, []).append(value)
    for name, value in forwarded:
        lname = name.strip().lower()
        if lname in _NEVER_FROM_CALLER or not (lname in _SIGNED_NAMES or lname.startswith(_SIGNED_PREFIX)):
            continue
        values.setdefault(lname, []).append(value)
    names = sorted(values)
    block = "".join(f"{name}:{','.join(' '.join(v.split()) for v in values[name])}\n" for name in names)
    return block, ";".join(names)


def _signing_key(secret: bytes, day: str, region: str, service: str) -> bytes:
    """HMAC-SHA256 chain `AWS4`+secret → date → region → service → `aws4_request` (a key valid for one day)."""
    key = b"AWS4" + secret
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def _amz_date(now: float) -> str:
    """`now` (POSIX seconds) as x-amz-date, UTC, whole seconds (fractions truncated, as botocore does)."""
    if isinstance(now, bool) or not isinstance(now, (int, float)):
        raise TypeError("now must be a POSIX timestamp (int or float)")
    try:
        return datetime.fromtimestamp(now, tz=UTC).strftime(_TIMESTAMP)
    except (OverflowError, OSError, ValueError):
        pass
    raise ValueError("now is not a representable POSIX timestamp")


def _checked_method(method: str) -> str:
    """The method as signed: uppercased like botocore, and a token, since it opens the canonical request."""
    _check(method, _METHOD, "method must be an HTTP token")
    return method.upper()


def _host_header(host: str, port: int) -> str:
    """The Host value the upstream sees, and so the one signed: `host`, with `:port` unless the port is 443."""
    _check(host, _HOST, "host must be printable ASCII without spaces")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("port must be an integer in 1..65535")
    return host if port == 443 else f"{host}:{port}"


def _utf8(text: str, what: str) -> bytes:
    """`text` as UTF-8. A failure is raised outside the `except`, so no chained UnicodeEncodeError travels with it: its
    `object` attribute would hold the whole text (a secret, or a canonical request with the session token)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    raise ValueError(f"{what} is not encodable as UTF-8")


def _check(value: str, pattern: re.Pattern[str], message: str) -> None:
    """Refuse a value that could break the signed structure (a newline, a comma, a slash); the message never echoes it."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(message)
