"""Table definitions and versioned migrations for every ``batching_*`` SQL object.

``migrate`` brings a database to :data:`SCHEMA_VERSION` one numbered step at a time, all in
one transaction (all or none), recording each step in ``batching_schema_version``; a second
run is a no-op. ``require_current`` refuses to work on a database that is missing, older or newer.

Times are epoch seconds (double precision) taken from the application's clock, so the same
statements run on SQLite and PostgreSQL and tests can drive time with a fake clock.

Why it stays one module: the tables and their numbered migrations must agree; each migration
is written against the tables as declared here, and ``migrate`` applies them in one order.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from batching import errors

logger = logging.getLogger(__name__)

metadata = sa.MetaData()
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
NO_DEADLINE = 1e18
"""``sort_deadline`` of an item without a deadline: sorts after every real one."""

schema_version = sa.Table(
    "batching_schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("description", sa.Text, nullable=False),
    sa.Column("applied_at", sa.Float, nullable=False),
)


def _item_columns(*, archive: bool) -> list[sa.Column[Any]]:
    """The item row; the archive's copy keeps the payload inline and has its own key, because
    SQLite hands a purged item's id out again (``id`` is not AUTOINCREMENT)."""
    key: list[sa.Column[Any]] = (
        [
            sa.Column("archive_id", _ID, primary_key=True, autoincrement=True),
            sa.Column("id", _ID, nullable=False),
        ]
        if archive
        else [sa.Column("id", _ID, primary_key=True, autoincrement=True)]
    )
    payload: list[sa.Column[Any]] = (
        [sa.Column("payload", sa.LargeBinary, nullable=False)] if archive else []
    )
    return [
        *key,
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("lane", sa.String(200), nullable=False, server_default=""),
        sa.Column("item_key", sa.String(500), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False, server_default="default"),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        *payload,
        sa.Column("payload_format", sa.String(8), nullable=False, server_default="json"),
        sa.Column("dtype", sa.String(16)),
        sa.Column("shape", sa.String(100)),
        sa.Column("cost", sa.Integer, nullable=False, server_default="1"),
        sa.Column("state", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default="5"),
        sa.Column("crash_count", sa.Integer, nullable=False, server_default="0"),
        # A suspect (migration 11): its lease expired with its worker, so it is claimed only in
        # an isolation round of at most this many items (0: not a suspect; ``batching.crashes``).
        sa.Column("isolate_n", sa.Integer, nullable=False, server_default="0"),
        sa.Column("enqueued_at", sa.Float, nullable=False),
        sa.Column("run_after", sa.Float, nullable=False),
        sa.Column("deadline_at", sa.Float),
        sa.Column("sort_deadline", sa.Float, nullable=False),
        sa.Column("lease_id", sa.String(36)),
        sa.Column("leased_by", sa.String(200)),
        sa.Column("lease_expires_at", sa.Float),
        sa.Column("last_error", sa.Text),
        sa.Column("finished_at", sa.Float),
        sa.Column("batch_id", sa.String(36)),
        # The ``batching enqueue`` command that brought the item in (migration 13), so an
        # operator can cancel what one bad file enqueued. Not indexed: a cancel reads the
        # queue's ready index, and an index would cost every enqueue a write.
        sa.Column("enqueue_run", sa.String(64)),
        # The model version whose forward pass last failed the item (migration 15), for the
        # error rate of each version of a rollout (``batching rollout status``); a committed
        # item's version is its batch's, in the ledger.
        sa.Column("model_version", sa.String(100)),
        # Its key's slice of the key space (``batching.routing.bucket``; migration 15), so a
        # scorer that serves one version of a rollout claims only that version's items.
        sa.Column("route_bucket", sa.Integer),
    ]


