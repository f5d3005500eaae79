"""The batch ledger's retention (``batching purge --ledger``, migration 19) on real SQLite
and PostgreSQL queues, real Parquet files, a real Delta table and a real results table in
another database: rows nothing needs go, the horizon is recorded with the first of them,
and what was scored before the horizon's day is not called an orphan, while an orphan from
that day on still is."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from deltalake import write_deltalake

from batching import errors, models
from batching.evidence import reconcile as rc
from batching.evidence import sweep as sw
from batching.evidence.reconcile import Kind, Severity
from batching.ingress import controls, version_pins
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import delta, parquet
from batching.outputs import sql as sql_sink
from batching.store import retention, schema
from batching.testing import FakeClock
from tests.integration import test_rollout
from tests.integration.outputs_read import delta_rows, sql_rows
from tests.integration.test_reconcile import commit, path_of
from tests.integration.test_sinks import claim, ledger, scored
from tests.integration.test_version_pins import configured

DAY = 86400.0
ckpt = test_rollout.ckpt  # the rollout tests' empty checkpoint, a fixture


@pytest.fixture
def at_2330(clock: FakeClock) -> FakeClock:
    """The clock at 23:30 UTC of its day (D): a batch then is scored in D."""
    clock.now = retention.midnight(clock.now) + DAY - 1800
    return clock


def across_midnight(queue: q.SqlQueue, sink: sinks.Sink, clock: FakeClock) -> tuple[Any, Any]:
    """``old`` committed at D 23:30, ``new`` at D+1 00:20; then two days on, every item purged
    and the ledger purged up to D+1 00:00 (``old``'s row goes, ``new``'s stays)."""
    old = commit(queue, sink, ["a", "b"], clock)
    clock.advance(50 * 60)
    new = commit(queue, sink, ["c"], clock)
    clock.advance(2 * DAY)
    assert queue.purge(DAY) == 3
    horizon = retention.midnight(clock() - 2 * DAY)
    assert queue.purge_ledger(2 * DAY, actor="ops", reason="retention") == (1, horizon)
    assert retention.day(horizon) > retention.day(old.scored_at)
    assert [r.batch_id for r in ledger(queue)] == [new.batch_id]
    return old, new


def findings(report: rc.Report) -> list[tuple[Kind, Severity, tuple[str, ...]]]:
    return [(f.kind, f.severity, f.batch_ids) for f in report.findings]


def test_only_rows_nothing_needs_go_and_the_horizon_never_moves_back(
    queue: q.SqlQueue, sink: parquet.ParquetSink, clock: FakeClock
) -> None:
    kept_by_item = commit(queue, sink, ["a"], clock)
    unpublished = commit(queue, sink, ["b"], clock)
    gone = commit(queue, sink, ["c"], clock)
    clock.advance(3 * DAY)
    recent = commit(queue, sink, ["d"], clock)
    assert queue.purge(DAY) == 3  # a, b, c
    queue.enqueue([models.EnqueueRecord("a", models.Payload(b"{}"))])
    with queue.begin() as conn:  # a done again by its batch, b's row left unpublished
        conn.execute(
            schema.items.update()
            .where(schema.items.c.item_key == "a")
            .values(state=int(models.State.DONE), batch_id=kept_by_item.batch_id)
        )
        conn.execute(
            schema.batches.update()
            .where(schema.batches.c.batch_id == unpublished.batch_id)
            .values(state=models.BatchState.COMMITTED.value)
        )
    assert controls.state(queue.engine, queue.queue).ledger_horizon is None

    n, horizon = queue.purge_ledger(DAY, actor="ops", reason="retention")

    assert n == 1
    left = {r.batch_id for r in ledger(queue)}
    assert left == {kept_by_item.batch_id, unpublished.batch_id, recent.batch_id}
    assert gone.batch_id not in left
    assert horizon == retention.midnight(clock() - DAY)
    assert controls.state(queue.engine, queue.queue).ledger_horizon == horizon
    (audited,) = [a for a in controls.audit(queue.engine, queue.queue) if a.action == "purge"]
    assert (audited.actor, audited.reason) == ("ops", "retention")
    assert audited.detail == {"ledger_rows": 1, "horizon": retention.day(horizon)}

    with queue.begin() as conn:  # a's item goes after all: its row is not needed now
        conn.execute(
            schema.items.update().where(schema.items.c.item_key == "a").values(finished_at=0.0)
        )
    assert queue.purge(DAY) == 1
    earlier = retention.midnight(clock() - 2 * DAY)
    assert earlier < horizon
    assert queue.purge_ledger(2 * DAY) == (1, horizon)
    assert controls.state(queue.engine, queue.queue).ledger_horizon == horizon  # not back


def test_nothing_deleted_records_no_horizon(
    queue: q.SqlQueue, sink: parquet.ParquetSink, clock: FakeClock
) -> None:
    commit(queue, sink, ["a"], clock)  # its item is kept: its row is needed
    clock.advance(3 * DAY)
    assert queue.purge_ledger(DAY) == (0, None)
    with queue.engine.connect() as conn:
        assert retention.horizon(conn, queue.queue) is None


def test_parquet_files_before_the_horizon_are_not_orphans_and_later_ones_are(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, at_2330: FakeClock
) -> None:
    clock = at_2330
    old, new = across_midnight(queue, sink, clock)
    assert rc.reconcile(queue, parquet.ParquetSink(queue, root), now=clock()).findings == ()
    assert sw.sweep(queue, parquet.ParquetSink(queue, root), now=clock()).findings == ()

    # An orphan in the horizon's day (a copy of new's file under another batch's name)...
    stray = root / path_of(queue, new)
    orphan = stray.with_name(f"part-{uuid.uuid4()}.parquet")
    shutil.copy(stray, orphan)
    # ... and one in old's day: the cost of the horizon, not found.
    older = next(root.glob(f"date={retention.day(old.scored_at)}/*/*.parquet"))
    shutil.copy(older, older.with_name(f"part-{uuid.uuid4()}.parquet"))
    for report in (
        rc.reconcile(queue, parquet.ParquetSink(queue, root), now=clock()),
        sw.sweep(queue, parquet.ParquetSink(queue, root), now=clock(), restart=True),
    ):
        (found,) = report.findings
        assert (found.kind, found.severity, found.files) == (
            Kind.ORPHAN_FILE,
            Severity.CRITICAL,
            (str(orphan),),
        )


def test_delta_rows_before_the_horizon_are_not_orphans_and_later_ones_are(
    queue: q.SqlQueue, tmp_path: Path, at_2330: FakeClock
) -> None:
    clock = at_2330
    table = delta.DeltaSink(queue, str(tmp_path / "table"))
    old, new = across_midnight(queue, table, clock)
    # new's row reads back the days of its commit and the hour before: old's day too
    assert rc.reconcile(queue, table, now=clock()).findings == ()
    assert {r["batch_id"] for r in delta_rows(table.uri)} == {old.batch_id, new.batch_id}

    # written behind the ledger's back, scored in new's day (a day reconcile reads)
    stray = scored(claim(queue, ["x"]), FakeClock(new.scored_at))
    rows = delta._delta_rows(sinks.batch_table(stray), stray.model_version)
    write_deltalake(table.uri, rows, mode="append", partition_by=delta.PARTITIONS)
    report = rc.reconcile(queue, table, now=clock())
    assert (Kind.ORPHAN_FILE, Severity.CRITICAL, (stray.batch_id,)) in findings(report)
    assert old.batch_id not in {b for f in report.findings for b in f.batch_ids}


@pytest.fixture
def purged_warehouse(queue: q.SqlQueue, tmp_path: Path, at_2330: FakeClock) -> tuple[str, Any, Any]:
    """A results table in another database, its ledger purged across midnight: its URL, the
    sink, and the batch whose row was purged."""
    url = f"sqlite:///{tmp_path / 'warehouse.db'}"
    sink = sql_sink.WarehouseSqlSink(queue, url, "results")
    old, _ = across_midnight(queue, sink, at_2330)
    return url, sink, old


def test_a_key_resent_after_its_rows_were_purged_keeps_its_first_score_in_a_warehouse(
    queue: q.SqlQueue, purged_warehouse: tuple[str, Any, Any], clock: FakeClock
) -> None:
    """Its first batch is unknown to the ledger now: not another queue database's."""
    url, warehouse, old = purged_warehouse
    again = commit(queue, warehouse, ["a", "e"], clock)  # a: resent after its purge
    rows = {r["item_key"]: r["batch_id"] for r in sql_rows(url, "results")}
    assert (rows["a"], rows["e"]) == (old.batch_id, again.batch_id)
    assert rc.reconcile(queue, warehouse, now=clock()).findings == ()


