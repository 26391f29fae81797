"""Request shapes proved: the judges of `egress_proxy.decision.shapes`, evaluated symbolically on parsed values.

For one rule with a shape, `ShapeModel` builds symbolic parsed values in a fresh Z3 context and runs the judges'
own source on them (`proofs.symexec` with `SHAPE_MODULES`):

- the head (`shapes.judge_parts`): the path's segments (Z3 strings over the characters a normalized path holds:
  the template's count, one fewer and one more), the decoded query pairs (none, one or two: each name one of the
  listed parameters or any other, each value any text) and header values (none, one or two: each name a listed
  header in lower or title case, or another, each value any text without control characters but HTAB);
- an MCP body (`shapes.mcp_refusal`): one message or a batch of two, each a request, notification or response
  naming a listed method, `tools/call`, `tools/list` or any other; a `tools/call` request names a listed tool or any
  other, and its arguments hold every key any tool lists, requires or forbids plus any other key, each present or
  not, each of any JSON type (a string, integer, number, boolean, null, or an array of any length, or an object);
- a GraphQL body (`shapes.graphql_refusal`): one request or a batch of two, each with a document (an operation type
  and two root fields, each a listed field, `__typename`, `__schema`, `__type` or any other) and a persisted hash
  (a listed one or any other), either or both;
- a git push (`shapes.judge_git`): one or two updates, each old and new id zero or not (sha1 or sha256 ids), each ref
  any string git's command line admits.

`shape-confined` asks `admitted ∧ ¬statement` (`proofs/spec/shapes.py`, from the artifact as declared); a model
is built into a concrete request (and body) and replayed through `decide` and `adapter.judge_body` before it is
reported refuted. `vacuity` asks, per template, tool, GraphQL field and push pattern, for an admitted witness,
replayed the same way.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable
from urllib.parse import urlencode

import z3

from compiler.artifact import Artifact, Rule
from egress_proxy.decision import shapes
from egress_proxy.decision.adapter import judge_body
from egress_proxy.decision.types import Decision, Request
from proofs.solve import Limits, check
from proofs.spec import shapes as spec
from proofs.symexec import (
    JSON_TYPES,
    SHAPE_MODULES,
    Atom,
    Domain,
    Evaluator,
    Hidden,
    SymArgs,
    SymJson,
    Unsupported,
    char_class,
)

# What a normalized path segment may hold (compiler.normalize: RFC 3986 pchar and percent-escapes; no `/` or `;`).
SEGMENT_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,=:@%"
IDS = {40: ("0" * 40, "1" * 40), 64: ("0" * 64, "1" * 64)}  # (zero, non-zero) object ids: sha1 and sha256
METHOD_KINDS = ("request", "notification", "response")
KINDS = ("query", "mutation", "subscription")
PUBLIC_ANSWERS = ("93.184.215.14", "8.8.8.8", "1.1.1.1")
MAX_ITEMS = 2  # messages, operations, updates, query pairs, header values per question


def _chars(chars: str, ctx: z3.Context) -> z3.ReRef:
    return char_class(chars, ctx)  # runs of consecutive characters as ranges (what Z3's regex solver is quick on)


def _range(lo: str, hi: str, ctx: z3.Context) -> z3.ReRef:
    return z3.Range(lo, hi, ctx)


@dataclass
class Names:
    """A name: an index into `labels` (`None` stands for any other name), the judge's view a Choice of the labels and
    an `Atom` for the other one (exact for equality with the labels only)."""

    var: z3.ArithRef
    labels: tuple[str | None, ...]
    value: Any
    other: str  # the text a counterexample uses for "any other"

    def text(self, model: z3.ModelRef) -> str:
        k = model.eval(self.var, model_completion=True).as_long()
        label = self.labels[k]
        return label if label is not None else self.other


@dataclass
class Question:
    """One rule's judge on its symbolic inputs: `admitted` (Bool), the statement, well-formedness, how to replay."""

    admitted: Any
    statement: Any
    wf: list
    build: Callable[[z3.ModelRef], tuple[Request, bytes | None, str]]  # the request, its body, a description
    extra: dict = field(default_factory=dict)


