"""The maintenance flow: the output's housekeeping, for a sink that needs it, and the
queue's retention when asked.

A Delta table written one commit per lease gathers small files and a long log: the flow
compacts them (``optimize``), writes a checkpoint, vacuums files no version within the
retention needs, and cleans the log (``sink.maintain``). A Parquet dataset or a SQL table
needs none: the flow says so and does nothing. The same as ``batching maintain``.

With ``purge_older_than_h``, it then removes done and cancelled items finished that long
ago, and with ``purge_ledger`` the batch ledger's rows none of whose items is left, up to a
UTC midnight (``batching purge --older-than ... [--ledger]``); each purge recorded in the
queue's audit as ``batching-maintain``. Off unless set: retention deletes rows.
"""

from __future__ import annotations

import math
from typing import Any

from prefect import flow, get_run_logger

from batching import config, errors
from batching.compose import build
from batching.store import retention
from flows import credentials, logs, settings
from flows.score import flow_run_id, retrying_task


@retrying_task("maintain-outputs", retries=2, backoff_s=5.0)
def maintain_outputs(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    vacuum_retention_h: float | None,
) -> dict[str, object]:
    """Run the sink's housekeeping; returns what it did (empty: nothing to do).

    Raises:
        QueueError, SchemaError: the database failed or its schema is not current.
        SinkError: the output could not be maintained.
    """
    res = settings.locations(cfg, db_url, output)
    queue = build.open_queue(cfg, res.db_url)
    try:
        queue.check_schema()
        return build.open_sink(queue, res).maintain(vacuum_retention_h=vacuum_retention_h)
    finally:
        queue.engine.dispose()


ACTOR = "batching-maintain"


@retrying_task("purge-queue", retries=2, backoff_s=5.0)
def purge_queue(
    cfg: config.PipelineConfig, db_url: str | None, older_than_h: float, ledger: bool
) -> dict[str, object]:
    """Purge the queue's done and cancelled items older than ``older_than_h`` hours, then,
    with ``ledger``, the ledger rows nothing needs (the same as ``batching purge``; a retry
    deletes what is left).

    Raises:
        QueueError, SchemaError: the database failed or its schema is not current.
    """
    res = settings.locations(cfg, db_url, None)
    queue = build.open_queue(cfg, res.db_url)
    age_s, why = older_than_h * 3600.0, f"scheduled retention: older than {older_than_h:g} h"
    try:
        queue.check_schema()
        done: dict[str, object] = {"items_purged": queue.purge(age_s, actor=ACTOR, reason=why)}
        if ledger:
            rows, horizon = queue.purge_ledger(age_s, actor=ACTOR, reason=why)
            done["ledger_rows_purged"] = rows
            done["ledger_horizon"] = None if horizon is None else retention.day(horizon)
        return done
    finally:
        queue.engine.dispose()


@flow(name="batching-maintain")
def maintain(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    output: str | None = None,
    vacuum_retention_h: float | None = None,
    db_url_secret: str | None = None,
    purge_older_than_h: float | None = None,
    purge_ledger: bool = False,
) -> dict[str, object]:
    """Housekeeping of a pipeline's output: compaction, checkpoint, vacuum (Delta tables);
    then the queue's retention, when ``purge_older_than_h`` is set.

    Args:
        config: pipeline YAML; default ``deployments/online.yaml``.
        overrides, db_url, output, db_url_secret: as for the score flow.
        vacuum_retention_h: keep files a version of the last this many hours needs (default:
            the table's own retention, 7 days).
        purge_older_than_h: remove done and cancelled items finished this many hours ago
            (keep more than the reconcile window and than producers may resend); None: none.
        purge_ledger: then delete the ledger rows none of whose items is left, committed
            before the UTC midnight at or before that age (docs/operations.md, retention).

    Returns:
        What each step did; empty when the output needs no housekeeping and nothing was
        purged.

    Raises:
        ConfigError: ``purge_ledger`` without ``purge_older_than_h``, or an age that is not
            a positive number of hours.
    """
    with logs.to_prefect(flow_run_id()):
        credentials.refuse_passwords(db_url=db_url, output=output, overrides=overrides)
        cfg = settings.load(config or settings.ONLINE, overrides)
        _check_retention(purge_older_than_h, purge_ledger)
        db = credentials.db_url(db_url, db_url_secret)
        failed: errors.BatchingError | None = None
        try:
            done = maintain_outputs(cfg, db, output, vacuum_retention_h)
        except errors.BatchingError as exc:  # the queue's retention does not wait on it
            failed, done = exc, {}
        else:
            get_run_logger().info(
                "maintained the %s output: %s", cfg.output.kind, done or "nothing to do"
            )
        if purge_older_than_h is not None:
            purged = purge_queue(cfg, db, purge_older_than_h, purge_ledger)
            get_run_logger().info("purged queue %r: %s", cfg.queue.name, purged)
            done = {**done, **purged}
        if failed is not None:  # the run fails for it, after the retention ran
            raise failed
        return done


def _check_retention(older_than_h: float | None, ledger: bool) -> None:
    if older_than_h is None:
        if ledger:
            raise errors.ConfigError(
                "purge_ledger needs purge_older_than_h (hours): the ledger's rows go only "
                "after their items, e.g. purge_older_than_h: 720"
            )
        return
    if not (math.isfinite(older_than_h) and 0 < older_than_h * 3600 <= retention.MAX_AGE_S):
        raise errors.ConfigError(
            f"purge_older_than_h must be a positive number of hours up to "
            f"{retention.MAX_AGE_S / 3600:.0f}, got {older_than_h!r}"
        )
