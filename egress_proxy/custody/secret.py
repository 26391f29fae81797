"""`Secret`: a credential value that never shows itself, and the encodings a scanner looks for."""

from __future__ import annotations

import base64
import binascii
import hmac
import html
import json
import re
from typing import Final, NoReturn, final
from urllib.parse import quote, quote_plus

_SHOWN: Final = "Secret(<redacted>)"

# Base64 stems shorter than this are too likely to occur by chance in a response body.
_MIN_STEM: Final = 8

_PERCENT: Final = re.compile(r"%[0-9A-F]{2}")
_ESCAPED_BY_SOMEONE: Final = frozenset("\"\\/<>&'")  # characters JSON, Go's JSON or HTML encoders escape


@final
class Secret:
    """Bytes that `repr`, `str`, `format`, logging, pickling, copying and exceptions never show.

    `reveal()` is the only way out and is called at the moment of injection. Equality is
    constant-time; a Secret is not hashable (a hash is a function of the value).
    """

    __slots__ = ("__value", "__needles")

    def __init__(self, value: bytes) -> None:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("a secret holds bytes")
        self.__value = bytes(value)

    def reveal(self) -> bytes:
        """The value itself: call this only where the bytes leave for the upstream request."""
        return self.__value

    def needles(self, inject_format: str = "{secret}") -> tuple[bytes, ...]:
        """The value and its common encodings, for scanning responses and outputs; a value with whitespace around it, also
        without (as the upstream reads a header). Injected as `Basic {secret}`, also what the upstream decodes it to:
        `user:password` and the password, with their encodings. Derived once per Secret and kind of format (the proxy
        opens the same Secret for many requests)."""
        basic = inject_format.partition("{secret}")[0].strip().lower() == "basic"
        try:
            memo = self.__needles
        except AttributeError:
            memo = self.__needles = {}
        found = memo.get(basic)
        if found is None:
            found = encodings_of(self.__value)
            # An HTTP server strips the whitespace around a header value: the upstream reads (and echoes) it without.
            bare = self.__value.strip(b" \t")
            parts = ([bare] if bare and bare != self.__value else []) + (_basic_parts(self.__value) if basic else [])
            if parts:
                seen = dict.fromkeys(found)
                for part in parts:
                    seen.update(dict.fromkeys(encodings_of(part)))
                found = tuple(seen)
            memo[basic] = found
        return found

    def __repr__(self) -> str:
        return _SHOWN

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return _SHOWN

    def __bytes__(self) -> NoReturn:
        raise TypeError("a secret is not converted implicitly; call .reveal() at injection")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self.__value, other.__value)

    __hash__ = None  # type: ignore[assignment]

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise TypeError("a secret cannot be pickled")

    def __reduce__(self) -> NoReturn:
        raise TypeError("a secret cannot be pickled")

    def __getstate__(self) -> NoReturn:
        raise TypeError("a secret cannot be pickled")

    # Immutable: a copy is the same object, so copying never goes through pickling's protocol.
    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: object) -> Secret:
        return self


def _b64_stems(value: bytes) -> list[bytes]:
    """Base64 text that appears wherever `value` is embedded in a longer base64 stream.

    Base64 maps 3 bytes to 4 characters, so the value's encoding depends on its offset mod 3
    inside the encoded stream (`user:secret` in HTTP Basic auth is offset 5). For each offset,
    keep only the characters that depend on the value alone.
    """
    stems: list[bytes] = []
    for shift in (0, 1, 2):
        padded = bytes(shift) + value
        whole = len(padded) // 3  # groups made only of (prefix +) value bytes
        first = 1 if shift else 0  # the first group mixes prefix bytes with value bytes
        if whole - first <= 0:
            continue
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            stem = encode(padded[: whole * 3])[first * 4 :]
            if len(stem) >= _MIN_STEM:
                stems.append(stem)
    return stems


def _basic_parts(value: bytes) -> list[bytes]:
    """What an HTTP Basic credential (base64 of `user:password`) decodes to: the pair, and the password when it is
    long enough not to occur by chance; nothing for a value that is not such a credential."""
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return []
    _, colon, password = decoded.partition(b":")
    if not colon:
        return []
    return [decoded] + ([password] if len(password) >= _MIN_STEM else [])


def encodings_of(value: bytes) -> tuple[bytes, ...]:
    """`value` and its common encodings (base64 std/urlsafe with and without padding and embedded,
    URL-encoded, hex lower and upper, JSON- and HTML-escaped, also with every character escaped), without duplicates,
    the value first."""
    value = bytes(value)
    if not value:
        return ()
    std = base64.b64encode(value)
    url = base64.urlsafe_b64encode(value)
    hexed = binascii.hexlify(value)
    candidates = [
        value,
        std,
        std.rstrip(b"="),
        url,
        url.rstrip(b"="),
        *_b64_stems(value),
        quote(value, safe="").encode("ascii"),
        quote_plus(value, safe="").encode("ascii"),
        _lower_percent(quote(value, safe="")).encode("ascii"),
        hexed,
        hexed.upper(),
        *_every_character(value),
        *_escaped(value),
    ]
    seen: dict[bytes, None] = {}
    for needle in candidates:
        if needle and needle not in seen:
            seen[needle] = None
    return tuple(seen)


def _every_character(value: bytes) -> list[bytes]:
    """URL- and HTML-escaped with every character escaped, as obfuscating encoders do (`%67%68…`, `&#103;&#104;…`,
    `&#x67;&#x68;…`): every byte percent-encoded (upper and lower hex digits) and, for text, every character as a
    numeric character reference (decimal, and hex in lower and upper digits)."""
    percent = "".join(f"%{byte:02X}" for byte in value)
    forms = [percent, percent.lower()]
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return [f.encode("ascii") for f in forms]
    hexed = "".join(f"&#x{ord(c):x};" for c in text)
    forms += ["".join(f"&#{ord(c)};" for c in text), hexed, hexed.upper().replace("&#X", "&#x")]
    return [f.encode("ascii") for f in forms]


def _escaped(value: bytes) -> list[bytes]:
    """How a JSON or HTML document quotes the value: as its encoder escapes it (`\\/`, `\\u003c` …), and every
    character as `\\uXXXX` (lower and upper hex digits). Only for values that are text."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return []
    # UTF-16 code units in hex, each as \uXXXX (a character outside the BMP becomes its surrogate pair, as in JSON)
    every = "\\u" + text.encode("utf-16-be").hex("|", 2).replace("|", "\\u")
    if text.isascii() and text.isprintable() and not _ESCAPED_BY_SOMEONE.intersection(text):
        return [every.encode("ascii"), every.upper().replace("\\U", "\\u").encode("ascii")]  # the other forms are the value
    plain = json.dumps(text)[1:-1]
    html_safe = plain.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")  # Go's encoding/json
    return [
        f.encode("utf-8")
        for f in (plain, json.dumps(text, ensure_ascii=False)[1:-1], plain.replace("/", "\\/"), html_safe, every, every.upper().replace("\\U", "\\u"),
                  html.escape(text))
    ]


def _lower_percent(text: str) -> str:
    """`%2F` → `%2f`: some encoders emit lowercase hex digits in percent escapes."""
    return _PERCENT.sub(lambda m: m.group(0).lower(), text)
