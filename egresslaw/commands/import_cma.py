"""`egresslaw import-cma FILE`: a CMA environment (JSON or YAML) -> `.egress` source on stdout."""

from __future__ import annotations

from egresslaw.common import err, read_text


def register(sub) -> None:
    p = sub.add_parser("import-cma", help="turn a Claude Managed Agents environment's networking into .egress source")
    p.add_argument("file", metavar="FILE", help="environment JSON or YAML")
    p.add_argument("--catalog", default=None, help="catalog version to pin (default: the newest published)")
    p.set_defaults(run=run)


def run(args) -> int:
    from catalog import CatalogError, available_versions, load_catalog
    from compiler.cma import CmaImportError, import_cma
    from egresslaw.common import CliError

    text = read_text(args.file, "environment file")
    try:
        catalog = load_catalog(args.catalog or available_versions()[-1])
    except CatalogError as exc:
        raise CliError(str(exc)) from None
    try:
        source = import_cma(text, catalog)
    except CmaImportError as exc:
        err(f"{args.file}: error: {exc.message}")
        if exc.help:
            err(f"help: {exc.help}")
        return 1
    print(source, end="")
    return 0
