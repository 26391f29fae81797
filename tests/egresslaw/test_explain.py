"""`egresslaw explain`: the decision, rule and reason for one request, as users run it."""

from __future__ import annotations

import json

import pytest

from egresslaw.cli import main
from tests.egress_proxy.builders import artifact, connection, profile, rule, worker

ART = artifact(
    workers=[worker("edge", deny_cidrs=("140.82.113.0/24",))],
    connections=[
        connection("github", [rule("read-repos", "api.github.com", "/repos/acme/", ["GET", "HEAD"], ["accept"]),
                              rule("open-issues", "api.github.com", "/repos/acme/app/issues", ["POST"], ["content-type"])]),
        connection("edgy", [rule("r", "api.github.com", "/", ["GET"])], worker="edge"),
    ],
    profiles=[profile("ci", [("deb.debian.org", 80), ("pypi.org", 443)])],
)


@pytest.fixture
def art(tmp_path):
    path = tmp_path / "egresslaw.json"
    path.write_text(ART.to_json())
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_allow_prints_rule_headers_and_inject(capsys, art):
    code, out, _ = run(capsys, "explain", art, "--connection", "github", "GET https://api.github.com/repos/acme/app?page=2",
                       "-H", "Accept: application/json", "-H", "Authorization: Bearer caller", "--resolve", "140.82.112.6")
    assert code == 0
    assert "decision: allow" in out and "rule: read-repos" in out and "path: /repos/acme/app\n" in out
    assert "forward headers: Accept\n" in out and "inject header: Authorization" in out
    assert "addresses: judged `140.82.112.6`" in out
    assert "caller" not in out  # header values are never printed


def test_without_resolve_the_address_check_is_skipped_and_said(capsys, art):
    code, out, _ = run(capsys, "explain", art, "--connection", "github", "GET https://api.github.com/repos/acme/app")
    assert code == 0
    assert "addresses: not checked" in out


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--connection", "github", "GET https://api.github.com/repos/acmex/app"], "path-not-allowed"),
        (["--connection", "github", "POST https://api.github.com/repos/acme/app"], "method-not-allowed"),
        (["--connection", "github", "GET http://api.github.com/repos/acme/app"], "scheme-not-allowed"),
        (["--connection", "github", "GET https://api.github.com/repos/acme/%2e%2e/x"], "path-encoded-dot"),
        (["--connection", "github", "GET https://0x7f.0.0.1/repos/acme/app"], "host-noncanonical-ip"),
        (["--connection", "github", "GET https://api.github.com:8443/repos/acme/app"], "no-matching-rule"),
        (["--connection", "github", "GET https://api.github.com/repos/acme/app", "-H", "Host: evil.com"], "host-header-mismatch"),
        (["--connection", "github", "GET https://api.github.com/repos/acme/app", "--body"], "body-on-bodyless-method"),
        (["--connection", "github", "GET https://api.github.com/repos/acme/app", "--resolve", "::ffff:169.254.169.254"], "address-not-public"),
        (["--connection", "github", "GET https://api.github.com/repos/acme/app", "--resolve", "8.8.8.8", "--resolve", "100.64.0.1"], "address-not-public"),
        (["--connection", "edgy", "GET https://api.github.com/", "--resolve", "140.82.113.3"], "address-denied"),
        (["--profile", "ci", "deb.debian.org:443"], "profile-host-not-allowed"),
        (["--profile", "ci", "deb.debian.org:80", "--resolve", "10.0.0.1"], "address-not-public"),
        (["--connection", "github", "api.github.com:80"], "no-matching-rule"),
    ],
)
def test_deny_exits_1_with_the_reason(capsys, art, argv, reason):
    code, out, _ = run(capsys, "explain", art, *argv)
    assert code == 1
    assert f"reason: {reason} (" in out
    assert "decision: deny" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--profile", "ci", "deb.debian.org:80"],
        ["--profile", "ci", "GET http://deb.debian.org/debian/dists/stable/Release", "--resolve", "151.101.2.132"],
        ["--connection", "github", "api.github.com:443"],
        ["--connection", "github", "POST https://api.github.com/repos/acme/app/issues", "--body", "-H", "Content-Type: application/json"],
    ],
)
def test_allow_exits_0(capsys, art, argv):
    code, out, _ = run(capsys, "explain", art, *argv)
    assert code == 0, out
    assert "decision: allow" in out


