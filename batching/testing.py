"""In-memory twins for your own tests: a queue, outputs and a clock, no database and no files.

:class:`InMemoryQueue` keeps the queue table's contract (the verbs, their order, leases as
fencing tokens, attempts counted at claim, backoff with jitter, dead letters, expiry, the
reaper, stats) in a dict; the project runs it through the same contract tests as the
SQLite and PostgreSQL queues (``tests/integration/test_queue_verbs.py``). :class:`MemoryOutputs`
is a commit port that acks through it, all or nothing, and keeps the rows. With them, a
scorer with your model (or a fake runner) runs in a unit test, with a :class:`FakeClock`::

    from batching.loop.scorer import Scorer
    from batching.loop.stats import RunLimits
    from batching.testing import FakeClock, InMemoryQueue, MemoryOutputs

    clock = FakeClock()
    queue = InMemoryQueue("q", clock=clock)
    queue.enqueue(records)
    outputs = MemoryOutputs(queue)
    Scorer(config, queue, my_runner, outputs, clock=clock).run(RunLimits())
    assert set(outputs.rows) == {r.item_key for r in records}

Standard library only (plus the package's value types).

Why it stays one module: a test imports the twins together, and the queue's twin is the
contract written once more, verb by verb, to be read beside ``SqlQueue``.
"""

from __future__ import annotations

import collections
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from batching import crashes, errors, models, outcomes, ports, routing

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

NO_DEADLINE = 1e18  # sorts after every real deadline, as in the SQL queue


class FakeClock:
    """A settable epoch-seconds clock (a ``ports.Clock``)."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class ItemRow:
    """One item as the queue table would hold it (what :meth:`InMemoryQueue.item` returns)."""

    item: models.WorkItem
    state: models.State = models.State.READY
    attempts: int = 0
    crash_count: int = 0
    isolate_n: int = 0
    run_after: float = 0.0
    lease_id: str | None = None
    lease_expires_at: float | None = None
    last_error: str | None = None
    finished_at: float | None = None
    batch_id: str | None = None

    def order(self) -> tuple[int, float, float, int]:
        """Claim order: priority (high first), deadline (none last), age, id."""
        deadline = self.item.deadline_at
        return (-self.item.priority, deadline or NO_DEADLINE, self.item.enqueued_at, self.item.id)


@dataclass
class _Store:
    """Every queue's items, shared by the queues of one store (one table)."""

    rows: dict[int, ItemRow] = field(default_factory=dict)
    keys: dict[tuple[str, str], int] = field(default_factory=dict)
    archive: list[ItemRow] = field(default_factory=list)
    lock: threading.RLock = field(default_factory=threading.RLock)
    next_id: int = 1
    paused: set[str] = field(default_factory=set)  # queues paused (``pause``)


def _backoff_s(attempts: int, base_s: float, max_s: float, rng: random.Random) -> float:
    ceiling = min(max_s, base_s * 2.0 ** max(0, attempts - 1))
    return ceiling * (0.5 + 0.5 * rng.random())


