"""The budget at the real mitmproxy edge: `egresslaw proxy --workers 2` as a child process, its workers sharing one
SQLite ledger (`--budget-store`). The first request over a requests cap is 429 `budget-exceeded` with `Retry-After`
and the cap named, audited with its window; a restart (SIGTERM, then a new process on the same ledger) does not reset
the window; a request whose declared length would pass a bytes cap is refused and costs nothing; a chunked body under
a bytes cap is 411 and nothing reaches the upstream; a ledger locked past its busy timeout refuses 503
`budget-unavailable` (nothing upstream) and serving resumes once it is free; a ledger that cannot be opened stops
the start (exit 2, the file named). The canary credential is in no answer, log or audit line.

Every wait is bounded and waits for a state, never for a fixed time. The window is a day, so the test never crosses
one; should a boundary pass between the first and the last request all the same, only the assertions that depend on
staying in one window are skipped.
"""

from __future__ import annotations

import http.client
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compiler.artifact import Budget
from egress_proxy.front.budget import SqliteLedger, window_start
from tests.egress_proxy import builders as b
from tests.proxy_harness import (
    FleetProcess,
    assert_no_canary,
    build_artifact,
    clean_environment,
    make_env,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API, PKGS = "api.acme-test.dev", "pkgs.acme-test.dev"
DAY = 86400


def budgeted_artifact():
    """The harness's artifact, its connection `github` capped at 1 request a day, and profiles for plain traffic to
    `pkgs`: `ci` (3 requests a day), `bulk` (2,000 bytes a day), `steady` (100 requests a day), `free` (no budget)."""
    base = build_artifact()
    github = base.connection("github").model_copy(update={"budget": Budget(window=DAY, requests=1)})

    def profile(name, budget):
        return b.profile(name, [(PKGS, 80), (API, 443)]).model_copy(update={"budget": budget})

    profiles = [profile("ci", Budget(window=DAY, requests=3)), profile("bulk", Budget(window=DAY, bytes=2000)),
                profile("steady", Budget(window=DAY, requests=100)), profile("free", None)]
    return b.artifact(connections=[github], profiles=profiles, workspace=base.workspace)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("budget-edge"), budgeted_artifact())


def routing(http_port: int, tls_port: int, ca: Path) -> list[str]:
    return ["--resolve", f"{PKGS}=93.184.216.35", "--resolve", f"{API}=93.184.216.34",
            "--connect-to", f"{PKGS}:80:127.0.0.1:{http_port}", "--connect-to", f"{API}:443:127.0.0.1:{tls_port}", "--upstream-ca", str(ca)]


def fleet_on(env, ledger: Path, http_upstream, tls_upstream, pki) -> FleetProcess:
    return FleetProcess(env, [*routing(http_upstream.port, tls_upstream.port, pki.ca_pem), "--budget-store", str(ledger)], workers=2)


def send(fleet: FleetProcess, method: str, url: str, lease: str, body: bytes | None = None, chunked: bool = False,
         seen: list[bytes] | None = None) -> tuple[int, dict[str, str], bytes, list[tuple[str, str]]]:
    """One request on a new connection (the kernel picks a worker), with exactly the headers listed in the answer's
    last element (what the proxy charges)."""
    conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=90)
    headers = [("Host", url.split("/")[2]), ("Proxy-Authorization", f"Bearer {lease}")]
    if body is not None:
        headers.append(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(len(body))))
    try:
        conn.putrequest(method, url, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if chunked:
            conn.endheaders()
            conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body or b""), body or b""))
        else:
            conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        if seen is not None:
            seen.append(b"".join(f"{k}: {v}".encode() for k, v in resp.getheaders()) + data)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, headers
    finally:
        conn.close()


def cost_of(method: str, path: str, host: str, port: int, headers: list[tuple[str, str]], body: int) -> int:
    """docs/budget.md, "What a request costs", written out again."""
    head = f"{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers if k.lower() != "host") + "\r\n"
    return len(head.encode()) + body


def requests_of(fleet: FleetProcess) -> list[dict]:
    return [e for chain in fleet.events() for e in chain if e["kind"] == "request"]


