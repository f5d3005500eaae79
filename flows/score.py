"""The score flow: check preconditions, drain the queue within a time budget, report.

1. ``validate-preconditions`` (retried with backoff and jitter while the failure is transient):
   the database is reachable and its schema current, the model checkpoint is present with the
   pinned sha256, the output location is writable, the config passes ``batching check``. When
   one fails nothing is claimed, the lineage run records START and FAIL with the reason, and
   the flow run fails with it.
2. ``score-queue``: one :func:`batching.compose.run.run_score_workers` call, the retryable
   unit (a retry resumes from the queue; committed items are never scored twice): the flow
   run is the parent lineage run and its scorer (in this process, or ``workers`` processes)
   a child run whose parent facet names it. Its hard time limit is
   ``max_seconds``, enforced between micro-batches: a Prefect task timeout cannot interrupt a
   forward pass. It keeps a progress artifact current and publishes the run summary table.
3. ``check-backlog``: whether the queue is still deeper or older than the config's
   ``backlog_alert_depth`` / ``backlog_alert_age_s``. The run's ``on_completion`` hook then
   emits ``batching.queue.backlog``: only once the run is Completed, because the event starts
   another run of the ``score`` deployment (one at a time, ``CANCEL_NEW``), which a run still
   holding the deployment's slot would have cancelled.

However the run ends (Completed, Failed, Crashed, Cancelled), :func:`report_run_end` emits
``batching.run.ended`` if it committed items, which triggers a reconcile of the run. A
Completed run that committed more items past ``latency_slo_s`` than its latency objective
allows emits ``batching.run.sla_missed`` (:func:`emit_sla_missed`); a run the retry-storm
breaker stopped emits ``batching.breaker.tripped``, and ``batching.queue.paused`` when it
paused the queue (:func:`report_breaker`).
Credentials come from Secret blocks named in parameters (:mod:`flows.credentials`); a parameter
holding a password is refused before anything runs.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from prefect import Flow, flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun, State, TaskRun
from prefect.context import TaskRunContext
from prefect.logging.loggers import flow_run_logger
from prefect.tasks import Task, exponential_backoff

from batching import config, errors, outcomes
from batching.compose import build, checks, inplace
from batching.compose import record as run_record
from batching.compose import run as app
from batching.ingress import controls, run_ledger
from batching.loop import stats as run_stats
from batching.redaction import redact_url
from flows import artifacts, credentials, events, logs, settings, slots
from flows import lineage as flow_lineage

P = ParamSpec("P")
R = TypeVar("R")

TRANSIENT = (errors.QueueError, errors.SinkError)
"""Failures a later attempt can fix: the database or the output location was unavailable."""


def is_transient(exc: object) -> bool:
    """Whether a later attempt can fix ``exc`` (:data:`TRANSIENT`)."""
    return isinstance(exc, TRANSIENT)


def retry_transient(_task: Task[Any, Any], _run: TaskRun, state: State[Any]) -> bool:
    """``retry_condition_fn``: retry only :data:`TRANSIENT` failures."""
    return is_transient(state.result(raise_on_failure=False))


def retrying_task(
    name: str, *, retries: int, backoff_s: float
) -> Callable[[Callable[P, R]], Task[P, R]]:
    """A task that retries :data:`TRANSIENT` failures with exponential, jittered backoff and
    never caches (every run reads the queue afresh)."""
    return task(
        name=name,
        retries=retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=backoff_s),
        retry_jitter_factor=0.5,
        retry_condition_fn=retry_transient,
        cache_policy=NO_CACHE,
    )


@retrying_task("validate-preconditions", retries=3, backoff_s=1.0)
def validate_preconditions(
    cfg: config.PipelineConfig, db_url: str | None, output: str | None
) -> dict[str, Any]:
    """Check everything a run needs before it claims anything.

    Returns:
        ``ready`` (items ready now), ``sha256`` (verified checkpoint digest) and
        ``worst_case_latency_s`` (from the policy check).

    Raises:
        QueueError: the database is unreachable. SchemaError: its schema is not current.
        CheckpointError: the checkpoint is missing or its sha256 is not the pinned one.
        SinkError: the output location is not writable. PolicyError: the config fails
        ``batching check``.
    """
    res = settings.locations(cfg, db_url, output)
    queue = build.open_queue(cfg, res.db_url)
    try:
        queue.check_schema()
        ready = queue.stats(done=False).by_state.get("ready", 0)
        build.open_sink(queue, res).preflight()
    finally:
        queue.engine.dispose()
    report = checks.check_config(cfg)  # reads the checkpoint and checks its sha256: no load
    report.raise_for_errors()
    return {
        "ready": ready,
        "sha256": cfg.model.sha256,
        "worst_case_latency_s": report.worst_case_latency_s,
    }


@retrying_task("score-queue", retries=2, backoff_s=5.0)
def score_queue(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    limits: run_stats.RunLimits,
    expected: int,
    workers: int = 1,
    model_version: str | None = None,
    in_place: inplace.InPlace | None = None,
) -> app.WorkersScoreOutcome:
    """Score the queue within ``limits`` as the flow run's lineage run; publish the summary.

    ``expected``: the items the run expects to score, the progress artifact's 100 %.
    ``in_place``: score the queue's input shards (``inplace.InPlace``; the bulk flow's).
    The flow run is the parent lineage run (and run-ledger row) of job ``<config name>``; its
    scorers are child runs ``<config name>.worker-<i>`` whose parent facet names it: one in
    this process (``workers`` = 1), else that many scorer processes.
    A retry resumes the run: one lineage run and run-ledger row whose counts add up every
    attempt's, and only what is left of ``limits`` (see :class:`batching.compose.record.Attempt`).
    """
    attempt = this_attempt()
    with artifacts.Progress(cfg.name, expected) as progress, run_metrics(cfg, workers):
        outcome = app.run_score_workers(
            cfg,
            workers,
            db_url=settings.db_url(db_url),
            output=output,
            limits=limits,
            run_id=flow_run_id(),
            on_progress=progress.counts,
            lineage_config=settings.lineage_config(cfg),
            resend_signals=True,  # a cancel still ends the flow run as Prefect intends
            attempt=attempt,
            in_process=workers == 1,
            model_version=model_version,
            in_place=in_place,
        )
        if (error := outcome.workers.error()) is not None:
            raise error
    artifacts.publish_summary(cfg.name, outcome.run_id, outcome.summary, outcome.output)
    return outcome


@contextmanager
def run_metrics(cfg: config.PipelineConfig, workers: int) -> Iterator[None]:
    """The run's metrics (``metrics.pushgateway_url`` / ``metrics.textfile_path``): recorded
    while it runs (by every worker), pushed every ``publish.PUSH_EVERY_S`` while it runs, and
    pushed or written at its end, failed or not."""
    m = cfg.metrics
    if not (m.pushgateway_url or m.textfile_path):
        yield
        return
    from batching.metrics import publish

    with publish.worker_metrics(os.environ, workers > 1) as folder:
        reg = publish.registry(folder)
        try:
            with publish.pushing(cfg, reg):
                yield
        finally:
            for problem in publish.publish_run(cfg, reg):
                get_run_logger().warning(problem)


def this_attempt() -> run_record.Attempt:
    """This try of the running task, and whether Prefect will retry a failure of it: while
    retries are left, a :data:`TRANSIENT` one (as ``retry_transient`` decides)."""
    number = max(1, runtime.task_run.run_count)  # 0 outside a task run
    context = TaskRunContext.get()
    retries = context.task.retries if context is not None else 0

    def retried(exc: BaseException) -> bool:
        return number <= retries and is_transient(exc)

    return run_record.Attempt(number, retried)


def fail_if_nothing_succeeded(
    cfg: config.PipelineConfig, db_url: str | None, run_id: str, summary: Mapping[str, object]
) -> None:
    """Fail the flow run, as ``batching score`` exits 1, when the run failed items and
    committed none: such a run ended Completed, green on every dashboard, while each of its
    items went dead (``outcomes.nothing_succeeded``). ``summary`` is the last attempt's; a
    retried run whose earlier attempt committed items (the run ledger counts every attempt's)
    succeeded. Before the backlog check: a backlog event would start another run to fail the
    same way."""
    why = outcomes.nothing_succeeded(summary, cfg.queue.name)
    if why is None:
        return
    try:
        queue = build.open_queue(cfg, settings.db_url(db_url) or cfg.database.url)
        try:
            if run_ledger.RunLedger(queue).committed(run_id) > 0:
                return
        finally:
            queue.engine.dispose()
    except errors.BatchingError:  # the ledger cannot say otherwise: the summary stands
        pass
    raise errors.NothingSucceeded(why)


def require_workers(
    workers: int, max_items: int | None = None, max_seconds: float | None = None
) -> None:
    """Refuse a worker count below 1, and limits that would end the run before it claims
    (bad input: the run fails before anything is claimed, not green with nothing scored)."""
    if workers < 1:
        raise errors.ConfigError(f"workers must be at least 1, got {workers}")
    if max_items is not None and max_items < 1:
        raise errors.ConfigError(f"max_items must be at least 1 (or none), got {max_items}")
    if max_seconds is not None and not max_seconds > 0:
        raise errors.ConfigError(f"max_seconds must be > 0 (or none), got {max_seconds!r}")


@task(name="check-backlog", cache_policy=NO_CACHE)
def check_backlog(cfg: config.PipelineConfig, db_url: str | None) -> dict[str, Any] | None:
    """The ``batching.queue.backlog`` payload when the queue crosses its alert depth or age,
    else None (also when the queue cannot be read). :func:`emit_backlog` sends it."""
    if cfg.backlog_alert_depth is None and cfg.backlog_alert_age_s is None:
        return None
    try:
        queue = build.open_queue(cfg, settings.db_url(db_url) or cfg.database.url)
        try:
            # A paused queue's backlog starts no run (it would claim nothing, then report the
            # same backlog again): the pause itself is what an operator is told about.
            if controls.state(queue.engine, cfg.queue.name).paused:
                get_run_logger().warning("queue paused: no backlog event; resume it to score")
                return None
            payload = events.backlog(cfg, queue.stats(done=False))
        finally:
            queue.engine.dispose()
    except errors.QueueError:  # after a scoring run that succeeded: not a reason to fail it
        get_run_logger().warning("backlog not checked: the queue could not be read", exc_info=True)
        return None
    if payload is not None:
        get_run_logger().warning("queue backlog over its alert threshold: %s", payload)
    return payload


def emit_backlog(flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """``on_completion`` hook: emit the run's backlog event, if its summary carries one.

    Prefect calls it after the server accepted Completed, which released the deployment's
    concurrency slot, so the run the event triggers is not cancelled by this one.
    """
    summary = state.result(raise_on_failure=False)
    payload = summary.get(BACKLOG_KEY) if isinstance(summary, dict) else None
    if payload:
        events.emit_backlog(payload)


def emit_sla_missed(flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """``on_completion`` hook: emit ``batching.run.sla_missed`` if the run's result carries it."""
    summary = state.result(raise_on_failure=False)
    payload = summary.get(SLA_KEY) if isinstance(summary, dict) else None
    if payload:
        events.emit_sla_missed(payload)


def report_breaker(flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """``on_failure`` hook: a run the retry-storm breaker stopped (``errors.RetryStorm``)
    emits ``batching.breaker.tripped``, and ``batching.queue.paused`` when the breaker paused
    the queue (its control row names a ``breaker:`` actor since the run started)."""
    storm = state.result(raise_on_failure=False)
    if not isinstance(storm, errors.RetryStorm):
        return
    params = run_parameters(flow, flow_run)
    run_id = str(flow_run.id)
    cfg = settings.load(params["config"], params.get("overrides"))  # it loaded for the run
    events.emit_breaker_tripped(cfg, str(storm), run_id, run_id)
    try:
        db = credentials.db_url(params.get("db_url"), params.get("db_url_secret"))
        queue = build.open_queue(cfg, settings.db_url(db) or cfg.database.url)
        try:
            control = controls.state(queue.engine, cfg.queue.name)
        finally:
            queue.engine.dispose()
    except errors.BatchingError:
        return
    started = flow_run.start_time.timestamp() if flow_run.start_time else 0.0
    actor = control.paused_by or ""
    if control.paused and actor.startswith("breaker:") and (control.paused_at or 0.0) >= started:
        events.emit_queue_paused(cfg, actor, control.reason, control.paused_at)


def flow_run_id() -> str:
    """The current Prefect flow-run id: also the OpenLineage run id."""
    run_id = runtime.flow_run.id
    if run_id is None:
        raise RuntimeError("not inside a Prefect flow run")
    return str(run_id)


@contextmanager
def before_scoring(
    cfg: config.PipelineConfig, db_url: str | None, output: str | None
) -> Iterator[None]:
    """A failure in the block is recorded as the scoring lineage run's START and FAIL."""
    try:
        yield
    except Exception as exc:
        flow_lineage.record_failure(cfg, db_url, output, flow_run_id(), exc)
        raise


BACKLOG_KEY = "backlog"
"""Key of the score flow's result: the backlog event payload, or None."""
SLA_KEY = "sla_missed"
"""Key of the score flow's result: the ``batching.run.sla_missed`` payload, or None."""


def report_run_end(flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """State hook of the score and bulk flows (Completed, Failed, Crashed, Cancelled): emit
    ``batching.run.ended``, which triggers a reconcile of the run, when the run ledger says
    the run (its workers and earlier attempts included) committed items; nothing when none.

    A run whose ledger cannot be read (its database is down, its parameters are refused)
    emits nothing and says so: the reconcile deployment's ``unreconciled`` schedule checks
    every run that committed items and was not reconciled.
    """
    log = flow_run_logger(flow_run, flow)
    params = run_parameters(flow, flow_run)
    run_id = str(flow_run.id)
    try:
        credentials.refuse_passwords(
            **{p: params.get(p) for p in ("db_url", "output", "overrides")}
        )
    except errors.BatchingError:  # the run was refused for it before it started: said there
        log.info("the run was refused before it started: nothing to reconcile")
        return
    try:
        cfg = settings.load(params["config"], params.get("overrides"))
        db = credentials.db_url(params.get("db_url"), params.get("db_url_secret"))
        queue = build.open_queue(cfg, settings.db_url(db) or cfg.database.url)
        try:
            committed = run_ledger.RunLedger(queue).committed(run_id)
        finally:
            queue.engine.dispose()
    except errors.BatchingError as exc:
        log.warning(
            "no reconcile asked for this run: its ledger could not be read (%s); the "
            "unreconciled-runs schedule checks it if it committed items",
            redact_url(str(exc)),
        )
        return
    if committed == 0:
        log.info("the run committed nothing: no reconcile asked")
        return
    events.emit_run_ended(cfg, run_id, state.name or state.type.value, committed, params)


def run_parameters(flow: Flow[..., Any], flow_run: FlowRun) -> dict[str, Any]:
    """The run's parameters, with the flow's defaults for those it was not given."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(flow.fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return defaults | dict(flow_run.parameters)


@flow(
    name="batching-score",
    on_completion=[emit_backlog, emit_sla_missed, report_run_end],
    on_failure=[report_run_end, report_breaker],
    on_crashed=[report_run_end],
    on_cancellation=[report_run_end],
)
def score(
    config: str = settings.ONLINE,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    output: str | None = None,
    max_seconds: float | None = None,
    max_items: int | None = None,
    workers: int = 1,
    db_url_secret: str | None = None,
    lineage_api_key_secret: str | None = None,
    model_version: str | None = None,
    gpu_slot: str | None = None,
    gpu_slot_wait_s: float | None = None,
) -> dict[str, Any]:
    """Score a pipeline's queue: preconditions, then claim, batch, score, commit; report.

    Args:
        config: pipeline YAML (relative to the working directory or the repository).
        overrides: settings that win over the file, e.g. ``{"batching": {"max_wait_s": 0.1}}``.
        db_url: database URL without a password; default ``$BATCHING_DB_URL``, else the
            config's. A URL with a password is refused (the API would store it): name a
            Secret block in ``db_url_secret``, or give the worker ``PGPASSWORD`` / ``~/.pgpass``.
        output: output folder (Parquet) or table (SQL); default the config's.
        max_seconds: stop claiming after this long (checked between micro-batches). The run
            also ends as soon as the queue is empty, unlike ``batching score --max-seconds``,
            which waits for new work until then: the schedule starts the next run.
        max_items: stop after claiming this many items (shared out between workers).
        workers: scorer processes side by side (``batching score --workers``); each is a
            child lineage job ``<name>.worker-<i>`` of this flow run's.
        db_url_secret: name of a Prefect Secret block holding the database URL.
        lineage_api_key_secret: name of a Prefect Secret block holding the lineage API key.
        model_version: serve that version of a rollout alone (``batching score
            --model-version``): a deployment per GPU slot and version, where a device cannot
            hold two.
        gpu_slot: a Prefect global concurrency limit of 1 (one GPU of one host) held while
            scoring, so runs that name the same slot never share its GPU
            (:mod:`flows.slots`; the deployment's ``CUDA_VISIBLE_DEVICES`` picks the GPU).
        gpu_slot_wait_s: fail the run if the slot stays taken this long (default: wait).

    Returns:
        The run summary (items, batches, batch sizes, padding, latency, items/s), under
        ``backlog`` the backlog event payload (None when the queue is within its thresholds),
        and under ``sla_missed`` the SLA-missed event payload (None within the objective).
    """
    with logs.to_prefect(flow_run_id()):
        credentials.refuse_passwords(db_url=db_url, output=output, overrides=overrides)
        cfg = credentials.with_lineage_api_key(
            settings.load(config, overrides), lineage_api_key_secret
        )
        db = credentials.db_url(db_url, db_url_secret)
        with before_scoring(cfg, db, output):
            require_workers(workers, max_items, max_seconds)
            slots.require_one_scorer(gpu_slot, workers)
            found = validate_preconditions(cfg, db, output)
        expected = min(found["ready"], max_items or found["ready"])
        limits = run_stats.RunLimits(max_seconds=max_seconds, max_items=max_items)
        with slots.gpu_slot(gpu_slot, gpu_slot_wait_s):
            outcome = score_queue(cfg, db, output, limits, expected, workers, model_version)
        fail_if_nothing_succeeded(cfg, db, flow_run_id(), outcome.summary)
        backlog = check_backlog(cfg, db)
        stats = outcome.workers.stats()
        sla = events.sla_missed(
            cfg, flow_run_id(), stats.latencies_s if stats else run_stats.Samples()
        )
        return outcome.summary | {BACKLOG_KEY: backlog, SLA_KEY: sla}
