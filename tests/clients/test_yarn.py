"""yarn 1 (classic) through the real proxy, configured only by `egresslaw sandbox-env`: its registry is
registry.yarnpkg.com, which catalog 2026.12 is the first to list under npm.

policies/demo as shipped (catalog 2026.11), and the same policy with its one `catalog` line moved to 2026.12,
each enforced by an in-process proxy in front of the stand-ins of tests/clients/standins.py (which serve the
npm registry under registry.yarnpkg.com too); the fixture is parametrized by the catalog, so one proxy runs at a
time (tests/clients/world.py says why). yarn itself is installed beforehand, never by the tests: `npm install -g
yarn@1`; without it these tests are skipped.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.clients import standins as si
from tests.clients.world import (
    BROKERED_AUTH,
    DEMO_CATALOG,
    allowed_hosts,
    close,
    demo_artifact,
    ok,
    serve,
)

pytestmark = pytest.mark.slow

NEXT_CATALOG = "2026.12"  # adds registry.yarnpkg.com:443 (yarn 1's default registry) to the npm ecosystem
YARN = shutil.which("yarn")


@functools.cache
def _yarn_version() -> str:
    if YARN is None:
        return "none"
    return subprocess.run([YARN, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout.strip()


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    if not _yarn_version().startswith("1."):
        pytest.skip(f"yarn 1 is not installed (found {_yarn_version()}): `npm install -g yarn@1`")
    if shutil.which("npm") is None or shutil.which("git") is None:
        pytest.skip("npm and git are needed to build the stand-ins' packages")
    standins = si.start(tmp_path_factory.mktemp("yarn-standins"), git_auth=BROKERED_AUTH)
    yield standins
    standins.stop()


@pytest.fixture(scope="module")
def site(request, services, tmp_path_factory):
    """The demo policy on catalog `request.param`, enforced by a proxy in front of the stand-ins."""
    root = tmp_path_factory.mktemp(f"yarn-{request.param}")
    world = serve(root, services, demo_artifact(root, request.param))
    yield world
    close(world)


ON_NEXT = pytest.mark.parametrize("site", [NEXT_CATALOG], indirect=True)
ON_PUBLISHED = pytest.mark.parametrize("site", [DEMO_CATALOG], indirect=True)


def _yarn_cache(home: Path) -> dict[str, str]:
    """Test isolation, no proxy or CA setting: yarn 1 run as root keeps its cache under /usr/local/share, not HOME."""
    return {"YARN_CACHE_FOLDER": str(home / ".yarn-cache")}


def _project(home: Path) -> Path:
    project = home / "project"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "sandbox-project", "version": "1.0.0", "private": True}))
    return project


def _tarballs() -> set[str]:
    return {f"/{name}/-/{name.rsplit('/', 1)[-1]}-1.0.0.tgz" for name in (si.NPM_SCOPED, si.NPM_PLAIN)}


def test_the_new_catalog_adds_exactly_yarns_registry_to_the_npm_grant(tmp_path):
    def hosts(catalog: str) -> set[tuple[str, int, str]]:
        artifact = demo_artifact(tmp_path / catalog, catalog)
        (profile,) = [p for p in artifact.sandbox_profiles if p.name == "package-builder"]
        return {(h.host, h.port, h.granted_by) for h in profile.network.allowed_hosts}

    published, adopted = hosts(DEMO_CATALOG), hosts(NEXT_CATALOG)
    assert adopted - published == {("registry.yarnpkg.com", 443, "allow_package_managers:npm")}
    assert published <= adopted


@ON_NEXT
def test_yarn1_add_then_install_from_the_lockfile(site):
    env, home = site.sandbox_env("--profile", "package-builder")
    project = _project(home)
    before = len(site.services.requests_to("registry.yarnpkg.com"))
    ok(site.run(["yarn", "add", si.NPM_SCOPED, si.NPM_PLAIN], {**env, **_yarn_cache(home)}, home, cwd=project))
    for name in (si.NPM_SCOPED, si.NPM_PLAIN):
        assert json.loads((project / "node_modules" / name / "package.json").read_text())["version"] == "1.0.0"
    done = site.run(["node", "-e", f"console.log(require({si.NPM_SCOPED!r}))"], {}, home, cwd=project)
    assert ok(done).strip() == f"{si.NPM_SCOPED} through the egress proxy"
    # the packuments name registry.npmjs.org tarballs; yarn 1 fetched them from its own registry, and locked that
    resolved = re.findall(r'resolved "([^"#]+)', (project / "yarn.lock").read_text())
    assert sorted(resolved) == sorted(f"https://registry.yarnpkg.com{path}" for path in _tarballs())
    paths = {h.path.lower() for h in site.services.requests_to("registry.yarnpkg.com")[before:]}
    assert {"/@acme%2fel-demo-scoped", f"/{si.NPM_PLAIN}"} | _tarballs() <= paths
    assert allowed_hosts(site, f"sandbox-{site._n}") == {"registry.yarnpkg.com"}
    # a fresh sandbox (empty HOME, empty cache) installs the same from the lockfile alone
    env, home = site.sandbox_env("--profile", "package-builder")
    again = _project(home)
    for name in ("package.json", "yarn.lock"):  # the dependencies `yarn add` wrote, and their lock
        shutil.copy(project / name, again / name)
    before = len(site.services.requests_to("registry.yarnpkg.com"))
    ok(site.run(["yarn", "install", "--frozen-lockfile"], {**env, **_yarn_cache(home)}, home, cwd=again))
    assert (again / "node_modules" / si.NPM_SCOPED / "index.js").is_file()
    assert (again / "node_modules" / si.NPM_PLAIN / "index.js").is_file()
    assert _tarballs() <= {h.path for h in site.services.requests_to("registry.yarnpkg.com")[before:]}
    assert allowed_hosts(site, f"sandbox-{site._n}") == {"registry.yarnpkg.com"}


@ON_PUBLISHED
def test_yarn1_on_the_published_catalog_is_refused_its_registry(site):
    env, home = site.sandbox_env("--profile", "package-builder")
    project = _project(home)
    before = len(site.services.requests_to("registry.yarnpkg.com"))
    # yarn 1 takes a refused CONNECT for a network hiccup and tries five times, 3 s apart: ~12 s, then fails
    done = site.run(["yarn", "add", si.NPM_PLAIN], {**env, **_yarn_cache(home)}, home, cwd=project)
    assert done.returncode != 0 and b"statusCode=403" in done.stdout + done.stderr, done.stderr[-2000:]
    events = site.events(f"sandbox-{site._n}")
    assert events and {(e["kind"], e["host"], e["decision"], e["reason"]) for e in events} == {
        ("connect", "registry.yarnpkg.com", "deny", "profile-host-not-allowed")}
    assert site.services.requests_to("registry.yarnpkg.com")[before:] == []
    assert not (project / "node_modules").exists()


@ON_NEXT
def test_yarn1_on_a_terminal_makes_no_update_check(site):
    """On a terminal yarn 1 asks https://yarnpkg.com/latest-version (no package host: refused, and retried for ~12 s
    after the install is done); sandbox-env's `YARN_DISABLE_SELF_UPDATE_CHECK` is what stops it."""
    env, home = site.sandbox_env("--profile", "package-builder")
    subject = f"sandbox-{site._n}"
    last = site.run(["yarn", "config", "get", "lastUpdateCheck"], {**env, **_yarn_cache(home)}, home).stdout.decode().strip()
    if last.isdigit() and time.time() * 1000 - int(last) < 86_400_000:
        pytest.skip("yarn's own config records an update check in the last day: yarn would not check now")

    def update_checks() -> set[tuple[str, str]]:
        return {(e["decision"], e["reason"]) for e in site.proxy.events()
                if e["kind"] == "connect" and e.get("subject") == subject and e["host"] == "yarnpkg.com"}

    # without the variable the check goes out; yarn is killed once the proxy has refused it, not after its retries
    bare = {k: v for k, v in env.items() if k != "YARN_DISABLE_SELF_UPDATE_CHECK"}
    _, shown, held = site.run_on_a_terminal(["yarn", "add", si.NPM_PLAIN], {**bare, **_yarn_cache(home)}, home, _project(home),
                                            kill_when=lambda: bool(update_checks()), timeout=60)
    assert held, shown.decode(errors="replace")[-2000:]
    assert update_checks() == {("deny", "profile-host-not-allowed")}
    # with sandbox-env's environment unchanged: the registry only
    env, home = site.sandbox_env("--profile", "package-builder")
    status, shown, _ = site.run_on_a_terminal(["yarn", "add", si.NPM_PLAIN], {**env, **_yarn_cache(home)}, home, _project(home))
    assert status == 0, shown.decode(errors="replace")[-2000:]
    assert allowed_hosts(site, f"sandbox-{site._n}") == {"registry.yarnpkg.com"}
