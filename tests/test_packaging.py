"""The wheel is the product: built from this tree's sdist, installed into a fresh virtualenv, it compiles, proves and serves.

The path a release takes (`deploy/release.sh`, `python -m build`): the sdist is built from a clean copy of the tracked
tree and must carry what a rebuild needs (LICENSE, README.md, CHANGELOG.md, the grammar, the catalog data, the
specifications; MANIFEST.in) and no tests; the wheel is then built from the unpacked sdist, not from the tree.

Packages are discovered (`[tool.setuptools.packages.find]`), so a new package cannot be left out of the wheel
the way `proofs.spec` once was (a wheel without it had no `prove`). Nothing here imports from the source tree:
every command runs from the new virtualenv in a scratch directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from tests import ports
from tests.lockfiles import constraints

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, *, stdin: bytes | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "EGRESSLAW_"))}
    proc = subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd}: {proc.returncode}\n{proc.stdout.decode()[-2000:]}\n{proc.stderr.decode()[-4000:]}"
    return proc


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range, one slice per xdist worker


def test_a_wheel_built_from_the_sdist_installs_and_compiles_proves_and_serves(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a clean copy of the tracked tree: what a clone holds, nothing built or cached
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        rel = Path(name.decode())
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "sdist"), str(src)], tmp_path)
    (sdist,) = (tmp_path / "sdist").glob("egresslaw-*.tar.gz")
    with tarfile.open(sdist) as tar:
        top = f"{sdist.name.removesuffix('.tar.gz')}/"
        members = {m.name.removeprefix(top) for m in tar.getmembers() if m.isfile()}
        tar.extractall(tmp_path / "unpacked", filter="data")
    for needed in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "compiler/grammar.lark", "catalog/data/MANIFEST.json",
                   "catalog/data/2026.11/providers.json", "proofs/spec/__init__.py", "proofs/spec/addresses.py"):
        assert needed in members, f"the sdist has no {needed}"
    assert not [m for m in members if m.startswith("tests/")], "the sdist carries the test suite"
    # the wheel from the sdist alone: anything the sdist left out that the build needs fails here, not at a user's pip
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(tmp_path / "unpacked" / top)], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("egresslaw-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("catalog", "compiler", "proofs", "proofs/spec", "egress_proxy", "egress_proxy/decision",
                    "egress_proxy/custody", "egress_proxy/audit", "egress_proxy/edge", "egress_proxy/run", "egresslaw/commands"):
        assert f"{package}/__init__.py" in names, f"the wheel has no {package}"
    assert "compiler/grammar.lark" in names and any(n.startswith("catalog/data/") for n in names)
    assert not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    # prove needs z3; the dependencies at the lock's versions, so a release on the index cannot turn this red
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraints(tmp_path)), f"{wheel}[prove]"], tmp_path)
    _run([str(venv / "bin" / "python"), "-m", "pip", "check"], tmp_path)
    el = str(venv / "bin" / "egresslaw")
    work = tmp_path / "work"
    shutil.copytree(ROOT / "policies" / "demo", work / "demo")
    _run([el, "compile", "demo", "-o", "build/egresslaw.json", "--locked"], work)
    _run([el, "keys", "init", "--proof-signing", "--dir", "prover"], work)
    _run([el, "prove", "build/egresslaw.json", "-o", "build/proof.json", "--jobs", "2", "--sign", "prover/proof-signing.key"], work)
    report = json.loads((work / "build" / "proof.json").read_text())
    verdicts = {r["verdict"] for r in report["results"]}
    assert verdicts == {"proved"} and len(report["results"]) >= 50, verdicts
    _run([el, "keys", "init", "--dir", "keys"], work)
    _run([el, "custody", "put", "--keys", "keys", "--store", "custody.db", "--workspace", "acme", "--connection", "github",
          "--handle", "gh-prod"], work, stdin=b"ghp_wheelCANARY0123456789\n")
    port = _free_port()
    proxy = subprocess.Popen([el, "proxy", "--artifact", "build/egresslaw.json", "--proof", "build/proof.json",
                              "--trust-proofs", "prover/proof-signing.pub", "--keys", "keys",
                              "--store", "custody.db", "--listen", f"127.0.0.1:{port}", "--confdir", "conf", "--audit-log", "audit.jsonl",
                              "--allow-missing-credentials"],  # only `github` is sealed: the minting kinds' records are not this test's
                             cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proxy.poll() is None, proxy.communicate()[1].decode()[-3000:]
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"GET http://pypi.org/simple/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n")
                    answer = s.recv(4096)
                break
            except OSError:
                assert time.monotonic() < deadline, "the proxy from the wheel never listened"
                time.sleep(0.2)
        assert answer.startswith(b"HTTP/1.1 407"), answer[:200]  # no lease: refused by the proxy the wheel installed
        assert b"lease-missing" in answer
    finally:
        proxy.send_signal(signal.SIGTERM)
        out, err = proxy.communicate(timeout=60)
    assert proxy.returncode == 0, err.decode()[-3000:]
    audit = b"".join(f.read_bytes() for f in work.glob("audit*.jsonl"))  # one chain per worker process
    assert b"lease-missing" in audit and b"CANARY" not in out + err + audit
    verified = _run([el, "audit", "verify", str(work)], work)
    assert b" 0 open, 0 broken" in verified.stdout
