"""`egresslaw keys init` and `egresslaw custody …`: exit codes, stdin handling, and the canary test."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import sqlite3
import subprocess
import sys
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from egress_proxy.custody.keys import load_custody_keys
from egress_proxy.custody.records import Address, CustodyError
from egress_proxy.custody.secret import encodings_of
from egress_proxy.custody.sqlite import CustodyStore
from egresslaw.cli import main

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ADDR = ["--workspace", "acme", "--connection", "github", "--handle", "gh-prod"]


def run(*args: str, stdin: bytes = b"", cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    """The real CLI in a child process: real stdin, real exit code."""
    return subprocess.run(
        [sys.executable, "-m", "egresslaw", *args], input=stdin, capture_output=True, cwd=cwd or ROOT, env=ENV, timeout=60
    )


def run_here(monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes], *args: str, stdin: bytes = b"") -> tuple[int, bytes, bytes]:
    """The CLI in this process via `egresslaw.cli.main`, with `stdin` as standard input."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    captured = capsysbinary.readouterr()
    return code, captured.out, captured.err


@pytest.fixture()
def keys(tmp_path: Path) -> Path:
    proc = run("keys", "init", "--dir", str(tmp_path / "keys"))
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "keys"


def _opts(keys: Path, tmp_path: Path) -> list[str]:
    return ["--keys", str(keys), "--store", str(tmp_path / "custody.db")]


# -- keys init ----------------------------------------------------------------------------------


def test_keys_init_creates_private_files_and_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "k"
    first = run("keys", "init", "--dir", str(target))
    assert first.returncode == 0
    ring = load_custody_keys(target)
    assert first.stdout.decode() == (f"created `{target}/custody.key` (custody key id `{ring.active}`), `{target}/lease.key`, "
                                     f"`{target}/audit.key` and `{target}/audit.pub`\n")
    assert target.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in target.iterdir()} == {n: 0o600 for n in ("custody.key", "lease.key", "audit.key", "audit.pub")}
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    again = run("keys", "init", "--dir", str(target))
    assert again.returncode == 2
    assert f"error: key file `{target}/custody.key` already exists; refusing to overwrite it" in again.stderr.decode()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_keys_add_audit_key_upgrades_an_older_keys_directory(tmp_path: Path) -> None:
    target = tmp_path / "k"
    assert run("keys", "init", "--dir", str(target)).returncode == 0
    (target / "audit.key").unlink()
    (target / "audit.pub").unlink()
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    added = run("keys", "add-audit-key", "--dir", str(target))
    assert added.returncode == 0 and b"audit key id `ak-" in added.stdout
    assert (target / "audit.key").stat().st_mode & 0o777 == 0o600
    assert {p.name: p.read_bytes() for p in target.iterdir() if p.name in before} == before  # the other keys are kept
    again = run("keys", "add-audit-key", "--dir", str(target))
    assert again.returncode == 2 and b"already exists" in again.stderr


def test_keys_init_needs_dir(tmp_path: Path) -> None:
    proc = run("keys", "init")
    assert proc.returncode == 2 and b"--dir" in proc.stderr


