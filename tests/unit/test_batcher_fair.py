"""Tenant fair share in batch forming (``MicroBatcher(fair=...)``): a bucket holding several
tenants' items cuts them as a fair claim ranks them; one tenant's batches are unchanged."""

from __future__ import annotations

import collections
import itertools
import random
from typing import Any

import pytest

from batching import config, models, tenant_share, testing
from batching.policy import adaptive, batcher

_PAYLOAD = models.Payload(b"", models.PayloadFormat.TENSOR, "float32", (2,))
_ids = itertools.count(1)


def new_clock() -> testing.FakeClock:
    """A fake clock at the items' times."""
    return testing.FakeClock(1000.0)


def items(
    tenant: str, n: int, enqueued_at: float, *, priority: int = 0, cost: int = 1
) -> list[models.WorkItem]:
    """``n`` items of ``tenant``, enqueued a millisecond apart from ``enqueued_at``."""
    return [
        models.WorkItem(
            i,
            f"{tenant}-{i}",
            _PAYLOAD,
            enqueued_at + 0.001 * k,
            tenant=tenant,
            priority=priority,
            cost=cost,
        )
        for k, i in enumerate(itertools.islice(_ids, n))
    ]


def fair_batcher(
    clock: testing.FakeClock,
    weights: dict[str, float] | None = None,
    wait_s: float = 30.0,
    **pol: Any,
) -> batcher.MicroBatcher:
    policy = config.BatchingPolicy(**{"max_batch_size": 8, "max_wait_s": 0.0, **pol})
    share = tenant_share.FairShare(weights or {}, max_tenant_wait_s=wait_s)
    return batcher.MicroBatcher(policy, clock, fair=share)


def tenants(batch: models.Batch | None) -> collections.Counter[str]:
    assert batch is not None
    return collections.Counter(i.tenant for i in batch.items)


def test_a_flood_does_not_hold_back_a_tenant_that_came_later() -> None:
    clock = new_clock()
    fair = fair_batcher(clock)
    plain = batcher.MicroBatcher(config.BatchingPolicy(max_batch_size=8, max_wait_s=0.0), clock)
    flood, quiet = items("flood", 1000, 900.0), items("quiet", 10, 990.0)
    for b in (fair, plain):
        b.add(flood + quiet)
    assert tenants(fair.poll()) == {"flood": 4, "quiet": 4}
    assert tenants(fair.poll()) == {"flood": 4, "quiet": 4}
    assert tenants(fair.poll()) == {"flood": 6, "quiet": 2}  # quiet's last two, then flood
    assert tenants(fair.poll()) == {"flood": 8}
    assert tenants(plain.poll()) == {"flood": 8}  # without: 125 batches before quiet's first


def test_a_flush_cuts_by_length_and_fairly() -> None:
    clock = new_clock()
    b = fair_batcher(clock, max_wait_s=10.0)
    b.add(items("flood", 100, 900.0, cost=3) + items("quiet", 4, 990.0, cost=3))
    b.add(items("flood", 100, 950.0, cost=5))
    first = b.poll(flush=True)
    assert tenants(first) == {"flood": 4, "quiet": 4}
    assert first is not None
    assert {i.cost for i in first.items} == {3}  # nearest in cost


def test_weights_split_each_batch() -> None:
    clock = new_clock()
    b = fair_batcher(clock, {"gold": 2.0}, max_batch_size=9)
    b.add(items("gold", 100, 900.0) + items("bulk", 100, 900.0))
    seen = [tenants(b.poll()) for _ in range(4)]
    assert all(s == {"gold": 6, "bulk": 3} for s in seen)


def test_within_a_tenant_the_order_is_priority_then_age() -> None:
    clock = new_clock()
    b = fair_batcher(clock, max_batch_size=4)
    a_low, a_high = items("a", 3, 900.0), items("a", 3, 950.0, priority=5)
    b.add(a_low + a_high + items("b", 4, 900.0))
    batch = b.poll()
    assert batch is not None
    assert [i.id for i in batch.items if i.tenant == "a"] == [a_high[0].id, a_high[1].id]


