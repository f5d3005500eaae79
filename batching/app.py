"""Wiring: build the adapters a config names and run one scoring run with lineage.

The CLI and ``flows/`` call :func:`run_score`; the pipeline itself receives its adapters and
knows nothing of how they were built.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batching import config as cfg
from batching import (
    database,
    errors,
    lineage,
    models,
    naming,
    pipeline,
    registry,
    run_ledger,
    sinks,
)
from batching import queue as q
from batching.service_profile import ServiceProfile
from batching.workers import (
    WorkerReport,
    WorkersOutcome,
    WorkersProgress,
    is_worker_job,
    run_workers,
    share_limits,
    worker_job_name,
)

logger = logging.getLogger(__name__)

PRODUCER = "https://github.com/batching/batching"


@dataclass(frozen=True)
class Resolved:
    """Where a run reads and writes, after CLI/flow overrides: the queue's database, the
    outputs (``target``; ``output`` is its location) and the local lineage log."""

    db_url: str
    target: registry.Target
    events_path: Path | None

    @property
    def output(self) -> str:
        """The dataset root, the results table or the Delta table URI."""
        return self.target.where


def resolve(config: cfg.PipelineConfig, db_url: str | None, output: str | None) -> Resolved:
    """Apply ``--db`` / ``--output`` overrides to the config's database and output location.

    The local lineage log sits beside a local output folder: ``<its parent>/lineage/events.jsonl``
    (``outputs/lineage/events.jsonl`` beside the config file for a table or an object-store
    URI; before, under the current folder, where ``batching lineage`` run elsewhere did not
    find it), unless the config names a path.

    Raises:
        ConfigError: an override is empty, or names no SQL table for a SQL sink.
    """
    for flag, value in (("--db", db_url), ("--output", output)):
        if value is not None and not value.strip():
            raise errors.ConfigError(f"{flag} is empty; give a value or leave the option out")
    target = output_target(config, output)
    folder = registry.kind_of(target).local_folder(target)
    events_dir = folder.parent if folder is not None else _sql_events_dir(config)
    events = lineage.events_path(
        config.lineage, base_dir=Path(config.base_dir), output_dir=events_dir
    )
    return Resolved(
        db_url or config.database.url,
        target,
        events if config.lineage.transport == "file" else None,
    )


def output_target(config: cfg.PipelineConfig, output: str | None) -> registry.Target:
    """The config's outputs, ``output`` (``--output``) overriding its location."""
    out = config.output
    if out.kind == "sql":
        table = output or out.table
        cfg.check_identifier(table, "--output (SQL table)")
        return registry.Target("sql", table, url=out.url)
    where = output or out.path
    if "://" not in where:  # a local folder: relative to the config's (--output: the cwd's)
        local = Path(where) if output else config.resolve(where) or Path(where)
        where = str(local.expanduser().resolve())
    return registry.Target(out.kind, where, storage_options=dict(out.storage_options))


def _sql_events_dir(config: cfg.PipelineConfig) -> Path:
    """Where the local lineage log of outputs without a local folder goes (a table, an
    object-store URI): beside the config file."""
    return (Path(config.base_dir) / "outputs").resolve()


def require_writable_folder(path: Path, what: str) -> None:
    """Create ``path`` (and its parents) if missing, and refuse it if that fails or it is not a
    folder: a bad ``--output`` is bad input, told before a run is on record.

    Raises:
        ConfigError: naming ``what``, the path and why.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise errors.ConfigError(
            f"{what} {path} cannot be created ({reason}); name a folder you can write to"
        ) from None


def open_queue(
    config: cfg.PipelineConfig,
    db_url: str,
    *,
    clock: Callable[[], float] = time.time,
    create: bool = False,
) -> q.SqlQueue:
    """The config's queue on ``db_url``, with its retry settings. A SQLite file must exist
    unless ``create`` (``queue.migrate()`` comes next): opening one would leave an empty file.

    Raises:
        ConfigError: the URL is malformed, or names a SQLite file that does not exist.
    """
    if not create:
        database.require_database(db_url)
    return q.SqlQueue(
        database.create_engine(db_url),
        config.queue.name,
        clock=clock,
        max_attempts=config.queue.max_attempts,
        backoff_base_s=config.queue.backoff_base_s,
        backoff_max_s=config.queue.backoff_max_s,
    )


def open_sink(
    queue: q.SqlQueue, res: Resolved, *, scorer: bool = False, read_only: bool = False
) -> sinks.Sink:
    """The run's sink (``registry``), committing through ``queue``; ``scorer``: a scoring
    run's (the Parquet sink defers its ledger marks to the next commit); ``read_only``:
    reconcile's (it creates no folder or table until a repair writes)."""
    return registry.open_sink(queue, replace(res.target, scorer=scorer, read_only=read_only))


