"""The Delta Lake sink: outputs in a Delta table (delta-rs), the format Spark, DuckDB, Polars and
Databricks read with no glob convention; a local path or an object-store URI (``s3://...``).

The queue's database decides (:mod:`batching.outputs.outbox`): the ack, the ledger row and the batch's
rows in the outbox commit together, and the Delta commit is the roll-forward of that ledger
row. Each commit appends one batch and carries a Delta transaction id (``txn``): the app id is
the writer (one per sink, so per scorer process) and the version its sequence number, and
``DeltaTable.transaction_version(writer)`` says the highest sequence already in the table
(the version never goes back). A writer's batches roll forward in sequence order, so a batch
is in the table when that version is its sequence, and not when it is lower; past it (two
commits of one writer overlapped, and the later one reached the table first), the commit log
decides, as below. Two processes rolling the same batch forward at once
(a scorer and a reconcile) commit the same app id, which Delta refuses to the second
(``CommitFailedError``): it looks again and finds the batch there. Why not record the batch id
in the commit and search the log before committing: that search is not atomic with the
commit (both could miss the other's and append), and it grows with the table.

A transaction id expires after ``delta.setTransactionRetentionDuration`` (7 days here, so the
ids of finished writers do not pile up in every checkpoint). A writer the table does not
know is then looked up in the commit log (each commit names its batch in its commitInfo),
back to when the batch was recorded; if the log no longer reaches that far, in the table's
rows.

Rows: the batch's columns (``sinks.batch_table``; ``output`` as a list of float32) plus the
partition columns ``date`` (UTC day of scoring) and ``model_version``, as the Parquet sink.
Housekeeping (``maintain``; ``batching maintain``; the maintenance flow): compaction
(``optimize``), a checkpoint, ``vacuum`` of files no version within the retention needs, and
log clean-up.

delta-rs aborts the interpreter at exit after ``DeltaTable.to_pyarrow_table()`` (its Arrow
dataset's threads outlive Arrow; delta-io/delta-rs#2184), so reads here go through
``QueryBuilder`` (DataFusion), which does not.

Why it stays one module: it is the only one that imports ``deltalake``; the commits, the
idempotency check, reconcile's reads and the housekeeping open one table with one set of
storage options and translate one family of errors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError
from sqlalchemy.engine import Row

from batching import errors, facts, models, naming, ports
from batching.outputs import contract as sinks
from batching.outputs import ledger, outbox
from batching.redaction import redact_url
from batching.store import retention

logger = logging.getLogger(__name__)

PARTITIONS = ["date", "model_version"]
TXN_RETENTION = "interval 7 days"
"""``delta.setTransactionRetentionDuration`` of the tables this sink creates."""
_TRIES = 8  # commits lost to another roll-forward of the same writer before giving up
_HISTORY_SKEW_S = 300.0  # a batch's Delta commit is never older than its ledger row minus this
_CHUNK = 500
SCHEMA = pa.schema(
    [
        ("item_key", pa.string()),
        ("output", pa.list_(pa.float32())),
        ("scored_at", pa.timestamp("us", tz="UTC")),
        ("run_id", pa.string()),
        ("batch_id", pa.string()),
        ("queue", pa.string()),
        ("tenant", pa.string()),
        ("date", pa.string()),
        ("model_version", pa.string()),
    ]
)


def table_uri(path: str, base_dir: Path | None = None) -> str:
    """A table URI as delta-rs takes it: an object-store URI as given, a local path absolute
    (relative to ``base_dir``, default the working directory).

    Raises:
        ConfigError: the URI carries credentials or a query string.
    """
    scheme, sep, _ = path.partition("://")
    if sep and scheme.lower() != "file":
        problem = naming.uri_problem(path)
        if problem:
            raise errors.ConfigError(f"Delta table {problem}")
        return path
    local = Path(path.removeprefix("file://")).expanduser()
    if not local.is_absolute():
        local = (base_dir if base_dir is not None else Path.cwd()) / local
    return os.path.normpath(local)


def _is_local(uri: str) -> bool:
    return "://" not in uri


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """delta-rs, object-store and Arrow failures as ``SinkError`` naming ``what``."""
    try:
        yield
    except (DeltaError, OSError, pa.ArrowException) as exc:
        # object-store errors come as several lines with terminal colour codes ("\x1b[31m↳"),
        # and RUST_BACKTRACE adds a backtrace: one line, plain (found by reviews)
        text = redact_url(errors.native_text(exc))
        raise errors.SinkError(f"{what}: {text}{_log_fix(text)}") from exc


def _log_fix(text: str) -> str:
    """What to do about a damaged checkpoint (a walk-through truncated one and got the
    reader's words alone), or nothing for other errors. A Parquet error of delta-rs's kernel
    is the log's (its checkpoint); a data file's comes as an "External error" naming it."""
    lower = text.lower()
    kernel = lower.startswith("kernel error") and "parquet error" in lower
    if "checkpoint" not in lower and not kernel:
        return ""
    return (
        "; the table's checkpoint in _delta_log is damaged or missing: move the damaged "
        "*.checkpoint.parquet and _delta_log/_last_checkpoint out of _delta_log (the JSON "
        "commits rebuild the table), then `batching maintain -c CONFIG` writes a new one"
    )


_FILE_FIX = (
    "; a data file the table lists is gone or damaged: move a damaged one out of the table's "
    "folder, then `batching maintain -c CONFIG` takes the files that are gone out of the table "
    "and `batching reconcile -c CONFIG --repair` scores their items again"
)


OWNER_NOTE = "batching: the outputs of queue database {}"
"""A batching Delta table's description: the database its rows answer to (schema 20)."""
_OWNER = re.compile(r"batching: the outputs of queue database [0-9a-f-]{36}")


def sql_literal(value: str) -> str:
    """``value`` as a SQL string literal for a delta-rs predicate."""
    return "'" + value.replace("'", "''") + "'"


class DeltaSink(outbox.OutboxSink):
    """Outputs in a Delta table, rolled forward from the outbox (see the module docstring).

    Args:
        fence: the queue's side of a commit (``SqlQueue``).
        uri: the table: a local folder or ``s3://bucket/path`` (``gs://``, ``az://``...);
            created if missing.
        storage_options: delta-rs's own object-store settings (``AWS_REGION``,
            ``AWS_ENDPOINT_URL``, ...); credentials come from the environment, as delta-rs
            reads them, never from a config file.

    Raises:
        SinkError: the table cannot be reached or created.
    """

    kind = "delta"

    def __init__(
        self,
        fence: ports.Fence,
        uri: str,
        *,
        storage_options: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(fence)
        self.uri = table_uri(uri)
        self.location = self.uri
        self.storage_options = dict(storage_options or {})
        self._shown = redact_url(self.uri)
        self._created = False  # on the first write: reading creates nothing

    def _ensure_table(self) -> None:
        """Create the table if it does not exist yet (once; two scorers at once: one wins)."""
        if self._created:
            return
        self._refuse_a_folder_of_files()
        note = self._owner_note()
        with _translated(f"cannot create the Delta table {self._shown}"):
            if _is_local(self.uri):
                Path(self.uri).mkdir(parents=True, exist_ok=True)
            DeltaTable.create(
                self.uri,
                SCHEMA,
                mode="ignore",
                partition_by=PARTITIONS,
                description=note,
                configuration={"delta.setTransactionRetentionDuration": TXN_RETENTION},
                storage_options=self.storage_options or None,
            )
        self._created = True

    def check_owner(self) -> None:
        """Refuse a table another queue database writes (its description names it: two
        databases' reconciles each took the other's rows for orphans, and their repairs
        deleted them all; found by a review), and a local folder that holds files but no
        Delta table (a Parquet output's: the table was created in it, and both outputs'
        files mixed in the same partition folders; found by a walk-through).

        Raises:
            ConfigError: either.
        """
        self._refuse_a_folder_of_files()
        if self.exists():
            self._refuse_foreign(self.table())

    def _owner_note(self) -> str:
        return OWNER_NOTE.format(self.fence.database_id)

    def _refuse_foreign(self, table: DeltaTable, *, claim: bool = False) -> None:
        """Refuse ``table`` when its description names another database; with ``claim``,
        describe a table with no description as this database's (an older release's table:
        one commit), then read it again (of two claims at once, the last one's stands, and
        the other is refused)."""
        mine = self._owner_note()
        with _translated(f"cannot read the Delta table {self._shown}"):
            said = table.metadata().description or ""
        if not said and claim:
            with _translated(f"cannot describe the Delta table {self._shown}"):
                table.alter.set_table_description(mine)
            said = self.table().metadata().description or ""
        owner = _OWNER.search(said)
        if owner is not None and owner.group(0) != mine:
            raise errors.ConfigError(
                f"output {self._shown} holds the outputs of another queue database (its "
                f"description: {said!r}; this database's: {mine!r}): two databases' ledgers "
                "cannot share one table. Give this config an output.path of its own (or "
                "--output); if the other database is gone for good, move the table aside"
            )

    def _refuse_a_folder_of_files(self) -> None:
        folder = Path(self.uri)
        if not _is_local(self.uri) or not folder.is_dir() or (folder / "_delta_log").exists():
            return  # a table, or one another scorer is creating now
        with _translated(f"cannot list {self._shown}"):
            other = next((p.name for p in folder.iterdir()), None)
        if other is not None:
            raise errors.ConfigError(
                f"output {self._shown} is not a Delta table (no _delta_log) and is not empty "
                f"(it holds {other}); give output.path an empty or new folder, or set "
                "output.kind to what is there"
            )

    def exists(self) -> bool:
        """Whether the table exists (it is created by the first write)."""
        with _translated(f"cannot open the Delta table {self._shown}"):
            return DeltaTable.is_deltatable(self.uri, storage_options=self.storage_options or None)

    def table(self) -> DeltaTable:
        """The table at its latest version.

        Raises:
            SinkError: it cannot be opened (or does not exist).
        """
        with _translated(f"cannot open the Delta table {self._shown}"):
            return DeltaTable(self.uri, storage_options=self.storage_options or None)

    # -- rolling forward -------------------------------------------------------------------

    def _write(self, pending: outbox.Pending, table: pa.Table) -> int:
        """Append the batch as one commit under its writer's transaction id, unless the table
        has it already."""
        self._ensure_table()
        rows = _delta_rows(table, pending.model_version)
        assert pending.writer is not None
        assert pending.seq is not None
        for _ in range(_TRIES):
            dt = self.table()
            if self._holds(dt, pending):
                return 0
            # The writer's mark never goes back: a batch that reaches the table after a later
            # one of its writer (commits that overlapped) keeps the later one's version.
            applied = self._applied(dt, pending.writer)
            version = max(pending.seq, applied if applied is not None else 0)
            props = CommitProperties(
                app_transactions=[Transaction(pending.writer, version, int(time.time() * 1000))],
                custom_metadata={
                    "batching.batch_id": pending.batch_id,
                    "batching.run_id": pending.run_id,
                },
            )
            try:
                with _translated(f"cannot commit to the Delta table {self._shown}"):
                    write_deltalake(
                        dt, rows, mode="append", partition_by=PARTITIONS, commit_properties=props
                    )
                return int(rows.num_rows)
            except errors.SinkError as exc:
                if not isinstance(exc.__cause__, CommitFailedError):
                    raise
                # Another roll-forward of this writer committed first: look again.
        raise errors.SinkError(
            f"cannot commit batch {pending.batch_id} to the Delta table {self._shown}: "
            f"{_TRIES} concurrent commits in a row; retried with the next commit"
        )

    def _applied(self, dt: DeltaTable, writer: str) -> int | None:
        with _translated(f"cannot read the Delta table {self._shown}"):
            return dt.transaction_version(writer)

    def _holds(self, dt: DeltaTable, pending: outbox.Pending) -> bool:
        """Whether the table has the batch already (see the module docstring): its writer's
        mark says so when it is this batch's sequence number (or says not when it is below);
        past it (a later batch of the writer got there first) or unknown (expired), the
        commit log, then the rows, decide."""
        assert pending.writer is not None
        assert pending.seq is not None
        applied = self._applied(dt, pending.writer)
        if applied is not None and applied <= pending.seq:
            return applied == pending.seq
        with _translated(f"cannot read the Delta table {self._shown}"):
            found = _in_history(dt, pending.batch_id, pending.committed_at - _HISTORY_SKEW_S)
        if found is not None:
            return found
        return bool(self._count_rows([pending.batch_id]))

    # -- life cycle ------------------------------------------------------------------------

    def preflight(self) -> None:
        """The table opens, is a batching output of this queue database (a table of an older
        release is described as this database's), and a local one's folder takes a file.

        Raises:
            SinkError: it does not open, is not a batching output, or takes no file.
            ConfigError: it is another queue database's.
        """
        self._ensure_table()
        table = self.table()
        with _translated(f"cannot read the Delta table {self._shown}"):
            partitions = list(table.metadata().partition_columns)
            names = set(table.schema().to_arrow().names)
        lacking = [n for n in SCHEMA.names if n not in names]
        if partitions != PARTITIONS or lacking:
            raise errors.SinkError(
                f"the Delta table {self._shown} is not a batching output (partitioned by "
                f"{partitions or 'nothing'}{', without ' + ', '.join(lacking) if lacking else ''}"
                "): give output.path a table of its own"
            )
        self._refuse_foreign(table, claim=True)
        if _is_local(self.uri):
            try:
                with tempfile.TemporaryFile(dir=self.uri):
                    pass
            except OSError as exc:
                raise errors.SinkError(
                    f"output location {self.uri} is not writable ({exc.strerror}); "
                    "fix its permissions"
                ) from None

    def describe(self) -> sinks.SinkDescription:
        namespace, name = naming.file_dataset_id(self.uri)
        fields = [(f.name, str(f.type)) for f in SCHEMA]
        return {
            "kind": self.kind,
            "location": self._shown,
            "namespace": namespace,
            "name": name,
            "fields": fields,
        }

    def maintain(self, *, vacuum_retention_h: float | None = None) -> dict[str, object]:
        """Compact small files, write a checkpoint, vacuum files no version within the
        retention needs (``vacuum_retention_h``, default the table's: 7 days), clean the log.

        Returns what each step did.

        Raises:
            ConfigError: ``vacuum_retention_h`` is under the table's minimum retention
                (checked by a dry run before any step runs).
        """
        # delta-rs takes whole hours: rounded up, so a vacuum never keeps less than asked
        # (30 min rounded to 0 h would drop every file no current version needs).
        hours = None if vacuum_retention_h is None else math.ceil(vacuum_retention_h)
        if hours is not None:
            try:
                self.table().vacuum(retention_hours=hours, dry_run=True)
            except Exception as exc:  # delta-rs's refusal, in its words
                if "retention" not in str(exc).lower():
                    raise
                asked = f"{vacuum_retention_h:g}h" + (
                    "" if hours == vacuum_retention_h else f" (rounded up to {hours}h)"
                )
                raise errors.ConfigError(
                    f"--vacuum-retention {asked}: {errors.native_text(exc)}; give the "
                    "table's minimum or more (nothing was done)"
                ) from None
        with _translated(f"cannot maintain the Delta table {self._shown}"):
            # A file the log lists that is gone can be read by no one, so nothing compacts:
            # its entry goes (a commit of its own, in the table's history), and the next
            # reconcile finds its items without an output, which --repair scores again.
            gone = self.table().repair(dry_run=False).get("files_removed", [])
            if gone:
                logger.warning(
                    "files gone from the Delta table taken out of its log",
                    extra={"action": "delta_missing_files", "n_files": len(gone)},
                )
            compacted = self.table().optimize.compact()
            dt = self.table()
            dt.create_checkpoint()
            removed = dt.vacuum(retention_hours=hours, dry_run=False)
            self.table().cleanup_metadata()
        return {
            "missing_files_dropped": len(gone),
            "files_added": compacted.get("numFilesAdded", 0),
            "files_removed": compacted.get("numFilesRemoved", 0),
            "checkpoint_version": dt.version(),
            "files_vacuumed": len(removed),
        }

    # -- reconcile ---------------------------------------------------------------------------

    def survey(self, since: float | None = None) -> facts.Survey:
        """Nothing to list first: a batch is in the table only after its ledger row commits,
        so a batch the table shows without a row in reconcile's snapshot is looked up again."""
        return facts.Survey()

    def inspect(
        self,
        rows: Sequence[Row[Any]],
        done: Sequence[facts.DoneItem],
        observed: facts.Observed,
        *,
        dataset_lost: bool = False,
    ) -> facts.OutputFacts:
        """Each published batch's rows read back (count and keys); committed ones wait in the
        outbox; batches in the table that no live ledger row names are orphans."""
        if not self.exists():
            if not dataset_lost:
                sinks.refuse_missing_output(
                    rows,
                    f"no Delta table at {self._shown}",
                    self.fence.queue,
                    "output.path or --output",
                )
            found: dict[str, list[str]] = {}
            days: dict[str, str] = {}
        else:
            found, days = self._keys_by_batch(rows)
        batches = []
        for row in rows:
            if row.state == models.BatchState.COMMITTED and row.batch_id not in found:
                batches.append(self.pending_facts(row, observed))
            else:
                batches.append(self._batch_facts(row, found.get(row.batch_id)))
        unknown = set(found) - {r.batch_id for r in rows}
        return facts.OutputFacts(
            batches=tuple(batches),
            done=tuple(done),
            orphan_batches=tuple(sorted(self._orphans(unknown, days))),
        )

    @property
    def quarantine_uri(self) -> str:
        """The Delta table beside this one that keeps the rows a repair removes."""
        return self.uri.rstrip("/") + ".quarantine"

    def _remove(self, predicate: str) -> int:
        """Copy the rows ``predicate`` selects into the quarantine table, then delete them
        from this one (a repair never deletes data); returns the table's new version. A
        crash between the two leaves the rows in both: the repair, run again, copies them
        again and deletes them."""
        rows = self._query(f"SELECT * FROM t WHERE {predicate}")
        with _translated(f"cannot write the quarantine table {redact_url(self.quarantine_uri)}"):
            if rows.num_rows:
                if _is_local(self.quarantine_uri):
                    Path(self.quarantine_uri).mkdir(parents=True, exist_ok=True)
                write_deltalake(
                    self.quarantine_uri,
                    rows,
                    mode="append",
                    storage_options=self.storage_options or None,
                )
        with _translated(f"cannot delete from the Delta table {self._shown}"):
            dt = self.table()
            dt.delete(predicate)
            return int(dt.version())

    def set_aside(self, files: Sequence[str], batch_ids: Sequence[str]) -> list[str]:
        """Move the rows of ``batch_ids`` into the quarantine table (``<table>.quarantine``)
        and out of this table's latest version."""
        if not batch_ids:
            return []
        ids = ", ".join(sql_literal(b) for b in batch_ids)
        version = self._remove(f"batch_id IN ({ids})")
        shown = redact_url(self.quarantine_uri)
        return [
            f"{shown} (rows of {b}; removed from the table at version {version})" for b in batch_ids
        ]

    def drop_rows(self, batch_id: str, keys: Sequence[str]) -> str | None:
        """Delete the rows of ``keys`` from batch ``batch_id``; its ledger row counts the rest
        (superseded when none is left). Returns ``batch_id`` while it holds rows."""
        with self.fence.begin() as conn:
            row = ledger.row(conn, batch_id)
        if row is None or row.state not in models.LIVE_BATCH_STATES:
            return None
        for start in range(0, len(keys), _CHUNK):
            chunk = ", ".join(sql_literal(k) for k in keys[start : start + _CHUNK])
            self._remove(f"batch_id = {sql_literal(batch_id)} AND item_key IN ({chunk})")
        left = self._count_rows([batch_id]).get(batch_id, 0)
        with self.fence.begin() as conn:
            ledger.set_rows(conn, batch_id, left)
        return batch_id if left else None

    # -- reading ---------------------------------------------------------------------------

    @staticmethod
    def read(uri: str, sql: str, *, storage_options: Mapping[str, str] | None = None) -> pa.Table:
        """Run ``sql`` on the table at ``uri``, registered as ``t`` (DataFusion; see the
        module docstring for why not ``to_pyarrow_table``).

        Raises:
            SinkError: the table cannot be read.
        """
        shown = redact_url(uri)
        with _translated(f"cannot read the Delta table {shown}"):
            table = DeltaTable(uri, storage_options=dict(storage_options or {}) or None)
            try:
                return pa.table(QueryBuilder().register("t", table).execute(sql).read_all())
            except (DeltaError, OSError, pa.ArrowException):
                raise
            except Exception as exc:  # DataFusion's own, a plain Exception: a file it read
                raise errors.SinkError(
                    f"cannot read the Delta table {shown}: {redact_url(errors.native_text(exc))}"
                    f"{_FILE_FIX if 'parquet' in str(exc).lower() else ''}"
                ) from exc

    def _query(self, sql: str) -> pa.Table:
        return self.read(self.uri, sql, storage_options=self.storage_options)

    def _count_rows(self, batch_ids: Sequence[str]) -> dict[str, int]:
        """Rows in the table per batch, for those of ``batch_ids`` it holds."""
        counts: dict[str, int] = {}
        for start in range(0, len(batch_ids), _CHUNK):
            ids = ", ".join(sql_literal(b) for b in batch_ids[start : start + _CHUNK])
            got = self._query(
                f"SELECT batch_id, count(*) AS n FROM t WHERE batch_id IN ({ids}) GROUP BY batch_id"
            )
            counts |= dict(zip(got["batch_id"].to_pylist(), got["n"].to_pylist(), strict=True))
        return counts

    def _keys_by_batch(
        self, rows: Sequence[Row[Any]]
    ) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Item keys per batch in the partitions (days) the ledger rows were scored in, and
        each batch's last day there."""
        days = sorted({_day(t) for r in rows for t in (r.committed_at - 3600, r.committed_at)})
        if not days:
            return {}, {}
        within = ", ".join(sql_literal(d) for d in days)
        got = self._query(f"SELECT batch_id, item_key, date FROM t WHERE date IN ({within})")
        out: dict[str, list[str]] = {}
        last: dict[str, str] = {}
        for batch_id, key, day in zip(
            got["batch_id"].to_pylist(),
            got["item_key"].to_pylist(),
            got["date"].to_pylist(),
            strict=True,
        ):
            out.setdefault(batch_id, []).append(key)
            last[batch_id] = max(last.get(batch_id, day), day)
        return out, last

    def _batch_facts(self, row: Row[Any], keys: list[str] | None) -> facts.BatchFacts:
        def found(where: str, problem: str | None = None, got: Any = None) -> facts.BatchFacts:
            return facts.BatchFacts(
                row.batch_id,
                row.model_version,
                row.state,
                row.committed_at,
                where,
                self._shown,
                problem,
                got,
            )

        if row.state not in models.LIVE_BATCH_STATES:
            return found("retired")
        if not keys:
            return found("missing", "its rows are not in the Delta table")
        if len(keys) != row.n_rows:
            return found("dataset", f"{len(keys)} rows in the table, ledger says {row.n_rows}")
        return found("dataset", None, frozenset(keys))

    def _orphans(self, batch_ids: set[str], days: Mapping[str, str]) -> list[str]:
        """Those of ``batch_ids`` with no live ledger row now (a batch committed after the
        snapshot has one by the time its rows are in the table), but for one without a row
        whose rows are all in days before the ledger horizon's (its row may be one retention
        purged: ``batching.store.retention``)."""
        with self.fence.read() as conn:
            states = ledger.states(conn, batch_ids)
            at = retention.horizon(conn, None)  # any queue's: queues may share a table
        return [
            b
            for b in batch_ids
            if states.get(b) not in models.LIVE_BATCH_STATES
            and not (b not in states and retention.excused(days[b], at))
        ]


def _delta_rows(table: pa.Table, model_version: str) -> pa.Table:
    """A batch's rows as the table stores them: ``output`` a list, the partition columns added."""
    output = table.column("output").cast(pa.list_(pa.float32()))
    days = pc.strftime(table.column("scored_at"), format="%Y-%m-%d")
    n = table.num_rows
    columns = {name: table.column(name) for name in SCHEMA.names if name in table.column_names}
    columns |= {"output": output, "date": days, "model_version": pa.array([model_version] * n)}
    return pa.table({name: columns[name] for name in SCHEMA.names}, schema=SCHEMA)


def _day(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d")


def _in_history(dt: DeltaTable, batch_id: str, since: float) -> bool | None:
    """Whether a commit since ``since`` (epoch s) names ``batch_id``; None when the log no
    longer reaches back that far (cleaned up), so it cannot say."""
    limit = 32
    while True:
        commits = dt.history(limit)
        for commit in commits:
            if commit.get("batching.batch_id") == batch_id:
                return True
        oldest = commits[-1] if commits else None
        if oldest is None or oldest.get("version") == 0 or oldest["timestamp"] < since * 1000:
            return False
        if len(commits) < limit:  # the log starts later than ``since``: cleaned up
            return None
        limit *= 8
