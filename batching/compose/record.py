"""A scoring run on record: its row in the run ledger (``batching_runs``), a heartbeat from
its start to its end, its lineage run; and the runs that died without closing theirs.

:class:`Record` is what both ways to score (one scorer, or ``--workers N``) put a run
through; :func:`fail_abandoned` and :func:`close_dead_worker` close the runs of processes that
died (the lineage FAIL and the ledger's ``failed``), so neither Marquez nor the ledger shows a
dead run running forever.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from batching import config as cfg
from batching import errors, models
from batching.evidence import lineage
from batching.ingress import queue as q
from batching.ingress import run_ledger
from batching.loop.pipes import WorkerReport
from batching.loop.workers import is_worker_job, worker_job_name

logger = logging.getLogger(__name__)


def _never(_exc: BaseException) -> bool:
    return False


@dataclass(frozen=True)
class Attempt:
    """Which try of a run this is, when the caller retries a failed run under the same run id
    (the score flow's task retries: the run id is the flow run's).

    The first attempt records lineage START; a later one resumes the run (RUNNING), its run
    ledger row and what is left of its limits. A failure that ``retried`` says will be retried
    ends the attempt, not the run: lineage RUNNING with the error, not FAIL (OpenLineage: one
    START and one terminal event per run), and the COMPLETE or FAIL at the end counts every
    attempt's rows.
    """

    number: int = 1
    retried: Callable[[BaseException], bool] = _never

    def open(self, emitter: lineage.LineageEmitter, ctx: lineage.RunContext) -> None:
        """START the run, or mark it running again on a retry."""
        if self.number == 1:
            emitter.start(ctx)
        else:
            emitter.running(ctx)

    def fail(
        self,
        emitter: lineage.LineageEmitter,
        ctx: lineage.RunContext,
        error: BaseException,
        outputs: list[lineage.DatasetRef],
    ) -> None:
        """FAIL the run, or only this attempt when ``error`` is to be retried."""
        if self.retried(error):
            emitter.running(ctx, error)
        else:
            emitter.fail(ctx, error, outputs=outputs)


FIRST = Attempt()


def record_failed_start(
    emitter: lineage.LineageEmitter,
    ctx: lineage.RunContext,
    error: BaseException,
    attempt: Attempt = FIRST,
) -> None:
    """START then FAIL (with the error) for a run that failed before scoring began."""
    attempt.open(emitter, ctx)
    out = ctx.outputs[0]  # a retry's earlier attempts committed rows this one cannot count
    attempt.fail(emitter, ctx, error, [out.with_stats(0) if attempt.number == 1 else out])
    emitter.close()


class Record:
    """A run on record, from its ledger row to its end: the row, with a heartbeat on a thread
    of its own (lineage calls included, up to their deadline: a live run must never look
    abandoned to another run starting meanwhile), and its lineage run. Lineage first at the
    end: a ledger that cannot be updated now still gets it, and the row is closed as
    abandoned by a later run."""

    def __init__(
        self,
        runs: run_ledger.RunLedger,
        emitter: lineage.LineageEmitter,
        ctx: lineage.RunContext,
        attempt: Attempt,
        heartbeat_s: float,
    ) -> None:
        self.runs, self.emitter, self.ctx, self.attempt = runs, emitter, ctx, attempt
        self._beating = _Beating(_beat(runs, ctx.run_id), heartbeat_s)

    def open(self) -> None:
        """START the lineage run (RUNNING again on a retry)."""
        self.attempt.open(self.emitter, self.ctx)

    def complete(self, outputs: list[lineage.DatasetRef], summary: Mapping[str, Any]) -> None:
        self.emitter.complete(self.ctx, outputs=outputs)
        self._end("completed", summary)

    def fail(
        self, error: BaseException, outputs: list[lineage.DatasetRef], summary: Mapping[str, Any]
    ) -> None:
        """FAIL (or, when the error will be retried, RUNNING with it) and close the row."""
        self.attempt.fail(self.emitter, self.ctx, error, outputs)
        state = "running" if self.attempt.retried(error) else "failed"
        self._end(state, summary, str(error) or type(error).__name__)

    def stop(self) -> None:
        """Stop the heartbeat (idempotent)."""
        self._beating.stop()

    def _end(self, state: str, summary: Mapping[str, Any], error: str | None = None) -> None:
        self.emitter.close()
        self.stop()
        finish(self.runs, self.ctx.run_id, state, summary, error)


def finish(
    runs: run_ledger.RunLedger,
    run_id: str,
    state: str,
    summary: Mapping[str, Any],
    error: str | None = None,
) -> None:
    """Close the run's ledger row; a database that fails now is logged, not raised: the run
    is over (raising would retry a finished run), and its row, left running, is closed as
    abandoned by a later run."""
    try:
        runs.finish(run_id, state, summary, error=error)
    except errors.BatchingError:
        logger.warning("run ledger not updated", exc_info=True)


def silent_for_s(config: cfg.PipelineConfig) -> float:
    """How long a running run may go without a heartbeat before it counts as abandoned: two
    leases (its items' leases have expired by then too, so it can commit nothing more)."""
    return 2 * config.queue.lease_s


def _beat(runs: run_ledger.RunLedger, run_id: str) -> Callable[[], None]:
    """The run ledger's heartbeat for ``run_id``; a database hiccup is logged, not raised."""

    def beat() -> None:
        try:
            runs.beat(run_id)
        except errors.BatchingError:
            logger.warning("run heartbeat not recorded", exc_info=True)

    return beat


class _Beating:
    """Calls ``beat`` every ``interval_s`` on a thread of its own until ``stop()``: the parent
    of ``--workers`` runs no scorer, whose heartbeat would keep its ledger row alive."""

    def __init__(self, beat: Callable[[], None], interval_s: float) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(beat, interval_s), name="run-heartbeat", daemon=True
        )
        self._thread.start()

    def _run(self, beat: Callable[[], None], interval_s: float) -> None:
        while not self._done.wait(interval_s):
            beat()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def fail_abandoned(
    emitter: lineage.LineageEmitter,
    ctx: lineage.RunContext,
    config: cfg.PipelineConfig,
    abandoned: list[models.AbandonedRun],
) -> None:
    """FAIL in lineage the runs of the config's job that died without an end (closed in the
    ledger by ``close_abandoned``): the job and its queue input from ``ctx``, none of this
    run's facets (its model or config may differ). A worker's run is its parent's to close,
    unless the parent is not running either (the whole ``--workers`` run was killed)."""
    for run in abandoned:
        if run.flow == config.name and run.parent_run_id is None:
            dead = lineage.RunContext(
                run_id=run.run_id,
                job_name=config.name,
                job_namespace=ctx.job_namespace,
                inputs=ctx.inputs,
            )
        elif run.orphan and is_worker_job(run.flow, config.name):
            dead = lineage.RunContext(
                run_id=run.run_id,
                job_name=run.flow,
                job_namespace=ctx.job_namespace,
                inputs=ctx.inputs,
                parent_run_id=run.parent_run_id,
                parent_job_name=config.name,
            )
        else:
            continue
        # What it committed, into the output it recorded (before, a killed run's committed
        # rows were in no event); a run from before schema 18 recorded none.
        outputs = []
        if run.output is not None:
            namespace, name = run.output
            outputs = [lineage.DatasetRef(namespace, name, row_count=run.committed)]
        emitter.fail(dead, errors.BatchingError(run.error), outputs=outputs)


