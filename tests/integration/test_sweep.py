"""The full sweep on real SQLite / PostgreSQL, real Parquet files and a real SQL table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import models
from batching.evidence import reconcile as rc
from batching.evidence import reconcile_result, sweep_pages
from batching.evidence import sweep as sw
from batching.evidence.reconcile import Kind, Severity
from batching.ingress import queue as q
from batching.outputs import parquet, parquet_layout
from batching.outputs import sql as sql_sink
from batching.store import schema
from batching.testing import FakeClock
from tests.integration.test_reconcile import commit, make_every_fault, path_of, run
from tests.integration.test_sinks import _after, claim, scored

DAYS_3 = 3 * 24 * 3600.0
HOURS_2 = 2 * 3600.0


def shape(report: rc.Report) -> list[tuple[Any, ...]]:
    """What two reports must agree on, in a stable order."""
    return sorted(
        (str(f.kind), str(f.severity), f.batch_ids, f.files, f.item_keys, f.count)
        for f in report.findings
    )


def swept(queue: q.SqlQueue, root: Path | str, clock: FakeClock, **kw: Any) -> rc.Report:
    sink = (
        sql_sink.SqlSink(queue, str(root), create=False)
        if kw.pop("output_kind", "parquet") == "sql"
        else parquet.ParquetSink(queue, root, create=False)
    )
    report = sw.sweep(queue, sink, now=clock(), **kw)
    json.dumps(report.to_dict())  # JSON-ready, as reconcile's
    return report


def sweep_row(queue: q.SqlQueue) -> Any:
    with queue.engine.connect() as conn:
        # (a reconcile's last result is a row there too: reconcile_result)
        sweeps = schema.sweeps.c.name.not_like(f"{reconcile_result.PREFIX}%")
        (row,) = conn.execute(sa.select(schema.sweeps).where(sweeps)).all()
    return row


def test_a_file_lost_days_after_its_commit_is_found_by_the_sweep_not_the_window(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    """The hourly reconcile looks back two hours: a file lost later never alerted."""
    commit(queue, sink, ["a", "b"], clock)
    lost = commit(queue, sink, ["c"], clock)
    clock.advance(DAYS_3)
    (root / path_of(queue, lost)).unlink()
    assert run(queue, root, clock, since=clock() - HOURS_2).findings == ()
    report = swept(queue, root, clock)
    (missing,) = report.findings
    assert (missing.kind, missing.severity) == (Kind.MISSING_FILE, Severity.CRITICAL)
    assert (missing.batch_ids, missing.item_keys) == ((lost.batch_id,), ("c",))
    assert not report.ok
    assert report.sweep is not None
    assert report.sweep["finished"]
    assert sweep_row(queue).finished_at == clock()


def test_the_sweep_finds_what_a_whole_reconcile_finds_one_row_a_page(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every fault class, each page one ledger row, one file, two item ids: duplicates across
    pages, orphans, leftovers, lost writes without a batch, stale leases."""
    make_every_fault(queue, sink, root, clock, monkeypatch)
    whole = run(queue, root, clock)
    assert {f.kind for f in whole.findings} >= {Kind.DUPLICATE, Kind.ORPHAN_FILE}
    report = swept(queue, root, clock, page_size=1, item_page_size=2)
    assert shape(report) == shape(whole)
    seen: list[int] = []  # batches checked after each page of the ledger phase

    def on_page(p: sw.Progress) -> None:
        if p.phase == "ledger":
            seen.append(p.batches)

    # Pages of at most one item: one batch a page (each batch here holds one or two items).
    by_items = swept(queue, root, clock, page_size=100, item_page_size=1, on_page=on_page)
    assert shape(by_items) == shape(whole)
    assert seen == list(range(1, len(seen) + 1))
    assert len(seen) > 5
    assert report.sweep is not None
    assert report.sweep["pages"] > 10


