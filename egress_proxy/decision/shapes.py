"""Request shapes judged (docs/shapes.md): what a request admitted under a rule may carry.

The adapter reads a request once (`egress_proxy.decision.bodies` parses a body; the head's segments, query pairs and
header values are plain text) and this module judges the parsed values against the rule's shape. It never parses
bytes and never sees mitmproxy: every function takes plain values and a frozen `Shape` built from the artifact.

Each judge answers `(reason, where)`: `reason` "" admits; otherwise a reason code of
`egress_proxy.decision.reasons` and `where`, the exact place in words (`segment 3`, `name=state`,
`tool=delete_repo`, `path=$.repo`, `ref=refs/heads/main`): never a value the request carried beyond a name the
rule itself could list (a tool, a field, a ref or a key), shown escaped and cut to 80 characters.

The judges are written so the prover can evaluate them symbolically (`proofs.symexec`, docs/proofs.md): plain `if`,
`for` over tuples and `return`, no mutation of a container in a loop, patterns matched only with
`compiler.patterns.matches`, and a denial's place built only with `shown` (or an f-string), which the prover never
examines. `judge_parts`, `judge_segments`, `judge_pairs`, `judge_headers`, `mcp_refusal`, `graphql_refusal` and
`judge_git` are what it evaluates; the rest reads the request into them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl

from compiler.artifact import Git, GraphQL, Mcp, Rule, Value
from compiler.patterns import Alt, CharSet, Literal, Pattern, PatternError, Repeat, Seq, matches, parse_pattern

OK = ("", "")
INTEGER = parse_pattern("-?(0|[1-9][0-9]{0,18})")  # canonical decimal, at most 19 digits (a 64-bit range)
JSON_TYPES = {"string": (str,), "integer": (int,), "boolean": (bool,), "null": (type(None),), "array": (list,), "object": (dict,)}
INTROSPECTION = frozenset({"__schema", "__type"})
ZERO_OIDS = ("0" * 40, "0" * 64)  # a push's id that creates (old) or deletes (new) a ref
GIT_SERVICES = {"/info/refs": None, "/git-upload-pack": "git-upload-pack", "/git-receive-pack": "git-receive-pack"}
DEFAULT_MAX_BODY = 1 << 20


def shown(name: object) -> str:
    """A name for a denial's `where`: escaped, at most 80 characters."""
    text = str(name).encode("unicode_escape").decode("ascii")
    return text if len(text) <= 80 else text[:77] + "..."


def shown_hash(persisted: str) -> str:
    """A persisted-query hash for a denial's `where`: its first 16 characters."""
    return shown(persisted[:16])


@dataclass(frozen=True, slots=True)
class Check:
    """One `Value` with its pattern parsed once."""

    value: Value
    pattern: Pattern | None


def check_of(value: Value) -> Check:
    """ValueError when the pattern is outside the subset (the compiler refuses it first; a hand-made artifact may not)."""
    try:
        return Check(value, parse_pattern(value.pattern) if value.pattern is not None else None)
    except PatternError as exc:
        raise ValueError(f"pattern: {exc}") from None


@dataclass(frozen=True, slots=True)
class ToolShape:
    name: str
    arguments: dict[str, Check]
    required: tuple[str, ...]
    forbidden: frozenset[str]
    additional: bool


@dataclass(frozen=True, slots=True)
class Shape:
    """A rule's shapes as the judges read them (`shape_of`); `head` false: nothing in the head is judged."""

    rule: str
    prefix: str
    template: tuple[tuple[str | None, Check | None], ...] | None  # (literal, None) or (None, check) per segment
    query: dict[str, Check] | None
    header_values: dict[str, Check]
    mcp: Mcp | None
    tools: dict[str, ToolShape]
    graphql: GraphQL | None
    git: Git | None
    push: tuple[Pattern, ...]
    max_body: int

    @property
    def head(self) -> bool:
        return self.template is not None or self.query is not None or bool(self.header_values) or self.git is not None

    @property
    def body(self) -> str:
        """The protocol whose body this rule judges ("" : none)."""
        return "mcp" if self.mcp is not None else "graphql" if self.graphql is not None else "git" if self.git is not None else ""


