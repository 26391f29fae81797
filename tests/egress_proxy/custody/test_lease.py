"""Leases: mint/verify round trip, and each failure class with its reason code."""

from __future__ import annotations

import base64
import json

import pytest

from egress_proxy.custody import lease
from egress_proxy.custody.lease import LeaseError

KEY = bytes(range(32))
NOW = 1_800_000_000


def test_round_trip_connection():
    token = lease.mint(KEY, "agent-7", connection="github", ttl=60, now=NOW)
    got = lease.verify(KEY, token, now=NOW + 59)
    assert (got.subject, got.profile, got.connection, got.exp) == ("agent-7", None, "github", NOW + 60)


def test_round_trip_profile():
    got = lease.verify(KEY, lease.mint(KEY, "sb", profile="ci-builder", now=NOW), now=NOW)
    assert got.profile == "ci-builder" and got.connection is None


@pytest.mark.parametrize("token", [None, ""])
def test_missing(token):
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, token, now=NOW)
    assert exc.value.reason == "lease-missing"


def test_expired_at_the_boundary():
    token = lease.mint(KEY, "s", connection="c", ttl=10, now=NOW)
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, token, now=NOW + 10)
    assert exc.value.reason == "lease-expired"


def _forge(token: str, **changes) -> str:
    prefix, kid, body, mac = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{prefix}.{kid}.{new}.{mac}"


def _sign(claims: dict, key: bytes = KEY, prefix: str = "el2") -> str:
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    signed = f"{prefix}.{lease.key_id(key)}.{body}" if prefix == "el2" else f"{prefix}.{body}"
    return f"{signed}.{lease._b64(lease._mac(key, signed))}"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: _forge(t, connection="admin"),
        lambda t: _forge(t, exp=NOW + 10**6),
        lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),
    ],
)
def test_forged_is_invalid(mutate):
    token = lease.mint(KEY, "s", connection="c", now=NOW)
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, mutate(token), now=NOW)
    assert exc.value.reason == "lease-invalid"
    assert token not in str(exc.value)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t.replace("el2.", "el3.", 1),
        lambda t: t + ".x",
        lambda t: "not-a-token",
        lambda t: "el2...",
        lambda t: "el2.lk-0123456789abcdef.!!.!!",
        lambda t: t + "é",
        lambda t: t + "A" * lease.MAX_TOKEN,
        lambda t: t.replace(".lk-", ".LK-", 1),
    ],
)
def test_malformed(mutate):
    token = lease.mint(KEY, "s", connection="c", now=NOW)
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, mutate(token), now=NOW)
    assert exc.value.reason == "lease-malformed"
    assert token not in str(exc.value)


def test_a_lease_names_its_key():
    token = lease.mint(KEY, "s", connection="c", now=NOW)
    assert token.split(".")[:2] == ["el2", lease.key_id(KEY)]
    assert lease.key_id(KEY) != lease.key_id(bytes(32)) and lease.key_id(KEY).startswith("lk-")


def test_legacy_lease_without_key_id_is_refused_with_its_own_reason():
    old = _sign({"sub": "s", "exp": NOW + 60, "connection": "c"}, prefix="el1")
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, old, now=NOW)
    assert exc.value.reason == "lease-key-unknown" and "key id" in exc.value.message


def test_other_key_is_unknown():
    token = lease.mint(KEY, "s", connection="c", now=NOW)
    with pytest.raises(LeaseError) as exc:
        lease.verify(bytes(32), token, now=NOW)
    assert exc.value.reason == "lease-key-unknown"


def test_a_key_id_that_lies_about_its_key_does_not_verify():
    # A token signed with another key but naming this key's id: the MAC under this key fails.
    body = lease.mint(bytes(32), "s", connection="c", now=NOW).split(".")[2]
    signed = f"el2.{lease.key_id(KEY)}.{body}"
    token = f"{signed}.{lease._b64(lease._mac(bytes(32), signed))}"
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, token, now=NOW)
    assert exc.value.reason == "lease-invalid"


