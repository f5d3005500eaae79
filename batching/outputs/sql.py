"""SQL results tables: outputs keyed by ``(queue, model_version, item_key)``, one row per item,
the output as little-endian float32 bytes plus ``output_dim``.

Two sinks, one table shape:

* :class:`SqlSink` writes into the queue's own database: results, acks and the ledger row
  (``published``) commit in ONE transaction, so there is nothing to roll forward.
* :class:`WarehouseSqlSink` writes into another database (a warehouse beside a PostgreSQL
  queue): the queue's database decides (ledger row and the rows in the outbox, with the ack),
  and an idempotent insert keyed by item is the roll-forward (:mod:`batching.outputs.outbox`).

A replayed key is not inserted twice (``ON CONFLICT DO NOTHING``): the first committed output
of a key stays.

Why it stays one module: both sinks write and read the same table shape through the same
helpers (the rows of a batch, the keyed insert, the key lookups reconcile makes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Row

from batching import config, errors, facts, models, naming, outcomes, ports
from batching.outputs import contract as sinks
from batching.outputs import ledger, outbox
from batching.redaction import redact_url
from batching.store import database, retention, schema

logger = logging.getLogger(__name__)
_B = schema.batches
_CHUNK = 500


class SqlSink(sinks.FencedSink):
    """Outputs in a results table of the queue's database (results, acks and the ledger row
    commit in one transaction).

    Args:
        fence: the queue's side of a commit (``SqlQueue``); its database holds the table.
        table: results table name; a name other than ``batching_results`` is created if
            missing, and keyed by queue too if it was created before that key (migration 9).
        create: False for a sink opened to be read (reconcile): it changes no table.

    Raises:
        ConfigError: ``table`` is not a SQL identifier.
    """

    kind = "sql"

    def __init__(
        self, fence: ports.Fence, table: str = schema.results.name, *, create: bool = True
    ) -> None:
        self.fence = fence
        self.table_name = config.check_identifier(table, "output.table")
        self._table = _results_table(table)
        if create and table != schema.results.name:
            with fence.begin() as conn:
                _ensure(conn, self._table)

    # -- a commit (sinks.commit) ---------------------------------------------------------

    def stage(self, batch: sinks.ScoredBatch) -> sinks.Staged:
        """Nothing to stage: the rows are inserted with the ack."""
        return sinks.Staged(batch, self.table_name)

    def record(self, conn: Connection, staged: sinks.Staged) -> outcomes.CommitResult:
        """Insert the rows whose key is new and the ledger row (``published``)."""
        batch = staged.batch
        rows = result_rows(sinks.batch_table(batch), batch.model_version)
        inserted = insert_new(conn, self._table, rows)
        now = self.fence.clock()
        values = ledger.row_values(
            self.fence,
            self.kind,
            staged,
            n_rows=inserted,
            state=models.BatchState.PUBLISHED,
            published_at=now,
        )
        ledger.insert(conn, values)
        replayed = len(rows) - inserted
        return outcomes.CommitResult(batch.batch_id, inserted, self.table_name, n_replayed=replayed)

    def publish_staged(self, staged: sinks.Staged) -> bool:
        """Visible since the commit."""
        return True

    def discard(self, staged: sinks.Staged) -> None:
        """Nothing was staged."""

    def flush(self) -> None:
        """Nothing is deferred."""

    # -- life cycle ------------------------------------------------------------------------

    def preflight(self) -> None:
        """The table lives in the queue's database, which the run checks already."""

    def recover(self) -> outcomes.RecoverResult:
        """Nothing to finish: a commit is a single transaction."""
        return outcomes.RecoverResult()

    def describe(self) -> sinks.SinkDescription:
        """Dataset kind, table name and its columns."""
        namespace, name = naming.sql_dataset_id(self.fence.url, self.table_name)
        return _description(self.kind, self.table_name, namespace, name, self._table)

    def maintain(self, *, vacuum_retention_h: float | None = None) -> dict[str, object]:
        """Nothing to compact: a table keyed by item."""
        return {}

    # -- reconcile ---------------------------------------------------------------------------

    def owns(self) -> sa.ColumnElement[bool]:
        return sa.and_(_B.c.sink == self.kind, _B.c.path == self.table_name)

    def survey(self, since: float | None = None) -> facts.Survey:
        return facts.Survey()

    def observe(
        self, conn: Connection, survey: facts.Survey, rows: Sequence[Row[Any]]
    ) -> facts.Observed:
        return facts.Observed()

    def inspect(
        self,
        rows: Sequence[Row[Any]],
        done: Sequence[facts.DoneItem],
        observed: facts.Observed,
        *,
        dataset_lost: bool = False,
    ) -> facts.OutputFacts:
        """Each done item of a live batch looked up in the table by its key."""
        with self.fence.read() as conn:
            if _has_table(conn, self._table):
                found = _found_keys(conn, self._table, self.fence.queue, rows, done)
            else:
                if not dataset_lost:
                    _refuse_missing(rows, self.table_name, "the queue's database", self.fence.queue)
                found = set()
        return facts.OutputFacts(
            batches=tuple(_table_facts(r, self.table_name) for r in rows),
            done=_with_outputs(done, rows, found),
        )

    def publish(self, batch_id: str) -> bool:
        """Nothing to roll forward."""
        return False

    def set_aside(self, files: Sequence[str], batch_ids: Sequence[str]) -> list[str]:
        """A table keyed by item has no orphan file."""
        return []

    def drop_rows(self, batch_id: str, keys: Sequence[str]) -> str | None:
        """Its key keeps one row per item: there are no duplicates to drop."""
        return None


