"""``batching metrics serve``: the gauges that come from the tables, read at each scrape, so
they are right even when no scorer runs.

* the queue table (``SqlQueue.stats(all_queues=True)``, as ``batching status --json``): items by
  state, oldest ready age and expired leases per queue and tenant (top N tenants by items not
  done, the rest as ``other``). The live states are read at each scrape, through their partial
  indexes; done items are counted in the background, at most every ``done_every_s``
  (:class:`DoneCounts`): that count reads every done item, seconds for ten million, and a
  scrape that waited for it would time out on an old queue;
* the queue controls (``batching queue pause``, ``cap``): paused, depth cap; the ledger's
  horizon (``batching purge --ledger``) and when the retention last ran (its audit rows);
* the config: the queue's age bound (``backlog_alert_age_s``), ``latency_slo_s``,
  ``latency_objective``;
* the lineage spool's backlog;
* the last reconcile (``batching.evidence.reconcile.remember``): findings by class and
  severity, when it ran and when it was last clean.

A database error at scrape time, or a schema that is not this release's, is logged and
shows as ``batching_exporter_up 0``; the exporter keeps serving.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batching import models
from batching.config import PipelineConfig
from batching.evidence import reconcile_result, spool
from batching.ingress import controls
from batching.ingress.done_counts import DoneCounts, filled
from batching.ingress.queue import SqlQueue
from batching.metrics import catalog, publish
from batching.metrics.tenants import fold, top_tenants
from batching.store import database, schema

logger = logging.getLogger(__name__)

RECONCILE_PREFIX = reconcile_result.PREFIX
"""``batching_sweeps`` rows named this plus the queue hold the last reconcile's result."""


DONE_EVERY_S = 300.0
"""How often the exporter counts the done items by default (``metrics serve --done-every``)."""


_LIVE_STATES = tuple(s for s in catalog.QUEUE_STATES if s != "done")


def _family(name: str) -> GaugeMetricFamily:
    """An empty gauge family with the catalog's help and labels."""
    m = catalog.by_name()[name]
    return GaugeMetricFamily(name, m.help, labels=list(m.labels))


