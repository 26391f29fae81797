"""deploy/kubernetes.yaml, deploy/sandbox-networkpolicy.yaml and docs/kubernetes.md: valid, consistent, and the pod starts.

Three layers, cheapest first.

1. Schemas, offline. The Kubernetes kinds against the JSON schemas `kubernetes-validate` bundles, strict (an
   unknown field fails), for the oldest Kubernetes the docs support and the newest bundled. The two custom
   resources (ServiceMonitor, CiliumNetworkPolicy) against small schemas written here for exactly the fields
   this project uses, every object closed (`additionalProperties: false`): field names, types, enums and
   patterns as the upstream CRDs define them (prometheus-operator
   `example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml`, cilium
   `pkg/k8s/apis/cilium.io/client/crds/v2/ciliumnetworkpolicies.yaml`), read there, restated here; a field
   used that is not in them fails until it is added, so the subset cannot drift silently. Broken copies must be
   refused (a validator that accepts everything is a defect).
2. What the documents say to each other: every Secret, ConfigMap and key the manifest refers to is made by the
   documented setup before the first `apply`; Services, ServiceMonitor and probes meet the ports; the sandbox
   policies admit the proxy's pods and nothing else (a small evaluator of NetworkPolicy rules, stated from the
   Kubernetes documentation, not from the manifest); the stop fits the grace period.
3. The pod, played as the kubelet would (slow, root only). Volumes are laid out as the kubelet makes them
   (pkg/volume: emptyDir root:root 0777; with fsGroup, every entry chgrp'd, group rw (ro for Secret and
   ConfigMap volumes), directories setgid; Secret files behind `..data` symlinks; read-only mounts where the
   manifest says so). The init container's `command`/`args` and then the proxy's ENTRYPOINT with the env of
   the YAML (both parsed, never copied) run as uid 10001 with `setpriv`, in a root filesystem built in a private
   mount namespace and entered with `chroot`; the same for the lane's pod (`egresslaw lane`, with this machine's
   Envoy from the `lane` extra standing for the lane image's).

Two front ends, two workloads (`Front`): the proxy's StatefulSet and the lane's, each with its Services, budget,
autoscaler and ServiceMonitor; the checks of layer 2 run for both, against the options of their own command.

   Why a chroot rather than rewritten paths: uid 10001 cannot use this machine's interpreter in place
   (`.venv/bin/python -> /root/.pyenv/...`, and /root is 0700) nor reach pytest's temp dir
   (/tmp/pytest-of-root is 0700). In the namespace the test builds what the image would hold: the host's /usr,
   the repository and its .venv (at the image's /opt/egresslaw), the interpreter's prefix (its parents 0755
   there, nothing else of /root), all read-only, the root itself read-only (`readOnlyRootFilesystem`), and the
   pod's volumes at the manifest's own paths. So no path is rewritten. Three values are replaced, and only
   these: the store (a SQLite file for the PostgreSQL URL) and the listen and admin addresses (loopback, free
   ports). Mounts live and die with the namespace: nothing is mounted on the host.
"""

from __future__ import annotations

import copy
import http.client
import json
import math
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from ipaddress import ip_address, ip_network
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from compiler.secrets_scan import secret_kind
from egresslaw.cli import build_parser
from tests.deploy.dockerfile import FINAL, image_env, install_dirs

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kubernetes.yaml"
SANDBOX_POLICY = ROOT / "deploy" / "sandbox-networkpolicy.yaml"
DOC = ROOT / "docs" / "kubernetes.md"

MIN_KUBERNETES = "1.30"  # native sidecars (1.29) and the preStop `sleep` action (1.30), both on by default from here
K8S_VERSIONS = (MIN_KUBERNETES, kv_utils.major_minor(kv_utils.latest_version()))


# -- the files ---------------------------------------------------------------------------------------


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC_TEXT, re.DOTALL | re.MULTILINE)


MANIFEST_DOCS = _load(MANIFEST)
SANDBOX_DOCS = _load(SANDBOX_POLICY)
DOC_TEXT = DOC.read_text()
DOC_YAML = [yaml.safe_load(block) for block in _blocks("yaml")]
DOC_OBJECTS = [d for d in DOC_YAML if "kind" in d]  # the optional DNS policy, the Cilium variant
(SCRAPE_CONFIG,) = [d for d in DOC_YAML if "scrape_configs" in d]


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def _labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


BY_KIND = _by_kind(MANIFEST_DOCS)
SERVICES = {s["metadata"]["name"]: s for s in BY_KIND["Service"]}


