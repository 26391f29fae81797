"""`egresslaw` entry point: parse arguments, call one function per command, render. Nothing else lives here."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

import egresslaw.commands
from egress_proxy.decision.provenance import core_digest
from egresslaw import __version__
from egresslaw.common import (
    CliError,
    Parser,
    err,
    misspelled_options,
    options_from_environment,
)
from egresslaw.logs import utc_timestamp

# Exit codes by command path, for every `--help` whose module does not state them itself.
EXIT_CODES: dict[str, str] = {
    "audit": "those of its ACTION (see `egresslaw audit ACTION --help`); 2 usage",
    "custody": "those of its ACTION (see `egresslaw custody ACTION --help`); 2 usage",
    "keys": "those of its ACTION (see `egresslaw keys ACTION --help`); 2 usage",
    "audit verify": "0 the chain is intact, 1 it is broken (the line is named), 2 usage or I/O",
    "ca": "0 the path was printed, 2 the CA cannot be created or read",
    "custody put": "0 sealed, 1 refused (empty, too long, CR/LF/NUL, bad address), 2 usage, keys, store or lock problem",
    "custody list": "0 listed, 2 usage, keys, store or lock problem",
    "custody delete": "0 deleted, 1 no record there, 2 usage, keys, store or lock problem",
    "custody rotate": "0 re-sealed, 1 a record does not open (nothing changed), 2 usage, keys, store or lock problem",
    "keys init": "0 created, 2 a key file exists already (never overwritten) or the directory is unusable",
    "keys add-audit-key": "0 created, 2 the audit key exists already (never overwritten) or the directory is unusable",
    "keys rotate": "0 a new lease key is active (older ones verify until their retirement), 2 usage or a keys problem",
    "lease": "0 the token was printed, 2 usage or a keys problem",
    "sandbox-env": "0 the environment was printed (and the CA bundle written), 2 usage, a lease, keys, CA or artifact problem",
    "sandbox-run": "CMD's own (128+N when signal N ended it); 2 usage, no network namespace, the proxy unreachable at start, or CMD not found (CMD never ran)",
    "show": "0 printed, 2 the artifact is missing, malformed or edited after compiling",
    "import-cma": "0 the source was written, 1 the environment cannot be imported (the reason is given), 2 usage or I/O",
}


# The settings the other commands share with `egresslaw proxy` (which reads every option from EGRESSLAW_*): in a
# container whose image sets EGRESSLAW_KEYS, EGRESSLAW_STORE, EGRESSLAW_ARTIFACT … every command finds the same files.
_KEYS, _STORE, _ARTIFACT = {"keys": "EGRESSLAW_KEYS"}, {"store": "EGRESSLAW_STORE", "lock_timeout": "EGRESSLAW_LOCK_TIMEOUT"}, {"artifact": "EGRESSLAW_ARTIFACT"}
ENV_OPTIONS: dict[str, dict[str, str]] = {
    "custody put": {**_KEYS, **_STORE, **_ARTIFACT},
    "custody delete": {**_KEYS, **_STORE, **_ARTIFACT},
    "custody list": {**_KEYS, **_STORE},
    "custody rotate": {**_KEYS, **_STORE},
    "lease": {**_KEYS, **_ARTIFACT},
    "sandbox-env": {**_KEYS, **_ARTIFACT},
    "keys init": {"dir": "EGRESSLAW_KEYS"},
    "keys rotate": {"dir": "EGRESSLAW_KEYS"},
    "keys add-audit-key": {"dir": "EGRESSLAW_KEYS"},
    "ca": {"confdir": "EGRESSLAW_CONFDIR"},
}


def _document(parser: argparse.ArgumentParser, path: str = "") -> None:
    """Give every (sub)command a description and its exit codes in `--help`, whoever registered it."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            here = f"{path} {name}".strip()
            if not sub.description:
                sub.description = helps.get(name) or here
            if here in ENV_OPTIONS and getattr(sub, "env_prefix", None) is None:  # the proxy's reads them all already
                options_from_environment(sub, "EGRESSLAW_", ENV_OPTIONS[here])
            codes = EXIT_CODES.get(here)
            if codes and "exit codes" not in (sub.epilog or ""):
                sub.epilog = (sub.epilog + "\n\n" if sub.epilog else "") + f"exit codes: {codes}"
            _document(sub, here)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every command module under `egresslaw/commands/` registered, in name order."""
    # raw text: `--version` prints the decision-core digest on one line
    parser = Parser(
        prog="egresslaw",
        description="compile, prove and enforce egress policy",
        epilog="exit codes differ per command (see COMMAND --help); 2 is always a usage or I/O problem, never a traceback",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"egresslaw {__version__} (decision core {core_digest()})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(egresslaw.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"egresslaw.commands.{info.name}")
        module.register(sub)
    _document(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; usage and I/O problems exit 2 with a message, never a traceback."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named without their values: a stray argument may be a secret pasted in the wrong place
        shown = " ".join(a.split("=", 1)[0] + ("=…" if "=" in a else "") if a.startswith("-") else "…" for a in extra)
        hints = misspelled_options(parser, list(sys.argv[1:] if argv is None else argv), extra)
        parser.error(f"unrecognized arguments: {shown} (values not shown; a secret is read from stdin, never from arguments)"
                     + "".join(f"; {h}" for h in hints))
    try:
        return int(args.run(args) or 0)
    except CliError as exc:
        return _report(args, exc.message, exc.help, exc.code)
    except OSError as exc:  # a file this command may not read or write (keys made by another user, a read-only volume)
        return _report(args, *_os_problem(exc), 2)
    except KeyboardInterrupt:
        err("error: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # fail closed with a message; the type only, since messages may carry input
        return _report(args, f"internal error ({exc.__class__.__name__}); please report this with the command you ran", None, 2)


def _os_problem(exc: OSError) -> tuple[str, str | None]:
    """What went wrong with which file, and the fix: never the file's content (an OSError carries none)."""
    import errno
    import os

    what = (exc.strerror or exc.__class__.__name__).lower()
    path = exc.filename
    if path is None:
        return f"{what} ({exc.__class__.__name__})", None
    if exc.errno in (errno.EACCES, errno.EPERM):
        uid = os.getuid()
        return (f"permission denied on `{path}` (this command runs as uid {uid})",
                f"make it readable (and, for a store or log, writable) by uid {uid}: `chown -R {uid} {Path(path).parent}`, or create "
                f"it as that user (in a container: `docker run --user {uid} … egresslaw keys init`)")
    if exc.errno == errno.EROFS:
        return f"`{path}` is on a read-only file system", "mount a writable volume there (the proxy writes its store, CA and audit log)"
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device of `{path}`", "free space there, or point the option at another volume"
    return f"cannot use `{path}`: {what}", None


def _report(args: argparse.Namespace, message: str, help_: str | None, code: int) -> int:
    """`error:`/`help:` lines, or one JSON object when the command logs JSON (`--log-format json`)."""
    if getattr(args, "log_format", None) == "json":
        doc = {"ts": utc_timestamp(time.time()), "level": "error", "logger": "egresslaw", "message": message, **({"help": help_} if help_ else {})}
        err(json.dumps(doc, sort_keys=True, ensure_ascii=False))
        return code
    err(f"error: {message}")
    if help_:
        err(f"help: {help_}")
    return code


if __name__ == "__main__":
    sys.exit(main())
