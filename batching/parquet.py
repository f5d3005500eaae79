"""The Parquet dataset sink: a Hive-partitioned dataset where a visible file is always a
committed file.

Layout::

    <root>/date=YYYY-MM-DD/model_version=<v>/part-<batch_id>.parquet   committed, published
    <root>.staging/<batch_id>.<lease_id>.parquet.tmp                   written, not yet published
    <root>.quarantine/<relative path>                                  moved aside by reconcile

A commit (1) writes the batch to the staging folder (outside the dataset root, so no reader's
``**/*.parquet`` glob sees it) and fsyncs it, (2) acks the items and inserts the ledger row
(state ``committed``) in one transaction, (3) renames the file into the dataset, fsyncs the
folder and marks the row ``published`` (at once, or with the next commit: ``defer_marks``).
``recover()`` rolls (3) forward after a crash and deletes staging files that no ledger row
names once their lease is gone (their items are re-scored). ``date`` and ``model_version`` are
Hive partition columns: they live in the path, not in the file, so ``pyarrow.dataset`` and
DuckDB read them without a type conflict.

The shared value types, ledger states and error translation live in :mod:`batching.sinks`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import quote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import errors, models, schema, sinks

if TYPE_CHECKING:
    from batching.queue import SqlQueue

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".parquet.tmp"
REWRITE = "rewrite"
"""The lease part of a staging file that reconcile's duplicate repair writes (``drop_rows``):
no claim holds it, so without a rule of its own a scorer starting meanwhile would sweep it."""
REWRITE_GRACE_S = 600.0
"""A rewrite's staging file younger than this is in flight; older, its repair died."""
_HASH_CHUNK = 1 << 20
_LEDGER = schema.batches


# ----------------------------------------------------------------------------- file layout


@dataclass(frozen=True, slots=True)
class ParquetLayout:
    """Where a Parquet dataset keeps committed, staged and quarantined files (absolute paths).

    Staging and quarantine are siblings of the root by default: outside it, so a reader's
    ``root/**/*.parquet`` glob never matches them, and on the same filesystem, so a rename is
    atomic.
    """

    root: Path
    staging: Path
    quarantine: Path

    @classmethod
    def for_root(cls, root: str | Path, staging: str | Path | None = None) -> ParquetLayout:
        """The layout of dataset ``root``; raises ``ConfigError`` if staging is inside it."""
        base = Path(root).expanduser().absolute()
        stage = Path(staging).expanduser().absolute() if staging else _sibling(base, "staging")
        if stage == base or base in stage.parents:
            raise errors.ConfigError(
                f"staging folder {stage} is inside the dataset root {base}; readers would see "
                "uncommitted files. Put it beside the root (the default)"
            )
        return cls(base, stage, _sibling(base, "quarantine"))

    def relative_path(self, batch_id: str, model_version: str, scored_at: float) -> str:
        """``date=YYYY-MM-DD/model_version=<v>/part-<batch_id>.parquet`` (UTC day of scoring)."""
        day = datetime.fromtimestamp(scored_at, UTC).strftime("%Y-%m-%d")
        version = quote(model_version, safe="")
        return f"date={day}/model_version={version}/part-{batch_id}.parquet"

    def staging_file(self, batch_id: str, lease_id: str) -> Path:
        """The staging file of a batch; its name carries the lease that may commit it."""
        return self.staging / f"{batch_id}.{lease_id}{STAGING_SUFFIX}"

    def visible_files(self) -> list[str]:
        """Every ``*.parquet`` file a reader's glob sees, as POSIX paths relative to the root."""
        if not self.root.is_dir():
            return []
        found = (p for p in self.root.rglob("*.parquet") if p.is_file())
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def staging_files(self) -> list[Path]:
        """Every file in the staging folder."""
        if not self.staging.is_dir():
            return []
        return sorted(p for p in self.staging.iterdir() if p.is_file())

    def quarantine_file(self, path: Path) -> Path:
        """Move ``path`` into the quarantine folder (never deleted); returns where it went."""
        if self.staging in path.parents:
            rel = Path("staging") / path.name
        else:
            rel = path.relative_to(self.root)
        dest = self.quarantine / rel
        n = 0
        while dest.exists():
            n += 1
            dest = self.quarantine / f"{rel}.{n}"
        with sinks.translate_errors(f"cannot quarantine {path}"):
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, dest)
        logger.warning("file quarantined", extra={"action": "quarantine", "path": str(dest)})
        return dest


