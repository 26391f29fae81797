"""The image without a container engine: its lock, its build stage and the recipe of docs/container.md, played here.

No docker daemon and no base-image registry are reachable where this project is built, so the image cannot be
built. What it would hold can: the build stage's `RUN` lines run as the Dockerfile writes them, in a temporary root
(`/opt/egresslaw`, `/src`, `/tmp` … moved under it), from a copy of this machine's Python 3.12 at the root's
`/usr/local`, standing for the base image's. Then the documented recipe runs line by line: host commands in a shell,
each `docker run` as the process the engine would start: the image's `ENV` (its paths moved the same way), the user
by `setpriv` (uid 10001, no groups, no capabilities), named volumes created from the image's directories (a new
volume takes the owner, mode and content of the image directory it is mounted on), `:ro`, `--read-only` and
`--tmpfs` as mounts in a private mount namespace. Two things are this machine's, not the image's, and only these:
the base interpreter is found through `LD_LIBRARY_PATH` (the image has libpython on ld.so's path), and the proxy
listens on free loopback ports (the recipe publishes 8080 and 9090; the test checks those are the image's ports).

Fast tests read the files only; the slow one builds and runs (pip's download cache, ~/.cache/pip, makes reruns
quick; every file is still checked against the lock's hashes).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests import ports
from tests.deploy.dockerfile import BUILD, FINAL, STEPS, install_dirs
from tests.deploy.dockerfile import commands as _commands
from tests.deploy.dockerfile import image_env as _env
from tests.lockfiles import PROXY, PROXY_NAME, lock_pins, requirement_closure

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
LOCK_NAME = PROXY_NAME
LOCK = PROXY
DOC = ROOT / "docs" / "container.md"
DEV_BIN = Path(sys.executable).parent  # the dev venv: the prover's machine of the recipe
PROVER_MISSING = "error: the prover needs z3-solver\nhelp: pip install 'egresslaw[prove]'\n"


# -- reading the Dockerfile ------------------------------------------------------------------------




def _healthcheck() -> list[str]:
    (check,) = [rest for kw, rest in FINAL if kw == "HEALTHCHECK"]
    _, sep, command = check.partition("CMD ")
    assert sep, check
    return json.loads(command)  # the exec form: no shell, which a slim image has but should not need


def _recipe_in_the_dockerfile() -> list[str]:
    """The header's recipe: its comment lines indented by three spaces, the indent removed."""
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    return [line[4:] for line in header.splitlines() if line.startswith("#   ")]


def _doc_block(name: str) -> str:
    text = DOC.read_text()
    marker = f"<!-- recipe: {name} -->\n```sh\n"
    assert marker in text, f"docs/container.md has no `{name}` recipe block"
    return text.split(marker, 1)[1].split("```", 1)[0]


# -- the lock (tests/test_lock.py: it is the runtime part of requirements.lock) ---------------------------


def test_the_build_installs_the_lock_by_hash_and_removes_pip():
    runs = [rest for kw, rest in BUILD if kw == "RUN"]
    commands = [words for run in runs for words in _commands(run)]
    installs = [words for words in commands if "install" in words and any(w.endswith("pip") for w in words[:1])]
    lock_install = ["--require-hashes", "--no-deps", "-r", LOCK_NAME]
    assert installs[0][installs[0].index("install") + 1:] == lock_install
    for words in installs[1:]:  # the project itself: a local wheel, nothing resolved
        assert words[words.index("install") + 1:][:1] == ["--no-deps"] and words[-1].endswith(".whl"), words
    copies = [rest for kw, rest in BUILD if kw == "COPY"]
    assert copies[0].split()[0] == LOCK_NAME  # its own layer, before the sources
    last = _commands(runs[-1])[-1]
    assert last[0].endswith("/pip") and last[1:] == ["uninstall", "-y", "pip", "setuptools", "wheel"]
    everything = " ".join(rest for kw, rest in STEPS if kw == "RUN")
    assert "z3" not in everything and "[prove]" not in everything and "[test]" not in everything


def test_the_runtime_stage_takes_the_venv_only_and_never_runs_pip():
    assert [rest for kw, rest in FINAL if kw == "COPY"] == ["--from=build /opt/egresslaw /opt/egresslaw"]
    for keyword, rest in FINAL:
        if keyword == "RUN":
            assert "pip" not in rest and "python" not in rest, rest


