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

from batching.evidence import lineage
from batching.ingress import ingest
from batching.model import workloads
from batching.outputs import parquet_layout
from flows import events
from flows.reconcile import reconcile
from flows.score import score
from tests import olspec
from tests.conftest import wait_for
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
    assert score(**pipeline.params(), return_state=True).is_completed()
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

    clean = reconcile(**pipeline.params(), return_state=True)
    assert clean.is_completed(), clean.message
    assert clean.result()["found"]["findings"] == []
    check_lineage(pipeline, run_id_of(clean), ["START", "COMPLETE"], registry)


def check_alert(run_id: str, since: float) -> None:
    """The failed run emitted ``batching.reconcile.failed``, related to the run."""
    (event,) = wait_for(lambda: events_named(events.RECONCILE_FAILED, since), what="the alert")
    assert event.resource.id == "batching.output.tabular"
    assert set(event.payload["critical"]) == CRITICAL
    related = {r.id for r in event.related}
    assert f"prefect.flow-run.{run_id}" in related


def check_lineage(pipeline: Pipeline, run_id: str, expected: list[str], registry: Registry) -> None:
    """The reconcile run is its own lineage job, with valid events."""
    found = pipeline.lineage(run_id)
    assert [e["eventType"] for e in found] == expected
    for event in found:
        olspec.assert_valid_event(event, registry)
        assert event["job"]["name"] == "score-tabular-reconcile"
    if expected[-1] == "FAIL":
        message = found[-1]["run"]["facets"]["errorMessage"]["message"]
        assert message.startswith("ReconcileFailed: critical findings")
