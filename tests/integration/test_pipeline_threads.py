"""Scorer thread interplay with fakes and real threads: these wait on real time, so they live
with the integration tests (unit tests use a fake clock and never sleep)."""

from __future__ import annotations

import time
from collections import Counter

from batching import models, pipeline
from tests.unit.test_pipeline import FakeClock, keys, rig


def test_items_reaped_and_claimed_again_while_in_flight_commit_once_under_the_new_lease() -> None:
    """The old batch is fenced out by its lost lease; the new claim's batch commits."""
    r = rig(keys(8), max_batch_size=4, claim_size=4)

    def reaped_and_reclaimed(n: int) -> None:
        if n != 1:
            return
        r.queue.reap("lease-1")  # the lease expired during this forward pass
        deadline = time.monotonic() + 5
        while r.queue.row("k0").lease_id in (None, "lease-1") and time.monotonic() < deadline:
            time.sleep(0.001)  # until the feeder claimed k0..k3 again

    r.runner.on_forward = reaped_and_reclaimed
    stats = r.scorer.run(pipeline.RunLimits(until_empty=False, max_items=12))
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
