"""An item's state and its committed output row, read as a downstream reader would, through
the ledger: the item's ``batch_id`` names its ``batching_batches`` row (sink, location, model
version, state), and the row is read from there: a SQL results table by key, a Delta table by
key and batch, a Parquet file by key. A batch recorded but not yet rolled forward (the outbox
of a Delta or warehouse table, a Parquet file still in staging) is read from where it waits:
it is committed, so the client gets the row the output will hold.

Why it stays one module: every read here goes through the same item views and the same
per-batch cache of output rows, and the queue read beside them shares the engine and lock.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, Row

from batching import errors, models
from batching.ingress import queue as q
from batching.ingress.done_counts import DoneCounts, filled
from batching.ingress.watch import SqliteChanges
from batching.outputs import contract as sinks
from batching.outputs import outbox, registry
from batching.store import database, schema

logger = logging.getLogger(__name__)

API_DONE_EVERY_S = 10.0
"""How often the queue read (``GET /v1/queues/{queue}``) counts the queue's done items."""
_FIRST_COUNT_WAIT_S = 30.0
_monotonic = time.monotonic  # the first count's wait (a test's clock)
_T = schema.items
TERMINAL = frozenset(
    {models.State.DONE, models.State.DEAD, models.State.EXPIRED, models.State.CANCELLED}
)
"""States an item never leaves: a long poll ends there."""
_CHUNK = 500
_BATCH_CHUNK = 16
CACHED_BATCHES = 256
CACHED_BYTES = 64 * 1024 * 1024
"""Batches whose rows a ``Results`` keeps, at most (a client often reads a result twice: the
POST that waited, then a GET), and their rows' bytes at most (wide outputs: fewer batches)."""


@dataclass(frozen=True)
class ItemView:
    """What a client may see of one item (``result`` and ``model_version``: those of its
    committed output, once done)."""

    item_key: str
    id: int
    state: models.State
    tenant: str
    error: str | None = None
    batch_id: str | None = None
    result: Mapping[str, Any] | None = None
    model_version: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def doc(self) -> dict[str, Any]:
        """The item as the API answers it."""
        return {
            "item_key": self.item_key,
            "state": self.state.name.lower(),
            "result": None if self.result is None else dict(self.result),
            "error": self.error,
            "model_version": self.model_version,
        }


