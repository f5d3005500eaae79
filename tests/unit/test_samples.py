"""A run's samples in bounded memory (``loop.stats.Samples``): a scorer that runs for weeks
kept every item's latency in a list (~75 bytes an item; a soak review)."""

from __future__ import annotations

import random

import pytest

from batching.loop.stats import RunStats, Samples


def nearest_rank(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def lognormal(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.lognormvariate(-3.0, 1.5) for _ in range(n)]


def test_a_million_samples_hold_a_few_thousand_numbers() -> None:
    s = Samples(keep=4096)
    for chunk in range(100):
        s.extend(lognormal(10_000, chunk))
    assert len(s) == 1_000_000
    assert len(s._new) < 4096  # the bound is the point
    assert len(s._bins) < 3_000  # 1% bins from a microsecond to hours


@pytest.mark.parametrize("p", [0, 1, 50, 90, 99, 99.9, 100])
def test_quantiles_once_folded_are_within_half_a_percent(p: float) -> None:
    values = lognormal(50_000, 7)
    s = Samples(keep=1000)
    s.extend(values)
    exact = nearest_rank(values, p)
    assert s.quantile(p) == pytest.approx(exact, rel=0.005)


def test_before_folding_the_quantiles_are_the_samples_themselves() -> None:
    values = lognormal(999, 3)
    s = Samples.of(values)
    assert [s.quantile(p) for p in (0, 50, 99, 100)] == [
        nearest_rank(values, p) for p in (0, 50, 99, 100)
    ]


def test_count_sum_max_and_a_registered_threshold_stay_exact_after_folding() -> None:
    values = [0.2999, 0.3, 0.3001, -0.01, 0.0, 5.0] * 1000
    s = Samples([0.3], keep=7)
    s.extend(values)
    assert (len(s), s.max, s.quantile(0)) == (6000, 5.0, -0.01)
    assert s.total == pytest.approx(sum(values))
    assert s.count_above(0.3) == 2000  # 0.3001 and 5.0; 0.3 itself is not above
    assert s.count_above(1.0) == 1000  # unregistered: to the 1% bin, exact away from one


def test_samples_add_up_across_scorers() -> None:
    a, b = lognormal(3000, 1), lognormal(5000, 2)
    merged = Samples.of(a, [0.05]) + Samples.of(b, [0.05])
    one = Samples.of(a + b, [0.05])
    assert (len(merged), merged.max) == (len(one), one.max)
    assert merged.count_above(0.05) == one.count_above(0.05)
    assert merged.quantile(99) == pytest.approx(one.quantile(99), rel=0.005)


def test_a_long_run_summary_reads_the_folded_samples() -> None:
    stats = RunStats(started_at=0.0, finished_at=10.0, latencies_s=Samples([0.5], keep=100))
    stats.latencies_s.extend([0.1] * 9_900 + [0.7] * 100)
    summary = stats.summary()
    assert summary["latency_p50_s"] == pytest.approx(0.1, rel=0.005)
    assert summary["latency_p99_s"] == pytest.approx(0.1, rel=0.005)
    assert summary["latency_max_s"] == 0.7
    assert stats.latencies_s.count_above(0.5) == 100


def test_a_run_counts_its_failure_reasons_and_keeps_a_bounded_number() -> None:
    stats = RunStats(started_at=0.0, finished_at=1.0, failed=40)
    stats.count_failures(["bad shape"] * 5 + [f"unique {i}" for i in range(35)])
    assert len(stats.failure_reasons) == 33  # 32 kept, the rest as one
    assert stats.failure_reasons["(other reasons)"] == 4  # the 4 unique ones past 32
    summary = stats.summary()
    assert next(iter(summary["failure_reasons"].items())) == ("bad shape", 5)
    merged = RunStats.merged([stats, stats])
    assert merged.failure_reasons["bad shape"] == 10


def test_negative_samples_clock_skew_fold_by_their_own_bins() -> None:
    values = [-1.0 + i / 20_000 for i in range(10_000)] + [0.0] * 100
    s = Samples(keep=500)
    s.extend(values)
    for p in (1, 25, 50, 75, 99):
        assert s.quantile(p) == pytest.approx(nearest_rank(values, p), rel=0.005)
    assert (s.quantile(0), s.quantile(100)) == (-1.0, 0.0)


def test_a_nan_or_infinite_sample_is_dropped_not_fatal() -> None:
    s = Samples(keep=4)
    s.extend([0.1, float("nan"), 0.2, float("inf"), 0.3, -float("inf")])
    s.extend([0.4] * 4)
    assert (len(s), s.max) == (7, 0.4)
    assert s.quantile(50) == pytest.approx(0.4, rel=0.005)


def test_a_threshold_not_every_folded_part_counted_is_not_kept_as_exact() -> None:
    counted = Samples([0.5], keep=10)
    counted.extend([0.4] * 100)
    uncounted = Samples(keep=10)
    uncounted.extend([0.4] * 100)
    total = counted + uncounted
    assert total.thresholds == ()
    assert total.count_above(0.5) == 0
