"""`egresslaw lease --keys KEYS (--profile P | --connection C) [--ttl 3600] [--subject S] [--artifact A]`: mint a lease token."""

from __future__ import annotations

import argparse
import time

from egresslaw.common import CliError, out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lease",
        help="mint a lease token for one profile or connection",
        description="mint an HMAC-SHA256-signed lease (printed alone on stdout), signed by the active lease key and "
        "naming its key id; run this on the trusted side only",
    )
    add_mint_arguments(parser, required=True)
    parser.set_defaults(run=run)


def add_mint_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The options that say what lease to mint (shared with `sandbox-env`, which mints one when given `--keys`)."""
    parser.add_argument("--keys", required=required, metavar="KEYS", help="the keys directory made by `egresslaw keys init`")
    which = parser.add_mutually_exclusive_group(required=required)
    which.add_argument("--profile", metavar="P", help="the sandbox profile the lease grants")
    which.add_argument("--connection", metavar="C", help="the connection the lease grants")
    parser.add_argument("--ttl", type=int, default=3600, metavar="S", help="seconds until it expires (default 3600)")
    parser.add_argument("--subject", default="anonymous", metavar="S", help="who the lease is for, recorded in the audit log")
    parser.add_argument("--artifact", metavar="A", help="refuse a profile or connection this compiled artifact does not contain")


def mint_from_args(args: argparse.Namespace) -> str:
    """Mint the lease the arguments describe (after checking the subject against `--artifact` when given)."""
    from egress_proxy.custody.keys import KeyFileError, load_lease_keys
    from egress_proxy.custody.lease import LeaseError, mint

    if args.artifact:
        check_subject(args.artifact, profile=args.profile, connection=args.connection)
    try:
        keys = load_lease_keys(args.keys)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    try:
        return mint(keys, args.subject, profile=args.profile, connection=args.connection, ttl=args.ttl, now=time.time())
    except LeaseError as exc:
        raise CliError(exc.message) from None


def check_subject(artifact_path: str, *, profile: str | None, connection: str | None) -> None:
    """CliError (with a did-you-mean) unless the artifact contains the named profile or connection."""
    import difflib

    from egresslaw.commands.prove import load

    artifact = load(artifact_path)
    if profile is not None:
        kind, name, known = "sandbox profile", profile, [p.name for p in artifact.sandbox_profiles]
    else:
        kind, name, known = "connection", connection, [c.name for c in artifact.connections]
    if name in known:
        return
    close = difflib.get_close_matches(name or "", known, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean `{close[0]}`?"
    elif known:
        hint = f"its {kind}s: " + ", ".join(f"`{k}`" for k in sorted(known))
    else:
        hint = f"it has no {kind}"
    raise CliError(f"artifact `{artifact_path}` has no {kind} `{name}`; a lease for it would be refused (lease-unknown-subject)", help=hint)


def run(args: argparse.Namespace) -> int:
    out(mint_from_args(args))
    return 0
