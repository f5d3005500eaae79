"""Reconcile: prove every acked item has exactly one committed output; classify and repair.

Finding classes (severity), from the queue table, the ``batching_batches`` ledger and the files:

=====================  ========  =============================================================
class                  severity  meaning
=====================  ========  =============================================================
lost_write             critical  a done item has no committed output: no ledger row, its batch
                                 was retired, or its key is absent from the file / table
missing_file           critical  a live ledger row whose file is neither staged nor published
truncated_or_corrupt   critical  file unreadable, or size / sha256 / row count differ
orphan_file            critical  a visible ``*.parquet`` that no live ledger row names
                       warning   a staging leftover: never committed and its lease is gone
duplicate              critical  one ``(model_version, item_key)`` in two live batches
unpublished            warning   ledger ``committed`` but the file not published yet
stale_lease            warning   leased items whose lease expired and were not reaped
sla_miss               warning   items finished after their deadline, or expired
dead                   info      dead-lettered items, counted by ``last_error``
expired                info      items expired before scoring, counted by ``last_error``
=====================  ========  =============================================================

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

import enum
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import models, parquet, schema, sinks

if TYPE_CHECKING:
    from batching.queue import SqlQueue

logger = logging.getLogger(__name__)

OutputKind = Literal["parquet", "sql"]
SAMPLE_KEYS = 50
"""At most this many item keys are listed in an info or sla_miss finding (counts are exact)."""
_CHUNK = 500
_I = schema.items
_B = schema.batches


class Severity(enum.StrEnum):
    """How bad a finding is; any critical finding makes a report not ``ok``."""

    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


class Kind(enum.StrEnum):
    """Finding classes (see the module docstring)."""

    LOST_WRITE = "lost_write"
    MISSING_FILE = "missing_file"
    TRUNCATED_OR_CORRUPT = "truncated_or_corrupt"
    ORPHAN_FILE = "orphan_file"
    DUPLICATE = "duplicate"
    UNPUBLISHED = "unpublished"
    STALE_LEASE = "stale_lease"
    SLA_MISS = "sla_miss"
    DEAD = "dead"
    EXPIRED = "expired"


# ----------------------------------------------------------------------------- facts (input)


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """One ledger row and what was found for it.

    ``where``: ``dataset`` or ``staging`` (file found there), ``missing``, ``table`` (SQL
    sink) or ``retired`` (row quarantined or superseded; not checked). ``file``: the path
    checked (absolute), the ledger path when missing, or the table name. ``keys``: item keys
    in the file, None when not read (SQL, retired) or unreadable (then ``problem`` says why).
    """

    batch_id: str
    model_version: str
    state: str
    committed_at: float
    where: str
    file: str
    problem: str | None = None
    keys: frozenset[str] | None = None

    @property
    def live(self) -> bool:
        return self.state in sinks.LIVE_STATES


@dataclass(frozen=True, slots=True)
class DoneItem:
    """A done item; ``has_output`` is whether the SQL results table has its key (None: Parquet)."""

    item_key: str
    batch_id: str | None
    has_output: bool | None = None


@dataclass(frozen=True, slots=True)
class StagingFile:
    """A file in the staging folder; ``batch_id`` None when the name is not a staging name."""

    path: str
    batch_id: str | None
    ledger_state: str | None
    lease_held: bool


@dataclass(frozen=True, slots=True)
class ItemTally:
    """Items in one state: exact count, reasons (``last_error`` -> count), a sample of keys."""

    count: int = 0
    reasons: Mapping[str, int] = field(default_factory=dict)
    sample: tuple[str, ...] = ()


@dataclass(frozen=True)
class Facts:
    """Everything :func:`classify` needs; built by :func:`gather`, or by hand in tests.

    ``visible``: each visible file (absolute path) -> its ledger row's state (None: no row).
    ``foreign_batches``: batches of another sink that done items point at (not judged here).
    """

    output_kind: OutputKind
    batches: tuple[BatchFacts, ...] = ()
    done: tuple[DoneItem, ...] = ()
    foreign_batches: frozenset[str] = frozenset()
    visible: Mapping[str, str | None] = field(default_factory=dict)
    staging: tuple[StagingFile, ...] = ()
    stale_leases: tuple[str, ...] = ()
    dead: ItemTally = ItemTally()
    expired: ItemTally = ItemTally()
    late: ItemTally = ItemTally()


# ----------------------------------------------------------------------------- report (output)


@dataclass(frozen=True, slots=True)
class Finding:
    """One fault: its class, severity, message, and the item keys / files / batches concerned.

    ``count`` is the number of items (or files) concerned; it can exceed ``len(item_keys)``
    when keys are sampled.
    """

    kind: Kind
    severity: Severity
    message: str
    item_keys: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    batch_ids: tuple[str, ...] = ()
    count: int = 0
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": str(self.kind),
            "severity": str(self.severity),
            "message": self.message,
            "count": self.count,
            "item_keys": list(self.item_keys),
            "files": list(self.files),
            "batch_ids": list(self.batch_ids),
            "details": dict(self.details),
        }


@dataclass(frozen=True, slots=True)
class Repair:
    """One repair action: ``action`` on ``target``, touching ``n_items`` items."""

    action: str
    target: str
    n_items: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "target": self.target, "n_items": self.n_items}


@dataclass(frozen=True)
class Report:
    """What reconcile found (before any repair) and what it repaired."""

    output_kind: OutputKind
    location: str
    now: float
    since: float | None
    run_id: str | None
    findings: tuple[Finding, ...]
    repairs: tuple[Repair, ...] = ()

    @property
    def ok(self) -> bool:
        """No critical finding."""
        return not any(f.severity is Severity.CRITICAL for f in self.findings)

    @property
    def clean(self) -> bool:
        """No critical or warning finding (info only)."""
        return all(f.severity is Severity.INFO for f in self.findings)

    @property
    def counts(self) -> dict[str, int]:
        """Items (or files) concerned per finding class; classes with no finding are absent."""
        out: Counter[str] = Counter()
        for f in self.findings:
            out[str(f.kind)] += f.count
        return dict(out)

    def by_kind(self, kind: Kind) -> list[Finding]:
        return [f for f in self.findings if f.kind is kind]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "ok": self.ok,
            "clean": self.clean,
            "output_kind": self.output_kind,
            "location": self.location,
            "now": self.now,
            "since": self.since,
            "run_id": self.run_id,
            "counts": self.counts,
            "findings": [f.to_dict() for f in self.findings],
            "repairs": [r.to_dict() for r in self.repairs],
        }


# ----------------------------------------------------------------------------- classification


def classify(facts: Facts) -> list[Finding]:
    """Turn facts into findings (pure: no I/O), in a stable order."""
    keys_by_batch: dict[str | None, list[str]] = defaultdict(list)
    for item in facts.done:
        keys_by_batch[item.batch_id].append(item.item_key)
    findings = [f for b in facts.batches for f in _batch_findings(b, keys_by_batch)]
    findings += _duplicates(facts.batches)
    findings += _lost_writes(facts)
    findings += _orphans(facts)
    findings += _queue_findings(facts)
    return findings


def _batch_findings(b: BatchFacts, keys_by_batch: Mapping[str | None, list[str]]) -> list[Finding]:
    if not b.live or b.where == "table":
        return []
    if b.where == "missing":
        kind, severity, msg = Kind.MISSING_FILE, Severity.CRITICAL, "its file is missing"
    elif b.problem is not None:
        kind, severity, msg = Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL, b.problem
    elif b.state == sinks.COMMITTED or b.where == "staging":
        kind, severity, msg = Kind.UNPUBLISHED, Severity.WARNING, f"not published ({b.where})"
    else:
        return []
    keys = tuple(sorted(keys_by_batch.get(b.batch_id, ())))
    message = f"batch {b.batch_id} ({b.state}): {msg}"
    return [Finding(kind, severity, message, keys, (b.file,), (b.batch_id,), count=1)]


def _duplicates(batches: Sequence[BatchFacts]) -> list[Finding]:
    """Keys in two live batches of one model version: the first committed copy wins."""
    owners: dict[tuple[str, str], list[BatchFacts]] = defaultdict(list)
    for b in batches:
        if b.live and b.keys:
            for key in b.keys:
                owners[(b.model_version, key)].append(b)
    losers: dict[str, dict[str, BatchFacts]] = defaultdict(dict)
    by_id = {b.batch_id: b for b in batches}
    for (_, key), copies in owners.items():
        if len(copies) > 1:
            winner = min(copies, key=lambda b: (b.committed_at, b.batch_id))
            for b in copies:
                if b is not winner:
                    losers[b.batch_id][key] = winner
    return [_duplicate(by_id[loser], wins) for loser, wins in sorted(losers.items())]


def _duplicate(loser: BatchFacts, wins: Mapping[str, BatchFacts]) -> Finding:
    winners = sorted({w.batch_id: w for w in wins.values()}.values(), key=lambda w: w.batch_id)
    return Finding(
        Kind.DUPLICATE,
        Severity.CRITICAL,
        f"batch {loser.batch_id} repeats {len(wins)} keys already committed",
        item_keys=tuple(sorted(wins)),
        files=(loser.file, *(w.file for w in winners)),
        batch_ids=(loser.batch_id, *(w.batch_id for w in winners)),
        count=len(wins),
        details={"winner_by_key": {k: w.batch_id for k, w in sorted(wins.items())}},
    )


def _lost_writes(facts: Facts) -> list[Finding]:
    by_id = {b.batch_id: b for b in facts.batches}
    groups: dict[tuple[str | None, str], list[str]] = defaultdict(list)
    for item in facts.done:
        reason = _lost_reason(item, by_id.get(item.batch_id or ""), facts.foreign_batches)
        if reason is not None:
            groups[(item.batch_id, reason)].append(item.item_key)
    return [
        Finding(
            Kind.LOST_WRITE,
            Severity.CRITICAL,
            f"{len(keys)} done items without output: {reason}",
            item_keys=tuple(sorted(keys)),
            batch_ids=(batch_id,) if batch_id else (),
            count=len(keys),
        )
        for (batch_id, reason), keys in sorted(
            groups.items(), key=lambda g: (g[0][0] or "", g[0][1])
        )
    ]


def _lost_reason(item: DoneItem, batch: BatchFacts | None, foreign: frozenset[str]) -> str | None:
    """Why a done item has no committed output, or None when it has one (or is judged elsewhere)."""
    if item.batch_id is None:
        return "acked without a batch"
    if item.batch_id in foreign:
        return None
    if batch is None:
        return "its batch has no ledger row"
    if not batch.live:
        return f"its batch is {batch.state}"
    if batch.where == "missing" or batch.problem is not None:
        return None  # reported as missing_file / truncated_or_corrupt with these keys
    if item.has_output is False:
        return "no result row for its key"
    if batch.keys is not None and item.item_key not in batch.keys:
        return "its key is not in its batch's file"
    return None


def _orphans(facts: Facts) -> list[Finding]:
    out = []
    for path, state in sorted(facts.visible.items()):
        if state not in sinks.LIVE_STATES:
            why = "no ledger row" if state is None else f"its ledger row is {state}"
            msg = f"visible file that readers see is not committed ({why})"
            out.append(Finding(Kind.ORPHAN_FILE, Severity.CRITICAL, msg, files=(path,), count=1))
    for sf in facts.staging:
        in_flight = sf.ledger_state is None and sf.lease_held and sf.batch_id is not None
        if sf.ledger_state == sinks.COMMITTED or in_flight:
            continue
        why = "no ledger row" if sf.ledger_state is None else f"ledger row is {sf.ledger_state}"
        msg = f"staging leftover ({why}; lease gone)"
        out.append(Finding(Kind.ORPHAN_FILE, Severity.WARNING, msg, files=(sf.path,), count=1))
    return out


def _queue_findings(facts: Facts) -> list[Finding]:
    out = []
    if facts.stale_leases:
        n = len(facts.stale_leases)
        msg = f"{n} leased items past their lease, not reaped"
        keys = tuple(sorted(facts.stale_leases))
        out.append(Finding(Kind.STALE_LEASE, Severity.WARNING, msg, item_keys=keys, count=n))
    late = facts.late.count + facts.expired.count
    if late:
        msg = (
            f"{facts.late.count} items finished after their deadline, {facts.expired.count} expired"
        )
        keys = (facts.late.sample + facts.expired.sample)[:SAMPLE_KEYS]
        out.append(Finding(Kind.SLA_MISS, Severity.WARNING, msg, item_keys=keys, count=late))
    for kind, tally in ((Kind.DEAD, facts.dead), (Kind.EXPIRED, facts.expired)):
        if tally.count:
            msg = f"{tally.count} {kind} items"
            details = {"reasons": dict(tally.reasons)}
            out.append(
                Finding(kind, Severity.INFO, msg, tally.sample, count=tally.count, details=details)
            )
    return out


# ----------------------------------------------------------------------------- gathering


@dataclass(frozen=True)
class _Scope:
    queue: str
    kind: OutputKind
    table: str | None
    since: float | None
    run_id: str | None
    now: float

    def done(self) -> list[sa.ColumnElement[bool]]:
        conds = [_I.c.queue == self.queue, _I.c.state == int(models.State.DONE)]
        if self.since is not None:
            conds.append(_I.c.finished_at >= self.since)
        if self.run_id is not None:
            run = sa.select(_B.c.batch_id).where(_B.c.run_id == self.run_id)
            conds.append(_I.c.batch_id.in_(run.scalar_subquery()))
        return conds

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
) -> Facts:
    """Read the queue, the ledger and the files into :class:`Facts` (files listed first)."""
    table = str(target) if output_kind == "sql" else None
    scope = _Scope(queue.queue, output_kind, table, since, run_id, now)
    layout = None if table else parquet.ParquetLayout.for_root(target, staging)
    with sinks.translate_errors(f"cannot list {target}"):
        visible = [str(layout.root / p) for p in layout.visible_files()] if layout else []
        staged = layout.staging_files() if layout else []
    with queue.begin() as conn:
        rows = _ledger_rows(conn, scope)
        done = _done_items(conn, scope)
        foreign = _foreign_batches(conn, scope)
        visible_states = _visible_states(conn, layout, visible) if layout else {}
        listed = _staging_facts(conn, staged)
        health = _health(conn, scope)
    with sinks.translate_errors(f"cannot read {target}"):
        batches = tuple(_check_batch(layout, r) for r in rows)
        still = tuple(s for s in listed if Path(s.path).exists())  # published meanwhile
    return Facts(output_kind, batches, done, foreign, visible_states, still, **health)


def _ledger_rows(conn: Connection, scope: _Scope) -> list[Any]:
    window: list[sa.ColumnElement[bool]] = [sa.true()]
    if scope.since is not None:
        window.append(_B.c.committed_at >= scope.since)
    if scope.run_id is not None:
        window.append(_B.c.run_id == scope.run_id)
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
        r, sa.and_(r.c.model_version == _B.c.model_version, r.c.item_key == _I.c.item_key)
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
        StagingFile(str(p), b, states.get(b), lease in held) for p, (b, lease) in ours.items()
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
        if path is not None and path.is_file():  # staging first: a rename may be under way
            problem, keys = parquet.check_file(
                path, n_rows=row.n_rows, n_bytes=row.n_bytes, sha256=row.sha256
            )
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
                conn.execute(
                    _I.update()
                    .where(_I.c.batch_id == loser, _I.c.item_key == key)
                    .values(batch_id=winner)
                )
        new = self.sink.drop_rows(loser, f.item_keys)
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
) -> Report:
    """Check that every done item of ``queue`` has exactly one committed output.

    Args:
        queue: the queue (its database holds the ledger and, for SQL, the results table).
        sink_root_or_table: the Parquet dataset root, or the SQL results table name.
        output_kind: ``parquet`` or ``sql``.
        since: only items finished and batches committed at or after this time (epoch s);
            batches that window's items point at are always included.
        run_id: only batches of this run and the items they committed.
        now: the time stale leases are judged against (epoch s).
        repair: fix what can be fixed (see the module docstring); never deletes data.
        staging: the Parquet staging folder, when not the default ``<root>.staging``.

    Returns:
        The findings as gathered before any repair, and the repairs made.

    Raises:
        QueueError: the database failed. SinkError: a file could not be listed or moved.
    """
    location = str(sink_root_or_table)
    facts = gather(
        queue,
        location,
        output_kind=output_kind,
        since=since,
        run_id=run_id,
        now=now,
        staging=staging,
    )
    findings = tuple(classify(facts))
    repairs: tuple[Repair, ...] = ()
    if repair and findings:
        sink = (
            parquet.ParquetSink(queue, location, staging=staging)
            if output_kind == "parquet"
            else None
        )
        repairs = tuple(_Repairer(queue, sink, now).run(findings))
    report = Report(output_kind, location, now, since, run_id, findings, repairs)
    _log(report)
    return report


def _log(report: Report) -> None:
    extra = {"action": "reconcile", "ok": report.ok, "counts": report.counts}
    extra["n_repairs"] = len(report.repairs)
    if not report.ok:
        logger.error("reconcile found critical faults", extra=extra)
    elif not report.clean:
        logger.warning("reconcile found warnings", extra=extra)
    else:
        logger.info("reconcile clean", extra=extra)
