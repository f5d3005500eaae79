"""The full sweep: reconcile everything an output ever committed, a page at a time, resumable.

:func:`batching.evidence.reconcile.reconcile` judges one run, a ``since`` window, or
everything at once in memory; the scheduled one looks back a window, so a file lost after its
window passed is never seen. :func:`sweep` walks everything, in four phases, each in pages,
and records where it is in ``batching_sweeps`` after every page:

1. ``ledger``: the output's ledger rows of the queue by ``(committed_at, batch_id)``, with the
   done items pointing at them: each row's output checked by the sink (``observe`` and
   ``inspect``, as reconcile does: missing, truncated or corrupt, unpublished, keys absent)
   and the items' lost writes. A key in a batch's file whose item points at another batch
   is a copy: that batch is read too, and the two judged for duplicates (found through the
   items table: two copies of a key whose item row retention purged are not seen).
2. ``items``: done items by id range whose batch has no ledger row, or none at all.
3. ``files`` (sinks that list files, :class:`batching.facts.ListedOutput`): the visible files
   in walk order, each page's ledger states looked up by key (orphans), and the staging
   folder once (leftovers).
4. ``queue``: stale leases, dead, expired and late items, and batches written to another
   dataset (queue-wide aggregates, as reconcile without ``since``).

Memory: a page of ledger rows and their done items, a page of item ids, one folder's file
names at a time (the walk sorts each folder it enters), and the findings (what is wrong, not
what is right). A SQL table is looked up by key a page at a time; a Delta table is read a
day partition at a time (the days a page's batches were committed in, as reconcile reads
them: a page costs a day's rows). Findings of earlier pages are kept in the sweep's row (their item keys sampled
to ``SAMPLE_KEYS``) so a resumed sweep reports the whole sweep's.

Safe beside a live scorer as reconcile is: every page reads its ledger rows and items in one
snapshot; files are listed before the ledger states they are compared with are read (a file
is visible only after its ledger row commits); a row's output is looked for in staging first.
What commits after a phase passed its place is the next sweep's.

A sweep stopped part way (``max_pages``, ``max_seconds``, a crash) resumes after its cursor;
a finished one starts over; ``restart`` starts over now. Two sweeps of one output at once do
the work twice; neither is wrong. ``repair`` repairs each page's findings as reconcile does
(one ``_Repairer`` for the call) and checks nothing again. A sweep that ends without a
finding above info records ``reconciled_at`` on the runs it covered
(:func:`mark_runs_reconciled`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import ports
from batching.evidence import reconcile as rc
from batching.evidence import sweep_pages as pages
from batching.evidence.findings import (
    SAMPLE_KEYS,
    Finding,
    Kind,
    Repair,
    Report,
    Severity,
)
from batching.outputs import contract as sinks
from batching.store import schema

logger = logging.getLogger(__name__)

PAGE_SIZE = 500
"""Ledger rows (and visible files) a page at most."""
ITEM_PAGE_SIZE = 50_000
"""Items a page at most: a ledger page stops at the row whose items (``n_rows``) pass it (one
row at least), and a page of the ``items`` phase spans this many item ids."""
_B = schema.batches
_S = schema.sweeps
_R = schema.runs


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a sweep is, after a page: its phase, the pages and what they covered (all
    invocations of this sweep), ``pages_now`` of this call, findings so far."""

    name: str
    phase: str
    pages: int
    pages_now: int
    batches: int
    items: int
    files: int
    findings: int
    started_at: float
    finished: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sweep(
    queue: ports.ReconcilePort,
    sink: sinks.Sink,
    *,
    now: float,
    restart: bool = False,
    max_pages: int | None = None,
    max_seconds: float | None = None,
    page_size: int = PAGE_SIZE,
    item_page_size: int = ITEM_PAGE_SIZE,
    repair: bool = False,
    dataset_lost: bool = False,
    on_page: Callable[[Progress], None] | None = None,
) -> Report:
    """Reconcile everything ``sink`` holds for ``queue``, a page at a time, from where the last
    sweep of this output stopped (see the module docstring).

    Args:
        queue: the queue (its database holds the ledger and the sweep's cursor).
        sink: the output; it answers for its own facts and repairs, as in reconcile.
        now: the time findings are judged against (epoch s), and recorded with the cursor.
        restart: start over even if a sweep of this output stopped part way.
        max_pages: stop after this many pages of this call (the cursor is kept).
        max_seconds: stop after the first page that ends past this many seconds (a call
            sweeps one page at least).
        page_size: ledger rows (and visible files) a page at most.
        item_page_size: items a page at most (a ledger page's done items as the ledger counts
            them, one batch at least; the ids a page of the ``items`` phase spans).
        repair: repair each page's findings as reconcile's ``repair`` does, page by page
            (nothing is checked again: the next sweep, or a reconcile, sees what is left).
        dataset_lost: as in reconcile.
        on_page: called after each page is recorded (a progress display).

    Returns:
        A report of every finding of this sweep so far (those of pages done before this
        call with their item keys sampled), its repairs, and ``sweep``: its progress.

    Raises:
        QueueError: the database failed. SinkError: the output could not be read or changed.
        ConfigError: the sink refuses to judge (see ``dataset_lost``; another database's
            output).
    """
    if page_size < 1 or item_page_size < 1:
        raise ValueError("page_size and item_page_size must be at least 1")
    sink.check_owner()  # as reconcile: another database's output is not judged here
    name = rc.sweep_name(queue.queue, sink)
    rc.fresh_statistics(queue)
    state, carried = _start(queue, name, now, restart=restart)
    walker = pages.Walker(queue, sink, now, state, dataset_lost, page_size, item_page_size)
    repairer = rc._Repairer(queue, sink, now) if repair else None
    found: list[Finding] = []
    repairs: list[Repair] = []
    ends = None if max_seconds is None else time.monotonic() + max_seconds
    pages_now = 0
    while state.phase != "done":
        if (max_pages is not None and pages_now >= max_pages) or (
            ends is not None and pages_now and time.monotonic() > ends
        ):
            break
        page = walker.step()
        found += page
        state.findings += [_kept(f) for f in page]
        if repairer is not None and page:
            repairs += repairer.run(page)
        state.pages, pages_now = state.pages + 1, pages_now + 1
        _record(queue, name, state, now)
        if on_page is not None:
            on_page(_progress(name, state, pages_now))
    findings = _merged((*carried, *found))
    if state.phase == "done" and all(f.severity is Severity.INFO for f in findings):
        with queue.begin() as conn:
            owns = sink.owns()
            mark_runs_reconciled(conn, queue.queue, owns, upto=state.started_at, now=now)
    progress = _progress(name, state, pages_now)
    location = sink.describe()["location"]
    report = Report(
        sink.kind,
        location,
        now,
        None,
        None,
        findings,
        tuple(repairs),
        progress.to_dict(),
        not_done=rc.not_done(queue),
    )
    _log(report, progress)
    return report


