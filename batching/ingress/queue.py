"""The SQL queue table: enqueue, claim, heartbeat, ack, fail, release, release_expired, stats.

All dialect branches (SQLite / PostgreSQL) live here. Every write after a claim is a
compare-and-set on ``(id, state, lease_id)``, or on a range lease's row (``batching_ranges``: a
claim of one run of ready ids, its items left ready; every verb but a whole ack or release
demotes it to item leases first): the lease id stamped at claim is a fencing token, and a
write with a stale lease changes nothing and reports 0 rows.

SQLite: WAL, ``synchronous=NORMAL``, ``busy_timeout``; write transactions start with
``BEGIN IMMEDIATE`` (a deferred transaction that upgrades to a write ignores the busy timeout),
``read()`` transactions deferred; engine set-up, the writer lock and the claim's one-row
read-back live in :mod:`batching.store.sqlite`, URLs and engines in :mod:`batching.store.database`. PostgreSQL: claims lock candidates in a
``MATERIALIZED`` CTE with ``FOR NO KEY UPDATE SKIP LOCKED``; enqueue sends one ``NOTIFY`` per
batch and :class:`Waiter` listens, polling as a backstop (SQLite: it reads ``PRAGMA
data_version``, :mod:`batching.ingress.watch`); an ack sends one on ``watch.DONE_CHANNEL``.

Why it stays one module: every verb is a compare-and-set on the same row under one fencing
rule, and each dialect branch (SQLite / PostgreSQL) sits next to its twin. Split by verb,
the invariant would be spread over files; split by dialect, every verb would exist twice.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import operator
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import orjson
import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from batching import crashes, errors, models, routing, tenant_share
from batching.ingress import admission, controls, pg_bulk, sqlite_bulk, sqlite_claim, watch
from batching.ports import Clock
from batching.store import database, retention, schema, sqlite

logger = logging.getLogger(__name__)

NOTIFY_CHANNEL = watch.ITEMS_CHANNEL
_ENQUEUE_CHUNK = 1000
_PURGE_CHUNK = 10_000  # items archived and deleted per statement
_LEDGER_PAGE = 2_000  # ledger rows read (and deleted) a transaction: ~50 ms of SQLite's lock
_REAP_LIMIT = 5000  # expired leases returned by one claim (the next claim takes the rest)
_T = schema.items
_P = schema.payloads
_CLAIM_COLUMNS = (
    "id",
    "item_key",
    "payload_format",
    "dtype",
    "shape",
    "enqueued_at",
    "queue",
    "lane",
    "tenant",
    "priority",
    "cost",
    "deadline_at",
    "attempts",
    "max_attempts",
    "sort_deadline",
)
# Claim order, sorted in C on the returned rows (two stable passes, least significant first):
# priority high first, then deadline (none last), enqueued_at, id.
_BY_DEADLINE_AGE_ID = operator.itemgetter(
    _CLAIM_COLUMNS.index("sort_deadline"),
    _CLAIM_COLUMNS.index("enqueued_at"),
    _CLAIM_COLUMNS.index("id"),
)
_BY_PRIORITY = operator.itemgetter(_CLAIM_COLUMNS.index("priority"))
_BY_TENANT = operator.itemgetter(_CLAIM_COLUMNS.index("tenant"))
_ORDER = "priority DESC, sort_deadline, enqueued_at, id"  # the ready index's, a tenant's
_R = schema.ranges
# An item row still ready, for statements that find their rows by id: ``state + 0`` does not
# imply the ready indexes' predicate, so PostgreSQL goes by the primary key. With ``state =
# 0`` and its statistics not yet gathered (a queue just filled) it chose the ready index and
# read the whole of it for each range, with ``id`` its last column.
_STILL_READY = _T.c.state + sa.literal_column("0") == sa.literal_column("0")
# The candidates of a claim that may lease a range, as one row: first and last id, how many,
# the earliest deadline (schema.NO_DEADLINE when none has one).
_PROBE = "SELECT min(id), max(id), count(*), min(sort_deadline)"
# PostgreSQL: a range lease's rows, as a claim's UPDATE ... RETURNING would give them (the
# attempt the range counts at ack or demotion counted here, as a per-item claim does).
_RANGE_ATTEMPTS = "CASE WHEN state = 0 THEN attempts + 1 ELSE attempts END AS attempts"
_RANGE_ROWS = (
    "SELECT "
    + ", ".join(_RANGE_ATTEMPTS if c == "attempts" else c for c in _CLAIM_COLUMNS)
    + " FROM batching_items WHERE id BETWEEN :range_lo AND :range_hi"
    " AND (state + 0 = 0 OR (state + 0 = 1 AND lease_id = :lease))"  # see sqlite_claim.RANGE
)


_Room = Callable[[Mapping[str, int], Mapping[str, int]], None]
"""``SqlQueue._room``'s check: (inserted by the groups before, by this one), by tenant."""


class _Written(NamedTuple):
    """What one enqueue's records inserted: how many, the keys skipped, new items by tenant."""

    inserted: int
    duplicates: tuple[str, ...]
    by_tenant: collections.Counter[str]


class _ClaimSql(NamedTuple):
    """A claim's UPDATE, and the candidates counted for a range lease (None: never one)."""

    update: str
    probe: str | None


_Statements = Callable[[int], tuple[_ClaimSql, "_ClaimSql | None"]]
# Whether the queue's ready items are all one tenant's (or none): its first and last tenant
# by ix_batching_items_tenant_ready, two probes. SQLite only (PostgreSQL would pay a round trip).
_ONE_TENANT = sa.text(
    "SELECT (SELECT tenant FROM batching_items WHERE queue = :queue AND state = 0"
    " ORDER BY tenant LIMIT 1) IS (SELECT tenant FROM batching_items WHERE queue = :queue"
    " AND state = 0 ORDER BY tenant DESC LIMIT 1)"
)

# The pieces of the two statements below: whether :queue is paused and its route (its
# ``batching_queue_controls`` row; none: running, no route); whether an item or range lease
# of it has expired. The literal ``state = 0`` / ``state = 1`` match the partial indexes'
# predicates.
_CONTROL = (
    "(SELECT paused FROM batching_queue_controls WHERE queue = :queue),"
    " (SELECT route FROM batching_queue_controls WHERE queue = :queue)"
)
_LAPSED = (
    "EXISTS (SELECT 1 FROM batching_items WHERE queue = :queue AND state = 1"
    " AND lease_expires_at < :now)"
    " OR EXISTS (SELECT 1 FROM batching_ranges WHERE queue = :queue AND lease_expires_at < :now)"
)
# What a claim's transaction has to do first (``SqlQueue._before_claim``): the control, whether
# a ready item is past its deadline, whether a lease lapsed. A claim then runs no expiry or
# reaping statement when there is none to do (4 statements of an empty claim's 9 on SQLite).
_LOOK = sa.text(
    f"SELECT {_CONTROL}, EXISTS (SELECT 1 FROM batching_items WHERE queue = :queue"
    f" AND state = 0 AND deadline_at IS NOT NULL AND deadline_at < :now), {_LAPSED}"
)
# Whether a claim has anything to do at all (``SqlQueue._nothing_to_do``): the control, and a
# ready item outside every range lease held, or a lease lapsed.
_WORK = sa.text(
    f"SELECT {_CONTROL}, EXISTS (SELECT 1 FROM batching_items i WHERE i.queue = :queue"
    " AND i.state = 0 AND NOT EXISTS (SELECT 1 FROM batching_ranges r WHERE r.queue = :queue"
    f" AND i.id BETWEEN r.lo AND r.hi)) OR {_LAPSED}"
)


def _listed(dialect: str, ids: Sequence[int]) -> list[int] | str:
    """``ids`` as the one value :func:`_in_list` binds: a PostgreSQL array, a JSON array on
    SQLite."""
    values = list(map(int, ids))
    return values if dialect == "postgresql" else orjson.dumps(values).decode()


def _in_list(
    column: sa.ColumnElement[int], dialect: str, value: list[int] | str | None = None
) -> sa.ColumnElement[bool]:
    """``column`` is one of a list bound as ONE value (``b_ids``, from :func:`_listed`: an
    array that PostgreSQL's ANY reads, a JSON array that SQLite's json_each reads): an IN list
    of 512 binds cost more than the UPDATE it filtered. With ``value``, bound here (a
    parameter of its own); without, passed as ``b_ids`` when the statement runs."""
    type_ = postgresql.ARRAY(sa.BigInteger) if dialect == "postgresql" else sa.String()
    bound = sa.bindparam("b_ids", value, type_=type_, unique=value is not None)
    if dialect == "postgresql":
        return column == sa.any_(bound)
    each = sa.func.json_each(bound).table_valued("value")
    return column.in_(sa.select(each.c.value))


def _is_run(ids: Sequence[int]) -> bool:
    """Whether ``ids`` are one run of consecutive ids, each once (``BETWEEN`` finds them)."""
    return max(ids) - min(ids) + 1 == len(ids) == len(set(ids))


# An ack's statements, built once: building one (its clauses, then its cache key) cost more
# than running it (an ack of two items 1.1 ms of CPU on SQLite, half of it in building).
_LEASE_RANGES = (
    sa.select(_R.c.id, _R.c.lo, _R.c.hi)
    .where(_R.c.lease_id == sa.bindparam("b_lease"))
    .with_for_update()
)
_RANGE_ACKED = (
    sa.update(_R)
    .where(_R.c.id == sa.bindparam("b_range"))
    .values(remaining=_R.c.remaining - sa.bindparam("b_k"))
)
_RANGE_DONE = sa.delete(_R).where(_R.c.id == sa.bindparam("b_range"), _R.c.remaining <= 0)


@functools.lru_cache(maxsize=8)
def _ack_sql(dialect: str, *, ranged: bool, run: bool) -> sa.Update:
    """An ack's UPDATE (binds ``b_finished``, ``b_batch``, ``b_lease`` and the ids'; see
    ``SqlQueue._ack_ids``): items of a range lease go from ready to done, the attempt counted
    here; others by their per-item lease. The ids as one run (``BETWEEN``) or a list."""
    ids: sa.ColumnElement[bool]
    if run:
        ids = _T.c.id.between(sa.bindparam("b_lo"), sa.bindparam("b_hi"))
    else:
        ids = _in_list(_T.c.id, dialect)
    done: dict[str, Any] = {
        "state": int(models.State.DONE),
        "finished_at": sa.bindparam("b_finished"),
        "lease_id": None,
        "lease_expires_at": None,
        "batch_id": sa.bindparam("b_batch"),
        "last_error": None,
    }
    if ranged:
        return sa.update(_T).where(ids, _STILL_READY).values(attempts=_T.c.attempts + 1, **done)
    held = sa.and_(_T.c.lease_id == sa.bindparam("b_lease"), _T.c.state == sa.literal_column("1"))
    return sa.update(_T).where(ids, held).values(**done)


