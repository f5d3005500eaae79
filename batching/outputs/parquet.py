"""The Parquet dataset sink: a Hive-partitioned dataset where a visible file is always a
committed file (the layout: :mod:`batching.outputs.parquet_layout`).

A commit (``sinks.commit``) (1) writes the batch to the staging folder (outside the dataset
root, so no reader's ``**/*.parquet`` glob sees it) and fsyncs it, (2) acks the items and
inserts the ledger row (state ``committed``, naming the file, its size and sha256) in one
transaction, (3) renames the file into the dataset, fsyncs the folder and marks the row
``published`` (at once, or with the next commit: ``defer_marks``). ``recover()`` rolls (3)
forward after a crash and deletes staging files that no ledger row names once their lease is
gone (their items are re-scored).

For reconcile it lists the files readers see and the staging folder before the ledger is
read, checks each ledger row's file (size, sha256, rows, keys) after, and finds batches whose
file lives in another dataset root (another config's ``output.path``): those are judged
there, not here.

Why it stays one module: the commit's three steps, start-up recovery and reconcile's checks
reason about the same three folders and the same ledger row per file (the layout itself is
``parquet_layout``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePath
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from batching import errors, facts, models, naming, outcomes, ports
from batching.outputs import contract as sinks
from batching.outputs import ledger
from batching.outputs.parquet_layout import (
    REWRITE,
    ParquetLayout,
    check_file,
    check_owner,
    fsync_dir,
    parse_staging_name,
    rewrite_in_flight,
    unsafe_row,
)
from batching.store import retention, schema

logger = logging.getLogger(__name__)

_DAY_S = 86_400.0
_B = schema.batches


class ParquetSink(sinks.FencedSink):
    """A Hive-partitioned Parquet dataset where a visible file is always a committed file.

    Args:
        fence: the queue's side of a commit (``SqlQueue``): its database holds the ledger.
        root: dataset root folder; created if missing.
        staging: staging folder (default ``<root>.staging``); must be outside the root and on
            the same filesystem.
        fsync: fsync files and folders (turn off only in tests that measure nothing durable).
        defer_marks: record "published" in the ledger inside the *next* commit's transaction
            (or ``flush()``) instead of a transaction of its own after every rename. The
            scorer turns it on: the extra transaction waited behind claims for the SQLite
            writer and cost ~10 ms a commit. A crash before the mark leaves a ``committed``
            row whose file is already in place; ``recover()`` (and reconcile's repair) marks it.

    ``create``: make the folders now; else at the first write (``stage``, ``preflight``), so
    a sink opened to be read (reconcile) creates nothing.

    Raises:
        ConfigError: staging is inside the root (or, at the first write, on another
            filesystem).
        SinkError: the folders cannot be created (at the first write).
    """

    kind = "parquet"

    def __init__(
        self,
        fence: ports.Fence,
        root: str | Path,
        *,
        staging: str | Path | None = None,
        fsync: bool = True,
        defer_marks: bool = False,
        create: bool = True,
    ) -> None:
        self.fence = fence
        self.layout = ParquetLayout.for_root(root, staging)
        self._fsync = fsync
        self._defer_marks = defer_marks
        self._unmarked: list[str] = []  # published files whose ledger row says "committed"
        self._taken: dict[str, list[str]] = {}  # marks a commit's transaction recorded
        self._marks_lock = threading.Lock()  # a failed run's flush can race its commit stage
        self._folders = False
        if create:
            self._ensure_folders()

    def _ensure_folders(self) -> None:
        """Create the root and staging folders (once), on one filesystem.

        Raises:
            ConfigError: staging is on another filesystem than the root.
            SinkError: they cannot be created.
        """
        if self._folders:
            return
        with sinks.translate_errors(f"cannot create output folders for {self.layout.root}"):
            self.layout.root.mkdir(parents=True, exist_ok=True)
            self.layout.staging.mkdir(parents=True, exist_ok=True)
            same_fs = self.layout.root.stat().st_dev == self.layout.staging.stat().st_dev
        if not same_fs:
            raise errors.ConfigError(
                f"staging folder {self.layout.staging} is on another filesystem than "
                f"{self.layout.root}; a rename would not be atomic. Put them side by side"
            )
        self._folders = True

    # -- a commit (sinks.commit) ---------------------------------------------------------

    def stage(self, batch: sinks.ScoredBatch) -> sinks.Staged:
        """Step 1: write and fsync the batch's staging file."""
        self._ensure_folders()
        rel = self.layout.relative_path(batch.batch_id, batch.model_version, batch.scored_at)
        path = self.layout.staging_file(batch.batch_id, batch.lease_id)
        n_bytes, digest = self._write_staging(batch.table(), path)
        return sinks.Staged(batch, rel, path, n_bytes, digest)

    def record(self, conn: Connection, staged: sinks.Staged) -> outcomes.CommitResult:
        """Step 2: the ledger row (``committed``), and the published marks deferred so far."""
        marks = self._pending_marks()
        ledger.mark_published(conn, marks, self.fence.clock())
        ledger.insert(conn, ledger.row_values(self.fence, self.kind, staged))
        with self._marks_lock:
            self._taken[staged.batch.batch_id] = marks
        n = len(staged.batch.items)
        return outcomes.CommitResult(
            staged.batch.batch_id, n, staged.location, staged.n_bytes, published=False
        )

    def publish_staged(self, staged: sinks.Staged) -> bool:
        """Step 3: rename into the dataset; False when only the ledger's mark failed (the
        file is visible; ``recover()`` records the mark).

        Raises:
            SinkError: the rename failed. The batch is committed (its items acked) but readers
                do not see it, so the run must stop rather than ack more into an output that
                refuses them; the next start, or ``reconcile --repair``, publishes it.
        """
        with self._marks_lock:
            taken = self._taken.pop(staged.batch.batch_id, [])
        self._marked(taken)
        assert staged.path is not None
        batch_id = staged.batch.batch_id
        try:
            self._publish(batch_id, staged.location, staged.path, defer=self._defer_marks)
        except errors.SinkError as exc:
            logger.error(
                "batch committed but not published",
                extra={"action": "publish_failed", "batch_id": batch_id, "error": str(exc)},
            )
            raise errors.SinkError(
                f"batch {batch_id} is committed but not published ({exc}); scoring stops. "
                "Fix the output folder; the next run's start or `batching reconcile --repair` "
                "publishes it"
            ) from exc
        except errors.QueueError:
            logger.warning(
                "batch published; its ledger mark is left for recovery",
                extra={"action": "publish_mark_failed", "batch_id": batch_id},
                exc_info=True,
            )
            return False
        return True

    def discard(self, staged: sinks.Staged) -> None:
        """The lease was lost: delete the staging file."""
        with self._marks_lock:
            self._taken.pop(staged.batch.batch_id, None)
        assert staged.path is not None
        with sinks.translate_errors(f"cannot delete staging file {staged.path}"):
            staged.path.unlink(missing_ok=True)

    def flush(self) -> None:
        """Record the deferred "published" marks now (the scorer calls it when a run ends)."""
        marks = self._pending_marks()
        if not marks:
            return
        with self.fence.begin() as conn:
            ledger.mark_published(conn, marks, self.fence.clock())
        self._marked(marks)

    # -- life cycle ------------------------------------------------------------------------

    def preflight(self) -> None:
        """Write and drop an unnamed file where this sink stages its files, and record this
        database as the dataset's owner unless another one is.

        Raises:
            SinkError: the staging folder is not writable.
            ConfigError: the dataset is another database's, or a Delta table.
        """
        if self.layout.root.is_dir():  # another's, or a Delta table: refused before a mkdir
            self._check_owner(claim=False)
        self._ensure_folders()
        folder = self.layout.staging
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            raise errors.SinkError(
                f"output location {folder} is not writable ({exc.strerror}); fix its permissions"
            ) from None
        self._check_owner(claim=True)

    def check_owner(self) -> None:
        """Refuse a dataset another database's scorers write (``parquet_layout.OWNER_FILE``).

        Raises:
            ConfigError: it is another database's, or a Delta table.
        """
        if self.layout.root.is_dir():
            self._check_owner(claim=False)

    def _check_owner(self, *, claim: bool) -> None:
        check_owner(self.layout.root, self.fence.database_id, claim=claim)

    def recover(self) -> outcomes.RecoverResult:
        """Finish what a crash interrupted (call at scorer start-up).

        Publishes ledger rows still ``committed`` whose file is in this sink's staging folder
        or already renamed; deletes staging files that no ledger row names and whose lease
        holds no item any more (their items are re-scored); keeps those whose lease is held.
        """
        with self.fence.begin() as conn:
            pending = [str(r.batch_id) for r in ledger.committed(conn, self.owns())]
        rolled = tuple(b for b in pending if self.publish(b))
        removed, in_flight = self._sweep_staging()
        result = outcomes.RecoverResult(rolled, removed, in_flight)
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
        fields = [(n, str(t)) for n, t in sinks.FILE_FIELDS]
        fields.insert(1, ("output", "fixed_size_list<float>"))
        fields += [("date", "string"), ("model_version", "string")]
        namespace, name = naming.file_dataset_id(self.layout.root)
        location = str(self.layout.root)
        return {
            "kind": self.kind,
            "location": location,
            "namespace": namespace,
            "name": name,
            "fields": fields,
        }

    def maintain(self, *, vacuum_retention_h: float | None = None) -> dict[str, object]:
        """Nothing to compact or vacuum: one file per commit, each its own batch."""
        return {}

    def publish(self, batch_id: str) -> bool:
        """Roll a ``committed`` batch forward: rename its staged file into place, mark it published.

        Returns False when the row is not ``committed`` or its file is in neither place here.
        """
        with self.fence.begin() as conn:
            row = ledger.row(conn, batch_id)
        if row is None or row.state != models.BatchState.COMMITTED or self._unsafe(row):
            return False
        staged = self.layout.staging / PurePath(row.staging_path or "").name
        final = self.layout.root / row.path
        if not (staged.is_file() or final.is_file()):
            return False
        self._publish(batch_id, row.path, staged)
        return True

    # -- reconcile (batching.facts) ----------------------------------------------------------

    def owns(self) -> sa.ColumnElement[bool]:
        """Every Parquet batch: one written to another dataset root is found in ``inspect``."""
        return _B.c.sink == self.kind

    def survey(self, since: float | None = None) -> facts.Survey:
        """The files a reader's glob sees, and the staging folder, listed now; with ``since``,
        only the ``date=`` partitions from the day before it on (a batch's partition is the day
        it was scored, before its commit)."""
        after = None if since is None else since - _DAY_S
        with sinks.translate_errors(f"cannot list {self.layout.root}"):
            visible = tuple(str(self.layout.root / p) for p in self.layout.visible_files(after))
            return facts.Survey(visible, tuple(self.layout.staging_files()))

    def visible_after(self, after: str | None) -> Iterator[str]:
        """Visible files in walk order, after ``after`` (the full sweep's listing)."""
        parts = self.walk_key(after) if after is not None else ()
        with sinks.translate_errors(f"cannot list {self.layout.root}"):
            for found in self.layout.walk_visible(parts):
                yield str(self.layout.root.joinpath(*found))

    def walk_key(self, path: str) -> tuple[str, ...]:
        return Path(path).relative_to(self.layout.root).parts

    def staging_survey(self) -> facts.Survey:
        """The staging folder, listed now."""
        with sinks.translate_errors(f"cannot list {self.layout.staging}"):
            return facts.Survey((), tuple(self.layout.staging_files()))

    def observe(
        self, conn: Connection, survey: facts.Survey, rows: Sequence[Row[Any]]
    ) -> facts.Observed:
        """The ledger state of each visible file; each staging file's batch and lease. A file
        without a ledger row in a ``date=`` partition before the ledger horizon's day is left
        out: its row may be one retention purged (``batching.store.retention``)."""
        visible = self._visible_states(conn, survey.visible)
        at = retention.horizon(conn, None)  # any queue's: queues may share a dataset
        kept = {p: s for p, s in visible.items() if s is not None or not self._excused(p, at)}
        return facts.Observed(
            visible=kept,
            staging=tuple(self._staging_facts(conn, survey.staged)),
            output_empty=False if len(kept) < len(visible) else None,
        )

    def _excused(self, path: str, at: float | None) -> bool:
        first = Path(path).relative_to(self.layout.root).parts[0]
        return first.startswith("date=") and retention.excused(first.removeprefix("date="), at)

    def inspect(
        self,
        rows: Sequence[Row[Any]],
        done: Sequence[facts.DoneItem],
        observed: facts.Observed,
        *,
        dataset_lost: bool = False,
    ) -> facts.OutputFacts:
        """Each ledger row's file checked (staging first, then the dataset).

        Raises:
            ConfigError: the root holds no file and no live batch in scope has its file
                here: a wrong ``output.path`` would read as every file lost (``--repair``
                would rescore them all). ``dataset_lost`` judges them anyway: those written
                under this root, not those whole under the root they were written to.
        """
        with sinks.translate_errors(f"cannot read {self.layout.root}"):
            batches = tuple(self._check_batch(r) for r in rows)
            still = tuple(s for s in observed.staging if Path(s.path).exists())
        empty = not observed.visible if observed.output_empty is None else observed.output_empty
        if empty and not dataset_lost:
            self._refuse_empty_dataset(rows, batches)
        # A batch missing here but whole in the root it was written to (another config's
        # output.path, or --output) is that dataset's: judged here it read as a missing file,
        # and --repair scored its items again, into this dataset. With ``dataset_lost`` too:
        # this root's dataset was lost, not that one (which --repair then doubled).
        elsewhere = [
            b.where == "missing" and self._kept_elsewhere(r)
            for r, b in zip(rows, batches, strict=True)
        ]
        others = Counter(
            _written_under(r.staging_path) for r, e in zip(rows, elsewhere, strict=True) if e
        )
        if others and observed.visible:
            self._refuse_foreign_dataset(rows, batches, elsewhere, others)
        return facts.OutputFacts(
            batches=tuple(b for b, e in zip(batches, elsewhere, strict=True) if not e),
            done=tuple(done),
            foreign_batches=frozenset(
                r.batch_id for r, e in zip(rows, elsewhere, strict=True) if e
            ),
            visible=observed.visible,
            staging=still,
            other_datasets=others,
        )

    def set_aside(self, files: Sequence[str], batch_ids: Sequence[str]) -> list[str]:
        """Move the files that are still there into the quarantine folder (never deleted)."""
        there = [Path(p) for p in files if Path(p).exists()]
        return [str(self.layout.quarantine_file(p)) for p in there]

    def drop_rows(self, batch_id: str, keys: Sequence[str]) -> str | None:
        """Remove the rows of ``keys`` from a live batch (duplicates found by reconcile).

        The old row becomes ``superseded`` and its file goes to quarantine; the remaining
        rows, if any, are committed as a new batch (same run, lease and model version) whose id
        is returned, and items that pointed at the old batch are moved to it. The row is
        superseded only if it is still live, in the same transaction: of two repairs of one
        batch at once, the second changes nothing.
        """
        with self.fence.begin() as conn:
            row = ledger.row(conn, batch_id)
        if row is None or row.state not in models.LIVE_BATCH_STATES or self._unsafe(row):
            return None
        old = self.layout.root / row.path
        with sinks.translate_errors(f"cannot read {old}"):
            table = pq.ParquetFile(old).read()
        drop = pc.is_in(table["item_key"], value_set=pa.array(list(keys), pa.string()))
        kept = table.filter(pc.invert(drop))
        if kept.num_rows == 0:
            with self.fence.begin() as conn:
                won = ledger.supersede(conn, self.fence, batch_id, None, ())
            if won:
                self.layout.quarantine_file(old)
            return None
        return self._rewrite(row, kept, old)

    # -- the steps' parts ----------------------------------------------------------------

    def _write_staging(self, table: pa.Table, staged: Path) -> tuple[int, str]:
        """Write and fsync the staging file; returns (size in bytes, sha256)."""
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
                fsync_dir(staged.parent)
        return buf.size, hashlib.sha256(memoryview(buf)).hexdigest()

    def _pending_marks(self) -> list[str]:
        with self._marks_lock:
            return list(self._unmarked)

    def _marked(self, batch_ids: list[str]) -> None:
        done = set(batch_ids)
        with self._marks_lock:
            self._unmarked = [b for b in self._unmarked if b not in done]

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
        with self.fence.begin() as conn:
            ledger.mark_published(conn, [batch_id], self.fence.clock())

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
            fsync_dir(final.parent)

    def _make_dirs(self, folder: Path) -> None:
        """Create ``folder`` and missing parents, fsyncing each new entry's parent."""
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for path in reversed(missing):
            path.mkdir(exist_ok=True)
            if self._fsync:
                fsync_dir(path.parent)

    def _sweep_staging(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        with sinks.translate_errors(f"cannot list {self.layout.staging}"):
            staged = {p: parse_staging_name(p.name) for p in self.layout.staging_files()}
        ours = {p: parsed for p, parsed in staged.items() if parsed is not None}
        with self.fence.begin() as conn:
            # Leases first: a commit (ack and ledger row together) landing between the two
            # reads (separate snapshots on PostgreSQL) then shows as held or as known, never
            # as neither, which would delete a file its scorer is about to publish.
            held = self.fence.held_leases(conn, {lease for _, lease in ours.values()})
            known = ledger.states(conn, [b for b, _ in ours.values()])
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

    def _rewrite(self, row: Any, kept: pa.Table, old: Path) -> str | None:
        """Commit ``kept`` as a new batch replacing ``row``, then quarantine the old file. None when
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
        values |= {"state": models.BatchState.COMMITTED, "committed_at": self.fence.clock()}
        values |= {"published_at": None}
        with self.fence.begin() as conn:
            won = ledger.supersede(conn, self.fence, row.batch_id, new_id, keys)
            if won:
                ledger.insert(conn, values)
        if not won:
            with sinks.translate_errors(f"cannot delete staging file {staged}"):
                staged.unlink(missing_ok=True)
            logger.warning(
                "batch already repaired by another reconcile",
                extra={"action": "repair_skipped", "batch_id": row.batch_id},
            )
            return None
        # The new file first: between the two renames a reader sees the kept rows twice
        # (the same values; a repair that dies there leaves the old file an orphan, which
        # reconcile reports and `reconcile --repair` sets aside), never without them. The other order hid every row of the old file
        # meanwhile, duplicate or not (a consumer review).
        self._publish(new_id, rel, staged)
        self.layout.quarantine_file(old)
        return new_id

    # -- reconcile's parts -----------------------------------------------------------------

    def _visible_states(self, conn: Connection, visible: Sequence[str]) -> dict[str, str | None]:
        """Each visible file's ledger state (a live row's first), None without a row.

        Looked up by the batch id its name carries (``part-<batch_id>.parquet``: the key,
        one probe each); a file whose row is not found so, or not live, by its path too (a
        scan of the ledger, which has no index on paths: only for the odd file)."""
        rel = {Path(p).relative_to(self.layout.root).as_posix(): p for p in visible}
        states: dict[str, str | None] = dict.fromkeys(visible)
        by_id = {_named_batch(r): r for r in rel}
        ids = [b for b in by_id if b is not None]
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            q = sa.select(_B.c.path, _B.c.state).where(
                _B.c.sink == self.kind, _B.c.batch_id.in_(chunk)
            )
            for row in conn.execute(q):
                if row.path in rel:
                    states[rel[row.path]] = row.state
        odd = [r for r, p in rel.items() if states[p] not in models.LIVE_BATCH_STATES]
        for start in range(0, len(odd), _CHUNK):
            chunk = odd[start : start + _CHUNK]
            q = sa.select(_B.c.path, _B.c.state).where(_B.c.sink == self.kind, _B.c.path.in_(chunk))
            for row in conn.execute(q):
                if states[rel[row.path]] not in models.LIVE_BATCH_STATES:
                    states[rel[row.path]] = row.state
        return states

    def _staging_facts(self, conn: Connection, staged: Sequence[Path]) -> list[facts.StagingFile]:
        parsed = {p: parse_staging_name(p.name) for p in staged}
        ours = {p: x for p, x in parsed.items() if x is not None}
        states = ledger.states(conn, [b for b, _ in ours.values()])
        held = self.fence.held_leases(conn, {lease for _, lease in ours.values()})
        foreign = [facts.StagingFile(str(p), None, None, False) for p in parsed if p not in ours]
        return foreign + [
            facts.StagingFile(
                str(p), b, states.get(b), lease in held or rewrite_in_flight(p, lease)
            )
            for p, (b, lease) in ours.items()
        ]

    def _check_batch(self, row: Any) -> facts.BatchFacts:
        def found(
            where: str, file: str, problem: str | None = None, keys: frozenset[str] | None = None
        ) -> facts.BatchFacts:
            return facts.BatchFacts(
                row.batch_id,
                row.model_version,
                row.state,
                row.committed_at,
                where,
                file,
                problem,
                keys,
            )

        if row.state not in models.LIVE_BATCH_STATES:
            return found("retired", row.path)
        unsafe = unsafe_row(self.layout, row)
        if unsafe is not None:  # never read, moved or set aside: reported (unsafe_path)
            return found("unsafe", repr(row.path), unsafe)
        staging = self.layout.staging
        staged = staging / PurePath(row.staging_path).name if row.staging_path else None
        for where, path in (("staging", staged), ("dataset", self.layout.root / row.path)):
            if path is None:
                continue
            try:  # staging first: a rename under way moves the file from there to the dataset
                problem, keys = check_file(
                    path, n_rows=row.n_rows, n_bytes=row.n_bytes, sha256=row.sha256
                )
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue
            return found(where, str(path), problem, None if problem else keys)
        return found("missing", row.path)

    def _unsafe(self, row: Any) -> bool:
        """Whether the row names a path outside the dataset (logged: it is not acted on)."""
        unsafe = unsafe_row(self.layout, row)
        if unsafe is not None:
            logger.error(
                "%s; not acted on (reconcile reports it)",
                unsafe,
                extra={"action": "unsafe_path", "batch_id": row.batch_id},
            )
        return unsafe is not None

    def _kept_elsewhere(self, row: Any) -> bool:
        """Whether a batch's file is in the dataset root it was written for, another one."""
        if not row.staging_path or not row.path:
            return False
        root = Path(_written_under(row.staging_path))
        return not _same_folder(root, self.layout.root) and (root / row.path).is_file()

    def _refuse_foreign_dataset(
        self,
        rows: Sequence[Any],
        batches: Sequence[facts.BatchFacts],
        elsewhere: Sequence[bool],
        others: Counter[str],
    ) -> None:
        """Refuse when the root holds files but not one live batch of the ledger: every one
        is whole where it was written, another root. This root is then most likely another
        pipeline's dataset (a wrong ``--output``): its files would read as orphans, and
        ``--repair`` would set them all aside."""
        here = [
            b
            for r, b, e in zip(rows, batches, elsewhere, strict=True)
            if not e and r.state in models.LIVE_BATCH_STATES and b.where != "missing"
        ]
        if here:
            return
        roots = ", ".join(sorted(others)[:3])
        raise errors.ConfigError(
            f"none of the ledger's batches of queue {self.fence.queue!r} is under "
            f"{self.layout.root}: {others.total()} were written under {roots}; its files "
            "would read as orphans (and --repair would set them aside): check output.path or "
            "--output"
        )

    def _refuse_empty_dataset(
        self, rows: Sequence[Any], batches: Sequence[facts.BatchFacts]
    ) -> None:
        """Refuse when every live batch's file is missing and the root holds none at all."""
        live = [
            (r, b)
            for r, b in zip(rows, batches, strict=True)
            if r.state in models.LIVE_BATCH_STATES
        ]
        if not live or any(b.where != "missing" for _, b in live):
            return
        root = self.layout.root
        away = Counter(
            _written_under(r.staging_path)
            for r, _ in live
            if r.staging_path and not _same_folder(Path(_written_under(r.staging_path)), root)
        )
        here, roots = len(live) - away.total(), ", ".join(sorted(away)[:3])
        queue = self.fence.queue
        if here:
            found = (
                f"but the ledger has {here} committed batch(es) of queue {queue!r} written there"
            )
            found += f" ({away.total()} more written under {roots})" if away else ""
        else:
            found = (
                f"and none of the ledger's {away.total()} committed batch(es) of queue {queue!r} "
                f"was written there (written under {roots})"
            )
        raise errors.ConfigError(
            f"no Parquet files under {root}, {found}: check output.path or --output; if the "
            "dataset was deleted, reconcile with --dataset-lost to judge (and with --repair "
            "requeue) them"
        )


_CHUNK = 500


def _named_batch(rel: str) -> str | None:
    """The batch id a visible file's name carries (``part-<batch_id>.parquet``), or None."""
    name = PurePath(rel).name
    if not (name.startswith("part-") and name.endswith(".parquet")):
        return None
    batch_id = name.removeprefix("part-").removesuffix(".parquet")
    return batch_id if sinks.SAFE_ID.match(batch_id) else None


def _same_folder(a: Path, b: Path) -> bool:
    """Whether two paths name one folder (spelled alike, or the same folder on disk)."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is gone
        return False


def _written_under(staging_path: str) -> str:
    """The dataset root a staging file was written for (``<root>.staging`` by default)."""
    folder = PurePath(staging_path).parent
    if folder.name.endswith(".staging"):
        return str(folder.with_name(folder.name.removesuffix(".staging")))
    return str(folder)
