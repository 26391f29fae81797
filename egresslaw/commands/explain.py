"""`egresslaw explain ARTIFACT --connection C 'GET https://host/path'`: run the decision function on one request.

Exit 0 allow, 1 deny, 2 usage. Never resolves a name: addresses are judged only when given with
`--resolve` (repeatable); without it the address check is skipped and the output says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from egresslaw.common import CliError, out

_PORT = re.compile(r"^[0-9]{1,5}$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*$")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="show the decision, rule and reason for one request",
        description="run the proxy's decision function on one request: exit 0 allow, 1 deny, 2 usage",
        epilog="examples:\n"
        "  egresslaw explain build/egresslaw.json --connection github 'GET https://api.github.com/repos/acme/app' "
        "-H 'Accept: application/json' --resolve 140.82.112.6\n"
        "  egresslaw explain build/egresslaw.json --profile package-builder 'pypi.org:443'\n"
        "  egresslaw explain build/egresslaw.json --profile trusted-ci 'GET https://github.com/acme/private.git/info/refs'\n\n"
        "exit codes: 0 allow, 1 deny, 2 usage or I/O",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("artifact", metavar="ARTIFACT", help="a compiled artifact (build/egresslaw.json)")
    subject = parser.add_mutually_exclusive_group(required=True)
    subject.add_argument("--connection", metavar="C", help="judge as traffic of this connection (credentialed)")
    subject.add_argument("--profile", metavar="P", help="judge as traffic of this sandbox profile")
    parser.add_argument(
        "request",
        metavar="REQUEST",
        help="'METHOD URL' (e.g. 'GET https://api.github.com/repos/acme/app') or 'HOST:PORT' for the destination check alone",
    )
    parser.add_argument("-H", "--header", action="append", default=[], metavar="'NAME: VALUE'", help="a request header (repeatable)")
    parser.add_argument(
        "--resolve", action="append", default=[], metavar="IP", help="an answer the name resolved to (repeatable); judged like the proxy does"
    )
    parser.add_argument("--body", action="store_true", help="the request carries a body")
    parser.add_argument("--data", metavar="FILE", help="the request's body, read from FILE (`-`: stdin); a rule with a body "
                        "shape (mcp, graphql, git) judges it as the edge does (implies --body)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the CLI loads every command module to build its parser; each command pays for what it runs.
    from egress_proxy.decision.adapter import (
        decide,
        decide_connect,
        decide_without_addresses,
        judge_answers,
        judge_body,
    )
    from egress_proxy.decision.reasons import describe
    from egress_proxy.decision.types import Decision, Lease, Request
    from egresslaw.commands.prove import load

    artifact = load(args.artifact)  # a directory or a policy source is named as such, with the compile step
    if args.connection is not None:
        conn = artifact.connection(args.connection)
        if conn is None:
            raise CliError(f"connection `{args.connection}` is not in the artifact", _known("connections", [c.name for c in artifact.connections]))
        lease = Lease(subject="explain", profile=None, connection=args.connection, exp=0)
    else:
        if artifact.profile(args.profile) is None:
            raise CliError(f"profile `{args.profile}` is not in the artifact", _known("profiles", [p.name for p in artifact.sandbox_profiles]))
        lease = Lease(subject="explain", profile=args.profile, connection=None, exp=0)
    headers = tuple(_header(h) for h in args.header)
    body = _data(args.data) if args.data is not None else None
    args.body = args.body or body is not None
    text = args.request.strip()
    checked = bool(args.resolve)
    if " " not in text and "://" in text:
        raise CliError(f"`{text}` has no method", f"write the method first, e.g. 'GET {text}'")
    if " " not in text:
        # HOST:PORT: the proxy's CONNECT decision on that authority as sent, with -H and --body as the CONNECT's own
        # (and the answers, if given)
        _host_port(text, None)  # a usage error when there is no port at all; the decision judges its spelling
        decision = decide_connect(artifact, lease, text, headers, args.body)
        if decision.allowed and checked:
            addresses = judge_answers(artifact, lease, args.resolve)
            if not addresses.allowed:
                decision = Decision(reason=addresses.reason, detail=addresses.detail, host=decision.host)
    else:
        method, _, url = text.partition(" ")
        scheme, authority, target = _split_url(url.strip())
        host, port = _host_port(authority, {"http": 80, "https": 443}.get(scheme))
        given_host = any(n.lower() == "host" for n, _ in headers)
        request = Request(
            method=method,
            scheme=scheme,  # type: ignore[arg-type]
            host=host,
            port=port,
            target=target,
            headers=headers,
            host_header=None if given_host else authority,  # what a client sends unless -H Host overrides it
            has_body=args.body,
        )
        decision = decide(artifact, lease, request, args.resolve) if checked else decide_without_addresses(artifact, lease, request)
        if decision.allowed and decision.body_shape is not None:
            if body is None:
                kind = decision.body_shape
                raise CliError(f"rule `{decision.rule}` judges the {kind} body of this request",
                               "give the body with --data FILE (or --data - for stdin) to see its judgement")
            decision = judge_body(artifact, lease, request, decision, body)
    kind, name = ("connection", args.connection) if args.connection is not None else ("profile", args.profile)
    capacity = _capacity(artifact, kind, name)
    if args.format == "json":
        out(json.dumps({**_as_json(decision, checked, args.resolve), "capacity": capacity[1]}, sort_keys=True, indent=2))
    else:
        _render(decision, checked, args.resolve, describe)
        out(f"capacity: {capacity[0]}")
    return 0 if decision.allowed else 1


def _capacity(artifact, kind: str, name: str) -> tuple[str, dict]:
    """The subject's capacity (docs/budget.md; the count needs no solver): its line and JSON form."""
    from proofs.capacity import capacity

    cap = capacity(artifact, kind, name)  # the subject was looked up above: it is in the artifact
    return cap.text(), cap.to_dict()


