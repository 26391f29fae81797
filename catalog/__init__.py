"""Versioned, immutable preset catalogs: package-manager hosts, sandbox providers, special-purpose addresses.

- `model`   — the catalog's frozen models and `load_catalog`: `data/<version>/` files, checked against `MANIFEST.json`.
- `errors`  — `Problem` (a message and a `help`), the one error shape every package's root error derives from.

The lowest room: imports nothing of the project.
"""

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