def load_profile(config: cfg.PipelineConfig) -> ServiceProfile | None:
    """The measured service profile named by the config, or None when it has none yet."""
    path = config.resolve(config.service_profile)
    if path is None or not path.is_file():
        return None
    return ServiceProfile.load(path)


def datasets(
    config: cfg.PipelineConfig, res: Resolved, sink: sinks.Sink | None = None
) -> tuple[lineage.DatasetRef, lineage.DatasetRef]:
    """Lineage datasets: the queue table (input) and the run's outputs, named by their sink
    (with its schema when the ``sink`` is open)."""
    ns, name = naming.sql_dataset_id(res.db_url, "batching_items")
    queue_ds = lineage.DatasetRef(
        ns, name, (("item_key", "string"), ("payload_format", "string"), ("cost", "integer"))
    )
    if sink is None:
        ns, name = registry.dataset_id(res.target, res.db_url)
        return queue_ds, lineage.DatasetRef(ns, name, ())
    described = sink.describe()
    fields = tuple((str(n), str(t)) for n, t in described["fields"])
    return queue_ds, lineage.DatasetRef(described["namespace"], described["name"], fields)


def scoring_context(
    config: cfg.PipelineConfig,
    res: Resolved,
    run_id: str,
    *,
    sink: Any = None,
    checksum: str | None = None,
    parent: tuple[str, str] | None = None,
    job_name: str | None = None,
) -> lineage.RunContext:
    """The lineage run of a scoring run: queue in, outputs out, model, config and its hash.

    ``checksum`` is the loaded checkpoint's sha256; before it is loaded, the pinned one.
    ``job_name`` defaults to the config's name.
    """
    queue_ds, out_ds = datasets(config, res, sink)
    return lineage.RunContext(
        run_id=run_id,
        job_name=job_name or config.name,
        parent_run_id=parent[0] if parent else None,
        parent_job_name=parent[1] if parent else None,
        inputs=(queue_ds,),
        outputs=(out_ds,),
        model=lineage.ModelRef(
            config.model.name, config.model.version, checksum or config.model.sha256
        ),
        config=config.model_dump(mode="json"),
        config_hash=config.config_hash(),
    )


def make_emitter(
    config: cfg.PipelineConfig, res: Resolved, lineage_config: cfg.LineageConfig | None = None
) -> lineage.LineageEmitter:
    """The run's lineage emitter (``lineage_config`` overrides the config's).

    Raises:
        ConfigError: the lineage settings are invalid.
    """
    return lineage.LineageEmitter(
        lineage_config or config.lineage,
        base_dir=Path(config.base_dir),
        producer=PRODUCER,
        output_dir=res.events_path.parent.parent if res.events_path else _sql_events_dir(config),
    )


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


def _left(
    limits: pipeline.RunLimits, so_far: models.RunSoFar | None, now: float
) -> pipeline.RunLimits:
    """A retry's limits: what the run's earlier attempts left of them (items, seconds)."""
    if so_far is None:
        return limits
    done = so_far.items_committed + so_far.items_failed
    items = None if limits.max_items is None else max(0, limits.max_items - done)
    seconds = None if limits.max_seconds is None else limits.max_seconds - (now - so_far.started_at)
    if seconds is not None and seconds <= 0:
        items, seconds = 0, None  # the run's time is spent: claim nothing
    return replace(limits, max_items=items, max_seconds=seconds)


@dataclass
class ScoreOutcome:
    """What one scoring run did: its id, summary numbers and where outputs and lineage went."""

    run_id: str
    summary: dict[str, Any]
    output: str
    events_path: Path | None
    lineage_failures: int = 0
    recovered: dict[str, Any] = field(default_factory=dict)
    stats: pipeline.RunStats | None = None  # the raw counters behind ``summary``
    db_url: str = ""  # the database read (``--db`` or the config's)


