"""What every command module shares: the usage error and small output helpers."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from catalog.errors import Problem


class CliError(Problem):
    """A usage or I/O problem: printed as `error: …` (plus `help: …`) with exit code `code`, never a traceback."""

    def __init__(self, message: str, help: str | None = None, code: int = 2) -> None:
        super().__init__(message, help)
        self.code = code


def read_text(path: str | Path, what: str = "file") -> str:
    """Read a UTF-8 file or raise CliError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"{what} `{path}` does not exist", "check the path") from None
    except IsADirectoryError:
        raise CliError(f"{what} `{path}` is a directory, not a file", "pass the file itself") from None
    except NotADirectoryError:
        raise CliError(f"{what} `{path}`: a part of the path is a file, not a directory", "check the path") from None
    except UnicodeDecodeError as exc:
        raise CliError(f"{what} `{path}` is not UTF-8 text (byte {exc.start})", "pass the text file itself, saved as UTF-8") from None
    except OSError as exc:
        raise CliError(f"cannot read {what} `{path}`: {exc.strerror or exc.__class__.__name__}", "check the path and its permissions") from None


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
    except OSError as exc:
        raise CliError(f"cannot write `{path}`: {exc.strerror or exc.__class__.__name__}") from None


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def err(text: str) -> None:
    sys.stderr.write(text + "\n")


