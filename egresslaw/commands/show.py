"""`egresslaw show ARTIFACT`: the compiled artifact for people: every host and what granted it, every rule."""

from __future__ import annotations

from egresslaw.common import out


def register(sub) -> None:
    p = sub.add_parser("show", help="print a compiled artifact in readable form")
    p.add_argument("artifact", metavar="ARTIFACT", help="build/egresslaw.json")
    p.set_defaults(run=run)


def run(args) -> int:
    from egresslaw.commands.prove import load

    a = load(args.artifact)  # a directory or a policy source is named as such, with the compile step
    out(f"workspace {a.workspace}   catalog {a.catalog.version} (special-purpose table {a.catalog.special_purpose_date})")
    out(f"digest    {a.digest}")
    out("")
    out("workers")
    for w in a.workers:
        settings = [
            f"follow_redirects={str(w.follow_redirects).lower()}",
            f"max_redirects={w.max_redirects}",
            f"ipv6={str(w.ipv6).lower()}",
            f"ip_literals={str(w.ip_literals).lower()}",
        ]
        if w.deny_cidrs:
            settings.append("deny=" + ",".join(w.deny_cidrs))
        if w.allow_cidrs:
            settings.append("allow=" + ",".join(w.allow_cidrs))
        out(f"  {w.name:<16} {' '.join(settings)}")
    out("")
    out("sandbox profiles")
    for p in a.sandbox_profiles:
        out(f"  {p.name} v{p.version}  trust={p.trust}  provider={p.provider} ({p.provider_certification})  network={p.network.mode}")
        out(f"    network_policy_hash {p.network_policy_hash}")
        if p.network.mode == "none":
            out("    (no egress)")
        for h in p.network.allowed_hosts:
            out(f"    {h.host + ':' + str(h.port):<40} granted by {h.granted_by}")
        if p.network.allow_mcp_servers:
            out("    allow_mcp_servers: MCP calls cross the platform gateway (no workload host)")
        if p.brokers:
            out(f"    brokers {', '.join(p.brokers)}: a request matching one of their rules carries that connection's credential")
    out("")
    out("connections")
    for c in a.connections:
        kind = ""
        if c.mint is not None:
            m = c.mint
            kind = f"  kind={m.kind} ({m.region}/{m.service})" if m.kind == "aws_sigv4" else f"  kind={m.kind} (token {m.token_url})"
        inject = "" if c.kind == "aws_sigv4" else f"  inject={c.inject.header}: {c.inject.format}" + (
            f" (basic_user {c.inject.basic_user})" if c.inject.basic_user else "")
        out(f"  {c.name} v{c.version}  credential={c.credential_handle}{kind}{inject}  worker={c.worker}")
        for r in c.rules:
            headers = ", ".join(r.headers) if r.headers else "(none)"
            out(f"    {r.name:<16} {'|'.join(r.methods):<12} https://{r.host}:{r.port}{r.path_prefix}   headers: {headers}")
    return 0
