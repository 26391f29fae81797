"""shape-confined, stated from docs/shapes.md and the rule's shapes as declared in the artifact.

What a rule's shape admits, over the prover's symbolic parsed values (`proofs.shapes`: texts and JSON values as Z3
terms, names as an index into `labels`, the names the model distinguishes, `None` standing for any other name):

- a value (`compiler.artifact.Value`): of its `type` (`any`: any); one of its `enum` by JSON equality (`true` is
  not `1`); a string no longer than `max_length` characters and matching its `pattern` (the whole text); an
  array of at most `max_length` elements; an integer within `minimum`..`maximum`; a `pattern` admits strings only.
  Where docs/shapes.md is silent this statement is lenient, never stricter than the contract: `max_length` says
  nothing of a boolean, null, number or object, `minimum`/`maximum` nothing of a non-integer.
- a text value (a path segment, a query or header value): `type = "integer"` is canonical decimal digits
  (`-?(0|[1-9][0-9]*)`) whose number the value admits; `string` and `any` the text as a string; any other type
  admits no text.
- a template: exactly its segments, each literal equal, each variable non-empty and admitted;
- a query (when declared): every name listed, none twice, each value admitted;
- header values: each listed header (names compare case-insensitively) at most once, its value admitted;
- MCP: a response only with `responses`; a request or notification only with a listed method; a `tools/call`
  request only for a listed tool, with every required key, no forbidden key, no key the tool does not list unless
  `additional`, and each listed key's value admitted;
- GraphQL: a persisted hash only when listed; a document only with an operation type that has a list (or a query
  with `introspection`), each root field listed for it, `__typename`, or (with `introspection`) `__schema`/`__type`;
- git: each updated ref matches a push pattern (`*` any run of characters but `/`, all else literal), a delete
  (new id zero) only with `delete`, a creation (old id zero, new not) only with `create`.

Nothing here imports `egress_proxy`; patterns go through `compiler.patterns`' AST and `proofs.regex`, the one
translation the evaluator's primitive shares (tested against Python's matcher).
"""

from __future__ import annotations

from typing import Any

import z3

from compiler.artifact import Git, GraphQL, Mcp, Tool, Value
from compiler.patterns import parse_pattern
from proofs.regex import pattern_regex, string

CANONICAL = "-?(0|[1-9][0-9]*)"
INTROSPECTION = ("__schema", "__type")


def _true(ctx: z3.Context) -> z3.BoolRef:
    return z3.BoolVal(True, ctx)


def _or(ctx: z3.Context, terms) -> z3.BoolRef:
    terms = list(terms)
    return z3.Or(*terms) if terms else z3.BoolVal(False, ctx)


def _and(ctx: z3.Context, terms) -> z3.BoolRef:
    terms = list(terms)
    return z3.And(*terms) if terms else z3.BoolVal(True, ctx)


def named(var: z3.ArithRef, labels: tuple[str | None, ...], names) -> z3.BoolRef:
    """The name `var` (an index into `labels`) is one of `names`."""
    ctx = var.ctx
    return _or(ctx, [var == z3.IntVal(k, ctx) for k, label in enumerate(labels) if label is not None and label in names])


def regex(pattern: str, ctx: z3.Context) -> z3.ReRef:
    return pattern_regex(parse_pattern(pattern).node, ctx)


def json_admits(v: Value, x: Any) -> z3.BoolRef:
    """The JSON value `x` (`x.is_json(type name)`, terms `b`, `i`, `s`, `n`) is admitted by `v`."""
    ctx = x.s.ctx
    is_ = x.is_json
    out = []
    if v.type != "any":
        out.append(is_(v.type))
    if v.enum is not None:
        alts = []
        for e in v.enum:
            if e is None:
                alts.append(is_("null"))
            elif isinstance(e, bool):
                alts.append(z3.And(is_("boolean"), x.b == z3.BoolVal(e, ctx)))
            elif isinstance(e, int):
                alts.append(z3.And(is_("integer"), x.i == z3.IntVal(e, ctx)))
            else:
                alts.append(z3.And(is_("string"), x.s == string(e, ctx)))
        out.append(_or(ctx, alts))
    if v.max_length is not None:
        out.append(z3.Implies(is_("string"), z3.Length(x.s) <= v.max_length))
        out.append(z3.Implies(is_("array"), x.n <= v.max_length))
    if v.pattern is not None:
        out.append(z3.And(is_("string"), z3.InRe(x.s, regex(v.pattern, ctx))))
    if v.minimum is not None:
        out.append(z3.Implies(is_("integer"), x.i >= v.minimum))
    if v.maximum is not None:
        out.append(z3.Implies(is_("integer"), x.i <= v.maximum))
    return _and(ctx, out)


