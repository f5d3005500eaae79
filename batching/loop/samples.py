"""Samples of one measure in bounded memory (:class:`Samples`): a run's latencies and pass
times, read back as quantiles for its summary."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


class Samples:
    """The samples of one measure (seconds), in bounded memory: a scorer runs for weeks.

    The newest samples (up to ``keep``) are kept as they are; past that they are folded into
    logarithmic bins 1% wide. A quantile is the exact sample's while nothing was folded, and
    within 0.5% of it after (below a microsecond, within a microsecond); the count, sum, min,
    max and the count above each of ``thresholds`` stay exact. (A run kept every latency in
    a list: ~75 bytes an item, 1 GB a day at 150 items a second; a soak review.)
    """

    KEEP = 1 << 16
    FLOOR = 1e-6  # samples at or below fall in bin 0
    _LOG_GROWTH = math.log(1.01)

    def __init__(self, thresholds: Iterable[float] = (), keep: int = KEEP) -> None:
        self.thresholds = tuple(sorted(set(thresholds)))
        self._keep = max(1, keep)
        self._new: list[float] = []
        self._bins: dict[int, int] = {}
        self._n = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        self._above = dict.fromkeys(self.thresholds, 0)

    @classmethod
    def of(cls, values: Iterable[float], thresholds: Iterable[float] = ()) -> Samples:
        samples = cls(thresholds)
        samples.extend(values)
        return samples

    def add(self, value: float) -> None:
        self._new.append(value)
        if len(self._new) >= self._keep:
            self._fold()

    def extend(self, values: Iterable[float]) -> None:
        self._new.extend(values)
        if len(self._new) >= self._keep:
            self._fold()

    def __len__(self) -> int:
        return self._n + len(self._new)

    @property
    def total(self) -> float:
        return self._sum + math.fsum(self._new)

    @property
    def mean(self) -> float:
        return self.total / len(self) if len(self) else 0.0

    @property
    def max(self) -> float:
        return max(self._max, max(self._new, default=-math.inf)) if len(self) else 0.0

    def count_above(self, threshold: float) -> int:
        """Samples over ``threshold``: exact for one of ``thresholds`` or while nothing was
        folded; else to the 1% bin (a bin that straddles ``threshold`` counts as above)."""
        new = sum(1 for v in self._new if v > threshold)
        return new + self._above.get(threshold, self._binned_above(threshold))

    def quantile(self, p: float) -> float:
        """The sample of rank ``p`` percent (nearest rank, as a sorted list's index)."""
        if not len(self):
            return 0.0
        if not self._bins:
            values = sorted(self._new)
            return float(values[rank(len(values), p)])
        self._fold()
        k, seen = rank(self._n, p), 0
        for b in sorted(self._bins):
            seen += self._bins[b]
            if seen > k:
                mid = self.FLOOR * math.exp((b - 0.5) * self._LOG_GROWTH) if b else self._min
                return min(max(mid, self._min), self._max)
        return self._max

    def __add__(self, other: Samples) -> Samples:
        total = Samples({*self.thresholds, *other.thresholds}, self._keep)
        for part in (self, other):
            total._n += part._n
            total._sum += part._sum
            total._min, total._max = min(total._min, part._min), max(total._max, part._max)
            for b, n in part._bins.items():
                total._bins[b] = total._bins.get(b, 0) + n
            for t in total.thresholds:  # to the bin where a part did not count it
                total._above[t] += part._above.get(t, part._binned_above(t))
            total.extend(part._new)
        return total

    def _binned_above(self, threshold: float) -> int:
        cut = self._bin(threshold)
        return sum(n for b, n in self._bins.items() if b >= cut and b > 0)

    def _bin(self, value: float) -> int:
        return (
            0 if value <= self.FLOOR else 1 + int(math.log(value / self.FLOOR) / self._LOG_GROWTH)
        )

    def _fold(self) -> None:
        if not self._new:
            return
        a = np.asarray(self._new, dtype=np.float64)
        self._new = []
        self._n += a.size
        self._sum += float(a.sum())
        self._min, self._max = min(self._min, float(a.min())), max(self._max, float(a.max()))
        for t in self.thresholds:
            self._above[t] += int(np.count_nonzero(a > t))
        ratio = np.maximum(a, self.FLOOR) / self.FLOOR
        bins = np.where(a <= self.FLOOR, 0, 1 + (np.log(ratio) / self._LOG_GROWTH).astype(np.int64))
        counts = np.bincount(bins)
        for b in np.flatnonzero(counts).tolist():
            self._bins[b] = self._bins.get(b, 0) + int(counts[b])


def rank(n: int, p: float) -> int:
    """The index of percentile ``p`` in ``n`` sorted values (nearest rank)."""
    return min(n - 1, max(0, round(p / 100 * (n - 1))))
