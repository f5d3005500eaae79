"""Unit tests for the pure micro-batcher: fake clock, parametrized tables, no sleeps, no I/O."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from batching import config, models
from batching.policy import batcher


class FakeClock:
    """A settable clock (epoch seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_ids = iter(range(1, 10**9))


def item(
    *,
    enqueued_at: float = 1000.0,
    cost: int = 1,
    priority: int = 0,
    deadline_at: float | None = None,
    item_id: int | None = None,
) -> models.WorkItem:
    """A WorkItem with a fresh id unless one is given."""
    item_id = next(_ids) if item_id is None else item_id
    return models.WorkItem(
        id=item_id,
        item_key=f"k{item_id}",
        payload=models.Payload(b"{}"),
        enqueued_at=enqueued_at,
        priority=priority,
        cost=cost,
        deadline_at=deadline_at,
    )


def policy(**overrides: Any) -> config.BatchingPolicy:
    """A policy with test-friendly defaults: 4 rows, 1 s wait, no cost cap, one bucket."""
    return config.BatchingPolicy(**{"max_batch_size": 4, "max_wait_s": 1.0, **overrides})


def ids(batch: models.Batch | None) -> list[int]:
    assert batch is not None
    return [i.id for i in batch.items]


# --- release reasons --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "costs", "deadline", "advance_s", "flush", "reason", "n_released"),
    [
        ({}, [1, 1, 1, 1], None, 0.0, False, "size", 4),
        ({"max_batch_size": 10, "max_batch_cost": 10}, [4, 4, 4], None, 0.0, False, "cost", 2),
        ({"max_batch_size": 10, "max_batch_cost": 8}, [4, 4], None, 0.0, False, "cost", 2),
        ({}, [1, 1], None, 1.0, False, "wait", 2),
        ({}, [1, 1], None, 0.99, False, None, 0),
        ({"max_wait_s": 10.0}, [1, 1], 1000.5, 0.3, False, "deadline", 2),
        ({"max_wait_s": 10.0}, [1, 1], 1000.5, 0.29, False, None, 0),
        ({}, [1, 1], None, 0.0, True, "flush", 2),
        ({}, [1, 1, 1, 1, 1], None, 0.0, True, "size", 4),
    ],
)
def test_release_reasons(
    overrides: dict[str, Any],
    costs: list[int],
    deadline: float | None,
    advance_s: float,
    flush: bool,
    reason: str | None,
    n_released: int,
) -> None:
    clock = FakeClock()
    b = batcher.MicroBatcher(policy(**overrides), clock, service_time=lambda n, c: 0.2)
    b.add(item(cost=c, deadline_at=deadline) for c in costs)
    clock.advance(advance_s)
    batch = b.poll(flush=flush)
    if reason is None:
        assert batch is None
        assert len(b) == len(costs)
    else:
        assert batch is not None
        assert (batch.reason, len(batch)) == (reason, n_released)
        assert batch.formed_at == clock.now
        assert len(b) == len(costs) - n_released


def test_poll_on_empty_batcher_returns_none() -> None:
    b = batcher.MicroBatcher(policy(), FakeClock())
    assert b.poll() is None
    assert b.poll(flush=True) is None
    assert b.drain() == []
    assert b.next_deadline() is None


# --- wait window anchored at enqueued_at -----------------------------------------------------


@pytest.mark.parametrize(
    ("enqueued_ago_s", "released"),
    [(3600.0, True), (1.0, True), (0.999, False), (0.0, False)],
)
def test_wait_is_measured_from_enqueued_at(enqueued_ago_s: float, released: bool) -> None:
    clock = FakeClock(now=5000.0)
    b = batcher.MicroBatcher(policy(max_wait_s=1.0), clock)
    b.add([item(enqueued_at=clock.now - enqueued_ago_s)])
    batch = b.poll()
    assert (batch is not None) is released
    if batch is not None:
        assert batch.reason == "wait"
        assert batch.stats.oldest_wait_s == pytest.approx(enqueued_ago_s)


# --- deadlines and service time ---------------------------------------------------------------


def test_deadline_release_accounts_for_batch_size_in_service_time() -> None:
    clock = FakeClock(now=0.0)
    b = batcher.MicroBatcher(
        policy(max_batch_size=8, max_wait_s=60.0), clock, service_time=lambda n, c: 0.1 * n
    )
    b.add([item(enqueued_at=0.0, deadline_at=2.0)])
    assert b.next_deadline() == pytest.approx(1.9)
    b.add(item(enqueued_at=0.0) for _ in range(4))
    assert b.next_deadline() == pytest.approx(1.5)  # 5 items take 0.5 s
    clock.now = 1.49
    assert b.poll() is None
    clock.now = 1.5
    batch = b.poll()
    assert batch is not None
    assert (batch.reason, len(batch)) == ("deadline", 5)


