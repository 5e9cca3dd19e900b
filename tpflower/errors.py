"""The exception of tpflower's Python API (docs/python-api.md), and the one a run stops with (RunError)."""

from __future__ import annotations

import os
from pathlib import Path

TRACEBACK_ENV = "TPFLOWER_TRACEBACK"
OFF_WORDS = ("", "0", "false", "no", "off")  # TPFLOWER_TRACEBACK values that leave tracebacks off


def traceback_wanted() -> bool:
    """Whether ``TPFLOWER_TRACEBACK`` asks for the original exception and its traceback instead of the one
    line: set to anything but 0, false, no, off or nothing (case aside)."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in OFF_WORDS


class TpflowerError(Exception):
    """A refused setting, bad data or a failed run, raised by ``tpflower.fit``, ``Model.predict`` and
    ``tpflower.load``. Its message is what the command line prints after ``error:`` (one line; a data check's
    report is its header and one line per problem); ``log`` is the file that holds the traceback, if any."""

    def __init__(self, message: str, log: str | Path | None = None):
        super().__init__(message)
        self.log = Path(log) if log is not None else None


class RunError(RuntimeError):
    """A run stopped by a client or the transport; the message names the table and shard at fault."""
