"""`aws_sigv4`: every request re-signed with the custody's AWS keys (Signature Version 4, header form).

The sandbox runs a stock AWS client with placeholder keys. The edge never forwards what that client signed with:
`Authorization`, `X-Amz-Date`, `X-Amz-Security-Token` and `X-Amz-Content-Sha256` are edge headers (no rule may
allowlist them, the core never forwards them) and the signer (egress_proxy/credentials/sigv4.py) writes its own.

The payload: for `s3` the edge signs `UNSIGNED-PAYLOAD` (S3 accepts it over TLS, and the edge's upstream leg is always
TLS), or keeps the client's `STREAMING-UNSIGNED-PAYLOAD-TRAILER` (aws-chunked bodies with an unsigned trailing
checksum, which botocore sends for uploads), so the body streams as it comes. Signed streaming
(`STREAMING-AWS4-HMAC-SHA256-PAYLOAD…`: each chunk signed with the client's key) cannot be re-signed without
rewriting the body and is refused (`credential-sign-unsupported`). Every other service signs the body's SHA-256:
the edge holds the body (to `base.MAX_HASHED_BODY`, 8 MiB, or the rule's limit, whichever is smaller) and signs once it is whole.
"""

from __future__ import annotations

from compiler.artifact import Connection
from compiler.constants import EDGE_HEADERS
from egress_proxy.credentials import sigv4
from egress_proxy.credentials.base import (
    Attached,
    Fields,
    FieldSpec,
    Minted,
    Reply,
    SigningUnsupported,
    SignView,
    TokenRequest,
    needles_of,
)
from egress_proxy.custody.secret import Secret

UNSIGNED_SERVICES = frozenset({"s3"})
assert set(EDGE_HEADERS["aws_sigv4"]) | {"authorization"} == set(sigv4.EDGE_HEADERS)


class AwsSigV4:
    name = "aws_sigv4"
    fields = (
        FieldSpec("access_key_id", True, False, "the access key id (AKIA… or ASIA…)"),
        FieldSpec("secret_access_key", True, True, "the secret access key"),
        FieldSpec("session_token", False, True, "the session token of temporary credentials"),
    )
    mints = False

    def check(self, fields: Fields) -> None:
        return None

    def token_request(self, conn: Connection, fields: Fields, now: float) -> TokenRequest:
        raise NotImplementedError("SigV4 signs each request; nothing is minted")

    def token_reply(self, conn: Connection, fields: Fields, reply: Reply, now: float) -> Minted:
        raise NotImplementedError("SigV4 signs each request; nothing is minted")

    def attach(self, conn: Connection, fields: Fields, token: Secret | None) -> Attached:
        mint = conn.mint
        assert mint is not None and mint.region and mint.service
        region, service = mint.region, mint.service
        unsigned = service in UNSIGNED_SERVICES

        def sign(view: SignView, body: bytes | None, now: float) -> list[tuple[str, str]]:
            client = (view.client_payload or "").strip()
            if client.startswith("STREAMING-AWS4-"):
                raise SigningUnsupported("the request's body is signed chunk by chunk (`STREAMING-AWS4-…`), which the edge "
                                         "cannot re-sign", "upload without chunk signatures (botocore does by default over https)")
            if unsigned:
                payload = sigv4.STREAMING_UNSIGNED_TRAILER if client == sigv4.STREAMING_UNSIGNED_TRAILER else sigv4.UNSIGNED_PAYLOAD
            else:
                payload = sigv4.payload_hash(body or b"")
            token = fields.text("session_token") if "session_token" in fields.secret else None
            try:
                return sigv4.sign(method=view.method, host=view.host, port=view.port, target=view.target, headers=view.headers,
                                  payload=payload, access_key_id=fields.plain["access_key_id"],
                                  secret_access_key=fields.text("secret_access_key"), session_token=token, region=region,
                                  service=service, now=now)
            except (ValueError, TypeError) as exc:  # the signer names the argument it refused, never its value
                raise SigningUnsupported(f"the request cannot be signed: {exc}") from None

        return Attached(needles=needles_of(fields), sign=sign, hash_body=not unsigned)


KIND = AwsSigV4()
