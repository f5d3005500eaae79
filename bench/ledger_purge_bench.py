"""What ``batching purge --ledger`` costs on a large ledger: N published ledger rows of one
queue, committed evenly over the days before now (a Parquet output's rows: a path, a
sha256, one item each), a share of them still named by a done item; then the purge of
everything older than ``--older-than-days``. Not a test.

    python bench/ledger_purge_bench.py [--rows 1000000] [--days 30] [--kept 0.01] [--older-than-days 3]
    python bench/ledger_purge_bench.py --db postgresql://postgres@127.0.0.1:5432/postgres

Prints the purge's wall time, rows deleted, its pages (transactions of up to 2,000 rows
read) and the longest of them: how long a scorer's commit may wait behind one (SQLite's
writer lock; on PostgreSQL a page blocks nothing but a duplicate repair).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
import uuid
from collections.abc import Iterator

import sqlalchemy as sa
from cap_bench import scratch_queue  # bench/ is on the path (this script's folder)
from sqlalchemy.engine import Connection

from batching import models
from batching.ingress import queue as q
from batching.store import retention, schema


def fill(queue: q.SqlQueue, rows: int, kept: float, now: float, days: float) -> int:
    """``rows`` ledger rows evenly over the ``days`` up to ``now``, a ``kept`` share of them
    named by a done item (their items not purged yet); returns the items written."""
    rng = random.Random(7)
    items = 0
    chunk = 20_000
    for start in range(0, rows, chunk):
        ledger, named = [], []
        for n in range(start, min(rows, start + chunk)):
            at = now - (rows - n) * days * 86400 / rows
            batch_id = str(uuid.uuid4())
            ledger.append(
                {
                    "batch_id": batch_id,
                    "run_id": "run-bench",
                    "queue": queue.queue,
                    "lease_id": batch_id,
                    "model_version": "v1",
                    "sink": "parquet",
                    "path": f"date=2026-01-01/model_version=v1/part-{batch_id}.parquet",
                    "n_rows": 1,
                    "n_bytes": 2048,
                    "sha256": "0" * 64,
                    "state": models.BatchState.PUBLISHED.value,
                    "committed_at": at,
                    "published_at": at,
                }
            )
            if rng.random() < kept:
                named.append(
                    {
                        "queue": queue.queue,
                        "item_key": f"k{n}",
                        "state": int(models.State.DONE),
                        "batch_id": batch_id,
                        "enqueued_at": at,
                        "finished_at": at,
                        "run_after": at,
                        "sort_deadline": schema.NO_DEADLINE,
                    }
                )
        with queue.begin() as conn:
            conn.execute(schema.batches.insert(), ledger)
            if named:
                conn.execute(schema.items.insert(), named)
        items += len(named)
    return items


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=1_000_000, help="ledger rows")
    p.add_argument("--days", type=float, default=30.0, help="committed evenly over these")
    p.add_argument("--kept", type=float, default=0.01, help="share still named by an item")
    p.add_argument("--older-than-days", type=float, default=3.0, help="the purge's age")
    p.add_argument("--db", help="PostgreSQL admin URL (a scratch database); default SQLite")
    args = p.parse_args()
    with scratch_queue(args.db, "ledgerq") as queue:
        engine = queue.engine
        named = fill(queue, args.rows, args.kept, time.time(), args.days)
        pages: list[float] = []
        begin = queue.begin

        @contextlib.contextmanager
        def timed_begin() -> Iterator[Connection]:
            started = time.perf_counter()
            with begin() as conn:
                yield conn
            pages.append(time.perf_counter() - started)

        queue.begin = timed_begin  # type: ignore[method-assign]
        started = time.perf_counter()
        deleted, horizon = queue.purge_ledger(args.older_than_days * 86400)
        wall = time.perf_counter() - started
        with engine.connect() as conn:
            left = conn.execute(sa.select(sa.func.count()).select_from(schema.batches))
            remaining = left.scalar_one()
    print(
        f"{engine.dialect.name}: {args.rows} ledger rows ({named} named by an item), purge "
        f"older than {args.older_than_days:g} d: {deleted} deleted in {wall:.2f} s "
        f"({deleted / wall:,.0f} rows/s), {remaining} left; {len(pages)} transactions, "
        f"longest {max(pages) * 1e3:.0f} ms, median {sorted(pages)[len(pages) // 2] * 1e3:.0f} ms; "
        f"horizon {None if horizon is None else retention.day(horizon)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
