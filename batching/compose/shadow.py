"""Shadow outputs: a side Parquet dataset of the items a rollout shadows (``rollout start
--shadow``), each with the stable version's output (the one published) and the candidate's
for the same input, and the drift between the two that ``batching rollout status`` reports.

Layout: ``<shadow_path>/queue=<q>/model_version=<candidate>/part-<uuid>.parquet``, one file
per shadowed batch, written to a temporary name and renamed (a reader never sees half a
file). Nothing here is published or acked: a batch shadowed twice (its items retried) holds
two rows of a key, and the drift reads each key's latest.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from batching import config as cfg
from batching import errors
from batching.compose import build
from batching.loop.routes import ShadowRows
from batching.outputs import registry

_SCHEMA = pa.schema(
    [
        ("item_key", pa.string()),
        ("stable_version", pa.string()),
        ("stable_output", pa.list_(pa.float32())),
        ("candidate_output", pa.list_(pa.float32())),
        ("scored_at", pa.float64()),
        ("run_id", pa.string()),
    ]
)
PSI_BINS = 10


def folder(config: cfg.PipelineConfig, res: build.Resolved | None = None) -> Path:
    """The config's shadow dataset: ``rollout.shadow_path`` (relative to its file), else
    ``shadow/`` beside a local output folder (``res``'s: after ``--output``), else
    ``outputs/shadow`` beside the file."""
    res = res or build.resolve(config, None, None)
    local = registry.kind_of(res.target).local_folder(res.target)
    path = config.resolve(config.rollout.shadow_path)
    if path is None:
        path = local.parent / "shadow" if local is not None else config.resolve("outputs/shadow")
    assert path is not None
    if local is not None and build.overlaps(path, local):
        raise errors.ConfigError(
            f"rollout.shadow_path {path} overlaps the output dataset {local}: shadow outputs "
            "are never published; give rollout.shadow_path a folder outside it"
        )
    return path.expanduser().resolve()


class ShadowWriter:
    """Writes each shadowed batch of a run (the scoring loop's ``shadow_out``)."""

    def __init__(self, root: Path, queue: str, run_id: str) -> None:
        self.root, self.queue, self.run_id = root, queue, run_id

    def __call__(self, rows: ShadowRows) -> None:
        part = self.root / f"queue={quote(self.queue, safe='')}"
        part = part / f"model_version={quote(rows.candidate, safe='')}"
        part.mkdir(parents=True, exist_ok=True)
        n = len(rows.keys)
        table = pa.table(
            {
                "item_key": rows.keys,
                "stable_version": [rows.stable] * n,
                "stable_output": [np.asarray(o, np.float32) for o in rows.stable_outputs],
                "candidate_output": [np.asarray(o, np.float32) for o in rows.candidate_outputs],
                "scored_at": [time.time()] * n,
                "run_id": [self.run_id] * n,
            },
            schema=_SCHEMA,
        )
        name = f"part-{uuid.uuid4()}.parquet"
        tmp = part / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, part / name)


def drift(root: Path, queue: str, candidate: str, since: float) -> dict[str, Any] | None:
    """How far the candidate's outputs are from the stable version's on the items shadowed
    since ``since`` (each key's latest row): ``items``, ``mean_abs_diff`` (over every output
    element), ``max_abs_diff``; for vector outputs the mean ``cosine`` similarity, for scalar
    outputs the ``ks`` statistic and ``psi`` of the two distributions (deciles of the stable
    one). None when nothing was shadowed."""
    part = root / f"queue={quote(queue, safe='')}" / f"model_version={quote(candidate, safe='')}"
    if not part.is_dir():
        return None
    table = pads.dataset(part, format="parquet", schema=_SCHEMA).to_table(
        filter=pads.field("scored_at") >= since
    )
    if table.num_rows == 0:
        return None
    latest: dict[str, int] = {}  # the files come in no promised order: the newest by time
    keys = table.column("item_key").to_pylist()
    for i in np.argsort(table.column("scored_at").to_numpy(), kind="stable"):
        latest[keys[i]] = int(i)
    rows = sorted(latest.values())
    stable = np.stack([np.asarray(table["stable_output"][i].as_py(), np.float32) for i in rows])
    cand = np.stack([np.asarray(table["candidate_output"][i].as_py(), np.float32) for i in rows])
    diff = np.abs(stable.astype(np.float64) - cand)
    out: dict[str, Any] = {
        "items": len(rows),
        "mean_abs_diff": float(diff.mean()),
        "max_abs_diff": float(diff.max()),
    }
    if stable.shape[1] > 1:
        norms = np.linalg.norm(stable, axis=1) * np.linalg.norm(cand, axis=1)
        cosine = (stable * cand).sum(axis=1) / np.where(norms == 0, 1.0, norms)
        out["cosine"] = float(cosine.mean())
    else:
        out["ks"] = ks_statistic(stable[:, 0], cand[:, 0])
        out["psi"] = psi(stable[:, 0], cand[:, 0])
    return out


def ks_statistic(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the two
    empirical distribution functions."""
    a, b = np.sort(a), np.sort(b)
    points = np.concatenate([a, b])
    gap = np.searchsorted(a, points, side="right") / len(a)
    gap -= np.searchsorted(b, points, side="right") / len(b)
    return float(np.abs(gap).max())


def psi(expected: np.ndarray[Any, Any], actual: np.ndarray[Any, Any]) -> float:
    """The population stability index of ``actual`` against ``expected``, over the deciles
    of ``expected`` (empty bins floored at a tiny share, as is usual)."""
    edges = np.unique(np.quantile(expected, np.linspace(0, 1, PSI_BINS + 1)[1:-1]))
    e = np.bincount(np.searchsorted(edges, expected, side="right"), minlength=len(edges) + 1)
    a = np.bincount(np.searchsorted(edges, actual, side="right"), minlength=len(edges) + 1)
    e_share = np.maximum(e / len(expected), 1e-6)
    a_share = np.maximum(a / len(actual), 1e-6)
    value = float(((a_share - e_share) * np.log(a_share / e_share)).sum())
    return 0.0 if math.isclose(value, 0.0, abs_tol=1e-12) else value
