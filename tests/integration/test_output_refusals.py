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
from tests.integration.outputs_read import delta_rows


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


def test_a_second_queue_database_writing_the_same_parquet_dataset_is_refused(
    tmp_path: Path,
) -> None:
    """Two queue databases, one Parquet root (a walk-through's second database kept the
    shipped output.path): each one's reconcile took the other's files for orphans and its
    --repair set them aside. The first scorer records its database as the dataset's owner;
    the second database's scorer and reconcile are refused before they touch anything."""
    root = tmp_path / "scores"
    config = make_config(tmp_path, {"kind": "parquet", "path": str(root)})
    first, second = (f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db"))
    for url in (first, second):
        enqueue(url, config, 20)
    wiring.run_score(config, db_url=first, limits=RunLimits())
    files = sorted(root.rglob("*.parquet"))
    assert files
    assert json.loads((root / "_batching_database.json").read_text())["database_id"]
    with pytest.raises(errors.ConfigError, match=r"holds the outputs of another queue database"):
        wiring.run_score(config, db_url=second, limits=RunLimits())
    assert states(second) == {int(models.State.READY): 20}
    for url, refused in ((second, True), (first, False)):
        queue = build.open_queue(config, url)
        sink = build.open_sink(queue, build.resolve(config, url, None), read_only=True)
        try:
            if refused:
                with pytest.raises(errors.ConfigError, match=r"output\.path of its own"):
                    rc.reconcile(queue, sink, now=queue.clock(), repair=True)
            else:
                assert rc.reconcile(queue, sink, now=queue.clock()).clean
        finally:
            queue.engine.dispose()
    assert sorted(root.rglob("*.parquet")) == files  # nothing set aside
    # An output of its own: the second database scores.
    own = make_config(tmp_path, {"kind": "parquet", "path": str(tmp_path / "scores-b")})
    wiring.run_score(own, db_url=second, limits=RunLimits())
    assert states(second) == {int(models.State.DONE): 20}


def test_parquet_and_delta_outputs_refuse_each_others_folders(
    sqlite_url: str, tmp_path: Path
) -> None:
    """An output.kind changed and output.path kept: each sink wrote its files into the
    other's partition folders (found by a walk-through)."""
    parquet_root, delta_root = tmp_path / "pq", tmp_path / "dl"
    as_parquet = make_config(tmp_path, {"kind": "parquet", "path": str(parquet_root)})
    as_delta = make_config(tmp_path, {"kind": "delta", "path": str(delta_root)})
    enqueue(sqlite_url, as_parquet, 40)
    wiring.run_score(as_parquet, db_url=sqlite_url, limits=RunLimits(max_items=10))
    wiring.run_score(as_delta, db_url=sqlite_url, limits=RunLimits(max_items=10))
    before = {root: sorted(root.rglob("*")) for root in (parquet_root, delta_root)}
    into_parquet = make_config(tmp_path, {"kind": "delta", "path": str(parquet_root)})
    with pytest.raises(errors.ConfigError, match=r"is not a Delta table .* not empty"):
        wiring.run_score(into_parquet, db_url=sqlite_url, limits=RunLimits())
    into_delta = make_config(tmp_path, {"kind": "parquet", "path": str(delta_root)})
    with pytest.raises(errors.ConfigError, match=r"is a Delta table"):
        wiring.run_score(into_delta, db_url=sqlite_url, limits=RunLimits())
    assert before == {root: sorted(root.rglob("*")) for root in (parquet_root, delta_root)}
    assert states(sqlite_url)[int(models.State.READY)] == 20


def test_a_damaged_delta_checkpoint_is_named_with_its_fix(sqlite_url: str, tmp_path: Path) -> None:
    """A truncated checkpoint gave reconcile the reader's words alone ("Corrupt footer"), and
    with it moved out, "a _last_checkpoint hint" (found by a walk-through). The message now
    says what to move; doing so, the table reads again from its JSON commits."""
    table = tmp_path / "dl"
    config = make_config(tmp_path, {"kind": "delta", "path": str(table)})
    enqueue(sqlite_url, config, 20)
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    queue = build.open_queue(config, sqlite_url)
    try:
        sink = build.open_sink(queue, build.resolve(config, sqlite_url, None))
        sink.maintain()
        (checkpoint,) = (table / "_delta_log").glob("*.checkpoint.parquet")
        with checkpoint.open("r+b") as f:
            f.truncate(100)
        with pytest.raises(errors.SinkError, match=r"checkpoint in _delta_log is damaged"):
            rc.reconcile(queue, sink, now=queue.clock())
        aside = tmp_path / "aside"
        aside.mkdir()
        for moved in (checkpoint, table / "_delta_log" / "_last_checkpoint"):
            moved.rename(aside / moved.name)
        assert rc.reconcile(queue, sink, now=queue.clock()).clean
    finally:
        queue.engine.dispose()


def test_the_owner_file_is_written_without_hard_links_and_a_damaged_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vfat and some network mounts have no hard links: the claim fell over there, and no
    run scored (found by a review); it now creates the file exclusively instead. An empty
    owner file (a power loss before its write reached the disk) stopped every claim and
    refused nobody: it is named, with the fix."""
    import errno
    import os

    from batching.outputs import parquet_layout

    def no_links(*_: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    root = tmp_path / "vfat"
    root.mkdir()
    parquet_layout.check_owner(root, "db-a", claim=True)
    assert json.loads((root / parquet_layout.OWNER_FILE).read_text())["database_id"] == "db-a"
    parquet_layout.check_owner(root, "db-a", claim=True)  # its own: again fine
    with pytest.raises(errors.ConfigError, match="names db-a; this database is db-b"):
        parquet_layout.check_owner(root, "db-b", claim=True)
    assert [p.name for p in root.iterdir()] == [parquet_layout.OWNER_FILE]  # no tmp left
    (root / parquet_layout.OWNER_FILE).write_text("")
    with pytest.raises(errors.SinkError, match=r"names no database \(damaged\).*delete it"):
        parquet_layout.check_owner(root, "db-a", claim=True)


def test_a_second_queue_database_writing_the_same_delta_table_is_refused(
    tmp_path: Path,
) -> None:
    """As for Parquet, with a Delta table: both databases' rows went in, and each one's
    reconcile --repair deleted the other's until the table held none (found by a review).
    The table's description names the database it answers to; a table of an older release
    (no description) is described by the next scorer."""
    table = tmp_path / "dl"
    config = make_config(tmp_path, {"kind": "delta", "path": str(table)})
    first, second, third = (f"sqlite:///{tmp_path / n}" for n in ("a.db", "b.db", "c.db"))
    for url in (first, second, third):
        enqueue(url, config, 20)
    wiring.run_score(config, db_url=first, limits=RunLimits())
    from deltalake import DeltaTable

    said = DeltaTable(str(table)).metadata().description
    assert said is not None
    assert said.startswith("batching: the outputs of queue database ")
    with pytest.raises(errors.ConfigError, match=r"holds the outputs of another queue database"):
        wiring.run_score(config, db_url=second, limits=RunLimits())
    assert states(second) == {int(models.State.READY): 20}
    queue = build.open_queue(config, second)
    try:
        sink = build.open_sink(queue, build.resolve(config, second, None), read_only=True)
        with pytest.raises(errors.ConfigError, match=r"output\.path of its own"):
            rc.reconcile(queue, sink, now=queue.clock(), repair=True)
    finally:
        queue.engine.dispose()
    assert len(delta_rows(str(table))) == 20
    # An older release's table (no description): the next scorer describes it as its own.
    DeltaTable(str(table)).alter.set_table_description("")
    wiring.run_score(config, db_url=first, limits=RunLimits())
    assert DeltaTable(str(table)).metadata().description == said
    with pytest.raises(errors.ConfigError, match=r"holds the outputs of another queue database"):
        wiring.run_score(config, db_url=third, limits=RunLimits())
