"""`egresslaw proxy --artifact A --proof P --keys KEYS …`: run the egress edge (exit 2 on any start-up failure)."""

from __future__ import annotations

import argparse

from egress_proxy.front.settings import BOUNDS as BOUND_ROWS
from egress_proxy.front.settings import DEFAULTS, ENV_PREFIX, add_options
from egresslaw.common import PARSERS, CliError, export_fields, hostport, options_from_environment, parse_digest, parse_positive_int
from egresslaw.logs import FORMATS as LOG_FORMATS
from egresslaw.logs import LEVELS as LOG_LEVELS

D = DEFAULTS  # egress_proxy/front/settings.py: the one place a default is spelled
LIMIT_FLAGS = ("max_head_bytes", "max_headers", "max_request_line", "max_body", "max_connections_per_client", "max_connections",
               "header_timeout", "idle_timeout")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="run the egress proxy",
        description="run the egress edge: refuses to start (exit 2, nothing listening) unless the artifact is all-proved "
        "and the keys and custody store are usable; every option can also be set as EGRESSLAW_<OPTION> "
        "(e.g. EGRESSLAW_AUDIT_LOG; repeatable options: values separated by spaces), and a flag wins over it",
        epilog="exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 2 any start-up failure (nothing left listening)",
    )
    add_options(parser, "proxy", parsers=PARSERS)
    parser.add_argument("--store", default=D.store, metavar="FILE|URL",
                        help=f"the custody store: a SQLite file (default {D.store}) or a postgresql:// URL shared by a fleet")
    parser.add_argument("--workers", type=parse_positive_int, default=None, metavar="N",
                        help="worker processes sharing the listen address (SO_REUSEPORT), supervised, one audit chain each "
                        "(default: the cores this process may use, lowered to its cgroup CPU quota rounded up: a container limited to 2 CPUs runs 2; "
                        "1: one process, no supervisor)")
    parser.add_argument("--allow-missing-credentials", action="store_true",
                        help="start although a connection's credential is not in custody (each is warned at start; its requests "
                        "are denied credential-unavailable); without it the proxy refuses to start and names the address")
    limits = parser.add_argument_group("limits (decided before the lease; docs/proxy.md \"Limits\"); SIZE is bytes or 64k, 64m, 1g")
    limits.add_argument("--max-head-bytes", type=_size, default=None, metavar="SIZE", help=f"largest request head, request line and headers (default {D.max_head_bytes >> 10}k; 431)")
    limits.add_argument("--max-headers", type=int, default=None, metavar="N", help=f"most header fields in a request (default {D.max_headers}; 431)")
    limits.add_argument("--max-request-line", type=_size, default=None, metavar="SIZE", help=f"longest request line, HTTP/2 method and :path (default {D.max_request_line >> 10}k; 414)")
    limits.add_argument("--max-body", type=_size, default=None, metavar="SIZE", help=f"largest request body (default {D.max_body >> 20}m; 413); bodies stream, never buffered whole")
    limits.add_argument("--max-body-for", action="append", default=[], metavar="NAME[/RULE]=SIZE", help="the body limit of one connection or profile, or one rule of it (repeatable)")
    limits.add_argument("--max-connections-per-client", type=int, default=None, metavar="N", help=f"most open connections from one client address (default {D.max_connections_per_client}; 429)")
    limits.add_argument("--max-connections", type=int, default=None, metavar="N", help="most open client connections (default 0: half the descriptors the process may open; 503)")
    limits.add_argument("--header-timeout", type=float, default=None, metavar="S", help=f"seconds for a request head, from its first byte or from accept (default {D.header_timeout:g}; 408)")
    limits.add_argument("--idle-timeout", type=int, default=None, metavar="S", help=f"seconds without a byte either way before a connection is closed (default {D.idle_timeout})")
    bounds = parser.add_argument_group("bounds on what peers make the proxy hold (docs/proxy.md \"Bounds\")")
    for name, kind, text in BOUND_ROWS:
        default = getattr(D, name)
        shown = f"{default >> 10}k" if kind == "size" and default < 1 << 20 else f"{default >> 20}m" if kind == "size" else f"{default:g}"
        bounds.add_argument("--" + name.replace("_", "-"), type={"size": _size, "count": int, "seconds": float}[kind], default=None,
                            metavar={"size": "SIZE", "count": "N", "seconds": "S"}[kind], help=f"{text} (default {shown})")
    parser.add_argument("--max-response", default=D.max_response, metavar="SIZE", help=f"cap on a credentialed response body as received (default {D.max_response})")
    parser.add_argument("--rule-max-response", action="append", default=[], metavar="CONNECTION/RULE=SIZE", help="the response cap of one rule")
    parser.add_argument("--max-decoded", default=D.max_decoded, metavar="SIZE", help=f"cap on a credentialed response body once decoded (default {D.max_decoded})")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text lines or one JSON object per line, UTC timestamps (default text)")
    logs.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the least severe level logged (default info)")
    parser.set_defaults(run=run)
    # Every option above, and any added later, can also come from EGRESSLAW_<OPTION> (flags win).
    options_from_environment(parser, ENV_PREFIX)


