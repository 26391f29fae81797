"""`egresslaw lease --keys KEYS (--profile P | --connection C) [--ttl 3600] [--subject S] [--artifact A]`: mint a lease token.

The profile or connection is checked against the artifact the proxy serves before a lease is minted: `--artifact`,
else `EGRESSLAW_ARTIFACT`, else `build/egresslaw.json` (what `egresslaw compile` writes by default) when it exists.
With none of them the lease is refused, not minted for a subject nobody checked (the proxy would answer every request
`lease-unknown-subject`, a bare 407 to the tool); `--no-subject-check` mints without checking, on purpose.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from egresslaw.common import CliError, out

DEFAULT_ARTIFACT = "build/egresslaw.json"  # `egresslaw compile`'s default output (egresslaw/commands/compile.py)


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
    parser.add_argument("--artifact", metavar="A",
                        help=f"the compiled artifact the proxy serves: a profile or connection it does not contain is refused "
                        f"(default: EGRESSLAW_ARTIFACT, else {DEFAULT_ARTIFACT} when it exists; with neither, nothing is minted)")
    parser.add_argument("--no-subject-check", action="store_true",
                        help="mint without checking the profile or connection against any artifact, even one given or found "
                        "(the proxy refuses a lease whose subject its artifact lacks: lease-unknown-subject)")



def find_artifact(args: argparse.Namespace) -> tuple[str, str] | None:
    """The artifact to check a subject against, and how it was found: `--artifact`, else EGRESSLAW_ARTIFACT, else
    `build/egresslaw.json` in the working directory when it exists; None when there is none."""
    if getattr(args, "artifact", None):
        return args.artifact, "--artifact"
    if os.environ.get("EGRESSLAW_ARTIFACT"):  # `lease` and `sandbox-env` bind it to --artifact already; `sandbox-run` does not
        return os.environ["EGRESSLAW_ARTIFACT"], "from EGRESSLAW_ARTIFACT"
    if Path(DEFAULT_ARTIFACT).is_file():
        return DEFAULT_ARTIFACT, "in the working directory"
    return None


def mint_from_args(args: argparse.Namespace) -> str:
    """Mint the lease the arguments describe, once its subject is known to be in the artifact (see `find_artifact`);
    a CliError when it is not, or when no artifact can be found (unless `--no-subject-check`)."""
    from egress_proxy.custody.keys import KeyFileError, load_lease_keys
    from egress_proxy.custody.lease import LeaseError, mint

    try:
        keys = load_lease_keys(args.keys)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    try:
        token = mint(keys, args.subject, profile=args.profile, connection=args.connection, ttl=args.ttl, now=time.time())
    except LeaseError as exc:
        raise CliError(exc.message) from None
    if not args.no_subject_check:  # INVARIANT: the token is returned (printed, handed to a sandbox) only after this check
        found = find_artifact(args)
        if found is None:
            kind, name = ("profile", args.profile) if args.profile is not None else ("connection", args.connection)
            raise CliError(f"no artifact to check {kind} `{name}` against: no --artifact, no EGRESSLAW_ARTIFACT, and no "
                           f"`{DEFAULT_ARTIFACT}` here; nothing was minted",
                           help=f"give the artifact the proxy serves (`--artifact {DEFAULT_ARTIFACT}` or EGRESSLAW_ARTIFACT), or "
                           "`--no-subject-check` to mint without checking (a misspelt name then shows only as the proxy's 407 "
                           "lease-unknown-subject)")
        check_subject(found[0], profile=args.profile, connection=args.connection, found=found[1])
    return token


def check_subject(artifact_path: str, *, profile: str | None, connection: str | None, found: str = "--artifact") -> None:
    """CliError (with a did-you-mean) unless the artifact contains the named profile or connection; `found` says how
    the artifact was chosen (named in the message unless it was `--artifact`)."""
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
    how = "" if found == "--artifact" else f" ({found})"
    raise CliError(f"artifact `{artifact_path}`{how} has no {kind} `{name}`; a lease for it would be refused (lease-unknown-subject)",
                   help=hint)


def run(args: argparse.Namespace) -> int:
    out(mint_from_args(args))
    return 0
