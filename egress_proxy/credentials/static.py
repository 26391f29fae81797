"""`static`: the record's one value, pasted into the connection's `inject` format (an API key, a personal token)."""

from __future__ import annotations

from compiler.artifact import Connection
from egress_proxy.credentials.base import (
    Attached,
    Fields,
    FieldSpec,
    Minted,
    Reply,
    TokenRequest,
    header_value,
)
from egress_proxy.custody.secret import Secret


class Static:
    name = "static"
    fields = (FieldSpec("secret", True, True, "the value itself (what `custody put` reads on stdin)"),)
    mints = False

    def check(self, fields: Fields) -> None:
        return None

    def token_request(self, conn: Connection, fields: Fields, now: float) -> TokenRequest:
        raise NotImplementedError("static credentials are not minted")

    def token_reply(self, conn: Connection, fields: Fields, reply: Reply, now: float) -> Minted:
        raise NotImplementedError("static credentials are not minted")

    def attach(self, conn: Connection, fields: Fields, token: Secret | None) -> Attached:
        secret = fields.secret["secret"]
        # The record's needles as the format reads them (`Basic …` also yields what it decodes to).
        return Attached(needles=secret.needles(conn.inject.format), value=header_value(conn.inject, secret.reveal()))


KIND = Static()
