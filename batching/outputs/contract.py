"""The outputs contract: what every sink answers, and how a commit is composed.

A sink never sees the queue. It is given a :class:`~batching.ports.Fence` (the queue's side of
a commit: a transaction in the queue's database and the ack of a lease's items in it), and a
commit is composed from the two by :func:`commit`, the one place the protocol lives:

1. ``sink.stage(batch)``: make the batch durable outside any transaction, if the sink needs to
   (the Parquet sink writes and fsyncs a staging file; the others stage nothing here).
2. In ONE transaction of the queue's database: ``fence.ack_all_or_raise`` acks the lease's
   items (compare-and-set on the lease: ``LeaseLost``, and nothing is written, when any is no
   longer held), then ``sink.record(conn, staged)`` inserts the batch's ledger row, and with it
   whatever must commit with the ack: the results of a table in that database, or the batch's
   rows in the outbox for a sink that writes elsewhere (a Delta table, a warehouse table).
3. ``sink.publish_staged(staged)``: make it visible (rename into the dataset; roll the outbox
   forward into the table). A failure here leaves a ``committed`` ledger row that the sink's
   ``recover()`` at the next start-up and reconcile's repair roll forward, idempotently.

So the database decides: a crash before step 2 commits leaves no ledger row (the items are
re-scored once their lease expires); after it, a ledger row that rolls forward into exactly one
visible copy. Each sink also answers what reconcile and the flows need of its output: its
``preflight`` (can it be written), ``unpublished`` (is all of a run in it), its facts
(:mod:`batching.facts`), its repairs. Sinks: :mod:`~batching.outputs.parquet`,
:mod:`~batching.outputs.sql` (another database's through :mod:`~batching.outputs.outbox`),
:mod:`~batching.outputs.delta` (through the outbox); :mod:`batching.outputs.registry` opens the
one a config names. OS and pyarrow errors become ``SinkError`` in :func:`translate_errors` only.

Why it stays one module: the batch a sink commits, the protocol every sink answers and the
commit that composes it are one contract; apart, each would be read against the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from batching import errors, facts, models, outcomes, ports

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.engine import Connection, Row

logger = logging.getLogger(__name__)

SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,36}$")
"""Batch and lease ids (they become file names): letters, digits, ``_`` and ``-``, 1-36."""


@dataclass(frozen=True, eq=False)
class ScoredBatch:
    """A scored micro-batch ready to commit: ``outputs`` maps each item's id to a 1-D float array; every item has exactly one output and
    all outputs have the same length (``output_dim``). ``scored_at`` is epoch seconds.
    ``batch_id`` (``[A-Za-z0-9_-]``, at most 36 characters) is a fresh UUID unless given.

    Raises ``SinkError`` when the batch is empty, an output is missing, extra, not 1-D, of
    another length or not finite, or an id has an unsafe form.
    """

    items: Sequence[models.WorkItem]
    outputs: Mapping[int, npt.ArrayLike]
    lease_id: str
    run_id: str
    model_version: str
    scored_at: float
    batch_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    forwards: Mapping[str, Sequence[int]] = field(default_factory=dict)
    """The forward passes its items were scored in (pass id -> ids, in the
    pass's order), as the ledger records them for replay; empty: not recorded."""
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
    def n_rows(self) -> int:  # rows written: one per item (a shard's: one per input row)
        return len(self.items)

    def table(self) -> pa.Table:  # the rows as Arrow (a shard's: already so)
        return batch_table(self)

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


FILE_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("item_key", pa.string()),
    ("scored_at", pa.timestamp("us", tz="UTC")),
    ("run_id", pa.string()),
    ("batch_id", pa.string()),
    ("queue", pa.string()),
    ("tenant", pa.string()),
)
"""The columns of a batch's rows beside ``output`` (``fixed_size_list<float32>``)."""


def batch_table(batch: ScoredBatch) -> pa.Table:
    """The rows of a batch as Arrow: one per item, ``output`` as ``fixed_size_list<float32>``."""
    mat = batch.matrix()
    n, dim = mat.shape
    output = pa.FixedSizeListArray.from_arrays(pa.array(mat.reshape(-1), pa.float32()), dim)
    scored_us = round(batch.scored_at * 1_000_000)
    columns: dict[str, object] = {
        "item_key": models.item_column(batch.items, "item_key"),
        "output": output,
        "scored_at": pa.array([scored_us] * n, pa.timestamp("us", tz="UTC")),
        "run_id": [batch.run_id] * n,
        "batch_id": [batch.batch_id] * n,
        "queue": models.item_column(batch.items, "queue"),
        "tenant": models.item_column(batch.items, "tenant"),
    }
    meta = {"batching.model_version": batch.model_version, "batching.run_id": batch.run_id}
    return pa.table(columns).replace_schema_metadata(meta)


