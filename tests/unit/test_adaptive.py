"""SLO-adaptive batching: the online service-time model, the release rule, and the batcher
driven through simulated arrival traces (steady, ramp, burst, overload) by a fake clock and a
simulated server: no sleeps, no threads, no I/O.

The simulated scorer is the real one's shape: a batch is cut only while the hand-off slot is
empty (one batch decoded ahead of the forward pass), the forward pass takes ``a + b * n``
seconds (times a seeded jitter), the commit a fixed overhead after it. The controller is told
what the loop tells it (forward start and end, commit). The prior handed to both batchers is
a profile that is 30% optimistic, so the adaptive one has to learn the real service time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from batching import config, models
from batching.policy import adaptive, batcher
from batching.testing import FakeClock

A_S, B_S = 0.010, 0.001  # the simulated model: 10 ms per batch + 1 ms per item
COMMIT_S = 0.002  # from the end of a forward pass to its commit
STALL_S = 0.06  # a stalled commit's extra time (``simulate(stalls=...)``)
N_MAX = 64
SLO_S = 0.25
CAPACITY = N_MAX / (A_S + B_S * N_MAX)  # items/s with full batches (~865)
N_BUCKETS = 8  # the length buckets of the padded runs: item costs 1..8, one per bucket
PADDED_MEAN = (1 + N_BUCKETS) / 2  # an item of the mean cost costs B_S in a padded batch


def true_service(n: int, rng: random.Random, cost: float = 1.0) -> float:
    return (A_S + B_S * n * cost) * (1.0 + rng.uniform(-0.1, 0.1))


def prior(n: int, cost: int) -> float:
    """The profile: 30% optimistic."""
    return 0.7 * (A_S + B_S * n)


def padded_prior(n: int, cost: int) -> float:
    """The profile of a model whose items cost their padded length (``padded=True``)."""
    return 0.7 * (A_S + B_S * n * cost / PADDED_MEAN)


@dataclass
class Outcome:
    latencies: list[float] = field(default_factory=list)
    in_slo: int = 0
    expired: list[batcher.Late] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    mixed: int = 0  # batches holding items of more than one length bucket
    reasons: dict[str, int] = field(default_factory=dict)
    end_s: float = 0.0

    @property
    def p99(self) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]

    def throughput(self, duration_s: float) -> float:
        return len(self.latencies) / max(self.end_s, duration_s)

    def goodput(self, duration_s: float) -> float:
        return self.in_slo / max(self.end_s, duration_s)


def simulate(
    arrivals: list[float],
    *,
    adaptive_on: bool,
    max_wait_s: float = 0.05,
    late_policy: batcher.LatePolicy = "score",
    deadlines: bool = False,
    buckets: int = 1,
    padded: bool = False,
    stalls: float = 0.0,
    default_deadline_s: float | None = None,
    seed: int = 7,
) -> Outcome:
    """Run a trace of arrival times (seconds from 0) through the batcher and the simulated
    server; returns every item's enqueue-to-commit latency. ``buckets``: the items' costs
    take turns over that many length buckets; ``padded``: a batch costs ``B_S`` per item times
    its longest item's cost over the mean cost (else the cost does not matter); ``stalls``:
    the share of commits that take ``STALL_S`` longer (an fsync, a core taken by another
    process), which no model of the forward pass predicts."""
    rng = random.Random(seed)
    stall_rng = random.Random(seed + 1)
    clock = FakeClock(0.0)
    edges = list(range(1, buckets))
    pol = config.BatchingPolicy(max_batch_size=N_MAX, max_wait_s=max_wait_s, length_buckets=edges)
    profile = padded_prior if padded else prior
    ctrl = (
        adaptive.SloController.for_policy(SLO_S, profile, N_MAX, tuple(edges))
        if adaptive_on
        else None
    )
    b = batcher.MicroBatcher(
        pol,
        clock,
        profile,
        adaptive=ctrl,
        late_policy=late_policy,
        default_deadline_s=default_deadline_s,
    )
    out = Outcome()
    running: tuple[models.Batch, float, float] | None = None  # batch, start, end
    slot: models.Batch | None = None
    i = 0

    def start(batch: models.Batch) -> tuple[models.Batch, float, float]:
        cost = max(item.cost for item in batch.items)
        s = true_service(len(batch), rng, cost / PADDED_MEAN if padded else 1.0)
        if ctrl is not None:
            ctrl.forward_started(len(batch), cost, clock.now)
        out.sizes.append(len(batch))
        out.mixed += len({item.cost for item in batch.items}) > 1
        out.reasons[batch.reason] = out.reasons.get(batch.reason, 0) + 1
        return batch, clock.now, clock.now + s

    for _ in range(10 * len(arrivals) + 1000):
        if i >= len(arrivals) and not len(b) and running is None and slot is None:
            break
        times = []
        if i < len(arrivals):
            times.append(arrivals[i])
        if running is not None:
            times.append(running[2])
        if slot is None and len(b):
            due = b.next_deadline()
            assert due is not None
            times.append(max(due, clock.now))
        clock.now = max(clock.now, min(times))
        new = []
        while i < len(arrivals) and arrivals[i] <= clock.now:
            at = arrivals[i]
            new.append(
                models.WorkItem(
                    i + 1,
                    f"k{i}",
                    models.Payload(b"{}"),
                    at,
                    cost=1 + i % buckets,
                    deadline_at=at + SLO_S if deadlines else None,
                )
            )
            i += 1
        if new:
            b.add(new)
        if running is not None and running[2] <= clock.now:
            batch, began, end = running
            done = end + COMMIT_S + (STALL_S if stall_rng.random() < stalls else 0.0)
            for item in batch.items:
                out.latencies.append(done - item.enqueued_at)
                out.in_slo += done - item.enqueued_at <= SLO_S
            out.end_s = max(out.end_s, done)
            if ctrl is not None:
                cost = max(item.cost for item in batch.items)
                ctrl.forward_done(len(batch), cost, end - began, end, batch.formed_at)
                ctrl.committed(batch.formed_at, end - began, done)
            running = None
            if slot is not None:
                running, slot = start(slot), None
        if slot is None:
            batch_or_none = b.poll()
            out.expired += b.take_late()
            if batch_or_none is not None:
                if running is None:
                    running = start(batch_or_none)
                else:
                    slot = batch_or_none
    else:
        pytest.fail("the simulation did not finish")
    assert len(out.latencies) + len(out.expired) == len(arrivals)  # nothing lost
    return out


def poisson(rate: float, duration_s: float, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    t, times = 0.0, list[float]()
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return times
        times.append(t)


def ramp(start_rate: float, end_rate: float, duration_s: float, seed: int = 2) -> list[float]:
    """Poisson arrivals whose rate grows linearly (thinning)."""
    top = max(start_rate, end_rate)
    rng = random.Random(seed)
    return [
        t
        for t in poisson(top, duration_s, seed)
        if rng.random() <= (start_rate + (end_rate - start_rate) * t / duration_s) / top
    ]


def bursts(base_rate: float, burst: int, every_s: float, duration_s: float) -> list[float]:
    times = poisson(base_rate, duration_s, seed=3)
    k = every_s
    while k < duration_s:
        times += [k] * burst
        k += every_s
    return sorted(times)


DURATION_S = 3.0
TRACES = {
    "steady-50%": poisson(0.5 * CAPACITY, DURATION_S),
    "steady-90%": poisson(0.9 * CAPACITY, DURATION_S),
    "ramp-10-95%": ramp(0.1 * CAPACITY, 0.95 * CAPACITY, DURATION_S),
    "burst": bursts(0.2 * CAPACITY, 100, 0.5, DURATION_S),
}
THROUGHPUT_FACTOR = 0.95  # adaptive throughput >= this x the fixed config's, same trace


@pytest.mark.parametrize("name", sorted(TRACES))
def test_feasible_traces_meet_the_slo_without_losing_throughput(name: str) -> None:
    trace = TRACES[name]
    tuned = simulate(trace, adaptive_on=True)
    fixed = simulate(trace, adaptive_on=False)
    assert tuned.p99 <= SLO_S, (name, tuned.p99)
    assert tuned.throughput(DURATION_S) >= THROUGHPUT_FACTOR * fixed.throughput(DURATION_S)
    # no slower than the fixed window where the fixed window meets the SLO as well
    assert tuned.p99 <= max(fixed.p99, SLO_S)


def test_low_load_latency_is_service_not_window() -> None:
    """At low load an idle model takes the batch at once: no window is waited out."""
    trace = poisson(0.05 * CAPACITY, DURATION_S)
    tuned = simulate(trace, adaptive_on=True, max_wait_s=0.1)
    fixed = simulate(trace, adaptive_on=False, max_wait_s=0.1)
    assert tuned.p99 < 0.1  # below the window
    assert fixed.p99 > 0.1  # the fixed window waits it out
    assert set(tuned.reasons) <= {"idle", "size"}


def test_a_window_above_the_budget_is_cut_by_the_slo() -> None:
    """A fixed window too long for the SLO misses it; the adaptive rule keeps the budget."""
    trace = poisson(0.3 * CAPACITY, DURATION_S)
    fixed = simulate(trace, adaptive_on=False, max_wait_s=0.24)
    tuned = simulate(trace, adaptive_on=True, max_wait_s=0.24)
    assert fixed.p99 > SLO_S
    assert tuned.p99 <= SLO_S


def test_overload_sheds_explicitly_and_keeps_the_admitted_within_slo() -> None:
    """At 150% of capacity with deadlines and ``late_policy: expire``, what is committed is
    within the SLO (the excess expired, each with its reason); scoring everything instead
    commits late, and commits fewer items within the SLO."""
    trace = poisson(1.5 * CAPACITY, DURATION_S)
    shed = simulate(trace, adaptive_on=True, deadlines=True, late_policy="expire")
    late = simulate(trace, adaptive_on=False, deadlines=True, late_policy="score")
    assert shed.expired
    assert "deadline" in shed.expired[0].reason
    assert shed.p99 <= SLO_S
    assert late.p99 > SLO_S
    assert shed.goodput(DURATION_S) >= late.goodput(DURATION_S)
    # the model stays busy with full batches: throughput near capacity
    assert shed.throughput(DURATION_S) >= 0.8 * CAPACITY


def test_overload_with_stalled_commits_holds_the_slo_by_the_learned_slack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 150% with a tenth of the commits stalled 60 ms (an fsync, a core taken by another
    process), items the rule judged in time (the SLO as their default deadline, by the
    upper estimate) commit late unless the controller learns how late its predictions run.
    With its slack, p99 and goodput stay where they are without stalls; with the slack
    pinned to 0, the same trace breaks the SLO by a fifth."""
    trace = poisson(1.5 * CAPACITY, 15.0)

    def run(stalls: float) -> Outcome:
        out = simulate(
            trace, adaptive_on=True, late_policy="expire", default_deadline_s=SLO_S, stalls=stalls
        )
        assert out.expired
        assert "default deadline" in out.expired[0].reason
        return out

    calm, learned = run(0.0), run(0.1)
    assert calm.p99 <= 1.02 * SLO_S
    assert learned.p99 <= 1.03 * SLO_S
    assert learned.goodput(15.0) >= 0.97 * calm.goodput(15.0)
    monkeypatch.setattr(adaptive.SloController, "slack_s", property(lambda self: 0.0))
    blind = run(0.1)
    assert blind.p99 >= 1.15 * SLO_S
    assert blind.goodput(15.0) < learned.goodput(15.0)


