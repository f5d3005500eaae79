"""The full sweep's pages (:mod:`batching.evidence.sweep`): where a sweep is (:class:`State`,
kept in ``batching_sweeps``), and one page of each phase (:class:`Walker`) with the queries
it reads the queue and the ledger with."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import facts, models, ports
from batching.evidence import reconcile as rc
from batching.evidence.findings import SAMPLE_KEYS, Facts, Finding, Kind, classify
from batching.outputs import contract as sinks
from batching.store import schema

PHASES = ("ledger", "items", "files", "queue", "done")
_I = schema.items
_B = schema.batches


@dataclass
class State:
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
    def load(cls, row: Any) -> State:
        cursor, progress = json.loads(row.cursor or "{}"), json.loads(row.progress or "{}")
        return cls(started_at=row.started_at, **cursor, **progress)

    def next_phase(self) -> None:
        self.phase = PHASES[PHASES.index(self.phase) + 1]
        self.after, self.upto = None, None


# ----------------------------------------------------------------------------- the phases


@dataclass
class Walker:
    queue: ports.ReconcilePort
    sink: sinks.Sink
    now: float
    state: State
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
