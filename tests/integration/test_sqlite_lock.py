"""SQLite's one writer lock, held too long: a waiting writer says which process holds it and
for how long, and a ``--workers`` run ends a worker that holds it past its lease (a paused
process would otherwise stop every other writer until the busy timeout, then fail them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from batching import config as cfg
from batching import models
from tests.conftest import wait_for
from tests.integration.conftest import BATCHING
from tests.integration.test_pipeline import SLOW, enqueue, items, w1_records, write_config

HOOKS = Path(__file__).with_name("hooks")
HOLD = """
import sys, time
from batching.ingress import queue as q
from batching.store import database
queue = q.SqlQueue(database.create_engine(sys.argv[1]), "tabular")
with queue.begin():
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.slow
def test_a_waiting_writer_names_the_process_that_holds_the_lock(
    sqlite_url: str, tmp_path: Path
) -> None:
    records = tmp_path / "r.jsonl"
    records.write_text('{"item_key": "a", "payload": {"x": [1, 2]}}\n')
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, sqlite_url, "7"], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "held"
    waiter = subprocess.run(
        [BATCHING, "enqueue", str(records), "-q", "tabular", "--db", sqlite_url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    holder.communicate(timeout=30)
    assert waiter.returncode == 0, waiter.stderr
    assert f"waiting 5 s for the SQLite writer lock: process {holder.pid} has held it" in (
        waiter.stderr
    )


@pytest.mark.slow
def test_workers_end_a_worker_that_holds_the_lock_past_its_lease(
    sqlite_url: str, tmp_path: Path
) -> None:
    n = 1500
    path = write_config("tabular.yaml", tmp_path, batching=SLOW, queue={"lease_s": 3})
    enqueue(sqlite_url, cfg.load_config(path), w1_records(n, tmp_path))
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
        "BATCHING_TEST_HANG_WORKER": "batching-worker-1",
    }
    score = [BATCHING, "score", "-c", str(path), "--db", sqlite_url, "--quiet", "--until-empty"]
    paused = subprocess.run(
        [*score, "--workers", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "has held the database's writer lock" in paused.stderr, paused.stderr[-3000:]
    assert "database is locked" not in paused.stderr
    assert paused.returncode == 1, "a worker was ended: the run says so"
    done_by_then = Counter(models.State(r.state).name for r in items(sqlite_url).values())
    assert done_by_then["DONE"] > 0

    def leases_over() -> bool | None:  # --until-empty does not wait for leased items
        held = [r.lease_expires_at for r in items(sqlite_url).values() if r.lease_expires_at]
        return all(t < time.time() for t in held) or None

    wait_for(leases_over, 30, "the ended worker's leases to expire")
    again = subprocess.run(score, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    rows = items(sqlite_url)
    assert Counter(models.State(r.state).name for r in rows.values()) == Counter(DONE=n)
    assert max(r.attempts for r in rows.values()) == 1, "the paused worker's items were charged"