def test_buckets_share_a_forward_pass_at_low_load() -> None:
    """Eight length buckets at a third of capacity: one forward pass per bucket in turn
    makes each bucket wait for the others'; the adaptive rule lets a few buckets' items ride
    in one padded batch where the model predicts it sooner for all, and its p99 is well
    below the fixed window's, with fewer forward passes."""
    trace = poisson(0.3 * CAPACITY, DURATION_S)
    tuned = simulate(trace, adaptive_on=True, buckets=N_BUCKETS, padded=True)
    fixed = simulate(trace, adaptive_on=False, buckets=N_BUCKETS, padded=True)
    assert fixed.mixed == 0  # the fixed rule never mixes buckets
    assert tuned.mixed > len(tuned.sizes) / 4
    assert len(tuned.sizes) < 0.9 * len(fixed.sizes)
    assert tuned.p99 < 0.6 * fixed.p99


def test_padding_costs_no_throughput_near_capacity() -> None:
    """At 90% the buckets fill on their own: the rule keeps the fixed config's throughput."""
    trace = poisson(0.9 * CAPACITY, DURATION_S)
    tuned = simulate(trace, adaptive_on=True, buckets=N_BUCKETS, padded=True)
    fixed = simulate(trace, adaptive_on=False, buckets=N_BUCKETS, padded=True)
    assert tuned.throughput(DURATION_S) >= THROUGHPUT_FACTOR * fixed.throughput(DURATION_S)
    assert tuned.p99 <= 1.1 * fixed.p99


