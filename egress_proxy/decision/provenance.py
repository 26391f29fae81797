"""Which egresslaw and which decision core is running: the version and the digest a proof report must match.

The digest is sha256 over the source of the decision core (`egress_proxy.decision.core` and the policy
data it reads, `compiler.constants`) as the running process loaded it. The prover records it
in the report; the proxy refuses a report made from another core. Imports nothing heavy.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import sys

CORE_SOURCES = ("egress_proxy.decision.core", "compiler.constants")


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
    """sha256 of the decision core's source (hex)."""
    h = hashlib.sha256()
    for name in CORE_SOURCES:
        h.update(name.encode() + b"\0" + module_source(name).encode("utf-8") + b"\0")
    return h.hexdigest()


@functools.cache
def egresslaw_version() -> str:
    """The installed egresslaw version (the one `egresslaw --version` prints)."""
    try:
        return importlib.metadata.version("egresslaw")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from an uninstalled tree
        return "0+unknown"
