"""Prometheus metrics: what a scorer counts (:mod:`~batching.metrics.recorder`), how it is
served, pushed or written (:mod:`~batching.metrics.publish`), and the exporter that reads the
tables (:mod:`~batching.metrics.exporter`). The names and labels are in
:mod:`~batching.metrics.catalog` (standard library only); ``prometheus_client`` is imported by
the modules of this package alone, and only when one of them is.
"""