def _two_buckets(
    slo_s: float, a_s: float = 0.010, b_s: float = 0.001, max_batch_cost: int | None = None
) -> batcher.MicroBatcher:
    """A batcher with buckets of cost <= 1, <= 8 and above, on an idle model that costs
    ``a_s + b_s * n * cost`` (the profile, unmeasured: the cold margin is 25%)."""
    clock = FakeClock(100.0)
    pol = config.BatchingPolicy(
        max_batch_size=64, max_wait_s=0.05, length_buckets=[1, 8], max_batch_cost=max_batch_cost
    )
    model = adaptive.ServiceModel(lambda n, c: a_s + b_s * n * c, n_ref=64, c_ref=8)
    ctrl = adaptive.SloController(slo_s, model)
    return batcher.MicroBatcher(pol, clock, adaptive=ctrl)


def _items(first_id: int, n: int, cost: int, at: float = 100.0) -> list[models.WorkItem]:
    return [
        models.WorkItem(first_id + k, f"k{first_id + k}", models.Payload(b"{}"), at, cost=cost)
        for k in range(n)
    ]


def test_items_ride_with_another_bucket_when_it_is_sooner_for_all() -> None:
    """One item of cost 8 and two of cost 1 at an idle model that costs 10 ms a pass: one
    pass of three padded to 8 (12.4 ms) instead of two in turn (10.8 ms, then 10.2 more)."""
    b = _two_buckets(slo_s=1.0, b_s=0.0001)
    b.add(_items(1, 1, cost=8) + _items(2, 2, cost=1))
    batch = b.poll()
    assert batch is not None
    assert sorted(item.cost for item in batch.items) == [1, 1, 8]
    assert batch.reason == "idle"
    assert batch.bucket == 1
    assert len(b) == 0


