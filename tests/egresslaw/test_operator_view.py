"""What an operator filters on: per-request JSON log lines with the audit event's id and fields, and the
`/metrics` families for connections, outcomes, bytes, redactions and custody reachability."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.proxy_harness import CANARY, assert_no_canary, free_port, make_env, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API = "api.acme-test.dev"
FIELDS = ("event_id", "kind", "decision", "reason", "subject", "connection", "host", "port", "method", "path", "status", "duration_ms")


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_") and "proxy" not in k.lower()}
    return {**base, "EGRESSLAW_TRUST_PROOFS": os.environ["EGRESSLAW_TRUST_PROOFS"], **extra}


def _get(port: int, path: str, lease: str, method: str = "GET", body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        headers = {"Proxy-Authorization": f"Bearer {lease}", **({"Content-Type": "application/json"} if body else {})}
        conn.request(method, f"https://{API}{path}", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _metrics(admin: int, token: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=10)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"})
    resp = conn.getresponse()
    assert resp.status == 200
    return resp.read().decode()


def _value(families: dict, name: str, **labels: str) -> float:
    for sample in families[name].samples:
        if sample.name in (name, name + "_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise AssertionError(f"no sample {name} {labels}")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_denial_logs_its_audit_fields_and_the_metrics_count_what_crossed(tmp_path, tls_upstream, pki, workers):
    e = make_env(tmp_path / "env")
    port, admin = free_port(), free_port()
    env = _env(EGRESSLAW_ARTIFACT=str(e.artifact), EGRESSLAW_PROOF=str(e.proof), EGRESSLAW_KEYS=str(e.keys), EGRESSLAW_STORE=str(e.store),
               EGRESSLAW_LISTEN=f"127.0.0.1:{port}", EGRESSLAW_ADMIN=f"127.0.0.1:{admin}", EGRESSLAW_CONFDIR=str(e.confdir),
               EGRESSLAW_AUDIT_LOG=str(e.audit), EGRESSLAW_LOG_FORMAT="json", EGRESSLAW_WORKERS=workers,
               EGRESSLAW_RESOLVE=f"{API}=93.184.216.34", EGRESSLAW_CONNECT_TO=f"{API}:443:127.0.0.1:{tls_upstream.port}",
               EGRESSLAW_UPSTREAM_CA=str(pki.ca_pem))
    proc = subprocess.Popen([sys.executable, "-m", "egresslaw", "proxy"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        while not (lines and "listening on" in lines[-1]):
            line = proc.stderr.readline()
            assert line, "".join(lines) + proc.stderr.read()
            lines.append(line)
        lease = e.lease(connection="github", subject="agent-ops")
        assert _get(port, "/repos/acme/app/issues", lease, "POST", b'{"title": "' + b"x" * 1000 + b'"}')[0] == 200
        status, echoed = _get(port, "/repos/acme/app/echo", lease)  # the upstream echoes the credential: redacted
        assert status == 200 and CANARY.encode() not in echoed
        status, body = _get(port, "/orgs/acme/secrets", lease)
        assert status == 403 and b"path-not-allowed" in body
        token = (e.confdir / "admin.token").read_text().strip()
        families: dict = {}

        def delivered() -> bool:  # the outcome events are counted as the flows close: poll
            families.clear()
            families.update({f.name: f for f in text_string_to_metric_families(_metrics(admin, token))})
            return _value(families, "egresslaw_outcomes", kind="request", failure="none") >= 2

        assert wait_for(delivered, timeout=20)
        assert _value(families, "egresslaw_bytes", direction="down") > len(echoed) // 2
        assert _value(families, "egresslaw_bytes", direction="up") >= 1000
        assert _value(families, "egresslaw_redactions") >= 1
        assert _value(families, "egresslaw_custody_reachable") == 1
        assert _value(families, "egresslaw_open_connections") >= 0
        text = _metrics(admin, token)
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
            assert check.returncode == 0, check.stdout + check.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    err = "".join(lines) + rest
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines()]
    (denial,) = [r for r in records if r.get("reason") == "path-not-allowed"]
    assert denial["message"].startswith("deny path-not-allowed GET api.acme-test.dev:443/orgs/acme/secrets")
    assert all(denial.get(f) is not None for f in FIELDS), denial
    assert (denial["decision"], denial["subject"], denial["connection"], denial["host"], denial["port"], denial["method"], denial["status"]) == (
        "deny", "agent-ops", "github", API, 443, "GET", 403)
    from egress_proxy.audit.verify import audit_logs

    events = [json.loads(line) for segs in audit_logs(e.audit) for seg in segs for line in seg[0].read_text().splitlines()]
    (audited,) = [ev for ev in events if ev.get("id") == denial["event_id"]]
    assert (audited["reason"], audited["path"], audited["subject"]) == ("path-not-allowed", denial["path"], "agent-ops")
    assert_no_canary(err, "JSON logs")
    assert lease not in err
