"""Sinks on a real SQLite file and a real PostgreSQL database, with real Parquet files read back."""

from __future__ import annotations

import functools
import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from batching import config as cfg
from batching import errors, models, outcomes
from batching.compose import build
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import ledger as batch_ledger
from batching.outputs import parquet, parquet_layout
from batching.outputs import sql as sql_sink
from batching.store import database, schema
from batching.testing import FakeClock
from tests.conftest import REPO

DIM = 3


class Crash(BaseException):
    """Stands for the process dying at a chosen step (not an Exception: nothing catches it)."""


def claim(queue: q.SqlQueue, keys: list[str], lease_s: float = 30) -> models.Claim:
    queue.enqueue([models.EnqueueRecord(k, models.Payload(b"{}"), tenant="t1") for k in keys])
    got = queue.claim(len(keys), lease_s=lease_s)
    if not got.items and got.suspects:  # a lost lease's items: claimed alone, as a scorer does
        got = queue.claim(len(keys), lease_s=lease_s, isolate=True)
    assert len(got) == len(keys)
    return got


def scored(c: models.Claim, clock: FakeClock, model_version: str = "v1") -> sinks.ScoredBatch:
    outputs = {i.id: np.arange(DIM, dtype=np.float32) + i.id / 8 for i in c.items}
    return sinks.ScoredBatch(c.items, outputs, c.lease_id, "run-1", model_version, clock())


def ledger(queue: q.SqlQueue) -> list[Any]:
    with queue.engine.connect() as conn:
        return list(conn.execute(sa.select(schema.batches)))


def items(queue: q.SqlQueue) -> dict[str, Any]:
    with queue.engine.connect() as conn:
        return {r.item_key: r for r in conn.execute(sa.select(schema.items))}


def visible(root: Path) -> set[str]:
    """What a reader's ``root/**/*.parquet`` glob returns (hidden folders included)."""
    return {p.relative_to(root).as_posix() for p in root.glob("**/*.parquet")}


def read_outputs(root: Path) -> dict[str, list[float]]:
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    return dict(zip(table["item_key"].to_pylist(), table["output"].to_pylist(), strict=True))


# ----------------------------------------------------------------------------- Parquet


def test_deferred_marks_ride_on_the_next_commit_and_flush_and_recover_records_the_rest(
    queue: q.SqlQueue, root: Path, clock: FakeClock
) -> None:
    sink = parquet.ParquetSink(queue, root, defer_marks=True)
    first = sink.commit(scored(claim(queue, ["a"]), clock))
    assert first.published
    assert visible(root) == {first.location}  # readers see it at once

    def states() -> dict[str, str]:
        return {r.batch_id: r.state for r in ledger(queue)}

    assert states() == {first.batch_id: "committed"}
    second = sink.commit(scored(claim(queue, ["b"]), clock))
    assert states() == {first.batch_id: "published", second.batch_id: "committed"}
    sink.flush()
    assert set(states().values()) == {"published"}
    third = sink.commit(scored(claim(queue, ["c"]), clock))  # then the process dies
    result = parquet.ParquetSink(queue, root).recover()
    assert result.rolled_forward == (third.batch_id,)
    assert set(states().values()) == {"published"}
    assert set(read_outputs(root)) == {"a", "b", "c"}