@dataclass(frozen=True, slots=True)
class Staged:
    """A scored batch after step 1, ready to record: where its rows go (``location``: a path
    relative to the dataset root, a table, a table URI), and what the sink staged for it: a
    staging file (``path``, its size and sha256), or its rows as Arrow IPC bytes for the
    outbox (``body``)."""

    batch: ScoredBatch
    location: str
    path: Path | None = None
    n_bytes: int | None = None
    sha256: str | None = None
    body: bytes | None = None


class SinkDescription(TypedDict):
    """A sink's output dataset for lineage: kind, location, OpenLineage namespace and name
    (credentials stripped), and ``(column, type)`` fields."""

    kind: str
    location: str
    namespace: str
    name: str
    fields: list[tuple[str, str]]


class Sink(Protocol):
    """An output that commits scored batches exactly once in effect, and answers for itself.

    ``kind`` is what the ledger's ``sink`` column says of its batches; ``fence`` the queue's
    side of its commits.
    """

    kind: str
    fence: ports.Fence

    # -- a commit, composed by :func:`commit` -----------------------------------------------

    def stage(self, batch: ScoredBatch) -> Staged:
        """Step 1: make ``batch`` durable outside the transaction, if this sink needs to."""
        ...

    def record(self, conn: Connection, staged: Staged) -> outcomes.CommitResult:
        """Step 2, in the queue's transaction after the ack: the ledger row and what commits
        with it. Raises ``QueueError`` (nothing committed)."""
        ...

    def publish_staged(self, staged: Staged) -> bool:
        """Step 3, after the commit: make it visible; False leaves it for ``recover()``."""
        ...

    def discard(self, staged: Staged) -> None:
        """The lease was lost at step 2: remove what step 1 staged."""
        ...

    def commit(self, batch: ScoredBatch) -> outcomes.CommitResult:
        """The three steps (:func:`commit` with this sink's fence)."""
        ...

    def flush(self) -> None:
        """Record what the sink deferred (the scorer calls it when idle and at the end)."""
        ...

    def unpublished(self) -> str | None:
        """At a run's end: why committed batches are not in the output yet (one line), or None."""
        ...

    # -- life cycle --------------------------------------------------------------------------

    def preflight(self) -> None:
        """Raise ``SinkError`` when the output cannot be written (checked before a run claims)."""
        ...

    def check_owner(self) -> None:
        """Raise ``ConfigError`` when the output is another database's (reconcile, before it
        judges; a scorer's ``preflight`` records this database as a new output's owner)."""
        ...

    def recover(self) -> outcomes.RecoverResult:
        """Finish what a crash interrupted: roll ``committed`` batches forward, clear staging."""
        ...

    def describe(self) -> SinkDescription:
        """The output dataset, for lineage."""
        ...

    def maintain(self, *, vacuum_retention_h: float | None = None) -> dict[str, object]:
        """Housekeeping of the output (a Delta table's checkpoint, compaction and vacuum);
        returns what was done, empty when the sink needs none."""
        ...

    # -- reconcile (see batching.facts) ------------------------------------------------------

    def owns(self) -> sa.ColumnElement[bool]:
        """The ledger rows (``schema.batches``) whose outputs this sink judges."""
        ...

    def survey(self, since: float | None = None) -> facts.Survey:
        """What a reader sees now; called before the ledger is read. ``since``: only what was
        written since then need be listed (a sink that lists files may skip older
        partitions; a scoped reconcile looks for orphans there only); None: everything."""
        ...

    def observe(
        self, conn: Connection, survey: facts.Survey, rows: Sequence[Row[tuple[object, ...]]]
    ) -> facts.Observed:
        """What the ledger says of the survey, in reconcile's snapshot."""
        ...

    def inspect(
        self,
        rows: Sequence[Row[tuple[object, ...]]],
        done: Sequence[facts.DoneItem],
        observed: facts.Observed,
        *,
        dataset_lost: bool = False,
    ) -> facts.OutputFacts:
        """Each ledger row checked against the output, and which done items have theirs."""
        ...

    def publish(self, batch_id: str) -> bool:
        """Roll a ``committed`` batch forward (a repair); False when there is nothing to do."""
        ...

    def set_aside(self, files: Sequence[str], batch_ids: Sequence[str]) -> list[str]:
        """Move an orphan or corrupt output out of readers' sight, never deleting data (files
        to a quarantine folder; a table's rows of ``batch_ids`` to a quarantine table);
        returns where each went."""
        ...

    def drop_rows(self, batch_id: str, keys: Sequence[str]) -> str | None:
        """Remove the rows of ``keys`` from a live batch (duplicates); returns the id of the
        batch now holding the rest, None when none is left (or another repair won)."""
        ...


