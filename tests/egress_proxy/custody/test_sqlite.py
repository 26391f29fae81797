"""The sealed store: round trips, tamper evidence, keys, rotation and its crash safety, concurrency."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egress_proxy.custody import keys as keyfiles
from egress_proxy.custody.keys import (
    CustodyKey,
    KeyFileError,
    init_keys,
    load_custody_keys,
)
from egress_proxy.custody.records import (
    MAX_SECRET_BYTES,
    Address,
    CredentialSource,
    CustodyError,
    associated_data,
    check_secret,
)
from egress_proxy.custody.secret import Secret, encodings_of
from egress_proxy.custody.sqlite import CustodyStore

ROOT = Path(__file__).resolve().parents[3]
A = Address("acme", "github", "gh-prod")
VALUE = b"ghp_0123456789abcdefCANARYvalue"


@contextmanager
def _raw(db: Path) -> Iterator[sqlite3.Connection]:
    """A second, plain SQLite connection for tampering (autocommit), closed afterwards."""
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def _key_ids(db: Path) -> set[str]:
    with _raw(db) as conn:
        return {r[0] for r in conn.execute("SELECT key_id FROM records")}


def _assert_clean(message: str, *values: bytes) -> None:
    for value in values:
        for needle in encodings_of(value):
            assert needle.decode("latin-1") not in message, "a secret leaked into a message"


# -- round trip -------------------------------------------------------------------------------


def test_round_trip_and_list(store: CustodyStore) -> None:
    other = Address("acme", "slack", "xoxb-handle")
    r1 = store.put(A, VALUE)
    store.put(other, b"second")
    assert store.open(A).reveal() == VALUE
    assert store.open(other).reveal() == b"second"
    assert isinstance(store.open(A), Secret)
    listed = store.list()
    assert [r.address for r in listed] == [A, other]
    assert listed[0].key_id == r1.key_id == load_custody_keys(store.keys_dir).active
    assert listed[0].created.endswith("Z") and listed[0].version == 1
    _assert_clean(repr(listed), VALUE, b"second")


def test_put_replaces_and_keeps_created(store: CustodyStore) -> None:
    first = store.put(A, VALUE)
    second = store.put(A, b"rotated-value")
    assert store.open(A).reveal() == b"rotated-value"
    assert second.created == first.created
    assert len(store.list()) == 1


def test_put_accepts_a_secret_object(store: CustodyStore) -> None:
    store.put(A, Secret(VALUE))
    assert store.open(A) == Secret(VALUE)


def test_missing_record(store: CustodyStore) -> None:
    with pytest.raises(CustodyError, match=r"no credential at `acme/github/gh-prod`"):
        store.open(A)
    with pytest.raises(CustodyError, match="no credential at"):
        store.delete(A)


def test_delete(store: CustodyStore) -> None:
    store.put(A, VALUE)
    store.delete(A)
    assert store.list() == ()
    with pytest.raises(CustodyError):
        store.open(A)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=st.binary(min_size=1, max_size=300).filter(lambda b: not set(b) & {0, 10, 13}),
    name=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FFF, exclude_categories=("Cs", "Cc")), min_size=1, max_size=20).filter(
        lambda s: s == s.strip()
    ),
)
def test_round_trip_property(store: CustodyStore, value: bytes, name: str) -> None:
    address = Address("ws", name, "h")
    store.put(address, value)
    assert store.open(address).reveal() == value


# -- refused secrets and names ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "empty"),
        (VALUE + b"\r", "CR"),
        (VALUE + b"\nX-Injected: 1", "LF"),
        (VALUE + b"\x00", "NUL"),
        (b"x" * (MAX_SECRET_BYTES + 1), "longer than 16384 bytes"),
    ],
)
def test_refused_secrets(store: CustodyStore, value: bytes, reason: str) -> None:
    with pytest.raises(CustodyError, match=reason) as info:
        store.put(A, value)
    _assert_clean(str(info.value) + repr(info.value) + str(info.value.help), VALUE)
    assert store.list() == ()


def test_largest_secret_is_accepted(store: CustodyStore) -> None:
    store.put(A, b"y" * MAX_SECRET_BYTES)
    assert len(store.open(A).reveal()) == MAX_SECRET_BYTES
    assert check_secret(b"ok") == b"ok"


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        (("", "c", "h"), "workspace is empty"),
        (("w", "c\x01" + VALUE.decode(), "h"), "connection contains a control character"),
        (("w", "c", "h\x7f"), "handle contains a control character"),
        (("w", " c", "h"), "leading or trailing whitespace"),
        (("w", "c", "h" * 300), "longer than 256 bytes"),
    ],
)
def test_refused_addresses_are_not_echoed(parts: tuple[str, str, str], reason: str) -> None:
    with pytest.raises(CustodyError, match=reason) as info:
        Address(*parts)
    _assert_clean(str(info.value), VALUE)


def test_associated_data_is_unambiguous() -> None:
    assert associated_data(Address("a", "bc", "d"), "ck-1") != associated_data(Address("ab", "c", "d"), "ck-1")
    assert associated_data(A, "ck-1") != associated_data(A, "ck-2")
    assert associated_data(A, "ck-1", 1) != associated_data(A, "ck-1", 2)


# -- tamper evidence ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "value", "moved_to"),
    [
        ("connection", "slack", Address("acme", "slack", "gh-prod")),
        ("workspace", "evil", Address("evil", "github", "gh-prod")),
        ("handle", "gh-dev", Address("acme", "github", "gh-dev")),
    ],
)
def test_moved_record_fails_to_open(store: CustodyStore, column: str, value: str, moved_to: Address) -> None:
    store.put(A, VALUE)
    with _raw(store.path) as conn:
        conn.execute(f"UPDATE records SET {column} = ?", (value,))
    with pytest.raises(CustodyError, match=f"record `{moved_to}` does not open: authentication failed") as info:
        store.open(moved_to)
    _assert_clean(str(info.value) + str(info.value.help), VALUE)


def test_copied_record_fails_and_original_still_opens(store: CustodyStore) -> None:
    store.put(A, VALUE)
    with _raw(store.path) as conn:
        conn.execute(
            "INSERT INTO records SELECT workspace, 'attacker', handle, version, key_id, nonce, sealed, created, updated FROM records"
        )
    with pytest.raises(CustodyError, match="record `acme/attacker/gh-prod` does not open"):
        store.open(Address("acme", "attacker", "gh-prod"))
    assert store.open(A).reveal() == VALUE


def test_swapped_ciphertexts_fail(store: CustodyStore) -> None:
    b = Address("acme", "github", "gh-other")
    store.put(A, VALUE)
    store.put(b, b"other-value")
    with _raw(store.path) as conn:
        (na, sa), (nb, sb) = conn.execute("SELECT nonce, sealed FROM records ORDER BY handle DESC").fetchall()
        conn.execute("UPDATE records SET nonce = ?, sealed = ? WHERE handle = 'gh-prod'", (nb, sb))
        conn.execute("UPDATE records SET nonce = ?, sealed = ? WHERE handle = 'gh-other'", (na, sa))
    for address in (A, b):
        with pytest.raises(CustodyError, match="authentication failed"):
            store.open(address)


@pytest.mark.parametrize(
    ("column", "where"),
    [("nonce", 0), ("nonce", 11), ("sealed", 0), ("sealed", len(VALUE) - 1), ("sealed", len(VALUE)), ("sealed", len(VALUE) + 15)],
    ids=["nonce-first", "nonce-last", "ciphertext-first", "ciphertext-last", "tag-first", "tag-last"],
)
def test_flipped_byte_fails(store: CustodyStore, column: str, where: int) -> None:
    store.put(A, VALUE)
    with _raw(store.path) as conn:
        (blob,) = conn.execute(f"SELECT {column} FROM records").fetchone()
        assert len(conn.execute("SELECT sealed FROM records").fetchone()[0]) == len(VALUE) + 16  # ciphertext || tag
        edited = bytearray(blob)
        edited[where] ^= 0x01
        conn.execute(f"UPDATE records SET {column} = ?", (bytes(edited),))
    with pytest.raises(CustodyError, match=r"record `acme/github/gh-prod` does not open: authentication failed") as info:
        store.open(A)
    _assert_clean(str(info.value), VALUE)


def test_a_record_opened_before_is_read_again_on_every_open(store: CustodyStore) -> None:
    """The store keeps what it opened (one decryption per row), but reads the row every time: an edit, a re-seal and
    a delete by another connection are seen by the very next open."""
    store.put(A, VALUE)
    first = store.open(A)
    assert store.open(A) is first and first.needles() is first.needles()
    with _raw(store.path) as conn:
        (blob,) = conn.execute("SELECT sealed FROM records").fetchone()
        conn.execute("UPDATE records SET sealed = ?", (bytes([blob[0] ^ 1]) + blob[1:],))
    with pytest.raises(CustodyError, match="authentication failed"):
        store.open(A)
    with CustodyStore(store.path, store.keys_dir) as other:
        other.put(A, b"another-value")
    assert store.open(A).reveal() == b"another-value"
    with CustodyStore(store.path, store.keys_dir) as other:
        other.delete(A)
    with pytest.raises(CustodyError, match="no credential"):
        store.open(A)
    assert "OpenedRecords(0 of" in repr(store._opened)


def test_truncated_nonce_and_edited_version_fail(store: CustodyStore) -> None:
    store.put(A, VALUE)
    with _raw(store.path) as conn:
        conn.execute("UPDATE records SET nonce = substr(nonce, 1, 8)")
    with pytest.raises(CustodyError, match="nonce has been altered"):
        store.open(A)
    store.put(A, VALUE)
    with _raw(store.path) as conn:
        conn.execute("UPDATE records SET version = 2")
    with pytest.raises(CustodyError, match="unsupported format version `2`"):
        store.open(A)


def test_wrong_key_with_the_same_id_fails(store: CustodyStore, keys: Path) -> None:
    store.put(A, VALUE)
    ring = load_custody_keys(keys)
    (key,) = ring.keys()
    (keys / "custody.key").unlink()
    keyfiles.write_custody_keys(keys, [CustodyKey(key.id, key.created, os.urandom(32))], active=key.id)
    with CustodyStore(store.path, keys) as fresh, pytest.raises(CustodyError, match="authentication failed"):
        fresh.open(A)


def test_key_from_another_keys_directory_fails(store: CustodyStore, tmp_path: Path) -> None:
    store.put(A, VALUE)
    other = tmp_path / "other-keys"
    init_keys(other)
    with CustodyStore(store.path, other) as foreign:
        with pytest.raises(CustodyError, match=r"sealed under key id `ck-[0-9a-f-]+`, which is not in") as info:
            foreign.open(A)
        assert "acme/github/gh-prod" in str(info.value)
        with pytest.raises(CustodyError, match="the store seals under key id") as info:
            foreign.put(Address("acme", "x", "y"), b"v")
        assert info.value.io


def test_edited_key_id_column_fails(store: CustodyStore, keys: Path) -> None:
    store.put(A, VALUE)
    old = next(iter(_key_ids(store.path)))
    store.put(Address("acme", "b", "c"), b"v")
    ring = load_custody_keys(keys)
    extra = CustodyKey("ck-20260101-deadbeef", "2026-01-01T00:00:00Z", ring.material(old))  # same bytes, new id
    keyfiles.write_custody_keys(keys, [*ring.keys(), extra], active=ring.active)
    with _raw(store.path) as conn:
        conn.execute("UPDATE records SET key_id = ? WHERE handle = 'gh-prod'", (extra.id,))
    with pytest.raises(CustodyError, match="authentication failed"):
        store.open(A)


# -- keys --------------------------------------------------------------------------------------------


# -- the store file ---------------------------------------------------------------------------------


def test_store_file_is_private_wal_and_holds_no_plaintext(store: CustodyStore) -> None:
    store.put(A, VALUE)
    assert store.path.stat().st_mode & 0o777 == 0o600
    with _raw(store.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    blob = b"".join(p.read_bytes() for p in store.path.parent.glob("custody.db*"))
    assert not [n for n in encodings_of(VALUE) if n in blob]


def test_not_a_store(tmp_path: Path, keys: Path) -> None:
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CustodyError, match="is not a usable custody store") as info:
        CustodyStore(tmp_path / "junk.db", keys)
    assert info.value.io
    with _raw(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) STRICT")
        conn.execute("INSERT INTO meta VALUES ('format', 'something-else/9')")
    with pytest.raises(CustodyError, match="unsupported format `something-else/9`"):
        CustodyStore(tmp_path / "other.db", keys)


def test_missing_store_without_create(tmp_path: Path, keys: Path) -> None:
    with pytest.raises(CustodyError, match="does not exist") as info:
        CustodyStore(tmp_path / "absent.db", keys, create=False)
    assert info.value.io and not (tmp_path / "absent.db").exists()


def test_store_satisfies_the_backend_protocol(store: CustodyStore) -> None:
    class Vault:
        """A second backend needs only `open`: this is the whole contract the proxy relies on."""

        def open(self, address: Address) -> Secret:
            raise CustodyError(f"no credential at `{address}`")

    assert isinstance(store, CredentialSource)
    assert isinstance(Vault(), CredentialSource)
    assert not isinstance(object(), CredentialSource)


# -- rotation -----------------------------------------------------------------------------------------


def _fill(store: CustodyStore, n: int = 5) -> dict[Address, bytes]:
    values = {Address("acme", f"conn{i}", f"h{i}"): f"value-{i}-{os.urandom(4).hex()}".encode() for i in range(n)}
    for address, value in values.items():
        store.put(address, value)
    return values


def test_rotation_reseals_everything_and_retires_the_old_key(store: CustodyStore, keys: Path) -> None:
    values = _fill(store)
    old = load_custody_keys(keys).active
    result = store.rotate()
    assert result.resealed == len(values) and result.retired == (old,) and result.key_id != old
    assert _key_ids(store.path) == {result.key_id}
    assert load_custody_keys(keys).ids == (result.key_id,)
    for address, value in values.items():
        assert store.open(address).reveal() == value
    with CustodyStore(store.path, keys) as fresh:  # a new process sees the same
        assert all(fresh.open(a).reveal() == v for a, v in values.items())
    assert store.put(Address("acme", "new", "h"), b"n").key_id == result.key_id
    second = store.rotate()
    assert second.retired == (result.key_id,) and _key_ids(store.path) == {second.key_id}


def test_rotation_erases_old_ciphertext_from_the_files(store: CustodyStore) -> None:
    store.put(A, VALUE)
    with _raw(store.path) as conn:
        (old_sealed,) = conn.execute("SELECT sealed FROM records").fetchone()
    store.rotate()
    blob = b"".join(p.read_bytes() for p in store.path.parent.glob("custody.db*"))
    assert old_sealed not in blob  # secure_delete + checkpoint: nothing left under the retired key


def test_delete_erases_the_ciphertext_from_the_files(store: CustodyStore) -> None:
    store.put(A, VALUE)
    store.put(Address("acme", "keep", "h"), b"kept")
    with _raw(store.path) as conn:
        (sealed,) = conn.execute("SELECT sealed FROM records WHERE handle = 'gh-prod'").fetchone()
    store.delete(A)
    blob = b"".join(p.read_bytes() for p in store.path.parent.glob("custody.db*"))
    assert sealed not in blob  # secure_delete zeroes the freed cell; the checkpoint empties the WAL


def test_rotation_of_an_empty_store(store: CustodyStore, keys: Path) -> None:
    result = store.rotate()
    assert result.resealed == 0 and load_custody_keys(keys).ids == (result.key_id,)


def test_rotation_with_a_broken_record_changes_nothing(store: CustodyStore, keys: Path) -> None:
    values = _fill(store, 3)
    before_ids = _key_ids(store.path)
    with _raw(store.path) as conn:
        conn.execute("UPDATE records SET connection = 'moved' WHERE handle = 'h1'")
    with pytest.raises(CustodyError, match=r"rotation aborted, no record changed: 1 record\(s\) do not open: `acme/moved/h1`"):
        store.rotate()
    assert _key_ids(store.path) == before_ids
    for address, value in values.items():
        if address.handle != "h1":
            assert store.open(address).reveal() == value


def test_a_stale_process_follows_a_rotation(tmp_path: Path, keys: Path) -> None:
    with CustodyStore(tmp_path / "c.db", keys) as a, CustodyStore(tmp_path / "c.db", keys) as b:
        a.put(A, VALUE)
        rotated = b.rotate()
        assert a.open(A).reveal() == VALUE  # re-reads custody.key for the unknown key id
        assert a.put(Address("acme", "x", "y"), b"v").key_id == rotated.key_id  # never seals under a retired key
    assert _key_ids(tmp_path / "c.db") == {rotated.key_id}


CRASH = textwrap.dedent(
    """
    import os, sys
    from egress_proxy.custody import keys, sqlite as custody
    where, db, keydir = sys.argv[1], sys.argv[2], sys.argv[3]
    if where == "mid-reseal":
        real, calls = custody.seal, []
        def seal(*a):
            calls.append(1)
            if len(calls) == 3:
                os._exit(9)  # die with two records re-sealed but not committed
            return real(*a)
        custody.seal = seal
    elif where == "after-commit":
        real_write, calls = keys.write_custody_keys, []
        def write(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                os._exit(9)  # die after COMMIT, before old keys are removed
            return real_write(*a, **k)
        keys.write_custody_keys = write
    elif where == "before-reseal":
        custody.CustodyStore._reseal_all = lambda self, new: os._exit(9)
    custody.CustodyStore(db, keydir).rotate()
    """
)


@pytest.mark.parametrize("where", ["before-reseal", "mid-reseal", "after-commit"])
def test_crash_mid_rotation_leaves_every_record_readable(tmp_path: Path, keys: Path, where: str) -> None:
    db = tmp_path / "c.db"
    with CustodyStore(db, keys) as store:
        values = _fill(store, 5)
    old = load_custody_keys(keys).active
    proc = subprocess.run([sys.executable, "-c", CRASH, where, str(db), str(keys)], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == 9, proc.stderr.decode()
    ids_after_crash = load_custody_keys(keys).ids
    assert old in ids_after_crash and len(ids_after_crash) == 2  # the new key was written before any record used it
    with CustodyStore(db, keys) as store:
        for address, value in values.items():
            assert store.open(address).reveal() == value
        used = _key_ids(db)
        assert len(used) == 1 and (used == {old}) == (where != "after-commit")
        result = store.rotate()  # and the next rotation cleans up
        assert _key_ids(db) == {result.key_id}
        assert load_custody_keys(keys).ids == (result.key_id,)
        assert all(store.open(a).reveal() == v for a, v in values.items())


# -- concurrency ---------------------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys
    from egress_proxy.custody.records import Address
    from egress_proxy.custody.sqlite import CustodyStore
    tag, db, keydir, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with CustodyStore(db, keydir) as store:
        for i in range(n):
            store.put(Address("acme", tag, f"h{i}"), f"{tag}-{i}".encode())
            store.put(Address("acme", "shared", "h"), f"{tag}-{i}".encode())
    """
)


