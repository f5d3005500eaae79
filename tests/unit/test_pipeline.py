"""Unit tests for the Scorer: in-memory queue, fake runner, list sink, fake clock; no I/O."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from batching import config, errors, models, outcomes, routing
from batching.loop import scorer as pipeline
from batching.loop import stats as run_stats
from batching.testing import FakeClock

# ----------------------------------------------------------------------------- fakes


@dataclass
class Row:
    item: models.WorkItem
    state: models.State = models.State.READY
    lease_id: str | None = None
    attempts: int = 0
    run_after: float = 0.0
    last_error: str | None = None


class InMemoryQueue:
    """The queue contract the Scorer uses (claim, heartbeat, fail, release) plus ack and a reaper."""

    def __init__(self, clock: FakeClock, *, max_attempts: int = 3) -> None:
        self.clock = clock
        self.max_attempts = max_attempts
        self.rows: dict[int, Row] = {}
        self.fail_calls: list[tuple[str, dict[int, str]]] = []
        self.heartbeats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._leases = 0
        self._reaped: set[str] = set()  # never given again (the SQL queue's reaped items are
        # suspects, leased apart; and a lease is added to for half its time at most)

    def add(
        self, keys: Sequence[str], payload: bytes = b"{}", deadline_at: float | None = None
    ) -> None:
        with self._lock:
            for key in keys:
                item_id = len(self.rows) + 1
                item = models.WorkItem(
                    item_id, key, models.Payload(payload), self.clock(), deadline_at=deadline_at
                )
                self.rows[item_id] = Row(item, run_after=self.clock())

    def claim(
        self,
        n: int,
        *,
        lease_s: float,
        lane: str | None = None,
        max_cost: int | None = None,
        columns: bool = False,  # items as work items either way (ItemBlocks: integration tests)
        isolate: bool = False,  # no suspects here: an isolation claim finds none
        lease_id: str | None = None,
        pin: routing.Pin | None = None,  # no routes here
    ) -> models.Claim:
        if isolate:
            return models.Claim("none", (), self.clock() + lease_s, isolated=True)
        with self._lock:
            self._leases += 1
            if lease_id is None or lease_id in self._reaped:
                lease_id = f"lease-{self._leases}"
            now = self.clock()
            ready = [
                r
                for r in self.rows.values()
                if r.state is models.State.READY and r.run_after <= now
            ]
            items = []
            for row in ready[:n]:
                row.state, row.lease_id = models.State.LEASED, lease_id
                row.attempts += 1
                items.append(row.item._replace(attempts=row.attempts))
            return models.Claim(lease_id, tuple(items), now + lease_s)

    def check_schema(self) -> None:
        """No schema in memory: always current."""

    def heartbeat(self, lease_id: str, lease_s: float) -> int:
        self.heartbeats[lease_id] += 1
        return len(self._held(lease_id, None))

    def ack(self, lease_id: str, ids: Sequence[int]) -> bool:
        """All or nothing, like the SQL ack inside the sink's transaction."""
        with self._lock:
            held = self._held(lease_id, ids)
            if len(held) != len(ids):
                return False
            for row in held:
                row.state, row.lease_id = models.State.DONE, None
            return True

    def fail(
        self,
        lease_id: str,
        failures: Mapping[int, str],
        *,
        retry: bool = True,
        model_version: str | None = None,
    ) -> models.FailResult:
        with self._lock:
            self.fail_calls.append((lease_id, dict(failures)))
            retried = dead = 0
            for row in self._held(lease_id, list(failures)):
                row.lease_id, row.last_error = None, failures[row.item.id]
                if not retry or row.attempts >= self.max_attempts:
                    row.state, dead = models.State.DEAD, dead + 1
                else:
                    row.state, row.run_after = models.State.READY, self.clock() + 30
                    retried += 1
            return models.FailResult(retried, dead)

    def release(self, lease_id: str, ids: Sequence[int] | None = None) -> int:
        with self._lock:
            held = self._held(lease_id, ids)
            for row in held:
                row.state, row.lease_id = models.State.READY, None
                row.attempts -= 1
            return len(held)

    def expire(self, lease_id: str, reasons: Mapping[int, str]) -> int:
        with self._lock:
            held = self._held(lease_id, list(reasons))
            for row in held:
                row.state, row.lease_id = models.State.EXPIRED, None
            return len(held)

    def reap(self, lease_id: str) -> int:
        """The reaper after a lease expired: its items go back to ready (attempt kept)."""
        with self._lock:
            self._reaped.add(lease_id)
            held = self._held(lease_id, None)
            for row in held:
                row.state, row.lease_id = models.State.READY, None
            return len(held)

    def _held(self, lease_id: str, ids: Sequence[int] | None) -> list[Row]:
        rows = self.rows.values() if ids is None else [self.rows[i] for i in ids]
        return [r for r in rows if r.state is models.State.LEASED and r.lease_id == lease_id]

    def keys(self, state: models.State) -> set[str]:
        return {r.item.item_key for r in self.rows.values() if r.state is state}

    def row(self, key: str) -> Row:
        return next(r for r in self.rows.values() if r.item.item_key == key)


@dataclass(frozen=True)
class Scored:
    lease_id: str
    items: Sequence[models.WorkItem]
    outputs: Mapping[int, Any]
    model_version: str | None = None


