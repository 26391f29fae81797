"""The Dockerfile and the Kubernetes example: linted here (no container engine on CI), built where docker works.

What is checked is what an adopter relies on: a pinned base, a non-root user, nothing secret and
nothing but the runtime in the image, configuration through EGRESSLAW_* variables that really are
proxy options, and a Deployment whose probes, mounts and permissions fit what the proxy checks.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from compiler.secrets_scan import secret_kind
from egresslaw.cli import build_parser
from tests.deploy.dockerfile import STEPS, image_env

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kubernetes.yaml"




def _proxy_dests() -> set[str]:
    proxy = build_parser()._subparsers._group_actions[0].choices["proxy"]
    return {a.dest for a in proxy._actions if a.option_strings and a.dest != "help"}


def test_the_base_image_is_pinned_to_a_patch_release():
    (arg,) = [rest for kw, rest in STEPS if kw == "ARG" and rest.startswith("PYTHON_IMAGE=")]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.1[2-9]\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", image), image
    assert [rest for kw, rest in STEPS if kw == "FROM"] == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]


def test_it_runs_as_an_unprivileged_user():
    users = [rest for kw, rest in STEPS if kw == "USER"]
    assert users and users[-1] == "10001:10001"
    final = STEPS[[i for i, (kw, _) in enumerate(STEPS) if kw == "FROM"][-1]:]
    assert [kw for kw, _ in final].index("USER") < [kw for kw, _ in final].index("ENTRYPOINT")
    assert any("useradd --system --uid 10001" in rest for kw, rest in final if kw == "RUN")


def test_only_the_runtime_goes_in():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}  # the top-level packages the wheel is built from
    copied = set()
    for keyword, rest in STEPS:
        assert keyword != "ADD", "use COPY: ADD fetches URLs and unpacks archives"
        if keyword == "COPY" and not rest.startswith("--from="):
            copied |= set(rest.split()[:-1])
    top = {p.split(".")[0] for p in packages}
    lock = "deploy/requirements-proxy.lock"  # the runtime's pins with hashes (tests/deploy/test_image_build.py)
    assert copied == top | {"pyproject.toml", "README.md", "LICENSE", lock}
    runs = " ".join(rest for kw, rest in STEPS if kw == "RUN")
    assert f"pip install --require-hashes --no-deps -r {lock}" in runs and "[test]" not in runs and "[prove]" not in runs
    for tool in ("pytest", "hypothesis", "pre-commit", "gcc", "build-essential", "curl", "wget", "git"):
        assert tool not in runs, tool
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*"  # the build context is an allowlist: keys, stores and logs never enter it
    assert {line[1:].rstrip("/") for line in ignore if line.startswith("!")} == copied


def test_nothing_secret_is_baked_in():
    for keyword, rest in STEPS:
        for token in shlex.split(rest.replace("\\", " ")):
            assert not secret_kind(token), (keyword, token)
        if keyword in ("ENV", "ARG"):
            for name in re.findall(r"([A-Z_]+)=", rest):
                assert not re.search(r"TOKEN|SECRET|PASSWORD|PRIVATE|CREDENTIAL", name), name
        if keyword == "COPY":
            assert not re.search(r"\.key\b|\.pem\b|\.db\b|keys|audit|\.env\b", rest), rest


def test_configuration_is_proxy_options_and_the_ports_match():
    env = image_env(STEPS)
    dests = _proxy_dests()
    ours = {k: v for k, v in env.items() if k.startswith("EGRESSLAW_")}
    assert {"EGRESSLAW_ARTIFACT", "EGRESSLAW_PROOF", "EGRESSLAW_KEYS", "EGRESSLAW_LISTEN", "EGRESSLAW_ADMIN"} <= set(ours)
    for name in ours:
        assert name[len("EGRESSLAW_"):].lower() in dests, name
    exposed = {int(p) for kw, rest in STEPS if kw == "EXPOSE" for p in rest.split()}
    assert exposed == {int(ours["EGRESSLAW_LISTEN"].rsplit(":", 1)[1]), int(ours["EGRESSLAW_ADMIN"].rsplit(":", 1)[1])}
    assert [rest for kw, rest in STEPS if kw == "ENTRYPOINT"] == ['["egresslaw"]']
    assert [rest for kw, rest in STEPS if kw == "CMD"] == ['["proxy"]']


def test_license_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {"text": "Apache-2.0"}


@pytest.mark.skipif(shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0,
                    reason="no container engine here; the Dockerfile is linted above")
def test_the_image_builds_and_runs_as_non_root(tmp_path):
    tag = "egresslaw-test:ci"
    subprocess.run(["docker", "build", "-t", tag, str(ROOT)], check=True, timeout=1800)
    out = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", tag, "-u"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "10001"
    version = subprocess.run(["docker", "run", "--rm", tag, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("egresslaw ")


# -- the Kubernetes example: a fleet ----------------------------------------------------------------


# The Kubernetes manifest's tests are in tests/deploy/test_kubernetes.py.
