"""OpenLineage runs the flows record themselves; ``batching.app.run_score`` records scoring.

The OpenLineage run id is always the Prefect flow-run id, so a run in Marquez and a run in the
Prefect UI cross-reference one to one. Two cases need the flow's help:

* a score run whose preconditions fail never reaches ``run_score``: :func:`record_failure`
  emits its START and FAIL (with the ``errorMessage`` facet) under the scoring job's name;
* a reconcile run is its own job, ``<config name>-reconcile``: :func:`reconcile_run`.

Lineage trouble never fails a run: the emitter counts and logs delivery failures, and a run
context that cannot be built is logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from batching import app, config, errors, lineage
from flows import settings

logger = logging.getLogger(__name__)


def emitter(cfg: config.PipelineConfig, res: app.Resolved) -> lineage.LineageEmitter:
    """A lineage emitter for ``cfg``, with the environment's transport, like ``run_score``'s.

    Raises:
        ConfigError: the lineage settings are invalid (e.g. a malformed ``OPENLINEAGE_URL``).
    """
    out_dir = res.events_path.parent.parent if res.events_path else Path("outputs").resolve()
    return lineage.LineageEmitter(
        settings.lineage_config(cfg),
        base_dir=Path(cfg.base_dir),
        producer=app.PRODUCER,
        output_dir=out_dir,
    )


def datasets(
    cfg: config.PipelineConfig, res: app.Resolved
) -> tuple[lineage.DatasetRef, lineage.DatasetRef]:
    """The queue table and the output dataset, named as ``run_score`` names them."""
    queue = lineage.DatasetRef(*lineage.sql_dataset_id(res.db_url, "batching_items"))
    if cfg.output.kind == "parquet":
        out = lineage.file_dataset_id(Path(res.output).resolve())
    else:
        out = lineage.sql_dataset_id(res.db_url, str(res.output))
    return queue, lineage.DatasetRef(*out)


def scoring_context(
    cfg: config.PipelineConfig, res: app.Resolved, run_id: str
) -> lineage.RunContext:
    """The run context of a scoring run: queue in, outputs out, model, config and its hash."""
    queue, out = datasets(cfg, res)
    return lineage.RunContext(
        run_id=run_id,
        job_name=cfg.name,
        inputs=(queue,),
        outputs=(out,),
        model=lineage.ModelRef(cfg.model.name, cfg.model.version, cfg.model.sha256),
        config=cfg.model_dump(mode="json"),
        config_hash=cfg.config_hash(),
    )


def reconcile_context(
    cfg: config.PipelineConfig, res: app.Resolved, run_id: str, *, repair: bool
) -> lineage.RunContext:
    """The run context of a reconcile run: it reads the queue and the outputs (writes on repair)."""
    queue, out = datasets(cfg, res)
    return lineage.RunContext(
        run_id=run_id,
        job_name=f"{cfg.name}-reconcile",
        inputs=(queue, out),
        outputs=(queue, out) if repair else (),
        config=cfg.model_dump(mode="json"),
        config_hash=cfg.config_hash(),
    )


def record_failure(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    run_id: str,
    error: BaseException,
) -> None:
    """Emit START then FAIL for a scoring run that failed before it started scoring."""
    try:
        res = settings.locations(cfg, db_url, output)
        ctx = scoring_context(cfg, res, run_id)
        emit = emitter(cfg, res)
    except (errors.ConfigError, ValueError):
        logger.warning("lineage for the failed run skipped", exc_info=True)
        return
    emit.start(ctx)
    emit.fail(ctx, error, outputs=[ctx.outputs[0].with_stats(0)])
    emit.close()


@contextmanager
def reconcile_run(
    cfg: config.PipelineConfig, res: app.Resolved, run_id: str, *, repair: bool
) -> Iterator[lineage.RunContext]:
    """START on entry; COMPLETE on a clean exit, FAIL with the error when the block raises."""
    ctx = reconcile_context(cfg, res, run_id, repair=repair)
    emit = emitter(cfg, res)
    emit.start(ctx)
    try:
        yield ctx
    except BaseException as exc:
        emit.fail(ctx, exc)
        raise
    else:
        emit.complete(ctx)
    finally:
        emit.close()
