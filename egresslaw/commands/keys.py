"""`egresslaw keys init --dir KEYS`: create the custody, lease and audit keys (0600) in a private directory.
`egresslaw keys add-audit-key --dir KEYS` adds the audit key to a directory made before it existed."""

from __future__ import annotations

import argparse

from egresslaw.common import CliError, out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="manage the keys directory", description="manage the keys directory")
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    init = sub.add_parser(
        "init",
        help="create KEYS/custody.key, KEYS/lease.key and KEYS/audit.key (mode 0600)",
        description="create KEYS/custody.key, KEYS/lease.key, KEYS/audit.key (mode 0600, directory 0700) and KEYS/audit.pub "
        "(the audit checkpoints' public key, for auditors); existing keys are never overwritten",
    )
    init.add_argument("--dir", required=True, metavar="KEYS", help="the keys directory (created if missing)")
    init.set_defaults(run=run_init)
    add = sub.add_parser(
        "add-audit-key",
        help="create KEYS/audit.key and KEYS/audit.pub in an existing keys directory",
        description="create KEYS/audit.key (0600) and KEYS/audit.pub in a keys directory made before audit keys existed; "
        "the other keys are kept, an existing audit key is never overwritten",
    )
    add.add_argument("--dir", required=True, metavar="KEYS", help="the existing keys directory")
    add.set_defaults(run=run_add_audit_key)


def run_init(args: argparse.Namespace) -> int:
    """Create the keys; a key that exists already is an error, never overwritten."""
    from egress_proxy.keys import KeyFileError, init_keys

    try:
        ring = init_keys(args.dir)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    root = ring.path.parent
    out(f"created `{ring.path}` (custody key id `{ring.active}`), `{root / 'lease.key'}`, `{root / 'audit.key'}` and `{root / 'audit.pub'}`")
    return 0


def run_add_audit_key(args: argparse.Namespace) -> int:
    """Add the audit key to an existing keys directory; an existing one is an error, never overwritten."""
    from pathlib import Path

    from egress_proxy.keys import KeyFileError, init_audit_key

    try:
        key = init_audit_key(args.dir)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    out(f"created `{Path(args.dir) / 'audit.key'}` and `{Path(args.dir) / 'audit.pub'}` (audit key id `{key.id}`)")
    return 0
