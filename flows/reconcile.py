"""The reconcile flow: prove every acked item has exactly one committed output.

Scope: one upstream scoring run (``upstream_flow_run_id``: the trigger on ``batching.run.ended``
passes it), else the last ``window_s`` seconds (the hourly schedule), else everything; or, with
``unreconciled`` (the safety-net schedule), each run that committed items and that no trigger
reached; or, with ``full`` (the daily schedule), a resumable sweep of everything committed. Reconciling a run marks it in the run ledger (``batching_runs.reconciled_at``).

1. ``reconcile-outputs`` runs every check of :func:`batching.evidence.reconcile.reconcile` and publishes
   the findings table. With ``repair=True`` it repairs what it found, then checks again (a clean
   second pass is the proof) and publishes that table too.
2. A critical finding (left after the repair, when repairing) emits
   ``batching.reconcile.failed`` and fails the flow run, so automations alert; repairs emit
   ``batching.reconcile.repaired``; a reconcile without one emits ``batching.reconcile.checked``
   (what the reconcile-stale automation expects to see).

The run is also an OpenLineage run (job ``<config name>-reconcile``): START, then COMPLETE, or
FAIL with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger

from batching import config, errors
from batching.compose import build
from batching.evidence import reconcile as rc
from batching.evidence import sweep as full_sweep
from batching.ingress import queue as q
from batching.ingress import run_ledger
from batching.outputs import contract as sinks
from batching.redaction import redact_url
from flows import artifacts, credentials, events, logs, settings
from flows import lineage as flow_lineage
from flows.score import flow_run_id, retrying_task


class ReconcileFailed(Exception):
    """Reconcile found critical faults: outputs are lost, missing, corrupt, orphaned or doubled."""


@retrying_task("reconcile-outputs", retries=2, backoff_s=2.0)
def reconcile_outputs(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    *,
    run_id: str | None,
    since: float | None,
    repair: bool,
    dataset_lost: bool = False,
) -> rc.Report:
    """Check (and with ``repair``, fix) the queue, ledger and outputs of ``cfg`` in scope
    (``dataset_lost``: judge the ledger's batches though the output holds nothing).

    Raises:
        QueueError, SchemaError: the database failed or its schema is not current.
        SinkError: a file could not be listed or moved.
    """
    with _opened(cfg, db_url, output) as (queue, sink):
        return rc.reconcile(
            queue,
            sink,
            since=since,
            run_id=run_id,
            now=time.time(),
            repair=repair,
            dataset_lost=dataset_lost,
        )


@contextmanager
def _opened(
    cfg: config.PipelineConfig, db_url: str | None, output: str | None
) -> Iterator[tuple[q.SqlQueue, sinks.Sink]]:
    """The queue (schema checked) and its output, opened to be judged (it creates nothing
    until a repair writes)."""
    res = settings.locations(cfg, db_url, output)
    queue = build.open_queue(cfg, res.db_url)
    try:
        queue.check_schema()
        yield queue, build.open_sink(queue, res, read_only=True)
    finally:
        queue.engine.dispose()


@retrying_task("sweep-outputs", retries=2, backoff_s=5.0)
def sweep_outputs(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    *,
    max_seconds: float | None,
    repair: bool,
) -> rc.Report:
    """A full sweep of the output of ``cfg``: every committed batch, item and file, a page at
    a time, from where the last sweep stopped (:func:`batching.evidence.sweep.sweep`); a retry
    resumes after the last page recorded.

    Raises:
        QueueError, SchemaError: the database failed or its schema is not current.
        SinkError: a file could not be listed or moved.
    """
    with _opened(cfg, db_url, output) as (queue, sink):
        logger = get_run_logger()

        def on_page(p: full_sweep.Progress) -> None:
            logger.info(
                "sweep page %d (%s): %d batches, %d items, %d files checked so far",
                p.pages,
                p.phase,
                p.batches,
                p.items,
                p.files,
            )

        return full_sweep.sweep(
            queue, sink, now=time.time(), max_seconds=max_seconds, repair=repair, on_page=on_page
        )


def _payload(cfg: config.PipelineConfig, report: rc.Report, upstream: str | None) -> dict[str, Any]:
    critical = sorted({str(f.kind) for f in report.findings if f.severity is rc.Severity.CRITICAL})
    run_id = flow_run_id()
    return {
        "config": cfg.name,
        "queue": cfg.queue.name,
        "location": report.location,
        "counts": report.counts,
        "critical": critical,
        "repairs": len(report.repairs),
        "upstream_flow_run_id": upstream,
        "findings_text": findings_text(report),
        "flow_run_id": run_id,
        "flow_run_url": events.flow_run_url(run_id),
    }


MAX_FINDING_LINES = 20


def findings_text(report: rc.Report) -> str:
    """The critical and warning findings of ``report`` in words, one line each, critical first
    (at most :data:`MAX_FINDING_LINES`): what an alert's reader sees."""
    order = {rc.Severity.CRITICAL: 0, rc.Severity.WARNING: 1}
    shown = sorted(
        (f for f in report.findings if f.severity in order), key=lambda f: order[f.severity]
    )
    lines = [
        f"- {f.severity}: {str(f.kind).replace('_', ' ')} ({f.count} affected): {_one_line(f.message)}"
        for f in shown[:MAX_FINDING_LINES]
    ]
    if len(shown) > MAX_FINDING_LINES:
        lines.append(f"- and {len(shown) - MAX_FINDING_LINES} more (see the findings artifact)")
    return "\n".join(lines) or "- none"


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(redact_url(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def check(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    *,
    run_id: str | None,
    since: float | None,
    repair: bool,
    dataset_lost: bool = False,
) -> tuple[rc.Report, rc.Report]:
    """Reconcile (and repair, when asked, then check again); publish each findings table.

    Returns the report as found and the final one (the same report when not repairing).
    """

    def judged(fix: bool) -> rc.Report:
        return reconcile_outputs(
            cfg, db_url, output, run_id=run_id, since=since, repair=fix, dataset_lost=dataset_lost
        )

    found = judged(repair)
    artifacts.publish_findings(cfg.name, found, "reconcile")
    final = found
    if repair:
        final = judged(False)
        artifacts.publish_findings(cfg.name, final, "after repair")
    get_run_logger().info(
        "reconcile found %s, repaired %d, left %s", found.counts, len(found.repairs), final.counts
    )
    return found, final


def judge(
    cfg: config.PipelineConfig, found: rc.Report, final: rc.Report, upstream: str | None
) -> None:
    """Emit the reconcile events; raise :class:`ReconcileFailed` when ``final`` is not ok."""
    if found.repairs:
        events.emit_reconcile(
            events.RECONCILE_REPAIRED, cfg.queue.name, _payload(cfg, found, upstream)
        )
    if final.ok:
        payload = _payload(cfg, final, upstream)
        events.emit_reconcile(events.RECONCILE_CHECKED, cfg.queue.name, payload)
        return
    payload = _payload(cfg, final, upstream)
    events.emit_reconcile(events.RECONCILE_FAILED, cfg.queue.name, payload)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(final.counts.items()))
    raise ReconcileFailed(
        f"critical findings {', '.join(payload['critical'])} on {final.location} ({counts})"
    )


def unreconciled_runs(
    cfg: config.PipelineConfig, db_url: str | None, settled_s: float, limit: int
) -> list[str]:
    """Runs of ``cfg`` that committed items, ended over ``settled_s`` ago and were never
    reconciled (:meth:`batching.ingress.run_ledger.RunLedger.unreconciled`)."""
    queue = build.open_queue(cfg, settings.db_url(db_url) or cfg.database.url)
    try:
        queue.check_schema()
        return run_ledger.RunLedger(queue).unreconciled(cfg.name, settled_s, limit=limit)
    finally:
        queue.engine.dispose()


def mark_reconciled(cfg: config.PipelineConfig, db_url: str | None, run_id: str) -> None:
    """Record in the run ledger that ``run_id`` was reconciled (a failure is only logged: the
    run is then checked again by the next ``unreconciled`` pass)."""
    try:
        queue = build.open_queue(cfg, settings.db_url(db_url) or cfg.database.url)
        try:
            run_ledger.RunLedger(queue).mark_reconciled(run_id)
        finally:
            queue.engine.dispose()
    except errors.QueueError:
        get_run_logger().warning("run %s not marked reconciled", run_id, exc_info=True)


UNRECONCILED_SETTLED_S = 900.0
"""``unreconciled``: a run is taken once it ended (or last beat) this long ago: its own
trigger has had its chance (Prefect holds some trigger events up to 15 min)."""
SWEEP_MAX_S = 3000.0
"""``full``: a sweep stops after the first page that ends past this many seconds; the next
full run resumes it (a sweep of a million items took about 20 s; docs/benchmarks.md)."""
UNRECONCILED_MAX_RUNS = 20
"""``unreconciled``: runs reconciled per flow run, oldest first; the next run takes the rest."""


@flow(name="batching-reconcile")
def reconcile(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    output: str | None = None,
    upstream_flow_run_id: str | None = None,
    window_s: float | None = None,
    repair: bool = False,
    db_url_secret: str | None = None,
    lineage_api_key_secret: str | None = None,
    unreconciled: bool = False,
    settled_s: float = UNRECONCILED_SETTLED_S,
    full: bool = False,
    sweep_max_s: float | None = SWEEP_MAX_S,
    dataset_lost: bool = False,
) -> dict[str, Any]:
    """Reconcile a pipeline's queue and outputs; fail on any critical finding.

    Args:
        config: pipeline YAML; default ``deployments/online.yaml``.
        overrides, db_url, output, db_url_secret, lineage_api_key_secret: as for the score flow.
        upstream_flow_run_id: only the batches of this scoring run (its flow-run id).
        window_s: else only items and batches of the last ``window_s`` seconds.
        repair: repair what is found, then check again.
        unreconciled: instead, each run of the config that committed items, ended more than
            ``settled_s`` ago and was never reconciled (one its trigger did not reach), up to
            :data:`UNRECONCILED_MAX_RUNS`, oldest first. A run reconciled (by this or by its
            trigger) is marked in the run ledger and not taken again.
        full: instead, a full sweep of everything committed to the output (the daily
            schedule): bounded in memory, resumable; a sweep that is still going after
            ``sweep_max_s`` stops after its page and the next full run resumes it. Findings
            fail the run as any reconcile's do.
        dataset_lost: judge the batches in scope even when the output holds no file at all
            (it was deleted; with ``repair`` their items are scored again), as
            ``batching reconcile --dataset-lost``. Without it such an output, or one that
            holds none of the ledger's batches, fails the run and emits
            ``batching.reconcile.failed``: nothing could be judged.

    Raises:
        ConfigError: ``window_s`` is not above 0; ``unreconciled`` or ``full`` with another
            scope; ``upstream_flow_run_id`` names no run of the ledger; the output cannot be
            judged (above).

    Returns:
        The report as found (``found``) and, when repairing, the second pass (``after_repair``);
        with ``unreconciled``, those of each run under ``runs``.
    """
    run_id = flow_run_id()
    with logs.to_prefect(run_id):
        credentials.refuse_passwords(db_url=db_url, output=output, overrides=overrides)
        cfg = settings.load(config or settings.ONLINE, overrides)
        cfg = credentials.with_lineage_api_key(cfg, lineage_api_key_secret)
        db = credentials.db_url(db_url, db_url_secret)
        _check_scope(window_s, upstream_flow_run_id, unreconciled=unreconciled, full=full)
        if unreconciled:
            return reconcile_unreconciled(cfg, db, output, settled_s=settled_s, repair=repair)
        if full:
            return reconcile_full(cfg, db, output, max_seconds=sweep_max_s, repair=repair)
        since = time.time() - window_s if window_s and not upstream_flow_run_id else None
        res = settings.locations(cfg, db, output)
        if upstream_flow_run_id:
            _require_run(cfg, db, upstream_flow_run_id)
        with flow_lineage.reconcile_run(
            cfg, res, run_id, repair=repair, upstream=upstream_flow_run_id
        ) as run:
            try:
                found, final = check(
                    cfg,
                    db,
                    output,
                    run_id=upstream_flow_run_id,
                    since=since,
                    repair=repair,
                    dataset_lost=dataset_lost,
                )
            except errors.ConfigError as exc:  # an output that cannot be judged: alert
                _unjudged(cfg, res.output, upstream_flow_run_id, exc)
                raise
            run.checked(final)
            if upstream_flow_run_id:
                mark_reconciled(cfg, db, upstream_flow_run_id)
            judge(cfg, found, final, upstream_flow_run_id)
        return {"found": found.to_dict()} | ({"after_repair": final.to_dict()} if repair else {})


def _check_scope(
    window_s: float | None, upstream: str | None, *, unreconciled: bool, full: bool
) -> None:
    """Refuse a scope that would check nothing and still send the heartbeat (a negative
    window starts in the future), or two scopes of which one would be skipped."""
    if window_s is not None and not window_s > 0:
        raise errors.ConfigError(f"window_s must be > 0 seconds, got {window_s!r}")
    given = [
        name
        for name, on in (
            ("unreconciled", unreconciled),
            ("full", full),
            ("upstream_flow_run_id", bool(upstream)),
            ("window_s", window_s is not None),
        )
        if on
    ]
    if (unreconciled or full) and len(given) > 1:
        raise errors.ConfigError(
            f"{' and '.join(given)} are different scopes: give unreconciled, full, or "
            "upstream_flow_run_id / window_s (a run's batches, the last seconds)"
        )


def _require_run(cfg: config.PipelineConfig, db_url: str | None, run_id: str) -> None:
    """Refuse a run id the run ledger does not hold: its reconcile would check nothing and
    mark it reconciled."""
    queue = build.open_queue(cfg, settings.db_url(db_url) or cfg.database.url)
    try:
        queue.check_schema()
        if not run_ledger.RunLedger(queue).known(run_id):
            raise errors.ConfigError(
                f"upstream_flow_run_id {run_id!r} is no scoring run of the ledger of "
                f"{redact_url(queue.url)}; give the flow-run id of a score run"
            )
    finally:
        queue.engine.dispose()


def _unjudged(
    cfg: config.PipelineConfig, location: str, upstream: str | None, exc: Exception
) -> None:
    """An output reconcile refused to judge (it holds no file, or none of the ledger's
    batches): the failed event, so the alert that a critical finding raises fires too."""
    run_id = flow_run_id()
    events.emit_reconcile(
        events.RECONCILE_FAILED,
        cfg.queue.name,
        {
            "config": cfg.name,
            "queue": cfg.queue.name,
            "location": location,
            "counts": {},
            "critical": ["unjudged"],
            "repairs": 0,
            "upstream_flow_run_id": upstream,
            "findings_text": str(exc),
            "flow_run_id": run_id,
            "flow_run_url": events.flow_run_url(run_id),
        },
    )


def reconcile_unreconciled(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    *,
    settled_s: float,
    repair: bool,
) -> dict[str, Any]:
    """The ``unreconciled`` pass: reconcile and mark each run no trigger reached; judge each
    (alert events per run), then fail if any had critical findings."""
    runs = unreconciled_runs(cfg, db_url, settled_s, UNRECONCILED_MAX_RUNS)
    get_run_logger().info("%d unreconciled run(s) to check: %s", len(runs), ", ".join(runs))
    res = settings.locations(cfg, db_url, output)
    results: dict[str, Any] = {}
    failed: list[str] = []
    with flow_lineage.reconcile_run(cfg, res, flow_run_id(), repair=repair):
        for upstream in runs:
            found, final = check(cfg, db_url, output, run_id=upstream, since=None, repair=repair)
            mark_reconciled(cfg, db_url, upstream)
            results[upstream] = {"found": found.to_dict()} | (
                {"after_repair": final.to_dict()} if repair else {}
            )
            try:
                judge(cfg, found, final, upstream)
            except ReconcileFailed as exc:
                failed.append(f"run {upstream}: {exc}")
        if failed:
            raise ReconcileFailed("; ".join(failed))
    return {"runs": results}


def reconcile_full(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    *,
    max_seconds: float | None,
    repair: bool,
) -> dict[str, Any]:
    """The ``full`` pass: sweep the whole output, publish the findings, judge them."""
    res = settings.locations(cfg, db_url, output)
    with flow_lineage.reconcile_run(cfg, res, flow_run_id(), repair=repair) as run:
        report = sweep_outputs(cfg, db_url, output, max_seconds=max_seconds, repair=repair)
        artifacts.publish_findings(cfg.name, report, "full sweep")
        progress = report.sweep
        get_run_logger().info(
            "full sweep %s: found %s, repaired %d",
            "finished" if progress is None or progress.get("finished") else "stopped part way",
            report.counts,
            len(report.repairs),
        )
        run.checked(report)
        judge(cfg, report, report, None)
    return {"found": report.to_dict()}
