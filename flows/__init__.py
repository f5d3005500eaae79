"""Prefect flows over the ``batching`` library: the only package that imports prefect.

* :mod:`flows.score`: ``batching-score``: preconditions, bounded scoring run, summary, backlog.
* :mod:`flows.reconcile`: ``batching-reconcile``: findings, alert event, optional repair.
* :mod:`flows.bulk`: ``batching-bulk``: enqueue an input dataset, drain it (bulk profile).
* :mod:`flows.deployments` / :mod:`flows.serve`: schedules and triggers; ``python -m flows.serve``.
* :mod:`flows.alerts`: the reconcile-failed notification; ``python -m flows.alerts``.
"""
