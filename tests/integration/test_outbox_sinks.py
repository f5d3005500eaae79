"""The sinks that roll forward from the outbox (a Delta table; a results table in another
database) on a real SQLite file and a real PostgreSQL queue, read back with ``deltalake``,
DuckDB's delta reader and SQLAlchemy, with crashes at every step between the queue's commit
and the output's."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa
from deltalake import DeltaTable, write_deltalake

from batching import errors, models
from batching.evidence import reconcile as rc
from batching.evidence.reconcile import Kind, Severity
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import delta, ledger, outbox
from batching.outputs import sql as sql_sink
from batching.store import schema
from batching.testing import FakeClock
from tests.conftest import wait_for
from tests.integration.outputs_read import delta_rows, duckdb_delta_rows, sql_rows
from tests.integration.test_sinks import Crash, claim, items, scored
from tests.integration.test_sinks import ledger as ledger_rows

KINDS = ["delta", "warehouse"]


class Output:
    """A sink of one kind and how to read its output back."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.uri = str(tmp_path / "table")
        self.url = f"sqlite:///{tmp_path / 'warehouse.db'}"

    def open(self, queue: q.SqlQueue) -> outbox.OutboxSink:
        if self.kind == "delta":
            return delta.DeltaSink(queue, self.uri)
        return sql_sink.WarehouseSqlSink(queue, self.url, "results")

    def rows(self) -> list[tuple[str, str]]:
        """``(item_key, batch_id)`` of every row a reader sees."""
        if self.kind == "delta":
            if not DeltaTable.is_deltatable(self.uri):
                return []
            found = [(r["item_key"], r["batch_id"]) for r in delta_rows(self.uri)]
            assert sorted(found) == sorted(duckdb_delta_rows(self.uri)), "readers disagree"
            return found
        return [(r["item_key"], r["batch_id"]) for r in sql_rows(self.url, "results")]

    def outputs(self) -> dict[str, list[float]]:
        if self.kind == "delta":
            return {r["item_key"]: r["output"] for r in delta_rows(self.uri)}
        return {r["item_key"]: r["output"] for r in sql_rows(self.url, "results")}


@pytest.fixture(params=KINDS)
def output(request: pytest.FixtureRequest, tmp_path: Path) -> Output:
    return Output(str(request.param), tmp_path)


@pytest.fixture
def sink(output: Output, queue: q.SqlQueue) -> outbox.OutboxSink:
    return output.open(queue)


def outbox_ids(queue: q.SqlQueue) -> set[str]:
    with queue.engine.connect() as conn:
        return set(conn.execute(sa.select(schema.outbox.c.batch_id)).scalars())


def crash(*_args: Any, **_kwargs: Any) -> None:
    raise Crash


def commit_dying(
    sink: outbox.OutboxSink,
    batch: sinks.ScoredBatch,
    monkeypatch: pytest.MonkeyPatch,
    target: Any,
    name: str,
) -> None:
    """Commit ``batch`` with the process dying at ``target.name``."""
    with monkeypatch.context() as m:
        m.setattr(target, name, crash)
        with pytest.raises(Crash):
            sink.commit(batch)


def reconcile(queue: q.SqlQueue, sink: sinks.Sink, clock: FakeClock, **kw: Any) -> rc.Report:
    return rc.reconcile(queue, sink, now=clock(), **kw)


# ----------------------------------------------------------------------------- commits


def test_a_commit_writes_each_row_once_and_empties_the_outbox(
    queue: q.SqlQueue, sink: outbox.OutboxSink, output: Output, clock: FakeClock
) -> None:
    batch = scored(claim(queue, ["a", "b", "c"]), clock)
    result = sink.commit(batch)
    assert (result.published, result.n_rows) == (True, 3)
    (row,) = ledger_rows(queue)
    assert (row.state, row.sink, row.path, row.n_rows) == ("published", sink.kind, sink.location, 3)
    assert (row.writer, row.seq) == (sink.writer, 1)
    assert outbox_ids(queue) == set()
    assert sorted(output.rows()) == [(k, batch.batch_id) for k in "abc"]
    got = output.outputs()
    for item in batch.items:
        np.testing.assert_allclose(
            np.asarray(got[item.item_key]), np.asarray(batch.outputs[item.id])
        )
    assert {k: i.state for k, i in items(queue).items()} == dict.fromkeys("abc", models.State.DONE)
    assert reconcile(queue, sink, clock).findings == ()