def test_no_ride_past_the_cost_cap_once_padded() -> None:
    """The case above, but max_batch_cost 16: their costs add up to 10, padded to 8 they are
    24, more than the plan-time check's worst batch allows; the cost-8 item goes alone."""
    b = _two_buckets(slo_s=1.0, b_s=0.0001, max_batch_cost=16)
    b.add(_items(1, 1, cost=8) + _items(2, 2, cost=1))
    first = b.poll()
    assert first is not None
    assert {item.cost for item in first.items} == {8}
    assert len(b) == 2


def test_no_ride_when_padding_costs_more_than_a_forward_pass() -> None:
    """Twenty items of cost 1 and two of cost 8 padded together: 186 ms, against 30 ms and
    26 ms apart."""
    b = _two_buckets(slo_s=1.0)
    b.add(_items(1, 20, cost=1, at=99.9) + _items(30, 2, cost=8))
    first = b.poll()
    assert first is not None
    assert {item.cost for item in first.items} == {1}
    assert len(first) == 20
    assert len(b) == 2


def test_no_ride_that_would_make_the_batch_late() -> None:
    """The oldest item alone is predicted in time (12.6 ms bound, 10 ms of its 23.5 ms SLO
    gone), with the other bucket's item it would not be (14.5 ms): it goes alone."""
    b = _two_buckets(slo_s=0.0235, b_s=0.0001)
    b.add(_items(1, 1, cost=1, at=99.99) + _items(2, 1, cost=8))
    first = b.poll()
    assert first is not None
    assert [item.cost for item in first.items] == [1]
    assert len(b) == 1


