"""Send the ``batching`` library's log records to the Prefect API (the run's logs in the UI).

Prefect forwards a library's records only when ``PREFECT_LOGGING_EXTRA_LOGGERS`` names the
logger *before* ``import prefect`` configures logging, and then only at the level the logger
allows (the root's WARNING by default). :func:`to_prefect` covers both: it sets ``batching`` to
INFO and attaches Prefect's API handler when the environment did not. Records from the
pipeline's own threads (forward, commit, heartbeat) carry no Prefect run context, so they are
stamped with the active flow run's id; outside a run they are kept out of the API. Their
numbers (``extra``: ``batch_id``, ``n_items``, ``duration_s``...), which Prefect's handler
drops, are put on the line the UI shows (``batching.logs.WithFields``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.exceptions import MissingContextError
from prefect.logging.handlers import APILogHandler

from batching.logs import WithFields

LIBRARY = "batching"
EXTRA_LOGGERS_ENV = "PREFECT_LOGGING_EXTRA_LOGGERS"


class _StampRun(logging.Filter):
    """Give ``batching`` records logged outside a Prefect context the active flow run id."""

    def __init__(self, flow_run_id: str | None) -> None:
        super().__init__()
        self.flow_run_id = flow_run_id

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == LIBRARY or record.name.startswith(LIBRARY + ".")
        if not ours or getattr(record, "flow_run_id", None):
            return True
        if _in_run_context():
            return True
        if self.flow_run_id:
            record.flow_run_id = self.flow_run_id
        else:
            record.send_to_api = False
        return True


def _in_run_context() -> bool:
    from prefect.context import get_run_context

    try:
        get_run_context()
    except MissingContextError:
        return False
    return True


@contextmanager
def to_prefect(flow_run_id: str | None, level: int = logging.INFO) -> Iterator[None]:
    """Within the block, ``batching`` records at ``level`` and above reach the flow run's logs,
    each with its numbers on the line.

    Restores the logger's level, handlers and their formatters on exit.
    """
    logger = logging.getLogger(LIBRARY)
    previous = logger.level
    handlers = [h for h in logger.handlers if isinstance(h, APILogHandler)]
    added = [] if handlers else [APILogHandler()]
    stamp = _StampRun(flow_run_id)
    for handler in added:
        logger.addHandler(handler)
    for handler in handlers + added:
        handler.addFilter(stamp)
    wrapped = [
        (h, h.formatter) for h in handlers + added if not isinstance(h.formatter, WithFields)
    ]
    for handler, formatter in wrapped:
        handler.setFormatter(WithFields(formatter))
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
        for handler in handlers + added:
            handler.removeFilter(stamp)
        for handler, formatter in wrapped:
            handler.setFormatter(formatter)
        for handler in added:
            logger.removeHandler(handler)