@functools.lru_cache(maxsize=512)
def _text(sql: str) -> sa.TextClause:
    """``sa.text(sql)``, once per distinct statement: parsing a claim's SQL for its binds cost
    ~40 us a statement, three statements a claim (the claim's SQL is rendered from a few
    shapes: lane, pin, ranges excluded, fair-share tenants)."""
    return sa.text(sql)


def backoff_s(attempts: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: uniform in [0.5, 1] x min(max_s, base_s * 2^(attempts-1))."""
    ceiling = min(max_s, base_s * 2.0 ** max(0, attempts - 1))
    return ceiling * (0.5 + 0.5 * rng.random())


@functools.lru_cache(maxsize=256)
def _shape_text(shape: tuple[int, ...]) -> str:
    """A tensor payload's shape as the JSON the ``shape`` column holds; the items of one
    enqueue mostly share a shape, and a ``json.dumps`` each was a sixth of a W1 item's enqueue
    (cProfile)."""
    return json.dumps(list(shape))


class SqlQueue:
    """One named queue in a ``batching_items`` table, on SQLite or PostgreSQL.

    Args:
        engine: from :func:`create_engine`.
        queue: queue name (lane/model routing lives in ``lane``).
        clock: epoch-seconds clock; ``time.time`` unless a test drives time.
        max_attempts: default for enqueued items.
        backoff_base_s / backoff_max_s: retry backoff after ``fail``.
        fair_share / tenant_weights / max_tenant_wait_s: claims share across tenants by
            weight, with aging (:mod:`batching.tenant_share`); off: global order. The
            weights also set each tenant's share of a depth cap (:mod:`~.admission`).
    """

    def __init__(
        self,
        engine: Engine,
        queue: str = "default",
        *,
        clock: Clock = time.time,
        max_attempts: int = 5,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 600.0,
        worker: str | None = None,
        rng: random.Random | None = None,
        fair_share: bool = True,
        tenant_weights: Mapping[str, float] | None = None,
        max_tenant_wait_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.queue = queue
        # The last claim came back short of its n: the queue may be drained, so the next
        # claim looks first, in a read, whether it has anything to do (_nothing_to_do).
        self._short = True
        self.clock = clock
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.worker = worker or f"{uuid.uuid4().hex[:12]}"
        self._rng = rng or random.Random()
        self.tenant_weights = dict(tenant_weights or {})  # the depth cap's shares (1.0 unlisted)
        self._url = engine.url.render_as_string(hide_password=True)
        self._database_id: str | None = None
        self._fair = (
            tenant_share.FairShare(self.tenant_weights, max_tenant_wait_s) if fair_share else None
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def url(self) -> str:
        """The database's URL, its password masked."""
        return self._url

    @property
    def database_id(self) -> str:
        """The database's id (``schema.database_id``), read once: what an output records as
        its owner (a scorer's preflight and a reconcile each asked twice)."""
        if self._database_id is None:
            with self.read() as conn:
                self._database_id = schema.database_id(conn)
        return self._database_id

    @contextlib.contextmanager
    def begin(self) -> Iterator[Connection]:
        """A write transaction (SQLite: BEGIN IMMEDIATE); errors become ``QueueError``.

        SQLite allows one writer: writers take :func:`batching.store.sqlite.writer_lock` first (a
        thread lock, then a file lock shared with other processes), so they queue without
        SQLite's sleep-and-retry busy handler.
        """
        lock = sqlite.writer_lock(self.engine)
        with lock, database.translate_errors(self._url), self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction whose statements all see one snapshot; errors become
        ``QueueError``. Do not write in it.

        SQLite: a deferred ``BEGIN``, which reads a WAL snapshot without taking the write lock
        (``begin()`` would queue behind claims and commits just to read). PostgreSQL:
        ``REPEATABLE READ`` (its default, ``READ COMMITTED``, takes a new snapshot for each
        statement, so a commit landing between two reads shows its items done but not its
        ledger row).
        """
        with database.translate_errors(self._url), self.engine.connect() as conn:
            if self.dialect == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
            else:
                conn.execution_options(**{sqlite.READ_ONLY: True})
            with conn.begin():
                yield conn

    def migrate(self) -> schema.MigrationResult:
        """Create or upgrade the schema; a second run applies nothing."""
        with database.translate_errors(self._url):
            if self.dialect == "sqlite":
                sqlite.use_wal(self.engine)
            return schema.migrate(self.engine, self.clock)

    def check_schema(self) -> None:
        """Raise ``SchemaError`` unless the schema is current, ``QueueError`` if unreachable."""
        with self.read() as conn:
            try:
                schema.require_current(conn)
            except errors.SchemaError as exc:  # name the database the user has to upgrade
                message = str(exc).replace("--db URL", f"--db {database.redact(self._url)}")
                raise errors.SchemaError(message) from None

    # -- ingress -----------------------------------------------------------------------------

    def enqueue(
        self,
        records: Iterable[models.EnqueueRecord],
        on_progress: Callable[[int], None] | None = None,
        *,
        enqueue_run: str | None = None,
    ) -> models.EnqueueResult:
        """Insert records in one transaction, idempotent on ``(queue, item_key)``.

        Keys already in the queue (or repeated within ``records``) are not inserted again and
        are reported in ``duplicates``. PostgreSQL: one ``NOTIFY`` for the whole call.
        ``on_progress`` is called with the number of distinct records written so far (new or
        found present) after each chunk of the transaction; nothing is visible before its
        commit. ``records`` is read a chunk at a time inside the transaction (a file streamed
        by ``ingest.iter_records`` is never held whole); an error it raises rolls back all.
        ``enqueue_run`` is stamped on every new item (``batching queue cancel --enqueue-run``).

        Raises:
            QueueFull: the new items would take the queue past its depth cap
                (:mod:`batching.ingress.controls`); nothing is enqueued.
        """
        with self.begin() as conn:
            schema.require_current_to_write(conn)
            room = functools.partial(self._room(conn), {})
            done = self._write_records(conn, records, self.clock(), enqueue_run, room, on_progress)
            if done.inserted and self.dialect == "postgresql":
                conn.execute(sa.select(sa.func.pg_notify(NOTIFY_CHANNEL, self.queue)))
        logger.info(
            "items enqueued",
            extra={"action": "enqueue", "queue": self.queue, "n_items": done.inserted},
        )
        return models.EnqueueResult(done.inserted, done.duplicates)

    def enqueue_each(
        self,
        groups: Sequence[Sequence[models.EnqueueRecord]],
        *,
        enqueue_run: str | None = None,
        then: Callable[[Connection], object] | None = None,
    ) -> list[models.EnqueueResult | errors.QueueFull | errors.InputError]:
        """Enqueue several requests' records in ONE transaction, each group admitted or
        refused on its own, in order: a group that would take the queue past its depth cap
        (or its tenant past its share) is rolled back to a savepoint and gets its
        ``QueueFull``, the groups after it still go in while there is room. A key a group
        sends that an earlier group (or the queue) holds is that group's duplicate when the
        holder is the record's own tenant; another tenant's key rolls the group back with
        ``KeyTaken``, judged inside the transaction, so a request of several items is never
        half written because another process took one of its keys a moment before.

        The HTTP ingress writes the requests waiting at one moment this way: at the cap one
        transaction answers them all, where refusing a group whole and retrying its halves
        took up to twice as many transactions as requests, and the ingress fell behind just
        when the queue was full. ``then`` is called with the connection last, inside the
        transaction (the ingress reads its answer there: a read transaction of its own after
        the commit cost it a connection, a BEGIN and a COMMIT more a group).

        Raises:
            QueueError: the database failed; nothing is enqueued.
            SchemaError: the database's schema is not this release's (migrated under a
                running API); nothing is enqueued.
        """
        now = self.clock()
        out: list[models.EnqueueResult | errors.QueueFull | errors.InputError] = []
        with self.begin() as conn:
            schema.require_current_to_write(conn)
            check = self._room(conn)
            added: collections.Counter[str] = collections.Counter()  # by the groups admitted
            for records in groups:
                savepoint = conn.begin_nested()
                room = functools.partial(check, collections.Counter(added))
                try:
                    done = self._write_records(conn, records, now, enqueue_run, room, None)
                    if done.duplicates:
                        self._refuse_taken(conn, records, done.duplicates)
                except (errors.QueueFull, errors.InputError) as refused:
                    savepoint.rollback()
                    out.append(refused)
                    continue
                savepoint.commit()
                added.update(done.by_tenant)
                out.append(models.EnqueueResult(done.inserted, done.duplicates))
            inserted = added.total()
            if inserted and self.dialect == "postgresql":
                conn.execute(sa.select(sa.func.pg_notify(NOTIFY_CHANNEL, self.queue)))
            if then is not None:
                then(conn)
        logger.info(
            "items enqueued",
            extra={"action": "enqueue", "queue": self.queue, "n_items": inserted},
        )
        return out

    def _refuse_taken(
        self,
        conn: Connection,
        records: Sequence[models.EnqueueRecord],
        duplicates: Sequence[str],
    ) -> None:
        """Raise ``KeyTaken`` when a duplicate of ``records`` is held by another tenant than
        the record's (read in the writing transaction)."""
        tenant_of = {r.item_key: r.tenant for r in records}
        keys = sorted(set(duplicates))
        for at in range(0, len(keys), 500):  # within every database's bound-parameter limit
            # Read whole before raising: a cursor left open by the raise (its rows held by
            # the traceback) kept the API writer's SQLite connection on an old snapshot, and
            # its every write after another process's commit failed "database is locked"
            # (found by a review: one 409 of several keys, then every POST 503).
            rows = conn.execute(
                sa.select(_T.c.item_key, _T.c.tenant).where(
                    _T.c.queue == self.queue, _T.c.item_key.in_(keys[at : at + 500])
                )
            ).all()
            for key, tenant in rows:
                if tenant != tenant_of[key]:
                    raise errors.KeyTaken(key, self.queue)

    def _write_records(
        self,
        conn: Connection,
        records: Iterable[models.EnqueueRecord],
        now: float,
        enqueue_run: str | None,
        room: Callable[[Mapping[str, int]], None],
        on_progress: Callable[[int], None] | None,
    ) -> _Written:
        """Insert ``records`` a chunk at a time in ``conn``'s transaction, repeats and keys
        present skipped; ``room`` checks the cap after each chunk (raising ``QueueFull``)."""
        dupes: list[str] = []
        seen: set[str] = set()  # keys only: a chunk's payloads go once it is written
        written = [0, 0]  # distinct records written, of them inserted
        added: collections.Counter[str] = collections.Counter()  # inserted, by tenant
        rows: list[dict[str, Any]] = []
        bodies: dict[str, bytes] = {}
        chunk = pg_bulk.CHUNK if self.dialect == "postgresql" else _ENQUEUE_CHUNK
        for rec in records:
            if rec.item_key in seen:
                dupes.append(rec.item_key)
                continue
            seen.add(rec.item_key)
            bodies[rec.item_key] = rec.payload.data
            rows.append(self._row(rec, now, enqueue_run))
            if len(rows) == chunk:
                self._write_chunk(conn, rows, bodies, written, dupes, on_progress, added)
                room(added)
                rows, bodies = [], {}
        if rows:
            self._write_chunk(conn, rows, bodies, written, dupes, on_progress, added)
            room(added)
        return _Written(written[1], tuple(dupes), added)

    def _write_chunk(
        self,
        conn: Connection,
        rows: list[dict[str, Any]],
        bodies: dict[str, bytes],
        written: list[int],
        dupes: list[str],
        on_progress: Callable[[int], None] | None,
        added: collections.Counter[str],
    ) -> None:
        """Insert one chunk of distinct records; counts into ``written``, ``dupes`` and
        ``added`` (inserted by tenant)."""
        if self.dialect == "postgresql":  # COPY through a staging table, or one statement
            ids = pg_bulk.insert_new(conn, rows, bodies)
        else:  # the driver's executemany
            ids = sqlite_bulk.insert_new(conn, rows)
            if ids:
                sqlite_bulk.insert_bodies(conn, ((i, bodies[k]) for k, i in ids.items()))
        added.update(r["tenant"] for r in rows if r["item_key"] in ids)
        written[0] += len(rows)
        written[1] += len(ids)
        dupes.extend(r["item_key"] for r in rows if r["item_key"] not in ids)
        if on_progress is not None:
            on_progress(written[0])

    def _room(self, conn: Connection) -> _Room:
        """In an enqueue's transaction: a check that raises ``QueueFull`` once the items a
        group inserted so far (``added``, by tenant), after those of the groups admitted
        before it in the same transaction (``earlier``), would take the queue past its depth
        cap (one that never does when the queue has no cap), or, past half the cap, one of the
        group's tenants past its weighted share of it (``admission.over_share``: a flooding
        tenant cannot take the room of the others). The earlier groups count as the queue's
        items: a group is judged as if it were an enqueue of its own after them."""
        cap = admission.max_depth(conn, self.queue)
        if cap is None:
            return lambda _earlier, _added: None
        depths = admission.depth_by_tenant(conn, self.queue)
        before = sum(depths.values())

        def check(earlier: Mapping[str, int], added: Mapping[str, int]) -> None:
            depth, n = before + sum(earlier.values()), sum(added.values())
            if not n:  # keys present already: a resend adds nothing, even past a lowered cap
                return
            if depth + n > cap:
                raise admission.queue_full(self.queue, depth, n, cap)
            if 2 * (depth + n) > cap:
                now = collections.Counter(depths) + collections.Counter(earlier)
                admission.over_share(self.queue, cap, now, added, self.tenant_weights, depth=depth)

        return check

    def _row(
        self, rec: models.EnqueueRecord, now: float, enqueue_run: str | None
    ) -> dict[str, Any]:
        p = rec.payload
        return {
            "queue": self.queue,
            "lane": rec.lane,
            "item_key": rec.item_key,
            "tenant": rec.tenant,
            "priority": rec.priority,
            "payload_format": str(p.format),
            "dtype": p.dtype,
            "shape": _shape_text(tuple(p.shape)) if p.shape is not None else None,
            "cost": rec.cost,
            "state": int(models.State.READY),
            "attempts": 0,
            "max_attempts": rec.max_attempts or self.max_attempts,
            "crash_count": 0,
            "enqueued_at": now,
            "run_after": now,
            "deadline_at": rec.deadline_at,
            "sort_deadline": rec.deadline_at if rec.deadline_at is not None else schema.NO_DEADLINE,
            "enqueue_run": enqueue_run,
            "route_bucket": routing.bucket(rec.item_key),
        }

    # -- claim -------------------------------------------------------------------------------

    @database.reconnecting
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
        """Lease up to ``n`` ready items in one statement, under one new lease id (or
        ``lease_id``: a scorer adding items to a lease it holds, so the batches it cuts from
        several claims commit once, not once per claim; the fence is the same, item by item).

        Order: priority (high first), then deadline (earliest first, none last), then age;
        with ``fair_share`` (the default), within each tenant, and the ``n`` split across
        the ready tenants by weight, with aging (:mod:`batching.tenant_share`).
        ``attempts`` is counted here; the reaper gives it back to the items of a lost worker
        unless one was alone in an isolation round (:mod:`batching.crashes`).
        ``max_cost`` caps the sum of cost hints (the first item is always taken, so an
        oversized item is not starved). First, in the same transaction, items past their
        deadline are moved to ``expired`` and this queue's expired leases are reaped.
        Returns a claim with zero items when nothing is ready, and with zero items and
        ``paused`` when the queue is paused (read first, in the claim's transaction; nothing
        else is done then: no expiry, no reaping). With ``columns``, a SQLite
        claim of uniform items (see ``sqlite_claim.unpack_claim``) holds them as one
        :class:`~batching.models.ItemBlock`.

        A plain claim never takes a suspect (an item whose worker was lost); its
        ``suspects`` says whether any wait. With ``isolate``, the claim takes suspects only,
        at most as many as the first one's ``isolate_n``: score them with nothing else in
        flight, so a death while they run is charged to them alone.

        With ``pin``, only the items the queue's route (read in the claim's transaction)
        sends to ``pin.version``, by their stored key bucket: a scorer serving one version of
        a rollout, where a device cannot hold two. Nothing when the route names no such
        version (or, without a route, when it is not ``pin.default``).
        """
        if n < 1:
            raise ValueError("n must be >= 1")
        lease_id = lease_id or str(uuid.uuid4())
        now = self.clock()
        params: dict[str, Any] = {
            "queue": self.queue,
            "lane": lane,
            "now": now,
            "n": n,
            "lease": lease_id,
            "worker": self.worker,
            "expires": now + lease_s,
            "budget": max_cost,
            "isolate": isolate,
            "suspects": False,
            "paused": False,
            "route": None,
            "expired": (),
            "pin": pin,
        }
        fair = None if isolate else self._fair  # an isolation round keeps the global order
        pinned = pin is not None
        ranking = None if fair is None else fair.ranking(now)
        # A range lease (one row for a run of ids) only where every rule of a per-item lease
        # holds for it unchanged: not a suspects' round, a pin or a cost budget; the claim
        # itself checks that the items are one run of ids with no deadline.
        rangeable = columns and not isolate and not pinned and max_cost is None and n >= 2

        def statements(excluded: int) -> tuple[_ClaimSql, _ClaimSql | None]:
            """The claim leaving out ``excluded`` ranges, and (SQLite, fair share) the plain
            claim to run instead when the ready items are one tenant's."""
            if ranking is None:
                budget = None if isolate else max_cost
                return self._claim_sql(
                    lane, budget, isolate=isolate, pinned=pinned, excluded=excluded
                ), None
            sql = self._fair_claim_sql(lane, max_cost, ranking, params, pinned, excluded)
            if self.dialect != "sqlite":
                return sql, None
            return sql, self._claim_sql(lane, max_cost, pinned=pinned, excluded=excluded)

        if not isolate and self._short and self._nothing_to_do(params, now):
            return models.Claim(
                lease_id,
                (),
                now + lease_s,
                paused=bool(params["paused"]),
                route=params["route"],
            )
        block = columns and not isolate
        if self.dialect == "sqlite":
            claimed = self._claim_sqlite(statements, params, now, block, rangeable)
        else:
            claimed = self._claim_returning(statements, params, now, block, rangeable)
        self._short = len(claimed if isinstance(claimed, models.ItemBlock) else claimed[0]) < n
        if isinstance(claimed, models.ItemBlock):
            if fair is not None:
                fair.charge({claimed.template.tenant: len(claimed)}, now)
            return models.Claim(
                lease_id,
                claimed,
                now + lease_s,
                suspects=bool(params["suspects"]),
                expired=params["expired"],
                route=params["route"],
            )
        rows, bodies = claimed
        if fair is not None and rows:
            fair.charge(collections.Counter(map(_BY_TENANT, rows)), now)
        rows.sort(key=_BY_DEADLINE_AGE_ID)
        rows.sort(key=_BY_PRIORITY, reverse=True)  # stable: ties keep the order above
        return models.Claim(
            lease_id=lease_id,
            items=_items(rows, bodies),
            lease_expires_at=now + lease_s,
            isolated=isolate,
            suspects=bool(params["suspects"]),
            paused=bool(params["paused"]),
            expired=params["expired"],
            route=params["route"],
        )

    def _claim_sql(
        self,
        lane: str | None,
        max_cost: int | None,
        *,
        isolate: bool = False,
        pinned: bool = False,
        excluded: int = 0,
    ) -> _ClaimSql:
        where = "queue = :queue AND state = 0 AND run_after <= :now"
        where += " AND lane = :lane" if lane is not None else ""
        where += " AND isolate_n > 0" if isolate else " AND isolate_n = 0"
        where += f" AND {self._pin_sql()}" if pinned else ""
        where += _not_in_ranges(excluded)
        order = "priority DESC, sort_deadline, enqueued_at, id"
        order = f"isolate_n, {order}" if isolate else order
        pg = self.dialect == "postgresql"
        lock = " FOR NO KEY UPDATE SKIP LOCKED" if pg else ""
        unlocked = (
            "SELECT id, cost, priority, sort_deadline, enqueued_at FROM batching_items"
            f" WHERE {where} ORDER BY {order} LIMIT :n"
        )
        cand = unlocked + lock
        probe = None if max_cost is not None or isolate else f"{_PROBE} FROM ({unlocked}) c"
        if max_cost is None:
            picked = cand
        else:
            # Lock first, pack afterwards: PostgreSQL refuses window functions beside FOR UPDATE.
            # The first row is always taken, so an item costlier than the budget still runs.
            picked = (
                "SELECT id FROM (SELECT id, row_number() OVER w AS rn, sum(cost) OVER w AS run"
                f" FROM cand WINDOW w AS (ORDER BY {order})) s WHERE rn = 1 OR run <= :budget"
            )
        cols = ", ".join(f"q.{c}" for c in _CLAIM_COLUMNS)
        if pg:
            ctes = f"cand AS MATERIALIZED ({cand})"
            if max_cost is not None:
                ctes += f", picked AS MATERIALIZED ({picked})"
            source = "picked" if max_cost is not None else "cand"
            return _ClaimSql(
                f"WITH {ctes} UPDATE batching_items q SET state = 1, attempts = q.attempts + 1,"
                " lease_id = :lease, leased_by = :worker, lease_expires_at = :expires"
                f" FROM {source} WHERE q.id = {source}.id AND q.state = 0 RETURNING {cols}",
                probe,
            )
        # SQLite returns nothing here: the claimed rows are read back as one row (_claim_sqlite).
        ids = f"SELECT id FROM ({cand})" if max_cost is None else f"WITH cand AS ({cand}) {picked}"
        return _ClaimSql(
            "UPDATE batching_items SET state = 1, attempts = attempts + 1, lease_id = :lease,"
            f" leased_by = :worker, lease_expires_at = :expires WHERE id IN ({ids})",
            probe,
        )

    def _fair_claim_sql(
        self,
        lane: str | None,
        max_cost: int | None,
        ranking: tenant_share.Ranking,
        params: dict[str, Any],
        pinned: bool = False,
        excluded: int = 0,
    ) -> _ClaimSql:
        """The claim statement with the fair share (``params`` gets its binds).

        The ready tenants come from a skip scan of ``ix_batching_items_tenant_ready`` (one
        probe a tenant), each tenant's first ``n`` ready items from the same index in its own
        order; those are ranked by aged rank and tag (:func:`tenant_share.rank_sql`) and the
        first ``n`` taken (within ``max_cost``). One statement whatever the number of
        tenants. PostgreSQL locks each tenant's candidates ``FOR NO KEY UPDATE SKIP LOCKED``
        in a ``MATERIALIZED`` CTE, as the plain claim does (the unchosen ones only until
        the claim commits); SQLite holds its write lock.
        """
        aged, tag, binds = tenant_share.rank_sql(ranking)
        params.update(binds)
        pg = self.dialect == "postgresql"
        ready = "queue = :queue AND state = 0"
        tenants = (
            f"tenants(tenant) AS (SELECT (SELECT tenant FROM batching_items WHERE {ready}"
            " ORDER BY tenant LIMIT 1) UNION ALL SELECT (SELECT i.tenant FROM batching_items i"
            " WHERE i.queue = :queue AND i.state = 0 AND i.tenant > t.tenant"
            " ORDER BY i.tenant LIMIT 1) FROM tenants t WHERE t.tenant IS NOT NULL)"
        )
        where = f"{ready} AND tenant = t.tenant AND run_after <= :now AND isolate_n = 0"
        where += " AND lane = :lane" if lane is not None else ""
        where += f" AND {self._pin_sql()}" if pinned else ""
        where += _not_in_ranges(excluded)
        head = "id, cost, tenant, priority, sort_deadline, enqueued_at"
        unlocked = per_tenant = ""
        if pg:
            unlocked = (
                f"SELECT c.* FROM tenants t CROSS JOIN LATERAL (SELECT {head} FROM"
                f" batching_items WHERE {where} ORDER BY {_ORDER} LIMIT :n) c"
            )
            per_tenant = unlocked.removesuffix(") c") + " FOR NO KEY UPDATE SKIP LOCKED) c"
        else:
            per_tenant = (
                f"SELECT i.id, i.cost, i.tenant, i.priority, i.sort_deadline, i.enqueued_at"
                " FROM tenants t JOIN batching_items i ON i.id IN (SELECT id FROM batching_items"
                f" WHERE {where} ORDER BY {_ORDER} LIMIT :n)"
            )
        order = f"aged, tag, {_ORDER}"
        ranked = (
            f"SELECT id, cost, priority, sort_deadline, enqueued_at, {aged} AS aged, {tag} AS tag"
            " FROM (SELECT l.*, row_number() OVER (PARTITION BY tenant ORDER BY"
            f" {_ORDER}) AS rn FROM per_tenant l) r ORDER BY {order} LIMIT :n"
        )
        materialized = " MATERIALIZED" if pg else ""
        ctes = f"{tenants}, per_tenant AS{materialized} ({per_tenant}), cand AS ({ranked})"
        probe = None
        if max_cost is None and not pinned:
            plain = ctes.replace(per_tenant, unlocked) if pg else ctes
            probe = f"WITH RECURSIVE {plain} {_PROBE} FROM cand"
        source = "SELECT id FROM cand"
        if max_cost is not None:
            source = (
                "SELECT id FROM (SELECT id, row_number() OVER w AS rn, sum(cost) OVER w AS run"
                f" FROM cand WINDOW w AS (ORDER BY {order})) s WHERE rn = 1 OR run <= :budget"
            )
        if pg:
            cols = ", ".join(f"q.{c}" for c in _CLAIM_COLUMNS)
            return _ClaimSql(
                f"WITH RECURSIVE {ctes}, picked AS ({source}) UPDATE batching_items q SET"
                " state = 1, attempts = q.attempts + 1, lease_id = :lease, leased_by = :worker,"
                " lease_expires_at = :expires FROM picked WHERE q.id = picked.id AND q.state = 0"
                f" RETURNING {cols}",
                probe,
            )
        return _ClaimSql(
            "UPDATE batching_items SET state = 1, attempts = attempts + 1, lease_id = :lease,"
            " leased_by = :worker, lease_expires_at = :expires"
            f" WHERE id IN (WITH RECURSIVE {ctes} {source})",
            probe,
        )

    def _claim_returning(
        self,
        statements: _Statements,
        params: dict[str, Any],
        now: float,
        columns: bool = False,
        rangeable: bool = False,
    ) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
        """PostgreSQL: the UPDATE ... RETURNING read back as one row of columns
        (:func:`pg_bulk.claim_as_one_row`), then the bodies as one value in the ids' order
        (a row each past ``pg_bulk.CONCAT_MAX_BYTES``); with ``columns``, uniform items as
        one ItemBlock (as a SQLite claim). Items whose body row is gone are buried in the
        same transaction.

        Claims that may lease a range hold the queue's range lock exclusively, every other
        claim (and a cancel) shares it: a range is leased by reading which items are ready,
        with no row locked, so nothing else may take a ready item meanwhile. A range lease
        reads its rows back once it has committed, in a read transaction of its own (as a
        SQLite claim does), so the lock is held for the range's one row, not for reading
        its bodies (~0.1 s for 16,384 W1 items, during which every other scorer of the
        queue would wait)."""
        with self.begin() as conn:
            controls.lock_ranges(conn, self.queue, exclusive=rangeable)
            if not self._before_claim(conn, now, params):
                return [], {}
            sql, _ = statements(self._exclude_ranges(conn, params))
            ranged = rangeable and self._lease_range(conn, sql.probe, params)
            if not ranged:
                claimed = self._returned(conn, sql.update, params, columns)
                if isinstance(claimed, models.ItemBlock):
                    return claimed
                rows, bodies = claimed
                if len(bodies) != len(rows):
                    rows = self._bury_bodiless(conn, params["lease"], rows, bodies, now)
                return rows, bodies
        return self._read_back(
            lambda c: self._returned(c, _RANGE_ROWS, params, columns), params, now
        )

    def _read_back(
        self,
        read: Callable[[Connection], tuple[list[Any], dict[int, bytes]] | models.ItemBlock],
        params: dict[str, Any],
        now: float,
    ) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
        """A committed claim's rows, read in a read transaction of their own; if reading them
        fails, the claim is released, not left leased (and, item by item, charged an attempt)
        until it expires. Items whose body row is gone are buried in a write transaction."""
        try:
            with self.read() as conn:
                claimed = read(conn)
        except BaseException:
            self._release_quietly(params["lease"])
            raise
        if isinstance(claimed, models.ItemBlock):
            return claimed
        rows, bodies = claimed
        if len(bodies) != len(rows):
            with self.begin() as conn:
                rows = self._bury_bodiless(conn, params["lease"], rows, bodies, now)
        return rows, bodies

    def _returned(
        self, conn: Connection, claim_sql: str, params: dict[str, Any], columns: bool
    ) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
        """PostgreSQL: the rows of ``claim_sql`` (a claim's UPDATE ... RETURNING, or a range's
        SELECT) as one row of columns, then their bodies (see _claim_returning)."""
        row = conn.execute(_text(pg_bulk.claim_as_one_row(claim_sql)), params).one()
        parts = pg_bulk.split_row(row)
        if parts is None:
            return [], {}
        head, times = parts
        full = pg_bulk.with_bodies(conn, head)
        if full is None:  # too many bytes for one value: the bodies a row each
            rows, _ = sqlite_claim.unpack_claim(self.queue, head, times)
            return rows, self._bodies(conn, [r[0] for r in rows])
        return sqlite_claim.unpack_claim(self.queue, full, times, columns=columns)

    def _claim_sqlite(
        self,
        statements: _Statements,
        params: dict[str, Any],
        now: float,
        columns: bool = False,
        rangeable: bool = False,
    ) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
        """SQLite: the UPDATE (or a range lease's one row) alone under the write lock, then
        the rows read back outside it.

        ``statements`` may give a second statement to run instead of the first (a fair claim)
        when the ready items are all one tenant's (:data:`_ONE_TENANT`, two index probes in
        the same transaction): the plain claim, which takes them in the same order without
        ranking them.

        Python's sqlite3 releases and retakes the GIL for every row it steps. With other
        threads busy in Python each retake can wait a switch interval (5 ms), and a claim that
        returned its rows one by one held the database's only write lock all that time (with
        a thread spinning beside it: 468 against 24 us a row). So the UPDATE returns nothing;
        once it commits, the rows are this lease's, and one aggregate SELECT in a read
        transaction (a WAL snapshot, no write lock) returns them all as a single row. If
        reading them back fails, the claim is released, not left leased.
        """
        with self.begin() as conn:
            if not self._before_claim(conn, now, params):
                return [], {}
            sql, alone = statements(self._exclude_ranges(conn, params))
            if alone is not None and conn.execute(_ONE_TENANT, params).scalar():
                sql = alone
            if rangeable and self._lease_range(conn, sql.probe, params):
                n_claimed = params["range_n"]
            else:
                n_claimed = conn.execute(_text(sql.update), params).rowcount
        if not n_claimed:
            return [], {}
        return self._read_back(lambda c: self._read_claimed(c, params, columns), params, now)

    def _read_claimed(
        self, conn: Connection, params: dict[str, Any], columns: bool
    ) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
        reads = sqlite_claim.RANGE if "range_n" in params else sqlite_claim.LEASE
        try:
            row = conn.execute(reads.claimed, params).one()
        except exc.DataError:  # "string or blob too big": bodies over 1 GB in all
            row = conn.execute(reads.no_bodies, params).one()
            times = _claimed_times(conn, row, params, reads)
            rows, _ = sqlite_claim.unpack_claim(self.queue, row, times)
            return rows, self._bodies(conn, [r[0] for r in rows])
        times = _claimed_times(conn, row, params, reads)
        return sqlite_claim.unpack_claim(self.queue, row, times, columns=columns)

    # -- range leases (one row for a run of ready ids; schema.ranges) -------------------------

    def _exclude_ranges(self, conn: Connection, params: dict[str, Any]) -> int:
        """Bind this queue's range leases into ``params`` (``xlo0``, ``xhi0``, ...) for
        :func:`_not_in_ranges`; returns how many."""
        held = conn.execute(
            sa.select(_R.c.lo, _R.c.hi).where(_R.c.queue == self.queue).order_by(_R.c.lo)
        ).all()
        for k, (lo, hi) in enumerate(held):
            params[f"xlo{k}"], params[f"xhi{k}"] = lo, hi
        return len(held)

    def _lease_range(self, conn: Connection, probe: str | None, params: dict[str, Any]) -> bool:
        """Lease the claim's items by one ``batching_ranges`` row when they are one run of
        ids (at least two) with no deadline: the claim's candidates, counted in one
        aggregate row (no row stepped in Python under the write lock). False, with nothing
        written, when they are not; the claim then leases them item by item."""
        if probe is None:
            return False
        lo, hi, n, soonest = conn.execute(_text(probe), params).one()
        if not n or n < 2 or hi - lo + 1 != n or soonest < schema.NO_DEADLINE:
            return False
        conn.execute(
            sa.insert(_R).values(
                queue=self.queue,
                lo=lo,
                hi=hi,
                remaining=n,
                lease_id=params["lease"],
                leased_by=params["worker"],
                lease_expires_at=params["expires"],
            )
        )
        params.update(range_lo=lo, range_hi=hi, range_n=n)
        return True

    def _demote(
        self, conn: Connection, held: sa.ColumnElement[bool], *, skip_locked: bool = False
    ) -> int:
        """Turn the range leases matching ``held`` into per-item leases (state leased, an
        attempt counted, the range's lease id and expiry), in ``conn``'s transaction; returns
        the items. Every verb but a whole ack or release does this first, so the rules of a
        per-item lease (fencing, the crash rule, backoff, dead-lettering) apply unchanged.
        The ranges are deleted first: of two transactions demoting one range, one does.

        ``skip_locked`` (the reaper's; PostgreSQL): leave a range another transaction holds
        locked (its ack, or its owner's transaction frozen mid-commit) to a later reap. A
        blocking delete there waited under the queue's claim lock, so one frozen scorer
        stopped every scorer of the queue until it resumed."""
        if skip_locked and self.dialect == "postgresql":
            free = sa.select(_R.c.id).where(held).with_for_update(skip_locked=True)
            ids = list(conn.execute(free).scalars())
            if not ids:
                return 0
            held = _R.c.id.in_(ids)
        gone = conn.execute(
            sa.delete(_R)
            .where(held)
            .returning(_R.c.lo, _R.c.hi, _R.c.lease_id, _R.c.leased_by, _R.c.lease_expires_at)
        ).all()
        n = 0
        for lo, hi, lease_id, leased_by, expires in gone:
            n += conn.execute(
                sa.update(_T)
                .where(_T.c.id.between(lo, hi), _STILL_READY)
                .values(
                    state=int(models.State.LEASED),
                    attempts=_T.c.attempts + 1,
                    lease_id=lease_id,
                    leased_by=leased_by,
                    lease_expires_at=expires,
                )
            ).rowcount
        return n

    def _lease_ranges(self, conn: Connection, lease_id: str) -> Sequence[Any]:
        """The range leases of ``lease_id``, locked (PostgreSQL) before any of their items:
        a range is always locked before its items, by every verb, so an ack and a reaper
        demoting the same range wait for each other rather than deadlock."""
        return conn.execute(_LEASE_RANGES, {"b_lease": lease_id}).all()

    def _release_quietly(self, lease_id: str) -> None:
        try:
            self.release(lease_id)
        except errors.QueueError:
            logger.warning(
                "claimed items could not be released; they return when the lease expires",
                extra={"action": "release_failed", "lease_id": lease_id},
                exc_info=True,
            )

    def _bury_bodiless(
        self,
        conn: Connection,
        lease_id: str,
        rows: list[Any],
        bodies: Mapping[int, bytes],
        now: float,
    ) -> list[Any]:
        """Dead-letter claimed rows whose payload row is gone (a manual delete or a partial
        restore) in the claim's transaction; returns the rest. They can never be scored, and
        failing the claim instead would charge an attempt to every item claimed with them."""
        lost = [r[0] for r in rows if r[0] not in bodies]
        self._demote(conn, _R.c.lease_id == lease_id)
        conn.execute(
            sa.update(_T)
            .where(self._leased(lease_id, lost))
            .values(
                state=int(models.State.DEAD),
                finished_at=now,
                lease_id=None,
                lease_expires_at=None,
                last_error="payload missing from batching_payloads",
            )
        )
        self._notify_final(conn)
        logger.error(
            "claimed items have no payload; dead-lettered",
            extra={"action": "dead_letter", "queue": self.queue, "n_items": len(lost)},
        )
        return [r for r in rows if r[0] in bodies]

    def _bodies(self, conn: Connection, ids: list[int]) -> dict[int, bytes]:
        stmt = sa.select(_P.c.id, _P.c.payload).where(self._id_in(ids, _P.c.id))
        return dict(conn.execute(stmt).fetchall())

    def _nothing_to_do(self, params: dict[str, Any], now: float) -> bool:
        """Whether a claim would find nothing to do, read in a read transaction (no write
        lock): the queue paused (``params["paused"]``), or no ready item outside the range
        leases held, no item lease and no range lease expired. Then the claim returns empty
        without its write transaction, whose statements (pause, expiry, reaping, suspects,
        ranges, the claim) cost an empty claim ~2 ms of CPU on SQLite: a scorer below
        capacity claims again after every batch and whenever the database changes, so its
        empty claims cost more than its forward passes, on cores the model shares.

        Every item the full claim would expire or take is ready and outside the ranges held
        (a range holds no item with a deadline), and every lease it would reap has expired,
        so a false here skips nothing; a true may still find nothing (a backoff's
        ``run_after``, a lane, a pin), and the full claim then runs as before."""
        with self.read() as conn:
            paused, route, work = conn.execute(_WORK, {"queue": self.queue, "now": now}).one()
        params["paused"], params["route"] = bool(paused), route
        return bool(paused) or not work

    def _before_claim(self, conn: Connection, now: float, params: dict[str, Any]) -> bool:
        """In the claim's transaction, first: whether the queue is paused (one key lookup; if
        so, ``params["paused"]`` and False, nothing else done). Then items past their deadline
        expire (``params["expired"]``: how many, by tenant), and this queue's expired leases
        (a worker killed, or stopped without releasing) go back to ready, so a scorer picks
        up what a dead one left without anyone running the reaper. Then the suspects: whether
        any wait (``params["suspects"]``), and for an isolation claim how many it may take
        together (``params["n"]``; the first suspect's ``isolate_n``)."""
        paused, route, overdue, lapsed = conn.execute(_LOOK, params).one()
        params["paused"], params["route"] = bool(paused), route
        if params["paused"]:
            return False
        pin = params["pin"]
        if pin is not None:
            params.update(_pin_binds(pin, params["route"]))
        if overdue:
            params["expired"] = self._expire_overdue(conn, now)
        if lapsed:
            self._release_expired(conn, now, _REAP_LIMIT, this_queue=True)
        # The literal ``state = 0 AND isolate_n > 0`` matches the partial index's predicate.
        where = "queue = :queue AND state = 0 AND isolate_n > 0 AND run_after <= :now"
        where += " AND lane = :lane" if params["lane"] is not None else ""
        where += f" AND {self._pin_sql()}" if pin is not None else ""
        first = conn.execute(
            _text(f"SELECT isolate_n FROM batching_items WHERE {where} ORDER BY isolate_n LIMIT 1"),
            params,
        ).scalar()
        params["suspects"] = first is not None
        if params["isolate"]:
            params["n"] = min(params["n"], int(first or 0))
        return True

    def _pin_sql(self) -> str:
        """A pinned claim's filter (binds: :func:`_pin_binds`): the items whose stored key
        bucket and tenant the route sends to the pinned version. An item without a bucket
        (written by something other than ``enqueue``) is left to a scorer that is not pinned."""
        if self.dialect == "postgresql":
            listed = "tenant IN (SELECT jsonb_array_elements_text(CAST(:pin_tenants AS jsonb)))"
        else:
            listed = "tenant IN (SELECT value FROM json_each(:pin_tenants))"
        candidate = f"route_bucket < :pin_cut AND (:pin_any_tenant = 1 OR {listed})"
        return (
            f"((:pin_want = 1 AND {candidate}) OR (:pin_want = 2 AND route_bucket IS NOT NULL"
            f" AND NOT ({candidate})))"
        )

    def _expire_overdue(self, conn: Connection, now: float) -> tuple[tuple[str, int], ...]:
        """Move this queue's ready items past their deadline to ``expired``; returns how many
        by tenant, ``(tenant, n)`` sorted by tenant (empty when none did).

        PostgreSQL counts them in the statement (``UPDATE ... RETURNING tenant`` grouped in a
        CTE: one row per tenant). SQLite, where this transaction holds the only write lock,
        counts them first (one row per tenant) and updates only when there are any: a claim
        with nothing overdue reads the expiry index once, as before, and never steps a row
        a time under the lock.
        """
        overdue = sa.and_(
            _T.c.queue == self.queue,
            _T.c.state == sa.literal_column("0"),
            _T.c.deadline_at.is_not(None),
            _T.c.deadline_at < now,
        )
        update = (
            sa.update(_T)
            .where(overdue)
            .values(
                state=int(models.State.EXPIRED),
                finished_at=now,
                last_error="deadline passed before scoring",
            )
        )
        if self.dialect == "postgresql":
            done = update.returning(_T.c.tenant).cte("expired")
            count: sa.Select[Any] = sa.select(done.c.tenant, sa.func.count()).group_by(
                done.c.tenant
            )
        else:
            count = sa.select(_T.c.tenant, sa.func.count()).where(overdue).group_by(_T.c.tenant)
        by_tenant = tuple(sorted((str(t), int(n)) for t, n in conn.execute(count)))
        if not by_tenant:
            return ()
        if self.dialect != "postgresql":
            conn.execute(update)
        self._notify_final(conn)
        n = sum(k for _, k in by_tenant)
        logger.warning(
            "%d item(s) of queue %r expired: deadline passed before scoring",
            n,
            self.queue,
            extra={"action": "expire", "queue": self.queue, "n_items": n},
        )
        return by_tenant

    def expire_overdue(self) -> int:
        """Move ready items whose deadline has passed to ``expired``; returns how many."""
        with self.begin() as conn:
            return sum(n for _, n in self._expire_overdue(conn, self.clock()))

    # -- lease writes (all compare-and-set on the lease) -------------------------------------

    def _leased(self, lease_id: str, ids: Sequence[int] | None = None) -> sa.ColumnElement[bool]:
        cond = sa.and_(_T.c.lease_id == lease_id, _T.c.state == sa.literal_column("1"))
        if ids is not None:
            cond = sa.and_(cond, self._id_in(ids))
        return cond

    def _id_in(
        self, ids: Sequence[int], column: sa.ColumnElement[int] = _T.c.id
    ) -> sa.ColumnElement[bool]:
        """``column`` is one of ``ids`` (:func:`_in_list`)."""
        return _in_list(column, self.dialect, _listed(self.dialect, ids))

    def _ack_ids(self, ids: Sequence[int], *, ranged: bool) -> tuple[sa.Update, dict[str, Any]]:
        """The ack's UPDATE for ``ids`` (:func:`_ack_sql`) and their binds: ``b_lo`` and
        ``b_hi`` for one run of ids (:func:`_is_run`), else ``b_ids`` (a PostgreSQL array, a
        JSON array on SQLite)."""
        run = _is_run(ids)
        mark = _ack_sql(self.dialect, ranged=ranged, run=run)
        if run:
            return mark, {"b_lo": min(ids), "b_hi": max(ids)}
        return mark, {"b_ids": _listed(self.dialect, ids)}

    def _ids(self, ids: Sequence[int]) -> sa.ColumnElement[bool]:
        """``id`` is one of ``ids``: ``BETWEEN`` when they are one run (a batch cut from a
        range lease mostly is: 0.45 us a row less than the JSON list on SQLite), else
        :meth:`_id_in`."""
        if _is_run(ids):
            return _T.c.id.between(min(ids), max(ids))
        return self._id_in(ids)

    @database.reconnecting
    def heartbeat(self, lease_id: str, lease_s: float) -> int:
        """Extend the lease; returns rows extended (0: the lease was lost, stop and write nothing).

        Raises:
            QueueError: SQLite: the database file is gone from its path (deleted or moved
                under this process's connections, which would go on claiming and acking in
                a file nobody reads, beside outputs no ledger there records).
        """
        database.require_file_still_there(self.engine)
        expires = self.clock() + lease_s
        with self.begin() as conn:  # the ranges first, as every verb locks them
            ranged = conn.execute(
                sa.update(_R)
                .where(_R.c.lease_id == lease_id)
                .values(lease_expires_at=expires)
                .returning(_R.c.remaining)
            ).all()
            stmt = sa.update(_T).where(self._leased(lease_id)).values(lease_expires_at=expires)
            return int(conn.execute(stmt).rowcount) + sum(int(r[0]) for r in ranged)

    def ack(
        self,
        lease_id: str,
        ids: Sequence[int],
        *,
        conn: Connection | None = None,
        batch_id: str | None = None,
    ) -> int:
        """Mark items done if this lease still holds them; returns rows changed.

        Pass ``conn`` to ack inside the caller's transaction (outputs and ack commit together).
        PostgreSQL: ``NOTIFY`` on ``watch.DONE_CHANNEL`` (payload: the queue) in the same
        transaction, so a long-polling reader (``watch.CommitWatch``) wakes when it commits.
        """
        if not ids:
            return 0
        if conn is not None:
            return self._ack(conn, lease_id, ids, batch_id)
        with self.begin() as c:
            return self._ack(c, lease_id, ids, batch_id)

    def _ack(
        self, conn: Connection, lease_id: str, ids: Sequence[int], batch_id: str | None
    ) -> int:
        """Items of a range lease go from ready to done (the attempt counted here), the
        range's ``remaining`` goes down by as many and the range is deleted at zero; the
        rest by their per-item lease."""
        binds = {"b_finished": self.clock(), "b_batch": batch_id, "b_lease": lease_id}
        n, rest = 0, ids
        for range_id, lo, hi in self._lease_ranges(conn, lease_id):
            mine = [i for i in rest if lo <= i <= hi]
            if not mine:
                continue
            rest = [i for i in rest if not lo <= i <= hi]
            mark, listed = self._ack_ids(mine, ranged=True)
            k = int(conn.execute(mark, binds | listed).rowcount)
            n += k
            conn.execute(_RANGE_ACKED, {"b_range": range_id, "b_k": k})
            conn.execute(_RANGE_DONE, {"b_range": range_id})
        if rest:
            mark, listed = self._ack_ids(rest, ranged=False)
            n += int(conn.execute(mark, binds | listed).rowcount)
        if n:
            self._notify_final(conn)
        return n

    def _notify_final(self, conn: Connection) -> None:
        """PostgreSQL: ``NOTIFY`` on ``watch.DONE_CHANNEL`` in ``conn``'s transaction (sent
        when, and only if, it commits): items of this queue reached a final state (done,
        dead, expired), so a long-polling reader (``watch.CommitWatch``) wakes to read them."""
        if self.dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_notify(watch.DONE_CHANNEL, self.queue)))

    def ack_all_or_raise(
        self, conn: Connection, lease_id: str, ids: Sequence[int], batch_id: str
    ) -> None:
        """Ack ``ids`` in ``conn``'s transaction, or raise ``LeaseLost`` if any is no longer held."""
        n = self.ack(lease_id, ids, conn=conn, batch_id=batch_id)
        if n != len(ids):
            raise errors.LeaseLost(
                f"lease {lease_id} holds {n} of {len(ids)} items; batch {batch_id} not committed"
            )

    def held_leases(self, conn: Connection, lease_ids: Collection[str]) -> set[str]:
        """Those of ``lease_ids`` that still hold at least one leased item (a commit may follow)."""
        if not lease_ids:
            return set()
        q = sa.select(_T.c.lease_id).where(
            _T.c.state == int(models.State.LEASED), _T.c.lease_id.in_(list(lease_ids))
        )
        ranged = sa.select(_R.c.lease_id).where(_R.c.lease_id.in_(list(lease_ids)))
        return {str(r[0]) for r in conn.execute(sa.union(q, ranged))}

    def rebatch(
        self, conn: Connection, old_batch_id: str, new_batch_id: str, keys: Sequence[str]
    ) -> int:
        """Point the done items of ``keys`` committed in ``old_batch_id`` at ``new_batch_id``
        (a rewrite of the batch), in ``conn``'s transaction; returns rows changed."""
        if not keys:
            return 0
        stmt = (
            _T.update()
            .where(_T.c.batch_id == old_batch_id, _T.c.item_key.in_(list(keys)))
            .values(batch_id=new_batch_id)
        )
        return int(conn.execute(stmt).rowcount)

    @database.reconnecting
    def fail(
        self,
        lease_id: str,
        failures: Mapping[int, str],
        *,
        retry: bool = True,
        model_version: str | None = None,
    ) -> models.FailResult:
        """Fail items held by this lease: retry after backoff with jitter, or dead-letter.

        An item goes to ``dead`` (keeping the error) when ``retry`` is false or its attempts
        reached max attempts; otherwise back to ``ready`` with ``run_after`` pushed out.
        ``model_version``: the version whose forward pass failed them (a rollout's error
        rate; ``batching.ingress.rollout``), recorded on each.
        """
        if not failures:
            return models.FailResult(0, 0)
        now = self.clock()
        retried = dead = 0
        with self.begin() as conn:
            self._demote(conn, _R.c.lease_id == lease_id)
            rows = conn.execute(
                sa.select(_T.c.id, _T.c.attempts, _T.c.max_attempts).where(
                    self._leased(lease_id, list(failures))
                )
            ).all()
            for row in rows:
                is_dead = not retry or row.attempts >= row.max_attempts
                values: dict[str, Any] = {
                    "lease_id": None,
                    "lease_expires_at": None,
                    "leased_by": None,
                    "last_error": failures[row.id][:2000],
                }
                if model_version is not None:
                    values["model_version"] = model_version
                if is_dead:
                    values |= {"state": int(models.State.DEAD), "finished_at": now}
                else:
                    delay = backoff_s(
                        row.attempts, self.backoff_base_s, self.backoff_max_s, self._rng
                    )
                    values |= {"state": int(models.State.READY), "run_after": now + delay}
                n = conn.execute(
                    sa.update(_T).where(self._leased(lease_id, [row.id])).values(**values)
                ).rowcount
                dead += n if is_dead else 0
                retried += 0 if is_dead else n
            if dead:
                self._notify_final(conn)
        logger.info(
            "items failed",
            extra={"action": "fail", "queue": self.queue, "n_retried": retried, "n_dead": dead},
        )
        return models.FailResult(retried=retried, dead=dead)

    @database.reconnecting
    def release(self, lease_id: str, ids: Sequence[int] | None = None) -> int:
        """Give items back to ``ready`` without using up an attempt (clean shutdown).
        PostgreSQL: a ``NOTIFY`` with them, so an idle scorer takes them at once."""
        with self.begin() as conn:
            held = _R.c.lease_id == lease_id
            if ids is None:  # a range's items are ready already, its attempt not counted
                gone = conn.execute(sa.delete(_R).where(held).returning(_R.c.remaining)).all()
                n = sum(int(r[0]) for r in gone)
            else:
                n = 0
                self._demote(conn, held)
            stmt = (
                sa.update(_T)
                .where(self._leased(lease_id, ids))
                .values(
                    state=int(models.State.READY),
                    attempts=_T.c.attempts - 1,
                    lease_id=None,
                    lease_expires_at=None,
                    leased_by=None,
                    run_after=self.clock(),
                )
            )
            n += int(conn.execute(stmt).rowcount)
            if n and self.dialect == "postgresql":
                conn.execute(sa.select(sa.func.pg_notify(NOTIFY_CHANNEL, self.queue)))
            return n

    @database.reconnecting
    def release_expired(self, limit: int = 5000, *, this_queue: bool = False) -> models.ReapResult:
        """The reaper: return items whose lease expired to ``ready`` (or ``dead`` past max
        attempts), every one of them, ``limit`` per transaction.

        Every queue in the table (``reconcile --repair``), or this one; each claim also reaps
        its own queue's expired leases first. One conditional statement per outcome; each
        re-checks ``lease_expires_at < now`` so a lease renewed or acked meanwhile is never
        clobbered.
        """
        released = dead = 0
        while True:  # ``limit`` items a transaction, until none is left
            with self.begin() as conn:
                done = self._release_expired(conn, self.clock(), limit, this_queue=this_queue)
            released, dead = released + done.released, dead + done.dead
            if done.released + done.dead < limit:
                return models.ReapResult(released=released, dead=dead)

    def _release_expired(
        self, conn: Connection, now: float, limit: int, *, this_queue: bool
    ) -> models.ReapResult:
        lapsed = _R.c.lease_expires_at < now
        mine = sa.and_(lapsed, _R.c.queue == self.queue) if this_queue else lapsed
        self._demote(conn, mine, skip_locked=True)
        expired = self._expired(conn, now, limit, this_queue=this_queue)
        released = dead = suspects = 0
        for verdict in crashes.judge(expired):
            base = sa.and_(
                self._id_in(verdict.ids),
                _T.c.state == sa.literal_column("1"),
                _T.c.lease_expires_at < now,
            )
            common = {
                "lease_id": None,
                "lease_expires_at": None,
                "leased_by": None,
                "crash_count": _T.c.crash_count + 1,
                "isolate_n": verdict.isolate_n,
                "last_error": verdict.reason,
            }
            if verdict.charged:
                dead += conn.execute(
                    sa.update(_T)
                    .where(base, _T.c.attempts >= _T.c.max_attempts)
                    .values(
                        state=int(models.State.DEAD),
                        finished_at=now,
                        **(common | {"last_error": crashes.KILLER}),
                    )
                ).rowcount
            else:  # not charged: the claim's attempt is given back
                common["attempts"] = _T.c.attempts - 1
            n = conn.execute(
                sa.update(_T)
                .where(base)
                .values(state=int(models.State.READY), run_after=now, **common)
            ).rowcount
            released += n
            suspects += 0 if verdict.charged else n
        if dead:  # the killer found (this queue's, in a claim; the CLI reaper's: any)
            self._notify_final(conn)
        if released or dead:
            logger.warning(
                "expired leases released",
                extra={
                    "action": "release_expired",
                    "queue": self.queue if this_queue else None,
                    "n_released": released,
                    "n_suspects": suspects,
                    "n_dead": dead,
                },
            )
        return models.ReapResult(released=released, dead=dead)

    def _expired(
        self, conn: Connection, now: float, limit: int, *, this_queue: bool
    ) -> list[crashes.Expired]:
        q = (
            sa.select(_T.c.id, _T.c.lease_id, _T.c.isolate_n)
            .where(_T.c.state == sa.literal_column("1"), _T.c.lease_expires_at < now)
            .order_by(_T.c.lease_expires_at)
            .limit(limit)
        )
        if this_queue:
            q = q.where(_T.c.queue == self.queue)
        if self.dialect == "postgresql":
            q = q.with_for_update(skip_locked=True, key_share=True)
        return [crashes.Expired(r[0], str(r[1]), int(r[2])) for r in conn.execute(q)]

    def lease_held(self, conn: Connection, lease_id: str, ids: Sequence[int]) -> bool:
        """True when this lease still holds every one of ``ids`` (checked in ``conn``'s txn)."""
        n, rest = 0, list(ids)
        for _, lo, hi in self._lease_ranges(conn, lease_id):
            mine = [i for i in rest if lo <= i <= hi]
            if mine:
                rest = [i for i in rest if not lo <= i <= hi]
                ready = sa.and_(self._ids(mine), _STILL_READY)
                count = sa.select(sa.func.count()).select_from(_T).where(ready)
                n += conn.execute(count).scalar_one()
        if rest:
            held = self._leased(lease_id, rest)
            n += conn.execute(sa.select(sa.func.count()).select_from(_T).where(held)).scalar_one()
        return int(n) == len(ids)

    # -- operations --------------------------------------------------------------------------

    @database.reconnecting
    def stats(self, *, all_queues: bool = False, done: bool = True) -> models.QueueStats:
        """Counts by state, oldest ready age and expired leases, per (queue, lane, tenant).

        Each state is counted through its own partial index, in one snapshot, so the cost
        follows the items still live (ready, leased, dead, expired, cancelled). ``done``: the
        done items too, which reads every one of them (one scan of the table, ~1 s a million
        rows on SQLite here); without it their counts are None and ``by_state`` has no
        ``done``: what a metrics scrape, a flow's precondition or a note after a run asks.
        """
        now = self.clock()
        parts = (*_LIVE_PARTS, _DONE_PART) if done else _LIVE_PARTS
        merged: dict[tuple[str, str, str], models.LaneStats] = {}
        with self.read() as conn:
            held = schema.held_by_ranges(conn)
            lapsed = None if held is None else schema.held_by_ranges(conn, lapsed_at=now)
            q = self._stats_query(now, held, lapsed)
            if not all_queues:
                q = q.where(_T.c.queue == self.queue)
            for part in parts:
                for r in conn.execute(q.where(part)):
                    g = _lane_stats(r, now, done)
                    key = (g.queue, g.lane, g.tenant)
                    merged[key] = g if key not in merged else models.LaneStats.merge(merged[key], g)
        return models.QueueStats.of(tuple(merged[k] for k in sorted(merged)), done=done)

    def _stats_query(
        self,
        now: float,
        held: sa.ColumnElement[bool] | None,
        lapsed: sa.ColumnElement[bool] | None,
    ) -> sa.Select[Any]:
        """Counts by state per (queue, lane, tenant); the ready items of a range lease
        (``held``; ``lapsed``: of one expired) count as leased, as they are."""
        state: sa.ColumnElement[Any] = _T.c.state
        leased, ready = _T.c.state == 1, _T.c.state == 0
        stale = sa.and_(leased, _T.c.lease_expires_at < now)
        if held is not None:
            state = sa.case((sa.and_(ready, held), 1), else_=_T.c.state)
            stale = stale if lapsed is None else sa.or_(stale, sa.and_(ready, lapsed))
            ready = sa.and_(ready, sa.not_(held))
        return sa.select(
            _T.c.queue,
            _T.c.lane,
            _T.c.tenant,
            *[
                sa.func.sum(sa.case((state == s.value, 1), else_=0)).label(s.name.lower())
                for s in models.State
            ],
            sa.func.sum(sa.case((stale, 1), else_=0)).label("xl"),
            sa.func.min(sa.case((ready, _T.c.enqueued_at))).label("oldest"),
            sa.func.sum(sa.case((sa.and_(ready, _T.c.run_after > now), 1), else_=0)).label(
                "backoff"
            ),
        ).group_by(_T.c.queue, _T.c.lane, _T.c.tenant)

    @database.reconnecting
    def queue_names(self) -> list[str]:
        """Every queue that has an item, in order: one seek per queue on the key index (queue,
        item_key), not a read of every row."""
        names: list[str] = []
        first = sa.select(sa.func.min(_T.c.queue))
        with self.read() as conn:
            name = conn.execute(first).scalar()
            while name is not None:
                names.append(str(name))
                name = conn.execute(first.where(_T.c.queue > name)).scalar()
        return names

    @database.reconnecting
    def done_counts(self, *, all_queues: bool = True) -> dict[tuple[str, str, str], int]:
        """Done items by (queue, lane, tenant), every queue's (``all_queues``) or this one's:
        what ``stats(done=True)`` adds to the live counts, and as costly (a read of every
        done item)."""
        q = sa.select(_T.c.queue, _T.c.lane, _T.c.tenant, sa.func.count()).where(_DONE_PART)
        if not all_queues:
            q = q.where(_T.c.queue == self.queue)
        with self.read() as conn:
            rows = conn.execute(q.group_by(_T.c.queue, _T.c.lane, _T.c.tenant)).all()
        return {(r[0], r[1], r[2]): int(r[3]) for r in rows}

    def redrive(
        self,
        states: Sequence[models.State] = (models.State.DEAD, models.State.EXPIRED),
        *,
        tenant: str | None = None,
        enqueue_run: str | None = None,
        actor: str | None = None,
        reason: str | None = None,
    ) -> int:
        """Move dead and/or expired (or, when asked, cancelled) items back to ready with fresh
        attempts (deadline cleared); only ``tenant``'s, or those of ``enqueue_run``, when
        given (a cancel taken back is one cancel's, not every cancel the queue holds). With
        ``actor``, recorded in the queue's audit in the same transaction."""
        codes = [int(s) for s in states]
        where = [_T.c.queue == self.queue, _T.c.state.in_(codes)]
        if tenant is not None:
            where.append(_T.c.tenant == tenant)
        if enqueue_run is not None:
            where.append(_T.c.enqueue_run == enqueue_run)
        with self.begin() as conn:
            schema.require_current_to_write(conn)
            stmt = (
                sa.update(_T)
                .where(*where)
                .values(
                    state=int(models.State.READY),
                    attempts=0,
                    crash_count=0,
                    run_after=self.clock(),
                    deadline_at=None,
                    sort_deadline=schema.NO_DEADLINE,
                    finished_at=None,
                )
            )
            n = conn.execute(stmt).rowcount
            if actor is not None:
                detail = {
                    "redriven": n,
                    "states": [s.name.lower() for s in states],
                    "tenant": tenant,
                    "enqueue_run": enqueue_run,
                }
                now = self.clock()
                controls.record(
                    conn, self.queue, "redrive", actor, now, reason, detail, changed=n > 0
                )
        logger.info("items redriven", extra={"action": "redrive", "n_items": n})
        return n

    def purge(
        self,
        older_than_s: float,
        *,
        archive: bool = False,
        actor: str | None = None,
        reason: str | None = None,
    ) -> int:
        """Delete (or move to ``batching_items_archive``) done and cancelled items finished
        before now - age; with ``actor``, the purge is recorded in the queue's audit."""
        cutoff = self.clock() - older_than_s
        n = 0
        for code in ("2", "5"):  # done, cancelled: each literal matches its partial index
            cond = sa.and_(
                _T.c.queue == self.queue,
                _T.c.state == sa.literal_column(code),
                _T.c.finished_at < cutoff,
            )
            more = True
            while more:  # a transaction per chunk: no long write lock, no list of every id
                with self.begin() as conn:
                    schema.require_current_to_write(conn)  # archives by this schema's columns
                    # The rows first, locked (PostgreSQL): a reconcile requeueing one of them
                    # between the statements below would leave a ready item without its payload.
                    # Not inside a range lease still held: SQLite gives the highest ids out
                    # again, and a new item must not be born inside a range.
                    held = schema.held_by_ranges(conn, queue=self.queue)
                    where = cond if held is None else sa.and_(cond, sa.not_(held))
                    ids = list(
                        conn.execute(
                            sa.select(_T.c.id).where(where).limit(_PURGE_CHUNK).with_for_update()
                        ).scalars()
                    )
                    more = len(ids) == _PURGE_CHUNK
                    if ids:
                        n += self._purge_rows(conn, ids, archive=archive)
        if actor is not None:
            detail = {"purged": n, "older_than_s": older_than_s, "archived": archive}
            with self.begin() as conn:
                now = self.clock()
                controls.record(
                    conn, self.queue, "purge", actor, now, reason, detail, changed=n > 0
                )
        logger.info("items purged", extra={"action": "purge", "n_items": n, "archived": archive})
        return n

    def purge_ledger(
        self, older_than_s: float, *, actor: str | None = None, reason: str | None = None
    ) -> tuple[int, float | None]:
        """Delete the batch ledger's rows of this queue committed before the UTC midnight at
        or before now - age (the horizon) that nothing needs: ``published``, no item row
        pointing at them (purge those first) and no outbox row; returns (rows deleted, the
        queue's horizon now: None while no row was ever purged). The horizon is recorded in the queue's controls, in the transaction that
        deletes the first row, and never moves back (``batching.store.retention`` says what
        readers make of it). Pages by ``(committed_at, batch_id)``: a row kept is read once."""
        horizon = retention.midnight(self.clock() - older_than_s)
        b, now = schema.batches, self.clock()
        unneeded = sa.and_(
            b.c.state == models.BatchState.PUBLISHED.value,
            ~sa.exists().where(_T.c.batch_id == b.c.batch_id),
            ~sa.exists().where(schema.outbox.c.batch_id == b.c.batch_id),
        )
        page = sa.select(b.c.committed_at, b.c.batch_id).where(
            b.c.queue == self.queue, b.c.committed_at < horizon
        )
        after: tuple[float, str] | None = None
        n, recorded = 0, False
        while True:
            with self.begin() as conn:
                schema.require_current_to_write(conn)
                retention.hold(conn, self.queue)  # a repair re-pointing items takes turns
                q = page
                if after is not None:
                    q = q.where(sa.tuple_(b.c.committed_at, b.c.batch_id) > sa.tuple_(*after))
                rows = conn.execute(
                    q.order_by(b.c.committed_at, b.c.batch_id).limit(_LEDGER_PAGE)
                ).all()
                if rows:
                    ids = [r.batch_id for r in rows]
                    gone = int(
                        conn.execute(sa.delete(b).where(b.c.batch_id.in_(ids), unneeded)).rowcount
                    )
                    if gone and not recorded:  # with the first rows gone: never one without
                        self._raise_horizon(conn, horizon, now)
                        recorded = True
                    n += gone
                    after = (rows[-1].committed_at, rows[-1].batch_id)
            if len(rows) < _LEDGER_PAGE:
                break
        if actor is not None:
            detail = {"ledger_rows": n, "horizon": retention.day(horizon)}
            with self.begin() as conn:
                now = self.clock()
                controls.record(
                    conn, self.queue, "purge", actor, now, reason, detail, changed=n > 0
                )
        logger.info(
            "ledger rows purged",
            extra={"action": "purge_ledger", "n_batches": n, "horizon": retention.day(horizon)},
        )
        with self.read() as conn:
            return n, retention.horizon(conn, self.queue)

    def _raise_horizon(self, conn: Connection, horizon: float, now: float) -> None:
        controls.locked_row(conn, self.queue, now)
        before = retention.horizon(conn, self.queue)
        if before is None or before < horizon:
            controls.update_row(conn, self.queue, {"ledger_horizon": horizon}, now)

    def _purge_rows(self, conn: Connection, ids: list[int], *, archive: bool) -> int:
        """Archive (if asked), then delete these items and their payloads; returns how many."""
        if archive:
            cols = [c.name for c in schema.items_archive.columns if c.name != "archive_id"]
            source = sa.select(*(_P.c.payload if c == "payload" else _T.c[c] for c in cols))
            source = source.join_from(_T, _P, _P.c.id == _T.c.id).where(self._id_in(ids))
            conn.execute(schema.items_archive.insert().from_select(cols, source))
        conn.execute(sa.delete(_P).where(self._id_in(ids, _P.c.id)))
        return int(conn.execute(sa.delete(_T).where(self._id_in(ids))).rowcount)

    def committed_items(self, ids: Sequence[int]) -> dict[int, models.WorkItem]:
        """The done items of ``ids`` still in the queue (with their payloads), by id, as a
        claim would hand them to the runner: what ``batching replay`` scores again. An id
        purged since (or never done) is absent."""
        found: dict[int, models.WorkItem] = {}
        with self.read() as conn:
            for start in range(0, len(ids), 5000):
                chunk = ids[start : start + 5000]
                stmt = (
                    sa.select(*(_T.c[c] for c in _CLAIM_COLUMNS))
                    .where(_T.c.queue == self.queue, _T.c.state == int(models.State.DONE))
                    .where(self._id_in(chunk))
                )
                rows = list(conn.execute(stmt))
                bodies = self._bodies(conn, [r[0] for r in rows])
                found.update((i.id, i) for i in _items([r for r in rows if r[0] in bodies], bodies))
        return found

    @database.reconnecting
    def expire(self, lease_id: str, reasons: Mapping[int, str]) -> int:
        """Move items this lease holds to ``expired`` unscored (``late_policy: expire``: each
        predicted to miss its deadline), keeping each one's reason; returns items changed.
        Compare-and-set on the lease, like the other lease writes: an item no longer held
        is left alone."""
        if not reasons:
            return 0
        now = self.clock()
        n = 0
        with self.begin() as conn:
            self._demote(conn, _R.c.lease_id == lease_id)
            for item_id, reason in reasons.items():
                n += conn.execute(
                    sa.update(_T)
                    .where(self._leased(lease_id, [item_id]))
                    .values(
                        state=int(models.State.EXPIRED),
                        finished_at=now,
                        last_error=reason[:2000],
                        lease_id=None,
                        lease_expires_at=None,
                        leased_by=None,
                    )
                ).rowcount
            if n:
                self._notify_final(conn)
        if n:
            logger.warning(
                "%d item(s) of queue %r expired: predicted to miss their deadline",
                n,
                self.queue,
                extra={"action": "expire", "queue": self.queue, "n_items": n},
            )
        return n


