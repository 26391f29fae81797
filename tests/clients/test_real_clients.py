"""Real, unchanged clients through the real proxy, configured only by `egresslaw sandbox-env`'s output.

The policy is policies/demo (compiled here): the `package-builder` profile (pip and npm hosts) for the
package managers, `trusted-ci` (github.com) for git, the `github` connection for the credentialed call, and
`trusted-ci`'s brokered connection `github-read` for a `git clone` of a private repository and an
authenticated `curl`, with a profile lease only.
The services are the local stand-ins of tests/clients/standins.py under their real names; the proxy runs
in-process with test routing (names resolve to public-looking addresses that are never dialled, the
vetted connection goes to 127.0.0.1). Each client runs in a subprocess whose environment is a bare
PATH/HOME/LANG plus what `sandbox-env` printed, nothing else (tests/clients/world.py). yarn 1, which needs
catalog 2026.12, is in tests/clients/test_yarn.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.clients import standins as si
from tests.clients.world import (
    BROKERED_AUTH,
    allowed_hosts,
    assert_no_secret,
    close,
    demo_artifact,
    ok,
    serve,
)
from tests.proxy_harness import CANARY, assert_no_canary

pytestmark = pytest.mark.slow

TOOLS = {name: shutil.which(name) for name in ("curl", "npm", "git", "bash", "wget")}


def _need(*names: str):
    missing = [n for n in names if TOOLS[n] is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Stand-ins, the demo artifact, keys + custody (the canary as the github credential), the proxy."""
    root = tmp_path_factory.mktemp("clients")
    if TOOLS["npm"] is None or TOOLS["git"] is None:
        pytest.skip("npm and git are needed to build the stand-ins' packages")
    services = si.start(root / "standins", git_auth=BROKERED_AUTH)
    world = serve(root, services, demo_artifact(root))
    yield world
    services.stop()
    close(world)


# ---------------------------------------------------------------------------------------------
# curl, python requests / httpx / urllib
# ---------------------------------------------------------------------------------------------


@_need("curl", "bash")
def test_curl_from_the_export_lines(world):
    exports, home = world.sandbox_env("--profile", "package-builder", fmt="export")
    world.leases.append(exports.split("HTTPS_PROXY=")[1].split(":", 2)[2].split("@")[0])
    (home / "env.sh").write_text(exports)
    done = world.run(["bash", "-c", f'. {home}/env.sh && curl -sS --max-time 20 https://pypi.org/simple/{si.WHEEL_NAME}/'], {}, home)
    assert si.WHEEL_FILE in ok(done)
    assert allowed_hosts(world, f"sandbox-{world._n}") == {"pypi.org"}


@_need("wget")
def test_wget_trusts_the_proxy_ca_through_the_wgetrc(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    subject = f"sandbox-{world._n}"
    url = f"https://pypi.org/simple/{si.WHEEL_NAME}/"
    assert not (home / ".wgetrc").exists()  # wget reads ~/.wgetrc without WGETRC: the check below would prove nothing
    assert si.WHEEL_FILE in ok(world.run(["wget", "-nv", "-O-", url], env, home))
    assert allowed_hosts(world, subject) == {"pypi.org"}
    # the same environment without WGETRC: the proxy allows the CONNECT, wget refuses the proxy's certificate
    mark, before = world.proxy.mark(), len(world.services.requests_to("pypi.org"))
    done = world.run(["wget", "-nv", "-O-", url], {k: v for k, v in env.items() if k != "WGETRC"}, home)
    assert done.returncode == 5, (done.returncode, done.stderr[-2000:])  # 5: wget's status for a failed TLS verification
    assert b"certificate" in done.stderr and si.WHEEL_FILE.encode() not in done.stdout
    decided = [(e["kind"], e["decision"]) for e in world.proxy.new_events(mark) if e["kind"] in ("connect", "request")]
    assert decided == [("connect", "allow")]  # no request inside the tunnel: TLS failed first
    assert world.services.requests_to("pypi.org")[before:] == []


@pytest.mark.parametrize(
    "program",
    [
        "import requests; r = requests.get(URL, timeout=20); r.raise_for_status(); print(r.text)",
        "import httpx; r = httpx.get(URL, timeout=20); r.raise_for_status(); print(r.text)",
        "import urllib.request; print(urllib.request.urlopen(URL, timeout=20).read().decode())",
    ],
    ids=["requests", "httpx", "urllib"],
)
def test_python_clients_from_the_environment(world, program):
    env, home = world.sandbox_env("--profile", "package-builder")
    url = f"https://pypi.org/simple/{si.WHEEL_NAME}/"
    done = world.run([sys.executable, "-c", f"URL = {url!r}\n{program}"], env, home)
    assert si.WHEEL_FILE in ok(done)
    assert allowed_hosts(world, f"sandbox-{world._n}") == {"pypi.org"}


# ---------------------------------------------------------------------------------------------
# Package managers and git, with a sandbox-profile lease
# ---------------------------------------------------------------------------------------------


def test_pip_download_and_install_a_wheel(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    ok(world.run([*pip, "download", "--no-deps", "-d", str(home / "dl"), si.WHEEL_NAME], env, home))
    assert (home / "dl" / si.WHEEL_FILE).is_file()
    ok(world.run([*pip, "install", "--no-deps", "--target", str(home / "site"), si.WHEEL_NAME], env, home))
    done = world.run([sys.executable, "-c", "import egresslaw_demo; print(egresslaw_demo.VALUE)"], {"PYTHONPATH": str(home / "site")}, home)
    assert ok(done).strip() == si.WHEEL_VALUE
    assert allowed_hosts(world, f"sandbox-{world._n}") == {"pypi.org", "files.pythonhosted.org"}


@_need("npm")
def test_npm_install_a_plain_and_a_scoped_package(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    project = home / "project"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "sandbox-project", "version": "1.0.0", "private": True}))
    ok(world.run(["npm", "install", si.NPM_SCOPED, si.NPM_PLAIN], env, home, cwd=project))
    for name in (si.NPM_SCOPED, si.NPM_PLAIN):
        assert json.loads((project / "node_modules" / name / "package.json").read_text())["version"] == "1.0.0"
    done = world.run(["node", "-e", f"console.log(require({si.NPM_SCOPED!r}))"], {}, home, cwd=project)
    assert ok(done).strip() == f"{si.NPM_SCOPED} through the egress proxy"
    paths = {h.path for h in world.services.requests_to("registry.npmjs.org")}
    assert "/@acme%2fel-demo-scoped" in {p.lower() for p in paths}  # npm's scoped spelling passed the profile unchanged
    assert allowed_hosts(world, f"sandbox-{world._n}") == {"registry.npmjs.org"}