class InMemoryQueue:
    """One named queue of an in-memory table: the queue table's contract, without SQL.

    Args and behaviour as ``batching.ingress.queue.SqlQueue``: ``clock`` (epoch seconds),
    ``max_attempts`` for items enqueued without one, ``backoff_base_s`` / ``backoff_max_s``
    for retries. :meth:`sibling` opens another queue of the same table.
    """

    def __init__(
        self,
        queue: str = "default",
        *,
        clock: ports.Clock = time.time,
        max_attempts: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 600.0,
        rng: random.Random | None = None,
        worker: str | None = None,
        _store: _Store | None = None,
    ) -> None:
        self.queue = queue
        self.clock = clock
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.worker = worker or uuid.uuid4().hex[:12]
        self._rng = rng or random.Random()
        self._store = _store or _Store()

    def sibling(self, queue: str) -> InMemoryQueue:
        """Another queue of the same table (items, keys and leases are its own)."""
        return InMemoryQueue(
            queue,
            clock=self.clock,
            max_attempts=self.max_attempts,
            backoff_base_s=self.backoff_base_s,
            backoff_max_s=self.backoff_max_s,
            _store=self._store,
        )

    def item(self, item_key: str) -> ItemRow:
        """A copy of the row of ``item_key`` in this queue (KeyError: no such item)."""
        with self._store.lock:
            return replace(self._store.rows[self._store.keys[(self.queue, item_key)]])

    def pause(self) -> None:
        """Pause this queue (``batching.ingress.controls.pause``, without the audit): claims
        take nothing and say ``paused`` until :meth:`resume`."""
        with self._store.lock:
            self._store.paused.add(self.queue)

    def resume(self) -> None:
        """Let claims take this queue's items again."""
        with self._store.lock:
            self._store.paused.discard(self.queue)

    # -- ingress -----------------------------------------------------------------------------

    def enqueue(
        self,
        records: Iterable[models.EnqueueRecord],
        on_progress: Callable[[int], None] | None = None,
        *,
        enqueue_run: str | None = None,
    ) -> models.EnqueueResult:
        """Add records, idempotent on ``(queue, item_key)``; a key already there (or repeated
        in ``records``) is reported in ``duplicates`` and not added again. ``enqueue_run`` is
        taken, as ``SqlQueue.enqueue`` takes it, and not kept."""
        now = self.clock()
        inserted, dupes, seen = 0, [], set()
        with self._store.lock:
            for rec in records:
                if rec.item_key in seen or (self.queue, rec.item_key) in self._store.keys:
                    dupes.append(rec.item_key)
                    continue
                seen.add(rec.item_key)
                self._add(rec, now)
                inserted += 1
        if on_progress is not None:
            on_progress(len(seen) + len(dupes))
        return models.EnqueueResult(inserted, tuple(dupes))

    def _add(self, rec: models.EnqueueRecord, now: float) -> None:
        store = self._store
        item = models.WorkItem(
            store.next_id,
            rec.item_key,
            rec.payload,
            now,
            queue=self.queue,
            lane=rec.lane,
            tenant=rec.tenant,
            priority=rec.priority,
            cost=rec.cost,
            deadline_at=rec.deadline_at,
            attempts=0,
            max_attempts=rec.max_attempts or self.max_attempts,
        )
        store.rows[item.id] = ItemRow(item, run_after=now)
        store.keys[(self.queue, rec.item_key)] = item.id
        store.next_id += 1

    # -- claim -------------------------------------------------------------------------------

    def claim(
        self,
        n: int,
        *,
        lease_s: float,
        lane: str | None = None,
        max_cost: int | None = None,
        columns: bool = False,
        isolate: bool = False,
        lease_id: str | None = None,
        pin: routing.Pin | None = None,
    ) -> models.Claim:
        """Lease up to ``n`` ready items under one new lease id, in claim order (priority,
        deadline, age); first, items past their deadline expire and this queue's expired
        leases are reaped. ``max_cost`` caps the sum of costs (the first item always fits).
        ``columns`` is accepted and ignored: items come back as work items. ``lease_id``: add
        to that lease (the caller holds it) rather than a new one. Suspects (items
        of a lost worker) only with ``isolate``, at most the first one's ``isolate_n``. No
        routes here: a ``pin`` to the default version takes everything, another nothing."""
        if n < 1:
            raise ValueError("n must be >= 1")
        now = self.clock()
        if pin is not None and pin.version != pin.default:
            return models.Claim(lease_id or str(uuid.uuid4()), (), now + lease_s)
        lease_id = lease_id or str(uuid.uuid4())
        with self._store.lock:
            if self.queue in self._store.paused:
                return models.Claim(lease_id, (), now + lease_s, paused=True)
            expired = self._expire_overdue(now)
            self._reap(now, this_queue=True)
            ready = [
                r
                for r in self._mine()
                if r.state is models.State.READY
                and r.run_after <= now
                and (lane is None or r.item.lane == lane)
            ]
            suspects = sorted((r for r in ready if r.isolate_n), key=lambda r: r.isolate_n)
            if isolate:
                n = min(n, suspects[0].isolate_n if suspects else 0)
                ready = sorted(suspects, key=lambda r: (r.isolate_n, *r.order()))[:n]
            else:
                ready = sorted((r for r in ready if not r.isolate_n), key=ItemRow.order)[:n]
            taken: list[models.WorkItem] = []
            spent = 0
            for row in ready:
                if (
                    not isolate
                    and max_cost is not None
                    and taken
                    and spent + row.item.cost > max_cost
                ):
                    break
                spent += row.item.cost
                row.state, row.lease_id = models.State.LEASED, lease_id
                row.lease_expires_at = now + lease_s
                row.attempts += 1
                taken.append(row.item._replace(attempts=row.attempts))
        return models.Claim(
            lease_id,
            tuple(taken),
            now + lease_s,
            isolated=isolate,
            suspects=bool(suspects),
            expired=expired,
        )

    def _mine(self) -> Iterable[ItemRow]:
        return (r for r in self._store.rows.values() if r.item.queue == self.queue)

    def expire_overdue(self) -> int:
        """Move ready items whose deadline has passed to ``expired``; returns how many."""
        with self._store.lock:
            return sum(n for _, n in self._expire_overdue(self.clock()))

    def _expire_overdue(self, now: float) -> tuple[tuple[str, int], ...]:
        """Expire ready items past their deadline; returns ``(tenant, n)`` sorted by tenant."""
        by_tenant: collections.Counter[str] = collections.Counter()
        for row in self._mine():
            deadline = row.item.deadline_at
            if row.state is models.State.READY and deadline is not None and deadline < now:
                row.state, row.finished_at = models.State.EXPIRED, now
                row.last_error = "deadline passed before scoring"
                by_tenant[row.item.tenant] += 1
        return tuple(sorted(by_tenant.items()))

    # -- lease writes (compare-and-set on the lease) -----------------------------------------

    def _held(self, lease_id: str, ids: Sequence[int] | None = None) -> list[ItemRow]:
        rows = self._mine() if ids is None else (self._store.rows.get(i) for i in ids)
        return [
            r
            for r in rows
            if r is not None and r.state is models.State.LEASED and r.lease_id == lease_id
        ]

    def check_schema(self) -> None:
        """Memory has no schema to migrate: always current."""

    def heartbeat(self, lease_id: str, lease_s: float) -> int:
        """Extend the lease; returns items extended (0: the lease was lost)."""
        with self._store.lock:
            held = self._held(lease_id)
            for row in held:
                row.lease_expires_at = self.clock() + lease_s
            return len(held)

    def ack(self, lease_id: str, ids: Sequence[int], *, batch_id: str | None = None) -> int:
        """Mark items done if this lease still holds them; returns items changed."""
        with self._store.lock:
            held = self._held(lease_id, ids)
            for row in held:
                row.state, row.finished_at, row.batch_id = models.State.DONE, self.clock(), batch_id
                row.lease_id = row.lease_expires_at = row.last_error = None
            return len(held)

    def ack_all_or_raise(self, lease_id: str, ids: Sequence[int], batch_id: str) -> None:
        """Ack every one of ``ids``, or none and raise ``LeaseLost``."""
        with self._store.lock:
            if len(self._held(lease_id, ids)) != len(ids):
                raise errors.LeaseLost(f"lease {lease_id} no longer holds every item")
            self.ack(lease_id, ids, batch_id=batch_id)

    def fail(
        self,
        lease_id: str,
        failures: Mapping[int, str],
        *,
        retry: bool = True,
        model_version: str | None = None,
    ) -> models.FailResult:
        """Fail items held by this lease: back to ready after a backoff with jitter, or dead
        (``retry`` false, or no attempts left); ``model_version`` is not kept here."""
        retried = dead = 0
        now = self.clock()
        with self._store.lock:
            for row in self._held(lease_id, list(failures)):
                row.lease_id = row.lease_expires_at = None
                row.last_error = failures[row.item.id][:2000]
                if not retry or row.attempts >= row.item.max_attempts:
                    row.state, row.finished_at = models.State.DEAD, now
                    dead += 1
                else:
                    delay = _backoff_s(
                        row.attempts, self.backoff_base_s, self.backoff_max_s, self._rng
                    )
                    row.state, row.run_after = models.State.READY, now + delay
                    retried += 1
        return models.FailResult(retried, dead)

    def release(self, lease_id: str, ids: Sequence[int] | None = None) -> int:
        """Give items back to ready without using up an attempt."""
        with self._store.lock:
            held = self._held(lease_id, ids)
            for row in held:
                row.state, row.run_after = models.State.READY, self.clock()
                row.lease_id = row.lease_expires_at = None
                row.attempts -= 1
            return len(held)

    def expire(self, lease_id: str, reasons: Mapping[int, str]) -> int:
        """Move items this lease holds to expired unscored, each with its reason."""
        with self._store.lock:
            held = self._held(lease_id, list(reasons))
            for row in held:
                row.state, row.finished_at = models.State.EXPIRED, self.clock()
                row.last_error = reasons[row.item.id][:2000]
                row.lease_id = row.lease_expires_at = None
            return len(held)

    def release_expired(self, limit: int = 5000, *, this_queue: bool = False) -> models.ReapResult:
        """The reaper: items whose lease expired go back to ready (dead past max attempts)."""
        with self._store.lock:
            return self._reap(self.clock(), this_queue=this_queue)

    def _reap(self, now: float, *, this_queue: bool) -> models.ReapResult:
        """Expired leases back to ready; who is charged the attempt: ``batching.crashes``."""
        released = dead = 0
        rows = self._mine() if this_queue else self._store.rows.values()
        expired = {
            row.item.id: row
            for row in rows
            if row.state is models.State.LEASED
            and row.lease_expires_at is not None
            and row.lease_expires_at < now
        }
        lost = (crashes.Expired(i, r.lease_id or "", r.isolate_n) for i, r in expired.items())
        for verdict in crashes.judge(lost):
            for row in map(expired.__getitem__, verdict.ids):
                row.lease_id = row.lease_expires_at = None
                row.crash_count += 1
                row.isolate_n, row.last_error = verdict.isolate_n, verdict.reason
                if not verdict.charged:
                    row.attempts -= 1
                elif row.attempts >= row.item.max_attempts:
                    row.state, row.finished_at = models.State.DEAD, now
                    row.last_error = crashes.KILLER
                    dead += 1
                    continue
                row.state, row.run_after = models.State.READY, now
                released += 1
        return models.ReapResult(released, dead)

    # -- operations --------------------------------------------------------------------------

    def stats(self, *, all_queues: bool = False, done: bool = True) -> models.QueueStats:
        """Counts by state, oldest ready age and expired leases, per (queue, lane, tenant);
        without ``done``, done items are not counted (None), as ``SqlQueue.stats``."""
        now = self.clock()
        groups: dict[tuple[str, str, str], list[ItemRow]] = {}
        with self._store.lock:
            rows = list(self._store.rows.values() if all_queues else self._mine())
        for row in rows:
            if done or row.state is not models.State.DONE:
                key = (row.item.queue, row.item.lane, row.item.tenant)
                groups.setdefault(key, []).append(row)
        return models.QueueStats.of(
            tuple(_lane_stats(k, v, now, done) for k, v in sorted(groups.items())), done=done
        )

    def redrive(
        self, states: Sequence[models.State] = (models.State.DEAD, models.State.EXPIRED)
    ) -> int:
        """Dead and/or expired items back to ready with fresh attempts (deadline cleared)."""
        n = 0
        with self._store.lock:
            for row in self._mine():
                if row.state in states:
                    row.state, row.attempts, row.crash_count = models.State.READY, 0, 0
                    row.run_after, row.finished_at = self.clock(), None
                    row.item = row.item._replace(deadline_at=None)
                    n += 1
        return n

    def purge(self, older_than_s: float, *, archive: bool = False) -> int:
        """Remove (or move to :attr:`archived`) done and cancelled items finished before now
        - age."""
        cutoff = self.clock() - older_than_s
        with self._store.lock:
            old = [
                r
                for r in self._mine()
                if r.state in (models.State.DONE, models.State.CANCELLED)
                and (r.finished_at or 0.0) < cutoff
            ]
            for row in old:
                del self._store.rows[row.item.id]
                del self._store.keys[(self.queue, row.item.item_key)]
                if archive:
                    self._store.archive.append(row)
        return len(old)

    @property
    def archived(self) -> list[ItemRow]:
        """Items ``purge(archive=True)`` moved out of the table."""
        return list(self._store.archive)


