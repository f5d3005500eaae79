"""OpenLineage runs the flows record themselves; ``batching.compose.run.run_score`` records scoring.

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

from batching import config, errors
from batching.compose import build
from batching.compose import record as run_record
from batching.evidence import lineage
from batching.store import database
from flows import settings

logger = logging.getLogger(__name__)


def emitter(cfg: config.PipelineConfig, res: build.Resolved) -> lineage.LineageEmitter:
    """A lineage emitter for ``cfg``, with the environment's transport, like ``run_score``'s.

    Raises:
        ConfigError: the lineage settings are invalid (e.g. a malformed ``OPENLINEAGE_URL``).
    """
    return build.make_emitter(cfg, res, settings.lineage_config(cfg))


def reconcile_context(
    cfg: config.PipelineConfig, res: build.Resolved, run_id: str, *, repair: bool
) -> lineage.RunContext:
    """The run context of a reconcile run: it reads the queue and the outputs (writes on repair)."""
    queue, out = build.datasets(cfg, res)
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
        ctx = build.scoring_context(cfg, res, run_id)
        emit = emitter(cfg, res)
    except (errors.ConfigError, ValueError):
        logger.warning("lineage for the failed run skipped", exc_info=True)
        return
    run_record.record_failed_start(emit, ctx, error)


@contextmanager
def reconcile_run(
    cfg: config.PipelineConfig, res: build.Resolved, run_id: str, *, repair: bool
) -> Iterator[lineage.RunContext]:
    """START on entry; COMPLETE on a clean exit, FAIL with the error when the block raises."""
    ctx = reconcile_context(cfg, res, run_id, repair=repair)
    engine = database.create_engine(res.db_url)  # its spool: events the backend did not take
    emit = build.make_emitter(cfg, res, settings.lineage_config(cfg), engine=engine)
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
        engine.dispose()
