"""`open_store`: a path is the SQLite store, a URL the PostgreSQL one; nothing at all is refused with the fix."""

from __future__ import annotations

import pytest

from egress_proxy.custody.keys import init_keys
from egress_proxy.custody.records import CustodyError
from egress_proxy.custody.sqlite import CustodyStore
from egress_proxy.custody.stores import open_store


def test_a_path_opens_the_sqlite_store(tmp_path) -> None:
    init_keys(tmp_path / "keys")
    with open_store(tmp_path / "c.db", tmp_path / "keys", create=True) as store:
        assert isinstance(store, CustodyStore)
    with pytest.raises(CustodyError) as exc:
        open_store(tmp_path / "missing.db", tmp_path / "keys", create=False)
    assert exc.value.io


def test_no_store_is_refused_with_the_fix(tmp_path) -> None:
    with pytest.raises(CustodyError) as exc:
        open_store("", tmp_path, create=False)
    assert exc.value.io and "--store" in (exc.value.help or "")
