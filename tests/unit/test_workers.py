"""``score --workers``: sharing out limits, merging the workers' counters, reporting failures."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest

from batching import errors
from batching.loop.pipes import Outbox as _Outbox
from batching.loop.pipes import Watch as _Watch
from batching.loop.pipes import WorkerReport
from batching.loop.stats import RunLimits, RunStats, Samples
from batching.loop.workers import WorkersOutcome, share_limits
from tests.conftest import KeptRecords


@pytest.mark.parametrize(
    ("max_items", "n", "shares"),
    [
        (10, 2, [5, 5]),
        (11, 3, [4, 4, 3]),
        (3, 5, [1, 1, 1]),  # fewer items than workers: only 3 start
        (1, 1, [1]),
    ],
)
def test_max_items_is_shared_out_and_adds_up(max_items: int, n: int, shares: list[int]) -> None:
    limits = RunLimits(until_empty=False, max_items=max_items, max_seconds=5.0)
    got = share_limits(limits, n)
    assert [g.max_items for g in got] == shares
    assert {(g.until_empty, g.max_seconds) for g in got} == {(False, 5.0)}


def test_without_max_items_every_worker_gets_the_same_limits() -> None:
    limits = RunLimits(until_empty=True, max_seconds=9.0)
    assert share_limits(limits, 3) == [limits] * 3


def test_zero_workers_is_a_config_error() -> None:
    with pytest.raises(errors.ConfigError, match="--workers"):
        share_limits(RunLimits(), 0)


def stats(start: float, end: float | None, **fields: object) -> RunStats:
    s = RunStats(started_at=start, finished_at=end)
    for name, value in fields.items():
        setattr(s, name, value)
    return s


def test_merged_counters_add_up_and_the_run_spans_first_start_to_last_finish() -> None:
    a = stats(
        10.0,
        12.0,
        committed=3,
        failed=1,
        claimed=4,
        commits=1,
        batch_sizes=Counter([3]),
        latencies_s=Samples.of([0.1, 0.2, 0.3]),
        real_tokens=5,
        padded_tokens=6,
        bytes_written=100,
        reasons=Counter(size=1),
    )
    b = stats(
        11.0,
        14.0,
        committed=2,
        claimed=2,
        commits=2,
        batch_sizes=Counter([1, 1]),
        reasons=Counter(size=1, wait=1),
    )
    b.stage_s["claim"] = 0.5
    a.stage_s["claim"] = 0.25
    total = RunStats.merged([a, b])
    assert (total.committed, total.failed, total.claimed, total.commits) == (5, 1, 6, 3)
    assert total.batch_sizes == Counter({1: 2, 3: 1})
    lat = total.latencies_s
    assert (len(lat), lat.quantile(0), lat.quantile(100)) == (3, 0.1, 0.3)
    assert total.reasons == Counter(size=2, wait=1)
    assert total.stage_s["claim"] == 0.75
    assert (total.started_at, total.finished_at) == (10.0, 14.0)
    assert total.summary()["items_per_s"] == pytest.approx(5 / 4.0)
    assert (a.committed, b.committed) == (3, 2), "merging changed a part"


def test_merged_run_is_unfinished_while_any_part_is() -> None:
    assert RunStats.merged([stats(1.0, 2.0), stats(1.5, None)]).finished_at is None


def test_failures_are_reported_once_per_message_and_the_worst_exit_code_wins() -> None:
    outcome = WorkersOutcome(
        [
            WorkerReport(0, error="checkpoint sha256 mismatch", exit_code=2),
            WorkerReport(1, run_id="r1", stats=stats(0.0, 1.0, committed=7)),
            WorkerReport(2, error="checkpoint sha256 mismatch", exit_code=2),
            WorkerReport(3, error="the worker process was killed by signal 9", exit_code=1),
        ]
    )
    assert outcome.errors() == [
        "workers 0, 2: checkpoint sha256 mismatch",
        "worker 3: the worker process was killed by signal 9",
    ]
    assert outcome.exit_code == 2
    merged = outcome.stats()
    assert merged is not None
    assert merged.committed == 7


def test_all_finished_is_exit_0_and_no_report_is_no_stats() -> None:
    assert WorkersOutcome([WorkerReport(0, run_id="r")]).exit_code == 0
    assert WorkersOutcome([WorkerReport(0, error="x", exit_code=1)]).stats() is None


@dataclass
class Exited:
    """A worker process, as the watch sees it."""

    exitcode: int | None
    pid: int | None = 4242  # started

    def join(self, timeout: float | None = None) -> None:
        pass


def sent(*messages: tuple[str, int, object], torn: bool = False) -> Connection:
    """A pipe's read end holding ``messages``, as a worker wrote them before it exited
    (its write end closed); ``torn``: then killed mid-way through one more message."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    for message in messages:
        writer.send(message)
    if torn:  # the length of a 1,000-byte message, and only 10 of its bytes
        os.write(writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)
    writer.close()
    return reader


