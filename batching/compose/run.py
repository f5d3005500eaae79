"""One scoring run's life, alone or with worker processes: checks, start-up recovery, the run
ledger, the lineage run, and the loop in between.

The CLI and ``flows/`` call :func:`run_score` (one scorer) or :func:`run_score_workers` (N
scorer processes as one run); both put the run on record the same way (:class:`run_record.Record`: its
run-ledger row, a heartbeat from start to end, and its lineage run, START then COMPLETE or
FAIL). The adapters come from :mod:`batching.compose.build`; the loop (:mod:`batching.loop.scorer`) is
given them.

Why it stays one module: a run of N workers is the same life one level up. Its parent puts
itself on record as :func:`run_score` does and then calls :func:`run_score` for each worker, in
its own process or (``in_process``, a Prefect flow's single scorer) in this one. Both scales
share the attempt and limit rules (``_left``), so a retry resumes either one the same way.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from batching import config as cfg
from batching import errors, models, ports, routing
from batching.compose import build, evidence, inplace, shadow, shard_scorer, versions
from batching.compose import record as run_record
from batching.evidence import lineage
from batching.ingress import controls, version_pins
from batching.ingress import queue as q
from batching.loop import scorer as pipeline
from batching.loop import stats as run_stats
from batching.loop.pipes import WorkerReport, WorkersProgress
from batching.loop.workers import (
    WorkersOutcome,
    run_workers,
    share_limits,
    worker_job_name,
)
from batching.outputs import contract as sinks
from batching.store import database, sqlite

logger = logging.getLogger(__name__)


def _left(
    limits: run_stats.RunLimits, so_far: models.RunSoFar | None, now: float
) -> run_stats.RunLimits:
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
    summary: run_stats.RunSummary
    output: str
    events_path: Path | None
    lineage_failures: int = 0
    recovered: dict[str, Any] = field(default_factory=dict)
    stats: run_stats.RunStats | None = None  # the raw counters behind ``summary``
    db_url: str = ""  # the database read (``--db`` or the config's)


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
    def summary(self) -> run_stats.RunSummary:
        """The finished workers' counters as one run summary, as ``ScoreOutcome.summary``."""
        stats = self.workers.stats() or run_stats.RunStats(time.time())  # none ran: zeros
        summary = stats.summary()
        summary["items_committed"] = max(summary["items_committed"], self.committed)
        summary["lineage_failures"] = self.lineage_failures
        return summary


# Leases a failed attempt of a run could not give back (its database cut off): its retry
# (the same parent run, a flow run, in the same process: a Prefect task retry) gives them
# back first. Their items stayed leased until the lease expired, so a retry 5 s later
# claimed nothing and the flow run ended Completed with the queue still leased (a Prefect
# review). A spawned worker (``--workers`` > 1) reports its own to the parent, which keeps
# them here; a worker killed outright reports none, and its leases wait out their expiry.
_UNRELEASED: dict[str, set[str]] = {}
_UNRELEASED_LOCK = threading.Lock()


def _keep_unreleased(run_id: str, leases: Collection[str]) -> None:
    """Keep ``leases`` for the next attempt of ``run_id`` (the flow run's id) to give back."""
    if leases:
        with _UNRELEASED_LOCK:
            _UNRELEASED.setdefault(run_id, set()).update(leases)


def _give_back_unreleased(queue: q.SqlQueue, run_id: str) -> None:
    """Release, uncharged, the leases an earlier attempt of ``run_id`` (the flow run's id, or
    the run's own without a parent) could not (fenced by lease id: one that expired and was
    claimed again is another lease, untouched)."""
    with _UNRELEASED_LOCK:
        leases = sorted(_UNRELEASED.get(run_id, ()))
    for lease_id in leases:
        n = queue.release(lease_id)
        logger.info(
            "gave back %d item(s) an earlier attempt could not",
            n,
            extra={"action": "released_earlier_attempt", "lease_id": lease_id, "items": n},
        )
        with _UNRELEASED_LOCK:
            left = _UNRELEASED.get(run_id, set())
            left.discard(lease_id)
            if not left:
                _UNRELEASED.pop(run_id, None)


