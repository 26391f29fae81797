"""`egresslaw diff OLD NEW`: semantic diff of two artifacts, as example requests one admits and the other denies."""

from __future__ import annotations

import sys

from egresslaw.common import CliError
from egresslaw.render import FORMAT_HELP, FORMATS


def register(sub) -> None:
    p = sub.add_parser(
        "diff",
        help="semantic diff of two compiled artifacts, with example requests",
        description="requests one artifact admits and the other denies, found by Z3 and replayed through decide()",
        epilog="exit codes: 0 the artifacts admit the same requests, 1 they differ (or a subject is undecided), 2 usage or I/O",
    )
    p.add_argument("old", metavar="OLD", help="the previous artifact")
    p.add_argument("new", metavar="NEW", help="the new artifact")
    p.add_argument("--examples", type=int, default=3, metavar="N", help="examples per subject and direction (default 3)")
    p.add_argument("--timeout-ms", type=int, default=600_000, metavar="N",
                   help="wall-clock safety bound per solver call, in ms (default 600000; the budget is Z3's rlimit)")
    p.add_argument("--format", choices=FORMATS, default="text", help=FORMAT_HELP)
    p.set_defaults(run=run)


def run(args) -> int:
    from egresslaw.commands.prove import load

    if args.examples < 1:
        raise CliError(f"`--examples {args.examples}` must be at least 1")
    from egresslaw.commands.prove import check_solver_limits, prover_imports

    check_solver_limits(args.timeout_ms)
    with prover_imports():
        from proofs.diff import semantic_diff
        from proofs.solve import Limits
    old, new = load(args.old, "old artifact"), load(args.new, "new artifact")

    result = semantic_diff(old, new, limits=Limits(timeout_ms=args.timeout_ms), max_examples=args.examples)
    sys.stdout.write(result.render(args.format, new.locations, old.locations, args.new))
    return 0 if result.same else 1
