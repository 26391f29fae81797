"""`egresslaw prove ARTIFACT`: every SPEC §5 property for every worker and subject, with counterexamples."""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager

from egresslaw.common import CliError, Progress, err, read_text, write_text_atomic
from egresslaw.render import FORMAT_HELP, FORMATS

DEFAULT_OUTPUT = "build/proof.json"
DEFAULT_AGAINST_OUTPUT = "build/proof-against.json"
MAX_JOBS = 1024
MAX_SOLVER_LIMIT = 2**32 - 1  # Z3 takes both as an unsigned 32-bit number (a larger one would wrap)
# proofs.solve's defaults, repeated so `--help` needs no z3: the budget is the rlimit (deterministic), the wall clock
# only a safety bound far above it (tests/proofs/test_solve.py keeps the two copies equal)
DEFAULT_TIMEOUT_MS = 600_000
DEFAULT_RLIMIT = 50_000_000
MAX_BITS_HELP = ("give bits per request, e.g. `--max-bits 64`, or bits over any interval, e.g. `--max-bits 100000/1h` "
                 "(an interval is 30s, 15m, 1h, 1d or whole seconds)")
MAX_INTERVAL = 3650 * 86400  # ten years: an interval of any length a budget is reviewed over, bounded
_BITS = re.compile(r"[0-9]{1,15}(\.[0-9]{1,6})?")
_INTERVAL = re.compile(r"([0-9]{1,12})([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_max_bits(text: str) -> tuple[float, int | None]:
    """`--max-bits N[/WINDOW]`: (N bits, the interval in seconds or None); CliError (exit 2) for anything else."""
    bits, slash, window = text.partition("/")
    if not _BITS.fullmatch(bits):
        raise CliError(f"`--max-bits {text}`: `{bits}` is not a number of bits", MAX_BITS_HELP)
    if not slash:
        return float(bits), None
    found = _INTERVAL.fullmatch(window)
    seconds = int(found.group(1)) * _UNIT[found.group(2)] if found else 0
    if not 1 <= seconds <= MAX_INTERVAL:
        raise CliError(f"`--max-bits {text}`: `{window}` is not an interval of 1 second to 3650 days", MAX_BITS_HELP)
    return float(bits), seconds


def check_solver_limits(timeout_ms: int, rlimit: int = 0) -> None:
    """CliError unless `--timeout-ms` is 1..2^32-1 and `--rlimit` 0..2^32-1 (0: no resource limit)."""
    if not 1 <= timeout_ms <= MAX_SOLVER_LIMIT:
        raise CliError(f"`--timeout-ms {timeout_ms}` must be from 1 to {MAX_SOLVER_LIMIT}", "give milliseconds, e.g. `--timeout-ms 600000`")
    if not 0 <= rlimit <= MAX_SOLVER_LIMIT:
        raise CliError(f"`--rlimit {rlimit}` must be from 0 to {MAX_SOLVER_LIMIT}", "give a Z3 resource limit, e.g. `--rlimit 50000000`")


@contextmanager
def prover_imports():
    """Import the z3-backed `proofs` modules inside this block: without z3-solver (a base install, the proxy image)
    the command fails as a usage problem (exit 2) naming the extra to install, never with a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name != "z3" and not (exc.name or "").startswith("z3."):
            raise
        raise CliError("the prover needs z3-solver", "pip install 'egresslaw[prove]'") from None


def register(sub) -> None:
    p = sub.add_parser(
        "prove",
        help="prove the properties of a compiled artifact with Z3",
        description="prove every property for every worker and subject of a compiled artifact, with counterexamples",
        epilog="exit codes: 0 all proved, 1 something refuted, 4 something unknown (never counted as proved), 2 usage or I/O",
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="build/egresslaw.json")
    p.add_argument(
        "-o", "--output", default=None,
        help=f"where to write the JSON report (default {DEFAULT_OUTPUT}; with --against {DEFAULT_AGAINST_OUTPUT}, "
        "so a comparison never replaces the proof the proxy starts from)",
    )
    p.add_argument("--against", metavar="OLD", help="a previous artifact, or an egresslaw.lock: also prove no-widening against it")
    p.add_argument("--within", metavar="CEILING",
                   help="a ceiling an operator owns (a policy directory or file, compiled here, or its artifact): also prove "
                   "each subject admits nothing its ceiling subject denies and attaches no credential it does not")
    p.add_argument("--map", action="append", default=[], metavar="KIND:NAME=CEILING_NAME",
                   help="with --within: bound this subject by another ceiling subject than the same-named one, e.g. "
                   "`--map profile:ci-42=any-builder` (repeatable)")
    p.add_argument("--max-bits", metavar="N[/WINDOW]",
                   help="the exfiltration budget: refute (`max-bits`) every subject whose capacity is over N bits per "
                   "request, or with /WINDOW (30s, 15m, 1h, 1d, seconds) over any interval that long (docs/budget.md)")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="prover processes (default 1)")
    p.add_argument("--rlimit", type=int, default=DEFAULT_RLIMIT, metavar="N",
                   help=f"the budget: Z3 resource limit per solver call, the same on every machine and under any load "
                   f"(default {DEFAULT_RLIMIT}; 0: none)")
    p.add_argument("--timeout-ms", type=int, default=DEFAULT_TIMEOUT_MS, metavar="N",
                   help=f"wall-clock safety bound per solver call, in ms (default {DEFAULT_TIMEOUT_MS}: 10 minutes); "
                   "a check it stops is unknown with `wall-clock limit`")
    p.add_argument("--format", choices=FORMATS, default="text", help=FORMAT_HELP)
    p.add_argument("--sign", metavar="KEY", help="sign the report with this Ed25519 key (`keys init --proof-signing`)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the proved checks")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress on stderr: auto (once a run lasts 2 s), always or never")
    p.set_defaults(run=run)


def load(path: str, what: str = "artifact"):
    """Load and verify an artifact or raise CliError (exit 2)."""
    from pathlib import Path

    from compiler.artifact import ArtifactError, load_artifact

    compile_help = f"compile it first: `egresslaw compile {path} -o build/egresslaw.json`, then pass `build/egresslaw.json`"
    if Path(path).is_dir():
        raise CliError(f"{what} `{path}` is a directory, not a compiled artifact", compile_help)
    if Path(path).suffix == ".egress":
        raise CliError(f"{what} `{path}` is a policy source, not a compiled artifact", compile_help)
    try:
        return load_artifact(read_text(path, what))
    except ArtifactError as exc:
        raise CliError(f"`{path}`: {exc}") from None


def compile_policy(path: str, what: str, fix: str):
    """Compile the one policy `path` (a directory or file) names, in memory: the CompileResult, or its diagnostics
    printed on stderr and a CliError (`what` names it: "ceiling `c/`"; `fix` says what to do when it does not compile)."""
    from compiler.compile import compile_sources, find_policies, read_files
    from egresslaw.render import print_diagnostics

    roots, problems = find_policies([path])
    if problems or len(roots) != 1:
        if problems:
            print_diagnostics(problems, {}, "text")
        raise CliError(f"{what} is not one policy", "give one policy directory or file")
    result = compile_sources(*read_files(roots[0].files))
    if not result.ok:
        print_diagnostics(result.diagnostics, result.sources, "text")
        raise CliError(f"{what} does not compile", fix)
    return result


def ceiling_of(path: str, maps: list[str], artifact):
    """`--within`: the ceiling (an artifact, or a policy compiled here) with the subject mapping of `--map`."""
    from pathlib import Path

    from proofs.model import Ceiling

    source = Path(path)
    if source.is_dir() or source.suffix == ".egress":
        ceiling = compile_policy(path, f"ceiling `{path}`", f"fix the errors above (`egresslaw check {path}`)").artifact
    else:
        ceiling = load(path, "ceiling artifact")
    mapping = []
    for item in maps:
        subject, sep, target = item.partition("=")
        kind, colon, name = subject.partition(":")
        if not sep or not colon or kind not in ("profile", "connection") or not name or not target:
            raise CliError(f"--map `{item}` is not KIND:NAME=CEILING_NAME",
                           "e.g. `--map profile:ci-42=any-builder` or `--map connection:github=github-any`")
        if (artifact.profile(name) if kind == "profile" else artifact.connection(name)) is None:
            raise CliError(f"--map `{item}`: the artifact has no {kind} `{name}`")
        if (ceiling.profile(target) if kind == "profile" else ceiling.connection(target)) is None:
            raise CliError(f"--map `{item}`: the ceiling has no {kind} `{target}`")
        mapping.append((subject, target))
    if len(dict(mapping)) != len(mapping):
        raise CliError("--map names one subject twice")
    return Ceiling(ceiling, tuple(sorted(mapping)))


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
    if not 1 <= args.jobs <= MAX_JOBS:
        raise CliError(f"`--jobs {args.jobs}` must be from 1 to {MAX_JOBS}", "give the number of prover processes, e.g. `--jobs 4`")
    check_solver_limits(args.timeout_ms, args.rlimit)
    gate = parse_max_bits(args.max_bits) if args.max_bits is not None else None
    with prover_imports():
        from proofs.runner import MaxBits, prove
        from proofs.solve import Limits
    artifact = load(args.artifact)
    old = previous(args.against, artifact) if args.against else None
    if args.map and not args.within:
        raise CliError("--map maps subjects onto a ceiling", "give the ceiling with `--within CEILING`")
    ceiling = ceiling_of(args.within, args.map, artifact) if args.within else None
    signing_key = None
    if args.sign:
        from proofs.signing import SigningError, load_private_key

        try:
            signing_key = load_private_key(args.sign)
        except SigningError as exc:
            raise CliError(exc.message, exc.help) from None

    output = args.output if args.output is not None else (DEFAULT_AGAINST_OUTPUT if args.against else DEFAULT_OUTPUT)
    progress = Progress("prove", args.progress)

    def on_task(done: int, total: int) -> None:
        progress.update(done, total, "tasks done")

    from catalog import CatalogError

    try:
        progress.stage(f"{len(artifact.workers)} worker(s), {len(artifact.connections)} connection(s), "
                       f"{len(artifact.sandbox_profiles)} profile(s)")
        report = prove(artifact, old, jobs=args.jobs, limits=Limits(args.timeout_ms, args.rlimit), progress=on_task,
                       ceiling=ceiling, max_bits=MaxBits(*gate) if gate is not None else None)
    except CatalogError as exc:
        progress.close()
        raise CliError(f"`{args.artifact}`: {exc}") from None
    except BaseException:
        progress.close()
        raise
    s = report.summary
    progress.close(f"{s['total']} checks: {s['proved']} proved, {s['refuted']} refuted, {s['unknown']} unknown")
    if signing_key is not None:
        from dataclasses import replace

        from proofs.signing import sign_document

        report = replace(report, signature=sign_document(report.to_dict(), signing_key))
    if output:
        write_text_atomic(output, report.to_json())
    if args.format == "text":
        sys.stdout.write(report.render_text(verbose=args.verbose))
        if old is not None:
            sys.stdout.write(capacity_moved(old, artifact))
        if output:
            err(f"wrote {output}")
    else:
        sys.stdout.write(report.render(args.format, artifact.locations, args.artifact))
    return report.exit_code()


def capacity_moved(old, new) -> str:
    """`prove --against`: how each subject's capacity moved since OLD (`proofs.diff.capacity_moves`)."""
    from proofs.diff import capacity_moves, render_moves

    return "".join(line + "\n" for line in render_moves(capacity_moves(old, new)))
