"""Versioned, immutable preset catalogs: package-manager hosts, sandbox providers, special-purpose addresses."""

from catalog.model import (
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
