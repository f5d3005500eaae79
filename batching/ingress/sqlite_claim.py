"""A SQLite claim read back as ONE row: the claimed items' columns as JSON arrays and their
bodies as one blob (:data:`CLAIMED`), unpacked into work items or, for a claim of uniform
tensor items, one ``models.ItemBlock`` (:func:`unpack_claim`); see ``SqlQueue._claim_sqlite``
for why: ``sqlite3`` steps each row with the GIL released and retaken, while the claim held
SQLite's only write lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import orjson
import sqlalchemy as sa

from batching import models
from batching.store import schema

# A SQLite claim read back as ONE row of columns (see SqlQueue._claim_sqlite, unpack_claim):
# JSON arrays; body lengths (null: the body row is missing); the earliest and latest
# enqueued_at and the number of deadlines; the bodies concatenated. Every aggregate walks the
# same rows in the same order. Most claims need no more: their items were enqueued together
# and have no deadline. The others read their times with CLAIMED_TIMES.
_SQLITE_JSON_COLUMNS = (
    "i.id",
    "i.item_key",
    "i.payload_format",
    "i.dtype",
    "i.shape",
    "i.lane",
    "i.tenant",
    "i.priority",
    "i.cost",
    "i.attempts",
    "i.max_attempts",
    "length(p.payload)",
)
_WHOLE = "CAST({0} AS INTEGER)"
_FRACTION = "CAST(({0} - CAST({0} AS INTEGER)) * 4503599627370496 AS INTEGER)"
_TIMES = slice(len(_SQLITE_JSON_COLUMNS), len(_SQLITE_JSON_COLUMNS) + 3)  # min, max, deadlines
BODIES = _TIMES.stop  # CLAIMED's column of bodies


class Reads(NamedTuple):
    """The statements that read a claim back: ``claimed`` (its items as one row, bodies
    last), ``no_bodies`` (the same without the bodies, for a claim whose bodies add up to
    more than SQLite's longest blob) and ``times`` (each item's times, when needed)."""

    claimed: sa.TextClause
    no_bodies: sa.TextClause
    times: sa.TextClause


def _reads(where: str, attempts: str) -> Reads:
    columns = (attempts if c == "i.attempts" else c for c in _SQLITE_JSON_COLUMNS)
    head = (
        "SELECT "
        + ", ".join(f"json_group_array({c})" for c in columns)
        + ", min(i.enqueued_at), max(i.enqueued_at), count(i.deadline_at)"
    )
    source = " FROM batching_items i LEFT JOIN batching_payloads p ON p.id = i.id" + where
    # Each item's times, with its id, as two integers a time: its whole seconds and its
    # fraction times 2^52, exact for any time of at least 1 s (every clock time and deadline;
    # below that, within 2^-52 s). Text would not be: this SQLite's quote() and JSON keep 15
    # digits (87 of 700k random doubles came back changed through quote()), and formatting a
    # float cost ~0.5 us a row against ~0.15 for the integers. Read only for claims that need
    # it (see needs_times).
    times = (
        "SELECT json_group_array(i.id), "
        + ", ".join(
            f"json_group_array({part.format(column)})"
            for column in ("i.enqueued_at", "i.deadline_at")
            for part in (_WHOLE, _FRACTION)
        )
        + " FROM batching_items i"
        + where
    )
    return Reads(
        sa.text(head + ", CAST(group_concat(p.payload, '') AS BLOB)" + source),
        sa.text(head + source),
        sa.text(times),
    )


# A per-item lease's rows, by the leased index.
LEASE = _reads(
    " WHERE i.lease_expires_at = :expires AND i.state = 1 AND i.lease_id = :lease", "i.attempts"
)
# A range lease's rows, by id (read once the range has committed). They stay ready in the
# table, so the attempt the claim counts (written at ack or at demotion) is added here. A
# range may be demoted to item leases before it is read back (a failure of another batch of
# the same lease, on another thread of the scorer): its items are then leased by this lease.
RANGE = _reads(
    " WHERE i.id BETWEEN :range_lo AND :range_hi"
    " AND (i.state + 0 = 0 OR (i.state + 0 = 1 AND i.lease_id = :lease))",
    "i.attempts + (i.state = 0)",
)
CLAIMED, CLAIMED_NO_BODIES, CLAIMED_TIMES = LEASE
_FRACTION_UNIT = 2.0**-52


def _exact(whole: int, fraction: int) -> float:
    """A time from its ``CLAIMED_TIMES`` integers."""
    return whole + fraction * _FRACTION_UNIT  # both exact, and so is their sum: the time


def _exact_or_none(whole: int | None, fraction: int | None) -> float | None:
    return None if whole is None or fraction is None else _exact(whole, fraction)


def needs_times(row: Sequence[Any]) -> bool:
    """Whether a ``CLAIMED`` row's items need ``CLAIMED_TIMES``: enqueued at different times,
    or with a deadline."""
    earliest, latest, deadlines = row[_TIMES]
    return bool(earliest != latest or deadlines)


def _times(
    ids: list[int], row: Sequence[Any], times: Sequence[Any] | None
) -> tuple[list[float], list[float | None]]:
    """Each item's enqueued_at and deadline, in the order of ``ids``: from the ``CLAIMED``
    row's shared values, or from a ``CLAIMED_TIMES`` row."""
    n = len(ids)
    if times is None:
        return [row[_TIMES.start]] * n, [None] * n
    times_ids, *parts = map(orjson.loads, times)
    enqueued = list(map(_exact, parts[0], parts[1]))
    deadlines = list(map(_exact_or_none, parts[2], parts[3]))
    if times_ids != ids:  # another walk of the rows: align them by id
        at = dict(zip(times_ids, range(len(times_ids)), strict=True))
        enqueued = [enqueued[at[i]] for i in ids]
        deadlines = [deadlines[at[i]] for i in ids]
    return enqueued, deadlines


