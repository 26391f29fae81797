"""Fixtures shared by the custody tests: a fresh keys directory, and a SQLite store over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from egress_proxy.custody.keys import init_keys
from egress_proxy.custody.sqlite import CustodyStore


@pytest.fixture()
def keys(tmp_path: Path) -> Path:
    init_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture()
def store(tmp_path: Path, keys: Path):
    with CustodyStore(tmp_path / "custody.db", keys) as s:
        yield s
