"""`egresslaw custody put --kind oauth2|github_app|aws_sigv4`: a structured record from a JSON object on stdin or from
`--field NAME=VALUE` (plain fields) and `--field-file NAME=PATH`, checked for its kind before anything is sealed, and
never a value in what the command prints. `--kind static` (the default) is the value on stdin, as before kinds."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from egress_proxy.credentials import KINDS
from egress_proxy.credentials.base import open_fields
from egress_proxy.custody.keys import init_keys
from egress_proxy.custody.records import FIELDS_MARK, Address, decode_fields
from egress_proxy.custody.secret import Secret, encodings_of
from egress_proxy.custody.stores import open_store

WHERE = ["--workspace", "acme", "--connection", "drive", "--handle", "drive-oauth"]
ADDRESS = Address("acme", "drive", "drive-oauth")
# Distinctive values: none of them (in any encoding the scanner knows) may appear in what the CLI prints.
CLIENT_ID = "cid-canary-public-4e1b"
CLIENT_SECRET = "csecret-canary-8d3f0a"
REFRESH = "rtoken-canary-b72c91"
KEY_ID = "AKIACANARYKEYID00042"
SECRET_KEY = "aws-secret-canary-3f9e/K7MDENG+bPx"
SESSION = "aws-session-canary-7c2d=="
CANARIES = (CLIENT_ID, CLIENT_SECRET, REFRESH, KEY_ID, SECRET_KEY, SESSION, "canary")


@pytest.fixture(scope="module")
def app_pem() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption()).decode("ascii")


@pytest.fixture()
def keys(tmp_path: Path) -> Path:
    init_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture()
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "custody.db"


@pytest.fixture()
def put(cli, keys, store_path, monkeypatch):
    """`egresslaw custody put` at ADDRESS with `stdin`: (exit code, stdout, stderr)."""

    def run(*args: str, stdin: bytes = b""):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        return cli("custody", "put", "--keys", keys, "--store", store_path, *WHERE, *args)

    return run


def sealed(keys: Path, store_path: Path) -> bytes:
    with open_store(store_path, keys, create=False) as store:
        return store.open(ADDRESS).reveal()


def assert_nothing_shown(*texts: str, values: tuple[str, ...] = CANARIES) -> None:
    shown = "\n".join(texts)
    for value in values:
        for needle in encodings_of(value.encode()):
            assert needle.decode("ascii", "replace") not in shown, f"an encoding of a value was shown: {value[:6]}…"


def pem_lines(pem: str) -> tuple[str, ...]:
    return tuple(line for line in pem.splitlines() if len(line) >= 16 and not line.startswith("-----"))


# -- sealing -------------------------------------------------------------------------------------------------------------


def test_oauth2_fields_as_json_on_stdin_are_sealed_as_a_structured_record(put, keys, store_path):
    doc = {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "refresh_token": REFRESH}
    code, out, err = put("--kind", "oauth2", stdin=json.dumps(doc).encode() + b"\n")
    assert (code, err) == (0, "")
    assert out.startswith("sealed `acme/drive/drive-oauth` (oauth2: client_id, client_secret, refresh_token) under key id `")
    assert_nothing_shown(out, err)
    value = sealed(keys, store_path)
    assert value.startswith(FIELDS_MARK)
    assert decode_fields(value) == ("oauth2", doc)


def test_github_app_from_field_and_field_file_keeps_the_pem_whole(put, keys, store_path, tmp_path, app_pem):
    (tmp_path / "app.pem").write_text(app_pem)
    code, out, err = put("--kind", "github_app", "--field", "app_id=424242", "--field-file", f"private_key={tmp_path / 'app.pem'}")
    assert (code, err) == (0, "")
    assert "(github_app: app_id, private_key)" in out
    assert_nothing_shown(out, err, values=pem_lines(app_pem))
    kind, fields = decode_fields(sealed(keys, store_path))
    assert (kind, fields) == ("github_app", {"app_id": "424242", "private_key": app_pem})
    opened = open_fields(KINDS["github_app"], Secret(sealed(keys, store_path)))
    assert opened.plain == {"app_id": "424242"} and set(opened.secret) == {"private_key"}


def test_aws_sigv4_field_files_lose_one_trailing_newline(put, keys, store_path, tmp_path):
    (tmp_path / "secret").write_text(SECRET_KEY + "\n")
    (tmp_path / "session").write_text(SESSION)
    code, out, err = put("--kind", "aws_sigv4", "--field", f"access_key_id={KEY_ID}",
                         "--field-file", f"secret_access_key={tmp_path / 'secret'}",
                         "--field-file", f"session_token={tmp_path / 'session'}")
    assert (code, err) == (0, "")
    assert "(aws_sigv4: access_key_id, secret_access_key, session_token)" in out
    assert_nothing_shown(out, err)
    assert decode_fields(sealed(keys, store_path)) == (
        "aws_sigv4", {"access_key_id": KEY_ID, "secret_access_key": SECRET_KEY, "session_token": SESSION})


def test_put_again_replaces_the_record(put, keys, store_path):
    first = {"client_id": CLIENT_ID, "refresh_token": REFRESH}
    assert put("--kind", "oauth2", stdin=json.dumps(first).encode())[0] == 0
    second = {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET}
    assert put("--kind", "oauth2", stdin=json.dumps(second).encode())[0] == 0
    assert decode_fields(sealed(keys, store_path)) == ("oauth2", second)


def test_custody_list_shows_the_address_and_never_a_value(put, cli, keys, store_path):
    assert put("--kind", "oauth2", stdin=json.dumps({"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
                                                     "refresh_token": REFRESH}).encode())[0] == 0
    code, out, err = cli("custody", "list", "--keys", keys, "--store", store_path)
    assert code == 0
    [header, row] = out.splitlines()
    assert row.split()[:3] == ["acme", "drive", "drive-oauth"]
    assert_nothing_shown(out, err)
    code, out, err = cli("custody", "list", "--keys", keys, "--store", store_path, "--format", "json")
    assert code == 0
    [entry] = json.loads(out)
    assert (entry["workspace"], entry["connection"], entry["handle"]) == ("acme", "drive", "drive-oauth")
    assert set(entry) == {"workspace", "connection", "handle", "key_id", "created", "updated"}
    assert_nothing_shown(out, err)


@pytest.mark.parametrize("kind_args", [(), ("--kind", "static")])
def test_a_static_value_on_stdin_is_sealed_as_before(put, keys, store_path, kind_args):
    code, out, err = put(*kind_args, stdin=f"{CLIENT_SECRET}\n".encode())
    assert (code, err) == (0, "")
    assert out.startswith("sealed `acme/drive/drive-oauth` under key id `")
    assert "(" not in out
    assert_nothing_shown(out, err)
    value = sealed(keys, store_path)
    assert value == CLIENT_SECRET.encode()
    assert decode_fields(value) is None


def test_a_static_value_with_a_line_break_is_still_refused(put, store_path):
    code, out, err = put("--kind", "static", stdin=f"{CLIENT_SECRET}\n{REFRESH}\n".encode())
    assert code == 1
    assert err.startswith("error: the secret contains LF")
    assert_nothing_shown(out, err)
    assert not store_path.exists()


# -- refusals: exit 1, one `error:` line, no value shown, nothing sealed ------------------------------------------------


def refused(result, store_path: Path, message: str, values: tuple[str, ...] = CANARIES) -> str:
    code, out, err = result
    assert code == 1, (code, err)
    assert out == ""
    first = err.splitlines()[0]
    assert first.startswith("error: ") and message in first, first
    assert_nothing_shown(out, err, values=values)
    assert not store_path.exists()  # refused before the store was touched
    return err


@pytest.mark.parametrize(("kind", "field", "value"), [
    ("oauth2", "client_secret", CLIENT_SECRET),
    ("oauth2", "refresh_token", REFRESH),
    ("aws_sigv4", "secret_access_key", SECRET_KEY),
    ("aws_sigv4", "session_token", SESSION),
    ("github_app", "private_key", "-----BEGIN RSA PRIVATE KEY-----canary"),
])
def test_a_secret_field_on_the_command_line_is_refused(put, store_path, kind, field, value):
    err = refused(put("--kind", kind, "--field", f"{field}={value}"), store_path,
                  f"field `{field}` is a secret and never goes on the command line")
    assert f"--field-file {field}=PATH" in err


def test_a_pem_that_does_not_parse_is_refused(put, store_path, tmp_path):
    (tmp_path / "bad.pem").write_text("-----BEGIN RSA PRIVATE KEY-----\nbm90LWEta2V5LWNhbmFyeQcanary==\n"
                                      "-----END RSA PRIVATE KEY-----\n")
    refused(put("--kind", "github_app", "--field", "app_id=1", "--field-file", f"private_key={tmp_path / 'bad.pem'}"),
            store_path, "`private_key` is not an unencrypted PEM private key",
            values=(*CANARIES, "bm90LWEta2V5LWNhbmFyeQcanary"))


def test_an_ec_key_is_refused(put, store_path, tmp_path):
    key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode("ascii")
    (tmp_path / "ec.pem").write_text(key)
    refused(put("--kind", "github_app", "--field", "app_id=1", "--field-file", f"private_key={tmp_path / 'ec.pem'}"),
            store_path, "`private_key` is not an RSA key", values=(*CANARIES, *pem_lines(key)))


def test_a_non_numeric_app_id_is_refused(put, store_path, tmp_path, app_pem):
    (tmp_path / "app.pem").write_text(app_pem)
    refused(put("--kind", "github_app", "--field", "app_id=app-canary-77", "--field-file",
                f"private_key={tmp_path / 'app.pem'}"), store_path, "`app_id` is not the App's numeric id",
            values=(*CANARIES, *pem_lines(app_pem)))


@pytest.mark.parametrize(("args", "stdin", "message"), [
    (("--kind", "github_app", "--field", "app_id=1"), b"", "lacks `private_key` for a `github_app` credential"),
    (("--kind", "oauth2"), json.dumps({"refresh_token": REFRESH}).encode(), "lacks `client_id`"),
    (("--kind", "aws_sigv4", "--field", f"access_key_id={KEY_ID}"), b"", "lacks `secret_access_key`"),
    (("--kind", "oauth2"), json.dumps({"client_id": CLIENT_ID}).encode(), "needs `refresh_token`"),
    (("--kind", "oauth2"), json.dumps({"client_id": CLIENT_ID, "refresh_token": REFRESH, "auth_method": "canary"}).encode(),
     "`auth_method` must be one of"),
], ids=["field-form", "json-form", "aws", "no-grant-field", "auth-method"])
def test_a_record_missing_what_its_kind_needs_is_refused(put, store_path, args, stdin, message):
    refused(put(*args, stdin=stdin), store_path, message)


def test_an_unknown_field_in_json_is_named_and_its_value_not_shown(put, store_path):
    doc = {"client_id": CLIENT_ID, "refresh_token": REFRESH, "password": CLIENT_SECRET}
    err = refused(put("--kind", "oauth2", stdin=json.dumps(doc).encode()), store_path,
                  "has fields a `oauth2` credential does not take: password")
    assert "help: its fields: client_id, client_secret, refresh_token, auth_method" in err


def test_an_unknown_field_name_that_is_not_an_identifier_is_not_echoed(put, store_path):
    doc = {"client_id": CLIENT_ID, "refresh_token": REFRESH, "canary name-not an identifier": "x"}
    refused(put("--kind", "oauth2", stdin=json.dumps(doc).encode()), store_path, "(a name that is not an identifier)")


def test_an_unknown_field_flag_is_refused_without_its_value(put, store_path):
    err = refused(put("--kind", "oauth2", "--field", f"client_id={CLIENT_ID}", "--field", f"passwd={CLIENT_SECRET}"),
                  store_path, "--field wants NAME=… with NAME one of the `oauth2` fields")
    assert "client_secret (secret)" in err


def test_a_field_flag_without_a_value_separator_is_refused(put, store_path):
    refused(put("--kind", "aws_sigv4", "--field", KEY_ID), store_path, "--field wants NAME=…")


@pytest.mark.parametrize("stdin", [
    b'{"client_id": "' + CLIENT_ID.encode() + b'", "refresh_token": "' + REFRESH.encode() + b'"',
    REFRESH.encode(),
    b"\xff" + REFRESH.encode(),
], ids=["truncated", "a-bare-value", "not-utf8"])
def test_stdin_that_is_not_json_is_refused(put, store_path, stdin):
    err = refused(put("--kind", "oauth2", stdin=stdin), store_path, "stdin is not a JSON object of the `oauth2` fields")
    assert 'help: e.g. `{"client_id": "…"}`' in err


@pytest.mark.parametrize("doc", [
    [CLIENT_ID, REFRESH],
    REFRESH,
    {"client_id": CLIENT_ID, "refresh_token": [REFRESH]},
    {"client_id": CLIENT_ID, "refresh_token": {"value": REFRESH}},
], ids=["list", "string", "list-value", "object-value"])
def test_json_that_is_not_an_object_of_strings_is_refused(put, store_path, doc):
    refused(put("--kind", "oauth2", stdin=json.dumps(doc).encode()), store_path,
            "stdin must be a JSON object whose values are strings")


def test_an_empty_field_value_is_refused(put, store_path):
    refused(put("--kind", "oauth2", stdin=json.dumps({"client_id": "", "refresh_token": REFRESH}).encode()), store_path,
            "field `client_id` of the record is not a non-empty string")


def test_a_field_given_twice_is_refused(put, store_path, tmp_path):
    (tmp_path / "id").write_text(KEY_ID)
    refused(put("--kind", "aws_sigv4", "--field", f"access_key_id={KEY_ID}", "--field", "access_key_id=AKIAcanary2"),
            store_path, "field `access_key_id` is given twice")
    refused(put("--kind", "aws_sigv4", "--field", f"access_key_id={KEY_ID}", "--field-file", f"access_key_id={tmp_path / 'id'}"),
            store_path, "field `access_key_id` is given twice")


def test_a_field_file_that_does_not_exist_is_refused(put, store_path, tmp_path):
    missing = tmp_path / "no-such.pem"
    err = refused(put("--kind", "github_app", "--field", "app_id=1", "--field-file", f"private_key={missing}"), store_path,
                  "cannot read field `private_key` from")
    assert str(missing) in err


def test_a_field_file_that_is_not_utf8_is_refused(put, store_path, tmp_path):
    (tmp_path / "secret").write_bytes(b"\xff\xfe" + SECRET_KEY.encode())
    refused(put("--kind", "aws_sigv4", "--field", f"access_key_id={KEY_ID}", "--field-file",
                f"secret_access_key={tmp_path / 'secret'}"), store_path, "is not UTF-8 text")


def test_fields_for_a_static_credential_are_refused(put, store_path):
    refused(put("--kind", "static", "--field", f"secret={CLIENT_ID}"), store_path, "`--kind static` takes no fields")


def test_an_unknown_kind_is_refused(put, store_path):
    err = refused(put("--kind", "oauth3", stdin=json.dumps({"client_id": CLIENT_ID}).encode()), store_path,
                  "unknown credential kind")
    assert "help: one of: static, oauth2, github_app, aws_sigv4" in err


def test_a_nul_in_a_field_whose_name_is_not_an_identifier_does_not_echo_the_name(put, store_path):
    doc = {"client_id": CLIENT_ID, "refresh_token": REFRESH, "canary name-not an identifier": "a\u0000b"}
    refused(put("--kind", "oauth2", stdin=json.dumps(doc).encode()), store_path, "contains NUL")