class ShapeModel:
    """Symbolic inputs and questions for one rule (`rule`, its judge's `shape`) in context `ctx`."""

    def __init__(self, ctx: z3.Context, rule: Rule, shape: shapes.Shape, others: tuple[tuple[Rule, shapes.Shape], ...] = ()) -> None:
        self.ctx, self.rule, self.shape = ctx, rule, shape
        self.others = others  # rules judged on the same inputs (`Question.extra["others"]`: their `admitted`)
        self.all = ((rule, shape), *others)
        self.ev = Evaluator(ctx, SHAPE_MODULES)
        self.wf: list = []
        self._n = 0
        self._others: dict[tuple, Atom] = {}

    # -- values ----------------------------------------------------------------------------------------

    def _name(self, base: str) -> str:
        self._n += 1
        return f"{base}{self._n}"

    def text(self, base: str, alphabet: z3.ReRef | None = None) -> SymJson:
        ctx = self.ctx
        s = z3.String(self._name(base), ctx)
        if alphabet is not None:
            self.wf.append(z3.InRe(s, z3.Star(alphabet)))
        zero = z3.IntVal(0, ctx)
        return SymJson(z3.IntVal(JSON_TYPES.index(str), ctx), z3.BoolVal(False, ctx), zero, z3.RealVal(0, ctx), s, zero, (str,))

    def json(self, base: str) -> SymJson:
        ctx = self.ctx
        n = self._name(base)
        tag = z3.Int(f"{n}_tag", ctx)
        size = z3.Int(f"{n}_n", ctx)
        self.wf += [tag >= 0, tag < len(JSON_TYPES), size >= 0, size <= 4096]
        return SymJson(tag, z3.Bool(f"{n}_b", ctx), z3.Int(f"{n}_i", ctx), z3.Real(f"{n}_r", ctx), z3.String(f"{n}_s", ctx),
                       size, JSON_TYPES)

    def names(self, base: str, kind: str, listed, other: str) -> Names:
        ctx = self.ctx
        labels = tuple(sorted(set(listed))) + (None,)
        while other in labels:
            other = "z" + other
        var = z3.Int(self._name(base), ctx)
        self.wf += [var >= 0, var < len(labels)]
        atom = self._others.get((kind, labels))  # one domain per kind of name: "any other" names compare equal
        if atom is None:
            atom = self._others[(kind, labels)] = Atom(f"<any other {kind}>", Domain(kind, [x for x in labels if x is not None]), True)
        value = self.ev.choice([(var == k, x if x is not None else atom) for k, x in enumerate(labels)])
        return Names(var, labels, value, other)

    def plain_names(self, base: str, labels: tuple[str, ...]) -> Names:
        """A name of finitely many concrete texts (header names: the judge lowercases them)."""
        var = z3.Int(self._name(base), self.ctx)
        self.wf += [var >= 0, var < len(labels)]
        value = self.ev.choice([(var == k, x) for k, x in enumerate(labels)])
        return Names(var, labels, value, labels[-1])

    def count(self, base: str, allowed) -> z3.ArithRef:
        var = z3.Int(self._name(base), self.ctx)
        self.wf.append(z3.Or([var == k for k in allowed]))
        return var

    def judged(self, fn, variants: list[tuple[Any, tuple]], shape: shapes.Shape | None = None) -> Any:
        """Or over variants (guard, args) of `fn(shape, *args)` admitting (its reason "")."""
        ev = self.ev
        out = []
        for guard, args in variants:
            result = ev.call(fn, shape if shape is not None else self.shape, *args)
            reason = result[0] if type(result) is tuple else ev.choice([(g, r[0]) for g, r in ev.alternatives(result)])
            out.append(ev.and_(guard, ev.eq(reason, "")))
        return ev.bool_term(ev.or_(*out))

    def judged_all(self, fn, variants: list[tuple[Any, tuple]], same: Callable[[shapes.Shape], bool]) -> tuple[Any, list]:
        """`judged` for this rule, and for each other rule (None when `same` says its judge takes other inputs)."""
        return self.judged(fn, variants), [self.judged(fn, variants, sh) if same(sh) else None for _, sh in self.others]

    # -- the head ----------------------------------------------------------------------------------------

    def head(self) -> Question | None:
        shape, rule, ctx = self.shape, self.rule, self.ctx
        query = shape.query is not None and shape.git is None
        if shape.template is None and not query and not shape.header_values:
            return None
        seg_counts = sorted({c for _, sh in self.all if sh.template is not None
                             for c in (max(1, len(sh.template) - 1), len(sh.template), len(sh.template) + 1)}) or [0]
        segs = [self.text("segment", _chars(SEGMENT_CHARS, ctx)) for _ in range(max(seg_counts))]
        seg_count = self.count("segments", seg_counts)
        any_query = any(sh.query is not None and sh.git is None for _, sh in self.all)
        pair_counts = list(range(MAX_ITEMS + 1)) if any_query else [0]
        query_names = [p.name for r, _ in self.all for p in r.query or ()]
        pairs = [(self.names("query_name", "query parameter", query_names, "zz_other"),
                  self.text("query_value")) for _ in range(max(pair_counts))]
        pair_count = self.count("pairs", pair_counts)
        head_counts = list(range(MAX_ITEMS + 1)) if any(sh.header_values for _, sh in self.all) else [0]
        labels = []
        for name in sorted({n for _, sh in self.all for n in sh.header_values}):
            labels += [name, "-".join(w.capitalize() for w in name.split("-"))]
        labels.append("x-egresslaw-other")
        value_chars = z3.Union(z3.Re(z3.StringVal("\t", ctx)), _range(" ", "~", ctx), _range("\x80", "\U0002ffff", ctx))
        headers = [(self.plain_names("header", tuple(dict.fromkeys(labels))), self.text("header_value", value_chars))
                   for _ in range(max(head_counts))]
        head_count = self.count("headers", head_counts)
        # Every query and header count with each template's own segment count; the other segment counts (one fewer,
        # one more) with neither query nor headers: the count check comes first, so they add nothing combined.
        exact = {len(sh.template) for _, sh in self.all if sh.template is not None} or {0}
        combos = [(a, b, c) for a in seg_counts for b in pair_counts for c in head_counts if a in exact or (b == 0 and c == 0)]
        variants = []
        for a, b, c in combos:
            guard = z3.And(seg_count == a, pair_count == b, head_count == c)
            args = (tuple(segs[:a]), tuple((nm.value, v) for nm, v in pairs[:b]), tuple((nm.value, v) for nm, v in headers[:c]))
            variants.append((guard, args))
        self.wf.append(z3.Or([z3.And(seg_count == a, pair_count == b, head_count == c) for a, b, c in combos]))
        admitted, others = self.judged_all(shapes.judge_parts, variants, lambda sh: True)
        # The same judges one part at a time (the statement's parts are separate questions: much cheaper than the whole,
        # once `judge_parts` is shown to admit only what each part admits).
        pieces, parts = [], []
        if rule.template is not None:
            parts.append(spec.template_admits(rule.template, seg_count, [s.s for s in segs]))
            pieces.append(self.judged(shapes.judge_segments, [(seg_count == a, (tuple(segs[:a]),)) for a in seg_counts]))
        if query:
            parts.append(spec.query_admits(rule.query, pair_count, [(nm.var, nm.labels, v.s) for nm, v in pairs]))
            pieces.append(self.judged(shapes.judge_pairs, [(pair_count == b, (tuple((nm.value, v) for nm, v in pairs[:b]),))
                                                           for b in pair_counts]))
        if rule.header_values:
            parts.append(spec.headers_admit(rule.header_values, head_count, [(nm.var, nm.labels, v.s) for nm, v in headers]))
            pieces.append(self.judged(shapes.judge_headers, [(head_count == c, (tuple((nm.value, v) for nm, v in headers[:c]),))
                                                             for c in head_counts]))
        statement = z3.And(*parts) if parts else z3.BoolVal(True, ctx)

        def build(model: z3.ModelRef) -> tuple[Request, bytes | None, str]:
            count = model.eval(seg_count, model_completion=True).as_long()
            path = "/" + "/".join(_string(model, s.s) for s in segs[:count]) if shape.template is not None else None
            if shape.git is not None:
                base = "" if shape.prefix == "/" else shape.prefix
                path = f"{base}/info/refs"
            elif path is None:
                path = shape.prefix
            qs = [(nm.text(model), _string(model, v.s)) for nm, v in pairs[:model.eval(pair_count, model_completion=True).as_long()]]
            if shape.git is not None:
                qs = [("service", "git-upload-pack" if shape.git.fetch else "git-receive-pack")]
            hs = [(nm.text(model), _string(model, v.s)) for nm, v in headers[:model.eval(head_count, model_completion=True).as_long()]]
            target = path + ("?" + urlencode(qs) if qs else "")
            method = "GET" if "GET" in rule.methods else sorted(rule.methods)[0]
            req = Request(method=method, scheme="https", host=rule.host, port=rule.port, target=target, headers=tuple(hs))
            return req, None, f"`{method} {target}`" + "".join(f" {k}: {v}" for k, v in hs)

        return Question(admitted, statement, list(self.wf), build, {"segments": segs, "seg_count": seg_count, "pair_count": pair_count,
                                                             "head_count": head_count, "others": others,
                                                             "pieces": list(zip(pieces, parts))})

    # -- bodies ------------------------------------------------------------------------------------------

    def body(self) -> Question | None:
        if self.shape.mcp is not None:
            return self.mcp()
        if self.shape.graphql is not None:
            return self.graphql()
        if self.shape.git is not None and self.shape.git.push:
            return self.git()
        return None

    def mcp(self) -> Question:
        shape, ctx, ev = self.shape, self.ctx, self.ev
        mcp = shape.mcp
        assert mcp is not None
        every = [sh.mcp for _, sh in self.all if sh.mcp is not None]
        keys = sorted({k for m in every for t in m.tools for k in [*(p.name for p in t.arguments), *t.required, *t.forbidden]})
        key_domain = Domain("argument key", keys)
        other_key = Atom("<any other argument key>", key_domain, True)
        other_text = "zz_other_key"
        while other_text in keys:
            other_text = "z" + other_text
        messages = []
        for k in range(MAX_ITEMS):
            kind = z3.Int(self._name("kind"), ctx)
            self.wf += [kind >= 0, kind <= 2]
            method = self.names("method", "method", [*(x for m in every for x in m.methods), "tools/call", "tools/list"], "zz/other")
            tool = self.names("tool", "tool", [t.name for m in every for t in m.tools], "zz_other_tool")
            slots = [(z3.Bool(self._name("present"), ctx), key, self.json("argument")) for key in [*keys, other_key]]
            call = z3.And(kind == 0, method.var == method.labels.index("tools/call"))
            kind_value = ev.choice([(kind == i, name) for i, name in enumerate(METHOD_KINDS)])
            method_value = ev.merge(kind == 2, None, method.value)
            tool_value = ev.merge(call, tool.value, None)
            messages.append(_Message(kind, method, tool, slots, (kind_value, method_value, tool_value, SymArgs(slots))))
        count = self.count("messages", range(1, MAX_ITEMS + 1))
        admitted, others = self.judged_all(shapes.mcp_refusal, [(count == L, (tuple(m.judged for m in messages[:L]),))
                                                                 for L in range(1, MAX_ITEMS + 1)], lambda sh: sh.mcp is not None)
        statement = spec.mcp_admits(mcp, count, [m.spec_view() for m in messages])

        def build(model: z3.ModelRef) -> tuple[Request, bytes | None, str]:
            L = model.eval(count, model_completion=True).as_long()
            items = []
            for i, m in enumerate(messages[:L]):
                kind = model.eval(m.kind, model_completion=True).as_long()
                if kind == 2:
                    items.append({"jsonrpc": "2.0", "id": i + 1, "result": {}})
                    continue
                method = m.method.text(model)
                params: dict = {}
                if kind == 0 and method == "tools/call":
                    arguments = {}
                    for present, key, value in m.slots:
                        if z3.is_true(model.eval(present, model_completion=True)):
                            arguments[key if isinstance(key, str) else other_text] = _json(model, value)
                    params = {"name": m.tool.text(model), "arguments": arguments}
                item = {"jsonrpc": "2.0", "method": method, "params": params}
                if kind == 0:
                    item["id"] = i + 1
                items.append(item)
            doc = items[0] if L == 1 else items
            text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
            return self._post("application/json"), text.encode("utf-8"), f"body `{text}`"

        return Question(admitted, statement, list(self.wf), build,
                        {"messages": messages, "count": count, "other_key": other_text, "others": others})

    def graphql(self) -> Question:
        shape, ctx, ev = self.shape, self.ctx, self.ev
        g = shape.graphql
        assert g is not None
        every = [sh.graphql for _, sh in self.all if sh.graphql is not None]
        fields = sorted({f for x in every for f in (*x.query, *x.mutation, *x.subscription)} | {"__typename", *spec.INTROSPECTION})
        ops = []
        for _ in range(MAX_ITEMS):
            has_doc, has_hash = z3.Bool(self._name("document"), ctx), z3.Bool(self._name("persisted"), ctx)
            digest = self.names("hash", "persisted hash", [h for x in every for h in x.persisted], "0" * 63 + "1")
            hashed = z3.Int(self._name("document_hash"), ctx)  # what the document hashes to: any of the same names
            self.wf += [hashed >= 0, hashed < len(digest.labels)]
            atom = next(x for _, x in ev.alternatives(digest.value) if isinstance(x, Atom))
            doc_digest = ev.choice([(hashed == k, x if x is not None else atom) for k, x in enumerate(digest.labels)])
            kind = self.names("kind", "operation type", KINDS, "query")
            self.wf.append(kind.var < len(KINDS))  # the parser knows these three only
            picked = [self.names("field", "root field", fields, "zzOther") for _ in range(2)]
            document = ev.choice([(has_doc, Hidden(doc_digest)), (z3.Not(has_doc), None)])
            persisted = ev.merge(has_hash, digest.value, None)
            kind_value = ev.merge(has_doc, kind.value, None)
            judged = (document, persisted, kind_value, tuple(f.value for f in picked))
            ops.append(_Operation(has_doc, has_hash, digest, kind, picked, judged, hashed))
        count = self.count("operations", range(1, MAX_ITEMS + 1))
        admitted, others = self.judged_all(shapes.graphql_refusal, [(count == L, (tuple(o.judged for o in ops[:L]),))
                                                                     for L in range(1, MAX_ITEMS + 1)], lambda sh: sh.graphql is not None)
        statement = spec.graphql_admits(g, count, ops)

        def build(model: z3.ModelRef) -> tuple[Request, bytes | None, str]:
            L = model.eval(count, model_completion=True).as_long()
            items = []
            for o in ops[:L]:
                item: dict = {}
                if z3.is_true(model.eval(o.document, model_completion=True)):
                    item["query"] = f"{o.kind_names.text(model)} {{ {' '.join(f.text(model) for f in o.field_names)} }}"
                if z3.is_true(model.eval(o.persisted, model_completion=True)):
                    item["extensions"] = {"persistedQuery": {"version": 1, "sha256Hash": o.hash_names.text(model)}}
                items.append(item)
            doc = items[0] if L == 1 else items
            text = json.dumps(doc, separators=(",", ":"))
            return self._post("application/json"), text.encode("utf-8"), f"body `{text}`"

        return Question(admitted, statement, list(self.wf), build, {"ops": ops, "count": count, "others": others})

    def git(self) -> Question:
        shape, ctx, ev = self.shape, self.ctx, self.ev
        # git's command line: no control character, space, DEL or any of ~^:?*[\ (bodies.push_commands)
        banned = z3.Union(_range("\x00", " ", ctx), _chars("\x7f~^:?*[\\", ctx))
        ref_chars = z3.Intersect(z3.AllChar(z3.ReSort(z3.StringSort(ctx))), z3.Complement(banned))
        updates = []
        sha256 = z3.Bool(self._name("sha256"), ctx)  # one object format per push
        zero = ev.merge(sha256, IDS[64][0], IDS[40][0])
        nonzero = ev.merge(sha256, IDS[64][1], IDS[40][1])
        for _ in range(MAX_ITEMS):
            old_zero, new_zero = z3.Bool(self._name("old_zero"), ctx), z3.Bool(self._name("new_zero"), ctx)
            ref = self.text("ref", ref_chars)
            self.wf.append(z3.Length(ref.s) > 0)
            judged = (ev.merge(old_zero, zero, nonzero), ev.merge(new_zero, zero, nonzero), ref)
            updates.append((old_zero, new_zero, ref, judged))
        count = self.count("updates", range(1, MAX_ITEMS + 1))
        admitted, others = self.judged_all(shapes.judge_git, [(count == L, (tuple(u[3] for u in updates[:L]),))
                                                              for L in range(1, MAX_ITEMS + 1)], lambda sh: sh.git is not None)
        statement = spec.git_admits(shape.git, count, [(o, n, r.s) for o, n, r, _ in updates])  # type: ignore[arg-type]

        def build(model: z3.ModelRef) -> tuple[Request, bytes | None, str]:
            L = model.eval(count, model_completion=True).as_long()
            lines, shown = [], []
            zero, nonzero = IDS[64 if z3.is_true(model.eval(sha256, model_completion=True)) else 40]
            capabilities = "\0report-status" + (" object-format=sha256" if len(zero) == 64 else "")
            for i, (o, n, r, _) in enumerate(updates[:L]):
                old = zero if z3.is_true(model.eval(o, model_completion=True)) else nonzero
                new = zero if z3.is_true(model.eval(n, model_completion=True)) else nonzero
                ref = _string(model, r.s)
                line = f"{old} {new} {ref}" + (capabilities if i == 0 else "") + "\n"
                data = line.encode("utf-8")
                lines.append(b"%04x" % (len(data) + 4) + data)
                shown.append(f"{old[:7]} {new[:7]} {ref}")
            body = b"".join(lines) + b"0000"
            base = "" if shape.prefix == "/" else shape.prefix
            req = Request(method="POST", scheme="https", host=self.rule.host, port=self.rule.port,
                          target=f"{base}/git-receive-pack",
                          headers=(("Content-Type", "application/x-git-receive-pack-request"),), has_body=True)
            return req, body, "push " + "; ".join(shown)

        return Question(admitted, statement, list(self.wf), build, {"updates": updates, "count": count, "others": others})

    def _post(self, content_type: str) -> Request:
        target = shapes.example_target(self.shape) or self.shape.prefix
        return Request(method="POST", scheme="https", host=self.rule.host, port=self.rule.port, target=target,
                       headers=(("Content-Type", content_type),), has_body=True)