def test_service_time_receives_largest_cost() -> None:
    calls: list[tuple[int, int]] = []

    def service_time(n: int, max_cost: int) -> float:
        calls.append((n, max_cost))
        return 0.0

    b = batcher.MicroBatcher(policy(), FakeClock(), service_time=service_time)
    b.add([item(cost=3, deadline_at=2000.0), item(cost=9), item(cost=5)])
    b.next_deadline()
    assert calls[-1] == (3, 9)


def test_past_deadline_releases_at_once_and_is_not_dropped() -> None:
    clock = FakeClock(now=100.0)
    b = batcher.MicroBatcher(policy(max_wait_s=60.0), clock)
    stale = item(enqueued_at=99.0, deadline_at=50.0)
    b.add([stale])
    assert ids(b.poll()) == [stale.id]


# --- size and cost caps -----------------------------------------------------------------------


def test_size_cap_cuts_full_batches_and_keeps_the_rest() -> None:
    b = batcher.MicroBatcher(policy(max_batch_size=4), FakeClock())
    b.add(item() for _ in range(10))
    assert [len(b.poll() or ()) for _ in range(3)] == [4, 4, 0]
    assert len(b) == 2


@pytest.mark.parametrize(
    ("costs", "expected_batches"),
    [
        ([25], [[25]]),  # oversized alone
        ([3, 25, 3], [[3], [25], [3]]),  # cut stops before the oversized one, which then goes alone
        ([6, 4, 5, 5], [[6, 4], [5, 5]]),
        ([10, 10, 1], [[10], [10], [1]]),
    ],
)
def test_cost_cap_and_oversized_items(costs: list[int], expected_batches: list[list[int]]) -> None:
    clock = FakeClock()
    b = batcher.MicroBatcher(policy(max_batch_size=10, max_batch_cost=10), clock)
    b.add(item(enqueued_at=1000.0 + i * 1e-3, cost=c) for i, c in enumerate(costs))
    clock.advance(60.0)  # everything is overdue: each poll releases one batch
    got = [[i.cost for i in batch.items] for batch in iter(b.poll, None)]
    assert got == expected_batches


def test_oversized_item_released_alone_with_reason_cost() -> None:
    b = batcher.MicroBatcher(policy(max_batch_size=10, max_batch_cost=10), FakeClock())
    b.add([item(cost=25)])
    batch = b.poll()
    assert batch is not None
    assert (batch.reason, batch.stats.cost) == ("cost", 25)


# --- length buckets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cost", "edges", "expected"),
    [
        (5, (), 0),
        (1, (8, 32), 0),
        (8, (8, 32), 0),
        (9, (8, 32), 1),
        (32, (8, 32), 1),
        (33, (8, 32), 2),
        (10_000, (8, 32), 2),
    ],
)
def test_bucket_index(cost: int, edges: tuple[int, ...], expected: int) -> None:
    assert batcher.bucket_index(cost, edges) == expected


def test_batches_never_mix_buckets() -> None:
    rng = random.Random(7)
    edges = (8, 32, 128)
    b = batcher.MicroBatcher(policy(max_batch_size=16, length_buckets=edges), FakeClock())
    assert b.n_buckets == 4
    b.add(item(cost=rng.randint(1, 300)) for _ in range(500))
    for batch in b.drain():
        assert {batcher.bucket_index(i.cost, edges) for i in batch.items} == {batch.bucket}


def _mean_padding(batches: Sequence[models.Batch]) -> float:
    return sum(b.stats.padding_efficiency for b in batches) / len(batches)


def test_bucketing_improves_padding_efficiency() -> None:
    costs = [2, 100] * 32  # short and long interleaved

    def run(edges: tuple[int, ...]) -> list[models.Batch]:
        clock = FakeClock()
        b = batcher.MicroBatcher(policy(max_batch_size=8, length_buckets=edges), clock)
        b.add(item(enqueued_at=1000.0 + i * 1e-3, cost=c) for i, c in enumerate(costs))
        return list(iter(b.poll, None))  # online releases (size), not flush

    assert _mean_padding(run(())) == pytest.approx((4 * 2 + 4 * 100) / (8 * 100))
    assert _mean_padding(run((16,))) == 1.0


