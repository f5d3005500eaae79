"""Scale-out curve on simulated accelerators: rows/s of 1, 2, 4, 8 scorer processes sharing one
queue, on SQLite and PostgreSQL, with the CPU each run used. Not a test.

Each scorer process drives a simulated accelerator (``bench/sim_accel.py``: a W1-shaped model
whose forward sleeps 5 ms + 2 us a row and uses no CPU), so the processes compete for the
queue and commit tier, not for this machine's cores. Every run drains the same W1 tensor
items (enqueued before the clock starts) through the whole pipeline: claim, decode, forward,
Parquet commit (ledger + ack in one transaction).

    python bench/scale_bench.py [--items 200000] [--scorers 1 2 4 8] [--batch 256]
        [--pg postgresql://postgres@127.0.0.1:5432/postgres] [--in-place] [--json out.json]

``--in-place``: the same rows also scored in place (``bulk --in-place``: a Parquet file of
row groups of 4,096 rows, a shard each), so the queue holds a row per shard, not per row.

Reported per run: rows/s (first scorer's start to last one's end, model loads excluded), the
ideal of ``k`` processes bound by the simulated forward alone (``k * B / (5 ms + 2 us * B)``
at full batches ``B``), and the CPU used while the scorers drained the queue (sampled every
0.1 s; process start and model loads excluded, as from rows/s), in cores: the machine's
(``/proc/stat``), PostgreSQL's processes (``/proc``), the rest (the scorers), and the
machine's CPU microseconds per row.
``--pg``: a scratch database ``batching_scale`` is created for each run and dropped after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import sim_accel  # bench/ is on the path (this script's folder); scorers import it by name

from batching import models
from batching.compose import build, inplace
from batching.compose import run as app
from batching.config import load_config
from batching.ingress import ingest
from batching.loop import stats as run_stats
from batching.loop.workers import run_workers
from batching.model import workloads
from batching.store.database import normalize_url

DEPLOY = Path(__file__).resolve().parents[1] / "deployments"
SHARD_ROWS = 4096  # --in-place: rows a shard (and a row group) holds
TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / TICK


def _postgres_pids() -> dict[int, float]:
    """CPU seconds used so far by each process named postgres (backends and helpers)."""
    seen: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we looked
            continue
        if text[text.index("(") + 1 : text.rindex(")")] == "postgres":
            rest = text[text.rindex(")") + 2 :].split()
            seen[int(stat.parent.name)] = (float(rest[11]) + float(rest[12])) / TICK
    return seen


class CpuSampler:
    """The machine's busy CPU seconds and PostgreSQL's, sampled every ``every_s`` on a thread,
    so the CPU of any window of the run can be read afterwards (:meth:`between`). A backend
    that exits (a scorer's connection closing) keeps what it used until its last sample."""

    def __init__(self, every_s: float = 0.1) -> None:
        self._first = _postgres_pids()
        self._pg = dict(self._first)
        self.samples: list[tuple[float, float, float]] = []  # (time, machine busy, postgres)
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self._pg.update(_postgres_pids())
        pg = sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._pg.items())
        self.samples.append((time.time(), _machine_busy(), pg))

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def between(self, start: float, end: float) -> tuple[float, float]:
        """(machine, postgres) CPU seconds from the last sample at or before ``start`` to the
        first at or after ``end``."""
        before = max((s for s in self.samples if s[0] <= start), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= end), default=self.samples[-1])
        return after[1] - before[1], after[2] - before[2]


def _config(url: str, tmp: Path, tag: str, ckpt: tuple[str, str], batch: int) -> Any:
    return load_config(
        DEPLOY / "tabular.yaml",
        {
            "database": {"url": url},
            "output": {"path": str(tmp / f"out-{tag}")},
            "lineage": {"transport": "none"},
            "queue": {"name": "scale"},
            "model": {
                "name": "sim_accel:build",
                "version": "sim-1",
                "checkpoint": ckpt[0],
                "sha256": ckpt[1],
                "device": "cpu",
            },
            "batching": {"max_batch_size": batch, "claim_size": batch * 8, "max_wait_s": 0.005},
            "service_profile": None,
        },
    )


