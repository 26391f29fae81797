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
