"""Logging set-up for the command line and its worker processes (standard library only).

The library logs a constant message with its numbers in ``extra`` (``"batch committed"``,
``batch_id``, ``n_items``, ``duration_s``...): a structured handler (JSON) reads them as
fields, but a text handler prints the message alone. :func:`detail` renders them as a short
``key=value`` tail for the text a person reads: the CLI's stderr (:class:`OneLine`) and the
Prefect UI (:class:`WithFields`, installed by ``flows.logs``). The records themselves are not
changed: their message stays the constant, their fields stay attributes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from batching.redaction import redact_url

LIBRARY = "batching"

# The ``extra`` fields shown on a text line, in this order: which run, batch, lease or worker;
# then how much and how long. Any other ``n_*`` count follows them. Left off: the action (the
# message says it), paths, URLs and payload-sized values.
FIELDS = (
    "run_id",
    "batch_id",
    "lease_id",
    "item_id",
    "worker",
    "sink",
    "n_items",
    "n_rows",
    "n_bytes",
    "n_replayed",
    "published",
    "batch_size",
    "length",
    "oom_ceiling",
    "version",
    "duration_s",
)
_MAX_VALUE = 80  # a longer string field is not a number or an id: left to structured handlers


def detail(record: logging.LogRecord) -> str:
    """``" key=value ..."`` for the fields of :data:`FIELDS` (and other ``n_*`` counts) that
    ``record`` carries, or ``""``: seconds to the millisecond, ids as they are."""
    fields = record.__dict__
    extra_counts = sorted(k for k in fields if k.startswith("n_") and k not in FIELDS)
    parts = []
    for key in (*FIELDS, *extra_counts):
        text = _value(fields.get(key), key)
        if text is not None:
            parts.append(f"{key}={text}")
    return "".join(f" {p}" for p in parts)


def _value(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3f}" if key.endswith("_s") else f"{value:g}"
    if isinstance(value, str) and 0 < len(value) <= _MAX_VALUE and value.isprintable():
        return value if " " not in value else repr(value)
    return None


def cause(record: logging.LogRecord) -> str:
    """``" (kind: error)"`` from the record's structured cause (masked), or ``""``."""
    error = record.__dict__.get("error")
    if not error:
        return ""
    kind = record.__dict__.get("error_type")
    error = redact_url(str(error))
    return f" ({kind}: {error})" if kind else f" ({error})"


def _has_cause(record: logging.LogRecord, why: str) -> bool:
    """Whether the message already ends with its cause: a worker's record arrives so
    (``batching.loop.pipes.ToParent`` formats it before sending it to the parent)."""
    return bool(why) and record.getMessage().rstrip().endswith(why.strip())


def ours(record: logging.LogRecord) -> bool:
    """Whether ``record`` comes from the ``batching`` library."""
    return record.name == LIBRARY or record.name.startswith(LIBRARY + ".")


class OneLine(logging.Formatter):
    """Library warnings on stderr as one line each: no tracebacks for a user to wade through.

    ``fields``: the message followed by its numbers (:func:`detail`); off for a worker's
    records, which the parent's formatter renders.
    """

    def __init__(self, fmt: str | None = None, *, fields: bool = False) -> None:
        super().__init__(fmt)
        self.fields = fields

    def formatException(self, ei: Any) -> str:
        return ""

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        return text + detail(record) if self.fields else text

    def format(self, record: logging.LogRecord) -> str:
        record.exc_text = ""
        text = super().format(record)
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({record.exc_info[1]})"
        elif (why := cause(record)) and not _has_cause(record, why):
            text += why
        return text.rstrip()


class WithFields(logging.Formatter):
    """Another handler's formatter (or the default ``%(message)s``), with the message of each
    ``batching`` record followed by its numbers (:func:`detail`) and, when it has no
    exception, its structured cause: what Prefect's API handler sends to the UI, which shows
    the message alone. Other records are formatted as before."""

    def __init__(self, inner: logging.Formatter | None = None) -> None:
        super().__init__()
        self.inner = inner if inner is not None else logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if not ours(record):
            return self.inner.format(record)
        message = record.getMessage()
        tail = detail(record)
        why = "" if record.exc_info or _has_cause(record, cause(record)) else cause(record)
        if not tail and not why:
            return self.inner.format(record)
        copy = logging.makeLogRecord(record.__dict__)  # the record others see stays as it was
        copy.msg, copy.args = message + tail + why, None
        return self.inner.format(copy)


def configure_logging(level: int = logging.WARNING) -> None:
    """``batching`` loggers to stderr at ``level`` and up, one line each, with their numbers."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLine("%(levelname)s %(name)s: %(message)s", fields=True))
    root = logging.getLogger(LIBRARY)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
