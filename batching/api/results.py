"""An item's state and its committed output row, read as a downstream reader would, through
the ledger: the item's ``batch_id`` names its ``batching_batches`` row (sink, location, model
version, state), and the row is read from there: a SQL results table by key, a Delta table by
key and batch, a Parquet file by key. A batch recorded but not yet rolled forward (the outbox
of a Delta or warehouse table, a Parquet file still in staging) is read from where it waits:
it is committed, so the client gets the row the output will hold.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, Row

from batching import errors, models
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import ledger, outbox, registry
from batching.store import database, schema

logger = logging.getLogger(__name__)
_T = schema.items
TERMINAL = frozenset(
    {models.State.DONE, models.State.DEAD, models.State.EXPIRED, models.State.CANCELLED}
)
"""States an item never leaves: a long poll ends there."""
_CHUNK = 500


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
        self._lock = threading.Lock()

    def queue(self, name: str) -> q.SqlQueue:
        return q.SqlQueue(self.engine, name, tenant_weights=self.tenant_weights)

    def states(self, queue: str, keys: Sequence[str]) -> dict[str, ItemView]:
        """The items of ``keys`` in ``queue`` that exist (no result read), by key."""
        found: dict[str, ItemView] = {}
        with self.queue(queue).read() as conn:
            for start in range(0, len(keys), _CHUNK):
                chunk = list(keys[start : start + _CHUNK])
                stmt = _select().where(_T.c.queue == queue, _T.c.item_key.in_(chunk))
                found.update({r.item_key: _view(r) for r in conn.execute(stmt)})
        return found

    def item(self, queue: str, key: str) -> ItemView | None:
        """The item of ``key`` with its committed output row when done; None if unknown.

        Raises:
            QueueError: the database failed.
            SinkError: the output of a done item cannot be read.
        """
        with self.queue(queue).read() as conn:
            row = conn.execute(_select().where(_T.c.queue == queue, _T.c.item_key == key)).first()
            if row is None:
                return None
            view = _view(row)
            if view.state != models.State.DONE or view.batch_id is None:
                return view
            batch = ledger.row(conn, view.batch_id)
            if batch is None:
                return view
            body = _outbox_body(conn, view.batch_id)
            result = self._read(conn, batch, body, key, queue)
        return ItemView(
            view.item_key,
            view.id,
            view.state,
            view.tenant,
            view.error,
            view.batch_id,
            result,
            str(batch.model_version),
        )

    def stats(self, queue: str, tenant: str) -> dict[str, Any]:
        """``batching status --json`` of ``queue`` for ``tenant``'s items only: by_state,
        oldest_ready_age_s, expired_leases, groups (by lane), backoff; and the queue's
        control: paused and max_depth (its depth counts every tenant's items)."""
        from batching.ingress import controls

        q = self.queue(queue)
        mine = tuple(g for g in q.stats().groups if g.tenant == tenant)
        held = controls.states(self.engine).get(queue, controls.QueueControl(queue))
        return dataclasses.asdict(models.QueueStats.of(mine)) | {
            "tenant": tenant,
            "paused": held.paused,
            "max_depth": held.max_depth,
        }

    def close(self) -> None:
        if self._warehouse is not None:
            self._warehouse.dispose()

    def _read(
        self, conn: Connection, batch: Row[Any], body: bytes | None, key: str, queue: str
    ) -> dict[str, Any] | None:
        if body is not None:  # committed, not rolled forward yet: the rows it will write
            return _first(_match(outbox.decode(body), key), str(batch.model_version))
        kind = str(batch.sink)
        if kind == "sql":
            return self._sql_row(conn, str(batch.path), queue, str(batch.model_version), key)
        if kind == "delta":
            return self._delta_row(batch, key)
        if kind == "parquet":
            return self._parquet_row(batch, key)
        raise errors.SinkError(f"batch {batch.batch_id}: unknown sink {kind!r} in the ledger")

    def _sql_row(
        self, conn: Connection, table_name: str, queue: str, version: str, key: str
    ) -> dict[str, Any] | None:
        table = (
            schema.results
            if table_name == schema.results.name
            else schema.results_table(table_name)
        )
        stmt = table.select().where(
            table.c.queue == queue, table.c.model_version == version, table.c.item_key == key
        )
        if self.target.kind == "sql" and self.target.url is not None:
            with self._lock:  # requests read in the thread pool
                if self._warehouse is None:
                    self._warehouse = database.create_engine(self.target.url)
            url = self._warehouse.url.render_as_string(hide_password=True)
            with database.translate_errors(url), self._warehouse.connect() as other:
                row = other.execute(stmt).mappings().first()
        else:
            row = conn.execute(stmt).mappings().first()
        return None if row is None else _json(dict(row))

    def _delta_row(self, batch: Row[Any], key: str) -> dict[str, Any] | None:
        from batching.outputs import delta

        lit = delta.sql_literal
        sql = (
            f"SELECT * FROM t WHERE item_key = {lit(key)} AND batch_id = {lit(str(batch.batch_id))}"
        )
        uri = str(batch.path or self.target.where)
        table = delta.DeltaSink.read(uri, sql, storage_options=self.target.storage_options)
        return _first(table, str(batch.model_version))

    def _parquet_row(self, batch: Row[Any], key: str) -> dict[str, Any] | None:
        import pyarrow.parquet as pq

        root = Path(self.target.where).resolve()
        final = (root / str(batch.path)).resolve()
        if root not in final.parents:
            raise errors.SinkError(f"batch {batch.batch_id}: ledger path outside the dataset")
        # The rename into the dataset may land between two looks: final, staging, final.
        staging = [Path(batch.staging_path)] if batch.staging_path else []
        for path in (final, *staging, final):
            try:
                with sinks.translate_errors(f"cannot read {path}"):
                    table = pq.read_table(path, filters=[("item_key", "==", key)])
            except errors.SinkError:
                if path.exists():
                    raise
                continue
            return _first(table, str(batch.model_version))
        raise errors.SinkError(
            f"batch {batch.batch_id}: its file {final} is missing; run `batching reconcile`"
        )


def _select() -> sa.Select[Any]:
    return sa.select(
        _T.c.id, _T.c.item_key, _T.c.state, _T.c.tenant, _T.c.last_error, _T.c.batch_id
    )


def _view(row: Row[Any]) -> ItemView:
    return ItemView(
        str(row.item_key),
        int(row.id),
        models.State(row.state),
        str(row.tenant),
        row.last_error,
        row.batch_id,
    )


def _outbox_body(conn: Connection, batch_id: str) -> bytes | None:
    stmt = sa.select(schema.outbox.c.body).where(schema.outbox.c.batch_id == batch_id)
    body = conn.execute(stmt).scalar()
    return None if body is None else bytes(body)


def _match(table: pa.Table, key: str) -> pa.Table:
    import pyarrow.compute as pc

    return table.filter(pc.equal(table.column("item_key"), key))


def _first(table: pa.Table, version: str) -> dict[str, Any] | None:
    rows = table.slice(0, 1).to_pylist()
    if not rows:
        return None
    return _json({"model_version": version, **rows[0]})


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
