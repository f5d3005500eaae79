"""``batching score`` with a model that fails every batch: the retry-storm breaker stops the
run with one error line (no traceback), exit 1, and no item used an attempt."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import sqlalchemy as sa

from batching import models
from batching.model import workloads
from batching.store import database, schema
from tests.e2e.test_cli import DB, batching, write_config

STORM_MODULE = """
import torch
from torch import nn


class Broken(nn.Module):
    batching_input_dim = 64
    batching_output_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def build() -> nn.Module:
    return Broken()
"""


def test_score_stops_a_retry_storm_with_one_error_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "stormmod.py").write_text(STORM_MODULE)
    save_file({}, tmp_path / "empty.safetensors")
    sha = hashlib.sha256((tmp_path / "empty.safetensors").read_bytes()).hexdigest()
    model = {"name": "stormmod:build", "version": "v1", "checkpoint": "empty.safetensors"}
    config = write_config(
        tmp_path, model=model | {"sha256": sha, "device": "cpu"}, service_profile=None
    )
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))
    }
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(200))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0

    r = batching("score", "-c", str(config), cwd=tmp_path, env=env)

    assert r.rc == 1, r.err
    errors = [line for line in r.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, r.err
    assert errors[0].startswith(
        "error: retry storm on queue 'tabular': 3 batches in a row (32, 32, 32 items) failed"
    ), r.err
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in errors[0]
    engine = database.create_engine(f"sqlite:///{tmp_path / 'queue.db'}")
    with engine.connect() as conn:
        states = set(conn.execute(sa.select(schema.items.c.state, schema.items.c.attempts)))
    engine.dispose()
    assert states == {(models.State.READY, 0)}  # no attempt used