def _lane_stats(
    key: tuple[str, str, str], rows: list[ItemRow], now: float, done: bool = True
) -> models.LaneStats:
    count = {s: sum(1 for r in rows if r.state is s) for s in models.State}
    ready = [r for r in rows if r.state is models.State.READY]
    expired = sum(
        1
        for r in rows
        if r.state is models.State.LEASED
        and r.lease_expires_at is not None
        and r.lease_expires_at < now
    )
    oldest = min((r.item.enqueued_at for r in ready), default=None)
    return models.LaneStats(
        queue=key[0],
        lane=key[1],
        tenant=key[2],
        ready=count[models.State.READY],
        leased=count[models.State.LEASED],
        done=count[models.State.DONE] if done else None,
        dead=count[models.State.DEAD],
        expired=count[models.State.EXPIRED],
        cancelled=count[models.State.CANCELLED],
        expired_leases=expired,
        oldest_ready_age_s=None if oldest is None else now - oldest,
        backoff=sum(1 for r in ready if r.run_after > now),
    )


@dataclass(frozen=True)
class Committed:
    """One committed row of :class:`MemoryOutputs`."""

    batch_id: str
    output: list[float]
    scored_at: float
    model_version: str | None = None


class MemoryOutputs:
    """A commit port (``ports.CommitPort``) over an :class:`InMemoryQueue`: each commit acks
    the lease's items all or nothing (``LeaseLost`` otherwise) and keeps one row per item key
    (a key committed again keeps its first row, as the SQL sink does)."""

    def __init__(self, queue: InMemoryQueue) -> None:
        self.queue = queue
        self.rows: dict[str, Committed] = {}
        self.commits = 0
        self.flushes = 0
        self._lock = threading.Lock()

    def commit(
        self,
        items: Sequence[models.WorkItem],
        lease_id: str,
        outputs: Mapping[int, npt.NDArray[np.float32]],
        scored_at: float,
        model_version: str | None = None,
        forwards: Mapping[str, Sequence[int]] | None = None,
    ) -> outcomes.CommitResult:
        """Ack the items under ``lease_id`` and keep their outputs (and the version that
        scored them; ``forwards`` is not kept here).

        Raises:
            LeaseLost: the lease no longer holds every item; nothing is kept.
        """
        batch_id = str(uuid.uuid4())
        ids = [item.id for item in items]
        with self._lock:
            self.queue.ack_all_or_raise(lease_id, ids, batch_id)
            new = 0
            for item in items:
                if item.item_key not in self.rows:
                    values = [float(v) for v in outputs[item.id]]
                    row = Committed(batch_id, values, scored_at, model_version)
                    self.rows[item.item_key] = row
                    new += 1
            self.commits += 1
        return outcomes.CommitResult(batch_id, new, "memory", n_replayed=len(items) - new)

    def flush(self) -> None:
        """Nothing is deferred."""
        self.flushes += 1

    def recover(self) -> None:
        """Nothing is ever left undecided: a commit here is all or nothing."""
