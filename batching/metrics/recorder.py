"""The scorer's metrics: one set of ``prometheus_client`` series per process
(:func:`process_metrics`), and the :class:`Recorder` the scoring loop reports to
(``ports.ScoreObserver``).

With ``PROMETHEUS_MULTIPROC_DIR`` set before this module is imported (``score --workers``,
:mod:`batching.metrics.publish`), every worker's values go to files there and one endpoint
shows their sum; the run gauges then show the most recent value written.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from batching import models, outcomes
from batching.config import PipelineConfig
from batching.metrics import catalog
from batching.metrics.tenants import TenantFolder

logger = logging.getLogger(__name__)
# No ``*_created`` series: they double the series count and no rule or dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

_lock = threading.Lock()
_ADAPTIVE = {  # SloController.terms() -> its gauge
    "forward_margin": "batching_adaptive_forward_margin_ratio",
    "commit_tail_s": "batching_adaptive_commit_tail_seconds",
    "slack_s": "batching_adaptive_slack_seconds",
}
_process: ProcessMetrics | None = None


class ProcessMetrics:
    """The scorer's series (:data:`catalog.SCORER`), registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.series: dict[str, Any] = {m.name: make_series(m, registry) for m in catalog.SCORER}
        self._folders: dict[int, TenantFolder] = {}

    def folder(self, top_n: int) -> TenantFolder:
        """The process's tenant folder for ``top_n`` (one per N, shared by its runs)."""
        with _lock:
            return self._folders.setdefault(top_n, TenantFolder(top_n))


def make_series(m: catalog.Metric, registry: CollectorRegistry) -> Any:
    """The ``prometheus_client`` series of catalog entry ``m``, registered in ``registry``."""
    name = m.name.removesuffix("_total") if m.kind == "counter" else m.name
    if m.kind == "counter":
        return Counter(name, m.help, m.labels, registry=registry)
    if m.kind == "histogram":
        return Histogram(name, m.help, m.labels, registry=registry, buckets=m.buckets)
    return Gauge(name, m.help, m.labels, registry=registry, multiprocess_mode="mostrecent")


def process_metrics() -> ProcessMetrics:
    """This process's scorer series, made on first use in their own registry (not the
    default one: a push or a textfile carries the run's series only)."""
    global _process
    with _lock:
        if _process is None:
            _process = ProcessMetrics(CollectorRegistry(auto_describe=True))
        return _process