def test_key_set_overlap_and_retirement():
    old, new = lease.LeaseKey(lease.key_id(KEY), KEY, retires=NOW + 100), lease.LeaseKey(lease.key_id(bytes(32)), bytes(32))
    keys = lease.LeaseKeys([old, new], new.id)
    by_old = lease.mint(KEY, "s", connection="c", ttl=1000, now=NOW)
    by_new = lease.mint(keys, "s", connection="c", ttl=1000, now=NOW)
    assert by_new.split(".")[1] == new.id  # the active key mints
    assert lease.verify(keys, by_old, now=NOW + 99).subject == "s"  # the old key verifies during the overlap
    with pytest.raises(LeaseError) as exc:
        lease.verify(keys, by_old, now=NOW + 100)
    assert exc.value.reason == "lease-key-retired"
    assert lease.verify(keys, by_new, now=NOW + 100).subject == "s"
    forged = by_old[:-2] + ("AA" if not by_old.endswith("AA") else "BB")
    with pytest.raises(LeaseError) as exc:
        lease.verify(keys, forged, now=NOW + 100)
    assert exc.value.reason == "lease-invalid"  # a retired key's id still needs a good MAC before it is named
    assert "material" not in repr(keys) and KEY.hex() not in repr(keys) and repr(old) == f"LeaseKey(id={old.id!r}, retires={NOW + 100})"


def test_signed_but_names_both_is_invalid():
    # A token signed with the right key but naming two subjects of policy is still refused.
    token = _sign({"sub": "s", "exp": NOW + 5, "profile": "p", "connection": "c"})
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, token, now=NOW)
    assert exc.value.reason == "lease-invalid"


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(profile="p", connection="c"), dict(connection="c", ttl=0), dict(connection="c", ttl=10**9), dict(connection="bad name")],
)
def test_mint_refuses_bad_claims(kwargs):
    with pytest.raises(LeaseError):
        lease.mint(KEY, "s", now=NOW, **kwargs)


def test_verify_uses_constant_time_compare(monkeypatch):
    calls = []
    real = lease.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(lease.hmac, "compare_digest", spy)
    lease.verify(KEY, lease.mint(KEY, "s", connection="c", now=NOW), now=NOW)
    assert calls == [(32, 32)]


def test_verified_leases_answer_like_authenticate_and_recheck_time_and_key_set(monkeypatch):
    """The memo of verified tokens: a hit skips the MAC and the claims, never the expiry, the key's retirement or a
    key set that changed; refusals are not kept (a forged token is compared in constant time every time)."""
    old, new = lease.LeaseKey(lease.key_id(KEY), KEY, retires=NOW + 100), lease.LeaseKey(lease.key_id(bytes(32)), bytes(32))
    keys = lease.LeaseKeys([old, new], new.id)
    by_old = f"Bearer {lease.mint(KEY, 's', connection='c', ttl=50, now=NOW)}"
    by_new = _basic(f"u:{lease.mint(keys, 's', profile='p', ttl=1000, now=NOW)}")
    memo = lease.VerifiedLeases(size=2)
    compared = []
    real = lease.hmac.compare_digest
    monkeypatch.setattr(lease.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    for _ in range(3):
        assert memo.authenticate(keys, [by_old], now=NOW) == lease.authenticate(keys, [by_old], now=NOW)
        assert memo.authenticate(keys, [by_new], now=NOW).profile == "p"
    assert len(compared) == 2 + 3  # memo: once per token; authenticate: every time
    with pytest.raises(LeaseError) as exc:
        memo.authenticate(keys, [by_old], now=NOW + 50)
    assert exc.value.reason == "lease-expired"
    assert memo.authenticate(keys, [by_new], now=NOW + 100).profile == "p"
    rotated = lease.LeaseKeys([new], new.id)  # the old key gone: a token it signed is no longer known
    memo.authenticate(keys, [by_old], now=NOW)
    with pytest.raises(LeaseError) as exc:
        memo.authenticate(rotated, [by_old], now=NOW)
    assert exc.value.reason == "lease-key-unknown"
    retiring = lease.LeaseKeys([lease.LeaseKey(old.id, KEY, retires=NOW + 10), new], new.id)
    memo.authenticate(retiring, [by_old], now=NOW)
    with pytest.raises(LeaseError) as exc:
        memo.authenticate(retiring, [by_old], now=NOW + 10)
    assert exc.value.reason == "lease-key-retired"
    forged = by_old[:-2] + ("AA" if not by_old.endswith("AA") else "BB")
    compared.clear()
    for _ in range(2):
        with pytest.raises(LeaseError) as exc:
            memo.authenticate(keys, [forged], now=NOW)
        assert exc.value.reason == "lease-invalid"
    assert len(compared) == 2
    with pytest.raises(LeaseError) as exc:
        memo.authenticate(keys, [by_old, by_old], now=NOW)  # two headers: refused, memo or not
    assert exc.value.reason == "lease-malformed"
    assert len(memo._memo) <= 2 and KEY.hex() not in repr(memo)


def _basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


TOKEN = lease.mint(KEY, "s", connection="c", ttl=60, now=NOW)


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        (f"Bearer {TOKEN}", TOKEN),
        (f"bearer  {TOKEN} ", TOKEN),
        ("Bearer", None),
        ("Bearer ", None),
        (_basic(f"sandbox:{TOKEN}"), TOKEN),  # http://sandbox:LEASE@proxy
        (_basic(f"{TOKEN}:"), TOKEN),  # http://LEASE@proxy sends LEASE:
        (_basic(f"ignored-user:{TOKEN}"), TOKEN),
        ("basic " + base64.b64encode(f"u:{TOKEN}".encode()).decode(), TOKEN),
        (_basic(":"), None),
        ("Basic", None),
    ],
)
def test_token_of(header, token):
    assert lease.token_of(header) == token


