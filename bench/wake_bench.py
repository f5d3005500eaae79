"""What a SQLite scorer waiting for work costs, and how soon it claims an item enqueued by
another process: polling every poll_s (before) against ``PRAGMA data_version`` checked every
2 ms and 5 ms (``queue.Waiter``), interleaved in one run; and with ``poll_s`` raised to
0.25 s, which the wake-ups allow. Not a test.

The scorer here is the claim loop of ``batching.loop.scorer`` (claim; nothing: wait poll_s),
on its own, so the figures are the wake-up's: latency is from the producer's enqueue commit
(when ``enqueue`` returned, in the producer process) to the claim that took the item. Idle
cost: CPU seconds per second of the waiting process, and claims per second, with nothing
enqueued. python bench/wake_bench.py [--items 100] [--poll-s 0.05] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from batching import models
from batching.ingress import queue as q
from batching.store import database

IDLE_S = 3.0


def produce(url: str, n: int, seed: int) -> None:
    """Child process: enqueue ``n`` items one at a time at random gaps (20-80 ms, unrelated
    to any poll), print each key with the time its enqueue committed."""
    rng = random.Random(seed)
    queue = q.SqlQueue(database.create_engine(url), "wake")
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(n):
        time.sleep(rng.uniform(0.02, 0.08))
        key = f"{seed}-{i}"
        queue.enqueue([models.EnqueueRecord(key, models.Payload(b'{"x": 1}'))])
        print(json.dumps([key, time.time()]), flush=True)


class ClaimLoop:
    """The scorer's claim loop: claim; if nothing, wait(poll_s); ack what it claimed."""

    def __init__(self, queue: q.SqlQueue, wait: Callable[[float], object], poll_s: float):
        self.queue, self.wait, self.poll_s = queue, wait, poll_s
        self.claimed: dict[str, float] = {}
        self.claims = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            claim = self.queue.claim(64, lease_s=60)
            self.claims += 1
            if claim.items:
                now = time.time()
                for item in claim.items:
                    self.claimed[item.item_key] = now
                self.queue.ack(claim.lease_id, [i.id for i in claim.items])
            else:
                self.wait(self.poll_s)


def one(url: str, check_s: float | None, n: int, poll_s: float, seed: int) -> dict[str, float]:
    engine = database.create_engine(url)
    queue = q.SqlQueue(engine, "wake")
    waiter: q.Waiter | None = None
    if check_s is None:
        wait: Callable[[float], object] = time.sleep  # the SQLite Waiter before: a plain sleep
    else:
        waiter = q.Waiter(engine, "wake", check_s=check_s)
        wait = waiter.wait
    loop = ClaimLoop(queue, wait, poll_s)
    loop.thread.start()
    time.sleep(0.5)  # settle
    cpu, claims, start = time.process_time(), loop.claims, time.monotonic()
    time.sleep(IDLE_S)
    elapsed = time.monotonic() - start
    idle_cpu = (time.process_time() - cpu) / elapsed
    idle_claims = (loop.claims - claims) / elapsed
    child = subprocess.Popen(
        [sys.executable, __file__, "--produce", url, str(n), str(seed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    child.stdin.write("go\n")
    child.stdin.flush()
    committed = dict(json.loads(line) for line in child.stdout)
    child.wait()
    deadline = time.monotonic() + poll_s + 5
    while len(loop.claimed) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop.set()
    loop.thread.join()
    if waiter is not None:
        waiter.close()
    engine.dispose()
    lat = sorted((loop.claimed[k] - t) * 1e3 for k, t in committed.items() if k in loop.claimed)
    return {
        "idle_cpu_pct": idle_cpu * 100,
        "idle_claims_per_s": idle_claims,
        "p50_ms": statistics.median(lat),
        "p90_ms": lat[int(len(lat) * 0.9)],
        "max_ms": lat[-1],
        "missing": n - len(lat),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--produce":
        produce(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100, help="items per mode and round")
    parser.add_argument("--poll-s", type=float, default=0.05, help="queue.poll_s (default 0.05)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    url = f"sqlite:///{Path(tempfile.mkdtemp()) / 'q.db'}"
    q.SqlQueue(database.create_engine(url), "wake").migrate()
    poll_s = args.poll_s
    # (label, data_version check every, poll_s): before, after, and after with a poll_s the
    # wake-ups allow (the backstop alone: retries coming due, a missed wake-up)
    modes = [
        ("poll (before)", None, poll_s),
        ("data_version 2 ms", 0.002, poll_s),
        ("data_version 5 ms", 0.005, poll_s),
    ]
    if poll_s < 0.25:
        modes.append(("data_version 2 ms", 0.002, 0.25))
    results: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(modes))}
    seed = 0
    for _ in range(args.rounds):
        for i, (_label, check_s, mode_poll_s) in enumerate(modes):
            seed += 1
            results[i].append(one(url, check_s, args.items, mode_poll_s, seed))
    print(f"{args.items} items x {args.rounds} rounds per mode; latency: enqueue commit -> claim")
    print(
        f"{'mode':<20}{'poll_s':>7}{'idle CPU %':>11}{'claims/s':>10}"
        f"{'p50 ms':>8}{'p90 ms':>8}{'max ms':>8}"
    )
    for i, rows in results.items():
        label, _, mode_poll_s = modes[i]
        for r in rows:
            print(
                f"{label:<20}{mode_poll_s:>7g}{r['idle_cpu_pct']:>11.2f}"
                f"{r['idle_claims_per_s']:>10.1f}{r['p50_ms']:>8.1f}{r['p90_ms']:>8.1f}"
                f"{r['max_ms']:>8.1f}" + (f"  missing {r['missing']:g}" if r["missing"] else "")
            )


if __name__ == "__main__":
    main()
