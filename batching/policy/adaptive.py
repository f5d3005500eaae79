"""SLO-adaptive batching: a service-time model fitted online, and the release rule built on it.

Pure like the batcher: no I/O and no clock of its own; every time is passed in (epoch seconds).
The scoring loop reports what it measures (each forward pass, decode and commit), the
:class:`~batching.policy.batcher.MicroBatcher` asks when to release and how many items.

**The model.** :class:`ServiceModel` predicts the forward seconds ``t(n, c)`` of ``n`` items
padded to cost ``c`` as ``theta . (1, n, n*c, prior(n, c))`` (each feature in units of a typical
batch: sizes, costs, and the profile's seconds at that batch), where
``prior`` is the service profile (``batching profile``; none: 0). ``theta`` is a ridge
regression over the last ``window`` measured forwards, shrunk toward the profile as is: before
any measurement the model *is* the profile, and measurements correct it (another machine of
the same kind, a warm cache, a longer average length) without forgetting the profile's shape
where nothing was measured. :meth:`ServiceModel.bound` adds a margin: the 90th percentile of
the recent relative errors of the model's own out-of-sample predictions (a p99 target needs an
upper estimate, as Clipper's mean + 3 sigma does).

**The release rule** (:class:`SloController`). A batch released at ``t`` is predicted to be
committed at ``max(max(t + decode, busy_until) + bound(n, c), commit_until) + tail``: it is
decoded (measured per item), waits for the forward pass in flight (``busy_until``, its
predicted end), runs, waits for the commits queued before it (commits are serial:
``commit_until``), and commits (``tail``, a commit's own time, measured from the later of its
forward's end and the previous commit's end; EWMAs). What none of these terms sees (a
commit's fsync stalling, the cores taken by another process for a while) the controller
learns from its own record: each released batch's predicted commit (upper estimate) is kept
and, when the batch commits, how late it ran; the upper estimate adds the second largest of
the last 64 such misses (:attr:`SloController.slack_s`; 0 while batches commit in time). With
``latency_slo_s`` as the p99 target, the oldest item of a bucket has its *budget*: it must be
released by ``enqueued_at + slo - decode - bound(n, c) - tail`` (trigger ``"slo"``). Before that,
the batch grows while the model is busy and goes when the model frees up (trigger ``"idle"``:
at the predicted end of the forward pass in flight, less the batch's decode time, so decode
overlaps the forward), and while the commit stage is backed up (a batch released then would
only wait for it: releasing when its forward would end as the stage frees loses nothing and
makes one commit of what would have been several); an idle pipeline takes it at once.
``max_batch_size`` stays a hard upper bound (``max_wait_s`` is no trigger: the batcher's
docstring says why), and a batch is cut no larger than the oldest item's budget allows
(:meth:`SloController.size_cap`) unless even one item cannot make it (then it is late anyway,
and a full batch serves the rest fastest).

Why not wait at an idle model for a bigger batch: with a per-batch cost ``a + b*n``, going
when the model frees converges to the batch size that keeps up with arrivals
(``n* = rate*a / (1 - rate*b)``), so waiting buys no throughput below capacity and costs
latency; above capacity batches are full anyway (Triton's default is the same greedy rule).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

ServiceTime = Callable[[int, int], float]
"""Predicted seconds of one forward pass: (n_items, largest item cost) -> seconds."""

_N_FEATURES = 4
_THETA0 = (0.0, 0.0, 0.0, 1.0)  # the prior as is
_COLD_MARGIN = 0.25  # relative margin before enough errors are seen
_MIN_ERRORS = 8
_MAX_ENDS = 1024  # forward ends waiting for their commit
_MISS_WINDOW = 64  # the recent batches whose commit the slack is learned from
_MISS_QUANTILE = 0.99  # of their misses: the second largest of 64
_EFFICIENT_TOLERANCE = 0.01  # a smaller batch this close to the best time per item is as good
_PASS_OVERHEAD_S = 0.001  # the scorer's own work a pass besides the forward (release, hand-offs)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve ``a x = b`` (small, symmetric positive definite) by Gaussian elimination."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        if abs(p) < 1e-300:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / p
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))
        x[r] = s / m[r][r] if abs(m[r][r]) >= 1e-300 else 0.0
    return x


class ServiceModel:
    """Forward seconds ``t(n, c)`` fitted online (see module docstring).

    Args:
        prior: the profile's prediction for (n_items, padded cost); None: none (0 seconds).
        n_ref, c_ref: a typical batch size and item cost, to scale the features.
        window: measurements the fit keeps (older ones are forgotten).
        ridge: how strongly ``theta`` is held to the prior where measurements say little.
    """

    def __init__(
        self,
        prior: ServiceTime | None = None,
        *,
        n_ref: int = 1,
        c_ref: int = 1,
        window: int = 64,
        ridge: float = 1e-2,
    ) -> None:
        self._prior = prior
        self._n_ref = float(max(1, n_ref))
        self._c_ref = float(max(1, c_ref))
        # The profile's feature is in units of its own typical pass (seconds at the reference
        # size and cost), like the others are in units of theirs: in seconds, a fast model's
        # feature was tiny beside the ridge, which then held its coefficient at 1 whatever was
        # measured, and corrections went to the linear terms (a knee the device does not
        # have was kept).
        typical = prior(int(self._n_ref), int(self._c_ref)) if prior is not None else 0.0
        self._p_ref = typical if math.isfinite(typical) and typical > 0 else 1.0
        self._theta0 = (*_THETA0[:-1], self._p_ref)
        self._window = window
        self._ridge = ridge
        self._samples: collections.deque[tuple[tuple[float, ...], float]] = collections.deque()
        self._xtx = [[0.0] * _N_FEATURES for _ in range(_N_FEATURES)]
        self._xty = [0.0] * _N_FEATURES
        self._theta: tuple[float, ...] = self._theta0
        self._errors: collections.deque[float] = collections.deque(maxlen=window)
        self._margin = _COLD_MARGIN
        self.n_observed = 0
        self._efficient: dict[tuple[int, int], int] = {}  # (cost, most items) -> size

    def _features(self, n_items: int, cost: int) -> tuple[float, ...]:
        prior = self._prior(n_items, cost) if self._prior is not None else 0.0
        n = n_items / self._n_ref
        return (1.0, n, n * max(1, cost) / self._c_ref, max(0.0, prior) / self._p_ref)

    def predict(self, n_items: int, cost: int) -> float:
        """Mean forward seconds of ``n_items`` items padded to ``cost`` (0 for no items)."""
        if n_items <= 0:
            return 0.0
        x = self._features(n_items, cost)
        return max(0.0, sum(t * v for t, v in zip(self._theta, x, strict=True)))

    def bound(self, n_items: int, cost: int) -> float:
        """An upper estimate: the mean times (1 + the recent error margin)."""
        return self.predict(n_items, cost) * (1.0 + self._margin)

    def efficient_size(self, cost: int, max_items: int) -> int:
        """The batch size (<= ``max_items``) with the least predicted time per item at
        ``cost``, the forward and ~1 ms of the scorer's own work a pass: the smallest whose
        time per item is within 1% of the best. Past it a larger batch is slower per item,
        not faster, and the pass everything behind it waits for is longer (a CPU's
        transformer on long inputs stops gaining at 8-16 items; a model whose time is
        ``a + b*n`` keeps gaining, and its size stays ``max_items``). Sizes tried: powers
        of two, their midpoints, and ``max_items``; recomputed after each measurement."""
        if max_items <= 1:
            return max(1, max_items)
        key = (cost, max_items)
        size = self._efficient.get(key)
        if size is None:
            sizes = sorted(set(_sizes_up_to(max_items)))
            per_item = [(self.predict(n, cost) + _PASS_OVERHEAD_S) / n for n in sizes]
            limit = min(per_item) * (1.0 + _EFFICIENT_TOLERANCE)
            size = next(n for n, t in zip(sizes, per_item, strict=True) if t <= limit)
            if len(self._efficient) >= _MAX_ENDS:
                self._efficient.clear()
            self._efficient[key] = size
        return size

    @property
    def margin(self) -> float:
        """The relative margin :meth:`bound` adds (90th percentile of recent errors)."""
        return self._margin

    def observe(self, n_items: int, cost: int, seconds: float) -> None:
        """One measured forward pass of ``n_items`` items padded to ``cost``."""
        if n_items <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        before = self.predict(n_items, cost)
        if self.n_observed or self._prior is not None:
            # The error of a prediction made before the sample was seen (out of sample).
            rel = (seconds - before) / max(before, 1e-6)
            self._errors.append(min(1.0, max(-1.0, rel)))
        x = self._features(n_items, cost)
        self._add(x, seconds, +1.0)
        self._samples.append((x, seconds))
        if len(self._samples) > self._window:
            old_x, old_y = self._samples.popleft()
            self._add(old_x, old_y, -1.0)
        self._refit()
        self._efficient.clear()
        self.n_observed += 1
        if len(self._errors) >= _MIN_ERRORS:
            ordered = sorted(self._errors)
            self._margin = max(0.0, ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))])

    def _add(self, x: tuple[float, ...], y: float, sign: float) -> None:
        for i in range(_N_FEATURES):
            self._xty[i] += sign * x[i] * y
            row = self._xtx[i]
            for j in range(_N_FEATURES):
                row[j] += sign * x[i] * x[j]

    def _refit(self) -> None:
        lam = self._ridge
        a = [
            [v + (lam if i == j else 0.0) for j, v in enumerate(row)]
            for i, row in enumerate(self._xtx)
        ]
        b = [v + lam * t0 for v, t0 in zip(self._xty, self._theta0, strict=True)]
        self._theta = tuple(_solve(a, b))


def _sizes_up_to(max_items: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... below ``max_items``, and ``max_items``."""
    sizes, n = [max_items], 1
    while n < max_items:
        sizes.append(n)
        if n >= 2 and n + n // 2 < max_items:
            sizes.append(n + n // 2)
        n *= 2
    return sizes


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


@dataclass(frozen=True, slots=True)
class Due:
    """When a bucket's batch should go under the adaptive rule, and why."""

    at: float
    trigger: Literal[
        "slo", "idle"
    ]  # "slo" (the oldest item's budget) or "idle" (the model frees up)
    budget_at: float  # the oldest item's budget: release by then (orders buckets)


class SloController:
    """The adaptive release rule (see module docstring) and what the loop reports to it.

    Thread-safe for one reporter per kind (the forward stage reports forwards, the dispatcher
    decodes, the commit stage commits): each report replaces values, read whole by the rest.

    Args:
        slo_s: the p99 latency target (``latency_slo_s``), enqueue to commit.
        model: the service-time model.
        alpha: weight of the newest sample in the moving averages.
    """

    def __init__(self, slo_s: float, model: ServiceModel, *, alpha: float = 0.1) -> None:
        if slo_s <= 0:
            raise ValueError(f"slo_s must be > 0, got {slo_s}")
        self.slo_s = slo_s
        self.model = model
        self._alpha = alpha
        self.busy_until = -math.inf  # predicted end of the forward pass in flight
        self.commit_until = -math.inf  # predicted end of the commits the commit stage holds
        self._last_done = -math.inf  # the last commit's end
        self._tail_s: float | None = None
        self._decode_per_item_s: float | None = None
        self._ends: dict[float, float] = {}  # a batch's formed_at -> its forward's end
        # a batch's formed_at -> its commit as predicted then (upper, without the slack)
        self._expected: dict[float, float] = {}
        self._misses: collections.deque[float] = collections.deque(maxlen=_MISS_WINDOW)
        self._slack_s = 0.0

    @classmethod
    def for_policy(
        cls, slo_s: float, prior: ServiceTime | None, max_batch_size: int, edges: tuple[int, ...]
    ) -> SloController:
        """A controller whose model is scaled for this policy's batch size and costs."""
        c_ref = edges[-1] if edges else 1
        return cls(slo_s, ServiceModel(prior, n_ref=max_batch_size, c_ref=c_ref))

    # -- what the loop reports ---------------------------------------------------------------

    def forward_started(self, n_items: int, cost: int, at: float) -> None:
        """The forward stage started a batch at ``at``: busy until its predicted end."""
        self.busy_until = at + self.model.predict(n_items, cost)

    def forward_done(
        self, n_items: int, cost: int, seconds: float, at: float, formed_at: float | None = None
    ) -> None:
        """A forward pass took ``seconds`` and ended at ``at``: the model is free. ``formed_at``
        (the batch's release) pairs it with its commit (:meth:`committed`)."""
        self.model.observe(n_items, cost, seconds)
        self.busy_until = at
        self.commit_until = max(self.commit_until, at) + self.tail_s  # queued for its commit
        if formed_at is not None:
            if len(self._ends) >= _MAX_ENDS:  # commits that never came (a failed stage)
                self._ends.clear()
            self._ends[formed_at] = at

    def expect(self, formed_at: float, n_items: int, cost: int) -> None:
        """A batch of ``n_items`` (cost ``cost``) was released at ``formed_at``: what its
        commit is predicted to be now, by the upper estimate, is kept for :meth:`committed`
        to measure the prediction's miss against."""
        if len(self._expected) >= _MAX_ENDS:  # commits that never came (a failed stage)
            self._expected.clear()
        self._expected[formed_at] = self._finish(formed_at, n_items, cost, self.model.bound)

    def decoded(self, n_items: int, seconds: float) -> None:
        """The dispatcher decoded ``n_items`` items in ``seconds``."""
        if n_items > 0 and seconds >= 0:
            self._decode_per_item_s = _ewma(self._decode_per_item_s, seconds / n_items, self._alpha)

    def committed(self, formed_at: float, service_s: float, done_at: float) -> None:
        """A batch released at ``formed_at`` was committed at ``done_at``. The tail is the
        commit's own time: from its forward's end, or the previous commit's end when the
        stage was still busy (commits are serial), to ``done_at`` (without that forward's
        end: all but ``service_s``). The commit stage is then predicted busy for the tails of
        the batches still waiting for it."""
        end = self._ends.pop(formed_at, None)
        if end is not None:
            tail = done_at - max(end, self._last_done)
        else:
            tail = done_at - formed_at - service_s
        self._last_done = max(self._last_done, done_at)
        self._tail_s = _ewma(self._tail_s, max(0.0, tail), self._alpha)
        self.commit_until = done_at + len(self._ends) * self.tail_s
        expected = self._expected.pop(formed_at, None)
        if expected is not None:
            self._misses.append(done_at - expected)
            if len(self._misses) >= _MIN_ERRORS:
                ordered = sorted(self._misses)
                self._slack_s = max(0.0, ordered[int(_MISS_QUANTILE * (len(ordered) - 1))])

    # -- predictions -------------------------------------------------------------------------

    @property
    def tail_s(self) -> float:
        """Measured seconds from a forward's end to its commit (EWMA; 0 before any)."""
        return self._tail_s or 0.0

    @property
    def slack_s(self) -> float:
        """Seconds the upper estimate adds for the pipeline's own misses: the
        ``_MISS_QUANTILE`` of how much later than predicted (upper estimate, at release) the
        recent batches committed; 0 while they commit in time."""
        return self._slack_s

    def terms(self) -> dict[str, float]:
        """What the upper estimate adds, for the run's summary and the metrics: the forward
        margin (relative), the commit tail and the slack (seconds)."""
        return {
            "forward_margin": self.model.margin,
            "commit_tail_s": self.tail_s,
            "slack_s": self.slack_s,
        }

    def lead_s(self, n_items: int) -> float:
        """Predicted decode seconds of ``n_items`` (measured per item; 0 before any)."""
        return (self._decode_per_item_s or 0.0) * n_items

    def finish_bound_s(self, n_items: int, cost: int) -> float:
        """Predicted seconds from release to commit on an idle model, with the model's
        margin: decode + forward (bound) + tail, and the slack. What the budget is held to."""
        return self.lead_s(n_items) + self.model.bound(n_items, cost) + self.tail_s + self.slack_s

    def finish_at(self, now: float, n_items: int, cost: int, *, upper: bool = False) -> float:
        """Predicted commit time of a batch released at ``now``: it starts once decoded and
        the forward in flight has ended, then runs and commits. The mean; ``upper``: with the
        model's margin (:meth:`ServiceModel.bound`) and the pipeline's slack
        (:attr:`slack_s`), the estimate a p99 objective is held to."""
        if upper:
            return self._finish(now, n_items, cost, self.model.bound) + self.slack_s
        return self._finish(now, n_items, cost, self.model.predict)

    def _finish(self, now: float, n_items: int, cost: int, forward: ServiceTime) -> float:
        start = max(now + self.lead_s(n_items), self.busy_until)
        return max(start + forward(n_items, cost), self.commit_until) + self.tail_s

    def due(self, oldest_enqueued_at: float, n_items: int, cost: int) -> Due:
        """When a bucket of ``n_items`` (cost ``cost``, oldest enqueued at
        ``oldest_enqueued_at``) should go: at the budget, or when the model frees up."""
        budget_at = oldest_enqueued_at + self.slo_s - self.finish_bound_s(n_items, cost)
        # free: the model, and the commit stage by the time this batch's forward ends
        ready = max(self.busy_until, self.commit_until - self.model.predict(n_items, cost))
        free_at = max(ready - self.lead_s(n_items), oldest_enqueued_at)  # idle: now
        if free_at <= budget_at:
            return Due(free_at, "idle", budget_at)
        return Due(budget_at, "slo", budget_at)

    def size_cap(self, now: float, oldest_enqueued_at: float, cost: int, max_items: int) -> int:
        """The most items (<= ``max_items``) a batch released now may hold: no more than the
        model's most efficient size (:meth:`ServiceModel.efficient_size`), and no more than
        its oldest item's budget allows, unless even one item cannot make it."""
        budget_at = oldest_enqueued_at + self.slo_s

        def fits(n: int) -> bool:
            return self.finish_at(now, n, cost, upper=True) <= budget_at

        max_items = self.model.efficient_size(cost, max_items)
        if max_items <= 1 or fits(max_items) or not fits(1):
            return max_items
        # the largest n that fits (the model grows with n; bisect on a monotone predicate)
        return bisect.bisect_left(range(1, max_items + 1), True, key=lambda n: not fits(n))
