"""The one host normalizer and the one path normalizer, shared by compiler, decision function and prover."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

import idna

from compiler.errors import CompilerError

MAX_HOST_LENGTH = 253
MAX_LABEL_LENGTH = 63
_LDH = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_DEC_QUAD_PART = re.compile(r"^(0|[1-9][0-9]{0,2})$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
_HEX = "0123456789abcdefABCDEF"
_UNRESERVED = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
# RFC 3986 pchar (minus percent, handled separately) plus "/"; ";" is refused separately.
_PATH_SAFE = _UNRESERVED | set("!$&'()*+,=:@/")
# Fast path for the common case: a path made only of _PATH_SAFE characters (no `%`, `;` or NUL)
# is its own normal form up to the `//` and dot-segment checks; the loop below would copy it unchanged.
_PLAIN_PATH = re.compile("[" + re.escape("".join(sorted(_PATH_SAFE))) + "]*")


class HostError(CompilerError, ValueError):
    """A host that is not an acceptable exact name or canonical IP literal; `reason` is a stable code."""

    def __init__(self, reason: str, message: str, help: str | None = None) -> None:
        super().__init__(message, help)
        self.reason = reason


class PathError(CompilerError, ValueError):
    """A request path or rule prefix that is refused rather than rewritten; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HostForm:
    """A normalized host: a lowercase A-label name, or a canonical IP literal."""

    kind: Literal["name", "ipv4", "ipv6"]
    value: str

    @property
    def is_ip(self) -> bool:
        return self.kind != "name"


def normalize_host(raw: str) -> HostForm:
    """Normalize one host (no port): UTS-46, lowercase, one trailing dot dropped; refuse every ambiguous form."""
    if not raw:
        raise HostError("host-empty", "host is empty")
    if "*" in raw:
        raise HostError("host-wildcard", f"wildcard host `{_show(raw)}`", "list each exact host you need")
    if "://" in raw:
        raise HostError("host-scheme", f"host `{_show(raw)}` has a scheme", "write the bare host name, e.g. `api.github.com`")
    if "@" in raw:
        raise HostError("host-userinfo", f"host `{_show(raw)}` has userinfo", "remove the `user@` part")
    if "/" in raw or "?" in raw or "#" in raw or "\\" in raw:
        raise HostError("host-path", f"host `{_show(raw)}` has a path", "put the path in `path_prefix`")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in raw):
        raise HostError("host-invalid-character", f"host `{_show(raw)}` contains whitespace or a control character")
    if raw.startswith("["):
        return _bracketed_ipv6(raw)
    if ":" in raw:
        try:
            return HostForm("ipv6", ipaddress.IPv6Address(raw).compressed)
        except ValueError:
            raise HostError("host-port", f"host `{_show(raw)}` contains `:`", "give the port separately") from None
    host = raw
    if not host.isascii():
        try:
            host = idna.encode(host, uts46=True, std3_rules=True, transitional=False).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError):
            raise HostError("host-idna", f"host `{_show(raw)}` is not a valid internationalized name") from None
    host = host.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or host.endswith(".") or host.startswith(".") or ".." in host:
        raise HostError("host-empty-label", f"host `{_show(raw)}` has an empty label")
    labels = host.split(".")
    if _NUMERIC_LABEL.match(labels[-1]):
        return _numeric(raw, labels)
    if len(host) > MAX_HOST_LENGTH:
        raise HostError("host-too-long", f"host `{_show(raw)}` is longer than {MAX_HOST_LENGTH} characters")
    for label in labels:
        if len(label) > MAX_LABEL_LENGTH:
            raise HostError("host-label-length", f"label `{label}` is longer than {MAX_LABEL_LENGTH} characters")
        if not _LDH.match(label):
            raise HostError("host-label-syntax", f"label `{_show(label)}` is not letters, digits and inner hyphens")
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError, ValueError):
                raise HostError("host-idna", f"label `{label}` is not a valid A-label") from None
    return HostForm("name", host)


def _bracketed_ipv6(raw: str) -> HostForm:
    if not raw.endswith("]"):
        raise HostError("host-bracket", f"host `{_show(raw)}` has an unclosed bracket")
    inner = raw[1:-1]
    if "%" in inner:
        raise HostError("host-zone-id", f"IPv6 literal `{_show(raw)}` carries a zone id")
    try:
        return HostForm("ipv6", ipaddress.IPv6Address(inner).compressed)
    except ValueError:
        raise HostError("host-bracket", f"`{_show(raw)}` is not an IPv6 literal") from None


