"""`egresslaw import-cma FILE [--into DIR]`: a CMA environment (JSON or YAML) -> `.egress` source.

Without `--into`, a whole single-file policy goes to stdout. With `--into DIR`, the profile alone is
written to `DIR/<name>.egress` and joins the directory's policy (created with `DIR/workspace.egress`
on the first import), so any number of environments migrate into one policy: one workspace, one
catalog, one lock, and no import ever replaces or tombstones another.
"""

from __future__ import annotations

from pathlib import Path

from egresslaw.common import CliError, err, out, read_text, write_text_atomic

HEADER_FILE = "workspace.egress"


def register(sub) -> None:
    p = sub.add_parser(
        "import-cma",
        help="turn a Claude Managed Agents environment's networking into .egress source",
        description="turn a Claude Managed Agents environment (JSON or YAML) into a sandbox profile: a whole "
        "single-file policy on stdout, or, with --into DIR, one profile file joining DIR's policy",
        epilog="exit codes: 0 written, 1 the environment cannot be imported (the reason and a fix are given), "
        "2 usage or I/O, or --into would collide with what DIR declares",
    )
    p.add_argument("file", metavar="FILE", help="environment JSON or YAML")
    p.add_argument("--catalog", default=None, help="catalog version to pin (default: the one DIR pins, else the newest published)")
    p.add_argument("--name", default=None, help="the profile's name (default: the environment's name)")
    p.add_argument("--workspace", default=None, help="the policy's workspace (default: the profile's name, or DIR's name with --into)")
    p.add_argument("--into", metavar="DIR", default=None,
                   help=f"write DIR/<name>.egress (the profile alone) into DIR's policy, creating DIR/{HEADER_FILE} if DIR has no workspace yet")
    p.set_defaults(run=run)


def run(args) -> int:
    from catalog import CatalogError, available_versions, load_catalog
    from compiler.cma import CmaImportError, import_environment

    text = read_text(args.file, "environment file")
    existing = _directory_policy(Path(args.into)) if args.into else None
    version = args.catalog or (existing and existing["catalog"]) or available_versions()[-1]
    if existing and existing["catalog"] and args.catalog and args.catalog != existing["catalog"]:
        raise CliError(f"`{args.into}` pins catalog `{existing['catalog']}`, not `{args.catalog}`",
                       "drop --catalog: an import joins the directory's policy and its catalog")
    if existing and existing["workspace"] and args.workspace and args.workspace != existing["workspace"]:
        raise CliError(f"`{args.into}` is workspace `{existing['workspace']}`, not `{args.workspace}`",
                       "drop --workspace, or import into another directory")
    try:
        catalog = load_catalog(version)
    except CatalogError as exc:
        raise CliError(str(exc)) from None
    try:
        imported = import_environment(text, catalog, name=args.name, workspace=args.workspace)
    except CmaImportError as exc:
        err(f"{args.file}: error: {exc.message}")
        if exc.help:
            err(f"help: {exc.help}")
        return 1
    for note in imported.notes:
        err(f"note: {note}")
    if existing is None:
        print(imported.policy_source(), end="")
        return 0
    return _write_into(Path(args.into), imported, existing, args)


def _directory_policy(directory: Path) -> dict:
    """What the policy in `directory` already declares: its workspace, catalog and names (by file)."""
    from compiler.compile import parse_sources, read_sources

    if directory.exists() and not directory.is_dir():
        raise CliError(f"`{directory}` is not a directory")
    found: dict = {"workspace": None, "catalog": None, "names": {}}
    if not directory.is_dir() or not any(directory.rglob("*.egress")):
        return found
    sources, problems = read_sources([directory])
    files, parse_problems = parse_sources(sources)
    if problems or parse_problems:
        first = (problems + parse_problems)[0]
        raise CliError(f"`{first.span.path}` does not parse ({first.message})", f"fix it first: `egresslaw check {directory}`")
    for f in files:
        for d in f.decls:
            if d.kind in ("workspace", "catalog"):
                found[d.kind] = found[d.kind] or d.name
            else:
                found["names"].setdefault(d.name, f.path)
    return found


def _write_into(directory: Path, imported, existing: dict, args) -> int:
    from compiler.cma import header_source

    target = directory / f"{imported.name}.egress"
    if imported.name in existing["names"]:
        raise CliError(f"`{imported.name}` is already declared in `{existing['names'][imported.name]}`",
                       "import under another name with `--name NAME`")
    if target.exists():
        raise CliError(f"`{target}` exists already; refusing to overwrite it", "import under another name with `--name NAME`")
    header = None
    if existing["workspace"] is None:
        header = directory / HEADER_FILE
        if header.exists():
            raise CliError(f"`{header}` exists but `{directory}` declares no workspace", f"add `workspace \"…\"` to `{header}`")
        workspace = args.workspace or directory.resolve().name
        write_text_atomic(header, header_source(_safe(workspace), imported.catalog))
        out(f"wrote {header} (workspace `{_safe(workspace)}`, catalog {imported.catalog})")
    write_text_atomic(target, imported.profile_source())
    out(f"wrote {target} (sandbox_profile `{imported.name}`)")
    err(f"next: `egresslaw check {directory}`, then `egresslaw compile {directory}`")
    return 0


def _safe(name: str) -> str:
    from compiler.cma import NAME_SAFE

    return NAME_SAFE.sub("-", name).strip("-.") or "imported"
