"""Benchmark W1 (tabular) and W2 (text) exactly as the workloads doc asks. Not a test.

In one run, same machine, same model, same requests:
  limit    the raw model on pre-built tensors at its best batch policy
  batch-1  the full pipeline (SQLite queue -> score -> committed Parquet) with max_batch_size 1
  dynamic  the full pipeline with the shipped policy for the profile
  queue    (W1) claim + ack alone at the scorer's claim size: the ceiling of one scorer
and for W2 online, an open-loop run: Poisson arrivals at 50% and 90% of the measured dynamic
capacity, p50/p99 enqueue-to-commit latency. Limit and dynamic runs are interleaved
``--repeats`` times and their medians compared (every run is in the JSON).

    python bench/workload_bench.py [--w1-items 50000] [--w2-items 3000] [--online-s 20] [--only w1|w2]
    python bench/workload_bench.py --only w1 --pg postgresql://postgres@127.0.0.1:5432/postgres

W1 (tensor payloads) also runs with 1 and 2 scorer processes sharing one SQLite file (each
process with torch threads = cores / processes), and with ``--pg`` the same on PostgreSQL, in
a scratch database ``batching_bench`` that is dropped and created again.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batching import models
from batching.compose import build
from batching.compose import run as app
from batching.config import load_config
from batching.ingress import ingest
from batching.loop import stats as run_stats
from batching.loop.workers import run_workers
from batching.model import workloads, zoo
from batching.store.database import normalize_url

DEPLOY = Path(__file__).resolve().parents[1] / "deployments"
RESULTS: dict[str, Any] = {}


def config(name: str, tmp: Path, tag: str, **batching: Any) -> Any:
    overrides = {
        "database": {"url": f"sqlite:///{tmp / f'{tag}.db'}"},
        "output": {"path": str(tmp / f"out-{tag}")},
        "lineage": {"transport": "none"},
        "queue": {"name": tag},
    }
    if batching:
        overrides["batching"] = batching
    return load_config(DEPLOY / name, overrides)


def enqueue(cfg: Any, records: list[models.EnqueueRecord]) -> None:
    q = build.open_queue(cfg, cfg.database.url, create=True)
    q.migrate()
    q.enqueue(records)
    q.engine.dispose()


def pipeline_rate(cfg: Any, records: list[models.EnqueueRecord]) -> dict[str, Any]:
    """Enqueue, then score until empty; rows/s measured by the scorer from first claim to end."""
    enqueue(cfg, records)
    outcome = app.run_score(cfg, limits=run_stats.RunLimits(until_empty=True))
    s = outcome.summary
    assert s["items_committed"] == len(records), s
    return dict(s)


def per_row_us(summary: dict[str, Any]) -> dict[str, float]:
    """Busy microseconds per committed row of each stage, and of the whole run (wall)."""
    n = max(summary["items_committed"], 1)
    stages = {k: round(v / n * 1e6, 2) for k, v in summary["stage_busy_s"].items()}
    return {**stages, "wall": round(summary["elapsed_s"] / n * 1e6, 2)}


# -- W1 ------------------------------------------------------------------------------------


def w1_limit(x: np.ndarray) -> float:
    model, _ = zoo.build("w1-mlp")
    model.eval()
    t = torch.from_numpy(x)
    best = 0.0
    with torch.inference_mode():
        for size in (128, 512, 1024):
            model(t[:size])
            start = time.perf_counter()
            for i in range(0, len(t), size):
                model(t[i : i + size])
            best = max(best, len(t) / (time.perf_counter() - start))
    return best


def decode_rate(records: list[models.EnqueueRecord]) -> float:
    """Rows/s of the runner's decode + collate alone (where JSON payloads spend their time)."""
    from batching.config import ModelSpec
    from batching.model.runner import TorchRunner

    spec = ModelSpec(name="w1-mlp", version="bench", sha256=zoo.BUILTINS["w1-mlp"].sha256)
    runner = TorchRunner.load(spec)
    items = [models.WorkItem(i, r.item_key, r.payload, 0.0) for i, r in enumerate(records)]
    start = time.perf_counter()
    for k in range(0, len(items), 512):
        runner.decode(items[k : k + 512])
    return len(items) / (time.perf_counter() - start)


