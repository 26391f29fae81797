"""Which custody backend a `--store` names: a file path is the embedded SQLite store (the default),
a `postgresql://` URL is the PostgreSQL store a fleet of proxies shares (`egress_proxy.custody_pg`).

Both seal the same records the same way (`egress_proxy.custody`); the proxy sees only
`open(address) -> Secret`. A database URL may carry a password, so it is shown only through
`shown()`, which masks it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from egress_proxy.custody import CustodyError

if TYPE_CHECKING:
    from egress_proxy.custody import CustodyStore
    from egress_proxy.custody_pg import PostgresCustodyStore

DATABASE_SCHEMES = ("postgresql://", "postgres://")
_MASK = "***"

__all__ = ["CustodyUnavailable", "is_database_url", "open_store", "shown"]


class CustodyUnavailable(CustodyError):
    """The custody store cannot be reached right now (its database is down or unreachable).

    The proxy denies the request with `custody-unavailable` and forwards nothing; the store
    reconnects by itself. Never carries a secret or a database password.
    """

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message, help, io=True)


def is_database_url(store: str | os.PathLike[str]) -> bool:
    """True when `store` names a PostgreSQL database rather than a SQLite file."""
    return isinstance(store, str) and store.lower().startswith(DATABASE_SCHEMES)


def shown(store: str | os.PathLike[str]) -> str:
    """`store` as it may appear in a message or log line: a database URL with its password masked."""
    text = os.fspath(store)
    if not is_database_url(text):
        return text
    try:
        parts = urlsplit(text)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, sep, _password = userinfo.partition(":")
            netloc = f"{user}{':' + _MASK if sep else ''}@{hostport}"
        query = urlencode(
            [(k, _MASK if "password" in k.lower() else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="/"
        )
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    except ValueError:
        return f"{text.split(':', 1)[0]}://{_MASK}"  # unparseable: show the scheme only


def open_store(
    store: str | os.PathLike[str], keys_dir: str | os.PathLike[str], *, create: bool, lock_timeout: float | None = None
) -> CustodyStore | PostgresCustodyStore:
    """The custody store `store` names; CustodyError(io=True) or KeyFileError if it cannot be used.

    `lock_timeout` bounds the wait for another process's lock on a SQLite store (PostgreSQL has its own).
    """
    if not os.fspath(store):
        raise CustodyError("no custody store given", help="pass `--store custody.db` or `--store postgresql://…`", io=True)
    if is_database_url(store):
        from egress_proxy.custody_pg import PostgresCustodyStore

        return PostgresCustodyStore(str(store), keys_dir, create=create)
    from egress_proxy.custody import CustodyStore

    if lock_timeout is None:
        return CustodyStore(store, keys_dir, create=create)
    return CustodyStore(store, keys_dir, create=create, lock_timeout=lock_timeout)
