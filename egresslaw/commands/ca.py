"""`egresslaw ca --confdir DIR`: print the path of the proxy's CA certificate (PEM), creating it if needed."""

from __future__ import annotations

import argparse
from pathlib import Path

from egresslaw.common import CliError, out

DEFAULT_CONFDIR = "~/.egresslaw"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ca",
        help="print the path of the proxy's CA certificate",
        description="print the path of the CA certificate clients must trust for CONNECT interception, creating the CA if needed",
    )
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, metavar="DIR", help=f"the proxy's configuration directory (default {DEFAULT_CONFDIR})")
    parser.set_defaults(run=run)


def ca_certificate(confdir: str) -> Path:
    """`<confdir>/mitmproxy-ca-cert.pem`, with the CA (key kept private in the same directory) created on first use."""
    from mitmproxy import certs

    root = Path(confdir).expanduser()
    if root.exists() and not root.is_dir():
        raise CliError(f"--confdir `{root}` is not a directory", "pass a directory (it is created if missing)")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        certs.CertStore.from_store(root, "mitmproxy", 2048)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot create the CA in `{root}`: {exc.__class__.__name__}") from None
    return root / "mitmproxy-ca-cert.pem"


def run(args: argparse.Namespace) -> int:
    out(str(ca_certificate(args.confdir)))
    return 0
