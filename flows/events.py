"""The Prefect events the flows emit, and the names triggers and automations match on.

* ``batching.queue.backlog`` on resource ``batching.queue.<queue>``: after a score run, the
  queue's ready depth or oldest ready age is at or over ``backlog_alert_depth`` /
  ``backlog_alert_age_s``. The score deployment's trigger starts another run on it; the
  score flow emits it once Completed (its ``on_completion`` hook).
* ``batching.reconcile.failed`` on resource ``batching.output.<queue>``: reconcile found a
  critical fault (still there after a repair, when repairing). The alert automation notifies.
* ``batching.reconcile.repaired`` on the same resource: reconcile repaired faults.
* ``batching.run.ended`` on resource ``batching.run.<flow-run id>`` (labels
  ``batching.config``, ``batching.queue``): a score or bulk run ended (Completed, Failed,
  Crashed or Cancelled) having committed items, by the run ledger's count (its workers'
  included). The reconcile deployment's trigger reconciles that run on it. Its payload names
  the run's config, overrides, locations and Secret blocks, never a password. A run that
  committed nothing emits none. (A custom event: Prefect's own ``prefect.flow-run.*`` events
  of a deployment's first scheduled run reach triggers 15 min late, see
  ``bench/prefect_late_trigger.py``.)

* ``batching.run.sla_missed`` on resource ``batching.run.<flow-run id>`` (labels
  ``batching.config``, ``batching.queue``): a score run Completed having committed more of its
  items past ``latency_slo_s`` than the latency objective allows (its burn rate over 1). The
  payload has the counts, the ratio, the objective, its error budget and the burn rate. A run
  within its objective emits none. The ``batching-sla-missed`` automation notifies.
* ``batching.breaker.tripped`` on resource ``batching.queue.<queue>``: the retry-storm breaker
  stopped a run (consecutive batches failed with no single poison item); payload ``queue``,
  ``reason`` (the run's ``RetryStorm`` message), ``run`` and the flow run. The
  ``batching-breaker-tripped`` automation notifies.
* ``batching.queue.paused`` on resource ``batching.queue.<queue>``: a queue was paused by a
  run's breaker (``paused_by`` ``breaker:<run id>``, ``reason``, ``paused_at``).
* ``batching.reconcile.checked`` on resource ``batching.output.<queue>``: a reconcile found no
  critical fault. With ``batching.reconcile.failed`` it is the heartbeat the
  ``batching-reconcile-stale`` automation expects (no ``batching.reconcile.*`` for 2 h).

Inside a flow run (its hooks too) the client adds the flow run, flow and deployment as related
resources. ``docs/operations.md#alerts`` maps each event to its Prometheus alert.
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event
from prefect.utilities.urls import url_for

from batching import config, models
from batching.loop.stats import Samples

BACKLOG = "batching.queue.backlog"
RECONCILE_FAILED = "batching.reconcile.failed"
RECONCILE_REPAIRED = "batching.reconcile.repaired"
RECONCILE_CHECKED = "batching.reconcile.checked"
RUN_ENDED = "batching.run.ended"
SLA_MISSED = "batching.run.sla_missed"
BREAKER_TRIPPED = "batching.breaker.tripped"
QUEUE_PAUSED = "batching.queue.paused"
RUN_PARAMETERS = (
    "config",
    "overrides",
    "db_url",
    "db_url_secret",
    "output",
    "lineage_api_key_secret",
)
"""The run parameters ``batching.run.ended`` carries, for the reconcile it triggers."""


def queue_resource(queue: str) -> str:
    """Resource id of a queue: ``batching.queue.<queue>``."""
    return f"batching.queue.{queue}"


def output_resource(queue: str) -> str:
    """Resource id of a queue's outputs: ``batching.output.<queue>``."""
    return f"batching.output.{queue}"


def run_resource(flow_run_id: str) -> str:
    """Resource id of a scoring run: ``batching.run.<flow-run id>``."""
    return f"batching.run.{flow_run_id}"


