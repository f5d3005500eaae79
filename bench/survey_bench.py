"""What a scoped reconcile's listing costs against the whole dataset's. Not a test.

    python bench/survey_bench.py [--files 36000] [--days 30] [--reps 3]

Lays out ``--files`` empty ``part-*.parquet`` files over ``--days`` ``date=`` partitions
(the Parquet sink's layout; a listing reads names, not contents) in a temporary folder, then
times ``ParquetLayout.visible_files()`` (every file: the unscoped check, and every scoped
check before 2026-12-06) against ``visible_files(since)`` for a window of the last hour (the
partitions from the day before it on: what ``reconcile --since 1h`` lists now).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from batching.outputs.parquet_layout import ParquetLayout

DAY_S = 86_400.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=36_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.files < 1 or args.days < 1 or args.reps < 1:
        parser.error("--files, --days and --reps must be at least 1")
    now = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        layout = ParquetLayout.for_root(Path(tmp) / "out")
        for n in range(args.files):
            day = now - (n % args.days) * DAY_S
            rel = layout.relative_path(f"b{n:08d}", "v1", day)
            path = layout.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        for rep in range(args.reps):
            for name, since in (("whole dataset", None), ("last hour", now - 3600 - DAY_S)):
                start = time.perf_counter()
                listed = layout.visible_files(since)
                took = time.perf_counter() - start
                print(f"rep {rep} {name}: {len(listed)} files listed in {took * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
