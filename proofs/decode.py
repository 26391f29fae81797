"""Decode a Z3 model into domain objects (a Request, resolved addresses) and back (the abstraction).

`concretize` is what turns a satisfying assignment into a request line a person can read and
`decide()` can replay; `abstract` maps a concrete request onto the same variables, which is how the
differential test evaluates the Z3 terms on generated requests.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import z3

from compiler.constants import METHODS
from compiler.normalize import HostError, PathError, check_target, normalize_host, normalize_path
from egress_proxy.types import Request
from proofs.addr import decode_addr
from proofs.encode import OTHER_METHOD, OTHER_NAME, SCHEMES, SymRequest

BAD_HOST = "127.1"  # a non-canonical numeric form: every HostError is one class in the encoding
BAD_PATH_SUFFIX = "/../x"  # a dot segment: refused by normalize_path (connections), passed by check_target
BAD_TARGET_SUFFIX = "/%00"  # NUL: refused by both (profiles too)
BAD_AUTHORITY = "mismatch.example.net"


@dataclass(frozen=True)
class Counterexample:
    """A violation in domain terms. Every field is plain data; `summary` is the one-line story."""

    summary: str
    request: Request | None = None
    resolved_ips: tuple[str, ...] = ()
    ip_range: dict[str, str] | None = None  # the special-purpose entry the address (or its embedding) falls in
    header: str | None = None
    redirect_chain: tuple[dict[str, Any], ...] = ()
    rule: str | None = None
    setting: str | None = None
    decision: dict[str, Any] | None = None  # what decide() answered on replay
    old_decision: dict[str, Any] | None = None  # no-widening: what the previous artifact answered
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "request": request_dict(self.request) if self.request is not None else None,
            "resolved_ips": list(self.resolved_ips),
            "ip_range": self.ip_range,
            "header": self.header,
            "redirect_chain": list(self.redirect_chain),
            "rule": self.rule,
            "setting": self.setting,
            "decision": self.decision,
            "old_decision": self.old_decision,
            **({"extra": self.extra} if self.extra else {}),
        }


def request_line(req: Request) -> str:
    default = {"https": 443, "http": 80}.get(req.scheme)
    host = f"[{req.host}]" if ":" in req.host else req.host
    port = "" if req.port == default else f":{req.port}"
    return f"{req.method} {req.scheme}://{host}{port}{req.target}"


def request_dict(req: Request) -> dict[str, Any]:
    return {
        "line": request_line(req),
        "method": req.method,
        "scheme": req.scheme,
        "host": req.host,
        "port": req.port,
        "target": req.target,
        "headers": [[n, v] for n, v in req.headers],
        "host_header": req.host_header,
        "has_body": req.has_body,
    }


def request_from_dict(d: dict[str, Any]) -> Request:
    return Request(
        method=d["method"],
        scheme=d["scheme"],
        host=d["host"],
        port=d["port"],
        target=d["target"],
        headers=tuple((n, v) for n, v in d.get("headers", ())),
        host_header=d.get("host_header"),
        has_body=bool(d.get("has_body", False)),
    )


def decision_dict(decision) -> dict[str, Any]:
    return {
        "allowed": decision.allowed,
        "reason": decision.reason,
        "rule": decision.rule,
        "forward_headers": [n for n, _ in decision.forward_headers],
        "inject_header": decision.inject_header,
    }


def _int(model: z3.ModelRef, term) -> int:
    return model.eval(term, model_completion=True).as_long()


def _bool(model: z3.ModelRef, term) -> bool:
    return z3.is_true(model.eval(term, model_completion=True))


def other_name(sym: SymRequest) -> str:
    name = OTHER_NAME
    while name in sym.uni.hosts:
        name = "x" + name
    return name


def concretize(model: z3.ModelRef, sym: SymRequest) -> tuple[Request, tuple[str, ...]]:
    """The concrete request and resolved addresses a model describes."""
    uni = sym.uni
    scheme_id = _int(model, sym.scheme)
    scheme = SCHEMES[scheme_id] if scheme_id < 2 else "ftp"  # "other": any scheme but http(s)
    port = _int(model, sym.port)
    hid = _int(model, sym.host)
    if _bool(model, sym.host_err):
        host = BAD_HOST
    elif hid == uni.other_name:
        host = other_name(sym)
    elif hid == uni.other_ip:
        host = str(decode_addr(model, sym.lit))
    else:
        host = uni.hosts[hid]
    mid = _int(model, sym.method)
    method = METHODS[mid] if mid < len(METHODS) else OTHER_METHOD
    path = uni.paths.witnesses[_int(model, sym.path)]
    if _bool(model, sym.target_err):
        path = path.rstrip("/") + BAD_TARGET_SUFFIX
    elif _bool(model, sym.path_err):
        path = path.rstrip("/") + BAD_PATH_SUFFIX
    default_port = {"https": 443, "http": 80}.get(scheme)
    authority = (f"[{host}]" if ":" in host else host) + ("" if port == default_port else f":{port}")
    headers: list[tuple[str, str]] = []
    hh_n = _int(model, sym.hh_n)
    bad = _bool(model, sym.auth_bad)
    for i in range(hh_n):
        headers.append(("Host", BAD_AUTHORITY if bad and i == 0 else authority))
    host_header = None
    if _bool(model, sym.auth_given):
        host_header = BAD_AUTHORITY if bad and hh_n == 0 else authority
    hop = [h for h in uni.headers if _bool(model, sym.hop[h])]
    for h in uni.headers:
        if not _bool(model, sym.present[h]):
            continue
        if h == "connection":
            headers.append(("Connection", ", ".join(hop) if hop else "close"))
        elif h == "content-length":
            headers.append(("Content-Length", "0"))
            if _bool(model, sym.cl_multi):
                headers.append(("Content-Length", "0"))
        elif h == "transfer-encoding":
            headers.append(("Transfer-Encoding", "chunked"))
        elif h == "upgrade":
            headers.append(("Upgrade", "websocket"))
        else:
            headers.append((_title(h), "v"))
    ip = decode_addr(model, sym.ip)
    req = Request(method=method, scheme=scheme, host=host, port=port, target=path, headers=tuple(headers),
                  host_header=host_header, has_body=_bool(model, sym.has_body))
    return req, (ip.compressed,)


def _title(name: str) -> str:
    return "-".join(part[:1].upper() + part[1:] for part in name.split("-"))


def abstract(sym: SymRequest, req: Request, ip: object) -> list[tuple[z3.ExprRef, z3.ExprRef]]:
    """Substitution pairs (variable, value) that put a concrete request and one address into `sym`'s variables."""
    from egress_proxy.decide import DEFAULT_PORTS, _authority_agrees, _connection_tokens  # the implementation's own helpers

    ctx, uni = sym.ctx, sym.uni
    I = lambda v: z3.IntVal(v, ctx)  # noqa: E731
    Bo = lambda v: z3.BoolVal(bool(v), ctx)  # noqa: E731
    pairs: list[tuple[z3.ExprRef, z3.ExprRef]] = []
    pairs.append((sym.scheme, I(SCHEMES.index(req.scheme) if req.scheme in SCHEMES[:2] else 2)))
    port = req.port if isinstance(req.port, int) and not isinstance(req.port, bool) else -1
    pairs.append((sym.port, I(max(-1, min(port, 65536)))))
    host_err = False
    hid = uni.other_name
    lit = None
    name = None
    try:
        form = normalize_host(req.host)
        name = form.value
        if name in uni.hosts[:-2]:
            hid = uni.hosts.index(name)
        elif form.is_ip:
            hid = uni.other_ip
        if form.is_ip:
            lit = ipaddress.ip_address(name)
    except HostError:
        host_err = True
    pairs += [(sym.host, I(hid)), (sym.host_err, Bo(host_err))]
    if lit is not None:
        pairs += [(sym.lit.is6, Bo(lit.version == 6)), (sym.lit.x, z3.BitVecVal(int(lit), 128, ctx))]
    else:
        pairs += [(sym.lit.is6, Bo(False)), (sym.lit.x, z3.BitVecVal(0, 128, ctx))]
    pairs.append((sym.method, I(METHODS.index(req.method) if req.method in METHODS else len(METHODS))))
    names = [(n.lower(), v) for n, v in req.headers]
    host_values = [v for n, v in names if n == "host"]
    pairs.append((sym.hh_n, I(min(len(host_values), 2))))
    pairs.append((sym.auth_given, Bo(req.host_header is not None)))
    values = host_values + ([req.host_header] if req.host_header is not None else [])
    bad = name is not None and any(
        not _authority_agrees(v, name, req.port, DEFAULT_PORTS.get(req.scheme, 0)) for v in values
    )
    pairs.append((sym.auth_bad, Bo(bad)))
    pairs.append((sym.cl_multi, Bo(sum(1 for n, _ in names if n == "content-length") > 1)))
    pairs.append((sym.has_body, Bo(req.has_body)))
    try:
        path = normalize_path(req.target)
        pairs += [(sym.path_err, Bo(False)), (sym.path, I(uni.paths.classify(path)))]
    except PathError:
        pairs += [(sym.path_err, Bo(True)), (sym.path, I(0))]
    try:
        check_target(req.target)
        pairs.append((sym.target_err, Bo(False)))
    except PathError:
        pairs.append((sym.target_err, Bo(True)))
    present = {n for n, _ in names}
    tokens = _connection_tokens(names)
    other = uni.headers[-1]
    known = set(uni.headers[:-1])
    for h in uni.headers:
        if h == other:
            p = any(n not in known for n in present)
            hp = any(t not in known for t in tokens)
        else:
            p, hp = h in present, h in tokens
        pairs += [(sym.present[h], Bo(p)), (sym.hop[h], Bo(hp))]
    addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    pairs += [(sym.ip.is6, Bo(addr.version == 6)), (sym.ip.x, z3.BitVecVal(int(addr), 128, ctx))]
    return pairs
