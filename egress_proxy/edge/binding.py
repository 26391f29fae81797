"""Lease binding: what the edge lends the shared admission (`egress_proxy.front.admit`) for one client connection.

`LeaseBinding.hooks(conn)` is the `front.admit.Hooks` of a client connection: the lease keys (read again when
`keys rotate --lease` replaced the file; fail closed), the cache of leases that verified, the connection's claim on
one lease (the first accepted lease binds it; another refuses it for good), its resolution (once per name and
connection) and its pins (`Upstreams.pin`). `offers_other_lease` is the same claim inside a tunnel, where the lease
was judged at the CONNECT.

It takes from the addon, at construction: `record` (the client record of a connection, made on first need),
`resolve` (the addon's bounded lookup), `pin` (`upstreams.Upstreams.pin`), `clock` (read live) and `ledger` (the budget
ledger in force, read live: `front.budget.LazyLedger`). The lease key file
is set by the addon's `configure` (`lease_keys`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mitmproxy import http

from egress_proxy.custody import lease as leases
from egress_proxy.custody.keys import KeyFileError
from egress_proxy.decision.types import Lease
from egress_proxy.edge.flows import Client, identity, printable
from egress_proxy.front.admit import Hooks

log = logging.getLogger("egresslaw.proxy")


class LeaseBinding:
    """A client connection's claim on one lease, and the admission's hooks that hold it to that claim."""

    def __init__(self, *, record: Callable[[Any], Client], resolve: Callable[[str, int], Awaitable[Sequence[str]]],
                 pin: Callable[[Client, str, int, tuple[str, ...]], str | None], clock: Callable[[], float],
                 ledger: Callable[[], Any] = lambda: None) -> None:
        self._record, self._resolve, self._pin, self._clock, self._ledger = record, resolve, pin, clock, ledger
        self.lease_keys: Any = None  # keys.LeaseKeyFile: re-read when `keys rotate --lease` replaces it
        self.verified = leases.VerifiedLeases()  # tokens that verified, checked again only for time and key set

    def key_set(self) -> leases.LeaseKeys:
        """The lease keys in force; LeaseError (fail closed) when none is loaded or the file cannot be read."""
        if self.lease_keys is None:
            raise leases.LeaseError("lease-key-unknown", "no lease key loaded")
        try:
            return self.lease_keys.current()  # read again when `keys rotate --lease` replaced the file
        except KeyFileError:
            raise leases.LeaseError("internal-error", "lease keys unavailable") from None  # fail closed (logged once)

    def hooks(self, conn: Any) -> Hooks:
        """What the edge lends the admission for a request of client connection `conn`: the lease keys, the connection's
        claim on a lease, its per-connection resolution and pins."""
        client = self._record(conn)

        def bind(lease: Lease) -> str | None:
            # INVARIANT: one client connection, one subject. The first accepted lease binds the connection; another
            # lease on it is refused and the connection is refused for good (closed after this answer in HTTP/1).
            claim = identity(lease)
            client.bound = client.bound or claim
            if client.bound != claim:
                client.refused = "lease-mismatch"
                return "lease-mismatch"
            return None

        async def resolve(lease: Lease, host: str, port: int) -> Sequence[str] | str:
            """Resolve `host` once per client connection (its answers are judged again on every request)."""
            ips = client.vetted.get((host, port), ())
            if not ips:
                try:
                    ips = tuple(await self._resolve(host, port))
                except Exception as exc:  # resolver failures of any kind deny
                    log.info("resolve of `%s` failed: %s", printable(host), exc.__class__.__name__)
                    ips = ()
                if conn.timestamp_end is not None:
                    # INVARIANT: no state for a client that has gone (its client_disconnected already ran, and forgot it).
                    return "client-disconnected"
            return ips

        def pinned(lease: Lease, host: str, port: int, ips: tuple[str, ...]) -> str | None:
            return self._pin(client, host, port, ips)

        return Hooks(lease_keys=self.key_set, verified=self.verified, clock=self._clock, resolve=resolve, bind=bind, pinned=pinned,
                     ledger=self._ledger())

    def offers_other_lease(self, flow: http.HTTPFlow, lease: Lease) -> bool:
        """Inside a tunnel (HTTP/1 or an HTTP/2 stream), a `Proxy-Authorization` carrying another valid lease: the
        client connection is refused for good."""
        values = flow.request.headers.get_all("proxy-authorization")
        if not values:
            return False
        try:
            other = self.verified.authenticate(self.key_set(), values, now=self._clock())
        except leases.LeaseError:
            return False  # not a lease at all: it is stripped like any client header
        if identity(other) == identity(lease):
            return False
        self._record(flow.client_conn).refused = "lease-mismatch"
        return True
