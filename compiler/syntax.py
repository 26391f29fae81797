"""The syntax tree: frozen nodes with source spans. Spans never take part in equality."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True, slots=True)
class Span:
    """A source range, 1-based lines and columns; `end_column` is exclusive."""

    path: str
    line: int
    column: int
    end_line: int
    end_column: int


NO_SPAN = Span("<none>", 0, 0, 0, 0)


def _span() -> Span:
    return field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Str:
    value: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Num:
    value: int | float
    text: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Bool:
    value: bool
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Null:
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Ref:
    """A bare name where a reference is expected (e.g. `worker = edge`)."""

    name: str
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class ListV:
    items: tuple[Value, ...]
    span: Span = _span()


@dataclass(frozen=True, slots=True)
class Pair:
    key: str
    value: Value
    quoted: bool = False
    key_span: Span = _span()


@dataclass(frozen=True, slots=True)
class Obj:
    pairs: tuple[Pair, ...]
    blocks: tuple[Named, ...] = ()  # nested `kind "name" { … }` blocks, e.g. `egress` in a connection
    span: Span = _span()

    def get(self, key: str) -> Pair | None:
        """The first pair named `key`."""
        for p in self.pairs:
            if p.key == key:
                return p
        return None


Value = Union[Str, Num, Bool, Null, Ref, ListV, Obj]


@dataclass(frozen=True, slots=True)
class Named:
    """`kind "name" { … }`: a top-level declaration or a nested block such as `egress`.

    Top-level kinds are workspace, catalog (no body), worker, sandbox_profile and connection.
    """

    kind: str
    name: str
    body: Obj | None = None
    kind_span: Span = _span()
    name_span: Span = _span()
    span: Span = _span()


Decl = Named


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str
    version: int
    decls: tuple[Decl, ...]
    version_span: Span = _span()
    text: str = field(default="", compare=False, repr=False)
    comments: tuple[tuple[int, int, str], ...] = field(default=(), compare=False, repr=False)  # (line, column, text)


def plain(value: Value) -> object:
    """The JSON-compatible Python value of a syntax value (references become their name)."""
    if isinstance(value, (Str, Num, Bool)):
        return value.value
    if isinstance(value, Null):
        return None
    if isinstance(value, Ref):
        return value.name
    if isinstance(value, ListV):
        return [plain(v) for v in value.items]
    if value.blocks:
        raise ValueError("blocks have no plain value")
    return {p.key: plain(p.value) for p in value.pairs}
