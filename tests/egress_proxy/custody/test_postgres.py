"""The PostgreSQL custody store against a real PostgreSQL server (tests/pg_server.py), and the real
proxy serving from it: sealed rows bound to their address, a put in one process opened in another,
a rotation by another process seen by a long-lived one, rotation in one transaction, and with the
database stopped every credentialed request denied `custody-unavailable` with zero upstream bytes,
until the database is back and serving resumes by itself. The canary never appears in the rows,
the cluster's files (heap, WAL), the server's statement log, the proxy's logs or any output.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from egress_proxy.custody.keys import init_keys, load_custody_keys
from egress_proxy.custody.postgres import META, RECORDS, PostgresCustodyStore
from egress_proxy.custody.records import (
    Address,
    CustodyError,
    CustodyUnavailable,
    shown,
)
from egress_proxy.custody.secret import Secret
from egress_proxy.custody.stores import open_store
from tests.conformance.wire import open_socket, read_answer, tls_client
from tests.pg_server import PgServer
from tests.proxy_harness import (
    CANARY,
    HOSTS,
    WORKSPACE,
    assert_no_canary,
    free_port,
    make_env,
    start_proxy,
    stop_proxy,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
GH = Address(WORKSPACE, "github", "gh-prod")
PASSWORD = "pw-Hunter2-notshown"  # trust auth ignores it; it must never be shown either


@pytest.fixture(scope="module")
def pg():
    server = PgServer()
    server.start()
    yield server
    server.destroy()


@pytest.fixture
def url(pg) -> str:
    return pg.create_database()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    init_keys(tmp_path / "keys")
    return tmp_path / "keys"


@pytest.fixture
def store(url, keys):
    with PostgresCustodyStore(url, keys) as s:
        yield s


def cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "egresslaw", *args], input=stdin, capture_output=True, cwd=ROOT, timeout=120)


def raw(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True)


def wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# --- the store ---------------------------------------------------------------------------------


def test_put_by_one_process_opens_in_another(url, keys):
    put = cli("custody", "put", "--keys", str(keys), "--store", url, "--workspace", WORKSPACE, "--connection", "github",
              "--handle", "gh-prod", stdin=CANARY.encode() + b"\n")
    assert put.returncode == 0, put.stderr
    assert_no_canary(put.stdout + put.stderr, "custody put output")
    with open_store(url, keys, create=False) as s:
        secret = s.open(GH)
        assert isinstance(secret, Secret) and secret.reveal() == CANARY.encode()
        assert CANARY not in repr(secret) and CANARY not in f"{secret}"
    listed = cli("custody", "list", "--keys", str(keys), "--store", url, "--format", "json")
    assert listed.returncode == 0, listed.stderr
    (record,) = json.loads(listed.stdout)
    assert (record["workspace"], record["connection"], record["handle"]) == (WORKSPACE, "github", "gh-prod")
    assert_no_canary(listed.stdout + listed.stderr, "custody list output")


def test_round_trip_replace_list_delete(store):
    first = store.put(GH, b"one")
    again = store.put(GH, Secret(b"two"))
    assert store.open(GH).reveal() == b"two" and again.created == first.created
    other = Address(WORKSPACE, "github", "other")
    store.put(other, b"three")
    assert [r.address for r in store.list()] == [GH, other]
    store.delete(other)
    with pytest.raises(CustodyError, match="no credential at"):
        store.open(other)
    with pytest.raises(CustodyError, match="no credential at"):
        store.delete(other)
    with pytest.raises(CustodyError, match="contains LF"):
        store.put(GH, b"a\nb")


@pytest.mark.parametrize(
    ("edit", "params"),
    [
        (f"UPDATE {RECORDS} SET handle = 'moved'", ()),  # moved to another address
        (f"UPDATE {RECORDS} SET sealed = set_byte(sealed, 0, get_byte(sealed, 0) # 1)", ()),  # flipped ciphertext bit
        (f"UPDATE {RECORDS} SET nonce = set_byte(nonce, 3, get_byte(nonce, 3) # 128)", ()),  # flipped nonce bit
        (f"UPDATE {RECORDS} SET key_id = 'ck-20000101-deadbeef'", ()),  # key id column edited
        (f"UPDATE {RECORDS} SET version = 2", ()),  # format version column edited
    ],
)
def test_sealed_rows_are_bound_to_their_address_and_key(store, url, edit, params):
    store.put(GH, CANARY.encode())
    with raw(url) as conn:
        conn.execute(edit, params)
    target = Address(WORKSPACE, "github", "moved") if "moved" in edit else GH
    with pytest.raises(CustodyError) as info:
        store.open(target)
    assert any(m in info.value.message for m in ("does not open", "is not in", "unsupported format version")), info.value.message
    assert CANARY not in str(info.value) and CANARY not in (info.value.help or "")


def test_rows_hold_only_ciphertext(store, url):
    store.put(GH, CANARY.encode())
    with raw(url) as conn:
        rows = conn.execute(f"SELECT * FROM {RECORDS}").fetchall() + conn.execute(f"SELECT * FROM {META}").fetchall()
    assert_no_canary(repr(rows).encode() + b"".join(v for row in rows for v in row if isinstance(v, bytes)), "the database rows")


def test_rotation_by_another_process_is_seen_by_a_long_lived_store(store, url, keys):
    addresses = [Address(WORKSPACE, "github", f"h{i}") for i in range(5)]
    for i, address in enumerate(addresses):
        store.put(address, f"secret-{i}".encode())
    old = {r.key_id for r in store.list()}
    rotated = cli("custody", "rotate", "--keys", str(keys), "--store", url)
    assert rotated.returncode == 0, rotated.stderr
    new = {r.key_id for r in store.list()}
    assert new != old and len(new) == 1
    assert [store.open(a).reveal() for a in addresses] == [f"secret-{i}".encode() for i in range(5)]
    assert store.put(Address(WORKSPACE, "github", "later"), b"after").key_id in new  # seals under the store's new key
    assert [k.id for k in load_custody_keys(keys).keys()] == sorted(new)  # the old key id is retired


def test_rotation_is_one_transaction(store, url, keys):
    for i in range(3):
        store.put(Address(WORKSPACE, "github", f"h{i}"), b"value")
    with raw(url) as conn:
        conn.execute(f"UPDATE {RECORDS} SET sealed = set_byte(sealed, 0, get_byte(sealed, 0) # 1) WHERE handle = 'h2'")
        before = conn.execute(f"SELECT handle, key_id, nonce, sealed FROM {RECORDS} ORDER BY handle").fetchall()
        seal_before = conn.execute(f"SELECT value FROM {META} WHERE name = 'seal_key_id'").fetchone()
    with pytest.raises(CustodyError, match="rotation aborted, no record changed: 1 record"):
        store.rotate()
    with raw(url) as conn:
        assert conn.execute(f"SELECT handle, key_id, nonce, sealed FROM {RECORDS} ORDER BY handle").fetchall() == before
        assert conn.execute(f"SELECT value FROM {META} WHERE name = 'seal_key_id'").fetchone() == seal_before
    assert store.open(Address(WORKSPACE, "github", "h0")).reveal() == b"value"


def test_a_database_without_a_store_is_refused_and_put_creates_it(url, keys):
    with pytest.raises(CustodyError, match="holds no custody store") as info:
        PostgresCustodyStore(url, keys, create=False)
    assert info.value.io
    listed = cli("custody", "list", "--keys", str(keys), "--store", url)
    assert listed.returncode == 2 and b"holds no custody store" in listed.stderr
    with PostgresCustodyStore(url, keys, create=True) as s:
        assert s.list() == ()
    with raw(url) as conn:
        conn.execute(f"UPDATE {META} SET value = 'someone-else/9' WHERE name = 'format'")
    with pytest.raises(CustodyError, match="unsupported format"):
        PostgresCustodyStore(url, keys, create=False)


def test_unreachable_at_start_is_an_io_error_that_never_shows_the_password(tmp_path, keys):
    nowhere = f"postgresql://egresslaw:{PASSWORD}@/postgres?host={tmp_path}&connect_timeout=2"
    with pytest.raises(CustodyError) as info:
        open_store(nowhere, keys, create=False)
    assert info.value.io and "cannot reach custody database" in info.value.message
    assert PASSWORD not in str(info.value) + (info.value.help or "")
    listed = cli("custody", "list", "--keys", str(keys), "--store", nowhere)
    assert listed.returncode == 2 and b"cannot reach custody database" in listed.stderr
    assert PASSWORD.encode() not in listed.stdout + listed.stderr
    assert PASSWORD not in shown(nowhere) and PASSWORD not in shown(f"postgresql:///db?password={PASSWORD}")


def test_repr_never_shows_the_password(pg, keys):
    url = pg.create_database().replace("egresslaw@", f"egresslaw:{PASSWORD}@")
    with PostgresCustodyStore(url, keys) as s:
        assert PASSWORD not in repr(s) and "***" in repr(s)


def test_outage_fails_closed_and_recovers_by_itself(tmp_path, keys):
    server = PgServer()
    try:
        server.start()
        url = server.create_database()
        with PostgresCustodyStore(url, keys, probe_interval=0.2) as s:
            s.put(GH, CANARY.encode())
            assert s.healthy() and s.open(GH).reveal() == CANARY.encode()
            server.stop()
            for _ in range(3):
                with pytest.raises(CustodyUnavailable) as info:
                    s.open(GH)
                assert info.value.io
            assert not s.healthy()
            with pytest.raises(CustodyUnavailable):
                s.put(GH, b"other")
            server.start()
            assert wait_for(s.healthy)
            assert s.open(GH).reveal() == CANARY.encode()
    finally:
        server.destroy()


def test_the_canary_is_in_no_file_and_no_log_of_the_cluster(pg, keys):
    url = pg.create_database()
    with PostgresCustodyStore(url, keys) as s:
        s.put(GH, CANARY.encode())
        assert s.open(GH).reveal() == CANARY.encode()
        s.rotate()
        s.delete(GH)
        s.put(GH, CANARY.encode())
        assert s.open(GH).reveal() == CANARY.encode()
    with raw(pg.url) as conn:
        conn.execute("CHECKPOINT")
    log = pg.log_text()
    assert b"egresslaw_custody_records" in log  # the statement log is on: the scan below can see a leak
    assert_no_canary(log, "the PostgreSQL log")
    for path in pg.files():
        assert_no_canary(path.read_bytes(), f"cluster file {path.relative_to(pg.root)}")


# --- the proxy on the PostgreSQL store ---------------------------------------------------------


def absolute(p, path: str, lease: str, host: str = "api.acme-test.dev", scheme: str = "https"):
    wire = f"GET {scheme}://{host}{path} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Bearer {lease}\r\n\r\n"
    with open_socket(p.host, p.port, 30) as sock:
        sock.sendall(wire.encode())
        answer = read_answer(sock)
    p.record(answer.raw)
    return answer


def tunnel(p, path: str, lease: str, host: str = "api.acme-test.dev"):
    sock = open_socket(p.host, p.port, 30)
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\nProxy-Authorization: Bearer {lease}\r\n\r\n".encode())
    assert read_answer(sock, "CONNECT").status == 200
    with tls_client(sock, p.ca, host) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        answer = read_answer(tls)
    p.record(answer.raw)
    return answer


def _readyz(p) -> tuple[int, str]:
    import http.client

    conn = http.client.HTTPConnection(*p.admin_address(), timeout=10)
    conn.request("GET", "/readyz")
    resp = conn.getresponse()
    answer = (resp.status, resp.read().decode())
    conn.close()
    return answer


def test_proxy_on_postgres_denies_custody_unavailable_while_the_database_is_down(tmp_path, pki, tls_upstream, http_upstream):
    server = PgServer()
    p = None
    try:
        server.start()
        url = server.create_database().replace("egresslaw@", f"egresslaw:{PASSWORD}@")
        env = make_env(tmp_path / "env")
        with PostgresCustodyStore(url, env.keys) as s:  # put through one store object; the proxy opens through its own
            s.put(GH, CANARY.encode())
        env = dataclasses.replace(env, store=url)
        connect_to = [f"{h}:443:127.0.0.1:{tls_upstream.port}" for h in HOSTS if h != "self.acme-test.dev"]
        connect_to.append(f"pkgs.acme-test.dev:80:127.0.0.1:{http_upstream.port}")
        p = start_proxy(env, pki, (tls_upstream, http_upstream), connect_to, listen=free_port())
        custody = p.addon.custody
        assert isinstance(custody, PostgresCustodyStore)
        custody.probe_interval = 0.2
        gh, ci = p.lease(connection="github"), p.lease(profile="ci")

        answer = absolute(p, "/repos/acme/before", gh)
        assert answer.status == 200, answer
        assert tls_upstream.raw_requests()[-1].all("Authorization") == [f"Bearer {CANARY}"]

        server.stop()
        for attempt in range(3):
            mark = p.mark()
            denied = [absolute(p, f"/repos/acme/down{attempt}", gh), tunnel(p, f"/repos/acme/down{attempt}", gh)]
            for answer in denied:
                assert answer.status == 403 and answer.header("x-egresslaw-deny") == "custody-unavailable", answer
                assert json.loads(answer.body) == {"error": "egress_denied", "reason": "custody-unavailable", "rule": None}
            assert p.upstream_delta(mark) == [(0, 0, 0), (0, 0, 0)], "a request went upstream without custody"
            assert wait_for(lambda: [e["reason"] for e in p.new_events(mark) if e["kind"] == "request"] == ["custody-unavailable"] * 2, 30)
        assert not custody.healthy()
        assert _readyz(p) == (503, "not ready: custody-unavailable\n")  # the whole proxy: no traffic for it now
        assert absolute(p, "/simple/pip/", ci, host="pkgs.acme-test.dev", scheme="http").status == 200  # sandbox traffic needs no custody

        server.start()
        assert wait_for(custody.healthy)
        assert wait_for(lambda: _readyz(p) == (200, "ready\n"))
        answer = absolute(p, "/repos/acme/after", gh)
        assert answer.status == 200, answer
        assert tls_upstream.raw_requests()[-1].all("Authorization") == [f"Bearer {CANARY}"]

        p.assert_nothing_leaked()
        assert PASSWORD not in p.logs.text()
        p.addon.audit.flush()
        assert PASSWORD.encode() not in p.env.audit.read_bytes()
        assert_no_canary(server.log_text(), "the PostgreSQL log")
    finally:
        if p is not None:
            stop_proxy(p)
            p.addon.custody.close()  # its pool would keep reconnecting to the destroyed server
        server.destroy()


def test_proxy_refuses_to_start_on_an_unreachable_database(tmp_path):
    env = make_env(tmp_path / "env")
    nowhere = f"postgresql://egresslaw:{PASSWORD}@/postgres?host={tmp_path}"
    proc = cli("proxy", "--artifact", str(env.artifact), "--proof", str(env.proof), "--keys", str(env.keys), "--store", nowhere,
               "--listen", f"127.0.0.1:{free_port()}", "--admin", "127.0.0.1:0", "--confdir", str(tmp_path / "conf"),
               "--audit-log", str(tmp_path / "audit.jsonl"))
    assert proc.returncode == 2, proc.stderr
    assert b"cannot reach custody database" in proc.stderr
    assert PASSWORD.encode() not in proc.stdout + proc.stderr


def test_the_mint_lock_is_one_holder_across_stores(url, keys):
    """`try_mint_lock`: a session advisory lock, so two stores (two proxy processes of a fleet) never mint one credential
    at once; another credential's lock is free meanwhile, and a release lets the other store take it."""
    held, other = Address("acme", "drive", "h"), Address("acme", "other", "h")
    with PostgresCustodyStore(url, keys) as a, PostgresCustodyStore(url, keys) as b:
        release = a.try_mint_lock(held)
        assert release is not None
        assert b.try_mint_lock(held) is None
        free = b.try_mint_lock(other)
        assert free is not None
        free()
        release()
        again = b.try_mint_lock(held)
        assert again is not None
        again()