def test_the_healthcheck_asks_the_admin_ports_healthz_with_the_venvs_python():
    (check,) = [rest for kw, rest in FINAL if kw == "HEALTHCHECK"]
    command = _healthcheck()
    assert command[:2] == ["/opt/egresslaw/bin/python", "-c"]
    assert "/healthz" in command[2] and "EGRESSLAW_ADMIN" in command[2]
    assert _env(FINAL)["EGRESSLAW_ADMIN"].rsplit(":", 1)[1] in command[2]  # the fallback is the image's admin port
    timeout = re.search(r"--timeout=(\d+)s", check)
    assert timeout and int(timeout[1]) > int(re.search(r"timeout=(\d+)\)", command[2])[1])  # urlopen gives up first


def test_the_dockerfile_header_and_the_docs_give_the_same_recipe():
    assert _recipe_in_the_dockerfile() == _doc_block("container").splitlines()


# -- the commands that need z3, and those that do not ------------------------------------------------

NO_Z3 = """
import sys
class NoZ3:
    def find_spec(self, name, path=None, target=None):
        if name == "z3" or name.startswith("z3."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoZ3())
from egresslaw.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _no_z3(*args: str, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`egresslaw ARGS` in a fresh interpreter where `import z3` fails as it does without the `prove` extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_")}
    return subprocess.run([sys.executable, "-c", NO_Z3, *args], cwd=cwd, env=env, input=stdin or b"", capture_output=True, timeout=120)


def _example_policy() -> str:
    """The policy the docs' `policy` block writes (its heredoc)."""
    block = _doc_block("policy")
    return block.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0] + "\n"


