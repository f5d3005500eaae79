"""Weighted fair share of claims across tenants: start-time fair queueing, a claim at a time.

Each tenant has a weight (``queue.tenant_weights``; 1.0 when unlisted). A claim of ``n`` ranks
the ready items of every tenant, each tenant's in its own order (priority, deadline, age, id),
by a virtual tag: the k-th (from 0) item of tenant t has tag ``S_t + k / w_t``, and the claim
takes the ``n`` smallest (ties: the item order). ``S_t``, the tenant's start, is
``max(F_t, V)``: ``F_t`` is the tag just past the last item served to t, ``V`` the virtual time,
the largest tag the last claim served. So:

- a claim splits ``n`` across the ready tenants in proportion to their weights (deficit round
  robin's split, with no quantum to tune), and a tenant with fewer ready items than its share
  leaves the rest to the others;
- across claims the tags carry the remainder, so at ``n = 1`` tenants take turns (2:1 weights:
  two of one for each of the other), and a flood from one tenant delays another by its share;
- a tenant that was idle starts at ``V``: no credit is hoarded while idle (DRR drops an empty
  queue's deficit), and a tenant at or below ``V`` needs no state (:meth:`FairShare.charge`
  forgets it, and one not served for twice ``max_tenant_wait_s``), so the state is the
  tenants served lately.

Aging: a tenant ahead of its share (a low weight, a burst) waits until the others catch up;
when this queue has not served it for ``max_tenant_wait_s``, its next item ranks before every
share, so no tenant waits longer than that (per scorer) while it has ready items.

The state is per :class:`~batching.ingress.queue.SqlQueue` (per scorer) and never written to
the database: each scorer shares fairly, and so does their sum. Pure: no I/O, no clock (the
caller passes ``now``). :func:`rank_sql` renders the shares as SQL expressions with bind
parameters for the claim statement; the dialect branches stay in ``queue``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_WEIGHT = 1.0
_RENORMALIZE_AT = 1e6  # tags are shifted back to 0 past this, so floats keep their precision


@dataclass(frozen=True)
class TenantShare:
    """One tenant's terms in a claim: its first tag, the tag step per item, whether its next
    item ranks before every share (aged)."""

    tenant: str
    start: float
    step: float
    aged: bool = False


@dataclass(frozen=True)
class Ranking:
    """The terms of one claim: the tenants with their own terms, and those of every other
    tenant (start at the virtual time, weight 1)."""

    shares: tuple[TenantShare, ...]
    default_start: float
    default_step: float = 1.0 / DEFAULT_WEIGHT


@dataclass
class FairShare:
    """Virtual tags of the tenants one queue serves (see the module docstring)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    max_tenant_wait_s: float = 30.0
    vtime: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    served_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tenant, weight in self.weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"tenant {tenant!r}: weight must be > 0, got {weight!r}")
        if not self.max_tenant_wait_s > 0:
            raise ValueError(f"max_tenant_wait_s must be > 0, got {self.max_tenant_wait_s!r}")

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, DEFAULT_WEIGHT)

    def start(self, tenant: str) -> float:
        return max(self.finish.get(tenant, self.vtime), self.vtime)

    def ranking(self, now: float) -> Ranking:
        """The terms of a claim at ``now``: every weighted tenant and every tenant ahead."""
        tenants = sorted(set(self.weights) | set(self.finish))
        shares = tuple(
            TenantShare(
                t,
                self.start(t),
                1.0 / self.weight(t),
                aged=t in self.served_at and now - self.served_at[t] >= self.max_tenant_wait_s,
            )
            for t in tenants
        )
        return Ranking(shares, self.vtime)

    def charge(self, taken: Mapping[str, int], now: float) -> None:
        """Account a claim that took ``taken[t]`` items of tenant t (the first ones of its
        order, as ranked): advance each one's tag and the virtual time, forget tenants no
        longer ahead."""
        served = {t: k for t, k in taken.items() if k > 0}
        if not served:
            return
        last = self.vtime
        for tenant, k in served.items():
            start, step = self.start(tenant), 1.0 / self.weight(tenant)
            self.finish[tenant] = start + k * step
            self.served_at[tenant] = now
            last = max(last, start + (k - 1) * step)
        self.vtime = last
        idle_since = now - 2 * self.max_tenant_wait_s  # gone idle: aging had its chance
        forget = [t for t, f in self.finish.items() if f <= last or self.served_at[t] < idle_since]
        for tenant in forget:
            del self.finish[tenant]
            self.served_at.pop(tenant, None)
        if self.vtime > _RENORMALIZE_AT:
            shift = self.vtime
            self.vtime = 0.0
            self.finish = {t: f - shift for t, f in self.finish.items()}

    def charge_aside(self, tenant: str, now: float) -> None:
        """Account one item of ``tenant`` served out of turn (a batch's lead item, taken by its
        age, not its tag): the tenant's tag advances, the virtual time does not. Were it
        advanced, a tenant served out of turn with a tag far ahead would drag every other
        tenant's start up with it, and their ties would go to the oldest items every time."""
        self.finish[tenant] = self.start(tenant) + 1.0 / self.weight(tenant)
        self.served_at[tenant] = now


def split(
    ready: Mapping[str, int], n: int, weights: Mapping[str, float] | None = None
) -> dict[str, int]:
    """How a fresh :class:`FairShare` splits a claim of ``n`` across tenants with ``ready[t]``
    items each: the ``n`` smallest tags, ties to the tenant first by name (the claim breaks
    them by the item order instead). For tests and docs; the claim ranks in SQL."""
    share = FairShare(dict(weights or {}))
    tags = sorted(
        (k / share.weight(t), t) for t, count in ready.items() for k in range(min(count, n))
    )
    out = {t: 0 for t in ready}
    for _, tenant in tags[:n]:
        out[tenant] += 1
    return out


def rank_sql(ranking: Ranking, rn: str = "rn") -> tuple[str, str, dict[str, object]]:
    """SQL expressions over a row with ``tenant`` and its place ``rn`` (from 1) in its
    tenant's order: its aged rank (0 first) and its tag; with their bind parameters
    (``fair_*``: they share a statement with the claim's own)."""
    params: dict[str, object] = {"fair_v": ranking.default_start, "fair_w": ranking.default_step}
    starts, steps, aged = [], [], []
    for i, share in enumerate(ranking.shares):
        if share.start != ranking.default_start or share.step != ranking.default_step or share.aged:
            params[f"fair_t{i}"] = share.tenant
        if share.start != ranking.default_start:
            params[f"fair_s{i}"] = share.start
            starts.append(f" WHEN :fair_t{i} THEN :fair_s{i}")
        if share.step != ranking.default_step:
            params[f"fair_w{i}"] = share.step
            steps.append(f" WHEN :fair_t{i} THEN :fair_w{i}")
        if share.aged:
            aged.append(f":fair_t{i}")
    start = f"CASE tenant{''.join(starts)} ELSE :fair_v END" if starts else ":fair_v"
    step = f"CASE tenant{''.join(steps)} ELSE :fair_w END" if steps else ":fair_w"
    tag = f"{start} + ({rn} - 1) * {step}"
    aged_rank = f"CASE WHEN {rn} = 1 AND tenant IN ({', '.join(aged)}) THEN 0 ELSE 1 END"
    return (aged_rank if aged else "1"), tag, params
