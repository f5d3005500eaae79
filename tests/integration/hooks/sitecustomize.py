"""Loaded by every Python process started with this folder on PYTHONPATH (a test sets it):
with BATCHING_TEST_HANG_WORKER=NAME, the process named NAME (``batching-worker-1``) hangs
right after taking the SQLite writer lock for the 5th time, holding it (as a thread stuck
in a system call, or a process paused in a debugger, would). Early: a worker that is slow to
start under a loaded machine may find the other has claimed most of the queue, and a claim
that finds nothing takes no write lock."""

from __future__ import annotations

import os

if os.environ.get("BATCHING_TEST_HANG_WORKER"):
    import multiprocessing
    import time

    from batching.store import sqlite

    enter = sqlite._WriterLock.__enter__
    taken = [0]

    def hanging_enter(self: sqlite._WriterLock) -> None:
        enter(self)
        if multiprocessing.current_process().name == os.environ["BATCHING_TEST_HANG_WORKER"]:
            taken[0] += 1
            if taken[0] == 5:
                time.sleep(3600)

    sqlite._WriterLock.__enter__ = hanging_enter  # type: ignore[method-assign]