def run_score(
    config: cfg.PipelineConfig,
    *,
    db_url: str | None = None,
    output: str | None = None,
    limits: run_stats.RunLimits | None = None,
    run_id: str | None = None,
    parent: tuple[str, str] | None = None,
    on_progress: run_stats.Progress | None = None,
    on_scorer: Callable[[Any], None] | None = None,
    lineage_config: cfg.LineageConfig | None = None,
    job_name: str | None = None,
    attempt: run_record.Attempt = run_record.FIRST,
    model_version: str | None = None,
    in_place: inplace.InPlace | None = None,
) -> ScoreOutcome:
    """Run one scoring run end to end: checks, recovery, scoring, run ledger and lineage.

    ``in_place``: score the queue's input shards (``bulk --in-place``) instead of its items,
    with the input dataset, when known, among the run's lineage inputs.

    ``model_version``: serve that version of a rollout alone (a device that cannot hold two):
    the run loads it as its model and claims only the items the queue's route sends to it
    (:func:`pinned`).

    ``parent`` (run id, job name) and ``job_name`` place the run under a parent lineage run
    (``run_score_workers``); by default the run is the config's job, without a parent.
    ``attempt``: a retry of the run ``run_id`` (see :class:`Attempt`).

    Raises:
        SchemaError, QueueError, CheckpointError, SinkError: a precondition or stage failed.
            Lineage records START and FAIL either way; the run ledger records the runs that
            got past the checks (its rows live in the queue database).
        ConfigError: the lineage settings are invalid (nothing can be recorded).
    """
    config, pin = pinned(config, model_version)
    res = build.checked(config, db_url, output)
    run_id = run_id or lineage.new_run_id()
    emitter = build.make_emitter(config, res, lineage_config)
    # What earlier runs spooled, re-sent beside this one (a worker leaves it to its parent).
    flush = evidence.start_lineage_flush(config, res, lineage_config) if parent is None else None

    def context(**kw: Any) -> lineage.RunContext:
        return build.scoring_context(
            config,
            res,
            run_id,
            parent=parent,
            job_name=job_name,
            lineage_config=lineage_config,
            **kw,
        )

    queue: q.SqlQueue | None = None
    try:
        queue = build.open_queue(config, res.db_url)
        database.bound_idle_transactions(queue.engine)  # a frozen scorer's locks: 60 s at most
        queue.check_schema()
        emitter.spool = build.make_spool(queue.engine, emitter.config)  # a database that works
        from batching.model import zoo  # torch: only what scores loads it
        from batching.model.runner import TorchRunner

        # A factory that cannot be imported is that error, not a changed identity of a
        # version with outputs (found by a walk-through); a changed identity is refused
        # before a load that may take minutes.
        zoo.require_importable(config.model.name)
        pin_version = _version_pinner(queue, run_id)
        pin_version(config.model)  # a version name is a promise about its outputs
        runner = TorchRunner.load(config.model, base_dir=config.base_dir)
        runner.warmup()
        sink = build.open_sink(queue, res, scorer=True)
        sink.preflight()  # an output that cannot be written fails the run before it claims
        # Expired leases first (a scorer killed with items leased): the sweep below then
        # deletes their staging files rather than keep them as in flight.
        queue.release_expired(this_queue=True)
        _give_back_unreleased(queue, parent[0] if parent else run_id)
        recovered = sink.recover()
        profile = build.load_profile(config)
        ctx = context(sink=sink, checksum=runner.checksum)
        if in_place is not None:
            ctx = in_place.context(ctx)
        else:
            inplace.refuse_shards(queue)
        runs, so_far = run_record.ledger_start(
            queue, config, ctx, runner.checksum, parent[0] if parent else None, attempt
        )
        abandoned = runs.close_abandoned(run_record.silent_for_s(config), but=run_id)
    except Exception as exc:  # a precondition failed: the run is still on record as failed
        run_record.record_failed_start(emitter, context(), exc, attempt)
        _stop(flush)
        if queue is not None:  # its pool is not left open until GC
            queue.engine.dispose()
        raise
    before = so_far.items_committed if so_far else 0  # by the run's earlier attempts
    record = run_record.Record(runs, emitter, ctx, attempt, config.queue.effective_heartbeat_s)
    observer = _observer(config)
    try:
        run_record.fail_abandoned(emitter, ctx, config, abandoned)
        record.open()
        scorer: pipeline.Scorer[Any] | shard_scorer.ShardScorer | None = None
        waiter = q.Waiter(queue.engine, queue.queue)  # its own connection: closed at the end
        # Objects alive now (the model, torch, SQLAlchemy, Prefect) are frozen out of the cyclic
        # GC for the run: a claim allocates thousands of items, and each collection of the oldest
        # generation otherwise walked them all again (W1: 32.7k -> 37.2k rows/s, measured).
        gc.freeze()
        try:
            outputs = sinks.Outputs(sink, run_id, config.model.version)
            if in_place is not None:
                scorer = shard_scorer.ShardScorer(
                    config,
                    queue,
                    runner,
                    outputs,
                    on_progress=on_progress,
                    wait_for_work=waiter.wait,
                    observer=observer,
                    pause_queue=_breaker_pause(config, queue, run_id),
                )
            else:
                scorer = pipeline.Scorer(
                    config,
                    queue,
                    runner,
                    outputs,
                    service_time=profile.predict if profile else None,
                    on_progress=on_progress,
                    wait_for_work=waiter.wait,
                    pause_queue=_breaker_pause(config, queue, run_id),
                    observer=observer,
                    runners=versions.ModelSet(config, runner, pin=pin_version),
                    shadow_out=shadow.ShadowWriter(
                        shadow.folder(config, res), config.queue.name, run_id
                    ),
                    model_version=config.model.version,
                    pin=pin,
                )
            if on_scorer is not None:
                on_scorer(scorer)
            # its commit stage flushes the sink
            stats = scorer.run(_left(limits or run_stats.RunLimits(), so_far, queue.clock()))
            refused = sink.unpublished()
            if refused is not None:  # acked, safe in the outbox, but not where readers look
                raise errors.SinkError(refused)
        except BaseException as exc:
            if scorer is not None:  # by the flow run's id: each attempt's worker has its own
                _keep_unreleased(parent[0] if parent else run_id, scorer.unreleased)
            done = scorer.stats if scorer is not None else None
            committed = before + (done.committed if done else 0)
            summary: Mapping[str, Any] = done.summary() if done else {}
            out = ctx.outputs[0].with_stats(committed)
            if in_place is not None:
                record.ctx = in_place.read(record.ctx, done.committed + done.failed if done else 0)
            record.fail(
                exc, [out.with_version(evidence.output_version(queue, sink, run_id))], summary
            )
            queue.engine.dispose()  # a failed run's pool is not left open until GC
            raise
        finally:
            gc.unfreeze()
            waiter.close()
        result = stats.summary()
        # The bytes are this attempt's only: a retry reports the rows alone; a sink that
        # does not know them (SQL, Delta: written by its roll-forward) reports none, not 0.
        size = (stats.bytes_written or None) if so_far is None else None
        out = ctx.outputs[0].with_stats(before + stats.committed, size)
        record.ctx = with_costs(ctx, result)
        if in_place is not None:
            record.ctx = in_place.read(record.ctx, stats.committed + stats.failed)
        if stats.by_version and ctx.model is not None:  # a rollout split the items
            by_version = dict(stats.by_version)
            record.ctx = replace(record.ctx, model=replace(ctx.model, versions=by_version))
        # the CPU threads of its passes: a replay on CPU needs them to give the same bits
        result["cpu_threads"] = runner.cpu_threads
        record.complete([out.with_version(evidence.output_version(queue, sink, run_id))], result)
        queue.engine.dispose()
        result["lineage_failures"] = emitter.failures
        if so_far is not None:
            result["attempt"] = attempt.number
            result["run_items_committed"] = before + stats.committed
        return ScoreOutcome(
            run_id,
            result,
            res.output,
            emitter.events_path,
            emitter.failures,
            _as_dict(recovered),
            stats,
            res.db_url,
        )
    finally:
        record.stop()
        _stop(flush)
        observer.lineage_failed(emitter.failures)


