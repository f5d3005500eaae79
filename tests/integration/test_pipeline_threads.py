"""Scorer thread interplay with fakes and real threads: these wait on real time, so they live
with the integration tests (unit tests use a fake clock and never sleep)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from batching import models
from batching.loop import stats as run_stats
from batching.testing import FakeClock
from tests.unit.test_pipeline import NewLeaseEachClaim, Rig, keys, rig


def test_items_reaped_and_claimed_again_while_in_flight_commit_once_under_the_new_lease() -> None:
    """The old batch is fenced out by its lost lease; the new claim's batch commits. (The
    SQL queue's reaper makes reaped items suspects, leased apart in an isolation round; this
    fake queue leases every claim apart, as that round would.)"""
    r = rig(keys(8), max_batch_size=4, claim_size=4, queue_class=NewLeaseEachClaim)

    def reaped_and_reclaimed(n: int) -> None:
        if n != 1:
            return
        r.queue.reap("lease-1")  # the lease expired during this forward pass
        deadline = time.monotonic() + 5
        while r.queue.row("k0").lease_id in (None, "lease-1") and time.monotonic() < deadline:
            time.sleep(0.001)  # until the feeder claimed k0..k3 again

    r.runner.on_forward = reaped_and_reclaimed
    stats = r.scorer.run(run_stats.RunLimits(until_empty=False, max_items=12))
    assert stats.lease_lost == 4
    assert r.sink.keys() == Counter(keys(8))
    assert "lease-1" not in {b.lease_id for b in r.sink.batches}
    assert r.queue.keys(models.State.DONE) == set(keys(8))


class CountingClock(FakeClock):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


def test_the_feeder_does_not_spin_while_the_model_is_busy() -> None:
    """A ready batch waits for the busy forward stage without burning a core."""
    clock = CountingClock()
    r = rig(keys(16), clock=clock, max_batch_size=4, claim_size=16)
    seen: list[int] = []

    def busy(n: int) -> None:
        if n == 1:
            start = clock.calls
            time.sleep(0.1)  # the model runs; the next batch is ready and must wait
            seen.append(clock.calls - start)

    r.runner.on_forward = busy
    r.scorer.run()
    assert seen[0] < 1000, f"feeder polled the clock {seen[0]} times in 0.1 s"


def test_batches_waiting_to_commit_are_committed_together_one_commit_per_lease() -> None:
    """Group commit: while the first commit is slow, the next scored batches queue up; the
    commit stage then takes them all at once, one sink commit per lease, capped in rows."""
    r = rig(keys(16), max_batch_size=2, claim_size=8, max_inflight_batches=8, max_rows_per_commit=6)
    committing, queued = threading.Event(), threading.Event()

    def on_forward(n: int) -> None:
        if n == 2:  # batch 2 is scored only once the first commit has taken batch 1 alone
            assert committing.wait(5)
        if n == 5:  # batches 2-4 are scored and waiting for the commit stage
            queued.set()

    def slow_first(batch: object) -> None:
        if not r.sink.batches:
            committing.set()
            assert queued.wait(5)
            time.sleep(0.05)

    r.runner.on_forward = on_forward
    r.sink.before_commit = slow_first
    stats = r.scorer.run()
    sizes = [len(b.items) for b in r.sink.batches]
    assert sizes[:2] == [2, 6]  # batch 1 alone; then batches 2-4 of lease 1, at the 6-row cap
    assert all(len({i.item_key for i in b.items}) == len(b.items) for b in r.sink.batches)
    assert r.sink.keys() == Counter(keys(16))
    assert stats.commits == len(r.sink.batches) < stats.batch_sizes.total() == 8
    assert r.queue.keys(models.State.DONE) == set(keys(16))


def test_an_idle_commit_stage_flushes_the_sink_while_the_run_goes_on() -> None:
    """Deferred sink work (publish marks) is recorded once commits stop arriving, not only at
    the end of a long-running scorer."""
    seen: list[int] = []

    def on_wait(r: Rig) -> None:  # the queue is empty and everything has committed
        deadline = time.monotonic() + 5
        while r.sink.flushes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(r.sink.flushes)
        r.scorer.stop()

    r = rig(keys(4), on_wait=on_wait, max_batch_size=4)
    r.scorer.run(run_stats.RunLimits(until_empty=False))
    assert seen[0] >= 1
    assert r.sink.keys() == Counter(keys(4))


def test_a_claim_runs_while_the_batches_already_claimed_are_dispatched() -> None:
    """The second claim blocks until the first claim's second batch has been scored: that
    needs claims on a thread of their own, beside the dispatcher."""
    r = rig(keys(8), max_batch_size=2, claim_size=4)
    second_scored = threading.Event()
    claims: list[bool] = []
    claim = r.queue.claim

    def claim_after_dispatch(n: int, **kw: Any) -> models.Claim:
        if len(claims) == 1:
            claims.append(second_scored.wait(5))
        else:
            claims.append(True)
        return claim(n, **kw)

    def on_forward(n: int) -> None:
        if n == 2:
            second_scored.set()

    r.queue.claim = claim_after_dispatch  # type: ignore[method-assign]
    r.runner.on_forward = on_forward
    r.scorer.run()
    assert claims[:2] == [True, True]
    assert r.sink.keys() == Counter(keys(8))


def test_a_decode_that_raises_fails_the_run_and_gives_every_item_back() -> None:
    """The dispatcher runs in the caller's thread: its error must stop the claim thread (or
    run() would wait for it forever) and release what was claimed."""
    r = rig(keys(40), max_batch_size=4, claim_size=8)

    def broken(n: int) -> None:
        raise RuntimeError("decoder crashed")

    r.runner.on_decode = broken
    raised: list[BaseException] = []

    def run() -> None:
        try:
            r.scorer.run(run_stats.RunLimits(until_empty=False))
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "run() hung after the dispatcher failed"
    assert [str(e) for e in raised] == ["decoder crashed"]
    assert r.queue.keys(models.State.LEASED) == set()
    assert r.queue.keys(models.State.READY) == set(keys(40))
