"""Envoy's access log into the chain: the reader's position, its rotation, and a crash in the middle of one.

Lines are written here as Envoy writes them (one JSON object per line); the lane's real Envoy drives the same
reader in tests/egress_proxy/run/test_lane.py."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from egress_proxy.audit.log import AuditLog
from egress_proxy.custody.keys import init_keys, load_audit_key
from egress_proxy.lane.ingest import Ingester


def _line(n: int) -> str:
    return json.dumps({"lane": "front", "id": f"id-{n}", "method": "CONNECT", "authority": "pypi.org:443", "status": 200,
                       "flags": "-", "decided": "allow", "bytes_up": 10, "bytes_down": 20, "duration_ms": 5}) + "\n"


@pytest.fixture
def setup(tmp_path):
    init_keys(tmp_path / "keys")
    audit = AuditLog(tmp_path / "audit.jsonl", load_audit_key(tmp_path / "keys"), fsync=False)
    yield tmp_path, audit
    audit.close()


def _reader(tmp_path, audit, **kw) -> Ingester:
    return Ingester(tmp_path / "access.log", tmp_path / "ingest.pos", audit, refusal=lambda host: None, policy=lambda: None, **kw)


def _ids(tmp_path, audit) -> list[str]:
    audit.flush()
    return [e["id"] for e in map(json.loads, (tmp_path / "audit.jsonl").read_text().splitlines()) if e.get("kind") == "outcome"]


def test_a_restart_resumes_at_the_saved_position_and_a_partial_line_waits(setup):
    tmp, audit = setup
    log = tmp / "access.log"
    log.write_text(_line(1) + _line(2) + _line(3)[:20])
    asyncio.run(_reader(tmp, audit).poll())
    with log.open("a") as fh:
        fh.write(_line(3)[20:])
    asyncio.run(_reader(tmp, audit).poll())  # a new reader: the saved position, not the start
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3"]


def test_rotation_and_a_crash_in_the_middle_of_one_lose_nothing_and_repeat_nothing(setup):
    tmp, audit = setup
    log = tmp / "access.log"
    reopened: list[bool] = []

    async def reopen() -> None:  # Envoy: what it held goes to the renamed file, then it opens the name again
        with (tmp / "access.log.1").open("a") as fh:
            fh.write(_line(2))
        log.write_text(_line(3))
        reopened.append(True)

    reader = _reader(tmp, audit, reopen=reopen, rotate_bytes=1)
    log.write_text(_line(1))

    async def first() -> bool:
        await reader.poll()
        return await reader.rotate()

    assert asyncio.run(first()) and reopened and not (tmp / "access.log.1").exists()
    asyncio.run(reader.poll())
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3"]
    # a crash after the rename and before the renamed file was finished: the next start reads it first
    os.replace(log, tmp / "access.log.1")
    with (tmp / "access.log.1").open("a") as fh:
        fh.write(_line(4))
    log.write_text(_line(5))
    restarted = _reader(tmp, audit)

    async def start() -> None:
        await restarted.recover()
        await restarted.poll()

    asyncio.run(start())
    assert _ids(tmp, audit) == ["id-1", "id-2", "id-3", "id-4", "id-5"]
    assert not (tmp / "access.log.1").exists()


def test_a_reopen_that_fails_gives_the_file_its_name_back(setup):
    tmp, audit = setup
    log = tmp / "access.log"

    async def reopen() -> None:
        raise OSError("envoy is gone")

    reader = _reader(tmp, audit, reopen=reopen, rotate_bytes=1)
    log.write_text(_line(1))

    async def go() -> bool:
        await reader.poll()
        return await reader.rotate()

    assert asyncio.run(go()) is False
    assert log.exists() and not (tmp / "access.log.1").exists()
    with log.open("a") as fh:
        fh.write(_line(2))
    asyncio.run(reader.poll())
    assert _ids(tmp, audit) == ["id-1", "id-2"]
