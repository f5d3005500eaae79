"""Deployments: prefect.yaml mirrors the served ones, and their triggers fire in the harness.

Triggers are automations; the harness server runs the reactive trigger and action services
(not the scheduler), so a trigger's flow run is created but, with no runner, never executed.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.runner import RunnerDeployment

from flows import deployments, events, settings
from flows.score import score
from tests.conftest import wait_for
from tests.flows.support import (
    REPO,
    enqueue_w2,
    events_named,
    make_pipeline,
    run_id_of,
)

PREFECT_YAML = REPO / "deployments" / "prefect.yaml"


def _served() -> dict[str, RunnerDeployment]:
    return {d.name: d for d in deployments.all_deployments()}


def _declared() -> dict[str, dict[str, Any]]:
    spec = yaml.safe_load(PREFECT_YAML.read_text(encoding="utf-8"))
    return {d["name"]: d for d in spec["deployments"]}


def _schedule(schedule: Any) -> dict[str, Any]:
    inner = schedule.schedule
    if hasattr(inner, "interval"):
        when: dict[str, Any] = {"interval": int(inner.interval.total_seconds())}
    else:
        when = {"cron": inner.cron, "timezone": inner.timezone}
    return when | ({"parameters": schedule.parameters} if schedule.parameters else {})


def _trigger(trigger: Any) -> dict[str, Any]:
    dumped = trigger.model_dump(mode="json")
    keys = ("name", "expect", "match", "match_related", "parameters")
    out = {k: dumped[k] for k in keys}
    out["expect"] = sorted(out["expect"])
    return out


def _declared_trigger(trigger: dict[str, Any]) -> dict[str, Any]:
    out = {k: trigger.get(k, {}) for k in ("name", "match", "match_related", "parameters")}
    return out | {"expect": sorted(trigger["expect"])}


def test_prefect_yaml_declares_the_served_deployments() -> None:
    served, declared = _served(), _declared()
    assert set(served) == set(declared)
    for name, deployment in served.items():
        spec = declared[name]
        assert deployment.entrypoint == spec["entrypoint"], name
        assert deployment.parameters == spec.get("parameters", {}), name
        assert [_schedule(s) for s in deployment.schedules or []] == [
            {k: v for k, v in s.items() if k != "active"} for s in spec.get("schedules", [])
        ], name
        assert [_trigger(t) for t in deployment.triggers] == [
            _declared_trigger(t) for t in spec.get("triggers", [])
        ], name


def test_every_entrypoint_names_its_flow() -> None:
    for name, spec in _declared().items():
        path, _, attr = spec["entrypoint"].partition(":")
        assert (REPO / path).is_file(), name
        module = importlib.import_module(Path(path).with_suffix("").as_posix().replace("/", "."))
        assert getattr(module, attr).name == f"batching-{name.partition('-')[0]}"


@pytest.fixture
def applied() -> Iterator[list[UUID]]:
    """Deployments applied by a test; deleted afterwards with the automations of their triggers."""
    ids: list[UUID] = []
    yield ids
    with get_client(sync_client=True) as client:
        for deployment_id in ids:
            client.delete_deployment(deployment_id)
        for trigger in ("reconcile-after-scoring", "score-on-backlog"):
            for automation in client.read_automations_by_name(trigger):
                client.delete_automation(automation.id)


def _apply(deployment: RunnerDeployment, applied: list[UUID]) -> UUID:
    deployment_id = cast(UUID, deployment.apply())  # sync_compatible: the id itself here
    applied.append(deployment_id)
    return deployment_id


def _runs_of(deployment_id: UUID) -> list[FlowRun]:
    deployment_filter = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    with get_client(sync_client=True) as client:
        return list(client.read_flow_runs(deployment_filter=deployment_filter))


def _triggered_runs(deployment_id: UUID) -> list[FlowRun]:
    """Runs an automation created (not the scheduler's, were it running)."""
    return [r for r in _runs_of(deployment_id) if "auto-scheduled" not in r.tags]


def test_a_finished_score_run_triggers_a_reconcile_of_that_run(
    tmp_path: Path, applied: list[UUID]
) -> None:
    reconcile_id = _apply(deployments.reconcile_deployment(), applied)
    pipeline = make_pipeline(tmp_path, 50)
    upstream = run_id_of(score(**pipeline.params(), return_state=True))

    def triggered() -> list[FlowRun]:
        runs = _runs_of(reconcile_id)
        return [r for r in runs if r.parameters.get("upstream_flow_run_id") == upstream]

    (run,) = wait_for(triggered, what="the reconcile run")
    assert run.parameters == {
        "upstream_flow_run_id": upstream,
        "config": pipeline.config,
        "overrides": pipeline.overrides,
        "db_url": None,
        "output": None,
    }


def test_a_backlog_after_a_score_run_emits_an_event_that_triggers_another_run(
    tmp_path: Path, applied: list[UUID]
) -> None:
    score_id = _apply(deployments.score_deployment(), applied)
    pipeline = make_pipeline(tmp_path, 0, config=str(REPO / settings.ONLINE))
    pipeline.overrides["backlog_alert_depth"] = 10
    enqueue_w2(pipeline, 40)
    since = time.time()
    state = score(**pipeline.params(max_items=16), return_state=True)
    assert state.is_completed(), state.message

    (event,) = wait_for(lambda: events_named(events.BACKLOG, since), what="the backlog event")
    assert event.resource.id == "batching.queue.text"
    assert event.payload["depth"] == 40 - state.result()["items_committed"]
    assert event.payload["reasons"] == ["depth"]
    assert state.result()["backlog"] == event.payload
    assert f"prefect.flow-run.{run_id_of(state)}" in {r.id for r in event.related}
    # Sent once the run is Completed: before, it was sent while the run still held the
    # deployment's one slot, and the run it triggered could be cancelled (CANCEL_NEW).
    assert event.occurred >= state.timestamp
    (run,) = wait_for(lambda: _triggered_runs(score_id), what="the backlog-triggered score run")
    assert run.parameters == {"config": settings.ONLINE, "max_seconds": deployments.ONLINE_MAX_S}