def ledger_start(
    queue: q.SqlQueue,
    config: cfg.PipelineConfig,
    ctx: lineage.RunContext,
    checksum: str | None,
    parent_run_id: str | None = None,
    attempt: Attempt = FIRST,
) -> tuple[run_ledger.RunLedger, models.RunSoFar | None]:
    """Record the run as started in the run ledger; returns the ledger to finish it, and
    what the run's earlier attempts did when this is a retry."""
    runs = run_ledger.RunLedger(queue)
    so_far = runs.start(
        ctx.run_id,
        config.name,
        config_hash=ctx.config_hash,
        model_version=config.model.version,
        model_sha256=checksum,
        parent_run_id=parent_run_id,
        resume=attempt.number > 1,
        output=(ctx.outputs[0].namespace, ctx.outputs[0].name) if ctx.outputs else None,
    )
    return runs, so_far


def close_dead_worker(
    emitter: lineage.LineageEmitter,
    runs: run_ledger.RunLedger,
    parent: lineage.RunContext,
    report: WorkerReport,
) -> None:
    """A worker that died (killed) never closed its run: FAIL it in lineage and the run
    ledger, with the rows its last progress report had committed (its items still leased
    return when their lease expires)."""
    assert report.run_id is not None  # run_score_workers gives every worker its run id
    error = errors.BatchingError(f"worker {report.index}: {report.error}")
    child = replace(
        parent,
        run_id=report.run_id,
        job_name=worker_job_name(parent.job_name, report.index),
        parent_run_id=parent.run_id,
        parent_job_name=parent.job_name,
    )
    emitter.fail(child, error, outputs=[child.outputs[0].with_stats(report.committed)])
    try:
        committed = {"items_committed": report.committed}
        runs.finish(report.run_id, "failed", committed, error=str(error))
    except errors.BatchingError:
        logger.warning("run ledger not updated for a dead worker", exc_info=True)
