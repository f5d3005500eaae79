"""The symptoms the Prometheus alerts page on, as Prefect events for users who live in
Prefect: a score run that missed its latency SLO, the breaker tripping and pausing a queue,
a reconcile that checked clean (the heartbeat the reconcile-stale automation expects); and
every automation file is one Prefect accepts."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect import Flow, flow
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, SendNotification
from prefect.events.schemas.automations import EventTrigger
from prefect.events.schemas.events import ResourceSpecification

from batching import config
from batching.ingress import ingest
from batching.loop.stats import Samples
from batching.model import workloads
from flows import alerts, events
from flows import bulk as bulk_module
from flows import maintain as maintain_module
from flows import reconcile as reconcile_module
from flows import rollout as rollout_module
from flows import score as score_module
from flows.reconcile import reconcile
from flows.score import score
from tests.conftest import wait_for
from tests.e2e.test_cli_breaker import STORM_MODULE
from tests.flows.support import REPO, TABULAR, Pipeline, events_named, make_pipeline, run_id_of

N_ITEMS = 40


def enqueue_w1(pipeline: Pipeline, n_items: int, *, waited_s: float = 0.0) -> None:
    """Enqueue W1 rows as if they had been enqueued ``waited_s`` ago."""
    file = workloads.write_w1_parquet(pipeline.root / "w1.parquet", n_items)
    queue = pipeline.queue(clock=lambda: time.time() - waited_s)
    try:
        queue.enqueue(ingest.read_records(file))
    finally:
        queue.engine.dispose()


def of_run(name: str, since: float, run_id: str) -> list[Any]:
    return [e for e in events_named(name, since) if e.payload.get("flow_run_id") == run_id]


def test_a_run_that_committed_its_items_late_emits_sla_missed_with_the_counts(
    tmp_path: Path,
) -> None:
    pipeline = make_pipeline(tmp_path, 0)
    enqueue_w1(pipeline, N_ITEMS, waited_s=600)  # every item waited 10 min: past 0.5 s
    since = time.time()
    state = score(**pipeline.params(), return_state=True)
    assert state.is_completed(), state.message
    run_id = run_id_of(state)

    (event,) = wait_for(lambda: of_run(events.SLA_MISSED, since, run_id), what="sla_missed")
    payload = event.payload
    assert payload == state.result()["sla_missed"]
    assert payload["items_committed"] == N_ITEMS
    assert payload["items_late"] == N_ITEMS
    assert payload["ratio"] == 1.0
    assert payload["latency_slo_s"] == 0.5
    assert payload["latency_objective"] == 0.99
    assert payload["burn_rate"] == pytest.approx(100.0)
    assert payload["latency_max_s"] >= 600
    assert payload["queue"] == "tabular"
    assert payload["config"] == "score-tabular"
    assert payload["flow_run_url"].endswith(f"/runs/flow-run/{run_id}")
    assert event.resource.id == f"batching.run.{run_id}"
    assert event.resource["batching.queue"] == "tabular"
    assert f"prefect.flow-run.{run_id}" in {r.id for r in event.related}


def test_a_run_within_its_objective_emits_no_sla_missed_and_a_clean_reconcile_says_so(
    tmp_path: Path,
) -> None:
    pipeline = make_pipeline(tmp_path, 0)
    pipeline.overrides["latency_slo_s"] = 3600.0
    enqueue_w1(pipeline, N_ITEMS)
    since = time.time()
    state = score(**pipeline.params(), return_state=True)
    assert state.is_completed(), state.message
    run_id = run_id_of(state)
    assert state.result()["sla_missed"] is None
    # run.ended is emitted after sla_missed would have been, by the same hooks in order
    wait_for(lambda: of_run(events.RUN_ENDED, since, run_id), what="run_ended")
    assert of_run(events.SLA_MISSED, since, run_id) == []

    checked = reconcile(**pipeline.params(upstream_flow_run_id=run_id), return_state=True)
    assert checked.is_completed(), checked.message
    (event,) = wait_for(
        lambda: [
            e
            for e in events_named(events.RECONCILE_CHECKED, since)
            if e.payload["upstream_flow_run_id"] == run_id
        ],
        what="reconcile_checked",
    )
    assert event.resource.id == "batching.output.tabular"
    assert event.payload["critical"] == []


def test_the_sla_payload_is_none_up_to_the_error_budget_and_set_past_it() -> None:
    cfg = config.load_config(TABULAR)  # latency_slo_s 0.5, objective 0.99: 1 % may be late
    within = Samples()
    within.extend([0.1] * 99 + [0.6])
    assert events.sla_missed(cfg, "r", within) is None
    assert events.sla_missed(cfg, "r", Samples()) is None
    late = Samples([cfg.latency_slo_s], keep=7)  # folded into 1% bins past 7 samples
    late.extend([0.1] * 97 + [0.4999, 0.5001, 0.7])  # the count over the SLO stays exact
    payload = events.sla_missed(cfg, "r", late)
    assert payload is not None
    assert payload["items_late"] == 2
    assert payload["ratio"] == 0.02
    assert payload["burn_rate"] == pytest.approx(2.0)
    assert payload["latency_max_s"] == 0.7


@flow
def _breaker_signals(queue: str) -> str:
    cfg = config.load_config(TABULAR, {"queue": {"name": queue}})
    events.emit_breaker_tripped(cfg, "3 batches failed, no single poison", "run-7", "fr-1")
    events.emit_queue_paused(cfg, "breaker:run-7", "3 batches failed, no single poison", 12.5)
    return score_module.flow_run_id()


def test_the_breaker_events_name_the_queue_the_reason_and_the_run() -> None:
    since = time.time()
    queue = f"q-{uuid.uuid4().hex[:8]}"
    run_id = _breaker_signals(queue)

    (tripped,) = wait_for(
        lambda: [
            e for e in events_named(events.BREAKER_TRIPPED, since) if e.payload["queue"] == queue
        ],
        what="breaker_tripped",
    )
    assert tripped.resource.id == f"batching.queue.{queue}"
    assert tripped.payload["reason"] == "3 batches failed, no single poison"
    assert tripped.payload["run"] == "run-7"
    assert tripped.payload["flow_run_url"].endswith("/runs/flow-run/fr-1")
    assert f"prefect.flow-run.{run_id}" in {r.id for r in tripped.related}
    (paused,) = wait_for(
        lambda: [
            e for e in events_named(events.QUEUE_PAUSED, since) if e.payload["queue"] == queue
        ],
        what="queue_paused",
    )
    assert paused.resource.id == f"batching.queue.{queue}"
    assert paused.payload["paused_by"] == "breaker:run-7"
    assert paused.payload["paused_at"] == 12.5


def storm_pipeline(root: Path, monkeypatch: pytest.MonkeyPatch) -> Pipeline:
    """A tabular pipeline whose model fails every batch, 200 items in batches of 32."""
    from safetensors.torch import save_file

    (root / "stormmod.py").write_text(STORM_MODULE)
    monkeypatch.syspath_prepend(str(root))
    save_file({}, root / "empty.safetensors")
    sha = hashlib.sha256((root / "empty.safetensors").read_bytes()).hexdigest()
    profile = json.loads((REPO / "deployments" / "profiles" / "w1-mlp-cpu.json").read_text())
    profile["model"] = {"name": "stormmod:build", "version": "v1"}
    (root / "storm-profile.json").write_text(json.dumps(profile))
    pipeline = make_pipeline(root, 200, batching={"max_batch_size": 32, "claim_size": 64})
    pipeline.overrides["service_profile"] = str(root / "storm-profile.json")
    pipeline.overrides["model"] = {
        "name": "stormmod:build",
        "version": "v1",
        "checkpoint": str(root / "empty.safetensors"),
        "sha256": sha,
        "device": "cpu",
    }
    return pipeline


def test_a_run_the_breaker_stopped_emits_breaker_tripped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = storm_pipeline(tmp_path, monkeypatch)
    since = time.time()
    state = score(**pipeline.params(), return_state=True)
    assert state.is_failed()
    run_id = run_id_of(state)

    (tripped,) = wait_for(
        lambda: of_run(events.BREAKER_TRIPPED, since, run_id), what="breaker_tripped"
    )
    assert tripped.resource.id == "batching.queue.tabular"
    assert tripped.payload["queue"] == "tabular"
    assert tripped.payload["run"] == run_id
    assert tripped.payload["reason"].startswith("retry storm on queue 'tabular': 3 batches")
    assert "CUDA error" in tripped.payload["reason"]
    assert f"prefect.flow-run.{run_id}" in {r.id for r in tripped.related}
    # the storm's run used no attempt and committed nothing, so it missed no SLO
    assert of_run(events.SLA_MISSED, since, run_id) == []


def test_a_clean_run_emits_no_breaker_event(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 20)
    since = time.time()
    state = score(**pipeline.params(), return_state=True)
    assert state.is_completed(), state.message
    run_id = run_id_of(state)
    wait_for(lambda: of_run(events.RUN_ENDED, since, run_id), what="run_ended")
    assert of_run(events.BREAKER_TRIPPED, since, run_id) == []


def test_a_run_whose_breaker_paused_the_queue_emits_queue_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The breaker pauses through the queue controls; the flow reports the pause."""
    pipeline = storm_pipeline(tmp_path, monkeypatch)
    since = time.time()
    state = score(**pipeline.params(), return_state=True)
    assert state.is_failed()
    (paused,) = wait_for(
        lambda: [e for e in events_named(events.QUEUE_PAUSED, since)],
        what="queue_paused",
    )
    assert paused.resource.id == "batching.queue.tabular"
    assert paused.payload["paused_by"].startswith("breaker:")
    assert "retry storm" in paused.payload["reason"]