def ref_pattern(pattern: str) -> Pattern:
    """A git ref pattern as a pattern of the subset: `*` is any run of characters other than `/` (`[^/]*`); every other
    character is literal (ValueError on a control character, which no ref holds)."""
    escaped = "[^/]*".join("".join("\\" + c if c in _REF_META else c for c in part) for part in pattern.split("*"))
    try:
        return parse_pattern(escaped)
    except PatternError as exc:
        raise ValueError(f"ref pattern: {exc}") from None


_REF_META = frozenset("\\.[]()|?*+{}^$/-")


def shape_of(rule: Rule) -> Shape | None:
    """The rule's shape table, or None when the rule has no shape at all (ValueError on a malformed pattern)."""
    if (rule.template is None and rule.query is None and not rule.header_values and rule.mcp is None
            and rule.graphql is None and rule.git is None):
        return None
    template = None
    if rule.template is not None:
        template = tuple((s.literal, None) if s.value is None else (None, check_of(s.value)) for s in rule.template)
    tools: dict[str, ToolShape] = {}
    if rule.mcp is not None:
        for tool in rule.mcp.tools:
            tools[tool.name] = ToolShape(tool.name, {p.name: check_of(p.value) for p in tool.arguments}, tool.required,
                                         frozenset(tool.forbidden), tool.additional)
    return Shape(
        rule=rule.name,
        prefix=rule.path_prefix,
        template=template,
        query=None if rule.query is None else {p.name: check_of(p.value) for p in rule.query},
        header_values={p.name.lower(): check_of(p.value) for p in rule.header_values},
        mcp=rule.mcp,
        tools=tools,
        graphql=rule.graphql,
        git=rule.git,
        push=tuple(ref_pattern(p) for p in rule.git.push) if rule.git is not None else (),
        max_body=rule.max_body or DEFAULT_MAX_BODY,
    )


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------


def in_enum(enum: tuple[object, ...], x: object) -> bool:
    """`x` is one of `enum`, by an equality that keeps JSON types apart (`true` is not `1`, `1.0` is not `1`)."""
    for e in enum:
        if type(e) is type(x) and e == x:
            return True
    return False


def judge_json(check: Check, x: object) -> str:
    """Why the JSON value `x` is outside `check` ("" : inside)."""
    v = check.value
    if v.type != "any":
        kinds = JSON_TYPES[v.type]
        if type(x) not in kinds:  # exact: a bool is no integer, a float no integer
            return f"not {'an' if v.type in ('integer', 'array', 'object') else 'a'} {v.type}"
    if v.enum is not None and not in_enum(v.enum, x):
        return "not one of the allowed values"
    if type(x) is str:
        if v.max_length is not None and len(x) > v.max_length:
            return f"longer than {v.max_length} characters"
        if check.pattern is not None and not matches(check.pattern, x):
            return "does not match the pattern"
    elif type(x) is list:
        if v.max_length is not None and len(x) > v.max_length:
            return f"more than {v.max_length} elements"
        if check.pattern is not None:  # a pattern constrains strings (found by shape-confined on a hand-made artifact)
            return "not a string"
    elif type(x) is int:
        if v.minimum is not None and x < v.minimum:
            return f"below {v.minimum}"
        if v.maximum is not None and x > v.maximum:
            return f"above {v.maximum}"
        if check.pattern is not None or v.max_length is not None:
            return "not a string"
    elif check.pattern is not None:
        return "not a string"
    return ""


def judge_text(check: Check, text: str) -> str:
    """Why a text value (a path segment, a query or header value) is outside `check` ("" : inside)."""
    v = check.value
    if v.type == "integer":
        if not matches(INTEGER, text):
            return "not an integer (canonical decimal digits)"
        return judge_json(check, int(text))
    if v.type not in ("string", "any"):
        return f"a text value is never {v.type}"
    return judge_json(check, text)