def commit(fence: ports.Fence, sink: Sink, batch: ScoredBatch) -> outcomes.CommitResult:
    """Commit ``batch`` to ``sink`` exactly once in effect (see the module docstring).

    Raises:
        LeaseLost: the lease no longer holds every item; nothing was committed and what was
            staged is gone.
        SinkError: step 1 failed (nothing committed).
        QueueError: the database failed at step 2: nothing committed, or (a COMMIT whose
            answer was lost) committed without this process knowing. The ledger decides:
            a staging file is left for ``recover()``, which rolls a committed batch forward.
    """
    started = time.perf_counter()
    staged = sink.stage(batch)
    ids = models.item_column(batch.items, "id")
    try:
        with fence.begin() as conn:
            fence.ack_all_or_raise(conn, batch.lease_id, ids, batch.batch_id)
            result = sink.record(conn, staged)
    except errors.LeaseLost:
        sink.discard(staged)
        logger.warning(
            "batch discarded: lease lost",
            extra={"action": "lease_lost", "batch_id": batch.batch_id, "sink": sink.kind},
        )
        raise
    if not result.published:  # else nothing is left to do: a table in the queue's database
        result = dataclasses.replace(result, published=sink.publish_staged(staged))
    logger.info(
        "batch committed",
        extra={
            "action": "batch_committed",
            "sink": sink.kind,
            "batch_id": batch.batch_id,
            "n_items": len(ids),
            "n_replayed": result.n_replayed,
            "n_bytes": result.n_bytes,
            "published": result.published,
            "duration_s": time.perf_counter() - started,
        },
    )
    return result


class FencedSink:
    """The part of a sink that is the same for all: ``commit`` through its fence."""

    fence: ports.Fence

    def commit(self: Sink, batch: ScoredBatch) -> outcomes.CommitResult:
        """Stage, record with the ack, publish (:func:`commit`)."""
        return commit(self.fence, self, batch)

    def unpublished(self) -> str | None:
        """None: a commit publishes (a deferred publish mark is recorded later)."""
        return None

    def check_owner(self) -> None:
        """Nothing to check: a table's rows are keyed by queue and version."""


@dataclass
class Outputs:
    """The scoring loop's commit port (:class:`~batching.ports.CommitPort`): a sink, and the
    run and model version every batch of the run is recorded with."""

    sink: Sink
    run_id: str
    model_version: str

    def commit(
        self,
        items: Sequence[models.WorkItem],
        lease_id: str,
        outputs: Mapping[int, npt.NDArray[np.float32]],
        scored_at: float,
        model_version: str | None = None,
        forwards: Mapping[str, Sequence[int]] | None = None,
    ) -> outcomes.CommitResult:
        """Commit one lease's scored items, as scored by ``model_version`` (None: the run's
        own; a routed run's other version) in the forward passes ``forwards`` (the sink's
        ``commit``: :func:`commit`)."""
        version = model_version or self.model_version
        batch = ScoredBatch(
            items, outputs, lease_id, self.run_id, version, scored_at, forwards=forwards or {}
        )
        return self.sink.commit(batch)

    def flush(self) -> None:
        self.sink.flush()

    def recover(self) -> outcomes.RecoverResult:
        """The sink's ``recover()``, as at start-up: the ledger decides each staged batch."""
        return self.sink.recover()


def refuse_missing_output(
    rows: Sequence[Row[tuple[object, ...]]], missing: str, queue: str, check: str
) -> None:
    """Reconcile found no output (``missing`` says what), yet the ledger has published
    batches there: a wrong setting would read as every batch lost, and ``--repair`` would
    rescore them all. ``check`` names the settings to look at.

    Raises:
        ConfigError: there are such batches.
    """
    published = [r for r in rows if r.state == models.BatchState.PUBLISHED]
    if published:
        raise errors.ConfigError(
            f"{missing}, but the ledger has {len(published)} published batch(es) of queue "
            f"{queue!r} there: check {check}; if it was deleted, reconcile with "
            "--dataset-lost to judge (and with --repair requeue) them"
        )


@contextlib.contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Turn OS and pyarrow errors into ``SinkError`` naming ``what`` (the one place it happens)."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise errors.SinkError(f"{what}: {exc}") from exc
