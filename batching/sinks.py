"""Committed outputs: the shared value types, the ``Sink`` role, the ledger states, and the SQL
results table sink. The Parquet dataset sink lives in :mod:`batching.parquet`.

Both sinks commit *exactly once in effect*: the items are acked (compare-and-set on the lease)
and the batch is recorded in ``batching_batches`` in ONE transaction, so a batch whose lease was
lost is never committed (``errors.LeaseLost``) and a committed batch is never lost.

SQL: outputs go to ``batching_results`` (or a custom table) keyed by ``(queue, model_version,
item_key)``; a replayed key is not inserted twice (``ON CONFLICT DO NOTHING``).

OS and pyarrow errors become ``errors.SinkError`` in :func:`translate_errors` only.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from sqlalchemy.engine import Connection

from batching import config, errors, models, schema

if TYPE_CHECKING:
    from batching.queue import SqlQueue

logger = logging.getLogger(__name__)

COMMITTED = schema.BATCH_COMMITTED
"""Ledger state: acked and recorded; the Parquet file may still be in staging."""
PUBLISHED = schema.BATCH_PUBLISHED
"""Ledger state: the output is visible to readers."""
QUARANTINED = "quarantined"
"""Ledger state: reconcile found the output missing or corrupt and requeued its items."""
SUPERSEDED = "superseded"
"""Ledger state: reconcile removed duplicate rows; the batch was rewritten or dropped."""
LIVE_STATES = schema.BATCH_LIVE_STATES

SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,36}$")
"""Batch and lease ids (they become file names): letters, digits, ``_`` and ``-``, 1-36."""
_LEDGER = schema.batches


# ----------------------------------------------------------------------------- value types


@dataclass(frozen=True, eq=False)
class ScoredBatch:
    """A scored micro-batch ready to commit.

    ``outputs`` maps each item's id to a 1-D float array; every item has exactly one output and
    all outputs have the same length (``output_dim``). ``scored_at`` is epoch seconds.
    ``batch_id`` (``[A-Za-z0-9_-]``, at most 36 characters) is a fresh UUID unless given.

    Raises:
        SinkError: the batch is empty, an output is missing, extra, not 1-D, of another
            length or not finite, or an id has an unsafe form.
    """

    items: Sequence[models.WorkItem]
    outputs: Mapping[int, npt.ArrayLike]
    lease_id: str
    run_id: str
    model_version: str
    scored_at: float
    batch_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    _matrix: npt.NDArray[np.float32] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.items, models.ItemBlock):  # a block stays columns
            object.__setattr__(self, "items", tuple(self.items))
        for what, value in (("batch_id", self.batch_id), ("lease_id", self.lease_id)):
            if not SAFE_ID.match(value):
                raise errors.SinkError(f"{what} must match [A-Za-z0-9_-]{{1,36}}, got {value!r}")
        if not self.items:
            raise errors.SinkError(f"batch {self.batch_id} has no items; nothing to commit")
        ids = set(models.item_column(self.items, "id"))
        if ids != set(self.outputs) or len(ids) != len(self.items):
            raise errors.SinkError(
                f"batch {self.batch_id}: need exactly one output per item "
                f"({len(self.items)} items, {len(self.outputs)} outputs)"
            )
        object.__setattr__(self, "_matrix", self._stack())

    @property
    def output_dim(self) -> int:
        """Length of every output vector."""
        return int(self.matrix().shape[1])

    def matrix(self) -> npt.NDArray[np.float32]:
        """Outputs as a little-endian float32 array of shape ``(n_items, output_dim)``."""
        return self._matrix

    def _stack(self) -> npt.NDArray[np.float32]:
        outputs, ids = self.outputs, models.item_column(self.items, "id")
        try:
            if isinstance(outputs, models.OutputRows) and outputs.ids == ids:  # in item order
                out = np.asarray(outputs.matrix).astype("<f4", copy=False)
            else:
                rows = list(map(outputs.__getitem__, ids))
                out = np.stack(rows).astype("<f4", copy=False)
        except (ValueError, TypeError) as exc:
            raise errors.SinkError(
                f"batch {self.batch_id}: outputs must be 1-D of equal length ({exc})"
            ) from None
        if out.ndim != 2:
            raise errors.SinkError(f"batch {self.batch_id}: outputs must be 1-D of equal length")
        if not np.isfinite(out).all():
            raise errors.SinkError(f"batch {self.batch_id}: outputs must be finite")
        return out


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit wrote.

    ``location``: the file path relative to the dataset root, or the table name. ``n_rows``:
    rows written (a replayed SQL key is counted in ``n_replayed`` instead). ``n_bytes``: file
    size in bytes (None for SQL). ``published`` is False when the batch committed but its
    rename failed; ``recover()`` publishes it.
    """

    batch_id: str
    n_rows: int
    location: str
    n_bytes: int | None = None
    published: bool = True
    n_replayed: int = 0


