"""Enqueue files are streamed: each item is held to the model's limits, a Parquet file is read
a record batch at a time, and a bad record anywhere leaves nothing enqueued."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batching import config, errors
from batching.ingress import ingest
from batching.ingress import queue as q
from batching.store import database


def jsonl(path: Path, payloads: list[object]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"item_key": f"k{i}", "payload": p}) + "\n" for i, p in enumerate(payloads)
        )
    )
    return path


@pytest.mark.parametrize(
    ("limits", "payload", "message"),
    [
        (
            ingest.ItemLimits(tokens=4),
            {"tokens": [1, 2, 3, 4, 5]},
            "holds 5 token ids, over the limit of 4 (model.max_item_tokens)",
        ),
        (
            ingest.ItemLimits(elements=3),
            {"x": [0.5] * 4},
            "holds 4 numbers, over the limit of 3 (model.max_item_elements)",
        ),
        (
            ingest.ItemLimits(bytes=40),
            {"x": [0.5] * 20},
            "over the limit of 40 (model.max_item_bytes)",
        ),
        (ingest.ItemLimits(bytes=40), {"x": [0.5] * 20000}, "the line is over 65616 bytes"),
    ],
)
def test_an_item_past_a_limit_names_its_line_and_the_limit(
    tmp_path: Path, limits: ingest.ItemLimits, payload: object, message: str
) -> None:
    path = jsonl(tmp_path / "r.jsonl", [{"x": [0.5]}, payload, {"x": [0.5]}])
    with pytest.raises(errors.InputError, match=r"r\.jsonl:2: ") as exc:
        ingest.read_records(path, limits=limits)
    assert message in str(exc.value)


def test_the_default_limits_are_the_model_sections_defaults() -> None:
    spec = config.ModelSpec(name="w1-mlp", version="v", sha256="0" * 64)
    assert ingest.ItemLimits.of(spec) == ingest.ItemLimits()
    assert ingest.ItemLimits().bytes <= config.MAX_ITEM_BYTES


def test_a_parquet_tensor_past_the_limit_names_its_row(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    rows = [np.arange(1, 5, dtype=np.int64)] * 3 + [np.arange(1, 7, dtype=np.int64)]
    pq.write_table(pa.table({"item_key": [f"k{i}" for i in range(4)], "payload": rows}), path)
    with pytest.raises(errors.InputError, match=r"t\.parquet:row 4: item 'k3' holds 6 token ids"):
        ingest.read_records(path, limits=ingest.ItemLimits(tokens=5))


def test_a_bad_last_row_of_a_many_batch_parquet_file_enqueues_nothing(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "PARQUET_BATCH_ROWS", 100)
    monkeypatch.setattr(q, "_ENQUEUE_CHUNK", 50)
    n = 1000
    keys = [f"k{i}" for i in range(n - 1)] + ["k3"]  # the last row repeats row 4's key
    payload = pa.array([[float(i)] * 4 for i in range(n)], pa.list_(pa.float32(), 4))
    path = tmp_path / "many.parquet"
    pq.write_table(pa.table({"item_key": keys, "payload": payload}), path, row_group_size=300)
    engine = database.create_engine(sqlite_url)
    queue = q.SqlQueue(engine, "bounds")
    queue.migrate()
    seen: list[int] = []
    with pytest.raises(
        errors.InputError, match=rf"many\.parquet:row {n}: item_key 'k3' repeats row 4"
    ):
        queue.enqueue(ingest.iter_records(path), seen.append)
    assert seen[-1] == 950  # the chunks before the bad row were written, then rolled back
    assert queue.stats().by_state.get("ready", 0) == 0
    # The same rows without the repeat: every batch's rows, in order, with their payloads.
    pq.write_table(
        pa.table({"item_key": [*keys[:-1], "last"], "payload": payload}), path, row_group_size=300
    )
    records = ingest.read_records(path)
    assert [r.item_key for r in records] == [*keys[:-1], "last"]
    assert np.frombuffer(records[-1].payload.data, np.float32).tolist() == [n - 1.0] * 4
    assert queue.enqueue(ingest.iter_records(path)).inserted == n
    engine.dispose()