@dataclass
class _Message:
    kind: z3.ArithRef
    method: Names
    tool: Names
    slots: list
    judged: tuple

    def spec_view(self) -> Any:
        return _View(kind=self.kind, method=self.method.var, method_labels=self.method.labels, tool=self.tool.var,
                     tool_labels=self.tool.labels,
                     arguments=[(present, key if isinstance(key, str) else None, value) for present, key, value in self.slots])


@dataclass
class _View:
    kind: Any
    method: Any
    method_labels: tuple
    tool: Any
    tool_labels: tuple
    arguments: list


class _Operation:
    """One GraphQL request of the model, as the statement reads it (`persisted`, `document`, `hash`, `kind`, `fields`)."""

    def __init__(self, has_doc, has_hash, digest: Names, kind: Names, picked: list[Names], judged: tuple, hashed) -> None:
        self.document, self.persisted, self.document_hash = has_doc, has_hash, hashed
        self.hash, self.hash_labels, self.hash_names = digest.var, digest.labels, digest
        self.kind, self.kind_labels, self.kind_names = kind.var, kind.labels, kind
        self.fields = [(f.var, f.labels) for f in picked]
        self.field_names = picked
        self.judged = judged


def _string(model: z3.ModelRef, s: z3.SeqRef) -> str:
    return text_of(model.eval(s, model_completion=True))