class WarehouseSqlSink(outbox.OutboxSink):
    """Outputs in a results table of another database, rolled forward from the outbox.

    Args:
        fence: the queue's side of a commit (``SqlQueue``).
        url: the other database (``postgresql://...`` or ``sqlite:///FILE``).
        table: the results table there; created if missing (when it is written: opened to
            be read, for reconcile, the sink changes nothing).
        create: False for a sink opened to be read.

    Raises:
        ConfigError: ``table`` is not a SQL identifier, or ``url`` is malformed.
        SinkError: the database cannot be reached or the table created.
    """

    kind = "sql"

    def __init__(
        self,
        fence: ports.Fence,
        url: str,
        table: str = schema.results.name,
        *,
        create: bool = True,
    ) -> None:
        super().__init__(fence)
        self.table_name = config.check_identifier(table, "output.table")
        self.url = url
        namespace, name = naming.sql_dataset_id(url, table)
        self.location = f"{namespace}/{name}"
        self._table = _results_table(table)
        self._engine = database.create_engine(url)
        self._ensured = False
        if create:
            self._ensure()

    def _ensure(self) -> None:
        if not self._ensured:
            with self._begin() as conn:
                _ensure(conn, self._table)
            self._ensured = True

    def _write(self, pending: outbox.Pending, table: pa.Table) -> int:
        self._ensure()  # a repair's roll-forward through a sink opened to be read
        rows = result_rows(table, pending.model_version)
        with self._begin() as conn:
            inserted = insert_new(conn, self._table, rows)
            if inserted < len(rows):  # keys held already: this batch's, or another writer's
                self._refuse_foreign(conn, rows, pending.batch_id)
            return inserted

    def _refuse_foreign(self, conn: Connection, rows: list[dict[str, Any]], batch_id: str) -> None:
        """Raise ``SinkError`` (the insert rolls back) when keys of this batch are held by
        batches this queue's ledger does not know: another queue database writing the same
        queue name into this table. Its rows were dropped, its items acked, and reconcile
        said clean (the keys were there), while readers got the other deployment's scores.

        A key scored before the ledger horizon's day by a batch whose row retention purged
        (``batching.store.retention``) is this queue's: the producer resent it after its
        purge, and readers keep its first score, as the insert left it."""
        t = self._table
        others: dict[str, str] = {}
        scored: dict[str, float] = {}
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start : start + _CHUNK]
            q = sa.select(t.c.item_key, t.c.batch_id, t.c.scored_at).where(
                t.c.queue == chunk[0]["queue"],
                t.c.model_version == chunk[0]["model_version"],
                t.c.item_key.in_([r["item_key"] for r in chunk]),
                t.c.batch_id != batch_id,
            )
            for key, other, at in conn.execute(q):
                others[str(key)], scored[str(key)] = str(other), float(at)
        if not others:
            return
        with self.fence.read() as queue_db:
            known = set(ledger.states(queue_db, sorted(set(others.values()))))
            at = retention.horizon(queue_db, self.fence.queue)
        foreign = {
            k: b
            for k, b in others.items()
            if b not in known and not retention.excused(retention.day(scored[k]), at)
        }
        if foreign:
            key, other = next(iter(sorted(foreign.items())))
            raise errors.SinkError(
                f"results table {t.name} of {redact_url(self.url)} holds {len(foreign)} of batch "
                f"{batch_id}'s keys from batches this queue's database does not know (e.g. "
                f"{key!r} from {other}): another queue database writes queue "
                f"{rows[0]['queue']!r} into it; give each queue database its own output.table"
            )

    def _begin(self) -> Any:
        return _translated(self.url, self._engine.begin)

    def preflight(self) -> None:
        """The other database answers and holds the table.

        Raises:
            SinkError: it does not.
        """
        with _translated(self.url, self._engine.connect) as conn:
            # a row, not a count: LIMIT applies after the aggregate (a scan of the table)
            conn.execute(sa.select(sa.literal(1)).select_from(self._table).limit(1))

    def describe(self) -> sinks.SinkDescription:
        namespace, name = naming.sql_dataset_id(self.url, self.table_name)
        return _description(self.kind, self.location, namespace, name, self._table)

    def maintain(self, *, vacuum_retention_h: float | None = None) -> dict[str, object]:
        return {}

    def survey(self, since: float | None = None) -> facts.Survey:
        return facts.Survey()

    def inspect(
        self,
        rows: Sequence[Row[Any]],
        done: Sequence[facts.DoneItem],
        observed: facts.Observed,
        *,
        dataset_lost: bool = False,
    ) -> facts.OutputFacts:
        """Committed batches wait in the outbox (or were lost with it); the done items of
        published ones are looked up in the other database by key."""
        published = [r for r in rows if r.state == models.BatchState.PUBLISHED]
        with _translated(self.url, self._engine.connect) as conn:
            if _has_table(conn, self._table):
                found = _found_keys(conn, self._table, self.fence.queue, published, done)
            else:
                if not dataset_lost:
                    _refuse_missing(rows, self.table_name, redact_url(self.url), self.fence.queue)
                found = set()
        batches = tuple(
            self.pending_facts(r, observed)
            if r.state == models.BatchState.COMMITTED
            else _table_facts(r, self.location)
            for r in rows
        )
        return facts.OutputFacts(batches=batches, done=_with_outputs(done, published, found))

    def set_aside(self, files: Sequence[str], batch_ids: Sequence[str]) -> list[str]:
        return []

    def drop_rows(self, batch_id: str, keys: Sequence[str]) -> str | None:
        return None