def test_json_rendering(capsys, art):
    code, out, _ = run(capsys, "explain", art, "--connection", "github", "GET https://api.github.com/repos/acmex", "--format", "json")
    assert code == 1
    doc = json.loads(out)
    assert doc["decision"] == "deny" and doc["reason"] == "path-not-allowed" and doc["rule"] is None
    assert doc["addresses_checked"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--connection", "nope", "GET https://api.github.com/"], "connection `nope` is not in the artifact"),
        (["--profile", "nope", "pypi.org:443"], "profile `nope` is not in the artifact"),
        (["--connection", "github", "GET api.github.com/x"], "is not an absolute URL"),
        (["--connection", "github", "GET https://api.github.com:https/"], "has an invalid port"),
        (["--profile", "ci", "pypi.org"], "has no port"),
        (["--connection", "github", "GET https://api.github.com/", "-H", "NoColon"], "is not `Name: value`"),
    ],
)
def test_usage_errors_exit_2(capsys, art, argv, message):
    code, _, err = run(capsys, "explain", art, *argv)
    assert code == 2
    assert message in err


def test_missing_or_tampered_artifact_exits_2(capsys, tmp_path, art):
    code, _, err = run(capsys, "explain", str(tmp_path / "missing.json"), "--profile", "ci", "pypi.org:443")
    assert code == 2 and "does not exist" in err
    tampered = tmp_path / "tampered.json"
    tampered.write_text(ART.to_json().replace("/repos/acme/", "/repos/"))
    code, _, err = run(capsys, "explain", str(tampered), "--profile", "ci", "pypi.org:443")
    assert code == 2 and "digest" in err


def test_subject_is_required(capsys, art):
    with pytest.raises(SystemExit) as exc:
        main(["explain", art, "GET https://api.github.com/"])
    assert exc.value.code == 2


BROKERING = artifact(
    workers=[worker("edge", deny_cidrs=("140.82.113.0/24",))],
    connections=[connection("github-read", [rule("git-refs", "github.com", "/acme", ["GET", "HEAD"], ["git-protocol"]),
                                            rule("git-fetch", "github.com", "/acme/app.git/git-upload-pack", ["POST"], ["content-type"])],
                            worker="edge", inject_format="Basic {secret}")],
    profiles=[profile("ci", [("github.com", 443)], brokers=("github-read",))],
)


@pytest.mark.parametrize(
    ("request_line", "rule", "broker", "inject"),
    [
        ("GET https://github.com/acme/app.git/info/refs?service=git-upload-pack", "git-refs", "github-read", "Authorization"),
        ("POST https://github.com/acme/app.git/git-upload-pack", "git-fetch", "github-read", "Authorization"),
        ("POST https://github.com/acme/app.git/git-receive-pack", None, None, None),  # a push: plain traffic, no credential
        ("GET https://github.com/acmex/app", None, None, None),
    ],
)
def test_a_profile_request_shows_the_connection_and_rule_that_broker_it(capsys, tmp_path, request_line, rule, broker, inject):
    path = tmp_path / "egresslaw.json"
    path.write_text(BROKERING.to_json())
    code, out, _ = run(capsys, "explain", str(path), "--profile", "ci", request_line, "-H", "Git-Protocol: version=2", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and (doc["rule"], doc["broker"], doc["inject_header"]) == (rule, broker, inject)
    code, out, _ = run(capsys, "explain", str(path), "--profile", "ci", request_line)
    assert (f"brokered by: connection `{broker}`" in out) == (broker is not None)
    # brokered traffic is judged by the connection's worker (`edge` denies this address; `default` would not)
    code, out, _ = run(capsys, "explain", str(path), "--profile", "ci", request_line, "--resolve", "140.82.113.4")
    assert code == (1 if broker else 0)


def test_a_shaped_body_is_judged_from_data_as_the_edge_does(capsys, tmp_path):
    """`--data FILE` runs the body's judgement (`adapter.judge_body`); without it, a rule that judges bodies says so."""
    from compiler.artifact import Mcp, Param, Tool, Value

    tools = Mcp(methods=("tools/call",), tools=(Tool(name="get_issue", arguments=(Param(name="repo", value=Value(enum=("acme/app",))),)),))
    mcp = rule("tools", "mcp.example.com", "/mcp", ["POST"], ["content-type"]).model_copy(update={"mcp": tools})
    path = tmp_path / "a.json"
    path.write_text(artifact(connections=[connection("mcp", [mcp])]).to_json())
    argv = [str(path), "--connection", "mcp", "POST https://mcp.example.com/mcp", "-H", "Content-Type: application/json"]
    code, _, err = run(capsys, "explain", *argv)
    assert code == 2 and "rule `tools` judges the mcp body" in err and "--data" in err
    body = tmp_path / "call.json"
    for repo, want in (("acme/app", (0, "decision: allow")), ("acme/evil", (1, "reason: mcp-argument-refused"))):
        body.write_text(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                    "params": {"name": "get_issue", "arguments": {"repo": repo}}}))
        code, stdout, _ = run(capsys, "explain", *argv, "--data", str(body))
        assert (code, want[1] in stdout) == (want[0], True), stdout
    assert "detail: rule `tools`: tool=get_issue path=$.repo: not one of the allowed values" in stdout
    assert "acme/evil" not in stdout  # the place, never the value
    code, _, err = run(capsys, "explain", *argv, "--data", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read the body" in err
