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


def test_a_default_deadline_makes_items_without_one_late_past_it() -> None:
    """``queue.default_deadline_s``: an item with no deadline is due that long after its
    enqueue; one with a deadline of its own keeps it."""
    clock = FakeClock(NOW + 0.9)
    pol = config.BatchingPolicy(max_batch_size=8, max_wait_s=0.5)
    b = batcher.MicroBatcher(
        pol, clock, lambda n, c: 0.2, late_policy="expire", default_deadline_s=1.0
    )
    old, fresh, own = (
        item(enqueued_at=NOW),  # due NOW + 1.0, finish NOW + 1.1: late
        item(enqueued_at=NOW + 0.5),  # due NOW + 1.5: in time
        item(enqueued_at=NOW, deadline_at=NOW + 60),  # its own deadline wins
    )
    b.add([old, fresh, own])
    batch = b.poll(flush=True)
    assert batch is not None
    assert sorted(i.id for i in batch.items) == sorted([fresh.id, own.id])
    (taken,) = b.take_late()
    assert taken.item.id == old.id
    assert "default deadline 2027-01-15T08:00:01.000Z (1 s after its enqueue)" in taken.reason
    assert "predicted finish 2027-01-15T08:00:01.100Z" in taken.reason


def test_a_default_deadline_is_ignored_when_late_items_are_scored() -> None:
    clock = FakeClock(NOW + 5)
    pol = config.BatchingPolicy(max_batch_size=8, max_wait_s=0.5)
    b = batcher.MicroBatcher(pol, clock, lambda n, c: 0.2, default_deadline_s=1.0)
    b.add([item(enqueued_at=NOW)])
    batch = b.poll()
    assert batch is not None
    assert len(batch) == 1
    assert b.take_late() == []


def test_a_uniform_block_past_its_default_deadline_is_cut_item_by_item() -> None:
    """A claim's columnar block is cut whole only while its oldest item can be in time; past
    that its items are judged one by one like any others."""
    tensor = models.Payload(b"", models.PayloadFormat.TENSOR, "float32", (2,))
    ids = [next(_ids) for _ in range(4)]
    block = models.ItemBlock(
        models.WorkItem(0, "", tensor, 0.0),
        ids,
        [f"k{i}" for i in ids],
        [NOW, NOW, NOW + 0.5, NOW + 0.5],
        [1] * 4,
        [8] * 4,
        bytes(32),
    )
    pol = config.BatchingPolicy(max_batch_size=4, max_wait_s=0.5)
    clock = FakeClock(NOW + 0.5)  # in time: cut whole, as a block
    b = batcher.MicroBatcher(
        pol, clock, lambda n, c: 0.1, late_policy="expire", default_deadline_s=1.0
    )
    b.add(block)
    whole = b.poll()
    assert whole is not None
    assert isinstance(whole.items, models.ItemBlock)
    assert list(whole.items.ids) == ids

    clock.now = NOW + 0.95  # the first two would finish at NOW + 1.05, past NOW + 1.0
    b = batcher.MicroBatcher(
        pol, clock, lambda n, c: 0.1, late_policy="expire", default_deadline_s=1.0
    )
    b.add(block)
    batch = b.poll()
    assert batch is not None
    assert [i.id for i in batch.items] == ids[2:]
    assert [t.item.id for t in b.take_late()] == ids[:2]


def test_config_refuses_a_default_deadline_without_expire() -> None:
    with pytest.raises(ValueError, match="default_deadline_s takes effect only with late_policy"):
        config.QueueConfig(default_deadline_s=1.0)
    assert config.QueueConfig(late_policy="expire", default_deadline_s=1.0).default_deadline_s


def test_with_the_controller_a_default_deadline_is_held_to_the_upper_estimate() -> None:
    """The default deadline stands for the p99 objective, so it is judged by the model's
    bound (mean x (1 + margin)); a deadline of the item's own, by the mean."""
    clock = FakeClock(NOW)
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.1))
    assert ctrl.model.bound(2, 1) == pytest.approx(0.125)  # the cold margin, 25%
    pol = config.BatchingPolicy(max_batch_size=8, max_wait_s=0.5)
    b = batcher.MicroBatcher(
        pol, clock, adaptive=ctrl, late_policy="expire", default_deadline_s=1.0
    )
    # both due at NOW + 0.12: in time by the mean (0.1), late by the bound (0.125)
    by_default, own = item(enqueued_at=NOW - 0.88), item(deadline_at=NOW + 0.12)
    b.add([by_default, own])
    batch = b.poll(flush=True)
    assert batch is not None
    assert [i.id for i in batch.items] == [own.id]
    (taken,) = b.take_late()
    assert taken.item.id == by_default.id
    assert "(now + 0.125 s predicted for a batch of 2)" in taken.reason


def test_the_run_summary_counts_what_its_claims_expired() -> None:
    """An item past its deadline when a claim finds it is expired by the claim's transaction;
    the metric counted it and the run's summary (``score --json``) said 0."""
    from batching.loop.scorer import Scorer
    from batching.loop.stats import RunLimits
    from batching.testing import InMemoryQueue, MemoryOutputs
    from tests.unit.test_testing import DoubleIt

    clock = FakeClock()
    queue = InMemoryQueue("q", clock=clock)
    overdue = models.EnqueueRecord("late", models.Payload(b'{"x": [1]}'), deadline_at=clock() + 1)
    queue.enqueue([overdue, models.EnqueueRecord("ok", models.Payload(b'{"x": [2]}'))])
    clock.advance(5)
    cfg = config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        batching=config.BatchingPolicy(max_batch_size=8, max_wait_s=0.0),
        queue=config.QueueConfig(poll_s=0.001),
    )
    stats = Scorer(cfg, queue, DoubleIt(), MemoryOutputs(queue), clock=clock).run(RunLimits())
    assert (stats.committed, stats.summary()["items_expired"]) == (1, 1)