def test_a_worker_that_reported_and_exited_is_not_called_dead() -> None:
    report = WorkerReport(0, run_id="r0")
    watch = _Watch([Exited(0)], [sent(("progress", 0, (3, 0, 3)), ("report", 0, report))], None)
    watch.poll(0.01)
    assert watch.reports == {0: report}
    assert watch.done()


def test_a_worker_killed_mid_message_is_called_dead_not_waited_for() -> None:
    """Its last message is half in the pipe: the read ends at the end of file, not in a wait
    for bytes that never come (a shared queue's pipe, which the parent held open too)."""
    done = threading.Event()
    watch = _Watch([Exited(-9)], [sent(("progress", 0, (5, 0, 8)), torn=True)], None)

    def poll() -> None:
        watch.poll(0.01)
        done.set()

    threading.Thread(target=poll, daemon=True).start()
    assert done.wait(10), "the watch waits for the rest of a dead worker's message"
    assert watch.reports[0].died
    assert watch.reports[0].committed == 5
    assert "killed by signal 9" in (watch.reports[0].error or "")


def test_a_dead_worker_leaves_the_others_reporting() -> None:
    report = WorkerReport(1, run_id="r1")
    progress: list[tuple[int, int, int]] = []
    watch = _Watch(
        [Exited(-9), Exited(0)],
        [sent(torn=True), sent(("progress", 1, (4, 1, 5)), ("report", 1, report))],
        lambda *counts: progress.append(counts),
    )
    while not watch.done():
        watch.poll(0.01)
    assert watch.reports[1] == report
    assert watch.reports[0].died
    assert progress == [(4, 1, 5)]


