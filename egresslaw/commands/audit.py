"""`egresslaw audit verify LOG`: check the audit log's hash chain (0 intact, 1 broken)."""

from __future__ import annotations

import argparse

from egresslaw.common import CliError, err, out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("audit", help="work with the proxy's audit log", description="work with the proxy's audit log")
    sub = parser.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = sub.add_parser("verify", help="check the hash chain", description="check the hash chain: exit 0 intact, 1 broken (with the line)")
    verify.add_argument("log", metavar="LOG", help="the JSONL audit log")
    verify.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from egress_proxy.audit import verify

    try:
        result = verify(args.log)
    except FileNotFoundError:
        raise CliError(f"audit log `{args.log}` does not exist") from None
    except OSError as exc:
        raise CliError(f"cannot read audit log `{args.log}`: {exc.strerror or exc.__class__.__name__}") from None
    if result.ok:
        out(f"ok: `{args.log}`: {result.message}")
        return 0
    err(f"error: `{args.log}`: chain broken at line {result.broken_line}: {result.message}")
    return 1