def _size(text: str) -> int:
    from egress_proxy.edge.limits import LimitError, parse_size

    try:
        return parse_size(text)
    except LimitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from egress_proxy.front.startup import StartupError
    from egress_proxy.run.server import Edge, EdgeConfig
    from egresslaw import logs

    logs.configure(args.log_level, args.log_format)
    log = logging.getLogger("egresslaw.proxy")
    try:
        config = EdgeConfig(
            artifact=args.artifact,
            proof=args.proof,
            keys=args.keys,
            store=args.store,
            budget_store=args.budget_store,
            audit_log=args.audit_log,
            listen=hostport(args.listen, "--listen"),
            admin=hostport(args.admin, "--admin"),
            confdir=args.confdir,
            allow_unproven=args.allow_unproven,
            allow_missing_credentials=args.allow_missing_credentials,
            trust_proofs=args.trust_proofs,
            allow_unsigned_proofs=args.allow_unsigned_proofs,
            require_within=parse_digest(args.require_within) if args.require_within else None,
            resolve=tuple(args.resolve),
            connect_to=tuple(args.connect_to),
            upstream_ca=args.upstream_ca,
            nameservers=tuple(args.nameserver),
            dns_timeout=args.dns_timeout,
            dns_concurrency=args.dns_concurrency,
            max_body_for=tuple(args.max_body_for),
            audit_max_bytes=args.audit_max_bytes,
            audit_max_age=args.audit_max_age,
            audit_sync=args.audit_sync,
            drain_grace=max(0.0, args.drain_grace),
            **export_fields(args),
            extra_options={"egresslaw_max_response": args.max_response, "egresslaw_rule_max_response": list(args.rule_max_response),
                           "egresslaw_max_decoded": args.max_decoded},
            **{name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name) is not None},  # unset: EdgeConfig's defaults
            bounds={name: getattr(args, name) for name, _, _ in BOUND_ROWS if getattr(args, name) is not None},
        )
    except CliError as exc:
        if args.log_format != "json":
            raise
        log.error("start-up failed: %s", exc.message, extra={"help": exc.help} if exc.help else None)
        return exc.code
    if args.allow_unproven:
        log.warning("--allow-unproven: serving an artifact that may not be proved; every request will warn")
    for name, value in (("--resolve", args.resolve), ("--connect-to", args.connect_to), ("--upstream-ca", [args.upstream_ca] if args.upstream_ca else [])):
        for entry in value:
            log.warning("test routing %s `%s` is active; never use it in production (recorded in every audit event)", name, entry)

    from egress_proxy.edge.limits import raise_descriptor_limit, return_large_buffers

    raise_descriptor_limit()  # as Go and nginx do: the soft limit up to the hard one; --max-connections derives from it
    return_large_buffers()  # what a peer made us hold goes back to the system when it is let go (docs/proxy.md "Bounds")

    from egress_proxy.run.supervisor import default_workers

    workers = args.workers or default_workers()
    if workers > 1:
        return asyncio.run(_run_workers(config, workers, args, log))

    async def main() -> int:
        import signal

        edge = Edge(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # from the first moment: a stop during start-up drains once started
            loop.add_signal_handler(sig, edge.shutdown)
        loop.add_signal_handler(signal.SIGHUP, lambda: log.warning("SIGHUP during start-up ignored: the artifact is being loaded as it is now"))
        try:
            await edge.start()
        except StartupError as exc:
            if args.log_format == "json":  # keep stderr one JSON object per line
                log.error("start-up failed: %s", exc.message, extra={"help": exc.help} if exc.help else None)
                return 2
            raise CliError(exc.message, exc.help) from None
        edge.install_sighup()
        listen = ", ".join(f"{h}:{p}" for h, p in edge.listen_addrs)
        admin = f"{edge.admin_addr[0]}:{edge.admin_addr[1]}" if edge.admin_addr else "off"
        log.info("egresslaw proxy listening on %s (admin %s); audit log `%s`", listen, admin, config.audit_log)
        try:
            await edge.wait()
        finally:
            await edge.stop()
        audit = edge.addon.audit
        if audit is None or not audit.close_ok:
            log.error(f"egresslaw proxy stopped, but the audit log was not closed cleanly: {(audit.error or 'its writer did not finish in time') if audit else 'not open'}")
            return 1
        log.info("egresslaw proxy stopped; audit log flushed and closed by a signed checkpoint")
        return 0

    return asyncio.run(main())


async def _run_workers(config, workers: int, args: argparse.Namespace, log) -> int:
    """`--workers N` (N > 1): the supervisor, its N worker processes (`python -m egresslaw.proxy_worker`) and the admin port."""
    import asyncio
    import signal
    import sys

    from egress_proxy.audit.verify import worker_audit_path
    from egress_proxy.front.startup import StartupError
    from egress_proxy.run.supervisor import Supervisor

    loop = asyncio.get_running_loop()
    try:
        supervisor = Supervisor(config, workers, worker_command=[sys.executable, "-m", "egresslaw.proxy_worker"],
                                log_options={"level": args.log_level, "format": args.log_format})
        # From the first moment, not after the start: a SIGTERM while the workers start is kept and drains them
        # once they are up (before, it killed the supervisor and left its workers running).
        loop.add_signal_handler(signal.SIGHUP, supervisor.reload)
        loop.add_signal_handler(signal.SIGUSR1, supervisor.flush)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, supervisor.shutdown)  # every worker drains; a second signal stops them at once
        await supervisor.start()
    except StartupError as exc:
        if args.log_format == "json":
            log.error("start-up failed: %s", exc.message, extra={"help": exc.help} if exc.help else None)
            return 2
        raise CliError(exc.message, exc.help) from None
    listen = ", ".join(f"{h}:{p}" for h, p in supervisor.listen_addrs)
    admin = f"{supervisor.admin_addr[0]}:{supervisor.admin_addr[1]}" if supervisor.admin_addr else "off"
    logs = f"`{worker_audit_path(config.audit_log, 1)}` … `{worker_audit_path(config.audit_log, workers).name}`"
    log.info("egresslaw proxy listening on %s (admin %s), %d workers; audit logs %s", listen, admin, workers, logs)
    code = await supervisor.wait()
    if code == 0:
        log.info("egresslaw proxy stopped; every worker's audit log flushed and closed by a signed checkpoint")
    return code
