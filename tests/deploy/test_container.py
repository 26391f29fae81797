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
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}  # the top-level packages the wheel is built from
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


# -- the Kubernetes example: a fleet ----------------------------------------------------------------

DOCS = list(yaml.safe_load_all(MANIFEST.read_text()))
BY_KIND: dict[str, list[dict]] = {}
for _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], []).append(_doc)
(WORKLOAD,) = BY_KIND["StatefulSet"]
POD = WORKLOAD["spec"]["template"]["spec"]
(PROXY,) = POD["containers"]
SIDECARS = [c for c in POD["initContainers"] if c.get("restartPolicy") == "Always"]
API_VERSIONS = {"ConfigMap": "v1", "Secret": "v1", "Service": "v1", "StatefulSet": "apps/v1",
                "HorizontalPodAutoscaler": "autoscaling/v2", "PodDisruptionBudget": "policy/v1"}


def _container_env(container: dict = PROXY) -> dict[str, str]:
    """The variables set by value (the others come from a Secret or the pod: `_env_from`)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _env_from(container: dict = PROXY) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"] for e in container.get("env", []) if "valueFrom" in e}


def _secret(name: str) -> dict:
    (secret,) = [s for s in BY_KIND["Secret"] if s["metadata"]["name"] == name]
    return secret


def test_every_document_is_well_formed_and_references_resolve():
    assert set(BY_KIND) == set(API_VERSIONS)
    for doc in DOCS:
        assert doc["apiVersion"] == API_VERSIONS[doc["kind"]] and doc["metadata"]["name"]
    names = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    for volume in POD["volumes"]:
        if "configMap" in volume:
            assert ("ConfigMap", volume["configMap"]["name"]) in names
        if "secret" in volume:
            assert ("Secret", volume["secret"]["secretName"]) in names
    for source in _env_from().values():
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["key"] in _secret(ref["name"])["stringData"]
    volumes = {v["name"] for v in POD["volumes"]} | {t["metadata"]["name"] for t in WORKLOAD["spec"]["volumeClaimTemplates"]}
    for container in POD["containers"] + POD["initContainers"]:
        assert {m["name"] for m in container["volumeMounts"]} <= volumes
    selector = WORKLOAD["spec"]["selector"]["matchLabels"]
    assert WORKLOAD["spec"]["template"]["metadata"]["labels"] == selector
    (service,) = BY_KIND["Service"]
    assert service["spec"]["selector"] == selector and WORKLOAD["spec"]["serviceName"] == service["metadata"]["name"]
    ports = {p["name"] for p in PROXY["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    (budget,) = BY_KIND["PodDisruptionBudget"]
    assert budget["spec"]["selector"]["matchLabels"] == selector


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


def test_the_replicas_share_postgres_custody_and_keep_no_credential_state():
    store = _env_from()["EGRESSLAW_STORE"]["secretKeyRef"]  # the URL (it may hold a password) comes from a Secret
    assert _secret(store["name"])["stringData"][store["key"]].startswith("REPLACE-")
    assert "EGRESSLAW_STORE" not in _container_env()
    assert "PersistentVolumeClaim" not in BY_KIND  # no SQLite file: the only volume per pod is its audit chains
    (template,) = WORKLOAD["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in PROXY["volumeMounts"]}
    audit_dir = _container_env()["EGRESSLAW_AUDIT_LOG"].split("/$(POD_NAME)/")[0]
    assert mounts[audit_dir] == template["metadata"]["name"]
    assert WORKLOAD["spec"]["replicas"] >= 2


def test_workers_match_the_cpu_limit_and_the_autoscaler_scales_on_cpu():
    source = _env_from()["EGRESSLAW_WORKERS"]["resourceFieldRef"]
    assert (source["containerName"], source["resource"], str(source["divisor"])) == (PROXY["name"], "limits.cpu", "1")
    limits, requests = PROXY["resources"]["limits"], PROXY["resources"]["requests"]
    assert limits == requests and float(limits["cpu"]).is_integer() and float(limits["cpu"]) >= 1  # whole CPUs, Guaranteed
    (hpa,) = BY_KIND["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", WORKLOAD["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    assert hpa["spec"]["minReplicas"] == WORKLOAD["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_keys_artifact_signed_proof_and_store_are_where_the_proxy_looks():
    env = _container_env()
    dests = _proxy_dests()
    assert all(name in ("POD_NAME",) or (name.startswith("EGRESSLAW_") and name[10:].lower() in dests) for name in env | _env_from())
    image = _env(STEPS)
    fleet_own = {"EGRESSLAW_AUDIT_LOG"}  # one directory per replica, one chain per worker in it
    assert {k: v for k, v in env.items() if k in image and k not in fleet_own} == {k: v for k, v in image.items() if k in env and k not in fleet_own}
    assert env["EGRESSLAW_AUDIT_LOG"].startswith(image["EGRESSLAW_AUDIT_LOG"].rsplit("/", 1)[0] + "/$(POD_NAME)/")
    assert _env_from()["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert [e["name"] for e in PROXY["env"]].index("POD_NAME") < [e["name"] for e in PROXY["env"]].index("EGRESSLAW_AUDIT_LOG")
    mounts = {m["mountPath"]: m for m in PROXY["volumeMounts"]}
    volumes = {v["name"]: v for v in POD["volumes"]}
    keys = mounts[env["EGRESSLAW_KEYS"]]
    assert keys["readOnly"] is True
    secret = volumes[keys["name"]]["secret"]
    assert secret["defaultMode"] & 0o007 == 0  # never readable by others: the proxy refuses such a key
    assert set(_secret(secret["secretName"])["stringData"]) == {"custody.key", "lease.key", "audit.key"}  # the proxy needs all three
    policy_dir = os.path.dirname(env["EGRESSLAW_ARTIFACT"])
    assert os.path.dirname(env["EGRESSLAW_PROOF"]) == os.path.dirname(env["EGRESSLAW_TRUST_PROOFS"]) == policy_dir
    assert mounts[policy_dir]["readOnly"] is True
    (config,) = [c for c in BY_KIND["ConfigMap"] if c["metadata"]["name"] == volumes[mounts[policy_dir]["name"]]["configMap"]["name"]]
    assert set(config["data"]) == {os.path.basename(env[k]) for k in ("EGRESSLAW_ARTIFACT", "EGRESSLAW_PROOF", "EGRESSLAW_TRUST_PROOFS")}
    assert not mounts[env["EGRESSLAW_CONFDIR"]].get("readOnly")


def test_the_audit_chains_are_shipped_after_the_proxy_closed_them():
    (shipper,) = SIDECARS  # a native sidecar: Kubernetes stops it only after the proxy container has exited
    script = " ".join(shipper["command"])
    assert "trap" in script and "TERM" in script  # its last copy, at its own stop, holds the closing checkpoints
    audit_mount = next(m for m in PROXY["volumeMounts"] if m["name"] == "audit")
    shipped = next(m for m in shipper["volumeMounts"] if m["name"] == "audit")
    assert shipped["mountPath"] == audit_mount["mountPath"] and shipped["readOnly"] is True
    assert f"{audit_mount['mountPath']}/$POD_NAME" in script  # each replica's directory, under its own name
    assert WORKLOAD["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30


def test_the_example_holds_no_secret():
    for secret in BY_KIND["Secret"]:
        for name, value in secret.get("stringData", {}).items():
            assert value.startswith("REPLACE-"), name
        assert "data" not in secret
    for token in re.findall(r"[A-Za-z0-9+/=_\-]{20,}", MANIFEST.read_text()):
        assert not secret_kind(token), token
