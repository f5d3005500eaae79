"""What reconcile is told about the outputs: value types a sink fills in and the pure
classification in :mod:`batching.evidence.findings` reads; standard library only.

Reconcile reads the queue and the batch ledger itself; each sink answers for its own output
(:class:`OutputFacts`), in three steps around the one database snapshot reconcile reads:

1. ``sink.survey()`` before the snapshot: what a reader can see (files listed, a table
   version). Listing first is what makes reconcile safe beside a live scorer: an output
   becomes visible only after its ledger row commits, so nothing listed can be newer than the
   ledger read after it.
2. ``sink.observe(conn, survey, rows)`` inside the snapshot: what the ledger says of what was
   listed (the states of visible files' rows, staging files' leases, outbox rows).
3. ``sink.inspect(rows, done, observed)`` after it: each ledger row checked against the output
   (:class:`BatchFacts`), and which done items have their output (:class:`DoneItem`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from batching import models


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """One ledger row and what was found for it.

    ``where``: ``dataset`` or ``staging`` (its output found there), ``missing``, ``table`` (a
    table keyed by item: judged per item, not per batch), ``pending`` (committed, its output
    waits in the outbox for the roll-forward), ``retired`` (row quarantined or superseded;
    not checked) or ``unsafe`` (its path leads outside the output root: never read or acted on). ``file``: what was checked (an absolute path, a table), the ledger path when
    missing. ``keys``: item keys found in the output, None when not read (a table, retired,
    pending) or unreadable (then ``problem`` says why).
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
        return self.state in models.LIVE_BATCH_STATES


@dataclass(frozen=True, slots=True)
class DoneItem:
    """A done item; ``has_output``: whether a table keyed by item holds its key (None when the
    output is judged per batch, from the keys in its batch's file)."""

    item_key: str
    batch_id: str | None
    has_output: bool | None = None


@dataclass(frozen=True, slots=True)
class StagingFile:
    """A file in the staging folder; ``batch_id`` None when the name is not a staging name."""

    path: str
    batch_id: str | None
    ledger_state: str | None
    lease_held: bool  # a commit may still follow: its claim holds items, or a repair wrote it


@dataclass(frozen=True)
class Survey:
    """What a reader could see before the ledger was read (step 1): visible files (absolute
    paths) and the files in staging."""

    visible: tuple[str, ...] = ()
    staged: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Observed:
    """What the ledger says of the survey (step 2): each visible file's ledger state (None: no
    row), the staging files, and the batches whose rows wait in the outbox."""

    visible: Mapping[str, str | None] = field(default_factory=dict)
    staging: tuple[StagingFile, ...] = ()
    outbox: frozenset[str] = frozenset()
    output_empty: bool | None = None
    """Whether the output was seen to hold nothing at all (the full sweep probes it once and
    passes ledger pages without a listing); None: judged from ``visible``."""


@dataclass(frozen=True)
class OutputFacts:
    """A sink's answer (step 3).

    ``batches``: one per ledger row in scope. ``done``: the done items, with ``has_output``
    where the sink judges per item. ``foreign_batches``: batches done items point at that this
    output does not judge (written to another dataset root). ``other_datasets``: those roots,
    with how many batches of the scope each holds. ``visible``: each visible file -> its
    ledger row's state (None: no row). ``orphan_batches``: batches whose rows a reader sees in
    a table without a live ledger row.
    """

    batches: tuple[BatchFacts, ...] = ()
    done: tuple[DoneItem, ...] = ()
    foreign_batches: frozenset[str] = frozenset()
    visible: Mapping[str, str | None] = field(default_factory=dict)
    staging: tuple[StagingFile, ...] = ()
    other_datasets: Mapping[str, int] = field(default_factory=dict)
    orphan_batches: tuple[str, ...] = ()


@runtime_checkable
class ListedOutput(Protocol):
    """A sink whose output is files a reader lists (Parquet): the full sweep walks them in
    order, a page at a time, instead of ``survey()``'s one listing of everything."""

    def visible_after(self, after: str | None) -> Iterator[str]:
        """Visible files (absolute paths) in walk order, those after ``after`` only (a
        path this iterator yielded); the walk holds one folder's entries at a time."""
        ...

    def walk_key(self, path: str) -> tuple[str, ...]:
        """The order ``visible_after`` yields in (compare two paths by it)."""
        ...

    def staging_survey(self) -> Survey:
        """The staging folder listed now (no visible file)."""
        ...
