"""Where a W1 row's CPU goes, and the ratio to the raw model limit this host allows. Not a test.

    python bench/cpu_budget.py [--rows 100000] [--reps 2] [--pg postgresql://...] [--json F]

The ratio of the pipeline to the raw model limit (issue targets: W1 on SQLite >= 0.5x, on
PostgreSQL >= 0.3x) is a ratio of two costs that follow different parts of a machine: the
forward follows its vector units and BLAS, the queue follows its single-core speed and memory.
On a host without a GPU the two also share the cores. This measures both on the same host, in
the same run, as CPU a row. Per rep, one process (torch's threads: the cores):

- raw: the pinned W1 model's forward alone on pre-built tensors at ``max_batch_size`` (2,048):
  rows/s, and the CPU a row (every thread of the process, ``getrusage``);
- queue: enqueue, then claim (as the scorer claims: columns, range leases) and ack at the
  claim size, nothing else: the CPU a row of claim + ack (the machine's, so PostgreSQL's
  server counts);
- pipeline: ``batching score`` until the queue is empty (``deployments/tabular.yaml``): rows/s
  (the scorer's, first claim to last commit), the machine's CPU a row over that window, the
  cores it kept busy, and each stage's busy time a row.

With every core busy the pipeline can go no faster than cores / (its CPU a row), so its ratio
to the raw limit is at most ``bound = (raw CPU a row / pipeline CPU a row) x (cores / cores the
raw forward used)``; and as the pipeline's CPU is the forward's plus the queue's plus the rest,
a ratio of 0.5 needs the queue and the rest to cost no more CPU a row than the forward itself.
SQLite's database files and the outputs go to a scratch folder; ``--pg`` is an admin URL whose
server runs on this host (a scratch database ``batching_budget`` is dropped and created).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import workload_bench as wb  # bench/ is on the path (this script's folder)
from scale_bench import CpuSampler

from batching.compose import run as app
from batching.config import load_config
from batching.ingress import ingest
from batching.loop import stats as run_stats
from batching.model import workloads, zoo
from batching.store.database import normalize_url

CORES = os.cpu_count() or 1


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raw(n: int, batch: int, rounds: int = 5) -> dict[str, float]:
    """The forward alone, the fastest of ``rounds`` passes over ``n`` rows (a limit; a pass
    lasts a fraction of a second, so one busy moment elsewhere would decide a single one):
    rows/s, CPU a row (us) and cores used."""
    model, _ = zoo.build("w1-mlp")
    model.eval()
    x = torch.from_numpy(workloads.w1_inputs(n))
    best: dict[str, float] = {"rows_s": 0.0}
    with torch.inference_mode():
        model(x[:batch])
        for _ in range(rounds):
            cpu, wall = _own_cpu(), time.perf_counter()
            for i in range(0, n, batch):
                model(x[i : i + batch])
            cpu, wall = _own_cpu() - cpu, time.perf_counter() - wall
            if n / wall > best["rows_s"]:
                best = {"rows_s": n / wall, "cpu_us": cpu / n * 1e6, "cores": cpu / wall}
    return best


class Target:
    """Fresh queues, one a phase, on SQLite files in ``tmp`` or in one scratch PostgreSQL
    database (dropped and created again for each queue, so no phase reads another's rows)."""

    def __init__(self, tmp: Path, pg: str | None) -> None:
        self.tmp, self.pg = tmp, pg

    @property
    def name(self) -> str:
        return "postgresql" if self.pg else "sqlite"

    def config(self, tag: str) -> Any:
        if self.pg is None:
            return wb.config("tabular.yaml", self.tmp, tag)
        import psycopg
        from sqlalchemy.engine import make_url

        conninfo = make_url(self.pg).set(drivername="postgresql").render_as_string(False)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS batching_budget WITH (FORCE)")
            conn.execute("CREATE DATABASE batching_budget")
        url = make_url(normalize_url(self.pg)).set(database="batching_budget")
        overrides = {
            "database": {"url": url.render_as_string(False)},
            "output": {"path": str(self.tmp / f"out-{tag}")},
            "lineage": {"transport": "none"},
            "queue": {"name": tag},
        }
        return load_config(wb.DEPLOY / "tabular.yaml", overrides)


def queue(target: Target, records: list[Any], tag: str) -> dict[str, float]:
    """Claim + ack alone (``workload_bench.queue_floor``): rows/s and the machine's CPU a row,
    the enqueue before it left out."""
    cfg, n = target.config(tag), len(records)
    sampler = CpuSampler()
    try:
        rate = wb.queue_floor(cfg, records)  # enqueues, then times claim + ack alone
        end = time.time()
    finally:
        sampler.stop()
    machine, server = sampler.between(end - n / rate, end)
    return {"rows_s": rate, "cpu_us": machine / n * 1e6, "server_us": server / n * 1e6}


def pipeline(target: Target, records: list[Any], tag: str) -> dict[str, Any]:
    """``batching score`` until empty: rows/s, the machine's CPU a row and cores over the
    scorer's own window (first claim to last commit), and each stage's busy time a row."""
    cfg = target.config(tag)
    wb.enqueue(cfg, records)
    sampler = CpuSampler()
    try:
        outcome = app.run_score(cfg, limits=run_stats.RunLimits(until_empty=True))
    finally:
        sampler.stop()
    s = outcome.summary
    assert s["items_committed"] == len(records), s
    end = sampler.samples[-1][0]
    start = end - float(s["elapsed_s"])
    machine, server = sampler.between(start, end)
    n = len(records)
    return {
        "rows_s": float(s["items_per_s"]),
        "cpu_us": machine / n * 1e6,
        "server_us": server / n * 1e6,
        "cores": machine / float(s["elapsed_s"]),
        "stages_us": wb.per_row_us(dict(s)),
    }


def one_rep(target: Target, records: list[Any], rep: int, batch: int) -> dict[str, Any]:
    forward = raw(len(records), batch)
    floor = queue(target, records, f"q{rep}")
    run = pipeline(target, records, f"p{rep}")
    bound = forward["cpu_us"] / run["cpu_us"] * CORES / forward["cores"]
    return {
        "database": target.name,
        "rep": rep,
        "raw": forward,
        "queue": floor,
        "pipeline": run,
        "x_raw": run["rows_s"] / forward["rows_s"],
        "bound_x_raw": bound,
        "rest_cpu_us": run["cpu_us"] - forward["cpu_us"] - floor["cpu_us"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| database | rep | raw rows/s | raw CPU µs/row | queue CPU µs/row | pipeline rows/s "
        "| x raw | pipeline CPU µs/row | cores | rest µs/row | bound x raw |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['database']} | {r['rep']} | {r['raw']['rows_s']:,.0f} | {r['raw']['cpu_us']:.2f} "
        f"| {r['queue']['cpu_us']:.2f} | {r['pipeline']['rows_s']:,.0f} | {r['x_raw']:.2f} "
        f"| {r['pipeline']['cpu_us']:.2f} | {r['pipeline']['cores']:.2f} "
        f"| {r['rest_cpu_us']:.2f} | {r['bound_x_raw']:.2f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000, help="W1 rows a phase")
    parser.add_argument("--reps", type=int, default=2, help="reps of the three phases")
    parser.add_argument("--pg", metavar="ADMIN_URL", help="also on PostgreSQL (this host's)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    if args.rows < 10_000 or args.reps < 1:
        parser.error("--rows must be at least 10000 and --reps at least 1")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        records = ingest.read_records(workloads.write_w1_parquet(tmp / "w1.parquet", args.rows))
        batch = wb.config("tabular.yaml", tmp, "probe").batching.max_batch_size
        targets = [Target(tmp, None)] + ([Target(tmp, args.pg)] if args.pg else [])
        rows = [
            one_rep(target, records, rep, batch) for rep in range(args.reps) for target in targets
        ]
    print(f"{args.rows:,} W1 rows a phase, {CORES} cores, torch {torch.__version__}")
    print(table(rows))
    for name in {r["database"] for r in rows}:
        mine = [r for r in rows if r["database"] == name]
        print(
            f"{name}: x raw {statistics.median(r['x_raw'] for r in mine):.2f} "
            f"(bound {statistics.median(r['bound_x_raw'] for r in mine):.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
