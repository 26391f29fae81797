"""`egresslaw keys init --dir KEYS`: create the custody and lease keys (0600) in a private directory."""

from __future__ import annotations

import argparse

from egresslaw.common import CliError, out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="manage the keys directory", description="manage the keys directory")
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    init = sub.add_parser(
        "init",
        help="create KEYS/custody.key and KEYS/lease.key (mode 0600)",
        description="create KEYS/custody.key and KEYS/lease.key (mode 0600, directory 0700); existing keys are never overwritten",
    )
    init.add_argument("--dir", required=True, metavar="KEYS", help="the keys directory (created if missing)")
    init.add_argument("--proof-signing", action="store_true",
                      help="instead, create the deploy prover's Ed25519 pair: KEYS/proof-signing.key (0600) and KEYS/proof-signing.pub")
    init.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    """Create the keys; a key that exists already is an error, never overwritten."""
    if args.proof_signing:
        from proofs.signing import SigningError, init_signing_keys

        try:
            private, public = init_signing_keys(args.dir)
        except SigningError as exc:
            raise CliError(exc.message, exc.help) from None
        out(f"created `{private}` (sign with `egresslaw prove --sign {private}`) and `{public}` "
            f"(give it to the proxy: `--trust-proofs {public}`)")
        return 0
    from egress_proxy.keys import KeyFileError, init_keys

    try:
        ring = init_keys(args.dir)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    out(f"created `{ring.path}` (custody key id `{ring.active}`) and `{ring.path.parent / 'lease.key'}`")
    return 0