# ----------------------------------------------------------------------------- rows


def result_rows(table: pa.Table, model_version: str) -> list[dict[str, Any]]:
    """A batch's rows (``sinks.batch_table``) as rows of a results table."""
    output = table.column("output").combine_chunks()
    dim = output.type.list_size
    mat = output.flatten().to_numpy(zero_copy_only=False).astype("<f4").reshape(-1, dim)
    scored = table.column("scored_at").cast(pa.int64()).to_pylist()
    return [
        {
            "model_version": model_version,
            "item_key": key,
            "queue": queue,
            "output": mat[n].tobytes(),
            "output_dim": int(dim),
            "scored_at": scored[n] / 1_000_000,
            "run_id": run_id,
            "batch_id": batch_id,
        }
        for n, (key, queue, run_id, batch_id) in enumerate(
            zip(
                table.column("item_key").to_pylist(),
                table.column("queue").to_pylist(),
                table.column("run_id").to_pylist(),
                table.column("batch_id").to_pylist(),
                strict=True,
            )
        )
    ]


def insert_new(conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> int:
    """Insert rows whose key is new (``ON CONFLICT DO NOTHING``); returns rows inserted."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    inserted = 0
    for start in range(0, len(rows), _CHUNK):
        stmt = (
            insert(table)
            .values(rows[start : start + _CHUNK])
            .on_conflict_do_nothing(index_elements=list(schema.RESULTS_KEY))
            .returning(table.c.item_key)
        )
        inserted += len(conn.execute(stmt).all())
    return inserted


def _has_table(conn: Connection, table: sa.Table) -> bool:
    return sa.inspect(conn).has_table(table.name)


def _refuse_missing(rows: Sequence[Row[Any]], table: str, where: str, queue: str) -> None:
    sinks.refuse_missing_output(
        rows, f"no results table {table!r} in {where}", queue, "output.table and output.url"
    )


def _results_table(name: str) -> sa.Table:
    return schema.results if name == schema.results.name else schema.results_table(name)


def _ensure(conn: Connection, table: sa.Table) -> None:
    if schema.ensure_results_table(conn, table):
        logger.warning(
            "results table rekeyed by queue, model version and item key",
            extra={"action": "results_rekeyed", "table": table.name},
        )


def _translated(url: str, opener: Any) -> Any:
    """A connection or transaction of the output's database; its failures are the output's
    (``SinkError``), not the queue's."""

    @contextlib.contextmanager
    def opened() -> Any:
        try:
            with database.translate_errors(url), opener() as conn:
                yield conn
        except errors.QueueError as exc:
            raise errors.SinkError(f"output {exc}") from exc

    return opened()


def _description(
    kind: str, location: str, namespace: str, name: str, table: sa.Table
) -> sinks.SinkDescription:
    fields = [(c.name, str(c.type).lower()) for c in table.columns]
    return {
        "kind": kind,
        "location": location,
        "namespace": namespace,
        "name": name,
        "fields": fields,
    }


def _table_facts(row: Row[Any], location: str) -> facts.BatchFacts:
    live = row.state in models.LIVE_BATCH_STATES
    return facts.BatchFacts(
        row.batch_id,
        row.model_version,
        row.state,
        row.committed_at,
        "table" if live else "retired",
        location,
    )


def _found_keys(
    conn: Connection,
    table: sa.Table,
    queue: str,
    rows: Iterable[Row[Any]],
    done: Sequence[facts.DoneItem],
) -> set[tuple[str, str]]:
    """The ``(model_version, item_key)`` of the done items of ``rows``' live batches that the
    table holds."""
    version = {r.batch_id: r.model_version for r in rows if r.state in models.LIVE_BATCH_STATES}
    wanted: dict[str, list[str]] = {}
    for item in done:
        if item.batch_id in version:
            wanted.setdefault(version[item.batch_id], []).append(item.item_key)
    found: set[tuple[str, str]] = set()
    lookup = _keyed_lookup if conn.dialect.name == "postgresql" else _listed_lookup
    for model_version, keys in wanted.items():
        for start in range(0, len(keys), _CHUNK):
            q = lookup(table, queue, model_version, keys[start : start + _CHUNK])
            found.update((model_version, str(k)) for k in conn.execute(q).scalars())
    return found


def _listed_lookup(
    table: sa.Table, queue: str, model_version: str, keys: list[str]
) -> sa.Select[Any]:
    """The keys of ``keys`` the table holds: ``item_key IN (...)`` (SQLite searches the key
    index once per listed key)."""
    return sa.select(table.c.item_key).where(
        table.c.queue == queue,
        table.c.model_version == model_version,
        table.c.item_key.in_(keys),
    )


def _keyed_lookup(
    table: sa.Table, queue: str, model_version: str, keys: list[str]
) -> sa.Select[Any]:
    """The keys of ``keys`` the table holds, one primary-key lookup each (PostgreSQL).

    Why not ``item_key IN (...)``: on a table never analyzed PostgreSQL took the results
    table for a few rows and read the whole ``(queue, model_version)`` range of its key for
    every chunk, the list a filter on each row (not hashed once the plan was cached): each
    chunk read every row (9.7 s for 20k items, 2.8 minutes for 50k; 22 minutes for 100k in the
    field, 2.5 s after ``ANALYZE``). Here each key
    is a ``LATERAL`` subquery on the full primary key; its ``LIMIT`` keeps the planner from
    flattening it into a join it might hash over the whole table, and a unique key's
    equality is one index probe whatever the statistics say.
    """
    wanted = (
        sa.func.unnest(sa.bindparam("keys", keys, type_=postgresql.ARRAY(sa.Text)))
        .table_valued("key")
        .render_derived(name="wanted")
    )
    hit = (
        sa.select(table.c.item_key)
        .where(
            table.c.queue == queue,
            table.c.model_version == model_version,
            table.c.item_key == wanted.c.key,
        )
        .limit(1)
        .lateral("hit")
    )
    return sa.select(hit.c.item_key).select_from(wanted).join(hit, sa.true())


def _with_outputs(
    done: Sequence[facts.DoneItem], rows: Iterable[Row[Any]], found: set[tuple[str, str]]
) -> tuple[facts.DoneItem, ...]:
    """``done`` with ``has_output`` set for the items of ``rows``' batches."""
    version = {r.batch_id: r.model_version for r in rows}
    return tuple(
        facts.DoneItem(d.item_key, d.batch_id, (version[d.batch_id], d.item_key) in found)
        if d.batch_id in version
        else d
        for d in done
    )
