"""A lease names a subject the proxy's artifact has, or it is not minted; an expired lease file runs nothing.

Every command that mints a lease (`lease`, `sandbox-env --keys`, `sandbox-run --keys`) finds the artifact the way
the proxy is given it when `--artifact` is left out, as the docs' examples leave it out: EGRESSLAW_ARTIFACT, else
`build/egresslaw.json` in the working directory. A misspelt profile or connection is refused (exit 2) with the
closest known name; with no artifact at all nothing is minted, unless `--no-subject-check` says so on purpose.
`sandbox-run --lease-file` refuses an expired lease before CMD runs (CMD would only ever see 407 lease-expired).
Each case runs the real CLI in a subprocess, from a directory of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EGRESSLAW = [sys.executable, "-m", "egresslaw"]
TIMEOUT = 120  # a loaded 2-core machine; the commands take about a second


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_")}
    base["PYTHONPATH"] = str(ROOT)  # run from any directory, as an installed egresslaw would
    return subprocess.run([*EGRESSLAW, *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**base, **(env or {})}, input=input)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """`work/` holds build/egresslaw.json (the demo policy, compiled with the default -o) and keys; `elsewhere/` nothing."""
    root = tmp_path_factory.mktemp("lease-subject")
    work, elsewhere = root / "work", root / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    done = _cli("compile", str(ROOT / "policies" / "demo"), "-q", cwd=work)
    assert done.returncode == 0 and (work / "build" / "egresslaw.json").is_file(), done.stderr
    done = _cli("keys", "init", "--dir", str(work / "keys"), cwd=work)
    assert done.returncode == 0, done.stderr
    return {"work": work, "elsewhere": elsewhere, "keys": work / "keys", "artifact": work / "build" / "egresslaw.json"}


@pytest.fixture
def listener():
    """A TCP listener on loopback standing in for a reachable proxy: were the lease not refused, CMD would run."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _assert_refused(done: subprocess.CompletedProcess, *parts: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "", "nothing may be minted or printed"
    assert done.stderr.startswith("error: ") and "\nhelp: " in done.stderr and "Traceback" not in done.stderr, done.stderr
    for part in parts:
        assert part in done.stderr, (part, done.stderr)
    assert "el2." not in done.stderr  # no lease in an error


# Every command that mints, with a misspelt profile and a misspelt connection, and no --artifact (as the docs write it).
MINTERS = {
    "lease": [],
    "sandbox-env": ["sandbox-env", "--proxy", "127.0.0.1:8080", "--confdir", "{work}/conf", "--bundle", "{work}/b.pem"],
    "sandbox-run": ["sandbox-run", "--proxy", "{listener}"],
}


def _argv(command: str, world, listener, *subject: str) -> list[str]:
    head = MINTERS[command] or ["lease"]
    fill = {"work": world["work"], "listener": listener}
    tail = ["--", "touch", str(world["work"] / "ran")] if command == "sandbox-run" else []
    return [a.format(**fill) for a in head] + ["--keys", str(world["keys"]), *subject, *tail]


@pytest.mark.parametrize("command", list(MINTERS))
@pytest.mark.parametrize(("subject", "kind", "close"), [
    (("--profile", "pakage-builder"), "sandbox profile `pakage-builder`", "package-builder"),
    (("--connection", "gihtub"), "connection `gihtub`", "github"),
])
def test_a_misspelt_subject_is_refused_from_the_default_artifact(world, listener, command, subject, kind, close):
    done = _cli(*_argv(command, world, listener, *subject), cwd=world["work"])
    _assert_refused(done, "artifact `build/egresslaw.json` (in the working directory)", f"has no {kind}",
                    f"help: did you mean `{close}`?")
    assert not (world["work"] / "ran").exists(), "CMD ran under a lease for a subject the artifact lacks"


@pytest.mark.parametrize("command", list(MINTERS))
def test_a_misspelt_subject_is_refused_from_egresslaw_artifact(world, listener, command):
    done = _cli(*_argv(command, world, listener, "--connection", "gihtub"), cwd=world["elsewhere"],
                env={"EGRESSLAW_ARTIFACT": str(world["artifact"])})
    _assert_refused(done, f"artifact `{world['artifact']}`", "has no connection `gihtub`",
                    "did you mean `github`?")
    assert not (world["work"] / "ran").exists()


@pytest.mark.parametrize("command", list(MINTERS))
def test_without_any_artifact_nothing_is_minted(world, listener, command):
    done = _cli(*_argv(command, world, listener, "--profile", "package-builder"), cwd=world["elsewhere"])
    _assert_refused(done, "no artifact to check profile `package-builder` against", "nothing was minted",
                    "--artifact build/egresslaw.json", "EGRESSLAW_ARTIFACT", "--no-subject-check")
    assert not (world["work"] / "ran").exists()


def test_the_right_subject_mints_and_no_subject_check_mints_on_purpose(world):
    from egress_proxy.custody.keys import load_lease_keys
    from egress_proxy.custody.lease import verify

    keys = load_lease_keys(world["keys"])
    done = _cli("lease", "--keys", str(world["keys"]), "--profile", "package-builder", cwd=world["work"])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert verify(keys, done.stdout.strip(), now=time.time()).profile == "package-builder"
    done = _cli("lease", "--keys", str(world["keys"]), "--profile", "not-in-any-artifact", "--no-subject-check", cwd=world["elsewhere"])
    assert done.returncode == 0, done.stderr
    assert verify(keys, done.stdout.strip(), now=time.time()).profile == "not-in-any-artifact"


def _lease_file(world, path: Path, *, issued: float, ttl: int) -> str:
    from egress_proxy.custody.keys import load_lease_keys
    from egress_proxy.custody.lease import mint

    token = mint(load_lease_keys(world["keys"]), "ci-7", profile="package-builder", ttl=ttl, now=issued)
    path.write_text(token + "\n")
    return token


def test_sandbox_run_refuses_an_expired_lease_file_before_cmd_runs(world, listener, tmp_path):
    issued = time.time() - 7200
    token = _lease_file(world, tmp_path / "lease.txt", issued=issued, ttl=60)
    expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(issued) + 60))
    marker = tmp_path / "ran"
    done = _cli("sandbox-run", "--proxy", listener, "--lease-file", str(tmp_path / "lease.txt"), "--", "touch", str(marker),
                cwd=tmp_path)
    _assert_refused(done, f"error: the lease in `{tmp_path / 'lease.txt'}` expired at {expired}", "nothing was run",
                    "help: mint a new one with `egresslaw lease")
    assert token not in done.stderr and token.split(".")[2] not in done.stderr
    assert not marker.exists(), "CMD ran with an expired lease"
    piped = _cli("sandbox-run", "--proxy", listener, "--lease-file", "-", "--", "touch", str(marker), cwd=tmp_path,
                 input=token + "\n")
    _assert_refused(piped, f"error: the lease in stdin expired at {expired}")
    assert not marker.exists()


def test_sandbox_run_takes_a_lease_file_that_has_not_expired(world, listener, tmp_path):
    """The control: the same command with a live lease gets past the lease (to the namespace, where one can be made)."""
    _lease_file(world, tmp_path / "lease.txt", issued=time.time(), ttl=3600)
    done = _cli("sandbox-run", "--proxy", listener, "--lease-file", str(tmp_path / "lease.txt"), "--", "true", cwd=tmp_path)
    assert "lease" not in done.stderr, done.stderr
    assert done.returncode == 0 or "network namespace" in done.stderr, done.stderr
