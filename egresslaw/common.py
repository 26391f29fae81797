"""What every command module shares: the usage error and small output helpers."""

from __future__ import annotations

import sys
from pathlib import Path


class CliError(Exception):
    """A usage or I/O problem: printed as `error: …` (plus `help: …`) with exit code `code`, never a traceback."""

    def __init__(self, message: str, help: str | None = None, code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.help = help
        self.code = code


def read_text(path: str | Path, what: str = "file") -> str:
    """Read a UTF-8 file or raise CliError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"{what} `{path}` does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {what} `{path}`: {exc.__class__.__name__}") from None


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
