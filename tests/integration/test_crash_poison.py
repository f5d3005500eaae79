"""An item that kills its scorer's process (not an exception: ``os._exit``, a segfault, a
SIGKILL) is found by isolation rounds and ends dead alone; every good item claimed with it
commits once, without an attempt charged for a batch-mate (``batching.crashes``)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from batching import config as cfg
from batching import crashes, models
from tests.integration.test_pipeline import dataset, enqueue, items, w1_records, write_config

N = 60
LEASE_S = 1.0
MAX_ATTEMPTS = 2
DIE_ON = Path(__file__).with_name("die_on.py")
KILLER = "w1-57"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "segv", "kill"])
def test_an_item_that_kills_its_scorer_dies_alone_and_its_batch_mates_commit(
    how: str, sqlite_url: str, tmp_path: Path
) -> None:
    path = write_config(
        "tabular.yaml",
        tmp_path,
        batching={"max_batch_size": 8, "claim_size": 32, "max_wait_s": 0.01},
        queue={"lease_s": LEASE_S, "max_attempts": MAX_ATTEMPTS},
    )
    config = cfg.load_config(path)
    records = [replace(r, max_attempts=MAX_ATTEMPTS) for r in w1_records(N, tmp_path)]
    enqueue(sqlite_url, config, records)
    score = [sys.executable, str(DIE_ON), KILLER, how, "--"]
    score += ["score", "-c", str(path), "--db", sqlite_url, "--quiet", "--until-empty"]
    deaths = 0
    for _ in range(12):  # a claim of 32: rounds of 16, 8, 4, 2, then 2 deaths alone
        proc = subprocess.run(
            score, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
        )
        if proc.returncode == 0:
            break
        deaths += 1
        assert proc.returncode in (3, -11, -9), proc.stderr[-2000:]
        time.sleep(LEASE_S + 0.2)  # the lease runs out; the next run's claim reaps it
    else:
        pytest.fail(f"still dying after {deaths} runs")

    rows = items(sqlite_url)
    states = Counter(models.State(r.state).name for r in rows.values())
    assert states == Counter(DONE=N - 1, DEAD=1), states
    killer = rows[KILLER]
    assert killer.state == models.State.DEAD
    assert killer.last_error == crashes.KILLER
    assert killer.attempts == MAX_ATTEMPTS
    good = [r for k, r in rows.items() if k != KILLER]
    assert max(r.attempts for r in good) == 1, "a good item was charged for its batch-mate"
    assert set(dataset(tmp_path / "outputs")) == set(rows) - {KILLER}
    assert 3 <= deaths <= 9