def text_of(value: z3.SeqRef) -> str:
    """A Z3 string constant's characters (its code points: `as_string` escapes some, ambiguously)."""
    ctx = value.ctx
    n = z3.Z3_get_string_length(ctx.ref(), value.as_ast())
    buf = (ctypes.c_uint * n)()
    z3.Z3_get_string_contents(ctx.ref(), value.as_ast(), n, buf)
    return "".join(chr(c) for c in buf)


def _json(model: z3.ModelRef, x: SymJson) -> Any:
    t = JSON_TYPES[model.eval(x.tag, model_completion=True).as_long()]
    if t is type(None):
        return None
    if t is bool:
        return z3.is_true(model.eval(x.b, model_completion=True))
    if t is int:
        return model.eval(x.i, model_completion=True).as_long()
    if t is float:
        r = model.eval(x.r, model_completion=True)
        value = float(Fraction(r.numerator_as_long(), r.denominator_as_long()))
        return value if value != int(value) or abs(value) > 2**53 else value  # a JSON number with a point
    if t is str:
        return _string(model, x.s)
    if t is list:
        return [0] * model.eval(x.n, model_completion=True).as_long()
    return {}


def replay(artifact: Artifact, lease, decide: Callable, req: Request, body: bytes | None, rule: str) -> tuple[bool, Decision, str]:
    """Whether the real code admits the request (and its body) under `rule`: `decide` on a public answer (which one is
    returned), then `adapter.judge_body` when the decision asks for its body to be judged."""
    for answer in PUBLIC_ANSWERS:
        d = decide(artifact, lease, req, [answer])
        if d.allowed or d.reason not in ("address-denied", "address-not-public", "ipv6-disabled"):
            break
    if not d.allowed or d.rule != rule:
        return False, d, answer
    if body is None:
        return True, d, answer
    if d.body_shape is None:
        return False, d, answer
    judged = judge_body(artifact, lease, req, d, body)
    return judged.allowed, judged, answer