def parse_staging_name(name: str) -> tuple[str, str] | None:
    """``(batch_id, lease_id)`` from a staging file name, or None when it is not one of ours."""
    if not name.endswith(STAGING_SUFFIX):
        return None
    parts = name[: -len(STAGING_SUFFIX)].split(".")
    if len(parts) != 2 or not all(sinks.SAFE_ID.match(p) for p in parts):
        return None
    return parts[0], parts[1]


def _sibling(root: Path, what: str) -> Path:
    return root.parent / f"{root.name}.{what}"


def rewrite_in_flight(path: Path, lease_id: str) -> bool:
    """A duplicate repair's staging file, written moments ago: its commit may follow."""
    if lease_id != REWRITE:
        return False
    try:
        return time.time() - path.stat().st_mtime < REWRITE_GRACE_S
    except FileNotFoundError:
        return False


def held_leases(conn: Connection, lease_ids: Collection[str]) -> set[str]:
    """Those of ``lease_ids`` that still hold at least one leased item (a commit may follow)."""
    if not lease_ids:
        return set()
    t = schema.items
    q = sa.select(t.c.lease_id).where(
        t.c.state == int(models.State.LEASED), t.c.lease_id.in_(list(lease_ids))
    )
    return {str(r[0]) for r in conn.execute(q.distinct())}


def check_file(
    path: Path, *, n_rows: int, n_bytes: int | None, sha256: str | None
) -> tuple[str | None, frozenset[str]]:
    """Read a committed file back against its ledger row, through one open file: a rename
    under way (staging to dataset) cannot make a good file look unreadable half-way.

    Returns ``(problem, item_keys)``: ``problem`` is None when the size (bytes), sha256 and row
    count match and the file is readable; otherwise a reason, and ``item_keys`` is empty.

    Raises:
        FileNotFoundError, IsADirectoryError, NotADirectoryError: no file at ``path`` (look
            for it elsewhere; it is not corrupt).
        PermissionError: this process may not read it (not corrupt either).
    """
    try:
        with path.open("rb") as f:
            size, digest = _digest(f)
            if n_bytes is not None and size != n_bytes:
                return f"{size} bytes, ledger says {n_bytes}", frozenset()
            if sha256 is not None and digest != sha256:
                return "sha256 differs from the ledger", frozenset()
            f.seek(0)
            keys = pq.ParquetFile(f).read(columns=["item_key"]).column(0).to_pylist()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        raise  # not here, or not ours to read: neither says the file is corrupt
    except (OSError, pa.ArrowException) as exc:
        return f"unreadable: {exc}", frozenset()
    if len(keys) != n_rows:
        return f"{len(keys)} rows, ledger says {n_rows}", frozenset()
    return None, frozenset(keys)


def _digest(f: BinaryIO) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_HASH_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- Parquet sink

_FILE_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("item_key", pa.string()),
    ("scored_at", pa.timestamp("us", tz="UTC")),
    ("run_id", pa.string()),
    ("batch_id", pa.string()),
    ("queue", pa.string()),
    ("tenant", pa.string()),
)


