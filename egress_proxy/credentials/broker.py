"""The broker: one per edge process, between custody and the requests that carry a connection's credential.

For each request the edge asks `attach(workspace, connection)`. The broker opens the custody record (every request:
a changed, rotated or deleted record is seen at once), checks it against the connection's kind, and returns what the
request carries. For minting kinds it keeps the token in memory only, in this process, and:

- refreshes it before it expires (`refresh_at`: half its life, at most 60 s, before `expires_at`), in the background:
  the current token serves the requests that find it due while one refresh runs, until half that margin is left
  (`serve_until`: a token with less would expire on its way to the upstream); a request that finds none waits;
- forgets a token the upstream answered 401 to (`rejected`: revoked or cut short at the provider);
- mints once per credential at a time: concurrent requests wait for the mint in flight and share its outcome;
- writes a field the provider rotated (a new refresh token) back to custody before the new token is used (the
  store's `put` is one transaction: the old record or the new one, never half);
- after a failed mint, answers the same failure for `FAILURE_HOLD` seconds without calling the provider again (a
  revoked grant must not turn every request into a call to the token endpoint); a token still valid keeps serving.

A token never leaves `Attached` except into the header the edge writes; nothing here logs, and errors carry statuses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compiler.artifact import Connection
from egress_proxy.credentials import KINDS
from egress_proxy.credentials.base import (
    Attached,
    CredentialError,
    Fetch,
    Fields,
    MintFailed,
    RecordInvalid,
    open_fields,
)
from egress_proxy.custody.records import Address, encode_fields
from egress_proxy.custody.secret import Secret

log = logging.getLogger("egresslaw.credentials")

FAILURE_HOLD = 2.0
LOCK_WAIT = 15.0  # how long a mint waits for another process's mint of the same credential (its call times out in 10 s)
MAX_MARGIN = 60.0


@dataclass
class _Token:
    grant: str  # the grant it was minted from: a record rotated by any process is the same grant, one sealed anew is not
    mint: Any  # the connection's kind settings it was minted under (a reload that changes them mints again)
    attached: Attached
    expires_at: float
    refresh_at: float  # from here a refresh runs in the background while this token serves
    serve_until: float  # from here no request gets it (too little life left to reach the upstream): they wait


class Broker:
    def __init__(self, custody: Callable[[], Any], clock: Callable[[], float] = time.time) -> None:
        self._custody = custody  # the edge's current custody source (it may be replaced while serving)
        self.clock = clock
        self._fields: dict[Address, tuple[Secret, str, Fields, Attached | None]] = {}
        self._tokens: dict[Address, _Token] = {}
        self._inflight: dict[Address, asyncio.Future[_Token]] = {}
        self._failed: dict[Address, tuple[float, CredentialError, str]] = {}  # (when, why, for which grant)
        self._background: set[asyncio.Task[None]] = set()  # refreshes in flight that no request waits for
        self.mints = 0  # successful mints in this process (metrics, tests)

    def __repr__(self) -> str:
        return f"Broker({len(self._tokens)} tokens, {len(self._inflight)} minting)"

    def rejected(self, address: Address, attached: Attached) -> None:
        """The upstream refused a request that carried this minted token (401): revoked or expired early at the provider,
        so the next request mints instead of sending it again."""
        token = self._tokens.get(address)
        if token is not None and token.attached is attached:
            del self._tokens[address]

    def forget(self) -> None:
        """Drop every token and opened record (a reload with another artifact: kinds and endpoints may differ)."""
        self._fields.clear()
        self._tokens.clear()
        self._failed.clear()

    async def attach(self, address: Address, conn: Connection, fetch: Fetch) -> Attached:
        """What a request of `conn` carries; `fetch` calls its token endpoint (the edge: resolved, judged by the
        connection's worker, pinned, audited). CustodyError (the record), RecordInvalid or MintFailed: nothing is
        forwarded."""
        kind = KINDS.get(conn.kind)
        if kind is None:
            raise RecordInvalid(f"the connection's credential kind `{conn.kind}` is not one this edge knows")
        record = self._custody().open(address)
        fields, fixed = self._open(address, record, conn)
        if not kind.mints:
            assert fixed is not None
            return fixed
        now = self.clock()
        token = self._tokens.get(address)
        if token is not None and (token.grant != fields.grant or token.mint != conn.mint):
            token = None
        if token is not None and now < token.refresh_at:
            return token.attached
        usable = token if token is not None and now < token.serve_until else None
        failed = self._failed.get(address)
        if failed is not None and failed[2] == fields.grant and now < failed[0] + FAILURE_HOLD:
            if token is not None and now < token.expires_at:
                return token.attached  # the provider refuses for now: the token serves to its very end
            raise failed[1]
        if usable is not None:
            # Due for refresh, still valid: it serves this request while one refresh runs beside it (no request waits).
            if address not in self._inflight:
                task = asyncio.get_running_loop().create_task(self._refresh(address, conn, fields, fetch))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return usable.attached
        return (await self._mint_once(address, conn, fields, fetch)).attached

    async def _refresh(self, address: Address, conn: Connection, fields: Fields, fetch: Fetch) -> None:
        """A refresh nobody waits for: its failure is held (FAILURE_HOLD) and logged, the current token serves on."""
        try:
            await self._mint_once(address, conn, fields, fetch)
        except CredentialError as exc:
            log.warning("refreshing the credential of connection `%s` failed (%s); its current token serves until it expires",
                        conn.name, exc.reason)
        except Exception as exc:  # never an unretrieved task exception; the next request that needs a token mints again
            log.error("refreshing the credential of connection `%s` failed: %s", conn.name, exc.__class__.__name__)

    def _open(self, address: Address, record: Secret, conn: Connection) -> tuple[Fields, Attached | None]:
        """The record's fields (and, for a kind that does not mint, what it attaches), derived once per record."""
        hit = self._fields.get(address)
        if hit is not None and hit[0] is record and hit[1] == conn.kind:
            return hit[2], hit[3]
        kind = KINDS[conn.kind]
        fields = open_fields(kind, record)
        fixed = None if kind.mints else kind.attach(conn, fields, None)
        if len(self._fields) >= 1024:
            self._fields.pop(next(iter(self._fields)))
        self._fields[address] = (record, conn.kind, fields, fixed)
        return fields, fixed

    async def _mint_once(self, address: Address, conn: Connection, fields: Fields, fetch: Fetch) -> _Token:
        """One mint per credential at a time: a request that finds one in flight waits for its outcome."""
        running = self._inflight.get(address)
        if running is not None:
            return await asyncio.shield(running)
        future: asyncio.Future[_Token] = asyncio.get_running_loop().create_future()
        self._inflight[address] = future
        try:
            token = await self._mint(address, conn, fields, fetch)
        except BaseException as exc:
            if isinstance(exc, CredentialError):
                self._failed[address] = (self.clock(), exc, fields.grant)
            future.set_exception(exc if isinstance(exc, Exception) else MintFailed("the mint was cancelled"))
            future.exception()  # retrieved: a failure nobody else awaited is not "never retrieved"
            raise
        else:
            self._failed.pop(address, None)
            future.set_result(token)
            return token
        finally:
            self._inflight.pop(address, None)

    async def _mint(self, address: Address, conn: Connection, fields: Fields, fetch: Fetch) -> _Token:
        """Mint under the fleet's lock for this credential (custody's `try_mint_lock`, when it has one), with the record
        read again once it is held: a refresh token another process just rotated is the one this mint spends."""
        try_lock = getattr(self._custody(), "try_mint_lock", None)
        if try_lock is None:
            return await self._mint_locked(address, conn, fields, fetch)
        deadline = self.clock() + LOCK_WAIT
        while (release := try_lock(address)) is None:
            if self.clock() > deadline:
                raise MintFailed("another proxy process has been minting this credential for too long")
            await asyncio.sleep(0.02)
        try:
            fields = self._open(address, self._custody().open(address), conn)[0]
            return await self._mint_locked(address, conn, fields, fetch)
        finally:
            release()

    async def _mint_locked(self, address: Address, conn: Connection, fields: Fields, fetch: Fetch) -> _Token:
        kind = KINDS[conn.kind]
        started = self.clock()
        reply = await fetch(conn, kind.token_request(conn, fields, started))
        report = getattr(fetch, "report", None)  # the edge audits the call once its outcome is known
        try:
            minted = kind.token_reply(conn, fields, reply, self.clock())
        except CredentialError as exc:
            if report is not None:
                report(conn, reply, exc)
            raise
        if report is not None:
            report(conn, reply, None)
        if minted.rotated:
            written = await self._write_back(address, conn, fields, minted.rotated)
            if written is not None:
                fields = written[1]
            else:  # custody could not take it: this process keeps the rotated fields (its next refresh needs them)
                fields = Fields(fields.kind, fields.plain, {**fields.secret, **{k: Secret(v.encode("utf-8")) for k, v in minted.rotated.items()}},
                                fields.grant)
                held = self._fields.get(address)
                if held is not None:  # the row it came from is unchanged: its memo now holds the rotated fields
                    self._fields[address] = (held[0], conn.kind, fields, None)
        life = max(0.0, minted.expires_at - started)
        self.mints += 1
        attached = kind.attach(conn, fields, minted.token)
        margin = min(MAX_MARGIN, life / 2)
        token = _Token(fields.grant, conn.mint, attached, minted.expires_at, minted.expires_at - margin, minted.expires_at - margin / 2)
        self._tokens[address] = token
        return token

    async def _write_back(self, address: Address, conn: Connection, fields: Fields,
                          rotated: dict[str, str]) -> tuple[Secret, Fields] | None:
        """Seal the record with the provider's rotated fields (one transaction), then use what custody now holds. None
        when custody cannot take it: the new token still serves (it is valid), and the failure is logged loudly."""
        values = {**fields.plain, **{k: v.reveal().decode("utf-8") for k, v in fields.secret.items()}, **rotated}
        custody = self._custody()
        put = getattr(custody, "put", None)
        try:
            if put is None:
                raise TypeError("read-only custody source")
            await asyncio.to_thread(put, address, encode_fields(conn.kind, values, grant=fields.grant))
            record = custody.open(address)
            return record, self._open(address, record, conn)[0]
        except Exception as exc:
            log.error("could not write the rotated credential of connection `%s` back to custody (%s): this process keeps "
                      "the new one in memory; seal the credential again before the proxy restarts, or the provider will "
                      "refuse its next refresh", conn.name, exc.__class__.__name__)
            return None
