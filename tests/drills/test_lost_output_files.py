"""Drill: some committed Parquet files are lost (deleted by a bad cleanup job, a restored
backup missing a day, a bucket lifecycle rule).

``batching reconcile`` finds it: a critical ``missing_file`` finding per lost file, with its
items, and exit 1. ``batching reconcile --repair`` requeues those items (never deletes
anything), the next ``batching score`` scores them again, and every item is committed exactly
once in the files that remain and the new ones.
"""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from tests.drills.conftest import Drill, assert_nothing_lost, report

N = 1000
BATCHES = {"max_batch_size": 32, "claim_size": 128, "max_wait_s": 0.01}
LOST_FILES = 3


@pytest.mark.drill
def test_lost_output_files_are_found_requeued_and_rescored_once(drill: Drill) -> None:
    drill.queue(N, batching=BATCHES, output={"max_rows_per_commit": 64})
    first = drill.score()
    assert first.rc == 0, first.err
    files = sorted(drill.outputs.rglob("*.parquet"))
    assert len(files) > LOST_FILES
    lost = files[:: len(files) // LOST_FILES][:LOST_FILES]
    lost_items = sum(pq.read_metadata(path).num_rows for path in lost)
    for path in lost:
        path.unlink()

    # The signal: critical findings naming each lost file, exit 1.
    found = drill.reconcile("--json")
    assert found.rc == 1, found.out + found.err
    missing = [f for f in json.loads(found.out)["findings"] if f["class"] == "missing_file"]
    assert {f["severity"] for f in missing} == {"critical"}
    assert {p for f in missing for p in f["files"]} == {
        str(p.relative_to(drill.outputs)) for p in lost
    }
    # ... and what `batching metrics serve` shows (the failed-reconcile alert reads it).
    critical = {"class": "missing_file", "severity": "critical"}
    assert drill.gauge("batching_reconcile_findings", **critical) == sum(
        f["count"] for f in missing
    )

    repaired = drill.reconcile("--repair", "--json")
    assert repaired.rc == 0, repaired.out + repaired.err
    assert drill.states()["READY"] == lost_items

    again = drill.score("--json")
    assert again.rc == 0, again.err
    assert json.loads(again.out)["summary"]["items_committed"] == lost_items
    before_clean = time.time()
    verdict = assert_nothing_lost(drill, N)  # ends on a clean reconcile
    assert drill.gauge("batching_reconcile_last_clean_timestamp_seconds") >= before_clean
    report(
        "lost_output_files",
        items=verdict.items,
        lost=verdict.lost,
        duplicated=verdict.duplicated,
        files_deleted=len(lost),
        items_in_them=lost_items,
        exit_reconcile=found.rc,
        exit_repair=repaired.rc,
        exit_again=again.rc,
        run_s=f"{first.duration_s:.1f}",
    )
