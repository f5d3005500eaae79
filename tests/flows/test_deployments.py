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
from prefect.client.schemas.objects import FlowRun, State
from prefect.deployments.runner import RunnerDeployment
from prefect.states import Cancelled, Crashed

from flows import deployments, events, settings
from flows import score as score_module
from flows.bulk import bulk
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


def _reconciles_of(reconcile_id: UUID, upstream: str) -> list[FlowRun]:
    runs = _runs_of(reconcile_id)
    return [r for r in runs if r.parameters.get("upstream_flow_run_id") == upstream]


def test_a_finished_score_run_triggers_a_reconcile_of_that_run(
    tmp_path: Path, applied: list[UUID]
) -> None:
    reconcile_id = _apply(deployments.reconcile_deployment(), applied)
    pipeline = make_pipeline(tmp_path, 50)
    upstream = run_id_of(score(**pipeline.params(), return_state=True))

    (run,) = wait_for(lambda: _reconciles_of(reconcile_id, upstream), what="the reconcile run")
    assert run.parameters == {
        "upstream_flow_run_id": upstream,
        "config": pipeline.config,
        "overrides": pipeline.overrides,
        "db_url": None,
        "db_url_secret": None,
        "output": None,
        "lineage_api_key_secret": None,
    }


def test_a_run_that_fails_after_committing_triggers_a_reconcile_and_one_that_committed_nothing_does_not(
    tmp_path: Path, applied: list[UUID], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a run failing its preconditions (nothing committed) triggered a reconcile that
    failed the same way; now only a run the ledger says committed items asks for one."""
    reconcile_id = _apply(deployments.reconcile_deployment(), applied)
    since = time.time()
    nothing = make_pipeline(tmp_path / "nothing", 10)
    nothing.overrides["model"] = {"sha256": "0" * 64}
    refused = score(**nothing.params(), return_state=True)
    assert refused.is_failed()
    assert "sha256" in (refused.message or "")

    def backlog_check_fails(*_args: Any) -> None:
        raise RuntimeError("the backlog check broke after scoring")

    monkeypatch.setattr(score_module, "check_backlog", backlog_check_fails)
    committed = make_pipeline(tmp_path / "committed", 30)
    failed = score(**committed.params(), return_state=True)
    assert failed.is_failed(), failed.message
    assert committed.by_state()["done"] == 30
    upstream = run_id_of(failed)

    (run,) = wait_for(lambda: _reconciles_of(reconcile_id, upstream), what="the reconcile run")
    assert run.parameters["config"] == committed.config
    # The refused run's hook ran first (the events of one process are sent in order); the
    # committed run's event is stored, so the refused run's would be too.
    ended = wait_for(lambda: events_named(events.RUN_ENDED, since), what="run-ended events")
    assert {e.resource.id for e in ended} == {events.run_resource(upstream)}
    (event,) = ended
    assert event.payload["state"] == "Failed"
    assert event.payload["items_committed"] == 30
    assert event.resource["batching.config"] == "score-tabular"
    assert _reconciles_of(reconcile_id, run_id_of(refused)) == []


@pytest.mark.parametrize("state", [Cancelled(), Crashed()])
def test_a_cancelled_or_crashed_run_that_committed_items_asks_for_a_reconcile(
    tmp_path: Path, state: State[Any]
) -> None:
    """Prefect runs these hooks where the run ends (a cancelled run's in the runner): here the
    hook is called as Prefect calls it, with the run as the API has it."""
    for flow in (score, bulk):
        assert score_module.report_run_end in flow.on_cancellation_hooks, flow.name
        assert score_module.report_run_end in flow.on_crashed_hooks, flow.name
        assert score_module.report_run_end in flow.on_failure_hooks, flow.name
        assert score_module.report_run_end in flow.on_completion_hooks, flow.name
    pipeline = make_pipeline(tmp_path, 20)
    run_id = run_id_of(score(**pipeline.params(), return_state=True))
    since = time.time()
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(UUID(run_id))
    score_module.report_run_end(score, flow_run, state)

    def mine() -> list[Any]:
        found = events_named(events.RUN_ENDED, since)
        return [e for e in found if e.payload["state"] == state.name]

    (event,) = wait_for(mine, what="the run-ended event")
    assert event.resource.id == events.run_resource(run_id)
    assert event.payload["items_committed"] == 20


def test_the_reconcile_trigger_matches_the_event_the_flows_emit() -> None:
    trigger = deployments.reconcile_trigger()
    assert trigger.expect == {events.RUN_ENDED}
    assert trigger.match.get("prefect.resource.id") == [events.run_resource("*")]
    assert set(trigger.parameters or {}) == {"upstream_flow_run_id", *events.RUN_PARAMETERS}


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
