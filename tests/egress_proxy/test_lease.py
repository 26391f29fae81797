"""Leases: mint/verify round trip, and each failure class with its reason code."""

from __future__ import annotations

import base64
import json

import pytest

from egress_proxy import lease
from egress_proxy.lease import LeaseError

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
    prefix, body, mac = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{prefix}.{new}.{mac}"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: _forge(t, connection="admin"),
        lambda t: _forge(t, exp=NOW + 10**6),
        lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),
        lambda t: t.replace("el1.", "el2.", 1),
        lambda t: t + ".x",
        lambda t: "not-a-token",
        lambda t: "el1..",
        lambda t: "el1.!!.!!",
        lambda t: t + "é",
    ],
)
def test_forged_or_malformed_is_invalid(mutate):
    token = lease.mint(KEY, "s", connection="c", now=NOW)
    with pytest.raises(LeaseError) as exc:
        lease.verify(KEY, mutate(token), now=NOW)
    assert exc.value.reason == "lease-invalid"
    assert token not in str(exc.value)


def test_other_key_is_invalid():
    token = lease.mint(KEY, "s", connection="c", now=NOW)
    with pytest.raises(LeaseError) as exc:
        lease.verify(bytes(32), token, now=NOW)
    assert exc.value.reason == "lease-invalid"


def test_signed_but_names_both_is_invalid():
    # A token signed with the right key but naming two subjects of policy is still refused.
    body = base64.urlsafe_b64encode(json.dumps({"sub": "s", "exp": NOW + 5, "profile": "p", "connection": "c"}).encode()).rstrip(b"=").decode()
    signed = f"el1.{body}"
    token = f"{signed}.{lease._b64(lease._mac(KEY, signed))}"
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


@pytest.mark.parametrize(
    ("header", "token"),
    [(None, None), ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None), ("Bearer ", None)],
)
def test_bearer(header, token):
    assert lease.bearer(header) == token


# -- `egresslaw lease` -------------------------------------------------------------------------------


def test_cli_mints_a_token_alone_on_stdout(tmp_path, capsys):
    import time

    from egress_proxy.keys import init_keys, load_lease_key
    from egresslaw.cli import main

    init_keys(tmp_path / "keys")
    assert main(["lease", "--keys", str(tmp_path / "keys"), "--connection", "github", "--ttl", "60", "--subject", "ci-7"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    got = lease.verify(load_lease_key(tmp_path / "keys"), out.strip(), now=time.time())
    assert (got.subject, got.connection) == ("ci-7", "github")


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--connection", "c", "--ttl", "0"], "ttl"), (["--profile", "p", "--subject", "two words"], "plain name")],
)
def test_cli_refuses_bad_claims(tmp_path, capsys, args, message):
    from egress_proxy.keys import init_keys
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
