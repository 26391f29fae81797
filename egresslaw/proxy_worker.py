"""`python -m egresslaw.proxy_worker FD`: one worker process of `egresslaw proxy --workers N` (its supervisor starts it).

The worker itself is `egress_proxy.run.supervisor.run_worker`; this entry point only sets up egresslaw's logging
(same format and level as the supervisor's, UTC), with the worker's number on every record: a `worker` field
in JSON, `(worker N)` after the logger's name in text.
"""

from __future__ import annotations

import logging
import sys

from egress_proxy.run.supervisor import main as worker_main
from egresslaw import logs


class _Tag(logging.Filter):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


class _TaggedText(logs.TextFormatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return line.replace(f" {record.name}: ", f" {record.name} (worker {getattr(record, 'worker', '?')}): ", 1)


def setup_logging(options: dict, index: int) -> None:
    """egresslaw's log handler (`egresslaw.logs.configure`) with this worker's number on every record."""
    handler = logs.configure(str(options.get("level", "info")), str(options.get("format", "text")))
    handler.addFilter(_Tag(index))
    if options.get("format", "text") != "json":
        handler.setFormatter(_TaggedText())


def main() -> int:
    return worker_main(sys.argv[1:], setup_logging)


if __name__ == "__main__":
    sys.exit(main())
