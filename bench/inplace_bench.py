"""Bulk scoring in place against the raw model limit and Ray Data ``map_batches``, on one W1
Parquet file, in the same run. Not a test.

    python bench/inplace_bench.py [--rows 1000000] [--reps 2] [--ray-python PATH] [--json F]

Per rep, alternating (the machine is shared and noisy; ratios are same-rep):

- raw: the pinned W1 model's forward alone on pre-built float32 tensors at batch 512, 2048
  and 8192 (the best is the limit), as ``bench/workload_bench.py`` measures it;
- in place: ``batching bulk --in-place`` on a fresh SQLite queue (``deployments/tabular.yaml``
  with its queue and output moved to a scratch folder), rows/s over the run's own elapsed
  time (model load excluded) and over the command's wall time (plan, fingerprint, start-up);
- Ray Data (``--ray-python``: a Python with ``ray[data]`` and ``safetensors``, e.g. the peers'
  venv, never a project dependency): ``read_parquet`` -> ``map_batches`` (the W1 MLP in an
  actor, batch 2048) -> ``write_parquet``, timed from the read to the written files (``ray.init`` and a
  warm-up excluded), in a child process with 2 CPUs.

The input: W1 rows as a ``fixed_size_list<float>[64]`` payload column and an ``item_key``,
row groups of 65,536 rows, written by pyarrow's defaults (snappy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from batching.config import load_config
from batching.model import workloads, zoo
from batching.model.runner import TorchRunner

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deployments"

RAY_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, torch, ray
    from safetensors.torch import load_file

    src, out, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(2)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False

    class W1:
        def __init__(self):
            torch.set_num_threads(2)
            w = load_file(ckpt)
            names = sorted({k.rsplit(".", 1)[0] for k in w})
            mods = []
            for n in names:
                lin = torch.nn.Linear(w[n + ".weight"].shape[1], w[n + ".weight"].shape[0])
                lin.load_state_dict({"weight": w[n + ".weight"], "bias": w[n + ".bias"]})
                mods.append(lin)
            seq = []
            for j, m in enumerate(mods):
                seq.append(m)
                if j < len(mods) - 1:
                    seq.append(torch.nn.ReLU())
            self.m = torch.nn.Sequential(*seq, torch.nn.Sigmoid()).eval()  # TabularMLP

        def __call__(self, batch):
            x = np.stack(batch["payload"]).astype(np.float32)
            with torch.inference_mode():
                y = self.m(torch.from_numpy(x)).numpy()
            return {"item_key": batch["item_key"], "output": y}

    def run(dst):
        ds = ray.data.read_parquet(src)
        ds = ds.map_batches(W1, batch_size=2048, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1)
        ds.write_parquet(dst)

    run(out + "-warm")  # start-up of the actor pool, once
    t0 = time.perf_counter()
    run(out)
    print(json.dumps({"seconds": time.perf_counter() - t0}))
    """
)


def raw_limit(runner: TorchRunner, rows: int = 65_536) -> tuple[float, int]:
    """Best rows/s of the bare forward on pre-built tensors, and its batch size."""
    x = torch.from_numpy(workloads.w1_inputs(rows))
    best = (0.0, 0)
    with torch.inference_mode():
        for bs in (512, 2048, 8192):
            runner.model(x[:bs])
            t0 = time.perf_counter()
            for a in range(0, rows, bs):
                runner.model(x[a : a + bs])
            rate = rows / (time.perf_counter() - t0)
            best = max(best, (rate, bs))
    return best


def in_place(src: Path, work: Path, rows: int) -> dict[str, Any]:
    """One ``batching bulk --in-place`` run on a fresh queue and output."""
    work.mkdir(parents=True)
    text = (DEPLOY / "tabular.yaml").read_text()
    text = text.replace("sqlite:///batching.db", f"sqlite:///{work}/q.db")
    text = text.replace("../outputs/tabular", str(work / "out"))
    text = text.replace("profiles/", f"{DEPLOY}/profiles/")
    cfg = work / "inplace.yaml"
    cfg.write_text(text)
    cli = [sys.executable, "-m", "batching.cli"]
    subprocess.run(
        [*cli, "init", "--db", f"sqlite:///{work}/q.db"], check=True, capture_output=True
    )
    t0 = time.perf_counter()
    done = subprocess.run(
        [*cli, "bulk", str(src), "-c", str(cfg), "--in-place", "--quiet", "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    summary = json.loads(done.stdout)["summary"]
    assert summary["items_committed"] == rows, summary
    return {
        "rows_s": summary["items_per_s"],
        "wall_rows_s": rows / wall,
        "elapsed_s": summary["elapsed_s"],
    }


def ray_data(python: str, src: Path, work: Path, ckpt: Path, rows: int) -> dict[str, Any]:
    script = work / "ray_w1.py"
    script.write_text(RAY_SCRIPT)
    done = subprocess.run(
        [python, str(script), str(src), str(work / "ray-out"), str(ckpt)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(
            f"error: the Ray Data run failed (exit {done.returncode}): {last}; --ray-python "
            f"{python} needs ray[data], torch and safetensors (`{python} -m pip install "
            "safetensors`)"
        )
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    written = pq.ParquetDataset(str(work / "ray-out")).read(columns=["item_key"]).num_rows
    assert written == rows, (written, rows)
    return {"rows_s": rows / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--ray-python",
        default=None,
        help="a Python with ray[data], torch, safetensors (peers venv)",
    )
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cfg = load_config(DEPLOY / "tabular.yaml")
    runner = TorchRunner.load(cfg.model, base_dir=cfg.base_dir)
    ckpt = zoo.checkpoint_path(cfg.model.name, cfg.model.checkpoint, Path(cfg.base_dir))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="inplace-bench-") as tmp:
        src = Path(tmp) / "w1.parquet"
        workloads.write_w1_parquet(src, a.rows)
        pq.write_table(pq.read_table(src), src, row_group_size=65_536)
        print(f"input: {a.rows} W1 rows, {src.stat().st_size / 2**20:.0f} MiB", flush=True)
        for rep in range(a.reps):
            raw, bs = raw_limit(runner)
            row: dict[str, Any] = {"rep": rep, "raw_rows_s": raw, "raw_batch": bs}
            row["inplace"] = in_place(src, Path(tmp) / f"ip{rep}", a.rows)
            if a.ray_python:
                row["ray_data"] = ray_data(a.ray_python, src, Path(tmp) / f"ip{rep}", ckpt, a.rows)
            results.append(row)
            ip = row["inplace"]
            line = (
                f"rep {rep}: raw {raw:,.0f} rows/s (bs {bs}); in place {ip['rows_s']:,.0f} "
                f"({ip['rows_s'] / raw:.2f}x raw; {ip['wall_rows_s']:,.0f} over the wall, "
                f"{ip['wall_rows_s'] / raw:.2f}x)"
            )
            if "ray_data" in row:
                rd = row["ray_data"]["rows_s"]
                line += f"; Ray Data {rd:,.0f} ({rd / raw:.2f}x raw, in place {ip['rows_s'] / rd:.1f}x it)"
            print(line, flush=True)
    if a.json:
        a.json.write_text(
            json.dumps({"rows": a.rows, "cpus": os.cpu_count(), "reps": results}, indent=2)
        )


if __name__ == "__main__":
    main()
