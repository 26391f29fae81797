"""A real, throw-away PostgreSQL server for the custody tests: `initdb` + `postgres` on a unix socket
in a fresh directory under /tmp, nothing listening on TCP.

PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user (Debian's
package creates it) or `nobody`, through `subprocess`'s `user=`/`group=`. Every statement is logged
with its parameters (`log_statement=all`) to `postgres.log`, so a test can scan the server's log
for a canary. The binaries come from Debian's `postgresql` package (`make test` installs it when
`initdb` is missing).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

START_TIMEOUT = 60.0


def bindir() -> Path:
    """The directory holding `initdb` and `postgres`; a clear failure if PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if candidates:
        return Path(candidates[-1]).parent
    raise RuntimeError("PostgreSQL server binaries (initdb, postgres) not found: run `make postgres` (installs Debian's `postgresql`)")


def _run_as() -> tuple[int, int] | None:
    """(uid, gid) to drop to when running as root; None when already unprivileged."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    raise RuntimeError("running as root and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as")


class PgServer:
    """initdb once, then start()/stop() as often as a test likes (same data, same socket, same URL)."""

    def __init__(self) -> None:
        self.bin = bindir()
        self.root = Path(tempfile.mkdtemp(prefix="egresslaw-pg-"))  # short: a unix socket path has ~107 bytes
        self.data = self.root / "data"
        self.sock = self.root / "sock"
        self.log = self.root / "postgres.log"
        self.sock.mkdir()
        self._ids = _run_as()
        if self._ids is not None:
            for path in (self.root, self.sock):
                os.chown(path, *self._ids)
        self.proc: subprocess.Popen | None = None
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "egresslaw", "--no-sync", "-E", "UTF8", "--locale=C"])

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, dbname: str, password: str | None = None) -> str:
        user = f"egresslaw:{password}" if password else "egresslaw"
        return f"postgresql://{user}@/{dbname}?host={quote(str(self.sock), safe='')}"

    def create_database(self) -> str:
        """A fresh, empty database (one per test: a keys directory belongs to one store); its URL."""
        import uuid

        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def _kw(self) -> dict:
        if self._ids is None:
            return {}
        uid, gid = self._ids
        return {"user": uid, "group": gid, "extra_groups": []}

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(argv, capture_output=True, text=True, cwd=self.root, timeout=120, **self._kw())
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr[-2000:]}")

    def start(self) -> None:
        import psycopg

        argv = [
            str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.sock),
            "-c", "listen_addresses=", "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
            "-c", "shared_buffers=16MB", "-c", "max_connections=40", "-c", "dynamic_shared_memory_type=mmap",
            "-c", "log_statement=all", "-c", "log_parameter_max_length=-1", "-c", "log_min_error_statement=info",
            "-c", "log_connections=on", "-c", "log_disconnections=on",
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root,
                                         start_new_session=True, **self._kw())
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {self.log_text()[-2000:]}")
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown (SIGINT): open sessions are terminated, as when the database goes away."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_text(self) -> bytes:
        return self.log.read_bytes() if self.log.exists() else b""

    def files(self) -> list[Path]:
        """Every file of the cluster (heap, WAL, log), for a raw byte scan."""
        return [p for p in self.root.rglob("*") if p.is_file() and not p.is_symlink()]

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
