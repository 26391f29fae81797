"""`egresslaw audit verify LOG|DIR [--keys KEYS | --public-key audit.pub]`: check an audit log, streaming.

Exit codes: 0 intact and closed by its checkpoint, 1 broken (the first wrong line is named), 3 every line
checks but the log does not end with a closing checkpoint (still written, writer killed, or truncated),
2 usage or I/O error. What could not be checked (line MACs without the secret key, the signing key itself
without `--public-key`) is always printed.

`egresslaw audit export LOG --to URL [--follow] ...`: ship every chain of LOG to an OTLP collector as OCSF records
(`egress_proxy.audit.export`, docs/audit-export.md). Exit codes: 0 everything exported (or stopped by a signal while
following), 1 the collector could not be reached within `--timeout`, 2 usage or a bad target, headers or TLS file.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from egresslaw.common import CliError, err, options_from_environment, out
from egresslaw.logs import FORMATS as LOG_FORMATS
from egresslaw.logs import LEVELS as LOG_LEVELS

EXIT = {"intact": 0, "broken": 1, "open": 3}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("audit", help="work with the proxy's audit log", description="work with the proxy's audit log")
    sub = parser.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = sub.add_parser(
        "verify",
        help="check the chain, the signed checkpoints and the segments",
        description="check an audit log (a file, or a directory of rotated segments; a directory or `--audit-log` path "
        "of a proxy with several workers: every worker's chain): exit 0 intact and closed, "
        "1 broken (the first wrong line is named), 3 intact so far but not closed (running, killed or truncated)",
    )
    verify.add_argument("log", metavar="LOG|DIR", help="the audit log file, or the directory holding its segments (or several logs)")
    verify.add_argument("--recursive", action="store_true",
                        help="a directory: also check the logs in its subdirectories (several replicas shipped side by side); "
                        "without it only the logs directly in DIR are read")
    keys = verify.add_mutually_exclusive_group()
    keys.add_argument("--keys", metavar="KEYS", help="the proxy's keys directory: also check every line's MAC (audit.key)")
    keys.add_argument("--public-key", metavar="FILE", help="audit.pub: check the signatures against this key, not the one the log names")
    verify.set_defaults(run=run_verify)
    export = sub.add_parser(
        "export",
        help="ship every chain of an audit log to an OTLP collector as OCSF records (HTTP/protobuf or gRPC)",
        description="export the audit log's lines (every chain: LOG, its workers' `LOG.wI` chains, their rotated segments) "
        "as OCSF records in OTLP logs, from a durable checkpoint that advances only when the collector acknowledged a batch",
        epilog="exit codes: 0 everything was exported (with --follow: stopped by SIGTERM/SIGINT), "
        "1 the collector could not be reached within --timeout, 2 usage, a bad --to, headers, TLS or state problem",
    )
    export.add_argument("log", metavar="LOG", help="the audit log, as `--audit-log` names it (its worker chains beside it are exported too)")
    export.add_argument("--to", required=True, metavar="URL",
                        help="the collector: grpc://HOST:PORT, grpcs://HOST:PORT, http://HOST:PORT[/PATH] or https://… (path default /v1/logs)")
    export.add_argument("--follow", action="store_true", help="keep exporting new lines until SIGTERM/SIGINT")
    export.add_argument("--state", metavar="DIR", help="the exporter's checkpoint directory (default: LOG.export beside the log)")
    export.add_argument("--headers", metavar="FILE", help="`Name: value` lines sent with every export (the collector's auth); never logged")
    export.add_argument("--ca", metavar="FILE", help="the CA that signed the collector's certificate (grpcs/https)")
    export.add_argument("--cert", metavar="FILE", help="a client certificate for the collector (with --key)")
    export.add_argument("--key", metavar="FILE", help="the client certificate's private key")
    export.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="without --follow: give up (exit 1) if everything is not exported by then (default 60); "
                        "each send waits at most min(10, SECONDS)")
    export.add_argument("--front", choices=("edge", "lane"), default="edge", help="the front end whose log this is (resource attribute egresslaw.front)")
    export.add_argument("--instance", metavar="NAME", help="service.instance.id of the records (default: the host name)")
    export.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text lines or one JSON object per line (default text)")
    export.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the least severe level logged (default info)")
    # a front end's child (`--export-to`) logs as the front end does: EGRESSLAW_LOG_FORMAT / EGRESSLAW_LOG_LEVEL
    options_from_environment(export, "EGRESSLAW_", {"log_format": "EGRESSLAW_LOG_FORMAT", "log_level": "EGRESSLAW_LOG_LEVEL"})
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Export until caught up (or, following, until a signal); the exporter runs in a thread, signals stop it."""
    from egress_proxy.audit.export import ExportError, Exporter, check_options, parse_target, read_headers
    from egresslaw import logs

    if not args.timeout > 0:
        raise CliError(f"`--timeout` {args.timeout:g} is not a positive number of seconds", "give e.g. `--timeout 60`")
    try:
        check_options(args.to, headers=args.headers, ca=args.ca, cert=args.cert, key=args.key)  # as the front ends check it
        target = parse_target(args.to)
        headers = read_headers(args.headers) if args.headers else ()
        exporter = Exporter(args.log, target, state_dir=args.state, headers=headers, ca=args.ca, cert=args.cert, key=args.key,
                            front=args.front, instance=args.instance, timeout=min(10.0, args.timeout))
    except ExportError as exc:
        raise CliError(exc.message, exc.help) from None
    logs.configure(args.log_level, args.log_format)
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    # A front end starts this with SIGTERM and SIGINT blocked (egress_proxy/run/exporter.py), so a stop that came while
    # it was starting waited for the handlers: now it is delivered, and the exporter drains before it exits.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    deadline = None if args.follow else time.monotonic() + args.timeout
    result: list[int | BaseException] = []

    def work() -> None:
        try:
            result.append(exporter.run(stop, follow=args.follow, deadline=deadline))
        except BaseException as exc:  # handed to the main thread, which reports it
            result.append(exc)

    thread = threading.Thread(target=work, name="egresslaw-export")
    thread.start()
    while thread.is_alive():  # the main thread only waits: the signal handlers run here and set `stop`
        thread.join(0.5)
    outcome = result[0] if result else 1
    if isinstance(outcome, ExportError):
        raise CliError(outcome.message, outcome.help)
    if isinstance(outcome, BaseException):
        raise outcome
    return int(outcome)