class Results:
    """Reads items and their outputs for the API.

    Args:
        engine: the queue's database.
        target: the config's outputs (``compose.build.output_target``).
        tenant_weights: each tenant's share of a queue's depth cap (``queue.tenant_weights``).
    """

    def __init__(
        self,
        engine: Engine,
        target: registry.Target,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        self.engine = engine
        self.target = target
        self.tenant_weights = dict(tenant_weights or {})
        self._warehouse: Engine | None = None
        self._changes: SqliteChanges | None = None
        self._lock = threading.Lock()
        self._bytes = 0  # of the rows kept in _batches
        self._batches: collections.OrderedDict[str, tuple[str, Mapping[str, dict[str, Any]]]] = (
            collections.OrderedDict()
        )
        self._done: dict[str, DoneCounts] = {}  # queue -> its done items, counted apart
        self._first_count_by: dict[str, float] = {}  # queue -> monotonic end of the first wait

    def queue(self, name: str) -> q.SqlQueue:
        return q.SqlQueue(self.engine, name, tenant_weights=self.tenant_weights)

    def item(self, queue: str, key: str) -> ItemView | None:
        """The item of ``key`` with its committed output row when done; None if unknown.

        Raises:
            QueueError: the database failed.
            SinkError: the output of a done item cannot be read.
        """
        with self.queue(queue).read() as conn:
            row = conn.execute(_VIEWS[False], {"b_queue": queue, "b_keys": [key]}).first()
            return None if row is None else self._with_results(conn, queue, [_view(row)])[0]

    def finished(self, queue: str, keys: Sequence[str]) -> dict[str, ItemView]:
        """The items of ``keys`` in a final state, with their committed output rows, by key
        (one read of the items, then one read of each batch's output for all its keys: what a
        long poll's wake-up costs, however many requests wait)."""
        if not keys:
            return {}
        with self.queue(queue).read() as conn:
            views = self._with_results(conn, queue, _views(conn, queue, keys, terminal=True))
        return {v.item_key: v for v in views}

    def acked(self) -> int | None:
        """A mark that changes when a batch is committed (SQLite: the ledger's last rowid,
        read on a connection of its own in microseconds), so a wake-up for a commit that
        finished nothing (an enqueue, a claim, a heartbeat) costs no read of the waiting
        items. None where the wake-up itself is an ack (PostgreSQL notifies on ack only)."""
        if self.engine.dialect.name != "sqlite":
            return None
        with self._lock:
            if self._changes is None:
                self._changes = SqliteChanges(self.engine)
        return self._changes.last_batch()

    def stats(self, queue: str, tenant: str) -> dict[str, Any]:
        """``batching status --json`` of ``queue`` for ``tenant``'s items only: by_state,
        oldest_ready_age_s, expired_leases, groups (by lane), backoff; and the queue's
        control: paused and max_depth (its depth counts every tenant's items).

        The live states are read now; ``done`` is the last count of the queue's done items,
        made in the background when a read finds it ``API_DONE_EVERY_S`` old
        (``done_counted_at``: when it started): that count reads every done item of the
        queue, seconds for millions, and a client polling its queue made one per request.
        Reads in the first ``_FIRST_COUNT_WAIT_S`` of the API's life wait for the first count
        to land; after that ``done`` is absent until one has."""
        from batching.ingress import controls

        q = self.queue(queue)
        with self._lock:
            done = self._done.get(queue)
            if done is None:
                done = self._done[queue] = DoneCounts(q, API_DONE_EVERY_S, all_queues=False)
                self._first_count_by[queue] = _monotonic() + _FIRST_COUNT_WAIT_S
            first_by = self._first_count_by[queue]
        live = q.stats(done=False)
        counts, counted_at = done.latest_at()
        if counts is None and done.wait(max(0.0, first_by - _monotonic())):
            counts, counted_at = done.latest_at()
        mine = tuple(g for g in filled(live, counts, set()).groups if g.tenant == tenant)
        held = controls.states(self.engine).get(queue, controls.QueueControl(queue))
        return dataclasses.asdict(models.QueueStats.of(mine, done=counts is not None)) | {
            "tenant": tenant,
            "done_counted_at": counted_at if counts is not None else None,
            "paused": held.paused,
            "max_depth": held.max_depth,
        }

    def close(self) -> None:
        if self._warehouse is not None:
            self._warehouse.dispose()
        if self._changes is not None:
            self._changes.close()

    def _with_results(
        self, conn: Connection, queue: str, views: Sequence[ItemView]
    ) -> list[ItemView]:
        """``views`` with the output rows of those done, each batch's read once."""
        by_batch: dict[str, list[str]] = {}
        for v in views:
            if v.state == models.State.DONE and v.batch_id is not None:
                by_batch.setdefault(v.batch_id, []).append(v.item_key)
        rows: dict[str, tuple[dict[str, Any] | None, str]] = {}

        def take(batch_id: str, version: str, found: Mapping[str, dict[str, Any]]) -> None:
            rows.update({k: (found.get(k), version) for k in by_batch[batch_id]})

        unread = []
        for batch_id, keys in by_batch.items():
            cached = self._cached(batch_id, keys)
            if cached is None:
                unread.append(batch_id)
            else:
                take(batch_id, *cached)
        for batch, body in _batches(conn, unread):  # a few at a time: their rows are let go
            keys = by_batch[batch.batch_id]
            found = self._read(conn, batch, body, keys, queue)
            take(batch.batch_id, *self._cache(batch.batch_id, str(batch.model_version), found))
        return [
            v
            if v.item_key not in rows
            else dataclasses.replace(
                v, result=rows[v.item_key][0], model_version=rows[v.item_key][1]
            )
            for v in views
        ]

    def _cached(
        self, batch_id: str, keys: Sequence[str]
    ) -> tuple[str, Mapping[str, dict[str, Any]]] | None:
        """A batch's rows read before, if they hold every key of ``keys``."""
        with self._lock:
            held = self._batches.get(batch_id)
            if held is None or not all(k in held[1] for k in keys):
                return None
            self._batches.move_to_end(batch_id)
            return held

    def _cache(
        self, batch_id: str, version: str, rows: Mapping[str, dict[str, Any]]
    ) -> tuple[str, Mapping[str, dict[str, Any]]]:
        """Keep a batch's rows (a committed batch's rows never change), the last
        ``CACHED_BATCHES`` batches read (``CACHED_BYTES`` of rows at most)."""
        with self._lock:
            held = self._batches.get(batch_id)
            partial = isinstance(rows, dict) and held is not None and isinstance(held[1], dict)
            merged = (version, {**held[1], **rows} if partial and held else rows)
            self._batches[batch_id] = merged
            self._batches.move_to_end(batch_id)
            self._bytes += _size(merged[1]) - (_size(held[1]) if held else 0)
            while len(self._batches) > 1 and (
                len(self._batches) > CACHED_BATCHES or self._bytes > CACHED_BYTES
            ):
                _, (_, gone) = self._batches.popitem(last=False)
                self._bytes -= _size(gone)
            return merged

    def _read(
        self, conn: Connection, batch: Row[Any], body: bytes | None, keys: list[str], queue: str
    ) -> Mapping[str, dict[str, Any]]:
        """The output rows of ``keys`` in ``batch`` (of every item, where the whole batch
        is read anyway), by key; a key without a row is absent."""
        version = str(batch.model_version)
        if body is not None:  # committed, not rolled forward yet: the rows it will write
            return _Rows(outbox.decode(body), version)
        kind = str(batch.sink)
        if kind == "sql":
            return self._sql_rows(conn, str(batch.path), queue, version, keys)
        if kind == "delta":
            return self._delta_rows(batch, keys)
        if kind == "parquet":
            return self._parquet_rows(batch)
        raise errors.SinkError(f"batch {batch.batch_id}: unknown sink {kind!r} in the ledger")

    def _sql_rows(
        self, conn: Connection, table_name: str, queue: str, version: str, keys: list[str]
    ) -> dict[str, dict[str, Any]]:
        table = (
            schema.results
            if table_name == schema.results.name
            else schema.results_table(table_name)
        )
        stmt = table.select().where(
            table.c.queue == queue,
            table.c.model_version == version,
            table.c.item_key.in_(keys),
        )
        if self.target.kind == "sql" and self.target.url is not None:
            with self._lock:  # requests read in the thread pool
                if self._warehouse is None:
                    self._warehouse = database.create_engine(self.target.url)
            url = self._warehouse.url.render_as_string(hide_password=True)
            with database.translate_errors(url), self._warehouse.connect() as other:
                found = other.execute(stmt).mappings().all()
        else:
            found = conn.execute(stmt).mappings().all()
        return {str(r["item_key"]): _json(dict(r)) for r in found}

    def _delta_rows(self, batch: Row[Any], keys: list[str]) -> Mapping[str, dict[str, Any]]:
        from batching.outputs import delta

        lit = delta.sql_literal
        listed = ", ".join(lit(k) for k in keys)
        sql = f"SELECT * FROM t WHERE batch_id = {lit(str(batch.batch_id))} AND item_key IN ({listed})"
        uri = str(batch.path or self.target.where)
        table = delta.DeltaSink.read(uri, sql, storage_options=self.target.storage_options)
        return _Rows(table, str(batch.model_version))

    def _parquet_rows(self, batch: Row[Any]) -> Mapping[str, dict[str, Any]]:
        import pyarrow.parquet as pq

        root = Path(self.target.where).resolve()
        final = (root / str(batch.path)).resolve()
        if root not in final.parents:
            raise errors.SinkError(f"batch {batch.batch_id}: ledger path outside the dataset")
        # The rename into the dataset may land between two looks: final, staging, final.
        staging = [Path(batch.staging_path)] if batch.staging_path else []
        looks = (final, *staging, final)
        for n, path in enumerate(looks, 1):
            try:
                with sinks.translate_errors(f"cannot read {path}"):
                    # one batch: small, read whole, on this thread and without a read-ahead
                    # buffer (a file of a few rows: half the CPU of the defaults)
                    table = pq.ParquetFile(path, pre_buffer=False).read(use_threads=False)
            except errors.SinkError:
                if n == len(looks) and path.exists():
                    raise
                continue
            return _Rows(table, str(batch.model_version))
        raise errors.SinkError(
            f"batch {batch.batch_id}: its file {final} is missing; run `batching reconcile`"
        )


def _select() -> sa.Select[Any]:
    """An item's row; one a range lease holds (ready in the table) reads as leased."""
    r = schema.ranges
    ranged = (
        sa.select(r.c.id)
        .where(r.c.queue == _T.c.queue, r.c.lo <= _T.c.id, r.c.hi >= _T.c.id)
        .exists()
    )
    held = sa.and_(_T.c.state == int(models.State.READY), ranged)
    state = sa.case((held, int(models.State.LEASED)), else_=_T.c.state).label("state")
    return sa.select(_T.c.id, _T.c.item_key, state, _T.c.tenant, _T.c.last_error, _T.c.batch_id)


# The items of keys ``b_keys`` in queue ``b_queue``, all (False) or final (True); built once:
# building the select and its cache key on every read (each POST, each commit) cost more.
_VIEWS = {
    final: _select().where(
        _T.c.queue == sa.bindparam("b_queue"),
        _T.c.item_key.in_(sa.bindparam("b_keys", expanding=True)),
        *([_T.c.state.in_([int(s) for s in TERMINAL])] if final else []),
    )
    for final in (False, True)
}


def _views(
    conn: Connection, queue: str, keys: Sequence[str], *, terminal: bool = False
) -> list[ItemView]:
    """The items of ``keys`` in ``queue`` (``terminal``: in a final state), in chunks."""
    found: list[ItemView] = []
    for start in range(0, len(keys), _CHUNK):
        binds = {"b_queue": queue, "b_keys": list(keys[start : start + _CHUNK])}
        found.extend(_view(r) for r in conn.execute(_VIEWS[terminal], binds))
    return found


def states(conn: Connection, queue: str, keys: Sequence[str]) -> dict[str, ItemView]:
    """The items of ``keys`` in ``queue`` that exist (no result read), by key."""
    return {v.item_key: v for v in _views(conn, queue, keys)}


def _view(row: Row[Any]) -> ItemView:
    return ItemView(
        str(row.item_key),
        int(row.id),
        models.State(row.state),
        str(row.tenant),
        row.last_error,
        row.batch_id,
    )


# The ledger rows of batches ``b_ids``, each with its outbox body (None: rolled forward, or a
# sink without one); built once, like ``_VIEWS``: a wake-up reads every batch it needs in one.
_BATCHES = (
    sa.select(schema.batches, schema.outbox.c.body.label("outbox_body"))
    .select_from(
        schema.batches.outerjoin(
            schema.outbox, schema.outbox.c.batch_id == schema.batches.c.batch_id
        )
    )
    .where(schema.batches.c.batch_id.in_(sa.bindparam("b_ids", expanding=True)))
)


def _batches(conn: Connection, batch_ids: Sequence[str]) -> Iterator[tuple[Row[Any], bytes | None]]:
    """The ledger row and outbox body of each of ``batch_ids`` that has a ledger row, read
    ``_BATCH_CHUNK`` at a time: a wake-up over a backlog of outbox batches (each body a
    batch's rows) holds a few bodies, not all of them (600 such batches read at once peaked
    at 170 MiB against 75 read one by one)."""
    for start in range(0, len(batch_ids), _BATCH_CHUNK):
        binds = {"b_ids": list(batch_ids[start : start + _BATCH_CHUNK])}
        for row in conn.execute(_BATCHES, binds).all():  # whole: the caller reads on conn
            body = row.outbox_body
            yield row, None if body is None else bytes(body)


class _Rows(Mapping[str, dict[str, Any]]):
    """A batch's output rows by key, each turned into JSON values when first asked for (a
    batch read whole is mostly asked for a few keys at a time)."""

    def __init__(self, table: pa.Table, version: str) -> None:
        self._table, self._version = table, version
        keys = table.column("item_key").to_pylist()
        self._index: dict[str, int] = {}
        for i, key in enumerate(keys):
            self._index.setdefault(str(key), i)
        self._done: dict[str, dict[str, Any]] = {}

    def __getitem__(self, key: str) -> dict[str, Any]:
        row = self._done.get(key)
        if row is None:
            (raw,) = self._table.slice(self._index[key], 1).to_pylist()
            row = self._done[key] = _json({"model_version": self._version, **raw})
        return row

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)


def _size(rows: Mapping[str, dict[str, Any]]) -> int:
    """Bytes a batch's rows hold, near enough: the table's, or ~1 KiB a row read by key."""
    return rows.nbytes if isinstance(rows, _Rows) else 1024 * len(rows)


def _json(row: dict[str, Any]) -> dict[str, Any]:
    """A row as JSON values: the output a list of floats, times epoch seconds."""
    out: dict[str, Any] = {}
    for name, value in row.items():
        if name == "date":
            continue  # a Delta partition column: scored_at says it
        if isinstance(value, bytes | memoryview):
            value = np.frombuffer(bytes(value), "<f4").tolist()
        elif isinstance(value, dt.datetime):
            value = value.timestamp()
        out[name] = value
    out.setdefault("output_dim", len(out.get("output") or ()))
    return out