def test_no_ride_that_delays_a_batch_more_than_it_saves() -> None:
    """63 items of cost 1 and one of cost 8, on a model whose pass costs 500 ms: one pass
    would be cheaper than two, but padding the 63 to 8 delays each of them 449 ms to save
    the one 59 ms."""
    b = _two_buckets(slo_s=10.0, a_s=0.5)
    b.add(_items(1, 63, cost=1, at=99.0) + _items(100, 1, cost=8))
    first = b.poll()
    assert first is not None
    assert len(first) == 63
    assert {item.cost for item in first.items} == {1}


# --- the service-time model -------------------------------------------------------------------


def test_model_is_the_prior_until_measured() -> None:
    model = adaptive.ServiceModel(prior, n_ref=N_MAX)
    for n in (1, 8, 64):
        assert model.predict(n, 1) == pytest.approx(prior(n, 1))
    assert adaptive.ServiceModel(None).predict(8, 1) == 0.0
    assert model.predict(0, 1) == 0.0


@pytest.mark.parametrize("with_prior", [True, False])
def test_model_learns_the_measured_service_time(with_prior: bool) -> None:
    model = adaptive.ServiceModel(prior if with_prior else None, n_ref=N_MAX)
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, N_MAX)
        model.observe(n, 1, A_S + B_S * n)
    for n in (1, 16, 64):
        assert model.predict(n, 1) == pytest.approx(A_S + B_S * n, rel=0.05)
    assert model.bound(16, 1) >= model.predict(16, 1)


def test_model_learns_a_cost_term() -> None:
    """Items padded to a longer cost cost more: the n*c feature learns it."""
    model = adaptive.ServiceModel(None, n_ref=32, c_ref=128)
    rng = random.Random(6)
    for _ in range(300):
        n, c = rng.randint(1, 32), rng.choice([16, 64, 128])
        model.observe(n, c, 0.005 + 0.00001 * n * c)
    assert model.predict(32, 128) == pytest.approx(0.005 + 0.00001 * 32 * 128, rel=0.05)
    assert model.predict(32, 16) < model.predict(32, 128)


def test_model_ignores_nonsense_measurements() -> None:
    model = adaptive.ServiceModel(prior, n_ref=N_MAX)
    model.observe(0, 1, 1.0)
    model.observe(4, 1, math.nan)
    model.observe(4, 1, -1.0)
    assert model.n_observed == 0


# --- the release rule -------------------------------------------------------------------------


def test_due_waits_for_the_model_then_the_budget() -> None:
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.1))
    assert ctrl.due(100.0, 4, 1).at == 100.0  # model idle: at once
    ctrl.forward_started(8, 1, 100.0)  # busy until 100.1
    assert ctrl.due(100.0, 4, 1) == adaptive.Due(100.1, "idle", 100.0 + 1.0 - 0.1 * 1.25)
    ctrl.busy_until = 105.0  # a long forward: the budget goes first
    due = ctrl.due(100.0, 4, 1)
    assert due.trigger == "slo"
    assert due.at == pytest.approx(100.875)