@dataclass(frozen=True, slots=True)
class RecoverResult:
    """What ``recover()`` did: batches published, staging files deleted, staging files kept
    because their lease is still held (a commit may be in flight)."""

    rolled_forward: tuple[str, ...] = ()
    removed_staging: tuple[str, ...] = ()
    in_flight: tuple[str, ...] = ()


class SinkDescription(TypedDict):
    """A sink's output dataset for lineage: kind, location and ``(column, type)`` fields."""

    kind: str
    location: str
    fields: list[tuple[str, str]]


class Sink(Protocol):
    """Commits scored batches exactly once in effect."""

    def commit(self, batch: ScoredBatch) -> CommitResult: ...

    def flush(self) -> None: ...

    def recover(self) -> RecoverResult: ...

    def describe(self) -> SinkDescription: ...


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn OS and pyarrow errors into ``SinkError`` naming ``what`` (the one place it happens)."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise errors.SinkError(f"{what}: {exc}") from exc


# ----------------------------------------------------------------------------- SQL sink


class SqlSink:
    """Outputs in a SQL results table keyed by ``(queue, model_version, item_key)``.

    Outputs are stored as little-endian float32 bytes plus ``output_dim``. Results, acks and
    the ledger row (state ``published``) commit in one transaction.

    Args:
        queue: the queue whose database holds the results table.
        table: results table name; a name other than ``batching_results`` is created if
            missing, and keyed by queue too if it was created before that key (migration 9).

    Raises:
        ConfigError: ``table`` is not a SQL identifier.
    """

    kind = "sql"

    def __init__(self, queue: SqlQueue, table: str = schema.results.name) -> None:
        self._queue = queue
        self.table_name = config.check_identifier(table, "output.table")
        if table == schema.results.name:
            self._table = schema.results
        else:
            self._table = schema.results_table(table)
            with queue.begin() as conn:
                if schema.ensure_results_table(conn, self._table):
                    logger.warning(
                        "results table rekeyed by queue, model version and item key",
                        extra={"action": "results_rekeyed", "table": table},
                    )

    def flush(self) -> None:
        """Nothing is deferred: outputs, acks and the ledger row commit together."""

    def commit(self, batch: ScoredBatch) -> CommitResult:
        """Insert the outputs and ack the items in one transaction; a replayed key is skipped.

        Raises:
            LeaseLost: the lease no longer holds every item; nothing was written.
            QueueError: the database failed; nothing was written.
        """
        rows = self._rows(batch)
        with self._queue.begin() as conn:
            ids = models.item_column(batch.items, "id")
            self._queue.ack_all_or_raise(conn, batch.lease_id, ids, batch.batch_id)
            inserted = self._insert_new(conn, rows)
            conn.execute(_LEDGER.insert().values(**self._ledger_values(batch, inserted)))
        logger.info(
            "batch committed",
            extra={
                "action": "batch_committed",
                "batch_id": batch.batch_id,
                "n_items": len(rows),
                "n_replayed": len(rows) - inserted,
            },
        )
        return CommitResult(
            batch.batch_id, inserted, self.table_name, n_replayed=len(rows) - inserted
        )

    def recover(self) -> RecoverResult:
        """Nothing to finish: a SQL commit is a single transaction."""
        return RecoverResult()

    def describe(self) -> SinkDescription:
        """Dataset kind, table name and its columns."""
        fields = [(c.name, str(c.type).lower()) for c in self._table.columns]
        return {"kind": self.kind, "location": self.table_name, "fields": fields}

    def _rows(self, batch: ScoredBatch) -> list[dict[str, Any]]:
        mat = batch.matrix()
        return [
            {
                "model_version": batch.model_version,
                "item_key": item.item_key,
                "queue": item.queue,
                "output": mat[n].tobytes(),
                "output_dim": int(mat.shape[1]),
                "scored_at": batch.scored_at,
                "run_id": batch.run_id,
                "batch_id": batch.batch_id,
            }
            for n, item in enumerate(batch.items)
        ]

    def _insert_new(self, conn: Connection, rows: list[dict[str, Any]]) -> int:
        """Insert rows whose key is new (``ON CONFLICT DO NOTHING``); returns rows inserted."""
        if self._queue.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        inserted = 0
        for start in range(0, len(rows), 500):
            stmt = (
                insert(self._table)
                .values(rows[start : start + 500])
                .on_conflict_do_nothing(index_elements=list(schema.RESULTS_KEY))
                .returning(self._table.c.item_key)
            )
            inserted += len(conn.execute(stmt).all())
        return inserted

    def _ledger_values(self, batch: ScoredBatch, inserted: int) -> dict[str, Any]:
        now = self._queue.clock()
        return {
            "batch_id": batch.batch_id,
            "run_id": batch.run_id,
            "queue": self._queue.queue,
            "lease_id": batch.lease_id,
            "model_version": batch.model_version,
            "sink": self.kind,
            "path": self.table_name,
            "n_rows": inserted,
            "state": PUBLISHED,
            "committed_at": now,
            "published_at": now,
        }
