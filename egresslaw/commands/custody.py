"""`egresslaw custody init|put|list|delete|rotate --keys KEYS [--store custody.db]`: manage sealed credentials.

No subcommand ever prints, logs or echoes a secret: `put` reads it from stdin only, and there is
deliberately no command that reads a credential back.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from egress_proxy.front.settings import DEFAULTS
from egresslaw.common import CliError, err, options_from_environment, out

if TYPE_CHECKING:
    from egress_proxy.custody.postgres import PostgresCustodyStore
    from egress_proxy.custody.sqlite import CustodyStore

DEFAULT_STORE = DEFAULTS.store  # egress_proxy/edge/settings.py


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "custody", help="manage sealed credentials", description="manage sealed credentials in the custody store"
    )
    sub = parser.add_subparsers(dest="custody_command", metavar="ACTION", required=True)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--keys", required=True, metavar="KEYS", help="the keys directory made by `egresslaw keys init`")
    common.add_argument("--store", default=DEFAULT_STORE, metavar="FILE|URL",
                        help=f"the custody store: a SQLite file (default {DEFAULT_STORE}) or a postgresql:// URL")
    common.add_argument(
        "--lock-timeout",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="how long to wait for a lock another process holds on the store or the keys directory (default 10)",
    )
    address = argparse.ArgumentParser(add_help=False)
    address.add_argument("--workspace", help="the policy's workspace (with --artifact: the artifact's, when omitted)")
    address.add_argument("--connection", required=True, help="the connection name")
    address.add_argument("--handle", help="the custody handle the policy's `credential` names (with --artifact: the connection's, "
                         "when omitted)")
    address.add_argument("--artifact", metavar="A",
                         help="the compiled artifact: refuse a workspace, connection, handle or --kind it does not have "
                         "(with a did-you-mean), and fill in --workspace/--handle")

    init = sub.add_parser(
        "init",
        parents=[common],
        help="create an empty custody store",
        description="create an empty SQLite custody store (mode 0600) under the keys directory's custody key; an existing "
        "file is never overwritten. `custody put` creates the store too; `init` is for a proxy whose connections are sealed "
        "later, or an image that ships an empty store (a proxy whose artifact has no connection needs no store at all)",
        epilog="exit codes: 0 created, 2 the store exists already (never overwritten), a postgresql:// URL, or a usage, keys "
        "or I/O problem",
    )
    options_from_environment(init, "EGRESSLAW_", {"keys": "EGRESSLAW_KEYS", "store": "EGRESSLAW_STORE", "lock_timeout": "EGRESSLAW_LOCK_TIMEOUT"})
    init.set_defaults(run=run_init)
    put = sub.add_parser(
        "put",
        parents=[common, address],
        help="seal the secret read from stdin",
        description="seal the secret read from stdin (never from arguments); one trailing newline is stripped; "
        "a secret that is empty, longer than 16 KiB, or contains CR, LF or NUL is refused. With --kind oauth2|github_app|"
        "aws_sigv4: the kind's fields, as a JSON object on stdin or one per --field (not secret) / --field-file, checked "
        "for the kind (a missing field, a PEM that does not parse) without echoing any value",
    )
    put.add_argument("--kind", default="static", metavar="KIND",
                     help="the credential kind of the connection: static (default: the value on stdin), oauth2, github_app or "
                     "aws_sigv4 (fields as a JSON object on stdin, or one per --field/--field-file)")
    put.add_argument("--field", action="append", default=[], metavar="NAME=VALUE",
                     help="a field that is not secret (client_id, app_id, access_key_id, …); secrets never go on the command line")
    put.add_argument("--field-file", action="append", default=[], metavar="NAME=PATH",
                     help="a field read from a file (one trailing newline stripped), e.g. private_key=app.pem")
    put.set_defaults(run=run_put)
    lst = sub.add_parser("list", parents=[common], help="show addresses, key ids and timestamps (never values)")
    lst.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    lst.set_defaults(run=run_list)
    delete = sub.add_parser("delete", parents=[common, address], help="remove one sealed credential")
    delete.set_defaults(run=run_delete)
    rotate = sub.add_parser("rotate", parents=[common], help="re-seal every record under a new custody key id")
    rotate.set_defaults(run=run_rotate)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of seconds") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"`{text}` is not between 0 and 3600 seconds")
    return value


def _fail(exc: Exception) -> int:
    """Render a custody or key error. Store/key problems are usage/IO (2); refused operations are 1."""
    from egress_proxy.custody.keys import KeyFileError
    from egress_proxy.custody.records import CustodyError

    if isinstance(exc, KeyFileError) or (isinstance(exc, CustodyError) and exc.io):
        raise CliError(exc.message, exc.help, code=2) from None
    assert isinstance(exc, CustodyError)
    err(f"error: {exc.message}")
    if exc.help:
        err(f"help: {exc.help}")
    return 1


def _store(args: argparse.Namespace, *, create: bool = False) -> CustodyStore | PostgresCustodyStore:
    from egress_proxy.custody.stores import open_store

    return open_store(args.store, args.keys, create=create, lock_timeout=args.lock_timeout)  # a file (SQLite) or a postgresql:// URL


def _address(args: argparse.Namespace):
    from egress_proxy.custody.records import Address

    if getattr(args, "artifact", None):
        _check_against_artifact(args)
    missing = [flag for flag, value in (("--workspace", args.workspace), ("--handle", args.handle)) if not value]
    if missing:
        raise CliError(f"{' and '.join(missing)} required", "give them, or `--artifact build/egresslaw.json` to take them from "
                       "the compiled artifact (which also refuses a typo'd connection)")
    return Address(args.workspace, args.connection, args.handle)


def _suggest(name: str, known: list[str], what: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    return f"its {what}s: " + ", ".join(f"`{k}`" for k in sorted(known)) if known else f"it has no {what}"


def _check_against_artifact(args: argparse.Namespace) -> None:
    """CliError (exit 2) unless the artifact has this workspace, connection, handle and kind; fills in what was omitted."""
    from egresslaw.commands.prove import load

    artifact = load(args.artifact)
    where = f"artifact `{args.artifact}`"
    if args.workspace is None:
        args.workspace = artifact.workspace
    elif args.workspace != artifact.workspace:
        raise CliError(f"{where} is for workspace `{artifact.workspace}`, not `{args.workspace}`: the proxy would never read this record",
                       f"use `--workspace {artifact.workspace}` (or leave it out)")
    connection = artifact.connection(args.connection)
    if connection is None:
        raise CliError(f"{where} has no connection `{args.connection}`: the proxy would never read this record",
                       _suggest(args.connection, [c.name for c in artifact.connections], "connection"))
    if args.handle is None:
        args.handle = connection.credential_handle
    elif args.handle != connection.credential_handle:
        raise CliError(f"connection `{connection.name}` of {where} reads its credential from handle `{connection.credential_handle}`, "
                       f"not `{args.handle}`", f"use `--handle {connection.credential_handle}` (or leave it out)")
    kind = getattr(args, "kind", None)
    if kind is not None and (kind != "static" or args.field or args.field_file) and kind != connection.kind:
        raise CliError(f"connection `{connection.name}` of {where} is `{connection.kind}`, not `{kind}`",
                       f"use `--kind {connection.kind}`")
    if kind == "static" and connection.kind != "static" and not (args.field or args.field_file):
        raise CliError(f"connection `{connection.name}` of {where} is `{connection.kind}`: a single static value would not fit it",
                       f"use `--kind {connection.kind}` with its fields")


def read_secret_from_stdin() -> bytes:
    """Read the secret from stdin (echo off on a terminal) and strip one trailing newline."""
    from egress_proxy.custody.records import MAX_SECRET_BYTES

    if sys.stdin is None:
        raise CliError("no standard input to read the secret from", "pipe the secret on stdin")
    limit = MAX_SECRET_BYTES + 3  # room for a trailing CRLF; one byte more means too long
    try:
        if sys.stdin.isatty():
            data = _read_tty_line(limit)
        else:
            data = sys.stdin.buffer.read(limit)
    except OSError as exc:
        raise CliError(f"cannot read the secret from stdin: {exc.strerror or exc.__class__.__name__}") from None
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    return data


def _read_tty_line(limit: int) -> bytes:
    import termios

    fd = sys.stdin.fileno()
    sys.stderr.write("secret (input hidden): ")
    sys.stderr.flush()
    old = termios.tcgetattr(fd)
    new = termios.tcgetattr(fd)
    new[3] &= ~termios.ECHO
    try:
        termios.tcsetattr(fd, termios.TCSAFLUSH, new)
        return sys.stdin.buffer.readline(limit)
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, old)
        sys.stderr.write("\n")


def run_init(args: argparse.Namespace) -> int:
    """Create an empty SQLite store: the file made here with O_EXCL (0600), so an existing one is never touched."""
    import os

    from egress_proxy.custody.keys import KeyFileError
    from egress_proxy.custody.records import CustodyError, is_database_url

    if is_database_url(args.store):
        raise CliError("`custody init` creates a SQLite file; a PostgreSQL store's tables are created when it is first used",
                       "give `--store FILE`, or use the postgresql:// URL as it is (`custody put`, `egresslaw proxy --store URL`)")
    try:
        from egress_proxy.custody.keys import load_custody_keys

        load_custody_keys(args.keys)  # the keys first: a store is never left behind for keys that do not load
        fd = os.open(args.store, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except KeyFileError as exc:
        raise CliError(exc.message, exc.help) from None
    except FileExistsError:
        raise CliError(f"custody store `{args.store}` exists already: it is never overwritten",
                       "use it as it is (`egresslaw custody list --store …`), or give another --store") from None
    os.fchmod(fd, 0o600)
    os.close(fd)
    try:
        with _store(args) as store:  # the schema, under the custody key: the empty file becomes an empty store
            count = len(store.list())
    except (CustodyError, KeyFileError) as exc:
        os.unlink(args.store)  # ours, made above: nothing half-made is left behind
        return _fail(exc)
    out(f"created custody store `{args.store}` (mode 0600, {count} records)")
    return 0


def run_put(args: argparse.Namespace) -> int:
    """Seal stdin at the address; the store is created if missing."""
    from egress_proxy.custody.keys import KeyFileError
    from egress_proxy.custody.records import CustodyError, check_secret

    try:
        address = _address(args)
        if args.kind == "static" and not (args.field or args.field_file):
            value = check_secret(read_secret_from_stdin())  # refuse before touching keys or store
            what = ""
        else:
            value, names = _structured(args)
            what = f" ({args.kind}: {', '.join(names)})"
        with _store(args, create=True) as store:
            record = store.put(address, value)
    except (CustodyError, KeyFileError) as exc:
        return _fail(exc)
    out(f"sealed `{record.address}`{what} under key id `{record.key_id}`")
    return 0


def _structured(args: argparse.Namespace) -> tuple[bytes, list[str]]:
    """The sealed form of a structured record from --field/--field-file or a JSON object on stdin, checked for its kind;
    CustodyError naming the field that is wrong, never a value."""
    from egress_proxy.credentials import KINDS, check_record
    from egress_proxy.credentials.base import CredentialError
    from egress_proxy.custody.records import MAX_RECORD_BYTES, CustodyError

    kind = KINDS.get(args.kind)
    if kind is None or args.kind == "static":
        raise CustodyError(f"`--kind {args.kind}` takes no fields" if args.kind == "static" else "unknown credential kind",
                           f"one of: {', '.join(KINDS)}")
    specs = {f.name: f for f in kind.fields}
    fields: dict[str, str] = {}
    for flag, items in (("--field", args.field), ("--field-file", args.field_file)):
        for item in items:
            name, eq, rest = item.partition("=")
            if not eq or name not in specs:
                raise CustodyError(f"{flag} wants NAME=… with NAME one of the `{args.kind}` fields",
                                   "fields: " + ", ".join(f"{f.name}{' (secret)' if f.secret else ''}" for f in kind.fields))
            if name in fields:
                raise CustodyError(f"field `{name}` is given twice")
            if flag == "--field":
                if specs[name].secret:
                    # INVARIANT: a secret on the command line is seen by every user of the machine (ps, /proc): refused
                    raise CustodyError(f"field `{name}` is a secret and never goes on the command line",
                                       f"use `--field-file {name}=PATH` or a JSON object on stdin")
                fields[name] = rest
            else:
                fields[name] = _read_field_file(name, rest, MAX_RECORD_BYTES)
    if not (args.field or args.field_file):
        raw = read_secret_from_stdin()
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            example = ", ".join(f'"{f.name}": "…"' for f in kind.fields if f.required)
            raise CustodyError(f"stdin is not a JSON object of the `{args.kind}` fields",
                               f"e.g. `{{{example}}}`, or one field per --field/--field-file") from None
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise CustodyError("stdin must be a JSON object whose values are strings")
        fields = doc
    try:
        return check_record(args.kind, fields), sorted(fields)
    except CredentialError as exc:
        raise CustodyError(exc.message, exc.help) from None


def _read_field_file(name: str, path: str, limit: int) -> str:
    from egress_proxy.custody.records import CustodyError

    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise CustodyError(f"cannot read field `{name}` from `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    if len(data) > limit:
        raise CustodyError(f"field `{name}` in `{path}` is longer than {limit} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CustodyError(f"field `{name}` in `{path}` is not UTF-8 text") from None
    if not text.startswith("-----BEGIN"):
        text = text[:-1] if text.endswith("\n") else text
    return text


def run_list(args: argparse.Namespace) -> int:
    """Addresses, key ids and timestamps, one record a line."""
    from egress_proxy.custody.keys import KeyFileError
    from egress_proxy.custody.records import CustodyError

    try:
        with _store(args) as store:
            records = store.list()
    except (CustodyError, KeyFileError) as exc:
        return _fail(exc)
    if args.format == "json":
        doc = [
            {
                "workspace": r.address.workspace,
                "connection": r.address.connection,
                "handle": r.address.handle,
                "key_id": r.key_id,
                "created": r.created,
                "updated": r.updated,
            }
            for r in records
        ]
        out(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    if not records:
        from egress_proxy.custody.records import shown

        err(f"no credentials in `{shown(args.store)}`")  # a database URL's password is masked
        return 0
    rows = [("WORKSPACE", "CONNECTION", "HANDLE", "KEY ID", "CREATED", "UPDATED")]
    rows += [(r.address.workspace, r.address.connection, r.address.handle, r.key_id, r.created, r.updated) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def run_delete(args: argparse.Namespace) -> int:
    """Remove one record; exit 1 if there is none."""
    from egress_proxy.custody.keys import KeyFileError
    from egress_proxy.custody.records import CustodyError

    try:
        address = _address(args)
        with _store(args) as store:
            store.delete(address)
    except (CustodyError, KeyFileError) as exc:
        return _fail(exc)
    out(f"deleted `{address}`")
    return 0


def run_rotate(args: argparse.Namespace) -> int:
    """Re-seal every record under a new key id and retire the old ones."""
    from egress_proxy.custody.keys import KeyFileError
    from egress_proxy.custody.records import CustodyError

    try:
        with _store(args) as store:
            result = store.rotate(on_wait=lambda message: err(f"note: {message}"))
    except (CustodyError, KeyFileError) as exc:
        return _fail(exc)
    retired = ", ".join(f"`{k}`" for k in result.retired) or "none"
    out(f"re-sealed {result.resealed} record(s) under key id `{result.key_id}`; retired key ids: {retired}")
    return 0
