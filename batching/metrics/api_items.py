"""What ``batching api`` counts (:data:`catalog.API`): the items each POST enqueued, found
already queued, or shed with a 429, by queue, tenant and outcome. The API serves them on its
own ``/metrics`` (:meth:`ApiMetrics.exposition`), beside its routes: a 429 happens in the API
process, before anything reaches the tables the exporter reads. Under ``batching api
--workers N`` a scrape answered by any one worker sums every worker's counts
(``prometheus_client``'s multiprocess mode; ``batching.cli.api_workers``)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from batching.metrics import catalog
from batching.metrics.recorder import make_series


class ApiMetrics:
    """The API's series in their own registry.

    Args:
        environment: the ``environment`` label (``metrics.environment``).
        summed_from: the folder of every worker's counts, when the API runs as several
            processes (their ``PROMETHEUS_MULTIPROC_DIR``, read by ``prometheus_client``
            when first imported); None: this process's counts alone.
    """

    def __init__(self, environment: str, summed_from: str | None = None) -> None:
        self.summed_from = summed_from
        self.registry = CollectorRegistry(auto_describe=True)
        self.environment = environment
        self._items = make_series(catalog.by_name()["batching_api_items_total"], self.registry)

    def observe(self, queue: str, tenant: str, outcome: str, n: int) -> None:
        """``n`` items of one POST had ``outcome`` (one of :data:`catalog.API_OUTCOMES`)."""
        if outcome not in catalog.API_OUTCOMES:
            raise ValueError(f"unknown API outcome {outcome!r}; one of {catalog.API_OUTCOMES}")
        if n > 0:
            self._items.labels(self.environment, queue, tenant, outcome).inc(n)

    def exposition(self) -> tuple[bytes, str]:
        """These series in the Prometheus text format, and its content type: this process's,
        or every worker's summed when they count in multiprocess mode."""
        if not self.summed_from:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        summed = CollectorRegistry()
        MultiProcessCollector(summed, path=self.summed_from)  # type: ignore[no-untyped-call]
        return generate_latest(summed), CONTENT_TYPE_LATEST
