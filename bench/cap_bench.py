"""What a depth cap costs an enqueue: a one-item enqueue's time on a queue holding N ready items,
with a cap (the admission check counts the queue's items by tenant in the enqueue's
transaction, under SQLite's writer lock) and without one. Not a test.

    python bench/cap_bench.py [--items 100000] [--enqueues 50]
    python bench/cap_bench.py --db postgresql://postgres@127.0.0.1:5432/postgres   # scratch db

Prints the median of ``--enqueues`` one-item enqueues each way, for the commit being run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

from batching import models
from batching.ingress import controls
from batching.ingress import queue as q
from batching.store import database


def scratch(url: str | None, folder: Path) -> tuple[str, str | None]:
    """A fresh database: a SQLite file in ``folder``, or a new database beside ``url``'s."""
    if url is None:
        return f"sqlite:///{folder / 'cap.db'}", None
    name = f"cap_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(database.normalize_url(url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    target = sa.make_url(database.normalize_url(url)).set(database=name)
    return target.render_as_string(hide_password=False), name


@contextlib.contextmanager
def scratch_queue(admin_url: str | None, queue: str) -> Iterator[q.SqlQueue]:
    """A migrated queue in a fresh database (:func:`scratch`), disposed of and (PostgreSQL)
    dropped afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        url, name = scratch(admin_url, Path(tmp))
        engine = database.create_engine(url)
        try:
            found = q.SqlQueue(engine, queue)
            found.migrate()
            yield found
        finally:
            engine.dispose()
            if admin_url is not None and name is not None:
                admin = sa.create_engine(
                    database.normalize_url(admin_url), isolation_level="AUTOCOMMIT"
                )
                with admin.connect() as conn:
                    conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
                admin.dispose()


def median_ms(queue: q.SqlQueue, prefix: str, n: int) -> float:
    times = []
    for k in range(n):
        record = models.EnqueueRecord(f"{prefix}{k}", models.Payload(b"{}"), tenant="t1")
        started = time.perf_counter()
        queue.enqueue([record])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, default=100_000, help="ready items (4 tenants)")
    p.add_argument("--enqueues", type=int, default=50, help="one-item enqueues each way")
    p.add_argument("--db", help="PostgreSQL admin URL (a scratch database); default SQLite")
    args = p.parse_args()
    with scratch_queue(args.db, "capq") as queue:
        engine = queue.engine
        queue.enqueue(
            models.EnqueueRecord(f"k{i}", models.Payload(b"{}"), tenant=f"t{i % 4}")
            for i in range(args.items)
        )
        cap = 10 * args.items
        controls.set_max_depth(engine, "capq", cap, actor="bench", reason=None, now=time.time())
        capped = median_ms(queue, "c", args.enqueues)
        controls.set_max_depth(engine, "capq", None, actor="bench", reason=None, now=time.time())
        plain = median_ms(queue, "p", args.enqueues)
    print(
        f"{engine.dialect.name}, {args.items} ready items: one-item enqueue, median of "
        f"{args.enqueues}: {capped:.2f} ms with a cap, {plain:.2f} ms without"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
