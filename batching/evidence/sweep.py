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
import hashlib
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import facts, models, ports
from batching.evidence import reconcile as rc
from batching.evidence.findings import (
    SAMPLE_KEYS,
    Facts,
    Finding,
    Kind,
    Repair,
    Report,
    Severity,
    classify,
)
from batching.outputs import contract as sinks
from batching.store import schema

logger = logging.getLogger(__name__)

PAGE_SIZE = 500
"""Ledger rows (and visible files) a page at most."""
ITEM_PAGE_SIZE = 50_000
"""Items a page at most: a ledger page stops at the row whose items (``n_rows``) pass it (one
row at least), and a page of the ``items`` phase spans this many item ids."""
PHASES = ("ledger", "items", "files", "queue", "done")
_CHUNK = 500
_I = schema.items
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


@dataclass
class _State:
    """What ``batching_sweeps`` keeps of a sweep (``cursor`` and ``progress``, JSON)."""

    started_at: float
    phase: str = "ledger"
    after: Any = None  # ledger: [committed_at, batch_id]; items: an id; files: a path
    upto: int | None = None  # items: the highest item id when the phase began
    pages: int = 0
    batches: int = 0
    items: int = 0
    files: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)
    other_datasets: dict[str, int] = field(default_factory=dict)

    def cursor(self) -> str:
        return json.dumps({"phase": self.phase, "after": self.after, "upto": self.upto})

    def progress(self) -> str:
        doc = dataclasses.asdict(self)
        for key in ("started_at", "phase", "after", "upto"):
            doc.pop(key)
        return json.dumps(doc)

    @classmethod
    def load(cls, row: Any) -> _State:
        cursor, progress = json.loads(row.cursor or "{}"), json.loads(row.progress or "{}")
        return cls(started_at=row.started_at, **cursor, **progress)

    def next_phase(self) -> None:
        self.phase = PHASES[PHASES.index(self.phase) + 1]
        self.after, self.upto = None, None


def sweep_name(queue: str, sink: sinks.Sink) -> str:
    """The sweep's name in ``batching_sweeps``: one per queue and output location."""
    name = f"{queue}|{sink.kind}|{sink.describe()['location']}"
    if len(name) <= 300:
        return name
    return f"{name[:280]}#{hashlib.sha256(name.encode()).hexdigest()[:16]}"


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
        max_seconds: stop after the first page that ends past this many seconds.
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
        ConfigError: the sink refuses to judge (see ``dataset_lost``).
    """
    if page_size < 1 or item_page_size < 1:
        raise ValueError("page_size and item_page_size must be at least 1")
    name = sweep_name(queue.queue, sink)
    rc.fresh_statistics(queue)
    state, carried = _start(queue, name, now, restart=restart)
    walker = _Walker(queue, sink, now, state, dataset_lost, page_size, item_page_size)
    repairer = rc._Repairer(queue, sink, now) if repair else None
    found: list[Finding] = []
    repairs: list[Repair] = []
    ends = None if max_seconds is None else time.monotonic() + max_seconds
    pages_now = 0
    while state.phase != "done":
        if (max_pages is not None and pages_now >= max_pages) or (
            ends is not None and time.monotonic() > ends
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
        sink.kind, location, now, None, None, findings, tuple(repairs), progress.to_dict()
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
) -> tuple[_State, tuple[Finding, ...]]:
    """The sweep's state: resumed from its row, or a fresh one (none, finished, ``restart``)."""
    with queue.read() as conn:
        row = conn.execute(_S.select().where(_S.c.name == name)).first()
    if row is not None and row.finished_at is None and not restart:
        state = _State.load(row)
        logger.info(
            "sweep resumed",
            extra={"action": "sweep_resumed", "sweep": name, "phase": state.phase},
        )
        return state, tuple(Finding.from_dict(d) for d in state.findings)
    state = _State(started_at=now)
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


def _record(queue: ports.ReconcilePort, name: str, state: _State, now: float) -> None:
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


def _progress(name: str, state: _State, pages_now: int) -> Progress:
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


# ----------------------------------------------------------------------------- the phases