def run_score(
    config: cfg.PipelineConfig,
    *,
    db_url: str | None = None,
    output: str | None = None,
    limits: pipeline.RunLimits | None = None,
    run_id: str | None = None,
    parent: tuple[str, str] | None = None,
    on_progress: pipeline.Progress | None = None,
    on_scorer: Callable[[pipeline.Scorer], None] | None = None,
    lineage_config: cfg.LineageConfig | None = None,
    job_name: str | None = None,
    attempt: Attempt = FIRST,
) -> ScoreOutcome:
    """Run one scoring run end to end: checks, recovery, scoring, run ledger and lineage.

    ``parent`` (run id, job name) and ``job_name`` place the run under a parent lineage run
    (``run_score_workers``); by default the run is the config's job, without a parent.
    ``attempt``: a retry of the run ``run_id`` (see :class:`Attempt`).

    Raises:
        SchemaError, QueueError, CheckpointError, SinkError: a precondition or stage failed.
            Lineage records START and FAIL either way; the run ledger records the runs that
            got past the checks (its rows live in the queue database).
        ConfigError: the lineage settings are invalid (nothing can be recorded).
    """
    res = _checked(config, db_url, output)
    run_id = run_id or lineage.new_run_id()
    emitter = make_emitter(config, res, lineage_config)

    def context(**kw: Any) -> lineage.RunContext:
        return scoring_context(config, res, run_id, parent=parent, job_name=job_name, **kw)

    try:
        queue = open_queue(config, res.db_url)
        queue.check_schema()
        from batching.runner import TorchRunner  # torch: only what scores loads it

        runner = TorchRunner.load(config.model, base_dir=config.base_dir)
        runner.warmup()
        sink = open_sink(queue, res, scorer=True)
        # Expired leases first (a scorer killed with items leased): the sweep below then
        # deletes their staging files rather than keep them as in flight.
        queue.release_expired(this_queue=True)
        recovered = sink.recover()
        profile = load_profile(config)
        ctx = context(sink=sink, checksum=runner.checksum)
        runs, so_far = _ledger_start(
            queue, config, ctx, runner.checksum, parent[0] if parent else None, attempt
        )
        abandoned = runs.close_abandoned(_silent_for_s(config), but=run_id)
    except Exception as exc:  # a precondition failed: the run is still on record as failed
        record_failed_start(emitter, context(), exc, attempt)
        raise
    before = so_far.items_committed if so_far else 0  # by the run's earlier attempts
    # From its ledger row to its end the run beats, lineage calls (up to their deadline)
    # included: a live run must never look abandoned to another run starting meanwhile.
    beating = _Beating(_beat(runs, run_id), config.queue.effective_heartbeat_s)
    try:
        _fail_abandoned(emitter, ctx, config, abandoned)
        out_ds = ctx.outputs[0]
        attempt.open(emitter, ctx)
        scorer: pipeline.Scorer | None = None
        # Objects alive now (the model, torch, SQLAlchemy, Prefect) are frozen out of the cyclic
        # GC for the run: a claim allocates thousands of items, and each collection of the oldest
        # generation otherwise walked them all again (W1: 32.7k -> 37.2k rows/s, measured).
        gc.freeze()
        try:
            scorer = pipeline.Scorer(
                config,
                queue,
                runner,
                sinks.Outputs(sink, run_id, config.model.version),
                service_time=profile.predict if profile else None,
                on_progress=on_progress,
                wait_for_work=q.Waiter(queue.engine, queue.queue).wait,
            )
            if on_scorer is not None:
                on_scorer(scorer)
            # its commit stage flushes the sink
            stats = scorer.run(_left(limits or pipeline.RunLimits(), so_far, queue.clock()))
        except BaseException as exc:
            done = scorer.stats if scorer is not None else None
            beating.stop()
            state = "running" if attempt.retried(exc) else "failed"
            _finish(runs, run_id, state, done.summary() if done else {}, str(exc))
            committed = before + (done.committed if done else 0)
            attempt.fail(emitter, ctx, exc, [out_ds.with_stats(committed)])
            emitter.close()
            raise
        finally:
            gc.unfreeze()
        summary = stats.summary()
        beating.stop()
        _finish(runs, run_id, "completed", summary)
        # The bytes are this attempt's only: a retry reports the rows alone.
        size = stats.bytes_written if so_far is None else None
        emitter.complete(ctx, outputs=[out_ds.with_stats(before + stats.committed, size)])
        emitter.close()
        queue.engine.dispose()
        summary["lineage_failures"] = emitter.failures
        if so_far is not None:
            summary |= {"attempt": attempt.number, "run_items_committed": before + stats.committed}
        return ScoreOutcome(
            run_id,
            summary,
            str(res.output),
            emitter.events_path,
            emitter.failures,
            _as_dict(recovered),
            stats,
            res.db_url,
        )
    finally:
        beating.stop()


