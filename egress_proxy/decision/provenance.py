"""Which egresslaw and which decision code is running: the version and the digest a proof report must match.

The digest is sha256 over the source, as the running process loaded it, of every module a proof's
scope depends on: the whole decision package (`egress_proxy.decision`: the core, the adapter that
reads requests into it and composes its verdict, the address adapter, the index that builds the
subject tables), the normalizers that build the tables (`compiler.normalize`), the pattern subset request shapes match
(`compiler.patterns`), the policy data the
core reads (`compiler.constants`), the artifact model the tables are read from (`compiler.artifact`)
and the catalog loader (`catalog`, whose data files are pinned by their own published digests). The
prover records it in the report; the proxy refuses a report made from other code. Imports nothing heavy.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import pkgutil
import sys

CORE_SOURCES = ("egress_proxy.decision.core", "compiler.constants")  # what the prover evaluates symbolically
DIGEST_PACKAGES = ("egress_proxy.decision", "catalog")  # every module of these
DIGEST_MODULES = ("compiler.constants", "compiler.normalize", "compiler.artifact", "compiler.patterns")
# the same, as paths (for messages)
DIGEST_SCOPE = tuple(p.replace(".", "/") + "/" for p in DIGEST_PACKAGES) + tuple(m.replace(".", "/") + ".py" for m in DIGEST_MODULES)


def digest_modules() -> tuple[str, ...]:
    """The modules `core_digest` covers, sorted: each package with every module in it, then the single modules."""
    names: set[str] = set(DIGEST_MODULES)
    for package in DIGEST_PACKAGES:
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
        names.add(package)
        names.update(f"{package}.{m.name}" for m in pkgutil.iter_modules(locations) if not m.ispkg)
    return tuple(sorted(names))


def module_source(name: str) -> str:
    """A module's source as its loader provides it (for a loaded module, the loader that loaded it)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None) if module is not None else importlib.util.find_spec(name)
    loader = getattr(spec, "loader", None)
    source = loader.get_source(name) if loader is not None and hasattr(loader, "get_source") else None
    if source is None:
        raise RuntimeError(f"no source for module `{name}`")
    return source


def core_digest() -> str:
    """sha256 of the source of every module in `digest_modules()` (hex)."""
    h = hashlib.sha256()
    for name in digest_modules():
        h.update(name.encode() + b"\0" + module_source(name).encode("utf-8") + b"\0")
    return h.hexdigest()


@functools.cache
def egresslaw_version() -> str:
    """The installed egresslaw version (the one `egresslaw --version` prints)."""
    try:
        return importlib.metadata.version("egresslaw")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
        return "0+unknown"