def test_size_cap_fits_the_oldest_items_budget() -> None:
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.1 + 0.01 * n))
    # bound = 1.25 * (0.1 + 0.01 n); 0.5 s left -> n <= 30
    assert ctrl.size_cap(100.5, 100.0, 1, 64) == 30
    assert ctrl.size_cap(100.0, 100.0, 1, 64) == 64  # the whole batch fits
    assert ctrl.size_cap(101.5, 100.0, 1, 64) == 64  # late anyway: a full batch


def knee(n: int, cost: int) -> float:
    """A CPU's transformer on long inputs: each item costs less up to 8 a pass, then more
    (the batch's activations outgrow the caches); short inputs keep gaining."""
    growth = 0.1 * (n - 8) if n > 8 and cost >= 8 else 0.0
    return 0.004 + 0.001 * n * cost / 8 * (1.0 + growth)


def test_efficient_size_is_where_time_per_item_stops_falling() -> None:
    model = adaptive.ServiceModel(knee, n_ref=32, c_ref=8)
    assert model.efficient_size(8, 32) == 8  # past 8 a pass is slower per item
    assert model.efficient_size(1, 32) == 32  # short inputs gain to the end
    assert model.efficient_size(8, 4) == 4
    assert model.efficient_size(8, 1) == 1
    # a + b*n keeps gaining: the size stays the largest
    fixed_cost = adaptive.ServiceModel(lambda n, c: 0.005 + 0.000002 * n, n_ref=2048)
    assert fixed_cost.efficient_size(1, 2048) == 2048
    # no fixed cost at all: every size is as good, and the smallest within 1% goes
    flat = adaptive.ServiceModel(lambda n, c: 0.01 * n, n_ref=64)
    assert flat.efficient_size(1, 64) == 12  # (0.01 n + 1 ms) / n within 1% of n = 64's


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_measurements_overrule_a_knee_the_device_does_not_have(scale: float) -> None:
    """A profile with its knee at 8 items (a CPU's), then a device that keeps gaining (a
    GPU's ``a + b*n``): the measurements move the cut to the largest size, whether the
    profile's passes take tens of milliseconds or a tenth of that (before, the ridge held
    a fast profile's share whatever was measured, and the cut stayed at 16 of 32)."""

    def profile(n: int, cost: int) -> float:
        return scale * knee(n, cost)

    model = adaptive.ServiceModel(profile, n_ref=32, c_ref=8)
    assert model.efficient_size(8, 32) <= 12  # the profile's knee (and the pass's overhead)
    rng = random.Random(7)
    for _ in range(96):
        n = rng.randint(1, 32)
        model.observe(n, 8, scale * (0.004 + 0.0005 * n))
    assert model.efficient_size(8, 32) == 32
    assert model.predict(32, 8) == pytest.approx(scale * (0.004 + 0.0005 * 32), rel=0.05)


def test_the_profile_shape_stays_where_nothing_was_measured() -> None:
    """Forwards measured at one size only, 20% slower than the profile there: the model
    scales the profile where it was measured and keeps its knee where nothing was."""
    model = adaptive.ServiceModel(knee, n_ref=32, c_ref=8)
    for _ in range(64):
        model.observe(8, 8, 1.2 * knee(8, 8))
    assert model.predict(8, 8) == pytest.approx(1.2 * knee(8, 8), rel=0.02)
    assert model.efficient_size(8, 32) == 8


def test_a_batch_is_cut_at_the_efficient_size_not_grown_past_it() -> None:
    """Thirty long items at a free model whose passes stop gaining at 8 go as passes of 8,
    with time to spare in the SLO: a pass of 30 would be slower per item and hold everything
    behind it four times as long."""
    clock = FakeClock(100.0)
    pol = config.BatchingPolicy(max_batch_size=32, max_wait_s=0.05, length_buckets=[1, 8])
    ctrl = adaptive.SloController(10.0, adaptive.ServiceModel(knee, n_ref=32, c_ref=8))
    b = batcher.MicroBatcher(pol, clock, adaptive=ctrl)
    b.add(_items(1, 30, cost=8) + _items(100, 30, cost=1))
    sizes = []
    while (batch := b.poll()) is not None:
        sizes.append((max(i.cost for i in batch.items), len(batch)))
    assert sorted(sizes) == [(1, 30), (8, 6), (8, 8), (8, 8), (8, 8)]


