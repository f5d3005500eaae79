"""Reconcile: prove every acked item has exactly one committed output; classify and repair.

The finding classes and their severities are listed in :mod:`batching.findings`.

``repair=True`` reaps stale leases, rolls unpublished batches forward, moves orphan, corrupt
and superseded files into ``<root>.quarantine/`` (never deletes data), marks retired ledger
rows ``quarantined`` / ``superseded``, keeps the first-committed copy of a duplicate, and
requeues items without an output. A second reconcile after a repair finds nothing above info.

Safe beside a live scorer: files are listed *before* the ledger is read (a file becomes visible
only after its ledger row commits), and a staging file whose lease still holds items is left
alone (its commit may be in flight). Gathering (I/O) is separate from :func:`classify`, which
is pure and unit-tested on hand-made :class:`Facts`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import errors, models, parquet, schema, sinks
from batching.findings import (
    SAMPLE_KEYS,
    BatchFacts,
    DoneItem,
    Facts,
    Finding,
    ItemTally,
    Kind,
    OutputKind,
    Repair,
    Report,
    Severity,
    StagingFile,
    classify,
)

if TYPE_CHECKING:
    from batching.queue import SqlQueue

logger = logging.getLogger(__name__)

_CHUNK = 500
_I = schema.items
_B = schema.batches
_R = schema.runs


# ----------------------------------------------------------------------------- gathering


@dataclass(frozen=True)
class _Scope:
    queue: str
    kind: OutputKind
    table: str | None
    since: float | None
    run_id: str | None
    now: float
    run_ids: tuple[str, ...] = ()  # run_id and its workers' runs (``with_workers``)

    def with_workers(self, conn: Connection) -> _Scope:
        """The scope with the run's workers (``batching score --workers``) looked up once: a
        subquery under an OR made PostgreSQL scan the whole ledger and items tables."""
        if self.run_id is None:
            return self
        workers = conn.execute(
            sa.select(_R.c.run_id).where(_R.c.parent_run_id == self.run_id)
        ).scalars()
        return replace(self, run_ids=(self.run_id, *workers))

    def done(self) -> list[sa.ColumnElement[bool]]:
        conds = [_I.c.queue == self.queue, _I.c.state == int(models.State.DONE)]
        if self.since is not None:
            conds.append(_I.c.finished_at >= self.since)
        if self.run_id is not None:
            run = sa.select(_B.c.batch_id).where(self.of_run())
            conds.append(_I.c.batch_id.in_(run.scalar_subquery()))
        return conds

    def of_run(self) -> sa.ColumnElement[bool]:
        """Batches of the run, or of its workers."""
        return _B.c.run_id.in_(self.run_ids or (self.run_id,))

    def ours(self) -> sa.ColumnElement[bool]:
        if self.kind == "sql":
            return sa.and_(_B.c.sink == "sql", _B.c.path == self.table)
        return _B.c.sink == "parquet"


def gather(
    queue: SqlQueue,
    target: str | Path,
    *,
    output_kind: OutputKind,
    since: float | None = None,
    run_id: str | None = None,
    now: float,
    staging: str | Path | None = None,
    dataset_lost: bool = False,
) -> Facts:
    """Read the queue, the ledger and the files into :class:`Facts` (files listed first).

    Raises:
        ConfigError: the Parquet root holds no file and no live batch in scope has its file
            anywhere: a wrong ``output.path`` would read as every file lost (``--repair`` would
            rescore them all). ``dataset_lost`` judges them anyway.
    """
    table = str(target) if output_kind == "sql" else None
    scope = _Scope(queue.queue, output_kind, table, since, run_id, now)
    layout = None if table else parquet.ParquetLayout.for_root(target, staging)
    with sinks.translate_errors(f"cannot list {target}"):
        visible = [str(layout.root / p) for p in layout.visible_files()] if layout else []
        staged = layout.staging_files() if layout else []
    # One snapshot for every read: a batch committed meanwhile is wholly in it or wholly out.
    with queue.read() as conn:
        scope = scope.with_workers(conn)
        rows = _ledger_rows(conn, scope)
        done = _done_items(conn, scope)
        foreign = _foreign_batches(conn, scope)
        visible_states = _visible_states(conn, layout, visible) if layout else {}
        listed = _staging_facts(conn, staged)
        health = _health(conn, scope)
    with sinks.translate_errors(f"cannot read {target}"):
        batches = tuple(_check_batch(layout, r) for r in rows)
        still = tuple(s for s in listed if Path(s.path).exists())  # published meanwhile
    if layout is None:
        return Facts(output_kind, batches, done, foreign, visible_states, still, **health)
    if not visible and not dataset_lost:
        _refuse_empty_dataset(layout, rows, batches, queue.queue)
    # A batch missing here but whole in the root it was written to (another config's
    # output.path, or --output) is that dataset's: judged here it read as a missing file, and
    # --repair scored its items again, into this dataset. ``dataset_lost`` judges them all.
    elsewhere = [
        not dataset_lost and b.where == "missing" and _kept_elsewhere(layout, r)
        for r, b in zip(rows, batches, strict=True)
    ]
    others = Counter(
        _written_under(r.staging_path) for r, e in zip(rows, elsewhere, strict=True) if e
    )
    foreign |= {r.batch_id for r, e in zip(rows, elsewhere, strict=True) if e}
    batches = tuple(b for b, e in zip(batches, elsewhere, strict=True) if not e)
    return Facts(
        output_kind, batches, done, foreign, visible_states, still, **health, other_datasets=others
    )


def _kept_elsewhere(layout: parquet.ParquetLayout, row: Any) -> bool:
    """Whether a batch's file is in the dataset root it was written for, another one."""
    if not row.staging_path or not row.path:
        return False
    root = Path(_written_under(row.staging_path))
    return not _same_folder(root, layout.root) and (root / row.path).is_file()


