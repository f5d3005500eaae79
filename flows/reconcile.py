"""The reconcile flow: prove every acked item has exactly one committed output.

Scope: one upstream scoring run (``upstream_flow_run_id``: the score deployment's trigger
passes it), else the last ``window_s`` seconds (the hourly schedule), else everything.

1. ``reconcile-outputs`` runs every check of :func:`batching.evidence.reconcile.reconcile` and publishes
   the findings table. With ``repair=True`` it repairs what it found, then checks again (a clean
   second pass is the proof) and publishes that table too.
2. A critical finding (left after the repair, when repairing) emits
   ``batching.reconcile.failed`` and fails the flow run, so automations alert; repairs emit
   ``batching.reconcile.repaired``.

The run is also an OpenLineage run (job ``<config name>-reconcile``): START, then COMPLETE, or
FAIL with the reason.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from batching import config
from batching.compose import build
from batching.evidence import reconcile as rc
from flows import artifacts, events, logs, settings
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
) -> rc.Report:
    """Check (and with ``repair``, fix) the queue, ledger and outputs of ``cfg`` in scope.

    Raises:
        QueueError, SchemaError: the database failed or its schema is not current.
        SinkError: a file could not be listed or moved.
    """
    res = settings.locations(cfg, db_url, output)
    queue = build.open_queue(cfg, res.db_url)
    try:
        queue.check_schema()
        return rc.reconcile(
            queue,
            build.open_sink(queue, res, read_only=True),
            since=since,
            run_id=run_id,
            now=time.time(),
            repair=repair,
        )
    finally:
        queue.engine.dispose()


def _payload(cfg: config.PipelineConfig, report: rc.Report, upstream: str | None) -> dict[str, Any]:
    critical = sorted({str(f.kind) for f in report.findings if f.severity is rc.Severity.CRITICAL})
    return {
        "config": cfg.name,
        "queue": cfg.queue.name,
        "location": report.location,
        "counts": report.counts,
        "critical": critical,
        "repairs": len(report.repairs),
        "upstream_flow_run_id": upstream,
    }


def check(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    *,
    run_id: str | None,
    since: float | None,
    repair: bool,
) -> tuple[rc.Report, rc.Report]:
    """Reconcile (and repair, when asked, then check again); publish each findings table.

    Returns the report as found and the final one (the same report when not repairing).
    """
    found = reconcile_outputs(cfg, db_url, output, run_id=run_id, since=since, repair=repair)
    artifacts.publish_findings(cfg.name, found, "reconcile")
    final = found
    if repair:
        final = reconcile_outputs(cfg, db_url, output, run_id=run_id, since=since, repair=False)
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
        return
    payload = _payload(cfg, final, upstream)
    events.emit_reconcile(events.RECONCILE_FAILED, cfg.queue.name, payload)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(final.counts.items()))
    raise ReconcileFailed(
        f"critical findings {', '.join(payload['critical'])} on {final.location} ({counts})"
    )


@flow(name="batching-reconcile")
def reconcile(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    output: str | None = None,
    upstream_flow_run_id: str | None = None,
    window_s: float | None = None,
    repair: bool = False,
) -> dict[str, Any]:
    """Reconcile a pipeline's queue and outputs; fail on any critical finding.

    Args:
        config: pipeline YAML; default ``deployments/online.yaml``.
        overrides, db_url, output: as for the score flow.
        upstream_flow_run_id: only the batches of this scoring run (its flow-run id).
        window_s: else only items and batches of the last ``window_s`` seconds.
        repair: repair what is found, then check again.

    Returns:
        The report as found (``found``) and, when repairing, the second pass (``after_repair``).
    """
    run_id = flow_run_id()
    with logs.to_prefect(run_id):
        cfg = settings.load(config or settings.ONLINE, overrides)
        since = time.time() - window_s if window_s and not upstream_flow_run_id else None
        res = settings.locations(cfg, db_url, output)
        with flow_lineage.reconcile_run(
            cfg, res, run_id, repair=repair, upstream=upstream_flow_run_id
        ) as run:
            found, final = check(
                cfg, db_url, output, run_id=upstream_flow_run_id, since=since, repair=repair
            )
            run.checked(final)
            judge(cfg, found, final, upstream_flow_run_id)
        return {"found": found.to_dict()} | ({"after_repair": final.to_dict()} if repair else {})