def test_a_sweep_stopped_part_way_resumes_after_its_cursor(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = []
    for n in range(6):
        batches.append(commit(queue, sink, [f"k{n}"], clock))
        clock.advance(1)  # committed in this order
    for lost in (batches[1], batches[4]):
        (root / path_of(queue, lost)).unlink()
    whole = swept(queue, root, clock, page_size=2)
    assert [f.batch_ids for f in whole.findings] == [(batches[1].batch_id,), (batches[4].batch_id,)]

    first = swept(queue, root, clock, page_size=2, max_pages=2, restart=True)
    assert first.sweep is not None
    assert not first.sweep["finished"]
    assert [f.batch_ids for f in first.findings] == [(batches[1].batch_id,)]
    row = sweep_row(queue)
    assert row.finished_at is None
    cursor = json.loads(row.cursor)
    fourth = batches[3]
    assert cursor == {
        "phase": "ledger",
        "after": [fourth.scored_at, fourth.batch_id],
        "upto": None,
    }
    assert json.loads(row.progress)["batches"] == 4

    read_after: list[Any] = []
    page = sweep_pages._ledger_page

    def spy(conn: Any, queue_name: str, owns: Any, after: Any, n: int) -> list[Any]:
        read_after.append(after)
        return page(conn, queue_name, owns, after, n)

    monkeypatch.setattr(sweep_pages, "_ledger_page", spy)
    rest = swept(queue, root, clock, page_size=2)
    assert read_after[0] == cursor["after"], "resumed after the cursor, not from the start"
    assert None not in read_after
    assert shape(rest) == shape(whole)
    assert rest.sweep is not None
    assert rest.sweep["finished"]
    assert json.loads(sweep_row(queue).progress)["batches"] == 6

    read_after.clear()
    again = swept(queue, root, clock, page_size=2)  # finished: starts over
    assert read_after[0] is None
    assert shape(again) == shape(whole)

    one = swept(queue, root, clock, page_size=2, max_seconds=0, restart=True)
    assert one.sweep is not None
    assert (one.sweep["pages_now"], one.sweep["finished"]) == (1, False), "a page at least"


def test_a_repair_between_two_pages_of_a_sweep_starts_it_over(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    """A sweep stops after its first page, which found a file lost; a plain --repair requeues
    it and the queue scores it again. Resumed, the sweep carried the finding (critical, exit
    1, for a file that is back) and counted the first page's items twice; it starts over."""
    batches = []
    for n in range(6):
        batches.append(commit(queue, sink, [f"k{n}"], clock))
        clock.advance(1)
    (root / path_of(queue, batches[0])).unlink()
    first = swept(queue, root, clock, page_size=2, max_pages=1, restart=True)
    assert [f.kind for f in first.findings] == [Kind.MISSING_FILE]
    assert first.sweep is not None
    assert not first.sweep["finished"]

    run(queue, root, clock, repair=True)  # requeues k0 ...
    commit(queue, sink, ["k0"], clock)  # ... and it is scored again
    rest = swept(queue, root, clock, page_size=2)
    assert rest.findings == ()
    assert rest.sweep is not None
    assert rest.sweep["finished"]
    assert rest.sweep["items"] == 6


def test_a_sweep_stopped_in_the_files_phase_resumes_there(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    batches = [commit(queue, sink, [f"k{n}"], clock) for n in range(4)]
    strays = []
    for n, b in enumerate(batches[:3]):
        stray = root / f"date=2027-01-1{n}/model_version=v1/part-stray{n}.parquet"
        stray.parent.mkdir(parents=True)
        shutil.copy(root / path_of(queue, b), stray)
        strays.append(str(stray))
    whole = swept(queue, root, clock, page_size=2)
    assert sorted(f.files[0] for f in whole.findings) == strays
    assert {(f.kind, f.severity) for f in whole.findings} == {(Kind.ORPHAN_FILE, Severity.CRITICAL)}
    while True:
        part = swept(queue, root, clock, page_size=2, max_pages=1)
        assert part.sweep is not None
        if json.loads(sweep_row(queue).cursor)["phase"] == "files" or part.sweep["finished"]:
            break
    last = part
    while last.sweep is not None and not last.sweep["finished"]:
        last = swept(queue, root, clock, page_size=2, max_pages=1)
    assert shape(last) == shape(whole)
    assert json.loads(sweep_row(queue).progress)["files"] == 7


def test_a_sql_table_row_lost_days_later_is_found_by_the_sweep(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    sink = sql_sink.SqlSink(queue)
    commit(queue, sink, ["a", "b"], clock)
    commit(queue, sink, ["x", "y"], clock)
    clock.advance(DAYS_3)
    with queue.begin() as conn:
        conn.execute(schema.results.delete().where(schema.results.c.item_key == "y"))
    table = "batching_results"
    assert run(queue, table, clock, output_kind="sql", since=clock() - HOURS_2).findings == ()
    whole = run(queue, table, clock, output_kind="sql")
    report = swept(queue, table, clock, output_kind="sql", page_size=1)
    assert [(f.kind, f.item_keys) for f in report.findings] == [(Kind.LOST_WRITE, ("y",))]
    assert shape(report) == shape(whole)


def test_sweep_repair_fixes_page_by_page_and_a_clean_sweep_marks_runs_reconciled(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_every_fault(queue, sink, root, clock, monkeypatch)
    runs = schema.runs
    with queue.begin() as conn:
        for run_id, finished_at in (("run-1", 1.0), ("no-batches", 1.0), ("later", 1e12)):
            conn.execute(
                runs.insert().values(
                    run_id=run_id, flow="score", queue=queue.queue, state="completed",
                    started_at=0.0, finished_at=finished_at,
                )
            )  # fmt: skip
    repaired = swept(queue, root, clock, page_size=2, repair=True)
    assert not repaired.ok
    assert {r.action for r in repaired.repairs} >= {"requeue", "quarantine", "drop_duplicates"}
    with queue.engine.connect() as conn:
        marked = dict(conn.execute(sa.select(runs.c.run_id, runs.c.reconciled_at)).all())
    assert set(marked.values()) == {None}, "a sweep with findings marks no run"
    after = swept(queue, root, clock, page_size=2)
    assert after.clean, after.to_dict()
    assert run(queue, root, clock).clean
    with queue.engine.connect() as conn:
        marked = dict(conn.execute(sa.select(runs.c.run_id, runs.c.reconciled_at)).all())
    assert marked == {"run-1": clock(), "no-batches": None, "later": None}


def test_names_are_per_queue_and_output(queue: q.SqlQueue, root: Path, tmp_path: Path) -> None:
    a = rc.sweep_name("q1", parquet.ParquetSink(queue, root, create=False))
    b = rc.sweep_name("q1", parquet.ParquetSink(queue, tmp_path / "other", create=False))
    c = rc.sweep_name("q2", parquet.ParquetSink(queue, root, create=False))
    assert len({a, b, c}) == 3
    assert len(rc.sweep_name("q" * 400, sql_sink.SqlSink(queue, create=False))) <= 300


def test_done_items_without_a_ledger_row_are_found_across_id_pages(
    queue: q.SqlQueue, sink: parquet.ParquetSink, root: Path, clock: FakeClock
) -> None:
    commit(queue, sink, ["a", "b", "c"], clock)
    queue.enqueue([models.EnqueueRecord(k, models.Payload(b"{}")) for k in ("l1", "l2", "l3")])
    got = queue.claim(3, lease_s=30)
    queue.ack(got.lease_id, [i.id for i in got.items])  # acked, no batch
    report = swept(queue, root, clock, item_page_size=1)
    (lost_write,) = report.findings
    assert (lost_write.kind, lost_write.item_keys) == (Kind.LOST_WRITE, ("l1", "l2", "l3"))


def test_the_walk_lists_what_a_reader_sees_in_order_and_resumes_after_a_file(
    tmp_path: Path,
) -> None:
    layout = parquet_layout.ParquetLayout.for_root(tmp_path / "out")
    names = [
        "date=2026-01-01/model_version=a/part-1.parquet",
        "date=2026-01-01/model_version=a-b/part-2.parquet",  # "-" sorts before "/"
        "date=2026-01-01/model_version=a/z/part-3.parquet",
        "date=2026-01-02/model_version=a/part-4.parquet",
        "date=2026-01-02/model_version=a/notes.txt",
        ".hidden/part-5.parquet",
    ]
    for name in names:
        (layout.root / name).parent.mkdir(parents=True, exist_ok=True)
        (layout.root / name).write_bytes(b"x")
    walked = ["/".join(parts) for parts in layout.walk_visible()]
    assert sorted(walked) == sorted(layout.visible_files())
    assert walked == sorted(walked, key=lambda p: tuple(p.split("/")))
    for n, name in enumerate(walked):
        after = tuple(name.split("/"))
        assert ["/".join(p) for p in layout.walk_visible(after)] == walked[n + 1 :]


def test_commits_landing_while_the_sweep_reads_are_not_faults(
    queue: q.SqlQueue,
    sink: parquet.ParquetSink,
    root: Path,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live scorer commits between a page's ledger read and its file checks, and between
    the files' listing and their ledger lookup: nothing is missing, lost or orphaned."""
    for n in range(3):
        commit(queue, sink, [f"k{n}"], clock)
        clock.advance(1)
    pending = [scored(claim(queue, [f"live{n}"]), clock) for n in range(2)]

    def commit_one() -> None:
        if pending:
            sink.commit(pending.pop())

    monkeypatch.setattr(sweep_pages, "_ledger_page", _after(sweep_pages._ledger_page, commit_one))
    monkeypatch.setattr(
        parquet.ParquetSink, "observe", _after(parquet.ParquetSink.observe, commit_one)
    )
    report = swept(queue, root, clock, page_size=1)
    assert not pending
    assert report.findings == (), report.to_dict()
    monkeypatch.undo()
    assert swept(queue, root, clock).findings == ()