def solve(ctx: z3.Context, assertions: list, limits: Limits):
    return check(ctx, assertions, limits, None, strings=True)


# ---------------------------------------------------------------------------------------------
# The checks of one rule
# ---------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """A check's outcome on one rule: `verdict` proved / refuted / unknown, with a summary and the replayed example."""

    verdict: str
    summary: str = ""
    request: Request | None = None
    body: bytes | None = None
    decision: Decision | None = None
    answer: str = PUBLIC_ANSWERS[0]  # the resolver answer the replay used
    other: Decision | None = None  # a comparison's other side, replayed
    setting: str | None = None  # what was compared


_BUILT: dict[tuple[Rule, str], tuple[ShapeModel, Question] | None] = {}


def _questions(rule: Rule, shape: shapes.Shape, which: str) -> tuple[ShapeModel, Question] | None:
    """The rule's head or body question, built once per process (its checks ask it several things in one context)."""
    key = (rule, which)
    if key not in _BUILT:
        if len(_BUILT) >= 64:
            _BUILT.clear()
        ctx = z3.Context()
        model = ShapeModel(ctx, rule, shape)
        q = model.head() if which == "head" else model.body()
        _BUILT[key] = (model, q) if q is not None else None
    return _BUILT[key]


def _by_pieces(ctx: z3.Context, q: Question, limits: Limits):
    """`admitted ∧ ¬statement` unsat, shown part by part: the whole judge admits only what each part's judge admits,
    and each part's judge only what its part of the statement admits. The unsat outcome, or None (ask the whole)."""
    pieces = q.extra.get("pieces") or []
    if len(pieces) < 2:
        return None
    o = solve(ctx, [*q.wf, q.admitted, z3.Not(z3.And(*[p for p, _ in pieces]))], limits)
    if o.status != "unsat":
        return None
    for piece, part in pieces:
        o = solve(ctx, [*q.wf, piece, z3.Not(part)], limits)
        if o.status != "unsat":
            return None
    return o


