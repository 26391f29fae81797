"""The Dockerfile and the Kubernetes example: linted here (no container engine on CI), built where docker works.

What is checked is what an adopter relies on: a pinned base, a non-root user, nothing secret and
nothing but the runtime in the image, configuration through EGRESSLAW_* variables that really are
proxy options, and a Deployment whose probes, mounts and permissions fit what the proxy checks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from compiler.secrets_scan import secret_kind
from egresslaw.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kubernetes.yaml"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
            current = ""
    return out


STEPS = instructions(DOCKERFILE.read_text())


def _env(steps) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in steps:
        if keyword == "ENV":
            for token in shlex.split(rest):
                name, _, value = token.partition("=")
                env[name] = value
    return env


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
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    copied = set()
    for keyword, rest in STEPS:
        assert keyword != "ADD", "use COPY: ADD fetches URLs and unpacks archives"
        if keyword == "COPY" and not rest.startswith("--from="):
            copied |= set(rest.split()[:-1])
    top = {p.split(".")[0] for p in packages}
    assert copied == top | {"pyproject.toml", "README.md", "LICENSE"}
    runs = " ".join(rest for kw, rest in STEPS if kw == "RUN")
    assert "pip install ." in runs and "[test]" not in runs
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
    env = _env(STEPS)
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


# -- the Kubernetes example -------------------------------------------------------------------------

DOCS = list(yaml.safe_load_all(MANIFEST.read_text()))
BY_KIND: dict[str, list[dict]] = {}
for _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], []).append(_doc)
(DEPLOYMENT,) = BY_KIND["Deployment"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
(PROXY,) = POD["containers"]


def _container_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in PROXY.get("env", [])}


def test_every_document_is_well_formed_and_references_resolve():
    assert set(BY_KIND) == {"ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment", "Service"}
    for doc in DOCS:
        assert doc["apiVersion"] in ("v1", "apps/v1") and doc["metadata"]["name"]
    names = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    for volume in POD["volumes"]:
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in names
        if "secret" in volume:
            assert ("Secret", volume["secret"]["secretName"]) in names
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
    volumes = {v["name"] for v in POD["volumes"]}
    for container in POD["containers"] + POD.get("initContainers", []):
        assert {m["name"] for m in container["volumeMounts"]} <= volumes
    selector = DEPLOYMENT["spec"]["selector"]["matchLabels"]
    assert DEPLOYMENT["spec"]["template"]["metadata"]["labels"] == selector
    (service,) = BY_KIND["Service"]
    assert service["spec"]["selector"] == selector
    ports = {p["name"] for p in PROXY["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_the_pod_runs_as_the_image_user_with_nothing_extra():
    image_user = [rest for kw, rest in STEPS if kw == "USER"][-1]
    context = POD["securityContext"]
    assert context["runAsNonRoot"] is True and f"{context['runAsUser']}:{context['runAsGroup']}" == image_user
    assert context["fsGroup"] == context["runAsGroup"]  # how a non-root proxy reads root-owned Secret files
    assert POD["automountServiceAccountToken"] is False
    for container in POD["containers"] + POD["initContainers"]:
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]


def test_probes_use_the_admin_port_health_endpoints():
    admin_port = int(_container_env()["EGRESSLAW_ADMIN"].rsplit(":", 1)[1])
    named = {p["name"]: p["containerPort"] for p in PROXY["ports"]}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = PROXY[probe]["httpGet"]
        assert get["path"] == path and named[get["port"]] == admin_port, probe
    assert named["proxy"] == int(_container_env()["EGRESSLAW_LISTEN"].rsplit(":", 1)[1])


def test_keys_artifact_and_proof_are_mounted_where_the_proxy_looks():
    env = _container_env()
    dests = _proxy_dests()
    assert all(name.startswith("EGRESSLAW_") and name[10:].lower() in dests for name in env)
    image = _env(STEPS)
    assert {k: v for k, v in env.items() if k in image} == {k: v for k, v in image.items() if k in env}  # the image's defaults
    mounts = {m["mountPath"]: m for m in PROXY["volumeMounts"]}
    volumes = {v["name"]: v for v in POD["volumes"]}
    keys = mounts[env["EGRESSLAW_KEYS"]]
    assert keys["readOnly"] is True
    secret = volumes[keys["name"]]["secret"]
    assert secret["defaultMode"] & 0o007 == 0  # never readable by others: the proxy refuses such a key
    (keys_secret,) = [s for s in BY_KIND["Secret"] if s["metadata"]["name"] == secret["secretName"]]
    assert set(keys_secret["stringData"]) == {"custody.key", "lease.key"}
    policy_dir = os.path.dirname(env["EGRESSLAW_ARTIFACT"])
    assert os.path.dirname(env["EGRESSLAW_PROOF"]) == policy_dir and mounts[policy_dir]["readOnly"] is True
    (config,) = [c for c in BY_KIND["ConfigMap"] if c["metadata"]["name"] == volumes[mounts[policy_dir]["name"]]["configMap"]["name"]]
    assert set(config["data"]) == {os.path.basename(env["EGRESSLAW_ARTIFACT"]), os.path.basename(env["EGRESSLAW_PROOF"])}
    data = [p for p in mounts if env["EGRESSLAW_STORE"].startswith(p + "/")]
    assert data and not mounts[data[0]].get("readOnly")


def test_the_example_holds_no_secret():
    for secret in BY_KIND["Secret"]:
        for name, value in secret.get("stringData", {}).items():
            assert value.startswith("REPLACE-"), name
        assert "data" not in secret
    for token in re.findall(r"[A-Za-z0-9+/=_\-]{20,}", MANIFEST.read_text()):
        assert not secret_kind(token), token