def test_an_aged_tenant_goes_first_whatever_its_weight() -> None:
    clock = new_clock()
    b = fair_batcher(clock, {"heavy": 1000.0}, wait_s=5.0, max_batch_size=4)
    b.add(items("heavy", 400, 900.0) + items("light", 5, 900.5))
    assert tenants(b.poll()) == {"heavy": 3, "light": 1}  # both start fresh: one each, then tags
    assert tenants(b.poll()) == {"heavy": 4}  # light's next tag is 1, heavy's 0.004: far behind
    clock.now += 5.0  # light not served for max_tenant_wait_s: its next item ranks first
    assert tenants(b.poll()) == {"heavy": 3, "light": 1}
    assert tenants(b.poll()) == {"heavy": 4}


def block(tenant: str, n: int, enqueued_at: float, cost: int) -> models.ItemBlock:
    """A uniform claim of ``n`` of ``tenant``'s items (one cost, all enqueued at once)."""
    template = models.WorkItem(0, "", _PAYLOAD, 0.0, tenant=tenant, cost=cost)
    ids = list(itertools.islice(_ids, n))
    data = b"".join(i.to_bytes(8, "little") for i in ids)
    return models.ItemBlock(
        template, ids, [f"k{i}" for i in ids], [enqueued_at] * n, [1] * n, [5] * n, data
    )


def test_blocks_of_two_tenants_are_cut_fairly() -> None:
    clock = new_clock()
    b = fair_batcher(clock)
    b.add(block("flood", 800, 900.0, cost=2))
    b.add(block("quiet", 8, 900.0, cost=2))
    assert tenants(b.poll()) == {"flood": 4, "quiet": 4}


@pytest.mark.parametrize("seed", range(20))
def test_one_tenant_is_cut_as_without_fair_share(seed: int) -> None:
    rng = random.Random(seed)
    pol = config.BatchingPolicy(
        max_batch_size=rng.choice([1, 3, 8]),
        max_wait_s=rng.choice([0.0, 0.05]),
        max_batch_cost=rng.choice([None, 9, 40]),
        length_buckets=rng.choice([[], [2], [1, 4]]),
    )
    clock = new_clock()
    fair = batcher.MicroBatcher(pol, clock, fair=tenant_share.FairShare())
    plain = batcher.MicroBatcher(pol, clock)
    for _ in range(40):
        if rng.random() < 0.4:
            claim = items("one", rng.randint(1, 20), clock.now, cost=rng.choice([1, 2, 6]))
            fair.add(claim)
            plain.add(claim)
        clock.now += rng.random() * 0.03
        flush = rng.random() < 0.2
        assert fair.poll(flush=flush) == plain.poll(flush=flush)
    assert fair.drain() == plain.drain()


@pytest.mark.parametrize("seed", range(100))
def test_many_tenants_every_item_once_and_aging_bounds_the_wait(seed: int) -> None:
    rng = random.Random(seed)
    clock = new_clock()
    wait_s = 0.3
    b = fair_batcher(
        clock,
        {"t0": 4.0, "t1": 0.5},
        wait_s=wait_s,
        max_batch_size=rng.choice([2, 5, 8]),
        length_buckets=rng.choice([[], [2]]),
    )
    one_bucket = not b._edges
    added: set[int] = set()
    released: list[int] = []
    since: dict[str, float] = {}  # tenant -> when it last had an item released, or came
    for _ in range(300):
        if rng.random() < 0.3:
            tenant = rng.choice(["t0", "t1", "t2", "t3"])
            claim = items(tenant, rng.randint(1, 30), clock.now, cost=rng.choice([1, 2, 3]))
            b.add(claim)
            added.update(i.id for i in claim)
        clock.now += 0.01
        batch = b.poll(flush=rng.random() < 0.1)
        if batch is None:  # max_wait_s 0: something is due whenever anything is pending
            assert len(b) == 0
            continue
        released.extend(i.id for i in batch.items)
        assert len(batch.items) <= b._policy.max_batch_size
        pending = {i.tenant for i in _pending(b)}
        for tenant in {i.tenant for i in batch.items} | (set(since) - pending):
            since.pop(tenant, None)
        for tenant in pending:
            since.setdefault(tenant, clock.now)
            # aged after wait_s, then served by the next cut (across buckets, turns go by
            # age: under overload a tenant whose items are all in the younger bucket waits)
            if one_bucket:
                assert clock.now - since[tenant] <= wait_s + 0.02, (tenant, clock.now, since)
    released.extend(i.id for batch in b.drain() for i in batch.items)
    assert sorted(released) == sorted(added)


