"""Recognizing string literals that look like credentials, so that policies only ever hold custody handles."""

from __future__ import annotations

import math
import re
from collections import Counter

from compiler.constants import (
    HIGH_ENTROPY_BITS_PER_CHAR,
    HIGH_ENTROPY_MIN_LENGTH,
    SECRET_PREFIXES,
)

_WORDS = re.compile(r"[\s/?&=@:#;,]+")
_TOKENISH = re.compile(r"^[A-Za-z0-9+/=_\-.~]+$")
_PEM = re.compile(r"-----BEGIN [A-Z ]*(PRIVATE KEY|CERTIFICATE|KEY)-----")


def _entropy(text: str) -> float:
    counts = Counter(text)
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def secret_kind(text: str) -> str | None:
    """Why `text` looks like a secret (a short, value-free description), or None."""
    for word in _WORDS.split(text):  # a URL's userinfo, path segments and query values are words too
        for prefix in SECRET_PREFIXES:
            if word.startswith(prefix) and len(word) >= len(prefix) + 8:
                return f"starts with the token prefix `{prefix}`"
    if _PEM.search(text):
        return "contains a PEM block"
    for word in re.split(r"[\s,;:\"']+", text):
        if (
            len(word) >= HIGH_ENTROPY_MIN_LENGTH
            and not word.startswith("/")
            and _TOKENISH.match(word)
            and any(c.isdigit() for c in word)
            and any(c.isalpha() for c in word)
            and word.count(".") < 2  # dotted names (hosts) are not tokens
            and _entropy(word) >= HIGH_ENTROPY_BITS_PER_CHAR
        ):
            return f"is a {len(word)}-character high-entropy string"
    return None


def redact(text: str) -> str:
    """`text` for a message: the literal itself if harmless, else a placeholder that names no byte of it."""
    return "<redacted>" if secret_kind(text) else text


_LITERAL_OR_COMMENT = re.compile(r'"(?:[^"\\]|\\.)*"|#.*$')


def mask_secrets(line: str) -> str:
    """A source line with every secret-looking string literal or comment replaced by `*` of equal width."""

    def mask(m: re.Match) -> str:
        text = m.group(0)
        return "*" * len(text) if secret_kind(text.strip('"#')) else text

    return _LITERAL_OR_COMMENT.sub(mask, line)
