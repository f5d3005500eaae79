"""Reconcile's findings: the facts it gathers, what it reports, and the pure classification.

Finding classes (severity), from the queue table, the ``batching_batches`` ledger and what each
sink reports of its output (files, a table; see :mod:`batching.facts`):

=====================  ========  =============================================================
class                  severity  meaning
=====================  ========  =============================================================
lost_write             critical  a done item has no committed output: no ledger row, its batch
                                 was retired, or its key is absent from the file / table
missing_file           critical  a live ledger row whose output is gone: its file neither staged
                                 nor published, its rows not in the table, its outbox row lost
truncated_or_corrupt   critical  file unreadable, or size / sha256 / row count differ
orphan_file            critical  a visible ``*.parquet`` that no live ledger row names, or rows
                                 of a batch in a table without one
                       warning   a staging leftover: never committed and its lease is gone
duplicate              critical  one ``(model_version, item_key)`` in two live batches
unpublished            critical  ledger ``committed`` (its items acked) but the output not
                                 published for over ``PUBLISH_GRACE_S``: readers miss acked
                                 items (a file in staging, rows waiting in the outbox)
                       warning   the same, committed less than ``PUBLISH_GRACE_S`` ago (a live
                                 scorer between its commit and its rename or roll-forward)
                       info      the file is published; the ledger's mark is not (a live
                                 scorer records it with its next commit; recovery or
                                 ``--repair`` does after a crash): readers see the file
stale_lease            warning   leased items whose lease expired and were not reaped
sla_miss               warning   items finished after their deadline, or expired
dead                   info      dead-lettered items, counted by ``last_error``
expired                info      items expired before scoring, counted by ``last_error``
other_dataset          warning   a batch missing here but whole in the other dataset root it
                                 was written to (not judged or repaired here: reconcile there)
unsafe_path            critical  a live ledger row names a path outside the dataset root or
                                 its staging folder (``..``, absolute, a symlink out): never
                                 read, moved or repaired; a person looks at the row
=====================  ========  =============================================================

:func:`classify` is pure: gathering (I/O) and repair live in :mod:`batching.evidence.reconcile`, so the
classification is unit-tested on hand-made :class:`Facts`.

Why it stays one module: the table above, the severities the report's verdicts read and the
rules that assign them are one contract; apart, a class's severity would drift from its rule.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batching import models
from batching.facts import BatchFacts, DoneItem, StagingFile

OutputKind = str
"""The sink that wrote the outputs judged (``sinks.Sink.kind``): ``parquet``, ``sql`` or ``delta``."""
SAMPLE_KEYS = 50
"""At most this many item keys are listed in an info or sla_miss finding (counts are exact)."""


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
    OTHER_DATASET = "other_dataset"
    UNSAFE_PATH = "unsafe_path"


# ----------------------------------------------------------------------------- facts (input)


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
    ``foreign_batches``: batches of another sink, or written to another dataset root, that
    done items point at (not judged here). ``other_datasets``: those other roots, with how
    many batches of the scope each holds.
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
    other_datasets: Mapping[str, int] = field(default_factory=dict)
    orphan_batches: tuple[str, ...] = ()
    now: float | None = None  # when the facts were read (None: every age is past the grace)


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
    """What reconcile found (before any repair) and what it repaired; ``sweep``: where a full
    sweep is (:mod:`batching.evidence.sweep`), None for a reconcile."""

    output_kind: OutputKind
    location: str
    now: float
    since: float | None
    run_id: str | None
    findings: tuple[Finding, ...]
    repairs: tuple[Repair, ...] = ()
    sweep: Mapping[str, Any] | None = None
    # The queue's items not done when it was judged, (leased, ready): not findings, not judged
    # (a dead scorer's are leased until their lease expires); None: not counted.
    not_done: tuple[int, int] | None = None

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
        return (
            {
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
            | ({"sweep": dict(self.sweep)} if self.sweep is not None else {})
            | (
                {"not_done": {"leased": self.not_done[0], "ready": self.not_done[1]}}
                if self.not_done is not None
                else {}
            )
        )


# ----------------------------------------------------------------------------- classification

PUBLISH_GRACE_S = 60.0
"""How long a committed batch may stay unpublished before reconcile calls it critical: a live
scorer publishes within milliseconds of its commit, so past this its publish failed."""


def classify(facts: Facts, *, copies: Sequence[BatchFacts] = ()) -> list[Finding]:
    """Turn facts into findings (pure: no I/O), in a stable order.

    ``copies``: batches outside the facts that hold keys of theirs (the full sweep reads
    them), judged for duplicates with ``facts.batches`` and for nothing else."""
    keys_by_batch: dict[str | None, list[str]] = defaultdict(list)
    for item in facts.done:
        keys_by_batch[item.batch_id].append(item.item_key)
    findings = [f for b in facts.batches for f in _batch_findings(b, keys_by_batch, facts.now)]
    findings += duplicates((*facts.batches, *copies))
    findings += _lost_writes(facts)
    findings += _orphans(facts)
    findings += _queue_findings(facts)
    for root, n in sorted(facts.other_datasets.items()):
        msg = f"{n} batch(es) not here but in {root}, where they were written: reconcile there"
        findings.append(Finding(Kind.OTHER_DATASET, Severity.WARNING, msg, files=(root,), count=n))
    return findings


def _batch_findings(
    b: BatchFacts, keys_by_batch: Mapping[str | None, list[str]], now: float | None
) -> list[Finding]:
    if not b.live or b.where == "table":
        return []
    if b.where == "unsafe":
        kind, severity = Kind.UNSAFE_PATH, Severity.CRITICAL
        msg = b.problem or "its ledger row names a path outside the dataset"
    elif b.where == "missing":
        kind, severity, msg = (
            Kind.MISSING_FILE,
            Severity.CRITICAL,
            b.problem or "its file is missing",
        )
    elif b.problem is not None:
        kind, severity, msg = Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL, b.problem
    elif b.where in ("staging", "pending"):
        # Its items are acked, yet readers do not see them: critical, unless the commit is so
        # recent that a live scorer may be publishing it right now.
        recent = now is not None and now - b.committed_at < PUBLISH_GRACE_S
        kind, severity = Kind.UNPUBLISHED, Severity.WARNING if recent else Severity.CRITICAL
        msg = (
            "acked but not published (its file is in staging)"
            if b.where == "staging"
            else "acked but not published (its rows wait in the outbox for the roll-forward)"
        )
    elif (
        b.state == models.BatchState.COMMITTED
    ):  # in the dataset: only the ledger's mark is pending
        kind, severity = Kind.UNPUBLISHED, Severity.INFO
        msg = (
            "published; its ledger mark is pending (a scorer's next start or commit on the "
            "queue records it, as does `batching reconcile --repair`)"
        )
    else:
        return []
    keys = tuple(sorted(keys_by_batch.get(b.batch_id, ())))
    message = msg if kind is Kind.UNSAFE_PATH else f"batch {b.batch_id} ({b.state}): {msg}"
    return [Finding(kind, severity, message, keys, (b.file,), (b.batch_id,), count=1)]


def duplicates(batches: Sequence[BatchFacts]) -> list[Finding]:
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
    if batch.where in ("missing", "pending", "unsafe") or batch.problem is not None:
        return None  # reported as missing_file / truncated_or_corrupt / unpublished / unsafe_path
    if item.has_output is False:
        return "no result row for its key"
    if batch.keys is not None and item.item_key not in batch.keys:
        return "its key is not in its batch's file"
    return None


def _orphans(facts: Facts) -> list[Finding]:
    out = []
    for path, state in sorted(facts.visible.items()):
        if state not in models.LIVE_BATCH_STATES:
            why = "no ledger row" if state is None else f"its ledger row is {state}"
            msg = f"visible file that readers see is not committed ({why})"
            out.append(Finding(Kind.ORPHAN_FILE, Severity.CRITICAL, msg, files=(path,), count=1))
    for batch_id in facts.orphan_batches:
        msg = f"rows of batch {batch_id} are in the table without a live ledger row"
        out.append(
            Finding(Kind.ORPHAN_FILE, Severity.CRITICAL, msg, batch_ids=(batch_id,), count=1)
        )
    for sf in facts.staging:
        in_flight = sf.ledger_state is None and sf.lease_held and sf.batch_id is not None
        if sf.ledger_state == models.BatchState.COMMITTED or in_flight:
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
