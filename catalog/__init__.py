"""Versioned, immutable preset catalogs: package-manager hosts, sandbox providers, special-purpose addresses."""

from catalog.model import (
    ECOSYSTEMS,
    AddressRange,
    Catalog,
    CatalogError,
    PackageManagerHost,
    Provider,
    SpecialPurposeTable,
    UnwrapForm,
    available_versions,
    load_catalog,
    verify_manifest,
)

__all__ = [
    "ECOSYSTEMS",
    "AddressRange",
    "Catalog",
    "CatalogError",
    "PackageManagerHost",
    "Provider",
    "SpecialPurposeTable",
    "UnwrapForm",
    "available_versions",
    "load_catalog",
    "verify_manifest",
]