class Recorder:
    """Records one run's scoring into this process's series (a ``ports.ScoreObserver``).

    Args:
        config: the run's config (environment, queue, model version, latency_slo_s,
            max_batch_size, metrics.top_tenants).
        metrics: the series to record into (default: :func:`process_metrics`).
    """

    def __init__(self, config: PipelineConfig, metrics: ProcessMetrics | None = None) -> None:
        self.metrics = metrics or process_metrics()
        self.env = config.metrics.environment
        self.queue = config.queue.name
        self.version = config.model.version
        self.slo_s = config.latency_slo_s
        self.max_batch_size = config.batching.max_batch_size
        self.folder = self.metrics.folder(config.metrics.top_tenants)
        self._children: dict[tuple[str, str, str], Any] = {}
        self._by_version: dict[str, dict[str, Any]] = {}
        e = (self.env, self.queue)
        s = self.metrics.series
        self._e = {  # the adaptive controller's only once it reports: a fixed run has none
            m.name: s[m.name].labels(*e)
            for m in catalog.SCORER
            if m.labels == catalog.E and m.name not in _ADAPTIVE.values()
        }
        self._h = self._hv(self.version)

    def _hv(self, version: str | None) -> dict[str, Any]:
        """The ``H``-labelled children of ``version`` (a rollout's batches: their own)."""
        version = version or self.version
        held = self._by_version.get(version)
        if held is None:
            s, h = self.metrics.series, (self.env, self.queue, version)
            held = {m.name: s[m.name].labels(*h) for m in catalog.SCORER if m.labels == catalog.H}
            self._by_version[version] = held
        return held

    def _s(self, name: str, tenant: str, version: str | None = None) -> Any:
        """The ``S``-labelled child of ``name`` for this (folded) tenant label and version."""
        key = (name, tenant, version or self.version)
        child = self._children.get(key)
        if child is None:
            child = self.metrics.series[name].labels(self.env, self.queue, tenant, key[2])
            self._children[key] = child
        return child

    def _by_tenant(self, items: Sequence[models.WorkItem]) -> dict[str, list[int]]:
        """Item positions by folded tenant label."""
        positions: dict[str, list[int]] = collections.defaultdict(list)
        for i, tenant in enumerate(models.item_column(items, "tenant")):
            positions[tenant].append(i)
        out: dict[str, list[int]] = collections.defaultdict(list)
        for tenant, p in positions.items():
            out[self.folder.label(tenant, len(p))].extend(p)
        return out

    def started(self, at: float) -> None:
        """The run started."""
        self._e["batching_run_active"].set(1)
        self._e["batching_run_started_timestamp_seconds"].set(at)
        self._e["batching_run_heartbeat_timestamp_seconds"].set(at)

    def heartbeat(self, at: float) -> None:
        """The run is alive (and active: with workers, the gauge shows the latest write, so
        a worker that finished first does not hide the others for longer than a beat)."""
        self._e["batching_run_active"].set(1)
        self._e["batching_run_heartbeat_timestamp_seconds"].set(at)

    def batch_committed(self, batch: models.Batch, result: outcomes.ScoreResult) -> None:
        """A batch went through the commit stage: its shape, forward time, and the device
        seconds it used, by tenant (apportioned by cost)."""
        version = batch.model_version
        h = self._hv(version)
        h["batching_batches_total"].inc()
        h["batching_batch_size_items"].observe(len(batch))
        h["batching_batch_cost"].observe(batch.stats.cost)
        h["batching_batch_fill_ratio"].observe(len(batch) / self.max_batch_size)
        padded = result.padded_tokens
        h["batching_padding_efficiency_ratio"].observe(
            result.real_tokens / padded if padded else 1.0
        )
        h["batching_forward_seconds"].observe(result.service_s)
        if result.n_oom_splits:
            h["batching_oom_splits_total"].inc(result.n_oom_splits)
        if result.poisoned:
            poisoned = [i for i in batch.items if i.id in result.poisoned]
            for tenant, p in self._by_tenant(poisoned).items():
                self._s("batching_poison_isolated_total", tenant, version).inc(len(p))
        for tenant, seconds in outcomes.by_cost(batch.items, result.service_s).items():
            # folded as ``committed`` counted them (n_items 0: counted once, there)
            label = self.folder.label(tenant, 0)
            self._s("batching_device_seconds_total", label, version).inc(seconds)

    def committed(
        self, items: Sequence[models.WorkItem], done_at: float, model_version: str | None = None
    ) -> None:
        """Items committed: counts, latency, retries and SLA misses by tenant."""
        enqueued = models.item_column(items, "enqueued_at")
        deadlines = models.item_column(items, "deadline_at")
        attempts = models.item_column(items, "attempts")
        v = model_version
        for tenant, positions in self._by_tenant(items).items():
            latency = self._s("batching_item_latency_seconds", tenant, v)
            late = retried = 0
            for i in positions:
                waited = done_at - enqueued[i]
                latency.observe(waited)
                deadline = deadlines[i]
                late += waited > self.slo_s or (deadline is not None and done_at > deadline)
                retried += attempts[i] > 1
            self._s("batching_items_committed_total", tenant, v).inc(len(positions))
            # Born with the committed series (at 0 when none is late): a miss series born at
            # its first miss would start at that count, which rate() never sees, and a
            # tenant's miss ratio would be absent rather than 0 while it is on time.
            self._s("batching_sla_misses_total", tenant, v).inc(late)
            if retried:
                self._s("batching_retries_total", tenant, v).inc(retried)

    def failed(
        self, items: Sequence[models.WorkItem], *, retry: bool, model_version: str | None = None
    ) -> None:
        """Items failed: retried (``failed``) or dead-lettered (``dead``), by tenant and the
        version that failed them."""
        v = model_version
        for tenant, positions in self._by_tenant(items).items():
            dead = sum(not retry or items[i].attempts >= items[i].max_attempts for i in positions)
            retried_before = sum(items[i].attempts > 1 for i in positions)
            if dead:
                self._s("batching_items_dead_total", tenant, v).inc(dead)
            if len(positions) - dead:
                self._s("batching_items_failed_total", tenant, v).inc(len(positions) - dead)
            if retried_before:
                self._s("batching_retries_total", tenant, v).inc(retried_before)

    def released(self, items: Sequence[models.WorkItem]) -> None:
        """Items given back without an attempt."""
        for tenant, positions in self._by_tenant(items).items():
            self._s("batching_items_released_total", tenant).inc(len(positions))

    def lease_lost(self, n_items: int) -> None:
        """Items whose lease was lost."""
        self._h["batching_lease_losses_total"].inc(n_items)

    def commit_timed(self, seconds: float) -> None:
        """One group commit's duration."""
        self._h["batching_commit_seconds"].observe(seconds)

    def adaptive_state(self, terms: Mapping[str, float]) -> None:
        """The adaptive controller's terms after a commit (the latest write wins)."""
        s, e = self.metrics.series, (self.env, self.queue)
        for term, name in _ADAPTIVE.items():
            s[name].labels(*e).set(terms[term])

    def lineage_failed(self, n_events: int) -> None:
        """Lineage events not delivered."""
        if n_events:
            self._h["batching_lineage_emit_failures_total"].inc(n_events)

    def breaker_tripped(self) -> None:
        """The breaker stopped the run."""
        self._h["batching_breaker_trips_total"].inc()

    def forward_hung(self) -> None:
        """The forward-pass watchdog stopped the run."""
        self._h["batching_forward_hangs_total"].inc()

    def expired(self, by_tenant: Sequence[tuple[str, int]]) -> None:
        """Items a claim expired before scoring (their deadline passed): ``(tenant, n)``."""
        for tenant, n in by_tenant:
            if n:
                self._s("batching_items_expired_total", self.folder.label(tenant, n)).inc(n)

    def finished(self, at: float) -> None:
        """The run ended."""
        self._e["batching_run_active"].set(0)
        self._e["batching_run_heartbeat_timestamp_seconds"].set(at)