def test_urgent_bucket_goes_before_full_bucket_not_yet_due() -> None:
    clock = FakeClock(now=1000.0)
    b = batcher.MicroBatcher(policy(max_batch_size=2, length_buckets=(8,)), clock)
    b.add([item(cost=1), item(cost=1)])  # bucket 0: full, not due until 1001
    b.add([item(enqueued_at=990.0, cost=50)])  # bucket 1: overdue
    first, second = b.poll(), b.poll()
    assert first is not None
    assert second is not None
    assert (first.bucket, first.reason) == (1, "wait")
    assert (second.bucket, second.reason) == (0, "size")


# --- ordering ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("specs", "expected_order"),
    [
        # (priority, deadline_at, enqueued_at) -> release order (indices into specs)
        ([(0, None, 1.0), (5, None, 2.0), (1, None, 3.0)], [1, 2, 0]),
        ([(0, None, 1.0), (0, 9.0, 2.0), (0, 5.0, 3.0)], [2, 1, 0]),
        ([(0, None, 3.0), (0, None, 1.0), (0, None, 2.0)], [1, 2, 0]),
        ([(1, None, 3.0), (0, 1.0, 1.0), (1, 8.0, 2.0)], [2, 0, 1]),
    ],
)
def test_priority_then_deadline_then_enqueue_order(
    specs: list[tuple[int, float | None, float]], expected_order: list[int]
) -> None:
    clock = FakeClock(now=0.0)
    b = batcher.MicroBatcher(policy(max_batch_size=1, max_wait_s=100.0), clock)
    items = [item(priority=p, deadline_at=d, enqueued_at=e) for p, d, e in specs]
    b.add(items)
    released = [ids(b.poll()) for _ in items]
    assert released == [[items[i].id] for i in expected_order]


# --- growing while the executor is busy -------------------------------------------------------


def test_batch_keeps_growing_while_busy() -> None:
    clock = FakeClock(now=0.0)
    b = batcher.MicroBatcher(policy(max_batch_size=64, max_wait_s=0.01), clock)
    b.add(item(enqueued_at=0.0) for _ in range(2))
    clock.advance(0.5)  # executor busy: nobody polls
    b.add(item(enqueued_at=0.3) for _ in range(3))
    clock.advance(0.5)
    b.add(item(enqueued_at=0.9) for _ in range(5))
    batch = b.poll()
    assert batch is not None
    assert (batch.reason, len(batch)) == ("wait", 10)


# --- next_deadline ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items_spec", "edges", "expected"),
    [
        ([], (), None),
        ([(1, 999.0, None)], (), 1000.0),  # wait: enqueued + 1 s
        ([(1, 1000.0, 1000.5)], (), 1000.3),  # deadline 1000.5 - 0.2 s service
        ([(1, 1000.0, 1005.0)], (), 1001.0),  # deadline later than wait
        ([(1, 1000.0, None)] * 4, (), 1000.0),  # full: now
        ([(1, 990.0, None)] * 4, (), 991.0),  # full and overdue: its due time
        ([(1, 1000.5, None), (50, 1000.2, None)], (8,), 1001.2),  # min over buckets
    ],
)
def test_next_deadline(
    items_spec: list[tuple[int, float, float | None]],
    edges: tuple[int, ...],
    expected: float | None,
) -> None:
    clock = FakeClock(now=1000.0)
    b = batcher.MicroBatcher(policy(length_buckets=edges), clock, service_time=lambda n, c: 0.2)
    b.add(item(cost=c, enqueued_at=e, deadline_at=d) for c, e, d in items_spec)
    got = b.next_deadline()
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_poll_releases_exactly_at_next_deadline() -> None:
    clock = FakeClock(now=0.0)
    b = batcher.MicroBatcher(policy(max_wait_s=0.25), clock)
    b.add([item(enqueued_at=0.1)])
    due = b.next_deadline()
    assert due is not None
    assert due == pytest.approx(0.35)
    clock.now = due - 1e-9
    assert b.poll() is None
    clock.now = due
    assert b.poll() is not None
    assert b.next_deadline() is None


# --- flush and drain --------------------------------------------------------------------------


def test_flush_yields_full_length_sorted_batches() -> None:
    rng = random.Random(3)
    b = batcher.MicroBatcher(policy(max_batch_size=10, max_wait_s=60.0), FakeClock())
    costs = [rng.randint(1, 512) for _ in range(100)]
    b.add(item(cost=c) for c in costs)
    batches = b.drain()
    assert [len(x) for x in batches] == [10] * 10
    for batch in batches:
        got = [i.cost for i in batch.items]
        assert got == sorted(got)
    ranked = sorted(costs)
    chunks = [ranked[i : i + 10] for i in range(0, 100, 10)]
    best = sum(sum(c) / (10 * max(c)) for c in chunks) / 10  # sorted consecutive cut (optimum)
    assert _mean_padding(batches) >= 0.9 * best


