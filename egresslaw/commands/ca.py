"""`egresslaw ca --confdir DIR`: print the path of the proxy's CA certificate (PEM), creating it if needed."""

from __future__ import annotations

import argparse
from pathlib import Path

from egress_proxy.front.settings import DEFAULTS
from egresslaw.common import CliError, out

DEFAULT_CONFDIR = DEFAULTS.confdir  # egress_proxy/edge/settings.py


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ca",
        help="print the path of the proxy's CA certificate",
        description="print the path of the CA certificate clients must trust for CONNECT interception, creating the CA if needed",
    )
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, metavar="DIR", help=f"the proxy's configuration directory (default {DEFAULT_CONFDIR})")
    parser.set_defaults(run=run)


def ca_certificate(confdir: str) -> Path:
    """The CA certificate's path (created on first use); a CliError when the directory cannot hold it."""
    # Imported here: mitmproxy costs every other command's start-up (the CLI loads each command module).
    from egress_proxy.front.ca import ca_certificate as make
    from egress_proxy.front.startup import StartupError

    try:
        return make(confdir)
    except StartupError as exc:
        raise CliError(exc.message, exc.help) from None


def run(args: argparse.Namespace) -> int:
    out(str(ca_certificate(args.confdir)))
    return 0