def _claimed_times(
    conn: Connection, row: Sequence[Any], params: dict[str, Any], reads: sqlite_claim.Reads
) -> Any:
    """A SQLite claim's ``CLAIMED_TIMES`` row, read only when its items need it (most share
    one enqueue time and have no deadline: no second read)."""
    if not sqlite_claim.needs_times(row):
        return None
    return conn.execute(reads.times, params).one()


def _not_in_ranges(excluded: int) -> str:
    """A claim's filter leaving out the ids of ``excluded`` range leases (binds from
    ``SqlQueue._exclude_ranges``): on the ready index's own ``id``, so SQLite tests it
    before it reads a row."""
    return "".join(f" AND id NOT BETWEEN :xlo{k} AND :xhi{k}" for k in range(excluded))


_FORMATS = {f.value: f for f in models.PayloadFormat}
# Named tuples built by tuple.__new__ itself: no Python-level __new__ call per row.
_new_item = functools.partial(tuple.__new__, models.WorkItem)
_new_payload = functools.partial(tuple.__new__, models.Payload)


def _pin_binds(pin: routing.Pin, route_json: str | None) -> dict[str, Any]:
    """The binds of :meth:`SqlQueue._pin_sql` for ``pin`` under the route a claim read:
    ``pin_want`` 1 takes the candidate's items, 2 the stable version's, 0 nothing."""
    route = routing.Route.from_json(route_json) if route_json else routing.Route(pin.default)
    want = 0
    if pin.version == route.candidate:
        want = 1
    elif pin.version == route.stable:
        want = 2
    cut = route.percent * 100 if route.candidate is not None else 0.0
    return {
        "pin_want": want,
        "pin_cut": cut,
        "pin_any_tenant": 0 if route.tenants else 1,
        "pin_tenants": json.dumps(list(route.tenants)),
    }


