"""The prover's symbolic inputs: a request as the decision core observes it, resolver answers, a header name.

Each input is exact for what the core can observe (docs/proofs.md, "Inputs"), and where it is a
finite abstraction the evaluator enforces the only operations it is exact for:

- scheme: `https`, `http` or any other; port: any integer;
- host: one of the exact host strings of the subject's declared rules and allowlist and of its
  tables, "any other name", or "any IP literal" (with its own symbolic address); `host_error`
  stands for every refusal of the host normalizer. A host is an `Atom` of a `Domain`: the core may
  only compare it for equality with those exact strings (anything else is `Unsupported`);
- method: one of `compiler.constants.METHODS`, of the methods the rules and tables name, or any
  other; an `Atom` too;
- path: one witness per class of the constant-prefix partition (`PathSpace`), an `Atom` compared only
  with (or tested for a prefix of) the partition's constants; `path_error` stands for every refusal of
  the path normalizer; for a profile, `path_odd` for every valid target that has no normalized form;
- the header scan's findings as free booleans (framing, a CR/LF/NUL in a header, declared trailers, a tunnelled
  request naming another port, ...);
- the resolver answers as a list of *any* length (`AnswerList`): `ANSWERS` slots, each present or not, each a
  128-bit address; the evaluator accepts only loops over it whose outcome on any list is their outcome on a
  sub-list of at most `ANSWERS` answers, and says `unknown` otherwise;
- one header name: a Z3 string ranging over every lowercase HTTP token, and whether the caller
  listed it in `Connection`.

`concretize` turns a model into a `Request`, answers and header name that `decide()` replays;
`abstract` maps a concrete request onto the variables (the differential test).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import z3

from compiler.artifact import Connection, SandboxProfile
from compiler.constants import BODYLESS_METHODS, METHODS
from compiler.normalize import HostError, PathError, normalize_host, normalize_path
from egress_proxy.decision import core
from egress_proxy.decision.types import Request
from proofs.symexec import (
    AnswerList,
    Atom,
    Domain,
    Evaluator,
    SymStr,
    Unsupported,
    token_regex,
)

OTHER_NAME = "other.example.net"  # the stand-in for any name no rule mentions
OTHER_IP = "<an IP literal>"  # the stand-in host text for any IP literal (never equal to a rule host)
OTHER_METHOD = "TRACE"  # the stand-in for any method no table names
SCHEMES = ("https", "http", "ftp")  # "ftp": any scheme but http(s)
ANSWERS = 3  # answer slots: enough for any loop `_answer_loop` accepts with one flag (see AnswerList)
ID_BITS = 16  # host, method, scheme and path-class ids
PORT_BITS = 32
BAD_HOST = "127.1"  # a non-canonical numeric form: every HostError is one class here
BAD_PATH_SUFFIX = "/%00"  # NUL: refused by normalize_path and check_target alike
ODD_PATH_SUFFIX = "/%2E"  # an encoded dot: a valid target for a profile (check_target), never a normalized path
BAD_AUTHORITY = "mismatch.example.net"
# Extensions tried, in order, to find a path in a partition class; "x" first so that the raw-prefix
# counterexample reads `/repos/acmex`.
_EXT_CHARS = "xqzjkvw0123456789abcdefghilmnoprstuy-_~"


def _is_normal_path(p: str) -> bool:
    try:
        return normalize_path(p) == p
    except PathError:
        return False


class PathSpace:
    """Finite partition of all normalized paths by the constants `p` and `p + "/"` of every prefix `p`.

    For constants K, whether a path equals or starts with any k in K is fixed by the longest k in K
    that prefixes it and whether the path equals it: one witness per realizable (longest, equal)
    pair covers every behaviour of code that compares the path with constants of K only — which
    the path `Domain` enforces (any other operation on a path is `Unsupported`).
    """

    def __init__(self, prefixes: list[str]) -> None:
        consts: set[str] = set()
        for p in prefixes:
            consts.add(p)
            if p != "/":
                consts.add(p + "/")
        self.consts = sorted(consts)
        witnesses: list[str] = []
        seen: set[tuple[str | None, bool]] = set()
        for c in [""] + self.consts:
            for w in self._members(c):
                sig = self.signature(w)
                if sig not in seen:
                    seen.add(sig)
                    witnesses.append(w)
        self.witnesses = tuple(witnesses)
        self._index = {self.signature(w): i for i, w in enumerate(self.witnesses)}

    def longest(self, path: str) -> str | None:
        best = None
        for k in self.consts:
            if path.startswith(k) and (best is None or len(k) > len(best)):
                best = k
        return best

    def signature(self, path: str) -> tuple[str | None, bool]:
        k = self.longest(path)
        return (k, k is not None and path == k)

    def classify(self, path: str) -> int:
        """The class id of a normalized path."""
        return self._index[self.signature(path)]

    def _members(self, c: str) -> list[str]:
        out = []
        if c and _is_normal_path(c) and self.longest(c) == c:
            out.append(c)
        base = c or "/"
        exts = list(_EXT_CHARS) + [a + b for a in _EXT_CHARS for b in _EXT_CHARS]
        if not c:
            exts = [""] + exts
        for ext in exts:
            cand = base + ext if c else "/" + ext
            if not _is_normal_path(cand):
                continue
            sig = self.signature(cand)
            if sig[0] == (c or None) and not sig[1]:
                out.append(cand)
                break
        return out


@dataclass
class Universe:
    """The finite domains of one subject (the union over the artifacts compared)."""

    hosts: list[str]  # exact host strings as rules/allowlists/tables write them; then OTHER_NAME, OTHER_IP
    literals: dict[int, ipaddress.IPv4Address | ipaddress.IPv6Address]  # host id -> address, for IP-literal hosts
    paths: PathSpace
    other_name: str
    profile: bool = False  # a profile's requests (their paths may be `path_odd`)
    methods: list[str] = field(default_factory=lambda: [*METHODS, OTHER_METHOD])  # exact methods; then any other

    def __post_init__(self) -> None:
        exact_hosts = self.hosts[:-2]
        self.host_domain = Domain("host", [*exact_hosts, ""])
        self.host_atoms = [Atom(h, self.host_domain, False) for h in exact_hosts]
        self.host_atoms += [Atom(h, self.host_domain, True) for h in self.hosts[-2:]]
        self.method_domain = Domain("method", self.methods[:-1])
        self.method_atoms = [Atom(m, self.method_domain, i == len(self.methods) - 1) for i, m in enumerate(self.methods)]
        self.path_domain = Domain("path", [*self.paths.consts, ""], prefixes=True)
        self.path_atoms = [Atom(w, self.path_domain, True) for w in self.paths.witnesses]

    @property
    def other_ip(self) -> int:
        return len(self.hosts) - 1

    @classmethod
    def build(cls, subjects: list[Connection | SandboxProfile], prefixes: list[str], tables=()) -> Universe:
        """`prefixes`: every constant the core and the statements compare paths with; `subjects` include the
        connections a profile brokers (their hosts are names its requests may carry); `tables` the core's tables of
        the subjects (`core.Subject`), whose hosts and methods are constants the core compares with."""
        hosts: set[str] = set()
        methods: set[str] = set(METHODS) | set(BODYLESS_METHODS)
        for s in subjects:
            if isinstance(s, Connection):
                hosts.update(r.host for r in s.rules)
                methods.update(m for r in s.rules for m in r.methods)
            else:
                hosts.update(h.host for h in s.network.allowed_hosts)
        for t in tables:
            if t is None:
                continue
            hosts.update(h for h, _ in t.destinations)
            for r in t.rules:
                hosts.add(r.host)
                methods.update(r.methods)
        hosts = {h for h in hosts if isinstance(h, str)}
        methods = {m for m in methods if isinstance(m, str)}
        other = OTHER_NAME
        while other in hosts:
            other = "x" + other
        other_method = OTHER_METHOD
        while other_method in methods:
            other_method = "X" + other_method
        host_list = sorted(hosts) + [other, OTHER_IP]
        literals = {}
        for i, h in enumerate(host_list[:-2]):
            try:
                form = normalize_host(h)
            except HostError:
                continue
            if form.is_ip and form.value == h:
                literals[i] = ipaddress.ip_address(h)
        profile = any(isinstance(s, SandboxProfile) for s in subjects)
        method_list = [*METHODS, *sorted(methods - set(METHODS)), other_method]
        return cls(host_list, literals, PathSpace(sorted(set(prefixes))), other, profile, method_list)


def fresh_address(ctx: z3.Context, name: str) -> tuple[z3.BoolRef, z3.BitVecRef, z3.BoolRef]:
    """(is6, x, well-formed): an IPv4 address has its high 96 bits zero."""
    is6, x = z3.Bool(f"{name}_is6", ctx), z3.BitVec(f"{name}_x", 128, ctx)
    return is6, x, z3.Or(is6, z3.Extract(127, 32, x) == z3.BitVecVal(0, 96, ctx))


def decode_address(model: z3.ModelRef, is6: z3.BoolRef, x: z3.BitVecRef) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    v6 = z3.is_true(model.eval(is6, model_completion=True))
    value = model.eval(x, model_completion=True).as_long()
    return ipaddress.IPv6Address(value) if v6 else ipaddress.IPv4Address(value & core.V4_MAX)


class SymbolicRequest:
    """The symbolic inputs of one universe in one Z3 context, with their well-formedness `wf`."""

    def __init__(self, ev: Evaluator, uni: Universe, tag: str = "r") -> None:
        ctx = self.ctx = ev.ctx
        self.ev, self.uni, self.tag = ev, uni, tag
        self._shapes: dict[tuple[str, str], z3.BoolRef] = {}
        # Bit-vectors and booleans only (no integers): the questions stay in QF_BV, which Z3 bit-blasts.
        I, B = (lambda n: z3.BitVec(f"{tag}_{n}", ID_BITS, ctx)), (lambda n: z3.Bool(f"{tag}_{n}", ctx))  # noqa: E731
        self.scheme, self.host, self.method, self.path = I("scheme"), I("host"), I("method"), I("path")
        self.port = z3.BitVec(f"{tag}_port", PORT_BITS, ctx)  # any port the adapter can pass (unsigned)
        self.host_bad, self.path_bad, self.path_odd = B("host_error"), B("path_error"), B("path_odd")
        self.flags = {f: B(f) for f in ("unreadable_headers", "duplicate_host", "field_break", "trailers", "port_mismatch",
                                         "host_mismatch", "upgrade", "framing", "body")}
        self.lit6, self.lit, lit_wf = fresh_address(ctx, f"{tag}_literal")
        self.answers = []
        wf = [lit_wf]
        # "any IP literal" is none of the literal hosts the tables name (those are hosts of their own)
        for i, addr in uni.literals.items():
            wf.append(z3.Not(z3.And(self.lit6 == z3.BoolVal(addr.version == 6, ctx), self.lit == z3.BitVecVal(int(addr), 128, ctx))))
        for i in range(ANSWERS):  # a list of 0..ANSWERS answers (present ones first)
            is6, x, a_wf = fresh_address(ctx, f"{tag}_answer{i}")
            present = B(f"answer{i}_present")
            if i:
                wf.append(z3.Implies(present, self.answers[-1][0]))
            self.answers.append((present, is6, x))
            wf.append(a_wf)
        self.name = z3.String(f"{tag}_header", ctx)
        self.name_listed = B("header_in_connection")
        n_hosts, n_methods, n_paths = len(uni.hosts), len(uni.methods), len(uni.paths.witnesses)
        upgrade_names = z3.Or(self.name == z3.StringVal("upgrade", ctx), self.name == z3.StringVal("http2-settings", ctx))
        wf += [z3.ULT(var, z3.BitVecVal(n, ID_BITS, ctx))
               for var, n in ((self.scheme, len(SCHEMES)), (self.host, n_hosts), (self.method, n_methods), (self.path, n_paths))]
        # the adapter reads a path without a normalized form as `path_odd` for a profile only (a refusal for a connection)
        wf.append(z3.Not(z3.And(self.path_odd, self.path_bad)) if uni.profile else z3.Not(self.path_odd))
        self.wf = z3.And(wf)
        # Only the header-safety questions range over header names (string theory stays out of the rest).
        # The header scan reads `upgrade`/`http2-settings` as an upgrade request whatever the value.
        self.header_wf = z3.And(z3.InRe(self.name, token_regex(ctx)), z3.Implies(upgrade_names, self.flags["upgrade"]),
                                z3.Implies(self.name == z3.StringVal("trailer", ctx), self.flags["trailers"]))

    def _choice(self, var: z3.BitVecRef, values) -> object:
        return self.ev.choice([(var == z3.BitVecVal(i, ID_BITS, self.ctx), v) for i, v in enumerate(values)])

    def observation(self) -> core.Observation:
        """The core's Observation with symbolic fields."""
        ev, uni, ctx = self.ev, self.uni, self.ctx
        is_ip = ev.or_(*[self.host == z3.BitVecVal(i, ID_BITS, ctx) for i in [*uni.literals, uni.other_ip]])
        ip6, ip = self.lit6, self.lit
        for i, addr in uni.literals.items():
            here = self.host == z3.BitVecVal(i, ID_BITS, ctx)
            ip6 = z3.If(here, z3.BoolVal(addr.version == 6, ctx), ip6)
            ip = z3.If(here, z3.BitVecVal(int(addr), 128, ctx), ip)
        # As the adapter reads it: a refused host is passed as "" (and no literal), a refused path as "".
        host = ev.merge(self.host_bad, "", self._choice(self.host, uni.host_atoms))
        is_ip = ev.and_(ev.not_(self.host_bad), is_ip)
        o = core.Observation(self._choice(self.scheme, SCHEMES), self.port, ev.merge(self.host_bad, "host-error", ""),
                             host, is_ip, ip6, ip)
        o.method = self._choice(self.method, uni.method_atoms)
        for name, var in self.flags.items():
            setattr(o, name, var)
        o.path_error = ev.merge(self.path_bad, "path-error", "")
        o.path_odd = self.path_odd
        fine = z3.Not(self.path_bad)
        o.path = ev.choice([(self.path_bad, "")] + [(z3.And(fine, self.path == z3.BitVecVal(j, ID_BITS, ctx)), w)
                                                    for j, w in enumerate(uni.path_atoms)])
        return o

    def shape_input(self, kind: str, key: str) -> z3.BoolRef:
        """The free verdict (true: refused) of a request shape: `kind` `head` or `body`, `key` the rule's shape key
        (`core.RuleTable.head_shape`/`body_shape`). One variable per key, so rules that judge alike (in one artifact
        or across the two a comparison reads) share it."""
        var = self._shapes.get((kind, key))
        if var is None:
            var = self._shapes[(kind, key)] = z3.Bool(f"{self.tag}_{kind}_shape_{key[:16]}", self.ctx)
        return var

    def answer_list(self) -> AnswerList:
        """The resolver answers as the core reads them (`(valid, is6, x)`: the adapter passes parsed answers)."""
        return AnswerList((present, (True, is6, x)) for present, is6, x in self.answers)

    def check_answers(self, answers: AnswerList) -> None:
        """`Unsupported` unless the slots suffice for every loop the core ran over the answers (`AnswerList.need`)."""
        if answers.need > len(self.answers):
            raise Unsupported(f"the core's loops over the resolver answers need {answers.need} answers to show every "
                              f"behaviour on a list of any length; the model has {len(self.answers)}")

    def header(self) -> SymStr:
        return SymStr(self.name)


