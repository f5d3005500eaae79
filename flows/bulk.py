"""The bulk flow: enqueue an input dataset, then drain the queue with the bulk profile.

Enqueueing is idempotent on ``item_key``: a rerun (or a task retry) enqueues only keys the
queue has never seen, and scoring resumes where the last run stopped. Like a score run, a bulk
run that committed items emits ``batching.run.ended`` when it ends, which triggers its reconcile.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from batching import config, errors
from batching.compose import build, inplace
from batching.ingress import ingest
from batching.loop import stats as run_stats
from flows import credentials, logs, settings, slots
from flows.score import (
    before_scoring,
    fail_if_nothing_succeeded,
    flow_run_id,
    report_run_end,
    require_workers,
    retrying_task,
    score_queue,
    validate_preconditions,
)


@retrying_task("enqueue-input", retries=2, backoff_s=1.0)
def enqueue_input(cfg: config.PipelineConfig, db_url: str | None, path: str) -> dict[str, int]:
    """Enqueue every record of a Parquet (or JSONL) file in one transaction.

    Returns ``inserted`` (new items) and ``duplicates`` (keys already queued, not enqueued again).

    Raises:
        InputError: the file is missing or a record is invalid (nothing is enqueued).
        QueueError: the database failed (nothing is enqueued).
    """
    records = ingest.read_records(path)
    queue = build.open_queue(cfg, settings.db_url(db_url) or cfg.database.url)
    try:
        result = queue.enqueue(records)
    finally:
        queue.engine.dispose()
    return {"inserted": result.inserted, "duplicates": len(result.duplicates)}


@retrying_task("enqueue-shards", retries=2, backoff_s=1.0)
def enqueue_shards(
    cfg: config.PipelineConfig, db_url: str | None, path: str, rows_per_shard: int
) -> tuple[inplace.InPlace, dict[str, int]]:
    """Queue a Parquet dataset as shards (``bulk --in-place``), idempotently.

    Returns the run's input (for lineage) and ``inserted``, ``duplicates`` and ``rows``.

    Raises:
        InputError: the input is unreadable, or a file changed since its shards were queued.
        QueueError: the database failed (nothing is enqueued).
    """
    db = settings.db_url(db_url) or cfg.database.url
    found, result = inplace.enqueue_shards(cfg, db, path, rows_per_shard)
    counts = {"inserted": result.inserted, "duplicates": len(result.duplicates), "rows": found.rows}
    return inplace.InPlace.of(found), counts


@flow(
    name="batching-bulk",
    on_completion=[report_run_end],
    on_failure=[report_run_end],
    on_crashed=[report_run_end],
    on_cancellation=[report_run_end],
)
def bulk(
    input_path: str,
    config: str = settings.BULK,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    output: str | None = None,
    max_seconds: float | None = None,
    workers: int = 1,
    db_url_secret: str | None = None,
    lineage_api_key_secret: str | None = None,
    gpu_slot: str | None = None,
    gpu_slot_wait_s: float | None = None,
    in_place: bool = False,
    rows_per_shard: int = 65_536,
) -> dict[str, Any]:
    """Enqueue ``input_path`` and score the whole queue with the bulk profile.

    Args:
        input_path: Parquet (or JSONL) file of records: ``item_key``, ``payload``, ...
        config, overrides, db_url, output: as for the score flow.
        max_seconds: stop claiming after this long (checked between micro-batches).
        workers: scorer processes side by side, as for the score flow.
        db_url_secret, lineage_api_key_secret: Secret block names, as for the score flow.
        gpu_slot, gpu_slot_wait_s: the GPU slot held while scoring, as for the score flow.
        in_place: queue a Parquet file or folder as shards of ``rows_per_shard`` rows or more
            (whole row groups) and score it where it lies (``batching bulk --in-place``).

    Returns:
        ``enqueued`` and ``duplicates`` counts, then the run summary.
    """
    with logs.to_prefect(flow_run_id()):
        credentials.refuse_passwords(db_url=db_url, output=output, overrides=overrides)
        cfg = credentials.with_lineage_api_key(
            settings.load(config, overrides), lineage_api_key_secret
        )
        db = credentials.db_url(db_url, db_url_secret)
        # The slot first: a run that cannot have it (none by that name, or held past
        # gpu_slot_wait_s) queued its file anyway, for whichever scorer came next (a review).
        slots.require_one_scorer(gpu_slot, workers)
        with slots.gpu_slot(gpu_slot, gpu_slot_wait_s):
            with before_scoring(cfg, db, output):
                require_workers(workers)
                found = validate_preconditions(cfg, db, output)
                source: inplace.InPlace | None = None
                if in_place:
                    source, enqueued = enqueue_shards(cfg, db, input_path, rows_per_shard)
                    expected = enqueued["rows"]  # rows, not shards
                else:
                    enqueued = enqueue_input(cfg, db, input_path)
                    expected = found["ready"] + enqueued["inserted"]
            limits = run_stats.RunLimits(max_seconds=max_seconds)
            outcome = score_queue(cfg, db, output, limits, expected, workers, in_place=source)
        fail_if_nothing_succeeded(cfg, db, flow_run_id(), outcome.summary)
        if source is not None and source.plan is not None and max_seconds is None:
            left = inplace.left_of(cfg, db or cfg.database.url, source.plan)
            if left.rows:  # the dataset is not scored whole: the flow run fails, saying why
                raise errors.Incomplete(left.describe(source.plan.rows, cfg.queue.name))
        return {
            "enqueued": enqueued["inserted"],
            "duplicates": enqueued["duplicates"],
            **outcome.summary,
        }
