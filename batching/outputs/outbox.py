"""Outputs outside the queue's database, committed exactly once through an outbox.

A Delta table or a table in another database cannot join the queue's transaction, so the
database decides, and the output follows (the transactional outbox):

1. ``record`` (in the transaction that acks the items) inserts the ledger row, ``committed``,
   with the writer's id and its next sequence number, and the batch's rows (Arrow IPC) in
   ``batching_outbox``. The items are done exactly when this commits.
2. ``publish_staged`` (after it) writes the rows to the output with the sink's idempotent
   ``_write``, then marks the ledger row ``published`` and deletes the outbox row, together.

A crash between the two leaves a ``committed`` row and its outbox row: any scorer's
``recover()`` at start-up, and reconcile's repair, roll it forward; ``_write`` makes doing it
twice (two processes at once, or a crash after the write but before the mark) write it once.
A writer's batches roll forward in sequence order, so an output that remembers the highest
sequence it applied per writer (a Delta transaction id) can tell what it already has. If the
output cannot be written (down, full), the batch stays ``committed`` and later commits of the
same writer queue behind it; ``flush()`` and the next commit try again, in order. Once
:data:`MAX_QUEUED` wait, a commit fails the run (``SinkError``): what is committed stays in the
outbox, where the next start-up's ``recover()`` finds it, and the queue, not the scorer's
memory, holds what is not scored yet.
"""

from __future__ import annotations

import abc
import itertools
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from batching import errors, facts, models, outcomes, ports
from batching.outputs import contract as sinks
from batching.outputs import ledger
from batching.store import schema

logger = logging.getLogger(__name__)
_B = schema.batches
_O = schema.outbox
MAX_QUEUED = 16  # batches committed but refused by the output, held in memory at most