def flow_run_url(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI (``PREFECT_UI_URL``, else the API's), if known."""
    return url_for("flow-run", obj_id=flow_run_id)


def emit_run_ended(
    cfg: config.PipelineConfig,
    flow_run_id: str,
    state: str,
    committed: int,
    parameters: dict[str, Any],
) -> None:
    """Emit ``batching.run.ended`` for a run that committed ``committed`` (> 0) items.

    ``parameters``: the run's, of which :data:`RUN_PARAMETERS` go into the payload; they were
    checked for passwords when the run started (a run refused for one committed nothing).
    """
    resource = {
        "prefect.resource.id": run_resource(flow_run_id),
        "prefect.resource.name": f"{cfg.name} run {flow_run_id}",
        "batching.config": cfg.name,
        "batching.queue": cfg.queue.name,
    }
    payload = {
        "flow_run_id": flow_run_id,
        "flow_run_url": flow_run_url(flow_run_id),
        "state": state,
        "items_committed": committed,
        **{p: parameters.get(p) for p in RUN_PARAMETERS},
    }
    emit_event(event=RUN_ENDED, resource=resource, payload=payload)


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


def latency_objective(cfg: config.PipelineConfig) -> float:
    """The share of items to commit within ``latency_slo_s`` (``latency_objective``)."""
    return cfg.latency_objective


def sla_missed(
    cfg: config.PipelineConfig, flow_run_id: str, latencies_s: Samples
) -> dict[str, Any] | None:
    """The ``batching.run.sla_missed`` payload of a run whose items took ``latencies_s``
    (enqueue to commit, one per item committed) when more of them than the error budget
    (1 - ``latency_objective``) took over ``latency_slo_s``; else None."""
    committed = len(latencies_s)
    late = latencies_s.count_above(cfg.latency_slo_s)
    objective = latency_objective(cfg)
    budget = 1.0 - objective
    ratio = late / committed if committed else 0.0
    if ratio <= budget:
        return None
    return {
        "queue": cfg.queue.name,
        "config": cfg.name,
        "flow_run_id": flow_run_id,
        "flow_run_url": flow_run_url(flow_run_id),
        "items_committed": committed,
        "items_late": late,
        "ratio": ratio,
        "latency_slo_s": cfg.latency_slo_s,
        "latency_objective": objective,
        "error_budget": budget,
        "burn_rate": ratio / budget,
        "latency_max_s": latencies_s.max,
    }


def emit_sla_missed(payload: dict[str, Any]) -> None:
    """Emit ``batching.run.sla_missed`` for the run a :func:`sla_missed` payload names."""
    resource = {
        "prefect.resource.id": run_resource(payload["flow_run_id"]),
        "prefect.resource.name": f"{payload['config']} run {payload['flow_run_id']}",
        "batching.config": payload["config"],
        "batching.queue": payload["queue"],
    }
    emit_event(event=SLA_MISSED, resource=resource, payload=payload)


def emit_breaker_tripped(
    cfg: config.PipelineConfig, reason: str, run: str, flow_run_id: str | None = None
) -> None:
    """Emit ``batching.breaker.tripped``: the breaker of scorer run ``run`` (of flow run
    ``flow_run_id``) stopped it for ``reason``."""
    resource = {
        "prefect.resource.id": queue_resource(cfg.queue.name),
        "prefect.resource.name": cfg.queue.name,
        "batching.config": cfg.name,
    }
    payload = {
        "queue": cfg.queue.name,
        "config": cfg.name,
        "reason": reason,
        "run": run,
        "flow_run_id": flow_run_id,
        "flow_run_url": flow_run_url(flow_run_id) if flow_run_id else None,
    }
    emit_event(event=BREAKER_TRIPPED, resource=resource, payload=payload)


def emit_queue_paused(
    cfg: config.PipelineConfig, paused_by: str, reason: str | None, paused_at: float | None
) -> None:
    """Emit ``batching.queue.paused``: ``paused_by`` paused the config's queue for ``reason``."""
    resource = {
        "prefect.resource.id": queue_resource(cfg.queue.name),
        "prefect.resource.name": cfg.queue.name,
        "batching.config": cfg.name,
    }
    payload = {
        "queue": cfg.queue.name,
        "config": cfg.name,
        "paused_by": paused_by,
        "reason": reason,
        "paused_at": paused_at,
    }
    emit_event(event=QUEUE_PAUSED, resource=resource, payload=payload)