@_need("git")
def test_git_clone_over_smart_http(world):
    env, home = world.sandbox_env("--profile", "trusted-ci")
    mark = world.proxy.mark()
    ok(world.run(["git", "clone", "-q", f"https://github.com/{si.GIT_REPO}", str(home / "clone")], env, home))
    assert (home / "clone" / si.GIT_FILE).read_text() == si.GIT_TEXT
    assert allowed_hosts(world, f"sandbox-{world._n}") == {"github.com"}
    # git asks libcurl for any proxy auth scheme, so it first sends no credentials and answers the 407's
    # Basic challenge: the only denials are lease-missing with nothing offered, and they come first.
    connects = [(e["decision"], e["reason"], e.get("auth")) for e in world.proxy.new_events(mark) if e["kind"] == "connect"]
    assert connects[-1] == ("allow", "allowed", None) and set(connects[:-1]) <= {("deny", "lease-missing", "none")}, connects


def test_a_profile_lease_cannot_reach_a_host_outside_its_profile(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    program = "import requests\ntry:\n    requests.get('https://github.com/', timeout=20)\nexcept requests.exceptions.ProxyError as e:\n    print('refused', e.__class__.__name__)"
    assert ok(world.run([sys.executable, "-c", program], env, home)).startswith("refused")
    [event] = world.events(f"sandbox-{world._n}")
    assert (event["host"], event["decision"], event["reason"]) == ("github.com", "deny", "profile-host-not-allowed")


# ---------------------------------------------------------------------------------------------
# A credentialed connection call: one injected credential upstream, a redacted echo back
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["curl", "requests"])
def test_connection_call_gets_exactly_one_credential_and_a_redacted_echo(world, client):
    if client == "curl" and TOOLS["curl"] is None:
        pytest.skip("curl is not installed")
    env, home = world.sandbox_env("--connection", "github")
    url = f"https://api.github.com/repos/acme/app/{client}"
    before = len(world.services.requests_to("api.github.com"))
    if client == "curl":
        cmd = ["curl", "-sS", "--max-time", "20", "-H", "Authorization: Bearer sandbox-own", "-H", "Accept: application/json", url]
    else:
        cmd = [sys.executable, "-c", f"import requests; print(requests.get({url!r}, headers={{'Authorization': 'Bearer sandbox-own'}}, timeout=20).text)"]
    echo = json.loads(ok(world.run(cmd, env, home)))
    assert echo["authorization"] == "Bearer [REDACTED]" and echo["b64"] == "[REDACTED]"
    hits = world.services.requests_to("api.github.com")[before:]
    assert len(hits) == 1 and hits[0].all("Authorization") == [f"Bearer {CANARY}"]
    assert not any(k.lower().startswith("proxy-") for k, _ in hits[0].headers)
    [event] = [e for e in world.events(f"sandbox-{world._n}") if e["kind"] == "request"]
    assert (event["connection"], event["rule"], event["redactions"]) == ("github", "read-repos", 3)
    assert_no_canary(json.dumps(echo), "the client's answer")


