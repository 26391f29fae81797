"""Catalog models and the loader; data files live in `catalog/data/<version>/` and never change."""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from catalog.errors import Problem

DATA_DIR = Path(__file__).parent / "data"
MANIFEST = DATA_DIR / "MANIFEST.json"
FILES = ("package_managers.json", "providers.json", "special_purpose.json")
ECOSYSTEMS = ("apt", "cargo", "gem", "go", "npm", "pip")
Certification = Literal["advisory_filter", "security_boundary"]


class CatalogError(Problem):
    """A catalog version is missing, malformed, or differs from its published digest."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PackageManagerHost(_Frozen):
    host: str
    port: int
    source: str


class Provider(_Frozen):
    name: str
    revision: str
    axes: tuple[str, ...]
    egress_certification: Certification

    @property
    def ref(self) -> str:
        """`name@revision`, the form policies use."""
        return f"{self.name}@{self.revision}"


class AddressRange(_Frozen):
    cidr: str
    name: str
    reference: str
    kind: str

    @functools.cached_property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        """The parsed network (strict: host bits must be zero)."""
        return ipaddress.ip_network(self.cidr)


class UnwrapForm(_Frozen):
    form: str
    prefix: str
    reference: str
    ipv4: str
    judge: Literal["embedded only", "container and embedded"]


class SpecialPurposeTable(_Frozen):
    version: str
    registry_date: str
    sources: tuple[str, ...]
    note: str
    ranges: tuple[AddressRange, ...]
    unwrap: tuple[UnwrapForm, ...]

    def lookup(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> AddressRange | None:
        """The most specific special-purpose range containing `ip`, or None."""
        best: AddressRange | None = None
        for entry in self.ranges:
            net = entry.network
            if net.version == ip.version and ip in net:
                if best is None or net.prefixlen > best.network.prefixlen:
                    best = entry
        return best


class _PackageManagers(_Frozen):
    version: str
    ecosystems: dict[str, tuple[PackageManagerHost, ...]]


class _Providers(_Frozen):
    version: str
    axes: tuple[str, ...]
    providers: tuple[Provider, ...]


class Catalog(_Frozen):
    version: str
    digest: str
    package_managers: dict[str, tuple[PackageManagerHost, ...]]
    axes: tuple[str, ...]
    providers: tuple[Provider, ...]
    special_purpose: SpecialPurposeTable

    def provider(self, ref: str) -> Provider | None:
        """The provider whose `name@revision` is exactly `ref`."""
        for p in self.providers:
            if p.ref == ref:
                return p
        return None


def available_versions() -> tuple[str, ...]:
    """Published catalog versions, oldest first."""
    return tuple(sorted(p.name for p in DATA_DIR.iterdir() if p.is_dir()))


def _file_digests(version: str) -> dict[str, str]:
    root = DATA_DIR / version
    return {f"{version}/{name}": hashlib.sha256((root / name).read_bytes()).hexdigest() for name in FILES}


def verify_manifest() -> list[str]:
    """Every difference between the data files and the published manifest (empty when intact)."""
    published = json.loads(MANIFEST.read_text())
    problems = []
    for version in available_versions():
        for path, digest in _file_digests(version).items():
            if path not in published:
                problems.append(f"{path} is not in the manifest")
            elif published[path] != digest:
                problems.append(f"{path} changed after publication (sha256 {digest}, published {published[path]})")
    for path in published:
        if not (DATA_DIR / path).exists():
            problems.append(f"{path} is in the manifest but missing")
    return problems


@functools.cache
def load_catalog(version: str) -> Catalog:
    """Load and validate a published catalog version; its digest covers the manifest entries of its files."""
    if version not in available_versions():
        known = ", ".join(available_versions())
        raise CatalogError(f"catalog version `{version}` is not published (known: {known})")
    root = DATA_DIR / version
    try:
        pms = _PackageManagers.model_validate_json((root / "package_managers.json").read_bytes())
        provs = _Providers.model_validate_json((root / "providers.json").read_bytes())
        table = SpecialPurposeTable.model_validate_json((root / "special_purpose.json").read_bytes())
    except (OSError, ValidationError) as exc:
        raise CatalogError(f"catalog `{version}` is malformed: {exc}") from None
    if set(pms.ecosystems) != set(ECOSYSTEMS):
        raise CatalogError(f"catalog `{version}` must list exactly the ecosystems {', '.join(ECOSYSTEMS)}")
    digests = _file_digests(version)
    digest = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    return Catalog(
        version=version,
        digest=digest,
        package_managers=pms.ecosystems,
        axes=provs.axes,
        providers=provs.providers,
        special_purpose=table,
    )
