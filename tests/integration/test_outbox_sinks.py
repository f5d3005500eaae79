"""The sinks that roll forward from the outbox (a results table in another database) on a
real SQLite file and a real PostgreSQL queue, read back with SQLAlchemy, with crashes at every
step between the queue's commit and the output's."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from batching import errors, ledger, models, outbox, schema, sinks, sql_sink
from batching import queue as q
from batching import reconcile as rc
from batching.reconcile import Kind, Severity
from tests.conftest import FakeClock
from tests.integration.outputs_read import sql_rows
from tests.integration.test_sinks import Crash, claim, items, scored
from tests.integration.test_sinks import ledger as ledger_rows

KINDS = ["warehouse"]


class Output:
    """A sink of one kind and how to read its output back."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.url = f"sqlite:///{tmp_path / 'warehouse.db'}"

    def open(self, queue: q.SqlQueue) -> outbox.OutboxSink:
        return sql_sink.WarehouseSqlSink(queue, self.url, "results")

    def rows(self) -> list[tuple[str, str]]:
        """``(item_key, batch_id)`` of every row a reader sees."""
        return [(r["item_key"], r["batch_id"]) for r in sql_rows(self.url, "results")]

    def outputs(self) -> dict[str, list[float]]:
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


def test_an_output_that_fails_keeps_its_batch_and_later_ones_wait_behind_it(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write = type(sink)._write
    down = [True]

    def flaky(self: outbox.OutboxSink, pending: outbox.Pending, table: Any) -> int:
        if down[0]:
            raise errors.SinkError("output unavailable")
        return write(self, pending, table)

    monkeypatch.setattr(type(sink), "_write", flaky)
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


def test_a_lost_output_row_is_found_and_requeued(
    queue: q.SqlQueue, sink: outbox.OutboxSink, output: Output, clock: FakeClock
) -> None:
    batch = scored(claim(queue, ["a", "b"]), clock)
    sink.commit(batch)
    engine = sa.create_engine(output.url)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM results WHERE item_key = 'b'"))
    engine.dispose()
    expected = (Kind.LOST_WRITE, Severity.CRITICAL)
    report = reconcile(queue, sink, clock)
    assert [(f.kind, f.severity) for f in report.findings] == [expected]
    reconcile(queue, sink, clock, repair=True)
    again = queue.claim(10, lease_s=30)
    assert {i.item_key for i in again.items} <= {"a", "b"}
    sink.commit(scored(again, clock))
    assert reconcile(queue, sink, clock).findings == ()
    assert Counter(k for k, _ in output.rows()) == Counter("ab")