@pytest.mark.parametrize(
    "header",
    ["Digest username=x", "Negotiate abc", TOKEN, "Basic !!!", "Basic " + base64.b64encode(b"no-colon").decode(),
     "Basic " + base64.b64encode("u:\u00e9".encode()).decode(), "Basic Zm9v"],
)
def test_token_of_malformed(header):
    with pytest.raises(LeaseError) as exc:
        lease.token_of(header)
    assert exc.value.reason == "lease-malformed"
    assert TOKEN not in exc.value.message and header not in exc.value.message


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ([], "lease-missing"),
        (["Bearer "], "lease-missing"),
        ([_basic(":")], "lease-missing"),
        ([f"Bearer {TOKEN}", f"Bearer {TOKEN}"], "lease-malformed"),
        ([_basic("u:not-a-lease")], "lease-malformed"),
        ([_basic("u:" + TOKEN[:-2] + ("AA" if not TOKEN.endswith("AA") else "BB"))], "lease-invalid"),
    ],
)
def test_authenticate_reasons_are_the_same_whatever_the_scheme(values, reason):
    with pytest.raises(LeaseError) as exc:
        lease.authenticate(KEY, values, now=NOW)
    assert exc.value.reason == reason


def test_authenticate_both_schemes_one_check(monkeypatch):
    calls = []
    real = lease.hmac.compare_digest
    monkeypatch.setattr(lease.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for value in (f"Bearer {TOKEN}", _basic(f"x:{TOKEN}"), _basic(f"{TOKEN}:")):
        assert lease.authenticate(KEY, [value], now=NOW).connection == "c"
    assert len(calls) == 3
    expired = lease.mint(KEY, "s", connection="c", ttl=1, now=NOW - 10)
    for value in (f"Bearer {expired}", _basic(f"x:{expired}")):
        with pytest.raises(LeaseError) as exc:
            lease.authenticate(KEY, [value], now=NOW)
        assert exc.value.reason == "lease-expired"


@pytest.mark.parametrize(("value", "scheme"), [(None, "none"), ("Bearer x", "bearer"), ("BASIC eA==", "basic"), ("x.y.z", "other"), ("Digest a", "other")])
def test_scheme_of_never_echoes_the_value(value, scheme):
    assert lease.scheme_of(value) == scheme


# -- `egresslaw lease` -------------------------------------------------------------------------------


def test_cli_mints_a_token_alone_on_stdout(tmp_path, capsys):
    import time

    from egress_proxy.custody.keys import init_keys, load_lease_key
    from egresslaw.cli import main

    init_keys(tmp_path / "keys")
    assert main(["lease", "--keys", str(tmp_path / "keys"), "--connection", "github", "--ttl", "60", "--subject", "ci-7", "--no-subject-check"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    got = lease.verify(load_lease_key(tmp_path / "keys"), out.strip(), now=time.time())
    assert (got.subject, got.connection) == ("ci-7", "github")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--connection", "c", "--ttl", "0"], "ttl"), (["--profile", "p", "--subject", "two words"], "plain name")],
)
def test_cli_refuses_bad_claims(tmp_path, capsys, args, message):
    from egress_proxy.custody.keys import init_keys
    from egresslaw.cli import main

    init_keys(tmp_path / "keys")
    assert main(["lease", "--keys", str(tmp_path / "keys"), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_cli_without_keys_exits_2(tmp_path, capsys):
    from egresslaw.cli import main

    assert main(["lease", "--keys", str(tmp_path / "nokeys"), "--connection", "c"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_needs_exactly_one_subject_of_policy(tmp_path):
    from egresslaw.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["lease", "--keys", str(tmp_path), "--connection", "c", "--profile", "p"])
    assert exc.value.code == 2


def test_cli_lease_names_the_active_key_id(tmp_path, capsys):
    from egress_proxy.custody.keys import init_keys, load_lease_keys
    from egresslaw.cli import main

    init_keys(tmp_path / "keys")
    assert main(["lease", "--keys", str(tmp_path / "keys"), "--profile", "p", "--no-subject-check"]) == 0
    assert capsys.readouterr().out.split(".")[1] == load_lease_keys(tmp_path / "keys").active.id


# -- `--artifact`: a lease for a subject the artifact does not contain is refused, with a did-you-mean ----


@pytest.fixture
def artifact_file(tmp_path):
    from tests.egress_proxy import builders as b

    art = b.artifact(
        connections=[b.connection("github", [b.rule("read", "api.github.com", "/repos", ["GET"])], credential="gh")],
        profiles=[b.profile("package-builder", [("pypi.org", 443)])],
    )
    path = tmp_path / "egresslaw.json"
    path.write_text(art.to_json())
    from egress_proxy.custody.keys import init_keys

    init_keys(tmp_path / "keys")
    return path


@pytest.mark.parametrize(
    ("args", "help_text"),
    [
        (["--profile", "package-bulder"], "did you mean `package-builder`?"),
        (["--connection", "githb"], "did you mean `github`?"),
        (["--connection", "zzz"], "its connections: `github`"),
    ],
)
def test_cli_artifact_refuses_an_unknown_subject_with_a_did_you_mean(artifact_file, capsys, args, help_text):
    from egresslaw.cli import main

    keys = artifact_file.parent / "keys"
    assert main(["lease", "--keys", str(keys), "--artifact", str(artifact_file), *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "lease-unknown-subject" in captured.err and f"help: {help_text}" in captured.err


def test_cli_artifact_admits_a_known_subject(artifact_file, capsys):
    from egresslaw.cli import main

    keys = artifact_file.parent / "keys"
    assert main(["lease", "--keys", str(keys), "--artifact", str(artifact_file), "--profile", "package-builder"]) == 0
    assert capsys.readouterr().out.startswith("el2.")


def test_cli_artifact_that_does_not_load_exits_2(tmp_path, capsys):
    from egress_proxy.custody.keys import init_keys
    from egresslaw.cli import main

    init_keys(tmp_path / "keys")
    (tmp_path / "bad.json").write_text("{}")
    assert main(["lease", "--keys", str(tmp_path / "keys"), "--artifact", str(tmp_path / "bad.json"), "--profile", "p"]) == 2
    assert "artifact" in capsys.readouterr().err


# -- lease keys: the file formats, rotation with an overlap, the proxy's re-read ------------------------


def test_rotation_keeps_the_old_key_verifying_until_its_retirement(tmp_path):
    from egress_proxy.custody.keys import init_keys, load_lease_keys, rotate_lease_key

    init_keys(tmp_path / "k")
    before = load_lease_keys(tmp_path / "k")
    old_lease = lease.mint(before, "s", connection="c", ttl=600, now=NOW)
    keys, replaced = rotate_lease_key(tmp_path / "k", overlap=300, now=NOW)
    assert replaced.id == before.active.id and keys.active.id != before.active.id and replaced.retires == NOW + 300
    assert load_lease_keys(tmp_path / "k").active.id == keys.active.id  # what was written is what is read
    assert (tmp_path / "k" / "lease.key").stat().st_mode & 0o777 == 0o600
    assert lease.verify(load_lease_keys(tmp_path / "k"), old_lease, now=NOW + 299).subject == "s"
    with pytest.raises(LeaseError) as exc:
        lease.verify(load_lease_keys(tmp_path / "k"), old_lease, now=NOW + 300)
    assert exc.value.reason == "lease-key-retired"
    new_lease = lease.mint(load_lease_keys(tmp_path / "k"), "s", connection="c", now=NOW)
    assert new_lease.split(".")[1] == keys.active.id


def test_a_second_rotation_never_lengthens_an_old_window_and_drops_long_retired_keys(tmp_path):
    from egress_proxy.custody.keys import init_keys, load_lease_keys, rotate_lease_key

    init_keys(tmp_path / "k")
    first, _ = rotate_lease_key(tmp_path / "k", overlap=1000, now=NOW)
    second, _ = rotate_lease_key(tmp_path / "k", overlap=50, now=NOW + 10)
    assert sorted(k.retires for k in second.keys() if k.retires) == [NOW + 60, NOW + 60]  # 1000 was cut to now + 50
    third, _ = rotate_lease_key(tmp_path / "k", overlap=0, now=NOW + lease.MAX_TTL + 100)
    assert len(third.keys()) == 2 and len(load_lease_keys(tmp_path / "k").keys()) == 2  # the long-retired ones are gone


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: d["keys"][0].update(id="lk-0000000000000000"), "does not match its key"),
        (lambda d: d.update(active="lk-ffffffffffffffff"), "`active`"),
        (lambda d: d["keys"][0].update(retires="tomorrow"), "`retires`"),
        (lambda d: d["keys"][-1].update(retires="2030-01-01T00:00:00Z"), "active lease key has a retirement"),
        (lambda d: d["keys"].append(dict(d["keys"][0])), "appears twice"),
        (lambda d: d.update(keys=[]), "non-empty list"),
        (lambda d: d["keys"][0].pop("retires"), "exactly"),
    ],
)
def test_a_malformed_key_set_is_refused_without_key_bytes(tmp_path, edit, why):
    import os

    from egress_proxy.custody.keys import (
        KeyFileError,
        init_keys,
        load_lease_keys,
        rotate_lease_key,
    )

    init_keys(tmp_path / "k")
    rotate_lease_key(tmp_path / "k", overlap=60, now=NOW)
    path = tmp_path / "k" / "lease.key"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError) as exc:
        load_lease_keys(tmp_path / "k")
    assert why in exc.value.message
    assert not any(k["key"] in exc.value.message for k in doc["keys"])


def test_the_proxy_key_file_reads_a_rotation_and_fails_closed_on_a_broken_file(tmp_path, caplog):
    import os

    from egress_proxy.custody.keys import (
        KeyFileError,
        LeaseKeyFile,
        init_keys,
        rotate_lease_key,
    )

    init_keys(tmp_path / "k")
    source = LeaseKeyFile(tmp_path / "k")
    first = source.current().active.id
    rotate_lease_key(tmp_path / "k", overlap=60, now=NOW)
    assert source.current().active.id != first and source.current().get(first) is not None
    (tmp_path / "k" / "lease.key").write_text("not json")
    with pytest.raises(KeyFileError):
        source.current()
    with pytest.raises(KeyFileError):
        source.current()
    assert sum("cannot be read again" in r.getMessage() for r in caplog.records) == 1  # logged once, not per request
    os.unlink(tmp_path / "k" / "lease.key")
    (tmp_path / "k" / "lease.key").touch(mode=0o600)
    with pytest.raises(KeyFileError):
        source.current()


def test_cli_keys_rotate(tmp_path, capsys):
    from egress_proxy.custody.keys import init_keys, load_lease_keys
    from egresslaw.cli import main

    init_keys(tmp_path / "k")
    old = load_lease_keys(tmp_path / "k").active.id
    assert main(["keys", "rotate", "--lease", "--dir", str(tmp_path / "k"), "--overlap", "0"]) == 0
    text = capsys.readouterr().out
    new = load_lease_keys(tmp_path / "k").active.id
    assert f"new lease key `{new}`" in text and f"lease key `{old}` verifies until" in text and "(the key just replaced)" in text
    raw = json.loads((tmp_path / "k" / "lease.key").read_text())
    assert not any(k["key"] in text for k in raw["keys"])
    assert main(["keys", "rotate", "--dir", str(tmp_path / "k")]) == 2
    assert "--lease" in capsys.readouterr().err
    assert main(["keys", "rotate", "--lease", "--dir", str(tmp_path / "k"), "--overlap", "-1"]) == 2


