"""Pure micro-batcher: pending claimed items in, released ``Batch`` values out.

No I/O, no wall clock, no sleeps: time comes from the injected ``Clock`` (epoch seconds), so the
policy is tested with a fake clock. The scoring loop calls :meth:`MicroBatcher.poll` only when
the executor is free, so the next batch keeps growing while the model is busy (Triton, TF
Serving, BentoML), and sleeps until :meth:`MicroBatcher.next_deadline` or new items.

Policy:

- **Buckets.** Each item goes to the length bucket of its ``cost``: the first edge of
  ``policy.length_buckets`` that is >= cost; items above the last edge go to an overflow bucket,
  so ``k`` edges make ``k + 1`` buckets (no edges: one bucket). A batch mixes buckets only
  under the adaptive rule (below).
- **When.** A bucket is *full* when it holds ``max_batch_size`` items or its total cost reaches
  ``max_batch_cost``. Otherwise it is *due* when its oldest item's age, measured from that item's
  ``enqueued_at`` (not from when the batcher saw it), reaches ``max_wait_s``, or at
  ``earliest deadline_at - service_time(n, max cost)``, where ``n`` and the max cost are those
  of the bucket's next batch (capped at ``max_batch_size``; the cost is the bucket's largest, a
  conservative estimate). A bucket is ready when full or due.
- **Which bucket.** Among ready buckets the one with the earliest due time releases first, so an
  overdue bucket goes before a full bucket that is not yet due, and under overload buckets are
  served oldest-first (nothing starves across buckets; with light tenants, nothing past its
  SLO budget). ``flush=True`` releases the most urgent bucket even when none is ready.
- **Who (online).** Within a bucket items are cut in order of priority (higher first), then
  deadline (earliest first, none last), then ``enqueued_at``. The cut stops at the first item
  that would break the size or cost cap; the first item always fits, so an item costlier than
  the whole budget is released alone rather than stuck. Priority is strict inside a bucket: a
  wait or deadline trigger decides *when*, priority decides *who*.
- **Whose (``fair``, from ``queue.fair_share``).** A bucket holding several tenants' items
  takes its first item as above, then the rest as a fair claim ranks them
  (:mod:`batching.tenant_share`): each tenant's items in the order above, interleaved by
  weight, an aged tenant's first item ahead. A claim of 1,000 of one tenant's items thus does
  not hold another's 10 back for 1,000 / ``max_batch_size`` batches. The first item leads so
  that buckets, which take turns by it, keep taking turns. Blocks of different tenants go to
  the buckets for it. One tenant: the order above, nothing ranked. A flush cuts by length as
  below, items of one cost in the fair order.
- **Light tenants first (``fair`` and ``adaptive``).** A tenant with items pending is
  *light* while its recent arrivals (items over weight, decayed with a 2 s half-life) are at
  most a quarter of the heaviest pending tenant's, and all tenants of such a rate together
  send at most a third of the arrivals (many small tenants are the load, not a flood's
  victims). While a light tenant has an item pending, the next batch goes from the ready
  bucket of its most urgent item instead of by the buckets' turn; that bucket's light items
  lead its cut, and light items of shorter buckets ride in it (padded to its length, within
  ``max_batch_size`` and the padded ``max_batch_cost``, while every item stays predicted in
  time, as ``_fill`` requires; the flood's items make room). A pass serves one bucket and a
  flood fills them all, so a light item otherwise waited for its bucket's turn behind the
  flood. Not when the most urgent bucket's budget would be spent before the light pass is
  through: it goes. Tenants of one rate are never light, and their batches are as without
  the rule; so, across buckets, nothing starves past a bucket's SLO budget.
- **Who (bulk, ``flush=True`` and ``drain``).** The batch is built around the bucket's most
  urgent item (the anchor) and filled with the items nearest to it in cost, then sorted by cost.
  Many pending items therefore give full, length-sorted batches with little padding, while the
  anchor keeps long items from starving behind a stream of short ones.
- **Reason.** ``"size"``/``"cost"`` when the bucket was full (size if the batch has
  ``max_batch_size`` rows, else cost), else ``"deadline"`` or ``"wait"`` for the time trigger
  that fired first, else ``"flush"``.

Uniform claims (``models.ItemBlock``: one tensor shape, cost and priority, no deadline) skip
the per-item structures while no bucket holds an item: blocks wait in order and full batches
are cut from the first as slices, which is what the bucket would cut (the same items, reason,
stats and times; tested against the item path on random workloads). A first block that holds
no full batch, a block that would come before those waiting, or items of another kind send
every pending block into the buckets, where the rules above decide.

The batcher never drops items silently: with ``late_policy="score"`` (the default) items past
their deadline are released like the rest; with ``"expire"`` an item whose deadline falls
before the predicted finish of the batch it was cut into (now + the predicted service; with
``adaptive``, the controller's predicted commit time) leaves the batch and waits in
:meth:`MicroBatcher.take_late` with a reason naming its deadline and the prediction, for the
loop to expire (never scored).

With an ``adaptive`` controller (``batching.policy.adaptive``; ``batching.adaptive``), a bucket
is due at the earlier of its deadline rule (with the controller's prediction) and the
controller's release time: when the model frees up, never later than the oldest item's SLO
budget (reasons ``"idle"`` and ``"slo"``); buckets are served in order of their oldest item's
budget, and a batch is cut no larger than that budget allows. ``max_wait_s`` is no trigger
there: at a free model the rule goes at once, and a batch the window pushed into a busy one
would only wait behind the forward in flight, smaller than the one the model could take
when it frees. A batch cut short of its caps takes the items of other buckets (nearest
first) where the model predicts one padded forward pass no longer than the two it replaces
and a lower sum of the pending items' completion times, while every item in it stays
predicted in time (:meth:`MicroBatcher._fill`): at low load one pass serves several
buckets' few items instead of each bucket waiting its turn; near capacity the buckets fill
on their own, padding costs more than it saves, and none join. Buckets keep
their items in sorted lists, lazily deleted: a claim arrives already in bucket order, so an
``add`` of k items is O(k) (one merge when it interleaves with what is pending) and a release
of b items O(b) plus the stale entries it skips, plus O(number of buckets) per decision.

Why it stays one module: one decision (which items leave, and when) made from one data
structure (the buckets and the queue of blocks); the block path is tested against the item
path on random workloads, which keeps both in one place.
"""

from __future__ import annotations

import bisect
import collections
import datetime
import functools
import heapq
import itertools
import math
import operator
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from batching import models, ports, tenant_share
from batching.policy.adaptive import ServiceTime, SloController

