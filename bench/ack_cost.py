"""Benchmark: what a W1 item's claim and ack cost on SQLite with some of the item table's
indexes dropped, or with other connection pragmas: where the per-row write at ack goes.

Not a test, and not a configuration to ship: an index dropped here is one a claim, a purge
or a count needs. One process, a fresh SQLite file per variant; N W1 tensor items enqueued,
then claimed as the scorer claims them (``columns=True``, claims of 16,384: range leases) and
acked 2,048 at a time. Microseconds a row: claim, ack, and the wall time and this process's
CPU over both. The variants run in turn, ``--rounds`` times, so a drift of the machine shows
as a spread rather than as a difference.

    python bench/ack_cost.py [--items 200000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import queue_bench  # bench/ is on the path (this script's folder)
import sqlalchemy as sa

from batching import models
from batching.ingress import ingest
from batching.ingress import queue as q
from batching.model import workloads
from batching.store import database

VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (indexes dropped, pragmas set on every connection)
    "as shipped": ((), ()),
    "no done index": (("ix_batching_items_done",), ()),
    "no batch index": (("ix_batching_items_batch",), ()),
    "no ready index": (("ix_batching_items_ready",), ()),
    "no tenant ready index": (("ix_batching_items_tenant_ready",), ()),
    "cache 64 MiB, mmap 256 MiB, checkpoint 10k pages": (
        (),
        ("cache_size = -65536", "mmap_size = 268435456", "wal_autocheckpoint = 10000"),
    ),
}


def measure(
    folder: Path,
    records: list[models.EnqueueRecord],
    drop: tuple[str, ...],
    pragmas: tuple[str, ...],
) -> tuple[float, float, float, float]:
    """(claim, ack, wall, CPU) microseconds a row for one fresh queue."""
    engine = database.create_engine(f"sqlite:///{folder / uuid.uuid4().hex[:8]}.db")

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: object, _record: object) -> None:
        cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
        for pragma in pragmas:
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    queue = q.SqlQueue(engine, "w1")
    queue.migrate()
    with engine.begin() as conn:
        for index in drop:
            conn.exec_driver_sql(f"DROP INDEX {index}")
    queue.enqueue(records)
    n = len(records)
    cpu, wall = time.process_time(), time.perf_counter()
    claim_s, ack_s = queue_bench.claim_and_ack(queue, n, 16_384)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    engine.dispose()
    return tuple(x / n * 1e6 for x in (claim_s, ack_s, wall, cpu))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=200_000, help="W1 items a variant")
    parser.add_argument("--rounds", type=int, default=2, help="times each variant runs")
    args = parser.parse_args()
    if args.items < 16_384 or args.rounds < 1:
        parser.error("--items must be at least 16384 and --rounds at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        records = ingest.read_records(workloads.write_w1_parquet(folder / "w1.parquet", args.items))
        print("| round | variant | claim us/row | ack us/row | wall us/row | CPU us/row |")
        print("|---|---|---:|---:|---:|---:|")
        for r in range(1, args.rounds + 1):
            for name, (drop, pragmas) in VARIANTS.items():
                claim, ack, wall, cpu = measure(folder, records, drop, pragmas)
                print(f"| {r} | {name} | {claim:.2f} | {ack:.2f} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