def _version_pinner(queue: q.SqlQueue, run_id: str) -> Callable[[cfg.ModelSpec], None]:
    """Pins a version's identity for ``queue`` as this run first runs it (``version_pins``)."""

    def pin(spec: cfg.ModelSpec) -> None:
        version_pins.pin(queue.engine, queue.queue, spec, run_id=run_id, now=queue.clock())

    return pin


def claiming_a_share(config: cfg.PipelineConfig, n: int) -> cfg.PipelineConfig:
    """The config each of ``n`` workers scores with: a claim of its share of the config's
    claim (never under a full batch). A worker claiming the whole ``claim_size`` took a
    backlog of that size as one range lease, and the others found nothing and ended: one
    worker scored while they idled (found by a review with the shipped bulk and tabular
    configs), and its death left the backlog leased for ``lease_s``."""
    policy = config.batching
    share = max(policy.max_batch_size, policy.effective_claim_size // max(1, n))
    if n <= 1 or share >= policy.effective_claim_size:
        return config
    batching = policy.model_copy(update={"claim_size": share})
    return config.model_copy(update={"batching": batching})


def pinned(
    config: cfg.PipelineConfig, version: str | None
) -> tuple[cfg.PipelineConfig, routing.Pin | None]:
    """The config of a run that serves ``version`` alone (its ``model`` that version's entry
    of the registry), and its pin; unchanged, and no pin, for None.

    Raises:
        InputError: ``version`` is not in the registry.
    """
    if version is None:
        return config, None
    spec = config.registry().get(version)
    if spec is None:
        raise errors.InputError(
            f"--model-version {version!r} is not in the config's registry (it lists "
            f"{', '.join(sorted(config.registry()))}); add it under model_versions"
        )
    return config.model_copy(update={"model": spec}), routing.Pin(version, config.model.version)


def with_costs(ctx: lineage.RunContext, summary: Mapping[str, Any]) -> lineage.RunContext:
    """``ctx`` with the run's device seconds (``batching_cost``), when its summary has them."""
    if "device_s" not in summary:
        return ctx
    cost = {
        "deviceSeconds": float(summary["device_s"]),
        "byTenant": dict(summary.get("device_s_by_tenant") or {}),
        "byModelVersion": dict(summary.get("device_s_by_version") or {}),
    }
    return replace(ctx, cost=cost)


def _observer(config: cfg.PipelineConfig) -> ports.ScoreObserver:
    """The metrics recorder when the config serves, pushes or writes metrics; else none
    (``prometheus_client`` is imported only then)."""
    if not config.metrics.enabled:
        return ports.NoObserver()
    from batching.metrics.recorder import Recorder

    return Recorder(config)


def _breaker_pause(
    config: cfg.PipelineConfig, queue: q.SqlQueue, run_id: str
) -> Callable[[str], object] | None:
    """What the retry-storm breaker calls to pause the queue (``breaker.pause_queue``), with
    the run as the actor of the audit row; None when the config says not to pause."""
    if not config.breaker.pause_queue:
        return None

    def pause(reason: str) -> object:
        return controls.pause(
            queue.engine, queue.queue, actor=f"breaker:{run_id}", reason=reason, now=queue.clock()
        )

    return pause


def _stop(flush: evidence.BackgroundFlush | None) -> None:
    if flush is not None:
        flush.stop()


def run_score_workers(
    config: cfg.PipelineConfig,
    n: int,
    *,
    db_url: str | None = None,
    output: str | None = None,
    limits: run_stats.RunLimits | None = None,
    run_id: str | None = None,
    lineage_config: cfg.LineageConfig | None = None,
    threads: int | None = None,
    on_progress: WorkersProgress | None = None,
    stop: threading.Event | None = None,
    resend_signals: bool = False,
    attempt: run_record.Attempt = run_record.FIRST,
    in_process: bool = False,
    model_version: str | None = None,
    in_place: inplace.InPlace | None = None,
) -> WorkersScoreOutcome:
    """Score with ``n`` worker processes as ONE run of the config's job.

    ``in_place``: the workers score the queue's input shards (as :func:`run_score`'s).

    ``model_version``: every worker serves that version of a rollout alone (as
    :func:`run_score`'s); the parent run records it as its model.

    ``in_process`` (``n`` = 1): the one worker is scored in this process, not a spawned one
    (a Prefect flow run's single scorer: the flow run is the parent run, its scorer the
    child ``<job>.worker-0`` with a parent facet naming it, as with ``n`` workers); its
    failure is raised as it is, not reported.

    The parent run (``run_id``: the Prefect flow-run id, or a new one) has its run-ledger row
    and records lineage START, then COMPLETE with the rows the workers committed, or FAIL
    naming the workers that failed. Each worker is a whole scoring run (:func:`run_score`:
    its own ledger row, which names the parent, recovery and events) of the child job
    ``<job>.worker-<i>``, whose parent facet points here: Marquez nests it under the job.
    ``reconcile --run <parent>`` covers the workers' batches. Worker failures are reported
    in the outcome (``workers.error()``), not raised; the run of a worker that died without
    closing it (killed) is closed here as failed. ``resend_signals`` and the rest are as for
    ``workers.run_workers``; ``attempt`` as for ``run_score``.

    Raises:
        SchemaError, QueueError, SinkError, ConfigError, CheckpointError: the database, the
            output location or an argument is unusable; the lineage settings are invalid.
    """
    original = config  # the workers pin from it: a queue without a route runs its model
    config, _ = pinned(config, model_version)
    res = build.checked(config, db_url, output)
    share_limits(limits or run_stats.RunLimits(), n)  # bad input: refused before any record
    if in_process and n != 1:
        raise ValueError(f"in_process scores one worker, not {n}")
    run_id = run_id or lineage.new_run_id()
    # a run id that is not a UUID: refused here
    ctx = build.scoring_context(config, res, run_id, lineage_config=lineage_config)
    emitter = build.make_emitter(config, res, lineage_config)
    flush = evidence.start_lineage_flush(config, res, lineage_config)  # earlier runs' events
    try:
        queue = build.open_queue(config, res.db_url)
        queue.check_schema()
        emitter.spool = build.make_spool(queue.engine, emitter.config)  # a database that works
        _give_back_unreleased(queue, run_id)  # an earlier attempt's workers could not
        sink = build.open_sink(queue, res, read_only=True)  # its dataset, for lineage
        ctx = build.scoring_context(config, res, run_id, sink=sink, lineage_config=lineage_config)
        ctx = in_place.context(ctx) if in_place is not None else ctx
        runs, so_far = run_record.ledger_start(
            queue, config, ctx, config.model.sha256, attempt=attempt
        )
    except Exception as exc:
        run_record.record_failed_start(emitter, ctx, exc, attempt)
        _stop(flush)
        raise
    before = so_far.items_committed if so_far else 0  # by the run's earlier attempts
    # The parent runs no scorer: its record beats for its ledger row itself, to its end.
    record = run_record.Record(runs, emitter, ctx, attempt, config.queue.effective_heartbeat_s)
    counts = [0, 0, 0]  # the workers' summed progress: committed, failed, claimed

    def progress(committed: int, failed: int, claimed: int) -> None:
        counts[:] = committed, failed, claimed
        if on_progress is not None:
            on_progress(committed, failed, claimed)

    record.open()
    try:
        try:
            each: dict[str, Any] = {
                "db_url": db_url,
                "output": output,
                "limits": _left(limits or run_stats.RunLimits(), so_far, queue.clock()),
                "on_progress": progress,
                "parent": (run_id, ctx.job_name),
                "lineage_config": lineage_config,
            }
            outcome = (
                _in_process(original, model_version=model_version, in_place=in_place, **each)
                if in_process
                else _spawned(
                    claiming_a_share(original, n),
                    n,
                    model_version=model_version,
                    in_place=in_place,
                    threads=threads,
                    stop=stop,
                    resend_signals=resend_signals,
                    engine=queue.engine,
                    **each,
                )
            )
            _keep_unreleased(run_id, {x for r in outcome.reports for x in r.unreleased})
        except BaseException as exc:
            counted = {"items_committed": counts[0], "items_failed": counts[1]}
            record.fail(exc, [ctx.outputs[0].with_stats(before + counts[0])], counted)
            queue.engine.dispose()
            raise
        result = WorkersScoreOutcome(
            run_id, outcome, res.output, emitter.events_path, committed=counts[0], db_url=res.db_url
        )
        summary = result.summary
        stats = outcome.stats()
        size = (stats.bytes_written or None) if stats and so_far is None else None  # see above
        out_ds = ctx.outputs[0].with_stats(before + summary["items_committed"], size)
        out_ds = out_ds.with_version(evidence.output_version(queue, sink, run_id))
        for report in (r for r in outcome.reports if r.died):
            run_record.close_dead_worker(emitter, runs, ctx, report)
        error = outcome.error()
        record.ctx = with_costs(ctx, summary)
        if in_place is not None:
            read = summary["items_committed"] + summary["items_failed"]
            record.ctx = in_place.read(record.ctx, read)
        if error is None:
            record.complete([out_ds], summary)
        else:
            record.fail(error, [out_ds], summary)
        queue.engine.dispose()
        reports = sum(r.lineage_failures for r in outcome.reports)
        result.lineage_failures = emitter.failures + reports
        return result
    finally:
        record.stop()
        _stop(flush)


def _spawned(
    config: cfg.PipelineConfig,
    n: int,
    *,
    engine: Any,
    parent: tuple[str, str],
    model_version: str | None = None,
    in_place: inplace.InPlace | None = None,
    **kwargs: Any,
) -> WorkersOutcome:
    """``n`` workers in spawned processes (``workers.run_workers``), each with a run id."""
    return run_workers(
        _ScoreOne(model_version, in_place),
        config,
        n,
        parent=parent,
        run_ids=[lineage.new_run_id() for _ in range(n)],
        lock_holder=functools.partial(sqlite.lock_holder, engine),
        **kwargs,
    )


def _in_process(
    config: cfg.PipelineConfig,
    *,
    on_progress: WorkersProgress,
    parent: tuple[str, str],
    **kwargs: Any,
) -> WorkersOutcome:
    """The one worker of ``run_score_workers(in_process=True)``, scored here; reported as a
    spawned worker's would be (a failure raises)."""

    def progress(stats: run_stats.RunStats) -> None:
        on_progress(stats.committed, stats.failed, stats.claimed)

    done = run_score(
        config,
        run_id=lineage.new_run_id(),
        parent=parent,
        job_name=worker_job_name(parent[1], 0),
        on_progress=progress,
        **kwargs,
    )
    report = WorkerReport(
        0,
        run_id=done.run_id,
        stats=done.stats,
        output=done.output,
        events_path=str(done.events_path) if done.events_path else None,
        lineage_failures=done.lineage_failures,
    )
    return WorkersOutcome([report])


class _ScoreOne:
    """:func:`run_score`, as a worker process runs it: pickled by its class's name, so the
    worker looks ``run_score`` up in its own interpreter (a parent's monkeypatched or wrapped
    function could not be pickled). ``model_version``: each worker serves that version alone;
    ``in_place``: each scores input shards."""

    def __init__(
        self, model_version: str | None = None, in_place: inplace.InPlace | None = None
    ) -> None:
        self.model_version = model_version
        self.in_place = in_place

    def __call__(
        self,
        config: cfg.PipelineConfig,
        *,
        db_url: str | None,
        output: str | None,
        limits: run_stats.RunLimits | None,
        on_progress: run_stats.Progress | None,
        on_scorer: Callable[[pipeline.Scorer[Any]], None] | None,
        parent: tuple[str, str] | None,
        job_name: str | None,
        lineage_config: cfg.LineageConfig | None,
        run_id: str | None,
    ) -> ScoreOutcome:
        return run_score(
            config,
            db_url=db_url,
            output=output,
            limits=limits,
            on_progress=on_progress,
            on_scorer=on_scorer,
            parent=parent,
            job_name=job_name,
            lineage_config=lineage_config,
            run_id=run_id,
            model_version=self.model_version,
            in_place=self.in_place,
        )


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