def mark_runs_reconciled(
    conn: Connection, queue: str, owns: sa.ColumnElement[bool], *, upto: float, now: float
) -> int:
    """Record ``reconciled_at = now`` on the runs of ``queue`` that finished by ``upto`` and
    committed batches ``owns`` selects (theirs or their workers'): a clean sweep that started
    at ``upto`` covered every one of those batches. Returns the runs marked."""
    worker = _R.alias("worker")
    of_run = sa.exists().where(_B.c.run_id == _R.c.run_id, owns)
    of_workers = sa.exists().where(
        worker.c.parent_run_id == _R.c.run_id, _B.c.run_id == worker.c.run_id, owns
    )
    stmt = (
        _R.update()
        .where(_R.c.queue == queue, _R.c.finished_at.is_not(None), _R.c.finished_at <= upto)
        .where(sa.or_(of_run, of_workers))
        .values(reconciled_at=now)
    )
    return int(conn.execute(stmt).rowcount)


def _start(
    queue: ports.ReconcilePort, name: str, now: float, *, restart: bool
) -> tuple[pages.State, tuple[Finding, ...]]:
    """The sweep's state: resumed from its row, or a fresh one (none, finished, ``restart``)."""
    with queue.read() as conn:
        row = conn.execute(_S.select().where(_S.c.name == name)).first()
    if row is not None and row.finished_at is None and not restart:
        state = pages.State.load(row)
        logger.info(
            "sweep resumed",
            extra={"action": "sweep_resumed", "sweep": name, "phase": state.phase},
        )
        return state, tuple(_finding(d) for d in state.findings)
    state = pages.State(started_at=now)
    with queue.begin() as conn:
        if row is not None:
            conn.execute(_S.delete().where(_S.c.name == name))
        conn.execute(
            _S.insert().values(
                name=name,
                cursor=state.cursor(),
                progress=state.progress(),
                started_at=now,
                updated_at=now,
            )
        )
    return state, ()