if TYPE_CHECKING:
    from batching.config import BatchingPolicy

__all__ = ["Late", "MicroBatcher", "ServiceTime", "batch_stats", "bucket_index"]

Reason = Literal["size", "cost", "wait", "deadline", "flush", "slo", "idle"]
LatePolicy = Literal["score", "expire"]


@dataclass(frozen=True, slots=True)
class Late:
    """An item cut from a batch because it cannot meet its deadline (``late_policy: expire``)."""

    item: models.WorkItem
    reason: str


_Entry = TypeVar("_Entry", bound=tuple[Any, ...])
_LIGHT_RATIO = 4  # a tenant is light while it sends at most 1/4 of the heaviest's rate
_LIGHT_SHARE = 1 / 3  # ... and the light tenants together at most this share of arrivals
_LIGHT_HALF_LIFE_S = 2.0  # of the tenants' arrival counts
_LIGHT_FORGET = 0.01  # a tenant's count below this is dropped (gone quiet)
_COMPACT_SLACK = 64  # stale entries tolerated before a rebuild, beyond 2x live items
# The per-item work below runs as map/zip over items with models' field getters (C calls),
# not as a Python step per item (the batcher held ~22% of a W1 run's GIL time that way).
_ID, _COST, _ENQUEUED = models.ITEM_ID, models.ITEM_COST, models.ITEM_ENQUEUED_AT
_SEQ = operator.itemgetter(-1)  # of an ordered entry


def _grouped(
    keys: list[int], seqs: list[int], items: list[models.WorkItem]
) -> list[tuple[int, list[int], list[models.WorkItem]]]:
    """``(key, seqs, items)`` per distinct key (a bucket, a cost), in first-seen order; one
    group without a step per item when every key is the same (fixed-size inputs)."""
    if keys and keys.count(keys[0]) == len(keys):
        return [(keys[0], seqs, items)]
    groups: dict[int, tuple[list[int], list[models.WorkItem]]] = {}
    for key, seq, item in zip(keys, seqs, items, strict=True):
        group_seqs, group_items = groups.setdefault(key, ([], []))
        group_seqs.append(seq)
        group_items.append(item)
    return [(key, group_seqs, group_items) for key, (group_seqs, group_items) in groups.items()]


def bucket_index(cost: int, edges: Sequence[int]) -> int:
    """Return the length bucket of ``cost``: the first edge >= cost, ``len(edges)`` above all."""
    return bisect.bisect_left(edges, cost)


def batch_stats(
    items: Sequence[models.WorkItem], formed_at: float, max_batch_size: int
) -> models.BatchStats:
    """Describe a batch: size, total cost, fill, padding efficiency and waits (seconds).

    Args:
        items: the batch, at least one item.
        formed_at: when the batch was released (epoch seconds).
        max_batch_size: the policy's row cap (``fill`` = size / max_batch_size).

    Waits run from each item's ``enqueued_at`` to ``formed_at``, clamped at 0 for clock skew.
    ``padding_efficiency`` is sum(cost) / (size * max(cost)), 1.0 when all costs are equal.
    """
    size = len(items)
    costs = models.item_column(items, "cost")
    total, widest = sum(costs), max(costs)
    enqueued = models.item_column(items, "enqueued_at")
    waits = list(map(operator.sub, itertools.repeat(formed_at, size), enqueued))
    if min(waits) < 0.0:  # clock skew: clamp each wait (rare; otherwise all of it runs in C)
        waits = [max(0.0, w) for w in waits]
    return models.BatchStats(
        size=size,
        cost=total,
        fill=size / max_batch_size,
        padding_efficiency=total / (size * widest) if widest > 0 else 1.0,
        oldest_wait_s=max(waits),
        mean_wait_s=sum(waits) / size,
    )


def _no_service_time(n_items: int, max_cost: int) -> float:
    return 0.0


class _Ordered(Generic[_Entry]):
    """Entries (tuples ending with an item's seq) in ascending order, lazily deleted: entries
    of released items are skipped at the front and dropped once they outnumber live items.

    Claims arrive sorted the way buckets order them, so adding is an append (or one sort that
    merges two sorted runs, linear time), and a cut walks from the front: no per-item heap
    pushes and pops.
    """

    __slots__ = ("_entries", "_head")

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._head = 0  # entries before it are all stale

    def add(self, entries: list[_Entry]) -> None:
        if not entries:
            return
        entries.sort()
        mine = self._entries
        if mine and entries[0] < mine[-1]:
            del mine[: self._head]
            self._head = 0
            mine.extend(entries)
            mine.sort()
        else:
            mine.extend(entries)

    def top(self, live: dict[int, models.WorkItem]) -> _Entry | None:
        """The first live entry, or None."""
        mine, head = self._entries, self._head
        while head < len(mine) and mine[head][-1] not in live:
            head += 1
        self._head = head
        return mine[head] if head < len(mine) else None

    def live_seqs(self, live: dict[int, models.WorkItem]) -> Iterator[int]:
        """The seqs of live entries in order, filtered in C (do not release while iterating)."""
        return filter(
            live.__contains__, map(_SEQ, itertools.islice(self._entries, self._head, None))
        )

    def live_entries(self, live: dict[int, models.WorkItem]) -> Iterator[_Entry]:
        """The live entries in order (do not release while iterating)."""
        return (e for e in itertools.islice(self._entries, self._head, None) if e[-1] in live)

    def compact(self, live: dict[int, models.WorkItem]) -> None:
        mine, head = self._entries, self._head
        if len(mine) - head > 2 * len(live) + _COMPACT_SLACK:
            self._entries = [entry for entry in mine[head:] if entry[-1] in live]
            self._head = 0
        elif head > _COMPACT_SLACK and 2 * head > len(mine):
            del mine[:head]
            self._head = 0


