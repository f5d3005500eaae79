"""A scoring run's limits and stats: when it stops (:class:`RunLimits`), what it counted
(:class:`RunStats`, its samples in bounded memory: :class:`Samples`), and its summary as a
closing table (:func:`summary_rows`)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from batching import models, outcomes
from batching.loop.samples import Samples, rank

__all__ = ["Progress", "RunLimits", "RunStats", "RunSummary", "Samples", "summary_rows"]


@dataclass(frozen=True)
class RunLimits:
    """When a run stops: queue empty, after ``max_items`` claimed, or after ``max_seconds``."""

    until_empty: bool = True
    max_items: int | None = None
    max_seconds: float | None = None


class RunSummary(TypedDict):
    """A run's summary (``RunStats.summary``): what the CLI's closing table, the Prefect
    summary artifact and the run ledger show. The last four keys are added by the run's
    owner: lineage events not delivered, its CPU threads, and for a retried run its attempt
    and the items every attempt committed."""

    items_committed: int
    items_failed: int
    items_released: int
    lease_lost_items: int
    items_isolated: int
    items_expired: int
    batches: int
    commits: int
    batch_size_mean: float
    batch_size_p50: float
    batch_size_p99: float
    padding_efficiency: float
    items_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    service_s_mean: float
    release_reasons: dict[str, int]
    elapsed_s: float
    stage_busy_s: dict[str, float]
    items_by_version: dict[str, int]
    device_s: float
    device_s_by_tenant: dict[str, float]
    device_s_by_version: dict[str, float]
    adaptive: NotRequired[dict[str, float]]
    items_shadowed: NotRequired[int]
    shadow_failed: NotRequired[int]
    lineage_failures: NotRequired[int]
    cpu_threads: NotRequired[int]  # torch's, on CPU: a replay scores with as many
    attempt: NotRequired[int]
    run_items_committed: NotRequired[int]
    failure_reasons: NotRequired[dict[str, int]]  # the most frequent, when items failed


# RunStats fields that add up across scorers (RunStats.merged).
_ADDITIVE = (
    "shadowed",
    "shadow_failed",
    "committed",
    "failed",
    "released",
    "lease_lost",
    "isolated",
    "claimed",
    "commits",
    "batch_sizes",
    "latencies_s",
    "service_s",
    "real_tokens",
    "padded_tokens",
    "bytes_written",
    "breaker_trips",
    "expired",
    "failure_reasons",
)

_REASONS_KEPT = 32  # distinct failure reasons a run counts; the rest under ``_OTHER_REASONS``
_OTHER_REASONS = "(other reasons)"
_REASON_CHARS = 300


@dataclass
class RunStats:
    """Counters and samples of one run; ``summary()`` turns them into the closing table."""

    started_at: float
    committed: int = 0
    failed: int = 0
    released: int = 0
    lease_lost: int = 0
    isolated: int = 0  # suspects claimed in isolation rounds (``batching.crashes``)
    claimed: int = 0
    commits: int = 0
    # bounded: a count by size, and samples (:class:`Samples`); the SLO's count stays exact
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    latencies_s: Samples = field(default_factory=Samples)
    service_s: Samples = field(default_factory=Samples)
    real_tokens: int = 0
    padded_tokens: int = 0
    bytes_written: int = 0
    breaker_trips: int = 0  # retry storms that stopped the run (``batching.loop.breaker``)
    # items expired unscored: predicted late once claimed (``late_policy: expire``), or past
    # their deadline when this run's claim found them (the claim's transaction expired them)
    expired: int = 0
    # A rollout's shadow sample: stable items the candidate scored aside, and those it failed
    # (never the run's failure: the stable output commits either way).
    shadowed: int = 0
    shadow_failed: int = 0
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    # why items failed (the model's or the input's error, as the queue records it): the run's
    # failure message names the commonest, not only a count (a Prefect review)
    failure_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    by_version: collections.Counter[str] = field(default_factory=collections.Counter)
    # Device seconds (forward time on the run's one device), by tenant (apportioned by cost)
    # and by model version: what the run cost, and whom.
    device_s_by_tenant: dict[str, float] = field(default_factory=dict)
    device_s_by_version: dict[str, float] = field(default_factory=dict)
    stage_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("claim", "decode", "forward", "commit"), 0.0)
    )
    finished_at: float | None = None
    # The adaptive controller's terms at the run's end (``batching.adaptive``; empty without):
    # forward_margin (relative), commit_tail_s, slack_s (``policy.adaptive.SloController``).
    adaptive: dict[str, float] = field(default_factory=dict)

    @classmethod
    def merged(cls, parts: Sequence[RunStats]) -> RunStats:
        """One run's worth of counters from several scorers' (``score --workers``): counts and
        samples add up, and the run spans the first start to the last finish."""
        if not parts:
            raise ValueError("nothing to merge")
        total = cls(started_at=min(p.started_at for p in parts))
        for p in parts:
            for name in _ADDITIVE:
                setattr(total, name, getattr(total, name) + getattr(p, name))
            total.reasons.update(p.reasons)
            total.by_version.update(p.by_version)
            _add(total.device_s_by_tenant, p.device_s_by_tenant)
            _add(total.device_s_by_version, p.device_s_by_version)
            for stage, seconds in p.stage_s.items():
                total.stage_s[stage] = total.stage_s.get(stage, 0.0) + seconds
            for term, value in p.adaptive.items():  # the most cautious scorer's
                total.adaptive[term] = max(total.adaptive.get(term, value), value)
        ends = [p.finished_at for p in parts]
        total.finished_at = None if None in ends else max(e for e in ends if e is not None)
        return total

    def summary(self) -> RunSummary:
        """The run summary: items, batches, batch sizes, padding efficiency, latency, items/s."""
        elapsed = max((self.finished_at or time.time()) - self.started_at, 1e-9)
        sizes, lat = self.batch_sizes, self.latencies_s
        batches = sizes.total()
        summary: RunSummary = {
            "items_committed": self.committed,
            "items_failed": self.failed,
            "items_released": self.released,
            "lease_lost_items": self.lease_lost,
            "items_isolated": self.isolated,
            "items_expired": self.expired,
            "batches": batches,
            "commits": self.commits,
            "batch_size_mean": sum(k * n for k, n in sizes.items()) / batches if batches else 0.0,
            "batch_size_p50": _pct_counts(sizes, 50),
            "batch_size_p99": _pct_counts(sizes, 99),
            "padding_efficiency": self.real_tokens / self.padded_tokens
            if self.padded_tokens
            else 1.0,
            "items_per_s": self.committed / elapsed,
            "latency_p50_s": lat.quantile(50),
            "latency_p99_s": lat.quantile(99),
            "latency_max_s": lat.max,
            "service_s_mean": self.service_s.mean,
            "release_reasons": dict(self.reasons),
            "elapsed_s": elapsed,
            # Where the time went: seconds each stage was busy (stages overlap, so these can
            # add up to more than elapsed_s; the largest is the bottleneck).
            "stage_busy_s": dict(self.stage_s),
            # A rollout's route split the items: how many each model version committed.
            "items_by_version": dict(self.by_version),
            "device_s": sum(self.device_s_by_version.values()),
            "device_s_by_tenant": dict(self.device_s_by_tenant),
            "device_s_by_version": dict(self.device_s_by_version),
        }
        if self.adaptive:
            summary["adaptive"] = dict(self.adaptive)
        if self.failure_reasons:
            summary["failure_reasons"] = dict(self.failure_reasons.most_common(5))
        if self.shadowed or self.shadow_failed:
            summary["items_shadowed"] = self.shadowed
            summary["shadow_failed"] = self.shadow_failed
        return summary

    def count_failures(self, reasons: Iterable[str], weight: int = 1) -> None:
        """Count items failed for ``reasons`` (``weight`` each: a shard's rows), at most
        ``_REASONS_KEPT`` distinct."""
        for reason in reasons:
            text = reason[:_REASON_CHARS]
            if text in self.failure_reasons or len(self.failure_reasons) < _REASONS_KEPT:
                self.failure_reasons[text] += weight
            else:
                self.failure_reasons[_OTHER_REASONS] += weight

    def add_device_time(
        self, items: Sequence[models.WorkItem], version: str, seconds: float
    ) -> None:
        """A forward pass's seconds (a committed batch's, a shadow pass's), to the items'
        tenants by cost and to the version that ran it."""
        _add(self.device_s_by_tenant, outcomes.by_cost(items, seconds))
        _add(self.device_s_by_version, {version: seconds})


def _add(into: dict[str, float], more: Mapping[str, float]) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value


def summary_rows(summary: Mapping[str, object]) -> list[tuple[str, str]]:
    """A run summary (:class:`RunSummary`, or one read back as JSON) as ``(metric, value)``
    rows: the CLI's closing table and the Prefect summary artifact both show these."""
    reasons = summary.get("release_reasons")
    reasons = reasons if isinstance(reasons, Mapping) else {}
    rows = [
        ("items committed", f"{summary['items_committed']}"),
        ("items failed", f"{summary['items_failed']}"),
        ("items released", f"{summary['items_released']}"),
        ("batches", f"{summary['batches']}"),
        ("commits", f"{summary.get('commits', 0)}"),
        ("batch size mean", f"{summary['batch_size_mean']:.1f}"),
        (
            "batch size p50 / p99",
            f"{summary['batch_size_p50']:.0f} / {summary['batch_size_p99']:.0f}",
        ),
        ("padding efficiency", f"{summary['padding_efficiency']:.3f}"),
        ("items/s", f"{summary['items_per_s']:.1f}"),
        (
            "latency p50 / p99 (s, enqueue to commit)",
            f"{summary['latency_p50_s']:.3f} / {summary['latency_p99_s']:.3f}",
        ),
        ("elapsed (s)", f"{summary['elapsed_s']:.1f}"),
        ("release reasons", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "-"),
    ]
    failures = summary.get("failure_reasons")
    if isinstance(failures, Mapping) and failures:  # the commonest first
        rows.insert(2, ("items failed, by reason", outcomes.reasons_line(failures)))
    if summary.get("items_isolated"):  # suspects of a lost worker, scored alone
        rows.insert(3, ("items scored in isolation", f"{summary['items_isolated']}"))
    if summary.get("items_expired"):  # expired unscored: late, or past their deadline
        rows.insert(3, ("items expired (late)", f"{summary['items_expired']}"))
    if summary.get("items_shadowed") or summary.get("shadow_failed"):  # a rollout's sample
        rows.append(
            (
                "shadowed: scored aside / failed by the candidate",
                f"{summary.get('items_shadowed', 0)} / {summary.get('shadow_failed', 0)}",
            )
        )
    terms = summary.get("adaptive")
    if isinstance(terms, Mapping) and terms:  # why items expired: what the controller added
        rows.append(
            (
                "adaptive: forward margin / commit tail / slack",
                f"{float(terms.get('forward_margin', 0.0)):.0%} / "
                f"{float(terms.get('commit_tail_s', 0.0)):.3f} s / "
                f"{float(terms.get('slack_s', 0.0)):.3f} s",
            )
        )
    device = summary.get("device_s_by_tenant")
    if isinstance(device, Mapping) and device:  # the busiest tenants first
        top = sorted(device.items(), key=lambda kv: -float(kv[1]))[:5]
        shown = ", ".join(f"{t} {float(s):.3g}" for t, s in top)
        more = f" (+{len(device) - 5} more)" if len(device) > 5 else ""
        rows.append(("device seconds by tenant", shown + more))
    device_s = summary.get("device_s")
    if isinstance(device_s, int | float):
        rows.append(("device seconds (forward)", f"{device_s:.3g}"))
    by_version = summary.get("items_by_version")
    if isinstance(by_version, Mapping) and by_version:  # a rollout's route split them
        shown = ", ".join(f"{v} {n}" for v, n in sorted(by_version.items()))
        rows.insert(1, ("items by model version", shown))
    # Three significant digits: a short run's stages are busy for milliseconds, which a fixed
    # two decimals showed as 0.00.
    busy = summary.get("stage_busy_s")
    rows += (
        [(f"busy s: {k}", f"{v:.3g}") for k, v in (busy or {}).items()]
        if isinstance(busy, Mapping)
        else []
    )
    if "lineage_failures" in summary:
        rows.append(("lineage events not delivered", f"{summary['lineage_failures']}"))
    if "attempt" in summary:  # a retry: the rows above are this attempt's
        rows.append(("attempt", f"{summary['attempt']}"))
        rows.append(("items committed, all attempts", f"{summary['run_items_committed']}"))
    return rows


def _pct_counts(counts: Mapping[int, int], p: float) -> float:
    """Percentile ``p`` of values given as value -> how many times."""
    n = sum(counts.values())
    if not n:
        return 0.0
    k, seen = rank(n, p), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen > k:
            return float(value)
    return float(max(counts))


Progress = Callable[[RunStats], None]
