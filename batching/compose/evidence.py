"""Lineage work beside a scoring run: the output's version for the run's last event, and
re-sending the events earlier runs spooled (:mod:`batching.evidence.spool`), in the
background of a run or from ``batching lineage flush``. Neither ever fails or holds a run.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from batching import config as cfg
from batching import models
from batching.compose import build
from batching.evidence import lineage, spool
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.redaction import redact_url
from batching.store import database, schema

logger = logging.getLogger(__name__)


def output_version(queue: q.SqlQueue, sink: sinks.Sink, run_id: str) -> str | None:
    """The output dataset's version after the run, for the lineage ``version`` facet.

    A Delta table: its version when the run ended (after the run's last commit; with scorers
    beside it, perhaps after theirs too). Parquet and SQL have no version of their own: the
    sha256 of the ids of the batches the run (and its workers) committed, sorted, which names
    what the run added. None when the run committed nothing, or it cannot be read (logged:
    lineage never fails a run).
    """
    try:
        if sink.kind == "delta":
            return str(sink.table().version())  # type: ignore[attr-defined]
        b, r = schema.batches.c, schema.runs.c
        with queue.read() as conn:
            workers = sa.select(r.run_id).where(r.parent_run_id == run_id)
            ids = [run_id, *conn.execute(workers).scalars()]
            live = b.state.in_(models.LIVE_BATCH_STATES)
            found = conn.execute(sa.select(b.batch_id).where(b.run_id.in_(ids), live))
            batch_ids = sorted(found.scalars())
    except Exception:  # lineage never fails a run
        logger.warning(
            "output version not read", exc_info=True, extra={"action": "lineage_version_failed"}
        )
        return None
    if not batch_ids:
        return None
    return hashlib.sha256("\n".join(batch_ids).encode()).hexdigest()


def flush_lineage(
    config: cfg.PipelineConfig,
    res: build.Resolved,
    lineage_config: cfg.LineageConfig | None = None,
    *,
    deadline_s: float | None = None,
    stop: threading.Event | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> spool.Flushed | None:
    """Re-send the events spooled in ``res.db_url`` to where lineage goes now (its own engine
    and session: safe beside a run and other flushers); None when that is the console or
    nowhere (they wait).

    Raises:
        ConfigError: the lineage settings are invalid.
        QueueError: the database cannot be read or written.
    """
    settings = lineage_config or config.lineage
    if settings.transport not in build.RESENT_OVER:
        return None
    sender = lineage.EventSender(
        settings, base_dir=Path(config.base_dir), output_dir=build.lineage_dir(config, res)
    )
    engine = database.create_engine(res.db_url)
    try:
        kept = spool.Spool(
            engine, max_events=settings.spool_max_events, max_age_s=settings.spool_max_age_s
        )
        return kept.flush(
            sender.send, send_s=sender.deadline_s, deadline_s=deadline_s, stop=stop, on_sent=on_sent
        )
    finally:
        sender.close()
        engine.dispose()


class BackgroundFlush:
    """:func:`flush_lineage` in a daemon thread, beside a run: never raises, never holds it.

    ``stop()`` asks it to end after the event being sent and waits for that at most
    ``wait_s`` (one bounded send); what it did not send waits for the next flush.
    """

    def __init__(
        self,
        config: cfg.PipelineConfig,
        res: build.Resolved,
        lineage_config: cfg.LineageConfig | None,
        deadline_s: float,
    ) -> None:
        settings = lineage_config or config.lineage
        self.wait_s = (settings.timeout_s + 0.5) * (settings.retries + 1)
        self._stop = threading.Event()

        def flush() -> None:
            try:
                done = flush_lineage(
                    config, res, lineage_config, deadline_s=deadline_s, stop=self._stop
                )
            except Exception as exc:  # lineage never fails or holds a run
                # INFO: nothing is lost (it waits), and a database that fails fails the run too.
                logger.info(
                    "spooled lineage not flushed",
                    extra={"action": "lineage_flush_failed", "error": redact_url(str(exc))},
                )
                return
            if done is not None and (done.sent or done.failed_runs):
                level = logging.WARNING if done.failed_runs else logging.INFO
                logger.log(
                    level,
                    "spooled lineage flushed",
                    extra={
                        "action": "lineage_flushed",
                        "sent": done.sent,
                        "failed_runs": done.failed_runs,
                        "left": done.left.events,
                        "error": done.error,
                    },
                )

        self._thread = threading.Thread(target=flush, name="lineage-flush", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the flush to end; wait for the event in flight (``wait_s`` at most)."""
        self._stop.set()
        self._thread.join(self.wait_s)


def start_lineage_flush(
    config: cfg.PipelineConfig,
    res: build.Resolved,
    lineage_config: cfg.LineageConfig | None = None,
    *,
    deadline_s: float = 120.0,
) -> BackgroundFlush:
    """Re-send what earlier runs spooled, in the background, for ``deadline_s`` at most."""
    return BackgroundFlush(config, res, lineage_config, deadline_s)
