"""Reading the two hash-pinned locks (requirements.lock, deploy/requirements-proxy.lock) and pyproject's requirements."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
FULL_NAME = "requirements.lock"
PROXY_NAME = "deploy/requirements-proxy.lock"
FULL = ROOT / FULL_NAME
PROXY = ROOT / PROXY_NAME
VENV_EXTRAS = ("test", "prove", "lane", "dev")  # what `make venv` installs: the Makefile's `lock` target names the same


def lock_pins(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) of every requirement in the lock; anything but `name==version --hash…` fails."""
    logical = re.sub(r"\\\n", " ", "\n".join(line.split("#", 1)[0] for line in text.splitlines()))
    pins = {}
    for line in filter(None, (line.strip() for line in logical.splitlines())):
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert m, f"not an exact pin with hashes: {line[:120]}"
        name = canonicalize_name(m[1])
        assert name not in pins, f"{name} is pinned twice"
        pins[name] = (m[2], re.findall(r"sha256:([0-9a-f]{64})", m[3]))
    return pins


def requirement_closure(roots: list[str], dist) -> dict[str, list[Requirement]]:
    """Every distribution `roots` need on this platform (markers and extras evaluated), each with the requirements
    naming it; `dist(name)` gives the installed distribution whose metadata says what it needs in turn."""
    needed: dict[str, list[Requirement]] = {}
    extras: dict[str, set[str]] = {}
    pending = [Requirement(r) for r in roots]
    while pending:
        req = pending.pop()
        name = canonicalize_name(req.name)
        new = name not in extras or not set(req.extras) <= extras[name]
        needed.setdefault(name, []).append(req)
        extras.setdefault(name, set()).update(req.extras)
        if not new:
            continue
        for line in dist(name).requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *extras[name]}):
                pending.append(sub)
    return needed


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def base_dependencies() -> list[str]:
    return project()["dependencies"]


def venv_requirements() -> list[str]:
    """The base dependencies and every extra the venv installs."""
    optional = project()["optional-dependencies"]
    return [*base_dependencies(), *(r for extra in VENV_EXTRAS for r in optional[extra])]


def constraints(directory: Path) -> Path:
    """requirements.lock as a pip constraints file (versions, no hashes), for a test that installs into a venv of its
    own from the index (the wheel, pre-commit's hook environment): it gets the lock's versions, not today's releases."""
    path = directory / "lock-constraints.txt"
    path.write_text("".join(f"{name}=={version}\n" for name, (version, _) in sorted(lock_pins(FULL.read_text()).items())))
    return path