def _pending(b: batcher.MicroBatcher) -> list[models.WorkItem]:
    return [i for bucket in b._buckets for i in bucket.items.values()]


# --- light tenants first (adaptive) ------------------------------------------------------------


def light_batcher(
    clock: testing.FakeClock,
    slo_s: float = 10.0,
    late_policy: batcher.LatePolicy = "score",
    default_deadline_s: float | None = None,
    **pol: Any,
) -> batcher.MicroBatcher:
    """Adaptive and fair, buckets <= 10, 20, 30 and above, on an idle model that costs
    ``10 ms + 1 ms * n * cost / 10``: padding costs more than a pass saves, so the controller
    merges no buckets on its own (``_fill``) and only the light-tenant rule mixes them."""
    policy = config.BatchingPolicy(
        **{"max_batch_size": 8, "max_wait_s": 0.05, "length_buckets": [10, 20, 30], **pol}
    )
    model = adaptive.ServiceModel(lambda n, c: 0.010 + 0.0001 * n * c, n_ref=8, c_ref=30)
    return batcher.MicroBatcher(
        policy,
        clock,
        adaptive=adaptive.SloController(slo_s, model),
        fair=tenant_share.FairShare(),
        late_policy=late_policy,
        default_deadline_s=default_deadline_s,
    )


def flood_and_quiet(b: batcher.MicroBatcher) -> tuple[models.WorkItem, models.WorkItem]:
    """A flood of 40 items in each bucket (the oldest), then one quiet item of cost 25 and,
    younger still, one of cost 5. Returns the quiet items."""
    for cost in (5, 15, 25, 35):
        b.add(items("flood", 40, 995.0, cost=cost))
    long_one, short_one = items("quiet", 1, 998.0, cost=25), items("quiet", 1, 999.0, cost=5)
    b.add(long_one + short_one)
    return long_one[0], short_one[0]


def test_a_light_tenant_goes_next_and_its_shorter_items_ride_along() -> None:
    clock = new_clock()
    b = light_batcher(clock)
    long_one, short_one = flood_and_quiet(b)
    batch = b.poll()
    assert batch is not None
    assert batch.bucket == 2  # the quiet tenant's oldest item's bucket, not the flood's turn
    assert long_one in batch.items
    assert short_one in batch.items  # rode in from the cost-5 bucket, padded to 25
    assert tenants(batch) == {"flood": 6, "quiet": 2}  # the flood made room: 8 in all
    # no light item pending: the buckets' own turn again (the longest is the most urgent)
    after = b.poll()
    assert after is not None
    assert after.bucket == 3
    assert tenants(after) == {"flood": 8}


def test_tenants_of_one_rate_keep_the_buckets_turns() -> None:
    clock = new_clock()
    b = light_batcher(clock)
    for cost in (5, 15, 25):
        b.add(items("a", 20, 995.0 + cost / 100, cost=cost))
        b.add(items("b", 20, 995.0 + cost / 100, cost=cost))
    assert b._light_tenants() == set()
    first = b.poll()
    assert first is not None
    assert first.bucket == 0
    assert tenants(first) == {"a": 4, "b": 4}


def test_a_bucket_whose_budget_is_spent_keeps_its_turn() -> None:
    """SLO 5 s: the flood's oldest items (995.0) are past their budget at 1000, so the most
    urgent of their buckets (the longest: its pass is the longest) goes first, light tenant
    or not."""
    clock = new_clock()
    b = light_batcher(clock, slo_s=5.0)
    flood_and_quiet(b)
    batch = b.poll()
    assert batch is not None
    assert batch.bucket == 3
    assert tenants(batch) == {"flood": 8}


