"""Samples of one measure in bounded memory (:class:`Samples`): a run's latencies and pass
times, read back as quantiles for its summary."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


class Samples:
    """The samples of one measure (seconds), in bounded memory: a scorer runs for weeks.

    The newest samples (up to ``keep``) are kept as they are; past that they are folded into
    logarithmic bins 1% wide, signed (a latency can be negative when the enqueuing host's
    clock runs ahead). A quantile is the exact sample's while nothing was folded, and within
    0.5% of it after (within a microsecond of 0, within a microsecond); the count, sum, min,
    max and the count above each of ``thresholds`` stay exact. A NaN or infinite sample is
    dropped when folded. (A run kept every latency in
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
        top = max((v for v in self._new if math.isfinite(v)), default=-math.inf)
        return max(self._max, top) if math.isfinite(max(self._max, top)) else 0.0

    def count_above(self, threshold: float) -> int:
        """Samples over ``threshold``: exact for one of ``thresholds`` or while nothing was
        folded; else to the 1% bin (a bin that straddles ``threshold`` counts as above)."""
        new = sum(1 for v in self._new if v > threshold)
        return new + self._above.get(threshold, self._binned_above(threshold))

    def quantile(self, p: float) -> float:
        """The sample of rank ``p`` percent (nearest rank, as a sorted list's index)."""
        if not self._bins:
            values = sorted(v for v in self._new if math.isfinite(v))
            return float(values[rank(len(values), p)]) if values else 0.0
        self._fold()
        if p <= 0 or p >= 100:  # the ends are kept exactly
            return self._min if p <= 0 else self._max
        k, seen = rank(self._n, p), 0
        for b in sorted(self._bins):
            seen += self._bins[b]
            if seen > k:
                return min(max(self._middle(b), self._min), self._max)
        return self._max

    def __add__(self, other: Samples) -> Samples:
        # a threshold stays exact only where every part that folded samples counted it
        names = {*self.thresholds, *other.thresholds}
        for part in (self, other):
            if part._n:
                names &= set(part.thresholds)
        total = Samples(names, self._keep)
        for part in (self, other):
            total._n += part._n
            total._sum += part._sum
            total._min, total._max = min(total._min, part._min), max(total._max, part._max)
            for b, n in part._bins.items():
                total._bins[b] = total._bins.get(b, 0) + n
            for t in total.thresholds:
                total._above[t] += part._above.get(t, 0)
            total.extend(part._new)
        return total

    def _binned_above(self, threshold: float) -> int:
        cut = self._bin(threshold)  # the bin that straddles it counts as above
        return sum(n for b, n in self._bins.items() if b >= cut)

    def _bin(self, value: float) -> int:
        """Signed bins: 0 within a microsecond of 0, +k above it, -k below (clock skew)."""
        size = abs(value)
        if size <= self.FLOOR:
            return 0
        k = 1 + int(math.log(size / self.FLOOR) / self._LOG_GROWTH)
        return k if value > 0 else -k

    def _middle(self, b: int) -> float:
        """A bin's value: its geometric middle (within 0.5% of any sample in it)."""
        if b == 0:
            return 0.0
        return math.copysign(self.FLOOR * math.exp((abs(b) - 0.5) * self._LOG_GROWTH), b)

    def _fold(self) -> None:
        if not self._new:
            return
        a = np.asarray(self._new, dtype=np.float64)
        a = a[np.isfinite(a)]  # a NaN or an infinity has no bin (and ended the run's thread)
        size = np.abs(a)
        k = 1 + (np.log(np.maximum(size, self.FLOOR) / self.FLOOR) / self._LOG_GROWTH).astype(
            np.int64
        )
        k[size <= self.FLOOR] = 0
        above = {t: int(np.count_nonzero(a > t)) for t in self.thresholds}
        self._new = []
        if not a.size:
            return
        self._n += a.size
        self._sum += float(a.sum())
        self._min, self._max = min(self._min, float(a.min())), max(self._max, float(a.max()))
        for t, n in above.items():
            self._above[t] += n
        for sign, part in ((1, k[a > 0]), (-1, k[a < 0]), (0, k[a == 0])):
            counts = np.bincount(part)
            for b in np.flatnonzero(counts).tolist():
                key = sign * b
                self._bins[key] = self._bins.get(key, 0) + int(counts[b])


def rank(n: int, p: float) -> int:
    """The index of percentile ``p`` in ``n`` sorted values (nearest rank)."""
    return min(n - 1, max(0, round(p / 100 * (n - 1))))
