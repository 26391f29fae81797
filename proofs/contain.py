"""A check that raises is `unknown`, never a crash: the property, the subject and the line that raised.

Whatever a check runs (the symbolic evaluator, the spec, concretization, the replay through `decide()`)
may raise; the runner turns the exception into a Result naming where, so `prove` still checks every other
subject and exits 4 with no traceback. Only the exception type, a short message and the innermost
frame in this project's code are kept (a message is cut at MESSAGE_MAX characters).
"""

from __future__ import annotations

import traceback
from pathlib import Path

from proofs.report import Result

ROOT = Path(__file__).resolve().parents[1]
MESSAGE_MAX = 160


def raised_at(exc: BaseException) -> str:
    """`path:line` of the innermost frame of `exc` in the project's own code (else the innermost frame at all)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        # below ROOT, but not a dependency of a venv inside a checkout (installed, ROOT is site-packages itself)
        if path.is_relative_to(ROOT) and not {".venv", "site-packages"} & set(path.relative_to(ROOT).parts):
            return f"{path.relative_to(ROOT).as_posix()}:{frame.lineno}"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def crash_detail(exc: BaseException) -> str:
    """`the check raised ValueError at proofs/x.py:12: message`, on one line and short."""
    message = " ".join(str(exc).split())
    if len(message) > MESSAGE_MAX:
        message = message[: MESSAGE_MAX - 3] + "..."
    return f"the check raised {type(exc).__name__} at {raised_at(exc)}" + (f": {message}" if message else "")


def crashed(worker: str, subject: str, prop: str, exc: BaseException) -> Result:
    return Result(worker, subject, prop, "unknown", 0, None, crash_detail(exc))