def test_a_lost_lease_writes_nothing(
    queue: q.SqlQueue, sink: outbox.OutboxSink, output: Output, clock: FakeClock
) -> None:
    c = claim(queue, ["a", "b"], lease_s=10)
    clock.advance(11)
    queue.release_expired()
    with pytest.raises(errors.LeaseLost):
        sink.commit(scored(c, clock))
    assert (ledger_rows(queue), outbox_ids(queue), output.rows()) == ([], set(), [])


def test_a_crash_between_the_queue_commit_and_the_output_is_rolled_forward_once(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    commit_dying(sink, batch, monkeypatch, type(sink), "_write")
    (row,) = ledger_rows(queue)
    assert row.state == "committed"
    assert outbox_ids(queue) == {batch.batch_id}
    assert items(queue)["a"].state == models.State.DONE  # the database decided
    assert output.rows() == []
    restarted = output.open(queue)  # another process, after the crash
    assert restarted.recover().rolled_forward == (batch.batch_id,)
    assert sorted(output.rows()) == [("a", batch.batch_id), ("b", batch.batch_id)]
    assert restarted.recover().rolled_forward == ()
    assert [r.state for r in ledger_rows(queue)] == ["published"]
    assert outbox_ids(queue) == set()


def test_a_crash_after_the_output_commit_before_the_mark_writes_nothing_twice(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    commit_dying(sink, batch, monkeypatch, ledger, "mark_published")
    assert [r.state for r in ledger_rows(queue)] == ["committed"]
    assert len(output.rows()) == 2  # written, not marked
    assert output.open(queue).recover().rolled_forward == (batch.batch_id,)
    assert sorted(output.rows()) == [("a", batch.batch_id), ("b", batch.batch_id)]
    assert [r.state for r in ledger_rows(queue)] == ["published"]


def test_two_roll_forwards_at_once_write_once(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scorer starting up and a reconcile repair roll the same batch forward together:
    both find it missing, both write; the output keeps one copy."""
    batch = scored(claim(queue, ["a", "b", "c"]), clock)
    commit_dying(sink, batch, monkeypatch, type(sink), "_write")
    both = threading.Barrier(2, timeout=30)
    write = type(sink)._write

    def together(self: outbox.OutboxSink, pending: outbox.Pending, table: Any) -> int:
        both.wait()  # each has read the ledger row and the outbox: neither has written
        return write(self, pending, table)

    monkeypatch.setattr(type(sink), "_write", together)
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(output.open(queue).recover()))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2
    assert Counter(k for k, _ in output.rows()) == Counter("abc")
    assert [r.state for r in ledger_rows(queue)] == ["published"]


def test_overlapping_commits_of_one_writer_each_reach_the_output(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Commit A takes sequence 1 and its transaction stays open while commit B takes 2,
    commits and is written: A's roll-forward must not take the writer's mark (2) for its
    own. Only PostgreSQL lets two write transactions overlap."""
    if queue.engine.dialect.name == "sqlite":
        pytest.skip("SQLite runs one write transaction at a time")
    a = scored(claim(queue, ["a"]), clock)
    b = scored(claim(queue, ["b"]), clock)
    record = type(sink).record
    a_recorded, b_done = threading.Event(), threading.Event()

    def slow_record(self: outbox.OutboxSink, conn: Any, staged: sinks.Staged) -> Any:
        result = record(self, conn, staged)
        if staged.batch.batch_id == a.batch_id:
            a_recorded.set()
            assert b_done.wait(30)  # A's transaction is still open
        return result

    monkeypatch.setattr(type(sink), "record", slow_record)
    first = threading.Thread(target=sink.commit, args=(a,))
    first.start()
    assert a_recorded.wait(30)
    sink.commit(b)
    b_done.set()
    first.join(30)
    assert sorted(output.rows()) == [("a", a.batch_id), ("b", b.batch_id)]
    assert [r.state for r in ledger_rows(queue)] == ["published", "published"]
    assert reconcile(queue, sink, clock).findings == ()


def output_down(sink: outbox.OutboxSink, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The output refuses every write while ``down[0]`` (set it False to bring it back)."""
    write = type(sink)._write
    down = [True]

    def flaky(self: outbox.OutboxSink, pending: outbox.Pending, table: Any) -> int:
        if down[0]:
            raise errors.SinkError("output unavailable")
        return write(self, pending, table)

    monkeypatch.setattr(type(sink), "_write", flaky)
    return down


def test_an_output_that_fails_keeps_its_batch_and_later_ones_wait_behind_it(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    down = output_down(sink, monkeypatch)
    first = sink.commit(scored(claim(queue, ["a"]), clock))
    assert first.published is False
    down[0] = False
    second = sink.commit(scored(claim(queue, ["b"]), clock))
    assert second.published is True
    assert sorted(k for k, _ in output.rows()) == ["a", "b"]
    assert {r.batch_id: (r.state, r.seq) for r in ledger_rows(queue)} == {
        first.batch_id: ("published", 1),
        second.batch_id: ("published", 2),
    }


def test_an_output_down_for_long_fails_the_run_and_the_next_start_writes_it_all(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Memory holds at most MAX_QUEUED refused batches: then the commit fails the run, and
    # what is committed waits in the outbox for the next start.
    down = output_down(sink, monkeypatch)
    keys = [f"k{n}" for n in range(outbox.MAX_QUEUED)]
    for key in keys[:-1]:
        assert sink.commit(scored(claim(queue, [key]), clock)).published is False
    with pytest.raises(errors.SinkError, match=r"refused the last 16 batches \(output unavai"):
        sink.commit(scored(claim(queue, [keys[-1]]), clock))
    assert {k: i.state for k, i in items(queue).items()} == dict.fromkeys(keys, models.State.DONE)
    assert len(outbox_ids(queue)) == outbox.MAX_QUEUED
    down[0] = False
    assert len(output.open(queue).recover().rolled_forward) == outbox.MAX_QUEUED
    assert sorted(k for k, _ in output.rows()) == sorted(keys)
    assert outbox_ids(queue) == set()


def test_flush_writes_what_a_failure_left_queued(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with monkeypatch.context() as m:
        m.setattr(type(sink), "_write", lambda *_: (_ for _ in ()).throw(errors.SinkError("down")))
        assert sink.commit(scored(claim(queue, ["a"]), clock)).published is False
    sink.flush()
    assert [k for k, _ in output.rows()] == ["a"]
    assert outbox_ids(queue) == set()


# ----------------------------------------------------------------------------- reconcile


def test_reconcile_finds_a_batch_waiting_in_the_outbox_and_repair_rolls_it_forward(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    commit_dying(sink, batch, monkeypatch, type(sink), "_write")
    report = reconcile(queue, sink, clock)
    assert [(f.kind, f.severity, f.item_keys) for f in report.findings] == [
        (Kind.UNPUBLISHED, Severity.WARNING, ("a", "b"))
    ]
    repaired = reconcile(queue, sink, clock, repair=True)
    assert [r.action for r in repaired.repairs] == ["roll_forward"]
    assert reconcile(queue, sink, clock).findings == ()
    assert sorted(k for k, _ in output.rows()) == ["a", "b"]


def test_a_lost_outbox_row_is_critical_and_repair_requeues_its_items(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    commit_dying(sink, batch, monkeypatch, type(sink), "_write")
    with queue.begin() as conn:
        conn.execute(schema.outbox.delete())
    report = reconcile(queue, sink, clock)
    assert [(f.kind, f.severity) for f in report.findings] == [
        (Kind.MISSING_FILE, Severity.CRITICAL)
    ]
    assert "outbox" in report.findings[0].message
    reconcile(queue, sink, clock, repair=True)
    assert {k: i.state for k, i in items(queue).items()} == dict.fromkeys("ab", models.State.READY)
    again = queue.claim(10, lease_s=30)
    sink.commit(scored(again, clock))
    assert reconcile(queue, sink, clock).findings == ()
    assert Counter(k for k, _ in output.rows()) == Counter("ab")


def lose_row(output: Output, key: str) -> None:
    if output.kind == "delta":
        DeltaTable(output.uri).delete(f"item_key = '{key}'")
        return
    engine = sa.create_engine(output.url)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM results WHERE item_key = :k"), {"k": key})
    engine.dispose()


def test_a_lost_output_row_is_found_and_requeued(
    queue: q.SqlQueue, sink: outbox.OutboxSink, output: Output, clock: FakeClock
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    sink.commit(batch)
    lose_row(output, "b")
    if output.kind == "delta":
        expected = (Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL)  # 1 row of the ledger's 2
    else:
        expected = (Kind.LOST_WRITE, Severity.CRITICAL)
    report = reconcile(queue, sink, clock)
    assert [(f.kind, f.severity) for f in report.findings] == [expected]
    reconcile(queue, sink, clock, repair=True)
    again = queue.claim(10, lease_s=30)
    assert {i.item_key for i in again.items} <= {"a", "b"}
    sink.commit(scored(again, clock))
    assert reconcile(queue, sink, clock).findings == ()
    assert Counter(k for k, _ in output.rows()) == Counter("ab")


def test_a_repaired_batch_that_was_still_committed_leaves_nothing_in_the_outbox(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Written, not marked (the process died), then a row lost. The repair rolls the batch
    # forward again (the warehouse's keyed insert puts the row back) or retires it and
    # requeues its items (Delta: the commit is there, one row short); a retired batch's rows
    # must not wait in the outbox for a roll-forward that will never come.
    batch = scored(claim(queue, ["a", "b"]), clock)
    commit_dying(sink, batch, monkeypatch, ledger, "mark_published")
    lose_row(output, "b")
    reconcile(queue, output.open(queue), clock, repair=True)
    assert outbox_ids(queue) == set()
    again = queue.claim(10, lease_s=30)
    assert {i.item_key for i in again.items} == (
        set() if output.kind == "warehouse" else {"a", "b"}
    )
    if again.items:
        sink.commit(scored(again, clock))
    assert reconcile(queue, sink, clock).findings == ()
    assert Counter(k for k, _ in output.rows()) == Counter("ab")


# ----------------------------------------------------------------------------- Delta only


@pytest.fixture
def table(tmp_path: Path, queue: q.SqlQueue) -> delta.DeltaSink:
    return delta.DeltaSink(queue, str(tmp_path / "table"))


def append(sink: delta.DeltaSink, batch: sinks.ScoredBatch) -> None:
    """Rows written behind the ledger's back (a bug, a hand-made fix): what reconcile is for."""
    rows = delta._delta_rows(sinks.batch_table(batch), batch.model_version)
    write_deltalake(sink.uri, rows, mode="append", partition_by=delta.PARTITIONS)


def test_delta_rows_of_a_batch_the_ledger_does_not_know_are_orphans_set_aside(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock
) -> None:
    table.commit(scored(claim(queue, ["a"]), clock))
    stray = scored(claim(queue, ["x"]), clock)
    append(table, stray)
    report = reconcile(queue, table, clock)
    assert [(f.kind, f.severity, f.batch_ids) for f in report.findings] == [
        (Kind.ORPHAN_FILE, Severity.CRITICAL, (stray.batch_id,))
    ]
    repaired = reconcile(queue, table, clock, repair=True)
    assert [r.action for r in repaired.repairs] == ["quarantine"]
    assert [r["item_key"] for r in delta_rows(table.uri)] == ["a"]
    # Set aside, not destroyed: the quarantine table holds them, past any vacuum.
    assert [(r["item_key"], r["batch_id"]) for r in delta_rows(table.quarantine_uri)] == [
        ("x", stray.batch_id)
    ]
    assert repaired.repairs[0].target.startswith(table.quarantine_uri)


def test_a_delta_batch_written_twice_is_found_and_repaired_to_one_copy(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    table.commit(batch)
    append(table, batch)  # the same batch again: what the transaction id prevents
    report = reconcile(queue, table, clock)
    assert [(f.kind, f.severity) for f in report.findings] == [
        (Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL)
    ]
    assert "4 rows in the table, ledger says 2" in report.findings[0].message
    reconcile(queue, table, clock, repair=True)
    assert Counter(r["item_key"] for r in delta_rows(table.quarantine_uri)) == Counter("aabb")
    again = queue.claim(10, lease_s=30)
    assert {i.item_key for i in again.items} == {"a", "b"}
    table.commit(scored(again, clock))
    assert reconcile(queue, table, clock).findings == ()
    assert Counter(r["item_key"] for r in delta_rows(table.uri)) == Counter("ab")


def test_a_batch_whose_transaction_id_expired_is_found_in_the_log_or_the_rows(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = scored(claim(queue, ["a"]), clock)
    table.commit(batch)
    dt = table.table()
    # The table no longer knows this writer (its id expired): the log names the batch...
    gone = outbox.Pending(batch.batch_id, "v1", "run-1", 0.0, "expired-writer", 1)
    assert table._holds(dt, gone)
    other = outbox.Pending("not-there", "v1", "run-1", 0.0, "expired-writer", 1)
    assert not table._holds(dt, other)
    # ... and when the log was cleaned up too, the rows do.
    monkeypatch.setattr(delta, "_in_history", lambda *_: None)
    assert table._holds(dt, gone)
    assert not table._holds(dt, other)


def test_delta_housekeeping_compacts_checkpoints_and_vacuums(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock
) -> None:
    for n in range(4):
        table.commit(scored(claim(queue, [f"k{n}"]), clock))
    done = table.maintain()
    assert done["files_removed"] == 4
    assert done["files_added"] == 1
    assert (
        Path(table.uri) / "_delta_log" / f"{done['checkpoint_version']:020d}.checkpoint.parquet"
    ).is_file()
    assert sorted(r["item_key"] for r in delta_rows(table.uri)) == [f"k{n}" for n in range(4)]
    assert reconcile(queue, table, clock).findings == ()


def test_a_delta_data_file_lost_is_named_then_maintain_and_repair_score_its_items_again(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock
) -> None:
    """A file the log lists is gone: every read of the table fails. It was 'an unexpected
    Exception ... (a bug)' from reconcile, --repair and maintain alike, with no way back."""
    lost = scored(claim(queue, ["a", "b"]), clock)
    table.commit(lost)
    kept = scored(claim(queue, ["c"]), clock)
    table.commit(kept)
    (gone,) = [f for f in Path(table.uri).rglob("*.parquet") if "_delta_log" not in str(f)][:1]
    gone.unlink()
    with pytest.raises(errors.SinkError) as failed:
        reconcile(queue, table, clock)
    message = str(failed.value)
    assert message.startswith(f"cannot read the Delta table {table.uri}: ")
    assert "`batching maintain -c CONFIG` takes the files that are gone out of the table" in message
    assert "\n" not in message
    assert table.maintain()["missing_files_dropped"] == 1
    report = reconcile(queue, table, clock)
    assert [(f.kind, f.severity) for f in report.findings] == [
        (Kind.MISSING_FILE, Severity.CRITICAL)
    ]
    reconcile(queue, table, clock, repair=True)
    again = queue.claim(10, lease_s=30)
    first = {i.item_key for i in again.items}
    assert first in ({"a", "b"}, {"c"})  # the file of whichever batch was removed
    table.commit(scored(again, clock))
    assert reconcile(queue, table, clock).findings == ()
    assert sorted(r["item_key"] for r in delta_rows(table.uri)) == ["a", "b", "c"]


def test_reconcile_of_another_delta_location_says_so_and_creates_nothing(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock, tmp_path: Path
) -> None:
    table.commit(scored(claim(queue, ["a"]), clock))
    wrong = delta.DeltaSink(queue, str(tmp_path / "typo"))
    report = reconcile(queue, wrong, clock)
    assert [(f.kind, f.severity, f.files) for f in report.findings] == [
        (Kind.OTHER_DATASET, Severity.WARNING, (table.uri,))
    ]
    assert not report.clean
    assert not (tmp_path / "typo").exists()


def test_a_delta_uri_with_credentials_is_refused_without_showing_them(queue: q.SqlQueue) -> None:
    # `--output` bypasses the config's check: the sink refuses it too, before any use.
    for uri in ("s3://AKIA:s3cr3t@bucket/t", "az://box/t?sig=s3cr3t"):
        with pytest.raises(errors.ConfigError, match="carries credentials") as info:
            delta.DeltaSink(queue, uri)
        assert "s3cr3t" not in str(info.value)


def test_a_deleted_delta_table_is_refused_unless_declared_lost(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock
) -> None:
    table.commit(scored(claim(queue, ["a"]), clock))
    shutil.rmtree(table.uri)
    with pytest.raises(errors.ConfigError, match="no Delta table at"):
        reconcile(queue, table, clock)
    lost = reconcile(queue, table, clock, dataset_lost=True)
    assert [(f.kind, f.severity) for f in lost.findings] == [(Kind.MISSING_FILE, Severity.CRITICAL)]
    reconcile(queue, table, clock, repair=True, dataset_lost=True)
    assert items(queue)["a"].state == models.State.READY


def test_delta_predicates_quote_item_keys(
    queue: q.SqlQueue, table: delta.DeltaSink, clock: FakeClock
) -> None:
    batch = scored(claim(queue, ["it's", 'a"b', "c\\d"]), clock)
    table.commit(batch)
    assert table.drop_rows(batch.batch_id, ["it's"]) == batch.batch_id
    assert sorted(r["item_key"] for r in delta_rows(table.uri)) == ['a"b', "c\\d"]
    (row,) = ledger_rows(queue)
    assert row.n_rows == 2


# ----------------------------------------------------------------------------- Delta on S3


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A local S3 (moto's server, offline) with a bucket; delta-rs's storage options for it."""
    pytest.importorskip("moto", reason="moto[server] (a dev dependency) runs a local S3")
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds)
        wait_for(lambda: _answers(client), 30, "moto's S3 server")
        client.create_bucket(Bucket="outputs")
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    finally:
        server.terminate()
        server.wait(10)


def _answers(client: Any) -> bool:
    try:
        client.list_buckets()
    except Exception:  # not up yet: any failure means "try again"
        return False
    return True


def test_a_delta_table_on_s3_commits_recovers_and_reconciles(
    queue: q.SqlQueue,
    s3: dict[str, str],
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Credentials from the environment, where delta-rs reads them (never a config file).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    uri = f"s3://outputs/{uuid.uuid4().hex}"
    sink = delta.DeltaSink(queue, uri, storage_options=s3)
    sink.preflight()
    first = scored(claim(queue, ["a", "b"]), clock)
    sink.commit(first)
    second = scored(claim(queue, ["c"]), clock)
    commit_dying(sink, second, monkeypatch, delta.DeltaSink, "_write")
    restarted = delta.DeltaSink(queue, uri, storage_options=s3)
    assert restarted.recover().rolled_forward == (second.batch_id,)
    rows = delta_rows(uri, s3)
    assert sorted(r["item_key"] for r in rows) == ["a", "b", "c"]
    assert reconcile(queue, restarted, clock).findings == ()
    assert restarted.describe()["namespace"] == "s3://outputs"