# The payload lives in its own table (design change, migration 3): claim, heartbeat, ack, fail
# and release rewrite the item's row, and with a ~1.3 KB JSON payload inline each of those
# rewrites cost 3x more (claim+ack 21 -> 6 us a row on SQLite, measured). Archived rows keep
# their payload inline: nothing updates them.
items = sa.Table(
    "batching_items",
    metadata,
    *_item_columns(archive=False),
    sa.UniqueConstraint("queue", "item_key", name="uq_batching_items_key"),
    postgresql_with={
        "fillfactor": 90,
        "autovacuum_vacuum_scale_factor": 0.01,
        "autovacuum_vacuum_threshold": 1000,
        "autovacuum_analyze_scale_factor": 0.02,
        "autovacuum_vacuum_cost_delay": 0,
    },
)
_READY = sa.text("state = 0")
_LEASED = sa.text("state = 1")
sa.Index(
    "ix_batching_items_ready",
    items.c.queue,
    items.c.priority.desc(),
    items.c.sort_deadline,
    items.c.enqueued_at,
    items.c.id,
    postgresql_where=_READY,
    sqlite_where=_READY,
)
# Ready items by tenant (migration 14), in the ready index's order within each: a fair claim
# (``batching.tenant_share``) skip-scans it for the ready tenants and reads each one's
# first items; by the ready index alone, a tenant behind a flood of another's 10,000 items
# would be found only after reading them all.
sa.Index(
    "ix_batching_items_tenant_ready",
    items.c.queue,
    items.c.tenant,
    items.c.priority.desc(),
    items.c.sort_deadline,
    items.c.enqueued_at,
    items.c.id,
    postgresql_where=_READY,
    sqlite_where=_READY,
)
# ``queue`` leads so the expiry sweep before every claim reads only this queue's overdue
# items; on deadline_at alone SQLite preferred the ready index and scanned the whole queue.
sa.Index(
    "ix_batching_items_expiry",
    items.c.queue,
    items.c.deadline_at,
    postgresql_where=sa.text("state = 0 AND deadline_at IS NOT NULL"),
    sqlite_where=sa.text("state = 0 AND deadline_at IS NOT NULL"),
)
# Leased rows by queue and expiry (migration 7; before, by expiry alone): every claim reaps
# its queue's expired leases first, and without ``queue`` leading SQLite read the whole queue
# for it under the write lock (300k items: 40.5 against 0.56 ms a claim of 10, measured).
sa.Index(
    "ix_batching_items_leased",
    items.c.queue,
    items.c.lease_expires_at,
    postgresql_where=_LEASED,
    sqlite_where=_LEASED,
)
# Suspects waiting for an isolation round (migration 11): every claim asks whether there are
# any, and the partial index is empty unless a worker died.
_SUSPECT = sa.text("state = 0 AND isolate_n > 0")
sa.Index(
    "ix_batching_items_suspect",
    items.c.queue,
    items.c.isolate_n,
    postgresql_where=_SUSPECT,
    sqlite_where=_SUSPECT,
)
# No index on lease_id (dropped by migration 5): heartbeat, release and fail find a lease's
# rows by scanning the leased set above (a few claims' worth), and ack goes by id. Keeping it
# cost every claim and ack one more index write per row: W1 claim+ack 9.8 -> 8.0 us a row raw.
# Partial indexes keep claim and ack cheap: a row enters each index once, when it is done.
_DONE = sa.text("state = 2")
sa.Index("ix_batching_items_done", items.c.finished_at, postgresql_where=_DONE, sqlite_where=_DONE)
# Cancelled items by queue and age (migration 13), for purge; empty unless someone cancels.
_CANCELLED = sa.text("state = 5")
sa.Index(
    "ix_batching_items_cancelled",
    items.c.queue,
    items.c.finished_at,
    postgresql_where=_CANCELLED,
    sqlite_where=_CANCELLED,
)
# Dead and expired items by queue (migration 17): what the live counts of ``SqlQueue.stats``
# read without stepping through every done item; written only when an item fails or expires.
_FAILED = sa.text("state IN (3, 4)")
sa.Index(
    "ix_batching_items_failed",
    items.c.queue,
    items.c.state,
    postgresql_where=_FAILED,
    sqlite_where=_FAILED,
)
_HAS_BATCH = sa.text("batch_id IS NOT NULL")
sa.Index(
    "ix_batching_items_batch",
    items.c.batch_id,
    postgresql_where=_HAS_BATCH,
    sqlite_where=_HAS_BATCH,
)

payloads = sa.Table(
    "batching_payloads",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
)

# Range leases (migration 16): a claim whose items are one run of ids [lo, hi], all ready, is
# leased by ONE row here instead of a write to each item row; the items keep ``state = 0``
# while the range holds them, every claim and cancel leaves them out, and ``remaining``
# counts those not yet acked. An ack writes each item once (ready to done). Anything else
# (fail, a partial release, an expired lease, ``expire``) first turns the range into per-item
# leases (``SqlQueue._demote``), so every rule of a per-item lease then applies unchanged.
ranges = sa.Table(
    "batching_ranges",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("queue", sa.String(200), nullable=False),
    sa.Column("lo", _ID, nullable=False),
    sa.Column("hi", _ID, nullable=False),
    sa.Column("remaining", sa.Integer, nullable=False),
    sa.Column("lease_id", sa.String(36), nullable=False),
    sa.Column("leased_by", sa.String(200)),
    sa.Column("lease_expires_at", sa.Float, nullable=False),
)
sa.Index("ix_batching_ranges_lease", ranges.c.lease_id)
sa.Index("ix_batching_ranges_queue", ranges.c.queue, ranges.c.lo)


