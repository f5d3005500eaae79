"""The rollout guard flow: judge a queue's candidate model version against the config's
``rollout`` bounds and roll it back when it breaches them, as ``batching rollout guard``.

Each run publishes the per-version comparison (items, errors, latency p50/p99, SLA misses)
as a table artifact; a rollback emits ``batching.rollout.rolled_back`` (an automation can
notify on it) and is recorded in the queue's audit and in lineage like a rollback by hand.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.events import emit_event

from batching.compose import rollouts
from batching.config import PipelineConfig
from batching.ingress.rollout import Change
from flows import credentials, events, logs, settings
from flows.score import flow_run_id, retrying_task

ROLLED_BACK = "batching.rollout.rolled_back"


@retrying_task("judge-rollout", retries=2, backoff_s=2.0)
def judge_rollout(
    cfg: PipelineConfig, db_url: str | None, dry_run: bool
) -> tuple[rollouts.Status, Change | None]:
    """Judge the candidate and roll it back on a breach (``rollouts.guard``)."""
    return rollouts.guard(cfg, db_url, dry_run=dry_run)


def publish_status(name: str, seen: rollouts.Status) -> None:
    """The per-version comparison as a table artifact."""
    rows = [
        {k: v for k, v in s.as_dict().items() if k != "version"} | {"version": s.version}
        for s in seen.stats
    ] or [{"version": "-", "role": "no rollout"}]
    route = seen.route.describe() if seen.route else "no route"
    verdict = seen.breach or "within bounds"
    create_table_artifact(
        table=rows,
        key=settings.artifact_key(name, "rollout"),
        description=f"`{seen.queue}`: {route}; guard: {verdict}.",
    )


@flow(name="batching-rollout")
def rollout_guard(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    db_url: str | None = None,
    db_url_secret: str | None = None,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Roll a queue's candidate back when it breaches the config's ``rollout`` bounds.

    Args:
        config: pipeline YAML; default ``deployments/online.yaml``.
        overrides, db_url, db_url_secret: as for the score flow.
        dry_run: judge and publish only.

    Returns:
        The rollout status (route, versions, guard) and whether it rolled back.
    """
    with logs.to_prefect(flow_run_id()):
        credentials.refuse_passwords(db_url=db_url, overrides=overrides)
        cfg = settings.load(config or settings.ONLINE, overrides)
        db = settings.db_url(credentials.db_url(db_url, db_url_secret))  # or $BATCHING_DB_URL
        seen, change = judge_rollout(cfg, db, dry_run)
        publish_status(cfg.name, seen)
        logger = get_run_logger()
        if change is None:
            logger.info("rollout of %s: %s", cfg.queue.name, seen.breach or "within bounds")
        else:
            logger.warning("rolled back: %s", seen.breach)
            emit_event(
                event=ROLLED_BACK,
                resource={
                    "prefect.resource.id": events.queue_resource(cfg.queue.name),
                    "prefect.resource.name": cfg.queue.name,
                    "batching.config": cfg.name,
                },
                payload={
                    "queue": cfg.queue.name,
                    "breach": seen.breach,
                    "to": change.after.as_dict(),
                },
            )
        return seen.as_dict() | {"rolled_back": change is not None}