def queue_floor(cfg: Any, records: list[models.EnqueueRecord]) -> float:
    """Rows/s of the queue alone: claim (as the scorer does: columns, range leases) and ack
    at the scorer's claim size, no model, no decode, no output. The pipeline cannot beat it (one scorer process). Objects alive at the
    start are frozen out of the cyclic GC, as ``app.run_score`` does for a run (without it the
    floor reads ~25% low)."""
    enqueue(cfg, records)
    q = build.open_queue(cfg, cfg.database.url)
    size, done = cfg.batching.effective_claim_size, 0
    gc.freeze()
    try:
        start = time.perf_counter()
        while done < len(records):
            claim = q.claim(size, lease_s=60, columns=True)  # as the scorer claims
            done += q.ack(claim.lease_id, [item.id for item in claim.items])
        rate = len(records) / (time.perf_counter() - start)
    finally:
        gc.unfreeze()
    q.engine.dispose()
    return rate


def w1(tmp: Path, n: int, repeats: int) -> None:
    """Limit, dynamic tensor and dynamic JSON interleaved ``repeats`` times; medians, as for
    W2, so one noisy moment on a shared machine decides neither side of a ratio."""
    x = workloads.w1_inputs(n)
    pq_file = workloads.write_w1_parquet(tmp / "w1.parquet", n)
    tensor_recs = ingest.read_records(pq_file)
    json_file = workloads.write_lines(tmp / "w1.jsonl", workloads.w1_json_lines(n))
    json_recs = ingest.read_records(json_file)
    n1 = min(n, 2000)
    b1 = pipeline_rate(
        config("tabular.yaml", tmp, "w1b1", max_batch_size=1, claim_size=64), tensor_recs[:n1]
    )
    limits, tensor_runs, json_runs = [w1_limit(x)], [], []
    for r in range(repeats):
        tensor_runs.append(pipeline_rate(config("tabular.yaml", tmp, f"w1t{r}"), tensor_recs))
        json_runs.append(pipeline_rate(config("tabular.yaml", tmp, f"w1j{r}"), json_recs))
        limits.append(w1_limit(x))
    floor = queue_floor(config("tabular.yaml", tmp, "w1floor"), tensor_recs)
    limit = statistics.median(limits)
    dyn_t, dyn_j = _median_run(tensor_runs), _median_run(json_runs)
    RESULTS["w1"] = {
        "items": n,
        "limit_rows_s": limit,
        "limit_runs": limits,
        "batch1_rows_s": b1["items_per_s"],
        "dynamic_tensor_rows_s": dyn_t["items_per_s"],
        "dynamic_tensor_runs": [s["items_per_s"] for s in tensor_runs],
        "dynamic_json_rows_s": dyn_j["items_per_s"],
        "dynamic_json_runs": [s["items_per_s"] for s in json_runs],
        "tensor_vs_limit": dyn_t["items_per_s"] / limit,
        "json_vs_limit": dyn_j["items_per_s"] / limit,
        "tensor_vs_batch1": dyn_t["items_per_s"] / b1["items_per_s"],
        "batch_size_mean": dyn_t["batch_size_mean"],
        "commits_tensor": dyn_t["commits"],
        "stage_us_per_row_tensor": per_row_us(dyn_t),
        "stage_us_per_row_json": per_row_us(dyn_j),
        "decode_tensor_rows_s": decode_rate(tensor_recs),
        "decode_json_rows_s": decode_rate(json_recs),
        "queue_only_rows_s": floor,
        "queue_only_vs_limit": floor / limit,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rows/s (of an even count, the slower middle one: never the
    faster side of a ratio whose limit is a plain median)."""
    return sorted(runs, key=lambda s: s["items_per_s"])[(len(runs) - 1) // 2]


def scorer_processes(cfg: Any, n: int, k: int) -> float:
    """Rows/s of ``k`` scorer processes (``batching score --workers k``, torch threads = cores
    / k) draining ``cfg``'s queue, from the first scorer's start to the last one's end (model
    loading excluded)."""
    outcome = run_workers(app.run_score, cfg, k, limits=run_stats.RunLimits(until_empty=True))
    if outcome.exit_code:
        raise RuntimeError("; ".join(outcome.errors()))
    stats = outcome.stats()
    assert stats is not None
    assert stats.committed == n, (stats.committed, n)
    return float(stats.summary()["items_per_s"])


def w1_sqlite_processes(tmp: Path, n: int, scorer_counts: tuple[int, ...] = (1, 2)) -> None:
    """W1 tensor payloads on one SQLite file: rows/s with 1 and 2 scorer processes."""
    recs = ingest.read_records(workloads.write_w1_parquet(tmp / "w1mp.parquet", n))
    out: dict[str, Any] = {}
    for k in scorer_counts:
        cfg = config("tabular.yaml", tmp, f"w1mp{k}")
        enqueue(cfg, recs)
        out[f"scorers_{k}_rows_s"] = scorer_processes(cfg, n, k)
    RESULTS["w1_sqlite_processes"] = out


def w1_pg(tmp: Path, n: int, admin_url: str, scorer_counts: tuple[int, ...] = (1, 2)) -> None:
    """W1 tensor payloads on PostgreSQL: rows/s with 1 and 2 scorer processes, in a scratch
    database ``batching_bench`` (dropped and created again for each count)."""
    import psycopg
    from sqlalchemy.engine import make_url

    recs = ingest.read_records(workloads.write_w1_parquet(tmp / "w1pg.parquet", n))
    url = make_url(normalize_url(admin_url)).set(database="batching_bench")
    conninfo = make_url(admin_url).set(drivername="postgresql").render_as_string(False)
    out: dict[str, Any] = {}
    for k in scorer_counts:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS batching_bench")
            conn.execute("CREATE DATABASE batching_bench")
        cfg = load_config(
            DEPLOY / "tabular.yaml",
            {
                "database": {"url": url.render_as_string(False)},
                "output": {"path": str(tmp / f"out-pg{k}")},
                "lineage": {"transport": "none"},
                "queue": {"name": "w1pg"},
            },
        )
        enqueue(cfg, recs)
        out[f"scorers_{k}_rows_s"] = scorer_processes(cfg, n, k)
    RESULTS["w1_postgres"] = out


# -- W2 ------------------------------------------------------------------------------------


def w2_limit(seqs: list[np.ndarray], batch: int = 32) -> float:
    model, _ = zoo.build("w2-text")
    model.eval()
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches = []
    for i in range(0, len(order), batch):
        group = [seqs[j] for j in order[i : i + batch]]
        width = max(len(s) for s in group)
        tokens = torch.zeros((len(group), width), dtype=torch.int64)
        for r, s in enumerate(group):
            tokens[r, : len(s)] = torch.from_numpy(s)
        batches.append((tokens, tokens == 0))
    with torch.inference_mode():
        model(*batches[0])
        start = time.perf_counter()
        for tokens, mask in batches:
            model(tokens, mask)
    return len(seqs) / (time.perf_counter() - start)


def w2(tmp: Path, n: int, online_s: float, repeats: int) -> None:
    """Limit and dynamic interleaved ``repeats`` times; medians, so one noisy moment cannot
    decide the ratio on a shared machine."""
    seqs = workloads.w2_inputs(n)
    recs = ingest.read_records(workloads.write_lines(tmp / "w2.jsonl", workloads.w2_json_lines(n)))
    n1 = min(n, 300)
    b1 = pipeline_rate(
        config("bulk.yaml", tmp, "w2b1", max_batch_size=1, claim_size=32, max_wait_s=0.0),
        recs[:n1],
    )
    limits, runs = [w2_limit(seqs)], []
    for r in range(repeats):
        runs.append(pipeline_rate(config("bulk.yaml", tmp, f"w2d{r}"), recs))
        limits.append(w2_limit(seqs))
    limit = statistics.median(limits)
    dyn = _median_run(runs)
    RESULTS["w2"] = {
        "items": n,
        "limit_rows_s": limit,
        "limit_runs": limits,
        "batch1_rows_s": b1["items_per_s"],
        "dynamic_rows_s": dyn["items_per_s"],
        "dynamic_runs": [s["items_per_s"] for s in runs],
        "dynamic_vs_limit": dyn["items_per_s"] / limit,
        "dynamic_vs_batch1": dyn["items_per_s"] / b1["items_per_s"],
        "padding_efficiency": dyn["padding_efficiency"],
        "batch_size_mean": dyn["batch_size_mean"],
        "stage_us_per_row": per_row_us(dyn),
    }
    if online_s > 0:
        capacity = dyn["items_per_s"]
        RESULTS["w2_online"] = [
            open_loop(tmp, recs, capacity * load, load, online_s) for load in (0.5, 0.9)
        ]


def open_loop(
    tmp: Path, recs: list[models.EnqueueRecord], rate: float, load: float, seconds: float
) -> dict[str, Any]:
    """Poisson arrivals at ``rate``/s for ``seconds`` against a live online scorer."""
    tag = f"w2on{int(load * 100)}"
    cfg = config("online.yaml", tmp, tag)
    enqueue(cfg, [])
    producer_q = build.open_queue(cfg, cfg.database.url)
    result: dict[str, Any] = {}
    scorer = threading.Thread(
        target=lambda: result.update(
            app.run_score(
                cfg, limits=run_stats.RunLimits(until_empty=False, max_seconds=seconds + 3)
            ).summary
        )
    )
    scorer.start()
    time.sleep(3.0)  # model load and warm-up happen before the first arrival
    rng = random.Random(11)
    sent, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        rec = recs[sent % len(recs)]
        producer_q.enqueue([models.EnqueueRecord(f"{tag}-{sent}", rec.payload, cost=rec.cost)])
        sent += 1
        time.sleep(rng.expovariate(rate))
    scorer.join()
    producer_q.engine.dispose()
    prof = build.load_profile(cfg)
    full = prof.predict(cfg.batching.max_batch_size, 128) if prof else float("nan")
    bound = 2 * (cfg.batching.max_wait_s + full)
    return {
        "load": load,
        "offered_rows_s": rate,
        "sent": sent,
        "committed": result.get("items_committed"),
        "latency_p50_s": result.get("latency_p50_s"),
        "latency_p99_s": result.get("latency_p99_s"),
        "bound_s": bound,
        "batch_size_mean": result.get("batch_size_mean"),
    }


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    count, seconds = _positive(int), _positive(float)
    more = "%s requests (default: the reference set; more repeat it)"
    parser.add_argument("--w1-items", type=count, default=50_000, help=more % "W1")
    parser.add_argument("--w2-items", type=count, default=3_000, help=more % "W2")
    parser.add_argument(
        "--online-s", type=seconds, default=20.0, help="length of each open-loop W2 run"
    )
    parser.add_argument("--only", choices=["w1", "w2"])
    parser.add_argument(
        "--repeats", type=count, default=3, help="limit/dynamic repetitions (W1 and W2)"
    )
    parser.add_argument("--json", type=Path, help="also write results here")
    parser.add_argument("--pg", metavar="URL", help="also run W1 on this PostgreSQL server")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "w1"):
            w1(Path(tmp), args.w1_items, args.repeats)
            w1_sqlite_processes(Path(tmp), args.w1_items)
            if args.pg:
                w1_pg(Path(tmp), args.w1_items, args.pg)
        if args.only in (None, "w2"):
            w2(Path(tmp), args.w2_items, args.online_s, args.repeats)
    print(json.dumps(RESULTS, indent=2))
    if args.json:
        args.json.write_text(json.dumps(RESULTS, indent=2))


if __name__ == "__main__":
    main()