class TableCollector(Collector):
    """Reads the tables of ``queue``'s database at each ``collect()`` (see module doc).

    Args:
        config: the environment label, the config queue's bound, SLO and objective, top N.
        queue: a queue on the database (any queue name: stats cover them all).
        clock: epoch seconds.
    """

    def __init__(
        self,
        config: PipelineConfig,
        queue: SqlQueue,
        clock: Callable[[], float] = time.time,
        done_every_s: float = DONE_EVERY_S,
    ) -> None:
        self.config = config
        self.queue = queue
        self.clock = clock
        self.env = config.metrics.environment
        self.done = DoneCounts(queue, done_every_s, clock)
        # every group shown, and when it last had a live item (dropped once none is left)
        self._seen: dict[tuple[str, str, str], float] = {}
        self._live: set[tuple[str, str, str]] = set()  # the groups live at the last scrape
        self._reading = threading.Lock()  # scrapes may come on several threads at once

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Every table gauge, then ``batching_exporter_up``."""
        try:
            families = list(self._read())
        except Exception as exc:  # any failure: up 0, the exporter keeps serving
            logger.warning(
                "metrics scrape could not read the database",
                extra={"action": "metrics_scrape_failed", "error": str(exc)},
            )
            families, up = [], 0.0
        else:
            up = 1.0
        yield from families
        g = _family("batching_exporter_up")
        g.add_metric([self.env], up)
        yield g

    def _read(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        database.require_file_still_there(self.queue.engine)  # else: old figures, up 1
        # A database of another schema (not yet migrated, or by a newer release): its
        # scorers refuse to start while the figures read here looked normal (an upgrade
        # review); up 0 pages as BatchingExporterDown, the log says which versions.
        self.queue.check_schema()
        live = self.queue.stats(all_queues=True, done=False)
        # after the live read: a group it did not find live had no live item by now (a time
        # read before it, under two overlapping scrapes, dropped a group a count had missed)
        seen_at = self.clock()
        with self._reading:
            known = {k[0] for k in self._seen} | {g.queue for g in live.groups}
            known |= {k[0] for k in (self.done.last() or {})}
            new = not set(self.queue.queue_names()) <= known  # its items done between scrapes
            counts, counted_at = self.done.latest_at(now_too=new)
            live_keys = {(g.queue, g.lane, g.tenant) for g in live.groups}
            for key in live_keys | self._live:  # its live items left before this scrape
                self._seen[key] = seen_at
            self._live = live_keys
            if counts is not None and counted_at is not None:
                # A group whose live items left before a count started that did not find it
                # done has no item left (purged): dropped. Kept as zeros for good, 20,000
                # short-lived tenants made each scrape 10x slower (a soak review).
                gone = [k for k, at in self._seen.items() if at < counted_at and k not in counts]
                for key in gone:
                    del self._seen[key]
            stats = filled(live, counts, self._seen.keys())
        queues = sorted({g.queue for g in stats.groups} | {self.config.queue.name})
        yield from self._queue_gauges(stats)
        yield from self._controls(queues)
        yield from self._objectives()
        yield from self._spool(now)
        yield from self._reconcile(queues)

    def _queue_gauges(self, stats: models.QueueStats) -> Iterator[GaugeMetricFamily]:
        volume: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for g in stats.groups:
            # Ranked by the live states, read fresh at each scrape: with the done count (a few
            # minutes old, absent at first) the top tenants flipped when a count landed.
            volume[g.queue][g.tenant] += sum(getattr(g, s) for s in _LIVE_STATES)
        keep = {q: top_tenants(v, self.config.metrics.top_tenants) for q, v in volume.items()}
        items: dict[tuple[str, str], dict[str, int]] = defaultdict(
            lambda: dict.fromkeys(catalog.QUEUE_STATES, 0)
        )
        age: dict[tuple[str, str], float] = defaultdict(float)
        leases: dict[tuple[str, str], int] = defaultdict(int)
        for g in stats.groups:
            key = (g.queue, fold(g.tenant, keep[g.queue]))
            for s in catalog.QUEUE_STATES:
                items[key][s] += getattr(g, s) or 0
            age[key] = max(age[key], g.oldest_ready_age_s or 0.0)
            leases[key] += g.expired_leases
        f_items = _family("batching_queue_items")
        f_age = _family("batching_queue_oldest_ready_age_seconds")
        f_leases = _family("batching_queue_expired_leases")
        counted = "done" in stats.by_state  # not before the first count has finished
        for (q, tenant), counts in sorted(items.items()):
            for s, n in counts.items():
                if s != "done" or counted:
                    f_items.add_metric([self.env, q, tenant, s], n)
            f_age.add_metric([self.env, q, tenant], age[(q, tenant)])
            f_leases.add_metric([self.env, q, tenant], leases[(q, tenant)])
        yield from (f_items, f_age, f_leases)

    def _controls(self, queues: list[str]) -> Iterator[GaugeMetricFamily]:
        rows = controls.states(self.queue.engine)  # queues without a row: not paused, no cap
        purged = controls.last_at(self.queue.engine, "purge")
        paused, depth = _family("batching_queue_paused"), _family("batching_queue_max_depth")
        horizon = _family("batching_queue_ledger_horizon_timestamp_seconds")
        retention = _family("batching_queue_retention_last_run_timestamp_seconds")
        for q in sorted(set(queues) | set(rows) | set(purged)):
            row = rows.get(q)
            paused.add_metric([self.env, q], float(row is not None and row.paused))
            if row is not None and row.max_depth is not None:
                depth.add_metric([self.env, q], float(row.max_depth))
            if row is not None and row.ledger_horizon is not None:
                horizon.add_metric([self.env, q], row.ledger_horizon)
            if q in purged:
                retention.add_metric([self.env, q], purged[q])
        yield from (paused, depth, horizon, retention)

    def _objectives(self) -> Iterator[GaugeMetricFamily]:
        labels = [self.env, self.config.queue.name]
        bound = self.config.backlog_alert_age_s
        f_bound = _family("batching_queue_age_bound_seconds")
        if bound is not None:
            f_bound.add_metric(labels, bound)
        f_slo = _family("batching_latency_slo_seconds")
        f_slo.add_metric(labels, self.config.latency_slo_s)
        f_obj = _family("batching_latency_objective_ratio")
        f_obj.add_metric(labels, self.config.latency_objective)
        yield from (f_bound, f_slo, f_obj)

    def _spool(self, now: float) -> Iterator[GaugeMetricFamily]:
        backlog = spool.backlog(self.queue.engine)
        t = schema.lineage_spool
        with self.queue.read() as conn:
            failing = conn.execute(
                sa.select(sa.func.count()).select_from(t).where(t.c.attempts > 0)
            ).scalar_one()
        oldest = backlog.oldest_at if backlog.oldest_at is not None else now
        for name, value in (
            ("batching_lineage_spool_events", backlog.events),
            ("batching_lineage_spool_oldest_age_seconds", max(0.0, now - oldest)),
            ("batching_lineage_spool_failing_events", failing),
        ):
            g = _family(name)
            g.add_metric([self.env], float(value))
            yield g

    def _reconcile(self, queues: list[str]) -> Iterator[GaugeMetricFamily]:
        runs, sweeps = schema.runs, schema.sweeps
        with self.queue.read() as conn:
            # One pass over the runs: when each queue was last reconciled, and when its first
            # committing run ended (a queue never reconciled shows that: reconcile owed since;
            # without a series, BatchingReconcileStale never fired for it).
            committed = sa.and_(runs.c.n_batches > 0, runs.c.finished_at.is_not(None))
            per_queue = conn.execute(
                sa.select(
                    runs.c.queue,
                    sa.func.max(runs.c.reconciled_at),
                    sa.func.min(sa.case((committed, runs.c.finished_at))),
                ).group_by(runs.c.queue)
            ).all()
            results = conn.execute(
                sa.select(sweeps.c.name, sweeps.c.finished_at, sweeps.c.progress).where(
                    sweeps.c.name.like(f"{RECONCILE_PREFIX}%")
                )
            ).all()
        last_runs = {q: reconciled for q, reconciled, _ in per_queue}
        owed = [(q, first) for q, _, first in per_queue if first is not None]
        f_find = _family("batching_reconcile_findings")
        f_last, f_clean = (
            _family("batching_reconcile_last_run_timestamp_seconds"),
            _family("batching_reconcile_last_clean_timestamp_seconds"),
        )
        last: dict[str, float] = {q: float(t) for q, t in last_runs.items() if t is not None}
        for name, finished_at, progress in results:
            q = name.removeprefix(RECONCILE_PREFIX)
            result = json.loads(progress or "{}")
            last[q] = max(last.get(q, 0.0), float(finished_at or 0.0))
            for f in result.get("findings", []):
                f_find.add_metric([self.env, q, f["class"], f["severity"]], float(f["count"]))
            if result.get("last_clean_at") is not None:
                f_clean.add_metric([self.env, q], float(result["last_clean_at"]))
        for q, first in owed:
            last.setdefault(q, float(first))
        for q, at in sorted(last.items()):
            f_last.add_metric([self.env, q], at)
        yield from (f_find, f_last, f_clean)


def serve(
    config: PipelineConfig,
    queue: SqlQueue,
    port: int,
    *,
    addr: str,
    done_every_s: float = DONE_EVERY_S,
) -> tuple[publish.Server, TableCollector]:
    """Serve a :class:`TableCollector` alone (no process metrics) on ``addr:port``, then
    start its first done count: a scrape seconds later finds it finished (on any queue but a
    huge one), where a queue whose items are all done has no series before it. After the
    bind: an exporter that cannot take its port (restarted in a loop) starts no count.

    Raises:
        ConfigError: the port or address cannot be bound (``--port``).
    """
    collector = TableCollector(config, queue, done_every_s=done_every_s)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    server = publish.serve(port, reg, addr=addr, option="--port")
    collector.done.latest()
    return server, collector
