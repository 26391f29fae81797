"""The exfiltration budget's values (docs/budget.md, "Declaring caps"): window and size text -> whole numbers, and
when a changed budget admits more than its published version (a widening under `compile --locked`).

The passes read `budget = {requests, bytes, window}` with these; `lock` asks `budget_widening` about each changed
subject. Pure functions of their arguments, no Lark.
"""

from __future__ import annotations

import math
import re

from compiler.artifact import Budget
from compiler.errors import CompilerError
from compiler.secrets_scan import redact

WINDOW_MIN = 1
WINDOW_MAX = 30 * 86400  # 30 days
CAP_MAX = 2**53  # requests or bytes per window: any larger figure is no cap at all (and stays an exact JSON number)
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
SIZES = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_WINDOW = re.compile(r"([0-9]{1,12})([smhd]?)")
_SIZE = re.compile(r"([0-9]{1,20})\s?([A-Za-z]*)")
# Spellings people write for a size that this language does not guess at: decimal (MB = 10^6) or binary (MiB)?
_AMBIGUOUS = {"k": "KiB", "kb": "KiB", "m": "MiB", "mb": "MiB", "g": "GiB", "gb": "GiB", "t": "TiB", "tb": "TiB"}


class BudgetValueError(CompilerError, ValueError):
    """A window or size that is not one; `help` says what to write instead."""


def _shown(text: str) -> str:
    """User input inside backticks: escaped, shortened, and never a secret."""
    shown = redact(text).encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= 40 else shown[:37] + "..."


def parse_window(value: str | int) -> int:
    """`"30s"`, `"15m"`, `"1h"`, `"1d"`, `"3600"` or `3600` as seconds, 1 second to 30 days."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BudgetValueError("`window` must be a duration", 'e.g. `window = "1h"` (`s`, `m`, `h`, `d`) or whole seconds')
    if isinstance(value, int):
        seconds = value
    else:
        m = _WINDOW.fullmatch(value)
        if m is None:
            raise BudgetValueError(f"window `{_shown(value)}` is not a duration",
                                   'a whole number and one unit: `"30s"`, `"15m"`, `"1h"`, `"1d"`, or whole seconds')
        seconds = int(m.group(1)) * UNITS[m.group(2) or "s"]
    if not WINDOW_MIN <= seconds <= WINDOW_MAX:
        raise BudgetValueError(f"a window of {seconds} seconds is outside 1 second to 30 days",
                               'windows run from `"1s"` to `"30d"`')
    return seconds


def parse_size(value: str | int) -> int:
    """`1048576`, `"1048576"`, `"512KiB"`, `"64MiB"`, `"1GiB"` (also `B` and `TiB`) as bytes, at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BudgetValueError("`bytes` must be a size", 'a whole number of bytes or a size such as `"64MiB"`')
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.fullmatch(value)
        if m is None or (m.group(2) and m.group(2) not in SIZES):
            unit = m.group(2) if m is not None else ""
            meant = _AMBIGUOUS.get(unit.lower()) if m is not None else None
            help = (f'write `"{m.group(1)}{meant}"` (powers of 1024)' if meant
                    else 'a whole number with `B`, `KiB`, `MiB`, `GiB` or `TiB`, e.g. `"64MiB"`')
            raise BudgetValueError(f"`{_shown(value)}` is not a size", help)
        size = int(m.group(1)) * SIZES[m.group(2) or "B"]
    if size < 1:
        raise BudgetValueError(f"`bytes` is {size}: a cap admits at least 1 byte", "leave `bytes` out to cap requests only")
    if size > CAP_MAX:
        raise BudgetValueError(f"`bytes` is {size:,}, over {CAP_MAX:,}", "leave `bytes` out: no window carries that much")
    return size


def describe_window(seconds: int) -> str:
    """`1h`, `15m`, `90s`: the largest unit that divides the window."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def describe_size(n: int) -> str:
    """`64 MiB`, `512 KiB`, `1,000 bytes`: the largest binary unit that divides the size."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size:,} {unit}"
    return f"{n:,} bytes"


def windows_meeting(old_window: int, new_window: int) -> int:
    """At most how many aligned windows of `new_window` seconds one aligned window of `old_window` meets (both
    aligned at the Unix epoch: a window holding `t` starts at `t - t mod window`)."""
    if new_window % old_window == 0:
        return 1  # a longer window whose boundaries are the old window's: each old window lies inside one
    if old_window % new_window == 0:
        return old_window // new_window
    return math.ceil(old_window / new_window) + 1  # an interval of that length meets at most this many


def budget_widening(old: Budget | None, new: Budget | None) -> str | None:
    """Why `new` may admit within one of `old`'s windows more than `old` does (None: it never does).

    A cap is narrower when, in every window of the published budget, the most the new budget admits (its cap
    times the new windows that window meets) is no more than the published cap: lowering a cap, or lengthening
    the window to a multiple of the old one, narrows; raising a cap, dropping it, or shortening the window while
    keeping the cap widens. A subject that had no budget cannot widen by gaining one."""
    if old is None:
        return None
    if new is None:
        return f"drops its budget (was {_caps(old)})"
    meets = windows_meeting(old.window, new.window)
    for cap in ("requests", "bytes"):
        before, after = getattr(old, cap), getattr(new, cap)
        if before is None:
            continue
        if after is None:
            return f"drops its budget's `{cap}` cap (was {_caps(old)})"
        if after * meets > before:
            return f"admits more per window: budget {_caps(new)}, was {_caps(old)}"
    return None


def _caps(budget: Budget) -> str:
    caps = [f"{v:,} {cap}" for cap in ("requests", "bytes") if (v := getattr(budget, cap)) is not None]
    return f"{' and '.join(caps)} per {describe_window(budget.window)}"
