"""Inputs a retry cannot help are dead at once, through the real scorer; batch-mates commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import sqlalchemy as sa

from batching import config as cfg
from batching import models
from batching.compose import build
from batching.compose import run as wiring
from batching.ingress import ingest
from batching.model import workloads
from batching.store import database, schema
from tests.conftest import REPO

DEPLOYMENTS = REPO / "deployments"


def load(name: str, tmp_path: Path, **overrides: Any) -> cfg.PipelineConfig:
    overrides.setdefault("lineage", {"path": str(tmp_path / "lineage" / "events.jsonl")})
    return cfg.load_config(DEPLOYMENTS / name, overrides)


def enqueue_and_score(
    url: str, config: cfg.PipelineConfig, docs: dict[str, Any], root: Path
) -> tuple[dict[str, Any], set[str]]:
    """Enqueue ``docs`` (key -> payload), score until empty; rows by key, keys committed."""
    queue = build.open_queue(config, url, create=True)
    queue.migrate()
    records = [
        ingest.record_from_mapping({"item_key": k, "payload": p}, k) for k, p in docs.items()
    ]
    assert queue.enqueue(records).inserted == len(records)
    queue.engine.dispose()
    wiring.run_score(config, db_url=url, output=str(root))
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = {r.item_key: r for r in conn.execute(sa.select(schema.items))}
    engine.dispose()
    keys = set(
        ds.dataset(root, format="parquet", partitioning="hive").to_table()["item_key"].to_pylist()
    )
    return rows, keys


def test_json_values_that_are_not_numbers_are_dead_at_once_and_batch_mates_commit(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = load("tabular.yaml", tmp_path, queue={"backoff_base_s": 0})
    x = workloads.w1_inputs(20)
    good = {f"good-{i}": {"x": row.tolist()} for i, row in enumerate(x)}
    bad_values = {"null": None, "bool": True, "string": "1.5", "nested": [1.0], "huge": 1e39}
    bad = {}
    for name, value in bad_values.items():
        row = x[0].tolist()
        row[7] = value
        bad[f"bad-{name}"] = {"x": row}
    rows, committed = enqueue_and_score(sqlite_url, config, {**good, **bad}, tmp_path / "out")
    assert committed == set(good)
    for key in good:
        assert (rows[key].state, rows[key].attempts) == (models.State.DONE, 1)
    for key in bad:
        assert (rows[key].state, rows[key].attempts) == (models.State.DEAD, 1), key
        assert rows[key].last_error.startswith('"x"[7] '), rows[key].last_error
    assert "null, not a number" in rows["bad-null"].last_error
    assert "1e+39 is beyond float32" in rows["bad-huge"].last_error


def test_an_item_too_big_for_the_memory_budget_is_dead_at_once_and_batch_mates_commit(
    sqlite_url: str, tmp_path: Path
) -> None:
    # One batch (no length buckets) of 20 short items and one of 1,000 tokens; 1 MiB of
    # "device" memory: the long item alone is over it, the short ones are run in chunks.
    config = load(
        "online.yaml",
        tmp_path,
        model={"memory_budget_bytes": 2**20},
        batching={"length_buckets": [], "max_batch_cost": 100_000},
        queue={"backoff_base_s": 0},
    )
    short = {f"short-{i}": {"tokens": list(range(1, 41))} for i in range(20)}
    docs = {**short, "long": {"tokens": [7] * 1000}}
    rows, committed = enqueue_and_score(sqlite_url, config, docs, tmp_path / "out")
    assert committed == set(short)
    assert {rows[k].batch_id for k in short} != {None}
    assert (rows["long"].state, rows["long"].attempts) == (models.State.DEAD, 1)
    reason = rows["long"].last_error
    assert reason.startswith("1000 tokens need about "), reason
    assert "MiB of device memory alone (estimated), over the memory budget of 1.0 MiB" in reason
    assert "model.memory_budget_bytes" in reason


def test_an_item_past_max_item_tokens_enqueued_anyway_is_dead_at_scoring(
    sqlite_url: str, tmp_path: Path
) -> None:
    # Enqueued under other limits (or by another tool): the scorer holds it to its own.
    config = load("online.yaml", tmp_path, model={"max_item_tokens": 50})
    docs = {"ok": {"tokens": [5] * 50}, "long": {"tokens": [5] * 51}}
    rows, committed = enqueue_and_score(sqlite_url, config, docs, tmp_path / "out")
    assert committed == {"ok"}
    assert (rows["long"].state, rows["long"].attempts) == (models.State.DEAD, 1)
    assert rows["long"].last_error == "51 tokens, over model.max_item_tokens 50"