@dataclass(frozen=True)
class Front:
    """One front end's workload (`egresslaw proxy` or `egresslaw lane`) and the objects that serve it."""

    command: str
    workload: dict

    @property
    def pod(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    @property
    def container(self) -> dict:
        (container,) = self.pod["containers"]
        return container

    @property
    def conf_init(self) -> dict:
        (init,) = [c for c in self.pod["initContainers"] if c["name"] == "conf"]
        return init

    @property
    def sidecars(self) -> list[dict]:
        return [c for c in self.pod["initContainers"] if c.get("restartPolicy") == "Always"]

    def _services(self, headless: bool) -> dict:
        selector = self.workload["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in SERVICES.values() if s["spec"]["selector"] == selector and (s["spec"].get("clusterIP") == "None") == headless]
        return service

    @property
    def headless(self) -> dict:
        return self._services(True)

    @property
    def client_service(self) -> dict:
        return self._services(False)

    @property
    def service_monitor(self) -> dict:
        (monitor,) = [m for m in BY_KIND["ServiceMonitor"] if _labels_match(m["spec"]["selector"], self.headless["metadata"]["labels"])]
        return monitor

    def of_kind(self, kind: str) -> dict:
        """The HorizontalPodAutoscaler or PodDisruptionBudget of this workload."""
        name = self.workload["metadata"]["name"]
        selector = self.workload["spec"]["selector"]["matchLabels"]
        (found,) = [d for d in BY_KIND[kind] if d["spec"].get("scaleTargetRef", {}).get("name") == name
                    or d["spec"].get("selector", {}).get("matchLabels") == selector]
        return found


WORKLOADS = {w["metadata"]["name"]: w for w in BY_KIND["StatefulSet"]}
FRONTS = (Front("proxy", WORKLOADS["egresslaw"]), Front("lane", WORKLOADS["egresslaw-lane"]))
FRONT_IDS = [f.command for f in FRONTS]
PROXY_FRONT, LANE_FRONT = FRONTS
WORKLOAD = PROXY_FRONT.workload
POD = PROXY_FRONT.pod
PROXY = PROXY_FRONT.container
CONF_INIT = PROXY_FRONT.conf_init
SIDECARS = PROXY_FRONT.sidecars
HEADLESS, CLIENT_SERVICE = PROXY_FRONT.headless, PROXY_FRONT.client_service
SERVICE_MONITOR = PROXY_FRONT.service_monitor
# The audit exporter's variables (docs/audit-export.md "In the front ends"), shared options of both commands.
EXPORT_ENV = ("EGRESSLAW_EXPORT_TO", "EGRESSLAW_EXPORT_HEADERS", "EGRESSLAW_EXPORT_CA")
(CILIUM,) = [d for d in DOC_OBJECTS if d["kind"] == "CiliumNetworkPolicy"]
(DNS_POLICY,) = [d for d in DOC_OBJECTS if d["kind"] == "NetworkPolicy"]

# The first version of the init container and its volume (deploy/kubernetes.yaml before the fix), as a cluster ran it.
FIRST_INIT = yaml.safe_load("""
name: conf
image: egresslaw:0.1.0
command:
  - sh
  - -c
  - >-
    install -d -m 0700 /var/lib/egresslaw/conf &&
    install -m 0600 /etc/egresslaw/conf/mitmproxy-ca.pem /etc/egresslaw/conf/mitmproxy-ca-cert.pem
    /etc/egresslaw/conf/admin.token /var/lib/egresslaw/conf/
volumeMounts:
  - {name: conf-secret, mountPath: /etc/egresslaw/conf, readOnly: true}
  - {name: conf, mountPath: /var/lib/egresslaw/conf}
""")
FIRST_VOLUME = {"name": "conf", "emptyDir": {}}


# -- the image, from the Dockerfile --------------------------------------------------------------------




@dataclass(frozen=True)
class Image:
    env: dict[str, str]
    user: tuple[int, int]
    workdir: str
    entrypoint: list[str]
    cmd: list[str]
    dirs: tuple[tuple[str, int, int, int], ...]  # (path, uid, gid, mode) made by `install -d` in a RUN


def _image() -> Image:
    env, dirs = image_env(FINAL), install_dirs(FINAL)
    user = next(rest for kw, rest in reversed(FINAL) if kw == "USER")
    uid, gid = (int(x) for x in user.split(":"))
    return Image(env=env, user=(uid, gid), workdir=next(rest for kw, rest in reversed(FINAL) if kw == "WORKDIR"),
                 entrypoint=json.loads(next(rest for kw, rest in FINAL if kw == "ENTRYPOINT")),
                 cmd=json.loads(next(rest for kw, rest in FINAL if kw == "CMD")), dirs=tuple(dirs))


IMAGE = _image()


def _dests(command: str = "proxy") -> set[str]:
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    return {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}


def _env_values(container: dict) -> dict[str, str]:
    """The variables set by value (the others come from a Secret or the pod: `_env_from`)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _env_from(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"] for e in container.get("env", []) if "valueFrom" in e}


def _mount_for(container: dict, path: str) -> dict:
    """The volumeMount `path` lies in (the deepest one that holds it)."""
    holding = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert holding, f"`{path}` is on no volume of container {container['name']}"
    return max(holding, key=lambda m: len(m["mountPath"]))


def _volume(name: str, pod: dict = POD) -> dict:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return volume


# -- the documented setup --------------------------------------------------------------------------------


def _setup_lines() -> list[str]:
    (block,) = [b for b in _blocks("bash") if "create namespace" in b]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


SETUP_LINES = _setup_lines()


def _setup_objects() -> dict[tuple[str, str], dict[str, str | None]]:
    """What the setup creates: (kind, name) -> {key: the file it is read from (None: a literal)}."""
    made: dict[tuple[str, str], dict[str, str | None]] = {}
    for line in SETUP_LINES:
        words = shlex.split(line)
        if "kubectl" not in words or "create" not in words:
            continue
        i = words.index("create")
        if words[i + 1] == "secret":
            assert words[i + 2] == "generic", line
            key = ("Secret", words[i + 3])
        elif words[i + 1] == "configmap":
            key = ("ConfigMap", words[i + 2])
        else:
            continue
        keys: dict[str, str | None] = {}
        for word in words[i:words.index("|") if "|" in words else len(words)]:
            if word.startswith("--from-file="):
                value = word.split("=", 1)[1]
                name, _, path = value.partition("=") if "=" in value else (os.path.basename(value), "", value)
                keys[name] = path
            elif word.startswith("--from-literal="):
                keys[word.split("=", 2)[1]] = None
        made[key] = keys
    return made


SETUP = _setup_objects()
(NAMESPACE,) = [line.split("=", 1)[1] for line in SETUP_LINES if line.startswith("NS=")]


def _references() -> list[tuple[str, str, str | None, str]]:
    """Every (kind, name, key or None for all, where) the manifest refers to."""
    refs: list[tuple[str, str, str | None, str]] = []
    for volume in [v for front in FRONTS for v in front.pod["volumes"]]:
        where = f"volume {volume['name']}"
        if "secret" in volume:
            refs.append(("Secret", volume["secret"]["secretName"], None, where))
        if "configMap" in volume:
            refs.append(("ConfigMap", volume["configMap"]["name"], None, where))
        for source in volume.get("projected", {}).get("sources", []):
            for kind, field in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if field in source:
                    items = source[field].get("items")
                    refs += [(kind, source[field]["name"], item["key"], where) for item in items] if items else [(kind, source[field]["name"], None, where)]
    for container in [c for front in FRONTS for c in front.pod["containers"] + front.pod["initContainers"]]:
        for name, source in _env_from(container).items():
            for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if field in source:
                    refs.append((kind, source[field]["name"], source[field]["key"], f"{container['name']} env {name}"))
    for endpoint in [e for monitor in BY_KIND["ServiceMonitor"] for e in monitor["spec"]["endpoints"]]:
        cred = endpoint["authorization"]["credentials"]
        refs.append(("Secret", cred["name"], cred["key"], "ServiceMonitor"))
    return refs


# -- 1. schemas ---------------------------------------------------------------------------------------------

_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_METADATA = _closed({"name": _STR, "namespace": _STR, "labels": _LABELS, "annotations": _LABELS}, ("name",))
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_ENDPOINT_SELECTOR = _closed({"matchLabels": _LABELS})
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _closed({
        "apiVersion": _STR, "kind": _STR, "metadata": _METADATA,
        "spec": _closed({
            "selector": _closed({"matchLabels": _LABELS}),
            "namespaceSelector": _closed({"any": _BOOL, "matchNames": {"type": "array", "items": _STR}}),
            "endpoints": {"type": "array", "minItems": 1, "items": _closed({
                "port": _STR, "path": _STR, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                "interval": _DURATION, "scrapeTimeout": _DURATION,
                "authorization": _closed({"type": _STR, "credentials": _closed({"name": _STR, "key": _STR, "optional": _BOOL}, ("key",))}),
            })},
        }, ("endpoints", "selector")),
    }, ("apiVersion", "kind", "metadata", "spec")),
    ("cilium.io/v2", "CiliumNetworkPolicy"): _closed({
        "apiVersion": _STR, "kind": _STR, "metadata": _METADATA,
        "spec": _closed({
            "description": _STR,
            "endpointSelector": _ENDPOINT_SELECTOR,
            "enableDefaultDeny": _closed({"egress": _BOOL, "ingress": _BOOL}),
            "egress": {"type": "array", "items": _closed({
                "toEndpoints": {"type": "array", "items": _ENDPOINT_SELECTOR},
                "toPorts": {"type": "array", "items": _closed({
                    "ports": {"type": "array", "maxItems": 40, "items": _closed({
                        "port": {"type": "string", "pattern": r"^(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})|([a-zA-Z0-9]-?)*[a-zA-Z](-?[a-zA-Z0-9])*$"},
                        "protocol": {"enum": ["TCP", "UDP", "SCTP", "VRRP", "IGMP", "ANY"]},
                    }, ("port",))},
                    "rules": _closed({"dns": {"type": "array", "items": _closed({
                        "matchName": {"type": "string", "maxLength": 255, "pattern": r"^([-a-zA-Z0-9_]+[.]?)+$"},
                        "matchPattern": {"type": "string", "maxLength": 255, "pattern": r"^([-a-zA-Z0-9_*]+[.]?)+$"},
                    })}}),
                })},
            })},
        }, ("endpointSelector",)),
    }, ("apiVersion", "kind", "metadata", "spec")),
}


def validate(doc: dict) -> list[str]:
    """Validate one object, for every supported Kubernetes version; the versions it was checked against.

    Raises on any error, and on a kind that has neither a bundled schema nor one above (never skipped)."""
    schema = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(doc)
        return ["crd"]
    return [kubernetes_validate.validate(doc, version, strict=True) for version in K8S_VERSIONS]


ALL_OBJECTS = [(MANIFEST.name, d) for d in MANIFEST_DOCS] + [(SANDBOX_POLICY.name, d) for d in SANDBOX_DOCS] + [(DOC.name, d) for d in DOC_OBJECTS]


@pytest.mark.parametrize(("where", "doc"), ALL_OBJECTS, ids=[f"{w}:{d['kind']}/{d['metadata']['name']}" for w, d in ALL_OBJECTS])
def test_every_object_is_valid_against_its_schema(where, doc):
    checked = validate(doc)
    assert checked == ["crd"] or checked == list(K8S_VERSIONS), (where, checked)


def _set(path: str, value):
    """A mutation: set the field at a dotted path (list indexes as numbers), creating the last key."""
    def mutate(doc: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = doc
        for part in parents:
            node = node[part]
        node[last] = value
    return mutate


POD_PATH = "spec.template.spec"
BROKEN = [  # (which object, mutation, a word the error names): each copy must be refused
    ("StatefulSet", _set(f"{POD_PATH}.terminationGracePeriodSecond", 60), "terminationGracePeriodSecond"),  # a typo: strict
    ("StatefulSet", _set("spec.replicas", "two"), "two"),
    ("StatefulSet", _set(f"{POD_PATH}.containers.0.lifecycle.preStop.sleep", {"seconds": "5"}), "5"),
    ("StatefulSet", _set(f"{POD_PATH}.securityContext.fsGroupChangePolicy", 3), "3"),
    ("StatefulSet", _set(f"{POD_PATH}.volumes.2.projected.sources.0.secret.items.0.mode", "0600"), "0600"),
    ("Service", _set("spec.ports.0.port", "eighty"), "eighty"),
    ("NetworkPolicy", _set("spec.egress.0.to.0.namespaceSelector.matchLabel", {"a": "b"}), "matchLabel"),
    ("NetworkPolicy", _set("spec.egress.0.ports.0.protocol", 6), "6"),
    ("ServiceMonitor", _set("spec.endpoints.0.bearerToken", "x" * 40), "bearerToken"),
    ("ServiceMonitor", _set("spec.endpoints.0.interval", "30 seconds"), "30 seconds"),
    ("CiliumNetworkPolicy", _set("spec.egress.0.toPorts.0.ports.0.port", 8080), "8080"),
    ("CiliumNetworkPolicy", _set("spec.egress.0.toPorts.0.ports.0.protocol", "ICMP"), "ICMP"),
    ("CiliumNetworkPolicy", _set("spec.egress.0.toFQDN", []), "toFQDN"),
]


@pytest.mark.parametrize(("kind", "mutate", "named"), BROKEN, ids=[f"{k}-{n}" for k, _, n in BROKEN])
def test_a_broken_copy_is_refused(kind, mutate, named):
    original = next(doc for _, doc in ALL_OBJECTS if doc["kind"] == kind and (kind != "NetworkPolicy" or doc["spec"].get("egress")))
    validate(original)
    broken = copy.deepcopy(original)
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError) as caught:
        validate(broken)
    assert named in str(caught.value.message) or named in json.dumps(list(caught.value.path)), caught.value.message


def test_a_kind_without_a_schema_is_an_error_not_a_pass():
    with pytest.raises(kv_utils.SchemaNotFoundError):
        validate({"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_the_supported_kubernetes_floor_is_stated_where_people_read():
    assert f"Kubernetes {MIN_KUBERNETES} or later" in DOC_TEXT
    assert f"Needs Kubernetes {MIN_KUBERNETES} or later" in MANIFEST.read_text()


# -- 2. what the documents say to each other ----------------------------------------------------------------


def test_every_secret_and_configmap_is_made_by_the_setup_before_the_first_apply():
    assert "Secret" not in BY_KIND and "ConfigMap" not in BY_KIND  # so `kubectl apply` of the manifest never overwrites them
    used = set()
    for kind, name, key, where in _references():
        assert (kind, name) in SETUP, f"{where}: {kind} `{name}` is made by no setup step"
        assert key is None or key in SETUP[(kind, name)], f"{where}: {kind} `{name}` has no key `{key}` in the setup"
        used.add((kind, name))
    assert used == set(SETUP), f"the setup makes objects nothing uses: {set(SETUP) - used}"
    apply = next(i for i, line in enumerate(SETUP_LINES) if "apply -f deploy/kubernetes.yaml" in line)
    creates = [i for i, line in enumerate(SETUP_LINES) if re.search(r"\bcreate (secret|configmap)\b", line)]
    assert creates and max(creates) < apply
    assert SETUP_LINES.index('kubectl create namespace "$NS"') < min(creates)
    assert all('-n "$NS"' in SETUP_LINES[i] for i in creates + [apply])
    # the admin token exists before the first start, made by a step of the setup, 0600 from the start
    assert any("CONF/admin.token" in line and "umask 077" in line and ">" in line for line in SETUP_LINES[:min(creates)])


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_the_pod_runs_as_the_image_user_with_nothing_extra(front):
    POD = front.pod
    context = POD["securityContext"]
    assert context["runAsNonRoot"] is True and (context["runAsUser"], context["runAsGroup"]) == IMAGE.user
    assert context["fsGroup"] == context["runAsGroup"]  # how a non-root proxy reads root-owned Secret files
    assert context["fsGroupChangePolicy"] == "OnRootMismatch"  # the audit volume is not re-owned file by file at every start
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert POD["automountServiceAccountToken"] is False
    assert POD["enableServiceLinks"] is False  # else EGRESSLAW_SERVICE_HOST, EGRESSLAW_PORT, … would reach the proxy's options
    for container in POD["containers"] + POD["initContainers"]:
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        assert "runAsUser" not in sc and "runAsGroup" not in sc  # the pod's, for every container


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_images_are_pinned_by_digest_and_the_same_egresslaw_everywhere(front):
    images = {c["name"]: c["image"] for c in front.pod["containers"] + front.pod["initContainers"]}
    for name, image in images.items():
        assert re.fullmatch(r"[a-z0-9.\-/]+(:[\w.\-]+)?@sha256:[0-9a-f]{64}", image), (name, image)
    assert images["conf"] == images[front.container["name"]]  # the init container's sh and install are the front end's image
    assert "docker buildx imagetools inspect" in DOC_TEXT and "imagetools inspect" in MANIFEST.read_text()


def _touches_a_volume_root(container: dict) -> list[list[str]]:
    """The commands of a shell script that chmod, chown or `install -d` a volume's mount point (only root may)."""
    argv = container.get("command", []) + container.get("args", [])
    assert argv[:2] == ["sh", "-c"], argv
    script = argv[2]
    roots = {m["mountPath"].rstrip("/") for m in container["volumeMounts"]}
    found = []
    for words in (shlex.split(part) for part in re.split(r"[;&|]+", script) if part.strip()):
        changes = words[:1] in (["chmod"], ["chown"], ["chgrp"]) or words[:2] == ["install", "-d"]
        if changes and {w.rstrip("/") for w in words} & roots:
            found.append(words)
    return found


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_the_init_container_creates_the_confdir_inside_the_volume_and_never_chmods_its_root(front):
    PROXY, CONF_INIT = front.container, front.conf_init
    confdir = _env_values(PROXY)["EGRESSLAW_CONFDIR"]
    mount = _mount_for(PROXY, confdir)
    assert mount["mountPath"] != confdir and not mount.get("readOnly")  # a directory inside the volume, not its root
    assert "emptyDir" in _volume(mount["name"], front.pod)
    init_mount = _mount_for(CONF_INIT, confdir)
    assert (init_mount["name"], init_mount["mountPath"]) == (mount["name"], mount["mountPath"])  # the same directory in both
    script = " ".join(CONF_INIT.get("command", []) + CONF_INIT.get("args", []))
    assert not _touches_a_volume_root(CONF_INIT)
    assert _touches_a_volume_root(FIRST_INIT)  # the check sees the first version's mistake
    assert f"install -d -m 0700 {confdir}" in script
    for name in ("mitmproxy-ca.pem", "mitmproxy-ca-cert.pem", "admin.token"):
        assert f"{_mount_for(CONF_INIT, '/etc/egresslaw/conf/')['mountPath']}/{name}" in script
    assert CONF_INIT["image"] == PROXY["image"]
    assert _mount_for(CONF_INIT, "/etc/egresslaw/conf/x")["readOnly"] is True


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_probes_use_the_admin_port_health_endpoints(front):
    PROXY = front.container
    admin_port = int(_env_values(PROXY)["EGRESSLAW_ADMIN"].rsplit(":", 1)[1])
    named = {p["name"]: p["containerPort"] for p in PROXY["ports"]}
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = PROXY[probe]["httpGet"]
        assert get["path"] == path and named[get["port"]] == admin_port, probe
    assert named[front.command] == int(_env_values(PROXY)["EGRESSLAW_LISTEN"].rsplit(":", 1)[1])


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_a_headless_service_governs_the_set_and_a_cluster_ip_serves_the_sandboxes(front):
    WORKLOAD, PROXY, HEADLESS, CLIENT_SERVICE = front.workload, front.container, front.headless, front.client_service
    selector = WORKLOAD["spec"]["selector"]["matchLabels"]
    assert WORKLOAD["spec"]["template"]["metadata"]["labels"] == selector
    assert WORKLOAD["spec"]["serviceName"] == HEADLESS["metadata"]["name"]
    named = {p["name"]: p["containerPort"] for p in PROXY["ports"]}
    for service in (HEADLESS, CLIENT_SERVICE):
        assert service["spec"]["selector"] == selector
    assert {p["name"]: p["port"] for p in HEADLESS["spec"]["ports"]} == named  # per pod: its own ports
    assert all("targetPort" not in p for p in HEADLESS["spec"]["ports"])  # ignored for clusterIP None: not written
    assert CLIENT_SERVICE["spec"].get("type", "ClusterIP") == "ClusterIP"
    (port,) = CLIENT_SERVICE["spec"]["ports"]  # the proxy only: the admin port is per pod, not for sandboxes
    assert named[port["targetPort"]] == named[front.command] and port["protocol"] == "TCP"
    budget = front.of_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == selector


def test_the_front_ends_select_only_their_own_pods():
    proxy, lane = (f.workload["spec"]["template"]["metadata"]["labels"] for f in FRONTS)
    for front, other in ((PROXY_FRONT, lane), (LANE_FRONT, proxy)):
        selector = front.workload["spec"]["selector"]
        for selecting in (selector, {"matchLabels": front.headless["spec"]["selector"]}, {"matchLabels": front.client_service["spec"]["selector"]},
                          front.of_kind("PodDisruptionBudget")["spec"]["selector"]):
            assert not _labels_match(selecting, other), front.command  # no Service, set or budget counts the other's pods
    assert PROXY_FRONT.service_monitor is not LANE_FRONT.service_monitor


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_metrics_are_scraped_from_every_pod_with_the_token_the_proxy_holds(front):
    PROXY, HEADLESS, CLIENT_SERVICE, WORKLOAD = front.container, front.headless, front.client_service, front.workload
    spec = front.service_monitor["spec"]
    assert _labels_match(spec["selector"], HEADLESS["metadata"]["labels"])
    assert not _labels_match(spec["selector"], CLIENT_SERVICE["metadata"]["labels"])  # one target per pod, not twice
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] in {p["name"] for p in HEADLESS["spec"]["ports"]}
    admin = {p["name"]: p["containerPort"] for p in PROXY["ports"]}[endpoint["port"]]
    assert admin == int(_env_values(PROXY)["EGRESSLAW_ADMIN"].rsplit(":", 1)[1])
    assert (endpoint["path"], endpoint["authorization"]["type"]) == ("/metrics", "Bearer")  # /metrics needs the token
    cred = endpoint["authorization"]["credentials"]
    # Prometheus sends exactly what the init container installs as the proxy's admin.token
    tokens = [(source["secret"]["name"], item["key"]) for source in _volume("conf-secret", front.pod)["projected"]["sources"]
              for item in source["secret"].get("items", []) if item["path"] == "admin.token"]
    assert tokens == [(cred["name"], cred["key"])]
    ca_secrets = {s["secret"]["name"] for s in _volume("conf-secret", front.pod)["projected"]["sources"]
                  if any(i["key"] == "mitmproxy-ca.pem" for i in s["secret"].get("items", []))}
    assert cred["name"] not in ca_secrets  # Prometheus never gets the CA key
    annotations = WORKLOAD["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == admin
    (job,) = SCRAPE_CONFIG["scrape_configs"]  # the annotation-driven job of the docs sends the same token
    assert job["authorization"]["credentials_file"].endswith(f"/{cred['name']}/{cred['key']}")
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [NAMESPACE]


CLOSE_SECONDS = {  # after the drain, how long each front end may take to close its audit chain
    "proxy": 30,  # egress_proxy/run/supervisor.py `_wait_stopped`: each worker gets drain_grace + 30 s to close its chain
    "lane": 10,  # egress_proxy/run/lane.py: Envoy gets 10 s to exit, then the access log is read and the chain closed
}
EXPORT_STOP = 15  # egress_proxy/run/exporter.py STOP_SECONDS: after the chain is closed, the exporter's last batch and checkpoint


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_the_stop_fits_the_grace_period(front):
    PROXY = front.container
    pre_stop = PROXY["lifecycle"]["preStop"]
    assert set(pre_stop) == {"sleep"}  # the kubelet's own action: no process in the container that could fail to start
    drain = float(_env_values(PROXY)["EGRESSLAW_DRAIN_GRACE"])
    assert build_parser().parse_args([front.command, "--artifact", "a", "--proof", "p", "--keys", "k", "--drain-grace", str(drain)]).drain_grace == drain
    last_ship = 10  # at least this long for the shipper's last copy, after the front end has exited
    grace = front.pod["terminationGracePeriodSeconds"]
    assert pre_stop["sleep"]["seconds"] + drain + CLOSE_SECONDS[front.command] + EXPORT_STOP + last_ship <= grace
    assert 3 <= pre_stop["sleep"]["seconds"] <= 15  # long enough for endpoints to go, short enough not to stall rollouts


def test_the_replicas_share_postgres_custody_and_keep_no_credential_state():
    store = _env_from(PROXY)["EGRESSLAW_STORE"]["secretKeyRef"]  # the URL (it may hold a password) comes from a Secret
    assert SETUP[("Secret", store["name"])][store["key"]] is not None  # from a file, never a literal on a command line
    assert "EGRESSLAW_STORE" not in _env_values(PROXY)
    (template,) = WORKLOAD["spec"]["volumeClaimTemplates"]  # no SQLite volume: the only one per pod is its audit chains
    audit_dir = _env_values(PROXY)["EGRESSLAW_AUDIT_LOG"].split("/$(POD_NAME)/")[0]
    assert _mount_for(PROXY, audit_dir + "/x")["name"] == template["metadata"]["name"]
    assert WORKLOAD["spec"]["replicas"] >= 2


def test_the_lane_gets_no_custody():
    env = _env_values(LANE_FRONT.container) | _env_from(LANE_FRONT.container)
    assert "EGRESSLAW_STORE" not in env  # the lane never opens custody
    keys = _volume(_mount_for(LANE_FRONT.container, env["EGRESSLAW_KEYS"])["name"], LANE_FRONT.pod)["secret"]
    assert {item["key"] for item in keys["items"]} == {"lease.key", "audit.key"}  # not custody.key
    assert env["EGRESSLAW_BUDGET_STORE"] == _env_from(PROXY)["EGRESSLAW_BUDGET_STORE"]  # one ledger for both front ends
    (template,) = LANE_FRONT.workload["spec"]["volumeClaimTemplates"]  # its chain outlives the pod, as the proxy's
    assert _mount_for(LANE_FRONT.container, env["EGRESSLAW_AUDIT_LOG"])["name"] == template["metadata"]["name"]


def test_workers_match_the_cpu_limit_and_the_autoscaler_scales_on_cpu():
    source = _env_from(PROXY)["EGRESSLAW_WORKERS"]["resourceFieldRef"]
    assert (source["containerName"], source["resource"], str(source["divisor"])) == (PROXY["name"], "limits.cpu", "1")
    limits = PROXY["resources"]["limits"]
    assert float(limits["cpu"]).is_integer() and float(limits["cpu"]) >= 1  # whole CPUs: one worker each
    for front in FRONTS:
        for container in front.pod["containers"] + front.pod["initContainers"]:  # Guaranteed QoS counts every container of the pod
            resources = container["resources"]
            assert resources["requests"] == resources["limits"] and set(resources["limits"]) == {"cpu", "memory"}, container["name"]
        hpa = front.of_kind("HorizontalPodAutoscaler")
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("StatefulSet", front.workload["metadata"]["name"])
        (metric,) = hpa["spec"]["metrics"]
        assert metric["resource"]["name"] == "cpu" and 0 < metric["resource"]["target"]["averageUtilization"] <= 100
        assert hpa["spec"]["minReplicas"] == front.workload["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_keys_artifact_signed_proof_and_confdir_are_where_the_proxy_looks(front):
    PROXY, POD = front.container, front.pod
    env = _env_values(PROXY)
    dests = _dests(front.command)
    for name in env | _env_from(PROXY):
        assert name == "POD_NAME" or (name.startswith("EGRESSLAW_") and name[10:].lower() in dests), name
    fleet_own = {"EGRESSLAW_AUDIT_LOG"}  # one directory per replica, one chain per worker in it
    if front.command == "lane":
        fleet_own |= {"EGRESSLAW_LISTEN", "EGRESSLAW_ADMIN"}  # the image's defaults are the proxy's; the lane's ports are its own
    image = IMAGE.env
    assert {k: v for k, v in env.items() if k in image and k not in fleet_own} == {k: v for k, v in image.items() if k in env and k not in fleet_own}
    assert env["EGRESSLAW_AUDIT_LOG"].startswith(image["EGRESSLAW_AUDIT_LOG"].rsplit("/", 1)[0] + "/$(POD_NAME)/")
    names = [e["name"] for e in PROXY["env"]]
    assert names.index("POD_NAME") < names.index("EGRESSLAW_AUDIT_LOG")  # $(POD_NAME) expands only if defined before
    keys = _mount_for(PROXY, env["EGRESSLAW_KEYS"])
    assert keys["mountPath"] == env["EGRESSLAW_KEYS"] and keys["readOnly"] is True
    secret = _volume(keys["name"], POD)["secret"]
    assert secret["defaultMode"] & 0o007 == 0  # never readable by others: the proxy refuses such a key
    assert set(SETUP[("Secret", secret["secretName"])]) == {"custody.key", "lease.key", "audit.key"}  # the proxy needs all three
    policy_dir = os.path.dirname(env["EGRESSLAW_ARTIFACT"])
    assert os.path.dirname(env["EGRESSLAW_PROOF"]) == os.path.dirname(env["EGRESSLAW_TRUST_PROOFS"]) == policy_dir
    policy = _mount_for(PROXY, policy_dir)
    assert policy["mountPath"] == policy_dir and policy["readOnly"] is True
    config = SETUP[("ConfigMap", _volume(policy["name"], POD)["configMap"]["name"])]
    assert set(config) == {os.path.basename(env[k]) for k in ("EGRESSLAW_ARTIFACT", "EGRESSLAW_PROOF", "EGRESSLAW_TRUST_PROOFS")}
    assert not _mount_for(PROXY, env["EGRESSLAW_CONFDIR"]).get("readOnly")
    assert _mount_for(PROXY, IMAGE.workdir)["mountPath"] == IMAGE.workdir  # the image's VOLUME is a volume on every runtime


@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_the_audit_chains_are_shipped_after_the_proxy_closed_them(front):
    PROXY = front.container
    (shipper,) = front.sidecars  # a native sidecar: Kubernetes stops it only after the front end's container has exited
    script = " ".join(shipper["command"])
    assert "trap" in script and "TERM" in script  # its last copy, at its own stop, holds the closing checkpoints
    audit_mount = next(m for m in PROXY["volumeMounts"] if m["name"] == "audit")
    shipped = next(m for m in shipper["volumeMounts"] if m["name"] == "audit")
    assert shipped["mountPath"] == audit_mount["mountPath"] and shipped["readOnly"] is True
    assert f"{audit_mount['mountPath']}/$POD_NAME" in script  # each replica's directory, under its own name


def test_both_front_ends_export_to_one_collector_with_its_credential_in_a_secret_file():
    settings = []
    for front in FRONTS:
        env = _env_values(front.container)
        assert set(EXPORT_ENV) <= set(env) and not set(EXPORT_ENV) & set(_env_from(front.container)), front.command
        settings.append({name: env[name] for name in EXPORT_ENV})
        for name in ("EGRESSLAW_EXPORT_HEADERS", "EGRESSLAW_EXPORT_CA"):  # files from a Secret, read-only, never readable by others
            mount = _mount_for(front.container, env[name])
            assert mount["readOnly"] is True, (front.command, name)
            secret = _volume(mount["name"], front.pod)["secret"]
            assert secret["defaultMode"] & 0o007 == 0 and "items" not in secret
            key = os.path.relpath(env[name], mount["mountPath"])
            assert SETUP[("Secret", secret["secretName"])][key] is not None, (front.command, name)  # from a file, not a literal
        assert "EGRESSLAW_EXPORT_STATE" not in env  # the checkpoint beside the chain: on the audit volume, which outlives the pod
    assert settings[0] == settings[1]  # one collector, one credential for both front ends
    target = settings[0]["EGRESSLAW_EXPORT_TO"]
    assert target.startswith(("grpcs://", "https://"))  # the headers carry the collector's credential: never in clear text
    (made,) = [line for line in SETUP_LINES if "CONF/export.headers" in line and ">" in line]
    assert "umask 077" in made and "read -rsp" in made  # typed, not in the shell history, 0600 from the start


def test_the_exporter_accepts_the_collector_address():
    export = pytest.importorskip("egress_proxy.audit.export")  # Imported here: the exporter is the integrator's, not yet everywhere
    export.parse_target(_env_values(PROXY)["EGRESSLAW_EXPORT_TO"])


def test_the_files_hold_no_secret():
    for path in (MANIFEST, SANDBOX_POLICY, DOC):
        for token in re.findall(r"[A-Za-z0-9+/=_\-]{20,}", path.read_text()):
            assert not secret_kind(token), (path.name, token)


# -- the sandbox policies: a small evaluator of NetworkPolicy egress rules ----------------------------------
# Stated from the Kubernetes documentation (concepts/services-networking/network-policies): a pod is isolated
# for egress when a policy with Egress in policyTypes selects it; then a connection is allowed iff some rule of
# some such policy admits it: a `to` entry matches (podSelector alone: pods of the policy's namespace;
# namespaceSelector alone: every pod of the namespaces; both in one entry: pods in those namespaces with those
# labels; ipBlock: the address) and a port entry matches (protocol TCP when omitted). No `to`, or no `ports`:
# everything. Selectors: matchLabels and matchExpressions, ANDed; `{}` matches everything.


@dataclass(frozen=True)
class Peer:
    what: str
    namespace: str | None  # None: not a pod (a node, the internet)
    labels: dict
    ip: str
    namespace_labels: dict | None = None

    def ns_labels(self) -> dict:
        return self.namespace_labels if self.namespace_labels is not None else {"kubernetes.io/metadata.name": self.namespace}


def _selects(selector: dict, labels: dict) -> bool:
    if not _labels_match(selector, labels):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def _peer_admitted(entry: dict, policy_ns: str, peer: Peer) -> bool:
    if "ipBlock" in entry:
        block = entry["ipBlock"]
        addr = ip_address(peer.ip)
        return addr in ip_network(block["cidr"]) and not any(addr in ip_network(x) for x in block.get("except", []))
    if peer.namespace is None:
        return False
    if "namespaceSelector" in entry:
        if not _selects(entry["namespaceSelector"], peer.ns_labels()):
            return False
    elif peer.namespace != policy_ns:
        return False
    return _selects(entry.get("podSelector", {}), peer.labels)


def egress(policies: list[dict], namespace: str, pod_labels: dict, peer: Peer, port: int, protocol: str) -> str:
    """`allowed by <policy>`, `not isolated` or `denied`."""
    selecting = [p for p in policies if "Egress" in p["spec"].get("policyTypes", ["Ingress"] + (["Egress"] if "egress" in p["spec"] else []))
                 and _selects(p["spec"]["podSelector"], pod_labels)]
    if not selecting:
        return "not isolated"
    for policy in selecting:
        for rule in policy["spec"].get("egress", []):
            to_ok = not rule.get("to") or any(_peer_admitted(entry, namespace, peer) for entry in rule["to"])
            ports_ok = not rule.get("ports") or any(
                p.get("protocol", "TCP") == protocol and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
                for p in rule["ports"])
            if to_ok and ports_ok:
                return f"allowed by {policy['metadata']['name']}"
    return "denied"


PROXY_LABELS = WORKLOAD["spec"]["template"]["metadata"]["labels"]
PROXY_PORT = {p["name"]: p["containerPort"] for p in PROXY["ports"]}
PEERS = {
    "proxy": Peer("a proxy pod", NAMESPACE, PROXY_LABELS, "10.1.0.5"),
    "db": Peer("the custody database in the proxy's namespace", NAMESPACE, {"app": "postgres"}, "10.1.0.6"),
    "impostor": Peer("a pod in the sandbox namespace labelled like the proxy", "sandbox-7", PROXY_LABELS, "10.1.0.7"),
    "neighbour": Peer("another sandbox pod", "sandbox-7", {"app": "agent"}, "10.1.0.8"),
    "dns": Peer("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, "10.1.0.10"),
    "kube-system": Peer("another kube-system pod", "kube-system", {"k8s-app": "metrics-server"}, "10.1.0.11"),
    "internet": Peer("an address outside the cluster", None, {}, "203.0.113.9"),
    "metadata": Peer("the cloud metadata service", None, {}, "169.254.169.254"),
}
SANDBOX_CASES = [  # (peer, port, protocol, with the docs' optional DNS policy, expected)
    ("proxy", PROXY_PORT["proxy"], "TCP", False, "allowed by egresslaw-sandbox-egress-to-proxy"),
    ("proxy", PROXY_PORT["admin"], "TCP", False, "denied"),  # metrics and health are not for sandboxes
    ("proxy", PROXY_PORT["proxy"], "UDP", False, "denied"),
    ("db", PROXY_PORT["proxy"], "TCP", False, "denied"),  # namespace AND label, not OR
    ("db", 5432, "TCP", False, "denied"),
    ("impostor", PROXY_PORT["proxy"], "TCP", False, "denied"),  # the label alone is not enough
    ("neighbour", 8080, "TCP", False, "denied"),
    ("dns", 53, "UDP", False, "denied"),  # no DNS unless asked for
    ("dns", 53, "TCP", False, "denied"),
    ("internet", 443, "TCP", False, "denied"),
    ("metadata", 80, "TCP", False, "denied"),
    ("dns", 53, "UDP", True, "allowed by egresslaw-sandbox-egress-dns"),
    ("dns", 53, "TCP", True, "allowed by egresslaw-sandbox-egress-dns"),
    ("dns", 443, "TCP", True, "denied"),
    ("kube-system", 53, "UDP", True, "denied"),
    ("internet", 53, "UDP", True, "denied"),
    ("proxy", PROXY_PORT["proxy"], "TCP", True, "allowed by egresslaw-sandbox-egress-to-proxy"),
]


@pytest.mark.parametrize(("peer", "port", "protocol", "with_dns", "expected"), SANDBOX_CASES,
                         ids=[f"{p}-{port}-{proto}-{'dns' if d else 'nodns'}" for p, port, proto, d, _ in SANDBOX_CASES])
def test_a_sandbox_pod_reaches_the_proxy_and_nothing_else(peer, port, protocol, with_dns, expected):
    policies = SANDBOX_DOCS + ([DNS_POLICY] if with_dns else [])
    for pod_labels in ({"app": "agent"}, {}, PROXY_LABELS):  # every pod of the namespace, whatever its labels
        assert egress(policies, "sandbox-7", pod_labels, PEERS[peer], port, protocol) == expected, PEERS[peer].what


def test_a_sandbox_pod_reaches_the_lane():
    lane = Peer("a lane pod", NAMESPACE, LANE_FRONT.workload["spec"]["template"]["metadata"]["labels"], "10.1.0.12")
    ports = {p["name"]: p["containerPort"] for p in LANE_FRONT.container["ports"]}
    assert egress(SANDBOX_DOCS, "sandbox-7", {"app": "agent"}, lane, ports["lane"], "TCP").startswith("allowed")
    assert egress(SANDBOX_DOCS, "sandbox-7", {"app": "agent"}, lane, ports["admin"], "TCP") == "denied"


def test_the_evaluator_sees_the_classic_mistakes():
    """The evaluator is what the table above relies on: two `to` entries (OR) must admit the database."""
    (allow,) = [p for p in SANDBOX_DOCS if p["spec"].get("egress")]
    split = copy.deepcopy(allow)
    entry = split["spec"]["egress"][0]["to"][0]
    split["spec"]["egress"][0]["to"] = [{"namespaceSelector": entry["namespaceSelector"]}, {"podSelector": entry["podSelector"]}]
    assert egress([split], "sandbox-7", {}, PEERS["db"], PROXY_PORT["proxy"], "TCP").startswith("allowed")
    assert egress([split], "sandbox-7", {}, PEERS["impostor"], PROXY_PORT["proxy"], "TCP").startswith("allowed")
    assert egress([], "sandbox-7", {}, PEERS["internet"], 443, "TCP") == "not isolated"


def test_the_sandbox_policies_name_the_proxys_namespace_and_select_every_pod():
    for policy in SANDBOX_DOCS + [DNS_POLICY]:
        assert policy["spec"]["podSelector"] == {} and policy["spec"]["policyTypes"] == ["Egress"]
        assert "namespace" not in policy["metadata"]  # applied per sandbox namespace with -n
    (deny,) = [p for p in SANDBOX_DOCS if not p["spec"].get("egress")]
    assert egress([deny], "sandbox-7", {}, PEERS["proxy"], PROXY_PORT["proxy"], "TCP") == "denied"
    assert "kubectl -n SANDBOX apply -f deploy/sandbox-networkpolicy.yaml" in SANDBOX_POLICY.read_text()


def test_the_cilium_variant_admits_the_proxy_and_only_its_name():
    spec = CILIUM["spec"]
    assert spec["endpointSelector"] == {} and spec["enableDefaultDeny"] == {"egress": True, "ingress": False}
    proxy_rule, dns_rule = spec["egress"]
    (to_proxy,) = proxy_rule["toEndpoints"]
    labels = dict(to_proxy["matchLabels"])
    assert labels.pop("k8s:io.kubernetes.pod.namespace") == NAMESPACE
    assert {k.removeprefix("k8s:"): v for k, v in labels.items()}.items() <= PROXY_LABELS.items() and labels
    assert proxy_rule["toPorts"] == [{"ports": [{"port": str(PROXY_PORT["proxy"]), "protocol": "TCP"}]}]
    (to_dns,) = dns_rule["toEndpoints"]
    assert to_dns["matchLabels"] == {"k8s:io.kubernetes.pod.namespace": "kube-system", "k8s:k8s-app": "kube-dns"}
    (dns_port,) = dns_rule["toPorts"]
    fqdn = f"{CLIENT_SERVICE['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
    assert dns_port["rules"]["dns"] == [{"matchName": fqdn}]  # one name, no pattern
    assert f"http://{fqdn}.:{PROXY_PORT['proxy']}" in DOC_TEXT  # the trailing dot: no search-domain queries
    assert all(set(rule) <= {"toEndpoints", "toPorts"} for rule in spec["egress"])  # no toCIDR, toEntities, toFQDNs: nothing outside


# -- 3. the pod, played as the kubelet would ------------------------------------------------------------------

POD_NAME = f"{WORKLOAD['metadata']['name']}-0"
TIMESTAMP_DIR = "..2026_01_01_00_00_00.000000001"  # the kubelet's AtomicWriter: files live here, reached through ..data


def _kubelet_owns(root: Path, gid: int, read_only: bool) -> None:
    """pkg/volume SetVolumeOwnership: every entry gets the fsGroup; files group rw (r on read-only volumes),
    directories also group x and setgid; symlinks are chgrp'd only."""
    entries = [root]
    for top, dirs, files in os.walk(root):
        entries += [Path(top, name) for name in dirs + files]
    for path in entries:
        os.lchown(path, -1, gid)
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.lstat().st_mode)
        mask = 0o440 if read_only else 0o660
        if path.is_dir():
            mask |= 0o2110
        os.chmod(path, mode | mask)


def _empty_dir(dest: Path, fs_group: int | None) -> None:
    dest.mkdir(parents=True)
    os.chmod(dest, 0o777)  # emptyDir: root:root 0777
    if fs_group is not None:
        _kubelet_owns(dest, fs_group, read_only=False)


def _claim(dest: Path, fs_group: int | None) -> None:
    """A fresh PersistentVolume's root as mkfs leaves it (root 0755, lost+found 0700), then the fsGroup."""
    (dest / "lost+found").mkdir(parents=True)
    os.chmod(dest, 0o755)
    os.chmod(dest / "lost+found", 0o700)
    if fs_group is not None:
        _kubelet_owns(dest, fs_group, read_only=False)


def _atomic_volume(dest: Path, files: dict[str, tuple[bytes, int]], fs_group: int | None) -> None:
    """A Secret/ConfigMap/projected volume: tmpfs root 1777, files in a timestamped directory behind `..data`."""
    dest.mkdir(parents=True)
    os.chmod(dest, 0o1777)
    ts = dest / TIMESTAMP_DIR
    ts.mkdir()
    os.chmod(ts, 0o755)
    for rel, (data, mode) in files.items():
        (ts / rel).write_bytes(data)
        os.chmod(ts / rel, mode)
        (dest / rel).symlink_to(f"..data/{rel}")
    (dest / "..data").symlink_to(TIMESTAMP_DIR)
    if fs_group is not None:
        _kubelet_owns(dest, fs_group, read_only=True)


@dataclass
class Pod:
    """One pod's volumes (staged as the kubelet makes them) and the root filesystem its containers see."""

    root: Path
    spec: dict
    workspace: Path  # where the documented setup ran: its files are what the Secrets and the ConfigMap hold
    fs_group: int | None
    workload: dict = None  # the StatefulSet the pod is of (its claims, its pod name)

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}-0"

    def __post_init__(self) -> None:
        self.volumes = self.root / "volumes"
        self.rootfs = self.root / "rootfs"
        for volume in self.spec["volumes"]:
            self._stage(volume, self.volumes / volume["name"])
        self.workload = self.workload or WORKLOAD
        for claim in self.workload["spec"]["volumeClaimTemplates"]:
            _claim(self.volumes / claim["metadata"]["name"], self.fs_group)
        self._build_rootfs()

    def _content(self, kind: str, name: str, items: list[dict] | None, default_mode: int) -> dict[str, tuple[bytes, int]]:
        made = SETUP[(kind, name)]  # KeyError: the setup does not make it, so neither can this pod
        wanted = items or [{"key": key, "path": key} for key in made]
        out = {}
        for item in wanted:
            source = made[item["key"]]
            assert source is not None, f"{kind} {name}/{item['key']} is a literal; the test has no value for it"
            out[item["path"]] = ((self.workspace / source).read_bytes(), item.get("mode", default_mode))
        return out

    def _stage(self, volume: dict, dest: Path) -> None:
        if "emptyDir" in volume:
            _empty_dir(dest, self.fs_group)
        elif "secret" in volume:
            s = volume["secret"]
            _atomic_volume(dest, self._content("Secret", s["secretName"], s.get("items"), s.get("defaultMode", 0o644)), self.fs_group)
        elif "configMap" in volume:
            c = volume["configMap"]
            _atomic_volume(dest, self._content("ConfigMap", c["name"], c.get("items"), c.get("defaultMode", 0o644)), self.fs_group)
        elif "projected" in volume:
            p = volume["projected"]
            files: dict[str, tuple[bytes, int]] = {}
            for source in p["sources"]:
                (field,) = source
                kind = {"secret": "Secret", "configMap": "ConfigMap"}[field]
                files |= self._content(kind, source[field]["name"], source[field].get("items"), p.get("defaultMode", 0o644))
            _atomic_volume(dest, files, self.fs_group)
        else:
            raise AssertionError(f"volume {volume['name']}: a kind of volume this kubelet does not know; teach it")

    def _build_rootfs(self) -> None:
        """The image's root: system files from the host's /usr, the egresslaw install, the Dockerfile's directories."""
        r = self.rootfs
        r.mkdir(mode=0o755)
        for name in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{name}"):
                (r / name).symlink_to(os.readlink(f"/{name}"))
        for d in ("usr", "dev", "proc", "tmp", "etc/ssl", "opt/egresslaw", *(str(p).lstrip("/") for p in self.host_binds().values())):
            (r / d).mkdir(parents=True, exist_ok=True, mode=0o755)
        (r / "etc/passwd").write_text(f"root:x:0:0:root:/root:/bin/sh\negresslaw:x:{IMAGE.user[0]}:{IMAGE.user[1]}::/nonexistent:/usr/sbin/nologin\n")
        (r / "etc/group").write_text(f"root:x:0:\negresslaw:x:{IMAGE.user[1]}:\n")
        (r / "etc/hosts").write_text("127.0.0.1 localhost\n")
        (r / "etc/resolv.conf").write_text("nameserver 127.0.0.1\n")
        for path, uid, gid, mode in IMAGE.dirs:
            target = r / path.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            os.chown(target, uid, gid)
            os.chmod(target, mode)
        for container in self.spec["containers"] + self.spec["initContainers"]:
            for mount in container["volumeMounts"]:  # the runtime makes mount points before the root goes read-only
                (r / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
        for parent in [r / "root", *(r / p.lstrip("/") for p in (sys.base_prefix,))]:
            if parent.exists():
                os.chmod(parent, 0o755)

    @staticmethod
    def host_binds() -> dict[str, str]:
        """Host path -> where the container sees it; all read-only."""
        binds = {"/usr": "/usr", str(ROOT): str(ROOT), sys.prefix: "/opt/egresslaw", sys.base_prefix: sys.base_prefix}
        if os.path.isdir("/etc/ssl"):
            binds["/etc/ssl"] = "/etc/ssl"
        return binds

    def argv(self, container: dict, env: dict[str, str]) -> list[str]:
        """`unshare … chroot … setpriv …`: the container's process as the runtime would start it."""
        r = str(self.rootfs)
        lines = ["set -e", shlex.join(["mount", "--bind", r, r]), shlex.join(["mount", "-o", "remount,bind,ro", r])]
        for host, inside in self.host_binds().items():
            lines.append(shlex.join(["mount", "--bind", "-o", "ro", host, r + inside]))
        lines += [shlex.join(["mount", "--rbind", "/dev", r + "/dev"]), shlex.join(["mount", "-t", "proc", "proc", r + "/proc"])]
        for mount in sorted(container["volumeMounts"], key=lambda m: m["mountPath"].count("/")):  # parents first, as runc does
            target = r + mount["mountPath"]
            lines.append(shlex.join(["mkdir", "-p", target]))  # inside a volume mounted just before: the runtime makes it
            ro = ["-o", "ro"] if mount.get("readOnly") else []
            lines.append(shlex.join(["mount", "--bind", *ro, str(self.volumes / mount["name"]), target]))
        mounted = [m["mountPath"].rstrip("/") + "/" for m in container["volumeMounts"]]
        for host, inside in self.host_binds().items():  # a checkout under /tmp (a clone there) is hidden by the tmp volume:
            if any(inside.startswith(m) for m in mounted):  # bind it again on top, as the image holds it at that path
                lines += [shlex.join(["mkdir", "-p", r + inside]), shlex.join(["mount", "--bind", "-o", "ro", host, r + inside])]
        uid, gid = self.spec["securityContext"]["runAsUser"], self.spec["securityContext"]["runAsGroup"]
        groups = ["--groups", str(self.fs_group)] if self.fs_group is not None else ["--clear-groups"]
        command = container.get("command") or IMAGE.entrypoint
        args = container.get("args") if "args" in container else ([] if "command" in container else IMAGE.cmd)
        process = ["chroot", r, "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", *groups, "--inh-caps=-all",
                   "--bounding-set=-all", "--no-new-privs", "--", "/usr/bin/env", "-i", f"--chdir={container.get('workingDir', IMAGE.workdir)}",
                   *(f"{k}={v}" for k, v in env.items()), *command, *args]  # env: the first word without `=` is the command
        lines.append("exec " + shlex.join(process))
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)]

    def env(self, container: dict, overrides: dict[str, str]) -> dict[str, str]:
        """The image's ENV, then the container's env resolved as the kubelet does, then `overrides` (replacing only)."""
        env = {"HOSTNAME": self.name, "HOME": "/nonexistent", **IMAGE.env}
        own: dict[str, str] = {}
        for entry in container.get("env", []):
            if "value" in entry:
                value = re.sub(r"\$\((\w+)\)", lambda m: own.get(m.group(1), m.group(0)), entry["value"])
            else:
                source = entry["valueFrom"]
                if "fieldRef" in source:
                    value = {"metadata.name": self.name}[source["fieldRef"]["fieldPath"]]
                elif "resourceFieldRef" in source:
                    ref = source["resourceFieldRef"]
                    (target,) = [c for c in self.spec["containers"] if c["name"] == ref.get("containerName", container["name"])]
                    quantity = target["resources"][ref["resource"].split(".")[0]][ref["resource"].split(".")[1]]
                    value = str(math.ceil(_cpu(quantity) / _cpu(ref.get("divisor", "1"))))
                elif "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    value = (self.workspace / SETUP[("Secret", ref["name"])][ref["key"]]).read_text()
                else:
                    raise AssertionError(f"env {entry['name']}: a source this kubelet does not know")
            own[entry["name"]] = value
        assert set(overrides) <= set(own), "overrides replace what the manifest sets, never add"
        return {**env, **own, **overrides}


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if str(quantity).endswith("m") else float(quantity)


def _mounts_under(path: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(path) in line]


def _can_play_kubelet() -> str:
    """Why the kubelet cannot be played here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (mount namespaces, chown, setpriv)"
    for tool in ("unshare", "setpriv", "chroot", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], check=False, capture_output=True)
    return "" if probe.returncode == 0 else "mount namespaces are not permitted here"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The documented setup's files, made the way the setup makes them: the token and CA steps run from the docs."""
    # here, not above: the harness imports the proxy and the prover, which the fast tests do not need
    from egress_proxy.custody.keys import init_keys
    from tests.proxy_harness import (
        CANARY,
        build_artifact,
        proof_for,
        proof_signing_key,
        seal,
    )

    why = _can_play_kubelet()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("setup")
    init_keys(root / "KEYS")
    (root / "SIGNING").mkdir()
    shutil.copy(proof_signing_key()[1], root / "SIGNING" / "proof-signing.pub")  # the key the test run's proofs are signed with
    artifact = build_artifact()
    (root / "build").mkdir()
    (root / "build" / "egresslaw.json").write_text(artifact.to_json())
    (root / "build" / "proof.json").write_text(proof_for(artifact))
    seal(root / "custody.db", root / "KEYS", "github", "gh-prod", CANARY.encode())  # SQLite, standing for the database
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for start in ("egresslaw ca ", "(umask 077 && openssl rand "):
        (line,) = [line for line in SETUP_LINES if line.startswith(start)]
        subprocess.run(["sh", "-c", line], cwd=root, env=env, check=True, capture_output=True, timeout=60)
    (root / "CONF" / "store.url").write_text("postgresql://egresslaw@db.invalid:5432/egresslaw?sslmode=verify-full")
    (root / "rclone.conf").write_text("[audit]\ntype = local\n")
    (root / "CONF" / "export.headers").write_text("Authorization: Bearer test-collector\n")  # what step 4b's `read` writes
    shutil.copy(root / "CONF" / "mitmproxy-ca-cert.pem", root / "collector-ca.pem")  # a CA certificate, standing for the SOC's
    return root


def _run(pod: Pod, container: dict, *, timeout: float = 60) -> subprocess.CompletedProcess:
    done = subprocess.run(pod.argv(container, pod.env(container, {})), check=False, capture_output=True, text=True, timeout=timeout)
    assert not _mounts_under(pod.root), "a mount leaked out of the test's namespace"
    return done


def _new_pod(tmp_path: Path, workspace: Path, spec: dict = POD, workload: dict = WORKLOAD) -> Pod:
    spec = copy.deepcopy(spec)
    return Pod(tmp_path / "pod", spec, workspace, spec["securityContext"].get("fsGroup"), workload)


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS, ids=FRONT_IDS)
def test_the_init_container_prepares_the_confdir_on_the_volumes_the_kubelet_makes(tmp_path, workspace, front):
    CONF_INIT = front.conf_init
    pod = _new_pod(tmp_path, workspace, front.pod, front.workload)
    data = pod.volumes / _mount_for(CONF_INIT, "/var/lib/egresslaw/conf")["name"]
    assert data.stat().st_uid == 0 and stat.S_IMODE(data.stat().st_mode) == 0o2777  # the emptyDir as the kubelet leaves it
    done = _run(pod, CONF_INIT)
    assert done.returncode == 0, done.stderr
    conf = data / "conf"
    uid, _ = IMAGE.user
    assert (conf.stat().st_uid, stat.S_IMODE(conf.stat().st_mode) & 0o777) == (uid, 0o700)
    for name, source in (("mitmproxy-ca.pem", "CONF/mitmproxy-ca.pem"), ("mitmproxy-ca-cert.pem", "CONF/mitmproxy-ca-cert.pem"),
                         ("admin.token", "CONF/admin.token")):
        st = (conf / name).stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o600), name
        assert (conf / name).read_bytes() == (workspace / source).read_bytes(), name
    again = _run(pod, CONF_INIT)  # a pod sandbox recreated keeps its emptyDir and runs the init container again
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
def test_the_first_init_command_fails_there_as_it_did_on_a_cluster(tmp_path, workspace):
    spec = copy.deepcopy(POD)
    spec["initContainers"].append(FIRST_INIT)
    spec["volumes"].append(FIRST_VOLUME)
    pod = _new_pod(tmp_path, workspace, spec)
    done = _run(pod, FIRST_INIT)
    assert done.returncode != 0
    assert "cannot change permissions" in done.stderr and "Operation not permitted" in done.stderr, done.stderr