class Progress:
    """Progress of a long run, on stderr, never on stdout (which may carry JSON or SARIF).

    On a terminal one status line is rewritten in place. Elsewhere (CI logs) a line is printed at
    every tenth of the work and, while a step runs long, every `interval` seconds, so a log never
    goes quiet for long. `mode` is `auto` (only once the run has lasted `delay` seconds),
    `always` or `never`.
    """

    def __init__(self, what: str, mode: str = "auto", *, stream=None, delay: float = 2.0, interval: float = 5.0) -> None:
        import threading
        import time

        self._time = time.monotonic
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = mode != "never"
        self.delay = 0.0 if mode == "always" else delay
        self.interval = 0.5 if self.tty else interval
        self.start = self._time()
        self.status = "starting"
        self.done = 0
        self.total = 0
        self._milestone = 0
        self._last = 0.0
        self._printed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="egresslaw-progress", daemon=True)
        if self.enabled:
            self._thread.start()

    def stage(self, status: str) -> None:
        """A new step whose length is unknown (e.g. `parsing 3 files (229,007 lines)`)."""
        with self._lock:
            self.status, self.done, self.total, self._milestone = status, 0, 0, 0
            self._emit(force=not self.tty)

    def update(self, done: int, total: int, status: str) -> None:
        """`done` of `total` units of the current step; `status` says what they are."""
        with self._lock:
            self.status, self.done, self.total = status, done, total
            tenth = (10 * done) // total if total else 0
            milestone = tenth > self._milestone or done == total
            self._milestone = max(self._milestone, tenth)
            self._emit(force=milestone or self.tty)

    def close(self, final: str | None = None) -> None:
        """Stop the ticker; print `final` if anything was printed before (so the log says how it ended)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            if self._printed and final:
                self._write(f"{self.what}: {final} ({self._elapsed()})", end=True)
            elif self._printed and self.tty:
                self.stream.write("\n")
                self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._emit(force=True)

    def _elapsed(self) -> str:
        return f"{self._time() - self.start:.1f} s"

    def _emit(self, force: bool) -> None:
        # INVARIANT: called with self._lock held.
        now = self._time()
        if not self.enabled or now - self.start < self.delay or not (force or not self._printed):
            return
        if not self.tty and self._printed and now - self._last < min(1.0, self.interval) and self.done != self.total:
            return  # never more than about one line a second in a log
        self._last = now
        count = f" {self.done}/{self.total}" if self.total else ""
        self._write(f"{self.what}: {self.status}{count} ({self._elapsed()})")

    def _write(self, line: str, end: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if end else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._printed = True


ENV_TRUE = ("1", "true", "yes", "on")
ENV_FALSE = ("0", "false", "no", "off")


def options_from_environment(parser, prefix: str, only: dict[str, str] | None = None) -> None:
    """Let every option of `parser` come from an environment variable `<prefix><DEST>` too (with `only`: just the
    options whose dest it names, each from the variable it maps to, e.g. `{"dir": "EGRESSLAW_KEYS"}`).

    `--audit-log F` is also `EGRESSLAW_AUDIT_LOG=F`; a flag (`--allow-unproven`) takes `1/true/yes/on`
    or `0/false/no/off`; a repeatable option takes several values separated by spaces or newlines.
    A flag on the command line always wins over the environment. The binding happens when the
    parser parses (so options added by any code before that get it) and each option's help names
    its variable.
    """
    parser.__class__ = _EnvOptionsParser
    parser.env_prefix = prefix
    parser.env_only = only


class Parser(argparse.ArgumentParser):
    """argparse with a did-you-mean for a misspelled command or choice (`egresslaw proxi`, `--log-format jsno`)."""

    def error(self, message: str):
        import difflib
        import re

        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            close = difflib.get_close_matches(m.group(1), re.findall(r"'([^']*)'", m.group(2)), n=1, cutoff=0.6)
            if close:
                message += f"; did you mean `{close[0]}`?"
        super().error(message)


def misspelled_options(parser: argparse.ArgumentParser, argv: list[str], extra: list[str]) -> list[str]:
    """For each unrecognized `--option` in `extra`, the closest option of the (sub)command `argv` names, if one is close."""
    import difflib

    leaf = parser
    for token in argv:
        if token == "--":
            break
        subs = [a for a in leaf._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            leaf = subs[0].choices[token]
    known = [o for a in leaf._actions for o in a.option_strings if o.startswith("--")]
    out = []
    for token in extra:
        name = token.split("=", 1)[0]
        if name.startswith("--"):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                out.append(f"`{name}`: did you mean `{close[0]}`?")
    return out


class _EnvOptionsParser(Parser):
    env_prefix = "EGRESSLAW_"
    env_only: dict[str, str] | None = None

    def parse_known_args(self, args=None, namespace=None):
        import os

        given = list(sys.argv[1:] if args is None else args)
        for action in self._actions:
            if not action.option_strings or action.dest == "help" or isinstance(action, argparse._VersionAction):
                continue
            if self.env_only is not None and action.dest not in self.env_only:
                continue
            name = self.env_only[action.dest] if self.env_only is not None else self.env_prefix + action.dest.upper()
            if action.help and name not in action.help:
                action.help += f" [env: {name}]"
            originals = self.__dict__.setdefault("_env_originals", {})
            original_default, original_required = originals.setdefault(action.dest, (action.default, action.required))
            raw = os.environ.get(name)
            if raw is None or _given_on_command_line(action, given):
                self.set_defaults(**{action.dest: original_default})  # the parser may be parsing again
                action.required = original_required
                continue
            self.set_defaults(**{action.dest: self._env_value(action, name, raw)})
            action.required = False
        return super().parse_known_args(args, namespace)

    def _env_value(self, action, name: str, raw: str):
        if action.nargs == 0:  # store_true / store_false / store_const
            word = raw.strip().lower()
            if word in ENV_TRUE:
                return action.const
            if word in ENV_FALSE:
                return action.default
            self.error(f"{name}={raw!r}: expected one of {'/'.join(ENV_TRUE)} or {'/'.join(ENV_FALSE)}")
        if isinstance(action, argparse._AppendAction):
            return [self._env_convert(action, name, item) for item in raw.split()]
        return self._env_convert(action, name, raw.strip())

    def _env_convert(self, action, name: str, text: str):
        try:
            value = action.type(text) if action.type is not None else text
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            self.error(f"{name}={text!r}: {exc}")
        if action.choices is not None and value not in action.choices:
            self.error(f"{name}={text!r}: choose from {', '.join(map(str, action.choices))}")
        return value


def _given_on_command_line(action, argv: list[str]) -> bool:
    """Does `argv` name this option (exactly, as `--opt=value`, or abbreviated as argparse allows)?"""
    for token in argv:
        if token == "--":
            break
        head = token.split("=", 1)[0]
        for opt in action.option_strings:
            if head == opt or (opt.startswith("--") and len(head) > 2 and head.startswith("--") and opt.startswith(head)):
                return True
    return False


# -- the validators of the options `egresslaw proxy` and `egresslaw lane` share (egress_proxy/front/settings.py) --


def parse_positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"`{text}` is not a positive integer")
    return int(text)


def parse_grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 3600:  # NaN and infinities fail too
        raise argparse.ArgumentTypeError(f"`{text}` is not a number of seconds from 0 to 3600")
    return value


def parse_audit_sync(text: str) -> str:
    # Imported here: an import cost (every command's parser is built for `--help`; only proxy and lane need the audit code)
    from egress_proxy.audit.log import parse_sync

    try:
        parse_sync(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


PARSERS = {"positive": parse_positive_int, "grace": parse_grace, "sync": parse_audit_sync, "float": float, "int": int}


def parse_digest(text: str) -> str:
    """--require-within: a sha256 hex digest or a prefix of at least 12 digits of one, lowercased."""
    value = text.strip().lower()
    if not 12 <= len(value) <= 64 or any(c not in "0123456789abcdef" for c in value):
        raise CliError(f"--require-within `{text}` is not an artifact digest",
                       "give the ceiling artifact's sha256 digest (at least 12 hex digits), as `egresslaw show` prints it")
    return value


def hostport(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise CliError(f"{what} `{text}` is not HOST:PORT")
    return host.strip("[]"), int(port)


EXPORT_FIELDS = ("export_to", "export_headers", "export_ca", "export_cert", "export_key", "export_state")


def export_fields(args) -> dict:
    """The audit export's options of `egresslaw proxy` and `egresslaw lane` (FrontConfig fields of the same names)."""
    return {name: getattr(args, name) or None for name in EXPORT_FIELDS}
