"""Claim time on a large SQLite queue with the leased-rows index of migration 7 against the
one before it (by expiry alone), interleaved. Not a test.

Every claim first reaps its queue's expired leases; this measures what that costs when the
queue holds many done items. python bench/reap_bench.py [--items 300000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from batching import models
from batching.ingress import queue as q
from batching.store import database

NEW = (
    "CREATE INDEX ix_batching_items_leased ON batching_items (queue, lease_expires_at)"
    " WHERE state = 1"
)
OLD = (
    "CREATE INDEX ix_batching_items_lease_exp ON batching_items (lease_expires_at) WHERE state = 1"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=300_000, help="items in the queue")
    n = parser.parse_args().items
    url = f"sqlite:///{Path(tempfile.mkdtemp()) / 'q.db'}"
    queue = q.SqlQueue(database.create_engine(url), "w1")
    queue.migrate()
    queue.enqueue(models.EnqueueRecord(f"k{i}", models.Payload(b'{"x":[1]}')) for i in range(n))
    done = 0
    while done < n - 2000:  # all but 2,000 done: what a queue with history looks like
        claim = queue.claim(4096, lease_s=60)
        done += queue.ack(claim.lease_id, [i.id for i in claim.items])

    def use(index: str) -> None:
        with queue.engine.begin() as conn:
            conn.exec_driver_sql("DROP INDEX IF EXISTS ix_batching_items_leased")
            conn.exec_driver_sql("DROP INDEX IF EXISTS ix_batching_items_lease_exp")
            conn.exec_driver_sql(index)

    def claim_ms() -> float:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            claim = queue.claim(10, lease_s=60)
            times.append(time.perf_counter() - start)
            queue.release(claim.lease_id)
        return statistics.median(times) * 1e3

    for rnd in range(3):
        use(OLD)
        old = claim_ms()
        use(NEW)
        new = claim_ms()
        print(
            f"round {rnd}: claim of 10 on {n} items: by expiry {old:.2f} ms, by queue {new:.2f} ms"
        )


if __name__ == "__main__":
    main()