class _Text:
    """A text seen as a JSON string (or, for `type = "integer"`, as the integer it spells)."""

    def __init__(self, s: z3.SeqRef, number: z3.ArithRef | None = None) -> None:
        self.s, self.i = s, number if number is not None else z3.IntVal(0, s.ctx)
        self.b, self.n = z3.BoolVal(False, s.ctx), z3.IntVal(0, s.ctx)
        self.integer = number is not None

    def is_json(self, name: str) -> z3.BoolRef:
        return z3.BoolVal(name == ("integer" if self.integer else "string"), self.s.ctx)


def text_admits(v: Value, s: z3.SeqRef) -> z3.BoolRef:
    """The text `s` (a path segment, a query or header value) is admitted by `v`."""
    ctx = s.ctx
    if v.type == "integer":
        negative = z3.PrefixOf(z3.StringVal("-", ctx), s)
        digits = z3.If(negative, z3.SubString(s, 1, z3.Length(s) - 1), s)
        number = z3.If(negative, -z3.StrToInt(digits), z3.StrToInt(digits))
        return z3.And(z3.InRe(s, regex(CANONICAL, ctx)), json_admits(v, _Text(s, number)))
    if v.type not in ("string", "any"):
        return z3.BoolVal(False, ctx)
    return json_admits(v.model_copy(update={"type": "string"}), _Text(s))


def template_admits(template, count: z3.ArithRef, segments: list[z3.SeqRef]) -> z3.BoolRef:
    """The path has exactly the template's segments (`count` of them, `segments[k]` the k-th)."""
    ctx = count.ctx
    out = [count == len(template)]
    for k, seg in enumerate(template):
        if k >= len(segments):
            return z3.BoolVal(False, ctx)
        s = segments[k]
        if seg.value is None:
            out.append(s == string(seg.literal, ctx))
        else:
            out.append(z3.And(z3.Length(s) > 0, text_admits(seg.value, s)))
    return z3.And(*out)


def query_admits(query, count: z3.ArithRef, pairs: list) -> z3.BoolRef:
    """Each of the first `count` pairs `(name var, labels, value text)` names a listed parameter once, value admitted."""
    ctx = count.ctx
    listed = {p.name: p.value for p in query}
    out = []
    for k, (var, labels, value) in enumerate(pairs):
        here = k < count
        ok = _or(ctx, [z3.And(named(var, labels, (name,)), text_admits(v, value)) for name, v in listed.items()])
        twice = _or(ctx, [z3.And(var == other, named(var, labels, listed)) for other, _, _ in pairs[:k]])
        out.append(z3.Implies(here, z3.And(ok, z3.Not(twice))))
    return _and(ctx, out)


def headers_admit(header_values, count: z3.ArithRef, headers: list) -> z3.BoolRef:
    """Each listed header among the first `count` `(name var, labels, value text)` appears once, its value admitted."""
    ctx = count.ctx
    out = []
    for param in header_values:
        lower = param.name.lower()
        hits = [(k < count, named(var, tuple(x.lower() if x is not None else None for x in labels), (lower,)), value)
                for k, (var, labels, value) in enumerate(headers)]
        for k, (here, its, value) in enumerate(hits):
            out.append(z3.Implies(z3.And(here, its), text_admits(param.value, value)))
            for here2, its2, _ in hits[:k]:
                out.append(z3.Not(z3.And(here, its, here2, its2)))
    return _and(ctx, out)


