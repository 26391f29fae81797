"""`egresslaw custody init` makes an empty store and never overwrites one; a profiles-only proxy needs no store.

Each case runs the real CLI in a subprocess: `custody init` against a real keys directory, and `egresslaw proxy` on
an artifact with sandbox profiles only, given a `--store` that does not exist, answering a real client on loopback.
"""

from __future__ import annotations

import http.client
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.egress_proxy import builders as b
from tests.proxy_harness import clean_environment, free_port, make_env

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "egresslaw", *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                          env=env or clean_environment())


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("custody-init")
    done = _cli("keys", "init", "--dir", str(root / "keys"))
    assert done.returncode == 0, done.stderr
    return root / "keys"


def test_init_creates_an_empty_0600_store_that_custody_list_reads(keys, tmp_path):
    store = tmp_path / "custody.db"
    done = _cli("custody", "init", "--keys", str(keys), "--store", str(store))
    assert done.returncode == 0 and f"created custody store `{store}`" in done.stdout, done.stderr
    assert stat.S_IMODE(store.stat().st_mode) == 0o600
    listed = _cli("custody", "list", "--keys", str(keys), "--store", str(store), "--format", "json")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr


def test_init_reads_the_environment_like_the_other_custody_commands(keys, tmp_path):
    store = tmp_path / "env.db"
    done = _cli("custody", "init", env=clean_environment(EGRESSLAW_KEYS=str(keys), EGRESSLAW_STORE=str(store)))
    assert done.returncode == 0 and store.is_file(), done.stderr


def test_init_never_overwrites_a_store(keys, tmp_path):
    store = tmp_path / "custody.db"
    assert _cli("custody", "init", "--keys", str(keys), "--store", str(store)).returncode == 0
    put = subprocess.run([sys.executable, "-m", "egresslaw", "custody", "put", "--keys", str(keys), "--store", str(store),
                          "--workspace", "acme", "--connection", "github", "--handle", "gh"], cwd=ROOT, capture_output=True,
                         text=True, timeout=TIMEOUT, env=clean_environment(), input="a-sealed-value\n")
    assert put.returncode == 0, put.stderr
    before = store.read_bytes()
    again = _cli("custody", "init", "--keys", str(keys), "--store", str(store))
    assert again.returncode == 2 and again.stdout == "", again.stdout
    assert f"error: custody store `{store}` exists already: it is never overwritten" in again.stderr and "\nhelp: " in again.stderr
    assert store.read_bytes() == before
    listed = _cli("custody", "list", "--keys", str(keys), "--store", str(store), "--format", "json")
    assert '"connection": "github"' in listed.stdout, listed.stderr  # the record is still there


def test_init_leaves_nothing_behind_when_it_cannot_make_the_store(tmp_path):
    store = tmp_path / "custody.db"
    done = _cli("custody", "init", "--keys", str(tmp_path / "nokeys"), "--store", str(store))
    assert done.returncode == 2 and "error: " in done.stderr and "\nhelp: " in done.stderr and "Traceback" not in done.stderr
    assert not store.exists()
    url = _cli("custody", "init", "--keys", str(tmp_path / "nokeys"), "--store", "postgresql://u@127.0.0.1:1/db")
    assert url.returncode == 2 and "creates a SQLite file" in url.stderr, url.stderr


def _proxy(env, store: Path, port: int, admin: int, workers: str) -> list[str]:
    return [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(env.artifact), "--proof", str(env.proof),
            "--keys", str(env.keys), "--store", str(store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
            "--confdir", str(env.confdir), "--audit-log", str(env.audit), "--workers", workers]


def _ready(admin: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_profiles_only_proxy_starts_without_a_store_and_serves(tmp_path, workers):
    env = make_env(tmp_path / "env", artifact=b.artifact(profiles=[b.profile("package-builder", [("pkgs.acme-test.dev", 443)])]))
    store = tmp_path / "absent" / "custody.db"
    port, admin = free_port(), free_port()
    proc = subprocess.Popen(_proxy(env, store, port, admin, workers), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=clean_environment())
    try:
        deadline = time.monotonic() + 180
        while not _ready(admin):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the proxy did not become ready"
            time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "http://pkgs.acme-test.dev/simple/", headers={"Host": "pkgs.acme-test.dev"})
        r = conn.getresponse()
        assert r.status == 407 and r.getheader("X-Egresslaw-Deny") == "lease-missing"  # serving, every denial with its reason
        r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "starting without a custody store" in stderr
    assert not store.exists() and not store.parent.exists()  # none was created


def test_a_proxy_with_a_connection_still_needs_its_store(tmp_path):
    """The control: the artifact has a connection, so a missing store stops the start (exit 2, nothing listening)."""
    env = make_env(tmp_path / "env")  # the harness's artifact: connection `github`
    port, admin = free_port(), free_port()
    done = subprocess.run(_proxy(env, tmp_path / "absent.db", port, admin, "1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT, env=clean_environment())
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "absent.db").exists()


def test_custody_init_is_in_the_bad_input_table():
    """`custody init` is attacked like every other command (the table in test_cli_bad_input.py)."""
    from tests.egresslaw.test_cli_bad_input import CASES

    assert any(c[1][:2] == ["custody", "init"] for c in CASES if c[1])
