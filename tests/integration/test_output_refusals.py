"""A run whose output will not take its rows says so: a Delta table that is not a batching
output fails the run before it claims; a results table in another database that refuses
writes (a real SQLite trigger) fails the run at its end, with its items acked and their rows
safe in the outbox, and the next run writes them once the output takes writes again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from deltalake import write_deltalake

from batching import config as cfg
from batching import errors, models
from batching.compose import build
from batching.compose import run as wiring
from batching.evidence import reconcile as rc
from batching.ingress import ingest
from batching.loop.stats import RunLimits
from batching.store import database, schema
from tests.conftest import REPO


def make_config(tmp_path: Path, output: dict[str, Any]) -> cfg.PipelineConfig:
    settings = {
        "batching": {"max_batch_size": 32, "claim_size": 64},
        "output": output,
        "lineage": {"path": str(tmp_path / "lineage" / "events.jsonl")},
        "service_profile": None,
    }
    return cfg.load_config(REPO / "deployments" / "tabular.yaml", settings)


def enqueue(url: str, config: cfg.PipelineConfig, n: int) -> None:
    queue = build.open_queue(config, url, create=True)
    queue.migrate()
    records = [
        ingest.record_from_mapping({"item_key": f"a-{i}", "payload": {"x": [0.5] * 64}}, str(i))
        for i in range(n)
    ]
    queue.enqueue(records)
    queue.engine.dispose()


def states(url: str) -> dict[int, int]:
    engine = database.create_engine(url)
    t = schema.items
    with engine.connect() as conn:
        found = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all()
    engine.dispose()
    return {int(k): int(v) for k, v in found}


def test_a_delta_table_that_is_not_a_batching_output_fails_the_run_before_it_claims(
    sqlite_url: str, tmp_path: Path
) -> None:
    import pyarrow as pa

    other = tmp_path / "other_delta"
    write_deltalake(str(other), pa.table({"id": [1, 2], "v": ["a", "b"]}))
    config = make_config(tmp_path, {"kind": "delta", "path": str(other)})
    enqueue(sqlite_url, config, 20)
    with pytest.raises(errors.SinkError, match=r"is not a batching output .*table of its own"):
        wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    assert states(sqlite_url) == {int(models.State.READY): 20}


def test_an_output_that_refuses_writes_fails_the_run_and_the_next_run_writes_its_rows(
    sqlite_url: str, tmp_path: Path
) -> None:
    warehouse = f"sqlite:///{tmp_path / 'warehouse.db'}"
    config = make_config(tmp_path, {"kind": "sql", "table": "results_wh", "url": warehouse})
    enqueue(sqlite_url, config, 100)
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits(max_items=10))
    engine = database.create_engine(warehouse)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TRIGGER refuse BEFORE INSERT ON results_wh "
            "BEGIN SELECT RAISE(ABORT, 'writes refused'); END"
        )
    with pytest.raises(errors.SinkError, match=r"refused \d+ committed batch\(es\) .*outbox"):
        wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    assert states(sqlite_url) == {int(models.State.DONE): 100}  # acked: safe in the outbox

    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER refuse")
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())  # recovers at its start
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT item_key FROM results_wh")).scalars().all()
    engine.dispose()
    assert sorted(keys) == sorted(f"a-{i}" for i in range(100))
    queue = build.open_queue(config, sqlite_url)
    sink = build.open_sink(queue, build.resolve(config, sqlite_url, None))
    report = rc.reconcile(queue, sink, now=queue.clock())
    queue.engine.dispose()
    assert report.clean, json.dumps([f.kind for f in report.findings])


def test_a_second_queue_database_writing_the_same_warehouse_table_is_refused(
    tmp_path: Path,
) -> None:
    """Two deployments (two queue databases), one warehouse table, the same queue name and
    keys: the second one's rows were dropped (the keys were there), its items acked, and
    its reconcile said clean, while readers got the first one's scores for other inputs."""
    warehouse = f"sqlite:///{tmp_path / 'warehouse.db'}"
    config = make_config(tmp_path, {"kind": "sql", "table": "results_wh", "url": warehouse})
    first, second = (f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db"))
    for url in (first, second):
        enqueue(url, config, 20)  # the same keys, each database its own items
    wiring.run_score(config, db_url=first, limits=RunLimits())
    with pytest.raises(errors.SinkError, match=r"another queue database writes queue 'tabular'"):
        wiring.run_score(config, db_url=second, limits=RunLimits())
    engine = database.create_engine(warehouse)
    with engine.connect() as conn:
        runs = conn.execute(sa.text("SELECT DISTINCT run_id FROM results_wh")).scalars().all()
    engine.dispose()
    assert len(runs) == 1  # the first deployment's rows, untouched