def tool_admits(tool: Tool, arguments: list) -> z3.BoolRef:
    """The arguments `(present, key label or None, value)` satisfy `tool` as declared."""
    ctx = next(iter(arguments))[0].ctx if arguments else z3.main_ctx()
    listed = {p.name: p.value for p in tool.arguments}
    out = []
    for present, key, value in arguments:
        if key is not None and key in tool.required:
            out.append(present)
        if key is not None and key in tool.forbidden:
            out.append(z3.Not(present))
        elif key is not None and key in listed:
            out.append(z3.Implies(present, json_admits(listed[key], value)))
        elif not tool.additional:
            out.append(z3.Not(present))
    for key in tool.required:  # a required key the model cannot present is never there
        if key not in [k for _, k, _ in arguments]:
            out.append(z3.BoolVal(False, ctx))
    return _and(ctx, out)


def mcp_admits(mcp: Mcp, count: z3.ArithRef, messages: list) -> z3.BoolRef:
    """Each of the first `count` messages (`kind` 0 request, 1 notification, 2 response; method, tool: (var, labels);
    arguments: `tool_admits`'s) is one the rule's `mcp` admits."""
    ctx = count.ctx
    out = []
    for k, m in enumerate(messages):
        response = m.kind == 2
        method_ok = named(m.method, m.method_labels, mcp.methods)
        call = z3.And(m.kind == 0, named(m.method, m.method_labels, ("tools/call",)))
        tools = _or(ctx, [z3.And(named(m.tool, m.tool_labels, (t.name,)), tool_admits(t, m.arguments)) for t in mcp.tools])
        ok = z3.If(response, z3.BoolVal(mcp.responses, ctx), z3.And(method_ok, z3.Implies(call, tools)))
        out.append(z3.Implies(k < count, ok))
    return _and(ctx, out)


def graphql_admits(g: GraphQL, count: z3.ArithRef, operations: list) -> z3.BoolRef:
    """Each of the first `count` operations (`persisted`/`document` Bools, `hash` and `document_hash` (what the document
    hashes to) over `hash_labels`, `kind`, `fields`: (var, labels)) is one the rule's `graphql` admits."""
    ctx = count.ctx
    lists = {"query": g.query, "mutation": g.mutation, "subscription": g.subscription}
    out = []
    for k, op in enumerate(operations):
        listed_hash = named(op.hash, op.hash_labels, g.persisted)
        by_kind = []
        for kind, fields in lists.items():
            if not fields and not (g.introspection and kind == "query"):
                continue
            admitted = set(fields) | {"__typename"} | (set(INTROSPECTION) if g.introspection else set())
            each = _and(ctx, [named(f, labels, admitted) for f, labels in op.fields])
            by_kind.append(z3.And(named(op.kind, op.kind_labels, (kind,)), each))
        document_ok = _or(ctx, by_kind)
        hashes = z3.Implies(z3.And(op.persisted, op.document), op.document_hash == op.hash)  # the document is that one
        ok = z3.And(z3.Implies(op.persisted, listed_hash), hashes, z3.Implies(op.document, document_ok),
                    z3.Or(op.persisted, op.document))
        out.append(z3.Implies(k < count, ok))
    return _and(ctx, out)


def ref_regex(pattern: str, ctx: z3.Context) -> z3.ReRef:
    """A push pattern: `*` is any run of characters other than `/`; everything else literal."""
    not_slash = z3.Intersect(z3.AllChar(z3.ReSort(z3.StringSort(ctx))), z3.Complement(z3.Re(z3.StringVal("/", ctx))))
    parts: list[z3.ReRef] = []
    for i, literal in enumerate(pattern.split("*")):
        if i:
            parts.append(z3.Star(not_slash))
        if literal:
            parts.append(z3.Re(string(literal, ctx)))
    if not parts:
        return z3.Re(z3.StringVal("", ctx))
    return parts[0] if len(parts) == 1 else z3.Concat(*parts)


def git_admits(git: Git, count: z3.ArithRef, updates: list) -> z3.BoolRef:
    """Each of the first `count` updates (`old_zero`, `new_zero` Bools, `ref` a string) is one the rule's `git` admits."""
    ctx = count.ctx
    out = []
    for k, (old_zero, new_zero, ref) in enumerate(updates):
        matched = _or(ctx, [z3.InRe(ref, ref_regex(p, ctx)) for p in git.push])
        ok = z3.And(matched, z3.Implies(new_zero, z3.BoolVal(git.delete, ctx)),
                    z3.Implies(z3.And(old_zero, z3.Not(new_zero)), z3.BoolVal(git.create, ctx)))
        out.append(z3.Implies(k < count, ok))
    return _and(ctx, out)