def test_a_key_held_by_an_unknown_batch_of_the_horizons_day_is_still_refused(
    queue: q.SqlQueue, purged_warehouse: tuple[str, Any, Any], clock: FakeClock
) -> None:
    url, warehouse, _ = purged_warehouse
    theirs = scored(claim(queue, ["z"]), clock)  # another queue database's "z", scored now
    other = sql_sink.result_rows(sinks.batch_table(theirs), "v1")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        sql_sink.insert_new(conn, schema.results_table("results"), other)
    engine.dispose()
    clock.advance(60)
    queue.release_expired()
    ours = commit(queue, warehouse, ["z"], clock)
    (row,) = [r for r in ledger(queue) if r.batch_id == ours.batch_id]
    assert row.state == models.BatchState.COMMITTED  # refused: it waits in the outbox
    with pytest.raises(errors.SinkError, match="does not know"):
        warehouse._roll_row(row)
    assert {r["batch_id"] for r in sql_rows(url, "results") if r["item_key"] == "z"} == {
        theirs.batch_id
    }


def test_a_version_pinned_before_the_horizon_keeps_its_identity(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    tmp_path: Path,
    ckpt: tuple[str, str],
    at_2330: FakeClock,
) -> None:
    """Its batches' rows are gone: the outputs under its name are not."""
    clock = at_2330
    fp32 = configured(tmp_path, ckpt).model
    version_pins.pin(queue.engine, queue.queue, fp32, run_id="r1", now=clock())
    across_midnight(queue, sink, clock)
    assert queue.purge_ledger(DAY)[0] == 1  # new's row too: no batch of v1 in the ledger
    assert ledger(queue) == []
    bf16 = configured(tmp_path, ckpt, dtype="bfloat16").model
    with pytest.raises(errors.CheckpointError, match="first scored with dtype float32"):
        version_pins.pin(queue.engine, queue.queue, bf16, run_id="r2", now=clock())