def _finish(
    runs: run_ledger.RunLedger,
    run_id: str,
    state: str,
    summary: dict[str, Any],
    error: str | None = None,
) -> None:
    """Close the run's ledger row; a database that fails now is logged, not raised: the run
    is over (raising would retry a finished run), and its row, left running, is closed as
    abandoned by a later run."""
    try:
        runs.finish(run_id, state, summary, error=error)
    except errors.BatchingError:
        logger.warning("run ledger not updated", exc_info=True)


def _silent_for_s(config: cfg.PipelineConfig) -> float:
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


def _fail_abandoned(
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
        emitter.fail(dead, errors.BatchingError(run.error), outputs=[])


def _ledger_start(
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
    )
    return runs, so_far


def _checked(config: cfg.PipelineConfig, db_url: str | None, output: str | None) -> Resolved:
    """Where a run reads and writes, refused as bad input before anything is on record."""
    res = resolve(config, db_url, output)
    database.require_database(res.db_url)
    folder = registry.kind_of(res.target).local_folder(res.target)
    if folder is not None:
        require_writable_folder(folder, "the output folder (output.path / --output)")
    return res


@dataclass
class WorkersScoreOutcome:
    """What ``run_score_workers`` did: the parent run and every worker's report."""

    run_id: str  # the parent run
    workers: WorkersOutcome
    output: str
    events_path: Path | None
    lineage_failures: int = 0  # the parent's and the finished workers' events not delivered
    committed: int = 0  # by every worker, the failed ones too (their last progress report)
    db_url: str = ""  # the database read (``--db`` or the config's)

    @property
    def summary(self) -> dict[str, Any]:
        """The finished workers' counters as one run summary, as ``ScoreOutcome.summary``."""
        stats = self.workers.stats() or pipeline.RunStats(time.time())  # none ran: zeros
        summary = stats.summary()
        committed = max(summary.get("items_committed", 0), self.committed)
        return {**summary, "items_committed": committed, "lineage_failures": self.lineage_failures}


def run_score_workers(
    config: cfg.PipelineConfig,
    n: int,
    *,
    db_url: str | None = None,
    output: str | None = None,
    limits: pipeline.RunLimits | None = None,
    run_id: str | None = None,
    lineage_config: cfg.LineageConfig | None = None,
    threads: int | None = None,
    on_progress: WorkersProgress | None = None,
    stop: Any = None,
    resend_signals: bool = False,
    attempt: Attempt = FIRST,
) -> WorkersScoreOutcome:
    """Score with ``n`` worker processes as ONE run of the config's job.

    The parent run (``run_id``: the Prefect flow-run id, or a new one) has its run-ledger row
    and records lineage START, then COMPLETE with the rows the workers committed, or FAIL
    naming the workers that failed. Each worker is a whole scoring run (``run_score``: its
    own ledger row, which names the parent, recovery and events) of the child job
    ``<job>.worker-<i>``, whose parent facet points here: Marquez nests it under the job.
    ``reconcile --run <parent>`` covers the workers' batches. Worker failures are reported
    in the outcome (``workers.error()``), not raised; the run of a worker that died without
    closing it (killed) is closed here as failed. ``resend_signals`` and the rest are as for
    ``workers.run_workers``; ``attempt`` as for ``run_score``.

    Raises:
        SchemaError, QueueError, SinkError, ConfigError, CheckpointError: the database, the
            output location or an argument is unusable; the lineage settings are invalid.
    """
    res = _checked(config, db_url, output)
    share_limits(limits or pipeline.RunLimits(), n)  # bad input: refused before any record
    run_id = run_id or lineage.new_run_id()
    ctx = scoring_context(config, res, run_id)  # a run id that is not a UUID: refused here
    emitter = make_emitter(config, res, lineage_config)
    try:
        queue = open_queue(config, res.db_url)
        queue.check_schema()
        ctx = scoring_context(config, res, run_id, sink=open_sink(queue, res))
        runs, so_far = _ledger_start(queue, config, ctx, config.model.sha256, attempt=attempt)
    except Exception as exc:
        record_failed_start(emitter, ctx, exc, attempt)
        raise
    before = so_far.items_committed if so_far else 0  # by the run's earlier attempts
    # The parent runs no scorer: it beats for its ledger row itself, from now to its end.
    beating = _Beating(_beat(runs, run_id), config.queue.effective_heartbeat_s)
    counts = [0, 0, 0]  # the workers' summed progress: committed, failed, claimed

    def progress(committed: int, failed: int, claimed: int) -> None:
        counts[:] = committed, failed, claimed
        if on_progress is not None:
            on_progress(committed, failed, claimed)

    worker_run_ids = [lineage.new_run_id() for _ in range(n)]
    attempt.open(emitter, ctx)
    try:
        outcome = run_workers(
            config,
            n,
            db_url=db_url,
            output=output,
            limits=_left(limits or pipeline.RunLimits(), so_far, queue.clock()),
            threads=threads,
            on_progress=progress,
            stop=stop,
            parent=(run_id, ctx.job_name),
            lineage_config=lineage_config,
            resend_signals=resend_signals,
            run_ids=worker_run_ids,
        )
    except BaseException as exc:
        summary = {"items_committed": counts[0], "items_failed": counts[1]}
        attempt.fail(emitter, ctx, exc, [ctx.outputs[0].with_stats(before + counts[0])])
        emitter.close()
        beating.stop()
        state = "running" if attempt.retried(exc) else "failed"
        _finish(runs, run_id, state, summary, str(exc) or type(exc).__name__)
        queue.engine.dispose()
        raise
    result = WorkersScoreOutcome(
        run_id,
        outcome,
        str(res.output),
        emitter.events_path,
        committed=counts[0],
        db_url=res.db_url,
    )
    summary = result.summary
    stats = outcome.stats()
    size = stats.bytes_written if stats and so_far is None else None  # a retry: rows alone
    out_ds = ctx.outputs[0].with_stats(before + summary["items_committed"], size)
    for report in (r for r in outcome.reports if r.died):
        _close_dead_worker(emitter, runs, ctx, report)
    error = outcome.error()
    if error is None:
        emitter.complete(ctx, outputs=[out_ds])
    else:
        attempt.fail(emitter, ctx, error, [out_ds])
    emitter.close()  # lineage first: a ledger that cannot be updated now still gets it
    beating.stop()
    if error is None:
        _finish(runs, run_id, "completed", summary)
    else:
        _finish(
            runs, run_id, "running" if attempt.retried(error) else "failed", summary, str(error)
        )
    queue.engine.dispose()
    result.lineage_failures = emitter.failures + sum(r.lineage_failures for r in outcome.reports)
    return result


def _close_dead_worker(
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


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    from dataclasses import asdict, is_dataclass

    return (
        asdict(value)
        if is_dataclass(value) and not isinstance(value, type)
        else {"result": str(value)}
    )


def check_config(config: cfg.PipelineConfig) -> Any:
    """Plan-time policy check against the config's measured service profile, after the pinned
    checkpoint (its file and sha256: a wrong digest fails here, before merge, not at the first
    score; nothing is deserialized).

    Raises:
        ConfigError: ``model.name`` is neither built in nor a factory (before, the check
            blamed the service profile and advised ``batching profile``, which failed too).
        CheckpointError: no checkpoint for a factory, a missing file, or another sha256.
    """
    from batching import policy, zoo

    spec = config.model
    zoo.read_pinned(
        zoo.checkpoint_path(spec.name, spec.checkpoint, Path(config.base_dir)), spec.sha256
    )
    return policy.check_policy(config, load_profile(config))


__all__ = [
    "ScoreOutcome",
    "WorkersScoreOutcome",
    "check_config",
    "errors",
    "run_score",
    "run_score_workers",
]
