"""`egresslaw audit verify LOG|DIR [--keys KEYS | --public-key audit.pub]`: check an audit log, streaming.

Exit codes: 0 intact and closed by its checkpoint, 1 broken (the first wrong line is named), 3 every line
checks but the log does not end with a closing checkpoint (still written, writer killed, or truncated),
2 usage or I/O error. What could not be checked (line MACs without the secret key, the signing key itself
without `--public-key`) is always printed.
"""

from __future__ import annotations

import argparse

from egresslaw.common import CliError, err, out

EXIT = {"intact": 0, "broken": 1, "open": 3}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("audit", help="work with the proxy's audit log", description="work with the proxy's audit log")
    sub = parser.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = sub.add_parser(
        "verify",
        help="check the chain, the signed checkpoints and the segments",
        description="check an audit log (a file, or a directory of rotated segments; a directory or `--audit-log` path "
        "of a proxy with several workers: every worker's chain): exit 0 intact and closed, "
        "1 broken (the first wrong line is named), 3 intact so far but not closed (running, killed or truncated)",
    )
    verify.add_argument("log", metavar="LOG|DIR", help="the audit log file, or the directory holding its segments (or several logs)")
    verify.add_argument("--recursive", action="store_true",
                        help="a directory: also check the logs in its subdirectories (several replicas shipped side by side); "
                        "without it only the logs directly in DIR are read")
    keys = verify.add_mutually_exclusive_group()
    keys.add_argument("--keys", metavar="KEYS", help="the proxy's keys directory: also check every line's MAC (audit.key)")
    keys.add_argument("--public-key", metavar="FILE", help="audit.pub: check the signatures against this key, not the one the log names")
    verify.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from egress_proxy.audit.log import AuditError
    from egress_proxy.audit.verify import verify_logs
    from egress_proxy.custody.keys import (
        KeyFileError,
        load_audit_key,
        load_audit_public_key,
    )

    try:
        key = load_audit_key(args.keys) if args.keys else load_audit_public_key(args.public_key) if args.public_key else None
        results = verify_logs(args.log, key=key, recursive=args.recursive)  # one log, or the chains of a proxy's workers (`--workers N`)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    except AuditError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot read audit log `{args.log}`: {exc.strerror or exc.__class__.__name__}") from None
    several = len(results) > 1
    for name, result in results:
        where = f"`{name}`" if several else f"`{args.log}`"
        if result.status == "intact":
            out(f"ok: {where}: {result.message}")
        elif result.status == "open":
            err(f"open: `{result.file}`: line {result.line}: {result.message}")
        else:
            err(f"error: `{result.file}`: " + (f"line {result.line}: " if result.line is not None else "") + result.message)
        show = out if result.ok else err
        for item in result.checked:
            show(f"  checked: {item}")
        for item in result.unchecked:
            show(f"  not checked: {item}")
        for item in result.notes:
            show(f"  note: {item}")
    worst = max((r.status for _, r in results), key=("intact", "open", "broken").index)
    if several:
        counts = {s: sum(1 for _, r in results if r.status == s) for s in ("intact", "open", "broken")}
        (out if worst == "intact" else err)(f"{len(results)} logs, each its own chain: {counts['intact']} intact, {counts['open']} open, {counts['broken']} broken")
    return EXIT[worst]
