"""Logging set-up for the command line and its worker processes (standard library only)."""

from __future__ import annotations

import logging
from typing import Any

from batching.redaction import redact_url


class OneLine(logging.Formatter):
    """Library warnings on stderr as one line each: no tracebacks for a user to wade through."""

    def formatException(self, ei: Any) -> str:
        return ""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_text = ""
        text = super().format(record)
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({record.exc_info[1]})"
        elif error := record.__dict__.get("error"):  # the library's structured cause (masked)
            kind = record.__dict__.get("error_type")
            error = redact_url(str(error))
            text += f" ({kind}: {error})" if kind else f" ({error})"
        return text.rstrip()


def configure_logging(level: int = logging.WARNING) -> None:
    """``batching`` loggers to stderr at ``level`` and up, one line each."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLine("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("batching")
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
