"""`import-cma`: a Claude Managed Agents environment's `networking` object -> `.egress` source."""

from __future__ import annotations

import json
import re

import yaml

from catalog import Catalog

from compiler.passes import admit_host, split_host_port
from compiler.syntax import NO_SPAN

_NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class CmaImportError(Exception):
    """The CMA document cannot become a policy; the message says why and how to fix it."""

    def __init__(self, message: str, help: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.help = help


def _find_networking(doc: object) -> tuple[dict, str | None]:
    """The networking object and the environment's name, wherever CMA put them."""
    if not isinstance(doc, dict):
        raise CmaImportError("the document is not an object", "pass a CMA environment (JSON or YAML)")
    name = doc.get("name") if isinstance(doc.get("name"), str) else None
    for path in (("networking",), ("config", "networking"), ("environment", "config", "networking"), ("environment", "networking")):
        node: object = doc
        for step in path:
            node = node.get(step) if isinstance(node, dict) else None
        if isinstance(node, dict):
            env = doc.get("environment") if isinstance(doc.get("environment"), dict) else {}
            return node, name or (env.get("name") if isinstance(env.get("name"), str) else None)
    if "type" in doc and ("allowed_hosts" in doc or doc.get("type") in ("none", "unrestricted", "limited")):
        return doc, name
    raise CmaImportError("no `networking` object found", "expected `networking` at the top level or under `config`")


def import_cma(text: str, catalog: Catalog, default_name: str = "imported") -> str:
    """`.egress` source for one sandbox profile holding the environment's networking object verbatim."""
    try:
        doc = json.loads(text)
    except ValueError:
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise CmaImportError(f"the file is neither JSON nor YAML{where}") from None
    networking, env_name = _find_networking(doc)
    kind = networking.get("type")
    if kind == "unrestricted":
        raise CmaImportError(
            "the environment's network is `unrestricted`, which egresslaw refuses",
            'list the hosts the sandbox needs as `{"type": "limited", "allowed_hosts": [...]}`, then import again',
        )
    if kind not in ("none", "limited"):
        raise CmaImportError(f"unknown networking type `{kind}`", 'expected "none" or "limited"')
    for host in networking.get("allowed_hosts", []) or []:
        if not isinstance(host, str):
            raise CmaImportError("`allowed_hosts` must hold strings")
        if "*" in host:
            raise CmaImportError(f"wildcard host `{host}` cannot be imported", "egresslaw allows exact hosts only: list each host the sandbox needs")
        # the compiler's own admission, so an import never writes a host the compiler would refuse
        bare, port = split_host_port(host, 443)
        if port is None:
            raise CmaImportError(f"`{host}` has an invalid port", "ports are 1-65535, e.g. `deb.debian.org:80`")
        _, problem = admit_host(bare, NO_SPAN)
        if problem is not None:
            raise CmaImportError(f"in `allowed_hosts`: {problem.message}", problem.help)
    provider = next(p.ref for p in catalog.providers if set(catalog.axes) <= set(p.axes))
    name = _NAME_SAFE.sub("-", env_name or default_name).strip("-.") or default_name
    body = json.dumps(networking, indent=2, ensure_ascii=False).replace("\n", "\n  ")
    return (
        "egresslaw 1\n"
        f'workspace "{name}"\n'
        f'catalog "{catalog.version}"\n'
        "\n"
        f"# imported from a Claude Managed Agents environment; `networking` is pasted verbatim.\n"
        f"# trust is not set, so the profile is adversarial: a limited network is then refused until\n"
        f'# you decide the workload is trusted (trust = "trusted") or give it {{"type": "none"}}.\n'
        f'sandbox_profile "{name}" {{\n'
        f'  provider = "{provider}"\n'
        f"  networking = {body}\n"
        "}\n"
    )