def encode(table: pa.Table) -> bytes:
    """A batch's rows as one Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())


def decode(body: bytes) -> pa.Table:
    """The rows :func:`encode` wrote."""
    return pa.ipc.open_stream(pa.py_buffer(body)).read_all()


@dataclass(frozen=True, slots=True)
class Pending:
    """A committed batch to roll forward: what ``_write`` needs of its ledger row."""

    batch_id: str
    model_version: str
    run_id: str
    committed_at: float
    writer: str | None
    seq: int | None

    @classmethod
    def of(cls, row: Row[Any]) -> Pending:
        return cls(
            row.batch_id, row.model_version, row.run_id, row.committed_at, row.writer, row.seq
        )


class OutboxSink(sinks.FencedSink, abc.ABC):
    """A sink whose output lives outside the queue's database (see the module docstring).

    Subclasses set ``kind`` and ``location`` (the ledger's ``path`` of their batches: the
    output's identity) and write a batch's rows with :meth:`_write`.
    """

    kind: str
    location: str

    def __init__(self, fence: ports.Fence) -> None:
        self.fence = fence
        self.writer = uuid.uuid4().hex
        self._seqs = itertools.count(1)
        self._recorded: dict[str, tuple[Pending, pa.Table]] = {}
        self._queued: list[tuple[Pending, pa.Table]] = []  # committed, not yet written
        self._refused: str = ""  # why the output refused the head of the queue last
        self._lock = threading.Lock()  # the commit stage and a flush when the run ends
        self._publishing = threading.Lock()  # one roll-forward at a time, in order

    @abc.abstractmethod
    def _write(self, pending: Pending, table: pa.Table) -> int:
        """Make the batch's rows visible in the output, once however often it is called;
        returns the rows written now (0: they were there already).

        Raises:
            SinkError: the output cannot be written (the batch stays ``committed``).
        """

    # What each output answers for itself (sinks.Sink):

    @abc.abstractmethod
    def preflight(self) -> None: ...

    @abc.abstractmethod
    def describe(self) -> sinks.SinkDescription: ...

    @abc.abstractmethod
    def maintain(self, *, vacuum_retention_h: float | None = None) -> dict[str, object]: ...

    @abc.abstractmethod
    def survey(self, since: float | None = None) -> facts.Survey: ...

    @abc.abstractmethod
    def inspect(
        self,
        rows: Sequence[Row[Any]],
        done: Sequence[facts.DoneItem],
        observed: facts.Observed,
        *,
        dataset_lost: bool = False,
    ) -> facts.OutputFacts: ...

    @abc.abstractmethod
    def set_aside(self, files: Sequence[str], batch_ids: Sequence[str]) -> list[str]: ...

    @abc.abstractmethod
    def drop_rows(self, batch_id: str, keys: Sequence[str]) -> str | None: ...

    # -- a commit (sinks.commit) ---------------------------------------------------------

    def stage(self, batch: sinks.ScoredBatch) -> sinks.Staged:
        """Nothing durable yet: the rows travel in the ledger's transaction."""
        table = sinks.batch_table(batch)
        return sinks.Staged(batch, self.location, body=encode(table))

    def record(self, conn: Connection, staged: sinks.Staged) -> outcomes.CommitResult:
        """The ledger row (``committed``, this writer's next sequence number) and the rows
        in the outbox, in the transaction that acks the items."""
        assert staged.body is not None
        with self._lock:
            seq = next(self._seqs)
        values = ledger.row_values(self.fence, self.kind, staged, writer=self.writer, seq=seq)
        ledger.insert(conn, values)
        conn.execute(_O.insert().values(batch_id=staged.batch.batch_id, body=staged.body))
        batch = staged.batch
        pending = Pending(
            batch.batch_id,
            batch.model_version,
            batch.run_id,
            values["committed_at"],
            self.writer,
            seq,
        )
        # Kept until publish_staged (or discard, when the lease was lost). A transaction that
        # fails otherwise fails the run, and this sink with it; the ledger decides what
        # recover() rolls forward at the next start.
        with self._lock:
            self._recorded[batch.batch_id] = (pending, decode(staged.body))
        return outcomes.CommitResult(
            batch.batch_id, len(batch.items), self.location, published=False
        )

    def publish_staged(self, staged: sinks.Staged) -> bool:
        """Write the rows to the output, after any earlier batch of this writer still queued."""
        with self._lock:
            recorded = self._recorded.pop(staged.batch.batch_id, None)
            if recorded is not None:
                self._queued.append(recorded)
        self._drain()
        with self._lock:
            waiting = len(self._queued)
            published = all(p.batch_id != staged.batch.batch_id for p, _ in self._queued)
        if waiting >= MAX_QUEUED:
            raise errors.SinkError(
                f"the output {self.location} refused the last {waiting} batches "
                f"({self._refused}); they are committed and wait in the queue's outbox, and "
                "the next start rolls them forward: fix the output, then score again"
            )
        return published

    def discard(self, staged: sinks.Staged) -> None:
        """Nothing was staged outside the transaction."""
        with self._lock:
            self._recorded.pop(staged.batch.batch_id, None)

    def flush(self) -> None:
        """Write what an earlier failure left queued (the scorer calls it when idle)."""
        self._drain()

    def unpublished(self) -> str | None:
        """The batches the output refused that still wait (after a last try to write them)."""
        self._drain()
        with self._lock:
            waiting = len(self._queued)
        if not waiting:
            return None
        return (
            f"the output {self.location} refused {waiting} committed batch(es) ({self._refused});"
            " their items are acked and their rows wait in the queue's outbox: fix the output, "
            "then the next run or `batching reconcile --repair` writes them"
        )

    # -- life cycle ------------------------------------------------------------------------

    def recover(self) -> outcomes.RecoverResult:
        """Roll forward every ``committed`` batch of this output (any writer's), in order."""
        with self.fence.begin() as conn:
            rows = ledger.committed(conn, self.owns())
        ordered = sorted(rows, key=lambda r: (r.writer or "", r.seq or 0, r.committed_at))
        rolled = tuple(r.batch_id for r in ordered if self._roll_row(r))
        logger.info(
            "sink recovered",
            extra={"action": "sink_recover", "sink": self.kind, "n_rolled_forward": len(rolled)},
        )
        return outcomes.RecoverResult(rolled_forward=rolled)

    def publish(self, batch_id: str) -> bool:
        """Roll a ``committed`` batch forward, with its writer's earlier ones first (a repair).

        Returns False when the row is not ``committed`` or its rows are not in the outbox.
        """
        with self.fence.begin() as conn:
            row = ledger.row(conn, batch_id)
            if row is None or row.state != models.BatchState.COMMITTED:
                return False
            earlier = []
            if row.writer is not None:
                same = sa.and_(self.owns(), _B.c.writer == row.writer, _B.c.seq < row.seq)
                earlier = sorted(ledger.committed(conn, same), key=lambda r: r.seq)
        for r in earlier:
            self._roll_row(r)
        return self._roll_row(row)

    def owns(self) -> sa.ColumnElement[bool]:
        """The batches this output's writers recorded."""
        return sa.and_(_B.c.sink == self.kind, _B.c.path == self.location)

    def observe(
        self, conn: Connection, survey: facts.Survey, rows: Sequence[Row[Any]]
    ) -> facts.Observed:
        """Which ``committed`` batches still have their rows in the outbox."""
        ids = [r.batch_id for r in rows if r.state == models.BatchState.COMMITTED]
        present: set[str] = set()
        for start in range(0, len(ids), 500):
            q = sa.select(_O.c.batch_id).where(_O.c.batch_id.in_(ids[start : start + 500]))
            present.update(str(b) for b in conn.execute(q).scalars())
        return facts.Observed(outbox=frozenset(present))

    def pending_facts(self, row: Row[Any], observed: facts.Observed) -> facts.BatchFacts:
        """A ``committed`` row: waiting in the outbox, or lost with it."""
        where, problem = "pending", None
        if row.batch_id not in observed.outbox:
            where = "missing"
            problem = "committed, but its rows are in neither the output nor the outbox"
        return facts.BatchFacts(
            row.batch_id,
            row.model_version,
            row.state,
            row.committed_at,
            where,
            self.location,
            problem,
        )

    # -- rolling forward -------------------------------------------------------------------

    def _drain(self) -> None:
        """Write the queued batches in order; stop at the first failure (kept, with the rest)."""
        with self._publishing:
            while True:
                with self._lock:
                    if not self._queued:
                        return
                    pending, table = self._queued[0]
                try:
                    self._roll(pending, table)
                except (errors.SinkError, errors.QueueError) as exc:
                    self._refused = str(exc)
                    logger.exception(
                        "batch committed but not published; retried with the next commit",
                        extra={"action": "publish_failed", "batch_id": pending.batch_id},
                    )
                    return
                with self._lock:
                    self._queued.pop(0)

    def _roll_row(self, row: Row[Any]) -> bool:
        """Roll one ledger row forward from its outbox row; False when it has none."""
        with self.fence.begin() as conn:
            body = conn.execute(
                sa.select(_O.c.body).where(_O.c.batch_id == row.batch_id)
            ).scalar_one_or_none()
        if body is None:
            return False
        self._roll(Pending.of(row), decode(body))
        return True

    def _roll(self, pending: Pending, table: pa.Table) -> None:
        """Write, then mark published and empty the outbox row, together; nothing when the
        batch is no longer ``committed`` (another process published it; reconcile retired it)."""
        with self.fence.read() as conn:
            row = ledger.row(conn, pending.batch_id)
        if row is None or row.state != models.BatchState.COMMITTED:
            return
        written = self._write(pending, table)
        with self.fence.begin() as conn:
            ledger.mark_published(conn, [pending.batch_id], self.fence.clock())
            conn.execute(_O.delete().where(_O.c.batch_id == pending.batch_id))
        logger.info(
            "batch rolled forward",
            extra={
                "action": "roll_forward",
                "sink": self.kind,
                "batch_id": pending.batch_id,
                "n_rows": written,
            },
        )
