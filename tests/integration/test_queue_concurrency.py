"""Many real processes claiming at once, and a claimer killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import models
from batching.ingress import queue as q
from batching.store import database, schema, sqlite
from tests.conftest import REPO, wait_for

WORKER = str(Path(__file__).with_name("queue_worker.py"))
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
MODES = ("drain", "drain-columns")


def fill(url: str, name: str, n: int) -> None:
    engine = database.create_engine(url)
    queue = q.SqlQueue(engine, name)
    records = [  # three tenants: concurrent claims split across them (fair share)
        models.EnqueueRecord(f"k{i}", models.Payload(b"{}"), tenant=f"t{i % 3}") for i in range(n)
    ]
    assert queue.enqueue(records).inserted == n
    engine.dispose()


def run_claimers(
    url: str, name: str, n_procs: int, claim_size: int, tmp: Path
) -> list[dict[str, Any]]:
    """``n_procs`` claimer processes draining the queue at once; every other one claims as a
    scorer does (range leases where its items are one run of ids), the rest item by item."""
    outs = [tmp / f"claims-{i}.json" for i in range(n_procs)]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, MODES[i % 2], url, name, str(claim_size), str(o)],
            env=ENV,
        )
        for i, o in enumerate(outs)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0
    return [c for o in outs for c in json.loads(o.read_text())]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "n_procs"), [("sqlite", 4), pytest.param("postgres", 8, marks=pytest.mark.postgres)]
)
def test_concurrent_claimers_ack_every_item_exactly_once(
    backend: str, n_procs: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    n_items = 50_000
    fill(url, "conc", n_items)
    claims = run_claimers(url, "conc", n_procs, 100, tmp_path)
    claimed = Counter(i for c in claims for i in c["ids"])
    assert len(claimed) == n_items
    assert max(claimed.values()) == 1, "an item was claimed by two live leases"
    assert sum(c["acked"] for c in claims) == n_items
    assert len({c["lease"] for c in claims}) == len(claims)
    engine = database.create_engine(url)
    stats = q.SqlQueue(engine, "conc").stats()
    engine.dispose()
    assert stats.by_state["done"] == n_items
    assert stats.by_state["leased"] == stats.by_state["ready"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hold", "hold-columns"])
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkilled_claimer_items_are_reaped_and_finished(
    backend: str, mode: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    fill(url, "kill", 300)
    proc = subprocess.Popen(  # hold-columns: a range lease, killed
        [sys.executable, WORKER, mode, url, "kill", "120", "2"],
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    held = json.loads(proc.stdout.readline())
    assert len(held["ids"]) == 120
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()

    engine = database.create_engine(url)
    queue = q.SqlQueue(engine, "kill")
    with engine.connect() as conn:
        ranges = conn.execute(sa.select(sa.func.count()).select_from(schema.ranges)).scalar()
    assert ranges == (1 if mode == "hold-columns" else 0)
    assert queue.stats().by_state["leased"] == 120
    assert queue.release_expired().released == 0, "lease still live right after the kill"
    time.sleep(2.2)  # the dead claimer's 2 s lease runs out in real time
    assert queue.release_expired().released == 120
    assert queue.ack(held["lease"], held["ids"]) == 0, "the dead claimer's lease can never ack"
    engine.dispose()

    claims = run_claimers(url, "kill", 1, 64, tmp_path)
    assert sorted(i for c in claims for i in c["ids"]) == sorted(
        set(i for c in claims for i in c["ids"])
    )
    engine = database.create_engine(url)
    queue = q.SqlQueue(engine, "kill")
    assert queue.stats().by_state["done"] == 300
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(schema.items.c.attempts, schema.items.c.crash_count).where(
                schema.items.c.id.in_(held["ids"])
            )
        ).all()
    engine.dispose()
    # The dead claimer's attempt was given back (it held 120 items: none is to blame alone).
    assert {(r.attempts, r.crash_count) for r in rows} == {(1, 1)}


LOCK_HOLDER = """
import fcntl, os, sys, time
db, ready, hold_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
fd = os.open(db + ".writer-lock", os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
open(ready, "w").close()
time.sleep(hold_s)
"""


def write_while_another_process_holds_the_lock_file(
    tmp_path: Path, hold_s: float, busy_timeout_ms: int
) -> float:
    """Seconds an enqueue took while another process held ``<db>.writer-lock`` (only the file
    lock: SQLite's own write lock stays free) for ``hold_s``."""
    db = tmp_path / "q.db"
    engine = database.create_engine(f"sqlite:///{db}", sqlite_busy_timeout_ms=busy_timeout_ms)
    queue = q.SqlQueue(engine, "lock")
    queue.migrate()
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), str(ready), str(hold_s)])
    try:
        wait_for(ready.exists, 30, "the other process to hold the lock file")
        started = time.monotonic()
        assert queue.enqueue([models.EnqueueRecord("k", models.Payload(b"{}"))]).inserted == 1
        return time.monotonic() - started
    finally:
        holder.kill()
        holder.wait(30)
        engine.dispose()


def test_a_sqlite_writer_queues_behind_another_process_on_the_lock_file(tmp_path: Path) -> None:
    assert write_while_another_process_holds_the_lock_file(tmp_path, 1.5, 30_000) >= 0.8


def test_a_sqlite_writer_waits_for_the_lock_file_no_longer_than_the_busy_timeout(
    tmp_path: Path,
) -> None:
    """A holder that never lets go (a stopped process) delays writers by the busy timeout,
    then SQLite's own lock decides; here it is free, so the write goes through."""
    assert write_while_another_process_holds_the_lock_file(tmp_path, 60, 300) < 20


def test_a_forked_child_takes_the_writer_lock_after_the_parent_not_with_it(
    tmp_path: Path,
) -> None:
    """The child gets a fresh lock (the parent's thread lock was held at the fork) and a file
    descriptor of its own, so it waits for the parent's flock instead of sharing it."""
    engine = database.create_engine(f"sqlite:///{tmp_path / 'q.db'}")
    lock = sqlite.writer_lock(engine)
    with lock:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if it had to wait for the parent
            started = time.monotonic()
            with lock:
                os._exit(0 if time.monotonic() - started >= 0.5 else 3)
        time.sleep(1.0)
    deadline = time.monotonic() + 10
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child never got the writer lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    engine.dispose()
