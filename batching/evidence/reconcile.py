"""Reconcile: prove every acked item has exactly one committed output; classify and repair.

The finding classes and their severities are listed in :mod:`batching.evidence.findings`.

Reconcile reads the queue and the batch ledger itself, and asks the sink for the rest (its
facts, see :mod:`batching.facts`; its repairs): it never knows which kind of output it judges.
``repair=True`` reaps stale leases, rolls unpublished batches forward, sets orphan and corrupt
outputs aside (files to ``<root>.quarantine/``; never deletes data), marks retired ledger rows
``quarantined`` / ``superseded``, keeps the first-committed copy of a duplicate, and requeues
items without an output. A second reconcile after a repair finds nothing above info.

Safe beside a live scorer: the sink surveys what readers see *before* the ledger is read (an
output becomes visible only after its ledger row commits), and a staging file whose lease
still holds items is left alone (its commit may be in flight). Gathering (I/O) is separate
from :func:`classify`, which is pure and unit-tested on hand-made :class:`Facts`.

Why it stays one module: the gathering (with the statistics its PostgreSQL plans need) and
the repairs read and change the same scope of the queue and the ledger, in one order.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import errors, models, ports
from batching.evidence import reconcile_result
from batching.evidence.findings import (
    SAMPLE_KEYS,
    Facts,
    Finding,
    ItemTally,
    Kind,
    Repair,
    Report,
    Severity,
    classify,
)
from batching.facts import BatchFacts, DoneItem, ListedOutput, StagingFile
from batching.outputs import contract as sinks
from batching.outputs import ledger
from batching.store import retention, schema

logger = logging.getLogger(__name__)

_CHUNK = 500
_I = schema.items
_B = schema.batches
_R = schema.runs


# ----------------------------------------------------------------------------- gathering


@dataclass(frozen=True)
class _Scope:
    queue: str
    ours: sa.ColumnElement[bool]  # the ledger rows of the sink judged
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


def gather(
    queue: ports.Fence,
    sink: sinks.Sink,
    *,
    since: float | None = None,
    run_id: str | None = None,
    now: float,
    dataset_lost: bool = False,
) -> Facts:
    """Read the queue and the ledger, and the sink's facts of its output, into :class:`Facts`
    (the sink surveys its output first; see :mod:`batching.facts`).

    Raises:
        ConfigError: the sink refuses to judge (a Parquet root without any file while the
            ledger has live batches, unless ``dataset_lost``; another database's output).
    """
    sink.check_owner()  # another database's output: its files are not this ledger's to judge
    scope = _Scope(queue.queue, sink.owns(), since, run_id, now)
    fresh_statistics(queue)
    # A scoped check lists only what its window (or run) can have written: listing and
    # looking up every file ever written made an hourly window as slow as the whole dataset
    # (4 s at 35k files, growing; a soak review). Orphans elsewhere: the unscoped check's.
    listed_since = since if run_id is None else _run_began(queue, scope, now)
    survey = sink.survey(listed_since)
    # One snapshot for every read: a batch committed meanwhile is wholly in it or wholly out.
    with queue.read() as conn:
        scope = scope.with_workers(conn)
        rows = _ledger_rows(conn, scope)
        done = _done_items(conn, scope)
        foreign = _foreign_batches(conn, scope)
        health = _health(conn, scope)
        observed = sink.observe(conn, survey, rows)
    if listed_since is not None and not observed.visible and isinstance(sink, ListedOutput):
        # nothing in the window's partitions: is the whole output empty (a wrong path)?
        empty = next(iter(sink.visible_after(None)), None) is None
        observed = replace(observed, output_empty=empty)
    out = sink.inspect(rows, done, observed, dataset_lost=dataset_lost)
    # Batches of this kind of output written elsewhere (another table, another URI): said, not
    # judged here (a mistyped location would otherwise read as clean, its batches unseen).
    others = Counter(out.other_datasets)
    others.update(path for kind, path in foreign.values() if kind == sink.kind)
    return Facts(
        sink.kind,
        out.batches,
        out.done,
        frozenset(foreign) | out.foreign_batches,
        out.visible,
        out.staging,
        **health,
        other_datasets=dict(others),
        orphan_batches=out.orphan_batches,
        now=now,
    )


def _run_began(queue: ports.Fence, scope: _Scope, now: float) -> float:
    """When the run's (and its workers') first batch committed; ``now`` if none has."""
    with queue.read() as conn:
        of_run = scope.with_workers(conn).of_run()
        first = conn.execute(sa.select(sa.func.min(_B.c.committed_at)).where(of_run)).scalar()
    return now if first is None else float(first)


_ANALYZED = (_I.name, _B.name)
_STALE_SHARE = 0.2
_STALE_MIN_ROWS = 1000
_STALE = sa.text(
    """
    SELECT c.relname FROM pg_catalog.pg_class c
    LEFT JOIN pg_catalog.pg_stat_user_tables s ON s.relid = c.oid
    WHERE c.oid IN (SELECT to_regclass(n) FROM unnest(CAST(:names AS text[])) AS n)
      AND (c.reltuples < 0
           OR COALESCE(s.n_mod_since_analyze, 0) > GREATEST(:min_rows, :share * c.reltuples))
    """
)


def fresh_statistics(queue: ports.Fence) -> list[str]:
    """PostgreSQL: ``ANALYZE`` the queue's items table and the ledger when they have no
    statistics, or when more than a fifth of their rows changed since they were last
    analyzed; returns the tables analyzed.

    Why: without statistics PostgreSQL takes a table of 100k rows for a few rows and picks
    plans that are quadratic at that size (a run's done items joined to its batches by a
    nested loop that rescans the run's batches for every item: 0.75 s a query for 20k
    items, 16 s a reconcile for 100k). Autovacuum analyzes in time on a busy database, but
    not while it is off, nor right after a bulk load or a restore. ``ANALYZE`` reads a
    sample (30k rows at the default statistics target, well under a second), changes no row
    and blocks neither readers nor writers; the check itself reads two catalog rows
    (``pg_class.reltuples`` is negative until a table is first analyzed,
    ``pg_stat_user_tables.n_mod_since_analyze`` counts the changes since). PostgreSQL skips
    a table the role does not own with a warning of its own; a failure (a lock not had in
    5 s) is logged and reconcile goes on with the plans it gets.
    """
    if queue.dialect != "postgresql":
        return []
    params = {"names": list(_ANALYZED), "min_rows": _STALE_MIN_ROWS, "share": _STALE_SHARE}
    try:
        with queue.begin() as conn:
            stale = [str(n) for n in conn.execute(_STALE, params).scalars()]
            if stale:
                conn.exec_driver_sql("SET LOCAL lock_timeout = '5s'")
            for name in stale:
                conn.exec_driver_sql(f'ANALYZE "{name}"')
    except errors.QueueError as exc:
        logger.warning(
            "statistics not refreshed; reconcile may be slow on large tables",
            extra={"action": "analyze_skipped", "error": str(exc)},
        )
        return []
    if stale:
        logger.info("tables analyzed", extra={"action": "analyze", "tables": stale})
    return stale


def _ledger_rows(conn: Connection, scope: _Scope) -> list[Any]:
    window: list[sa.ColumnElement[bool]] = [sa.true()]
    if scope.since is not None:
        window.append(_B.c.committed_at >= scope.since)
    if scope.run_id is not None:
        window.append(scope.of_run())
    referenced = sa.select(_I.c.batch_id).where(*scope.done()).scalar_subquery()
    q = _B.select().where(
        _B.c.queue == scope.queue,
        scope.ours,
        sa.or_(sa.and_(*window), _B.c.batch_id.in_(referenced)),
    )
    return list(conn.execute(q.order_by(_B.c.committed_at, _B.c.batch_id)))


def _foreign_batches(conn: Connection, scope: _Scope) -> dict[str, tuple[str, str]]:
    """Batches done items point at that the sink judged does not own: ``(sink, path)`` each."""
    referenced = sa.select(_I.c.batch_id).where(*scope.done()).scalar_subquery()
    q = sa.select(_B.c.batch_id, _B.c.sink, _B.c.path).where(
        _B.c.batch_id.in_(referenced), sa.not_(scope.ours)
    )
    return {str(r.batch_id): (str(r.sink), str(r.path)) for r in conn.execute(q)}


def _done_items(conn: Connection, scope: _Scope) -> tuple[DoneItem, ...]:
    q = sa.select(_I.c.item_key, _I.c.batch_id).where(*scope.done())
    return tuple(DoneItem(r.item_key, r.batch_id) for r in conn.execute(q))


def _health(conn: Connection, scope: _Scope) -> dict[str, Any]:
    """Stale leases, dead and expired tallies, late items (queue-wide; ``since`` applies)."""
    stale: sa.Select[Any] | sa.CompoundSelect[Any] = sa.select(_I.c.item_key).where(
        _I.c.queue == scope.queue,
        _I.c.state == int(models.State.LEASED),
        _I.c.lease_expires_at < scope.now,
    )
    lapsed = schema.held_by_ranges(conn, queue=scope.queue, lapsed_at=scope.now)
    if lapsed is not None:  # a range lease's items stay ready in the table
        ranged = sa.select(_I.c.item_key).where(
            _I.c.queue == scope.queue, _I.c.state == int(models.State.READY), lapsed
        )
        stale = sa.union_all(stale, ranged)
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


def _chunks(values: Sequence[str]) -> Iterable[list[str]]:
    for start in range(0, len(values), _CHUNK):
        yield list(values[start : start + _CHUNK])


# ----------------------------------------------------------------------------- repair


@dataclass
class _Repairer:
    queue: ports.ReconcilePort
    sink: sinks.Sink
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
        done = [b for b in f.batch_ids if self.sink.publish(b)]
        return [Repair("roll_forward", b, len(f.item_keys)) for b in done]

    def orphan(self, f: Finding) -> list[Repair]:
        return [Repair("quarantine", t) for t in self.sink.set_aside(f.files, f.batch_ids)]

    def retire(self, f: Finding) -> list[Repair]:
        """Missing or corrupt output: set aside what is there, requeue its items, retire the row."""
        (batch_id,) = f.batch_ids
        out = []
        if f.kind is Kind.TRUNCATED_OR_CORRUPT:
            out += [Repair("quarantine", t) for t in self.sink.set_aside(f.files, f.batch_ids)]
        with self.queue.begin() as conn:
            n = _requeue(conn, self.queue.queue, None, batch_id, str(f.kind), self.now)
            ledger.retire(conn, batch_id)
        return [*out, Repair("requeue", batch_id, n)]

    def duplicate(self, f: Finding) -> list[Repair]:
        loser = f.batch_ids[0]
        winners = {}
        for key, winner in f.details["winner_by_key"].items():
            while winner in self.rewritten:
                winner = self.rewritten[winner]
            winners[key] = winner
        with self.queue.begin() as conn:
            # The first copy's row may be one `purge --ledger` deleted since the findings
            # were read (no item pointed at it): an item pointed there now would read as a
            # lost write and be scored a third time (a review). After the hold, the row is
            # there and the purge sees the item, or it is gone and both copies stay.
            retention.hold(conn, self.queue.queue)
            states = ledger.states(conn, set(winners.values()))
            if any(states.get(w) not in models.LIVE_BATCH_STATES for w in winners.values()):
                logger.warning(
                    "duplicate left: its first copy's ledger row was purged meanwhile",
                    extra={"action": "repair_skipped", "batch_id": loser},
                )
                return []
            for key, winner in winners.items():
                conn.execute(
                    _I.update()
                    .where(_I.c.batch_id == loser, _I.c.item_key == key)
                    .values(batch_id=winner)
                )
        new = self.sink.drop_rows(loser, f.item_keys)
        if new is not None and new != loser:
            self.rewritten[loser] = new
        target = loser if new in (None, loser) else f"{loser} -> {new}"
        return [Repair("drop_duplicates", target, f.count)]

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
    queue: ports.ReconcilePort,
    sink: sinks.Sink,
    *,
    since: float | None = None,
    run_id: str | None = None,
    now: float,
    repair: bool = False,
    dataset_lost: bool = False,
) -> Report:
    """Check that every done item of ``queue`` has exactly one committed output in ``sink``.

    Args:
        queue: the queue (its database holds the ledger).
        sink: the output the items were committed to; it answers for its own facts and repairs.
        since: only items finished and batches committed at or after this time (epoch s);
            batches that window's items point at are always included.
        run_id: only batches of this run (or of its workers) and the items they committed.
        now: the time stale leases are judged against (epoch s).
        repair: fix what can be fixed (see the module docstring); never deletes data.
        dataset_lost: judge the ledger's batches even when the output holds nothing at all
            (a Parquet sink refuses otherwise: a wrong root would read as every file lost).

    Returns:
        The findings as gathered before any repair, and the repairs made.

    Raises:
        QueueError: the database failed. SinkError: the output could not be read or changed.
        ConfigError: the sink refuses to judge (see ``dataset_lost``).
    """

    def find() -> tuple[Finding, ...]:
        found = gather(queue, sink, since=since, run_id=run_id, now=now, dataset_lost=dataset_lost)
        return tuple(classify(found))

    findings = find()
    repairs: tuple[Repair, ...] = ()
    if repair and findings:
        repairs = tuple(_Repairer(queue, sink, now).run(findings))
        if any(r.action == "release_expired" and r.n_items for r in repairs):
            # A dead scorer's staging files were in flight while its leases held; reaped,
            # they are leftovers: moved now, not by a second --repair.
            left = [f for f in find() if f.kind is Kind.ORPHAN_FILE]
            repairs += tuple(_Repairer(queue, sink, now).run(left))
    if repairs:
        _restart_sweep(queue, sink)
    location = sink.describe()["location"]
    report = Report(
        sink.kind, location, now, since, run_id, findings, repairs, not_done=not_done(queue)
    )
    _log(report)
    reconcile_result.remember(queue, report)
    return report


def not_done(queue: ports.Fence) -> tuple[int, int]:
    """The queue's items not done, (leased, ready), a range lease's items counted leased:
    what a reconcile did not judge (a "clean" beside a dead scorer's shard still leased read
    as the whole dataset scored; found by a review)."""
    t, r = schema.items, schema.ranges
    with queue.read() as conn:
        by_state: dict[int, int] = dict(
            conn.execute(
                sa.select(t.c.state, sa.func.count())
                .where(t.c.queue == queue.queue, t.c.state.in_((0, 1)))
                .group_by(t.c.state)
            ).all()
        )
        held = conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(r.c.remaining), 0)).where(
                r.c.queue == queue.queue
            )
        ).scalar_one()
    return int(by_state.get(1, 0)) + int(held), int(by_state.get(0, 0)) - int(held)


def sweep_name(queue: str, sink: sinks.Sink) -> str:
    """A full sweep's name in ``batching_sweeps``: one per queue and output location."""
    name = f"{queue}|{sink.kind}|{sink.describe()['location']}"
    if len(name) <= 300:
        return name
    return f"{name[:280]}#{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def _restart_sweep(queue: ports.ReconcilePort, sink: sinks.Sink) -> None:
    """A repair changed what an unfinished full sweep of this output has checked: its pages
    so far (and the findings it carries from them) are stale, so its next run starts over.
    Resumed, it reported a file the repair had requeued and the queue had scored again as
    still missing (critical, exit 1), and counted the items of the pages before twice."""
    name = sweep_name(queue.queue, sink)
    unfinished = sa.and_(schema.sweeps.c.name == name, schema.sweeps.c.finished_at.is_(None))
    with queue.begin() as conn:
        gone = conn.execute(schema.sweeps.delete().where(unfinished)).rowcount
    if gone:
        logger.info(
            "a repair changed what the full sweep had checked: its next run starts over",
            extra={"action": "sweep_restart", "sweep": name},
        )


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
