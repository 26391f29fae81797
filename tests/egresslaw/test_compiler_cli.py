"""The compiler's commands as users run them: exit codes, renderings, files written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egresslaw.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def demo(tmp_path):
    dest = tmp_path / "policy"
    shutil.copytree(DEMO, dest)
    (dest / "egresslaw.lock").unlink(missing_ok=True)
    return dest


def test_python_dash_m_works():
    proc = subprocess.run([sys.executable, "-m", "egresslaw", "check", str(DEMO)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"ok: {DEMO}: 5 file(s), 3 profile(s), 6 connection(s), 3 worker(s)\n"


def test_check_exit_codes(capsys, tmp_path):
    assert run(capsys, "check", str(DEMO))[0] == 0
    code, _, err = run(capsys, "check", str(ROOT / "policies" / "examples" / "EL0010-host-wildcard.egress"))
    assert code == 1 and "error[EL0010]" in err and "help:" in err and "^" in err
    code, _, err = run(capsys, "check", str(tmp_path / "missing"))
    assert code == 2 and "error[EL0035]" in err


def test_compile_writes_artifact_and_lock_then_locked_passes(capsys, demo, tmp_path):
    out = tmp_path / "build" / "egresslaw.json"
    code, stdout, _ = run(capsys, "compile", str(demo), "-o", str(out))
    assert code == 0 and "new      connection:github v1" in stdout
    artifact = json.loads(out.read_text())
    assert artifact["format"] == "egresslaw.artifact/1" and len(artifact["digest"]) == 64
    assert (demo / "egresslaw.lock").exists()
    assert run(capsys, "compile", str(demo), "-o", str(out), "--locked")[0] == 0


def test_locked_compile_exits_3_on_drift_and_names_the_hosts(capsys, demo, tmp_path):
    out = tmp_path / "a.json"
    assert run(capsys, "compile", str(demo), "-o", str(out))[0] == 0
    before = out.read_bytes()
    src = demo / "sandboxes.egress"
    src.write_text(src.read_text().replace('"codeload.github.com"', '"codeload.github.com", "objects.githubusercontent.com"'))
    code, _, err = run(capsys, "compile", str(demo), "-o", str(out), "--locked")
    assert code == 3
    assert "changed  sandbox_profile:package-builder v1 -> v2" in err and "+ objects.githubusercontent.com:443" in err
    assert out.read_bytes() == before  # --locked never writes


def test_locked_without_a_lock_is_drift(capsys, demo, tmp_path):
    assert run(capsys, "compile", str(demo), "-o", str(tmp_path / "a.json"), "--locked")[0] == 3


def test_malformed_lock_is_a_located_error(capsys, demo, tmp_path):
    (demo / "egresslaw.lock").write_text("{not json")
    code, _, err = run(capsys, "compile", str(demo), "-o", str(tmp_path / "a.json"))
    assert code == 1 and "error[EL0036]" in err and "help:" in err


def test_json_and_sarif_render_the_same_list(capsys):
    path = str(ROOT / "tests" / "golden" / "many-errors" / "input.egress")
    code, out, _ = run(capsys, "check", path, "--format", "json")
    assert code == 1
    diags = json.loads(out)["diagnostics"]
    code, out, _ = run(capsys, "check", path, "--format", "sarif")
    sarif = json.loads(out)
    assert sarif["version"] == "2.1.0"
    results = sarif["runs"][0]["results"]
    assert [r["ruleId"] for r in results] == [d["code"] for d in diags]
    rules = sarif["runs"][0]["tool"]["driver"]["rules"]
    for r in results:
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"]
        assert r["locations"][0]["physicalLocation"]["region"]["startLine"] >= 1
        assert len(r["partialFingerprints"]["egresslawDiagnostic/v1"]) == 64


def test_sarif_fingerprints_survive_a_line_shift(capsys, tmp_path):
    src = (ROOT / "policies" / "examples" / "EL0010-host-wildcard.egress").read_text()
    (tmp_path / "a.egress").write_text(src)
    _, first, _ = run(capsys, "check", str(tmp_path / "a.egress"), "--format", "sarif")
    (tmp_path / "a.egress").write_text(src.replace("\n\n", "\n\n\n\n", 1))
    _, second, _ = run(capsys, "check", str(tmp_path / "a.egress"), "--format", "sarif")
    fp = lambda out: json.loads(out)["runs"][0]["results"][0]["partialFingerprints"]
    line = lambda out: json.loads(out)["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"]
    assert fp(first) == fp(second) and line(first) != line(second)


def test_fmt_check_and_rewrite(capsys, tmp_path):
    f = tmp_path / "p.egress"
    f.write_text('egresslaw 1\nworkspace "w"\ncatalog "2026.11"\nworker "e" { ipv6: false, }\n')
    assert run(capsys, "fmt", "--check", str(f))[0] == 1
    assert run(capsys, "fmt", str(f))[0] == 0
    assert f.read_text().endswith('worker "e" {\n  ipv6 = false\n}\n')
    assert run(capsys, "fmt", "--check", str(f))[0] == 0


def test_fmt_never_touches_a_file_that_does_not_parse(capsys, tmp_path):
    f = tmp_path / "p.egress"
    f.write_text('egresslaw 1\nworker "e" { ipv6 = \n')
    code, _, err = run(capsys, "fmt", str(f))
    assert code == 2 and "error[EL0001]" in err
    assert f.read_text() == 'egresslaw 1\nworker "e" { ipv6 = \n'


def test_fmt_check_tells_would_reformat_from_does_not_parse(capsys, tmp_path):
    ugly = tmp_path / "ugly.egress"
    ugly.write_text('egresslaw 1\nworkspace "w"\ncatalog "2026.11"\nworker "e" { ipv6: false, }\n')
    broken = tmp_path / "broken.egress"
    broken.write_text('egresslaw 1\nworker "e" { ipv6 = \n')
    code, out, err = run(capsys, "fmt", "--check", str(ugly))
    assert (code, out, err) == (1, f"would reformat {ugly}\n", "")
    code, out, err = run(capsys, "fmt", "--check", str(broken))
    assert code == 2 and out == "" and f"{broken}:2:" in err and "error[EL0001]" in err
    code, out, err = run(capsys, "fmt", "--check", str(ugly), str(broken))  # both: the broken file decides
    assert code == 2 and out == f"would reformat {ugly}\n" and "error[EL0001]" in err
    code, out, _ = run(capsys, "fmt", str(ugly), str(broken))  # the good one is formatted, the broken one untouched
    assert code == 2 and out == f"formatted {ugly}\n" and broken.read_text() == 'egresslaw 1\nworker "e" { ipv6 = \n'
    assert run(capsys, "fmt", "--check", str(ugly))[0] == 0


def test_import_cma_json_and_yaml(capsys, tmp_path):
    env = {"name": "research env", "config": {"type": "cloud", "networking": {"type": "none"}}}
    (tmp_path / "env.json").write_text(json.dumps(env))
    code, out, _ = run(capsys, "import-cma", str(tmp_path / "env.json"))
    assert code == 0 and 'sandbox_profile "research-env"' in out
    (tmp_path / "out.egress").write_text(out)
    assert run(capsys, "check", str(tmp_path / "out.egress"))[0] == 0
    (tmp_path / "env.yaml").write_text(
        "name: crawler\nconfig:\n  networking:\n    type: limited\n    allowed_hosts: [api.github.com, 'deb.debian.org:80']\n    allow_package_managers: true\n"
    )
    code, out, _ = run(capsys, "import-cma", str(tmp_path / "env.yaml"))
    assert code == 0 and '"allowed_hosts": [' in out
    (tmp_path / "crawler.egress").write_text(out)
    # trust is deliberately not invented: the imported limited profile is adversarial until someone decides
    code, _, err = run(capsys, "check", str(tmp_path / "crawler.egress"))
    assert code == 1 and "error[EL0019]" in err


@pytest.mark.parametrize(
    "networking, message",
    [
        ({"type": "unrestricted"}, "`unrestricted`, which egresslaw refuses"),
        ({"type": "limited", "allowed_hosts": ["*.github.com"]}, "wildcard host `*.github.com`"),
    ],
)
def test_import_cma_refusals(capsys, tmp_path, networking, message):
    (tmp_path / "env.json").write_text(json.dumps({"networking": networking}))
    code, out, err = run(capsys, "import-cma", str(tmp_path / "env.json"))
    assert code == 1 and message in err and "help:" in err and out == ""


def test_show_prints_every_host_and_its_grant(capsys, demo, tmp_path):
    out = tmp_path / "a.json"
    run(capsys, "compile", str(demo), "-o", str(out))
    code, stdout, _ = run(capsys, "show", str(out))
    assert code == 0
    assert "registry.npmjs.org:443" in stdout and "granted by allow_package_managers:npm" in stdout
    assert "read-repos" in stdout and "GET|HEAD" in stdout


def test_tampered_artifact_is_refused(capsys, demo, tmp_path):
    out = tmp_path / "a.json"
    run(capsys, "compile", str(demo), "-o", str(out))
    out.write_text(out.read_text().replace("/repos/acme", "/repos"))
    code, _, err = run(capsys, "show", str(out))
    assert code == 2 and "digest does not match" in err


def test_garbage_arguments_never_traceback(tmp_path):
    (tmp_path / "bin.egress").write_bytes(b"\xff\xfe\x00garbage")
    for argv in (["check", str(tmp_path / "bin.egress")], ["compile", str(tmp_path)], ["show", str(tmp_path / "bin.egress")], ["import-cma", str(tmp_path / "bin.egress")]):
        proc = subprocess.run([sys.executable, "-m", "egresslaw", *argv], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode in (1, 2), argv
        assert "Traceback" not in proc.stderr, proc.stderr


def test_widening_needs_allow_widening_and_is_shown_with_an_example(capsys, demo, tmp_path):
    out = tmp_path / "a.json"
    assert run(capsys, "compile", str(demo), "-o", str(out))[0] == 0
    before = out.read_bytes()
    src = demo / "github.egress"
    src.write_text(src.read_text().replace('path_prefix = "/repos/acme/"', 'path_prefix = "/repos/"'))
    code, _, err = run(capsys, "compile", str(demo), "-o", str(out))
    assert code == 1 and "error[EL0037]" in err and "connection:github widens" in err
    assert "https://api.github.com/repos" in err and "old DENY" in err and "new ALLOW" in err
    assert out.read_bytes() == before
    code, stdout, _ = run(capsys, "compile", str(demo), "-o", str(out), "--allow-widening")
    assert code == 0 and "widening accepted: connection:github" in stdout
    assert "changed  connection:github v1 -> v2" in stdout


MCP_RULE = """
  egress "tools" {
    host = "api.github.com"
    path = "/mcp"
    methods = ["POST"]
    headers = ["Content-Type", "Accept"]
    mcp = { tools = { get_issue = { arguments = { repo = ["acme/app", "acme/web"] } } } }
  }
}
"""


def test_a_loosened_request_shape_is_a_widening_and_a_tightened_one_is_not(capsys, demo, tmp_path):
    """The prover's diff takes shapes as free inputs, so the compiler holds each changed rule's shapes to its
    published version's: a tool added or an enum value added needs `--allow-widening`; one removed does not."""
    out = tmp_path / "a.json"
    src = demo / "github.egress"
    text = src.read_text()
    first = text.index("\n}\n", text.index('connection "github"'))
    src.write_text(text[:first] + MCP_RULE + text[first + 3:])
    assert run(capsys, "compile", str(demo), "-o", str(out), "--allow-widening")[0] == 0
    base = src.read_text()
    for wider in (base.replace('["acme/app", "acme/web"] } } }', '["acme/app", "acme/web", "acme/x"] } } }'),
                  base.replace("} } } }", "} }, drop = {} } }")):
        src.write_text(wider)
        code, _, err = run(capsys, "compile", str(demo), "-o", str(out))
        assert code == 1 and "error[EL0037]" in err and "connection:github" in err and "rule `tools`" in err, err
    src.write_text(base.replace('["acme/app", "acme/web"]', '["acme/app"]'))
    code, _, err = run(capsys, "compile", str(demo), "-o", str(out))
    assert code == 0, err


