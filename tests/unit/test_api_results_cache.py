"""The API's cache of committed batches' rows: the newest batches, within a count and a byte
budget (wide outputs keep fewer batches)."""

from __future__ import annotations

from typing import Any, cast

import pyarrow as pa
import pytest
import sqlalchemy as sa

from batching.api import results


def batch_rows(n: int, width: int) -> pa.Table:
    return pa.table(
        {
            "item_key": [f"k{i}" for i in range(n)],
            "output": pa.array([[0.5] * width] * n, pa.list_(pa.float32(), width)),
        }
    )


def test_the_newest_batches_are_kept_within_the_byte_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one = batch_rows(32, 256).nbytes
    monkeypatch.setattr(results, "CACHED_BYTES", 3 * one)
    res = results.Results(sa.create_engine("sqlite://"), cast(Any, None))
    for i in range(6):
        res._cache(f"b{i}", "v1", results._Rows(batch_rows(32, 256), "v1"))
    kept = [b for b in (f"b{i}" for i in range(6)) if res._cached(b, ["k0"]) is not None]
    assert kept == ["b3", "b4", "b5"]
    version, rows = res._cached("b5", ["k0", "k31"]) or ("", {})
    assert version == "v1"
    assert rows["k31"]["output"] == [0.5] * 256
    assert res._cached("b5", ["k32"]) is None  # a key the batch does not hold: read again


def test_one_batch_wider_than_the_budget_is_still_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "CACHED_BYTES", 10)
    res = results.Results(sa.create_engine("sqlite://"), cast(Any, None))
    res._cache("a", "v1", results._Rows(batch_rows(4, 8), "v1"))
    res._cache("b", "v1", results._Rows(batch_rows(4, 8), "v1"))
    assert res._cached("a", ["k0"]) is None
    assert res._cached("b", ["k0"]) is not None