class Broken(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("the log backend is down")

    def handleError(self, record: logging.LogRecord) -> None:  # as Prefect's can: re-raise
        raise RuntimeError("the log backend is down")


def test_worker_records_reach_the_parents_handlers_and_a_broken_one_costs_only_the_record() -> None:
    record = logging.LogRecord(
        "batching.outputs.parquet", logging.INFO, "f", 1, "batch committed", None, None
    )
    record.worker = 1
    report = WorkerReport(0, run_id="r0")
    inbox = sent(("log", 0, record), ("log", 0, record), ("report", 0, report))
    library, kept, broken = logging.getLogger("batching"), KeptRecords(), Broken()
    library.addHandler(kept)
    library.addHandler(broken)
    try:
        watch = _Watch([Exited(0)], [inbox], None)
        watch.poll(0.01)
    finally:
        library.removeHandler(kept)
        library.removeHandler(broken)
    assert watch.reports == {0: report}, "a failing log handler stopped the watch"
    assert [(r.name, r.getMessage(), r.__dict__["worker"]) for r in kept.records] == [
        ("batching.outputs.parquet", "batch committed", 1)
    ] * 2


def test_a_worker_that_exited_without_a_report_is_called_dead_with_how() -> None:
    watch = _Watch([Exited(-9)], [sent()], None)
    watch.poll(0.01)
    assert watch.reports[0].error is not None
    assert "killed by signal 9" in watch.reports[0].error
    assert watch.done()


def test_a_worker_that_exited_while_its_pipe_stays_open_is_called_dead() -> None:
    """A process it started still holds the write end: no end of file ever comes."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        watch = _Watch([Exited(1)], [reader], None)
        watch.poll(0.01)
        assert "exited 1" in (watch.reports[0].error or "")
    finally:
        writer.close()


def test_the_outbox_sends_in_order_from_any_thread_and_drops_what_the_parent_cannot_take() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = _Outbox(writer)
    outbox.put(("progress", 0, (1, 0, 1)))
    outbox.put(("log", 0, threading.Lock()))  # cannot be pickled: dropped, not fatal
    outbox.put(("report", 0, WorkerReport(0, run_id="r0")))
    outbox.close(timeout_s=10)
    writer.close()
    got = []
    with contextlib.suppress(EOFError):
        while True:
            got.append(reader.recv())
    assert got == [("progress", 0, (1, 0, 1)), ("report", 0, WorkerReport(0, run_id="r0"))]


def test_the_outbox_of_a_worker_whose_parent_is_gone_closes_without_waiting() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    reader.close()
    outbox = _Outbox(writer)
    for i in range(1000):  # more than a pipe holds
        outbox.put(("log", 0, "x" * 1000 + str(i)))
    outbox.close(timeout_s=10)
    assert not outbox._sender.is_alive()


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        ([WorkerReport(0, run_id="a"), WorkerReport(1, run_id="b")], None),
        (
            [
                WorkerReport(0, error="db down", exit_code=1, error_type="QueueError"),
                WorkerReport(1, error="bad sha256", exit_code=2, error_type="CheckpointError"),
            ],
            errors.CheckpointError,
        ),
        (
            [WorkerReport(0, error="db down", exit_code=1, error_type="QueueError")],
            errors.QueueError,
        ),
        (
            [
                WorkerReport(0, error="db down", exit_code=1, error_type="QueueError"),
                WorkerReport(1, error="db down", exit_code=1, error_type="QueueError"),
            ],
            errors.QueueError,
        ),
        # Mixed failures, in either order: not all transient, so not a transient type.
        (
            [
                WorkerReport(0, error="db down", exit_code=1, error_type="QueueError"),
                WorkerReport(1, error="was killed by signal 9", exit_code=1),
            ],
            errors.BatchingError,
        ),
        (
            [
                WorkerReport(0, error="was killed by signal 9", exit_code=1),
                WorkerReport(1, error="db down", exit_code=1, error_type="QueueError"),
            ],
            errors.BatchingError,
        ),
        (
            [
                WorkerReport(0, error="nan", exit_code=1, error_type="ModelError"),
                WorkerReport(1, error="db down", exit_code=1, error_type="QueueError"),
            ],
            errors.BatchingError,
        ),
        # A name in batching.errors that is not an error type.
        ([WorkerReport(0, error="x", exit_code=1, error_type="one_line")], errors.BatchingError),
        # A worker killed, or failing with an error that is not ours: the base type.
        ([WorkerReport(0, error="was killed by signal 9", exit_code=1)], errors.BatchingError),
        (
            [WorkerReport(0, error="x", exit_code=1, error_type="RuntimeError")],
            errors.BatchingError,
        ),
    ],
)
def test_the_workers_error_has_one_type_whatever_the_worker_order(
    reports: list[WorkerReport], expected: type[errors.BatchingError] | None
) -> None:
    error = WorkersOutcome(reports).error()
    if expected is None:
        assert error is None
        return
    assert type(error) is expected
    assert str(error) == "; ".join(WorkersOutcome(reports).errors())


def test_the_parent_run_beats_until_stopped() -> None:
    """The parent of --workers runs no scorer: its ledger row needs beats of its own."""
    from batching.compose.record import _Beating

    two = threading.Semaphore(0)
    beats: list[int] = []

    def beat() -> None:
        beats.append(1)
        two.release()

    beating = _Beating(beat, 0.001)
    assert two.acquire(timeout=10)
    assert two.acquire(timeout=10)
    beating.stop()
    after = len(beats)
    assert not any(t.name == "run-heartbeat" and t.is_alive() for t in threading.enumerate())
    assert len(beats) == after
