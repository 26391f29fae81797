"""`egresslaw proxy --artifact A --proof P --keys KEYS …`: run the egress edge (exit 2 on any start-up failure)."""

from __future__ import annotations

import argparse

from egresslaw.common import CliError, err

DEFAULT_STORE = "custody.db"
DEFAULT_CONFDIR = "~/.egresslaw"
DEFAULT_AUDIT = "egresslaw-audit.jsonl"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="run the egress proxy",
        description="run the egress edge: refuses to start (exit 2, nothing listening) unless the artifact is all-proved "
        "and the keys and custody store are usable",
    )
    parser.add_argument("--artifact", required=True, metavar="A", help="the compiled artifact (build/egresslaw.json)")
    parser.add_argument("--proof", required=True, metavar="P", help="the proof report for that artifact (build/proof.json)")
    parser.add_argument("--keys", required=True, metavar="KEYS", help="the keys directory (lease.key, custody.key)")
    parser.add_argument("--store", default=DEFAULT_STORE, metavar="FILE", help=f"the custody store (default {DEFAULT_STORE})")
    parser.add_argument("--listen", default="127.0.0.1:8080", metavar="HOST:PORT", help="proxy listen address (default 127.0.0.1:8080)")
    parser.add_argument("--admin", default="127.0.0.1:9090", metavar="HOST:PORT", help="admin (/metrics) listen address (default 127.0.0.1:9090)")
    parser.add_argument("--confdir", default=DEFAULT_CONFDIR, metavar="DIR", help=f"CA and admin token directory (default {DEFAULT_CONFDIR})")
    parser.add_argument("--audit-log", default=DEFAULT_AUDIT, metavar="F", help=f"append-only JSONL audit log (default {DEFAULT_AUDIT})")
    parser.add_argument("--allow-unproven", action="store_true", help="serve an artifact that is not all-proved (warns on every request)")
    parser.add_argument("--trust-proofs", metavar="PUBKEY", help="accept only proof reports signed by this Ed25519 public key (`keys init --proof-signing`)")
    routing = parser.add_argument_group("test routing (tests and staging only; warned at start-up and recorded in every audit event)")
    routing.add_argument("--resolve", action="append", default=[], metavar="HOST=IP[,IP...]", help="answers the proxy's resolver returns for HOST (still judged)")
    routing.add_argument("--connect-to", action="append", default=[], metavar="HOST:PORT:ADDR:APORT", help="after every check, dial ADDR:APORT instead (TLS still verifies HOST)")
    routing.add_argument("--upstream-ca", metavar="FILE", help="also trust this CA for upstream certificates")
    parser.set_defaults(run=run)


def hostport(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise CliError(f"{what} `{text}` is not HOST:PORT")
    return host.strip("[]"), int(port)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from egress_proxy.addon import StartupError
    from egress_proxy.server import Edge, EdgeConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mitmproxy").setLevel(logging.WARNING)
    config = EdgeConfig(
        artifact=args.artifact,
        proof=args.proof,
        keys=args.keys,
        store=args.store,
        audit_log=args.audit_log,
        listen=hostport(args.listen, "--listen"),
        admin=hostport(args.admin, "--admin"),
        confdir=args.confdir,
        allow_unproven=args.allow_unproven,
        trust_proofs=args.trust_proofs,
        resolve=tuple(args.resolve),
        connect_to=tuple(args.connect_to),
        upstream_ca=args.upstream_ca,
    )
    if args.allow_unproven:
        err("warning: --allow-unproven: serving an artifact that may not be proved; every request will warn")
    for name, value in (("--resolve", args.resolve), ("--connect-to", args.connect_to), ("--upstream-ca", [args.upstream_ca] if args.upstream_ca else [])):
        for entry in value:
            err(f"warning: test routing {name} `{entry}` is active; never use it in production (recorded in every audit event)")

    async def main() -> int:
        edge = Edge(config)
        try:
            await edge.start()
        except StartupError as exc:
            raise CliError(exc.message, exc.help) from None
        edge.install_sighup()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, edge.master.shutdown)
        listen = ", ".join(f"{h}:{p}" for h, p in edge.listen_addrs)
        admin = f"{edge.admin_addr[0]}:{edge.admin_addr[1]}" if edge.admin_addr else "off"
        err(f"egresslaw proxy listening on {listen} (admin {admin}); audit log `{config.audit_log}`")
        try:
            await edge.wait()
        finally:
            await edge.stop()
        err("egresslaw proxy stopped; audit log flushed")
        return 0

    return asyncio.run(main())