def test_commit_publishes_a_readable_file_recorded_in_the_ledger(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    c = claim(queue, ["a", "b", "c"])
    batch = scored(c, clock)
    result = sink.commit(batch)
    expected_path = f"date=2027-01-15/model_version=v1/part-{batch.batch_id}.parquet"
    assert (result.location, result.n_rows, result.published) == (expected_path, 3, True)
    assert visible(root) == {expected_path}
    assert not list(sink.layout.staging.iterdir())
    got = read_outputs(root)
    for item in c.items:
        np.testing.assert_array_equal(got[item.item_key], batch.outputs[item.id])
    (row,) = ledger(queue)
    data = (root / expected_path).read_bytes()
    assert (row.state, row.sink, row.path, row.n_rows) == ("published", "parquet", expected_path, 3)
    assert (row.n_bytes, row.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert row.published_at == clock()
    assert all(
        r.state == models.State.DONE and r.batch_id == batch.batch_id for r in items(queue).values()
    )


def test_dataset_schema_and_partitions(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    sink.commit(scored(claim(queue, ["a"]), clock, model_version="v1.0/beta"))
    table = pq.read_table(root)
    assert table.schema.field("output").type.value_type == "float"
    assert str(table.schema.field("scored_at").type) == "timestamp[us, tz=UTC]"
    row = table.to_pylist()[0]
    assert (row["model_version"], row["date"], row["queue"], row["tenant"]) == (
        "v1.0/beta",
        "2027-01-15",
        "sinks",
        "t1",
    )
    assert row["scored_at"].timestamp() == clock()
    names = [n for n, _ in sink.describe()["fields"]]
    assert {"item_key", "output", "model_version", "date", "batch_id", "run_id"} <= set(names)


def test_a_visible_file_is_always_committed(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink.commit(scored(claim(queue, ["old"]), clock))
    seen: list[str] = []

    def check(step: str) -> None:
        committed = {r.path for r in ledger(queue) if r.state in models.LIVE_BATCH_STATES}
        assert visible(root) <= committed, f"uncommitted file visible after {step}"
        seen.append(step)

    for step in ("stage", "_publish", "publish_staged"):
        monkeypatch.setattr(sink, step, _after(getattr(sink, step), functools.partial(check, step)))
    batch = scored(claim(queue, ["x", "y"]), clock)
    sink.commit(batch)
    assert seen == ["stage", "_publish", "publish_staged"]
    assert len(visible(root)) == 2


def _after(fn: Callable[..., Any], then: Callable[[], None]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        then()
        return out

    return wrapped


def test_commit_with_a_lost_lease_commits_nothing(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    c = claim(queue, ["a", "b"], lease_s=10)
    batch = scored(c, clock)
    clock.advance(11)
    assert queue.release_expired().released == 2
    with pytest.raises(errors.LeaseLost):
        sink.commit(batch)
    assert visible(root) == set()
    assert not list(sink.layout.staging.iterdir())
    assert ledger(queue) == []
    assert {r.state for r in items(queue).values()} == {models.State.READY}


def test_crash_before_commit_leaves_staging_that_recover_removes(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = claim(queue, ["a"], lease_s=10)
    batch = scored(c, clock)
    monkeypatch.setattr(sink, "record", _raise_crash)
    with pytest.raises(Crash):
        sink.commit(batch)
    staged = sink.layout.staging_file(batch.batch_id, batch.lease_id)
    assert staged.is_file()
    assert visible(root) == set()
    fresh = parquet.ParquetSink(queue, root)
    assert fresh.recover().in_flight == (staged.name,), "a held lease may still commit"
    assert staged.is_file()
    clock.advance(11)
    queue.release_expired()
    result = fresh.recover()
    assert result.removed_staging == (staged.name,)
    assert not staged.exists()
    assert ledger(queue) == []
    assert items(queue)["a"].state == models.State.READY


def _raise_crash(*_args: Any, **_kwargs: Any) -> None:
    raise Crash


def test_a_commit_landing_inside_anothers_recover_keeps_its_staged_file(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scorer starting (recover) beside a live one, whose commit lands between the sweep's
    reads of leases and ledger: the file must not be deleted as a crash leftover."""
    if queue.dialect != "postgresql":
        pytest.skip("SQLite's sweep holds the write lock: no commit can land inside it")
    batch = scored(claim(queue, ["a", "b"]), clock)
    staged = sink.stage(batch)
    assert staged.path is not None
    landed: list[bool] = []

    def commit_once() -> None:  # the live scorer's ack + ledger row, after the first read
        if not landed:
            ids = [i.id for i in batch.items]
            with queue.begin() as conn:
                queue.ack_all_or_raise(conn, batch.lease_id, ids, batch.batch_id)
                sink.record(conn, staged)
            landed.append(True)

    monkeypatch.setattr(queue, "held_leases", _after(queue.held_leases, commit_once))
    monkeypatch.setattr(batch_ledger, "states", _after(batch_ledger.states, commit_once))
    result = parquet.ParquetSink(queue, root).recover()
    assert landed
    assert result.removed_staging == ()
    assert staged.path.is_file(), "the live scorer's committed file was deleted"
    assert sink.publish_staged(staged)
    assert set(read_outputs(root)) == {"a", "b"}


def test_a_rewrite_left_by_a_dead_repair_is_swept_once_it_is_old(
    queue: q.SqlQueue, sink: parquet.ParquetSink
) -> None:
    staged = sink.layout.staging_file(str(uuid.uuid4()), parquet_layout.REWRITE)
    staged.write_bytes(b"kept rows of a duplicate repair")
    assert sink.recover().in_flight == (staged.name,)
    old = staged.stat().st_mtime - parquet_layout.REWRITE_GRACE_S - 1
    os.utime(staged, (old, old))
    assert sink.recover().removed_staging == (staged.name,)
    assert not staged.exists()


def test_crash_after_commit_is_rolled_forward_by_recover(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    monkeypatch.setattr(sink, "_publish", _raise_crash)
    with pytest.raises(Crash):
        sink.commit(batch)
    (row,) = ledger(queue)
    assert row.state == "committed"
    assert visible(root) == set()
    assert items(queue)["a"].state == models.State.DONE
    result = parquet.ParquetSink(queue, root).recover()
    assert result.rolled_forward == (batch.batch_id,)
    assert result.removed_staging == ()
    assert visible(root) == {row.path}
    assert set(read_outputs(root)) == {"a", "b"}
    (row,) = ledger(queue)
    assert row.state == "published"
    assert parquet.ParquetSink(queue, root).recover() == outcomes.RecoverResult()


def test_failed_rename_raises_after_the_commit_and_recover_publishes(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*_args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sink, "_move_into_place", broken)
    with pytest.raises(errors.SinkError, match=r"committed but not published.*No space left"):
        sink.commit(scored(claim(queue, ["a"]), clock))
    (row,) = ledger(queue)
    assert row.state == "committed"
    assert items(queue)["a"].state == models.State.DONE
    assert visible(root) == set()
    monkeypatch.undo()
    assert sink.recover().rolled_forward == (row.batch_id,)
    assert visible(root) == {row.path}


def test_scored_batch_checks_one_finite_output_per_item(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    c = claim(queue, ["a", "b"])
    good = {i.id: np.zeros(DIM) for i in c.items}
    with pytest.raises(errors.SinkError, match="exactly one output per item"):
        sinks.ScoredBatch(c.items, {c.items[0].id: np.zeros(DIM)}, c.lease_id, "r", "v", 0.0)
    with pytest.raises(errors.SinkError, match="finite"):
        sinks.ScoredBatch(
            c.items, {**good, c.items[0].id: np.full(DIM, np.nan)}, c.lease_id, "r", "v", 0.0
        )
    with pytest.raises(errors.SinkError, match="equal length"):
        sinks.ScoredBatch(
            c.items, {**good, c.items[0].id: np.zeros(DIM + 1)}, c.lease_id, "r", "v", 0.0
        )
    with pytest.raises(errors.SinkError, match="no items"):
        sinks.ScoredBatch([], {}, c.lease_id, "r", "v", 0.0)
    with pytest.raises(errors.SinkError, match="batch_id"):
        sinks.ScoredBatch(c.items, good, c.lease_id, "r", "v", 0.0, batch_id="../x")
    assert sinks.ScoredBatch(c.items, good, c.lease_id, "r", "v", 0.0).output_dim == DIM


def test_staging_inside_the_dataset_root_is_refused(queue: q.SqlQueue, root: Path) -> None:
    with pytest.raises(errors.ConfigError, match="inside the dataset root"):
        parquet.ParquetSink(queue, root, staging=root / "_staging")


# ----------------------------------------------------------------------------- SQL


def results(queue: q.SqlQueue, table: str = "batching_results") -> dict[str, Any]:
    t = schema.results_table(table)
    with queue.engine.connect() as conn:
        return {r.item_key: r for r in conn.execute(sa.select(t))}


def test_sql_commit_writes_results_acks_and_ledger_together(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    sink = sql_sink.SqlSink(queue)
    c = claim(queue, ["a", "b"])
    batch = scored(c, clock)
    result = sink.commit(batch)
    assert (result.n_rows, result.n_replayed, result.location) == (2, 0, "batching_results")
    got = results(queue)
    for item in c.items:
        row = got[item.item_key]
        out = np.frombuffer(row.output, dtype="<f4")
        assert row.output_dim == DIM
        np.testing.assert_array_equal(out, batch.outputs[item.id])
        assert (row.model_version, row.batch_id) == ("v1", batch.batch_id)
    (led,) = ledger(queue)
    assert (led.sink, led.state, led.path, led.n_rows) == (
        "sql",
        "published",
        "batching_results",
        2,
    )
    assert {r.state for r in items(queue).values()} == {models.State.DONE}


def test_sql_replay_keeps_the_first_output_and_adds_no_row(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    sink = sql_sink.SqlSink(queue)
    first = scored(claim(queue, ["a"]), clock)
    sink.commit(first)
    clock.advance(100)
    queue.purge(50)  # retention removed the done row; the producer sends the key again
    c = claim(queue, ["a", "b"])
    outputs = {i.id: np.full(DIM, 9.0) for i in c.items}
    replay = sinks.ScoredBatch(c.items, outputs, c.lease_id, "run-2", "v1", clock())
    result = sink.commit(replay)
    assert (result.n_rows, result.n_replayed) == (1, 1)
    got = results(queue)
    assert len(got) == 2
    assert got["a"].batch_id == first.batch_id
    assert np.frombuffer(got["b"].output, dtype="<f4").tolist() == [9.0] * DIM
    assert {r.state for r in items(queue).values()} == {models.State.DONE}


def _old_results_table(queue: q.SqlQueue, name: str, *extra: str) -> None:
    """A results table as made before migration 9 (keyed without the queue), with one row."""
    blob = "BYTEA" if queue.dialect == "postgresql" else "BLOB"
    with queue.begin() as conn:
        quoted = conn.dialect.identifier_preparer.quote(name)
        columns = "".join(f" {c}," for c in extra)
        conn.execute(
            sa.text(
                f"CREATE TABLE {quoted} (model_version VARCHAR(100), item_key VARCHAR(500),"
                f" queue VARCHAR(200) NOT NULL, output {blob} NOT NULL, output_dim INTEGER"
                " NOT NULL, scored_at FLOAT NOT NULL, run_id VARCHAR(64) NOT NULL,"
                f" batch_id VARCHAR(36) NOT NULL,{columns} PRIMARY KEY (model_version, item_key))"
            )
        )
        conn.execute(
            sa.text(
                f"INSERT INTO {quoted} (model_version, item_key, queue, output, output_dim,"
                " scored_at, run_id, batch_id) VALUES ('v1', 'x', 'elsewhere', :out, 1, 1.0,"
                " 'r0', 'b0')"
            ),
            {"out": b"\x00\x00\x80\x3f"},
        )


# Mixed case and the longest name a table may have: the rekey quotes it, and PostgreSQL
# changes the key in place (a rebuild beside it named <name>_new would pass 63 characters).
@pytest.mark.parametrize("name", ["old_results", "Scores", "r" * 63])
def test_a_custom_results_table_keyed_the_old_way_is_rekeyed_with_its_rows(
    queue: q.SqlQueue, clock: FakeClock, name: str
) -> None:
    """A table made before migration 9 (keyed without the queue) is rekeyed when a sink opens
    it: its rows stay, and a second queue can then store its output of a shared key."""
    _old_results_table(queue, name)
    sink = sql_sink.SqlSink(queue, name)
    with queue.engine.connect() as conn:
        key = sa.inspect(conn).get_pk_constraint(name)["constrained_columns"]
    assert set(key) == set(schema.RESULTS_KEY)
    assert sink.commit(scored(claim(queue, ["x"]), clock)).n_rows == 1
    t = schema.results_table(name)
    with queue.engine.connect() as conn:
        queues = sorted(r.queue for r in conn.execute(sa.select(t).where(t.c.item_key == "x")))
    assert queues == sorted(["elsewhere", queue.queue])
    assert sql_sink.SqlSink(queue, name).commit(scored(claim(queue, ["y"]), clock)).n_rows == 1


def test_an_old_sqlite_results_table_with_columns_of_its_own_is_refused_not_rebuilt(
    sqlite_url: str, clock: FakeClock
) -> None:
    engine = database.create_engine(sqlite_url)
    queue = q.SqlQueue(engine, "sinks", clock=clock)
    _old_results_table(queue, "mine", "note TEXT")
    with pytest.raises(errors.SchemaError, match=r"columns batching does not declare \(note\)"):
        sql_sink.SqlSink(queue, "mine")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT note, item_key FROM mine")).all() == [(None, "x")]
    engine.dispose()


def test_a_table_that_is_not_a_results_table_is_never_rekeyed(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    """A table of the same name that lacks the results columns (a user's own, the queue's
    archive) is refused as it is: PostgreSQL's in-place rekey once changed its key (the
    archive's purge then failed on every row)."""
    with queue.engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE legacy (queue VARCHAR(200), model_version VARCHAR(100), "
                "item_key VARCHAR(500), note TEXT, PRIMARY KEY (item_key))"
            )
        )
    with pytest.raises(errors.SchemaError, match=r"not a batching results table .*output"):
        sql_sink.SqlSink(queue, "legacy")
    with queue.engine.connect() as conn:
        assert sa.inspect(conn).get_pk_constraint("legacy")["constrained_columns"] == ["item_key"]


@pytest.mark.parametrize("table", ["batching_items_archive", "BATCHING_ITEMS"])
def test_output_naming_a_queue_table_is_refused(table: str) -> None:
    config = cfg.load_config(
        REPO / "deployments" / "tabular.yaml", {"output": {"kind": "sql", "table": "scores"}}
    )
    with pytest.raises(errors.ConfigError, match="one of the queue's own tables"):
        build.output_target(config, table)


def test_sql_commit_with_a_lost_lease_writes_nothing(queue: q.SqlQueue, clock: FakeClock) -> None:
    sink = sql_sink.SqlSink(queue)
    c = claim(queue, ["a"], lease_s=10)
    batch = scored(c, clock)
    clock.advance(11)
    queue.release_expired()
    queue.claim(1, lease_s=10, isolate=True)  # another worker holds it now
    with pytest.raises(errors.LeaseLost):
        sink.commit(batch)
    assert results(queue) == {}
    assert ledger(queue) == []
    assert items(queue)["a"].state == models.State.LEASED


def test_sql_custom_table_is_created_and_checked(queue: q.SqlQueue, clock: FakeClock) -> None:
    name = f"scores_{uuid.uuid4().hex[:6]}"
    sink = sql_sink.SqlSink(queue, name)
    sink.commit(scored(claim(queue, ["a"]), clock))
    assert set(results(queue, name)) == {"a"}
    assert sink.describe()["location"] == name
    assert ("output_dim", "integer") in sink.describe()["fields"]
    with pytest.raises(errors.ConfigError, match="SQL identifier"):
        sql_sink.SqlSink(queue, "bad-name; drop")


def tables(url: str) -> set[str]:
    engine = database.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("where", ["queue's database", "warehouse"])
def test_reconcile_opens_a_sql_output_without_creating_a_table(
    queue: q.SqlQueue, clock: FakeClock, tmp_path: Path, where: str
) -> None:
    from batching.evidence import reconcile as rc
    from batching.outputs import registry

    url = f"sqlite:///{tmp_path / 'warehouse.db'}" if where == "warehouse" else None
    read_url = url or queue.engine.url.render_as_string(hide_password=False)
    name = f"scores_{uuid.uuid4().hex[:6]}"
    registry.open_sink(queue, registry.Target("sql", name, url=url)).commit(
        scored(claim(queue, ["a"]), clock)
    )
    before = tables(read_url)

    def read_only(table: str) -> sinks.Sink:
        return registry.open_sink(queue, registry.Target("sql", table, url=url, read_only=True))

    typo = rc.reconcile(queue, read_only(name + "x"), now=clock())
    assert tables(read_url) == before  # a typo of the table name created nothing
    assert not typo.clean
    assert rc.reconcile(queue, read_only(name), now=clock()).clean

    engine = database.create_engine(read_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {name}"))
    engine.dispose()
    with pytest.raises(errors.ConfigError, match=f"no results table '{name}'"):
        rc.reconcile(queue, read_only(name), now=clock())
    assert name not in tables(read_url)
    lost = rc.reconcile(queue, read_only(name), now=clock(), dataset_lost=True)
    assert not lost.ok
