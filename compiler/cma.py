"""`import-cma`: a Claude Managed Agents environment's `networking` object -> `.egress` source.

One import yields a `sandbox_profile` block holding the environment's `networking` verbatim. It is
rendered either as a whole single-file policy (`policy_source`, with its own `workspace` and
`catalog`) or as a profile alone (`profile_source`) to join a directory policy that many imports
share (one workspace, one catalog, one lock).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import yaml

from catalog import ECOSYSTEMS, Catalog
from compiler.errors import CompilerError
from compiler.fmt import format_source
from compiler.parser import parse_source
from compiler.passes import admit_host, split_host_port
from compiler.syntax import NO_SPAN

NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$")  # the compiler's declaration-name rule


class CmaImportError(CompilerError):
    """The CMA document cannot become a policy; the message says why and how to fix it."""


@dataclass(frozen=True)
class CmaImport:
    """One imported environment: the profile block and what the user should know about it."""

    name: str  # the sandbox profile's name
    workspace: str  # for a single-file policy
    catalog: str  # the catalog version the provider was chosen from
    profile: str  # the `sandbox_profile "…" { … }` block, with its comments
    notes: tuple[str, ...] = field(default=())  # said on stderr: narrowings made, packages that cannot be fetched

    def policy_source(self) -> str:
        """A complete single-file policy, in `fmt`'s canonical layout."""
        return canonical(f'egresslaw 1\nworkspace "{self.workspace}"\ncatalog "{self.catalog}"\n\n{self.profile}')

    def profile_source(self) -> str:
        """The profile alone, to join a directory policy that declares `workspace` and `catalog` elsewhere."""
        return canonical(f"egresslaw 1\n\n{self.profile}")


def header_source(workspace: str, catalog: str) -> str:
    """The file that makes a directory a policy: its `workspace` and `catalog`."""
    return canonical(f'egresslaw 1\nworkspace "{workspace}"\ncatalog "{catalog}"\n')


def canonical(text: str) -> str:
    """`text` as `egresslaw fmt` would write it, so an import never fails a `fmt --check` hook."""
    tree, problems = parse_source(text, "import.egress")
    return format_source(tree) if tree is not None and not problems else text


def _find(doc: object) -> tuple[dict, dict, str | None]:
    """The networking object, the config object holding it (for `packages`) and the environment's name."""
    if not isinstance(doc, dict):
        raise CmaImportError("the document is not an object", "pass a CMA environment (JSON or YAML)")
    name = doc.get("name") if isinstance(doc.get("name"), str) else None
    for path in (("networking",), ("config", "networking"), ("environment", "config", "networking"), ("environment", "networking")):
        parent: object = doc
        for step in path[:-1]:
            parent = parent.get(step) if isinstance(parent, dict) else None
        node = parent.get(path[-1]) if isinstance(parent, dict) else None
        if isinstance(node, dict):
            env = doc.get("environment") if isinstance(doc.get("environment"), dict) else {}
            return node, parent, name or (env.get("name") if isinstance(env.get("name"), str) else None)
    if "type" in doc and ("allowed_hosts" in doc or doc.get("type") in ("none", "unrestricted", "limited")):
        return doc, {}, name
    raise CmaImportError("no `networking` object found", "expected `networking` at the top level or under `config`")


def _parse(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise CmaImportError(f"the file is neither JSON nor YAML{where}") from None


def _check_hosts(networking: dict) -> None:
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


def _package_ecosystems(config: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ecosystems `packages` installs from, other keys it has) — `type` is CMA's tag, not a manager."""
    packages = config.get("packages")
    if not isinstance(packages, dict):
        return (), ()
    used = tuple(sorted(k for k, v in packages.items() if k in ECOSYSTEMS and v))
    other = tuple(sorted(k for k in packages if k not in ECOSYSTEMS and k != "type"))
    return used, other


def import_environment(text: str, catalog: Catalog, *, name: str | None = None, workspace: str | None = None,
                       default_name: str = "imported") -> CmaImport:
    """Read a CMA environment and build its sandbox profile (see the module docstring)."""
    networking, config, env_name = _find(_parse(text))
    kind = networking.get("type")
    if kind == "unrestricted":
        raise CmaImportError(
            "the environment's network is `unrestricted`, which egresslaw refuses",
            'list the hosts the sandbox needs as `{"type": "limited", "allowed_hosts": [...]}`, then import again',
        )
    if kind not in ("none", "limited"):
        raise CmaImportError(f"unknown networking type `{kind}`", 'expected "none" or "limited"')
    _check_hosts(networking)
    if name is not None and not NAME.match(name):
        raise CmaImportError(f"`--name {name}` is not a simple identifier", "use letters, digits, `.`, `_` and `-`")
    profile_name = name or NAME_SAFE.sub("-", env_name or default_name).strip("-.")[:64] or default_name
    provider = next(p.ref for p in catalog.providers if set(catalog.axes) <= set(p.axes))
    body = json.dumps(networking, indent=2, ensure_ascii=False).replace("\n", "\n  ")
    lines = [
        f"# imported from the Claude Managed Agents environment `{env_name or profile_name}`; `networking` is pasted verbatim.",
        "# trust is not set, so the profile is adversarial: a limited network is then refused until",
        '# you decide the workload is trusted (trust = "trusted") or give it {"type": "none"}.',
        f'sandbox_profile "{profile_name}" {{',
        f'  provider = "{provider}"',
        f"  networking = {body}",
    ]
    notes: list[str] = []
    used, other = _package_ecosystems(config)
    managers = bool(networking.get("allow_package_managers"))
    if used and managers:
        listed = ", ".join(f'"{e}"' for e in used)
        lines.append(f"  # `packages` installs from {', '.join(used)} only: narrowed from all {len(ECOSYSTEMS)} ecosystems")
        lines.append(f"  package_managers = [{listed}]")
        notes.append(f"`allow_package_managers` narrowed to {', '.join(used)}, the ecosystems `packages` installs from")
    elif used:
        notes.append(
            f"`packages` installs from {', '.join(used)} but `allow_package_managers` is not true: the sandbox cannot reach "
            "those registries (add it to `networking` if the packages are fetched through this network)"
        )
    if other:
        notes.append(f"`packages` has keys egresslaw does not know ({', '.join(other)}); ecosystems are {', '.join(ECOSYSTEMS)}")
    lines.append("}")
    return CmaImport(
        name=profile_name,
        workspace=workspace or profile_name,
        catalog=catalog.version,
        profile="\n".join(lines) + "\n",
        notes=tuple(notes),
    )


def import_cma(text: str, catalog: Catalog, default_name: str = "imported") -> str:
    """`.egress` source for one sandbox profile holding the environment's networking verbatim (a whole policy)."""
    return import_environment(text, catalog, default_name=default_name).policy_source()