def test_slack_is_how_late_recent_commits_ran_against_their_prediction() -> None:
    """The controller keeps each released batch's predicted commit (upper estimate) and,
    from the actual commits, learns the 90th percentile of how late they ran: the slack
    that the upper estimate, the budget and the size cap then add. The mean stays the
    model's."""
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.1))
    upper = ctrl.finish_at(100.0, 4, 1, upper=True)
    assert upper == pytest.approx(100.0 + 0.1 * 1.25)  # the cold margin, no slack
    budget = ctrl.due(100.0, 4, 1).budget_at
    for k in range(20):  # batches that commit 50 ms after their prediction; 2 of them on time
        formed = 100.0 + k
        ctrl.expect(formed, 4, 1)
        predicted = ctrl.finish_at(formed, 4, 1, upper=True) - ctrl.slack_s
        ctrl.committed(formed, 0.1, predicted + (0.0 if k in (3, 11) else 0.05))
        ctrl.busy_until = ctrl.commit_until = -math.inf  # each batch alone on the model
    assert ctrl.slack_s == pytest.approx(0.05)
    assert ctrl.finish_at(200.0, 4, 1, upper=True) == pytest.approx(
        200.0 + 0.1 * 1.25 + ctrl.tail_s + 0.05
    )
    assert ctrl.finish_at(200.0, 4, 1) == pytest.approx(200.0 + 0.1 + ctrl.tail_s)
    assert ctrl.due(100.0, 4, 1).budget_at == pytest.approx(budget - ctrl.tail_s - 0.05)


def test_slack_is_zero_while_commits_are_in_time() -> None:
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.1))
    for k in range(20):
        ctrl.expect(100.0 + k, 4, 1)
        ctrl.committed(100.0 + k, 0.1, 100.0 + k + 0.08)  # before the prediction (0.125)
        ctrl.busy_until = ctrl.commit_until = -math.inf
    assert ctrl.slack_s == 0.0


def test_controller_rejects_a_nonpositive_slo() -> None:
    with pytest.raises(ValueError, match="slo_s"):
        adaptive.SloController(0.0, adaptive.ServiceModel())


def test_due_waits_for_a_backed_up_commit_stage() -> None:
    """Commits are serial: a batch released while the stage holds others would only wait
    for them, so it grows until its forward would end as the stage frees up."""
    ctrl = adaptive.SloController(1.0, adaptive.ServiceModel(lambda n, c: 0.01))
    ctrl.committed(formed_at=99.0, service_s=0.0, done_at=99.02)  # a commit takes 20 ms
    assert ctrl.tail_s == pytest.approx(0.02)
    for k in range(3):  # three forwards ended at 100.0: their commits run to 100.06
        ctrl.forward_done(1, 1, 0.01, 100.0, formed_at=99.5 + k)
    assert ctrl.commit_until == pytest.approx(100.06)
    due = ctrl.due(100.0, 1, 1)
    assert due.trigger == "idle"
    assert due.at == pytest.approx(100.05)  # its forward ends at 100.06
    assert ctrl.finish_at(100.0, 1, 1) == pytest.approx(100.06 + 0.02)
    # The commits' own times are measured, not the wait behind the earlier ones.
    ctrl.committed(99.5, 0.01, 100.02)
    ctrl.committed(100.5, 0.01, 100.04)
    assert ctrl.tail_s == pytest.approx(0.02)
    assert ctrl.commit_until == pytest.approx(100.04 + 0.02)  # one batch still queued