# ---------------------------------------------------------------------------------------------
# Brokering: a profile lease only, the credential injected at the edge for matching requests
# ---------------------------------------------------------------------------------------------


def _sandbox_files(home: Path) -> bytes:
    """Everything the sandbox holds on disk (its HOME: the clone, .git/config, the env file, the CA bundle)."""
    return b"".join(f.read_bytes() for f in sorted(home.rglob("*")) if f.is_file())


@_need("git")
def test_git_clone_of_a_private_repository_with_a_brokered_credential(world):
    env, home = world.sandbox_env("--profile", "trusted-ci")
    assert_no_secret(json.dumps(env), "the sandbox's environment")
    before = len(world.services.requests_to("github.com"))
    mark = world.proxy.mark()
    done = world.run(["git", "clone", f"https://github.com/{si.GIT_PRIVATE}", str(home / "private")], env, home)
    ok(done)
    assert (home / "private" / si.GIT_FILE).read_text() == si.GIT_PRIVATE_TEXT
    # every request git made reached the stand-in with exactly the brokered credential, and it was git's only one
    hits = [h for h in world.services.requests_to("github.com")[before:] if h.path.startswith(f"/{si.GIT_PRIVATE}/")]
    assert {h.method for h in hits} == {"GET", "POST"}
    assert all(h.all("Authorization") == [BROKERED_AUTH] for h in hits), [h.all("Authorization") for h in hits]
    requests = [e for e in world.proxy.settled(mark) if e["kind"] == "request"]
    assert {(e["profile"], e["broker"], e["rule"], e["status"]) for e in requests} == {
        ("trusted-ci", "github-read", "git-refs", 200), ("trusted-ci", "github-read", "git-fetch", 200)}
    # the sandbox never saw the secret: not in its environment, its output, its files (.git/config included)
    for what, data in (("git's output", done.stdout + done.stderr), ("the sandbox's files", _sandbox_files(home)),
                       ("the clone's .git/config", (home / "private" / ".git" / "config").read_bytes())):
        assert_no_secret(data, what)


@_need("git", "curl")
def test_outside_the_brokered_rules_the_upstream_gets_no_credential(world):
    env, home = world.sandbox_env("--profile", "trusted-ci")
    before = len(world.services.requests_to("github.com"))
    # a push is outside the read-only rules: it goes out as plain profile traffic, and the stand-in refuses it
    push = world.run(["curl", "-sS", "--max-time", "20", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                      "-H", "Content-Type: application/x-git-receive-pack-request",
                      f"https://github.com/{si.GIT_PRIVATE}/git-receive-pack"], env, home)
    assert ok(push) == "401"
    # so is a repository outside acme's prefix
    other = world.run(["git", "ls-remote", "https://github.com/someone-else/tool.git"], env, home)
    assert other.returncode != 0
    hits = world.services.requests_to("github.com")[before:]
    assert {h.path.split("?")[0] for h in hits} >= {f"/{si.GIT_PRIVATE}/git-receive-pack", "/someone-else/tool.git/info/refs"}
    assert all(h.all("Authorization") == [] for h in hits), [(h.path, h.all("Authorization")) for h in hits]
    assert_no_secret(push.stdout + push.stderr + other.stdout + other.stderr, "the clients' output")


@_need("curl")
def test_an_authenticated_curl_to_the_api_with_a_profile_lease(world):
    env, home = world.sandbox_env("--profile", "trusted-ci")
    before = len(world.services.requests_to("api.github.com"))
    cmd = ["curl", "-sS", "--max-time", "20", "-H", "Authorization: Bearer sandbox-own", "-H", "Accept: application/json"]
    echo = json.loads(ok(world.run([*cmd, "https://api.github.com/repos/acme/app"], env, home)))
    assert echo["authorization"] == "Basic [REDACTED]"  # the upstream echoed the credential; the sandbox got it redacted
    outside = json.loads(ok(world.run([*cmd, "https://api.github.com/user"], env, home)))
    assert outside["authorization"] == ""  # outside `api-read`: plain traffic, and the sandbox's own header is dropped
    first, second = world.services.requests_to("api.github.com")[before:]
    assert first.all("Authorization") == [BROKERED_AUTH] and second.all("Authorization") == []
    requests = [e for e in world.events(f"sandbox-{world._n}") if e["kind"] == "request"]
    assert [(e["broker"], e["rule"]) for e in requests] == [("github-read", "api-read"), (None, None)]
    assert requests[0]["redactions"] >= 1
    assert_no_secret(json.dumps([echo, outside]), "the client's answers")