def _data(name: str) -> bytes:
    """The body `--data` names: a file, or stdin for `-`."""
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read the body `{name}`: {exc.strerror or exc}", "give a readable file, or `-` for stdin") from None


def _render(decision, checked: bool, ips: list[str], describe) -> None:
    out(f"decision: {'allow' if decision.allowed else 'deny'}")
    out(f"reason: {decision.reason}" if decision.allowed else f"reason: {decision.reason} ({describe(decision.reason)})")
    if decision.detail:
        out(f"detail: {decision.detail}")
    out(f"rule: {decision.rule or '-'}")
    if decision.broker is not None:
        out(f"brokered by: connection `{decision.broker}` (its credential, header allowlist and worker; the sandbox holds none)")
    if decision.host is not None:
        out(f"host: {decision.host}")
    if decision.path is not None:
        out(f"path: {decision.path}")
    if decision.allowed:
        out(f"forward headers: {', '.join(n for n, _ in decision.forward_headers) or '-'}")
        out(f"inject header: {decision.inject_header or '- (no credential)'}")
    if checked:
        out(f"addresses: judged {', '.join(f'`{ip}`' for ip in ips)}")
    else:
        out("addresses: not checked (no --resolve given; the proxy judges every answer it resolves)")


def _as_json(decision, checked: bool, ips: list[str]) -> dict:
    return {
        "decision": "allow" if decision.allowed else "deny",
        "reason": decision.reason,
        "detail": decision.detail,
        "rule": decision.rule,
        "broker": decision.broker,  # a profile's request brokered as this connection's traffic
        "host": decision.host,
        "path": decision.path,
        "forward_headers": [name for name, _ in decision.forward_headers],  # names only, never values
        "inject_header": decision.inject_header,
        "addresses_checked": checked,
        "addresses": list(ips),
    }


def _known(what: str, names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in sorted(names)[:10]) or "none"
    return f"{what} in this artifact: {shown}"


def _header(raw: str) -> tuple[str, str]:
    name, sep, value = raw.partition(":")
    if not sep or not name or name != name.strip():
        shown = raw.split(None, 1)[0][:40] + " …" if raw.strip() else raw  # the first word: the rest may be a credential
        raise CliError(f"header `{shown}` is not `Name: value`", "write e.g. -H 'Accept: application/json'")
    return name, value.strip()


def _split_url(url: str) -> tuple[str, str, str]:
    """scheme, authority and request target (path and query) of an absolute URL, without normalizing anything."""
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.match(scheme):
        raise CliError(f"`{url}` is not an absolute URL", "write e.g. 'GET https://api.github.com/repos/acme/app'")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, target = rest[:cut], rest[cut:]
    if not target.startswith("/"):
        target = "/" + target  # `https://host?q` has the target `/?q`
    return scheme.lower(), authority, target


def _host_port(authority: str, default: int | None) -> tuple[str, int]:
    """Split `host[:port]` (`[v6]:port` too). The host is passed on as written: the decision normalizes it."""
    if authority.startswith("[") and "]" in authority:
        end = authority.index("]")
        host, rest = authority[: end + 1], authority[end + 1 :]
    elif authority.count(":") == 1:
        host, _, port_text = authority.partition(":")
        rest = ":" + port_text
    else:
        host, rest = authority, ""
    if rest:
        if not rest.startswith(":") or not _PORT.match(rest[1:]):
            raise CliError(f"`{authority}` has an invalid port", "write the port as digits, e.g. `api.github.com:443`")
        return host, int(rest[1:])
    if default is None:
        raise CliError(f"`{authority}` has no port", "write `HOST:PORT`, e.g. `deb.debian.org:80`")
    return host, default