def test_concurrent_puts_from_two_processes_lose_nothing(tmp_path: Path, keys: Path) -> None:
    db, n = tmp_path / "c.db", 150
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, tag, str(db), str(keys), str(n)], cwd=ROOT, stderr=subprocess.PIPE)
        for tag in ("one", "two")
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.decode()
    with CustodyStore(db, keys) as store:
        records = store.list()
        assert len(records) == 2 * n + 1
        for tag in ("one", "two"):
            for i in range(n):
                assert store.open(Address("acme", tag, f"h{i}")).reveal() == f"{tag}-{i}".encode()
        assert store.open(Address("acme", "shared", "h")).reveal() in {f"one-{n - 1}".encode(), f"two-{n - 1}".encode()}


# Each child opens a fresh store per round, all children released at the same instant by a gate
# (a file the parent holds an exclusive flock on; children wait on a shared one).
OPENER = textwrap.dedent(
    """
    import fcntl, os, sys
    from egress_proxy.custody.records import Address, CustodyError
    from egress_proxy.custody.sqlite import CustodyStore
    base, keydir, ident, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    for i in range(rounds):
        print(f"ready {i}", flush=True)
        fd = os.open(os.path.join(base, f"gate-{i}"), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.close(fd)
        try:
            with CustodyStore(os.path.join(base, f"store-{i}.db"), keydir) as store:
                store.put(Address("acme", "c", ident), ident.encode())
        except CustodyError as exc:
            print(f"failed {i}: {exc.message}", flush=True)
    print("done", flush=True)
    """
)


