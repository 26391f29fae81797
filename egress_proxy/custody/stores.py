"""Which custody backend a `--store` names: a file path is the embedded SQLite store (the default),
a `postgresql://` URL is the PostgreSQL store a fleet of proxies shares (`egress_proxy.custody.postgres`).

Both seal the same records the same way (`egress_proxy.custody.records`); the proxy sees only
`open(address) -> Secret`. A database URL may carry a password, so it is shown only through
`shown()`, which masks it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from egress_proxy.custody.records import CustodyError, is_database_url
from egress_proxy.custody.sqlite import CustodyStore

if TYPE_CHECKING:
    from egress_proxy.custody.postgres import PostgresCustodyStore

__all__ = ["open_store"]


def open_store(
    store: str | os.PathLike[str], keys_dir: str | os.PathLike[str], *, create: bool, lock_timeout: float | None = None
) -> CustodyStore | PostgresCustodyStore:
    """The custody store `store` names; CustodyError(io=True) or KeyFileError if it cannot be used.

    `lock_timeout` bounds the wait for another process's lock on a SQLite store (PostgreSQL has its own).
    """
    if not os.fspath(store):
        raise CustodyError("no custody store given", help="pass `--store custody.db` or `--store postgresql://…`", io=True)
    if is_database_url(store):
        # Imported here: psycopg and its pool cost an embedded (SQLite) proxy start-up for nothing.
        from egress_proxy.custody.postgres import PostgresCustodyStore

        return PostgresCustodyStore(str(store), keys_dir, create=create)
    if lock_timeout is None:
        return CustodyStore(store, keys_dir, create=create)
    return CustodyStore(store, keys_dir, create=create, lock_timeout=lock_timeout)