def _as_block(
    queue: str,
    cols: list[list[Any]],
    enqueued: list[float],
    deadlines: list[float | None],
    data: bytes | None,
) -> models.ItemBlock | None:
    """The parsed columns of a ``CLAIMED`` row as one ItemBlock, in claim order, when its items
    are uniform: tensor payloads of one dtype, shape and byte length, one lane, tenant,
    priority and cost, and no deadline. None otherwise."""
    ids, keys, fmts, dtypes, shapes, lanes, tenants, prios, costs, atts, maxes, sizes = cols
    n = len(ids)
    shared = (fmts, dtypes, shapes, lanes, tenants, prios, costs, sizes)
    if any(c.count(c[0]) != n for c in shared) or fmts[0] != "tensor" or sizes[0] is None:
        return None
    if deadlines.count(None) != n or not data or len(data) != n * sizes[0]:
        return None  # a deadline, or a body row missing
    # Claim order with one priority and no deadline: enqueued_at, then id. The aggregate
    # mostly returns them so already (ids in enqueue order); otherwise sort once.
    if ids != sorted(ids) or enqueued != sorted(enqueued):
        order = sorted(range(n), key=list(zip(enqueued, ids, strict=True)).__getitem__)
        ids, keys, enqueued, atts, maxes = (
            list(map(col.__getitem__, order)) for col in (ids, keys, enqueued, atts, maxes)
        )
        rows = np.frombuffer(data, dtype=np.uint8).reshape(n, sizes[0])
        data = rows[np.asarray(order)].tobytes()
    shape = tuple(map(int, orjson.loads(shapes[0]))) if shapes[0] else None
    payload = models.Payload(b"", models.PayloadFormat.TENSOR, dtypes[0], shape)
    template = models.WorkItem(
        0, "", payload, 0.0, queue, lanes[0], tenants[0], prios[0], costs[0], None, 0, 0
    )
    return models.ItemBlock(template, ids, keys, enqueued, atts, maxes, data)


@overload
def unpack_claim(
    queue: str,
    row: Sequence[Any],
    times: Sequence[Any] | None = None,
    *,
    columns: Literal[False] = False,
) -> tuple[list[Any], dict[int, bytes]]: ...
@overload
def unpack_claim(
    queue: str, row: Sequence[Any], times: Sequence[Any] | None = None, *, columns: bool
) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock: ...
def unpack_claim(
    queue: str, row: Sequence[Any], times: Sequence[Any] | None = None, *, columns: bool = False
) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
    """A row of ``CLAIMED`` as claimed rows (``_CLAIM_COLUMNS`` order) and bodies by
    id, a column at a time in C (JSON arrays, ``float`` over split text) and one ``zip``. A
    row of ``CLAIMED_NO_BODIES`` gives the rows and no bodies. ``times`` is the claim's
    ``CLAIMED_TIMES`` row, required when :func:`needs_times`. With ``columns``, uniform items
    (see ``_as_block``) come back as one :class:`~batching.models.ItemBlock` instead."""
    cols = list(map(orjson.loads, row[: _TIMES.start]))
    ids, keys, fmts, dtypes, shapes, lanes, tenants, prios, costs, atts, maxes, sizes = cols
    if not ids:
        return [], {}
    if times is None and needs_times(row):
        raise ValueError("this claim's items need their CLAIMED_TIMES row")
    enqueued, deadlines = _times(ids, row, times)
    data = row[BODIES] if len(row) > BODIES else None
    block = _as_block(queue, cols, enqueued, deadlines, data) if columns else None
    if block is not None:
        return block
    by_deadline = [schema.NO_DEADLINE if d is None else d for d in deadlines]
    rows = list(
        zip(
            ids,
            keys,
            fmts,
            dtypes,
            shapes,
            enqueued,
            itertools.repeat(queue, len(ids)),
            lanes,
            tenants,
            prios,
            costs,
            deadlines,
            atts,
            maxes,
            by_deadline,
            strict=True,
        )
    )
    bodies: dict[int, bytes] = {}
    if len(row) > BODIES:
        data = data or b""
        if None in sizes:  # a body row is missing (the caller buries those items)
            present = [
                (id_, size) for id_, size in zip(ids, sizes, strict=True) if size is not None
            ]
            ids, sizes = [p[0] for p in present], [p[1] for p in present]
        ends = list(itertools.accumulate(sizes))
        starts = itertools.chain((0,), ends)
        bodies = dict(zip(ids, map(data.__getitem__, map(slice, starts, ends)), strict=True))
    return rows, bodies