def confined(artifact: Artifact, lease, decide: Callable, rule: Rule, shape: shapes.Shape, limits: Limits) -> list[Verdict]:
    """shape-confined for one rule: nothing its judges admit (head, then body) lies outside its shape as declared."""
    out = []
    for which in ("head", "body"):
        try:
            built = _questions(rule, shape, which)
        except Unsupported as exc:
            out.append(Verdict("unknown", f"rule `{rule.name}`'s {which} shape cannot be evaluated symbolically: {exc}"))
            continue
        if built is None:
            continue
        model, q = built
        o = _by_pieces(model.ctx, q, limits)
        if o is None:
            o = solve(model.ctx, [*q.wf, q.admitted, z3.Not(q.statement)], limits)
        if o.status == "unknown":
            out.append(Verdict("unknown", f"rule `{rule.name}`'s {which} shape: solver gave no answer: {o.reason}"))
            continue
        if o.status == "unsat":
            out.append(Verdict("proved", f"rule `{rule.name}`: {which}"))
            continue
        req, body, desc = q.build(o.model)
        ok, d, answer = replay(artifact, lease, decide, req, body, rule.name)
        where = "the head" if which == "head" else "the body"
        summary = f"rule `{rule.name}` admits {desc}, outside its declared shape ({where})"
        out.append(Verdict("refuted" if ok else "unknown", summary if ok else
                           f"{summary}: the counterexample did not replay through decide()/judge_body ({d.reason if d else '?'})",
                           req, body, d, answer))
    return out


