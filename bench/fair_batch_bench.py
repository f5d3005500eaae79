"""What tenant fair share costs the batcher: microseconds an item to cut a backlog of pending
items into batches, with and without ``fair`` (``queue.fair_share``), the items of two tenants
in halves (one tenant's then the other's) or interleaved. Not a test.

    python bench/fair_batch_bench.py [--items 8192 32768] [--batch 256]
"""

from __future__ import annotations

import argparse
import itertools
import time

from batching import config, models, tenant_share
from batching.policy import batcher
from batching.testing import FakeClock

_PAYLOAD = models.Payload(b"", models.PayloadFormat.TENSOR, "float32", (2,))


def cut_us(n: int, batch: int, *, fair: bool, mixed: bool) -> float:
    """Microseconds an item to cut ``n`` pending items into batches of ``batch``."""
    clock = FakeClock(1000.0)
    policy = config.BatchingPolicy(max_batch_size=batch, max_wait_s=0.0)
    b = batcher.MicroBatcher(policy, clock, fair=tenant_share.FairShare() if fair else None)
    ids = itertools.count(1)
    b.add(
        [
            models.WorkItem(
                next(ids),
                f"k{k}",
                _PAYLOAD,
                900.0 + k * 1e-6,
                tenant=("a", "b")[k % 2] if mixed else ("a" if k < n // 2 else "b"),
            )
            for k in range(n)
        ]
    )
    started = time.perf_counter()
    while b.poll() is not None:
        pass
    return (time.perf_counter() - started) / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--items", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--batch", type=int, default=256, help="max_batch_size")
    args = p.parse_args()
    print("| pending | tenants | plain, us an item | fair, us an item |")
    print("|---:|---|---:|---:|")
    for n in args.items:
        for mixed in (False, True):
            plain = cut_us(n, args.batch, fair=False, mixed=mixed)
            fair = cut_us(n, args.batch, fair=True, mixed=mixed)
            how = "interleaved" if mixed else "in halves"
            print(f"| {n} | {how} | {plain:.2f} | {fair:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