def held_by_ranges(
    conn: Connection, *, queue: str | None = None, lapsed_at: float | None = None
) -> sa.ColumnElement[bool] | None:
    """Whether an item row is one a range lease holds (it stays ready in the table): the ids
    of ``queue``'s ranges (every queue's without one), only those expired before
    ``lapsed_at`` when given; read in ``conn``'s transaction. None when there are none."""
    held = sa.select(ranges.c.lo, ranges.c.hi)
    if queue is not None:
        held = held.where(ranges.c.queue == queue)
    if lapsed_at is not None:
        held = held.where(ranges.c.lease_expires_at < lapsed_at)
    spans = conn.execute(held).all()
    return sa.or_(*(items.c.id.between(lo, hi) for lo, hi in spans)) if spans else None


"""Request bodies by item id, written once at enqueue and read once per claim."""

items_archive = sa.Table("batching_items_archive", metadata, *_item_columns(archive=True))

batches = sa.Table(
    "batching_batches",
    metadata,
    sa.Column("batch_id", sa.String(36), primary_key=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("queue", sa.String(200), nullable=False),
    sa.Column("lease_id", sa.String(36), nullable=False),
    sa.Column("model_version", sa.String(100), nullable=False),
    sa.Column("sink", sa.String(16), nullable=False),
    sa.Column("path", sa.Text),
    sa.Column("staging_path", sa.Text),
    sa.Column("n_rows", sa.Integer, nullable=False),
    sa.Column("n_bytes", sa.BigInteger),
    sa.Column("sha256", sa.String(64)),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("committed_at", sa.Float, nullable=False),
    sa.Column("published_at", sa.Float),
    # A sink that rolls forward from the outbox (migration 10): the writer that recorded the
    # batch and its sequence number; a Delta commit carries them as its transaction id.
    sa.Column("writer", sa.String(64)),
    sa.Column("seq", sa.BigInteger),
    # Who was in each forward pass of the batch (migration 15; JSON, ``ledger.encode_forwards``),
    # so ``batching replay`` scores the same passes again.
    sa.Column("forwards", sa.Text),
)
sa.Index("ix_batching_batches_run", batches.c.run_id)
sa.Index("ix_batching_batches_committed", batches.c.committed_at)

outbox = sa.Table(
    "batching_outbox",
    metadata,
    sa.Column("batch_id", sa.String(36), primary_key=True),
    sa.Column("body", sa.LargeBinary, nullable=False),
)
"""A committed batch's rows (Arrow IPC) until they are rolled forward into an output outside
the queue's database (migration 10): written with the ack and the ledger row, deleted with
the ledger's ``published`` mark."""

runs = sa.Table(
    "batching_runs",
    metadata,
    sa.Column("run_id", sa.String(64), primary_key=True),
    sa.Column("flow", sa.String(100), nullable=False),
    sa.Column("queue", sa.String(200), nullable=False),
    sa.Column("config_hash", sa.String(64)),
    sa.Column("model_version", sa.String(100)),
    sa.Column("model_sha256", sa.String(64)),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
    sa.Column("n_items", sa.Integer, nullable=False, server_default="0"),
    sa.Column("n_failed", sa.Integer, nullable=False, server_default="0"),
    sa.Column("n_batches", sa.Integer, nullable=False, server_default="0"),
    sa.Column("summary", sa.Text),
    sa.Column("error", sa.Text),
    # A worker of ``batching score --workers`` (migration 6): the run it is part of, so a
    # reconcile of that run covers its workers' batches.
    sa.Column("parent_run_id", sa.String(64)),
    # A scoring run's last sign of life (migration 8): a run still "running" without one for
    # a while died with its process, and the next run on its queue closes it as failed.
    sa.Column("heartbeat_at", sa.Float),
    # When a reconcile last checked the run's batches (migration 12): a run that committed
    # items and was never reconciled is one no trigger reached.
    sa.Column("reconciled_at", sa.Float),
    # Its output dataset as lineage names it (migration 18; JSON [namespace, name], no
    # credentials), so the FAIL of a run that died names the dataset its rows went to.
    sa.Column("output", sa.Text),
)
lineage_spool = sa.Table(
    "batching_lineage_spool",
    metadata,
    sa.Column("seq", _ID, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(64), nullable=False),
    sa.Column("event_type", sa.String(16), nullable=False),
    sa.Column("event_time", sa.String(40), nullable=False),
    # The event as first serialised: a re-send is byte for byte the same event.
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("spooled_at", sa.Float, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    # A flusher's claim on the run's events: another flusher skips them until it expires.
    sa.Column("claimed_by", sa.String(64)),
    sa.Column("claim_expires_at", sa.Float),
    sqlite_autoincrement=True,
)
"""Lineage events the backend did not take (migration 12), re-sent in order per run by the
next run or ``batching lineage flush``; deleted once delivered."""
sa.Index("ix_batching_lineage_spool_run", lineage_spool.c.run_id, lineage_spool.c.seq)

sweeps = sa.Table(
    "batching_sweeps",
    metadata,
    sa.Column("name", sa.String(300), primary_key=True),
    sa.Column("cursor", sa.Text),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
    sa.Column("progress", sa.Text),
)
"""Where a full reconcile sweep of one output is (migration 12): a sweep stopped part way
resumes after its cursor."""

meta = sa.Table(
    "batching_meta",
    metadata,
    sa.Column("name", sa.String(100), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)
"""Facts about the database itself (migration 20): ``database_id``, from the time the
database was made, which an output records as the database its files answer to
(``parquet_layout.OWNER_FILE``, a Delta table's description)."""
DATABASE_ID = "database_id"

queue_controls = sa.Table(
    "batching_queue_controls",
    metadata,
    sa.Column("queue", sa.String(200), primary_key=True),
    sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("paused_at", sa.Float),
    sa.Column("paused_by", sa.String(200)),
    sa.Column("pause_reason", sa.Text),
    sa.Column("max_depth", sa.BigInteger),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("route", sa.Text),
    sa.Column("ledger_horizon", sa.Float),
)
"""A queue's controls (migration 13): paused (every claim reads this row by its key), and
its depth cap (enqueue refuses past it); no row: not paused, no cap. Its ``route``
(migration 15; JSON, ``batching.routing.Route``): which model version scores which items,
read by every claim with ``paused``; none: the scorer's configured version scores all. Its
``ledger_horizon`` (migration 19; a UTC midnight, epoch s): the ledger's rows committed before
it may be purged (``batching.store.retention``); none: the whole ledger is kept."""

queue_audit = sa.Table(
    "batching_queue_audit",
    metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("queue", sa.String(200), nullable=False),
    sa.Column("action", sa.String(32), nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("at", sa.Float, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("detail", sa.Text),  # JSON: what the action changed (counts, filters, before)
    sqlite_autoincrement=True,
)
"""Who paused, resumed, capped or cancelled what, when and why (migration 13); written in
the transaction of the change it records."""
sa.Index("ix_batching_queue_audit_queue", queue_audit.c.queue, queue_audit.c.id)

model_versions = sa.Table(
    "batching_model_versions",
    metadata,
    sa.Column("queue", sa.String(200), primary_key=True),
    sa.Column("version", sa.String(100), primary_key=True),
    sa.Column("name", sa.String(500), nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("dtype", sa.String(16), nullable=False),
    sa.Column("autocast", sa.String(16), nullable=False),
    sa.Column("first_run_id", sa.String(64), nullable=False),
    sa.Column("first_at", sa.Float, nullable=False),
)
"""What each model version of a queue was when it first scored (migration 18; its model,
checkpoint digest, dtype, autocast): outputs are keyed by version, so a config that gives a
version another identity is refused (``batching.ingress.version_pins``)."""

sa.Index(
    "ix_batching_runs_parent",
    runs.c.parent_run_id,
    postgresql_where=sa.text("parent_run_id IS NOT NULL"),
    sqlite_where=sa.text("parent_run_id IS NOT NULL"),
)


# The SQL sink's key (migration 9; before, without ``queue``): item keys are unique per queue,
# so two queues scoring with one model version into one table may share a key. Keyed without
# the queue, the second queue's output was dropped as a replay while its item was acked.
RESULTS_KEY = ("queue", "model_version", "item_key")


def results_table(name: str = "batching_results", md: sa.MetaData | None = None) -> sa.Table:
    """The SQL sink's results table, keyed by :data:`RESULTS_KEY`."""
    return sa.Table(
        name,
        md if md is not None else sa.MetaData(),
        sa.Column("queue", sa.String(200), primary_key=True),
        sa.Column("model_version", sa.String(100), primary_key=True),
        sa.Column("item_key", sa.String(500), primary_key=True),
        sa.Column("output", sa.LargeBinary, nullable=False),
        sa.Column("output_dim", sa.Integer, nullable=False),
        sa.Column("scored_at", sa.Float, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("batch_id", sa.String(36), nullable=False),
        extend_existing=True,
    )


results = results_table(md=metadata)


@dataclass(frozen=True)
class Migration:
    """One numbered schema step; ``apply`` runs inside the step's transaction."""

    version: int
    description: str
    apply: Callable[[Connection], None]


def _v1(conn: Connection) -> None:
    metadata.create_all(conn, checkfirst=True)


def _v2(conn: Connection) -> None:
    conn.execute(sa.text("DROP INDEX IF EXISTS ix_batching_items_ready_deadline"))
    for index in items.indexes:
        if index.name == "ix_batching_items_expiry":
            index.create(conn, checkfirst=True)


def _v3(conn: Connection) -> None:
    payloads.create(conn, checkfirst=True)
    columns = {c["name"] for c in sa.inspect(conn).get_columns(items.name)}
    if "payload" in columns:  # a database from before: move the bodies, then drop the column
        conn.execute(
            sa.text(
                "INSERT INTO batching_payloads (id, payload) SELECT id, payload FROM batching_items"
            )
        )
        conn.execute(sa.text("ALTER TABLE batching_items DROP COLUMN payload"))


def _v4(conn: Connection) -> None:
    columns = {c["name"] for c in sa.inspect(conn).get_columns(items_archive.name)}
    if "archive_id" in columns:
        return
    # Only the columns the old table has: later migrations add theirs (isolate_n, ...).
    names = [c.name for c in items_archive.columns if c.name in columns]
    _rebuild(conn, items_archive, names, order="finished_at, id")


def _rebuild(conn: Connection, table: sa.Table, names: Sequence[str], order: str) -> None:
    """Rebuild ``table`` as declared, keeping the rows' ``names`` columns: create it under a
    new name, copy, drop the old one, rename (the same statements on SQLite and PostgreSQL).
    SQLite renames in legacy mode, so views that name the table are not re-checked halfway."""
    quote = conn.dialect.identifier_preparer.quote
    rebuilt = table.to_metadata(sa.MetaData(), name=f"{table.name}_new")
    rebuilt.create(conn)
    cols = ", ".join(map(quote, names))
    old, new = quote(table.name), quote(rebuilt.name)
    conn.execute(sa.text(f"INSERT INTO {new} ({cols}) SELECT {cols} FROM {old} ORDER BY {order}"))
    conn.execute(sa.text(f"DROP TABLE {old}"))
    legacy = conn.dialect.name == "sqlite"
    if legacy:
        conn.exec_driver_sql("PRAGMA legacy_alter_table = ON")
    conn.execute(sa.text(f"ALTER TABLE {new} RENAME TO {old}"))
    if legacy:
        conn.exec_driver_sql("PRAGMA legacy_alter_table = OFF")


def ensure_results_table(conn: Connection, table: sa.Table) -> bool:
    """Create a custom results table if missing, or key it by :data:`RESULTS_KEY` if it is
    keyed the old way (migration 9 covers ``batching_results`` only); returns whether an
    existing table was rebuilt. Scorers starting together take turns (PostgreSQL: the
    migration lock; SQLite: the write lock)."""
    _lock(conn)
    table.create(conn, checkfirst=True)
    return rekey_results(conn, table)


def rekey_results(conn: Connection, table: sa.Table) -> bool:
    """Key a results table by :data:`RESULTS_KEY` if it is keyed the old way; returns whether
    it was changed. Its rows all stay (the old key was the stricter one).

    PostgreSQL changes the key in place (the table keeps its name, grants and the views on it).
    SQLite cannot, so the table is rebuilt; one with columns batching does not declare is
    refused rather than rebuilt without them.

    Raises:
        SchemaError: a SQLite table with columns of its own (rekey it by hand).
    """
    inspector = sa.inspect(conn)
    pk = inspector.get_pk_constraint(table.name)
    if set(pk["constrained_columns"]) == set(RESULTS_KEY):
        return False
    quote = conn.dialect.identifier_preparer.quote
    key = ", ".join(map(quote, RESULTS_KEY))
    have = [str(c["name"]) for c in inspector.get_columns(table.name)]
    missing = sorted({c.name for c in table.columns} - set(have))
    if missing:  # not a results table (another table of that name): never re-keyed
        raise errors.SchemaError(
            f"table {table.name} is not a batching results table (it lacks "
            f"{', '.join(missing)}), so it is left as it is: give output.table (or --output) "
            "a table of its own"
        )
    if conn.dialect.name == "postgresql":
        name = pk.get("name")
        drop = f"DROP CONSTRAINT {quote(name)}, " if name else ""
        conn.execute(sa.text(f"ALTER TABLE {quote(table.name)} {drop}ADD PRIMARY KEY ({key})"))
        return True
    extra = sorted(set(have) - {c.name for c in table.columns})
    if extra:
        raise errors.SchemaError(
            f"results table {table.name} has columns batching does not declare "
            f"({', '.join(extra)}), so it is not rebuilt: rebuild it by hand with PRIMARY KEY "
            f"({key}) (before migration 9 the key had no queue)"
        )
    _rebuild(conn, table, have, order="scored_at")
    return True


def _v5(conn: Connection) -> None:
    conn.execute(sa.text("DROP INDEX IF EXISTS ix_batching_items_lease_id"))


def _v6(conn: Connection) -> None:
    columns = {c["name"] for c in sa.inspect(conn).get_columns(runs.name)}
    if "parent_run_id" not in columns:
        conn.execute(sa.text(f"ALTER TABLE {runs.name} ADD COLUMN parent_run_id VARCHAR(64)"))
    for index in runs.indexes:
        index.create(conn, checkfirst=True)


def _v7(conn: Connection) -> None:
    conn.execute(sa.text("DROP INDEX IF EXISTS ix_batching_items_lease_exp"))
    for index in items.indexes:
        if index.name == "ix_batching_items_leased":
            index.create(conn, checkfirst=True)


def _v8(conn: Connection) -> None:
    columns = {c["name"] for c in sa.inspect(conn).get_columns(runs.name)}
    if "heartbeat_at" not in columns:
        conn.execute(sa.text(f"ALTER TABLE {runs.name} ADD COLUMN heartbeat_at FLOAT"))


def _v9(conn: Connection) -> None:
    rekey_results(conn, results)


def _v10(conn: Connection) -> None:
    outbox.create(conn, checkfirst=True)
    columns = {c["name"] for c in sa.inspect(conn).get_columns(batches.name)}
    if "writer" not in columns:
        conn.execute(sa.text(f"ALTER TABLE {batches.name} ADD COLUMN writer VARCHAR(64)"))
    if "seq" not in columns:
        conn.execute(sa.text(f"ALTER TABLE {batches.name} ADD COLUMN seq BIGINT"))


def _v11(conn: Connection) -> None:
    for table in (items, items_archive):
        columns = {c["name"] for c in sa.inspect(conn).get_columns(table.name)}
        if "isolate_n" not in columns:
            conn.execute(
                sa.text(f"ALTER TABLE {table.name} ADD COLUMN isolate_n INTEGER NOT NULL DEFAULT 0")
            )
    for index in items.indexes:
        if index.name == "ix_batching_items_suspect":
            index.create(conn, checkfirst=True)


def _v12(conn: Connection) -> None:
    for table in (lineage_spool, sweeps):
        table.create(conn, checkfirst=True)
    columns = {c["name"] for c in sa.inspect(conn).get_columns(runs.name)}
    if "reconciled_at" not in columns:
        conn.execute(sa.text(f"ALTER TABLE {runs.name} ADD COLUMN reconciled_at FLOAT"))


def _v13(conn: Connection) -> None:
    for table in (queue_controls, queue_audit):
        table.create(conn, checkfirst=True)
    for table in (items, items_archive):
        columns = {c["name"] for c in sa.inspect(conn).get_columns(table.name)}
        if "enqueue_run" not in columns:
            conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN enqueue_run VARCHAR(64)"))
    for index in items.indexes:
        if index.name == "ix_batching_items_cancelled":
            index.create(conn, checkfirst=True)


def _v14(conn: Connection) -> None:
    for index in items.indexes:
        if index.name == "ix_batching_items_tenant_ready":
            index.create(conn, checkfirst=True)


def _v15(conn: Connection) -> None:
    _add_column(conn, queue_controls.name, "route", "TEXT")
    _add_column(conn, batches.name, "forwards", "TEXT")
    for table in (items, items_archive):
        _add_column(conn, table.name, "model_version", "VARCHAR(100)")
        _add_column(conn, table.name, "route_bucket", "INTEGER")
    _fill_route_buckets(conn)


def _fill_route_buckets(conn: Connection, chunk: int = 5000) -> None:
    """The route bucket of the items already in the queue that can still be claimed (not done
    or cancelled): computed from their keys, as an enqueue does."""
    from batching.routing import bucket

    t = items
    todo = sa.and_(t.c.route_bucket.is_(None), t.c.state.not_in((2, 5)))
    update = t.update().where(t.c.id == sa.bindparam("rid")).values(route_bucket=sa.bindparam("b"))
    after = 0  # by id: each chunk starts past the last, not over the done rows again
    while True:
        page = sa.select(t.c.id, t.c.item_key).where(todo, t.c.id > after).order_by(t.c.id)
        rows = conn.execute(page.limit(chunk)).all()
        if not rows:
            return
        conn.execute(update, [{"rid": i, "b": bucket(k)} for i, k in rows])
        after = rows[-1][0]


def _v16(conn: Connection) -> None:
    ranges.create(conn, checkfirst=True)


def _v17(conn: Connection) -> None:
    for index in items.indexes:
        if index.name == "ix_batching_items_failed":
            index.create(conn, checkfirst=True)


def _v18(conn: Connection) -> None:
    model_versions.create(conn, checkfirst=True)
    _add_column(conn, runs.name, "output", "TEXT")


def _v19(conn: Connection) -> None:
    _add_column(conn, queue_controls.name, "ledger_horizon", "FLOAT")


def _v20(conn: Connection) -> None:
    meta.create(conn, checkfirst=True)
    held = sa.select(meta.c.value).where(meta.c.name == DATABASE_ID)
    if conn.execute(held).first() is None:
        conn.execute(meta.insert().values(name=DATABASE_ID, value=_id_of_creation(conn)))


def _id_of_creation(conn: Connection) -> str:
    """The database's id, from when migration 1 made it (its recorded time), not drawn at
    random: a backup taken before an upgrade to 20, restored (the documented roll-back) and
    upgraded again, is the same database and must get the same id, or its own dataset would
    refuse it (found by a review). Two databases made in the same microsecond would share
    one; a copy of a database shares it, as it shares its ledger."""
    first = conn.execute(
        sa.select(schema_version.c.applied_at).where(schema_version.c.version == 1)
    ).scalar()
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"batching-database:{float(first or 0.0)!r}"))


def database_id(conn: Connection) -> str:
    """This database's id (migration 20; the schema is current where this is called)."""
    return str(conn.execute(sa.select(meta.c.value).where(meta.c.name == DATABASE_ID)).scalar())


def _add_column(conn: Connection, table: str, column: str, sql_type: str) -> None:
    if column not in {c["name"] for c in sa.inspect(conn).get_columns(table)}:
        conn.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "queue items, archive, batch ledger, runs, results", _v1),
    Migration(2, "expiry index leads with queue", _v2),
    Migration(3, "payloads move to batching_payloads", _v3),
    Migration(4, "archive rows get their own key", _v4),
    Migration(5, "leased rows keep one index, by expiry", _v5),
    Migration(6, "runs record the run they are a worker of", _v6),
    Migration(7, "leased rows indexed by queue, then expiry", _v7),
    Migration(8, "runs record their last heartbeat", _v8),
    Migration(9, "SQL results keyed by queue, model version and item key", _v9),
    Migration(10, "an outbox for outputs outside the queue's database", _v10),
    Migration(11, "suspects of a lost worker wait for an isolation round", _v11),
    Migration(12, "a spool for undelivered lineage events, sweep cursors, runs reconciled", _v12),
    Migration(13, "queue controls (pause, depth cap) and their audit, cancelled items", _v13),
    Migration(14, "ready items indexed by tenant, for fair-share claims", _v14),
    Migration(
        15,
        "model routes per queue (rollouts); items record the version that failed them; "
        "batches record their forward passes (replay)",
        _v15,
    ),
    Migration(16, "range leases: one row leases a run of ready items", _v16),
    Migration(17, "dead and expired items indexed by queue, for counts without a full scan", _v17),
    Migration(
        18,
        "each model version's identity, pinned when it first scores; runs record their output",
        _v18,
    ),
    Migration(19, "queues record the ledger's retention horizon", _v19),
    Migration(20, "the database's own id, which an output dataset records as its owner", _v20),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


@dataclass(frozen=True)
class MigrationResult:
    """Versions before and after ``migrate``; equal when nothing was applied."""

    from_version: int
    to_version: int

    @property
    def applied(self) -> bool:
        return self.to_version != self.from_version


def current_version(conn: Connection) -> int:
    """Highest applied migration, 0 for an empty database."""
    if not sa.inspect(conn).has_table(schema_version.name):
        return 0
    value = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar()
    return int(value or 0)


def migrate(engine: Engine, now: Callable[[], float]) -> MigrationResult:
    """Apply every pending migration in one transaction (all or none); safe to run concurrently.

    Stop scorers first when a migration rewrites a table: 3 drops the inline payload column
    (SQLite rewrites ``batching_items``; PostgreSQL takes an exclusive lock, and the space
    returns only after ``VACUUM FULL``), 4 rebuilds ``batching_items_archive``, 7 drops and
    builds an index of ``batching_items`` (PostgreSQL locks the table until it commits), 9
    rekeys ``batching_results`` (SQLite rebuilds it; PostgreSQL locks it while it rekeys), 14
    builds an index of ``batching_items`` (PostgreSQL blocks writes to it until it commits),
    15 adds columns to ``batching_items`` and fills one for every live row under the table's
    lock (~30 s for 500k items on PostgreSQL), 17 builds an index of ``batching_items``.
    Writers of this release and later hold this lock shared (``require_current_to_write``):
    the migration waits for their transactions, and theirs begun meanwhile wait for it.
    """
    with engine.begin() as conn:
        _lock(conn)
        before = current_version(conn)
        if before > SCHEMA_VERSION:
            raise errors.SchemaError(_too_new(before))
        if before == 0:
            schema_version.create(conn, checkfirst=True)
        for step in MIGRATIONS:
            if step.version <= before:
                continue
            step.apply(conn)
            conn.execute(
                schema_version.insert().values(
                    version=step.version, description=step.description, applied_at=now()
                )
            )
            logger.info(
                "schema migrated", extra={"action": "schema_migrated", "version": step.version}
            )
    return MigrationResult(before, max(before, SCHEMA_VERSION))


def _lock(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7271101)"))


def live_runs(conn: Connection, now: float, within_s: float) -> list[tuple[str, str, float]]:
    """Runs still ``running`` whose heartbeat is at most ``within_s`` old: (run id, queue,
    heartbeat) of scorers alive now, which an upgrade should wait for (``batching init``).
    None on a database without heartbeats yet (before migration 8)."""
    if current_version(conn) < 8:
        return []
    r = runs.c
    alive = sa.select(r.run_id, r.queue, r.heartbeat_at).where(
        r.state == "running", r.heartbeat_at >= now - within_s
    )
    return [(str(a), str(b), float(c)) for a, b, c in conn.execute(alive.order_by(r.queue))]


def require_current_to_write(conn: Connection) -> None:
    """``require_current`` at the start of a write transaction, after (PostgreSQL) a SHARED
    hold of the migration's lock: a migration waits for the writes begun before it, and a
    write begun during it waits for it to commit, then reads the version it left. Checked
    only once, before the transaction, an older release's enqueue waited out a migration on
    the table's lock and then wrote rows the new schema had to fill (an upgrade review).
    Costs a statement (two on PostgreSQL) a write transaction, not a row."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock_shared(7271101)"))
    version = int(conn.execute(_MAX_VERSION).scalar() or 0)
    if version > SCHEMA_VERSION:
        raise errors.SchemaError(_too_new(version))
    if version < SCHEMA_VERSION:
        require_current(conn)  # its message names the fix


_MAX_VERSION = sa.select(sa.func.max(schema_version.c.version))


def _too_new(version: int) -> str:
    return (
        f"database schema is version {version}, newer than this batching "
        f"({SCHEMA_VERSION}); upgrade batching"
    )


def require_current(conn: Connection) -> None:
    """Raise ``SchemaError`` unless the database is at exactly :data:`SCHEMA_VERSION`."""
    version = current_version(conn)
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        raise errors.SchemaError(_too_new(version))
    raise errors.SchemaError(
        f"database schema is version {version}, expected {SCHEMA_VERSION}; "
        "run `batching init --db URL`"
    )