def _numeric(raw: str, labels: list[str]) -> HostForm:
    # INVARIANT: a host whose last label is a number is an IP address to every URL parser
    # (WHATWG "ends in a number"); only the canonical dotted quad, written in ASCII, is accepted.
    if raw.isascii() and len(labels) == 4 and all(_DEC_QUAD_PART.match(p) and int(p) <= 255 for p in labels):
        return HostForm("ipv4", ".".join(labels))
    raise HostError(
        "host-noncanonical-ip",
        f"`{_show(raw)}` is a non-canonical numeric IP form",
        "write an IPv4 literal as four decimal octets, or use a name",
    )


def normalize_path(raw: str) -> str:
    """The path of a request target without query, with percent-hex uppercased; refuse what could be read two ways."""
    if "#" in raw:
        raise PathError("path-fragment", "request target carries a fragment")
    path = raw.split("?", 1)[0]
    if not path.startswith("/"):
        raise PathError("path-not-absolute", f"path `{_show(path)}` does not start with `/`")
    if _PLAIN_PATH.fullmatch(path):
        return _check_segments(path)
    out = []
    i = 0
    while i < len(path):
        c = path[i]
        if c == "%":
            pair = path[i + 1 : i + 3]
            if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
                raise PathError("path-bad-escape", "path has a malformed percent-escape")
            pair = pair.upper()
            ch = chr(int(pair, 16))
            if ch in "/\\":
                raise PathError("path-encoded-slash", "path contains an encoded slash")
            if ch == ".":
                raise PathError("path-encoded-dot", "path contains an encoded dot")
            if ch == "\x00":
                raise PathError("path-nul", "path contains NUL")
            if ch == ";":
                raise PathError("path-parameter", "path contains an encoded `;`")
            if ch in _UNRESERVED:
                raise PathError("path-noncanonical-escape", "path percent-encodes an unreserved character")
            out.append("%" + pair)
            i += 3
            continue
        if c == "\x00":
            raise PathError("path-nul", "path contains NUL")
        if c == ";":
            raise PathError("path-parameter", "path contains `;` parameters")
        if c not in _PATH_SAFE:
            raise PathError("path-invalid-character", "path contains a character that must be percent-encoded")
        out.append(c)
        i += 1
    return _check_segments("".join(out))


def _check_segments(norm: str) -> str:
    if "//" in norm:
        raise PathError("path-empty-segment", "path contains `//`")
    if "/." in norm:  # only then can a segment be `.` or `..` (every path starts with `/`)
        for segment in norm.split("/"):
            if segment in (".", ".."):
                raise PathError("path-dot-segment", "path contains a `.` or `..` segment")
    return norm


def check_target(raw: str) -> str:
    """The path of a sandbox-profile request, without query, checked only for what every parser reads one way.

    A profile grants whole `host:port` pairs, so no path decision depends on how a path is read:
    dot segments, `//`, `;` and encoded `/` or `.` (npm's `/@scope%2fname`) pass; a fragment, a
    relative target, NUL, a malformed escape, whitespace, control or non-ASCII characters do not.
    """
    if "#" in raw:
        raise PathError("path-fragment", "request target carries a fragment")
    path = raw.split("?", 1)[0]
    if not path.startswith("/"):
        raise PathError("path-not-absolute", f"path `{_show(path)}` does not start with `/`")
    for i, c in enumerate(path):
        if c == "%":
            pair = path[i + 1 : i + 3]
            if len(pair) != 2 or pair[0] not in _HEX or pair[1] not in _HEX:
                raise PathError("path-bad-escape", "path has a malformed percent-escape")
            if pair == "00":
                raise PathError("path-nul", "path contains NUL")
        elif c == "\x00":
            raise PathError("path-nul", "path contains NUL")
        elif ord(c) <= 0x20 or ord(c) >= 0x7F:
            raise PathError("path-invalid-character", "path contains a character that must be percent-encoded")
    return path


def normalize_prefix(raw: str) -> str:
    """A rule's path prefix in canonical form: a valid path with no query and no trailing `/` (except `/` itself)."""
    if "?" in raw:
        raise PathError("path-query", "path prefix contains a query")
    norm = normalize_path(raw)
    if norm != raw:
        raise PathError("path-not-canonical", f"path prefix is not in canonical form (canonical: `{norm}`)")
    return norm.rstrip("/") or "/"


def prefix_matches(prefix: str, path: str) -> bool:
    """Segment-bounded prefix match: `/repos/acme` admits `/repos/acme` and `/repos/acme/x`, never `/repos/acmex`."""
    # INVARIANT: both arguments are already normalized (normalize_prefix / normalize_path).
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def _show(text: str) -> str:
    """User input for a message: control characters escaped, long input shortened."""
    shown = text.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 80 else shown[:77] + "..."