@pytest.mark.parametrize("kind", ["parquet", "delta"])
def test_one_queues_purge_leaves_another_queue_sharing_its_output_clean(
    queue: q.SqlQueue, tmp_path: Path, clock: FakeClock, kind: str
) -> None:
    """Queues of one database may share a dataset: the other queue's reconcile (and its
    full sweep) read the purged rows' outputs too (a review)."""
    other = q.SqlQueue(queue.engine, "other", clock=clock)

    def open_sink(owner: q.SqlQueue) -> sinks.Sink:
        if kind == "delta":
            return delta.DeltaSink(owner, str(tmp_path / "table"))
        return parquet.ParquetSink(owner, tmp_path / "out")

    commit(queue, open_sink(queue), ["a"], clock)
    commit(other, open_sink(other), ["b"], clock)
    clock.advance(3 * DAY)
    commit(other, open_sink(other), ["c"], clock)
    assert queue.purge(DAY) == 1
    assert queue.purge_ledger(DAY)[0] == 1
    assert rc.reconcile(other, open_sink(other), now=clock()).findings == ()
    assert sw.sweep(other, open_sink(other), now=clock()).findings == ()


def test_a_duplicate_repair_after_the_first_copys_row_was_purged_leaves_both(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The purge lands between the sweep's snapshot and its repair: pointing the item at the
    purged row read as a lost write and scored it a third time (a review)."""
    first = commit(queue, sink, ["k"], clock)
    clock.advance(3 * DAY)
    assert queue.purge(DAY) == 1  # k's item goes: first's row is not needed any more
    second = commit(queue, sink, ["k"], clock)  # the producer resends k
    found = sw.sweep(queue, parquet.ParquetSink(queue, root), now=clock())
    assert [f.kind for f in found.findings] == [Kind.DUPLICATE]
    repair = rc._HANDLERS[Kind.DUPLICATE]

    def purge_lands_first(self: Any, f: rc.Finding) -> list[rc.Repair]:
        assert queue.purge_ledger(DAY)[0] == 1
        return repair(self, f)

    monkeypatch.setitem(rc._HANDLERS, Kind.DUPLICATE, purge_lands_first)
    swept = sw.sweep(queue, parquet.ParquetSink(queue, root), now=clock(), repair=True)
    assert swept.repairs == ()
    assert {r.batch_id for r in ledger(queue)} == {second.batch_id}
    with queue.engine.connect() as conn:
        assert conn.execute(sa.select(schema.items.c.batch_id)).scalars().all() == [second.batch_id]
    assert rc.reconcile(queue, parquet.ParquetSink(queue, root), now=clock()).findings == ()
    assert first.batch_id != second.batch_id


def test_the_purge_pages_past_rows_it_keeps(
    queue: q.SqlQueue, sink: parquet.ParquetSink, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of two rows: the kept ones (still named by an item) are read once and passed."""
    monkeypatch.setattr(q, "_LEDGER_PAGE", 2)
    batches = []
    for n in range(7):
        batches.append(commit(queue, sink, [f"k{n}"], clock))
        clock.advance(1)
    clock.advance(3 * DAY)
    with queue.begin() as conn:  # k1 and k4 stay: their rows are needed
        conn.execute(
            schema.items.update()
            .where(schema.items.c.item_key.in_(["k1", "k4"]))
            .values(finished_at=clock())
        )
    assert queue.purge(DAY) == 5
    assert queue.purge_ledger(DAY)[0] == 5
    assert {r.batch_id for r in ledger(queue)} == {batches[1].batch_id, batches[4].batch_id}


def test_a_purge_killed_part_way_leaves_no_row_gone_without_its_horizon(
    queue: q.SqlQueue,
) -> None:
    """SIGKILL of ``purge_ledger`` in a process of its own, after its first pages: what is
    gone went with the horizon recorded, and a purge run again finishes the rest."""
    now, total = time.time(), 60_000
    rows = [
        {
            "batch_id": str(uuid.uuid4()),
            "run_id": "r",
            "queue": queue.queue,
            "lease_id": "l",
            "model_version": "v1",
            "sink": "sql",
            "path": "batching_results",
            "n_rows": 1,
            "state": models.BatchState.PUBLISHED.value,
            "committed_at": now - 10 * DAY + n,
        }
        for n in range(total)
    ]
    with queue.begin() as conn:
        conn.execute(schema.batches.insert(), rows)
    url = queue.engine.url.render_as_string(hide_password=False)
    code = (
        "import sys; from batching.ingress import queue as q; from batching.store import "
        "database; q.SqlQueue(database.create_engine(sys.argv[1]), sys.argv[2])"
        ".purge_ledger(86400.0)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, url, queue.queue])
    try:
        left = total
        deadline = time.monotonic() + 60
        while left == total and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
            with queue.engine.connect() as conn:
                left = conn.execute(
                    sa.select(sa.func.count()).select_from(schema.batches)
                ).scalar_one()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the purge ended before it was killed"
    with queue.engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(schema.batches)).scalar_one()
        horizon = retention.horizon(conn, queue.queue)
    assert 0 < left < total
    assert horizon == retention.midnight(time.time() - DAY)

    again = q.SqlQueue(queue.engine, queue.queue)  # the wall clock, as the killed one's
    assert again.purge_ledger(DAY) == (left, horizon)
    assert ledger(queue) == []