def _refuse_empty_dataset(
    layout: parquet.ParquetLayout,
    rows: Sequence[Any],
    batches: Sequence[BatchFacts],
    queue: str,
) -> None:
    """Refuse when every live batch's file is missing and the root holds none at all."""
    live = [(r, b) for r, b in zip(rows, batches, strict=True) if r.state in sinks.LIVE_STATES]
    if not live or any(b.where != "missing" for _, b in live):
        return
    roots = sorted({_written_under(r.staging_path) for r, _ in live if r.staging_path})
    elsewhere = [r for r in roots if r != str(layout.root)]
    where = f" (written under {', '.join(elsewhere[:3])})" if elsewhere else ""
    raise errors.ConfigError(
        f"no Parquet files under {layout.root}, but the ledger has {len(live)} committed "
        f"batch(es) of queue {queue!r}{where}: check output.path or --output; if the dataset "
        "was deleted, reconcile with --dataset-lost to judge (and with --repair requeue) them"
    )


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


def _ledger_rows(conn: Connection, scope: _Scope) -> list[Any]:
    window: list[sa.ColumnElement[bool]] = [sa.true()]
    if scope.since is not None:
        window.append(_B.c.committed_at >= scope.since)
    if scope.run_id is not None:
        window.append(scope.of_run())
    referenced = sa.select(_I.c.batch_id).where(*scope.done()).scalar_subquery()
    q = _B.select().where(
        _B.c.queue == scope.queue,
        scope.ours(),
        sa.or_(sa.and_(*window), _B.c.batch_id.in_(referenced)),
    )
    return list(conn.execute(q.order_by(_B.c.committed_at, _B.c.batch_id)))


def _foreign_batches(conn: Connection, scope: _Scope) -> frozenset[str]:
    referenced = sa.select(_I.c.batch_id).where(*scope.done()).scalar_subquery()
    q = sa.select(_B.c.batch_id).where(_B.c.batch_id.in_(referenced), sa.not_(scope.ours()))
    return frozenset(str(r[0]) for r in conn.execute(q))


def _done_items(conn: Connection, scope: _Scope) -> tuple[DoneItem, ...]:
    if scope.table is None:
        q = sa.select(_I.c.item_key, _I.c.batch_id).where(*scope.done())
        return tuple(DoneItem(r.item_key, r.batch_id) for r in conn.execute(q))
    r = schema.results_table(scope.table)
    joined = _I.outerjoin(_B, _B.c.batch_id == _I.c.batch_id).outerjoin(
        r,
        sa.and_(
            r.c.queue == _I.c.queue,
            r.c.model_version == _B.c.model_version,
            r.c.item_key == _I.c.item_key,
        ),
    )
    q = sa.select(_I.c.item_key, _I.c.batch_id, r.c.item_key.label("result_key"))
    rows = conn.execute(q.select_from(joined).where(*scope.done()))
    return tuple(DoneItem(x.item_key, x.batch_id, x.result_key is not None) for x in rows)


