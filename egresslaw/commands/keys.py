"""`egresslaw keys init --dir KEYS`: create the custody, lease and audit keys (0600) in a private directory.
`egresslaw keys rotate --lease --dir KEYS [--overlap S]`: a new lease key; the old one verifies until its retirement.
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
    init.add_argument("--proof-signing", action="store_true",
                      help="instead, create the deploy prover's Ed25519 pair: KEYS/proof-signing.key (0600) and KEYS/proof-signing.pub")
    init.set_defaults(run=run_init)
    rotate = sub.add_parser(
        "rotate",
        help="rotate the lease key with an overlap window",
        description="make a new lease key that mints every new lease; the old key keeps verifying the leases it minted "
        "until its retirement time (now + --overlap), so live sandboxes are not cut; a running proxy reads the new key "
        "set at its next lease check",
    )
    rotate.add_argument("--dir", "--keys", dest="dir", required=True, metavar="KEYS", help="the keys directory")
    rotate.add_argument("--lease", action="store_true", help="rotate the lease key (custody keys rotate with `egresslaw custody rotate`)")
    rotate.add_argument("--overlap", type=int, default=None, metavar="S",
                        help="seconds the old key (and any older one) still verifies; default the longest lease lifetime, "
                        "so no live lease is cut; 0 after a compromise")
    rotate.set_defaults(run=run_rotate)
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
    if args.proof_signing:
        from proofs.signing import SigningError, init_signing_keys

        try:
            private, public = init_signing_keys(args.dir)
        except SigningError as exc:
            raise CliError(exc.message, exc.help) from None
        out(f"created `{private}` (sign with `egresslaw prove --sign {private}`) and `{public}` "
            f"(give it to the proxy: `--trust-proofs {public}`)")
        return 0
    from egress_proxy.custody.keys import KeyFileError, init_keys

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

    from egress_proxy.custody.keys import KeyFileError, init_audit_key

    try:
        key = init_audit_key(args.dir)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    out(f"created `{Path(args.dir) / 'audit.key'}` and `{Path(args.dir) / 'audit.pub'}` (audit key id `{key.id}`)")
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    """Rotate the lease key; print the new key id and when each older key retires (never key bytes)."""
    import time

    from egress_proxy.custody.keys import KeyFileError, rotate_lease_key
    from egress_proxy.custody.lease import MAX_TTL

    if not args.lease:
        raise CliError("name the key to rotate: `--lease`", help="custody keys are rotated with `egresslaw custody rotate`")
    overlap = MAX_TTL if args.overlap is None else args.overlap
    if not 0 <= overlap <= MAX_TTL:
        raise CliError(f"--overlap `{overlap}` is not from 0 to {MAX_TTL} seconds (no lease lives longer)",
                       help="give 0 (retire now) or a number of seconds")
    try:
        keys, old = rotate_lease_key(args.dir, overlap=overlap, now=time.time())
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    out(f"new lease key `{keys.active.id}` mints every new lease")
    for key in keys.keys():
        if key.retires is not None:
            until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(key.retires))
            out(f"lease key `{key.id}` verifies until {until}" + (" (the key just replaced)" if key.id == old.id else ""))
    return 0