def test_flush_padding_beats_in_order_cutting() -> None:
    rng = random.Random(11)
    costs = [rng.randint(1, 512) for _ in range(400)]

    def run(flush: bool) -> list[models.Batch]:
        b = batcher.MicroBatcher(policy(max_batch_size=16, max_wait_s=60.0), FakeClock())
        b.add(item(enqueued_at=1000.0 + i * 1e-3, cost=c) for i, c in enumerate(costs))
        return list(iter(lambda: b.poll(flush=flush), None))

    assert _mean_padding(run(flush=True)) > _mean_padding(run(flush=False)) + 0.2


def test_flush_batch_is_anchored_on_most_urgent_item() -> None:
    b = batcher.MicroBatcher(policy(max_batch_size=2, max_wait_s=60.0), FakeClock())
    shorts = [item(cost=1) for _ in range(10)]
    long = item(cost=500, priority=1)
    b.add([*shorts, long])
    first = b.poll(flush=True)
    assert first is not None
    assert long in first.items


def test_interleaved_flush_does_not_starve_long_items() -> None:
    clock = FakeClock(now=0.0)
    b = batcher.MicroBatcher(policy(max_batch_size=4, max_wait_s=60.0), clock)
    long = item(enqueued_at=0.0, cost=400)
    b.add([long])
    released: set[int] = set()
    for step in range(1, 6):
        clock.now = float(step)
        b.add(item(enqueued_at=clock.now, cost=1) for _ in range(8))
        released.update(ids(b.poll(flush=True)))
    assert long.id in released


@pytest.mark.parametrize("seed", range(25))
def test_every_item_released_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    edges = tuple(sorted(rng.sample(range(1, 200), rng.randint(0, 4))))
    max_cost = rng.choice([None, 50, 300])
    pol = policy(
        max_batch_size=rng.randint(1, 32),
        max_batch_cost=max_cost,
        max_wait_s=rng.choice([0.0, 0.05, 1.0]),
        length_buckets=edges,
    )
    clock = FakeClock(now=0.0)
    b = batcher.MicroBatcher(pol, clock, service_time=lambda n, c: 1e-4 * n * c)
    added: list[models.WorkItem] = []
    batches: list[models.Batch] = []
    for _ in range(rng.randint(1, 40)):
        new = [
            item(
                enqueued_at=clock.now - rng.random(),
                cost=rng.randint(0, 400),
                priority=rng.randint(0, 2),
                deadline_at=rng.choice([None, clock.now + rng.random()]),
            )
            for _ in range(rng.randint(0, 30))
        ]
        b.add(new)
        added.extend(new)
        clock.advance(rng.random() * 0.1)
        if (batch := b.poll(flush=rng.random() < 0.2)) is not None:
            batches.append(batch)
    batches.extend(b.drain())

    counts = Counter(i.id for batch in batches for i in batch.items)
    assert counts == Counter(i.id for i in added)
    assert len(b) == 0
    for batch in batches:
        _check_batch_invariants(batch, pol)


def _check_batch_invariants(batch: models.Batch, pol: config.BatchingPolicy) -> None:
    assert 1 <= len(batch) <= pol.max_batch_size
    assert batch.reason in {"size", "cost", "wait", "deadline", "flush"}
    assert batch.stats.size == len(batch)
    assert batch.stats.cost == sum(i.cost for i in batch.items)
    if pol.max_batch_cost is not None and len(batch) > 1:
        assert batch.stats.cost <= pol.max_batch_cost
    buckets = {batcher.bucket_index(i.cost, pol.length_buckets) for i in batch.items}
    assert buckets == {batch.bucket}


def test_duplicate_pending_id_is_rejected_and_nothing_added() -> None:
    b = batcher.MicroBatcher(policy(), FakeClock())
    b.add([item(item_id=1)])
    with pytest.raises(ValueError, match="already pending"):
        b.add([item(item_id=2), item(item_id=1)])
    with pytest.raises(ValueError, match="already pending"):
        b.add([item(item_id=3), item(item_id=3)])
    assert len(b) == 1
    b.drain()
    b.add([item(item_id=1)])  # released ids may come back (retry)
    assert len(b) == 1


def test_negative_cost_is_rejected() -> None:
    b = batcher.MicroBatcher(policy(), FakeClock())
    with pytest.raises(ValueError, match="cost -1"):
        b.add([item(cost=-1)])