def _visible_states(
    conn: Connection, layout: parquet.ParquetLayout, visible: Sequence[str]
) -> dict[str, str | None]:
    rel = {Path(p).relative_to(layout.root).as_posix(): p for p in visible}
    states: dict[str, str | None] = dict.fromkeys(visible)
    for chunk in _chunks(list(rel)):
        q = sa.select(_B.c.path, _B.c.state).where(_B.c.sink == "parquet", _B.c.path.in_(chunk))
        for row in conn.execute(q):
            if states[rel[row.path]] not in sinks.LIVE_STATES:
                states[rel[row.path]] = row.state
    return states


def _staging_facts(conn: Connection, staged: Sequence[Path]) -> list[StagingFile]:
    parsed = {p: parquet.parse_staging_name(p.name) for p in staged}
    ours = {p: x for p, x in parsed.items() if x is not None}
    states: dict[str, str] = {}
    for chunk in _chunks([b for b, _ in ours.values()]):
        q = sa.select(_B.c.batch_id, _B.c.state).where(_B.c.batch_id.in_(chunk))
        states.update({r.batch_id: r.state for r in conn.execute(q)})
    held = parquet.held_leases(conn, {lease for _, lease in ours.values()})
    foreign = [StagingFile(str(p), None, None, False) for p in parsed if p not in ours]
    return foreign + [
        StagingFile(str(p), b, states.get(b), lease in held or parquet.rewrite_in_flight(p, lease))
        for p, (b, lease) in ours.items()
    ]


def _health(conn: Connection, scope: _Scope) -> dict[str, Any]:
    """Stale leases, dead and expired tallies, late items (queue-wide; ``since`` applies)."""
    stale = sa.select(_I.c.item_key).where(
        _I.c.queue == scope.queue,
        _I.c.state == int(models.State.LEASED),
        _I.c.lease_expires_at < scope.now,
    )
    late = [_I.c.deadline_at.is_not(None), _I.c.finished_at > _I.c.deadline_at]
    return {
        "stale_leases": tuple(r[0] for r in conn.execute(stale)),
        "dead": _tally(conn, scope, models.State.DEAD, []),
        "expired": _tally(conn, scope, models.State.EXPIRED, []),
        "late": _tally(conn, scope, models.State.DONE, late),
    }


def _tally(
    conn: Connection, scope: _Scope, state: models.State, extra: list[sa.ColumnElement[bool]]
) -> ItemTally:
    conds = [_I.c.queue == scope.queue, _I.c.state == int(state), *extra]
    if scope.since is not None:
        conds.append(_I.c.finished_at >= scope.since)
    reason = sa.func.coalesce(_I.c.last_error, "")
    q = sa.select(reason, sa.func.count()).where(*conds).group_by(reason)
    reasons = {str(r[0]): int(r[1]) for r in conn.execute(q)}
    sample = sa.select(_I.c.item_key).where(*conds).order_by(_I.c.id).limit(SAMPLE_KEYS)
    keys = tuple(r[0] for r in conn.execute(sample))
    return ItemTally(sum(reasons.values()), reasons if state != models.State.DONE else {}, keys)


def _check_batch(layout: parquet.ParquetLayout | None, row: Any) -> BatchFacts:
    def facts(where: str, file: str, problem: str | None = None, keys: Any = None) -> BatchFacts:
        return BatchFacts(
            row.batch_id, row.model_version, row.state, row.committed_at, where, file, problem, keys
        )

    if layout is None:
        return facts("table", row.path)
    if row.state not in sinks.LIVE_STATES:
        return facts("retired", row.path)
    staged = layout.staging / PurePath(row.staging_path).name if row.staging_path else None
    for where, path in (("staging", staged), ("dataset", layout.root / row.path)):
        if path is None:
            continue
        try:  # staging first: a rename under way moves the file from there to the dataset
            problem, keys = parquet.check_file(
                path, n_rows=row.n_rows, n_bytes=row.n_bytes, sha256=row.sha256
            )
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        return facts(where, str(path), problem, None if problem else keys)
    return facts("missing", row.path)


