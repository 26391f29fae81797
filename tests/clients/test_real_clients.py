"""Real, unchanged clients through the real proxy, configured only by `egresslaw sandbox-env`'s output.

The policy is policies/demo (compiled here): the `package-builder` profile (pip and npm hosts) for the
package managers, `trusted-ci` (github.com) for git, the `github` connection for the credentialed call, and
`trusted-ci`'s brokered connection `github-read` for a `git clone` of a private repository and an
authenticated `curl`, with a profile lease only.
The services are the local stand-ins of tests/clients/standins.py under their real names; the proxy runs
in-process with test routing (names resolve to public-looking addresses that are never dialled, the
vetted connection goes to 127.0.0.1). Each client runs in a subprocess whose environment is a bare
PATH/HOME/LANG plus what `sandbox-env` printed, nothing else.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.compile import compile_paths
from egress_proxy.custody.secret import encodings_of
from tests.clients import standins as si
from tests.proxy_harness import (
    CANARY,
    Pki,
    ScriptedResolver,
    assert_no_canary,
    make_env,
    seal,
    start_proxy,
    stop_proxy,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EGRESSLAW = str(Path(sys.executable).with_name("egresslaw"))
TOOLS = {name: shutil.which(name) for name in ("curl", "npm", "git", "bash")}
# github-read's custody secret: GitHub's git endpoint takes HTTP Basic, `x-access-token:TOKEN` (the canary as TOKEN).
BROKERED = base64.b64encode(f"x-access-token:{CANARY}".encode()).decode()
BROKERED_AUTH = f"Basic {BROKERED}"


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
    result = compile_paths([ROOT / "policies" / "demo"])
    assert result.artifact is not None, result.diagnostics
    env = make_env(root / "edge", artifact=result.artifact)
    seal(env.store, env.keys, "github-read", "gh-read", BROKERED.encode())  # workspace `acme`, as policies/demo
    pki = Pki(services.ca_pem, services.ca_pem, services.ca_pem, services.ca_pem)  # only the CA is read: --upstream-ca
    resolver = ScriptedResolver({name: [[ip]] for name, ip in si.PUBLIC.items()})
    proxy = start_proxy(env, pki, (), services.connect_to(), resolver=resolver)
    world = World(root, services, env, proxy)
    yield world
    stop_proxy(proxy)
    services.stop()
    proxy.assert_nothing_leaked()
    text = proxy.logs.text() + proxy.audit_bytes().decode()
    assert not any(t in text for t in world.leases), "a lease is in the proxy's logs or audit log"
    for shown in [*proxy.seen, text.encode()]:
        assert_no_secret(shown, "a client-visible response, the proxy's logs or the audit log")


class World:
    def __init__(self, root: Path, services: si.StandIns, env, proxy) -> None:
        self.root, self.services, self.env, self.proxy = root, services, env, proxy
        self.leases: list[str] = []
        self._n = 0

    def sandbox_env(self, *which: str, fmt: str = "json") -> tuple[dict[str, str] | str, Path]:
        """Run `egresslaw sandbox-env` (minting the lease with --keys) and return its output and the sandbox's HOME."""
        self._n += 1
        home = self.root / f"sandbox-{self._n}"
        home.mkdir()
        cmd = [EGRESSLAW, "sandbox-env", "--proxy", f"{self.proxy.host}:{self.proxy.port}", "--keys", str(self.env.keys),
               "--artifact", str(self.env.artifact), "--subject", f"sandbox-{self._n}", *which,
               "--ca", str(self.proxy.ca), "--bundle", str(home / "ca-bundle.pem"), "--format", fmt]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""  # the lease is printed on stdout, the one place it must be, and nowhere else
        if fmt == "json":
            env = json.loads(done.stdout)["env"]
            self.leases.append(env["HTTPS_PROXY"].split(":", 2)[2].split("@")[0])
            return env, home
        return done.stdout, home

    def run(self, cmd: list[str], env: dict[str, str], home: Path, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """A client in a subprocess whose environment is PATH, HOME, LANG and the sandbox environment only."""
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}
        done = subprocess.run(cmd, env={**base, **env}, cwd=cwd or home, capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        self.proxy.record(done.stdout + done.stderr)
        return done

    def events(self, subject: str) -> list[dict]:
        """The subject's decision events, each with its outcome (status, bytes, redactions) folded in."""
        return [e for e in self.proxy.settled((0, [])) if e.get("subject") == subject]


def assert_no_secret(data: bytes | str, where: str) -> None:
    """Neither the canary token nor the brokered Basic credential built from it, in any encoding the scan knows."""
    assert_no_canary(data, where)
    blob = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    for needle in encodings_of(BROKERED.encode()):
        assert needle not in blob, f"the brokered credential is in {where}"


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, (done.stdout.decode(errors="replace")[-2000:], done.stderr.decode(errors="replace")[-3000:])
    return done.stdout.decode()


def _allowed_hosts(world: World, subject: str) -> set[str]:
    events = world.events(subject)
    assert events and all(e["decision"] == "allow" for e in events), [(e["host"], e["reason"]) for e in events if e["decision"] != "allow"]
    return {e["host"] for e in events}


# ---------------------------------------------------------------------------------------------
# curl, python requests / httpx / urllib
# ---------------------------------------------------------------------------------------------


@_need("curl", "bash")
def test_curl_from_the_export_lines(world):
    exports, home = world.sandbox_env("--profile", "package-builder", fmt="export")
    world.leases.append(exports.split("HTTPS_PROXY=")[1].split(":", 2)[2].split("@")[0])
    (home / "env.sh").write_text(exports)
    done = world.run(["bash", "-c", f'. {home}/env.sh && curl -sS --max-time 20 https://pypi.org/simple/{si.WHEEL_NAME}/'], {}, home)
    assert si.WHEEL_FILE in _ok(done)
    assert _allowed_hosts(world, f"sandbox-{world._n}") == {"pypi.org"}


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
    assert si.WHEEL_FILE in _ok(done)
    assert _allowed_hosts(world, f"sandbox-{world._n}") == {"pypi.org"}


# ---------------------------------------------------------------------------------------------
# Package managers and git, with a sandbox-profile lease
# ---------------------------------------------------------------------------------------------


def test_pip_download_and_install_a_wheel(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _ok(world.run([*pip, "download", "--no-deps", "-d", str(home / "dl"), si.WHEEL_NAME], env, home))
    assert (home / "dl" / si.WHEEL_FILE).is_file()
    _ok(world.run([*pip, "install", "--no-deps", "--target", str(home / "site"), si.WHEEL_NAME], env, home))
    done = world.run([sys.executable, "-c", "import egresslaw_demo; print(egresslaw_demo.VALUE)"], {"PYTHONPATH": str(home / "site")}, home)
    assert _ok(done).strip() == si.WHEEL_VALUE
    assert _allowed_hosts(world, f"sandbox-{world._n}") == {"pypi.org", "files.pythonhosted.org"}


@_need("npm")
def test_npm_install_a_plain_and_a_scoped_package(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    project = home / "project"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "sandbox-project", "version": "1.0.0", "private": True}))
    _ok(world.run(["npm", "install", si.NPM_SCOPED, si.NPM_PLAIN], env, home, cwd=project))
    for name in (si.NPM_SCOPED, si.NPM_PLAIN):
        assert json.loads((project / "node_modules" / name / "package.json").read_text())["version"] == "1.0.0"
    done = world.run(["node", "-e", f"console.log(require({si.NPM_SCOPED!r}))"], {}, home, cwd=project)
    assert _ok(done).strip() == f"{si.NPM_SCOPED} through the egress proxy"
    paths = {h.path for h in world.services.requests_to("registry.npmjs.org")}
    assert "/@acme%2fel-demo-scoped" in {p.lower() for p in paths}  # npm's scoped spelling passed the profile unchanged
    assert _allowed_hosts(world, f"sandbox-{world._n}") == {"registry.npmjs.org"}


