"""What ``batching api`` counts (:data:`catalog.API`): the items each POST enqueued, found
already queued, or shed with a 429, by queue, tenant and outcome. The API serves them on its
own ``/metrics`` (:meth:`ApiMetrics.asgi_app`), beside its routes: a 429 happens in the API
process, before anything reaches the tables the exporter reads."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, make_asgi_app

from batching.metrics import catalog

disable_created_metrics()  # type: ignore[no-untyped-call]


class ApiMetrics:
    """The API's series in their own registry.

    Args:
        environment: the ``environment`` label (``metrics.environment``).
    """

    def __init__(self, environment: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.environment = environment
        m = catalog.by_name()["batching_api_items_total"]
        self._items = Counter(
            m.name.removesuffix("_total"), m.help, m.labels, registry=self.registry
        )

    def observe(self, queue: str, tenant: str, outcome: str, n: int) -> None:
        """``n`` items of one POST had ``outcome`` (one of :data:`catalog.API_OUTCOMES`)."""
        if outcome not in catalog.API_OUTCOMES:
            raise ValueError(f"unknown API outcome {outcome!r}; one of {catalog.API_OUTCOMES}")
        if n > 0:
            self._items.labels(self.environment, queue, tenant, outcome).inc(n)

    def asgi_app(self) -> Any:
        """The ``/metrics`` endpoint (Prometheus text format) of these series."""
        return make_asgi_app(self.registry)