def _chunks(values: Sequence[str]) -> Iterable[list[str]]:
    for start in range(0, len(values), _CHUNK):
        yield list(values[start : start + _CHUNK])


# ----------------------------------------------------------------------------- repair


@dataclass
class _Repairer:
    queue: SqlQueue
    sink: parquet.ParquetSink | None
    now: float
    # Batches this pass rewrote without their duplicates: old id -> the batch now holding the
    # rest of its rows. A winner found at gather time may be one of them.
    rewritten: dict[str, str] = field(default_factory=dict)

    def run(self, findings: Sequence[Finding]) -> list[Repair]:
        out: list[Repair] = []
        for kind in _REPAIR_ORDER:
            handler: Callable[[_Repairer, Finding], list[Repair]] = _HANDLERS[kind]
            for f in findings:
                if f.kind is kind:
                    out += handler(self, f)
        return out

    def stale(self, _f: Finding) -> list[Repair]:
        reaped = self.queue.release_expired()
        return [Repair("release_expired", self.queue.queue, reaped.released + reaped.dead)]

    def unpublished(self, f: Finding) -> list[Repair]:
        assert self.sink is not None
        done = [b for b in f.batch_ids if self.sink.publish(b)]
        return [Repair("roll_forward", b, len(f.item_keys)) for b in done]

    def orphan(self, f: Finding) -> list[Repair]:
        assert self.sink is not None
        files = [Path(p) for p in f.files if Path(p).exists()]
        return [Repair("quarantine", str(self.sink.layout.quarantine_file(p))) for p in files]

    def retire(self, f: Finding) -> list[Repair]:
        """Missing or corrupt file: quarantine what is there, requeue its items, retire the row."""
        (batch_id,) = f.batch_ids
        out = []
        if (
            self.sink is not None
            and f.kind is Kind.TRUNCATED_OR_CORRUPT
            and Path(f.files[0]).exists()
        ):
            out += [Repair("quarantine", str(self.sink.layout.quarantine_file(Path(f.files[0]))))]
        with self.queue.begin() as conn:
            n = _requeue(conn, self.queue.queue, None, batch_id, str(f.kind), self.now)
            conn.execute(
                _B.update().where(_B.c.batch_id == batch_id).values(state=sinks.QUARANTINED)
            )
        return [*out, Repair("requeue", batch_id, n)]

    def duplicate(self, f: Finding) -> list[Repair]:
        assert self.sink is not None
        loser = f.batch_ids[0]
        with self.queue.begin() as conn:
            for key, winner in f.details["winner_by_key"].items():
                while winner in self.rewritten:
                    winner = self.rewritten[winner]
                conn.execute(
                    _I.update()
                    .where(_I.c.batch_id == loser, _I.c.item_key == key)
                    .values(batch_id=winner)
                )
        new = self.sink.drop_rows(loser, f.item_keys)
        if new is not None:
            self.rewritten[loser] = new
        return [Repair("drop_duplicates", loser if new is None else f"{loser} -> {new}", f.count)]

    def lost(self, f: Finding) -> list[Repair]:
        batch_id = f.batch_ids[0] if f.batch_ids else None
        with self.queue.begin() as conn:
            n = _requeue(conn, self.queue.queue, f.item_keys, batch_id, str(f.kind), self.now)
        return [Repair("requeue", batch_id or "(no batch)", n)]


_HANDLERS: dict[Kind, Callable[[_Repairer, Finding], list[Repair]]] = {
    Kind.STALE_LEASE: _Repairer.stale,
    Kind.UNPUBLISHED: _Repairer.unpublished,
    Kind.ORPHAN_FILE: _Repairer.orphan,
    Kind.MISSING_FILE: _Repairer.retire,
    Kind.TRUNCATED_OR_CORRUPT: _Repairer.retire,
    Kind.DUPLICATE: _Repairer.duplicate,
    Kind.LOST_WRITE: _Repairer.lost,
}
_REPAIR_ORDER = tuple(_HANDLERS)


