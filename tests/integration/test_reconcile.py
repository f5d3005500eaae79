"""Reconcile on real SQLite / PostgreSQL and real Parquet files, against faults made for real."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from batching import errors, models
from batching.evidence import reconcile as rc
from batching.evidence.reconcile import Kind, Severity
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import parquet, parquet_layout
from batching.outputs import sql as sql_sink
from batching.store import database, schema
from batching.testing import FakeClock
from tests.integration.test_sinks import Crash, _after, claim, items, ledger, results, scored


def commit(
    queue: q.SqlQueue, sink: sinks.Sink, keys: list[str], clock: FakeClock, run_id: str = "run-1"
) -> sinks.ScoredBatch:
    batch = dataclasses.replace(scored(claim(queue, keys), clock), run_id=run_id)
    sink.commit(batch)
    return batch


def run(queue: q.SqlQueue, root: Path | str, clock: FakeClock, **kw: Any) -> rc.Report:
    kind, staging = kw.pop("output_kind", "parquet"), kw.pop("staging", None)
    sink: sinks.Sink = (
        sql_sink.SqlSink(queue, str(root))
        if kind == "sql"
        else parquet.ParquetSink(queue, root, staging=staging)
    )
    report = rc.reconcile(queue, sink, now=clock(), **kw)
    json.dumps(report.to_dict())  # always JSON-ready
    return report


def path_of(queue: q.SqlQueue, batch: sinks.ScoredBatch) -> str:
    return str(next(r.path for r in ledger(queue) if r.batch_id == batch.batch_id))


def set_items(queue: q.SqlQueue, keys: list[str], **values: Any) -> None:
    with queue.begin() as conn:
        conn.execute(
            schema.items.update().where(schema.items.c.item_key.in_(keys)).values(**values)
        )


def crash(*_args: Any, **_kwargs: Any) -> None:
    raise Crash


def commit_dying_at(
    sink: parquet.ParquetSink,
    step: str,
    batch: sinks.ScoredBatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Commit ``batch`` with the process dying at the sink's ``step`` (``record``: staged,
    never committed; ``_publish``: committed, its file still in staging)."""
    with monkeypatch.context() as m:
        m.setattr(sink, step, crash)
        with pytest.raises(Crash):
            sink.commit(batch)


def found(report: rc.Report) -> dict[tuple[Kind, Severity], list[rc.Finding]]:
    out: dict[tuple[Kind, Severity], list[rc.Finding]] = {}
    for f in report.findings:
        out.setdefault((f.kind, f.severity), []).append(f)
    return out


def commit_a_duplicate(
    queue: q.SqlQueue, sink: sinks.Sink, clock: FakeClock
) -> tuple[sinks.ScoredBatch, sinks.ScoredBatch]:
    """d1 in two files: retention purged its done row, then the producer sent it again."""
    first = commit(queue, sink, ["d1", "d2"], clock)
    clock.advance(100)
    queue.purge(50)
    return first, commit(queue, sink, ["d1", "d3"], clock)