def vacuity(artifact: Artifact, lease, decide: Callable, rule: Rule, shape: shapes.Shape, limits: Limits) -> list[Verdict]:
    """Per template, tool, GraphQL root field and push pattern of the rule: a witness the real judge admits (replayed)."""
    asks: list[tuple[str, str, Callable[[ShapeModel, Question], list]]] = []
    if shape.template is not None:
        n = len(shape.template)
        asks.append(("head", "its path template", lambda m, q: [q.extra["seg_count"] == n, q.extra["pair_count"] == 0,
                                                                 q.extra["head_count"] == 0]))
    if shape.mcp is not None:
        for tool in shape.mcp.tools:
            def pick(m: ShapeModel, q: Question, name: str = tool.name) -> list:
                msg = q.extra["messages"][0]
                if "tools/call" not in msg.method.labels or name not in msg.tool.labels:
                    return [z3.BoolVal(False, m.ctx)]
                return [q.extra["count"] == 1, msg.kind == 0, msg.method.var == msg.method.labels.index("tools/call"),
                        msg.tool.var == msg.tool.labels.index(name)]
            asks.append(("body", f"tool `{tool.name}`", pick))
    if shape.graphql is not None:
        g = shape.graphql
        for kind, fields in (("query", g.query), ("mutation", g.mutation), ("subscription", g.subscription)):
            for f in fields:
                def pick_field(m: ShapeModel, q: Question, kind: str = kind, f: str = f) -> list:
                    op = q.extra["ops"][0]
                    return [q.extra["count"] == 1, op.document, z3.Not(op.persisted),
                            op.kind == op.kind_labels.index(kind), op.fields[0][0] == op.fields[0][1].index(f)]
                asks.append(("body", f"{kind} field `{f}`", pick_field))
    if shape.git is not None:
        for pattern in shape.git.push:
            def pick_ref(m: ShapeModel, q: Question, pattern: str = pattern) -> list:
                _, _, ref, _ = q.extra["updates"][0]
                return [q.extra["count"] == 1, z3.InRe(ref.s, spec.ref_regex(pattern, m.ctx))]
            asks.append(("body", f"push pattern `{pattern}`", pick_ref))
    out = []
    for which, what, pick in asks:
        try:
            built = _questions(rule, shape, which)
        except Unsupported as exc:
            out.append(Verdict("unknown", f"rule `{rule.name}`: {what} cannot be evaluated symbolically: {exc}"))
            continue
        assert built is not None
        model, q = built
        o = solve(model.ctx, [*q.wf, q.admitted, *pick(model, q)], limits)
        if o.status == "unknown":
            out.append(Verdict("unknown", f"rule `{rule.name}`: {what}: solver gave no answer: {o.reason}"))
        elif o.status == "unsat":
            out.append(Verdict("refuted", f"rule `{rule.name}`: {what} admits nothing (every proof about it is vacuous)"))
        else:
            req, body, desc = q.build(o.model)
            ok, d, answer = replay(artifact, lease, decide, req, body, rule.name)
            out.append(Verdict("proved" if ok else "unknown",
                               f"rule `{rule.name}`: {what} admits e.g. {desc}" if ok else
                               f"rule `{rule.name}`: {what}: the witness {desc} did not replay ({d.reason if d else '?'})",
                               req, body, d, answer))
    return out