def test_riders_keep_the_padded_batch_within_the_cost_cap() -> None:
    """max_batch_cost 150: the cost-25 bucket's cut leaves room for one rider of the two
    quiet cost-5 items once the batch is padded to 25 (6 x 25 = 150)."""
    clock = new_clock()
    b = light_batcher(clock, max_batch_cost=150)
    for cost in (5, 25):
        b.add(items("flood", 40, 995.0, cost=cost))
    b.add(items("quiet", 1, 998.0, cost=25) + items("quiet", 2, 999.0, cost=5))
    batch = b.poll()
    assert batch is not None
    assert len(batch) * max(i.cost for i in batch.items) <= 150
    assert tenants(batch) == {"flood": 4, "quiet": 2}
    assert sorted(i.cost for i in batch.items if i.tenant == "quiet") == [5, 25]


def test_the_turns_own_light_item_and_priority_come_before_riders() -> None:
    """The quiet tenant's most urgent item (priority 9, cost 25) chose its bucket: it is in
    the batch, not crowded out by the five short riders; with room for three riders, the
    priority-5 one goes before older ones."""
    clock = new_clock()
    b = light_batcher(clock, max_batch_size=4)
    for cost in (5, 25):
        b.add(items("flood", 40, 995.0, cost=cost))
    long_one = items("quiet", 1, 999.0, cost=25, priority=9)
    urgent = items("quiet", 1, 999.0, cost=5, priority=5)
    b.add(long_one + items("quiet", 4, 998.5, cost=5) + urgent)
    batch = b.poll()
    assert batch is not None
    assert batch.bucket == 2
    assert long_one[0] in batch.items
    assert urgent[0] in batch.items
    assert tenants(batch) == {"quiet": 4}  # it leads its bucket, then three of five riders


def test_riders_that_would_make_the_turns_item_late_stay_behind() -> None:
    """A quiet item whose own deadline a batch of two meets and one of three does not: one
    short quiet item rides, the other six wait for their own turn, and it is not expired."""
    clock = new_clock()
    b = light_batcher(clock, late_policy="expire")
    ctrl = b._adaptive
    assert ctrl is not None
    for cost in (5, 15, 35):
        b.add(items("flood", 40, 995.0, cost=cost))
    deadline = ctrl.finish_at(clock.now, 2, 25) + 0.00001
    assert deadline < ctrl.finish_at(clock.now, 3, 25)
    urgent = models.WorkItem(
        next(_ids), "u", _PAYLOAD, 998.0, tenant="quiet", cost=25, deadline_at=deadline
    )
    b.add([urgent, *items("quiet", 7, 999.0, cost=5)])
    batch = b.poll()
    assert batch is not None
    assert batch.bucket == 2
    assert urgent in batch.items
    assert sorted(i.cost for i in batch.items) == [5, 25]
    assert b.take_late() == []


def test_riders_board_only_while_the_most_urgent_buckets_budget_holds() -> None:
    """The flood's cost-15 bucket must go 2 ms after a one-item light pass of cost 35 would
    end: the light item goes alone, its seven short riders stay behind, and the flood's
    bucket goes next with nothing expired (seven riders made the pass outlast that budget)."""
    clock = new_clock()
    b = light_batcher(clock, slo_s=1.0, late_policy="expire", default_deadline_s=1.0)
    ctrl = b._adaptive
    assert ctrl is not None
    size = ctrl.model.efficient_size(15, 8)
    budget = ctrl.finish_bound_s(size, 15) + ctrl.finish_bound_s(1, 35) + 0.002
    b.add(items("flood", 100, clock.now - 1.0 + budget, cost=15))
    b.add(items("quiet", 1, clock.now - 0.01, cost=35, priority=1))
    b.add(items("quiet", 7, clock.now - 0.01, cost=5))
    first = b.poll()
    assert first is not None
    assert tenants(first) == {"quiet": 1}
    clock.now += ctrl.finish_bound_s(1, 35)
    second = b.poll()
    assert second is not None
    assert tenants(second) == {"flood": 8}
    assert b.take_late() == []


