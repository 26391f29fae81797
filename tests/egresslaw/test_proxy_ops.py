"""Operating `egresslaw proxy`: EGRESSLAW_* environment variables, JSON/text logs in UTC, no mitmproxy advice."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from egresslaw import logs
from egresslaw.cli import build_parser
from tests.proxy_harness import assert_no_canary, free_port, make_env

ROOT = Path(__file__).resolve().parents[2]
UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _proxy_parser():
    parser = build_parser()
    return parser, next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "proxy")[1]


def _clean_env(**env: str) -> dict[str, str]:
    """The environment without EGRESSLAW_* settings or proxy variables, but with the test run's proof-signing key trusted."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_") and "proxy" not in k.lower()}
    return {**base, "EGRESSLAW_TRUST_PROOFS": os.environ["EGRESSLAW_TRUST_PROOFS"], **env}


def test_every_proxy_option_has_a_variable_and_flags_win(monkeypatch):
    for key in [k for k in os.environ if k.startswith("EGRESSLAW_")]:
        monkeypatch.delenv(key)
    env = {
        "EGRESSLAW_ARTIFACT": "a.json", "EGRESSLAW_PROOF": "p.json", "EGRESSLAW_KEYS": "/keys",
        "EGRESSLAW_LISTEN": "0.0.0.0:8080", "EGRESSLAW_ALLOW_UNPROVEN": "true", "EGRESSLAW_LOG_FORMAT": "json",
        "EGRESSLAW_RESOLVE": "a.example.org=93.184.216.34 b.example.org=93.184.216.35,93.184.216.36",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser, proxy = _proxy_parser()
    args = parser.parse_args(["proxy"])  # the required options come from the environment
    assert (args.artifact, args.proof, args.keys, args.listen, args.allow_unproven, args.log_format) == (
        "a.json", "p.json", "/keys", "0.0.0.0:8080", True, "json")
    assert args.resolve == ["a.example.org=93.184.216.34", "b.example.org=93.184.216.35,93.184.216.36"]
    args = parser.parse_args(["proxy", "--listen", "127.0.0.1:9", "--resolve", "c.example.org=93.184.216.1", "--log-format=text"])
    assert (args.listen, args.resolve, args.log_format) == ("127.0.0.1:9", ["c.example.org=93.184.216.1"], "text")
    helptext = proxy.format_help()
    for action in proxy._actions:
        if action.option_strings and action.dest != "help":
            assert f"EGRESSLAW_{action.dest.upper()}" in " ".join(helptext.split()), action.dest


def test_an_option_added_later_gets_its_variable_for_free(monkeypatch):
    monkeypatch.setenv("EGRESSLAW_FUTURE_KNOB", "4")
    parser, proxy = _proxy_parser()
    proxy.add_argument("--future-knob", type=int, default=1)  # as another command module would
    args = parser.parse_args(["proxy", "--artifact", "a", "--proof", "p", "--keys", "k"])
    assert args.future_knob == 4
    assert parser.parse_args(["proxy", "--artifact", "a", "--proof", "p", "--keys", "k", "--future-knob", "2"]).future_knob == 2


@pytest.mark.parametrize(("name", "value", "message"), [
    ("EGRESSLAW_ALLOW_UNPROVEN", "maybe", "EGRESSLAW_ALLOW_UNPROVEN='maybe': expected one of 1/true/yes/on or 0/false/no/off"),
    ("EGRESSLAW_LOG_LEVEL", "loud", "EGRESSLAW_LOG_LEVEL='loud': choose from debug, info, warning, error"),
    ("EGRESSLAW_AUDIT_SYNC", "never", "EGRESSLAW_AUDIT_SYNC='never': audit sync `never` is neither `request` nor a number of seconds"),
])
def test_a_bad_variable_is_a_usage_error_naming_it(name, value, message):
    proc = subprocess.run([sys.executable, "-m", "egresslaw", "proxy", "--artifact", "a", "--proof", "p", "--keys", "k"],
                          cwd=ROOT, capture_output=True, text=True, env=_clean_env(**{name: value}), timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_mitmproxy_advice_is_dropped_and_its_listen_error_left_to_egresslaw():
    f = logs.MitmproxyAdvice()

    def record(name, msg):
        return logging.LogRecord(name, logging.ERROR, "x", 1, msg, None, None)

    advice = record("mitmproxy.proxy.server", "something failed\nTry specifying a different port by using `--mode regular@8084`.")
    assert f.filter(advice) and advice.getMessage() == "something failed"
    assert not f.filter(record("mitmproxy.addons.proxyserver", "[Errno 98] HTTP(S) proxy failed to listen on 127.0.0.1:8080 with ..."))
    ours = record("egresslaw.proxy", "see `--mode` in mitmproxy")  # egresslaw's own records are never rewritten
    assert f.filter(ours) and ours.getMessage() == "see `--mode` in mitmproxy"


def test_text_lines_carry_utc_timestamps():
    line = logs.TextFormatter().format(logging.LogRecord("egresslaw.proxy", logging.WARNING, "x", 1, "hello %s", ("you",), None))
    stamp, level, rest = line.split(" ", 2)
    assert UTC.match(stamp) and level == "WARNING" and rest == "egresslaw.proxy: hello you"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_proxy_configured_only_by_environment_logs_json_in_utc(tmp_path):
    e = make_env(tmp_path / "env")
    port, admin = free_port(), free_port()
    env = _clean_env(
        EGRESSLAW_ARTIFACT=str(e.artifact), EGRESSLAW_PROOF=str(e.proof), EGRESSLAW_KEYS=str(e.keys), EGRESSLAW_STORE=str(e.store),
        EGRESSLAW_LISTEN=f"127.0.0.1:{port}", EGRESSLAW_ADMIN=f"127.0.0.1:{admin}", EGRESSLAW_CONFDIR=str(e.confdir),
        EGRESSLAW_AUDIT_LOG=str(e.audit), EGRESSLAW_LOG_FORMAT="json", EGRESSLAW_RESOLVE="api.acme-test.dev=93.184.216.34",
        EGRESSLAW_WORKERS="1",
    )
    proc = subprocess.Popen([sys.executable, "-m", "egresslaw", "proxy"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head = []
    try:
        while not (head and "listening on" in head[-1]):  # logged once the signal handlers are in place
            line = proc.stderr.readline()
            assert line, "".join(head) + proc.stderr.read()
            head.append(line)
        assert _listening(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, rest = proc.communicate(timeout=30)
    err = "".join(head) + rest
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    assert all(UTC.match(r["ts"]) and r["level"] in logs.LEVELS and r["logger"] for r in records)
    messages = [(r["level"], r["message"]) for r in records]
    assert ("warning", "test routing --resolve `api.acme-test.dev=93.184.216.34` is active; never use it in production "
            "(recorded in every audit event)") in messages
    assert any(level == "info" and m.startswith(f"egresslaw proxy listening on 127.0.0.1:{port} (admin 127.0.0.1:{admin})") for level, m in messages)
    assert messages[-1] == ("info", "egresslaw proxy stopped; audit log flushed and closed by a signed checkpoint")
    assert_no_canary(out + err, "proxy logs")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_busy_port_is_reported_by_egresslaw_without_mitmproxy_advice(tmp_path, fmt):
    e = make_env(tmp_path / "env")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(e.artifact), "--proof", str(e.proof), "--keys", str(e.keys),
             "--store", str(e.store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{free_port()}", "--confdir", str(e.confdir),
             "--audit-log", str(e.audit), "--log-format", fmt],
            cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2
    assert "--mode" not in proc.stderr and "Try specifying" not in proc.stderr and "mitmproxy" not in proc.stderr
    assert f"cannot listen on `127.0.0.1:{port}`: address already in use" in proc.stderr
    if fmt == "json":
        (record,) = [json.loads(line) for line in proc.stderr.splitlines()]
        assert record["level"] == "error" and "EGRESSLAW_LISTEN" in record["help"]
    else:
        assert proc.stderr.splitlines()[-1].startswith("help: free it or choose another with `--listen HOST:PORT`")