def test_many_processes_opening_a_new_store_at_once_all_succeed(tmp_path: Path, keys: Path) -> None:
    # The race behind the once-flaky test above: the first opens of a new store contend for the switch
    # to WAL, which SQLite can refuse with BUSY without calling the busy handler. Before the fix, 8
    # processes x 8 rounds failed in most rounds; now every open queues and succeeds.
    import fcntl

    children, rounds = 8, 8
    gates = []
    for i in range(rounds):
        fd = os.open(tmp_path / f"gate-{i}", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        gates.append(fd)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(tmp_path), str(keys), f"p{k}", str(rounds)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in range(children)
    ]
    failures: list[str] = []
    try:
        for i in range(rounds):
            for proc in procs:
                line = proc.stdout.readline()
                while line.startswith("failed"):
                    failures.append(line.strip())
                    line = proc.stdout.readline()
                assert line == f"ready {i}\n", line + proc.stderr.read()
            os.close(gates[i])  # release every child at once
        for proc in procs:
            rest, stderr = proc.communicate(timeout=120)
            failures += [line for line in rest.splitlines() if line.startswith("failed")]
            assert proc.returncode == 0 and rest.endswith("done\n"), stderr
    finally:
        for proc in procs:
            proc.kill()
    assert failures == []
    for i in range(rounds):
        with CustodyStore(tmp_path / f"store-{i}.db", keys) as store:
            assert [r.address.handle for r in store.list()] == sorted(f"p{k}" for k in range(children))