def test_the_prover_commands_name_the_extra_and_everything_else_works_without_z3(tmp_path):
    src = tmp_path / "policy-src"
    src.mkdir()
    (src / "github.egress").write_text(_example_policy())
    art, keys = str(tmp_path / "egresslaw.json"), str(tmp_path / "keys")
    store, lease_opts = str(tmp_path / "custody.db"), ["--keys", keys, "--artifact", art, "--connection", "github"]
    works = [
        ["check", str(src)],
        ["compile", str(src), "-o", art],  # a first compile publishes: nothing to compare, no prover
        ["show", art],
        ["keys", "init", "--dir", keys],
        ["keys", "init", "--proof-signing", "--dir", str(tmp_path / "signing")],
        ["custody", "put", "--keys", keys, "--store", store, "--artifact", art, "--connection", "github"],
        ["custody", "list", "--keys", keys, "--store", store],
        ["lease", *lease_opts, "--subject", "agent-1"],
        ["sandbox-env", "--proxy", "127.0.0.1:8080", *lease_opts, "--confdir", str(tmp_path / "conf"),
         "--bundle", str(tmp_path / "ca.pem")],
        ["ca", "--confdir", str(tmp_path / "conf")],
        ["fmt", str(src)],
        ["explain", art, "GET https://api.github.com/repos/acme/app", "--connection", "github"],
    ]
    for args in works:
        done = _no_z3(*args, cwd=tmp_path, stdin=b"example-token-not-a-secret\n")
        assert done.returncode == 0, (args[:2], done.stderr.decode()[-2000:])
    (src / "github.egress").write_text(_example_policy().replace('"/repos/acme/"', '"/repos/"'))  # a widening
    for args in (["prove", art, "-o", str(tmp_path / "proof.json")], ["diff", art, art], ["compile", str(src), "-o", art]):
        done = _no_z3(*args, cwd=tmp_path)
        assert (done.returncode, done.stderr.decode(), done.stdout) == (2, PROVER_MISSING, b""), args[0]
    # the control: with z3 the same widening is found (so the message above came from the missing import, not the input)
    with_z3 = subprocess.run([str(DEV_BIN / "egresslaw"), "compile", str(src), "-o", art], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    assert with_z3.returncode == 1 and "EL0037" in with_z3.stderr + with_z3.stdout


# -- the build stage, reproduced ---------------------------------------------------------------------

IMAGE_PATHS = ("/opt/egresslaw", "/usr/local", "/etc/egresslaw", "/var/lib/egresslaw", "/src", "/tmp")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _moved(text: str, where) -> str:
    """`text` with every image path (IMAGE_PATHS and below) replaced by `where(path)`."""
    pattern = r"(?<![\w.-])(" + "|".join(map(re.escape, IMAGE_PATHS)) + r")(?![\w.-])((?:/[^\s:'\"]*)?)"
    return re.sub(pattern, lambda m: where(m[1] + m[2]), text)


@dataclass
class Image:
    """The image's files in `root`: `root/usr/local` (the base's Python), `root/opt/egresslaw`, the runtime's dirs."""

    root: Path
    volumes: dict[str, Path] = field(default_factory=dict)
    containers: int = 0

    def path(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def build(self) -> None:
        """The base image (this machine's Python 3.12, copied), then the build stage's COPY and RUN lines as written."""
        base = Path(sys.base_prefix)
        if all(p.stat().st_mode & stat.S_IXOTH for p in (base, *base.parents)):  # e.g. /usr: uid 10001 can use it in place
            self.path("/usr/local/bin").mkdir(parents=True)
            self.path("/usr/local/bin/python").symlink_to(sys._base_executable)
        else:  # e.g. pyenv's, under /root (0700): a copy, hard links where they can be (fast; nothing writes to them)
            shutil.copytree(base, self.path("/usr/local"), symlinks=True, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns("test"))
            if not self.path("/usr/local/bin/python").exists():
                self.path("/usr/local/bin/python").symlink_to(Path(sys._base_executable).name)
        workdir = self.path(next(rest for kw, rest in BUILD if kw == "WORKDIR"))
        env = _env(BUILD, f"{self.path('/usr/local/bin')}:/usr/bin:/bin")
        # pip's cache only makes reruns fast; every file it holds is still checked against the lock's hashes
        env.pop("PIP_NO_CACHE_DIR")
        env |= {k: v for k, v in os.environ.items() if k.startswith("PIP_") and k not in env}  # this machine's index and CA
        env["HOME"] = os.environ.get("HOME", "/root")
        self.path("/tmp").mkdir(parents=True, exist_ok=True)
        for keyword, rest in BUILD:
            if keyword == "COPY":
                *sources, dest = rest.split()
                for source in sources:
                    target = workdir / dest / Path(source).name if dest.endswith("/") else workdir / dest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    if (ROOT / source).is_dir():
                        shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                    else:
                        shutil.copy2(ROOT / source, target)
            elif keyword == "RUN":
                done = subprocess.run(["sh", "-c", _moved(rest, lambda p: str(self.path(p)))], cwd=workdir, env=env,
                                      capture_output=True, text=True, timeout=240)
                assert done.returncode == 0, f"RUN {rest[:80]}…\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        for path, uid, gid, mode in install_dirs(FINAL):  # the runtime stage's directories
            target = self.path(path)
            target.mkdir(parents=True, exist_ok=True)
            os.chown(target, uid, gid)
            os.chmod(target, mode)

    def volume(self, name: str, at: str) -> Path:
        """A named volume; a new one takes the owner, mode and directories of the image's `at`, as the engine's copy-up."""
        if name not in self.volumes:
            dest = self.root / "volumes" / name
            dest.mkdir(parents=True)
            for path, uid, gid, mode in sorted(install_dirs(FINAL)):
                if path == at or path.startswith(at + "/"):
                    target = dest / os.path.relpath(path, at)
                    target.mkdir(parents=True, exist_ok=True)
                    os.chown(target, uid, gid)
                    os.chmod(target, mode)
            self.volumes[name] = dest
        return self.volumes[name]


@dataclass
class Container:
    """One `docker run`: its mounts (image path -> host path, read-only), user, env and command."""

    image: Image
    argv: list[str]
    user: tuple[int, int]
    env: dict[str, str]
    mounts: dict[str, tuple[Path, bool]]
    read_only: bool
    ports: set[int]
    name: str | None
    detach: bool
    interactive: bool

    def host(self, image_path: str) -> str:
        for at in sorted(self.mounts, key=len, reverse=True):
            if image_path == at or image_path.startswith(at + "/"):
                return str(self.mounts[at][0]) + image_path[len(at):]
        return str(self.image.path(image_path))

    def process(self, argv: list[str] | None = None) -> list[str]:
        """`unshare … setpriv … env -i … COMMAND`: the process the engine starts (or `docker exec`s) in this container."""
        lines = ["set -e"]
        read_only = [str(host) for host, ro in self.mounts.values() if ro]
        if self.read_only:  # the image's own files; volumes and the tmpfs stay writable
            read_only += [str(self.image.path(p)) for p in ("/opt", "/usr", "/etc", "/var", "/src", "/tmp") if self.image.path(p).exists()]
        for path in read_only:
            lines += [shlex.join(["mount", "--bind", path, path]), shlex.join(["mount", "-o", "remount,bind,ro", path])]
        uid, gid = self.user
        command = [_moved(word, self.host) for word in (argv or self.argv)]
        lines.append("exec " + shlex.join(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all",
                                           "--bounding-set=-all", "--no-new-privs", "--", "env", "-i",
                                           f"--chdir={self.host(next(rest for kw, rest in reversed(FINAL) if kw == 'WORKDIR'))}",
                                           *(f"{k}={v}" for k, v in self.env.items()), *command]))
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]