# ---------------------------------------------------------------------------------------------
# The head: template, query, header values, git's service
# ---------------------------------------------------------------------------------------------


def judge_path(shape: Shape, path: str) -> tuple[str, str]:
    """The normalized path (no query) against the template."""
    if shape.template is None:
        return OK
    return judge_segments(shape, tuple(path.split("/")[1:]))


def judge_segments(shape: Shape, segments: tuple[str, ...]) -> tuple[str, str]:
    """The path's segments (what follows each `/`) against the template (`shape.template` set)."""
    template = shape.template
    assert template is not None
    if len(segments) != len(template):
        return "path-template-mismatch", f"{len(segments)} segments, the template has {len(template)}"
    for i, pair in enumerate(zip(segments, template)):
        segment, part = pair
        literal, check = part
        if check is None:
            if segment != literal:
                return "path-template-mismatch", f"segment {i + 1} is not `{shown(literal)}`"
        elif segment == "":
            return "path-template-mismatch", f"segment {i + 1} is empty"
        else:
            why = judge_text(check, segment)
            if why:
                return "path-template-mismatch", f"segment {i + 1}: {why}"
    return OK


def query_gap(query: str) -> str:
    """Where a present query (after `?`) holds a place without a parameter ("" : none): `an empty query` for `?`
    alone, `an empty parameter at position N` for an empty `&`-separated component (a leading, trailing or doubled
    `&`). The pairs read past those places, and the edge forwards the target as written, so each would be another
    request upstream that the judges could not tell apart: a channel no shape accounts for."""
    if query == "":
        return "an empty query"
    for i, part in enumerate(query.split("&")):
        if part == "":
            return f"an empty parameter at position {i + 1}"
    return ""