def _requeue(
    conn: Connection,
    queue: str,
    keys: Sequence[str] | None,
    batch_id: str | None,
    reason: str,
    now: float,
) -> int:
    """Done items of ``batch_id`` (only ``keys`` when given) back to ready with fresh attempts."""
    conds = [_I.c.queue == queue, _I.c.state == int(models.State.DONE)]
    conds.append(_I.c.batch_id == batch_id if batch_id is not None else _I.c.batch_id.is_(None))
    values = {
        "state": int(models.State.READY),
        "attempts": 0,
        "crash_count": 0,
        "batch_id": None,
        "finished_at": None,
        "run_after": now,
        "lease_id": None,
        "lease_expires_at": None,
        "leased_by": None,
        "last_error": f"requeued by reconcile: {reason}",
    }
    if keys is None:
        return int(conn.execute(_I.update().where(*conds).values(**values)).rowcount)
    n = 0
    for chunk in _chunks(keys):
        stmt = _I.update().where(*conds, _I.c.item_key.in_(chunk)).values(**values)
        n += int(conn.execute(stmt).rowcount)
    return n


# ----------------------------------------------------------------------------- entry point


def reconcile(
    queue: SqlQueue,
    sink_root_or_table: str | Path,
    *,
    output_kind: OutputKind,
    since: float | None = None,
    run_id: str | None = None,
    now: float,
    repair: bool = False,
    staging: str | Path | None = None,
    dataset_lost: bool = False,
) -> Report:
    """Check that every done item of ``queue`` has exactly one committed output.

    Args:
        queue: the queue (its database holds the ledger and, for SQL, the results table).
        sink_root_or_table: the Parquet dataset root, or the SQL results table name.
        output_kind: ``parquet`` or ``sql``.
        since: only items finished and batches committed at or after this time (epoch s);
            batches that window's items point at are always included.
        run_id: only batches of this run (or of its workers) and the items they committed.
        now: the time stale leases are judged against (epoch s).
        repair: fix what can be fixed (see the module docstring); never deletes data.
        staging: the Parquet staging folder, when not the default ``<root>.staging``.
        dataset_lost: judge the ledger's batches even when the Parquet root holds no file
            (refused otherwise: a wrong root would read as every file lost).

    Returns:
        The findings as gathered before any repair, and the repairs made.

    Raises:
        QueueError: the database failed. SinkError: a file could not be listed or moved.
        ConfigError: an empty Parquet root while the ledger has live batches (see
            ``dataset_lost``).
    """
    location = str(sink_root_or_table)

    def find() -> tuple[Finding, ...]:
        facts = gather(
            queue,
            location,
            output_kind=output_kind,
            since=since,
            run_id=run_id,
            now=now,
            staging=staging,
            dataset_lost=dataset_lost,
        )
        return tuple(classify(facts))

    findings = find()
    repairs: tuple[Repair, ...] = ()
    if repair and findings:
        sink = (
            parquet.ParquetSink(queue, location, staging=staging)
            if output_kind == "parquet"
            else None
        )
        repairs = tuple(_Repairer(queue, sink, now).run(findings))
        if any(r.action == "release_expired" and r.n_items for r in repairs):
            # A dead scorer's staging files were in flight while its leases held; reaped,
            # they are leftovers: moved now, not by a second --repair.
            left = [f for f in find() if f.kind is Kind.ORPHAN_FILE]
            repairs += tuple(_Repairer(queue, sink, now).run(left))
    report = Report(output_kind, location, now, since, run_id, findings, repairs)
    _log(report)
    return report


def _log(report: Report) -> None:
    extra = {"action": "reconcile", "ok": report.ok, "counts": report.counts}
    extra["n_repairs"] = len(report.repairs)
    if report.repairs:  # what is left is the next check's to report (cli, flow)
        logger.warning("reconcile found faults and repaired them", extra=extra)
    elif not report.ok:
        logger.error("reconcile found critical faults", extra=extra)
    elif not report.clean:
        logger.warning("reconcile found warnings", extra=extra)
    else:
        logger.info("reconcile clean", extra=extra)


__all__ = [
    "BatchFacts",
    "DoneItem",
    "Facts",
    "Finding",
    "ItemTally",
    "Kind",
    "Repair",
    "Report",
    "Severity",
    "StagingFile",
    "classify",
    "gather",
    "reconcile",
]
