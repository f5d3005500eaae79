"""The reconcile flow against faults made for real in a scored Parquet dataset.

The library's tests cover every fault class in detail; here one run with several faults proves
the flow's side: findings artifact, alert event, Failed state, lineage, and repair.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from referencing import Registry

from batching import config
from batching.compose import build
from batching.evidence import lineage
from batching.evidence.findings import Finding, Kind, Report, Severity
from batching.ingress import ingest
from batching.model import workloads
from batching.outputs import parquet_layout
from flows import events
from flows import lineage as flow_lineage
from flows.reconcile import reconcile
from flows.score import score
from tests import olspec
from tests.conftest import REPO, wait_for
from tests.flows.support import (
    Pipeline,
    artifacts_of,
    events_named,
    make_pipeline,
    run_id_of,
)

CRITICAL = {"missing_file", "truncated_or_corrupt", "lost_write"}
WARNING = {"orphan_file", "stale_lease"}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())


def make_faults(pipeline: Pipeline) -> None:
    """Delete a committed file, truncate one, leave a staging leftover, ack items without an
    output, and leave a lease expired an hour ago."""
    files = sorted(pipeline.output.rglob("*.parquet"))
    files[0].unlink()
    files[1].write_bytes(files[1].read_bytes()[:100])
    staging = pipeline.output.parent / f"{pipeline.output.name}.staging"
    leftover = f"{uuid.uuid4().hex}.{uuid.uuid4().hex}{parquet_layout.STAGING_SUFFIX}"
    (staging / leftover).write_bytes(b"PAR1 torn")
    _ack_without_output(pipeline)
    _expire_a_lease(pipeline)


def _records(pipeline: Pipeline, prefix: str, n: int) -> list[Any]:
    file = workloads.write_w1_parquet(pipeline.root / f"{prefix}.parquet", n, prefix=prefix)
    return ingest.read_records(file)


def _ack_without_output(pipeline: Pipeline) -> None:
    queue = pipeline.queue()
    try:
        queue.enqueue(_records(pipeline, "acked-", 2))
        claim = queue.claim(2, lease_s=60)
        queue.ack(claim.lease_id, [i.id for i in claim.items])
    finally:
        queue.engine.dispose()


def _expire_a_lease(pipeline: Pipeline) -> None:
    queue = pipeline.queue(clock=lambda: time.time() - 3600)  # a worker lost an hour ago
    try:
        queue.enqueue(_records(pipeline, "stale-", 1))
        assert len(queue.claim(1, lease_s=60)) == 1
    finally:
        queue.engine.dispose()


def _finding_rows(run_id: str) -> list[dict[str, Any]]:
    (artifact,) = [a for a in artifacts_of(run_id) if a.key == "score-tabular-reconcile"]
    data = artifact.data
    return json.loads(data) if isinstance(data, str) else list(data)


def test_reconcile_alerts_on_real_faults_and_repair_makes_the_next_run_clean(
    tmp_path: Path, registry: Registry
) -> None:
    # Claims of 50: several leases, so several files for make_faults to break two of.
    pipeline = make_pipeline(tmp_path, 200, batching={"max_batch_size": 25, "claim_size": 50})
    scored = score(**pipeline.params(), return_state=True)
    assert scored.is_completed()
    make_faults(pipeline)
    since = time.time()

    failed = reconcile(**pipeline.params(), return_state=True)
    assert failed.is_failed()
    assert "critical findings" in (failed.message or "")
    run_id = run_id_of(failed)
    rows = _finding_rows(run_id)
    assert {(r["class"], r["severity"]) for r in rows} == {
        *((k, "critical") for k in CRITICAL),
        *((k, "warning") for k in WARNING),
    }
    check_alert(run_id, since)
    check_lineage(pipeline, run_id, ["START", "FAIL"], registry)

    repaired = reconcile(**pipeline.params(repair=True), return_state=True)
    assert repaired.is_completed(), repaired.message
    result = repaired.result()
    assert {f["class"] for f in result["found"]["findings"]} == CRITICAL | WARNING
    assert result["found"]["repairs"], "it repaired"
    assert result["after_repair"]["clean"], result["after_repair"]

    # the score run's own check (as its deployment trigger runs it): a child of that run
    upstream = run_id_of(scored)
    clean = reconcile(**pipeline.params(upstream_flow_run_id=upstream), return_state=True)
    assert clean.is_completed(), clean.message
    assert clean.result()["found"]["findings"] == []
    found = check_lineage(pipeline, run_id_of(clean), ["START", "COMPLETE"], registry)
    for event in found:
        parent = event["run"]["facets"]["parent"]
        assert parent["run"]["runId"] == upstream != event["run"]["runId"]
        job = event["job"]["namespace"], "score-tabular"
        assert (parent["job"]["namespace"], parent["job"]["name"]) == job
    assert "parent" not in pipeline.lineage(run_id)[0]["run"]["facets"]  # no upstream given


def check_alert(run_id: str, since: float) -> None:
    """The failed run emitted ``batching.reconcile.failed``, related to the run."""
    (event,) = wait_for(lambda: events_named(events.RECONCILE_FAILED, since), what="the alert")
    assert event.resource.id == "batching.output.tabular"
    assert set(event.payload["critical"]) == CRITICAL
    related = {r.id for r in event.related}
    assert f"prefect.flow-run.{run_id}" in related


def check_lineage(
    pipeline: Pipeline, run_id: str, expected: list[str], registry: Registry
) -> list[dict[str, Any]]:
    """The reconcile run is its own lineage job, with valid events; its end carries one
    data-quality assertion per finding class on the outputs it read."""
    found = pipeline.lineage(run_id)
    assert [e["eventType"] for e in found] == expected
    for event in found:
        olspec.assert_valid_event(event, registry)
        assert event["job"]["name"] == "score-tabular-reconcile"
    if expected[-1] == "FAIL":
        message = found[-1]["run"]["facets"]["errorMessage"]["message"]
        assert message.startswith("ReconcileFailed: critical findings")
    assert "dataQualityAssertions" not in found[0]["inputs"][1]["inputFacets"]  # START
    queue_ds, outputs = found[-1]["inputs"]
    assert (outputs["namespace"], outputs["name"]) == ("file", str(pipeline.output))
    assert "dataQualityAssertions" not in queue_ds["inputFacets"]
    checks = {
        a["assertion"]: a for a in outputs["inputFacets"]["dataQualityAssertions"]["assertions"]
    }
    assert set(checks) == {str(k) for k in Kind}
    failed = {k for k, a in checks.items() if not a["success"]}
    if expected[-1] == "FAIL":
        assert failed == CRITICAL | WARNING
        assert {checks[k]["severity"] for k in CRITICAL} == {"error"}
        assert {checks[k]["severity"] for k in WARNING} == {"warn"}
        assert all(int(checks[k]["actual"]) > 0 for k in failed)
    else:
        assert failed == set()
    return found


def _report(*findings: tuple[Kind, Severity, int]) -> Report:
    made = tuple(
        Finding(kind, severity, f"{kind} found", count=n) for kind, severity, n in findings
    )
    return Report("parquet", "/out", time.time(), None, None, made)


@pytest.mark.parametrize(
    ("finding", "success", "severity"),
    [
        ((Kind.UNPUBLISHED, Severity.CRITICAL, 3), False, "error"),
        ((Kind.UNPUBLISHED, Severity.WARNING, 3), False, "warn"),  # a live scorer's: no failure
        ((Kind.UNPUBLISHED, Severity.INFO, 3), True, "info"),  # readers see the file
        ((Kind.DEAD, Severity.INFO, 5), True, "info"),
    ],
)
def test_a_finding_class_is_one_assertion_failed_by_critical_and_warning_findings(
    finding: tuple[Kind, Severity, int], success: bool, severity: str
) -> None:
    found = {a.assertion: a for a in flow_lineage.assertions(_report(finding))}
    assert set(found) == {str(k) for k in Kind}
    checked = found[str(finding[0])]
    assert (checked.success, checked.severity) == (success, severity)
    assert checked.actual == str(finding[2])
    others = [a for k, a in found.items() if k != str(finding[0])]
    assert all(a.success and a.actual == "0" and a.description is None for a in others)


def test_an_upstream_that_is_no_run_id_gives_the_reconcile_run_no_parent(tmp_path: Path) -> None:
    cfg = config.load_config(REPO / "deployments" / "tabular.yaml")
    res = build.resolve(cfg, f"sqlite:///{tmp_path / 'q.db'}", str(tmp_path / "out"))
    run_id = lineage.new_run_id()
    upstream = lineage.new_run_id()
    ctx = flow_lineage.reconcile_context(cfg, res, run_id, repair=False, upstream=upstream)
    assert (ctx.parent_run_id, ctx.parent_job_name) == (upstream, "score-tabular")
    for bad in ("not-a-run-id", run_id, None):
        ctx = flow_lineage.reconcile_context(cfg, res, run_id, repair=False, upstream=bad)
        assert (ctx.parent_run_id, ctx.parent_job_name) == (None, None)


def _reconciled_at(pipeline: Pipeline) -> dict[str, float | None]:
    import sqlalchemy as sa

    from batching.store import schema

    engine = sa.create_engine(pipeline.db_url)
    try:
        with engine.connect() as conn:
            r = schema.runs.c
            top = r.parent_run_id.is_(None)  # flow runs; their scorers are children
            rows = conn.execute(sa.select(r.run_id, r.reconciled_at).where(top)).all()
    finally:
        engine.dispose()
    return {row.run_id: row.reconciled_at for row in rows}


def test_the_safety_net_reconciles_a_run_no_trigger_reached_and_only_once(tmp_path: Path) -> None:
    """No reconcile deployment here: the score run's event triggers nothing, as when Prefect
    held the trigger or the run was killed before its hooks ran."""
    pipeline = make_pipeline(tmp_path, 60)
    missed = run_id_of(score(**pipeline.params(), return_state=True))
    nothing = run_id_of(score(**pipeline.params(), return_state=True))  # the queue was empty
    assert _reconciled_at(pipeline) == {missed: None, nothing: None}

    young = reconcile(**pipeline.params(unreconciled=True), return_state=True)
    assert young.is_completed(), young.message
    assert young.result() == {"runs": {}}, "a run that ended under settled_s ago is left alone"

    net = reconcile(**pipeline.params(unreconciled=True, settled_s=0), return_state=True)
    assert net.is_completed(), net.message
    (checked,) = net.result()["runs"]
    assert checked == missed, "the run that committed nothing needs no reconcile"
    assert net.result()["runs"][missed]["found"]["findings"] == []
    marks = _reconciled_at(pipeline)
    assert marks[missed] is not None
    assert marks[nothing] is None

    again = reconcile(**pipeline.params(unreconciled=True, settled_s=0), return_state=True)
    assert again.is_completed(), again.message
    assert again.result() == {"runs": {}}, "a reconciled run is not reconciled again"


def test_a_run_reconciled_by_its_trigger_is_left_to_it_by_the_safety_net(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 30)
    upstream = run_id_of(score(**pipeline.params(), return_state=True))
    done = reconcile(**pipeline.params(upstream_flow_run_id=upstream), return_state=True)
    assert done.is_completed(), done.message
    assert _reconciled_at(pipeline)[upstream] is not None
    net = reconcile(**pipeline.params(unreconciled=True, settled_s=0), return_state=True)
    assert net.result() == {"runs": {}}


def test_the_safety_net_alerts_on_a_broken_run_and_fails(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 200, batching={"max_batch_size": 25, "claim_size": 50})
    upstream = run_id_of(score(**pipeline.params(), return_state=True))
    sorted(pipeline.output.rglob("*.parquet"))[0].unlink()
    since = time.time()
    net = reconcile(**pipeline.params(unreconciled=True, settled_s=0), return_state=True)
    assert net.is_failed()
    assert f"run {upstream}: critical findings missing_file" in (net.message or "")
    (event,) = wait_for(lambda: events_named(events.RECONCILE_FAILED, since), what="the alert")
    assert event.payload["upstream_flow_run_id"] == upstream
    assert _reconciled_at(pipeline)[upstream] is not None, "checked (and alerted): not again"


def test_the_full_sweep_finds_a_file_lost_outside_every_window_and_fails(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 200, batching={"max_batch_size": 25, "claim_size": 50})
    assert score(**pipeline.params(), return_state=True).is_completed()
    clean = reconcile(**pipeline.params(full=True), return_state=True)
    assert clean.is_completed(), clean.message
    assert clean.result()["found"]["sweep"]["finished"] is True
    sorted(pipeline.output.rglob("*.parquet"))[0].unlink()
    # The hourly window sees nothing (the batches are older than it, as if days had passed).
    windowed = reconcile(**pipeline.params(window_s=1e-6), return_state=True)
    assert windowed.is_completed(), windowed.message
    swept = reconcile(**pipeline.params(full=True), return_state=True)
    assert swept.is_failed()
    assert "critical findings missing_file" in (swept.message or "")


def test_a_scope_that_would_check_nothing_is_refused_not_green(tmp_path: Path) -> None:
    """A negative window (it starts in the future), a run id no run of the ledger has, and
    two scopes at once (one was skipped) each ended Completed with the heartbeat event while
    a file was missing."""
    pipeline = make_pipeline(tmp_path, 60)
    assert score(**pipeline.params(), return_state=True).is_completed()
    sorted(pipeline.output.rglob("*.parquet"))[0].unlink()
    for params, says in (
        ({"window_s": -3600}, "window_s must be > 0 seconds, got -3600"),
        (
            {"upstream_flow_run_id": "00000000-0000-0000-0000-000000000000"},
            "is no scoring run of the ledger",
        ),
        ({"unreconciled": True, "full": True}, "unreconciled and full are different scopes"),
    ):
        state = reconcile(**pipeline.params(**params), return_state=True)
        assert state.is_failed(), params
        assert says in (state.message or ""), state.message


def test_a_lost_dataset_alerts_and_dataset_lost_judges_it(tmp_path: Path) -> None:
    """Every file gone: the reconcile cannot judge the output (it would read every batch as
    lost because of a wrong path as much as a real loss). It fails with the failed event, so
    the alert fires; dataset_lost=True judges it, and repair scores the items again."""
    import shutil

    pipeline = make_pipeline(tmp_path, 60)
    upstream = run_id_of(score(**pipeline.params(), return_state=True))
    shutil.rmtree(pipeline.output)
    since = time.time()
    refused = reconcile(**pipeline.params(upstream_flow_run_id=upstream), return_state=True)
    assert refused.is_failed()
    assert "--dataset-lost" in (refused.message or "")
    (event,) = wait_for(lambda: events_named(events.RECONCILE_FAILED, since), what="the alert")
    assert (event.payload["critical"], event.payload["upstream_flow_run_id"]) == (
        ["unjudged"],
        upstream,
    )
    judged = reconcile(**pipeline.params(dataset_lost=True), return_state=True)
    assert judged.is_failed()
    assert "critical findings missing_file" in (judged.message or "")
    fixed = reconcile(**pipeline.params(dataset_lost=True, repair=True), return_state=True)
    assert fixed.is_completed(), fixed.message
    assert fixed.result()["found"]["repairs"]
