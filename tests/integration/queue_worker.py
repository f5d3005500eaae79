"""A claimer process for the concurrency and SIGKILL tests (run as a script, killed for real).

usage: queue_worker.py drain URL QUEUE CLAIM_SIZE OUT   claim+ack until empty; write claims
       queue_worker.py hold URL QUEUE CLAIM_SIZE LEASE_S  claim once, print, then hang
  drain-columns / hold-columns: the same with the scorer's claims (``columns=True``): a claim
  whose items are one run of ids is a range lease.
"""

from __future__ import annotations

import json
import sys
import time

from batching.ingress import queue as q
from batching.store import database


def drain(url: str, name: str, n: int, out: str, columns: bool) -> None:
    engine = database.create_engine(url)
    queue = q.SqlQueue(engine, name)
    claims, empty = [], 0
    while empty < 3:
        claim = queue.claim(n, lease_s=600, columns=columns)
        if not claim.items and claim.suspects:  # a dead claimer's items: alone, as a scorer would
            claim = queue.claim(n, lease_s=600, isolate=True)
        if not claim.items:
            empty += 1
            time.sleep(0.05)
            continue
        empty = 0
        ids = [i.id for i in claim.items]
        acked = queue.ack(claim.lease_id, ids)
        claims.append({"lease": claim.lease_id, "ids": ids, "acked": acked})
    with open(out, "w") as fh:
        json.dump(claims, fh)
    engine.dispose()


def hold(url: str, name: str, n: int, lease_s: float, columns: bool) -> None:
    engine = database.create_engine(url)
    claim = q.SqlQueue(engine, name).claim(n, lease_s=lease_s, columns=columns)
    print(json.dumps({"lease": claim.lease_id, "ids": [i.id for i in claim.items]}), flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    mode, url, name, size, last = sys.argv[1:6]
    verb, _, columns = mode.partition("-")
    if verb == "drain":
        drain(url, name, int(size), last, bool(columns))
    else:
        hold(url, name, int(size), float(last), bool(columns))
