"""Logging for long-running commands (`egresslaw proxy`): UTC timestamps, text or JSON lines, one level.

Text:  `2026-11-30T09:58:16.316Z WARNING egresslaw.proxy: message`
JSON:  `{"level": "warning", "logger": "egresslaw.proxy", "message": "message", "ts": "2026-11-30T09:58:16.316Z"}`
       plus any `extra={...}` fields given to the log call (e.g. `help`), and `exception` (its type
       only: exception messages can carry input) when one is attached.

mitmproxy's own records pass through the same handler with its command-line advice removed
(`Try specifying a different port by using --mode regular@8084`: egresslaw has no such option).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_STANDARD = set(vars(logging.LogRecord("x", 0, "x", 0, "x", None, None))) | {"message", "asctime", "taskName"}
# A line of mitmproxy advice that names one of mitmproxy's own options or commands.
_MITM_ADVICE = re.compile(r"^\s*(?:Try specifying\b.*|.*`--[a-z][a-z0-9-]*(?:[ =@][^`]*)?`.*|.*\b(?:mitmdump|mitmweb)\b.*)$")
# What egresslaw reports itself, better (the listen failure names the address and the cause).
_MITM_DUPLICATES = re.compile(r"proxy failed to listen on ")


def utc_timestamp(created: float) -> str:
    """ISO 8601 in UTC with milliseconds and a `Z`."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created * 1000) % 1000:03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{utc_timestamp(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        extra = getattr(record, "help", None)
        if extra:
            line += f"\nhelp: {extra}"
        if record.exc_info and record.exc_info[0] is not None:
            line += f" ({record.exc_info[0].__name__})"
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in doc:
                doc[key] = value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else str(value)
        if record.exc_info and record.exc_info[0] is not None:
            doc["exception"] = record.exc_info[0].__name__
        return json.dumps(doc, sort_keys=True, ensure_ascii=False, default=str)


class MitmproxyAdvice(logging.Filter):
    """Drops mitmproxy's command-line advice from its records, and the records egresslaw reports itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("mitmproxy"):
            return True
        message = record.getMessage()
        if _MITM_DUPLICATES.search(message):
            return False
        kept = [line for line in message.splitlines() if not _MITM_ADVICE.match(line)]
        if len(kept) != len(message.splitlines()):
            if not kept:
                return False
            record.msg, record.args = "\n".join(kept), None
        return True


def configure(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Route every record (egresslaw's and mitmproxy's) to one stderr handler; returns that handler."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(MitmproxyAdvice())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # mitmproxy is chatty at INFO (every client connection); its warnings and errors still show.
    logging.getLogger("mitmproxy").setLevel(logging.INFO if level == "debug" else max(logging.WARNING, root.level))
    return handler