def test_rows_kept_for_riders_that_cannot_board_go_to_the_buckets_own_items() -> None:
    """Seven short quiet items whose deadline no pass padded to 25 with a second item meets
    (the model busy for 100 ms): none boards, and the rows kept for them go to the cost-25
    bucket's flood items, a full batch rather than one item."""
    clock = new_clock()
    b = light_batcher(clock)
    ctrl = b._adaptive
    assert ctrl is not None
    for cost in (5, 25):
        b.add(items("flood", 40, 995.0, cost=cost))
    long_one = items("quiet", 1, 999.0, cost=25, priority=1)
    b.add(long_one)
    ctrl.forward_started(8, 35, clock.now + 0.1 - ctrl.model.predict(8, 35))  # busy 100 ms
    deadline = (ctrl.finish_at(clock.now, 1, 25) + ctrl.finish_at(clock.now, 2, 25)) / 2
    b.add(
        [
            models.WorkItem(
                next(_ids), f"r{k}", _PAYLOAD, 999.5, tenant="quiet", cost=5, deadline_at=deadline
            )
            for k in range(7)
        ]
    )
    batch = b.poll()
    assert batch is not None
    assert batch.bucket == 2
    assert long_one[0] in batch.items
    assert tenants(batch) == {"quiet": 1, "flood": 7}


def test_no_light_turn_that_would_spend_the_most_urgent_buckets_budget() -> None:
    """The flood's cost-35 bucket must go within 5 ms; a light pass first would take longer,
    so it goes, and nothing of the flood is expired."""
    clock = new_clock()
    b = light_batcher(clock, slo_s=1.0, late_policy="expire", default_deadline_s=1.0)
    ctrl = b._adaptive
    assert ctrl is not None
    oldest = clock.now - 1.0 + ctrl.finish_bound_s(8, 35) + 0.005
    b.add(items("flood", 8, oldest, cost=35))
    b.add(items("flood", 40, clock.now - 0.5, cost=15))
    b.add(items("quiet", 8, clock.now - 0.1, cost=25))
    batch = b.poll()
    assert batch is not None
    assert batch.bucket == 3
    assert tenants(batch) == {"flood": 8}
    assert b.take_late() == []


def test_no_tenant_is_light_without_a_heavier_one_pending_or_among_many_small_ones() -> None:
    clock = new_clock()
    b = light_batcher(clock)
    b.add(items("flood", 80, 999.0, cost=15))
    while b.poll(flush=True):  # the flood is served: nothing of it pending
        pass
    b.add(items("a", 3, 999.5, cost=5) + items("b", 3, 999.5, cost=25))
    assert b._light_tenants() == set()
    many = light_batcher(clock)  # six tenants at 1/10 of the flood each: 6/16 of arrivals
    many.add(items("flood", 100, 999.0, cost=15))
    for k in range(6):
        many.add(items(f"q{k}", 10, 999.5, cost=5))
    assert many._light_tenants() == set()
    few = light_batcher(clock)  # three of them: 3/13
    few.add(items("flood", 100, 999.0, cost=15))
    for k in range(3):
        few.add(items(f"q{k}", 10, 999.5, cost=5))
    assert few._light_tenants() == {"q0", "q1", "q2"}


def test_a_flood_of_blocks_counts_as_arrivals() -> None:
    clock = new_clock()
    b = light_batcher(clock)
    b.add(block("flood", 64, 999.0, cost=15))
    b.add(items("quiet", 2, 999.5, cost=25))
    assert b._light_tenants() == {"quiet"}
    with pytest.raises(ValueError, match="already pending"):  # refused: nothing counted
        b.add([b._buckets[2].items[next(iter(b._buckets[2].items))]] * 1000)
    assert b._light_tenants() == {"quiet"}