def _items(rows: list[Any], bodies: Mapping[int, bytes]) -> tuple[models.WorkItem, ...]:
    """Claimed rows (``_CLAIM_COLUMNS`` order) as work items, a column at a time.

    The hot path of every claim: ``map`` and ``zip`` over columns run in C, where a function
    call per row (unpack, build a payload, build an item) held the GIL 2.4 us a row, the
    largest single share of a W1 run's GIL time (py-spy --gil).
    """
    if not rows:
        return ()
    ids, keys, fmts, dtypes, shapes, *rest = zip(*rows, strict=True)
    enqueued, queues, lanes, tenants, prios, costs, deadlines, atts, maxes, _ = rest
    payloads = map(
        _new_payload,
        zip(
            map(bodies.__getitem__, ids),
            map(_FORMATS.__getitem__, fmts),
            dtypes,
            map(_shape, shapes),
            strict=True,
        ),
    )
    fields = (keys, payloads, enqueued, queues, lanes, tenants, prios, costs, deadlines, atts)
    return tuple(map(_new_item, zip(ids, *fields, maxes, strict=True)))


@functools.lru_cache(maxsize=256)
def _shape(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(v) for v in json.loads(text)) if text else None


def _state_in(*codes: int) -> sa.ColumnElement[bool]:
    """``state`` is one of ``codes``, written as literals: SQLite uses a partial index only
    where the query's terms match its WHERE clause as written, and a bound value never does."""
    listed: list[sa.ColumnElement[Any]] = [sa.literal_column(str(c)) for c in codes]
    return _T.c.state == listed[0] if len(listed) == 1 else _T.c.state.in_(listed)