@dataclass
class _Walker:
    queue: ports.ReconcilePort
    sink: sinks.Sink
    now: float
    state: _State
    dataset_lost: bool
    page_size: int
    item_page_size: int
    _listing: Iterator[str] | None = None
    _empty: bool | None = None

    def step(self) -> list[Finding]:
        """One page of the current phase; moves the cursor (and the phase, at its end)."""
        phase: Callable[[], list[Finding]] = getattr(self, f"_{self.state.phase}")
        return phase()

    # -- ledger ----------------------------------------------------------------------------

    def _ledger(self) -> list[Finding]:
        empty = self._output_empty()
        with self.queue.read() as conn:
            after, owns = self.state.after, self.sink.owns()
            rows = _ledger_page(conn, self.queue.queue, owns, after, self.page_size)
            rows = _up_to(rows, self.item_page_size)
            if not rows:
                self.state.next_phase()
                return []
            done = _done_items(conn, self.queue.queue, [r.batch_id for r in rows])
            observed = self.sink.observe(conn, facts.Survey(), rows)
        observed = dataclasses.replace(observed, output_empty=empty)
        out = self.sink.inspect(rows, done, observed, dataset_lost=self.dataset_lost)
        self.state.after = [rows[-1].committed_at, rows[-1].batch_id]
        self.state.batches += len(rows)
        self.state.items += len(done)
        others = Counter(self.state.other_datasets)
        others.update(out.other_datasets)
        self.state.other_datasets = dict(others)
        seen = {
            b for d in self.state.findings if d["class"] == "orphan_file" for b in d["batch_ids"]
        }
        page = {r.batch_id for r in rows}
        found = classify(
            Facts(
                self.sink.kind,
                out.batches,
                out.done,
                out.foreign_batches,
                orphan_batches=tuple(b for b in out.orphan_batches if b not in seen),
                now=self.now,
            ),
            copies=self._copies(out.batches, done, page),
        )
        # A duplicate is this page's when one of its batches is in the page, and said once
        # (two batches each pointing at the other's keys are read from both pages).
        said = {_pair(d["batch_ids"], d["item_keys"]) for d in self.state.findings}
        return [
            f
            for f in found
            if f.kind is not Kind.DUPLICATE
            or (page & set(f.batch_ids) and _pair(f.batch_ids, f.item_keys) not in said)
        ]

    def _output_empty(self) -> bool | None:
        """Whether a listed output holds no file at all (probed once a call), else None."""
        if self._empty is None and isinstance(self.sink, facts.ListedOutput):
            self._empty = next(iter(self.sink.visible_after(None)), None) is None
        return self._empty

    def _copies(
        self,
        batches: Sequence[facts.BatchFacts],
        done: Sequence[facts.DoneItem],
        page: set[str],
    ) -> tuple[facts.BatchFacts, ...]:
        """The batches that done items point at whose keys a page's files hold too."""
        pointed: dict[str | None, set[str]] = {}
        for d in done:
            pointed.setdefault(d.batch_id, set()).add(d.item_key)
        keys = sorted(
            {
                k
                for b in batches
                if b.live and b.keys
                for k in b.keys - pointed.get(b.batch_id, set())
            }
        )
        if not keys:
            return ()
        with self.queue.read() as conn:
            ids: set[str] = set()
            for chunk in rc._chunks(keys):
                at = [_I.c.queue == self.queue.queue, _I.c.item_key.in_(chunk)]
                q = sa.select(_I.c.batch_id).where(*at, _I.c.batch_id.is_not(None))
                ids.update(str(b) for b in conn.execute(q).scalars())
            wanted = sorted(ids - page)
            rows = [
                r
                for chunk in rc._chunks(wanted)
                for r in conn.execute(_B.select().where(_B.c.batch_id.in_(chunk), self.sink.owns()))
            ]
        if not rows:
            return ()
        observed = facts.Observed(output_empty=False)
        return self.sink.inspect(rows, (), observed, dataset_lost=self.dataset_lost).batches

    # -- items -----------------------------------------------------------------------------

    def _items(self) -> list[Finding]:
        with self.queue.read() as conn:
            if self.state.upto is None:
                self.state.upto = int(conn.execute(sa.select(sa.func.max(_I.c.id))).scalar() or 0)
                self.state.after = 0
            lo = int(self.state.after)
            hi = min(lo + self.item_page_size, self.state.upto)
            rows = _unbatched(conn, self.queue.queue, lo, hi)
        self.state.after = hi
        if hi >= self.state.upto:
            self.state.next_phase()
        done = tuple(facts.DoneItem(r.item_key, r.batch_id) for r in rows)
        return classify(Facts(self.sink.kind, done=done, now=self.now))

    # -- files -----------------------------------------------------------------------------

    def _files(self) -> list[Finding]:
        """Visible files in walk order (the staging folder with the first page); a sink
        that lists no files passes the phase."""
        sink = self.sink
        if not isinstance(sink, facts.ListedOutput):
            self.state.next_phase()
            return []
        staged: tuple[Any, ...] = ()
        if self.state.after is None:  # the staging folder, once, listed first
            staged = sink.staging_survey().staged
        if self._listing is None:  # kept between pages: a folder is listed once a call
            self._listing = sink.visible_after(self.state.after)
        chunk = tuple(itertools.islice(self._listing, self.page_size))
        with self.queue.read() as conn:
            observed = self.sink.observe(conn, facts.Survey(chunk, staged), ())
        out = self.sink.inspect((), (), observed, dataset_lost=True)
        self.state.files += len(chunk)
        if len(chunk) < self.page_size:
            self.state.next_phase()
        else:
            self.state.after = chunk[-1]
        return classify(
            Facts(self.sink.kind, visible=out.visible, staging=out.staging, now=self.now)
        )

    def _queue(self) -> list[Finding]:
        scope = rc._Scope(self.queue.queue, self.sink.owns(), None, None, self.now)
        with self.queue.read() as conn:
            health = rc._health(conn, scope)
            others = Counter(self.state.other_datasets)
            others.update(_other_datasets(conn, self.queue.queue, self.sink))
        self.state.next_phase()
        return classify(Facts(self.sink.kind, **health, other_datasets=dict(others), now=self.now))


