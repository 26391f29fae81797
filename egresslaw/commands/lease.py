"""`egresslaw lease --keys KEYS (--profile P | --connection C) [--ttl 3600] [--subject S]`: mint a lease token."""

from __future__ import annotations

import argparse
import time

from egresslaw.common import CliError, out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lease",
        help="mint a lease token for one profile or connection",
        description="mint an HMAC-SHA256-signed lease (printed alone on stdout); run this on the trusted side only",
    )
    parser.add_argument("--keys", required=True, metavar="KEYS", help="the keys directory made by `egresslaw keys init`")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--profile", metavar="P", help="the sandbox profile the lease grants")
    which.add_argument("--connection", metavar="C", help="the connection the lease grants")
    parser.add_argument("--ttl", type=int, default=3600, metavar="S", help="seconds until it expires (default 3600)")
    parser.add_argument("--subject", default="anonymous", metavar="S", help="who the lease is for, recorded in the audit log")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from egress_proxy.keys import KeyFileError, load_lease_key
    from egress_proxy.lease import LeaseError, mint

    try:
        key = load_lease_key(args.keys)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    try:
        token = mint(key, args.subject, profile=args.profile, connection=args.connection, ttl=args.ttl, now=time.time())
    except LeaseError as exc:
        raise CliError(exc.message) from None
    out(token)
    return 0
