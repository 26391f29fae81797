"""Sealed records: bound to their address and key id, secrets checked before sealing, URLs shown masked."""

from __future__ import annotations

import pytest

from egress_proxy.custody.records import (
    RECORD_VERSION,
    Address,
    CustodyError,
    check_secret,
    is_database_url,
    seal,
    shown,
    unseal,
)

KEY = bytes(range(32))
A = Address("acme", "github", "gh-prod")


def test_a_sealed_value_opens_at_its_address_only() -> None:
    nonce, sealed = seal(KEY, A, "k1", b"ghp_CANARYvalue")
    assert b"CANARY" not in sealed
    keys = {"k1": KEY, "k2": bytes(32)}.get
    assert unseal(keys, "KEYS", A, RECORD_VERSION, "k1", nonce, sealed) == b"ghp_CANARYvalue"
    for other, key_id in ((Address("acme", "github", "other"), "k1"), (Address("evil", "github", "gh-prod"), "k1"), (A, "k2")):
        with pytest.raises(CustodyError) as exc:
            unseal(keys, "KEYS", other, RECORD_VERSION, key_id, nonce, sealed)
        assert "CANARY" not in str(exc.value) and "authentication failed" in exc.value.message
    with pytest.raises(CustodyError, match="not in `KEYS`"):
        unseal(keys, "KEYS", A, RECORD_VERSION, "k3", nonce, sealed)


@pytest.mark.parametrize("value", [b"", b"a\rb", b"a\nb", b"a\x00b"])
def test_secrets_with_line_breaks_or_nul_are_refused(value: bytes) -> None:
    with pytest.raises(CustodyError):
        check_secret(value)


def test_database_urls_are_shown_without_their_password() -> None:
    url = "postgresql://egress:hunter2CANARY@db:5432/custody?sslmode=require&password=CANARY2"
    assert is_database_url(url) and not is_database_url("custody.db")
    assert "CANARY" not in shown(url) and "hunter2" not in shown(url)
    assert shown("custody.db") == "custody.db"
