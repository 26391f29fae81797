"""`egresslaw prove ARTIFACT`: every SPEC §5 property for every worker and subject, with counterexamples."""

from __future__ import annotations

import sys

from egresslaw.common import CliError, err, read_text, write_text_atomic


def register(sub) -> None:
    p = sub.add_parser("prove", help="prove the properties of a compiled artifact with Z3")
    p.add_argument("artifact", metavar="ARTIFACT", help="build/egresslaw.json")
    p.add_argument("-o", "--output", default="build/proof.json", help="where to write the JSON report (default build/proof.json)")
    p.add_argument("--against", metavar="OLD", help="a previous artifact, or an egresslaw.lock: also prove no-widening against it")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="prover processes (default 1)")
    p.add_argument("--timeout-ms", type=int, default=10_000, metavar="N", help="per-check solver timeout (default 10000)")
    p.add_argument("--rlimit", type=int, default=50_000_000, metavar="N", help="per-check Z3 resource limit (default 50000000)")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text", help="what to print on stdout")
    p.add_argument("--sign", metavar="KEY", help="sign the report with this Ed25519 key (`keys init --proof-signing`)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the proved checks")
    p.set_defaults(run=run)


def load(path: str, what: str = "artifact"):
    """Load and verify an artifact or raise CliError (exit 2)."""
    from compiler.artifact import ArtifactError, load_artifact

    try:
        return load_artifact(read_text(path, what))
    except ArtifactError as exc:
        raise CliError(f"`{path}`: {exc}") from None


def previous(path: str, current):
    """The artifact to prove no-widening against: a previous artifact, or the published state an `egresslaw.lock` records."""
    import json

    text = read_text(path, "previous artifact")
    try:
        raw = json.loads(text)
    except ValueError:
        raw = None
    if isinstance(raw, dict) and "subjects" in raw and raw.get("format") != "egresslaw.artifact/1":
        from compiler.lock import apply_lock

        prev = apply_lock(current, raw).previous
        if prev is None:
            raise CliError(f"`{path}`: the lock records no subject models, so nothing can be compared",
                           "pass a previous artifact with `--against build/previous.json`")
        return prev
    return load(path, "previous artifact")


def run(args) -> int:
    if args.jobs < 1:
        raise CliError(f"`--jobs {args.jobs}` must be at least 1")
    if args.timeout_ms < 1 or args.rlimit < 0:
        raise CliError("`--timeout-ms` must be at least 1 and `--rlimit` not negative")
    artifact = load(args.artifact)
    old = previous(args.against, artifact) if args.against else None
    signing_key = None
    if args.sign:
        from proofs.signing import SigningError, load_private_key

        try:
            signing_key = load_private_key(args.sign)
        except SigningError as exc:
            raise CliError(exc.message, exc.help) from None

    from proofs.runner import prove
    from proofs.solve import Limits

    progress = None
    if sys.stderr.isatty():
        def progress(done: int, total: int) -> None:
            sys.stderr.write(f"\rproving: {done}/{total} tasks")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    from catalog import CatalogError

    try:
        report = prove(artifact, old, jobs=args.jobs, limits=Limits(args.timeout_ms, args.rlimit), progress=progress)
    except CatalogError as exc:
        raise CliError(f"`{args.artifact}`: {exc}") from None
    if signing_key is not None:
        from dataclasses import replace

        from proofs.signing import sign_document

        report = replace(report, signature=sign_document(report.to_dict(), signing_key))
    if args.output:
        write_text_atomic(args.output, report.to_json())
    if args.format == "text":
        sys.stdout.write(report.render_text(verbose=args.verbose))
        if args.output:
            err(f"wrote {args.output}")
    else:
        sys.stdout.write(report.render(args.format))
    return report.exit_code()
