"""The bulk flow: enqueue a Parquet dataset (idempotent on item_key), drain it, bulk profile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batching.model import workloads
from flows.bulk import bulk
from tests.flows.support import BULK, make_pipeline, run_id_of

N_ITEMS = 60


def write_w2_parquet(path: Path, n_items: int) -> Path:
    """W2 token sequences as Parquet: ``item_key`` and a ``list<int64>`` payload column."""
    seqs = workloads.w2_inputs(n_items)
    payload = pa.array([s.astype(np.int64).tolist() for s in seqs], type=pa.list_(pa.int64()))
    keys = pa.array([f"w2-{i}" for i in range(n_items)])
    pq.write_table(pa.table({"item_key": keys, "payload": payload}), path)
    return path


def test_bulk_enqueues_a_parquet_dataset_once_and_drains_it(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 0, config=BULK)
    dataset = write_w2_parquet(tmp_path / "requests.parquet", N_ITEMS)

    first = bulk(**pipeline.params(input_path=str(dataset)), return_state=True)
    assert first.is_completed(), first.message
    summary = first.result()
    assert (summary["enqueued"], summary["duplicates"]) == (N_ITEMS, 0)
    assert summary["items_committed"] == N_ITEMS
    assert pipeline.by_state()["done"] == N_ITEMS
    events = pipeline.lineage(run_id_of(first))
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    assert events[-1]["job"]["name"] == "score-bulk"

    again = bulk(**pipeline.params(input_path=str(dataset)), return_state=True)
    assert again.is_completed(), again.message
    summary = again.result()
    assert (summary["enqueued"], summary["duplicates"], summary["items_committed"]) == (
        0,
        N_ITEMS,
        0,
    )
    assert pq.read_table(pipeline.output).num_rows == N_ITEMS


def test_bulk_in_place_scores_each_input_row_once(tmp_path: Path) -> None:
    """W2 token rows in two Parquet files scored in place: one output row per input row, in
    as many commits as shards; the flow run's lineage names the input and its version; a
    second run queues and scores nothing."""
    pipeline = make_pipeline(tmp_path, 0, config=BULK)
    folder = tmp_path / "dataset"
    folder.mkdir()
    for part in range(2):
        pq.write_table(
            pq.read_table(write_w2_parquet(tmp_path / "w2.parquet", N_ITEMS)),
            folder / f"part-{part}.parquet",
            row_group_size=20,
        )
    params = pipeline.params(input_path=str(folder), in_place=True, rows_per_shard=40)
    first = bulk(**params, return_state=True)
    assert first.is_completed(), first.message
    summary = first.result()
    assert (summary["enqueued"], summary["items_committed"], summary["commits"]) == (4, 120, 4)
    assert summary["padding_efficiency"] > 0.5  # length-sorted within each shard
    table = pq.ParquetDataset(pipeline.output).read()
    pairs = set(
        zip(
            table.column("input_file").to_pylist(),
            table.column("input_row").to_pylist(),
            strict=True,
        )
    )
    assert table.num_rows == len(pairs) == 2 * N_ITEMS
    assert table.column("error").null_count == 2 * N_ITEMS
    events = pipeline.lineage(run_id_of(first))
    names = {i["name"]: i for i in events[-1]["inputs"]}
    assert names[str(folder.resolve())]["facets"]["version"]["datasetVersion"]
    again = bulk(**params, return_state=True)
    assert again.is_completed(), again.message
    assert (again.result()["enqueued"], again.result()["items_committed"]) == (0, 0)