def one_run(
    cfg: Any,
    records: list[models.EnqueueRecord],
    k: int,
    batch: int,
    dataset: Path | None = None,
    n_rows: int = 0,
) -> dict[str, Any]:
    """Enqueue ``records`` (or, with ``dataset``, its shards: ``bulk --in-place``), then drain
    them with ``k`` scorer processes; rows/s and CPU."""
    queue = build.open_queue(cfg, cfg.database.url, create=True)
    queue.migrate()
    if dataset is None:
        queue.enqueue(records)
    queue.engine.dispose()
    score: Any = app.run_score
    if dataset is not None:
        found, _ = inplace.enqueue_shards(cfg, cfg.database.url, dataset, SHARD_ROWS)
        score = functools.partial(app.run_score, in_place=inplace.InPlace.of(found))
    n_rows = n_rows or len(records)
    cpu = CpuSampler()
    started = time.perf_counter()
    outcome = run_workers(score, cfg, k, threads=1, limits=run_stats.RunLimits(until_empty=True))
    wall = time.perf_counter() - started
    cpu.stop()
    if outcome.exit_code:
        raise RuntimeError("; ".join(outcome.errors()))
    stats = outcome.stats()
    if stats is None or stats.committed != n_rows:
        raise RuntimeError(f"the scorers committed {stats and stats.committed} of {n_rows}")
    rate = float(stats.summary()["items_per_s"])
    window = float(stats.summary()["elapsed_s"])  # the first scorer's start to the last's end
    machine, postgres = cpu.between(stats.started_at, stats.started_at + window)
    ideal = k * sim_accel.rows_per_s(batch)
    return {
        "scorers": k,
        "rows_s": round(rate),
        "ideal_rows_s": round(ideal),
        "vs_ideal": round(rate / ideal, 3),
        "wall_s": round(wall, 2),
        "drain_s": round(window, 2),
        "cpu_machine_cores": round(machine / window, 2),
        "cpu_postgres_cores": round(postgres / window, 2),
        "cpu_scorers_cores": round((machine - postgres) / window, 2),
        "cpu_us_per_row": round(machine / n_rows * 1e6, 1),
        "batch_size_mean": round(float(stats.summary()["batch_size_mean"]), 1),
    }


def _pg_url(admin_url: str, reset: bool) -> str:
    import psycopg
    from sqlalchemy.engine import make_url

    conninfo = make_url(admin_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS batching_scale WITH (FORCE)")
        if reset:
            conn.execute("CREATE DATABASE batching_scale")
    return make_url(normalize_url(admin_url)).set(database="batching_scale").render_as_string(False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=200_000, help="W1 rows per run")
    parser.add_argument("--scorers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=256, help="max_batch_size (claims: 8x)")
    parser.add_argument("--pg", metavar="ADMIN_URL", help="also run on this PostgreSQL server")
    parser.add_argument("--sqlite", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--per-row",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the per-row queue (--no-per-row: in place only)",
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help=f"also score the rows in place (bulk --in-place: shards of {SHARD_ROWS} rows)",
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ckpt = sim_accel.checkpoint(tmp)
        written = workloads.write_w1_parquet(tmp / "w1.parquet", args.items)
        records = ingest.read_records(written) if args.per_row else []
        dataset = tmp / "w1-groups.parquet"  # row groups small enough for every scorer a shard
        pq.write_table(pq.read_table(tmp / "w1.parquet"), dataset, row_group_size=SHARD_ROWS)
        backends: list[str] = (["sqlite"] if args.sqlite else []) + (
            ["postgresql"] if args.pg else []
        )
        runs = [(db, False) for db in backends if args.per_row]
        runs += [(db, True) for db in backends if args.in_place]
        for db, shards in runs:
            label = f"{db}-inplace" if shards else db
            results[label] = []
            for k in args.scorers:
                tag = f"{label}-{k}"
                url = f"sqlite:///{tmp / f'{tag}.db'}" if db == "sqlite" else _pg_url(args.pg, True)
                try:
                    conf = _config(url, tmp, tag, ckpt, args.batch)
                    row = one_run(
                        conf, records, k, args.batch, dataset if shards else None, args.items
                    )
                finally:
                    if db == "postgresql":
                        _pg_url(args.pg, False)
                results[label].append(row)
                print(label, json.dumps(row), flush=True)
    meta = {
        "items": args.items,
        "batch": args.batch,
        "base_s": sim_accel.BASE_S,
        "per_row_s": sim_accel.PER_ROW_S,
        "cpus": os.cpu_count(),
    }
    print(
        f"\n{'db':<19}{'k':>3}{'rows/s':>10}{'ideal':>10}{'vs ideal':>9}"
        f"{'scorers':>9}{'postgres':>9}{'machine':>9}{'us/row':>8}  (CPU while draining)"
    )
    for db, rows in results.items():
        for r in rows:
            print(
                f"{db:<19}{r['scorers']:>3}{r['rows_s']:>10,}{r['ideal_rows_s']:>10,}"
                f"{r['vs_ideal']:>9.2f}{r['cpu_scorers_cores']:>9.2f}"
                f"{r['cpu_postgres_cores']:>9.2f}{r['cpu_machine_cores']:>9.2f}"
                f"{r['cpu_us_per_row']:>8.1f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
