"""The pure parts of egress_proxy/edge/limits.py: sizes, per-subject body limits, judging a head as bytes, and how
bad limit values are refused (options, EdgeConfig, CLI). The limits against the real proxy: tests/conformance."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mitmproxy import http

from egress_proxy.decision.reasons import REASONS
from egress_proxy.edge.limits import (
    LimitConfig,
    LimitError,
    head_problem,
    limit_config,
    parse_body_limits,
    parse_size,
    request_problem,
)

ROOT = Path(__file__).resolve().parents[3]
CFG = LimitConfig(max_head_bytes=200, max_headers=3, max_request_line=50)


@pytest.mark.parametrize(("text", "value"), [("65536", 65536), ("64k", 65536), ("64K", 65536), ("64m", 64 << 20), ("1g", 1 << 30),
                                             ("8KiB", 8192), ("2 MB", 2 << 20), (512, 512)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "-1", "12q", "1.5m", "k", "m64"])
def test_bad_sizes(text):
    with pytest.raises(LimitError):
        parse_size(text)


def test_body_limit_per_connection_and_rule():
    cfg = LimitConfig(max_body=100, max_body_for=parse_body_limits(["github=10", "github/issues=5", "ci=7"]))
    assert cfg.body_limit("github", "issues") == 5
    assert cfg.body_limit("github", "read") == 10
    assert cfg.body_limit("ci", None) == 7
    assert cfg.body_limit("other", "x") == 100
    assert cfg.body_limit(None, None) == 100


@pytest.mark.parametrize("entry", ["github", "github=", "=5", "github/=5", "github=5x"])
def test_bad_body_limits(entry):
    with pytest.raises(LimitError, match="max-body-for"):
        parse_body_limits([entry])


@pytest.mark.parametrize(("data", "expected"), [
    (b"GET / HTTP/1.1\r\nA: 1\r\n\r\n", (0, "", True)),
    (b"GET / HTTP/1.1\r\nA: 1\r\n", (0, "", False)),
    (b"GET / HTTP/1.1\nA: 1\n\n", (0, "", True)),  # bare LF, as h11 reads it
    (b"GET /" + b"a" * 50 + b" HTTP/1.1\r\n\r\n", (414, "request-line-too-long", False)),
    (b"GET /" + b"a" * 60, (414, "request-line-too-long", False)),  # known before the line ends
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 200, (431, "head-too-large", False)),
    (b"GET / HTTP/1.1\r\n" + b"A: 1\r\n" * 4 + b"\r\n", (431, "too-many-headers", True)),
    (b"GET / HTTP/1.1\r\n" + b"A: 1\r\n" * 5, (431, "too-many-headers", False)),  # known before the head ends
    (b"GET / HTTP/1.1\r\n" + b"A: 1\r\n" * 3 + b"\r\nBODY" + b"x" * 500, (0, "", True)),  # the body is not the head
])
def test_head_problem(data, expected):
    assert head_problem(data, CFG) == expected


def test_request_problem_on_parsed_heads():
    ok = http.Request.make("GET", "https://a.test/x", headers={"a": "1"})
    assert request_problem(ok, CFG) is None
    assert request_problem(http.Request.make("GET", "https://a.test/" + "x" * 60), CFG) == (414, "request-line-too-long")
    many = http.Request.make("GET", "https://a.test/", headers=[(f"h{i}".encode(), b"1") for i in range(4)])
    assert request_problem(many, CFG) == (431, "too-many-headers")
    assert request_problem(http.Request.make("GET", "https://a.test/", headers={"a": "b" * 200}), CFG) == (431, "head-too-large")


def test_limit_config_refuses_bad_values():
    good = dict(max_head_bytes="64k", max_headers=100, max_request_line=8192, max_body="64m", max_body_for=[],
                max_connections_per_client=128, max_connections=0, header_timeout=10.0)
    assert limit_config(**good) == LimitConfig()
    for field, value in [("max_headers", 0), ("max_connections_per_client", -1), ("max_connections", -1), ("header_timeout", 0),
                         ("max_head_bytes", "big"), ("max_body", "0")]:
        with pytest.raises(LimitError):
            limit_config(**{**good, field: value})


def test_every_limit_reason_is_documented():
    readme = (ROOT / "docs" / "reference.md").read_text()  # the reason table
    for code in ("head-too-large", "too-many-headers", "request-line-too-long", "body-too-large", "header-timeout",
                 "too-many-connections", "proxy-at-capacity", "fd-exhausted"):
        assert code in REASONS
        assert f"| `{code}` |" in readme


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-body", "12q"], "--max-body"),  # argparse
    (["--max-body-for", "github"], "--max-body-for"),  # limit_config, before the artifact is read
    (["--idle-timeout", "0"], "--idle-timeout"),  # EdgeConfig
])
def test_cli_refuses_bad_limits_with_exit_2(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, "-m", "egresslaw", "proxy", "--artifact", str(tmp_path / "a.json"), "--proof", str(tmp_path / "p.json"),
                           "--keys", str(tmp_path), *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_descriptor_limit_is_raised_and_the_connection_ceiling_follows_it():
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))\n"
        "from egress_proxy.edge.limits import auto_connection_ceiling, raise_descriptor_limit\n"
        "low = auto_connection_ceiling()\n"
        "raised = raise_descriptor_limit()\n"
        "print(low, raised, min(hard, 1 << 20), auto_connection_ceiling())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    low, raised, expected, high = map(int, out)
    assert low == (200 - 64) // 2
    assert raised == expected and high == (expected - 64) // 2


def test_bounds_are_checked_by_kind():
    cfg = limit_config(max_head_bytes="64k", max_headers=100, max_request_line=8192, max_body="64m", max_body_for=[],
                       max_connections_per_client=128, max_connections=0, header_timeout=10.0,
                       stream_buffer="128k", stall_timeout=2, max_streams=10)
    assert (cfg.stream_buffer, cfg.stall_timeout, cfg.max_streams) == (128 * 1024, 2.0, 10)
    assert cfg.max_held == LimitConfig().max_held  # unset: its default
    base = dict(max_head_bytes="64k", max_headers=100, max_request_line=8192, max_body="64m", max_body_for=[],
                max_connections_per_client=128, max_connections=0, header_timeout=10.0)
    for field, value, flag in [("stream_buffer", "0", "--stream-buffer"), ("stall_timeout", float("inf"), "--stall-timeout"),
                               ("max_streams", 0, "--max-streams"), ("max_held", "lots", "--max-held"), ("no_such_bound", 1, "no_such_bound")]:
        with pytest.raises(LimitError, match=flag):
            limit_config(**base, **{field: value})


def test_response_heads_are_judged_by_lines_count_and_size():
    from egress_proxy.edge.layers import response_head_problem, unparsed_problem

    cfg = LimitConfig(max_response_head=1024, max_response_headers=5, max_response_line=100)
    head = [b"HTTP/1.1 200 OK", *(b"X-A: 1" for _ in range(5))]
    assert response_head_problem(head, cfg) is None
    assert response_head_problem([*head, b"X-B: 1"], cfg) == "response-head-too-large"  # six fields
    assert response_head_problem([b"HTTP/1.1 200 OK", b"X-A: " + b"a" * 100], cfg) == "response-line-too-long"
    assert response_head_problem([b"HTTP/1.1 200 OK", *(b"X-" + b"a" * 90 for _ in range(5)), b""], LimitConfig(
        max_response_head=400, max_response_headers=5, max_response_line=100)) == "response-head-too-large"
    # Unparsed bytes, as they arrive: a head not ended yet, then what a body reader left (a chunk-size line, trailers).
    assert unparsed_problem(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 100, True, cfg) == "response-line-too-long"
    assert unparsed_problem(b"HTTP/1.1 200 OK\r\n" + b"X: 1\r\n" * 6, True, cfg) == "response-head-too-large"
    assert unparsed_problem(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 90, True, cfg) is None
    assert unparsed_problem(b"f" * 102, False, cfg) == "response-line-too-long"
    assert unparsed_problem(b"X-T: 1\r\n" * 200, False, cfg) == "response-head-too-large"
    assert unparsed_problem(b"", False, cfg) is None