def test_fifty_thousand_pending_items() -> None:
    rng = random.Random(5)
    clock = FakeClock(now=0.0)
    pol = policy(max_batch_size=64, max_wait_s=0.0, length_buckets=(32, 128, 512))
    b = batcher.MicroBatcher(pol, clock, service_time=lambda n, c: 1e-5 * n)
    b.add(
        item(enqueued_at=rng.random(), cost=rng.randint(1, 1000), priority=rng.randint(0, 3))
        for _ in range(50_000)
    )
    clock.now = 1.0
    online = [b.poll() for _ in range(200)]
    assert all(batch is not None for batch in online)
    rest = b.drain()
    assert sum(len(x) for x in rest) + sum(len(x or ()) for x in online) == 50_000


# --- stats ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("costs", "enqueued", "formed_at", "expected"),
    [
        ([4, 4], [9.0, 9.0], 10.0, models.BatchStats(2, 8, 0.5, 1.0, 1.0, 1.0)),
        ([1, 3], [7.0, 9.0], 10.0, models.BatchStats(2, 4, 0.5, 4 / 6, 3.0, 2.0)),
        ([2, 2, 8, 4], [10.0] * 4, 10.0, models.BatchStats(4, 16, 1.0, 0.5, 0.0, 0.0)),
        ([0, 0], [11.0, 10.0], 10.0, models.BatchStats(2, 0, 0.5, 1.0, 0.0, 0.0)),
    ],
)
def test_batch_stats(
    costs: list[int], enqueued: list[float], formed_at: float, expected: models.BatchStats
) -> None:
    items = [item(cost=c, enqueued_at=e) for c, e in zip(costs, enqueued, strict=True)]
    got = batcher.batch_stats(items, formed_at, max_batch_size=4)
    _assert_stats(got, expected)


def _assert_stats(got: models.BatchStats, expected: models.BatchStats) -> None:
    assert (got.size, got.cost) == (expected.size, expected.cost)
    assert got.fill == pytest.approx(expected.fill)
    assert got.padding_efficiency == pytest.approx(expected.padding_efficiency)
    assert got.oldest_wait_s == pytest.approx(expected.oldest_wait_s)
    assert got.mean_wait_s == pytest.approx(expected.mean_wait_s)


def test_released_batch_carries_stats_and_bucket() -> None:
    clock = FakeClock(now=10.0)
    b = batcher.MicroBatcher(policy(max_batch_size=4, length_buckets=(2,)), clock)
    b.add([item(cost=3, enqueued_at=8.0), item(cost=6, enqueued_at=9.0)])
    batch = b.poll()
    assert batch is not None
    assert (batch.bucket, batch.reason, batch.formed_at) == (1, "wait", 10.0)
    _assert_stats(batch.stats, models.BatchStats(2, 9, 0.5, 9 / 12, 2.0, 1.5))


@pytest.mark.parametrize("seed", range(20))
def test_cuts_match_a_full_sort_of_the_pending_items_whatever_the_add_order(seed: int) -> None:
    """Claims arrive in runs that interleave (a retried old item, a higher priority): each
    size-triggered batch is still the first ``max_batch_size`` pending items by (priority
    high first, deadline, enqueued_at, arrival), exactly as sorting everything would give."""
    rng = random.Random(seed)
    clock = FakeClock()
    b = batcher.MicroBatcher(policy(max_batch_size=5, max_wait_s=1e9), clock)
    pending: list[tuple[tuple[int, float, float, int], models.WorkItem]] = []
    arrival = 0
    for _ in range(30):
        run = [
            item(
                priority=rng.choice([0, 0, 0, 1, 5]),
                enqueued_at=1000.0 + rng.randrange(50),
                deadline_at=rng.choice([None, None, 5000.0 + rng.randrange(50)]),
            )
            for _ in range(rng.randrange(1, 12))
        ]
        b.add(run)
        for i in run:
            deadline = float("inf") if i.deadline_at is None else i.deadline_at
            pending.append(((-i.priority, deadline, i.enqueued_at, arrival), i))
            arrival += 1
        for _ in range(rng.randrange(0, 3)):
            batch = b.poll()
            if len(pending) < 5:
                assert batch is None
                continue
            pending.sort(key=lambda entry: entry[0])
            assert ids(batch) == [i.id for _, i in pending[:5]]
            del pending[:5]
    assert sorted(i.id for batch in b.drain() for i in batch.items) == sorted(
        i.id for _, i in pending
    )
