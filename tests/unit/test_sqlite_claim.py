"""Unit tests for ``batching.ingress.sqlite_claim.unpack_claim``: a claim read back as one row, and its items'
times read back only when they differ (the rows are built here as SQLite returns them)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batching import models
from batching.ingress import sqlite_claim


def claimed_row(
    ids: list[int], enqueued: list[float], deadlines: list[float | None]
) -> tuple[Any, ...]:
    """A ``CLAIMED`` row of uniform 4-byte tensor items, bodies b"<id>" * 4 each."""
    n = len(ids)
    columns: list[list[Any]] = [
        ids,
        [f"k{i}" for i in ids],
        ["tensor"] * n,
        ["uint8"] * n,
        ["[4]"] * n,
        [""] * n,
        ["default"] * n,
        [0] * n,
        [4] * n,
        [1] * n,
        [5] * n,
        [4] * n,
    ]
    aggregates = (min(enqueued), max(enqueued), sum(d is not None for d in deadlines))
    bodies = b"".join(bytes([i]) * 4 for i in ids)
    return (*map(json.dumps, columns), *aggregates, bodies)


def times_row(
    ids: list[int], enqueued: list[float], deadlines: list[float | None]
) -> tuple[Any, ...]:
    """A ``CLAIMED_TIMES`` row: ids, then each time as whole seconds and fraction * 2^52."""

    def whole(t: float | None) -> int | None:
        return None if t is None else int(t)

    def fraction(t: float | None) -> int | None:
        return None if t is None else int((t - int(t)) * 2**52)

    columns = (ids, *(list(map(f, ts)) for ts in (enqueued, deadlines) for f in (whole, fraction)))
    return tuple(map(json.dumps, columns))


def test_items_enqueued_together_without_deadlines_need_no_second_read() -> None:
    row = claimed_row([3, 4], [1_796_091_256.6041782] * 2, [None, None])
    assert not sqlite_claim.needs_times(row)
    rows, bodies = sqlite_claim.unpack_claim("q", row)
    assert [(r[0], r[5], r[11]) for r in rows] == [
        (3, 1_796_091_256.6041782, None),
        (4, 1_796_091_256.6041782, None),
    ]
    assert bodies == {3: b"\x03" * 4, 4: b"\x04" * 4}


def test_times_read_in_another_row_order_are_aligned_by_id() -> None:
    ids, enqueued, deadlines = [5, 3], [1.5, 2.5], [9.25, None]
    row = claimed_row(ids, enqueued, deadlines)
    assert sqlite_claim.needs_times(row)
    times = times_row(ids[::-1], enqueued[::-1], deadlines[::-1])
    claimed = sqlite_claim.unpack_claim("q", row, times, columns=True)
    assert not isinstance(claimed, models.ItemBlock)  # a deadline: not a block
    rows, _ = claimed
    assert [(r[0], r[5], r[11]) for r in rows] == [(5, 1.5, 9.25), (3, 2.5, None)]


def test_a_block_takes_its_times_from_the_times_row_in_claim_order() -> None:
    ids, enqueued = [3, 5, 4], [2.5, 1.5, 2.5]
    row = claimed_row(ids, enqueued, [None] * 3)
    times = times_row([5, 4, 3], [1.5, 2.5, 2.5], [None] * 3)
    block = sqlite_claim.unpack_claim("q", row, times, columns=True)
    assert isinstance(block, models.ItemBlock)
    assert (block.ids, block.enqueued_at) == ([5, 3, 4], [1.5, 2.5, 2.5])  # enqueued_at, id
    assert [i.payload.data for i in block] == [b"\x05" * 4, b"\x03" * 4, b"\x04" * 4]


def test_a_claim_that_needs_its_times_refuses_to_guess_them() -> None:
    row = claimed_row([1, 2], [1.0, 2.0], [None, None])
    with pytest.raises(ValueError, match="CLAIMED_TIMES"):
        sqlite_claim.unpack_claim("q", row)