def batch_table(batch: sinks.ScoredBatch) -> pa.Table:
    """The Parquet rows of a batch: one per item, ``output`` as ``fixed_size_list<float32>``."""
    mat = batch.matrix()
    n, dim = mat.shape
    output = pa.FixedSizeListArray.from_arrays(pa.array(mat.reshape(-1), pa.float32()), dim)
    scored_us = round(batch.scored_at * 1_000_000)
    columns: dict[str, Any] = {
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


class ParquetSink:
    """A Hive-partitioned Parquet dataset where a visible file is always a committed file.

    Args:
        queue: the queue whose items are acked (and whose database holds the ledger).
        root: dataset root folder; created if missing.
        staging: staging folder (default ``<root>.staging``); must be outside the root and on
            the same filesystem.
        fsync: fsync files and folders (turn off only in tests that measure nothing durable).
        defer_marks: record "published" in the ledger inside the *next* commit's transaction
            (or ``flush()``) instead of a transaction of its own after every rename. The
            scorer turns it on: the extra transaction waited behind claims for the SQLite
            writer and cost ~10 ms a commit. A crash before the mark leaves a ``committed``
            row whose file is already in place; ``recover()`` (and reconcile's repair) marks it.

    Raises:
        ConfigError: staging is inside the root or on another filesystem.
        SinkError: the folders cannot be created.
    """

    kind = "parquet"

    def __init__(
        self,
        queue: SqlQueue,
        root: str | Path,
        *,
        staging: str | Path | None = None,
        fsync: bool = True,
        defer_marks: bool = False,
    ) -> None:
        self._queue = queue
        self.layout = ParquetLayout.for_root(root, staging)
        self._fsync = fsync
        self._defer_marks = defer_marks
        self._unmarked: list[str] = []  # published files whose ledger row says "committed"
        self._marks_lock = threading.Lock()  # a failed run's flush can race its commit stage
        with sinks.translate_errors(f"cannot create output folders for {self.layout.root}"):
            self.layout.root.mkdir(parents=True, exist_ok=True)
            self.layout.staging.mkdir(parents=True, exist_ok=True)
            same_fs = self.layout.root.stat().st_dev == self.layout.staging.stat().st_dev
        if not same_fs:
            raise errors.ConfigError(
                f"staging folder {self.layout.staging} is on another filesystem than "
                f"{self.layout.root}; a rename would not be atomic. Put them side by side"
            )

    def commit(self, batch: sinks.ScoredBatch) -> sinks.CommitResult:
        """Stage, commit (ack + ledger row in one transaction), then publish one batch.

        Returns the committed batch; ``published`` is False when only the rename failed.

        Raises:
            LeaseLost: the lease no longer holds every item; nothing was committed and the
                staging file was deleted.
            SinkError: the staging file could not be written; nothing was committed.
            QueueError: the database failed; the staging file is left for ``recover()``.
        """
        started = time.perf_counter()
        rel = self.layout.relative_path(batch.batch_id, batch.model_version, batch.scored_at)
        staged = self.layout.staging_file(batch.batch_id, batch.lease_id)
        n_bytes, digest = self._write_staging(batch_table(batch), staged)
        try:
            self._record(batch, rel, staged, n_bytes, digest)
        except errors.LeaseLost:
            self._discard(staged, batch.batch_id)
            raise
        published = self._try_publish(batch.batch_id, rel, staged)
        logger.info(
            "batch committed",
            extra={
                "action": "batch_committed",
                "batch_id": batch.batch_id,
                "n_items": len(batch.items),
                "n_bytes": n_bytes,
                "duration_s": time.perf_counter() - started,
            },
        )
        return sinks.CommitResult(batch.batch_id, len(batch.items), rel, n_bytes, published)

    def recover(self) -> sinks.RecoverResult:
        """Finish what a crash interrupted (call at scorer start-up).

        Publishes ledger rows still ``committed`` whose file is in this sink's staging folder
        or already renamed; deletes staging files that no ledger row names and whose lease
        holds no item any more (their items are re-scored); keeps those whose lease is held.
        """
        rolled = tuple(b for b in self._committed_batch_ids() if self.publish(b))
        removed, in_flight = self._sweep_staging()
        result = sinks.RecoverResult(rolled, removed, in_flight)
        logger.info(
            "sink recovered",
            extra={
                "action": "sink_recover",
                "n_rolled_forward": len(rolled),
                "n_removed_staging": len(removed),
                "n_in_flight": len(in_flight),
            },
        )
        return result

    def describe(self) -> sinks.SinkDescription:
        """Dataset kind, absolute root and the schema readers see (partition columns included)."""
        fields = [(n, str(t)) for n, t in _FILE_FIELDS]
        fields.insert(1, ("output", "fixed_size_list<float>"))
        fields += [("date", "string"), ("model_version", "string")]
        return {"kind": self.kind, "location": str(self.layout.root), "fields": fields}

    def publish(self, batch_id: str) -> bool:
        """Roll a ``committed`` batch forward: rename its staged file into place, mark it published.

        Returns False when the row is not ``committed`` or its file is in neither place here.
        """
        row = self._ledger_row(batch_id)
        if row is None or row.state != sinks.COMMITTED:
            return False
        staged = self.layout.staging / PurePath(row.staging_path or "").name
        final = self.layout.root / row.path
        if not (staged.is_file() or final.is_file()):
            return False
        self._publish(batch_id, row.path, staged)
        return True

    def drop_rows(self, batch_id: str, keys: Collection[str]) -> str | None:
        """Remove the rows of ``keys`` from a live batch (duplicates found by reconcile).

        The old row becomes ``superseded`` and its file goes to quarantine; the remaining
        rows, if any, are committed as a new batch (same run, lease and model version) whose id
        is returned, and items that pointed at the old batch are moved to it. The row is
        superseded only if it is still live, in the same transaction: of two repairs of one
        batch at once, the second changes nothing.
        """
        row = self._ledger_row(batch_id)
        if row is None or row.state not in sinks.LIVE_STATES:
            return None
        old = self.layout.root / row.path
        with sinks.translate_errors(f"cannot read {old}"):
            table = pq.ParquetFile(old).read()
        drop = pc.is_in(table["item_key"], value_set=pa.array(list(keys), pa.string()))
        kept = table.filter(pc.invert(drop))
        if kept.num_rows == 0:
            with self._queue.begin() as conn:
                won = _supersede(conn, batch_id, None, ())
            if won:
                self.layout.quarantine_file(old)
            return None
        return self._rewrite(row, kept, old)

    # -- steps of a commit ---------------------------------------------------------------

    def _write_staging(self, table: pa.Table, staged: Path) -> tuple[int, str]:
        """Step 1: write and fsync the staging file; returns (size in bytes, sha256)."""
        with sinks.translate_errors(f"cannot write staging file {staged}"):
            out = pa.BufferOutputStream()
            pq.write_table(table, out)
            buf = out.getvalue()
            staged.parent.mkdir(parents=True, exist_ok=True)
            try:
                with staged.open("wb") as f:
                    f.write(memoryview(buf))
                    f.flush()
                    if self._fsync:
                        os.fsync(f.fileno())
            except BaseException:
                staged.unlink(missing_ok=True)
                raise
            if self._fsync:
                _fsync_dir(staged.parent)
        return buf.size, hashlib.sha256(memoryview(buf)).hexdigest()

    def _record(
        self, batch: sinks.ScoredBatch, rel: str, staged: Path, n_bytes: int, digest: str
    ) -> None:
        """Step 2: ack the items and insert the ledger row in one transaction."""
        ids = models.item_column(batch.items, "id")
        marks = self._pending_marks()
        with self._queue.begin() as conn:
            self._queue.ack_all_or_raise(conn, batch.lease_id, ids, batch.batch_id)
            self._mark_published(conn, marks)
            conn.execute(
                _LEDGER.insert().values(
                    batch_id=batch.batch_id,
                    run_id=batch.run_id,
                    queue=self._queue.queue,
                    lease_id=batch.lease_id,
                    model_version=batch.model_version,
                    sink=self.kind,
                    path=rel,
                    staging_path=str(staged),
                    n_rows=len(ids),
                    n_bytes=n_bytes,
                    sha256=digest,
                    state=sinks.COMMITTED,
                    committed_at=self._queue.clock(),
                )
            )
        self._marked(marks)

    def flush(self) -> None:
        """Record the deferred "published" marks now (the scorer calls it when a run ends)."""
        marks = self._pending_marks()
        if not marks:
            return
        with self._queue.begin() as conn:
            self._mark_published(conn, marks)
        self._marked(marks)

    def _pending_marks(self) -> list[str]:
        with self._marks_lock:
            return list(self._unmarked)

    def _marked(self, batch_ids: list[str]) -> None:
        done = set(batch_ids)
        with self._marks_lock:
            self._unmarked = [b for b in self._unmarked if b not in done]

    def _mark_published(self, conn: Connection, batch_ids: list[str]) -> None:
        if batch_ids:
            conn.execute(
                _LEDGER.update()
                .where(_LEDGER.c.batch_id.in_(batch_ids), _LEDGER.c.state == sinks.COMMITTED)
                .values(state=sinks.PUBLISHED, published_at=self._queue.clock())
            )

    def _try_publish(self, batch_id: str, rel: str, staged: Path) -> bool:
        """Step 3, after the commit: a failure leaves the batch for ``recover()``."""
        try:
            self._publish(batch_id, rel, staged, defer=self._defer_marks)
        except (errors.SinkError, errors.QueueError):
            logger.exception(
                "batch committed but not published",
                extra={"action": "publish_failed", "batch_id": batch_id},
            )
            return False
        return True

    def _publish(self, batch_id: str, rel: str, staged: Path, *, defer: bool = False) -> None:
        """Rename the staged file into the dataset (idempotent), fsync, mark the row published
        (now, or with the next commit when ``defer``)."""
        final = self.layout.root / rel
        with sinks.translate_errors(f"cannot publish {final}"):
            self._move_into_place(staged, final)
        if defer:
            with self._marks_lock:
                self._unmarked.append(batch_id)
            return
        with self._queue.begin() as conn:
            self._mark_published(conn, [batch_id])

    def _move_into_place(self, staged: Path, final: Path) -> None:
        if final.is_file() and not staged.exists():
            return
        self._make_dirs(final.parent)
        try:
            os.replace(staged, final)
        except FileNotFoundError:
            if not final.is_file():  # not renamed meanwhile by a concurrent recover
                raise
        if self._fsync:
            _fsync_dir(final.parent)

    def _make_dirs(self, folder: Path) -> None:
        """Create ``folder`` and missing parents, fsyncing each new entry's parent."""
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for path in reversed(missing):
            path.mkdir(exist_ok=True)
            if self._fsync:
                _fsync_dir(path.parent)

    def _discard(self, staged: Path, batch_id: str) -> None:
        with sinks.translate_errors(f"cannot delete staging file {staged}"):
            staged.unlink(missing_ok=True)
        logger.warning(
            "batch discarded: lease lost", extra={"action": "lease_lost", "batch_id": batch_id}
        )

    # -- recovery and rewrites -----------------------------------------------------------

    def _committed_batch_ids(self) -> list[str]:
        q = sa.select(_LEDGER.c.batch_id).where(
            _LEDGER.c.sink == self.kind, _LEDGER.c.state == sinks.COMMITTED
        )
        with self._queue.begin() as conn:
            return [str(r[0]) for r in conn.execute(q.order_by(_LEDGER.c.committed_at))]

    def _sweep_staging(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        with sinks.translate_errors(f"cannot list {self.layout.staging}"):
            staged = {p: parse_staging_name(p.name) for p in self.layout.staging_files()}
        ours = {p: parsed for p, parsed in staged.items() if parsed is not None}
        with self._queue.begin() as conn:
            # Leases first: a commit (ack and ledger row together) landing between the two
            # reads (separate snapshots on PostgreSQL) then shows as held or as known, never
            # as neither, which would delete a file its scorer is about to publish.
            held = held_leases(conn, {lease for _, lease in ours.values()})
            known = _known_batches(conn, [b for b, _ in ours.values()])
        removed, in_flight = [], []
        for path, (batch_id, lease_id) in ours.items():
            if batch_id in known:
                continue  # a ledger row names it: roll-forward or reconcile decides
            if lease_id in held or rewrite_in_flight(path, lease_id):
                in_flight.append(path.name)
                continue
            with sinks.translate_errors(f"cannot delete staging file {path}"):
                path.unlink(missing_ok=True)
            removed.append(path.name)
        return tuple(removed), tuple(in_flight)

    def _ledger_row(self, batch_id: str) -> Any:
        with self._queue.begin() as conn:
            return conn.execute(_LEDGER.select().where(_LEDGER.c.batch_id == batch_id)).first()

    def _rewrite(self, row: Any, kept: pa.Table, old: Path) -> str | None:
        """Commit ``kept`` as a new batch replacing ``row``; quarantine the old file. None when
        another repair superseded ``row`` first (its staged file is then deleted)."""
        new_id = str(uuid.uuid4())
        index = kept.schema.get_field_index("batch_id")
        kept = kept.set_column(index, "batch_id", pa.array([new_id] * kept.num_rows))
        rel = str(PurePath(row.path).with_name(f"part-{new_id}.parquet").as_posix())
        staged = self.layout.staging_file(new_id, REWRITE)
        n_bytes, digest = self._write_staging(kept, staged)
        keys = kept.column("item_key").to_pylist()
        values = dict(row._mapping)
        values |= {"batch_id": new_id, "path": rel, "staging_path": str(staged)}
        values |= {"n_rows": len(keys), "n_bytes": n_bytes, "sha256": digest}
        values |= {"state": sinks.COMMITTED, "committed_at": self._queue.clock()}
        values |= {"published_at": None}
        with self._queue.begin() as conn:
            won = _supersede(conn, row.batch_id, new_id, keys)
            if won:
                conn.execute(_LEDGER.insert().values(**values))
        if not won:
            with sinks.translate_errors(f"cannot delete staging file {staged}"):
                staged.unlink(missing_ok=True)
            logger.warning(
                "batch already repaired by another reconcile",
                extra={"action": "repair_skipped", "batch_id": row.batch_id},
            )
            return None
        self.layout.quarantine_file(old)
        self._publish(new_id, rel, staged)
        return new_id


def _known_batches(conn: Connection, batch_ids: Sequence[str]) -> set[str]:
    if not batch_ids:
        return set()
    q = sa.select(_LEDGER.c.batch_id).where(_LEDGER.c.batch_id.in_(list(batch_ids)))
    return {str(r[0]) for r in conn.execute(q)}


def _supersede(conn: Connection, old_id: str, new_id: str | None, keys: Sequence[str]) -> bool:
    """Mark ``old_id`` superseded if it is still live, moving ``keys``' items to ``new_id``;
    False (nothing changed) when it is not: another repair got there first."""
    live = _LEDGER.c.state.in_(sinks.LIVE_STATES)
    won = conn.execute(
        _LEDGER.update().where(_LEDGER.c.batch_id == old_id, live).values(state=sinks.SUPERSEDED)
    ).rowcount
    if won and new_id is not None and keys:
        t = schema.items
        conn.execute(
            t.update()
            .where(t.c.batch_id == old_id, t.c.item_key.in_(list(keys)))
            .values(batch_id=new_id)
        )
    return bool(won)