def admitted_anywhere(artifact: Artifact, lease, decide: Callable, req: Request, body: bytes | None, answer: str) -> Decision:
    """What the real code does with the request (and body) under any rule: `decide`, then `judge_body` when asked."""
    d = decide(artifact, lease, req, [answer])
    if d.allowed and d.body_shape is not None and body is not None:
        d = judge_body(artifact, lease, req, d, body)
    return d


def included(kind: str, mine: tuple[Artifact, Any, Rule, shapes.Shape], theirs: tuple[Artifact, Any, Rule, shapes.Shape],
             decide: Callable, limits: Limits) -> Verdict:
    """Rule `mine`'s `kind` shape ("head" or "body") admits nothing rule `theirs` refuses, on the same inputs: proved;
    refuted with a request (and body) replayed on both sides (admitted by mine, refused by theirs); or unknown."""
    art, lease, rule, shape = mine
    other_art, other_lease, other_rule, other_shape = theirs
    try:
        ctx = z3.Context()
        model = ShapeModel(ctx, rule, shape, ((other_rule, other_shape),))
        q = model.head() if kind == "head" else model.body()
    except Unsupported as exc:
        return Verdict("unknown", f"rule `{rule.name}`'s {kind} shape cannot be evaluated symbolically: {exc}")
    if q is None:
        return Verdict("proved")
    other = q.extra["others"][0]
    wider = [q.admitted] if other is None else [q.admitted, z3.Not(other)]  # another protocol: any body of mine
    o = solve(ctx, [*q.wf, *wider], limits)
    if o.status == "unknown":
        return Verdict("unknown", f"rule `{rule.name}`'s {kind} shape: solver gave no answer: {o.reason}")
    if o.status == "unsat":
        return Verdict("proved")
    req, body, desc = q.build(o.model)
    ok, d, answer = replay(art, lease, decide, req, body, rule.name)
    d_other = admitted_anywhere(other_art, other_lease, decide, req, body, answer)
    summary = f"rule `{rule.name}` admits {desc}; rule `{other_rule.name}` refuses it ({d_other.reason})"
    if ok and not d_other.allowed:
        return Verdict("refuted", summary, req, body, d, answer, d_other)
    return Verdict("unknown", f"{summary}: the pair did not replay (here {d.reason or 'allowed'}, there "
                              f"{d_other.reason or 'allowed'})", req, body, d, answer, d_other)
