"""`egresslaw show ARTIFACT`: the compiled artifact for people: every host and what granted it, every rule, and each
subject's budget (caps per window) and capacity (docs/budget.md)."""

from __future__ import annotations

import json

from egresslaw.common import out


def register(sub) -> None:
    p = sub.add_parser("show", help="print a compiled artifact in readable form")
    p.add_argument("artifact", metavar="ARTIFACT", help="build/egresslaw.json")
    p.set_defaults(run=run)


def run(args) -> int:
    from egresslaw.commands.prove import load

    a = load(args.artifact)  # a directory or a policy source is named as such, with the compile step
    capacity = capacity_lines(a)
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
        out(f"    budget: {budget_text(p.budget)}")
        out(f"    capacity: {capacity('profile', p.name)}")
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
        out(f"    budget: {budget_text(c.budget)}")
        out(f"    capacity: {capacity('connection', c.name)}")
        for r in c.rules:
            headers = ", ".join(r.headers) if r.headers else "(none)"
            path = template_text(r.template) if r.template is not None else r.path_prefix
            out(f"    {r.name:<16} {'|'.join(r.methods):<12} https://{r.host}:{r.port}{path}   headers: {headers}")
            for line in shape_lines(r):
                out(f"      {line}")
    return 0


def budget_text(budget) -> str:
    """`10,000 requests and 64 MiB per 1h window`, or `none (no caps)`."""
    from compiler.budget import describe_size, describe_window

    if budget is None:
        return "none (no caps)"
    caps = ([f"{budget.requests:,} requests"] if budget.requests is not None else []) + (
        [describe_size(budget.bytes)] if budget.bytes is not None else [])
    return f"{' and '.join(caps)} per {describe_window(budget.window)} window"


def capacity_lines(artifact):
    """(kind, name) -> the subject's capacity line (`proofs.capacity.Capacity.text`; the count needs no solver)."""
    from proofs.capacity import capacities

    texts = {(c.kind, c.name): c.text() for c in capacities(artifact)}
    return lambda kind, name: texts[(kind, name)]


def value_text(v) -> str:
    """A `Value` as one short phrase (docs/shapes.md, "Values")."""
    parts = [] if v.type == "string" else [v.type]
    if v.enum is not None:
        parts.append("|".join(json.dumps(e) for e in v.enum))
    if v.pattern is not None:
        parts.append(f"/{v.pattern}/")
    if v.minimum is not None or v.maximum is not None:
        parts.append(f"{'' if v.minimum is None else v.minimum}..{'' if v.maximum is None else v.maximum}")
    if v.max_length is not None:
        parts.append(f"<= {v.max_length} long")
    return " ".join(parts) or "any text"


def template_text(segments) -> str:
    out_ = []
    for s in segments:
        out_.append(s.literal if s.value is None else "{" + f"{s.name}" + ("" if value_text(s.value) == "any text" else f": {value_text(s.value)}") + "}")
    return "/" + "/".join(out_)


def shape_lines(r) -> list[str]:
    """What a rule's request shapes admit, one line each (nothing for a rule without shapes)."""
    lines = []
    if r.query is not None:
        lines.append("query: " + (", ".join(f"{p.name}={value_text(p.value)}" for p in r.query) or "none"))
    for p in r.header_values:
        lines.append(f"header {p.name}: {value_text(p.value)}")
    if r.mcp is not None:
        lines.append(f"mcp methods: {', '.join(r.mcp.methods)}" + ("; client responses admitted" if r.mcp.responses else ""))
        for t in r.mcp.tools:
            args = ", ".join(f"{a.name}={value_text(a.value)}" for a in t.arguments) or "none"
            extra = [f"required {', '.join(t.required)}"] if t.required else []
            extra += [f"forbidden {', '.join(t.forbidden)}"] if t.forbidden else []
            extra += ["other keys admitted"] if t.additional else []
            lines.append(f"mcp tool {t.name}({args})" + (f"  [{'; '.join(extra)}]" if extra else ""))
    if r.graphql is not None:
        g = r.graphql
        for kind in ("query", "mutation", "subscription"):
            if getattr(g, kind):
                lines.append(f"graphql {kind}: {', '.join(getattr(g, kind))}")
        if g.persisted:
            lines.append(f"graphql persisted: {len(g.persisted)} hash(es)")
        lines.append(f"graphql introspection: {'admitted' if g.introspection else 'refused'}")
    if r.git is not None:
        g = r.git
        lines.append(f"git fetch: {'yes' if g.fetch else 'no'}; push: {', '.join(g.push) or 'no'}"
                     + (f"; create {'yes' if g.create else 'no'}; delete {'yes' if g.delete else 'no'}" if g.push else ""))
    if r.max_body is not None:
        lines.append(f"bodies judged up to {r.max_body} bytes")
    return lines
