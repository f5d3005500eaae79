"""The two reference workloads (see WORKLOADS in the docs), generated exactly as specified.

W1 "tabular": 50,000 rows of 64 float32 from ``numpy.random.default_rng(1)``.
W2 "text": 3,000 token sequences, lengths uniform in [8, 128], ids in [1, 30000), from
``numpy.random.default_rng(2)``: first all lengths, then each sequence.

Asked for more rows than a reference set has, they repeat it from its start (a longer
benchmark run, the same data); item keys stay unique.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

W1_ROWS = 50_000
W2_ROWS = 3_000


def w1_inputs(n: int = W1_ROWS) -> npt.NDArray[np.float32]:
    """The first ``n`` rows of the W1 reference set, shape ``[n, 64]``, repeated past 50,000."""
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((W1_ROWS, 64), dtype=np.float32)
    return ref[np.arange(n) % W1_ROWS]


def w2_inputs(n: int = W2_ROWS) -> list[npt.NDArray[np.int64]]:
    """The first ``n`` token sequences of the W2 reference set, repeated past 3,000."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(8, 129, size=W2_ROWS)
    seqs = [rng.integers(1, 30000, size=int(length), dtype=np.int64) for length in lengths]
    return [seqs[i % W2_ROWS] for i in range(n)]


def write_w1_parquet(path: Path, n: int, *, prefix: str = "w1-") -> Path:
    """W1 requests as Parquet with a fixed-size-list ``payload`` column (binary tensor payloads)."""
    x = w1_inputs(n)
    import pyarrow as pa  # here: the GPU check imports this module without pyarrow
    import pyarrow.parquet as pq

    payload = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 64)
    keys = pa.array([f"{prefix}{i}" for i in range(n)])
    pq.write_table(pa.table({"item_key": keys, "payload": payload}), path)
    return path


def w1_json_lines(n: int, *, prefix: str = "w1-") -> Iterator[str]:
    """W1 requests as JSONL records ``{"item_key", "payload": {"x": [...]}}``."""
    for i, row in enumerate(w1_inputs(n)):
        yield json.dumps({"item_key": f"{prefix}{i}", "payload": {"x": row.tolist()}})


def w2_json_lines(n: int, *, prefix: str = "w2-") -> Iterator[str]:
    """W2 requests as JSONL records ``{"item_key", "payload": {"tokens": [...]}}``."""
    for i, seq in enumerate(w2_inputs(n)):
        yield json.dumps({"item_key": f"{prefix}{i}", "payload": {"tokens": seq.tolist()}})


def write_lines(path: Path, lines: Iterator[str]) -> Path:
    """Write JSONL lines to ``path``."""
    with path.open("w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line + "\n")
    return path
