"""Value types shared by every component: frozen dataclasses and, for the per-item types built
on every claim (``WorkItem``, ``Payload``), named tuples; standard library only.

Times are epoch seconds (float) from the injected clock; durations carry ``_s``.

Why it stays one module: these are the kernel's nouns, imported by every layer; split by
topic they would import each other (a claim holds items, a batch holds a claim's items or
its block), and the block's columnar tricks must stay beside the item they stand for.
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload


class State(enum.IntEnum):
    """Item states as stored in ``batching_items.state`` (literal codes keep partial indexes usable)."""

    READY = 0
    LEASED = 1
    DONE = 2
    DEAD = 3
    EXPIRED = 4
    CANCELLED = 5  # by an operator, unscored (``batching queue cancel``): final, not dead


class BatchState(enum.StrEnum):
    """Ledger states of a committed batch, as stored in ``batching_batches.state``."""

    COMMITTED = "committed"
    """Acked and recorded; its output may not be visible yet (publish rolls it forward)."""
    PUBLISHED = "published"
    """Its output is visible to readers."""
    QUARANTINED = "quarantined"
    """Reconcile found its output missing or corrupt and requeued its items."""
    SUPERSEDED = "superseded"
    """Reconcile removed duplicate rows; the batch was rewritten or dropped."""


LIVE_BATCH_STATES = (BatchState.COMMITTED, BatchState.PUBLISHED)
"""Ledger states of a batch whose rows count."""


class PayloadFormat(enum.StrEnum):
    """How ``payload`` bytes are encoded."""

    JSON = "json"  # UTF-8 JSON document
    TENSOR = "tensor"  # raw little-endian bytes of an array with ``dtype`` and ``shape``


class Payload(NamedTuple):
    """A request body: JSON bytes, or a binary tensor (dtype, shape, raw bytes).

    A named tuple, like ``WorkItem``: built once per claimed row, where a frozen dataclass
    cost 3-5x more (0.6 and 1.2 us a row against ~0.2 us each).
    """

    data: bytes
    format: PayloadFormat = PayloadFormat.JSON
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def integer_tensor(self) -> bool:
        """A tensor of integers (token ids, to a token model), whatever its byte order."""
        return (
            self.format == PayloadFormat.TENSOR
            and self.dtype is not None
            and self.dtype.lstrip("<>=|")[:1] in ("i", "u")
        )


@dataclass(frozen=True, slots=True)
class EnqueueRecord:
    """One request to enqueue; ``item_key`` is the idempotency key within a queue."""

    item_key: str
    payload: Payload
    tenant: str = "default"
    priority: int = 0
    deadline_at: float | None = None
    cost: int = 1
    lane: str = ""
    max_attempts: int | None = None


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """What an enqueue did: rows inserted, and keys that already existed (not inserted again)."""

    inserted: int
    duplicates: tuple[str, ...] = ()


class WorkItem(NamedTuple):
    """A claimed item, as the scorer sees it (immutable; a named tuple for claim speed)."""

    id: int
    item_key: str
    payload: Payload
    enqueued_at: float
    queue: str = "default"
    lane: str = ""
    tenant: str = "default"
    priority: int = 0
    cost: int = 1
    deadline_at: float | None = None
    attempts: int = 1
    max_attempts: int = 5


# Field getters of a WorkItem: C calls, for hot paths that map them over a whole batch rather
# than take a Python step per item.
ITEM_ID = operator.attrgetter("id")
ITEM_PAYLOAD = operator.attrgetter("payload")
ITEM_ENQUEUED_AT = operator.attrgetter("enqueued_at")
ITEM_PRIORITY = operator.attrgetter("priority")
ITEM_COST = operator.attrgetter("cost")
ITEM_DEADLINE_AT = operator.attrgetter("deadline_at")
ITEM_TENANT = operator.attrgetter("tenant")


class ItemBlock(Sequence[WorkItem]):
    """Claimed items as columns: a run of items of one lease that differ only in id, key,
    enqueue time, attempts and payload bytes (one tensor dtype and shape, one cost, priority,
    lane, tenant and queue, no deadline), in claim order.

    A sequence of work items: indexing and iterating build them one by one (the general path,
    which every consumer supports). The scorer's hot path reads the columns instead: the
    micro-batcher cuts slices, the dense decode views the payload bytes as one matrix, the
    commit takes keys and ids as lists. ``SqlQueue.claim(columns=True)`` builds one for such a
    claim on SQLite; a claim of 8,192 W1 rows then builds no Python object per row.

    ``template`` holds the shared fields (its id, key, enqueue time, attempts and payload
    bytes are placeholders); ``data`` is the payloads concatenated, ``item_nbytes`` each.
    """

    __slots__ = (
        "attempts",
        "data",
        "enqueued_at",
        "ids",
        "item_nbytes",
        "keys",
        "max_attempts",
        "template",
    )

    def __init__(
        self,
        template: WorkItem,
        ids: list[int],
        keys: list[str],
        enqueued_at: list[float],
        attempts: list[int],
        max_attempts: list[int],
        data: bytes | memoryview,
    ) -> None:
        n = len(ids)
        if not (len(keys) == len(enqueued_at) == len(attempts) == len(max_attempts) == n):
            raise ValueError("ItemBlock columns differ in length")
        self.data = data if isinstance(data, bytes) else memoryview(data).cast("B")  # bytes
        if n and len(self.data) % n:
            raise ValueError(f"{len(self.data)} payload bytes do not split into {n} items")
        self.item_nbytes = len(self.data) // n if n else 0
        self.template = template
        self.ids, self.keys, self.enqueued_at = ids, keys, enqueued_at
        self.attempts, self.max_attempts = attempts, max_attempts

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> WorkItem: ...
    @overload
    def __getitem__(self, index: slice) -> ItemBlock: ...
    def __getitem__(self, index: int | slice) -> WorkItem | ItemBlock:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self.ids))
            if step != 1:
                raise ValueError("ItemBlock slices are contiguous (step 1)")
            nb = self.item_nbytes
            return ItemBlock(
                self.template,
                self.ids[start:stop],
                self.keys[start:stop],
                self.enqueued_at[start:stop],
                self.attempts[start:stop],
                self.max_attempts[start:stop],
                memoryview(self.data)[start * nb : max(start, stop) * nb],
            )
        i = range(len(self.ids))[index]  # negative indexes, IndexError
        nb = self.item_nbytes
        payload = self.template.payload._replace(data=bytes(self.data[i * nb : (i + 1) * nb]))
        return self.template._replace(
            id=self.ids[i],
            item_key=self.keys[i],
            payload=payload,
            enqueued_at=self.enqueued_at[i],
            attempts=self.attempts[i],
            max_attempts=self.max_attempts[i],
        )

    def __iter__(self) -> Iterator[WorkItem]:
        return map(self.__getitem__, range(len(self.ids)))

    def take(self, positions: Sequence[int]) -> ItemBlock:
        """The items at ``positions`` (in that order) as a block of their own."""
        nb, data = self.item_nbytes, memoryview(self.data)
        return ItemBlock(
            self.template,
            [self.ids[i] for i in positions],
            [self.keys[i] for i in positions],
            [self.enqueued_at[i] for i in positions],
            [self.attempts[i] for i in positions],
            [self.max_attempts[i] for i in positions],
            b"".join([data[i * nb : (i + 1) * nb] for i in positions]),
        )

    def __repr__(self) -> str:
        payload = self.template.payload
        return f"ItemBlock({len(self.ids)} items, {payload.dtype} {payload.shape})"

    def column(self, name: str) -> list[Any]:
        """The field ``name`` of every item, in order, without building the items (but for
        ``payload``)."""
        own = _BLOCK_COLUMNS.get(name)
        if own is not None:
            column: list[Any] = getattr(self, own)  # the column itself: read, do not change
            return column
        if name == "payload":
            return [item.payload for item in self]
        return [getattr(self.template, name)] * len(self.ids)

    @classmethod
    def join(cls, blocks: Sequence[ItemBlock]) -> ItemBlock:
        """One block of several with the same shared fields, in order."""
        first = blocks[0]
        if len(blocks) == 1:
            return first
        if any(b.template != first.template for b in blocks):
            raise ValueError("only blocks with the same shared fields join")
        chain = itertools.chain.from_iterable
        return cls(
            first.template,
            list(chain(b.ids for b in blocks)),
            list(chain(b.keys for b in blocks)),
            list(chain(b.enqueued_at for b in blocks)),
            list(chain(b.attempts for b in blocks)),
            list(chain(b.max_attempts for b in blocks)),
            b"".join(b.data for b in blocks),
        )


class OutputRows(Mapping[int, Any]):
    """Outputs by item id, held as one matrix whose row ``i`` belongs to ``ids[i]`` (what a
    forward pass returns): a mapping built without an entry per row; lookups by id build an
    index on first use."""

    __slots__ = ("_index", "ids", "matrix")

    def __init__(self, ids: Sequence[int], matrix: Any) -> None:
        if len(ids) != len(matrix):
            raise ValueError(f"{len(ids)} ids for {len(matrix)} output rows")
        self.ids = ids if isinstance(ids, list) else list(ids)  # compares equal to a block's
        self.matrix = matrix
        self._index: dict[int, int] | None = None

    def __getitem__(self, item_id: int) -> Any:
        if self._index is None:
            self._index = {id_: i for i, id_ in enumerate(self.ids)}
        return self.matrix[self._index[item_id]]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


# ItemBlock columns by WorkItem field; the other fields are the block's shared ones.
_BLOCK_COLUMNS = {"id": "ids", "item_key": "keys", "enqueued_at": "enqueued_at"}
_BLOCK_COLUMNS |= {"attempts": "attempts", "max_attempts": "max_attempts"}


def item_column(items: Sequence[WorkItem], name: str) -> list[Any]:
    """The field ``name`` of every item, in order: an ItemBlock's column (or shared value),
    else one C call over the work items. Read the list; do not change it."""
    if isinstance(items, ItemBlock):
        return items.column(name)
    return list(map(operator.attrgetter(name), items))


@dataclass(frozen=True, slots=True)
class Claim:
    """Items claimed under one lease (the fencing token for every later write)."""

    lease_id: str
    items: tuple[WorkItem, ...] | ItemBlock
    lease_expires_at: float
    isolated: bool = False
    """An isolation round: suspects only, to be scored with nothing else in flight."""
    suspects: bool = False  # suspects (a lost worker's items) wait for an isolation round
    paused: bool = False  # the queue is paused (``batching queue pause``): no items
    expired: tuple[tuple[str, int], ...] = ()  # (tenant, n) its transaction expired (deadline)
    route: str | None = None  # the queue's route, JSON (``batching.routing``); None: no route

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True, slots=True)
class FailResult:
    """Outcome of ``fail``: rows scheduled for retry and rows dead-lettered."""

    retried: int
    dead: int


@dataclass(frozen=True, slots=True)
class ReapResult:
    """Outcome of ``release_expired``: leases returned to ready, or dead after max attempts."""

    released: int
    dead: int


@dataclass(frozen=True, slots=True)
class AbandonedRun:
    """A run closed by ``RunLedger.close_abandoned``: its process died while it ran."""

    run_id: str
    flow: str
    parent_run_id: str | None
    error: str
    orphan: bool = False  # a worker whose parent run is not running either: none closes it
    committed: int = 0  # rows it (and its workers) committed, from the batch ledger
    output: tuple[str, ...] | None = None  # its output dataset: lineage's namespace, name


@dataclass(frozen=True, slots=True)
class RunSoFar:
    """What earlier attempts of a run did (``RunLedger.start`` of a run id already on record:
    a retry): when the first began, and the items they committed and failed."""

    started_at: float
    items_committed: int
    items_failed: int


@dataclass(frozen=True, slots=True)
class LaneStats:
    """Queue metrics for one (queue, lane, tenant) group."""

    queue: str
    lane: str
    tenant: str
    ready: int = 0
    leased: int = 0
    done: int | None = 0  # None: not counted (``SqlQueue.stats(done=False)``)
    dead: int = 0
    expired: int = 0
    cancelled: int = 0
    expired_leases: int = 0
    oldest_ready_age_s: float | None = None
    backoff: int = 0  # ready items not due yet: waiting out a retry's backoff

    @staticmethod
    def merge(a: LaneStats, b: LaneStats) -> LaneStats:
        """The counts of one group read in two parts (``SqlQueue.stats``: a state at a time)."""
        ages = [x for x in (a.oldest_ready_age_s, b.oldest_ready_age_s) if x is not None]
        return LaneStats(
            a.queue,
            a.lane,
            a.tenant,
            ready=a.ready + b.ready,
            leased=a.leased + b.leased,
            done=None if a.done is None or b.done is None else a.done + b.done,
            dead=a.dead + b.dead,
            expired=a.expired + b.expired,
            cancelled=a.cancelled + b.cancelled,
            expired_leases=a.expired_leases + b.expired_leases,
            oldest_ready_age_s=max(ages) if ages else None,
            backoff=a.backoff + b.backoff,
        )


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Queue metrics: totals by state plus one row per (queue, lane, tenant)."""

    by_state: dict[str, int]
    oldest_ready_age_s: float | None
    expired_leases: int
    groups: tuple[LaneStats, ...] = field(default_factory=tuple)
    backoff: int = 0  # ready items not due yet: waiting out a retry's backoff

    @classmethod
    def of(cls, groups: tuple[LaneStats, ...], *, done: bool = True) -> QueueStats:
        """The totals of these (queue, lane, tenant) rows; without ``done`` (not counted),
        ``by_state`` has no ``done``."""
        names = [s.name.lower() for s in State if done or s is not State.DONE]
        by_state = {n: sum(getattr(g, n) or 0 for g in groups) for n in names}
        ages = [g.oldest_ready_age_s for g in groups if g.oldest_ready_age_s is not None]
        return cls(
            by_state=by_state,
            oldest_ready_age_s=max(ages) if ages else None,
            expired_leases=sum(g.expired_leases for g in groups),
            groups=groups,
            backoff=sum(g.backoff for g in groups),
        )


@dataclass(frozen=True, slots=True)
class BatchStats:
    """What one released micro-batch looked like.

    ``fill`` is size / max_batch_size; ``padding_efficiency`` is real / padded length units
    (1.0 for fixed-size inputs); waits are measured from each item's ``enqueued_at``.
    """

    size: int
    cost: int
    fill: float
    padding_efficiency: float
    oldest_wait_s: float
    mean_wait_s: float


@dataclass(frozen=True, slots=True)
class Batch:
    """A micro-batch released by the batcher, with why it was released (size, cost, wait, deadline, flush)."""

    items: tuple[WorkItem, ...] | ItemBlock
    reason: str
    formed_at: float
    stats: BatchStats
    bucket: int = 0
    model_version: str | None = None  # the version that scores it (a route's); None: the run's
    pass_id: str = ""  # its forward pass (the ledger records who was in it, for replay)

    def __len__(self) -> int:
        return len(self.items)