@dataclass(frozen=True, slots=True)
class _Budget:
    """The per-batch caps: rows and, optionally, total cost."""

    max_size: int
    max_cost: int | None

    def fits(self, n_taken: int, cost_taken: int, cost: int) -> bool:
        """Whether one more item of ``cost`` fits; the first item always does."""
        if n_taken == 0:
            return True
        if n_taken >= self.max_size:
            return False
        return self.max_cost is None or cost_taken + cost <= self.max_cost

    def rows_of(self, cost: int) -> int:
        """Rows of one ``cost`` that a batch takes (what ``fits`` lets in, one by one)."""
        if self.max_cost is None or cost <= 0:
            return self.max_size
        return max(1, min(self.max_size, self.max_cost // cost))

    def full(self, n_items: int, cost: int) -> bool:
        """Whether pending items of this count and total cost make at least one capped batch."""
        return n_items >= self.max_size or (self.max_cost is not None and cost >= self.max_cost)


class _Bucket:
    """Pending items of one length bucket, indexed for O(log n) decisions (lazy-deleted heaps).

    ``fair``: count the live items of each tenant (``tenants``), and keep each tenant's order
    while there are several, for fair cuts; without it ``tenants`` stays empty."""

    def __init__(self, *, fair: bool = False) -> None:
        self._fair = fair
        self.items: dict[int, models.WorkItem] = {}  # seq -> item, the live set
        self.cost = 0
        self._order: _Ordered[tuple[int, float, float, int]] = _Ordered()  # -prio, dl, enq, seq
        self._ages: _Ordered[tuple[float, int]] = _Ordered()  # (enqueued_at, seq)
        self._deadlines: _Ordered[tuple[float, int]] = _Ordered()  # (deadline_at, seq)
        self._groups: dict[int, dict[int, models.WorkItem]] = {}  # cost -> seq -> item
        self._costs: list[int] = []  # sorted distinct costs present
        self.tenants: collections.Counter[str] = collections.Counter()  # live items a tenant
        # Each tenant's entries of _order, kept only while the bucket holds several tenants'
        # items (built when a second tenant arrives): a fair cut reads each tenant's first few
        # instead of walking every pending item.
        self._by_tenant: dict[str, _Ordered[tuple[int, float, float, int]]] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def push(self, seqs: list[int], items: list[models.WorkItem]) -> None:
        """Add items, each under its unique sequence number (``seqs[i]`` for ``items[i]``)."""
        self.items.update(zip(seqs, items, strict=True))
        if self._fair:
            self.tenants.update(map(models.ITEM_TENANT, items))  # counted in C
        costs = list(map(_COST, items))
        self.cost += sum(costs)
        enqueued = list(map(_ENQUEUED, items))
        deadlines = list(map(models.ITEM_DEADLINE_AT, items))
        sort_deadlines: Iterable[float]
        if deadlines.count(None) == len(deadlines):  # the common case: no deadline at all
            sort_deadlines = itertools.repeat(math.inf, len(items))
        else:
            sort_deadlines = [math.inf if d is None else d for d in deadlines]
            self._deadlines.add(
                [(d, q) for d, q in zip(deadlines, seqs, strict=True) if d is not None]
            )
        prios = map(operator.neg, map(models.ITEM_PRIORITY, items))
        entries = list(zip(prios, sort_deadlines, enqueued, seqs, strict=True))
        if self._by_tenant is not None:
            self._add_by_tenant(entries, list(map(models.ITEM_TENANT, items)))
        self._order.add(entries)
        if self._by_tenant is None and len(self.tenants) > 1:
            live = list(self._order.live_entries(self.items))
            self._by_tenant = {}
            self._add_by_tenant(live, [self.items[e[-1]].tenant for e in live])
        self._ages.add(list(zip(enqueued, seqs, strict=True)))
        for cost, group_seqs, group_items in _grouped(costs, seqs, items):
            group = self._groups.get(cost)
            if group is None:
                group = self._groups[cost] = {}
                bisect.insort(self._costs, cost)
            group.update(zip(group_seqs, group_items, strict=True))

    def _add_by_tenant(
        self, entries: list[tuple[int, float, float, int]], tenants: list[str]
    ) -> None:
        assert self._by_tenant is not None
        if tenants and tenants.count(tenants[0]) == len(tenants):
            groups = {tenants[0]: list(entries)}
        else:
            groups = {}
            for entry, tenant in zip(entries, tenants, strict=True):
                groups.setdefault(tenant, []).append(entry)
        for tenant, group in groups.items():
            self._by_tenant.setdefault(tenant, _Ordered()).add(group)

    def _uncount(self, taken: list[models.WorkItem]) -> None:
        for tenant, n in collections.Counter(map(models.ITEM_TENANT, taken)).items():
            left = self.tenants[tenant] - n
            if left > 0:
                self.tenants[tenant] = left
            else:
                del self.tenants[tenant]

    def oldest_enqueued_at(self) -> float:
        """``enqueued_at`` of the oldest pending item (bucket must be non-empty)."""
        top = self._ages.top(self.items)
        assert top is not None
        return top[0]

    def earliest_deadline(self) -> float | None:
        """Earliest ``deadline_at`` pending, or None when no item has one."""
        top = self._deadlines.top(self.items)
        return None if top is None else top[0]

    def max_cost(self) -> int:
        """Largest pending item cost (bucket must be non-empty)."""
        return self._costs[-1]

    def cut_in_order(self, budget: _Budget, order: Iterable[int] | None = None) -> list[int]:
        """Take items by (priority, deadline, enqueue), or in ``order`` (live seqs, e.g.
        :meth:`fair_order`), until the next would break the budget."""
        live = self._order.live_seqs(self.items) if order is None else iter(order)
        if budget.max_cost is None:  # rows are the only cap: the first max_size live items
            return list(itertools.islice(live, budget.max_size))
        seqs: list[int] = []
        total = 0
        for seq in live:
            cost = self.items[seq].cost
            if not budget.fits(len(seqs), total, cost):
                break
            seqs.append(seq)
            total += cost
        return seqs

    def fair_order(self, share: tenant_share.FairShare, now: float, per_tenant: int) -> list[int]:
        """Seqs for a fair cut (the bucket holds several tenants' items): the bucket's first
        item (the most urgent, as an unfair cut takes it), then each tenant's first
        ``per_tenant`` items (a batch takes no more of one) as a fair claim ranks them
        (:mod:`batching.tenant_share`): the k-th of tenant t at tag ``S_t + k / w_t``, an aged
        tenant's first before every tag; ties by the bucket's order.

        The first item leads because buckets take turns by it (their oldest, or an overdue
        deadline): were it passed over, its bucket would keep the turn and starve the others.
        """
        assert self._by_tenant is not None
        top = self._order.top(self.items)
        assert top is not None
        lead = top[-1]
        ranking = share.ranking(now)
        terms = {term.tenant: term for term in ranking.shares}
        default = tenant_share.TenantShare("", ranking.default_start, ranking.default_step)
        ranked: list[tuple[int, float, tuple[int, float, float, int]]] = []
        for tenant, ordered in self._by_tenant.items():
            term = terms.get(tenant, default)
            ordered.top(self.items)  # past the released front: cuts take a tenant's first
            firsts = itertools.islice(ordered.live_entries(self.items), per_tenant)
            for k, entry in enumerate(firsts):
                rank = -1 if entry[-1] == lead else (0 if term.aged and k == 0 else 1)
                ranked.append((rank, term.start + k * term.step, entry))
        ranked.sort()
        return [entry[-1] for _, _, entry in ranked]

    def entries_of(
        self, tenants: Collection[str], most: int
    ) -> list[tuple[int, float, float, int]]:
        """The first ``most`` live entries (-priority, deadline, enqueued_at, seq) of
        ``tenants``' items, in the bucket's order (:meth:`MicroBatcher._light_turn`)."""
        if self._by_tenant is None:  # one tenant here
            if not any(t in tenants for t in self.tenants):
                return []
            self._order.top(self.items)
            return list(itertools.islice(self._order.live_entries(self.items), most))
        mine = []
        for tenant in tenants:
            ordered = self._by_tenant.get(tenant)
            if ordered is not None:
                ordered.top(self.items)  # past the released front (riders leave from it)
                mine.append(itertools.islice(ordered.live_entries(self.items), most))
        return list(itertools.islice(heapq.merge(*mine), most))

    def cut_by_length(self, budget: _Budget, order: Sequence[int] | None = None) -> list[int]:
        """Take the most urgent item, then the items nearest to it in cost, within the budget;
        items of one cost in ``order`` (live seqs, e.g. :meth:`fair_order`) when given."""
        top = self._order.top(self.items)
        assert top is not None
        anchor = top[-1]
        rank = None if order is None else {seq: k for k, seq in enumerate(order)}
        seqs, total = [anchor], self.items[anchor].cost
        for seq, item in self._nearest(self.items[anchor].cost, rank):
            if seq == anchor:
                continue
            if not budget.fits(len(seqs), total, item.cost):
                break
            seqs.append(seq)
            total += item.cost
        return seqs

    def _nearest(
        self, cost: int, rank: dict[int, int] | None = None
    ) -> Iterator[tuple[int, models.WorkItem]]:
        """Pending items by distance of their cost from ``cost`` (ties: cheaper first); those
        of one cost by ``rank`` (seq -> place) when given, else as they came."""
        costs = self._costs
        hi = bisect.bisect_left(costs, cost)
        lo = hi - 1
        while lo >= 0 or hi < len(costs):
            if hi >= len(costs) or (lo >= 0 and cost - costs[lo] <= costs[hi] - cost):
                group, lo = costs[lo], lo - 1
            else:
                group, hi = costs[hi], hi + 1
            if rank is None:
                yield from self._groups[group].items()
            else:
                last = len(rank)  # items past every tenant's first few: after, as they came
                yield from sorted(self._groups[group].items(), key=lambda kv: rank.get(kv[0], last))

    def remove(self, seqs: Iterable[int]) -> list[models.WorkItem]:
        """Remove the given items and return them in the same order."""
        seqs = list(seqs)
        taken = list(map(self.items.pop, seqs))
        if self._fair:
            self._uncount(taken)
        costs = list(map(_COST, taken))
        self.cost -= sum(costs)
        for cost, group_seqs, _ in _grouped(costs, seqs, taken):
            group = self._groups[cost]
            collections.deque(map(group.__delitem__, group_seqs), maxlen=0)
            if not group:
                del self._groups[cost]
                del self._costs[bisect.bisect_left(self._costs, cost)]
        for ordered in (self._order, self._ages, self._deadlines):
            ordered.compact(self.items)
        if self._by_tenant is not None:
            if len(self.tenants) <= 1:
                self._by_tenant = None
            else:
                for tenant in list(self._by_tenant):
                    if tenant in self.tenants:
                        self._by_tenant[tenant].compact(self.items)
                    else:
                        del self._by_tenant[tenant]
        return taken


@dataclass(frozen=True, slots=True)
class _Readiness:
    """One non-empty bucket's release state at a given time."""

    index: int
    full: bool
    due_at: float  # epoch seconds when the wait or deadline trigger fires
    trigger: Reason  # "wait", "deadline" (or adaptive "slo", "idle"): which gives due_at
    rank: float  # order among ready buckets: due_at, or (adaptive) the oldest item's budget

    def ready(self, now: float) -> bool:
        return self.full or self.due_at <= now

    def ready_at(self, now: float) -> float:
        """When this bucket can release: now if full (or its due time if earlier)."""
        return min(self.due_at, now) if self.full else self.due_at


@dataclass(frozen=True, slots=True)
class _LightTurn:
    """The bucket to release, and with light tenants first (:meth:`MicroBatcher._light_turn`)
    the light tenants, the riders ((bucket index, seq) in the buckets' order), and the time
    the pass must be through by (the most urgent bucket's budget; inf when it is this one)."""

    state: _Readiness
    light: frozenset[str] = frozenset()
    riders: tuple[tuple[int, int], ...] = ()
    hold: float = math.inf


class MicroBatcher:
    """Forms micro-batches from claimed items under a ``BatchingPolicy`` (see module docstring).

    Args:
        policy: caps (``max_batch_size``, ``max_batch_cost``), ``max_wait_s`` (seconds) and
            ``length_buckets`` (strictly increasing cost edges).
        clock: returns the current time in epoch seconds.
        service_time: predicted seconds of one forward pass for (n_items, max item cost);
            used to release early enough to meet ``deadline_at``. None means 0 seconds.
        adaptive: the SLO-adaptive release rule (its model replaces ``service_time``);
            None: the fixed rules above.
        late_policy: ``"expire"`` takes items that cannot meet their deadline out of the
            batches cut (see :meth:`take_late`); ``"score"`` releases them like the rest.
        default_deadline_s: with ``"expire"``, an item without a deadline of its own is due
            this long after its enqueue (``queue.default_deadline_s``); None: it cannot be late.
        fair: the tenants' fair share of each batch (``queue.fair_share``): a bucket holding
            several tenants' items cuts them as a fair claim ranks them; None: one order.
    """

    def __init__(
        self,
        policy: BatchingPolicy,
        clock: ports.Clock,
        service_time: ServiceTime | None = None,
        *,
        adaptive: SloController | None = None,
        late_policy: LatePolicy = "score",
        default_deadline_s: float | None = None,
        fair: tenant_share.FairShare | None = None,
    ) -> None:
        self._policy = policy
        self._default_deadline_s = default_deadline_s if late_policy == "expire" else None
        self._fair = fair
        self._clock = clock
        self._adaptive = adaptive
        self._late_policy = late_policy
        self._late: list[Late] = []
        self._draining = False
        if adaptive is not None:
            service_time = adaptive.finish_bound_s
        self._service_time = service_time or _no_service_time
        self._edges = tuple(policy.length_buckets)
        self._budget = _Budget(policy.max_batch_size, policy.max_batch_cost)
        self._buckets = [_Bucket(fair=fair is not None) for _ in range(len(self._edges) + 1)]
        # Uniform claims (ItemBlocks) wait here, in order, while no bucket holds an item: full
        # batches are cut from the first as slices, without an entry per item. Whatever is
        # not a full batch goes to the buckets (see _settle), so the policy is unchanged.
        self._blocks: collections.deque[models.ItemBlock] = collections.deque()
        self._ids: set[int] = set()
        self._seq = itertools.count()
        self._bucket_of = functools.partial(bisect.bisect_left, self._edges)  # bucket_index
        self._arrivals: dict[str, float] = {}  # tenant -> decayed items added (_light_tenants)
        self._arrivals_at = -math.inf

    def __len__(self) -> int:
        """Number of pending items."""
        return len(self._ids)

    @property
    def n_buckets(self) -> int:
        """Number of length buckets (``len(length_buckets) + 1``)."""
        return len(self._buckets)

    def add(self, items: Iterable[models.WorkItem]) -> None:
        """Add claimed items; they wait here until released in a batch.

        Raises:
            ValueError: an item id is already pending (or repeated), or an item's cost is < 0.
                Nothing is added in that case.
        """
        if isinstance(items, models.ItemBlock) and self._take_block(items):
            self._count_arrivals({items.template.tenant: len(items)})
            return
        items = list(items)
        if self._blocks:  # items of another kind: every pending item goes to the buckets
            self._spill()
        self._add_items(items)
        if self._fair is not None and self._adaptive is not None:
            self._count_arrivals(collections.Counter(map(models.ITEM_TENANT, items)))

    def _take_block(self, block: models.ItemBlock) -> bool:
        """Keep ``block`` whole if it can be cut as it stands: no bucket holds an item, it falls
        in the bucket of the blocks waiting and comes after them in its order (lower priority,
        or the same and enqueued no earlier: a claim after a retry's backoff may hold older
        items), and its ids are new."""
        if not block or any(self._buckets) or block.template.cost < 0:
            return False
        if self._blocks:  # the buckets' order: priority, then enqueued_at, then arrival
            last = self._blocks[-1]
            prio, last_prio = block.template.priority, last.template.priority
            if (
                self._bucket_of(block.template.cost) != self._bucket_of(last.template.cost)
                or (self._fair is not None and block.template.tenant != last.template.tenant)
                or prio > last_prio
                or (prio == last_prio and block.enqueued_at[0] < last.enqueued_at[-1])
            ):
                return False
        ids = set(block.ids)
        if len(ids) != len(block) or not self._ids.isdisjoint(ids):
            return False  # the item path names the repeated item
        self._blocks.append(block)
        self._ids.update(ids)
        return True

    def _spill(self) -> None:
        """Move the waiting blocks into the buckets, item by item (the general path)."""
        while self._blocks:  # one at a time: a failed add leaves the rest where they were
            block = self._blocks[0]
            self._ids.difference_update(block.ids)
            try:
                self._add_items(list(block))
            except BaseException:
                self._ids.update(block.ids)
                raise
            self._blocks.popleft()

    def _settle(self) -> None:
        """A first block that holds no full batch, or whose oldest item would be late by its
        default deadline, goes to the buckets with those after it: there the wait, deadline,
        late and flush rules decide."""
        if self._blocks:
            head = self._blocks[0]
            cost = head.template.cost
            if not self._budget.full(len(head), len(head) * cost) or (
                self._default_deadline_s is not None
                and not self._draining
                and head.enqueued_at[0] + self._default_deadline_s
                < self._finish_at(self._clock(), self._budget.rows_of(cost), cost, upper=True)
            ):
                self._spill()

    def _add_items(self, batch: list[models.WorkItem]) -> None:
        self._check_new(batch)
        seqs = list(itertools.islice(self._seq, len(batch)))
        indexes = list(map(self._bucket_of, map(_COST, batch)))
        for index, group_seqs, group_items in _grouped(indexes, seqs, batch):
            self._buckets[index].push(group_seqs, group_items)
        self._ids.update(map(_ID, batch))

    def poll(self, *, flush: bool = False) -> models.Batch | None:
        """Release one batch if one must go now; call it when the executor is free.

        Args:
            flush: release the most urgent bucket even if no cap or trigger is reached (end of
                run, bulk drain); the batch is then cut by length (see module docstring).

        Returns:
            A non-empty batch, or None when nothing is pending or nothing is ready yet.
        """
        while self._ids:
            self._settle()
            now = self._clock()
            if self._blocks:
                return self._expected(self._cut_block(now))
            states = self._readiness()
            best = min(states, key=lambda s: (not s.ready(now), s.rank, s.index))
            if not (flush or best.ready(now)):
                return None
            turn = _LightTurn(best)
            if not flush and self._adaptive is not None and self._fair is not None:
                turn = self._light_turn(best, states, now)
            batch = self._release(turn.state, now, states, by_length=flush, turn=turn)
            if batch is not None:
                return self._expected(batch)
            # every item of that cut was late (``take_late``): look again
        return None

    def _expected(self, batch: models.Batch) -> models.Batch:
        """``batch``, its predicted commit told to the controller, which learns from the
        actual one how far its predictions run late (:meth:`SloController.expect`)."""
        if self._adaptive is not None and not self._draining:
            cost = max(models.item_column(batch.items, "cost"))  # a block's: one column
            self._adaptive.expect(batch.formed_at, len(batch), cost)
        return batch

    def take_late(self) -> list[Late]:
        """The items cut out of batches as late since the last call (``late_policy:
        expire``), each with its reason; the caller expires them. Empty otherwise."""
        late, self._late = self._late, []
        return late

    def next_deadline(self) -> float | None:
        """Clock time (epoch seconds) at which :meth:`poll` will next release a batch.

        It may be in the past (a batch is overdue); it moves only when items are added or
        released. None when nothing is pending.
        """
        if not self._ids:
            return None
        self._settle()
        now = self._clock()
        if self._blocks:  # the first holds a full batch: due now, or since the oldest's wait
            oldest = min(block.enqueued_at[0] for block in self._blocks)
            return min(oldest + self._policy.max_wait_s, now)
        return min(state.ready_at(now) for state in self._readiness())

    def drain(self) -> list[models.Batch]:
        """Release every pending item as batches (shutdown); the batcher is empty afterwards."""
        batches: list[models.Batch] = []
        self._draining = True  # released to the queue, not judged late
        try:
            while (batch := self.poll(flush=True)) is not None:
                batches.append(batch)
        finally:
            self._draining = False
        return batches

    def _check_new(self, items: Sequence[models.WorkItem]) -> None:
        ids = set(map(_ID, items))
        if (
            len(ids) == len(items)
            and self._ids.isdisjoint(ids)
            and min(map(_COST, items), default=0) >= 0
        ):
            return
        seen: set[int] = set()
        for item in items:
            if item.id in self._ids or item.id in seen:
                raise ValueError(
                    f"item {item.id} ({item.item_key!r}) is already pending in the batcher; "
                    "add each claimed item once"
                )
            if item.cost < 0:
                raise ValueError(f"item {item.id} ({item.item_key!r}) has cost {item.cost} < 0")
            seen.add(item.id)

    def _readiness(self) -> list[_Readiness]:
        return [self._state(i, bucket) for i, bucket in enumerate(self._buckets) if bucket]

    def _state(self, index: int, bucket: _Bucket) -> _Readiness:
        full = self._budget.full(len(bucket), bucket.cost)
        oldest = bucket.oldest_enqueued_at()
        n = min(len(bucket), self._policy.max_batch_size)
        due_at = math.inf
        trigger: Reason = "wait"
        deadline = bucket.earliest_deadline()
        if deadline is not None:
            due_at = deadline - max(0.0, self._service_time(n, bucket.max_cost()))
            trigger = "deadline"
        if self._adaptive is None:
            wait_at = oldest + self._policy.max_wait_s
            if wait_at <= due_at:
                due_at, trigger = wait_at, "wait"
            return _Readiness(index, full, due_at, trigger, due_at)
        # No max_wait_s here: the controller goes at once at a free model, and a batch the
        # window pushed into a busy one would only wait behind the forward in flight, as a
        # smaller batch than the one the model could take when it frees (design.md).
        cost = bucket.max_cost()
        due = self._adaptive.due(oldest, self._adaptive.model.efficient_size(cost, n), cost)
        rank = min(due.budget_at, due_at)
        if due.at < due_at:
            return _Readiness(index, full, due.at, due.trigger, rank)
        return _Readiness(index, full, due_at, trigger, rank)

    def _cap(self, bucket: _Bucket, now: float) -> _Budget:
        """The batch caps: the policy's, and with ``adaptive`` no more items than the oldest
        item's budget allows."""
        if self._adaptive is None:
            return self._budget
        cap = self._adaptive.size_cap(
            now, bucket.oldest_enqueued_at(), bucket.max_cost(), self._budget.max_size
        )
        if cap >= self._budget.max_size:
            return self._budget
        return _Budget(cap, self._budget.max_cost)

    def _release(
        self,
        state: _Readiness,
        now: float,
        states: Sequence[_Readiness],
        *,
        by_length: bool,
        turn: _LightTurn | None = None,
    ) -> models.Batch | None:
        bucket = self._buckets[state.index]
        budget = cut = self._cap(bucket, now)
        fair = self._fair if len(bucket.tenants) > 1 else None
        order = None if fair is None else bucket.fair_order(fair, now, budget.max_size)
        light = turn.light if turn is not None else frozenset()
        riders: Sequence[tuple[int, int]] = turn.riders if turn is not None else ()
        own = [e[-1] for e in bucket.entries_of(light, budget.max_size)] if light else []
        leading = set(own)
        if own and order is not None:  # the lead, then the light tenants' items here
            leading.add(order[0])
            order = [order[0], *(q for q in own if q != order[0])] + [
                q for q in order if q not in leading
            ]
        # the turn's own light items (and its lead) first, then riders
        riders = riders[: max(0, budget.max_size - max(1, len(leading)))]
        if riders:
            ride_cost = sum(self._buckets[i].items[q].cost for i, q in riders)
            left = None if budget.max_cost is None else max(0, budget.max_cost - ride_cost)
            cut = _Budget(budget.max_size - len(riders), left)
        seqs = (bucket.cut_by_length if by_length else bucket.cut_in_order)(cut, order)
        items = bucket.remove(seqs)
        if fair is not None:  # the lead item out of turn, the rest by their tags
            fair.charge_aside(items[0].tenant, now)
            fair.charge(collections.Counter(map(models.ITEM_TENANT, items[1:])), now)
        if riders:
            assert turn is not None
            items += self._board(riders, items, budget, now, turn.hold)
            # rows kept for riders that did not board go back to this bucket's own items
            rest = order if order is not None else bucket._order.live_seqs(bucket.items)
            left_here = (q for q in rest if q in bucket.items)
            again = [(state.index, q) for q in itertools.islice(left_here, budget.max_size)]
            items += self._board(again, items, budget, now, turn.hold)
        taken = len(items)
        if by_length:
            items.sort(key=lambda item: item.cost)
        elif self._adaptive is not None and len(items) < budget.max_size and not riders:
            items += self._fill(state.index, items, budget, now, states)
        self._ids.difference_update(map(_ID, items))
        if self._late_policy == "expire" and not self._draining:
            items = self._without_late(items, now)
            if not items:
                return None
        capped = budget is not self._budget and taken >= budget.max_size
        return models.Batch(
            items=tuple(items),
            reason="slo" if capped else self._reason(state, len(items), now),
            formed_at=now,
            stats=batch_stats(items, now, self._policy.max_batch_size),
            bucket=self._bucket_of(max(map(_COST, items))),
        )

    def _light_tenants(self) -> set[str]:
        """The tenants with items pending that a flood would otherwise queue: each sends at
        most 1/``_LIGHT_RATIO`` of the heaviest pending tenant's rate (items over weight,
        decayed with a ``_LIGHT_HALF_LIFE_S`` half-life), and together at most
        ``_LIGHT_SHARE`` of all arrivals. By arrivals, not backlog: tenants of one rate are
        never light; none when no heavier tenant has items pending (a flood gone quiet, or
        served), nor when many small tenants together are the load (favouring them all
        would pad most passes and make the flood late: found by review)."""
        assert self._fair is not None
        pending = {t for bucket in self._buckets for t in bucket.tenants}
        if len(pending) < 2 or not self._arrivals:
            return set()
        weight = self._fair.weight
        rate = {t: n / weight(t) for t, n in self._arrivals.items()}
        heaviest = max(rate.get(t, 0.0) for t in pending)
        if heaviest <= 0:
            return set()
        # the share of every tenant of a light rate, pending or not: those with items
        # pending at one moment are a few of many small tenants
        small = sum(n for t, n in self._arrivals.items() if rate[t] * _LIGHT_RATIO <= heaviest)
        if small > _LIGHT_SHARE * sum(self._arrivals.values()):
            return set()
        return {t for t in pending if rate.get(t, 0.0) * _LIGHT_RATIO <= heaviest}

    def _count_arrivals(self, counts: Mapping[str, int]) -> None:
        """Add ``counts`` (items a tenant, once added) to the tenants' decayed arrival
        counts; only where :meth:`_light_tenants` reads them (fair share, adaptive)."""
        if self._fair is None or self._adaptive is None or not counts:
            return
        now = max(self._clock(), self._arrivals_at)  # a clock stepped back decays nothing
        decay = 0.5 ** ((now - self._arrivals_at) / _LIGHT_HALF_LIFE_S)
        self._arrivals_at = now
        arrivals = {t: n * decay for t, n in self._arrivals.items()}
        for tenant, n in counts.items():
            arrivals[tenant] = arrivals.get(tenant, 0.0) + n
        self._arrivals = {t: n for t, n in arrivals.items() if n >= _LIGHT_FORGET}

    def _light_turn(self, best: _Readiness, states: Sequence[_Readiness], now: float) -> _LightTurn:
        """Adaptive with fair share: light tenants first (:meth:`_light_tenants`). The batch
        goes from the ready bucket holding a light tenant's most urgent item (priority,
        deadline, age) instead of by the buckets' turn; that bucket's light items lead its
        cut, and the light items of shorter buckets ride in it (they pad to its length;
        the flood's items make room; :meth:`_board` keeps it in time). A pass serves one
        bucket and a flood fills them all, so a light item otherwise waited for its
        bucket's turn behind the flood. Not when the most urgent bucket's budget would be
        spent before the light pass is through: that bucket goes, or its items would be
        late; and riders board only while that budget holds (``hold``)."""
        light = self._light_tenants()
        if not light:
            return _LightTurn(best)
        most = self._budget.max_size
        held = [(st, self._buckets[st.index].entries_of(light, most)) for st in states]
        pick = min(
            ((entries[0], st) for st, entries in held if entries and st.ready(now)),
            default=None,
            key=lambda pair: pair[0],
        )
        if pick is None:
            return _LightTurn(best)
        state = pick[1]
        hold = math.inf
        if state.index != best.index:
            bucket = self._buckets[state.index]
            assert self._adaptive is not None
            pass_s = self._adaptive.finish_bound_s(min(len(bucket), most), bucket.max_cost())
            if best.rank < now + pass_s:
                return _LightTurn(best)
            hold = best.rank
        riders = [
            (index, entry[-1])
            for entry, index in sorted(
                (entry, st.index)
                for st, entries in held
                if st.index < state.index
                for entry in entries
            )
        ]
        return _LightTurn(state, frozenset(light), tuple(riders), hold)

    def _board(
        self,
        candidates: Iterable[tuple[int, int]],
        items: list[models.WorkItem],
        budget: _Budget,
        now: float,
        hold: float,
    ) -> list[models.WorkItem]:
        """Take ``candidates`` ((bucket index, seq), in order) out of their buckets for the
        batch of ``items`` while each fits: no longer than the batch's padded cost, within
        ``max_batch_size`` and the padded ``max_batch_cost``, the pass through before
        ``hold`` (the most urgent bucket's budget) by the upper estimate, and, as
        :meth:`_fill` requires of a merge, every item in it still predicted in time (its
        oldest item's SLO and default deadline by the upper estimate, an item's own
        deadline by the mean). Stops at the first that does not fit."""
        ctrl = self._adaptive
        assert ctrl is not None
        padded = max(map(_COST, items))
        limit_s = min(ctrl.slo_s, self._default_deadline_s or math.inf)
        due = min(map(_ENQUEUED, items)) + limit_s
        own = _earliest_deadline(items)
        n = len(items)
        by_bucket: dict[int, list[int]] = collections.defaultdict(list)
        for index, seq in candidates:
            item = self._buckets[index].items[seq]
            k_due = min(due, item.enqueued_at + limit_s)
            k_own = own if item.deadline_at is None else min(own, item.deadline_at)
            if (
                item.cost > padded
                or n + 1 > budget.max_size
                or (budget.max_cost is not None and (n + 1) * padded > budget.max_cost)
                or now + ctrl.finish_bound_s(n + 1, padded) > hold
                or ctrl.finish_at(now, n + 1, padded, upper=True) > k_due
                or ctrl.finish_at(now, n + 1, padded) > k_own
            ):
                break
            by_bucket[index].append(seq)
            n, due, own = n + 1, k_due, k_own
        boarded: list[models.WorkItem] = []
        for index, seqs in by_bucket.items():
            boarded += self._buckets[index].remove(seqs)
        if boarded and self._fair is not None:
            self._fair.charge(collections.Counter(map(models.ITEM_TENANT, boarded)), now)
        return boarded

    def _fill(
        self,
        base: int,
        items: list[models.WorkItem],
        budget: _Budget,
        now: float,
        states: Sequence[_Readiness],
    ) -> list[models.WorkItem]:
        """Adaptive: the items of other buckets (nearest first) that ride in this batch, padded
        to its longest. A bucket's items join when the model predicts both (see module
        docstring): one padded forward pass no longer than the two it replaces, and a lower
        sum of the pending items' completion times (the joining items skip their wait for
        their bucket's turn; the batch's own items and those of the buckets ahead of that
        turn wait the longer forward out; those after it skip the joining bucket's forward).
        And only while the batch is still predicted in time for every item in it: its oldest
        item's SLO and default deadline by the upper estimate, an item's own deadline by the
        mean. With ``max_batch_cost``, the padded batch (items x its longest cost) stays within
        it, so a mixed batch is never larger than the worst batch of its longest item's bucket:
        what ``batching check`` judged at plan time (latency and device memory)."""
        ctrl = self._adaptive
        assert ctrl is not None
        model = ctrl.model
        n, cost, total = len(items), max(map(_COST, items)), sum(map(_COST, items))
        limit_s = min(ctrl.slo_s, self._default_deadline_s or math.inf)
        due = min(map(_ENQUEUED, items)) + limit_s
        own = _earliest_deadline(items)
        if ctrl.finish_at(now, n, cost, upper=True) > due or ctrl.finish_at(now, n, cost) > own:
            return []  # already tight: a larger batch would only make it later
        # each other bucket as it would go on its own: (its turn, its items, its forward)
        turns = {
            st.index: (
                st.rank,
                len(self._buckets[st.index]),
                model.predict(
                    min(len(self._buckets[st.index]), budget.max_size),
                    self._buckets[st.index].max_cost(),
                ),
            )
            for st in states
            if st.index != base and self._buckets[st.index]
        }
        added: list[models.WorkItem] = []
        for index in sorted(turns, key=lambda i: (abs(i - base), i)):
            room = budget.max_size - n
            left = None if budget.max_cost is None else budget.max_cost - total
            if room <= 0 or (left is not None and left <= 0):
                break
            other = self._buckets[index]
            fair = self._fair if len(other.tenants) > 1 else None
            order = None if fair is None else other.fair_order(fair, now, room)
            seqs = other.cut_in_order(_Budget(room, left), order)
            taken = [other.items[seq] for seq in seqs]
            k, k_cost, k_total = len(taken), max(map(_COST, taken)), sum(map(_COST, taken))
            padded = max(cost, k_cost)
            t_now, t_alone = model.predict(n, cost), model.predict(k, k_cost)
            t_merged = model.predict(n + k, padded)
            rank, _, _ = turns[index]
            ahead = [v for i, v in turns.items() if i != index and v[0] < rank]
            after = [v for i, v in turns.items() if i != index and v[0] >= rank]
            skipped = t_alone if k == len(other) else 0.0  # its turn is gone, not shortened
            delta = t_merged - t_now
            waited = t_now + sum(v[2] for v in ahead) + t_alone  # its items' finish, alone
            change = (
                k * (t_merged - waited)
                + (n + sum(v[1] for v in ahead)) * delta
                + sum(v[1] for v in after) * (delta - skipped)
            )
            if (
                (left is not None and k_total > left)
                or (budget.max_cost is not None and (n + k) * padded > budget.max_cost)
                or n + k > model.efficient_size(padded, self._budget.max_size)
                or t_merged > t_now + t_alone
                or change >= 0
            ):
                continue
            k_due = min(map(_ENQUEUED, taken)) + limit_s
            k_own = _earliest_deadline(taken)
            if ctrl.finish_at(now, n + k, padded, upper=True) > min(due, k_due) or (
                ctrl.finish_at(now, n + k, padded) > min(own, k_own)
            ):
                continue
            other.remove(seqs)
            if fair is not None:
                fair.charge(collections.Counter(map(models.ITEM_TENANT, taken)), now)
            added += taken
            n, cost, total = n + k, padded, total + k_total
            due, own = min(due, k_due), min(own, k_own)
            if other:  # what the room left of it: still its own turn
                left_n = min(len(other), budget.max_size)
                turns[index] = (rank, len(other), model.predict(left_n, other.max_cost()))
            else:
                del turns[index]
        return added

    def _without_late(self, items: list[models.WorkItem], now: float) -> list[models.WorkItem]:
        """``items`` less those predicted to finish after their deadline (kept for
        :meth:`take_late`): finish = now + the predicted time of this batch."""
        deadlines = list(map(models.ITEM_DEADLINE_AT, items))
        default_s = self._default_deadline_s
        if default_s is None and deadlines.count(None) == len(deadlines):
            return items
        n, cost = len(items), max(map(_COST, items))
        own = self._finish_at(now, n, cost)  # an item's own deadline: the mean
        by_default = self._finish_at(now, n, cost, upper=True)  # the SLO's: the upper estimate
        kept: list[models.WorkItem] = []
        for item, deadline in zip(items, deadlines, strict=True):
            if deadline is not None:
                due, finish, what = deadline, own, f"deadline {_utc(deadline)}"
            elif default_s is not None:
                due, finish = item.enqueued_at + default_s, by_default
                what = f"default deadline {_utc(due)} ({default_s:g} s after its enqueue)"
            else:
                kept.append(item)
                continue
            if due >= finish:
                kept.append(item)
                continue
            reason = (
                f"late_policy expire: {what} before the predicted finish "
                f"{_utc(finish)} (now + {finish - now:.3f} s predicted for a batch of {n})"
            )
            self._late.append(Late(item, reason))
        return kept

    def _finish_at(self, now: float, n: int, cost: int, *, upper: bool = False) -> float:
        """When a batch of ``n`` items (max cost ``cost``) released at ``now`` is predicted to
        finish: with the controller, the mean (an item with a deadline of its own is expired
        only when predicted late) or, ``upper``, with the model's margin (a default deadline
        holds the p99 objective), counting the forward in flight and the commit; else
        ``now`` + its service time."""
        if self._adaptive is not None:
            return self._adaptive.finish_at(now, n, cost, upper=upper)
        return now + max(0.0, self._service_time(n, cost))

    def _full_reason(self, n_items: int) -> Reason:
        return "size" if n_items >= self._policy.max_batch_size else "cost"

    def _cut_block(self, now: float) -> models.Batch:
        """The next full batch from the first block: its first rows (claim order is the
        bucket's order for items of one priority and no deadline), as the buckets would cut."""
        head = self._blocks[0]
        cost = head.template.cost
        n = self._budget.rows_of(cost)
        items = head[:n]
        if n < len(head):
            self._blocks[0] = head[n:]
        else:
            self._blocks.popleft()
        self._ids.difference_update(items.ids)
        return models.Batch(
            items=items,
            reason=self._full_reason(len(items)),
            formed_at=now,
            stats=batch_stats(items, now, self._policy.max_batch_size),
            bucket=self._bucket_of(cost),
        )

    def _reason(self, state: _Readiness, n_items: int, now: float) -> Reason:
        if state.full:
            return self._full_reason(n_items)
        return state.trigger if state.due_at <= now else "flush"


def _earliest_deadline(items: Iterable[models.WorkItem]) -> float:
    """The earliest ``deadline_at`` among ``items`` (inf when none has one)."""
    deadlines = map(models.ITEM_DEADLINE_AT, items)
    return min((d for d in deadlines if d is not None), default=math.inf)


def _utc(at: float) -> str:
    """Epoch seconds as ``2026-12-02T02:50:01.123Z`` (what a reason names)."""
    stamp = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"