def concretize(model: z3.ModelRef, sym: SymbolicRequest, header: bool = False) -> tuple[Request, tuple[str, ...]]:
    """The concrete request and resolver answers a model describes (with the symbolic header when `header`)."""
    uni = sym.uni

    def num(v):
        return model.eval(v, model_completion=True).as_long()

    def on(v):
        return z3.is_true(model.eval(v, model_completion=True))

    scheme = SCHEMES[num(sym.scheme)]
    port = num(sym.port)
    hid = num(sym.host)
    if on(sym.host_bad):
        host = BAD_HOST
    elif hid == uni.other_ip:
        host = str(decode_address(model, sym.lit6, sym.lit))
    else:
        host = uni.hosts[hid]
    method = uni.methods[num(sym.method)]
    path = uni.paths.witnesses[num(sym.path)]
    if on(sym.path_bad):
        path = path.rstrip("/") + BAD_PATH_SUFFIX
    elif on(sym.path_odd):
        path = path.rstrip("/") + ODD_PATH_SUFFIX
    default_port = {"https": 443, "http": 80}.get(scheme)
    authority = (f"[{host}]" if ":" in host else host) + ("" if port == default_port else f":{port}")
    flags = {k: on(v) for k, v in sym.flags.items()}
    headers: list[tuple[str, str]] = []
    if flags["duplicate_host"]:
        headers += [("Host", authority), ("Host", authority)]
    host_header = BAD_AUTHORITY if flags["host_mismatch"] else None
    if flags["upgrade"]:
        headers.append(("Upgrade", "websocket"))
    if flags["framing"]:
        headers += [("Transfer-Encoding", "chunked"), ("Content-Length", "0")]
    if flags["field_break"]:
        headers.append(("X-Folded", "a\rb"))
    if flags["trailers"]:
        headers.append(("Trailer", "x-checksum"))
    if header:
        name = model.eval(sym.name, model_completion=True).as_string()
        value = {"host": authority, "content-length": "0", "transfer-encoding": "chunked", "connection": "close"}.get(name, "v")
        if not (name == "host" and flags["duplicate_host"]):
            headers.append((name, value))
        if on(sym.name_listed):
            headers.append(("Connection", name))
    if flags["unreadable_headers"]:
        headers.append((b"x-unreadable", b"1"))  # type: ignore[arg-type]
    answers = tuple(str(decode_address(model, is6, x)) for present, is6, x in sym.answers if on(present))
    req = Request(method=method, scheme=scheme, host=host, port=port, target=path,  # type: ignore[arg-type]
                  headers=tuple(headers), host_header=host_header, has_body=flags["body"],
                  tunnel=flags["port_mismatch"], inner_port=port + 1 if flags["port_mismatch"] else None)
    return req, answers


