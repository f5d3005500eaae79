"""The maintenance flow under the Prefect test harness: a Delta output compacted and
checkpointed by a flow run, a Parquet output left alone."""

from __future__ import annotations

from pathlib import Path

from batching.outputs.delta import DeltaSink
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
