"""The reference workloads: exactly the documented sets, and longer runs that repeat them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from batching.model import workloads


def test_w1_is_the_documented_reference_set() -> None:
    want = np.random.default_rng(1).standard_normal((50_000, 64), dtype=np.float32)
    np.testing.assert_array_equal(workloads.w1_inputs(), want)
    np.testing.assert_array_equal(workloads.w1_inputs(10), want[:10])


def test_w2_lengths_and_ids_are_in_the_documented_ranges() -> None:
    seqs = workloads.w2_inputs()
    assert len(seqs) == 3_000
    assert {len(s) for s in seqs} == set(range(8, 129))
    assert all(s.min() >= 1 and s.max() < 30_000 for s in seqs)


def test_more_rows_than_the_reference_set_repeat_it_with_unique_keys(tmp_path: Path) -> None:
    x = workloads.w1_inputs(50_003)
    np.testing.assert_array_equal(x[50_000:], x[:3])
    table = pq.read_table(workloads.write_w1_parquet(tmp_path / "w1.parquet", 50_003))
    assert table.num_rows == 50_003
    assert len(set(table["item_key"].to_pylist())) == 50_003
    seqs = workloads.w2_inputs(3_002)
    np.testing.assert_array_equal(seqs[3_001], seqs[1])
