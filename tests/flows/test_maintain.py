"""The maintenance flow under the Prefect test harness: a Delta output compacted and
checkpointed by a flow run, a Parquet output left alone."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from batching import errors
from batching.outputs.delta import DeltaSink
from batching.store import retention
from flows.maintain import maintain
from flows.score import score
from tests.flows.support import make_pipeline


def test_the_maintain_flow_compacts_a_delta_output_and_scores_read_the_same(
    tmp_path: Path,
) -> None:
    pipeline = make_pipeline(tmp_path, 300, batching={"max_batch_size": 32, "claim_size": 32})
    pipeline.overrides["output"] = {"kind": "delta", "path": str(tmp_path / "table")}
    pipeline.overrides["output"] |= {"max_rows_per_commit": 32}
    scored = score(**pipeline.params())
    assert scored["items_committed"] == 300
    done = maintain(**pipeline.params())
    assert done["files_removed"] == scored["commits"] > 1
    assert done["files_added"] == 1
    rows = DeltaSink.read(str(tmp_path / "table"), "SELECT count(*) AS n FROM t")
    assert rows["n"].to_pylist() == [300]


def test_the_maintain_flow_leaves_a_parquet_output_alone(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 20)
    score(**pipeline.params())
    files = sorted(pipeline.output.rglob("*.parquet"))
    assert maintain(**pipeline.params()) == {}
    assert sorted(pipeline.output.rglob("*.parquet")) == files


def test_the_maintain_flow_purges_items_then_the_ledger_when_asked(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 50, batching={"max_batch_size": 16, "claim_size": 16})
    scored = score(**pipeline.params())
    assert maintain(**pipeline.params()) == {}  # no retention unless asked
    with sqlite3.connect(pipeline.db_file) as db:  # scored three days ago, as it knows
        db.execute("UPDATE batching_batches SET committed_at = committed_at - 3 * 86400")
        db.execute("UPDATE batching_items SET finished_at = finished_at - 3 * 86400")
    done = maintain(**pipeline.params(purge_older_than_h=24, purge_ledger=True))
    day = retention.day(retention.midnight(time.time() - 86400))
    assert done == {
        "items_purged": 50,
        "ledger_rows_purged": scored["commits"],
        "ledger_horizon": day,
    }
    with sqlite3.connect(pipeline.db_file) as db:
        assert db.execute("SELECT count(*) FROM batching_batches").fetchone() == (0,)
        audit = db.execute("SELECT actor, detail FROM batching_queue_audit").fetchall()
    assert [(actor, json.loads(detail).get("ledger_rows")) for actor, detail in audit] == [
        ("batching-maintain", None),
        ("batching-maintain", scored["commits"]),
    ]
    with pytest.raises(errors.ConfigError, match="purge_ledger needs purge_older_than_h"):
        maintain(**pipeline.params(purge_ledger=True))
    for bad in (float("nan"), 0.0, 1e9):  # 1e9 h: a cutoff no date can hold
        with pytest.raises(errors.ConfigError, match="positive number of hours up to 876000"):
            maintain(**pipeline.params(purge_older_than_h=bad))


def test_the_maintain_flow_purges_when_the_outputs_housekeeping_fails(tmp_path: Path) -> None:
    """The queue's retention does not wait on the output: the run fails after it."""
    pipeline = make_pipeline(tmp_path, 20)
    score(**pipeline.params())
    with sqlite3.connect(pipeline.db_file) as db:
        db.execute("UPDATE batching_items SET finished_at = finished_at - 3 * 86400")
    not_a_table = tmp_path / "a-file"
    not_a_table.write_text("not a Delta table")
    pipeline.overrides["output"] = {"kind": "delta", "path": str(not_a_table)}
    with pytest.raises(errors.SinkError):
        maintain(**pipeline.params(purge_older_than_h=24))
    assert pipeline.by_state()["done"] == 0
