"""examples/clients-demo.sh runs (a real pip install and npm install through the proxy), and the README's
walk-through shows that script's own commands and what it prints."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "clients-demo.sh"


def _readme_block(name: str = "clients-demo") -> list[str]:
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    block = text.split(f"<!-- {name}: begin -->", 1)[1].split(f"<!-- {name}: end -->", 1)[0]
    return [line for line in block.strip().strip("`").strip().splitlines() if line.strip()]


@pytest.mark.parametrize(("name", "least"), [("clients-demo", 9), ("clients-demo-broker", 8)])
def test_the_readme_shows_the_scripts_own_commands(name, least):
    script = {line.strip() for line in SCRIPT.read_text().splitlines()}
    block = _readme_block(name)
    assert len(block) >= least
    assert [line for line in block if line.strip() not in script] == []


@pytest.mark.skipif(not all(shutil.which(t) for t in ("npm", "git", "bash")), reason="npm, git and bash are needed")
def test_the_demo_script_installs_with_pip_and_npm_through_the_proxy(tmp_path):
    venv = Path(sys.executable).parent.parent
    env = {**{k: v for k, v in os.environ.items() if "proxy" not in k.lower()}, "VENV": str(venv)}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "demo")], capture_output=True, text=True, env=env, timeout=600,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "Successfully installed egresslaw-demo-1.0.0" in out and "added 2 packages" in out
    assert re.search(r"ok: `.*audit\.jsonl`: \d+ lines in 1 segment\(s\), every line checks, closed by its checkpoint", out)
    work = tmp_path / "demo"
    assert (work / "sandbox" / "site" / "egresslaw_demo" / "__init__.py").is_file()
    assert (work / "sandbox" / "project" / "node_modules" / "@acme" / "el-demo-scoped" / "package.json").is_file()
    events = [json.loads(line) for line in (work / "audit.jsonl").read_text().splitlines()]
    traffic = [e for e in events if e.get("kind") in ("connect", "request")]
    packages = [e for e in traffic if e["subject"] == "demo-sandbox"]
    assert packages and all(e["decision"] == "allow" for e in packages)
    assert {e["host"] for e in packages} == {"pypi.org", "files.pythonhosted.org", "registry.npmjs.org"}
    # the brokered step: git's first CONNECT offers no lease (libcurl answers the 407); every request is brokered
    brokered = [e for e in traffic if e["subject"] == "demo-ci" and e["kind"] == "request"]
    assert {(e["host"], e["broker"], e["rule"]) for e in brokered} == {
        ("github.com", "github-read", "git-refs"), ("github.com", "github-read", "git-fetch"),
        ("api.github.com", "github-read", "api-read")}
    assert all(e["decision"] == "allow" for e in traffic if e["subject"] is not None)
    assert "a private repository, cloned with a brokered credential the sandbox never held" in out
    assert '"authorization": "Basic [REDACTED]"' in out and "the sandbox holds no token" in out
    # The lease is in the sandbox's env file (it must be) and nowhere in what the script showed or logged.
    for env_file in (work / "sandbox" / "env.sh", work / "ci" / "env.sh"):
        lease = env_file.read_text().split("HTTPS_PROXY=http://egresslaw:")[1].split("@")[0]
        for where in (out, done.stderr, (work / "proxy.log").read_text(), (work / "audit.jsonl").read_text()):
            assert lease not in where and lease.split(".")[2] not in where
    # neither demo token is in anything the script showed or logged, nor anywhere in the brokering sandbox
    script = SCRIPT.read_text()
    tokens = [script.split(marker, 1)[1].split('"', 1)[0] for marker in ('printf %s "', 'TOKEN="')]
    assert all(t.startswith("ghp_Demo") for t in tokens)
    sandbox = b"".join(f.read_bytes() for f in (work / "ci").rglob("*") if f.is_file())
    for token in tokens:
        for where in (out, done.stderr, (work / "proxy.log").read_text(), (work / "audit.jsonl").read_text()):
            assert token not in where
        assert token.encode() not in sandbox
    # The variables the README says sandbox-env prints are the ones it printed.
    printed = set(re.findall(r"^export ([A-Za-z_]+)=", (work / "sandbox" / "env.sh").read_text(), flags=re.M))
    readme = (ROOT / "docs" / "walkthrough.md").read_text().split("What it prints", 1)[1].split("```", 2)[1]
    shown = set(re.findall(r"(?:^export |  )([A-Za-z_]+)=", readme, flags=re.M))
    assert shown == printed


PROXY_DEMO = ROOT / "examples" / "proxy-demo.sh"


@pytest.mark.skipif(not all(shutil.which(t) for t in ("curl", "bash")), reason="curl and bash are needed")
def test_readme_section_3_runs_as_written_against_a_local_stand_in(tmp_path):
    """`make proxy-demo`: the README's section-3 block, run verbatim (only the ports moved to free ones, so a busy
    8080 cannot fail the suite): the stand-in for api.github.com received the sealed token, curl's output holds it
    nowhere (the echo is redacted), the proxy drained on `kill %1`, and every audit chain verifies."""
    from tests.proxy_harness import free_port

    venv = Path(sys.executable).parent.parent
    env = {**{k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("EGRESSLAW_")},
           "VENV": str(venv), "PROXY_DEMO_LISTEN": f"127.0.0.1:{free_port()}", "PROXY_DEMO_ADMIN": f"127.0.0.1:{free_port()}"}
    work = tmp_path / "demo"
    done = subprocess.run(["bash", str(PROXY_DEMO), str(work)], capture_output=True, text=True, env=env, timeout=600,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    # what ran is README section 3's block, line for line (ports aside)
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    (block,) = re.findall(r"```sh\n(.*?)```", text[text.index("### 3. Run the egress proxy"):text.index("### 4.")], re.S)
    ran = (work / "section3.sh").read_text()
    assert ran.replace(env["PROXY_DEMO_LISTEN"], "127.0.0.1:8080").replace(env["PROXY_DEMO_ADMIN"], "127.0.0.1:9090").strip() == block.strip()
    # the upstream got `Bearer <token>`; what reached the client is redacted, in the body and the echo header alike
    echo = json.loads(out[out.index('{"path": "/repos/acme/app"'):].split("}", 1)[0] + "}")
    assert echo == {"path": "/repos/acme/app", "authorization": "Bearer [REDACTED]", "b64": "[REDACTED]"}
    assert re.search(r"2 logs, each its own chain: 2 intact, 0 open, 0 broken|1 logs?, .*1 intact, 0 open, 0 broken", out), out[-2000:]
    events = [json.loads(line) for log in sorted(work.glob("audit*.jsonl")) for line in log.read_text().splitlines()]
    requests = [e for e in events if e.get("kind") == "request"]
    assert [(e["decision"], e["subject"], e["host"], e["path"], e["rule"]) for e in requests] == [
        ("allow", "agent-7", "api.github.com", "/repos/acme/app", "read-repos")]
    token = PROXY_DEMO.read_text().split('GITHUB_TOKEN="', 1)[1].split('"', 1)[0]
    assert token.startswith("ghp_ProxyDemo")
    for where in (out, done.stderr, *(log.read_text() for log in work.glob("audit*.jsonl")), (work / "custody.db").read_bytes().decode("latin-1")):
        assert token not in where
