"""What a model that fails every batch costs: forward calls, attempts used, items dead.

Scores a W1 queue with a model whose forward always raises, ``--runs`` times in a row (as a
schedule or a backlog trigger would restart it), with the ``batching`` of ``--code`` (a
checkout: compare the commit before the retry-storm breaker with one after it)::

    python bench/retry_storm.py --code /path/to/checkout --items 200 --runs 5

Prints one JSON line: forward calls, exit codes, items by state, attempts used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = """
import os
import torch
from torch import nn


class Broken(nn.Module):
    batching_input_dim = 64
    batching_output_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(os.environ["STORM_CALLS"], "a") as f:
            f.write("1")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def build() -> nn.Module:
    return Broken()
"""

CONFIG = """
name: storm
queue: {{name: tabular, lease_s: 30}}
model: {{name: "stormmod:build", version: v1, checkpoint: empty.safetensors, sha256: {sha}, device: cpu}}
batching: {{max_batch_size: 32, max_wait_s: 0.01}}
output: {{path: out}}
lineage: {{transport: none}}
latency_slo_s: 5
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, required=True, help="a checkout of this project")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    code = args.code.resolve()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "stormmod.py").write_text(MODEL)
        from safetensors.torch import save_file

        save_file({}, root / "empty.safetensors")
        sha = hashlib.sha256((root / "empty.safetensors").read_bytes()).hexdigest()
        (root / "storm.yaml").write_text(CONFIG.format(sha=sha))
        lines = root / "w1.jsonl"
        with lines.open("w") as f:
            for i in range(args.items):
                f.write(json.dumps({"item_key": f"k{i}", "payload": {"x": [0.5] * 64}}) + "\n")
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join([str(root), str(code)]),
            "STORM_CALLS": str(root / "calls"),
        }
        db = f"sqlite:///{root / 'queue.db'}"

        def batching(*argv: str) -> int:
            cmd = [sys.executable, "-m", "batching.cli", *argv]
            return subprocess.run(cmd, cwd=root, env=env, capture_output=True).returncode

        batching("init", "--db", db)
        batching("enqueue", str(lines), "--db", db, "-q", "tabular")
        codes = [batching("score", "-c", "storm.yaml", "--db", db) for _ in range(args.runs)]
        with sqlite3.connect(root / "queue.db") as conn:
            states = dict(conn.execute("SELECT state, COUNT(*) FROM batching_items GROUP BY 1"))
            used = conn.execute("SELECT SUM(attempts) FROM batching_items").fetchone()[0]
            errors = [r[0] for r in conn.execute("SELECT DISTINCT last_error FROM batching_items")]
        calls = len((root / "calls").read_text()) if (root / "calls").exists() else 0
    names = {0: "ready", 1: "leased", 2: "done", 3: "dead", 4: "expired", 5: "cancelled"}
    print(
        json.dumps(
            {
                "items": args.items,
                "runs": args.runs,
                "exit_codes": codes,
                "forward_calls": calls,
                "attempts_used": used,
                "items_by_state": {names.get(k, str(k)): v for k, v in states.items()},
                "errors": errors,
            }
        )
    )


if __name__ == "__main__":
    main()