# ``stats`` counts a state at a time, each through its partial index (ready; leased; dead
# and expired; cancelled), so what it reads is the live items; done items, the bulk of an
# old queue, only when asked (6.4M of them: 6.2 s a count on SQLite, as one query did always).
_LIVE_PARTS = (_state_in(0), _state_in(1), _state_in(3, 4), _state_in(5))
_DONE_PART = _state_in(2)


def _lane_stats(r: Any, now: float, done: bool = True) -> models.LaneStats:
    return models.LaneStats(
        queue=r.queue,
        lane=r.lane,
        tenant=r.tenant,
        ready=int(r.ready or 0),
        leased=int(r.leased or 0),
        done=int(r.done or 0) if done else None,
        dead=int(r.dead or 0),
        expired=int(r.expired or 0),
        cancelled=int(r.cancelled or 0),
        expired_leases=int(r.xl or 0),
        oldest_ready_age_s=(now - float(r.oldest)) if r.oldest is not None else None,
        backoff=int(r.backoff or 0),
    )


class Waiter:
    """Waits for new work: PostgreSQL ``LISTEN``; SQLite ``PRAGMA data_version`` read every
    ``check_s`` (:class:`~batching.ingress.watch.SqliteChanges`), and on a change a look for
    a ready item of this queue. The timeout (``poll_s``) is the backstop on both.

    ``wait(timeout_s)`` returns True when new work may be there (a notification, a commit
    that left a ready item), False on timeout; callers claim either way.
    """

    def __init__(self, engine: Engine, queue: str, *, check_s: float = watch.CHECK_S) -> None:
        self._engine = engine
        self._queue = queue
        self._check_s = check_s
        self._conn: Any = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        # Opened now, before the first claim: a commit between that claim and the first
        # wait is seen.
        self._changes = watch.SqliteChanges(engine) if engine.dialect.name == "sqlite" else None
        self._failing = False

    def wait(self, timeout_s: float) -> bool:
        if self._changes is not None:
            return self._wait_sqlite(self._changes, timeout_s)
        import psycopg

        try:
            conn = self._listen()
            for note in conn.notifies(timeout=timeout_s, stop_after=1):
                return bool(note.payload == self._queue)
        except psycopg.Error as exc:  # the listening connection died: poll, listen again later
            logger.warning(
                "database connection lost while listening; polling, reconnecting next time",
                extra={"action": "reconnect", "error": str(exc).strip()[:200]},
            )
            self.close(stopping=False)
            self._stopped.wait(timeout_s)
        return False

    def _wait_sqlite(self, changes: watch.SqliteChanges, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if changes.changed() and changes.any_ready(self._queue):
                    self._failing = False
                    return True
                self._failing = False
            except sqlite3.Error as exc:  # reopened next time; poll meanwhile
                if not self._failing:
                    logger.warning(
                        "cannot read the database's change counter; polling",
                        extra={"action": "reconnect", "error": str(exc).strip()[:200]},
                    )
                self._failing = True
                self._stopped.wait(max(0.0, deadline - time.monotonic()))
                return False
            left = deadline - time.monotonic()
            if left <= 0 or self._stopped.wait(min(self._check_s, left)):
                return False

    def _listen(self) -> Any:
        with self._lock:
            if self._conn is None:
                import psycopg

                url = self._engine.url.set(drivername="postgresql")
                dsn = url.render_as_string(hide_password=False)
                conn = psycopg.connect(dsn, autocommit=True)
                try:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                except BaseException:  # closed here, not left for the collector to find open
                    conn.close()
                    raise
                self._conn = conn
            return self._conn

    def close(self, *, stopping: bool = True) -> None:
        if stopping:
            self._stopped.set()
            if self._changes is not None:
                self._changes.close()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