AUTOMATION_FILES = sorted(alerts.AUTOMATIONS.glob("*.yaml"))


@pytest.mark.parametrize("path", AUTOMATION_FILES, ids=lambda p: p.name)
def test_every_automation_file_is_an_automation_prefect_accepts(path: Path) -> None:
    block = uuid.uuid4()
    automation = alerts.load_automation(path, block)
    assert automation.name.startswith("batching-")
    (action,) = [a for a in automation.actions if isinstance(a, SendNotification)]
    assert action.block_document_id == block
    assert "docs/operations.md#" in action.body or path.name == "reconcile-failed.yaml"


def test_the_zombie_automation_crashes_the_silent_runs_of_every_flow_of_this_project() -> None:
    # A flow added to flows/ and left out of the list would stay Running after its host died.
    automation = alerts.load_automation(alerts.AUTOMATIONS / "zombie-runs.yaml", uuid.uuid4())
    trigger = automation.trigger
    assert isinstance(trigger, EventTrigger)
    assert trigger.posture == "Proactive"
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    ends = {
        f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed", "TimedOut")
    }
    assert trigger.expect == {"prefect.flow-run.heartbeat", *ends}
    related = trigger.match_related
    assert isinstance(related, ResourceSpecification)
    ours = {
        f.name
        for module in (score_module, bulk_module, reconcile_module, maintain_module, rollout_module)
        for f in vars(module).values()
        if isinstance(f, Flow)
    }
    assert set(related.root["prefect.resource.name"]) == ours
    assert [a.type for a in automation.actions] == ["change-flow-run-state", "send-notification"]
    (crash,) = [a for a in automation.actions if isinstance(a, ChangeFlowRunState)]
    assert crash.state == StateType.CRASHED
    # the window outlasts several beats of the shipped heartbeat (deployments/prefect*.yaml)
    for name in ("prefect.yaml", "prefect-gpu.yaml"):
        shipped = (REPO / "deployments" / name).read_text()
        assert 'PREFECT_FLOWS_HEARTBEAT_FREQUENCY: "60"' in shipped, name
    assert trigger.within.total_seconds() >= 5 * 60


def test_each_paging_symptom_has_an_automation() -> None:
    by_event: dict[str, EventTrigger] = {}
    for path in AUTOMATION_FILES:
        trigger = alerts.load_automation(path, uuid.uuid4()).trigger
        assert isinstance(trigger, EventTrigger)
        for name in trigger.expect:
            by_event[name] = trigger
    for name in (
        events.BACKLOG,
        events.SLA_MISSED,
        events.BREAKER_TRIPPED,
        events.RECONCILE_FAILED,
    ):
        assert by_event[name].posture == "Reactive", name
    stale = by_event["batching.reconcile.*"]
    assert stale.posture == "Proactive"
    assert stale.after == {"batching.reconcile.*"}
    assert stale.for_each == {"prefect.resource.id"}
    assert stale.within.total_seconds() == 7200