# -- put ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stdin", "stored"),
    [(b"tok-123", b"tok-123"), (b"tok-123\n", b"tok-123"), (b"tok-123\r\n", b"tok-123"), (b"  spaced  \n", b"  spaced  ")],
)
def test_put_reads_stdin_and_strips_one_newline(tmp_path: Path, keys: Path, stdin: bytes, stored: bytes) -> None:
    proc = run("custody", "put", *_opts(keys, tmp_path), *ADDR, stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    key_id = load_custody_keys(keys).active
    assert proc.stdout.decode() == f"sealed `acme/github/gh-prod` under key id `{key_id}`\n"
    with CustodyStore(tmp_path / "custody.db", keys) as store:
        assert store.open(Address("acme", "github", "gh-prod")).reveal() == stored


@pytest.mark.parametrize(
    ("stdin", "reason"),
    [
        (b"", "the secret is empty"),
        (b"\n", "the secret is empty"),
        (b"tok\n\n", "the secret contains LF"),
        (b"tok\r", "the secret contains CR"),
        (b"to\x00k", "the secret contains NUL"),
        (b"x" * 16385, "the secret is longer than 16384 bytes"),
        (b"x" * 100_000 + b"\n", "the secret is longer than 16384 bytes"),
    ],
)
def test_put_refuses_bad_secrets_with_exit_1(tmp_path: Path, keys: Path, stdin: bytes, reason: str) -> None:
    proc = run("custody", "put", *_opts(keys, tmp_path), *ADDR, stdin=stdin)
    assert proc.returncode == 1
    assert proc.stderr.decode().splitlines()[0].startswith(f"error: {reason}")
    assert proc.stdout == b""
    assert not (tmp_path / "custody.db").exists()  # refused before the store is touched


def test_put_accepts_exactly_16_kib_plus_newline(tmp_path: Path, keys: Path) -> None:
    assert run("custody", "put", *_opts(keys, tmp_path), *ADDR, stdin=b"x" * 16384 + b"\r\n").returncode == 0


def test_secret_cannot_be_given_as_an_argument(tmp_path: Path, keys: Path) -> None:
    proc = run("custody", "put", *_opts(keys, tmp_path), *ADDR, "--secret", "abc")
    assert proc.returncode == 2 and b"unrecognized arguments" in proc.stderr
    helptext = run("custody", "put", "--help").stdout.decode()
    assert "stdin" in helptext and "--secret" not in helptext


def test_put_needs_the_whole_address(tmp_path: Path, keys: Path) -> None:
    proc = run("custody", "put", *_opts(keys, tmp_path), "--workspace", "acme", "--handle", "h", stdin=b"v")
    assert proc.returncode == 2 and b"--connection" in proc.stderr


def test_default_store_is_custody_db_in_the_working_directory(tmp_path: Path, keys: Path) -> None:
    proc = run("custody", "put", "--keys", str(keys), *ADDR, stdin=b"v", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "custody.db").is_file()
    assert b"acme" in run("custody", "list", "--keys", str(keys), cwd=tmp_path).stdout


# -- list, delete, rotate ---------------------------------------------------------------------------


def test_list_text_and_json(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    opts = _opts(keys, tmp_path)
    assert run_here(monkeypatch, capsysbinary, "custody", "put", *opts, *ADDR, stdin=b"value-one")[0] == 0
    assert run_here(monkeypatch, capsysbinary, "custody", "put", *opts, "--workspace", "acme", "--connection", "slack", "--handle", "bot", stdin=b"v2")[0] == 0
    code, out, err = run_here(monkeypatch, capsysbinary, "custody", "list", *opts)
    assert code == 0 and err == b""
    lines = out.decode().splitlines()
    assert lines[0].split() == ["WORKSPACE", "CONNECTION", "HANDLE", "KEY", "ID", "CREATED", "UPDATED"]
    key_id = load_custody_keys(keys).active
    assert [line.split()[:4] for line in lines[1:]] == [["acme", "github", "gh-prod", key_id], ["acme", "slack", "bot", key_id]]
    code, out, _ = run_here(monkeypatch, capsysbinary, "custody", "list", *opts, "--format", "json")
    doc = json.loads(out)
    assert code == 0 and [(r["connection"], r["key_id"]) for r in doc] == [("github", key_id), ("slack", key_id)]
    assert set(doc[0]) == {"workspace", "connection", "handle", "key_id", "created", "updated"}


def test_list_of_an_empty_store(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    with CustodyStore(tmp_path / "custody.db", keys):
        pass
    code, out, err = run_here(monkeypatch, capsysbinary, "custody", "list", *_opts(keys, tmp_path))
    assert (code, out) == (0, b"") and b"no credentials in" in err


def test_list_of_a_missing_store_is_exit_2_and_creates_nothing(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    code, _, err = run_here(monkeypatch, capsysbinary, "custody", "list", *_opts(keys, tmp_path))
    assert code == 2 and f"error: custody store `{tmp_path}/custody.db` does not exist".encode() in err
    assert not (tmp_path / "custody.db").exists()


def test_not_a_store_is_exit_2(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    (tmp_path / "custody.db").write_bytes(b"garbage" * 1000)
    code, _, err = run_here(monkeypatch, capsysbinary, "custody", "list", *_opts(keys, tmp_path))
    assert code == 2 and b"is not a usable custody store" in err


def test_delete(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    opts = _opts(keys, tmp_path)
    run_here(monkeypatch, capsysbinary, "custody", "put", *opts, *ADDR, stdin=b"v")
    assert run_here(monkeypatch, capsysbinary, "custody", "delete", *opts, *ADDR) == (0, b"deleted `acme/github/gh-prod`\n", b"")
    code, out, err = run_here(monkeypatch, capsysbinary, "custody", "delete", *opts, *ADDR)
    assert (code, out) == (1, b"") and err.startswith(b"error: no credential at `acme/github/gh-prod`")


def test_rotate(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    opts = _opts(keys, tmp_path)
    run_here(monkeypatch, capsysbinary, "custody", "put", *opts, *ADDR, stdin=b"v")
    old = load_custody_keys(keys).active
    code, out, _ = run_here(monkeypatch, capsysbinary, "custody", "rotate", *opts)
    new = load_custody_keys(keys).active
    assert code == 0 and new != old
    assert out.decode() == f"re-sealed 1 record(s) under key id `{new}`; retired key ids: `{old}`\n"
    _, listed, _ = run_here(monkeypatch, capsysbinary, "custody", "list", *opts, "--format", "json")
    assert [r["key_id"] for r in json.loads(listed)] == [new]


def test_rotate_on_a_locked_keys_directory_says_so_and_exits_2(tmp_path: Path, keys: Path) -> None:
    from egress_proxy.custody.keys import locked

    opts = _opts(keys, tmp_path)
    assert run("custody", "put", *opts, *ADDR, stdin=b"v").returncode == 0
    with locked(keys):  # another rotation in flight
        proc = run("custody", "rotate", *opts, "--lock-timeout", "0.3")
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 2 and proc.stdout == b""
    assert lines[0] == f"note: waiting up to 0.3 s for the lock on keys directory `{keys}` (held by another process)"
    assert lines[1].startswith(f"error: keys directory `{keys}` is locked by another process")
    assert lines[2].startswith("help: another `egresslaw custody rotate` is running")


def test_put_into_a_write_locked_store_names_the_lock(tmp_path: Path, keys: Path) -> None:
    opts = _opts(keys, tmp_path)
    assert run("custody", "put", *opts, *ADDR, stdin=b"v").returncode == 0
    with closing(sqlite3.connect(tmp_path / "custody.db", isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        proc = run("custody", "put", *opts, *ADDR, "--lock-timeout", "0.3", stdin=b"w")
        other.execute("ROLLBACK")
    assert proc.returncode == 2
    assert proc.stderr.decode().startswith(
        f"error: custody store `{tmp_path}/custody.db` is locked by another process: its SQLite write lock was not released within 0.3 s\nhelp: "
    )


def test_rotate_with_a_tampered_record_is_exit_1_naming_it(tmp_path: Path, keys: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary) -> None:
    opts = _opts(keys, tmp_path)
    run_here(monkeypatch, capsysbinary, "custody", "put", *opts, *ADDR, stdin=b"v")
    with closing(sqlite3.connect(tmp_path / "custody.db")) as conn, conn:
        conn.execute("UPDATE records SET handle = 'stolen'")
    code, _, err = run_here(monkeypatch, capsysbinary, "custody", "rotate", *opts)
    assert code == 1 and b"rotation aborted, no record changed: 1 record(s) do not open: `acme/github/stolen`" in err


@pytest.mark.parametrize("command", [["put", *ADDR], ["list"], ["delete", *ADDR], ["rotate"]])
def test_key_file_with_mode_0644_is_exit_2_with_the_fix(tmp_path: Path, keys: Path, command: list[str]) -> None:
    os.chmod(keys / "custody.key", 0o644)
    proc = run("custody", command[0], *_opts(keys, tmp_path), *command[1:], stdin=b"v")
    assert proc.returncode == 2
    assert proc.stderr.decode() == (
        f"error: key file `{keys}/custody.key` is accessible by group or others (mode 0644)\n"
        f"help: run `chmod 600 {keys}/custody.key`\n"
    )


def test_missing_keys_directory_is_exit_2(tmp_path: Path) -> None:
    proc = run("custody", "list", "--keys", str(tmp_path / "nokeys"), "--store", str(tmp_path / "c.db"))
    assert proc.returncode == 2 and b"keys directory" in proc.stderr and b"does not exist" in proc.stderr


# -- the canary ------------------------------------------------------------------------------------------


def _scan(blobs: dict[str, bytes], canary: bytes) -> list[str]:
    return [f"{where}: {needle[:12]!r}…" for where, blob in blobs.items() for needle in encodings_of(canary) if needle in blob]


def test_the_scanner_finds_what_it_looks_for() -> None:
    canary = b"canary-" + uuid.uuid4().hex.encode()
    for form in (canary, base64.b64encode(canary), canary.hex().encode(), base64.b64encode(b"user:" + canary + b"!")):
        assert _scan({"x": b"..." + form + b"..."}, canary), form
    assert _scan({"x": b"nothing here"}, canary) == []


@pytest.mark.parametrize("mode", ["subprocess", "in-process"])
def test_canary_never_appears_anywhere(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch, capsysbinary, caplog: pytest.LogCaptureFixture) -> None:
    canary = f"canary-{uuid.uuid4().hex}{uuid.uuid4().hex}".encode()
    keys, db = tmp_path / "keys", tmp_path / "custody.db"
    opts = ["--keys", str(keys), "--store", str(db)]
    seen: dict[str, bytes] = {}
    codes: list[tuple[str, int]] = []

    def cli(name: str, *args: str, stdin: bytes = b"") -> int:
        if mode == "subprocess":
            proc = run(*args, stdin=stdin)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            code, out, err = run_here(monkeypatch, capsysbinary, *args, stdin=stdin)
        seen[f"{name} stdout"], seen[f"{name} stderr"] = out, err
        codes.append((name, code))
        return code

    def snapshot(when: str) -> None:
        # Read from a child process: closing any descriptor of custody.db in this process would drop
        # the POSIX locks our open SQLite connection holds (SQLite's documented hazard).
        for path in tmp_path.rglob("*"):
            if path.is_file():
                seen[f"{when}: file {path.relative_to(tmp_path)}"] = subprocess.run(["cat", str(path)], capture_output=True, check=True).stdout

    caplog.set_level(logging.DEBUG)
    assert cli("keys init", "keys", "init", "--dir", str(keys)) == 0
    assert cli("put", "custody", "put", *opts, *ADDR, stdin=canary + b"\n") == 0
    assert cli("put again (CRLF)", "custody", "put", *opts, *ADDR, stdin=canary + b"\r\n") == 0
    assert cli("put other", "custody", "put", *opts, "--workspace", "acme", "--connection", "other", "--handle", "h", stdin=b"not-the-canary") == 0
    reader = sqlite3.connect(db)  # an open connection keeps -wal and -shm on disk for the scan
    reader.execute("SELECT count(*) FROM records").fetchone()
    with CustodyStore(db, keys) as store:  # positive control: the canary really is in there, sealed
        assert store.open(Address("acme", "github", "gh-prod")).reveal() == canary
    assert cli("list", "custody", "list", *opts) == 0
    assert cli("list json", "custody", "list", *opts, "--format", "json") == 0
    snapshot("after put")
    # every refusal, each with the canary in the input
    assert cli("put LF", "custody", "put", *opts, *ADDR, stdin=canary + b"\n" + canary) == 1
    assert cli("put CR", "custody", "put", *opts, *ADDR, stdin=canary + b"\r" + canary) == 1
    assert cli("put NUL", "custody", "put", *opts, *ADDR, stdin=canary + b"\x00") == 1
    assert cli("put too long", "custody", "put", *opts, *ADDR, stdin=canary * (16384 // len(canary) + 1)) == 1
    assert cli("put empty", "custody", "put", *opts, *ADDR, stdin=b"") == 1
    assert cli("put bad handle", "custody", "put", *opts, "--workspace", "acme", "--connection", "c", "--handle", "h\x01" + canary.decode(), stdin=canary) == 1
    assert cli("put no keys", "custody", "put", "--keys", str(tmp_path / "none"), "--store", str(db), *ADDR, stdin=canary) == 2
    os.chmod(keys / "custody.key", 0o644)
    assert cli("put 0644", "custody", "put", *opts, *ADDR, stdin=canary) == 2
    assert cli("list 0644", "custody", "list", *opts) == 2
    assert cli("rotate 0644", "custody", "rotate", *opts) == 2
    os.chmod(keys / "custody.key", 0o600)
    assert cli("delete missing", "custody", "delete", *opts, "--workspace", "acme", "--connection", "nope", "--handle", "h") == 1
    assert cli("list missing store", "custody", "list", "--keys", str(keys), "--store", str(tmp_path / "missing.db")) == 2
    assert cli("keys init again", "keys", "init", "--dir", str(keys)) == 2
    with closing(sqlite3.connect(db)) as conn, conn:  # tamper: move the canary's record, then try to use it
        conn.execute("UPDATE records SET connection = 'moved' WHERE connection = 'github'")
    assert cli("rotate tampered", "custody", "rotate", *opts) == 1
    with CustodyStore(db, keys) as store, pytest.raises(CustodyError) as info:
        store.open(Address("acme", "moved", "gh-prod"))
    seen["open tampered: exception"] = f"{info.value} {info.value!r} {info.value.help}".encode()
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE records SET connection = 'github' WHERE connection = 'moved'")
    snapshot("after errors")
    assert cli("rotate", "custody", "rotate", *opts) == 0
    with CustodyStore(db, keys) as store:
        secret = store.open(Address("acme", "github", "gh-prod"))
        assert secret.reveal() == canary  # still the canary after rotation (positive control)
        seen["secret renderings"] = f"{secret} {secret!r} {[secret]} {secret:>10}".encode()
        logging.getLogger("egresslaw.canary").warning("opened %s %r", secret, secret)
    assert cli("list after rotate", "custody", "list", *opts) == 0
    snapshot("after rotate")
    assert cli("delete", "custody", "delete", *opts, *ADDR) == 0
    snapshot("after delete")
    reader.close()
    snapshot("after close")
    seen["logs"] = caplog.text.encode()
    assert len(codes) == 23 and len(seen) > 50
    assert {"after put: file custody.db-wal", "after put: file custody.db-shm", "after rotate: file custody.db-wal"} <= set(seen)
    assert _scan(seen, canary) == []