def test_the_request_over_a_requests_cap_is_429_audited_and_still_refused_after_a_restart(env, tmp_path, http_upstream, tls_upstream, pki):
    ledger = tmp_path / "budget.db"
    before = window_start(time.time(), DAY)
    seen: list[bytes] = []
    lease = env.lease(profile="ci")
    fleet = fleet_on(env, ledger, http_upstream, tls_upstream, pki)
    try:
        mark = http_upstream.mark()
        assert [send(fleet, "GET", f"http://{PKGS}/a{i}", lease, seen=seen)[0] for i in range(3)] == [200] * 3
        status, headers, body, _ = send(fleet, "GET", f"http://{PKGS}/a3", lease, seen=seen)
        assert status == 429 and headers["x-egresslaw-deny"] == "budget-exceeded"
        assert 1 <= int(headers["retry-after"]) <= DAY
        answer = json.loads(body)
        assert answer["reason"] == "budget-exceeded"
        assert answer["detail"].startswith("profile `ci`: 3 requests per 1d window used; resets at ")
        assert http_upstream.since(mark)[2] == 3  # the refused one never left
        # a connection's own budget (1 a day): its credential goes out once, then 429 with no credential anywhere
        github = env.lease(connection="github")
        assert send(fleet, "GET", f"https://{API}/repos/acme/x", github, seen=seen)[0] == 200
        assert send(fleet, "GET", f"https://{API}/repos/acme/y", github, seen=seen)[0] == 429
        denied = [e for e in requests_of(fleet) if e["reason"] == "budget-exceeded"]
        assert len(denied) == 2 and all(e["decision"] == "deny" for e in denied)
        mine = next(e for e in denied if e["profile"] == "ci")
        start = mine["budget"]["start"]
        assert mine["budget"] == {"window": DAY, "start": start, "resets": start + DAY, "cap": "requests", "limit": 3}
        assert mine["status"] == 429 and mine["detail"] == answer["detail"]
        assert next(e for e in denied if e["connection"] == "github")["budget"]["limit"] == 1
    finally:
        assert fleet.stop() == 0, fleet.text()[-3000:]
    for path in fleet.audit_files():
        assert_no_canary(path.read_bytes(), f"the audit log `{path.name}`")
    assert_no_canary(fleet.text(), "the proxy's stderr")
    again = fleet_on(env, ledger, http_upstream, tls_upstream, pki)
    try:
        status, headers, body, _ = send(again, "GET", f"http://{PKGS}/after-restart", lease, seen=seen)
        if window_start(time.time(), DAY) != before:
            pytest.skip("a day's window ended during the test: the restart's refusal is not defined across it")
        assert status == 429 and json.loads(body)["reason"] == "budget-exceeded"
        assert send(again, "GET", f"http://{PKGS}/other-subject", env.lease(profile="free"), seen=seen)[0] == 200  # no budget: untouched
    finally:
        assert again.stop() == 0, again.text()[-3000:]
    for shown in seen:
        assert_no_canary(shown, "a client-visible answer")
    assert_no_canary(again.text(), "the restarted proxy's stderr")
    assert SqliteLedger(ledger).used("profile:free", DAY, time.time()) == (0, 0)


def test_bytes_caps_chunked_bodies_and_a_locked_ledger(env, tmp_path, http_upstream, tls_upstream, pki):
    ledger = tmp_path / "budget.db"
    before = window_start(time.time(), DAY)
    bulk = env.lease(profile="bulk")
    fleet = fleet_on(env, ledger, http_upstream, tls_upstream, pki)
    try:
        # a body whose declared length would pass the 2,000-byte cap: refused, charged nothing, never upstream
        mark = http_upstream.mark()
        status, headers, body, _ = send(fleet, "POST", f"http://{PKGS}/upload", bulk, body=b"x" * 2500)
        assert status == 429 and json.loads(body)["detail"].startswith("profile `bulk`: 2,000 bytes per 1d window: 0 used")
        assert http_upstream.since(mark) == (0, 0, 0)
        # a chunked body under a bytes cap: 411, nothing upstream, nothing charged
        status, headers, body, _ = send(fleet, "POST", f"http://{PKGS}/upload", bulk, body=b"y" * 10, chunked=True)
        assert status == 411 and headers["x-egresslaw-deny"] == "budget-length-required"
        assert http_upstream.since(mark) == (0, 0, 0)
        # a smaller one passes, charged exactly its cost
        status, _, _, sent = send(fleet, "POST", f"http://{PKGS}/upload", bulk, body=b"z" * 500)
        assert status == 200 and http_upstream.since(mark)[2] == 1
        used = SqliteLedger(ledger).used("profile:bulk", DAY, time.time())
        if window_start(time.time(), DAY) == before:
            assert used == (1, cost_of("POST", "/upload", PKGS, 80, sent, 500))
        # the ledger locked by another writer past its busy timeout: 503 budget-unavailable, nothing upstream
        steady = env.lease(profile="steady")
        holder = sqlite3.connect(ledger, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            mark = http_upstream.mark()
            status, headers, body, _ = send(fleet, "GET", f"http://{PKGS}/while-locked", steady)
            assert status == 503 and headers["x-egresslaw-deny"] == "budget-unavailable"
            assert http_upstream.since(mark) == (0, 0, 0)
            assert send(fleet, "GET", f"http://{PKGS}/free", env.lease(profile="free"))[0] == 200  # no budget: no ledger
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert send(fleet, "GET", f"http://{PKGS}/after", steady)[0] == 200  # the ledger is back: so is serving
        reasons = [e["reason"] for e in requests_of(fleet) if e["profile"] in ("bulk", "steady")]
        assert sorted(reasons) == sorted(["budget-exceeded", "budget-length-required", "allowed", "budget-unavailable", "allowed"])
    finally:
        assert fleet.stop() == 0, fleet.text()[-3000:]
    assert_no_canary(fleet.text(), "the proxy's stderr")


def test_a_ledger_that_cannot_be_opened_stops_the_start_naming_the_file(env, tmp_path):
    bad = tmp_path / "budget.db"
    bad.write_bytes(b"not a SQLite database at all; " * 200)
    argv = [sys.executable, "-m", "egresslaw", "proxy", "--workers", "2", "--artifact", str(env.artifact), "--proof", str(env.proof),
            "--keys", str(env.keys), "--store", str(env.store), "--audit-log", str(tmp_path / "audit.jsonl"), "--confdir", str(env.confdir),
            "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--budget-store", str(bad)]
    done = subprocess.run(argv, cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: the budget ledger `{bad}` cannot be used" in done.stderr and "help: " in done.stderr
    assert bad.read_bytes().startswith(b"not a SQLite database")  # left as it was
