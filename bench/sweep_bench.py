"""Benchmark the full reconcile sweep on a million committed items. Not a test.

Builds the committed state with the library's own parts: ``SqlQueue.enqueue`` (payloads of two
bytes: the sweep never reads them), then ``claim`` and ``sinks.commit`` into a real
``ParquetSink`` (``defer_marks`` as the scorer has it; ``fsync`` off: durability is not what is
measured), one float output per item (W1's output shape; the model is not run: scoring is not
what is measured). Then times, each in a fresh process so its peak RSS is its own:

  sweep      ``batching.evidence.sweep.sweep`` from the start (``restart``): seconds, pages,
             peak RSS (``resource.getrusage``)
  reconcile  (``--compare-reconcile``) the everything-at-once ``reconcile`` on the same data

    python bench/sweep_bench.py [--items 1000000] [--batch 1024] [--compare-reconcile]
    python bench/sweep_bench.py --pg postgresql://postgres@127.0.0.1:5432/postgres ...

SQLite in a temporary folder; with ``--pg``, a scratch database ``batching_sweep_bench``
(dropped and created again).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from batching import models
from batching.evidence import reconcile as rc
from batching.evidence import sweep as sw
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import parquet
from batching.store import database
from batching.store.database import normalize_url

QUEUE = "sweep"
_ENQUEUE_CHUNK = 50_000


def open_queue(url: str) -> q.SqlQueue:
    return q.SqlQueue(database.create_engine(url), QUEUE)


def build(url: str, root: Path, n: int, batch: int) -> dict[str, Any]:
    """Enqueue ``n`` items, then claim and commit them ``batch`` at a time into ``root``."""
    queue = open_queue(url)
    queue.migrate()
    started = time.perf_counter()
    for lo in range(0, n, _ENQUEUE_CHUNK):
        queue.enqueue(
            models.EnqueueRecord(f"item-{k:08d}", models.Payload(b"{}"))
            for k in range(lo, min(n, lo + _ENQUEUE_CHUNK))
        )
    enqueued_s = time.perf_counter() - started
    sink = parquet.ParquetSink(queue, root, fsync=False, defer_marks=True)
    rng = np.random.default_rng(1)
    n_batches = 0
    while True:
        claim = queue.claim(batch, lease_s=600)
        if not claim.items:
            break
        outputs = {i.id: rng.random(1, dtype=np.float32) for i in claim.items}
        sink.commit(
            sinks.ScoredBatch(claim.items, outputs, claim.lease_id, "bench", "w1", time.time())
        )
        n_batches += 1
    sink.flush()
    queue.engine.dispose()
    return {
        "items": n,
        "batches": n_batches,
        "enqueue_s": round(enqueued_s, 1),
        "build_s": round(time.perf_counter() - started, 1),
    }


def measure(what: str, url: str, root: Path, page_size: int) -> dict[str, Any]:
    """One sweep or one whole reconcile, in this process: seconds, peak RSS, what it found."""
    queue = open_queue(url)
    sink = parquet.ParquetSink(queue, root, create=False)
    started = time.perf_counter()
    if what == "sweep":
        report = sw.sweep(queue, sink, now=time.time(), restart=True, page_size=page_size)
    else:
        report = rc.reconcile(queue, sink, now=time.time())
    seconds = time.perf_counter() - started
    queue.engine.dispose()
    return {
        "what": what,
        "seconds": round(seconds, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "counts": report.counts,
        "sweep": dict(report.sweep) if report.sweep else None,
    }


def child(what: str, url: str, root: Path, page_size: int) -> dict[str, Any]:
    """``measure`` in a fresh Python process (its peak RSS is the measurement's alone)."""
    args = [sys.executable, __file__, "--measure", what, "--url", url, "--root", str(root)]
    args += ["--page-size", str(page_size)]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def scratch_pg(admin_url: str) -> str:
    import psycopg
    from sqlalchemy.engine import make_url

    conninfo = make_url(admin_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS batching_sweep_bench")
        conn.execute("CREATE DATABASE batching_sweep_bench")
    url = make_url(normalize_url(admin_url)).set(database="batching_sweep_bench")
    return url.render_as_string(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1024, help="items a committed batch")
    p.add_argument("--page-size", type=int, default=sw.PAGE_SIZE)
    p.add_argument("--pg", help="PostgreSQL admin URL (a scratch database is made there)")
    p.add_argument("--compare-reconcile", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument("--measure", choices=("sweep", "reconcile"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.url, args.root, args.page_size)))
        return
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        url = scratch_pg(args.pg) if args.pg else f"sqlite:///{Path(tmp) / 'queue.db'}"
        root = Path(tmp) / "outputs"
        results: dict[str, Any] = {"database": "postgresql" if args.pg else "sqlite"}
        results["build"] = build(url, root, args.items, args.batch)
        print(json.dumps(results["build"]), flush=True)
        results["sweep"] = child("sweep", url, root, args.page_size)
        print(json.dumps(results["sweep"]), flush=True)
        if args.compare_reconcile:
            results["reconcile"] = child("reconcile", url, root, args.page_size)
            print(json.dumps(results["reconcile"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