def docker_run(image: Image, words: list[str], tag: str, cwd: Path, overrides: dict[str, str]) -> Container:
    """Parse `docker run …` as the engine does for the options the recipe uses (any other fails: teach it here)."""
    assert words[:2] == ["docker", "run"], words
    args = iter(words[2:])
    opts: dict[str, list[str]] = {}
    flags: set[str] = set()
    for word in args:
        if word in ("--rm", "-i", "-d", "--read-only"):
            flags.add(word)
        elif word in ("--user", "--name", "-v", "-p", "--tmpfs", "-e"):
            opts.setdefault(word, []).append(next(args))
        elif word.startswith("-"):
            raise AssertionError(f"`docker run {word}`: an option this test does not play yet")
        else:
            assert word == tag, f"the recipe runs `{word}`, the image it built is `{tag}`"
            break
    command = list(args) or json.loads(next(rest for kw, rest in FINAL if kw == "CMD"))
    entrypoint = json.loads(next(rest for kw, rest in FINAL if kw == "ENTRYPOINT"))
    image.containers += 1
    scratch = image.root / "containers" / str(image.containers)
    mounts: dict[str, tuple[Path, bool]] = {}
    for spec in opts.get("-v", []):
        source, dest, *mode = spec.replace("$PWD", str(cwd)).split(":")
        assert mode in ([], ["ro"]), spec
        host = Path(source) if source.startswith("/") else image.volume(source, dest)
        assert host.exists(), f"-v {spec}: `{host}` does not exist (the engine would make an empty root-owned directory)"
        mounts[dest] = (host, mode == ["ro"])
    for keyword, rest in FINAL:  # an anonymous volume for every VOLUME nothing is mounted on
        if keyword == "VOLUME":
            for i, path in enumerate(json.loads(rest)):
                if path not in mounts:
                    mounts[path] = (image.volume(f"anonymous-{image.containers}-{i}", path), False)
    for path in opts.get("--tmpfs", []):
        (scratch / path.lstrip("/")).mkdir(parents=True)
        os.chmod(scratch / path.lstrip("/"), 0o1777)
        mounts[path] = (scratch / path.lstrip("/"), False)
    ports = {int(p.rsplit(":", 1)[1]) for p in opts.get("-p", [])}
    user_spec = (opts.get("--user") or [next(rest for kw, rest in reversed(FINAL) if kw == "USER")])[-1]
    assert re.fullmatch(r"\d+:\d+", user_spec), f"--user {user_spec}: give uid:gid (a name needs the image's /etc/passwd)"
    user = tuple(int(x) for x in user_spec.split(":"))
    container = Container(image, entrypoint + command, user, {}, mounts, "--read-only" in flags, ports,
                          (opts.get("--name") or [None])[-1], "-d" in flags, "-i" in flags)
    env = _env(FINAL) | dict(e.split("=", 1) for e in opts.get("-e", [])) | overrides
    container.env = {k: ":".join(_moved(p, container.host) for p in v.split(":")) if k == "PATH" else _moved(v, container.host)
                     for k, v in env.items()}
    container.env |= {
        "HOME": "/nonexistent",  # the image user's home (absent there too)
        "TMPDIR": container.host("/tmp"),  # in the container /tmp itself is the tmpfs
        "LD_LIBRARY_PATH": str(image.path("/usr/local/lib")),  # libpython, on ld.so's path in the base image
    }
    return container


