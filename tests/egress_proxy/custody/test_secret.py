"""Secret never shows its value; needles cover the encodings a leak would take."""

from __future__ import annotations

import base64
import copy
import logging
import pickle
import traceback
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egress_proxy.custody.secret import Secret, encodings_of

VALUE = b"ghp_canaryCANARY0123456789+/=?&"


def _hits(text: str | bytes) -> list[bytes]:
    data = text.encode() if isinstance(text, str) else text
    return [n for n in encodings_of(VALUE) if n in data]


def test_reveal_is_the_only_way_out() -> None:
    s = Secret(VALUE)
    assert s.reveal() == VALUE
    assert isinstance(s.reveal(), bytes)


@pytest.mark.parametrize(
    "render",
    [repr, str, ascii, lambda s: f"{s}", lambda s: f"{s!r}", lambda s: f"{s:>80}", lambda s: "%s %r" % (s, s),
     lambda s: "{0}".format(s), lambda s: str([s, {"k": s}, (s,)]), lambda s: repr(vars(type(s)))],
)
def test_renderings_never_show_the_value(render) -> None:
    shown = render(Secret(VALUE))
    assert _hits(shown) == []
    assert "Secret(<redacted>)" in shown or "reveal" in shown


def test_no_instance_dict_and_no_implicit_bytes() -> None:
    s = Secret(VALUE)
    with pytest.raises(TypeError):
        vars(s)
    with pytest.raises(TypeError, match="reveal"):
        bytes(s)


def test_logging_never_shows_the_value(caplog: pytest.LogCaptureFixture) -> None:
    s = Secret(VALUE)
    log = logging.getLogger("egresslaw.test")
    with caplog.at_level(logging.DEBUG, logger="egresslaw.test"):
        log.info("credential %s %r", s, s)
        log.info(s)
        log.warning("as dict %(c)s", {"c": s})
    assert len(caplog.records) == 3
    assert _hits(caplog.text) == []
    assert "Secret(<redacted>)" in caplog.text


def test_exceptions_and_tracebacks_never_show_the_value() -> None:
    s = Secret(VALUE)
    try:
        raise ValueError("bad", s)
    except ValueError as exc:
        rendered = "".join(traceback.format_exception(exc)) + str(exc) + repr(exc)
    assert _hits(rendered) == []


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickling_raises(protocol: int) -> None:
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(Secret(VALUE), protocol=protocol)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps({"nested": [Secret(VALUE)]}, protocol=protocol)


def test_copies_are_the_same_object() -> None:
    s = Secret(VALUE)
    assert copy.copy(s) is s
    assert copy.deepcopy({"x": s})["x"] is s


def test_equality_and_hashing() -> None:
    assert Secret(VALUE) == Secret(VALUE)
    assert Secret(VALUE) != Secret(VALUE + b"x")
    assert Secret(VALUE) != VALUE  # never equal to the raw bytes: no oracle through ==
    with pytest.raises(TypeError):
        hash(Secret(VALUE))


def test_only_bytes_are_accepted() -> None:
    with pytest.raises(TypeError):
        Secret("a str")  # type: ignore[arg-type]
    assert Secret(bytearray(b"ab")).reveal() == b"ab"


def test_needles_cover_the_documented_encodings() -> None:
    needles = set(Secret(VALUE).needles())
    std = base64.b64encode(VALUE)
    url = base64.urlsafe_b64encode(VALUE)
    expected = {
        VALUE,
        std,
        std.rstrip(b"="),
        url,
        url.rstrip(b"="),
        quote(VALUE, safe="").encode(),
        VALUE.hex().encode(),
        VALUE.hex().upper().encode(),
    }
    assert expected <= needles
    assert Secret(VALUE).needles()[0] == VALUE
    assert Secret(VALUE).needles() == encodings_of(VALUE)
    assert len(set(encodings_of(VALUE))) == len(encodings_of(VALUE))


