"""Credential kinds: how the edge mints, refreshes or signs what a connection's requests carry.

- `base`        — what every kind shares: the `Kind` interface, its record's fields, what it attaches, how it fails.
- `static`      — the record's one value in the connection's `inject` format.
- `oauth2`      — an access token minted from a refresh token or client credentials (RFC 6749).
- `github_app`  — an installation token minted with the App's private key.
- `aws_sigv4`   — every request re-signed with custody's AWS keys; `sigv4` is the signer.
- `sigv4`       — AWS Signature Version 4, header form.
- `exchange`    — one POST to a token endpoint, TLS verified, to an address the caller vetted.
- `broker`      — one per edge process: opens records, caches and single-flights minted tokens, writes back.

`KINDS` maps a kind's name (the connection's `kind` in the policy) to its module's `KIND`, an object implementing
`base.Kind`. The broker is the only caller: it opens the record, caches and single-flights minted tokens, writes
rotated fields back to custody, and hands the edge an `Attached` (a header value, or a signer). Adding a kind is one
module here and its settings in the compiler.
"""

from __future__ import annotations

from collections.abc import Mapping

from compiler.constants import CREDENTIAL_KINDS
from egress_proxy.credentials import aws_sigv4, github_app, oauth2, static
from egress_proxy.credentials.base import Kind, RecordInvalid, open_fields
from egress_proxy.custody.records import encode_fields
from egress_proxy.custody.secret import Secret

KINDS: Mapping[str, Kind] = {k.name: k for k in (static.KIND, oauth2.KIND, github_app.KIND, aws_sigv4.KIND)}
assert tuple(KINDS) == CREDENTIAL_KINDS


def check_record(kind: str, fields: Mapping[str, str]) -> bytes:
    """The sealed form of a record of `kind` with `fields`, after the kind's own checks (`custody put`): RecordInvalid
    naming the field that is wrong, never a value."""
    found = KINDS.get(kind)
    if found is None:
        raise RecordInvalid(f"unknown credential kind `{kind}`", f"one of: {', '.join(KINDS)}")
    if kind == "static":
        raise RecordInvalid("a `static` credential is the value alone", "pipe it on stdin without `--kind` (or with `--kind static`)")
    value = encode_fields(kind, dict(fields))
    open_fields(found, Secret(value))  # every check a proxy would make when it opens the record
    return value
