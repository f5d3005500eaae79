"""The maintenance flow: the output's housekeeping, for a sink that needs it.

A Delta table written one commit per lease gathers small files and a long log: the flow
compacts them (``optimize``), writes a checkpoint, vacuums files no version within the
retention needs, and cleans the log (``sink.maintain``). A Parquet dataset or a SQL table
needs none: the flow says so and does nothing. The same as ``batching maintain``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from batching import config
from batching.compose import build
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


@flow(name="batching-maintain")
def maintain(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    output: str | None = None,
    vacuum_retention_h: float | None = None,
    db_url_secret: str | None = None,
) -> dict[str, object]:
    """Housekeeping of a pipeline's output: compaction, checkpoint, vacuum (Delta tables).

    Args:
        config: pipeline YAML; default ``deployments/online.yaml``.
        overrides, db_url, output, db_url_secret: as for the score flow.
        vacuum_retention_h: keep files a version of the last this many hours needs (default:
            the table's own retention, 7 days).

    Returns:
        What each step did; empty when the output needs no housekeeping.
    """
    with logs.to_prefect(flow_run_id()):
        credentials.refuse_passwords(db_url=db_url, output=output, overrides=overrides)
        cfg = settings.load(config or settings.ONLINE, overrides)
        db = credentials.db_url(db_url, db_url_secret)
        done = maintain_outputs(cfg, db, output, vacuum_retention_h)
        get_run_logger().info(
            "maintained the %s output: %s", cfg.output.kind, done or "nothing to do"
        )
        return done
