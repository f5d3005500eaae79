"""The deployments, their schedules and triggers, as ``python -m flows.serve`` serves them.

``deployments/prefect.yaml`` declares the same six for a process work pool; a test keeps the
two in step.

* ``batching-score/score``: every 5 min the online profile for at most 240 s; on
  ``batching.queue.backlog`` of the online queue, another bounded online run. One run at a
  time: a run due while one is running is cancelled.
* ``batching-score/score-nightly``: at 02:00 UTC the bulk profile for at most 3 h, one at a
  time. A deployment of its own: on ``score``'s, a backlog of online runs in progress at 02:00
  cancelled the night's bulk drain.
* ``batching-reconcile/reconcile``: hourly over the last 2 h; whenever a score or bulk run that
  committed items ends (Completed, Failed, Crashed or Cancelled: ``batching.run.ended``), over
  that run, with its config, locations and Secret block names; and every 15 min, for the
  online and the bulk config, each run that committed items and that no trigger reached
  (``unreconciled=True``: a safety net, e.g. for a run killed before its hooks ran); and at
  04:30 UTC a full sweep of the online and the bulk output (``full=True``), which walks
  everything committed and resumes where the last one stopped: a file lost days after its
  commit is found by it, not by the 2 h window.
* ``batching-bulk/bulk``: on demand, with ``input_path``.
* ``batching-maintain/maintain``: at 03:00 UTC the online output's housekeeping (a Delta
  table's compaction, checkpoint and vacuum; nothing for the other outputs).
* ``batching-rollout/rollout-guard``: every minute, the online queue's rollout judged
  against the config's ``rollout`` bounds, and its candidate rolled back on a breach.
"""

from __future__ import annotations

from datetime import timedelta
from typing import cast

from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.schedules import Cron, Interval

from flows import events, settings
from flows.bulk import bulk
from flows.maintain import maintain
from flows.reconcile import reconcile
from flows.rollout import rollout_guard
from flows.score import score

ONLINE_MAX_S = 240.0
BULK_MAX_S = 3 * 3600.0
INTERVAL_S = 300
RECONCILE_WINDOW_S = 7200.0
FULL_SWEEP_CRON = "30 4 * * *"
"""The daily full sweep: after the nightly drain (02:00) and the housekeeping (03:00)."""
UNRECONCILED_EVERY_S = 900
"""The safety net: every 15 min, reconcile the runs no ``batching.run.ended`` trigger reached."""
GUARD_INTERVAL_S = 60
"""The rollout guard's period: a breaching candidate serves its share for at most this long
after the guard has ``min_items`` of its items to judge."""
TAGS = ["batching"]


def _from_event(parameter: str) -> str:
    return "{{ event.payload." + parameter + " }}"


def reconcile_trigger() -> DeploymentEventTrigger:
    """Start a reconcile of a score or bulk run that committed items when it ends (however it
    ends), with that run's config, locations and Secret block names."""
    return DeploymentEventTrigger(
        name="reconcile-after-scoring",
        expect={events.RUN_ENDED},
        match={"prefect.resource.id": events.run_resource("*")},
        parameters={
            "upstream_flow_run_id": _from_event("flow_run_id"),
            **{p: _from_event(p) for p in events.RUN_PARAMETERS},
        },
    )


def backlog_trigger() -> DeploymentEventTrigger:
    """Start another bounded online run when the online queue reports a backlog."""
    online = settings.load(settings.ONLINE)
    return DeploymentEventTrigger(
        name="score-on-backlog",
        expect={events.BACKLOG},
        match={
            "prefect.resource.id": events.queue_resource(online.queue.name),
            "batching.config": online.name,
        },
        parameters={"config": settings.ONLINE, "max_seconds": ONLINE_MAX_S},
    )


def _one_at_a_time() -> ConcurrencyLimitConfig:
    return ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)


def score_deployment() -> RunnerDeployment:
    """``batching-score/score``: the online interval and the backlog trigger."""
    deployment = score.to_deployment(
        name="score",
        parameters={"config": settings.ONLINE, "max_seconds": ONLINE_MAX_S},
        schedules=[Interval(timedelta(seconds=INTERVAL_S))],
        triggers=[backlog_trigger()],
        concurrency_limit=_one_at_a_time(),
        tags=TAGS,
    )
    return cast(RunnerDeployment, deployment)  # sync_compatible: the object itself here


def nightly_deployment() -> RunnerDeployment:
    """``batching-score/score-nightly``: the bulk drain at 02:00 UTC, with a concurrency slot
    of its own (online runs in progress must not cancel it)."""
    deployment = score.to_deployment(
        name="score-nightly",
        parameters={"config": settings.BULK, "max_seconds": BULK_MAX_S},
        schedules=[Cron("0 2 * * *", timezone="UTC")],
        concurrency_limit=_one_at_a_time(),
        tags=TAGS,
    )
    return cast(RunnerDeployment, deployment)


def reconcile_deployment() -> RunnerDeployment:
    """``batching-reconcile/reconcile``: hourly over a 2 h window; after every scoring run that
    committed items; every 15 min, the online and bulk runs no trigger reached; and daily, a
    full sweep of the online and the bulk output (resumed where the last one stopped)."""
    deployment = reconcile.to_deployment(
        name="reconcile",
        parameters={"config": settings.ONLINE},
        schedules=[
            Interval(timedelta(hours=1), parameters={"window_s": RECONCILE_WINDOW_S}),
            *(
                Interval(
                    timedelta(seconds=UNRECONCILED_EVERY_S),
                    parameters={"config": config, "unreconciled": True},
                )
                for config in (settings.ONLINE, settings.BULK)
            ),
            *(
                Cron(FULL_SWEEP_CRON, timezone="UTC", parameters={"config": config, "full": True})
                for config in (settings.ONLINE, settings.BULK)
            ),
        ],
        triggers=[reconcile_trigger()],
        tags=TAGS,
    )
    return cast(RunnerDeployment, deployment)


def bulk_deployment() -> RunnerDeployment:
    """``batching-bulk/bulk``: on demand, ``--param input_path=...``."""
    deployment = bulk.to_deployment(name="bulk", parameters={"config": settings.BULK}, tags=TAGS)
    return cast(RunnerDeployment, deployment)


def maintain_deployment() -> RunnerDeployment:
    """``batching-maintain/maintain``: the output's housekeeping at 03:00 UTC."""
    deployment = maintain.to_deployment(
        name="maintain",
        parameters={"config": settings.ONLINE},
        schedules=[Cron("0 3 * * *", timezone="UTC")],
        concurrency_limit=_one_at_a_time(),
        tags=TAGS,
    )
    return cast(RunnerDeployment, deployment)


def rollout_guard_deployment() -> RunnerDeployment:
    """``batching-rollout/rollout-guard``: every minute, roll the online queue's candidate
    back if it breaches the config's ``rollout`` bounds (nothing to do without a rollout)."""
    deployment = rollout_guard.to_deployment(
        name="rollout-guard",
        parameters={"config": settings.ONLINE},
        schedules=[Interval(timedelta(seconds=GUARD_INTERVAL_S))],
        concurrency_limit=_one_at_a_time(),
        tags=TAGS,
    )
    return cast(RunnerDeployment, deployment)


def all_deployments() -> list[RunnerDeployment]:
    """Every deployment, for ``serve``."""
    return [
        score_deployment(),
        nightly_deployment(),
        reconcile_deployment(),
        bulk_deployment(),
        maintain_deployment(),
        rollout_guard_deployment(),
    ]
