"""A damaged audit log is reported as damaged, by file and line, never as "no audit log".

A log is recognised by its first line; when that line is the damaged one (not JSON, a flipped bit, cut short, the
file emptied) the log must still be found, so that the verifier names the file, the line and what is wrong. Each log
is written by the real AuditLog, then damaged on disk, then given to the real CLI (`audit verify DIR`,
`propose --audit DIR --keys KEYS`) in a subprocess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egress_proxy.audit.event import Event
from egress_proxy.audit.log import AuditLog
from egress_proxy.audit.verify import audit_logs
from egress_proxy.custody.keys import init_keys, load_audit_key

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 120


def _line_start(data: bytes, n: int) -> int:
    """The offset of line `n` (1-based)."""
    at = 0
    for _ in range(n - 1):
        at = data.index(b"\n", at) + 1
    return at


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x40
    return bytes(out)


def _replace_line(data: bytes, n: int, new: bytes) -> bytes:
    start = _line_start(data, n)
    return data[:start] + new + data[data.index(b"\n", start):]


# name -> (damage, exit code of `audit verify`, the line named, what is said about it)
DAMAGE = {
    "first-line-not-json": (lambda d: _replace_line(d, 1, b"{not json"), 1, 1, "not JSON"),
    "first-line-bit-flip": (lambda d: _flip(d, 1), 1, 1, "not JSON"),  # `{"decision"` -> `{bdecision"`
    "first-line-binary": (lambda d: b"\xff\xfe\x00\x81\n" + d, 1, 1, "not JSON"),
    "first-line-cut": (lambda d: d[:_line_start(d, 2) // 2], 3, 1, "incomplete (no newline)"),
    "emptied": (lambda d: b"", 1, 1, "the file is empty"),
    "third-line-not-json": (lambda d: _replace_line(d, 3, b'{"v": cut'), 1, 3, "not JSON"),
    "third-line-bit-flip": (lambda d: _flip(d, _line_start(d, 3) + 3), 1, 3, ""),
    "cut-mid-line": (lambda d: d[:_line_start(d, 3) + 30], 3, 3, "incomplete (no newline)"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """A closed log written by the real AuditLog (audit-open, four denials, the closing checkpoint), and its keys."""
    root = tmp_path_factory.mktemp("damaged")
    init_keys(root / "keys")
    log = AuditLog(root / "intact" / "audit.jsonl", load_audit_key(root / "keys"))
    for i in range(4):
        log.emit(Event.of({"kind": "request", "decision": "deny", "reason": "path-not-allowed", "method": "GET",
                  "host": "api.acme-test.dev", "port": 443, "path": f"/repos/acme/x/{i}"}))
    assert log.close()
    return {"root": root, "keys": root / "keys", "data": (root / "intact" / "audit.jsonl").read_bytes()}


def _damaged(written, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "audit.jsonl").write_bytes(DAMAGE[name][0](written["data"]))
    return folder


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_")}
    return subprocess.run([sys.executable, "-m", "egresslaw", *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env)


def test_the_intact_log_verifies(written, tmp_path):
    folder = tmp_path / "intact"
    folder.mkdir()
    (folder / "audit.jsonl").write_bytes(written["data"])
    done = _cli("audit", "verify", str(folder), "--keys", str(written["keys"]))
    assert done.returncode == 0 and done.stdout.startswith("ok: "), done.stdout + done.stderr


@pytest.mark.parametrize("name", list(DAMAGE))
def test_audit_verify_names_the_damaged_file_and_line(written, tmp_path, name):
    _, code, line, what = DAMAGE[name]
    folder = _damaged(written, tmp_path, name)
    for keys in (["--keys", str(written["keys"])], []):  # with the secret key, and with only the key the log names
        done = _cli("audit", "verify", str(folder), *keys)
        assert done.returncode == code, (keys, done.stdout, done.stderr)
        assert "holds no audit log" not in done.stderr and "Traceback" not in done.stderr, done.stderr
        if keys or line == 1 or code == 3:  # without the MAC key a flip inside a later line is found at its checkpoint
            assert f"`{folder / 'audit.jsonl'}`: line {line}: {what}" in done.stderr, (keys, done.stderr)
        else:
            assert f"`{folder / 'audit.jsonl'}`: line " in done.stderr, done.stderr


@pytest.mark.parametrize("name", list(DAMAGE))
def test_propose_with_keys_refuses_the_damaged_log_by_file_and_line(written, tmp_path, name):
    _, _, line, what = DAMAGE[name]
    folder = _damaged(written, tmp_path, name)
    done = _cli("propose", "--audit", str(folder), "--keys", str(written["keys"]), str(ROOT / "policies" / "demo"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert "holds no audit log" not in done.stderr and "every line verifies" not in done.stderr, done.stderr
    assert f"audit log `audit.jsonl`" in done.stderr and f"line {line}: {what}" in done.stderr, done.stderr
    assert "\nhelp: " in done.stderr


def test_a_directory_without_any_log_is_still_no_audit_log(written, tmp_path):
    """The control: files that were never audit logs (another tool's JSON lines, a text log) are not taken for damaged ones."""
    (tmp_path / "events.jsonl").write_text('{"other": "tool"}\n{"other": "line"}\n')
    (tmp_path / "proxy.log").write_text("not json at all\n")
    done = _cli("audit", "verify", str(tmp_path), "--keys", str(written["keys"]))
    assert done.returncode == 2 and "holds no audit log" in done.stderr, done.stderr


def test_a_rotated_segment_damaged_in_its_first_line_is_found(written, tmp_path):
    """The chain's first segment, damaged at its first line, still groups the log: the verifier names it."""
    log_dir = tmp_path / "rotated"
    log_dir.mkdir()
    shutil.copy(written["root"] / "intact" / "audit.jsonl", log_dir / "audit.jsonl.000001")
    (log_dir / "audit.jsonl.000001").write_bytes(_replace_line(written["data"], 1, b"garbage"))
    assert [[p.name for p, _ in log] for log in audit_logs(log_dir)] == [["audit.jsonl.000001"]]
    done = _cli("audit", "verify", str(log_dir), "--keys", str(written["keys"]))
    assert done.returncode == 1 and f"`{log_dir / 'audit.jsonl.000001'}`: line 1: not JSON" in done.stderr, done.stderr
