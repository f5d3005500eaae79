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
from tests.conftest import REPO

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
