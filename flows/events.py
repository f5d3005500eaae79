"""The Prefect events the flows emit, and the names triggers and automations match on.

* ``batching.queue.backlog`` on resource ``batching.queue.<queue>``: after a score run, the
  queue's ready depth or oldest ready age is at or over ``backlog_alert_depth`` /
  ``backlog_alert_age_s``. The score deployment's trigger starts another run on it; the
  score flow emits it once Completed (its ``on_completion`` hook).
* ``batching.reconcile.failed`` on resource ``batching.output.<queue>``: reconcile found a
  critical fault (still there after a repair, when repairing). The alert automation notifies.
* ``batching.reconcile.repaired`` on the same resource: reconcile repaired faults.

Inside a flow run (its hooks too) the client adds the flow run, flow and deployment as related
resources.
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event

from batching import config, models

BACKLOG = "batching.queue.backlog"
RECONCILE_FAILED = "batching.reconcile.failed"
RECONCILE_REPAIRED = "batching.reconcile.repaired"


def queue_resource(queue: str) -> str:
    """Resource id of a queue: ``batching.queue.<queue>``."""
    return f"batching.queue.{queue}"


def output_resource(queue: str) -> str:
    """Resource id of a queue's outputs: ``batching.output.<queue>``."""
    return f"batching.output.{queue}"


def backlog(cfg: config.PipelineConfig, stats: models.QueueStats) -> dict[str, Any] | None:
    """The backlog event payload when ``stats`` cross the config's thresholds, else None."""
    depth = stats.by_state.get("ready", 0)
    age = stats.oldest_ready_age_s
    deep = cfg.backlog_alert_depth is not None and depth >= cfg.backlog_alert_depth
    old = cfg.backlog_alert_age_s is not None and age is not None and age >= cfg.backlog_alert_age_s
    if not (deep or old):
        return None
    return {
        "queue": cfg.queue.name,
        "config": cfg.name,
        "depth": depth,
        "oldest_ready_age_s": age,
        "depth_threshold": cfg.backlog_alert_depth,
        "age_threshold_s": cfg.backlog_alert_age_s,
        "reasons": [r for r, hit in (("depth", deep), ("age", old)) if hit],
    }


def emit_backlog(payload: dict[str, Any]) -> None:
    """Emit ``batching.ingress.queue.backlog`` for the queue and config a :func:`backlog` payload names."""
    resource = {
        "prefect.resource.id": queue_resource(payload["queue"]),
        "prefect.resource.name": payload["queue"],
        "batching.config": payload["config"],
    }
    emit_event(event=BACKLOG, resource=resource, payload=payload)


def emit_reconcile(event: str, queue: str, payload: dict[str, Any]) -> None:
    """Emit a ``batching.reconcile.*`` event for the outputs of ``queue``."""
    resource = {"prefect.resource.id": output_resource(queue), "prefect.resource.name": queue}
    emit_event(event=event, resource=resource, payload=payload)
