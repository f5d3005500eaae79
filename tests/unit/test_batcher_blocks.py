"""The micro-batcher's ItemBlock path against its item path: the same claims, once as blocks
and once as work items, must give the same batches (fake clock, seeded random workloads)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from batching import config, models
from batching.policy import batcher

_PAYLOAD = models.Payload(b"", models.PayloadFormat.TENSOR, "float32", (2,))


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def block(
    first_id: int, n: int, enqueued_at: float, *, cost: int = 2, priority: int = 0
) -> models.ItemBlock:
    """``n`` uniform items, ids and enqueue times increasing (claim order)."""
    template = models.WorkItem(0, "", _PAYLOAD, 0.0, cost=cost, priority=priority)
    ids = list(range(first_id, first_id + n))
    data = b"".join(i.to_bytes(8, "little") for i in ids)
    return models.ItemBlock(
        template,
        ids,
        [f"k{i}" for i in ids],
        [enqueued_at + 0.001 * k for k in range(n)],
        [1] * n,
        [5] * n,
        data,
    )


def described(batch: models.Batch | None) -> Any:
    if batch is None:
        return None
    return (list(batch.items), batch.reason, batch.formed_at, batch.stats, batch.bucket)


def test_a_block_is_a_sequence_of_the_items_it_holds() -> None:
    b = block(10, 5, 100.0, cost=3, priority=2)
    items = list(b)
    assert [i.id for i in items] == [10, 11, 12, 13, 14]
    assert items[2] == b[2] == b[-3]
    assert items[2].payload.data == (12).to_bytes(8, "little")
    assert (items[2].cost, items[2].priority, items[2].enqueued_at) == (3, 2, 100.002)
    assert list(b[1:3]) == items[1:3]
    assert list(models.ItemBlock.join([b[:2], b[2:]])) == items
    assert models.item_column(b[3:], "id") == [13, 14]
    with pytest.raises(IndexError):
        b[5]


@pytest.mark.parametrize("seed", range(40))
def test_blocks_release_the_same_batches_as_their_items(seed: int) -> None:
    rng = random.Random(seed)
    pol = config.BatchingPolicy(
        max_batch_size=rng.choice([1, 3, 4, 8]),
        max_wait_s=rng.choice([0.0, 0.05, 1.0]),
        max_batch_cost=rng.choice([None, 5, 9, 40]),
        length_buckets=rng.choice([[], [2], [1, 4]]),
    )
    clock_a, clock_b = FakeClock(), FakeClock()
    by_block = batcher.MicroBatcher(pol, clock_a)
    by_item = batcher.MicroBatcher(pol, clock_b)
    next_id, released = 1, 0
    for _ in range(60):
        step = rng.random()
        if step < 0.3:  # a claim: uniform (a block), or now and then a single odd item
            if rng.random() < 0.85:
                claim: Any = block(
                    next_id,
                    rng.randint(1, 12),
                    clock_a.now - rng.random() * 0.01,
                    cost=rng.choice([0, 1, 2, 6]),
                    priority=rng.choice([0, 0, 0, 1]),
                )
            else:
                claim = (models.WorkItem(next_id, f"k{next_id}", _PAYLOAD, clock_a.now, cost=1),)
            next_id += len(claim)
            by_block.add(claim)
            by_item.add(tuple(claim))
        elif step < 0.45:
            clock_a.now += rng.random() * 0.1
            clock_b.now = clock_a.now
        else:
            flush = rng.random() < 0.2
            assert by_block.next_deadline() == by_item.next_deadline()
            got, want = by_block.poll(flush=flush), by_item.poll(flush=flush)
            assert described(got) == described(want)
            released += len(want or ())
        assert len(by_block) == len(by_item)
    rest = [described(b) for b in by_block.drain()]
    assert rest == [described(b) for b in by_item.drain()]
    assert len(by_block) == 0


def test_full_batches_of_a_block_are_slices_not_items() -> None:
    b = batcher.MicroBatcher(config.BatchingPolicy(max_batch_size=4, max_wait_s=1.0), FakeClock())
    b.add(block(1, 10, 999.0))
    first = b.poll()
    assert first is not None
    assert isinstance(first.items, models.ItemBlock)
    assert (models.item_column(first.items, "id"), first.reason) == ([1, 2, 3, 4], "size")
    second = b.poll()
    assert second is not None
    assert models.item_column(second.items, "id") == [5, 6, 7, 8]
    assert b.poll() is None  # 2 left, not due: they wait in a bucket like any item
    assert len(b) == 2


def test_a_repeated_id_is_refused_by_name_as_for_items() -> None:
    b = batcher.MicroBatcher(config.BatchingPolicy(max_batch_size=4, max_wait_s=1.0), FakeClock())
    b.add(block(1, 8, 999.0))
    with pytest.raises(ValueError, match=r"item 3 .* already pending"):
        b.add(block(3, 2, 999.5))