@pytest.mark.parametrize("seed", range(50))
def test_light_tenants_every_item_once_within_the_caps(seed: int) -> None:
    rng = random.Random(seed)
    clock = new_clock()
    max_cost = rng.choice([None, 120, 400])
    b = light_batcher(clock, max_batch_size=rng.choice([2, 5, 8]), max_batch_cost=max_cost)
    rates = {"flood": 0.9, "t1": 0.1, "t2": 0.05, "t3": 0.3}
    added: set[int] = set()
    released: list[int] = []
    for _ in range(300):
        for tenant, p in rates.items():
            if rng.random() < p:
                claim = items(tenant, rng.randint(1, 12), clock.now, cost=rng.randint(1, 40))
                b.add(claim)
                added.update(i.id for i in claim)
        clock.now += 0.01
        batch = b.poll(flush=rng.random() < 0.05)
        if batch is None:
            continue
        released.extend(i.id for i in batch.items)
        assert len(batch) <= b._policy.max_batch_size
        if max_cost is not None and len(batch) > 1:
            assert len(batch) * max(i.cost for i in batch.items) <= max_cost or (
                len({b._bucket_of(i.cost) for i in batch.items}) == 1  # a bucket's own cut
            )
    released.extend(i.id for batch in b.drain() for i in batch.items)
    assert sorted(released) == sorted(added)


def _trace_p99s(seed: int) -> dict[str, float]:
    """A flood at ~75% of capacity and three quiet tenants at 1/10 of its rate each, their
    items added as they arrive, through one simulated server whose pass costs 5 ms plus
    0.07 ms a token of its padded batch (W2's shape: lengths 8-128, 8 buckets). Returns the
    quiet tenants' and the flood's p99, arrival to the end of their pass."""
    rng = random.Random(seed)
    clock = new_clock()
    policy = config.BatchingPolicy(
        max_batch_size=32, max_wait_s=0.05, length_buckets=[16, 32, 48, 64, 80, 96, 112]
    )
    model = adaptive.ServiceModel(lambda n, c: 0.005 + 0.00007 * n * c, n_ref=32, c_ref=112)
    ctrl = adaptive.SloController(1.0, model)
    b = batcher.MicroBatcher(policy, clock, adaptive=ctrl, fair=tenant_share.FairShare())
    rates = {"flood": 120.0, "q1": 12.0, "q2": 12.0, "q3": 12.0}
    arrivals = sorted(
        (clock.now + t, tenant)
        for tenant, rate in rates.items()
        for t in itertools.accumulate(rng.expovariate(rate) for _ in range(int(rate * 30)))
    )
    waits: dict[str, list[float]] = collections.defaultdict(list)
    busy_until, i = clock.now, 0
    for _ in range(100 * len(arrivals)):
        if i >= len(arrivals) and not len(b):
            break
        due = b.next_deadline() if len(b) else None
        nxt = min(
            arrivals[i][0] if i < len(arrivals) else float("inf"),
            max(busy_until, due) if due is not None else float("inf"),
        )
        clock.now = max(clock.now, nxt)
        while i < len(arrivals) and arrivals[i][0] <= clock.now:
            at, tenant = arrivals[i]
            b.add(
                [
                    models.WorkItem(
                        next(_ids), f"t{i}", _PAYLOAD, at, tenant=tenant, cost=rng.randint(8, 128)
                    )
                ]
            )
            i += 1
        if clock.now < busy_until:
            continue
        batch = b.poll()
        if batch is None:
            continue
        cost = max(item.cost for item in batch.items)
        ctrl.forward_started(len(batch), cost, clock.now)
        took = 0.005 + 0.00007 * len(batch) * cost
        busy_until = clock.now + took
        ctrl.forward_done(len(batch), cost, took, busy_until, batch.formed_at)
        ctrl.committed(batch.formed_at, took, busy_until)
        for item in batch.items:
            waits["flood" if item.tenant == "flood" else "quiet"].append(
                busy_until - item.enqueued_at
            )
    else:
        pytest.fail("the simulation did not finish")
    return {k: sorted(v)[int(0.99 * len(v))] for k, v in waits.items()}


def test_light_tenants_wait_less_than_the_flood_beside_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    light = _trace_p99s(seed=3)
    monkeypatch.setattr(batcher, "_LIGHT_RATIO", float("inf"))  # nobody is ever light
    plain = _trace_p99s(seed=3)
    assert light["quiet"] < 0.75 * plain["quiet"], (light, plain)  # 0.21 against 0.38 s
    assert light["quiet"] < 0.5 * light["flood"], light