def _record(queue: ports.ReconcilePort, name: str, state: pages.State, now: float) -> None:
    values: dict[str, Any] = {"cursor": state.cursor(), "progress": state.progress()}
    values["updated_at"] = now
    if state.phase == "done":
        values["finished_at"] = now
    with queue.begin() as conn:
        conn.execute(_S.update().where(_S.c.name == name).values(**values))


def _kept(f: Finding) -> dict[str, Any]:
    """A finding as the sweep's row keeps it: its item keys (and winners) sampled."""
    keys = f.item_keys[:SAMPLE_KEYS]
    details = dict(f.details)
    if "winner_by_key" in details:
        details["winner_by_key"] = {k: details["winner_by_key"][k] for k in keys}
    return dataclasses.replace(f, item_keys=keys, details=details).to_dict()


def _finding(doc: Mapping[str, Any]) -> Finding:
    """A finding as :func:`_kept` wrote it."""
    return Finding(
        Kind(doc["class"]),
        Severity(doc["severity"]),
        str(doc["message"]),
        tuple(doc["item_keys"]),
        tuple(doc["files"]),
        tuple(doc["batch_ids"]),
        int(doc["count"]),
        dict(doc["details"]),
    )


def _merged(findings: Sequence[Finding]) -> tuple[Finding, ...]:
    """Lost writes of one batch and reason found on two pages (item id ranges) as one, as
    reconcile groups them; every other finding as it is."""
    out: list[Finding] = []
    at: dict[tuple[tuple[str, ...], str], int] = {}
    for f in findings:
        reason = f.message.partition(": ")[2]
        key = (f.batch_ids, reason)
        if f.kind is not Kind.LOST_WRITE or key not in at:
            if f.kind is Kind.LOST_WRITE:
                at[key] = len(out)
            out.append(f)
            continue
        first = out[at[key]]
        keys = tuple(sorted({*first.item_keys, *f.item_keys}))
        count = first.count + f.count
        message = f"{count} done items without output: {reason}"
        out[at[key]] = dataclasses.replace(first, message=message, item_keys=keys, count=count)
    return tuple(out)


def _progress(name: str, state: pages.State, pages_now: int) -> Progress:
    return Progress(
        name,
        state.phase,
        state.pages,
        pages_now,
        state.batches,
        state.items,
        state.files,
        len(state.findings),
        state.started_at,
        state.phase == "done",
    )


def _log(report: Report, progress: Progress) -> None:
    extra = {"action": "sweep", "ok": report.ok, "counts": report.counts}
    extra |= {"sweep": progress.name, "phase": progress.phase, "pages": progress.pages}
    extra |= {"pages_now": progress.pages_now, "finished": progress.finished}
    if not report.ok:
        logger.error("sweep found critical faults", extra=extra)
    elif not report.clean:
        logger.warning("sweep found warnings", extra=extra)
    else:
        logger.info("sweep page(s) clean", extra=extra)


__all__ = ["ITEM_PAGE_SIZE", "PAGE_SIZE", "Progress", "mark_runs_reconciled", "sweep"]