def run_verify(args: argparse.Namespace) -> int:
    from egress_proxy.audit.log import AuditError
    from egress_proxy.audit.verify import verify_logs
    from egress_proxy.custody.keys import (
        KeyFileError,
        load_audit_key,
        load_audit_public_key,
    )

    try:
        key = load_audit_key(args.keys) if args.keys else load_audit_public_key(args.public_key) if args.public_key else None
        results = verify_logs(args.log, key=key, recursive=args.recursive)  # one log, or the chains of a proxy's workers (`--workers N`)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    except AuditError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot read audit log `{args.log}`: {exc.strerror or exc.__class__.__name__}") from None
    several = len(results) > 1
    for name, result in results:
        where = f"`{name}`" if several else f"`{args.log}`"
        if result.status == "intact":
            out(f"ok: {where}: {result.message}")
        elif result.status == "open":
            err(f"open: `{result.file}`: line {result.line}: {result.message}")
        else:
            err(f"error: `{result.file}`: " + (f"line {result.line}: " if result.line is not None else "") + result.message)
        show = out if result.ok else err
        for item in result.checked:
            show(f"  checked: {item}")
        for item in result.unchecked:
            show(f"  not checked: {item}")
        for item in result.notes:
            show(f"  note: {item}")
    worst = max((r.status for _, r in results), key=("intact", "open", "broken").index)
    if several:
        counts = {s: sum(1 for _, r in results if r.status == s) for s in ("intact", "open", "broken")}
        (out if worst == "intact" else err)(f"{len(results)} logs, each its own chain: {counts['intact']} intact, {counts['open']} open, {counts['broken']} broken")
    return EXIT[worst]
