"""`egresslaw audit export`: a bad target, headers file or TLS option stops it with `error:`/`help:` and exit 2, never a
traceback, and never echoes a credential (the export itself: tests/egress_proxy/audit/test_export.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(("to", "said"), [
    ("ftp://collector:4317", "scheme `ftp`"),
    ("grpc://collector", "names no port"),
    ("collector:4317", "is not one of grpc"),
    ("http://collector:4318/v1/logs?token=x", "query"),
    ("https://admin:hunter2@collector:4318", "never in the url"),
])
def test_a_bad_target_is_a_usage_error(cli, tmp_path, to, said) -> None:
    code, out, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", to)
    assert code == 2 and not out
    assert said in err.lower() and "\nhelp: " in err and "Traceback" not in err
    assert "hunter2" not in err
    assert not (tmp_path / "audit.jsonl.export").exists()  # refused before anything was made


def test_a_bad_headers_file_names_the_line_not_the_value(cli, tmp_path) -> None:
    headers = tmp_path / "auth"
    headers.write_text("# collector auth\nX-Scope-OrgID: team\nBearer s3cr3t-canary\n")
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "http://127.0.0.1:9/", "--headers", headers)
    assert code == 2 and f"`{headers}` line 3" in err and "help: " in err
    assert "s3cr3t" not in err and "Traceback" not in err
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "http://127.0.0.1:9/", "--headers", tmp_path / "missing")
    assert code == 2 and "does not exist" in err


def test_tls_options_need_a_tls_target_and_go_together(cli, tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "grpc://127.0.0.1:4317", "--ca", ca)
    assert code == 2 and "plaintext" in err and "help: use grpcs:// or https://" in err
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "grpcs://127.0.0.1:4317", "--cert", ca)
    assert code == 2 and "go together" in err


def test_a_missing_log_is_named(cli, tmp_path) -> None:
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "grpc://127.0.0.1:9")
    assert code == 2 and f"`{tmp_path / 'audit.jsonl'}` does not exist" in err and "audit.w1.jsonl" in err and "help: " in err


def test_header_values_and_grpc_names_the_child_would_fail_on_are_refused_at_start(cli, tmp_path) -> None:
    euro, reserved = tmp_path / "euro", tmp_path / "reserved"
    euro.write_text("Authorization: Bearer tok€n-s3cr3t\n", encoding="utf-8")
    reserved.write_text("grpc-timeout: 1S\n")
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "http://127.0.0.1:9/", "--headers", euro)
    assert code == 2 and "visible ASCII" in err and "s3cr3t" not in err and "Traceback" not in err
    code, _, err = cli("audit", "export", tmp_path / "audit.jsonl", "--to", "grpc://127.0.0.1:9", "--headers", reserved)
    assert code == 2 and "gRPC metadata" in err and "help: " in err


def test_a_front_ends_log_format_reaches_the_exporter_from_the_environment(tmp_path) -> None:
    import json  # Imported here: only this test reads the JSON log lines
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "audit.jsonl").write_text("")  # an empty log: nothing to send, exit 0
    (tmp_path / "h").write_text("X-Org: s3cr3t\n")
    env = {**os.environ, "PYTHONPATH": str(root), "EGRESSLAW_LOG_FORMAT": "json", "EGRESSLAW_LOG_LEVEL": "debug"}
    done = subprocess.run([sys.executable, "-m", "egresslaw", "audit", "export", str(tmp_path / "audit.jsonl"), "--to",
                           "http://127.0.0.1:9/v1/logs/path-s3cr3t", "--timeout", "1", "--headers", str(tmp_path / "h")],
                          env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.decode().splitlines() if line.strip()]
    assert lines and any("plaintext" in json.dumps(line) for line in lines)  # the warning, as a JSON object
    assert b"s3cr3t" not in done.stderr + done.stdout
