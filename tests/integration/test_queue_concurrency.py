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

import pytest

from batching import models
from batching import queue as q
from tests.conftest import REPO, wait_for

WORKER = str(Path(__file__).with_name("queue_worker.py"))
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def fill(url: str, name: str, n: int) -> None:
    engine = q.create_engine(url)
    queue = q.SqlQueue(engine, name)
    records = [models.EnqueueRecord(f"k{i}", models.Payload(b"{}")) for i in range(n)]
    assert queue.enqueue(records).inserted == n
    engine.dispose()


def run_claimers(url: str, name: str, n_procs: int, claim_size: int, tmp: Path) -> list[dict]:
    outs = [tmp / f"claims-{i}.json" for i in range(n_procs)]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "drain", url, name, str(claim_size), str(o)], env=ENV
        )
        for o in outs
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
    engine = q.create_engine(url)
    stats = q.SqlQueue(engine, "conc").stats()
    engine.dispose()
    assert stats.by_state["done"] == n_items
    assert stats.by_state["leased"] == stats.by_state["ready"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkilled_claimer_items_are_reaped_and_finished(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    fill(url, "kill", 300)
    proc = subprocess.Popen(
        [sys.executable, WORKER, "hold", url, "kill", "120", "2"],
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

    engine = q.create_engine(url)
    queue = q.SqlQueue(engine, "kill")
    assert queue.release_expired().released == 0, "lease still live right after the kill"
    time.sleep(2.2)  # the dead claimer's 2 s lease runs out in real time
    assert queue.release_expired().released == 120
    assert queue.ack(held["lease"], held["ids"]) == 0, "the dead claimer's lease can never ack"
    engine.dispose()

    claims = run_claimers(url, "kill", 1, 64, tmp_path)
    assert sorted(i for c in claims for i in c["ids"]) == sorted(
        set(i for c in claims for i in c["ids"])
    )
    engine = q.create_engine(url)
    queue = q.SqlQueue(engine, "kill")
    assert queue.stats().by_state["done"] == 300
    with engine.connect() as conn:
        import sqlalchemy as sa

        from batching import schema

        rows = conn.execute(
            sa.select(schema.items.c.attempts, schema.items.c.crash_count).where(
                schema.items.c.id.in_(held["ids"])
            )
        ).all()
    engine.dispose()
    assert {(r.attempts, r.crash_count) for r in rows} == {(2, 1)}


LOCK_HOLDER = """
import fcntl, os, sqlite3, sys, time
db, ready = sys.argv[1], sys.argv[2]
fd = os.open(db + ".writer-lock", os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
con = sqlite3.connect(db, isolation_level=None)
con.execute("BEGIN IMMEDIATE")
open(ready, "w").close()
time.sleep(1.0)
con.execute("COMMIT")
fcntl.flock(fd, fcntl.LOCK_UN)
"""


def test_a_sqlite_writer_waits_for_another_process_on_the_lock_file(tmp_path: Path) -> None:
    """A writer in another process holds the lock file and SQLite's write lock for 1 s; with a
    1 ms busy timeout the busy handler alone would fail at once with "database is locked"."""
    db = tmp_path / "q.db"
    engine = q.create_engine(f"sqlite:///{db}", sqlite_busy_timeout_ms=1)
    queue = q.SqlQueue(engine, "lock")
    queue.migrate()
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), str(ready)])
    try:
        wait_for(ready.exists, 30, "the other process to hold the write lock")
        started = time.monotonic()
        result = queue.enqueue([models.EnqueueRecord("k", models.Payload(b"{}"))])
        waited = time.monotonic() - started
    finally:
        assert holder.wait(30) == 0
        engine.dispose()
    assert result.inserted == 1
    assert waited >= 0.5