def _ledger_page(
    conn: Connection, queue: str, owns: sa.ColumnElement[bool], after: Any, n: int
) -> list[Any]:
    q = _B.select().where(_B.c.queue == queue, owns)
    if after is not None:
        at, batch_id = after
        # ``committed_at >=`` first: the planner reads the committed_at index from there.
        q = q.where(
            _B.c.committed_at >= at,
            sa.or_(_B.c.committed_at > at, _B.c.batch_id > batch_id),
        )
    return list(conn.execute(q.order_by(_B.c.committed_at, _B.c.batch_id).limit(n)))


def _pair(batch_ids: Sequence[str], keys: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    return tuple(sorted(batch_ids)), tuple(keys[:SAMPLE_KEYS])


def _up_to(rows: list[Any], n_items: int) -> list[Any]:
    """The first of ``rows`` whose items (the ledger's ``n_rows``) add up to at most
    ``n_items``; at least one row."""
    total = 0
    for n, row in enumerate(rows):
        total += int(row.n_rows or 0)
        if n and total > n_items:
            return rows[:n]
    return rows


def _done_items(conn: Connection, queue: str, batch_ids: list[str]) -> tuple[facts.DoneItem, ...]:
    out: list[facts.DoneItem] = []
    for chunk in rc._chunks(batch_ids):
        q = sa.select(_I.c.item_key, _I.c.batch_id).where(
            _I.c.batch_id.in_(chunk), _I.c.queue == queue, _I.c.state == int(models.State.DONE)
        )
        out += (facts.DoneItem(k, b) for k, b in conn.execute(q).all())  # fetchall
    return tuple(out)


def _unbatched(conn: Connection, queue: str, lo: int, hi: int) -> list[Any]:
    """Done items with ids in ``(lo, hi]`` whose batch has no ledger row (or who have none).

    The range's batch ids first (a few per thousand items), looked up in the ledger by key;
    the items only of those missing: joining each item to the ledger cost a probe an item."""
    span = [_I.c.id > lo, _I.c.id <= hi, _I.c.queue == queue, _I.c.state == int(models.State.DONE)]
    named = [
        str(b)
        for b in conn.execute(sa.select(_I.c.batch_id).where(*span).distinct()).scalars()
        if b is not None
    ]
    known: set[str] = set()
    for chunk in rc._chunks(named):
        known.update(
            conn.execute(sa.select(_B.c.batch_id).where(_B.c.batch_id.in_(chunk))).scalars()
        )
    missing = [b for b in named if b not in known]
    lost: list[sa.ColumnElement[bool]] = [_I.c.batch_id.is_(None)]
    lost += [_I.c.batch_id.in_(chunk) for chunk in rc._chunks(missing)]
    q = sa.select(_I.c.item_key, _I.c.batch_id).where(*span, sa.or_(*lost)).order_by(_I.c.id)
    return list(conn.execute(q))


def _other_datasets(conn: Connection, queue: str, sink: sinks.Sink) -> dict[str, int]:
    """Batches of this kind of output written elsewhere (another table) that done items
    point at, per location: said, not judged here (as reconcile's)."""
    pointed = sa.exists().where(
        _I.c.batch_id == _B.c.batch_id, _I.c.state == int(models.State.DONE)
    )
    q = (
        sa.select(_B.c.path, sa.func.count())
        .where(_B.c.queue == queue, _B.c.sink == sink.kind, sa.not_(sink.owns()), pointed)
        .group_by(_B.c.path)
    )
    return {str(r[0]): int(r[1]) for r in conn.execute(q)}


__all__ = ["ITEM_PAGE_SIZE", "PAGE_SIZE", "Progress", "mark_runs_reconciled", "sweep", "sweep_name"]