class ListSink:
    """Keeps committed batches in a list; acks through the queue, all or nothing."""

    def __init__(self, queue: InMemoryQueue) -> None:
        self.queue = queue
        self.batches: list[Scored] = []
        self.flushes = 0
        self.recovers = 0
        self.before_commit: Callable[[Scored], None] | None = None
        self.committed = threading.Semaphore(0)  # released once per commit

    def commit(
        self,
        items: Sequence[models.WorkItem],
        lease_id: str,
        outputs: Mapping[int, Any],
        scored_at: float,
        model_version: str | None = None,
        forwards: Mapping[str, Sequence[int]] | None = None,
    ) -> outcomes.CommitResult:
        batch = Scored(lease_id, items, outputs, model_version)
        if self.before_commit is not None:
            self.before_commit(batch)
        if not self.queue.ack(batch.lease_id, [i.id for i in batch.items]):
            raise errors.LeaseLost(f"lease {batch.lease_id} lost")
        self.batches.append(batch)
        self.committed.release()
        return outcomes.CommitResult(lease_id, len(items), "list", n_bytes=10 * len(items))

    def flush(self) -> None:
        self.flushes += 1

    def recover(self) -> None:
        self.recovers += 1

    def keys(self) -> Counter[str]:
        return Counter(i.item_key for b in self.batches for i in b.items)


@dataclass
class FakeRunner:
    """Payload ``undecodable`` fails in decode, ``poison`` in forward; others score ``[id]``."""

    on_decode: Callable[[int], None] | None = None
    on_forward: Callable[[int], None] | None = None
    decoded: int = 0
    forwarded: int = 0
    sizes: list[int] = field(default_factory=list)

    def decode(
        self, items: Sequence[models.WorkItem]
    ) -> tuple[list[models.WorkItem], dict[int, str]]:
        self.decoded += 1
        if self.on_decode is not None:
            self.on_decode(self.decoded)
        bad = {i.id: "payload is not valid JSON" for i in items if i.payload.data == b"undecodable"}
        return [i for i in items if i.id not in bad], bad

    def forward(
        self, decoded: tuple[list[models.WorkItem], dict[int, str]]
    ) -> outcomes.ScoreResult:
        self.forwarded += 1
        if self.on_forward is not None:
            self.on_forward(self.forwarded)
        items, failures = decoded
        undecodable = frozenset(failures)
        self.sizes.append(len(items) + len(failures))
        outputs = {}
        for item in items:
            if item.payload.data == b"poison":
                failures[item.id] = "RuntimeError: poison"
            else:
                outputs[item.id] = np.array([float(item.id)], dtype=np.float32)
        return outcomes.ScoreResult(
            outputs, failures, 0.01, len(items), len(items), undecodable=undecodable
        )


def make_config(
    max_rows_per_commit: int = 1,
    commit_interval_s: float = 0.0,
    heartbeat_s: float | None = None,
    **batching: Any,
) -> config.PipelineConfig:
    """A policy for the fake rig; group commit is off unless asked for, so each scored batch
    is its own commit and tests that count commits are deterministic."""
    policy = {"max_batch_size": 4, "max_wait_s": 10.0, **batching}
    return config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        batching=config.BatchingPolicy(**policy),
        output=config.OutputConfig(
            max_rows_per_commit=max_rows_per_commit, commit_interval_s=commit_interval_s
        ),
        queue=config.QueueConfig(
            poll_s=0.001, heartbeat_s=heartbeat_s, lease_s=3 * heartbeat_s if heartbeat_s else 60
        ),
        latency_slo_s=60.0,
    )


@dataclass
class Rig:
    clock: FakeClock
    queue: InMemoryQueue
    runner: FakeRunner
    sink: ListSink
    scorer: pipeline.Scorer[Any]
    progress: list[int]
    waits: list[float]


def rig(
    keys: Sequence[str] = (),
    *,
    clock: FakeClock | None = None,
    on_wait: Callable[[Rig], None] | None = None,
    max_attempts: int = 3,
    max_rows_per_commit: int = 1,
    commit_interval_s: float = 0.0,
    heartbeat_s: float | None = None,
    queue_class: type[InMemoryQueue] | None = None,
    **batching: Any,
) -> Rig:
    clock = clock or FakeClock()
    queue = (queue_class or InMemoryQueue)(clock, max_attempts=max_attempts)
    queue.add(keys)
    runner, sink = FakeRunner(), ListSink(queue)
    progress: list[int] = []
    waits: list[float] = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        if on_wait is not None:
            on_wait(made)

    scorer = pipeline.Scorer(
        make_config(max_rows_per_commit, commit_interval_s, heartbeat_s, **batching),
        queue,
        runner,
        sink,
        clock=clock,
        on_progress=lambda stats: progress.append(stats.committed),
        wait_for_work=wait,
    )
    made = Rig(clock, queue, runner, sink, scorer, progress, waits)
    return made