def query_pairs(query: str) -> list[tuple[str, str]] | None:
    """The query's `name=value` pairs, percent-decoded once as UTF-8 (`+` is a space); None when it does not decode or
    when it has a place without a parameter (`query_gap`: `?` alone, an empty `&` component). Every judge of a query
    reads it through here, so none admits what another would refuse."""
    if query_gap(query):
        return None
    try:
        return parse_qsl(query, keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        return None


def judge_query(shape: Shape, query: str | None) -> tuple[str, str]:
    """The raw query (after `?`: "" for `?` alone, None when the target has no `?`) against the rule's `query`."""
    if shape.query is None or query is None:
        return OK
    gap = query_gap(query)
    if gap:
        return "query-parameter-not-allowed", gap
    pairs = query_pairs(query)
    if pairs is None:
        return "query-value-refused", "the query does not decode to UTF-8"
    return judge_pairs(shape, tuple(pairs))


def judge_pairs(shape: Shape, pairs: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """The query's decoded pairs against the rule's `query` (set): each name listed, at most once, its value admitted."""
    query = shape.query
    assert query is not None
    for i, pair in enumerate(pairs):
        name, value = pair
        check = query.get(name)
        if check is None:
            return "query-parameter-not-allowed", f"name={shown(name)}"
        for j in range(i):
            if pairs[j][0] == name:
                return "query-parameter-repeated", f"name={shown(name)}"
        why = judge_text(check, value)
        if why:
            return "query-value-refused", f"name={shown(name)}: {why}"
    return OK


def judge_headers(shape: Shape, headers: Iterable[tuple[str, str]]) -> tuple[str, str]:
    """The request's header values against `header_values` (lowercase names): each listed name at most once."""
    if not shape.header_values:
        return OK
    items = tuple(headers)
    for i, item in enumerate(items):
        name, value = item
        lower = name.lower()
        check = shape.header_values.get(lower)
        if check is not None:
            for j in range(i):
                if items[j][0].lower() == lower:
                    return "header-value-refused", f"name={shown(lower)}: given twice"
            why = judge_text(check, value)
            if why:
                return "header-value-refused", f"name={shown(lower)}: {why}"
    return OK


def git_service(shape: Shape, method: str, path: str, query: str | None) -> tuple[str, str, str]:
    """(reason, where, service) of a git rule's request: which smart-HTTP service it is, and whether the rule
    admits it. `service` is `git-upload-pack` or `git-receive-pack`."""
    assert shape.git is not None
    base = "" if shape.prefix == "/" else shape.prefix
    tail = path[len(base):] if path.startswith(base) else None
    if tail not in GIT_SERVICES:
        return "git-service-not-allowed", "not a smart-HTTP endpoint below the rule's path", ""
    service = GIT_SERVICES[tail]
    if service is None:  # info/refs: the service is named by the query, and nothing else may be
        pairs = query_pairs(query or "")
        if method not in ("GET", "HEAD") or pairs is None or len(pairs) != 1 or pairs[0][0] != "service":
            return "git-service-not-allowed", "`info/refs` takes GET with one `service` parameter", ""
        service = pairs[0][1]
        if service not in ("git-upload-pack", "git-receive-pack"):
            return "git-service-not-allowed", f"service {shown(service)}", ""
    elif method != "POST" or query is not None:
        return "git-service-not-allowed", f"`{tail[1:]}` takes POST with no query", ""
    if service == "git-upload-pack" and not shape.git.fetch:
        return "git-service-not-allowed", "fetch is not allowed", service
    if service == "git-receive-pack" and not shape.git.push:
        return "git-service-not-allowed", "push is not allowed", service
    return "", "", service


def judge_head(shape: Shape, method: str, path: str, query: str | None, headers: Iterable[tuple[str, str]]) -> tuple[str, str]:
    """Every head shape of the rule, in order: git's service (which paths a git rule has), the template, the query,
    the header values. A git rule's query is its service's, so `query` does not apply to it. `query` is the raw query
    ("" for `?` alone, None when the target has no `?`): under a declared `query`, a present query with a place
    without a parameter (`query_gap`) is refused, after the template."""
    if shape.git is not None:
        reason, where, _ = git_service(shape, method, path, query)
        if reason:
            return reason, where
    segments = tuple(path.split("/")[1:]) if shape.template is not None else ()
    pairs: tuple[tuple[str, str], ...] | None = ()
    if shape.query is not None and shape.git is None and query is not None:
        gap = query_gap(query)
        if gap:
            reason, where = judge_segments(shape, segments) if shape.template is not None else OK
            return (reason, where) if reason else ("query-parameter-not-allowed", gap)
        decoded = query_pairs(query)
        pairs = tuple(decoded) if decoded is not None else None
    return judge_parts(shape, segments, pairs, tuple(headers))


def judge_parts(shape: Shape, segments: tuple[str, ...], pairs: tuple[tuple[str, str], ...] | None,
                headers: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """The head's template, query and header values, in that order, on the path's segments, the decoded query pairs
    (None: the query does not decode) and the headers; git's service is judged before (`judge_head`)."""
    if shape.template is not None:
        reason, where = judge_segments(shape, segments)
        if reason:
            return reason, where
    if shape.query is not None and shape.git is None:
        if pairs is None:
            return "query-value-refused", "the query does not decode to UTF-8"
        reason, where = judge_pairs(shape, pairs)
        if reason:
            return reason, where
    return judge_headers(shape, headers)


def body_to_judge(shape: Shape, method: str, path: str, query: str | None) -> str:
    """The protocol whose body the edge must hold and judge for this (admitted) request ("" : none): an MCP or
    GraphQL POST, and a git push (`git-receive-pack` POST). GraphQL over GET is judged in the head."""
    if method != "POST":
        return ""
    if shape.git is not None:
        return "git" if git_service(shape, method, path, query)[2] == "git-receive-pack" else ""
    return shape.body


# ---------------------------------------------------------------------------------------------
# Bodies: MCP, GraphQL, git (parsed by egress_proxy.decision.bodies)
# ---------------------------------------------------------------------------------------------


def judge_arguments(tool: ToolShape, arguments: object) -> tuple[str, str]:
    """A `tools/call`'s `arguments` (an object) against the tool's."""
    if type(arguments) is not dict:
        return "mcp-argument-refused", "path=$: not an object"
    for key in tool.required:
        if key not in arguments:
            return "mcp-argument-refused", f"path=$.{shown(key)}: required"
    for key, value in arguments.items():
        if key in tool.forbidden:
            return "mcp-argument-refused", f"path=$.{shown(key)}: forbidden"
        check = tool.arguments.get(key)
        if check is None:
            if not tool.additional:
                return "mcp-argument-refused", f"path=$.{shown(key)}: not an allowed argument"
        else:
            why = judge_json(check, value)
            if why:
                return "mcp-argument-refused", f"path=$.{shown(key)}: {why}"
    return OK


def judge_mcp(shape: Shape, messages: Iterable[tuple[str, str | None, str | None, object]]) -> tuple[str, str, tuple[str, ...]]:
    """An MCP POST's messages, each `(kind, method, tool, arguments)` (kind `request`, `notification`, `response`;
    `tool`/`arguments` set for a `tools/call`): every one must be admitted (a batch is judged whole). Returns
    (reason, where, indexes of the `tools/list` requests) -- the edge filters the answers to those."""
    items = tuple(messages)
    reason, where = mcp_refusal(shape, items)
    if reason:
        return reason, where, ()
    return "", "", tuple(str(i) for i, m in enumerate(items) if m[1] == "tools/list" and m[0] == "request")


def mcp_refusal(shape: Shape, messages: tuple[tuple[str, str | None, str | None, object], ...]) -> tuple[str, str]:
    """The first message of `messages` the rule's `mcp` refuses, as (reason, where); OK when it admits them all."""
    mcp = shape.mcp
    assert mcp is not None
    for i, message in enumerate(messages):
        kind, method, tool, arguments = message
        at = f"index={i} " if i else ""
        if kind == "response":
            if not mcp.responses:
                return "mcp-method-not-allowed", f"{at}method=(a response)"
        elif method not in mcp.methods:
            return "mcp-method-not-allowed", f"{at}method={shown(method)}"
        elif method == "tools/call":
            allowed = shape.tools.get(tool) if type(tool) is str else None
            if allowed is None:
                return "mcp-tool-not-allowed", f"{at}tool={shown(tool)}"
            reason, where = judge_arguments(allowed, arguments)
            if reason:
                return reason, f"{at}tool={shown(tool)} {where}"
    return OK


def document_hash(document: str) -> str:
    """The sha256 hex of a GraphQL document (what a persisted-query hash names)."""
    return hashlib.sha256(document.encode("utf-8", "surrogatepass")).hexdigest()


def operation_fields(g: GraphQL, kind: str) -> tuple[str, ...]:
    """The root fields an operation of type `kind` may select (none: the type is not admitted)."""
    if kind == "query":
        return g.query
    if kind == "mutation":
        return g.mutation
    if kind == "subscription":
        return g.subscription
    return ()


def judge_graphql(shape: Shape, operations: Iterable[tuple[str | None, str | None, str | None, tuple[str, ...]]]) -> tuple[str, str]:
    """GraphQL requests, each `(document, persisted hash, operation type, root field names)` (type None: a persisted
    query sent without its document): every one must be admitted."""
    return graphql_refusal(shape, tuple(operations))


def graphql_refusal(shape: Shape, operations: tuple[tuple[str | None, str | None, str | None, tuple[str, ...]], ...]) -> tuple[str, str]:
    """The first operation the rule's `graphql` refuses, as (reason, where); OK when it admits them all."""
    g = shape.graphql
    assert g is not None
    for i, operation in enumerate(operations):
        document, persisted, kind, fields = operation
        at = f"index={i} " if i else ""
        if persisted is not None:
            if persisted not in g.persisted:
                return "graphql-persisted-query-not-allowed", f"{at}hash={shown_hash(persisted)}"
            if document is not None and document_hash(document) != persisted:
                return "graphql-persisted-query-not-allowed", f"{at}the document does not hash to its persisted-query hash"
        if persisted is None or document is not None:  # a listed hash alone: the operator admitted that exact document
            if kind is None:
                return "body-malformed", f"{at}no query document"
            allowed = operation_fields(g, kind)
            if not allowed and not (g.introspection and kind == "query"):
                return "graphql-operation-not-allowed", f"{at}operation={kind}"
            for field in fields:
                if field in INTROSPECTION:
                    if not g.introspection:
                        return "graphql-introspection-refused", f"{at}field={field}"
                elif field != "__typename" and field not in allowed:
                    return "graphql-field-not-allowed", f"{at}{kind} field={shown(field)}"
    return OK


def ref_allowed(push: tuple[Pattern, ...], ref: str) -> bool:
    """`ref` matches one of the rule's push patterns."""
    for p in push:
        if matches(p, ref):
            return True
    return False


def judge_git(shape: Shape, updates: Iterable[tuple[str, str, str]]) -> tuple[str, str]:
    """A push's ref updates, each `(old id, new id, ref)`."""
    git = shape.git
    assert git is not None
    for update in tuple(updates):
        old, new, ref = update
        if not ref_allowed(shape.push, ref):
            return "git-ref-not-allowed", f"ref={shown(ref)}"
        if new in ZERO_OIDS:
            if not git.delete:
                return "git-delete-refused", f"ref={shown(ref)}"
        elif old in ZERO_OIDS and not git.create:
            return "git-create-refused", f"ref={shown(ref)}"
    return OK


# ---------------------------------------------------------------------------------------------
# Examples: a request head a shape admits (the prover's witnesses, `explain`'s hints)
# ---------------------------------------------------------------------------------------------


def _pattern_example(node: object) -> str:
    """The shortest text the pattern AST matches (its first choice at every `|`)."""
    if isinstance(node, Literal):
        return node.char
    if isinstance(node, CharSet):
        if not node.negated:
            return node.ranges[0][0]
        for c in "a0_-.~":  # a character outside every range
            if not any(lo <= c <= hi for lo, hi in node.ranges):
                return c
        return "z" if not any(lo <= "z" <= hi for lo, hi in node.ranges) else "\u00e9"
    if isinstance(node, Seq):
        return "".join(_pattern_example(n) for n in node.items)
    if isinstance(node, Alt):
        return _pattern_example(node.options[0])
    if isinstance(node, Repeat):
        return _pattern_example(node.item) * node.low
    raise TypeError(f"not a pattern node: {node!r}")


def example_text(check: Check) -> str | None:
    """A text value `check` admits, or None when this module finds none (`explain` then names the constraint)."""
    v = check.value
    candidates: list[str] = []
    if v.enum is not None:
        candidates += [e if type(e) is str else str(e) for e in v.enum if type(e) in (str, int)]
    elif v.type == "integer":
        low = v.minimum if v.minimum is not None else (0 if v.maximum is None or v.maximum >= 0 else v.maximum)
        candidates.append(str(low))
    elif check.pattern is not None:
        candidates.append(_pattern_example(check.pattern.node))
    else:
        candidates.append("x")
    for text in candidates:
        if not judge_text(check, text):
            return text
    return None


def example_target(shape: Shape) -> str | None:
    """A request target (path and query) the head shapes admit, or None when none is found."""
    if shape.git is not None:
        base = "" if shape.prefix == "/" else shape.prefix
        service = "git-upload-pack" if shape.git.fetch else "git-receive-pack"
        return f"{base}/info/refs?service={service}"
    path = shape.prefix
    if shape.template is not None:
        parts = []
        for literal, check in shape.template:
            text = literal if check is None else example_text(check)
            if text is None:
                return None
            parts.append(text)
        path = "/" + "/".join(parts)
    return path