def abstract(sym: SymbolicRequest, o: core.Observation, answers: list, name: str = "", listed: bool = False) -> list:
    """Substitution pairs (variable, value) that put a concrete observation, answers and header name into `sym`."""
    ctx, uni = sym.ctx, sym.uni
    I = lambda v: z3.BitVecVal(v, ID_BITS, ctx)  # noqa: E731
    B = lambda v: z3.BoolVal(bool(v), ctx)  # noqa: E731
    port = o.port if 0 <= o.port < 1 << PORT_BITS else 0  # an out-of-range port is refused like port 0
    pairs = [(sym.scheme, I(SCHEMES.index(o.scheme) if o.scheme in SCHEMES[:2] else 2)),
             (sym.port, z3.BitVecVal(port, PORT_BITS, ctx)), (sym.host_bad, B(o.host_error))]
    if o.is_ip:
        hid = next((i for i, a in uni.literals.items() if int(a) == o.ip and (a.version == 6) == o.ip6), uni.other_ip)
    else:
        hid = uni.hosts.index(o.host) if o.host in uni.hosts[:-2] else uni.other_ip - 1
    pairs += [(sym.host, I(hid)), (sym.lit6, B(o.ip6)), (sym.lit, z3.BitVecVal(o.ip, 128, ctx))]
    pairs.append((sym.method, I(uni.methods.index(o.method) if o.method in uni.methods[:-1] else len(uni.methods) - 1)))
    pairs += [(var, B(getattr(o, flag))) for flag, var in sym.flags.items()]
    pairs.append((sym.path_bad, B(o.path_error)))
    pairs.append((sym.path_odd, B(o.path_odd)))
    pairs.append((sym.path, I(uni.paths.classify(o.path) if not (o.path_error or o.path_odd) else 0)))
    for i, (present, is6, x) in enumerate(sym.answers):
        addr = ipaddress.ip_address(answers[i]) if i < len(answers) else ipaddress.IPv4Address(0)
        pairs.append((present, B(i < len(answers))))
        pairs += [(is6, B(addr.version == 6)), (x, z3.BitVecVal(int(addr), 128, ctx))]
    pairs += [(sym.name, z3.StringVal(name, ctx)), (sym.name_listed, B(listed))]
    return pairs