def test_a_store_held_locked_is_reported_as_locked_within_the_bound(store: CustodyStore) -> None:
    store.put(A, VALUE)
    with _raw(store.path) as other:
        other.execute("BEGIN IMMEDIATE")  # another writer that does not let go
        try:
            # opening needs no write lock: an initialized store opens with reads only
            with CustodyStore(store.path, store.keys_dir, lock_timeout=0.2) as second:
                assert second.open(A).reveal() == VALUE
                with pytest.raises(CustodyError) as info:
                    second.put(Address("acme", "x", "y"), b"v")
        finally:
            other.execute("ROLLBACK")
    message = str(info.value)
    assert message == f"custody store `{store.path}` is locked by another process: its SQLite write lock was not released within 0.2 s"
    assert info.value.io and "--lock-timeout" in info.value.help and "unusable" not in message


def test_a_held_open_lock_is_named(tmp_path: Path, keys: Path) -> None:
    import fcntl

    db = tmp_path / "c.db"
    fd = os.open(tmp_path / "c.db.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process stuck while opening the store
    try:
        with pytest.raises(CustodyError) as info:
            CustodyStore(db, keys, lock_timeout=0.2)
    finally:
        os.close(fd)
    assert str(info.value) == (
        f"the open lock `{tmp_path / 'c.db.lock'}` of custody store `{db}` is held by another process; not released within 0.2 s"
    )
    with CustodyStore(db, keys, lock_timeout=0.2) as store:  # released: opens at once
        store.put(A, VALUE)


def test_rotation_on_a_locked_keys_directory_says_so_and_gives_up(store: CustodyStore, keys: Path) -> None:
    store.put(A, VALUE)
    before = (keys / "custody.key").read_bytes()
    waits: list[str] = []
    store.lock_timeout = 0.2
    with keyfiles.locked(keys):  # another rotation in flight (a separate open file: flock conflicts)
        with pytest.raises(KeyFileError) as info:
            store.rotate(on_wait=waits.append)
    assert waits == [f"waiting up to 0.2 s for the lock on keys directory `{keys}` (held by another process)"]
    assert str(info.value).startswith(f"keys directory `{keys}` is locked by another process")
    assert "custody rotate" in info.value.help
    assert (keys / "custody.key").read_bytes() == before and store.open(A).reveal() == VALUE
    assert store.rotate().resealed == 1  # and once it is free, rotation works


def test_the_mint_lock_is_held_across_processes(tmp_path):
    """`try_mint_lock`: another process holding a credential's mint lock makes it None here until that process lets go;
    another credential's lock is free meanwhile (a byte each)."""
    import subprocess
    import sys
    import textwrap

    from egress_proxy.custody.keys import init_keys
    from egress_proxy.custody.records import Address
    from egress_proxy.custody.sqlite import CustodyStore

    keys = tmp_path / "keys"
    init_keys(keys)
    store = CustodyStore(tmp_path / "custody.db", keys)
    held, other = Address("acme", "drive", "h"), Address("acme", "other", "h")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from egress_proxy.custody.records import Address
        from egress_proxy.custody.sqlite import CustodyStore
        store = CustodyStore({str(tmp_path / "custody.db")!r}, {str(keys)!r}, create=False)
        assert store.try_mint_lock(Address("acme", "drive", "h")) is not None
        print("held", flush=True)
        sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert store.try_mint_lock(held) is None
        release = store.try_mint_lock(other)
        assert release is not None
        release()
    finally:
        child.communicate("\n", timeout=30)
    release = store.try_mint_lock(held)
    assert release is not None
    release()
