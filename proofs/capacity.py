"""Capacity: how many bits one admitted request of a subject can carry to an upstream (docs/budget.md, "Capacity").

A subject's capacity is log2 of the number of distinct requests it admits that an upstream can tell apart, counted
**route by route** (a route: one rule of a connection, one brokered rule of a profile, or one allowed `host:port` of a
profile's plain traffic) and **field by field** (method, path, query, headers, body), from the artifact alone. Every
figure is an upper bound (exact where the docs say so): counts are kept as log2 in floating point and rounded up at
every combining step, so a printed figure is never below the true one.

What is counted is the request **as it leaves the edge**: the target as the client spelled it (`%3a` and `%3A` are two
requests; so are `s=open` and `s=%6Fpen`), the header names the rule forwards in every case spelling, the body.
The Host header is the edge's (the judged name), and the credential carries nothing the workload chose.

`witness` finds two requests the subject admits that differ only in the field carrying the most bits, replayed through
the real `decide()` (and `judge_body` for a body the rule judges): what a refutation of `prove --max-bits` shows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from compiler.artifact import Artifact, Budget, Connection, Rule, SandboxProfile, Value
from compiler.budget import describe_size, describe_window
from compiler.constants import BODYLESS_METHODS, METHODS, header_is_denylisted
from compiler.patterns import CharSet, Literal, PatternError, Repeat, Seq, parse_pattern
from egress_proxy.decision.adapter import decide, judge_body
from egress_proxy.decision.types import Decision, Lease, Request
from proofs.errors import ProofError

UNBOUNDED = math.inf
CLOCK_RESOLUTION = 0.001  # seconds: the timing channel's assumed clock (docs/budget.md, "Timing")
DEFAULT_MAX_BODY = 1 << 20  # what a body-shaped rule reads when it names no `max_body` (egress_proxy.decision.shapes)
MIN_REQUEST_COST = 24  # no request costs fewer bytes (`egress_proxy.front.budget.request_cost`): the timing bound's R
EPSILON = 1e-12  # relative: added at every combining step so that float error only ever rounds up

# Wire alphabets (upper bounds on the characters a field can hold as sent):
PATH_CHARS = 80  # a connection's path: the normalizer's safe characters (66 unreserved, `!$&'()*+,=:@/`) and `%`
SEGMENT_CHARS = PATH_CHARS - 1  # a path segment: no `/`
BYTE_CHARS = 256  # a target or a query as sent: any byte (no normalizer reads a query)
HEADER_VALUE_CHARS = 224  # a header value: any byte but a control character (HTAB allowed): the header scan refuses those
TEXT_CHARS = 0x110000 - 0x800  # a JSON string's character: any code point but a surrogate
INTEGER_DIGITS = 19  # a text integer: canonical decimal digits, at most 19 (egress_proxy.decision.shapes.INTEGER)
WITNESS_IPS = ("93.184.216.34",)  # a public address: the witness's resolver answer
HEX_LETTERS = frozenset("ABCDEFabcdef")
# `egress_proxy.credentials.aws_sigv4.UNSIGNED_SERVICES` (proofs may not import the credentials room; a test pins it)
UNSIGNED_PAYLOAD_SERVICES = frozenset({"s3"})


class CapacityError(ProofError):
    """A subject that is not in the artifact, a capacity with no route, or no witness pair for its top field."""


@dataclass(frozen=True)
class HeadLimits:
    """The head limits both front ends enforce (`egress_proxy.front.settings.DEFAULTS`; `proofs` may not import the
    front room, so tests/proofs/test_capacity.py pins these to it)."""

    max_head_bytes: int = 65536
    max_request_line: int = 8192
    max_headers: int = 100


@dataclass(frozen=True)
class Field:
    """One part of a route's requests and the bits it carries; `name` is `destination`, `scheme`, `method`, `path`,
    `query`, `headers`, `body` or (informational, inside `body`) `mcp.arguments`."""

    name: str
    bits: float
    why: str

    @property
    def informational(self) -> bool:
        """A field counted inside another (never added to the route's bits)."""
        return self.name == "mcp.arguments"


@dataclass(frozen=True)
class Route:
    """One way out: a rule (`rule` None: a profile's plain traffic to `host:port`; `owner`: the connection a rule
    belongs to), its fields and its bits."""

    rule: str | None
    owner: str | None
    host: str
    port: int
    fields: tuple[Field, ...]
    bits: float

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    @property
    def label(self) -> str:
        if self.rule is None:
            return f"`{self.host}:{self.port}`" if self.port else "any host"
        return f"rule `{self.rule}`" if self.owner is None else f"rule `{self.owner}/{self.rule}`"


# ---------------------------------------------------------------------------------------------
# Numbers in log2 space, rounded up
# ---------------------------------------------------------------------------------------------


def up(x: float) -> float:
    """`x` nudged up past any float error of the step that made it."""
    if math.isinf(x) or x == 0:
        return x
    return x + abs(x) * EPSILON + EPSILON


def log2_int(n: int) -> float:
    """log2 of an exact count (0 for a count of 0 or 1: an empty set adds nothing to an upper bound)."""
    if n <= 1:
        return 0.0
    if n & (n - 1) == 0:
        return float(n.bit_length() - 1)  # a power of two: exact
    return up(math.log2(n))


def log2sum(bits: list[float] | tuple[float, ...]) -> float:
    """log2(sum of 2^b), stably; -inf for no terms."""
    terms = [b for b in bits if b != -math.inf]
    if not terms:
        return -math.inf
    top = max(terms)
    if math.isinf(top):
        return top
    return up(top + math.log2(sum(2.0 ** (b - top) for b in terms)))


def free_bits(log_alphabet: float, n: int) -> float:
    """log2 of the strings of length 0..n over an alphabet of 2^log_alphabet characters: log2(sum_{k<=n} a^k)."""
    if n <= 0:
        return 0.0
    if math.isinf(log_alphabet):
        return math.inf
    if log_alphabet <= 0:
        return log2_int(n + 1)
    a = 2.0 ** log_alphabet if log_alphabet < 60 else None
    if a is not None and a == int(a) and n * log_alphabet <= 2048:
        k = int(a)
        return log2_int((k ** (n + 1) - 1) // (k - 1))
    # sum_{k<=n} a^k = a^n * sum_{j<=n} a^-j <= a^n / (1 - 1/a); also <= (n + 1) a^n
    tail = -math.log1p(-(2.0 ** -log_alphabet)) / math.log(2)
    return up(n * log_alphabet + min(tail, math.log2(n + 1)))


def ceil2(x: float) -> float:
    """`x` rounded up to two decimals (a figure within float error of a hundredth is that hundredth)."""
    if math.isinf(x):
        return x
    scaled = x * 100
    near = round(scaled)
    if abs(scaled - near) <= 1e-9 * max(1.0, abs(scaled)):
        return near / 100
    return math.ceil(scaled) / 100


def format_bits(bits: float) -> str:
    """`0 bits`, `1 bit`, `1.59 bits`, `8,388,616 bits`, `unbounded` (rounded up to two decimals)."""
    if math.isinf(bits):
        return "unbounded"
    shown = ceil2(max(bits, 0.0))
    if shown == int(shown):
        whole = int(shown)
        return f"{whole:,} bit" if whole == 1 else f"{whole:,} bits"
    return f"{shown:,.2f} bits"


def _number(bits: float) -> float | str:
    return "unbounded" if math.isinf(bits) else ceil2(max(bits, 0.0))


# ---------------------------------------------------------------------------------------------
# Values: how many wire spellings a constrained value has
# ---------------------------------------------------------------------------------------------


def _hex_cases(text: str) -> int:
    """Spellings of a normalized path text on the wire: each letter of a `%XY` escape in either case."""
    letters = 0
    i = 0
    while i < len(text):
        if text[i] == "%":
            letters += sum(1 for c in text[i + 1 : i + 3] if c in HEX_LETTERS)
            i += 3
        else:
            i += 1
    return 1 << letters


def _query_spellings(text: str) -> int:
    """Spellings of one decoded query text on the wire: each character as itself, or each of its UTF-8 bytes as `%XY`
    in either case (and a space as `+`): an upper bound."""
    total = 1
    for c in text:
        encoded = 1
        for b in c.encode("utf-8", "surrogatepass"):
            encoded *= 1 << sum(1 for h in f"{b:02X}" if h in HEX_LETTERS)
        total *= 1 + encoded + (1 if c == " " else 0)
    return total


def _pattern_shape(value: Value) -> tuple[int | None, int | None]:
    """(characters the pattern can use, its longest match) of a value's pattern; None for either when unknown."""
    if value.pattern is None:
        return None, None
    try:
        node = parse_pattern(value.pattern).node
    except PatternError:
        return None, None

    def chars(n) -> int:
        if isinstance(n, Literal):
            return 1
        if isinstance(n, CharSet):
            inside = sum(ord(hi) - ord(lo) + 1 for lo, hi in n.ranges)
            return 0x110000 - inside if n.negated else inside
        if isinstance(n, Repeat):
            return chars(n.item)
        return sum(chars(i) for i in (n.items if isinstance(n, Seq) else n.options))

    def longest(n) -> int | None:
        if isinstance(n, (Literal, CharSet)):
            return 1
        if isinstance(n, Repeat):
            inner = longest(n.item)
            return None if n.high is None or inner is None else inner * n.high
        parts = [longest(i) for i in (n.items if isinstance(n, Seq) else n.options)]
        if any(p is None for p in parts):
            return None
        return sum(parts) if isinstance(n, Seq) else max(parts)  # type: ignore[arg-type]

    return chars(node), longest(node)


def _integer_values(value: Value) -> list[tuple[int, int]]:
    """The admitted integers as inclusive ranges (a text integer: at most 19 digits)."""
    limit = 10**INTEGER_DIGITS - 1
    lo = max(value.minimum if value.minimum is not None else -limit, -limit)
    hi = min(value.maximum if value.maximum is not None else limit, limit)
    if value.enum is not None:
        return [(e, e) for e in sorted({e for e in value.enum if type(e) is int}) if lo <= e <= hi]
    return [(lo, hi)] if lo <= hi else []


def _integer_count(value: Value, spell) -> int:
    """Wire spellings of the admitted text integers: sum over values of `spell(digits, negative)`; `-0` included
    (the judge reads it as 0)."""
    total = 0
    for lo, hi in _integer_values(value):
        for negative, a, b in ((True, max(-hi, 1), -lo), (False, max(lo, 0), hi)):
            if a > b:
                continue
            for digits in range(1, INTEGER_DIGITS + 1):
                band_lo, band_hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
                x, y = max(a, band_lo), min(b, band_hi)
                if x <= y:
                    total += (y - x + 1) * spell(digits, negative)
        if lo <= 0 <= hi:
            total += spell(1, True)  # `-0`
    return total


def text_value_bits(value: Value, where: str, room: int) -> tuple[float, str]:
    """(bits, why) of one text value (a path segment, a query value, a header value) as sent, within `room` characters.

    `where`: `segment` (wire = judged text up to `%XY` case), `query` (percent-decoded once), `header` (as is)."""
    if value.type == "integer":
        if where == "query":
            count = _integer_count(value, lambda d, neg: (2**d) * (3 if neg else 1))
            return log2_int(count), "integers, each digit raw or `%3X`"
        count = _integer_count(value, lambda d, neg: 1)
        return log2_int(count), "integers in canonical decimal"
    if value.type not in ("string", "any"):
        return 0.0, f"a text value is never {value.type}: admits none"
    if value.enum is not None:
        texts = [e for e in value.enum if type(e) is str]
        if value.max_length is not None:
            texts = [t for t in texts if len(t) <= value.max_length]
        if where == "segment":
            return log2_int(sum(_hex_cases(t) for t in texts)), f"one of {len(texts)} values"
        if where == "query":
            return log2_int(sum(_query_spellings(t) for t in texts)), f"one of {len(texts)} values, in their percent spellings"
        return log2_int(len(texts)), f"one of {len(texts)} values"
    charset, longest = _pattern_shape(value)
    length = min(x for x in (value.max_length, longest, room) if x is not None)
    if where == "query":
        # a decoded character is at most 4 UTF-8 bytes, each `%XY`: 12 wire characters
        wire = room if value.max_length is None and longest is None else min(room, 12 * length)
        return free_bits(math.log2(BYTE_CHARS), wire), f"free text of at most {wire:,} characters as sent"
    alphabet = SEGMENT_CHARS if where == "segment" else HEADER_VALUE_CHARS
    if charset is not None:
        alphabet = min(alphabet, charset + (6 if where == "segment" else 0))  # `%xy`: lowercase hex on the wire
    what = "pattern" if value.pattern is not None else "free text"
    return free_bits(math.log2(max(alphabet, 1)), length), f"{what} of at most {length:,} characters over {alphabet} characters"


def json_value_choices(value: Value, max_body: int) -> float:
    """log2 of the JSON values an MCP argument may be (decoded; `any`, `array`, `object` and unbounded text or
    integers: the bytes of the body that carries them)."""
    if value.enum is not None:
        return log2_int(len(value.enum))
    if value.type in ("boolean",):
        return 1.0
    if value.type == "null":
        return 0.0
    if value.type == "integer":
        if value.minimum is not None and value.maximum is not None:
            return log2_int(max(value.maximum - value.minimum + 1, 0))
        return free_bits(8.0, max_body)
    if value.type == "string":
        charset, longest = _pattern_shape(value)
        length = min((x for x in (value.max_length, longest) if x is not None), default=None)
        if length is None:
            return free_bits(8.0, max_body)
        alphabet = min(TEXT_CHARS, charset) if charset is not None else TEXT_CHARS
        return free_bits(math.log2(max(alphabet, 1)), length)
    return free_bits(8.0, max_body)


# ---------------------------------------------------------------------------------------------
# Fields of a route
# ---------------------------------------------------------------------------------------------


def _room(limits: HeadLimits, methods: tuple[str, ...]) -> int:
    """The target's room: the request line holds the method, a space and the target (HTTP/2's reading; HTTP/1's is
    shorter by ` HTTP/1.1`)."""
    return max(limits.max_request_line - min(len(m) for m in methods) - 1, 0)


def _query_field(rule: Rule, room: int) -> Field:
    if rule.query is None:
        return Field("query", free_bits(math.log2(BYTE_CHARS), room), f"free within the request line's {room:,} characters")
    # Absent: 1. Present: `?` and one or more pairs joined by single `&` (the judge refuses `?` alone and an empty
    # `&` component, `egress_proxy.decision.shapes.query_gap`): for each subset S of the parameters, its |S|! orders,
    # each pair as `name`, `name=` or `name=value` in its percent spellings.
    per = []
    for p in rule.query:
        name = _query_spellings(p.name)
        value_bits, _ = text_value_bits(p.value, "query", room)
        per.append(up(math.log2(name) + log2sum([0.0, 0.0, value_bits])))  # `name`, `name=`, `name=value`
    elementary = [0.0] + [-math.inf] * len(per)  # e_j: sum over j-subsets of the product of their counts
    for bits in per:
        for j in range(len(per), 0, -1):
            elementary[j] = log2sum([elementary[j], elementary[j - 1] + bits])
    terms = [0.0]  # absent
    for j, e in enumerate(elementary):
        if j == 0 or e == -math.inf:
            continue
        terms.append(up(e + log2_int(math.factorial(j))))
    bits = min(log2sum(terms), log2sum([0.0, free_bits(math.log2(BYTE_CHARS), room)]))
    names = ", ".join(f"`{p.name}`" for p in rule.query)
    why = f"listed parameters {names} in any order, joined by `&`" if rule.query else "`query = {}`: no query"
    return Field("query", bits, why)


def _path_field(rule: Rule, room: int, free_query: bool) -> Field:
    if rule.template is not None:
        total = 0.0
        for seg in rule.template:
            if seg.value is None:
                total += log2_int(_hex_cases(seg.literal or ""))
            else:
                total += text_value_bits(seg.value, "segment", room)[0]
        total = min(up(total), free_bits(math.log2(PATH_CHARS), room))
        return Field("path", total, f"template of {len(rule.template)} segments")
    prefix = rule.path_prefix.rstrip("/") or "/"
    spell = log2_int(_hex_cases(prefix))
    left = max(room - len(prefix), 0)
    if free_query:
        return Field("path", up(spell + free_bits(math.log2(BYTE_CHARS), left)),
                     f"path and query below `{prefix}`: free within the request line's {room:,} characters")
    return Field("path", up(spell + free_bits(math.log2(PATH_CHARS), left)),
                 f"free below `{prefix}` within the request line's {room:,} characters")


def _header_names(rule: Rule, conn: Connection) -> list[str]:
    """The names a request under `rule` forwards (`egress_proxy.decision.core.forwarded` on the rule's table)."""
    inject = conn.inject.header
    names = {h.lower() for h in rule.headers if not header_is_denylisted(h, inject, conn.kind)}
    return sorted(n for n in names if n != "authorization" and not n.startswith("proxy-"))


def _headers_field(rule: Rule, conn: Connection, limits: HeadLimits) -> Field:
    names = _header_names(rule, conn)
    if not names:
        return Field("headers", 0.0, "no header is forwarded")
    shaped = {p.name.lower(): p.value for p in rule.header_values}
    per = []
    for name in names:
        spellings = sum(1 for c in name if c.isalpha())
        if name in shaped:
            value_bits = text_value_bits(shaped[name], "header", limits.max_head_bytes)[0]
        else:
            value_bits = free_bits(math.log2(HEADER_VALUE_CHARS), limits.max_head_bytes)
        per.append(up(spellings + value_bits))
    one = log2sum(per)  # one field: a name in one of its spellings, and a value
    bits = free_bits(one, limits.max_headers)  # any sequence of at most max_headers fields
    listed = ", ".join(f"`{n}`" for n in names)
    return Field("headers", bits, f"{listed} in any case, order and number up to {limits.max_headers}")


def _body_of(rule: Rule | None, method: str, bytes_cap: int | None) -> tuple[float, str] | None:
    """(bits, why) of the body a `method` request under `rule` (None: plain profile traffic) can carry; None: no body.

    A body the rule judges (`egress_proxy.decision.shapes.body_to_judge`: an MCP or GraphQL POST, a git push) is read
    whole to `max_body`; any other body (a PUT on an MCP rule, git's `git-upload-pack`) streams upstream unjudged and
    is bounded by the budget's bytes only."""
    if method in BODYLESS_METHODS:
        return None
    limit = None
    if rule is not None and method == "POST":
        if rule.mcp is not None or rule.graphql is not None or (rule.git is not None and not rule.git.fetch):
            limit = rule.max_body or DEFAULT_MAX_BODY
    if limit is not None and (bytes_cap is None or limit <= bytes_cap):
        kind = "mcp" if rule.mcp is not None else "graphql" if rule.graphql is not None else "git push"  # type: ignore[union-attr]
        return free_bits(8.0, limit), f"a {kind} body, read and judged to {describe_size(limit)}"
    if bytes_cap is not None:
        return free_bits(8.0, bytes_cap), f"at most the budget's {describe_size(bytes_cap)}"
    return math.inf, ""


def _body_field(rule: Rule | None, method_set: tuple[str, ...], bytes_cap: int | None, where: str) -> Field | None:
    """The body field: the most any of the methods' bodies carries."""
    bodies = [(m, _body_of(rule, m, bytes_cap)) for m in method_set]
    bodies = [(m, b) for m, b in bodies if b is not None]
    if not bodies:
        return None
    worst = max(b[0] for _, b in bodies)
    if math.isinf(worst):
        unjudged = ", ".join(m for m, b in bodies if math.isinf(b[0]))
        return Field("body", math.inf, f"body of {where} ({unjudged}; declare budget.bytes)")
    return Field("body", worst, next(b[1] for _, b in bodies if b[0] == worst))


def _mcp_field(rule: Rule) -> Field | None:
    if rule.mcp is None or not rule.mcp.tools:
        return None
    limit = rule.max_body or DEFAULT_MAX_BODY
    tools = []
    for tool in rule.mcp.tools:
        total = 0.0
        for arg in tool.arguments:
            if arg.name in tool.forbidden:
                continue
            choices = json_value_choices(arg.value, limit)
            total += choices if arg.name in tool.required else log2sum([choices, 0.0])
        if tool.additional:
            total += free_bits(8.0, limit)
        tools.append(up(total))
    return Field("mcp.arguments", log2sum(tools), f"{len(tools)} tools, each the product of its arguments' choices")


def _route_bits(head: list[Field], rule: Rule | None, methods: tuple[str, ...], cap: float, bytes_cap: int | None) -> float:
    """min(head fields but the method, every head) + log2(sum over methods of 2^(its body's bits)), and at most what
    a window's bytes hold."""
    rest = min(up(sum(f.bits for f in head if f.name != "method")), cap)
    per_method = log2sum([(b[0] if b is not None else 0.0) for b in (_body_of(rule, m, bytes_cap) for m in methods)])
    bits = up(rest + per_method)
    if bytes_cap is not None:
        bits = min(bits, free_bits(8.0, bytes_cap))
    return bits


def _rule_route(rule: Rule, conn: Connection, owner: str | None, limits: HeadLimits, bytes_cap: int | None) -> Route:
    room = _room(limits, rule.methods)
    free_query = rule.template is None and rule.query is None
    head = [Field("method", log2_int(len(rule.methods)), f"{', '.join(rule.methods)}")]
    head.append(_path_field(rule, room, free_query))
    if not free_query:
        head.append(_query_field(rule, room))
        target = free_bits(math.log2(BYTE_CHARS), room)
        if head[1].bits + head[2].bits > target:  # path and query share the request line
            head[2] = Field("query", max(target - head[1].bits, 0.0), head[2].why + " (the request line bounds both)")
    head.append(_headers_field(rule, conn, limits))
    if conn.mint is not None and conn.mint.kind == "aws_sigv4" and conn.mint.service in UNSIGNED_PAYLOAD_SERVICES:
        # the edge re-signs with the payload mode the client's own `x-amz-content-sha256` names (unsigned or
        # streaming-unsigned with a trailer): a header the edge writes, chosen by the workload
        head.append(Field("payload-mode", 1.0, "`x-amz-content-sha256`: the client picks one of two markers the edge signs"))
    head = [_capped(f, limits) for f in head]
    label = f"rule `{rule.name}`" if owner is None else f"rule `{owner}/{rule.name}`"
    body = _body_field(rule, rule.methods, bytes_cap, label)
    fields = head + ([body] if body is not None else [])
    mcp = _mcp_field(rule)
    if mcp is not None:
        fields.append(mcp)
    bits = _route_bits(head, rule, rule.methods, head_cap(limits), bytes_cap)
    return Route(rule.name, owner, rule.host, rule.port, tuple(fields), bits)


def _capped(f: Field, limits: HeadLimits) -> Field:
    """A head field carries no more than every head the limits admit."""
    cap = head_cap(limits)
    if f.bits <= cap:
        return f
    return Field(f.name, cap, f"{f.why} (the head's {describe_size(limits.max_head_bytes)} bound it)")


def head_cap(limits: HeadLimits) -> float:
    """Every head the limits admit: at most `max_head_bytes` bytes."""
    return free_bits(8.0, limits.max_head_bytes)


def _plain_route(host: str, port: int, limits: HeadLimits, bytes_cap: int | None) -> Route:
    room = _room(limits, METHODS)
    where = f"`{host}:{port}`"
    head = [
        Field("scheme", 1.0, "http or https"),
        Field("method", log2_int(len(METHODS)), "any method the core admits"),
        Field("path", free_bits(math.log2(BYTE_CHARS), room), f"path and query: free within the request line's {room:,} characters"),
        Field("headers", head_cap(limits), f"any token name not denylisted, any value: only the head's {describe_size(limits.max_head_bytes)} bound them"),
    ]
    body = _body_field(None, METHODS, bytes_cap, where)
    fields = head + ([body] if body is not None else [])
    bits = _route_bits(head, None, METHODS, head_cap(limits), bytes_cap)
    return Route(None, None, host, port, tuple(fields), bits)


# ---------------------------------------------------------------------------------------------
# Subjects
# ---------------------------------------------------------------------------------------------


def _min_cap(*budgets: Budget | None) -> int | None:
    caps = [b.bytes for b in budgets if b is not None and b.bytes is not None]
    return min(caps) if caps else None


@dataclass(frozen=True)
class Capacity:
    """One subject's capacity per request, its routes, and what its caps make of it per window."""

    kind: str  # "profile" | "connection"
    name: str
    bits: float
    routes: tuple[Route, ...]
    budget: Budget | None
    limits: HeadLimits = field(default_factory=HeadLimits)

    @property
    def subject(self) -> str:
        return f"{self.kind} `{self.name}`"

    @property
    def unbounded(self) -> str | None:
        """What makes the count unbounded (`body of rule \\`upload\\` (POST; declare budget.bytes)`), else None."""
        if not math.isinf(self.bits):
            return None
        for route in self.routes:
            for f in route.fields:
                if math.isinf(f.bits) and not f.informational:
                    return f.why
        return "unbounded"

    @property
    def top(self) -> tuple[Route, Field]:
        """The route carrying the most bits and its field carrying the most (CapacityError without a route)."""
        if not self.routes:
            raise CapacityError(f"{self.subject} admits no request: no field carries anything")
        route = max(self.routes, key=lambda r: r.bits)  # the first of equals: artifact order
        fields = [f for f in route.fields if not f.informational]
        return route, max(fields, key=lambda f: f.bits)

    def _requests(self) -> int | None:
        if self.budget is None:
            return None
        caps = []
        if self.budget.requests is not None:
            caps.append(self.budget.requests)
        if self.budget.bytes is not None:
            caps.append(self.budget.bytes // MIN_REQUEST_COST)
        return min(caps) if caps else None

    def window_bits(self) -> float:
        """At most what one window carries: min(R x bits + log2(R + 1), 8 x bytes + 0.01); unbounded without caps."""
        if self.budget is None:
            return math.inf
        bounds = []
        r = self.budget.requests
        if r is not None and not math.isinf(self.bits):
            bounds.append(up(r * max(self.bits, 0.0) + math.log2(r + 1)))
        if self.budget.bytes is not None:
            bounds.append(8 * self.budget.bytes + 0.01)
        if not self.routes:
            return 0.0
        return min(bounds) if bounds else math.inf

    def timing_bits(self) -> float:
        """What the moments of a window's requests carry at CLOCK_RESOLUTION: R x log2(W / resolution + 1)."""
        r = self._requests()
        if r is None:
            return math.inf
        if not self.routes:
            return 0.0
        return up(r * math.log2(self.budget.window / CLOCK_RESOLUTION + 1))  # type: ignore[union-attr]

    def over(self, seconds: int) -> float:
        """At most what any interval of `seconds` carries: the windows it overlaps, ceil(seconds / window) + 1."""
        per = self.window_bits()
        if math.isinf(per) or self.budget is None:
            return per
        return up(per * (math.ceil(seconds / self.budget.window) + 1))

    def to_dict(self) -> dict:
        """JSON-able: bits as numbers (rounded up to two decimals) or `unbounded`."""
        budget = None
        if self.budget is not None:
            budget = self.budget.model_dump(mode="json")
        return {
            "kind": self.kind,
            "name": self.name,
            "bits": _number(self.bits),
            "unbounded": self.unbounded,
            "routes": [
                {"rule": r.rule, "owner": r.owner, "host": r.host, "port": r.port, "bits": _number(r.bits),
                 "fields": [{"name": f.name, "bits": _number(f.bits), "why": f.why} for f in r.fields]}
                for r in self.routes
            ],
            "budget": budget,
            "window": None if self.budget is None else {
                "seconds": self.budget.window, "bits": _number(self.window_bits()), "timing_bits": _number(self.timing_bits()),
            },
            "limits": {"max_head_bytes": self.limits.max_head_bytes, "max_request_line": self.limits.max_request_line,
                       "max_headers": self.limits.max_headers},
            "clock_resolution": CLOCK_RESOLUTION,
        }

    def text(self) -> str:
        """One line: the figure per request, and per window when the subject has caps."""
        if not self.routes:
            return f"{self.subject}: admits no request (0 bits)"
        if math.isinf(self.bits):
            line = f"{self.subject}: unbounded per request: {self.unbounded}"
        else:
            line = f"{self.subject}: {format_bits(self.bits)} per request"
        if self.budget is not None:
            caps = []
            if self.budget.requests is not None:
                caps.append(f"{self.budget.requests:,} requests")
            if self.budget.bytes is not None:
                caps.append(describe_size(self.budget.bytes))
            line += (f"; {' and '.join(caps)} per {describe_window(self.budget.window)}: at most "
                     f"{format_bits(self.window_bits())} per window (+ timing <= {format_bits(self.timing_bits())})")
        return line


def _capacity(kind: str, name: str, routes: list[Route], budget: Budget | None, limits: HeadLimits) -> Capacity:
    bits = max(log2sum([r.bits for r in routes]), 0.0) if routes else 0.0
    cap = _min_cap(budget)
    if cap is not None:  # a request that costs more than a window's bytes is refused: at most that many, whatever the route
        bits = min(bits, free_bits(8.0, cap))
    return Capacity(kind, name, bits, tuple(routes), budget, limits)


def _connection_capacity(conn: Connection, limits: HeadLimits) -> Capacity:
    cap = _min_cap(conn.budget)
    routes = [_rule_route(rule, conn, None, limits, cap) for rule in conn.rules]
    return _capacity("connection", conn.name, routes, conn.budget, limits)


def _profile_capacity(artifact: Artifact, prof: SandboxProfile, limits: HeadLimits) -> Capacity:
    allowlist = prof.network.mode == "allowlist"
    # As `egress_proxy.decision.core.profile_subject` reads a profile: only a trusted one brokers; observe mode holds
    # only for a trusted profile with a network that brokers nothing.
    observe = prof.enforce == "observe" and prof.trust == "trusted" and not prof.brokers and allowlist
    cap = _min_cap(prof.budget)
    routes: list[Route] = []
    if observe:
        where = "destination (observe mode: plain traffic reaches any host)"
        routes.append(Route(None, None, "*", 0, (Field("destination", math.inf, where),), math.inf))
    hosts = sorted({(h.host, h.port) for h in prof.network.allowed_hosts}) if allowlist else []
    for host, port in hosts:
        routes.append(_plain_route(host, port, limits, cap))
    for name in prof.brokers if prof.trust == "trusted" else ():
        conn = artifact.connection(name)
        if conn is None:
            continue  # the core refuses the whole profile (`profile_subject` raises): it admits nothing through it
        both = _min_cap(prof.budget, conn.budget)
        routes.extend(_rule_route(rule, conn, conn.name, limits, both) for rule in conn.rules)
    return _capacity("profile", prof.name, routes, prof.budget, limits)


def capacities(artifact: Artifact, limits: HeadLimits = HeadLimits()) -> tuple[Capacity, ...]:
    """Every subject's capacity: profiles, then connections, in artifact order."""
    out = [_profile_capacity(artifact, p, limits) for p in artifact.sandbox_profiles]
    out += [_connection_capacity(c, limits) for c in artifact.connections]
    return tuple(out)


def capacity(artifact: Artifact, kind: str, name: str, limits: HeadLimits = HeadLimits()) -> Capacity:
    """One subject's capacity (`kind`: `profile` or `connection`); CapacityError when it is not in the artifact."""
    if kind == "profile":
        prof = artifact.profile(name)
        if prof is not None:
            return _profile_capacity(artifact, prof, limits)
    elif kind == "connection":
        conn = artifact.connection(name)
        if conn is not None:
            return _connection_capacity(conn, limits)
    raise CapacityError(f"{kind} `{name}` is not in the artifact")


# ---------------------------------------------------------------------------------------------
# Witnesses: two admitted requests that differ in the top field
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Witness:
    """Two requests the subject admits, differing only in `field` of `route`, with their decisions."""

    lease: Lease
    requests: tuple[Request, Request]
    bodies: tuple[bytes | None, bytes | None]
    route: Route
    field: Field
    decisions: tuple[Decision, Decision]

    def to_dict(self) -> dict:
        def one(req: Request, body: bytes | None, d: Decision) -> dict:
            return {"method": req.method, "scheme": req.scheme, "host": req.host, "port": req.port, "target": req.target,
                    "headers": [list(h) for h in req.headers], "body": None if body is None else body.decode("utf-8", "replace"),
                    "allowed": d.allowed, "reason": d.reason, "rule": d.rule}
        return {"route": self.route.label, "field": self.field.name, "bits": _number(self.field.bits),
                "requests": [one(r, b, d) for r, b, d in zip(self.requests, self.bodies, self.decisions)]}

    def describe(self) -> str:
        lines = [f"two admitted requests that differ in the {self.field.name} of {self.route.label} "
                 f"({format_bits(self.field.bits)}):"]
        for req, body in zip(self.requests, self.bodies):
            text = f"  {req.method} {req.scheme}://{req.host}:{req.port}{req.target}"
            if req.headers:
                text += " " + " ".join(f"[{n}: {v}]" for n, v in req.headers)
            if body is not None:
                text += f" body={json.dumps(body.decode('utf-8', 'replace'))}"
            lines.append(text)
        return "\n".join(lines)


def _base(artifact: Artifact, route: Route, fieldname: str) -> tuple[str, str, str, tuple[tuple[str, str], ...], Rule | None]:
    """(method, scheme, target, headers, rule) of a request the route admits."""
    if route.rule is None:
        method = "POST" if fieldname == "body" else "GET"
        return method, "https", "/", (), None
    conn = artifact.connection(route.owner) if route.owner is not None else None
    rule = _rule_of(artifact, route)
    assert rule is not None
    del conn
    # Imported here: the example builders belong to the judges; only a witness needs them.
    from egress_proxy.decision.shapes import example_target, shape_of

    shape = shape_of(rule)
    target = (example_target(shape) if shape is not None else None) or rule.path_prefix
    if rule.git is not None and fieldname == "body":
        base = "" if rule.path_prefix == "/" else rule.path_prefix.rstrip("/")
        target = f"{base}/git-upload-pack" if rule.git.fetch else f"{base}/git-receive-pack"  # upload-pack: unjudged
    bodied = [m for m in rule.methods if m not in BODYLESS_METHODS]
    method = bodied[0] if fieldname == "body" and bodied else next((m for m in rule.methods if m in BODYLESS_METHODS), rule.methods[0])
    headers: tuple[tuple[str, str], ...] = ()
    if method == "POST" and (rule.mcp is not None or rule.graphql is not None):
        headers = (("Content-Type", "application/json"),)
    if method == "POST" and rule.git is not None:
        headers = (("Content-Type", "application/x-git-receive-pack-request"),)
    return method, "https", target, headers, rule


def _rule_of(artifact: Artifact, route: Route) -> Rule | None:
    if route.rule is None:
        return None
    for conn in artifact.connections:
        if route.owner is None or conn.name == route.owner:
            for rule in conn.rules:
                if rule.name == route.rule and rule.host == route.host and rule.port == route.port:
                    return rule
    return None


def _bodies(rule: Rule | None) -> list[bytes]:
    if rule is not None and rule.mcp is not None:
        out = []
        for method in rule.mcp.methods:
            if method.startswith("notifications/") or method == "tools/call":
                continue
            out += [json.dumps({"jsonrpc": "2.0", "id": i, "method": method}).encode() for i in (1, 2)]
        return out
    if rule is not None and rule.graphql is not None:
        fields = rule.graphql.query or ("__typename",)
        return [f"{{\"query\": \"{{ {fields[0]} }}\"}}".encode(), f"{{\"query\": \"query {{ {fields[0]} }}\"}}".encode()]
    if rule is not None and rule.git is not None and not rule.git.fetch:
        return []  # a push's pkt-lines: no example built here
    return [b"a", b"b"]


def _variants(rule: Rule | None, route: Route, fieldname: str, method: str, target: str,
              headers: tuple[tuple[str, str], ...]) -> list[tuple[str, str, str, tuple[tuple[str, str], ...], bytes | None]]:
    """Candidate (method, scheme, target, headers, body) requests that differ from the base in `fieldname` only."""
    out: list[tuple[str, str, str, tuple[tuple[str, str], ...], bytes | None]] = []
    scheme = "https"
    path, _, query = target.partition("?")
    sep = "?" if "?" in target else ""
    if fieldname == "method":
        methods = rule.methods if rule is not None else METHODS
        out += [(m, scheme, target, headers, None) for m in methods if m in BODYLESS_METHODS]
    elif fieldname == "scheme":
        out += [(method, s, target, headers, None) for s in ("http", "https")]
    elif fieldname == "path":
        stem = path.rstrip("/")
        out += [(method, scheme, f"{stem}/{x}{sep}{query}", headers, None) for x in ("a", "b", "c")]
        if rule is not None and rule.template is not None:
            parts = path.split("/")
            for i, seg in enumerate(rule.template):
                for alt in _text_candidates(seg.value) if seg.value is not None else [seg.literal or ""] * 0:
                    changed = parts[:i + 1] + [alt] + parts[i + 2:]
                    out.append((method, scheme, "/".join(changed) + sep + query, headers, None))
            for i, seg in enumerate(rule.template):
                lit = seg.literal or ""
                if seg.value is None and "%" in lit:
                    changed = parts[:i + 1] + [lit.lower()] + parts[i + 2:]
                    out.append((method, scheme, "/".join(changed) + sep + query, headers, None))
    elif fieldname == "query":
        out += [(method, scheme, path + q, headers, None) for q in ("", "?", "?&", "?a", "?b")]
        if rule is not None and rule.query:
            for p in rule.query:
                for alt in _text_candidates(p.value):
                    out.append((method, scheme, f"{path}?{p.name}={alt}", headers, None))
    elif fieldname == "headers":
        names = [n for n, _ in headers]
        for i, (name, value) in enumerate(headers):  # a header the base needs, in other case spellings
            for spelled in (name.lower(), name.upper(), name.title()):
                out.append((method, scheme, target, headers[:i] + ((spelled, value),) + headers[i + 1:], None))
        candidates = ["x-a", "x-b"] if rule is None else [n for n in rule.headers if n not in [x.lower() for x in names]]
        for name in candidates:
            shaped = {p.name.lower(): p.value for p in rule.header_values} if rule is not None else {}
            values = _text_candidates(shaped[name]) if name in shaped else ["a", "b"]
            for v in values:
                out.append((method, scheme, target, headers + ((name, v),), None))
            out.append((method, scheme, target, headers + ((name.upper(), values[0] if values else "a"),), None))
    elif fieldname == "body":
        out += [(method, scheme, target, headers, b) for b in _bodies(rule)]
    elif fieldname == "destination":
        out += [(method, scheme, target, headers, None)]
    return out


def _text_candidates(value: Value) -> list[str]:
    # Imported here: the judges' example values; only a witness needs them.
    from egress_proxy.decision.shapes import check_of, example_text

    out = [str(e) for e in (value.enum or ()) if type(e) in (str, int)]
    if value.type == "integer":
        lo = value.minimum if value.minimum is not None else 0
        out += [str(lo), str(lo + 1)]
    try:
        example = example_text(check_of(value))
    except ValueError:
        example = None
    if example is not None:
        out += [example, example + example[-1:], example[:-1]]
    out += ["a", "b", "ab"]
    return list(dict.fromkeys(out))


def witness(artifact: Artifact, cap: Capacity) -> Witness:
    """Two requests `cap`'s subject admits that differ only in its top field, both replayed through `decide()` (and
    `judge_body` for a judged body) and admitted; CapacityError when none is found."""
    if not cap.routes or cap.bits == 0:
        raise CapacityError(f"{cap.subject} carries 0 bits: every request it admits is the same one, so no two differ")
    route, top = cap.top
    lease = Lease(subject="capacity-witness", profile=cap.name if cap.kind == "profile" else None,
                  connection=cap.name if cap.kind == "connection" else None, exp=2**62)
    method, scheme, target, headers, rule = _base(artifact, route, top.name)
    if top.name == "destination":
        hosts = ["capacity-a.example.org", "capacity-b.example.org"]
        candidates = [(method, "https", h, 443, target, headers, None) for h in hosts]
    else:
        candidates = [(m, s, route.host, route.port, t, h, b) for m, s, t, h, b in _variants(rule, route, top.name, method, target, headers)]
    fallback = _bodies(rule) if rule is not None and top.name != "body" else []
    found: list[tuple[Request, bytes | None, Decision]] = []
    seen: set[tuple] = set()
    for m, s, host, port, t, h, b in candidates:
        key = (m, s, host, t, h, b)
        if key in seen:
            continue
        seen.add(key)
        req = Request(method=m, scheme=s, host=host, port=port, target=t, headers=h, has_body=b is not None)  # type: ignore[arg-type]
        d = decide(artifact, lease, req, list(WITNESS_IPS))
        if d.allowed and d.body_shape is not None:
            if b is None and fallback:  # the field is in the head: both requests carry the same judged body
                b = fallback[0]
                req = Request(method=m, scheme=s, host=host, port=port, target=t, headers=h, has_body=True)  # type: ignore[arg-type]
            d = judge_body(artifact, lease, req, d, b or b"")
        if not d.allowed or (route.rule is not None and d.rule != route.rule) or (route.rule is None and d.rule is not None):
            continue
        found.append((req, b, d))
        if len(found) == 2:
            (r1, b1, d1), (r2, b2, d2) = found
            return Witness(lease, (r1, r2), (b1, b2), route, top, (d1, d2))
    raise CapacityError(f"{cap.subject}: no two admitted requests differing in the {top.name} of {route.label} were found "
                        "(the figure stands; only the example is missing)")