def keys(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ----------------------------------------------------------------------------- limits


def test_until_empty_commits_every_item_exactly_once() -> None:
    r = rig(keys(10), max_batch_size=4, claim_size=8)
    stats = r.scorer.run(run_stats.RunLimits(until_empty=True))
    assert r.sink.keys() == Counter(keys(10))
    assert r.queue.keys(models.State.DONE) == set(keys(10))
    assert (stats.claimed, stats.committed, stats.failed, stats.released) == (10, 10, 0, 0)
    assert sum(size * n for size, n in stats.batch_sizes.items()) == 10
    assert max(stats.batch_sizes) <= 4
    assert r.progress == sorted(r.progress)
    assert len(r.progress) == stats.batch_sizes.total()
    assert r.progress[-1] == 10
    assert stats.bytes_written == 100
    assert stats.finished_at == r.clock()
    assert r.sink.flushes >= 1  # deferred sink work is recorded before the run returns
    busy = stats.summary()["stage_busy_s"]
    assert list(busy) == ["claim", "decode", "forward", "commit"]
    assert all(seconds > 0 for seconds in busy.values())


# Commit-interval tests: a 30 s interval that the run must never wait out (``HANG_S`` guards
# it); the model's pace is set with events, not sleeps.
HANG_S = 10.0


def one_batch_per_commit(r: Rig) -> None:
    """The model is the bottleneck: batch n is scored only once batch n - 1 is committed."""

    def wait_for_the_last_commit(n: int) -> None:
        if n > 1:
            assert r.sink.committed.acquire(timeout=HANG_S), "the previous batch never committed"

    r.runner.on_forward = wait_for_the_last_commit


def interval_rig(interval_s: float, *, deadlines: bool = False) -> Rig:
    r = rig(max_batch_size=4, claim_size=12, max_rows_per_commit=100, commit_interval_s=interval_s)
    # A deadline far off: batches still go by size.
    r.queue.add(keys(12), deadline_at=r.clock() + 1e6 if deadlines else None)
    return r


def run_within(r: Rig) -> run_stats.RunStats:
    """Run until empty; raise what the run raised, but only if it did not wait the interval out."""
    started = time.monotonic()
    try:
        return r.scorer.run(run_stats.RunLimits(until_empty=True))
    finally:
        assert time.monotonic() - started < HANG_S, "the run waited the commit interval out"


def test_a_commit_interval_gathers_the_batches_scored_meanwhile_and_the_end_closes_it() -> None:
    r = interval_rig(30.0)
    stats = run_within(r)
    assert r.sink.keys() == Counter(keys(12))
    assert stats.batch_sizes == Counter({4: 3})
    assert stats.commits == 1


def test_without_an_interval_each_batch_commits_as_soon_as_it_is_scored() -> None:
    r = interval_rig(0.0)
    one_batch_per_commit(r)
    stats = run_within(r)
    assert r.sink.keys() == Counter(keys(12))
    assert stats.commits == 3


def test_items_with_a_deadline_are_committed_without_waiting_the_interval() -> None:
    r = interval_rig(30.0, deadlines=True)
    one_batch_per_commit(r)  # a batch that waited for the next one would never be followed
    stats = run_within(r)
    assert r.sink.keys() == Counter(keys(12))
    assert stats.commits == 3, "a batch holding a deadline waited for the next one"


def test_a_failed_stage_ends_a_commit_interval_wait_at_once() -> None:
    r = interval_rig(30.0)

    def second_fails(n: int) -> None:
        if n == 2:
            raise RuntimeError("the device fell over")

    r.runner.on_forward = second_fails
    with pytest.raises(RuntimeError, match="fell over"):
        run_within(r)
    assert r.sink.keys() == Counter(keys(4)), "the first batch, scored, was not committed"


@pytest.mark.parametrize(
    ("max_items", "claim_size", "expected"), [(1, 4, 1), (6, 4, 6), (10, 4, 10), (7, 100, 7)]
)
def test_max_items_caps_what_is_claimed(max_items: int, claim_size: int, expected: int) -> None:
    r = rig(keys(10), max_batch_size=4, claim_size=claim_size)
    stats = r.scorer.run(run_stats.RunLimits(until_empty=False, max_items=max_items))
    assert (stats.claimed, stats.committed) == (expected, expected)
    assert len(r.queue.keys(models.State.DONE)) == expected
    assert len(r.queue.keys(models.State.READY)) == 10 - expected


def test_until_empty_stops_before_max_items_on_a_short_queue() -> None:
    r = rig(keys(10), max_batch_size=4, claim_size=4)
    stats = r.scorer.run(run_stats.RunLimits(until_empty=True, max_items=25))
    assert (stats.claimed, stats.committed) == (10, 10)
    assert r.waits == []


def test_max_seconds_on_the_fake_clock_waits_for_work_then_stops() -> None:
    def on_wait(r: Rig) -> None:
        if not r.waits[1:]:
            r.queue.add(["late-1", "late-2", "late-3"])  # work arrives during the first wait
        r.clock.advance(1.0)

    r = rig(on_wait=on_wait, max_batch_size=4, claim_size=8)
    started = r.clock()
    stats = r.scorer.run(run_stats.RunLimits(until_empty=False, max_seconds=5.0))
    assert r.sink.keys() == Counter(["late-1", "late-2", "late-3"])
    assert stats.committed == 3
    assert r.clock() - started == 5.0
    # poll_s after an empty claim; doubling while claims keep finding nothing, from poll_s
    # again once one found work (the third claim)
    assert r.waits == [0.001, 0.001, 0.002, 0.004, 0.008]


def test_an_idle_scorer_polls_ever_less_often_up_to_idle_poll_max_s() -> None:
    r = rig(on_wait=lambda r: r.clock.advance(1.0), max_batch_size=4, claim_size=8)
    r.scorer.config = r.scorer.config.model_copy(
        update={"queue": r.scorer.config.queue.model_copy(update={"idle_poll_max_s": 0.005})}
    )
    r.scorer.run(run_stats.RunLimits(until_empty=False, max_seconds=6.0))
    assert r.waits == [0.001, 0.002, 0.004, 0.005, 0.005, 0.005]


def test_until_empty_on_an_empty_queue_returns_at_once() -> None:
    r = rig()
    stats = r.scorer.run()
    assert (stats.claimed, stats.committed, len(stats.batch_sizes)) == (0, 0, 0)
    assert r.waits == []


# ----------------------------------------------------------------------------- stop and errors


def test_stop_finishes_batches_in_flight_and_releases_the_rest_without_an_attempt() -> None:
    r = rig(keys(20), max_batch_size=4, claim_size=20)
    r.runner.on_decode = lambda n: r.scorer.stop() if n == 2 else None
    stats = r.scorer.run(run_stats.RunLimits(until_empty=False))
    assert (stats.claimed, stats.committed, stats.released) == (20, 8, 12)
    assert stats.summary()["items_released"] == 12
    assert sum(r.sink.keys().values()) == 8
    ready = r.queue.keys(models.State.READY)
    assert len(ready) == 12
    assert ready.isdisjoint(r.sink.keys())
    assert {r.queue.row(k).attempts for k in ready} == {0}
    assert r.queue.keys(models.State.LEASED) == set()


def test_heartbeats_go_on_while_a_stop_drains_the_batches_in_flight() -> None:
    """A SIGTERM stops claims at once; the batches in flight still need their leases until
    they commit (before, heartbeats stopped with the claims and a slow drain could outlive
    its leases)."""
    r = rig(keys(8), max_batch_size=4, claim_size=8, heartbeat_s=0.01)
    beat = threading.Event()
    heartbeat = r.queue.heartbeat

    def heartbeat_and_tell(lease_id: str, lease_s: float) -> int:
        beat.set()
        return heartbeat(lease_id, lease_s)

    r.queue.heartbeat = heartbeat_and_tell  # type: ignore[method-assign]

    def stop_then_wait_for_a_heartbeat(n: int) -> None:
        if n == 1:
            r.scorer.stop()
            beat.clear()
            assert beat.wait(10), "no heartbeat after stop() while a batch was in flight"

    r.runner.on_forward = stop_then_wait_for_a_heartbeat
    stats = r.scorer.run(run_stats.RunLimits(until_empty=False))
    assert stats.committed >= 4
    assert stats.committed + stats.released == 8
    assert r.queue.keys(models.State.LEASED) == set()


@pytest.mark.parametrize(("zeros", "warned"), [(1, False), (None, True)])
def test_a_lease_is_reported_lost_only_when_two_heartbeats_in_a_row_find_it_empty(
    zeros: int | None, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """One empty heartbeat is mostly a commit that acked the lease's last rows just before
    it: healthy runs logged "lease lost" several times each."""
    r = rig(keys(4), max_batch_size=4, claim_size=4, heartbeat_s=0.01)
    beats: list[int] = []
    enough = threading.Event()

    def heartbeat(lease_id: str, lease_s: float) -> int:
        beats.append(1)
        if len(beats) >= 4:
            enough.set()
        return 0 if zeros is None or len(beats) <= zeros else 1

    def slow_forward(n: int) -> None:  # the batch in flight while the heartbeats run
        assert enough.wait(10), "no heartbeats"

    r.queue.heartbeat = heartbeat  # type: ignore[method-assign]
    r.runner.on_forward = slow_forward
    with caplog.at_level("WARNING", logger="batching.loop.scorer"):
        stats = r.scorer.run(run_stats.RunLimits(until_empty=True))
    assert enough.is_set()
    assert stats.committed == 4
    lost = [rec for rec in caplog.records if rec.getMessage() == "heartbeat found lease lost"]
    assert bool(lost) is warned


def test_a_failed_release_still_ends_every_stage_and_the_heartbeats() -> None:
    r = rig(keys(20), max_batch_size=4, claim_size=20, heartbeat_s=0.01)
    r.runner.on_decode = lambda n: r.scorer.stop() if n == 2 else None

    def release(lease_id: str, ids: Sequence[int] | None = None) -> int:
        raise errors.QueueError("database gone")

    r.queue.release = release  # type: ignore[method-assign]
    with pytest.raises(errors.QueueError):
        r.scorer.run(run_stats.RunLimits(until_empty=False))
    alive = {t.name for t in threading.enumerate()} & {"forward", "commit", "heartbeat"}
    assert alive == set(), f"{alive} still running after run() raised"


def test_stop_before_run_claims_nothing() -> None:
    r = rig(keys(5))
    r.scorer.stop()
    stats = r.scorer.run()
    assert (stats.claimed, stats.committed) == (0, 0)
    assert r.queue.keys(models.State.READY) == set(keys(5))


def test_a_failed_stage_fails_the_run_and_releases_what_is_not_in_flight() -> None:
    r = rig(keys(12), max_batch_size=4, claim_size=12)

    def boom(n: int) -> None:
        raise RuntimeError("device lost")

    r.runner.on_forward = boom
    with pytest.raises(RuntimeError, match="device lost"):
        r.scorer.run()
    assert r.sink.batches == []
    assert r.scorer.stats.released >= 4
    leased = r.queue.keys(models.State.LEASED)
    assert len(leased) + r.scorer.stats.released == 12  # the failed batch waits for the reaper
    assert 4 <= len(leased) <= 8


def test_a_batch_scored_after_the_commit_stage_failed_is_released_not_stranded() -> None:
    # The commit stage fails on batch 1 only once batch 2 waits between the stages and the
    # forward stage is handing on batch 3: that hand-off gives up, and batch 3 must be released
    # with batch 2 rather than stay leased until it expires. Batch 1 is released too: the
    # database failed, not its items, and left to the reaper it would use up an attempt.
    r = rig(keys(12), max_batch_size=4, claim_size=12, max_inflight_batches=1)
    third = threading.Event()

    def on_forward(n: int) -> None:
        if n == 3:
            third.set()

    def fail_first(batch: Scored) -> None:
        assert third.wait(5)
        raise errors.QueueError("disk full")

    r.runner.on_forward = on_forward
    r.sink.before_commit = fail_first
    with pytest.raises(errors.QueueError, match="disk full"):
        r.scorer.run()
    assert r.runner.forwarded == 3
    assert r.queue.keys(models.State.LEASED) == set()
    assert r.queue.keys(models.State.READY) == set(keys(12))
    # Everything claimed went back; a claim already under way when the commit failed may
    # have taken released items once more (seen under load: claimed 16), and gave them back.
    stats = r.scorer.stats
    assert (stats.committed, stats.failed) == (0, 0)
    assert stats.released == stats.claimed >= 12


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("max_attempts", "state"), [(1, models.State.DEAD), (3, models.State.READY)]
)
def test_failed_items_go_to_queue_fail_alone_and_batch_mates_commit(
    max_attempts: int, state: models.State
) -> None:
    # A payload the model cannot read is dead at once: no retry can decode it. A failure in the
    # forward pass is retried until max_attempts.
    r = rig(max_attempts=max_attempts, max_batch_size=8, claim_size=8)
    r.queue.add(["ok-1", "ok-2"])
    r.queue.add(["bad-json"], b"undecodable")
    r.queue.add(["ok-3"])
    r.queue.add(["poison"], b"poison")
    r.queue.add(["ok-4", "ok-5"])
    stats = r.scorer.run()
    assert r.runner.sizes == [7]  # one batch: the bad items were batch-mates of the good ones
    assert r.sink.keys() == Counter(["ok-1", "ok-2", "ok-3", "ok-4", "ok-5"])
    assert (stats.committed, stats.failed) == (5, 2)
    calls = {
        r.queue.rows[i].item.item_key: (lease, why)
        for lease, failures in r.queue.fail_calls
        for i, why in failures.items()
    }
    lease = r.sink.batches[0].lease_id
    assert calls == {
        "bad-json": (lease, "payload is not valid JSON"),
        "poison": (lease, "RuntimeError: poison"),
    }
    assert r.queue.row("bad-json").state is models.State.DEAD
    assert r.queue.row("poison").state is state
    for key, (_, why) in calls.items():
        assert r.queue.row(key).last_error == why


def test_a_lost_lease_is_counted_not_committed_and_its_items_are_scored_again() -> None:
    r = rig(keys(8), max_batch_size=4, claim_size=4)
    lost: list[Scored] = []
    reaped: list[int] = []

    def reaper_runs_first(batch: Scored) -> None:
        if not lost:
            lost.append(batch)
            # the lease expired and the reaper ran before commit
            reaped.append(r.queue.reap(batch.lease_id))

    r.sink.before_commit = reaper_runs_first
    first = r.scorer.run()
    assert reaped[0] >= 4  # the batch's items, and any later claim added to its lease
    assert first.lease_lost == reaped[0]
    assert first.summary()["lease_lost_items"] == reaped[0]
    assert first.commits == len(r.sink.batches)  # the refused commit is not counted
    assert lost[0].lease_id not in {b.lease_id for b in r.sink.batches}
    second = pipeline.Scorer(make_config(max_batch_size=4), r.queue, r.runner, r.sink)
    second.run()  # whatever the first run did not pick up again
    assert r.sink.keys() == Counter(keys(8))
    assert first.committed + second.stats.committed == 8
    assert r.queue.keys(models.State.DONE) == set(keys(8))


def test_claims_add_to_the_lease_held_so_a_batch_spanning_them_commits_once() -> None:
    r = rig(keys(6), max_batch_size=6, claim_size=2)
    stats = r.scorer.run()
    assert stats.batch_sizes == Counter({6: 1})
    assert len({b.lease_id for b in r.sink.batches}) == 1
    assert stats.commits == 1
    assert r.queue.keys(models.State.DONE) == set(keys(6))


def test_a_batch_partly_reaped_gives_back_what_its_lease_still_holds() -> None:
    """Items claimed into a lease later expire later: a stalled scorer can lose the first
    claim's items and keep the second's. The batch holding both cannot commit (the ack is
    all or nothing); what the lease still holds goes back at once, not when the run ends
    (its heartbeats would keep those items leased, and nobody would commit them)."""
    r = rig(keys(4), max_batch_size=4, claim_size=2)
    lost: list[Scored] = []

    def first_claim_expired(batch: Scored) -> None:
        if not lost:
            lost.append(batch)
            with r.queue._lock:
                for item in batch.items[:2]:  # the reaper took the first claim's items
                    row = r.queue.rows[item.id]
                    row.state, row.lease_id = models.State.READY, None
                # ... and, as the SQL reaper's suspects are, they are never claimed into
                # that lease again (it is no longer added to)
                r.queue._reaped.add(batch.lease_id)

    r.sink.before_commit = first_claim_expired
    stats = r.scorer.run()
    assert len(lost[0].items) == 4  # one batch across the two claims, one lease
    assert stats.lease_lost >= 4
    assert stats.released >= 2  # (the run may claim them again before it ends)
    assert r.queue.keys(models.State.LEASED) == set()
    pipeline.Scorer(make_config(max_batch_size=4), r.queue, r.runner, r.sink).run()
    assert r.queue.keys(models.State.DONE) == set(keys(4))
    assert r.sink.keys() == Counter(keys(4))


class NewLeaseEachClaim(InMemoryQueue):
    """A queue that leases every claim apart (the lease of an isolation round; a lease let
    go between two claims)."""

    def claim(self, n: int, **kw: Any) -> models.Claim:
        return super().claim(n, **{**kw, "lease_id": None})


def test_a_batch_holding_two_leases_commits_each_lease_part_separately() -> None:
    r = rig(
        ["a1", "a2", "a3", "b1", "b2", "b3"],
        max_batch_size=2,
        claim_size=3,
        queue_class=NewLeaseEachClaim,
    )
    stats = r.scorer.run()
    parts = [(b.lease_id, [i.item_key for i in b.items]) for b in r.sink.batches]
    assert sorted(parts) == [
        ("lease-1", ["a1", "a2"]),
        ("lease-1", ["a3"]),
        ("lease-2", ["b1"]),
        ("lease-2", ["b2", "b3"]),
    ]
    assert stats.batch_sizes == Counter({2: 3})
    assert stats.committed == 6


def test_a_failing_sink_flush_is_logged_and_the_run_still_completes() -> None:
    r = rig(keys(6), max_batch_size=4, claim_size=8)

    def flush() -> None:
        r.sink.flushes += 1
        raise errors.QueueError("database is locked")

    r.sink.flush = flush  # type: ignore[method-assign]
    stats = r.scorer.run()
    assert r.sink.flushes >= 1
    assert stats.committed == 6
    assert r.queue.keys(models.State.DONE) == set(keys(6))


# ----------------------------------------------------------------------------- stats


@pytest.mark.parametrize(
    ("values", "p50", "p99"),
    [
        ([], 0.0, 0.0),
        ([5], 5.0, 5.0),
        ([1, 2, 3], 2.0, 3.0),
        (list(range(1, 101)), 51.0, 99.0),
        ([0.1] * 98 + [5.0, 9.0], 0.1, 5.0),  # nearest rank: p99 of 100 is the 99th
    ],
)
def test_summary_percentiles(values: list[float], p50: float, p99: float) -> None:
    stats = run_stats.RunStats(started_at=100.0, finished_at=110.0)
    stats.latencies_s = run_stats.Samples.of(values)
    stats.batch_sizes = Counter(round(v) for v in reversed(values))
    s = stats.summary()
    assert (s["latency_p50_s"], s["latency_p99_s"]) == (p50, p99)
    assert s["latency_max_s"] == (max(values) if values else 0.0)
    assert (s["batch_size_p50"], s["batch_size_p99"]) == (round(p50), round(p99))


def test_summary_numbers() -> None:
    stats = run_stats.RunStats(started_at=100.0, finished_at=104.0, committed=40, failed=2)
    stats.batch_sizes = Counter([8, 16, 16])
    stats.service_s = run_stats.Samples.of([0.1, 0.2, 0.3])
    stats.real_tokens, stats.padded_tokens = 30, 40
    stats.reasons.update(["size", "size", "wait"])
    s = stats.summary()
    assert s["items_per_s"] == 10.0
    assert s["elapsed_s"] == 4.0
    assert s["batches"] == 3
    assert s["batch_size_mean"] == pytest.approx(40 / 3)
    assert s["padding_efficiency"] == 0.75
    assert s["service_s_mean"] == pytest.approx(0.2)
    assert s["release_reasons"] == {"size": 2, "wait": 1}
    assert (s["items_committed"], s["items_failed"]) == (40, 2)
    empty = run_stats.RunStats(started_at=1.0, finished_at=1.0).summary()
    assert (empty["padding_efficiency"], empty["batch_size_mean"], empty["items_per_s"]) == (
        1.0,
        0.0,
        0.0,
    )


def test_run_stats_measure_latency_from_enqueue_on_the_injected_clock() -> None:
    clock = FakeClock()
    r = rig(clock=clock, max_batch_size=4, claim_size=4)
    r.queue.add(keys(4))
    clock.advance(2.5)
    stats = r.scorer.run()
    lat = stats.latencies_s
    assert (len(lat), lat.quantile(0), lat.max) == (4, 2.5, 2.5)
    assert stats.reasons == Counter({"size": 1})
    assert (len(stats.service_s), stats.service_s.mean) == (1, 0.01)


# ----------------------------------------------------------------------------- pacing


def test_summary_rows_are_one_list_for_the_cli_and_the_artifact() -> None:
    stats = run_stats.RunStats(started_at=0.0, committed=4, commits=1, batch_sizes=Counter([4]))
    stats.finished_at = 2.0
    rows = dict(run_stats.summary_rows({**stats.summary(), "lineage_failures": 0}))
    assert (rows["items committed"], rows["batches"], rows["commits"]) == ("4", "1", "1")
    assert rows["items/s"] == "2.0"
    assert {"busy s: claim", "busy s: commit", "lineage events not delivered"} <= set(rows)


def test_summary_rows_show_milliseconds_of_stage_time_not_zero() -> None:
    summary = run_stats.RunStats(started_at=0.0, finished_at=1.0).summary()
    summary["stage_busy_s"] = {"forward": 0.00123, "commit": 12.3456}
    rows = dict(run_stats.summary_rows(summary))
    assert rows["busy s: forward"] == "0.00123"
    assert rows["busy s: commit"] == "12.3"


class ClaimsAgainOnRelease(InMemoryQueue):
    """Runs ``hook`` (once) right after a release, before any other thread may claim: a
    claim landing in that moment, deterministically."""

    hook: Callable[[], object] | None = None

    def __init__(self, clock: FakeClock, *, max_attempts: int = 3) -> None:
        super().__init__(clock, max_attempts=max_attempts)
        self.gate = threading.RLock()  # the releasing thread's hook re-enters it

    def claim(self, n: int, **kwargs: Any) -> models.Claim:
        with self.gate:
            return super().claim(n, **kwargs)

    def release(self, lease_id: str, ids: Sequence[int] | None = None) -> int:
        with self.gate:
            n = super().release(lease_id, ids)
            hook, self.hook = self.hook, None
            if hook is not None:
                hook()
            return n


def test_items_given_back_and_claimed_again_into_the_same_lease_stay_tracked() -> None:
    """A claim adds to the open lease, so items given back can be claimed again under the
    very same lease id before the scorer stops tracking them; it then forgot the new claim's
    items, and the dispatch (or the shutdown) failed with KeyError (a chaos review, after
    connections were cut mid-commit)."""
    r = rig(keys(4), max_batch_size=4, claim_size=2, queue_class=ClaimsAgainOnRelease)
    queue = r.queue
    assert isinstance(queue, ClaimsAgainOnRelease)
    lost: list[Scored] = []
    claimed_again: list[int] = []

    def claim_now() -> None:  # a claim landing inside the give-back, into the open lease
        before = set(r.scorer._item_lease)
        r.scorer._claim(run_stats.RunLimits())
        claimed_again.extend(set(r.scorer._item_lease) - before)

    def first_claim_expired(batch: Scored) -> None:
        if not lost:
            lost.append(batch)
            with queue._lock:
                for item in batch.items[:2]:  # taken from the lease (reaped, then dead)
                    row = queue.rows[item.id]
                    row.state, row.lease_id = models.State.DEAD, None
            queue.hook = claim_now

    commit_part = r.scorer._commit_lease_part
    untracked: list[int] = []

    looked: list[bool] = []

    def commit_then_look(*args: Any, **kwargs: Any) -> int:
        made = commit_part(*args, **kwargs)
        if claimed_again and not looked:  # right after the commit the claim landed in
            looked.append(True)
            with r.scorer._lock:
                untracked.extend(i for i in claimed_again if i not in r.scorer._item_lease)
        return made

    r.sink.before_commit = first_claim_expired
    r.scorer._commit_lease_part = commit_then_look  # type: ignore[method-assign]
    stats = r.scorer.run()
    assert lost
    assert stats.lease_lost >= 4
    assert claimed_again  # the claim took the items given back...
    assert looked
    assert untracked == []  # ...and the scorer still knows whose they are


# ----------------------------------------------------------------------------- claims paced


def expiring(r: Rig) -> Rig:
    """``r`` under ``late_policy: expire``, which claims are paced under (read live)."""
    cfg = r.scorer.config
    queue = cfg.queue.model_copy(update={"late_policy": "expire"})
    r.scorer.config = cfg.model_copy(update={"queue": queue})
    return r


def paced_rig(**batching: Any) -> Rig:
    r = expiring(rig(keys(4), adaptive=True, **batching))
    r.scorer._claim_s = 0.004  # a claim's recent time: the lead is twice it
    r.scorer._watch.started(object())  # type: ignore[arg-type]  # a pass in flight
    return r


def test_a_claim_waits_while_the_pass_in_flight_is_far_from_its_end() -> None:
    r = paced_rig()
    ctrl = r.scorer.controller
    assert ctrl is not None
    now = r.clock()
    ctrl.busy_until = now + 0.100  # the next batch is cut as this pass ends
    ctrl.decoded(4, 0.004)  # 1 ms an item: the cut goes a decode ahead of the end
    hold = r.scorer._claim_hold_s()
    # claimed twice a claim's time before the cut: the items are in the batcher by then
    assert hold == pytest.approx(0.100 - 0.001 - 2 * 0.004)
    r.clock.advance(hold)
    assert r.scorer._claim_hold_s() == 0.0  # the lead reached: claim now


def test_a_claim_goes_at_once_when_the_model_is_idle_or_the_pass_ran_late() -> None:
    r = paced_rig()
    ctrl = r.scorer.controller
    assert ctrl is not None
    assert r.scorer._claim_hold_s() == 0.0  # nothing ever ran
    ctrl.busy_until = r.clock() - 0.010  # past its predicted end, still running or not
    assert r.scorer._claim_hold_s() == 0.0
    ctrl.busy_until = r.clock() + 0.005  # ends within the lead: no time to hold
    assert r.scorer._claim_hold_s() == 0.0
    ctrl.busy_until = r.clock() + 0.100
    assert r.scorer._claim_hold_s() > 0
    r.scorer._watch.finished()  # no pass in flight: a busy_until ahead of the clock is a
    assert r.scorer._claim_hold_s() == 0.0  # step back of the clock, not a pass to wait for


def test_a_long_pass_holds_its_claim_in_steps() -> None:
    r = paced_rig()
    assert r.scorer.controller is not None
    r.scorer.controller.busy_until = r.clock() + 60.0
    assert r.scorer._claim_hold_s() == pipeline.CLAIM_HOLD_MAX_S


def test_claims_are_not_held_without_the_adaptive_rule_in_bulk_or_in_isolation() -> None:
    fixed = rig(keys(4))
    assert fixed.scorer.controller is None
    assert fixed.scorer._claim_hold_s() == 0.0
    bulk = paced_rig()
    bulk.scorer.config = bulk.scorer.config.model_copy(update={"profile": "bulk"})
    assert bulk.scorer.controller is not None
    bulk.scorer.controller.busy_until = bulk.clock() + 1.0
    assert bulk.scorer._claim_hold_s() == 0.0  # throughput: claims run ahead
    suspects = paced_rig()
    assert suspects.scorer.controller is not None
    suspects.scorer.controller.busy_until = suspects.clock() + 1.0
    assert suspects.scorer._claim_hold_s() > 0
    suspects.scorer._isolating = True  # an isolation round claims when the rest committed
    assert suspects.scorer._claim_hold_s() == 0.0


def test_claims_are_not_held_under_late_policy_score() -> None:
    # An item whose own deadline passed while it waited in the table is expired by the next
    # claim; claimed at once, ``score`` scores it late, as that policy promises.
    r = paced_rig()
    assert r.scorer.controller is not None
    r.scorer.controller.busy_until = r.clock() + 1.0
    assert r.scorer._claim_hold_s() > 0
    cfg = r.scorer.config
    r.scorer.config = cfg.model_copy(
        update={"queue": cfg.queue.model_copy(update={"late_policy": "score"})}
    )
    assert r.scorer._claim_hold_s() == 0.0


def test_a_claim_that_finds_nothing_does_not_shorten_the_lead() -> None:
    r = paced_rig()
    r.scorer._claim(run_stats.RunLimits())  # takes the four items: a write
    after_write = r.scorer._claim_s
    assert after_write is not None
    assert after_write != 0.004
    r.scorer._claim(run_stats.RunLimits())  # finds nothing: a read
    assert r.scorer._claim_s == after_write


def test_the_end_of_a_pass_wakes_a_held_claim() -> None:
    # A pass that ends before its prediction: the claim held for it goes then, not at the
    # predicted cut (up to CLAIM_HOLD_MAX_S later, with the model idle meanwhile).
    r = expiring(rig(keys(4), adaptive=True))
    woken_by: list[str] = []
    wanted = r.scorer._claim_wanted
    set_wanted = wanted.set

    def record() -> None:
        woken_by.append(threading.current_thread().name)
        set_wanted()

    wanted.set = record  # type: ignore[method-assign]
    stats = r.scorer.run(run_stats.RunLimits(until_empty=True))
    assert stats.committed == 4
    assert "forward" in woken_by


class Ticking(FakeClock):
    """A clock that moves 1 ms each time it is read."""

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def test_a_held_claim_goes_once_its_hold_is_over_and_scores_every_item_once() -> None:
    r = expiring(rig(keys(4), clock=Ticking(), adaptive=True))
    r.scorer._claim_s = 0.004
    ctrl = r.scorer.controller
    assert ctrl is not None
    end = ctrl.busy_until = r.clock() + 0.050  # a pass in flight when the run starts: held
    r.scorer._watch.started(object())  # type: ignore[arg-type]
    claims: list[float] = []
    claim = r.queue.claim

    def timed_claim(*args: Any, **kwargs: Any) -> models.Claim:
        claims.append(r.clock.now)
        return claim(*args, **kwargs)

    r.queue.claim = timed_claim  # type: ignore[method-assign]
    stats = r.scorer.run(run_stats.RunLimits(until_empty=True))
    assert stats.committed == 4
    assert r.sink.keys() == Counter({k: 1 for k in keys(4)})
    assert claims[0] >= end - 2 * 0.004  # not before twice a claim's time before its end
