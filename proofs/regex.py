"""The pattern subset of request shapes (`compiler.patterns`: its explicit AST) as a Z3 regular expression.

One translation, used by the symbolic evaluator (its one primitive for `compiler.patterns.matches`) and by the
independent statements (`proofs/spec/shapes.py`), node by node:

| AST | Z3 |
|---|---|
| `Literal(c)` | `Re("c")` |
| `CharSet(ranges)` | the union of `Range(lo, hi)` |
| `CharSet(ranges, negated)` | any one character (`AllChar`) minus that union |
| `Seq(items)` | `Concat` |
| `Alt(options)` | `Union` |
| `Repeat(item, m, n)` | `Loop(item, m, n)`; `{0}` the empty string; no upper bound: `m` copies then `Star` |

`InRe(s, regex)` is a whole-string match, as `re.fullmatch` is. Z3's characters are the code points up to
0x2FFFF (its default `unicode` encoding): a text the prover models never holds a character above it
(`tests/proofs/test_regex.py` holds the translation equal to Python's matcher on random patterns and strings).
"""

from __future__ import annotations

import ctypes

import z3

from compiler.patterns import Alt, CharSet, Literal, Repeat, Seq

_CACHE: dict[tuple[int, object], z3.ReRef] = {}


def string(text: str, ctx: z3.Context) -> z3.SeqRef:
    """The Z3 string of exactly these characters (`z3.StringVal` reads `\\u{…}` in its argument as an escape)."""
    if "\\" not in text:
        return z3.StringVal(text, ctx)
    chars = (ctypes.c_uint * len(text))(*[ord(c) for c in text])
    return z3.SeqRef(z3.Z3_mk_u32string(ctx.ref(), len(text), chars), ctx)


def _one(c: str, ctx: z3.Context) -> z3.ReRef:
    return z3.Re(string(c, ctx))


def node_regex(node: object, ctx: z3.Context) -> z3.ReRef:
    """The Z3 regex of one pattern AST node (any `compiler.patterns` node)."""
    if isinstance(node, Literal):
        return _one(node.char, ctx)
    if isinstance(node, CharSet):
        parts = [z3.Range(lo, hi, ctx) if lo != hi else _one(lo, ctx) for lo, hi in node.ranges]
        union = parts[0] if len(parts) == 1 else z3.Union(*parts)
        if not node.negated:
            return union
        return z3.Intersect(z3.AllChar(z3.ReSort(z3.StringSort(ctx))), z3.Complement(union))
    if isinstance(node, Seq):
        return z3.Concat(*[node_regex(n, ctx) for n in node.items])
    if isinstance(node, Alt):
        return z3.Union(*[node_regex(n, ctx) for n in node.options])
    if isinstance(node, Repeat):
        item = node_regex(node.item, ctx)
        if node.high is None:
            star = z3.Star(item)
            return star if node.low == 0 else z3.Concat(z3.Loop(item, node.low, node.low), star)
        if node.high == 0:
            return z3.Re(z3.StringVal("", ctx))
        return z3.Loop(item, node.low, node.high)
    raise TypeError(f"not a pattern node: {node!r}")


def pattern_regex(node: object, ctx: z3.Context) -> z3.ReRef:
    """`node_regex`, memoized per context and node (a rule's patterns are translated once per question)."""
    key = (id(ctx), node)
    cached = _CACHE.get(key)
    if cached is None or cached.ctx is not ctx:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        cached = _CACHE[key] = node_regex(node, ctx)
    return cached
