"""The batch ledger's retention horizon (migration 19).

The ledger (``batching_batches``) gains a row with every commit, and reconcile needs a
commit's row for as long as its output exists: without retention it grows with commits for
ever (an online queue at low load commits each item alone: ~1.7M rows a day at 20 requests
a second). ``batching purge --ledger`` therefore deletes the rows of a queue committed before
a UTC midnight, the **horizon** H, that nothing needs any more: ``published``, no item row
pointing at them (retention purged those first) and no outbox row. H is recorded in the
queue's row of ``batching_queue_controls`` in the transaction that deletes the first of
them, and never moves back.

What the horizon means to the readers of the ledger:

* A batch's output is in the UTC day it was scored in (a Parquet ``date=`` partition, a
  Delta ``date``, a SQL row's ``scored_at``), which is no later than the day its row was
  committed in. So an output in a day before H's that no ledger row names may be one whose
  row retention deleted: reconcile does not call it an orphan (:func:`excused`). From H's
  day on, every output still has its row, and one without is an orphan as ever.
* A version pinned before H may have committed outputs whose rows are gone: it counts as
  committed (``batching.ingress.version_pins``).

The cost: orphans and duplicates of outputs scored before H's day are no longer found
(everything committed since is judged as before). Keep the horizon behind the reconcile
window, and behind the full sweep's last finished pass.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching.store import schema

DAY_S = 86400.0
MAX_AGE_S = 36500 * DAY_S
"""The longest age a purge (or any duration option) takes, 100 years: a cutoff that far back
is still a date (``99999999999d`` passed and failed turning into one, half-way through)."""
_LOCK_SPACE = 7271103  # pg_advisory_xact_lock(this, hashtext(queue)): purge and repairs


def midnight(epoch_s: float) -> float:
    """The UTC midnight at or before ``epoch_s``."""
    return math.floor(epoch_s / DAY_S) * DAY_S


def day(epoch_s: float) -> str:
    """``epoch_s``'s UTC day, ``YYYY-MM-DD`` (the form of a ``date=`` partition)."""
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d")


def horizon(conn: Connection, queue: str | None) -> float | None:
    """The queue's ledger horizon, read in ``conn``'s transaction; None: nothing purged.

    ``queue`` None: the latest of every queue's, for an output's readers: queues of one
    database may share an output, and a file (a Delta row) names no queue by its path, so
    one queue's purged rows would read as orphans to the other's reconcile (a review)."""
    c = schema.queue_controls.c
    q = sa.select(sa.func.max(c.ledger_horizon))
    found = conn.execute(q if queue is None else q.where(c.queue == queue)).scalar()
    return None if found is None else float(found)


def hold(conn: Connection, queue: str) -> None:
    """Take turns, until ``conn``'s transaction ends, with a purge of ``queue``'s ledger: a
    repair pointing an item at a batch checks the batch's row is still there after this,
    and the purge sees the item after it (PostgreSQL: an advisory lock; SQLite: the
    writer lock already does)."""
    if conn.dialect.name == "postgresql":
        conn.execute(
            sa.text("SELECT pg_advisory_xact_lock(:space, hashtext(:queue))"),
            {"space": _LOCK_SPACE, "queue": queue},
        )


def excused(scored_day: str, at: float | None) -> bool:
    """Whether an output of UTC day ``scored_day`` (``YYYY-MM-DD``) that no ledger row names
    may be one whose row retention deleted: the day is before the horizon ``at``'s."""
    return at is not None and scored_day < day(at)
