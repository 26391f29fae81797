"""`egresslaw` entry point: parse arguments, call one function per command, render. Nothing else lives here."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import egresslaw.commands
from egress_proxy.provenance import core_digest
from egresslaw import __version__
from egresslaw.common import CliError, err


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command module under `egresslaw/commands/` registered, in name order."""
    # raw text: `--version` prints the decision-core digest on one line
    parser = argparse.ArgumentParser(prog="egresslaw", description="compile, prove and enforce egress policy",
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--version", action="version", version=f"egresslaw {__version__} (decision core {core_digest()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(egresslaw.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"egresslaw.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; usage and I/O problems exit 2 with a message, never a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CliError as exc:
        err(f"error: {exc.message}")
        if exc.help:
            err(f"help: {exc.help}")
        return exc.code
    except KeyboardInterrupt:
        err("error: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # fail closed with a message; the type only, since messages may carry input
        err(f"error: internal error ({exc.__class__.__name__}); please report this with the command you ran")
        return 2


if __name__ == "__main__":
    sys.exit(main())
