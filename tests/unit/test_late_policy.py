"""The batcher's overload behaviour: ``late_policy`` (expire items predicted to miss their
deadline, with a reason, or score them late) and EDF order within a priority. Fake clock."""

from __future__ import annotations

import itertools
import random

import pytest

from batching import config, models
from batching.policy import adaptive, batcher
from batching.testing import FakeClock

_ids = itertools.count(1)
NOW = 1_800_000_000.0


def item(
    *, enqueued_at: float = NOW, deadline_at: float | None = None, priority: int = 0
) -> models.WorkItem:
    i = next(_ids)
    return models.WorkItem(
        i,
        f"k{i}",
        models.Payload(b"{}"),
        enqueued_at,
        priority=priority,
        deadline_at=deadline_at,
    )


def make(late_policy: batcher.LatePolicy, clock: FakeClock) -> batcher.MicroBatcher:
    pol = config.BatchingPolicy(max_batch_size=8, max_wait_s=0.5)
    return batcher.MicroBatcher(pol, clock, lambda n, c: 0.2, late_policy=late_policy)


def test_expire_takes_the_late_out_with_their_reason() -> None:
    clock = FakeClock(NOW)
    b = make("expire", clock)
    late, tight, loose, none = (
        item(deadline_at=NOW + 0.1),  # 0.2 s of service: cannot make it
        item(deadline_at=NOW + 0.2),  # exactly in time
        item(deadline_at=NOW + 5.0),
        item(),
    )
    b.add([late, tight, loose, none])
    batch = b.poll(flush=True)
    assert batch is not None
    assert [i.id for i in batch.items] == [tight.id, loose.id, none.id]
    assert batch.stats.size == 3
    taken = b.take_late()
    assert [t.item.id for t in taken] == [late.id]
    reason = taken[0].reason
    assert "late_policy expire" in reason
    assert "deadline 2027-01-15T08:00:00.100Z" in reason  # its deadline, in UTC
    assert "predicted finish 2027-01-15T08:00:00.200Z" in reason
    assert "0.200 s predicted for a batch of 4" in reason
    assert b.take_late() == []  # taken once
    assert len(b) == 0


def test_score_releases_the_late_like_the_rest() -> None:
    clock = FakeClock(NOW)
    b = make("score", clock)
    b.add([item(deadline_at=NOW - 1.0), item()])
    batch = b.poll(flush=True)
    assert batch is not None
    assert len(batch) == 2
    assert b.take_late() == []


def test_a_batch_all_late_gives_the_next_or_none() -> None:
    clock = FakeClock(NOW)
    b = make("expire", clock)
    b.add([item(deadline_at=NOW - 1.0), item(deadline_at=NOW + 0.05)])
    # due at once (deadline rule), every item late: nothing to release, both taken
    assert b.poll() is None
    assert len(b.take_late()) == 2
    assert len(b) == 0
    assert b.next_deadline() is None


def test_drain_releases_late_items_to_the_queue_not_expired() -> None:
    clock = FakeClock(NOW)
    b = make("expire", clock)
    b.add([item(deadline_at=NOW - 1.0), item()])
    batches = b.drain()
    assert sum(len(x) for x in batches) == 2
    assert b.take_late() == []


def test_expire_with_the_adaptive_controller_counts_the_model_in_flight() -> None:
    """With the controller, the finish is when the forward in flight ends plus this batch."""
    clock = FakeClock(NOW)
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.1))
    pol = config.BatchingPolicy(max_batch_size=8, max_wait_s=0.5)
    b = batcher.MicroBatcher(pol, clock, adaptive=ctrl, late_policy="expire")
    ctrl.forward_started(8, 1, NOW)  # busy until NOW + 0.1
    ok, late = item(deadline_at=NOW + 0.25), item(deadline_at=NOW + 0.15)
    b.add([ok, late])
    batch = b.poll(flush=True)
    assert batch is not None
    assert [i.id for i in batch.items] == [ok.id]
    assert [t.item.id for t in b.take_late()] == [late.id]


@pytest.mark.parametrize("seed", range(3))
def test_edf_within_a_priority(seed: int) -> None:
    """Cut order: priority (high first), then deadline (earliest first, none last), then
    enqueued_at: whatever order the claim added them in."""
    clock = FakeClock(NOW + 10)
    b = batcher.MicroBatcher(config.BatchingPolicy(max_batch_size=6, max_wait_s=0.5), clock)
    items = [
        item(priority=1, enqueued_at=NOW + 3),
        item(priority=0, deadline_at=NOW + 30, enqueued_at=NOW + 1),
        item(priority=0, deadline_at=NOW + 20, enqueued_at=NOW + 2),
        item(priority=0, enqueued_at=NOW),  # oldest, but no deadline: after those with one
        item(priority=0, enqueued_at=NOW + 0.5),
        item(priority=1, deadline_at=NOW + 40, enqueued_at=NOW + 4),
    ]
    expected = [items[i].id for i in (5, 0, 2, 1, 3, 4)]
    shuffled = items[:]
    random.Random(seed).shuffle(shuffled)
    for one in shuffled:
        b.add([one])
    batch = b.poll()
    assert batch is not None
    assert [i.id for i in batch.items] == expected