def test_narrowing_needs_no_flag(capsys, demo, tmp_path):
    out = tmp_path / "a.json"
    assert run(capsys, "compile", str(demo), "-o", str(out))[0] == 0
    src = demo / "github.egress"
    src.write_text(src.read_text().replace('methods = ["GET", "HEAD"]', 'methods = ["GET"]'))
    code, stdout, err = run(capsys, "compile", str(demo), "-o", str(out))
    assert code == 0, err
    assert "changed  connection:github v1 -> v2" in stdout and "widening" not in stdout


def test_show_prints_what_each_request_shape_admits(capsys, tmp_path):
    out, policy = tmp_path / "a.json", tmp_path / "shapes"
    shutil.copytree(ROOT / "tests" / "golden" / "shapes", policy)  # compile writes its lock beside the policy
    assert run(capsys, "compile", str(policy), "-o", str(out))[0] == 0
    code, stdout, _ = run(capsys, "show", str(out))
    assert code == 0
    for line in ('https://api.github.com:443/repos/{owner: "acme"}/{repo: "app"|"web"}/issues/{number: integer 1..1000000}',
                 'query: per_page=integer 1..100, state="closed"|"open"',
                 'header x-github-api-version: "2022-11-28"',
                 'mcp tool get_issue(number=integer 1.., repo="acme/app"|"acme/web")  [required number, repo]',
                 "graphql query: repository, viewer", "graphql introspection: refused",
                 "git fetch: yes; push: refs/heads/agent/*; create yes; delete no"):
        assert line in stdout, line