def recipe_lines(block: str) -> list[str]:
    """The block's commands: comments and blank lines dropped, continuations joined, a heredoc kept with its line."""
    out: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + next(lines).strip()
        heredoc = re.search(r"<<'(\w+)'", line)
        if heredoc:
            body = []
            for more in lines:
                body.append(more)
                if more == heredoc[1]:
                    break
            line = "\n".join([line, *body])
        out.append(line)
    return out


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range, one slice per xdist worker


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _through_proxy(port: int, url: str, lease: str) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    auth = base64.b64encode(f"egresslaw:{lease}".encode()).decode()
    try:
        conn.request("GET", url, headers={"Proxy-Authorization": f"Basic {auth}"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def _can_play_the_engine() -> str:
    if os.geteuid() != 0:
        return "needs root (chown to uid 10001, setpriv, mount namespaces)"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], check=False, capture_output=True)
    return "" if probe.returncode == 0 else "mount namespaces are not permitted here"


@pytest.fixture
def image_root():
    why = _can_play_the_engine()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="egresslaw-image-"))  # not pytest's tmp_path: its parents are 0700, closed to uid 10001
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_the_build_stage_makes_a_venv_without_z3_or_pip_and_the_documented_recipe_runs_in_it(image_root):
    image = Image(image_root)
    image.build()
    venv = image.path("/opt/egresslaw")
    (site,) = (venv / "lib").glob("python3.*/site-packages")

    # what the venv holds: no z3, no installer, every requirement met, nothing else
    dists = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    for absent in ("z3-solver", "pip", "setuptools", "wheel"):
        assert absent not in dists, absent
    assert not list(venv.glob("bin/pip*")) and not (site / "z3").exists()
    needed = requirement_closure(["egresslaw"], lambda name: dists[name])  # KeyError: a requirement is not installed
    for name, reqs in needed.items():
        for req in reqs:
            assert req.specifier.contains(dists[name].version, prereleases=True), f"{name} {dists[name].version} vs `{req}`"
    assert set(dists) == set(needed)
    assert {n: d.version for n, d in dists.items() if n != "egresslaw"} == {n: v for n, (v, _) in lock_pins(LOCK.read_text()).items()}
    size = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())
    assert size < 150 * 2**20, f"the venv is {size >> 20} MiB"  # 119 MiB when written; z3 alone is 59
    prove = subprocess.run([str(venv / "bin/egresslaw"), "prove", "build/egresslaw.json"], capture_output=True, text=True, timeout=60)
    assert (prove.returncode, prove.stderr) == (2, PROVER_MISSING)  # the real absence, not a hook

    # the documented recipe, line by line, from a fresh working directory standing for the repository root
    work = image_root / "work"
    work.mkdir(mode=0o755)
    host_env = {"PATH": f"{DEV_BIN}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
                "GITHUB_TOKEN": "ghp-not-a-real-token-only-a-test-value"}  # egresslaw: the dev venv, where `prove` is
    admin, listen = _free_port(), _free_port()
    proxy_overrides = {"EGRESSLAW_LISTEN": f"127.0.0.1:{listen}", "EGRESSLAW_ADMIN": f"127.0.0.1:{admin}"}
    running: dict[str, tuple[Container, subprocess.Popen, Path]] = {}
    tag, lease, ran = None, None, []
    try:
        for line in recipe_lines(_doc_block("policy")) + recipe_lines(_doc_block("container")):
            pipe, _, run = line.rpartition("| docker run ")  # `printf … | docker run -i …`: stdin from a host command
            if pipe:
                words = shlex.split("docker run " + run, comments=True)
            else:
                words = [] if "<<" in line else shlex.split(line, comments=True)  # a heredoc is the shell's
            if words[:2] == ["docker", "build"]:
                assert words[2:] == ["-t", words[3], "."], line  # what was built above, from the repository root
                tag = words[3]
            elif words[:2] == ["docker", "stop"]:
                grace = int(words[words.index("-t") + 1]) if "-t" in words else 10
                container, proc, log = running.pop(words[-1])
                proc.send_signal(signal.SIGTERM)  # STOPSIGNAL
                code = proc.wait(timeout=grace)  # TimeoutExpired: the engine would have killed it
                assert code == 0, log.read_text()[-4000:]
                health = subprocess.run(container.process(_healthcheck()), capture_output=True, timeout=30)
                assert health.returncode == 1  # the check can fail: with nothing listening it does
            elif words[:2] == ["docker", "run"]:
                stdin = b""
                if pipe:
                    stdin = subprocess.run(["bash", "-c", pipe], cwd=work, env=host_env, capture_output=True, check=True).stdout
                container = docker_run(image, words, tag, work, proxy_overrides if "-d" in words else {})
                assert container.interactive or not stdin, "stdin is piped to a container run without -i"
                if container.detach:
                    assert container.ports == {int(_env(FINAL)[v].rsplit(":", 1)[1]) for v in ("EGRESSLAW_LISTEN", "EGRESSLAW_ADMIN")}
                    log = image_root / f"{container.name}.log"
                    with log.open("wb") as out:
                        proc = subprocess.Popen(container.process(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
                    running[container.name] = (container, proc, log)
                    _wait_until_healthy(container, proc, log, admin)
                else:
                    done = subprocess.run(container.process(), input=stdin, capture_output=True, timeout=120)
                    assert done.returncode == 0, (container.argv, done.stderr.decode()[-3000:])  # stdout may hold a lease: not shown
                    if container.argv[1:2] == ["lease"]:
                        lease = done.stdout.decode().strip()
                        _a_request_outside_the_policy_is_refused(listen, lease)
                    if container.argv[1:3] == ["audit", "verify"]:  # every worker's chain, intact and closed
                        verified = {Path(w).name for w in re.findall(r"^ok: `?([^`\s:]+)`?:", done.stdout.decode(), re.M)}
                        # (each chain's `.NAME.writer` is the one-writer lock beside it, not a chain)
                        chains = {p.name for p in (image.volumes["egresslaw-data"] / "audit").iterdir() if not p.name.endswith(".writer")}
                        assert verified == chains and chains, (verified, chains)
            else:
                done = subprocess.run(["bash", "-c", line], cwd=work, env=host_env, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, (line[:80], done.stderr[-3000:])
            ran.append(words[:3] or line.split()[:2])
    finally:
        for _, proc, _ in running.values():
            proc.kill()
            proc.wait()
    assert lease and not running and ["docker", "run", "-d"] in ran

    # what the recipe left: the keys and the store are uid 10001's and private, one closed audit chain per worker
    keys, data = image.volumes["egresslaw-keys"], image.volumes["egresslaw-data"]
    for path in [*keys.glob("*.key"), data / "custody/custody.db"]:
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (10001, 0o600), path.name
    chains = sorted(p.name for p in (data / "audit").iterdir() if not p.name.endswith(".writer"))
    locks = sorted(p.name for p in (data / "audit").iterdir() if p.name.endswith(".writer"))
    assert locks == [f".{name}.writer" for name in chains] and all((data / "audit" / n).stat().st_size == 0 for n in locks)
    from egress_proxy.run.supervisor import default_workers  # here: only this test needs the proxy's code

    workers = default_workers()  # what `--workers` defaults to here: the cores, capped by the cgroup's CPU quota
    assert chains == (["audit.jsonl"] if workers == 1 else [f"audit.w{n}.jsonl" for n in range(1, workers + 1)]), chains
    assert all((data / "audit" / name).stat().st_uid == 10001 for name in chains)


def _wait_until_healthy(container: Container, proc: subprocess.Popen, log: Path, admin: int) -> None:
    """What `docker inspect … Health` would show once the proxy is up: /healthz, /readyz and the Dockerfile's check."""
    deadline, ready = time.monotonic() + 90, None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            ready = _get(admin, "/readyz")
        except OSError:
            ready = None
        if ready == 200:
            break
        time.sleep(0.25)
    assert ready == 200, f"not ready (exit {proc.poll()}):\n" + log.read_text()[-4000:]
    assert _get(admin, "/healthz") == 200
    health = subprocess.run(container.process(_healthcheck()), capture_output=True, text=True, timeout=30)
    assert health.returncode == 0, health.stderr[-2000:]


def _a_request_outside_the_policy_is_refused(listen: int, lease: str) -> None:
    """The lease minted in the image verifies in the proxy (the keys volume is shared), and the policy is enforced."""
    status, headers = _through_proxy(listen, "http://example.com/", lease)
    assert status == 403, (status, {k: v for k, v in headers.items() if k.startswith("x-egresslaw")})
