"""git smart HTTP through the real edge: the real `git` client (http.proxy with a connection lease, the edge's CA as
http.sslCAInfo) against `git http-backend` with pushes on, which demands the credential only the edge holds. The rule
fetches, pushes to refs/heads/agent/* only, may create and may not delete.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.shapes import servers
from tests.shapes.world import BEARER, GIT, serving, settle

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")]

REMOTE = f"https://{GIT}/{servers.GIT_REPO}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes-git")

    def start(cert, key):
        return servers.start_git(cert, key, root / "upstream", auth=BEARER)

    with serving(root, GIT, start, ("push",)) as world:
        world.home = root / "client-home"
        world.home.mkdir()
        yield world


def _git(world, *args: str) -> tuple[int, bytes]:
    """`git` through the edge (its exit status and stderr): its only way out is the proxy, configured through the
    environment (GIT_CONFIG_*) so the lease is in no argument list an assertion could print."""
    config = {"http.proxy": world.proxy.lease_url(), "http.sslCAInfo": str(world.proxy.ca), "http.proxyAuthMethod": "basic",
              "credential.helper": ""}
    env = servers.git_env(world.home) | {"GIT_CONFIG_COUNT": str(len(config))}
    for n, (key, value) in enumerate(config.items()):
        env |= {f"GIT_CONFIG_KEY_{n}": key, f"GIT_CONFIG_VALUE_{n}": value}
    done = subprocess.run(["git", *args], env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    world.proxy.record(done.stdout + done.stderr)
    return done.returncode, done.stderr


def _ok(done: tuple[int, bytes]) -> None:
    code, stderr = done
    assert code == 0, stderr.decode(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def clone(world):
    work = world.home / "app"
    _ok(_git(world, "clone", "-q", REMOTE, str(work)))  # fetch: info/refs?service=git-upload-pack, git-upload-pack
    assert (work / "README.md").read_text() == "the upstream's main\n"
    return work


def _commit(world, work, name: str) -> str:
    (work / name).write_text(f"{name}\n")
    env = servers.git_env(world.home)
    for cmd in (["git", "-C", str(work), "add", name], ["git", "-C", str(work), "commit", "-q", "-m", name]):
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=60)
    return subprocess.run(["git", "-C", str(work), "rev-parse", "HEAD"], env=env, check=True, capture_output=True, text=True).stdout.strip()


def _pushes_since(world, mark) -> list[servers.Received]:
    settle([world.server])
    return [r for r in world.server.since(mark) if r.method == "POST" and r.path.endswith("/git-receive-pack")]


def test_clone_carries_the_credential(world, clone):
    arrived = world.server.since(0)
    assert arrived and all(r.all("Authorization") == [BEARER] for r in arrived)
    assert any(r.path.endswith("/git-upload-pack") for r in arrived)


def test_push_to_an_agent_branch_moves_the_upstream_ref(world, clone):
    head = _commit(world, clone, "agent.txt")
    mark = world.proxy.mark()
    _ok(_git(world, "-C", str(clone), "push", "-q", "origin", "HEAD:refs/heads/agent/x"))
    assert servers.ref(world.server.root, "refs/heads/agent/x") == head
    decided = world.proxy.decisions(mark)
    assert decided and all((e["decision"], e["rule"]) == ("allow", "push") for e in decided), decided


def test_push_to_main_is_refused_and_main_stays(world, clone):
    before = servers.ref(world.server.root, "refs/heads/main")
    _commit(world, clone, "main.txt")
    mark, seen = world.proxy.mark(), world.server.mark()
    code, stderr = _git(world, "-C", str(clone), "push", "origin", "HEAD:refs/heads/main")
    assert code != 0 and b"403" in stderr, stderr[-2000:]
    event = world.proxy.refused(mark, "git-ref-not-allowed")
    assert "refs/heads/main" in (event.get("detail") or ""), event
    assert _pushes_since(world, seen) == [], "the upstream saw the refused push"
    assert servers.ref(world.server.root, "refs/heads/main") == before


def test_delete_is_refused_and_the_ref_stays(world, clone):
    if servers.ref(world.server.root, "refs/heads/agent/x") is None:  # run alone: make the branch first
        _commit(world, clone, "agent-delete.txt")
        _ok(_git(world, "-C", str(clone), "push", "-q", "origin", "HEAD:refs/heads/agent/x"))
    before = servers.ref(world.server.root, "refs/heads/agent/x")
    mark, seen = world.proxy.mark(), world.server.mark()
    code, stderr = _git(world, "-C", str(clone), "push", "origin", ":refs/heads/agent/x")
    assert code != 0 and b"403" in stderr, stderr[-2000:]
    world.proxy.refused(mark, "git-delete-refused")
    assert _pushes_since(world, seen) == []
    assert servers.ref(world.server.root, "refs/heads/agent/x") == before


def test_a_path_that_is_not_smart_http_is_refused(world):
    mark, seen = world.proxy.mark(), world.server.mark()
    with world.proxy.client() as client:
        response = client.get(f"{REMOTE}/HEAD")  # the dumb protocol
    world.proxy.record(response.content)
    assert response.status_code == 403 and response.headers.get("x-egresslaw-deny") == "git-service-not-allowed"
    world.proxy.refused(mark, "git-service-not-allowed")
    settle([world.server])
    assert world.server.since(seen) == []