def test_a_consistent_dataset_is_clean(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    commit(queue, sink, ["a", "b"], clock)
    commit(queue, sink, ["c"], clock)
    report = run(queue, root, clock)
    assert report.findings == ()
    assert (report.ok, report.clean, report.counts) == (True, True, {})


def test_a_commit_landing_during_the_gather_is_wholly_in_or_out(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scorer commits while reconcile reads: on PostgreSQL's default isolation the items
    showed done without their ledger row, a critical lost write that repair requeued."""
    commit(queue, sink, ["a"], clock)
    batch = scored(claim(queue, ["b", "c"]), clock)
    landed: list[bool] = []

    def commit_once() -> None:
        if not landed:
            sink.commit(batch)
            landed.append(True)

    monkeypatch.setattr(rc, "_ledger_rows", _after(rc._ledger_rows, commit_once))
    report = run(queue, root, clock)
    assert landed
    assert report.findings == (), report.to_dict()
    monkeypatch.undo()
    assert run(queue, root, clock).findings == ()


def test_a_live_scorers_pending_publish_mark_is_clean_not_a_warning(
    queue: q.SqlQueue, root: Path, clock: FakeClock
) -> None:
    """A scorer records "published" with its next commit: an hourly reconcile beside it read
    the wait as an unpublished warning, exit 1, and paged while nothing was wrong."""
    live = parquet.ParquetSink(queue, root, defer_marks=True)
    batch = scored(claim(queue, ["a", "b"]), clock)
    assert live.commit(batch).published
    report = run(queue, root, clock)
    assert report.clean, report.to_dict()
    (pending,) = report.findings
    assert (pending.kind, pending.severity) == (Kind.UNPUBLISHED, Severity.INFO)
    assert pending.batch_ids == (batch.batch_id,)
    live.flush()
    assert run(queue, root, clock).findings == ()


def test_a_scorer_starting_during_a_duplicate_repair_keeps_its_rewrite(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repair writes the kept rows to staging, then commits them: a scorer's start-up
    sweep in between deleted the file (no claim holds its lease), and the kept keys lost
    their output."""
    commit_a_duplicate(queue, sink, clock)
    write = parquet.ParquetSink._write_staging
    swept: list[Any] = []

    def scorer_starts_after(self: parquet.ParquetSink, table: Any, staged: Path) -> Any:
        out = write(self, table, staged)
        swept.append(parquet.ParquetSink(queue, root).recover())
        return out

    monkeypatch.setattr(parquet.ParquetSink, "_write_staging", scorer_starts_after)
    report = run(queue, root, clock, repair=True)
    assert [r.action for r in report.repairs] == ["drop_duplicates"]
    (recovered,) = swept
    assert recovered.removed_staging == ()
    monkeypatch.undo()
    assert run(queue, root, clock).findings == ()
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    assert sorted(table["item_key"].to_pylist()) == ["d1", "d2", "d3"]


def test_a_reader_during_a_duplicate_repair_never_misses_the_rows_it_keeps(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repair set the old file aside before it published the new one: a reader between
    the two saw none of the old file's rows, duplicate or not (a consumer review: 10 keys
    that were never duplicates vanished for that moment)."""
    commit_a_duplicate(queue, sink, clock)  # d1 first with d2, then with d3: d3 is kept
    aside = parquet_layout.ParquetLayout.quarantine_file
    seen: list[list[str]] = []

    def set_aside_then_read(self: parquet_layout.ParquetLayout, path: Path) -> Any:
        out = aside(self, path)
        table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
        seen.append(sorted(table["item_key"].to_pylist()))
        return out

    monkeypatch.setattr(parquet_layout.ParquetLayout, "quarantine_file", set_aside_then_read)
    report = run(queue, root, clock, repair=True)
    assert [r.action for r in report.repairs] == ["drop_duplicates"]
    (during,) = seen
    assert sorted(during) == ["d1", "d2", "d3"]
    monkeypatch.undo()
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    assert sorted(table["item_key"].to_pylist()) == ["d1", "d2", "d3"]


def test_two_repairs_of_one_duplicate_at_once_rewrite_it_once(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second `reconcile --repair` runs while the first is writing its rewrite: before,
    both superseded the batch, one quarantine failed, and two rewrites held the same key."""
    commit_a_duplicate(queue, sink, clock)
    write = parquet.ParquetSink._write_staging
    inner: list[rc.Report] = []
    calls: list[Path] = []

    def another_repair_meanwhile(self: parquet.ParquetSink, table: Any, staged: Path) -> Any:
        out = write(self, table, staged)
        calls.append(staged)
        if len(calls) == 1:  # the outer repair's rewrite is staged: the inner one runs whole
            inner.append(run(queue, root, clock, repair=True))
        return out

    monkeypatch.setattr(parquet.ParquetSink, "_write_staging", another_repair_meanwhile)
    outer = run(queue, root, clock, repair=True)
    assert [r.action for r in inner[0].repairs] == ["drop_duplicates"]
    assert [r.action for r in outer.repairs] == ["drop_duplicates"]
    monkeypatch.undo()
    assert run(queue, root, clock).findings == ()
    assert not list(sink.layout.staging.iterdir()), "the losing rewrite was left in staging"
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    assert sorted(table["item_key"].to_pylist()) == ["d1", "d2", "d3"]


def test_a_winner_rewritten_earlier_in_the_same_repair_keeps_its_keys(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    """``a-middle`` loses k2 to ``z-earliest`` and wins k1 against ``b-latest``. The repair
    rewrites a-middle first; k1's item must then point at the rewrite, not at a-middle, which
    is superseded (a lost write on the next pass, rescored into another duplicate)."""

    def commit_as(batch_id: str, keys: list[str]) -> None:
        clock.advance(1)
        sink.commit(dataclasses.replace(scored(claim(queue, keys), clock), batch_id=batch_id))

    commit_as("z-earliest", ["k2"])
    set_items(queue, ["k2"], state=int(models.State.READY))
    commit_as("a-middle", ["k1", "k2"])
    set_items(queue, ["k1"], state=int(models.State.READY))
    commit_as("b-latest", ["k1"])
    report = run(queue, root, clock, repair=True)
    assert [r.action for r in report.repairs] == ["drop_duplicates", "drop_duplicates"]
    assert run(queue, root, clock).findings == ()
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    assert sorted(table["item_key"].to_pylist()) == ["k1", "k2"]


def make_every_fault(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    """Create each fault class for real; returns what the assertions need."""
    made: dict[str, Any] = {}
    made["first"], made["second"] = commit_a_duplicate(queue, sink, clock)
    made["gone"] = gone = commit(queue, sink, ["m1", "m2"], clock)
    (root / path_of(queue, gone)).unlink()
    made["cut"] = cut = commit(queue, sink, ["t1"], clock)
    cut_file = root / path_of(queue, cut)
    cut_file.write_bytes(cut_file.read_bytes()[:100])
    made["stray"] = stray = root / "date=2027-01-15/model_version=v1/part-stray.parquet"
    shutil.copy(root / path_of(queue, made["first"]), stray)
    lost = claim(queue, ["l1"])
    queue.ack(lost.lease_id, [i.id for i in lost.items])  # acked, no output, no batch
    claim(queue, ["l2"])
    set_items(queue, ["l2"], state=int(models.State.DONE), batch_id=made["first"].batch_id)
    made["unpublished"] = scored(claim(queue, ["u1"]), clock)
    commit_dying_at(sink, "_publish", made["unpublished"], monkeypatch)
    leftover = scored(claim(queue, ["o1"], lease_s=10), clock)
    commit_dying_at(sink, "record", leftover, monkeypatch)
    made["leftover"] = sink.layout.staging_file(leftover.batch_id, leftover.lease_id)
    clock.advance(11)
    assert queue.release_expired().released == 1
    commit(queue, sink, ["o1"], clock)  # re-scored after its lease expired
    claim(queue, ["s1"], lease_s=5)
    clock.advance(6)  # the lease expires; nobody reaps it
    return made


def test_every_fault_is_found_and_repair_leaves_a_clean_dataset(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = make_every_fault(queue, sink, root, clock, monkeypatch)
    report = run(queue, root, clock)
    got = found(report)
    assert set(got) == {
        (Kind.DUPLICATE, Severity.CRITICAL),
        (Kind.MISSING_FILE, Severity.CRITICAL),
        (Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL),
        (Kind.ORPHAN_FILE, Severity.CRITICAL),
        (Kind.ORPHAN_FILE, Severity.WARNING),
        (Kind.LOST_WRITE, Severity.CRITICAL),
        (Kind.UNPUBLISHED, Severity.WARNING),
        (Kind.STALE_LEASE, Severity.WARNING),
    }
    assert not report.ok
    (dup,) = got[(Kind.DUPLICATE, Severity.CRITICAL)]
    assert dup.batch_ids == (made["second"].batch_id, made["first"].batch_id)
    assert dup.item_keys == ("d1",)
    (missing,) = got[(Kind.MISSING_FILE, Severity.CRITICAL)]
    assert (missing.batch_ids, missing.item_keys) == ((made["gone"].batch_id,), ("m1", "m2"))
    (corrupt,) = got[(Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL)]
    assert (corrupt.batch_ids, corrupt.item_keys) == ((made["cut"].batch_id,), ("t1",))
    assert got[(Kind.ORPHAN_FILE, Severity.CRITICAL)][0].files == (str(made["stray"]),)
    assert got[(Kind.ORPHAN_FILE, Severity.WARNING)][0].files == (str(made["leftover"]),)
    lost = {k for f in got[(Kind.LOST_WRITE, Severity.CRITICAL)] for k in f.item_keys}
    assert lost == {"l1", "l2"}
    (unpublished,) = got[(Kind.UNPUBLISHED, Severity.WARNING)]
    assert unpublished.batch_ids == (made["unpublished"].batch_id,)
    assert got[(Kind.STALE_LEASE, Severity.WARNING)][0].item_keys == ("s1",)

    repaired = run(queue, root, clock, repair=True)
    assert repaired.findings == report.findings
    assert {r.action for r in repaired.repairs} == {
        "release_expired",
        "roll_forward",
        "quarantine",
        "requeue",
        "drop_duplicates",
    }
    after = run(queue, root, clock)
    assert after.findings == (), after.to_dict()
    check_repaired_state(queue, root, made)


def check_repaired_state(queue: q.SqlQueue, root: Path, made: dict[str, Any]) -> None:
    quarantine = root.parent / f"{root.name}.quarantine"
    kept = sorted(p.name for p in quarantine.rglob("*") if p.is_file())
    assert kept == sorted(
        [
            made["stray"].name,
            Path(path_of(queue, made["cut"])).name,
            Path(path_of(queue, made["second"])).name,
            made["leftover"].name,
        ]
    ), "quarantined, never deleted"
    table = pq.read_table(root)
    keys = table["item_key"].to_pylist()
    assert sorted(keys) == ["d1", "d2", "d3", "o1", "u1"], "each key exactly once"
    rows = items(queue)
    for key in ("m1", "m2", "t1", "l1", "l2", "s1"):
        assert rows[key].state == models.State.READY, key
        assert rows[key].batch_id is None
    assert rows["l1"].attempts == 0
    assert rows["d1"].batch_id == made["first"].batch_id
    states = {r.batch_id: r.state for r in ledger(queue)}
    assert states[made["gone"].batch_id] == states[made["cut"].batch_id] == "quarantined"
    assert states[made["second"].batch_id] == "superseded"
    assert states[rows["d3"].batch_id] == "published"


def test_requeued_items_are_rescored_and_stay_clean(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_every_fault(queue, sink, root, clock, monkeypatch)
    run(queue, root, clock, repair=True)
    again = queue.claim(100, lease_s=30)
    alone = queue.claim(100, lease_s=30, isolate=True)  # s1's lease was lost: a suspect
    assert {i.item_key for i in again.items} == {"m1", "m2", "t1", "l1", "l2"}
    assert [i.item_key for i in alone.items] == ["s1"]
    sink.commit(scored(again, clock))
    sink.commit(scored(alone, clock))
    assert run(queue, root, clock).findings == ()
    assert len(pq.read_table(root)) == 11


def test_staging_file_of_a_held_lease_is_left_alone(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = claim(queue, ["a"])
    batch = scored(c, clock)
    commit_dying_at(sink, "record", batch, monkeypatch)
    report = run(queue, root, clock, repair=True)
    assert report.findings == ()
    assert sink.layout.staging_file(batch.batch_id, batch.lease_id).is_file()
    sink.commit(batch)  # the scorer was only slow: its commit still goes through
    assert run(queue, root, clock).findings == ()


def test_one_repair_reaps_a_dead_scorers_leases_and_moves_its_staging_file(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the first --repair reaped the leases, which made the staging file a leftover
    that only a second --repair moved (found by a new-user walkthrough, after a SIGKILL)."""
    batch = scored(claim(queue, ["a", "b"], lease_s=5), clock)
    commit_dying_at(sink, "record", batch, monkeypatch)  # staged, then the scorer was killed
    assert list(sink.layout.staging.iterdir())
    clock.advance(10)

    report = run(queue, root, clock, repair=True)

    assert {f.kind for f in report.findings} == {Kind.STALE_LEASE}
    assert {r.action for r in report.repairs} >= {"release_expired"}
    assert not list(sink.layout.staging.iterdir()), report.repairs
    assert run(queue, root, clock).clean


def test_a_file_renamed_while_reconcile_reads_it_is_not_corrupt(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scorer publishes (staging to dataset) just as reconcile opens the staged file:
    before, that read as "unreadable", and repair requeued a good batch (a duplicate later)."""
    batch = scored(claim(queue, ["a", "b"]), clock)
    commit_dying_at(sink, "_publish", batch, monkeypatch)  # committed, its file still in staging
    check = parquet_layout.check_file

    def renamed_first(path: Path, **kw: Any) -> Any:
        if path.parent == sink.layout.staging:
            assert sink.publish(batch.batch_id)
        return check(path, **kw)

    monkeypatch.setattr(parquet, "check_file", renamed_first)
    report = run(queue, root, clock, repair=True)
    # The ledger row was read before the rename: published but not marked, nothing worse.
    assert {(f.kind, f.severity) for f in report.findings} == {(Kind.UNPUBLISHED, Severity.INFO)}
    assert {r.state for r in items(queue).values()} == {models.State.DONE}
    monkeypatch.undo()
    assert run(queue, root, clock).findings == ()
    assert set(pq.read_table(root / path_of(queue, batch))["item_key"].to_pylist()) == {"a", "b"}


def test_a_file_reconcile_may_not_read_is_an_error_not_a_corrupt_file(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, reconcile run as another user reported it corrupt, and --repair requeued it."""
    batch = commit(queue, sink, ["a"], clock)
    locked = root / path_of(queue, batch)
    real_open = Path.open

    def open_(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self == locked:  # the tests run as root, which file modes do not stop
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    with pytest.raises(errors.SinkError, match="Permission denied"):
        run(queue, root, clock, repair=True)
    monkeypatch.undo()
    assert items(queue)["a"].state == models.State.DONE
    assert run(queue, root, clock).findings == ()


def test_dead_expired_and_late_items_are_reported_but_not_critical(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    bad = claim(queue, ["bad"])
    queue.fail(bad.lease_id, {bad.items[0].id: "boom"}, retry=False)
    queue.enqueue(
        [
            models.EnqueueRecord("late", models.Payload(b"{}"), deadline_at=clock() + 5),
            models.EnqueueRecord("exp", models.Payload(b"{}"), deadline_at=clock() + 1),
        ]
    )
    clock.advance(2)
    late = queue.claim(1, lease_s=30)
    clock.advance(10)
    sink.commit(scored(late, clock))
    report = run(queue, root, clock, repair=True)
    got = found(report)
    assert set(got) == {
        (Kind.DEAD, Severity.INFO),
        (Kind.EXPIRED, Severity.INFO),
        (Kind.SLA_MISS, Severity.WARNING),
    }
    assert got[(Kind.DEAD, Severity.INFO)][0].details == {"reasons": {"boom": 1}}
    assert got[(Kind.SLA_MISS, Severity.WARNING)][0].item_keys == ("late", "exp")
    assert (report.ok, report.clean, report.repairs) == (True, False, ())
    assert run(queue, root, clock, since=clock() + 1).findings == ()


def test_run_and_since_limit_the_ledger_window(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    old = commit(queue, sink, ["a"], clock, run_id="run-1")
    (root / path_of(queue, old)).unlink()
    clock.advance(60)
    commit(queue, sink, ["b"], clock, run_id="run-2")
    assert run(queue, root, clock, run_id="run-2").findings == ()
    assert run(queue, root, clock, since=clock() - 1).findings == ()
    (missing,) = run(queue, root, clock, run_id="run-1").findings
    assert (missing.kind, missing.item_keys) == (Kind.MISSING_FILE, ("a",))


def test_a_window_or_a_run_lists_only_the_partitions_it_can_have_written(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    """A scoped check listed (and looked up in the ledger) every file ever written: an hourly
    window grew as slow as the whole dataset (a soak review). It lists the ``date=``
    partitions from the day before its window on; an orphan older than that is the
    unscoped check's, one inside is found."""
    batch = commit(queue, sink, ["a"], clock, run_id="run-1")
    live = root / path_of(queue, batch)
    old = root / "date=2001-01-01" / live.parent.name / "part-lost.parquet"
    old.parent.mkdir(parents=True)
    shutil.copy(live, old)
    since = clock() - 60
    assert run(queue, root, clock, since=since).findings == ()
    assert run(queue, root, clock, run_id="run-1").findings == ()
    (orphan,) = run(queue, root, clock).findings
    assert (orphan.kind, orphan.files) == (Kind.ORPHAN_FILE, (str(old),))
    recent = live.with_name("part-lost.parquet")
    shutil.move(old, recent)
    for scoped in ({"since": since}, {"run_id": "run-1"}):
        (orphan,) = run(queue, root, clock, **scoped).findings
        assert (orphan.kind, orphan.files) == (Kind.ORPHAN_FILE, (str(recent),))


def test_two_queues_sharing_a_sql_results_table_keep_and_reconcile_their_own_outputs(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    """Item keys are unique per queue. Keyed by (model version, item key) alone, the second
    queue's output of a shared key was dropped as a replay while its item was acked, and
    reconcile matched that item to the first queue's row: clean (found by a new-user walkthrough)."""
    other = q.SqlQueue(queue.engine, "other", clock=clock)
    commit(queue, sql_sink.SqlSink(queue), ["x"], clock)
    batch = scored(claim(other, ["x"]), clock)
    assert sql_sink.SqlSink(other).commit(batch).n_rows == 1
    t = schema.results
    with queue.engine.connect() as conn:
        rows = {r.queue: r for r in conn.execute(sa.select(t).where(t.c.item_key == "x"))}
    assert set(rows) == {queue.queue, "other"}
    (item,) = batch.items
    np.testing.assert_array_equal(
        np.frombuffer(rows["other"].output, "<f4"), batch.outputs[item.id]
    )
    assert run(other, "batching_results", clock, output_kind="sql").findings == ()
    with other.begin() as conn:
        conn.execute(t.delete().where(t.c.queue == "other"))
    report = run(other, "batching_results", clock, output_kind="sql")
    assert [(f.kind, f.item_keys) for f in report.findings] == [(Kind.LOST_WRITE, ("x",))]
    assert run(queue, "batching_results", clock, output_kind="sql").findings == ()


def test_sql_lost_writes_are_found_and_requeued(queue: q.SqlQueue, clock: FakeClock) -> None:
    sink = sql_sink.SqlSink(queue)
    commit(queue, sink, ["a"], clock)
    clock.advance(100)
    queue.purge(50)
    commit(queue, sink, ["a", "b"], clock)  # a replay: the first output of "a" is kept
    commit(queue, sink, ["x", "y"], clock)
    with queue.begin() as conn:
        conn.execute(schema.results.delete().where(schema.results.c.item_key == "y"))
    claim(queue, ["z"])
    set_items(queue, ["z"], state=int(models.State.DONE), lease_id=None)
    report = run(queue, "batching_results", clock, output_kind="sql")
    assert [(f.kind, f.item_keys) for f in report.findings] == [
        (Kind.LOST_WRITE, ("z",)),
        (Kind.LOST_WRITE, ("y",)),
    ]
    run(queue, "batching_results", clock, output_kind="sql", repair=True)
    again = queue.claim(10, lease_s=30)
    assert {i.item_key for i in again.items} == {"y", "z"}
    sink.commit(scored(again, clock))
    assert run(queue, "batching_results", clock, output_kind="sql").findings == ()
    assert sorted(results(queue)) == ["a", "b", "x", "y", "z"]


def test_batches_of_another_sink_are_not_judged(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    commit(queue, sql_sink.SqlSink(queue), ["s"], clock)
    commit(queue, sink, ["p"], clock)
    assert run(queue, root, clock).findings == ()
    assert run(queue, "batching_results", clock, output_kind="sql").findings == ()


def test_batches_written_to_another_dataset_are_not_judged_or_rescored(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock, tmp_path: Path
) -> None:
    """One queue, two output roots (a copied config's output.path, or --output): before, the
    other root's batches read as missing files here, and --repair scored their items again."""
    other_root = tmp_path / "other"
    commit(queue, sink, ["a", "b"], clock)
    commit(queue, parquet.ParquetSink(queue, other_root), ["c"], clock)

    report = run(queue, root, clock, repair=True)

    assert report.repairs == ()
    assert [(f.kind, f.severity, f.count) for f in report.findings] == [
        (Kind.OTHER_DATASET, Severity.WARNING, 1)
    ]
    assert str(other_root) in report.findings[0].message
    assert (report.ok, report.clean) == (True, False)  # not green: said, not repaired
    assert {k: r.state for k, r in items(queue).items()} == dict.fromkeys("abc", models.State.DONE)
    assert run(queue, other_root, clock).findings[0].kind is Kind.OTHER_DATASET  # a and b

    lost = commit(queue, sink, ["d"], clock)
    (root / path_of(queue, lost)).unlink()  # written here, gone: still a missing file
    assert Kind.MISSING_FILE in {f.kind for f in run(queue, root, clock).findings}


def test_a_lost_dataset_judges_only_the_batches_written_under_it(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock, tmp_path: Path
) -> None:
    """One run scored with --output other, the rest into the config's root; other is
    deleted. Its refusal counts its own batch, and --dataset-lost --repair requeues that
    batch's items only: before, every batch of the ledger was judged missing there, the
    done items of the intact root were requeued and scored again (doubled for readers)."""
    other_root = tmp_path / "other"
    commit(queue, sink, ["a", "b"], clock)
    commit(queue, sink, ["c"], clock)
    commit(queue, parquet.ParquetSink(queue, other_root), ["x", "y"], clock)
    shutil.rmtree(other_root)

    with pytest.raises(errors.ConfigError) as refused:
        run(queue, other_root, clock, repair=True)
    assert "has 1 committed batch(es) of queue" in str(refused.value)
    assert f"(2 more written under {root})" in str(refused.value)
    report = run(queue, other_root, clock, repair=True, dataset_lost=True)

    missing = [f for f in report.findings if f.kind is Kind.MISSING_FILE]
    assert [sorted(f.item_keys) for f in missing] == [["x", "y"]]
    states = {k: r.state for k, r in items(queue).items()}
    assert states == dict.fromkeys("abc", models.State.DONE) | dict.fromkeys(
        "xy", models.State.READY
    )
    assert run(queue, root, clock).findings == ()  # the intact root: as it was


def test_a_root_holding_none_of_the_ledgers_batches_is_refused_before_any_repair(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock, tmp_path: Path
) -> None:
    """Another pipeline's dataset given as --output: every batch of this ledger is whole in
    the root it was written to, and the files here are another ledger's. Judged, they were
    all orphans, and --repair set the other pipeline's whole dataset aside."""
    commit(queue, sink, ["a", "b"], clock)
    theirs_engine = database.create_engine(f"sqlite:///{tmp_path / 'theirs.db'}")
    theirs = q.SqlQueue(theirs_engine, "theirs", clock=clock)
    theirs.migrate()
    foreign = tmp_path / "foreign"
    commit(theirs, parquet.ParquetSink(theirs, foreign), ["x"], clock)
    files = sorted(foreign.rglob("*.parquet"))

    with pytest.raises(errors.ConfigError, match=r"none of the ledger's batches .* is under"):
        run(queue, foreign, clock, repair=True)
    assert sorted(foreign.rglob("*.parquet")) == files  # nothing set aside
    assert run(queue, root, clock).findings == ()
    theirs_engine.dispose()


def test_outputs_survive_repair_bit_for_bit(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
) -> None:
    first, _ = commit_a_duplicate(queue, sink, clock)
    run(queue, root, clock, repair=True)
    table = pq.read_table(root).to_pydict()
    out = dict(zip(table["item_key"], table["output"], strict=True))
    d1 = next(i for i in first.items if i.item_key == "d1")
    np.testing.assert_array_equal(out["d1"], first.outputs[d1.id])
    assert sorted(out) == ["d1", "d2", "d3"]
    with queue.engine.connect() as conn:
        n = conn.execute(sa.select(sa.func.count()).select_from(schema.batches)).scalar_one()
    assert n == 3  # first, superseded second, and its rewrite
