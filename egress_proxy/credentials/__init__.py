"""Credential kinds: how the edge mints, refreshes or signs what a connection's requests carry.

`KINDS` maps a kind's name (the connection's `kind` in the policy) to its module's `KIND`, an object implementing
`egress_proxy.credentials.base.Kind`. The broker (egress_proxy/credentials/broker.py) is the only caller: it opens
the record, caches and single-flights minted tokens, writes rotated fields back to custody, and hands the edge an
`Attached` (a header value, or a signer). Adding a kind is one module here and its settings in the compiler.
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
