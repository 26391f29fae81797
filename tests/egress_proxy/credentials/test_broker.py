"""The broker and the credential kinds, against a fake custody, a fake token endpoint and a fake clock.

The custody fake behaves as the stores do: `open` returns the same `Secret` object while the record is unchanged and a
new one after `put`. The token-endpoint fake records each request, answers from a script and may be slow (so concurrent
requests overlap a mint in flight). Nothing here touches the network.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import json
import logging
import time
from urllib.parse import parse_qsl, quote, unquote_plus

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from compiler.artifact import Connection, Inject, Mint, Rule
from egress_proxy.credentials import KINDS, sigv4
from egress_proxy.credentials.base import (
    MintFailed,
    RecordInvalid,
    Reply,
    SigningUnsupported,
    SignView,
    TokenRequest,
    open_fields,
)
from egress_proxy.credentials.broker import Broker
from egress_proxy.custody.records import (
    FIELDS_MARK,
    Address,
    decode_fields,
    encode_fields,
    record_grant,
)
from egress_proxy.custody.secret import Secret, encodings_of

NOW = 1_800_000_000.0
ADDRESS = Address("acme", "drive", "drive-oauth")
TOKEN_URL = "https://auth.example.com/oauth/token"
CLIENT_ID = "client-id-plain-7a1c"
CLIENT_SECRET = "client-secret-9f2e-Zq"
REFRESH = "refresh-token-one-44b1"
REFRESH_2 = "refresh-token-two-83c0"
ACCESS = "access-token-one-5d2a"
ACCESS_2 = "access-token-two-e61f"
BODY_CANARY = "provider-body-canary-0c7d"
OLD = f"Bearer {ACCESS}".encode()
NEW = f"Bearer {ACCESS_2}".encode()


# -- fakes -----------------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Custody:
    """A custody source: the same Secret while the record is unchanged, a new one once it is replaced."""

    def __init__(self, value: bytes) -> None:
        self.record = Secret(value)
        self.puts: list[tuple[Address, bytes]] = []
        self.refuse_put = False

    def open(self, address: Address) -> Secret:
        assert address == ADDRESS
        return self.record

    def put(self, address: Address, value: bytes) -> None:
        if self.refuse_put:
            raise OSError("the store is read-only")
        self.puts.append((address, value))
        self.record = Secret(value)


class Endpoint:
    """A token endpoint: answers `replies` in order (the last one again and again), optionally after `delay` seconds."""

    def __init__(self, *replies: Reply, delay: float = 0.0) -> None:
        self.replies = list(replies)
        self.delay = delay
        self.requests: list[TokenRequest] = []

    async def __call__(self, conn: Connection, request: TokenRequest) -> Reply:
        assert conn.mint is not None and conn.mint.token_url
        self.requests.append(request)
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]

    def form(self, i: int = -1) -> dict[str, str]:
        pairs = parse_qsl(self.requests[i].body.decode("ascii"), keep_blank_values=True, strict_parsing=True)
        assert len({k for k, _ in pairs}) == len(pairs)  # no field twice
        return dict(pairs)

    def headers(self, i: int = -1) -> dict[str, str]:
        return dict(self.requests[i].headers)


async def never(conn: Connection, request: TokenRequest) -> Reply:
    raise AssertionError("this kind never calls a token endpoint")


def granted(token: str = ACCESS, expires_in: object = 3600, **extra: object) -> Reply:
    return Reply(200, json.dumps({"access_token": token, "token_type": "Bearer", "expires_in": expires_in, **extra}).encode())


def rule() -> tuple[Rule, ...]:
    return (Rule(name="files", host="www.example.com", methods=("GET",)),)


def oauth_conn(grant: str = "refresh_token", scopes: tuple[str, ...] = (), audience: str | None = None,
               inject: Inject = Inject()) -> Connection:
    mint = Mint(kind="oauth2", token_url=TOKEN_URL, token_host="auth.example.com", token_port=443, token_path="/oauth/token",
                grant=grant, scopes=scopes, audience=audience)
    return Connection(name="drive", version=1, credential_handle="drive-oauth", worker="default", rules=rule(),
                      inject=inject, mint=mint)


def oauth_record(**fields: str) -> bytes:
    values = {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "refresh_token": REFRESH}
    values.update(fields)
    return encode_fields("oauth2", {k: v for k, v in values.items() if v})


def run(coro):
    return asyncio.run(coro)


async def value(broker: Broker, conn: Connection, fetch) -> bytes | None:
    return (await broker.attach(ADDRESS, conn, fetch)).value


async def settle() -> None:
    """Let every other task of this loop (a refresh the broker runs in the background) finish."""
    await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))


def attach(broker: Broker, conn: Connection, fetch) -> bytes | None:
    return run(broker.attach(ADDRESS, conn, fetch)).value


def setup(record: bytes | None = None, *replies: Reply, delay: float = 0.0):
    custody = Custody(record if record is not None else oauth_record())
    clock = Clock()
    endpoint = Endpoint(*(replies or (granted(),)), delay=delay)
    return Broker(lambda: custody, clock=clock), custody, clock, endpoint


# -- oauth2: the token request -----------------------------------------------------------------------------------------

_FORM_SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~*%+")


def test_refresh_token_grant_with_client_secret_basic():
    client_id, secret = "app:1/é x", "s3cr:t%+&=/ é"
    broker, _, _, endpoint = setup(oauth_record(client_id=client_id, client_secret=secret))
    conn = oauth_conn(scopes=("files.read", "openid"), audience="https://api.example.com")
    assert attach(broker, conn, endpoint) == OLD
    assert endpoint.form() == {"grant_type": "refresh_token", "refresh_token": REFRESH, "scope": "files.read openid",
                               "audience": "https://api.example.com"}
    headers = endpoint.headers()
    assert headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert headers["Accept"] == "application/json"
    scheme, _, encoded = headers["Authorization"].partition(" ")
    assert scheme == "Basic"
    pair = base64.b64decode(encoded, validate=True).decode("ascii")
    # RFC 6749 §2.3.1: each of id and secret form-urlencoded, then joined by the one ":" that is not encoded
    assert pair.count(":") == 1
    user, _, password = pair.partition(":")
    assert set(user) <= _FORM_SAFE and set(password) <= _FORM_SAFE
    assert (unquote_plus(user), unquote_plus(password)) == (client_id, secret)


def test_client_secret_post_sends_both_in_the_body_and_no_authorization():
    broker, _, _, endpoint = setup(oauth_record(auth_method="client_secret_post"))
    attach(broker, oauth_conn(), endpoint)
    assert endpoint.form() == {"grant_type": "refresh_token", "refresh_token": REFRESH, "client_id": CLIENT_ID,
                               "client_secret": CLIENT_SECRET}
    assert "Authorization" not in endpoint.headers()


def test_a_public_client_sends_its_id_in_the_body_and_no_secret():
    broker, _, _, endpoint = setup(oauth_record(client_secret=""))
    attach(broker, oauth_conn(), endpoint)
    assert endpoint.form() == {"grant_type": "refresh_token", "refresh_token": REFRESH, "client_id": CLIENT_ID}
    assert "Authorization" not in endpoint.headers()


def test_client_credentials_sends_no_refresh_token_and_no_scope_when_none_is_declared():
    broker, _, _, endpoint = setup()
    attach(broker, oauth_conn(grant="client_credentials"), endpoint)
    assert endpoint.form() == {"grant_type": "client_credentials"}
    assert endpoint.headers()["Authorization"].startswith("Basic ")


def test_client_credentials_without_a_client_secret_is_record_invalid_and_calls_nobody():
    broker, _, _, endpoint = setup(oauth_record(client_secret=""))
    with pytest.raises(RecordInvalid, match="`client_credentials`"):
        attach(broker, oauth_conn(grant="client_credentials"), endpoint)
    assert endpoint.requests == []


def test_the_token_request_shows_no_value():
    broker, _, _, endpoint = setup()
    attach(broker, oauth_conn(), endpoint)
    shown = repr(endpoint.requests[0])
    assert REFRESH not in shown and CLIENT_SECRET not in shown and "Authorization" in shown


# -- oauth2: the reply, the cache and the refresh --------------------------------------------------------------------


def test_a_granted_token_is_put_in_the_inject_format():
    broker, _, _, endpoint = setup()
    assert attach(broker, oauth_conn(inject=Inject(header="X-Token", format="token={secret};")), endpoint) == (
        f"token={ACCESS};".encode())
    assert broker.mints == 1


@pytest.mark.parametrize(("expires_in", "refresh_after"), [(3600, 3540.0), (100, 50.0), ("600", 540.0), (None, 240.0)])
def test_the_token_is_reused_until_refresh_at_then_refreshed(expires_in, refresh_after):
    if expires_in is None:  # RECOMMENDED only (RFC 6749 §5.1): a short default life
        reply = Reply(200, json.dumps({"access_token": ACCESS}).encode())
    else:
        reply = granted(expires_in=expires_in)
    broker, _, clock, endpoint = setup(None, reply, granted(ACCESS_2))
    conn = oauth_conn()

    async def go():
        assert await value(broker, conn, endpoint) == OLD
        clock.now = NOW + refresh_after - 0.01
        assert await value(broker, conn, endpoint) == OLD
        await settle()
        assert len(endpoint.requests) == 1
        clock.now = NOW + refresh_after
        assert await value(broker, conn, endpoint) == OLD  # due: it serves while one refresh runs beside it
        await settle()
        assert len(endpoint.requests) == 2
        assert await value(broker, conn, endpoint) == NEW
        await settle()
        assert len(endpoint.requests) == 2 and broker.mints == 2

    run(go())


def test_a_request_that_finds_the_token_due_does_not_wait_for_the_refresh():
    broker, _, clock, endpoint = setup(None, granted(), granted(ACCESS_2))
    conn = oauth_conn()

    async def go():
        await value(broker, conn, endpoint)
        endpoint.delay = 0.2
        clock.now = NOW + 3540
        served = await asyncio.wait_for(asyncio.gather(*(value(broker, conn, endpoint) for _ in range(20))), 0.1)
        assert set(served) == {OLD}
        await settle()
        assert len(endpoint.requests) == 2  # twenty requests found it due: one refresh
        assert await value(broker, conn, endpoint) == NEW

    run(go())


def test_an_expired_token_is_not_served_and_the_request_waits_for_the_mint():
    broker, _, clock, endpoint = setup(None, granted(), granted(ACCESS_2))
    conn = oauth_conn()

    async def go():
        await value(broker, conn, endpoint)
        clock.now = NOW + 3600
        assert await value(broker, conn, endpoint) == NEW

    run(go())


def test_concurrent_requests_share_one_mint():
    broker, _, _, endpoint = setup(delay=0.05)
    conn = oauth_conn()

    async def many():
        return await asyncio.gather(*(broker.attach(ADDRESS, conn, endpoint) for _ in range(20)))

    results = run(many())
    assert len(endpoint.requests) == 1 and broker.mints == 1
    assert {a.value for a in results} == {OLD}


def test_concurrent_requests_share_one_failure():
    broker, _, _, endpoint = setup(None, Reply(503, b""), delay=0.05)
    conn = oauth_conn()

    async def many():
        return await asyncio.gather(*(broker.attach(ADDRESS, conn, endpoint) for _ in range(20)), return_exceptions=True)

    results = run(many())
    assert len(endpoint.requests) == 1
    assert all(isinstance(r, MintFailed) and r.provider_status == 503 for r in results)


def test_a_rotated_refresh_token_is_written_back_and_the_next_mint_uses_it():
    broker, custody, clock, endpoint = setup(None, granted(refresh_token=REFRESH_2), granted(ACCESS_2))
    conn = oauth_conn()

    async def go():
        assert await value(broker, conn, endpoint) == OLD
        [(address, sealed)] = custody.puts
        assert address == ADDRESS
        assert decode_fields(sealed) == ("oauth2", {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
                                                    "refresh_token": REFRESH_2})
        # the token belongs to the record now in custody: the next request reuses it, no mint
        assert await value(broker, conn, endpoint) == OLD
        assert len(endpoint.requests) == 1
        clock.now = NOW + 3540
        await value(broker, conn, endpoint)
        await settle()
        assert await value(broker, conn, endpoint) == NEW
        assert endpoint.form()["refresh_token"] == REFRESH_2
        assert len(custody.puts) == 1  # the second reply rotated nothing

    run(go())


def test_the_same_refresh_token_returned_is_not_written_back():
    broker, custody, _, endpoint = setup(None, granted(refresh_token=REFRESH))
    attach(broker, oauth_conn(), endpoint)
    assert custody.puts == []


def test_a_failed_write_back_keeps_serving_the_new_token_and_logs_without_values(caplog):
    broker, custody, clock, endpoint = setup(None, granted(refresh_token=REFRESH_2), granted(ACCESS_2))
    custody.refuse_put = True
    conn = oauth_conn()

    async def go():
        assert await value(broker, conn, endpoint) == OLD
        assert await value(broker, conn, endpoint) == OLD
        assert len(endpoint.requests) == 1
        # custody still holds the old refresh token, which the provider retired: this process kept the rotated one in
        # memory, and its next mint sends that
        clock.now = NOW + 3540
        await value(broker, conn, endpoint)
        await settle()
        assert await value(broker, conn, endpoint) == NEW
        assert endpoint.form()["refresh_token"] == REFRESH_2

    with caplog.at_level(logging.DEBUG, logger="egresslaw.credentials"):
        run(go())
    [entry] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert entry.name == "egresslaw.credentials" and "`drive`" in entry.getMessage()
    for secret in (ACCESS, ACCESS_2, REFRESH, REFRESH_2, CLIENT_SECRET):
        assert secret not in caplog.text


def test_a_refused_mint_names_its_status_and_never_the_body_and_is_held(caplog):
    refusal = Reply(400, json.dumps({"error": "invalid_grant", "error_description": BODY_CANARY}).encode())
    broker, _, clock, endpoint = setup(None, refusal, granted())
    conn = oauth_conn()

    async def go():
        with pytest.raises(MintFailed) as first:
            await value(broker, conn, endpoint)
        assert first.value.provider_status == 400
        assert first.value.reason == "credential-mint-failed"
        assert "400" in first.value.message
        for text in (str(first.value), first.value.message, first.value.help or "", repr(refusal)):
            assert BODY_CANARY not in text and "invalid_grant" not in text
        clock.now = NOW + 1.99  # within FAILURE_HOLD (2 s): the same failure, no call
        with pytest.raises(MintFailed):
            await value(broker, conn, endpoint)
        assert len(endpoint.requests) == 1
        clock.now = NOW + 2.0
        assert await value(broker, conn, endpoint) == OLD
        assert len(endpoint.requests) == 2

    with caplog.at_level(logging.DEBUG):
        run(go())
    assert BODY_CANARY not in caplog.text


def test_a_token_still_valid_serves_while_its_refresh_fails(caplog):
    broker, _, clock, endpoint = setup(None, granted(), Reply(500, json.dumps({"detail": BODY_CANARY}).encode()))
    conn = oauth_conn()

    async def go():
        await value(broker, conn, endpoint)
        clock.now = NOW + 3550  # past refresh_at (3540), before expires_at (3600)
        assert await value(broker, conn, endpoint) == OLD
        await settle()
        assert len(endpoint.requests) == 2
        clock.now = NOW + 3550 + 1.99  # the failure is held: no call, the token serves
        assert await value(broker, conn, endpoint) == OLD
        await settle()
        assert len(endpoint.requests) == 2
        clock.now = NOW + 3550 + 2.0  # tried again, still serving
        assert await value(broker, conn, endpoint) == OLD
        await settle()
        assert len(endpoint.requests) == 3
        clock.now = NOW + 3600  # expired: nothing to serve
        with pytest.raises(MintFailed) as failed:
            await value(broker, conn, endpoint)
        assert failed.value.provider_status == 500
        assert len(endpoint.requests) == 4

    with caplog.at_level(logging.WARNING, logger="egresslaw.credentials"):
        run(go())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("`drive`" in r.getMessage() for r in warnings)
    assert ACCESS not in caplog.text and BODY_CANARY not in caplog.text


def test_a_changed_record_mints_again_at_once():
    broker, custody, _, endpoint = setup(None, granted(), granted(ACCESS_2))
    conn = oauth_conn()
    attach(broker, conn, endpoint)
    custody.record = Secret(oauth_record(refresh_token=REFRESH_2))  # re-sealed by an operator
    assert attach(broker, conn, endpoint) == NEW
    assert endpoint.form()["refresh_token"] == REFRESH_2


def test_a_token_belongs_to_its_grant_not_to_the_row():
    """Another process rewrote the row with a rotated refresh token (the grant's lineage kept): the same grant, the token
    serves on. The same content read again: the same grant. A record sealed anew by hand: another grant, minted again."""
    broker, custody, _, endpoint = setup(None, granted(), granted(ACCESS_2))
    conn = oauth_conn()
    attach(broker, conn, endpoint)
    custody.record = Secret(custody.record.reveal())  # the same content, a new row version
    assert attach(broker, conn, endpoint) == OLD
    lineage = record_grant(custody.record.reveal())
    rotated = encode_fields("oauth2", {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "refresh_token": REFRESH_2},
                            grant=lineage)
    custody.record = Secret(rotated)  # what a broker in another process writes back
    assert attach(broker, conn, endpoint) == OLD and len(endpoint.requests) == 1
    custody.record = Secret(encode_fields("oauth2", {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
                                                     "refresh_token": REFRESH_2}))  # `custody put` again: a new grant
    assert attach(broker, conn, endpoint) == NEW
    assert endpoint.form()["refresh_token"] == REFRESH_2


def test_a_write_back_keeps_the_grants_lineage():
    broker, custody, _, endpoint = setup(None, granted(refresh_token=REFRESH_2))
    first = record_grant(custody.record.reveal())
    attach(broker, oauth_conn(), endpoint)
    [(_, sealed)] = custody.puts
    assert record_grant(sealed) == first and decode_fields(sealed)[1]["refresh_token"] == REFRESH_2


def test_changed_kind_settings_mint_again():
    broker, _, _, endpoint = setup(None, granted(), granted(ACCESS_2))
    attach(broker, oauth_conn(scopes=("a",)), endpoint)
    assert attach(broker, oauth_conn(scopes=("a",)), endpoint) == OLD
    assert attach(broker, oauth_conn(scopes=("a", "b")), endpoint) == NEW
    assert endpoint.form()["scope"] == "a b"


def test_forget_drops_the_tokens():
    broker, _, _, endpoint = setup(None, granted(), granted(ACCESS_2))
    conn = oauth_conn()
    attach(broker, conn, endpoint)
    broker.forget()
    assert attach(broker, conn, endpoint) == NEW
    assert len(endpoint.requests) == 2


def test_the_broker_and_a_reply_show_no_token():
    broker, _, _, endpoint = setup()
    attached = run(broker.attach(ADDRESS, oauth_conn(), endpoint))
    for shown in (repr(broker), repr(attached), repr(endpoint.replies[0])):
        assert ACCESS not in shown


@pytest.mark.parametrize("reply", [
    Reply(200, json.dumps({"access_token": ACCESS, "token_type": "mac", "expires_in": 3600}).encode()),
    Reply(200, json.dumps({"token_type": "Bearer", "expires_in": 3600}).encode()),
    granted(expires_in=0),
    granted(expires_in=-30),
    granted(expires_in=True),
    granted(expires_in="soon"),
    granted(token="has a space"),
    granted(token="has\rcr"),
    granted(token=""),
    granted(token=12345),
    granted(refresh_token="new refresh\ntoken"),
    Reply(200, b"access_token=" + ACCESS.encode()),
    Reply(200, b"[]"),
    Reply(302, granted().body),  # a redirect is never followed, whatever it carries
    Reply(201, granted().body),
], ids=["not-bearer", "no-access-token", "expires-0", "expires-negative", "expires-bool", "expires-text", "token-space",
        "token-cr", "token-empty", "token-number", "bad-refresh", "not-json", "not-object", "redirect",
        "not-200"])
def test_an_unusable_reply_is_mint_failed_and_shows_no_token(reply):
    broker, _, _, endpoint = setup(None, reply)
    with pytest.raises(MintFailed) as failed:
        attach(broker, oauth_conn(), endpoint)
    assert failed.value.provider_status == reply.status
    assert ACCESS not in str(failed.value) and "has a space" not in str(failed.value)
    assert broker.mints == 0


def test_a_lowercase_bearer_token_type_is_accepted():
    reply = Reply(200, json.dumps({"access_token": ACCESS, "token_type": "bearer", "expires_in": 60}).encode())
    broker, _, _, endpoint = setup(None, reply)
    assert attach(broker, oauth_conn(), endpoint) == OLD


def test_a_nan_expires_in_is_mint_failed():
    broker, _, _, endpoint = setup(None, Reply(200, b'{"access_token": "' + ACCESS.encode() + b'", "expires_in": NaN}'))
    with pytest.raises(MintFailed):
        attach(broker, oauth_conn(), endpoint)


# -- github_app --------------------------------------------------------------------------------------------------------

APP_ID = "123456"
INSTALLATION_URL = "https://api.github.com/app/installations/42/access_tokens"
INSTALLATION_TOKEN = "ghs_installationTokenForTests0123"


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem(key, fmt=serialization.PrivateFormat.TraditionalOpenSSL) -> str:
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()).decode("ascii")


def app_conn(repositories: tuple[str, ...] = (), permissions: tuple[tuple[str, str], ...] = ()) -> Connection:
    mint = Mint(kind="github_app", token_url=INSTALLATION_URL, token_host="api.github.com", token_port=443,
                token_path="/app/installations/42/access_tokens", repositories=repositories, permissions=permissions)
    return Connection(name="drive", version=1, credential_handle="drive-oauth", worker="default", rules=rule(), mint=mint)


def installation(token: str = INSTALLATION_TOKEN, expires_at: float = NOW + 3600, status: int = 201) -> Reply:
    when = datetime.datetime.fromtimestamp(expires_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Reply(status, json.dumps({"token": token, "expires_at": when}).encode())


def test_the_app_jwt_verifies_and_the_installation_token_is_attached(rsa_key):
    broker, _, clock, endpoint = setup(encode_fields("github_app", {"app_id": APP_ID, "private_key": pem(rsa_key)}),
                                       installation())
    clock.now = float(int(datetime.datetime.now(datetime.UTC).timestamp()))  # PyJWT checks exp against the real clock
    endpoint.replies = [installation(expires_at=clock.now + 3600)]
    assert attach(broker, app_conn(), endpoint) == f"Bearer {INSTALLATION_TOKEN}".encode()
    headers = endpoint.headers()
    scheme, _, token = headers["Authorization"].partition(" ")
    assert scheme == "Bearer"
    claims = jwt.decode(token, key=rsa_key.public_key(), algorithms=["RS256"], options={"require": ["iat", "exp", "iss"]})
    assert jwt.get_unverified_header(token)["alg"] == "RS256"
    assert claims["iss"] == APP_ID and isinstance(claims["iss"], str)
    assert claims["iat"] <= clock.now < claims["exp"]
    assert claims["exp"] - claims["iat"] <= 600
    assert headers["Accept"] == "application/vnd.github+json"
    assert json.loads(endpoint.requests[0].body) == {}


def test_a_pkcs8_key_signs_too(rsa_key):
    broker, _, _, endpoint = setup(
        encode_fields("github_app", {"app_id": APP_ID, "private_key": pem(rsa_key, serialization.PrivateFormat.PKCS8)}),
        installation())
    attach(broker, app_conn(), endpoint)
    token = endpoint.headers()["Authorization"].removeprefix("Bearer ")
    claims = jwt.decode(token, key=rsa_key.public_key(), algorithms=["RS256"],
                        options={"verify_exp": False, "verify_iat": False})
    assert claims == {"iss": APP_ID, "iat": int(NOW) - 60, "exp": int(NOW) + 540}


def test_the_installation_token_request_narrows_to_what_is_declared(rsa_key):
    broker, _, _, endpoint = setup(encode_fields("github_app", {"app_id": APP_ID, "private_key": pem(rsa_key)}),
                                   installation())
    attach(broker, app_conn(repositories=("api", "web"), permissions=(("contents", "read"), ("issues", "write"))), endpoint)
    assert json.loads(endpoint.requests[0].body) == {"repositories": ["api", "web"],
                                                     "permissions": {"contents": "read", "issues": "write"}}
    broker.forget()
    attach(broker, app_conn(repositories=("api",)), endpoint)
    assert json.loads(endpoint.requests[-1].body) == {"repositories": ["api"]}


def test_the_installation_token_is_refreshed_a_minute_before_it_expires(rsa_key):
    second = "ghs_secondInstallationToken0456"
    broker, _, clock, endpoint = setup(encode_fields("github_app", {"app_id": APP_ID, "private_key": pem(rsa_key)}),
                                       installation(), installation(second, NOW + 7200))
    conn = app_conn()

    async def go():
        await value(broker, conn, endpoint)
        clock.now = NOW + 3539
        assert await value(broker, conn, endpoint) == f"Bearer {INSTALLATION_TOKEN}".encode()
        await settle()
        assert len(endpoint.requests) == 1
        clock.now = NOW + 3540
        await value(broker, conn, endpoint)
        await settle()
        assert len(endpoint.requests) == 2
        assert await value(broker, conn, endpoint) == f"Bearer {second}".encode()

    run(go())


@pytest.mark.parametrize("reply", [
    installation(expires_at=NOW - 1),
    installation(expires_at=NOW),
    Reply(201, json.dumps({"token": INSTALLATION_TOKEN, "expires_at": "next week"}).encode()),
    Reply(201, json.dumps({"token": INSTALLATION_TOKEN}).encode()),
    installation(status=401),
    installation(token="ghs with space"),
], ids=["expired", "expires-now", "not-a-date", "no-expiry", "refused", "bad-token"])
def test_an_unusable_installation_token_is_mint_failed(rsa_key, reply):
    broker, _, _, endpoint = setup(encode_fields("github_app", {"app_id": APP_ID, "private_key": pem(rsa_key)}), reply)
    with pytest.raises(MintFailed) as failed:
        attach(broker, app_conn(), endpoint)
    assert failed.value.provider_status == reply.status
    assert INSTALLATION_TOKEN not in str(failed.value)


def test_a_private_key_that_is_not_a_pem_is_record_invalid_without_its_value():
    canary = "-----BEGIN RSA PRIVATE KEY-----\nnot-a-key-canary-31f9\n-----END RSA PRIVATE KEY-----\n"
    with pytest.raises(RecordInvalid) as bad:
        open_fields(KINDS["github_app"], Secret(encode_fields("github_app", {"app_id": APP_ID, "private_key": canary})))
    assert "`private_key` is not an unencrypted PEM private key" in bad.value.message
    assert "canary" not in str(bad.value) and "canary" not in (bad.value.help or "")


def test_an_ec_key_is_record_invalid():
    key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(RecordInvalid, match="not an RSA key"):
        open_fields(KINDS["github_app"], Secret(encode_fields("github_app", {"app_id": APP_ID,
                                                                             "private_key": pem(key, serialization.PrivateFormat.PKCS8)})))


@pytest.mark.parametrize("app_id", ["app-123", "12a", "-1", "1.5"])
def test_a_non_numeric_app_id_is_record_invalid_and_nothing_is_called(rsa_key, app_id):
    record = encode_fields("github_app", {"app_id": app_id, "private_key": pem(rsa_key)})
    with pytest.raises(RecordInvalid, match="`app_id` is not the App's numeric id"):
        open_fields(KINDS["github_app"], Secret(record))
    broker, _, _, endpoint = setup(record, installation())
    with pytest.raises(RecordInvalid):
        attach(broker, app_conn(), endpoint)
    assert endpoint.requests == []


def test_an_app_id_of_non_ascii_digits_is_record_invalid(rsa_key):
    with pytest.raises(RecordInvalid):
        open_fields(KINDS["github_app"], Secret(encode_fields("github_app", {"app_id": "１２３", "private_key": pem(rsa_key)})))


# -- the record against the connection's kind -------------------------------------------------------------------------

STATIC_VALUE = "sk-static-value-canary-6b2e"


def static_conn() -> Connection:
    return Connection(name="drive", version=1, credential_handle="drive-oauth", worker="default", rules=rule())


def test_a_static_record_for_an_oauth2_connection_is_record_invalid_naming_the_kinds():
    broker, _, _, endpoint = setup(STATIC_VALUE.encode(), granted())
    with pytest.raises(RecordInvalid) as bad:
        attach(broker, oauth_conn(), endpoint)
    assert bad.value.message == "the custody record holds a `static` credential and the connection is of kind `oauth2`"
    assert bad.value.help == "seal the connection's credential with `egresslaw custody put --kind oauth2`"
    assert STATIC_VALUE not in str(bad.value)
    assert endpoint.requests == []


def test_an_oauth2_record_for_a_static_connection_is_record_invalid_naming_the_kinds():
    broker, _, _, _ = setup(oauth_record())
    with pytest.raises(RecordInvalid) as bad:
        attach(broker, static_conn(), never)
    assert bad.value.message == "the custody record holds a `oauth2` credential and the connection is of kind `static`"
    for value in (CLIENT_ID, CLIENT_SECRET, REFRESH):
        assert value not in str(bad.value) and value not in (bad.value.help or "")


def test_a_static_record_on_a_static_connection_attaches_its_value():
    broker, _, _, _ = setup(STATIC_VALUE.encode())
    attached = run(broker.attach(ADDRESS, static_conn(), never))
    assert attached.value == f"Bearer {STATIC_VALUE}".encode()
    assert set(encodings_of(STATIC_VALUE.encode())) <= set(attached.needles)


def test_unknown_fields_are_named_and_a_name_that_is_not_an_identifier_is_not_echoed():
    record = encode_fields("oauth2", {"client_id": CLIENT_ID, "refresh_token": REFRESH, "scope": "x",
                                      "name-canary with spaces": "y"})
    with pytest.raises(RecordInvalid) as bad:
        open_fields(KINDS["oauth2"], Secret(record))
    assert bad.value.message == ("the custody record has fields a `oauth2` credential does not take: "
                                 "(a name that is not an identifier), scope")
    assert bad.value.help == "its fields: client_id, client_secret, refresh_token, auth_method"
    assert "canary" not in str(bad.value) and REFRESH not in str(bad.value)


@pytest.mark.parametrize(("kind", "fields", "missing"), [
    ("oauth2", {"refresh_token": REFRESH}, "`client_id`"),
    ("github_app", {"app_id": APP_ID}, "`private_key`"),
    ("github_app", {}, "`app_id`, `private_key`"),
    ("aws_sigv4", {"access_key_id": "AKIAEXAMPLE"}, "`secret_access_key`"),
])
def test_missing_required_fields_are_named(kind, fields, missing):
    with pytest.raises(RecordInvalid) as bad:
        open_fields(KINDS[kind], Secret(encode_fields(kind, fields)))
    assert bad.value.message == f"the custody record lacks {missing} for a `{kind}` credential"


def test_an_oauth2_record_with_neither_grant_field_is_record_invalid():
    with pytest.raises(RecordInvalid, match="needs `refresh_token`"):
        open_fields(KINDS["oauth2"], Secret(encode_fields("oauth2", {"client_id": CLIENT_ID})))


def test_an_unknown_auth_method_is_record_invalid():
    with pytest.raises(RecordInvalid, match="`auth_method` must be one of client_secret_basic, client_secret_post"):
        open_fields(KINDS["oauth2"], Secret(oauth_record(auth_method="private_key_jwt")))


def test_a_malformed_structured_record_is_record_invalid():
    with pytest.raises(RecordInvalid, match="malformed"):
        open_fields(KINDS["oauth2"], Secret(FIELDS_MARK + b'{"kind": "oauth2", "fields": ' + REFRESH.encode()))


def test_opened_fields_show_names_only():
    fields = open_fields(KINDS["oauth2"], Secret(oauth_record()))
    assert repr(fields) == "Fields(oauth2, plain=['client_id'], secret=['client_secret', 'refresh_token'])"


# -- needles -----------------------------------------------------------------------------------------------------------


def test_oauth2_needles_hold_every_secret_field_and_the_token_but_no_plain_field():
    broker, _, _, endpoint = setup()
    needles = set(run(broker.attach(ADDRESS, oauth_conn(), endpoint)).needles)
    for value in (CLIENT_SECRET, REFRESH, ACCESS):
        assert set(encodings_of(value.encode())) <= needles, value
    assert not set(encodings_of(CLIENT_ID.encode())) & needles


def test_a_rotated_refresh_token_is_a_needle():
    broker, _, _, endpoint = setup(None, granted(refresh_token=REFRESH_2))
    needles = set(run(broker.attach(ADDRESS, oauth_conn(), endpoint)).needles)
    assert set(encodings_of(REFRESH_2.encode())) <= needles


def test_github_app_needles_hold_each_long_line_of_the_pem_and_its_body_but_not_the_app_id(rsa_key):
    key = pem(rsa_key)
    broker, _, _, endpoint = setup(encode_fields("github_app", {"app_id": APP_ID, "private_key": key}), installation())
    needles = set(run(broker.attach(ADDRESS, app_conn(), endpoint)).needles)
    assert set(encodings_of(INSTALLATION_TOKEN.encode())) <= needles
    lines = [line for line in key.splitlines() if line and not line.startswith("-----")]
    assert len(lines) > 20
    for line in lines:
        if len(line) >= 16:
            assert line.encode() in needles
            assert quote(line, safe="").encode() in needles  # `+`, `/` and `=` as a URL-encoder writes them
    assert "".join(lines).encode() in needles  # re-wrapped or unwrapped
    assert APP_ID.encode() not in needles


# -- aws_sigv4 ---------------------------------------------------------------------------------------------------------

KEY_ID = "AKIAEXAMPLEKEYID0001"
SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYsecretCANARY"
SESSION = "IQoJb3JpZ2luX2VjSESSIONtokenCANARY//wEaCXVz=="


def sigv4_conn(service: str = "s3", region: str = "us-east-1") -> Connection:
    return Connection(name="drive", version=1, credential_handle="drive-oauth", worker="default", rules=rule(),
                      inject=Inject(header="Authorization", format="{secret}"),
                      mint=Mint(kind="aws_sigv4", region=region, service=service))


def signer(service: str = "s3", session: bool = False):
    fields = {"access_key_id": KEY_ID, "secret_access_key": SECRET_KEY} | ({"session_token": SESSION} if session else {})
    broker, _, _, _ = setup(encode_fields("aws_sigv4", fields))
    return run(broker.attach(ADDRESS, sigv4_conn(service), never))


def view(client_payload: str | None = None, host: str = "bucket.s3.amazonaws.com") -> SignView:
    return SignView(method="PUT", host=host, port=443, target="/key.txt?x-id=PutObject",
                    headers=[("content-type", "text/plain"), ("x-amz-meta-owner", "acme")], client_payload=client_payload)


def expected(payload: str, service: str = "s3", session: str | None = None, host: str = "bucket.s3.amazonaws.com"):
    v = view(host=host)
    return sigv4.sign(method=v.method, host=v.host, port=v.port, target=v.target, headers=v.headers, payload=payload,
                      access_key_id=KEY_ID, secret_access_key=SECRET_KEY, session_token=session, region="us-east-1",
                      service=service, now=NOW)


def test_s3_signs_unsigned_payload_without_the_body():
    attached = signer("s3")
    assert attached.value is None and attached.sign is not None and attached.hash_body is False
    headers = attached.sign(view(), None, NOW)
    assert dict(headers)["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    assert headers == expected("UNSIGNED-PAYLOAD")
    assert dict(headers)["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={KEY_ID}/20270115/us-east-1/s3/aws4_request, ")
    assert "x-amz-security-token" not in dict(headers)


def test_s3_keeps_the_clients_unsigned_trailer_and_ignores_a_client_hash():
    attached = signer("s3")
    headers = attached.sign(view("STREAMING-UNSIGNED-PAYLOAD-TRAILER"), None, NOW)
    assert headers == expected("STREAMING-UNSIGNED-PAYLOAD-TRAILER")
    client_hash = hashlib.sha256(b"what the client claims").hexdigest()
    assert dict(attached.sign(view(client_hash), None, NOW))["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"


def test_another_service_hashes_the_body():
    attached = signer("execute-api")
    assert attached.hash_body is True
    body = b'{"query": "hello"}'
    host = "abc123.execute-api.us-east-1.amazonaws.com"
    headers = attached.sign(view(host=host), body, NOW)
    assert dict(headers)["x-amz-content-sha256"] == hashlib.sha256(body).hexdigest()
    assert headers == expected(hashlib.sha256(body).hexdigest(), "execute-api", host=host)
    empty = attached.sign(view("UNSIGNED-PAYLOAD", host=host), None, NOW)
    assert dict(empty)["x-amz-content-sha256"] == hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize("service", ["s3", "execute-api"])
@pytest.mark.parametrize("payload", ["STREAMING-AWS4-HMAC-SHA256-PAYLOAD", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"])
def test_signed_streaming_is_signing_unsupported(service, payload):
    with pytest.raises(SigningUnsupported) as refused:
        signer(service).sign(view(payload), b"", NOW)
    assert refused.value.reason == "credential-sign-unsupported"
    assert SECRET_KEY not in str(refused.value)


def test_a_session_token_is_sent_and_signed():
    headers = signer("s3", session=True).sign(view(), None, NOW)
    found = dict(headers)
    assert found["x-amz-security-token"] == SESSION
    assert "x-amz-security-token" in found["authorization"].partition("SignedHeaders=")[2].split(",")[0].split(";")
    assert headers == expected("UNSIGNED-PAYLOAD", session=SESSION)


def test_sigv4_needles_hold_the_secret_key_and_session_token_but_not_the_key_id():
    needles = set(signer("s3", session=True).needles)
    assert set(encodings_of(SECRET_KEY.encode())) <= needles
    assert set(encodings_of(SESSION.encode())) <= needles
    assert not set(encodings_of(KEY_ID.encode())) & needles


def test_a_key_id_the_signer_refuses_is_signing_unsupported_without_values():
    broker, _, _, _ = setup(encode_fields("aws_sigv4", {"access_key_id": "AKIA,CANARY/ID", "secret_access_key": SECRET_KEY}))
    attached = run(broker.attach(ADDRESS, sigv4_conn(), never))
    with pytest.raises(SigningUnsupported) as refused:
        attached.sign(view(), None, NOW)
    assert "CANARY" not in str(refused.value) and SECRET_KEY not in str(refused.value)


def test_a_token_too_close_to_its_end_is_not_served_the_request_waits_for_the_new_one():
    """From `serve_until` (half the refresh margin before expiry: 75 s of a 100 s token) no request gets the old token,
    which could expire on its way to the upstream; a request that finds it so waits for the mint."""
    broker, _, clock, endpoint = setup(None, granted(expires_in=100), granted(ACCESS_2))
    conn = oauth_conn()

    async def go():
        assert await value(broker, conn, endpoint) == OLD
        clock.now = NOW + 75.0
        assert await value(broker, conn, endpoint) == NEW  # waited: no background refresh had run
        assert len(endpoint.requests) == 2

    run(go())


def test_a_token_the_upstream_rejected_is_minted_again():
    broker, custody, _, endpoint = setup(None, granted(), granted(ACCESS_2))
    conn = oauth_conn()

    async def go():
        first = await broker.attach(ADDRESS, conn, endpoint)
        broker.rejected(ADDRESS, first)
        assert (await broker.attach(ADDRESS, conn, endpoint)).value == NEW
        broker.rejected(ADDRESS, first)  # a late 401 for the old token forgets nothing newer
        assert (await broker.attach(ADDRESS, conn, endpoint)).value == NEW and len(endpoint.requests) == 2

    run(go())


def test_a_mint_waits_for_another_processs_and_spends_the_refresh_token_it_rotated():
    """The fleet's lock (custody's `try_mint_lock`): while another process mints, this one waits; once it holds the lock
    it reads the record again, so it spends the refresh token that process rotated and wrote back."""
    broker, custody, clock, endpoint = setup(None, granted())
    attempts: list[int] = []
    released: list[int] = []

    def try_mint_lock(address):
        attempts.append(1)
        if len(attempts) < 3:
            if len(attempts) == 2:  # the other process finishes: it rotated the refresh token and wrote it back
                custody.record = Secret(encode_fields("oauth2", {"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
                                                                 "refresh_token": REFRESH_2},
                                                      grant=record_grant(custody.record.reveal())))
            return None
        return lambda: released.append(1)

    custody.try_mint_lock = try_mint_lock
    assert attach(broker, oauth_conn(), endpoint) == OLD
    assert len(attempts) == 3 and released == [1]
    assert endpoint.form()["refresh_token"] == REFRESH_2  # not the one it read before it waited


def test_a_mint_that_never_gets_the_lock_fails_closed(monkeypatch):
    from egress_proxy.credentials import broker as broker_mod

    monkeypatch.setattr(broker_mod, "LOCK_WAIT", 0.05)
    broker, custody, clock, endpoint = setup(None, granted())
    broker.clock = time.monotonic
    custody.try_mint_lock = lambda address: None
    with pytest.raises(MintFailed):
        attach(broker, oauth_conn(), endpoint)
    assert endpoint.requests == []