def test_json_and_html_escaped_copies_are_covered() -> None:
    needles = encodings_of(b"a/b<c&d")
    assert b"a\\/b<c&d" in needles  # JSON with an escaped slash
    assert b"a/b\\u003cc\\u0026d" in needles  # Go's HTML-safe JSON
    assert b"\\u0061\\u002f\\u0062\\u003c\\u0063\\u0026\\u0064" in needles  # every character escaped
    assert b"\\u0061\\u002F\\u0062\\u003C\\u0063\\u0026\\u0064" in needles
    assert b"a/b&lt;c&amp;d" in needles  # HTML
    assert {b"%61%2F%62%3C%63%26%64", b"%61%2f%62%3c%63%26%64"} <= set(needles)  # every character URL-encoded
    assert {b"&#97;&#47;&#98;&#60;&#99;&#38;&#100;", b"&#x61;&#x2f;&#x62;&#x3c;&#x63;&#x26;&#x64;",
            b"&#x61;&#x2F;&#x62;&#x3C;&#x63;&#x26;&#x64;"} <= set(needles)  # every character an HTML reference
    assert encodings_of("é".encode())[-2:] == (b"\\u00e9", b"\\u00E9")


def test_lowercase_percent_escapes_are_covered() -> None:
    needles = encodings_of(b"a+b/c=d")
    assert b"a%2Bb%2Fc%3Dd" in needles
    assert b"a%2bb%2fc%3dd" in needles


@pytest.mark.parametrize("prefix", [b"", b"u:", b"us:", b"use:", b"user:", b"x" * 7 + b":"])
@pytest.mark.parametrize("suffix", [b"", b"!", b"!!", b"!!!"])
def test_value_embedded_in_base64_is_found(prefix: bytes, suffix: bytes) -> None:
    # HTTP Basic auth puts the secret at an arbitrary offset inside one base64 string
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        blob = encode(prefix + VALUE + suffix)
        assert any(n in blob for n in encodings_of(VALUE)[1:]), (prefix, suffix)


def test_short_values_get_no_short_stems() -> None:
    # a 4-character base64 stem would match random base64 in responses: only the full forms
    assert encodings_of(b"ab") == (b"ab", b"YWI=", b"YWI", b"6162", b"%61%62", b"&#97;&#98;", b"&#x61;&#x62;", b"\\u0061\\u0062")
    assert encodings_of(b"") == ()


@given(st.binary(min_size=1, max_size=64))
def test_needles_always_contain_value_and_hex(value: bytes) -> None:
    needles = encodings_of(value)
    assert needles[0] == value
    assert value.hex().encode() in needles
    assert base64.b64encode(value) in needles
    assert len(set(needles)) == len(needles)


@given(st.text(min_size=1, max_size=30))
def test_needles_hold_every_escaped_form_of_a_text_value(text: str) -> None:
    import html
    import json

    needles = set(encodings_of(text.encode()))
    plain = json.dumps(text)[1:-1]
    for form in (plain, plain.replace("/", "\\/"), html.escape(text), json.dumps(text, ensure_ascii=False)[1:-1]):
        assert form.encode() in needles, form
    assert "".join(f"\\u{ord(c):04x}" for c in text).encode() in needles or any(ord(c) > 0xFFFF for c in text)


def test_a_basic_credential_s_needles_include_what_it_decodes_to():
    value = base64.b64encode(b"x-access-token:ghs_token12345")
    needles = Secret(value).needles("Basic {secret}")
    assert needles[: len(encodings_of(value))] == encodings_of(value)  # the value's own needles first
    assert b"x-access-token:ghs_token12345" in needles and b"ghs_token12345" in needles
    assert base64.b64encode(b"ghs_token12345") in needles and b"ghs%5Ftoken12345" not in needles  # `_` is URL-safe
    assert b"x-access-token:ghs_token12345" not in Secret(value).needles("Bearer {secret}")
    assert Secret(b"not base64!").needles("Basic {secret}") == encodings_of(b"not base64!")
    assert b"short" not in Secret(base64.b64encode(b"u:short")).needles("Basic {secret}")  # a short password alone is not a needle


def test_whitespace_around_the_value_is_also_left_out_as_an_upstream_reads_the_header() -> None:
    # found by redteam2: `Bearer {secret}` with a trailing space kept by custody; the upstream echoes the value without it
    needles = Secret(b"\tghs_token0123456789 ").needles("Bearer {secret}")
    assert set(encodings_of(b"ghs_token0123456789")) <= set(needles)
    assert Secret(VALUE).needles() == encodings_of(VALUE)