@_need("git")
def test_git_clone_over_smart_http(world):
    env, home = world.sandbox_env("--profile", "trusted-ci")
    mark = world.proxy.mark()
    _ok(world.run(["git", "clone", "-q", f"https://github.com/{si.GIT_REPO}", str(home / "clone")], env, home))
    assert (home / "clone" / si.GIT_FILE).read_text() == si.GIT_TEXT
    assert _allowed_hosts(world, f"sandbox-{world._n}") == {"github.com"}
    # git asks libcurl for any proxy auth scheme, so it first sends no credentials and answers the 407's
    # Basic challenge: the only denials are lease-missing with nothing offered, and they come first.
    connects = [(e["decision"], e["reason"], e.get("auth")) for e in world.proxy.new_events(mark) if e["kind"] == "connect"]
    assert connects[-1] == ("allow", "allowed", None) and set(connects[:-1]) <= {("deny", "lease-missing", "none")}, connects


def test_a_profile_lease_cannot_reach_a_host_outside_its_profile(world):
    env, home = world.sandbox_env("--profile", "package-builder")
    program = "import requests\ntry:\n    requests.get('https://github.com/', timeout=20)\nexcept requests.exceptions.ProxyError as e:\n    print('refused', e.__class__.__name__)"
    assert _ok(world.run([sys.executable, "-c", program], env, home)).startswith("refused")
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
    echo = json.loads(_ok(world.run(cmd, env, home)))
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
    _ok(done)
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
    assert _ok(push) == "401"
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
    echo = json.loads(_ok(world.run([*cmd, "https://api.github.com/repos/acme/app"], env, home)))
    assert echo["authorization"] == "Basic [REDACTED]"  # the upstream echoed the credential; the sandbox got it redacted
    outside = json.loads(_ok(world.run([*cmd, "https://api.github.com/user"], env, home)))
    assert outside["authorization"] == ""  # outside `api-read`: plain traffic, and the sandbox's own header is dropped
    first, second = world.services.requests_to("api.github.com")[before:]
    assert first.all("Authorization") == [BROKERED_AUTH] and second.all("Authorization") == []
    requests = [e for e in world.events(f"sandbox-{world._n}") if e["kind"] == "request"]
    assert [(e["broker"], e["rule"]) for e in requests] == [("github-read", "api-read"), (None, None)]
    assert requests[0]["redactions"] >= 1
    assert_no_secret(json.dumps([echo, outside]), "the client's answers")