@pytest.mark.slow
def test_without_an_fs_group_the_secret_files_cannot_be_read(tmp_path, workspace):
    spec = copy.deepcopy(POD)
    del spec["securityContext"]["fsGroup"]
    pod = _new_pod(tmp_path, workspace, spec)
    assert pod.fs_group is None
    done = _run(pod, CONF_INIT)
    assert done.returncode != 0 and "Permission denied" in done.stderr, done.stderr  # fsGroup is what makes 0440 readable


def _get(port: int, path: str, token: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _free_port() -> int:
    from tests.proxy_harness import (
        free_port,  # here, not above: the harness imports the proxy, which the fast tests do not need
    )

    return free_port()


@pytest.mark.slow
def test_the_proxy_starts_as_the_image_user_becomes_ready_and_stops_cleanly(tmp_path, workspace):
    pod = _new_pod(tmp_path, workspace)
    done = _run(pod, CONF_INIT)
    assert done.returncode == 0, done.stderr
    data = pod.volumes / _mount_for(PROXY, IMAGE.workdir)["name"]
    store = "custody.db"  # SQLite in the pod's own volume, standing for the PostgreSQL URL of the Secret
    shutil.copy(workspace / store, data / store)
    os.chown(data / store, *IMAGE.user)
    os.chmod(data / store, 0o600)
    listen, admin = _free_port(), _free_port()
    overrides = {"EGRESSLAW_STORE": f"{IMAGE.workdir}/{store}", "EGRESSLAW_LISTEN": f"127.0.0.1:{listen}",
                 "EGRESSLAW_ADMIN": f"127.0.0.1:{admin}",
                 "EGRESSLAW_EXPORT_TO": f"grpcs://127.0.0.1:{_free_port()}"}  # a collector that is down: the proxy never waits on it
    env = pod.env(PROXY, overrides)
    assert env["EGRESSLAW_WORKERS"] == "2" and env["EGRESSLAW_AUDIT_LOG"] == f"/var/lib/egresslaw/audit/{POD_NAME}/audit.jsonl"
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(pod.argv(PROXY, env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, _ = _get(admin, "/readyz")
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(0.25)
        assert status == 200, f"not ready (exit {proc.poll()}):\n" + log.read_text()[-4000:]
        assert _get(admin, "/metrics")[0] == 401
        cred = SERVICE_MONITOR["spec"]["endpoints"][0]["authorization"]["credentials"]
        token = (workspace / SETUP[("Secret", cred["name"])][cred["key"]]).read_text().strip()  # what Prometheus sends
        code, body = _get(admin, "/metrics", token)
        assert code == 200 and b"egresslaw_build_info" in body
        if "export_to" in _dests("proxy"):  # the exporter's settings reached the proxy: it reports the export
            assert b"egresslaw_audit_export_backlog_bytes" in body
        conf = data / "conf"
        assert (conf / "mitmproxy-ca-cert.pem").read_bytes() == (workspace / "CONF/mitmproxy-ca-cert.pem").read_bytes()  # the shared CA, not a new one
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-4000:]
    assert not _mounts_under(pod.root)
    chains = pod.volumes / "audit" / POD_NAME
    files = sorted(p.name for p in chains.iterdir())
    assert {"audit.w1.jsonl", "audit.w2.jsonl"} <= set(files), files
    assert all((chains / f).stat().st_uid == IMAGE.user[0] for f in files)
    verify = subprocess.run([str(Path(sys.executable).parent / "egresslaw"), "audit", "verify", str(chains), "--keys", str(workspace / "KEYS")],
                            check=False, capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # intact and closed: what the shipper's last copy carries


@pytest.mark.slow
def test_the_lane_starts_as_the_image_user_becomes_ready_and_stops_cleanly(tmp_path, workspace):
    if "lane" not in build_parser()._subparsers._group_actions[0].choices or not shutil.which("envoy", path=str(Path(sys.executable).parent)):
        pytest.skip("the lane extra (Envoy) is not installed here")
    pod = _new_pod(tmp_path, workspace, LANE_FRONT.pod, LANE_FRONT.workload)
    done = _run(pod, LANE_FRONT.conf_init)
    assert done.returncode == 0, done.stderr
    listen, admin = _free_port(), _free_port()
    overrides = {"EGRESSLAW_LISTEN": f"127.0.0.1:{listen}", "EGRESSLAW_ADMIN": f"127.0.0.1:{admin}",
                 "EGRESSLAW_EXPORT_TO": f"grpcs://127.0.0.1:{_free_port()}"}  # a collector that is down
    env = pod.env(LANE_FRONT.container, overrides)
    assert env["EGRESSLAW_AUDIT_LOG"] == f"/var/lib/egresslaw/audit/{pod.name}/lane.jsonl"
    log = tmp_path / "lane.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(pod.argv(LANE_FRONT.container, env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, _ = _get(admin, "/readyz")
            except OSError:
                status = None
            if status == 200:
                break
            time.sleep(0.25)
        assert status == 200, f"not ready (exit {proc.poll()}):\n" + log.read_text()[-4000:]
        cred = LANE_FRONT.service_monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
        token = (workspace / SETUP[("Secret", cred["name"])][cred["key"]]).read_text().strip()
        assert _get(admin, "/metrics")[0] == 401
        code, body = _get(admin, "/metrics", token)
        assert code == 200 and b"egresslaw_build_info" in body
        if "export_to" in _dests("lane"):
            assert b"egresslaw_audit_export_backlog_bytes" in body
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()[-4000:]
    assert not _mounts_under(pod.root)
    chains = pod.volumes / "audit" / pod.name
    assert (chains / "lane.jsonl").stat().st_uid == IMAGE.user[0]
    verify = subprocess.run([str(Path(sys.executable).parent / "egresslaw"), "audit", "verify", str(chains / "lane.jsonl"), "--keys",
                             str(workspace / "KEYS")], check=False, capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
