"""Every metric's name, kind, labels and help, as data: the recorder and the exporter build
their series from it, and the alert rules and dashboards are checked against it. Standard
library only. Prometheus naming: base units (seconds, ratios), ``_total`` counters.

Label sets: ``S`` = environment, queue, tenant, model_version; ``H`` = environment, queue,
model_version; ``Q`` = environment, queue, tenant; ``E`` = environment, queue.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

S = ("environment", "queue", "tenant", "model_version")
H = ("environment", "queue", "model_version")
Q = ("environment", "queue", "tenant")
E = ("environment", "queue")
ENV = ("environment",)
OTHER_TENANT = "other"
"""The tenant label of every tenant beyond the top N (``metrics.top_tenants``)."""
QUEUE_STATES = ("ready", "leased", "done", "dead", "expired", "cancelled")
"""The ``state`` label of ``batching_queue_items`` (every one is exported, 0 when empty)."""

Kind = Literal["counter", "histogram", "gauge"]


@dataclass(frozen=True)
class Metric:
    """One metric family: ``name`` as exposed (a counter's with its ``_total``)."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


def _powers(start: float, factor: float, n: int) -> tuple[float, ...]:
    return tuple(start * factor**i for i in range(n))


_SIZE = _powers(1, 2, 14)  # 1 .. 8192 items (or cost units)
_RATIO = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

SCORER: tuple[Metric, ...] = (
    Metric("batching_items_committed_total", "counter", S, "Items committed (outputs and ack)."),
    Metric(
        "batching_items_failed_total", "counter", S, "Items failed and retried after a backoff."
    ),
    Metric("batching_items_dead_total", "counter", S, "Items dead-lettered by this scorer."),
    Metric("batching_items_expired_total", "counter", S, "Items expired before scoring."),
    Metric(
        "batching_items_released_total",
        "counter",
        S,
        "Items given back without using an attempt.",
    ),
    Metric(
        "batching_retries_total",
        "counter",
        S,
        "Items finished (committed or failed) on a retry (attempt 2 or later).",
    ),
    Metric(
        "batching_sla_misses_total",
        "counter",
        S,
        "Items committed after their deadline or later than latency_slo_s after enqueue.",
    ),
    Metric(
        "batching_poison_isolated_total",
        "counter",
        S,
        "Items a bisection isolated: failed alone while their batch-mates scored.",
    ),
    Metric(
        "batching_device_seconds_total",
        "counter",
        S,
        "Forward seconds on the scorer's device, shared among tenants by their items' cost.",
    ),
    Metric("batching_oom_splits_total", "counter", H, "Batches split in half after a CUDA OOM."),
    Metric(
        "batching_lease_losses_total", "counter", H, "Items whose lease was lost before commit."
    ),
    Metric(
        "batching_lineage_emit_failures_total",
        "counter",
        H,
        "Lineage events not delivered (spooled for a re-send, or dropped).",
    ),
    Metric(
        "batching_breaker_trips_total",
        "counter",
        H,
        "Runs stopped by the retry-storm breaker.",
    ),
    Metric(
        "batching_forward_hangs_total",
        "counter",
        H,
        "Runs stopped by the forward-pass watchdog (a pass past queue.forward_timeout_s).",
    ),
    Metric("batching_batches_total", "counter", H, "Batches through the commit stage."),
    Metric("batching_batch_size_items", "histogram", H, "Items per batch.", _SIZE),
    Metric("batching_batch_cost", "histogram", H, "Cost units per batch.", _SIZE),
    Metric(
        "batching_batch_fill_ratio",
        "histogram",
        H,
        "Batch size over batching.max_batch_size.",
        _RATIO,
    ),
    Metric(
        "batching_padding_efficiency_ratio",
        "histogram",
        H,
        "Real over padded length units of a batch (1 for fixed-size inputs).",
        _RATIO,
    ),
    Metric(
        "batching_forward_seconds",
        "histogram",
        H,
        "Forward pass of one batch (copies in and out included).",
        _SECONDS,
    ),
    Metric("batching_commit_seconds", "histogram", H, "One group commit.", _SECONDS),
    Metric(
        "batching_item_latency_seconds",
        "histogram",
        S,
        "Enqueue to commit, per committed item.",
        _LATENCY,
    ),
    Metric("batching_run_active", "gauge", E, "1 while a scoring run runs, 0 at its end."),
    Metric(
        "batching_run_heartbeat_timestamp_seconds",
        "gauge",
        E,
        "The run's last sign of life (group commits and heartbeats).",
    ),
    Metric("batching_run_started_timestamp_seconds", "gauge", E, "When the current run started."),
    Metric(
        "batching_adaptive_forward_margin_ratio",
        "gauge",
        E,
        "Adaptive batching: the relative margin its upper estimate adds to a forward pass.",
    ),
    Metric(
        "batching_adaptive_commit_tail_seconds",
        "gauge",
        E,
        "Adaptive batching: measured time from a forward pass's end to its commit.",
    ),
    Metric(
        "batching_adaptive_slack_seconds",
        "gauge",
        E,
        "Adaptive batching: how late recent batches committed against their prediction.",
    ),
)

EXPORTER: tuple[Metric, ...] = (
    Metric(
        "batching_queue_items",
        "gauge",
        (*Q, "state"),
        "Items in the queue table by state (done: counted every --done-every, 5 min by default).",
    ),
    Metric(
        "batching_queue_oldest_ready_age_seconds",
        "gauge",
        Q,
        "Age of the oldest ready item (0: none ready).",
    ),
    Metric(
        "batching_queue_expired_leases",
        "gauge",
        Q,
        "Leased items whose lease expired (not reaped yet).",
    ),
    Metric("batching_queue_paused", "gauge", E, "1 while the queue is paused."),
    Metric("batching_queue_max_depth", "gauge", E, "The queue's depth cap (absent: no cap)."),
    Metric(
        "batching_queue_ledger_horizon_timestamp_seconds",
        "gauge",
        E,
        "The queue's ledger horizon: ledger rows committed before it were purged (absent: none).",
    ),
    Metric(
        "batching_queue_retention_last_run_timestamp_seconds",
        "gauge",
        E,
        "When the queue's retention (batching purge, the maintain flow) last ran, whether or "
        "not it deleted anything (absent: never).",
    ),
    Metric(
        "batching_queue_age_bound_seconds",
        "gauge",
        E,
        "The oldest ready age the queue is held to (backlog_alert_age_s).",
    ),
    Metric("batching_latency_slo_seconds", "gauge", E, "The config's latency_slo_s."),
    Metric("batching_latency_objective_ratio", "gauge", E, "The config's latency_objective."),
    Metric("batching_lineage_spool_events", "gauge", ENV, "Lineage events waiting in the spool."),
    Metric(
        "batching_lineage_spool_oldest_age_seconds",
        "gauge",
        ENV,
        "Age of the oldest spooled lineage event (0: none).",
    ),
    Metric(
        "batching_lineage_spool_failing_events",
        "gauge",
        ENV,
        "Spooled lineage events a re-send already failed for.",
    ),
    Metric(
        "batching_reconcile_findings",
        "gauge",
        (*E, "class", "severity"),
        "Items (or files) per finding class and severity in the last reconcile.",
    ),
    Metric(
        "batching_reconcile_last_run_timestamp_seconds",
        "gauge",
        E,
        "When a reconcile of the queue last ran (never: when its first committing run ended).",
    ),
    Metric(
        "batching_reconcile_last_clean_timestamp_seconds",
        "gauge",
        E,
        "When a reconcile of the queue last found nothing but info.",
    ),
    Metric("batching_exporter_up", "gauge", ENV, "1 when the last scrape read the database."),
)

API_OUTCOMES = ("enqueued", "duplicate", "shed_depth_cap", "shed_tenant_share")
"""The ``outcome`` label of ``batching_api_items_total``: new, its key already queued, or
refused with 429 (the queue at its depth cap, or the tenant at its share of it; a POST
refused unread while either is full, ``batching.api.door``, counts its body's item keys)."""

API: tuple[Metric, ...] = (
    Metric(
        "batching_api_items_total",
        "counter",
        (*Q, "outcome"),
        "Items POSTed to `batching api`, by outcome (enqueued, duplicate, shed_depth_cap, "
        "shed_tenant_share: refused with 429).",
    ),
)
"""Served by ``batching api`` on its own ``/metrics``."""

ALL: tuple[Metric, ...] = SCORER + EXPORTER + API


def by_name() -> dict[str, Metric]:
    """Every metric by its exposed name."""
    return {m.name: m for m in ALL}


def series_names() -> set[str]:
    """Every series name a scrape can show (a histogram's ``_bucket``, ``_sum``, ``_count``)."""
    out: set[str] = set()
    for m in ALL:
        if m.kind == "histogram":
            out |= {f"{m.name}_bucket", f"{m.name}_sum", f"{m.name}_count"}
        else:
            out.add(m.name)
    return out
