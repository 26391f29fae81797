"""The adapter's body readers: request bodies (bytes) read one way, strictly and bounded, into plain values.

The core (`shapes`) judges what these return; nothing here judges policy. Each reader refuses what it cannot
read exactly one way with a `BodyError` whose `reason` is a code of `reasons` and whose `detail` says what was
wrong and where, in words (a key or field name at most, escaped and short; never a value of the body).

- JSON: `read_json` (valid UTF-8 without a BOM, valid JSON without NaN/Infinity or a float that overflows,
  no duplicate key, nesting at most 64 deep checked by a linear pre-scan before the parser recurses, no lone
  surrogate escape: `"\\ud800"` is refused, since a string that is not Unicode reads differently in each
  parser); `media_type`, `expect_json`, `expect_media`, `expect_identity` for the head.
- MCP: `mcp_messages` (JSON-RPC 2.0 messages of one body), `tool_call`, `canonical_id`.
- GraphQL: `graphql_requests` (POST), `graphql_get` (GET), `operation_of` (the one operation's type and root
  field names, through fragments), `document_hash`.
- git: `push_commands` (the ref updates of a `git-receive-pack` request).
- Responses: `ToolsFilter` (a `tools/list` answer cut to the tools the rule allows, JSON or SSE), `tools_list_ids`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Literal

from graphql import GraphQLError
from graphql.language import (
    FieldNode,
    FragmentDefinitionNode,
    FragmentSpreadNode,
    InlineFragmentNode,
    OperationDefinitionNode,
    parse,
)

from egress_proxy.errors import EgressError

MAX_DEPTH = 64
MAX_GRAPHQL_TOKENS = 20_000
EVENT_LIMIT = 1 << 20  # an SSE event held whole before it is passed or rewritten
ZERO_OIDS = frozenset({"0" * 40, "0" * 64})

_DETAIL_MAX = 80
_NAME_MAX = 32


class BodyError(EgressError):
    """A body (or a filtered answer) that does not read one way; `reason` is a code, `detail` says where."""

    def __init__(self, reason: str, detail: str) -> None:
        detail = detail if len(detail) <= _DETAIL_MAX else detail[: _DETAIL_MAX - 3] + "..."
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _malformed(detail: str) -> BodyError:
    return BodyError("body-malformed", detail)


def _name(text: str) -> str:
    """A key or field name, escaped (ASCII, quotes) and short enough for a detail."""
    shown = json.dumps(text[:_NAME_MAX], ensure_ascii=True)[1:-1]
    return shown + ("..." if len(text) > _NAME_MAX else "")


# --------------------------------------------------------------------------------------------------------------
# JSON

# A string (escapes skipped, possessive so nothing backtracks), a run of at most 64 KiB outside strings, or a `"` that
# opens a string never closed. Outside a string, valid JSON has a `"` only where a string starts, so on a valid
# document this sees exactly the parser's brackets; on an invalid one it sees the same up to the parser's first error
# (past an unclosed `"` the parser reads one string to the end, so nothing there nests).
_JSON_PIECES = re.compile(rb'"[^"\\]*+(?:\\[\s\S][^"\\]*+)*+"|[^"]{1,65536}|"')
# Brackets only, an opening one as 2 and a closing one as 0: after k brackets the depth is (their sum) - k.
_BRACKETS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{]}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _depth_exceeds(data: bytes, max_depth: int) -> bool:
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False  # no more openers in all (strings included: an over-count) than the limit: it cannot nest deeper
    depth = 0
    for piece in _JSON_PIECES.finditer(data):
        if data[piece.start()] == 0x22:  # a string (not copied), or an unclosed `"`: nothing after it nests
            if piece.end() - piece.start() == 1:
                return False
            continue
        brackets = piece.group().translate(_BRACKETS, _NOT_BRACKETS)
        opens = brackets.count(2)
        if depth + opens > max_depth:
            # the deepest point of this run, counted in C (accumulate and map, no Python loop per byte)
            if depth + max(map(operator.sub, itertools.accumulate(brackets), itertools.count(1))) > max_depth:
                return True
        depth += 2 * opens - len(brackets)
    return False


class _Duplicate(dict):
    """An object that named `key` twice (found after the parse, to name its path)."""

    key: str = ""


def _pairs(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = _Duplicate(out)
        for key, _ in pairs:
            if key in seen:
                dup.key = key
                break
            seen.add(key)
        return dup
    return out


def _constant(name: str) -> object:
    raise _malformed(f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _malformed("a number too large for a float")
    return value


def _path(path: str, step: object) -> str:
    if isinstance(step, int):
        return f"{path}[{step}]"
    key = str(step)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) and len(key) <= _NAME_MAX:
        return f"{path}.{key}"
    return f'{path}["{_name(key)}"]'


def _find_duplicate(value: object, path: str) -> str | None:
    # INVARIANT: the pre-scan bounded the depth, so this recursion is at most max_depth deep.
    if isinstance(value, _Duplicate):
        return _path(path, value.key)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for step, child in items:
        found = _find_duplicate(child, _path(path, step))
        if found is not None:
            return found
    return None


def _find_surrogate(value: object, path: str) -> str | None:
    if isinstance(value, str):
        return path if not value.isascii() and _not_unicode(value) else None
    if isinstance(value, dict):
        for key, child in value.items():
            if _not_unicode(key):
                return path
            found = _find_surrogate(child, _path(path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found = _find_surrogate(child, _path(path, index))
            if found is not None:
                return found
    return None


def _not_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_json(data: bytes, max_depth: int = MAX_DEPTH) -> object:
    """The one JSON value of `data`, read strictly; anything that could read two ways is a `BodyError`."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise _malformed("a byte order mark before the JSON")
    # INVARIANT: the depth is bounded before the (recursive) parser runs, in time linear in the body.
    if _depth_exceeds(data, max_depth):
        raise _malformed(f"nesting deeper than {max_depth}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _malformed(f"invalid utf-8 at byte {error.start}") from None
    duplicates = False

    def pairs(items: list[tuple[str, object]]) -> dict:
        nonlocal duplicates
        out = _pairs(items)
        duplicates = duplicates or isinstance(out, _Duplicate)
        return out

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_constant=_constant, parse_float=_float)
    except json.JSONDecodeError as error:
        raise _malformed(f"invalid json at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise _malformed(f"nesting deeper than {max_depth}") from None
    except ValueError:
        # int() past the interpreter's digit limit
        raise _malformed("a number too long to read") from None
    if duplicates:
        raise _malformed(f"duplicate key at {_find_duplicate(value, '$')}")
    if _SURROGATE_ESCAPE.search(text):
        where = _find_surrogate(value, "$")
        if where is not None:
            raise _malformed(f"a lone surrogate escape at {where}")
    return value


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


# --------------------------------------------------------------------------------------------------------------
# The head: content type and coding

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA = re.compile(rf"[ \t]*({_TOKEN})/({_TOKEN})[ \t]*((?:;.*)?)", re.S)
_PARAM = re.compile(rf'[ \t]*({_TOKEN})=({_TOKEN}|"(?:[^"\\]|\\.)*")[ \t]*', re.S)


def _values(headers: tuple[tuple[str, str], ...], name: str) -> list[str]:
    return [value for key, value in headers if key.lower() == name]


def _content_type(headers: tuple[tuple[str, str], ...]) -> tuple[str, dict[str, str]]:
    values = _values(headers, "content-type")
    if not values:
        return "", {}
    if len(values) > 1:
        raise BodyError("content-type-mismatch", "content-type given more than once")
    match = _MEDIA.fullmatch(values[0])
    if match is None:
        raise BodyError("content-type-mismatch", "a content-type that does not parse")
    params: dict[str, str] = {}
    rest = match.group(3)
    for part in rest.split(";")[1:] if rest else ():
        if not part.strip():
            continue
        param = _PARAM.fullmatch(part)
        if param is None:
            raise BodyError("content-type-mismatch", "a content-type parameter that does not parse")
        key, value = param.group(1).lower(), param.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        if key in params:
            raise BodyError("content-type-mismatch", f"content-type parameter {_name(key)} given twice")
        params[key] = value
    return f"{match.group(1)}/{match.group(2)}".lower(), params


def media_type(headers: tuple[tuple[str, str], ...]) -> str:
    """The lowercased `type/subtype` of the Content-Type ("" when absent); two, or one unreadable, refused."""
    return _content_type(headers)[0]


def expect_identity(headers: tuple[tuple[str, str], ...]) -> None:
    """Refuse a Content-Encoding other than `identity`: a coded body cannot be judged."""
    for value in _values(headers, "content-encoding"):
        for coding in value.split(","):
            if coding.strip().lower() not in ("identity", ""):
                raise _malformed("a coded body cannot be judged (content-encoding)")


def expect_media(headers: tuple[tuple[str, str], ...], wanted: str) -> None:
    """Refuse a body whose media type is not `wanted` (charset, if any, utf-8) or that is coded."""
    kind, params = _content_type(headers)
    if kind != wanted:
        raise BodyError("content-type-mismatch", f"content-type is not {wanted}")
    charset = params.get("charset")
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise BodyError("content-type-mismatch", "a charset other than utf-8")
    expect_identity(headers)


def expect_json(headers: tuple[tuple[str, str], ...]) -> None:
    """Refuse a body that is not `application/json` (charset utf-8 or none), or is coded."""
    expect_media(headers, "application/json")


# --------------------------------------------------------------------------------------------------------------
# MCP (JSON-RPC 2.0)


@dataclass(frozen=True)
class Message:
    """One JSON-RPC 2.0 message: `id` is its canonical JSON text; a response's `params` is None."""

    kind: Literal["request", "notification", "response"]
    method: str | None
    id: str | None
    params: object


def canonical_id(value: object) -> str:
    """The canonical JSON text of a JSON-RPC id (`7` and `"7"` differ, as they do on the wire)."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_REQUEST_KEYS = frozenset({"jsonrpc", "method", "params", "id"})
_RESPONSE_KEYS = frozenset({"jsonrpc", "result", "error", "id"})


def _message(value: object) -> Message:
    if not isinstance(value, dict):
        raise _malformed("a json-rpc message is not an object")
    if value.get("jsonrpc") != "2.0":
        raise _malformed('"jsonrpc" is not "2.0"')
    if "method" in value:
        extra = sorted(set(value) - _REQUEST_KEYS)
        if extra:
            raise _malformed(f"a request with member {_name(extra[0])}")
        method = value["method"]
        if not isinstance(method, str):
            raise _malformed("method is not a string")
        params = value.get("params")
        if "params" in value and not isinstance(params, (dict, list)):
            raise _malformed("params is neither an object nor an array")
        if "id" not in value:
            return Message("notification", method, None, params)
        ident = value["id"]
        if not (isinstance(ident, str) or _is_int(ident)):
            raise _malformed("a request id that is not a string or an integer")
        return Message("request", method, canonical_id(ident), params)
    extra = sorted(set(value) - _RESPONSE_KEYS)
    if extra:
        raise _malformed(f"a message with member {_name(extra[0])}")
    if ("result" in value) == ("error" in value):
        raise _malformed("neither a request nor a response (result xor error)")
    if "id" not in value:
        raise _malformed("a response without id")
    ident = value["id"]
    if "error" in value:
        error = value["error"]
        if not (isinstance(error, dict) and _is_int(error.get("code")) and isinstance(error.get("message"), str)):
            raise _malformed("an error that is not {code, message}")
        if not (ident is None or isinstance(ident, str) or _is_int(ident)):
            raise _malformed("a response id that is not a string, an integer or null")
    elif not (isinstance(ident, str) or _is_int(ident)):
        raise _malformed("a response id that is not a string or an integer")
    return Message("response", None, canonical_id(ident), None)


def mcp_messages(value: object) -> tuple[tuple[Message, ...], bool]:
    """The JSON-RPC 2.0 messages of one parsed body, and whether it was a batch."""
    if not isinstance(value, list):
        return (_message(value),), False
    if not value:
        raise _malformed("an empty batch")
    out = []
    for index, element in enumerate(value):
        try:
            out.append(_message(element))
        except BodyError as error:
            raise _malformed(f"index={index}: {error.detail}") from None
    return tuple(out), True


def tool_call(message: Message) -> tuple[str, object]:
    """A `tools/call` request's tool name and arguments (`{}` when absent)."""
    if message.kind != "request" or message.method != "tools/call":
        raise _malformed("not a tools/call request")
    params = message.params
    if not isinstance(params, dict):
        raise _malformed("tools/call params is not an object")
    name = params.get("name")
    if not isinstance(name, str):
        raise _malformed("tools/call name is not a string")
    arguments = params.get("arguments", {})
    if not isinstance(arguments, dict):
        raise _malformed("tools/call arguments is not an object")
    return name, arguments


# --------------------------------------------------------------------------------------------------------------
# GraphQL


@dataclass(frozen=True)
class GqlRequest:
    """One GraphQL request: its document, `operationName` and persisted-query hash (lowercase sha256 hex)."""

    document: str | None
    operation_name: str | None
    persisted: str | None


@dataclass(frozen=True)
class Operation:
    """A document's one operation: its type and root field names (aliases and fragments resolved)."""

    type: Literal["query", "mutation", "subscription"]
    fields: tuple[str, ...]


_GQL_KEYS = frozenset({"query", "operationName", "variables", "extensions"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _persisted(extensions: object) -> str | None:
    # Other extensions are refused: some servers read a stored document from them, which nothing here could judge.
    if extensions is None:
        return None
    if not isinstance(extensions, dict):
        raise _malformed("extensions is not an object")
    extra = sorted(set(extensions) - {"persistedQuery"})
    if extra:
        raise _malformed(f"extension {_name(extra[0])} is not judged")
    if "persistedQuery" not in extensions:
        return None
    persisted = extensions["persistedQuery"]
    if not isinstance(persisted, dict) or set(persisted) != {"version", "sha256Hash"}:
        raise _malformed("persistedQuery is not {version, sha256Hash}")
    if not (_is_int(persisted["version"]) and persisted["version"] == 1):
        raise _malformed("persistedQuery version is not 1")
    digest = persisted["sha256Hash"]
    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise _malformed("sha256Hash is not lowercase sha256 hex")
    return digest


def _gql(value: object) -> GqlRequest:
    # Unknown members are refused: `id`, `doc_id`, `documentId` name stored documents on some servers.
    if not isinstance(value, dict):
        raise _malformed("a graphql request is not an object")
    extra = sorted(set(value) - _GQL_KEYS)
    if extra:
        raise _malformed(f"a graphql request with member {_name(extra[0])}")
    document = value.get("query")
    if document is not None and not isinstance(document, str):
        raise _malformed("query is not a string")
    name = value.get("operationName")
    if name is not None and not isinstance(name, str):
        raise _malformed("operationName is not a string")
    variables = value.get("variables")
    if variables is not None and not isinstance(variables, dict):
        raise _malformed("variables is not an object")
    persisted = _persisted(value.get("extensions"))
    if document is None and persisted is None:
        raise _malformed("neither a query nor a persisted query")
    return GqlRequest(document, name, persisted)


def graphql_requests(value: object) -> tuple[tuple[GqlRequest, ...], bool]:
    """The GraphQL requests of one parsed POST body (an object or a batch array), and whether it was a batch."""
    if not isinstance(value, list):
        return (_gql(value),), False
    if not value:
        raise _malformed("an empty batch")
    out = []
    for index, element in enumerate(value):
        try:
            out.append(_gql(element))
        except BodyError as error:
            raise _malformed(f"index={index}: {error.detail}") from None
    return tuple(out), True


def graphql_get(pairs: tuple[tuple[str, str], ...]) -> GqlRequest:
    """The GraphQL request of a GET's decoded query pairs (`extensions` and `variables` are JSON text)."""
    seen: dict[str, str] = {}
    for key, text in pairs:
        if key not in _GQL_KEYS:
            raise _malformed(f"a graphql query parameter {_name(key)}")
        if key in seen:
            raise _malformed(f"query parameter {_name(key)} given twice")
        seen[key] = text
    value: dict[str, object] = {}
    for key in ("query", "operationName"):
        if key in seen:
            value[key] = seen[key]
    for key in ("variables", "extensions"):
        if key in seen:
            try:
                raw = seen[key].encode("utf-8")
            except UnicodeEncodeError:
                raise _malformed(f"{key} is not utf-8") from None
            try:
                value[key] = read_json(raw)
            except BodyError as error:
                raise _malformed(f"{key}: {error.detail}") from None
    return _gql(value)


def document_hash(document: str) -> str:
    """The sha256 hex of a document's UTF-8 text (what a persisted-query hash names)."""
    try:
        return hashlib.sha256(document.encode("utf-8")).hexdigest()
    except UnicodeEncodeError:
        raise _malformed("a document that is not unicode") from None


def operation_of(request: GqlRequest) -> Operation:
    """The document's one operation: its type and root field names, through fragments (cycle-safe)."""
    if request.document is None:
        raise _malformed("no document to read")
    try:
        document = parse(request.document, no_location=True, max_tokens=MAX_GRAPHQL_TOKENS)
    except GraphQLError as error:
        if "more than" in error.message and "tokens" in error.message:
            raise _malformed(f"a graphql document of more than {MAX_GRAPHQL_TOKENS} tokens") from None
        where = ""
        if error.locations:
            where = f" at line {error.locations[0].line} column {error.locations[0].column}"
        raise _malformed(f"graphql syntax error{where}") from None
    except RecursionError:
        raise _malformed("graphql document nested too deep") from None
    operations: list[OperationDefinitionNode] = []
    fragments: dict[str, FragmentDefinitionNode] = {}
    for definition in document.definitions:
        if isinstance(definition, OperationDefinitionNode):
            operations.append(definition)
        elif isinstance(definition, FragmentDefinitionNode):
            name = definition.name.value
            if name in fragments:
                raise _malformed(f"fragment {_name(name)} defined twice")
            fragments[name] = definition
        else:
            raise _malformed("a definition that is not an operation or a fragment")
    if not operations:
        raise _malformed("no operation in the document")
    if len(operations) > 1:
        raise BodyError("graphql-multiple-operations", f"{len(operations)} operations in one document")
    operation = operations[0]
    own = operation.name.value if operation.name is not None else None
    if request.operation_name is not None and request.operation_name != own:
        raise BodyError("graphql-multiple-operations", "operationName does not name the operation")
    fields: dict[str, None] = {}
    expanded: set[str] = set()
    # An explicit stack (reversed, so first-seen order holds): inline fragments nest as deep as the parser lets.
    stack = list(reversed(operation.selection_set.selections))
    while stack:
        selection = stack.pop()
        if isinstance(selection, FieldNode):
            fields.setdefault(selection.name.value, None)
            continue
        if isinstance(selection, FragmentSpreadNode):
            name = selection.name.value
            if name not in fragments:
                raise _malformed(f"unknown fragment {_name(name)}")
            if name in expanded:
                continue
            expanded.add(name)
            selections = fragments[name].selection_set.selections
        elif isinstance(selection, InlineFragmentNode):
            selections = selection.selection_set.selections
        else:  # pragma: no cover - the parser knows only these three
            raise _malformed("an unknown selection")
        stack.extend(reversed(selections))
    return Operation(operation.operation.value, tuple(fields))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------------
# git smart HTTP


@dataclass(frozen=True)
class RefUpdate:
    """One command of a push: `old` and `new` object ids (lowercase hex; `ZERO_OIDS` creates or deletes)."""

    old: str
    new: str
    ref: str


_OID = rb"(?:[0-9a-f]{40}|[0-9a-f]{64})"
_COMMAND = re.compile(rb"(" + _OID + rb") (" + _OID + rb") ([^\x00-\x20\x7f~^:?*\[\\]+)")
_SHALLOW = re.compile(rb"shallow " + _OID)
_PKT_MAX = 65520


def _pkt_lines(body: bytes):
    """The payloads of the pkt-lines before the first flush-pkt (strict lengths); a missing flush refused."""
    at = 0
    while True:
        head = body[at : at + 4]
        if len(head) < 4:
            raise _malformed("pkt-lines end before a flush-pkt")
        if not re.fullmatch(rb"[0-9a-fA-F]{4}", head):
            raise _malformed(f"a pkt-line length that is not hex at byte {at}")
        length = int(head, 16)
        if length == 0:
            return
        if length < 4 or length > _PKT_MAX:
            raise _malformed(f"a pkt-line length out of range at byte {at}")
        if at + length > len(body):
            raise _malformed(f"a pkt-line cut short at byte {at}")
        yield body[at + 4 : at + length]
        at += length


def push_commands(body: bytes) -> tuple[RefUpdate, ...]:
    """The ref updates of a `git-receive-pack` request: its pkt-lines before the first flush-pkt."""
    out: list[RefUpdate] = []
    width = 0
    for index, line in enumerate(_pkt_lines(body)):
        if line.endswith(b"\n"):
            line = line[:-1]
        if line.startswith(b"push-cert"):
            raise _malformed("push certificates are not judged")
        if line.startswith(b"shallow"):
            # a shallow clone's boundary, before the commands; it updates nothing
            if out or not _SHALLOW.fullmatch(line):
                raise _malformed(f"a malformed shallow line at line={index}")
            continue
        command, nul, capabilities = line.partition(b"\x00")
        if nul and out:
            raise _malformed(f"capabilities after the first command at line={index}")
        match = _COMMAND.fullmatch(command)
        if match is None:
            raise _malformed(f"not a push command at line={index}")
        try:
            ref = match.group(3).decode("utf-8")
        except UnicodeDecodeError:
            raise _malformed(f"a ref name that is not utf-8 at line={index}") from None
        old, new = match.group(1).decode("ascii"), match.group(2).decode("ascii")
        if len(old) != len(new) or (width and len(old) != width):
            raise _malformed(f"object ids of two lengths at line={index}")
        if nul:
            sha256 = b"object-format=sha256" in capabilities.split(b" ")
            if (len(old) == 64) != sha256:
                raise _malformed("object ids that do not match the object-format")
        width = len(old)
        out.append(RefUpdate(old, new, ref))
    return tuple(out)


# --------------------------------------------------------------------------------------------------------------
# The answer to tools/list, filtered


def tools_list_ids(messages: tuple[Message, ...]) -> frozenset[str]:
    """The ids (canonical JSON) of the `tools/list` requests among a POST's messages: what its answer must filter."""
    return frozenset(m.id for m in messages if m.kind == "request" and m.method == "tools/list" and m.id is not None)


class ToolsFilter:
    """Cuts each JSON-RPC response whose id is in `ids` (the client's `tools/list` requests) to the `allowed` tools.

    `ids=None` cuts every response that carries a `result.tools` list, whatever its id: for a stream whose requests
    the edge has not seen (a GET stream resumed with `Last-Event-ID` may replay an earlier answer).
    """

    def __init__(self, ids: frozenset[str] | None, allowed: frozenset[str]) -> None:
        self.ids = ids
        self.allowed = allowed

    def _cut(self, value: object) -> bool:
        """Filter one parsed message in place; whether it changed."""
        if not (isinstance(value, dict) and "id" in value and "method" not in value):
            return False
        try:
            ident = canonical_id(value["id"])
        except (TypeError, ValueError):  # pragma: no cover - a parsed JSON value always serializes
            return False
        result = value.get("result")
        if (self.ids is not None and ident not in self.ids) or not isinstance(result, dict) or not isinstance(result.get("tools"), list):
            return False
        tools = result["tools"]
        kept = [t for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"] in self.allowed]
        result["tools"] = kept
        return len(kept) != len(tools)

    def _rewrite(self, data: bytes) -> bytes | None:
        """The document with the matching answers cut, or None when nothing changed."""
        value = read_json(data)
        changed = False
        for message in value if isinstance(value, list) else (value,):
            changed = self._cut(message) or changed
        return _dumps(value) if changed else None

    def json(self, body: bytes) -> bytes:
        """The body with every matching answer cut; unchanged (byte for byte) when none is cut."""
        if self.ids is not None and not self.ids:
            return body
        rewritten = self._rewrite(body)
        return body if rewritten is None else rewritten

    def sse(self) -> SseFilter:
        """An incremental filter over a `text/event-stream` answer."""
        return SseFilter(self)


_LINE_BREAK = re.compile(rb"[\r\n]")


class SseFilter:
    """Reads a text/event-stream event by event, passes each through or rewrites its data; one event held."""

    def __init__(self, tools: ToolsFilter, limit: int = EVENT_LIMIT) -> None:
        self._tools = tools
        self._limit = limit
        self._held = bytearray()  # the current event's raw bytes, its partial last line included
        self._scan = 0  # where the next line terminator is looked for in _held
        self._line = 0  # where the current (partial) line starts in _held
        self._lines: list[tuple[int, int, int]] = []  # (start, end of content, end with terminator)
        self._first = True  # the stream's first line (a leading BOM is not part of the field name)
        self._closed = False

    def feed(self, chunk: bytes) -> bytes:
        """The bytes ready to pass on after `chunk`: whole events only."""
        if self._closed:
            raise ValueError("feed after close")
        held = self._held
        held += chunk
        out = bytearray()
        base = 0  # where the current event starts in _held (the ones before it are passed on)
        while True:
            found = _LINE_BREAK.search(held, self._scan)
            if found is None:
                self._scan = len(held)
                break
            at = found.start()
            if held[at] == 0x0D and at + 1 == len(held):
                self._scan = at  # a CR at the end: CRLF or CR alone is told by the next byte
                break
            end = at + 2 if held[at] == 0x0D and held[at + 1] == 0x0A else at + 1
            if at == self._line:  # a blank line: the event ends here
                out += self._dispatch(base, end)
                base = end
            else:
                self._lines.append((self._line, at, end))
            self._line = self._scan = end
        if base:
            # INVARIANT: one cut per feed, not one per event (a chunk of many small events stays linear)
            del held[:base]
            self._line -= base
            self._scan -= base
            self._lines = [(start - base, content - base, stop - base) for start, content, stop in self._lines]
        if len(held) > self._limit:
            raise BodyError("response-event-too-large", f"an event longer than {self._limit} bytes")
        return bytes(out)

    def close(self) -> bytes:
        """What remains at the end of the stream: a last event without its blank line is judged as one."""
        if self._closed:
            return b""
        self._closed = True
        held = self._held
        if not held:
            return b""
        if held[self._line :] != b"\r":  # (a CR alone there is the blank line that ends the event)
            if self._line < len(held):
                content = len(held) - 1 if held[-1] == 0x0D else len(held)
                self._lines.append((self._line, content, len(held)))
        out = self._dispatch(0, len(held))
        held.clear()
        return out

    def _dispatch(self, base: int, end: int) -> bytes:
        """Judge the event held in `_held[base:end]` (its lines in `_lines`); return it raw, or rewritten."""
        if end - base > self._limit:
            raise BodyError("response-event-too-large", f"an event longer than {self._limit} bytes")
        raw = bytes(self._held[base:end])
        lines = [(start - base, content - base, stop - base) for start, content, stop in self._lines]
        self._lines = []
        data: list[bytes] = []
        others: list[bytes] = []
        for index, (start, content, stop) in enumerate(lines):
            line = raw[start:content]
            if index == 0 and self._first and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            name, colon, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if colon and value.startswith(b" ") else value)
            else:  # kept as sent, with a line end if the stream ended on it
                others.append(raw[start:stop] if stop > content else raw[start:stop] + b"\n")
        self._first = False
        if not data or data == [b""]:
            return raw  # no data: a client dispatches nothing
        rewritten = self._tools._rewrite(b"\n".join(data))
        if rewritten is None:
            return raw
        return b"".join(others) + b"data: " + rewritten + b"\n\n"
