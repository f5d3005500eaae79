"""An item that kills its scorer's process (not an exception: ``os._exit``, a segfault, a
SIGKILL) is found by isolation rounds and ends dead alone; every good item claimed with it
commits once, without an attempt charged for a batch-mate (``batching.crashes``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from batching import config as cfg
from batching import crashes, models
from batching.ingress import ingest
from batching.model import workloads, zoo
from tests.e2e.test_cli import BATCHING
from tests.integration.test_pipeline import dataset, enqueue, items, w1_records, write_config

N = 60
LEASE_S = 1.0
MAX_ATTEMPTS = 2
DIE_ON = Path(__file__).with_name("die_on.py")
KILLER = "w1-57"


def the_killer_died_alone(url: str, tmp_path: Path) -> Any:
    """KILLER's row, dead after its attempts; every other item committed once, uncharged."""
    rows = items(url)
    states = Counter(models.State(r.state).name for r in rows.values())
    assert states == Counter(DONE=N - 1, DEAD=1), states
    killer = rows[KILLER]
    assert killer.state == models.State.DEAD
    assert killer.attempts == MAX_ATTEMPTS
    good = [r for k, r in rows.items() if k != KILLER]
    assert max(r.attempts for r in good) == 1, "a good item was charged for its batch-mate"
    assert set(dataset(tmp_path / "outputs")) == set(rows) - {KILLER}
    return killer


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

    killer = the_killer_died_alone(sqlite_url, tmp_path)
    assert killer.last_error == crashes.KILLER
    assert 3 <= deaths <= 9


# The watchdog's tests: a pass is stopped 1 s in, and the lease (1.5 s) is ended by the
# watchdog, not left to run out; retries come back at once.
HANG_QUEUE = {
    "lease_s": 1.5,
    "forward_timeout_s": 1.0,
    "max_attempts": MAX_ATTEMPTS,
    "backoff_base_s": 0.01,
}


def hung_runs(score: list[str], cwd: Path, env: dict[str, str] | None = None) -> list[str]:
    """Run ``score`` until it exits 0 (at most 10 times): each run before stops with the
    watchdog's ForwardHung (exit 1, its one line); returns those runs' stderr."""
    hangs: list[str] = []
    for _ in range(10):
        proc = subprocess.run(
            score, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        if proc.returncode == 0:
            return hangs
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "past queue.forward_timeout_s (1 s)" in proc.stderr, proc.stderr[-2000:]
        hangs.append(proc.stderr)
    pytest.fail(f"still hanging after {len(hangs)} runs")


@pytest.mark.slow
def test_an_item_that_hangs_the_forward_pass_dies_alone_and_its_batch_mates_commit(
    sqlite_url: str, tmp_path: Path
) -> None:
    # The process lives and its heartbeats would keep the lease forever: the watchdog stops
    # the run past forward_timeout_s and ends the lease at once (no wait for it to run out).
    path = write_config(
        "tabular.yaml",
        tmp_path,
        batching={"max_batch_size": 8, "claim_size": 32, "max_wait_s": 0.01},
        queue=HANG_QUEUE,
    )
    config = cfg.load_config(path)
    records = [replace(r, max_attempts=MAX_ATTEMPTS) for r in w1_records(N, tmp_path)]
    enqueue(sqlite_url, config, records)
    score = [sys.executable, str(DIE_ON), KILLER, "hang", "--"]
    score += ["score", "-c", str(path), "--db", sqlite_url, "--quiet", "--until-empty"]
    hangs = hung_runs(score, tmp_path)  # a batch of <= 8: rounds of 4, 2, then 2 alone

    killer = the_killer_died_alone(sqlite_url, tmp_path)
    assert killer.last_error.startswith("forward pass hung on this item, scored alone")
    assert 3 <= len(hangs) <= 6, [h[-300:] for h in hangs]
    assert "isolation rounds to find which" in hangs[0]
    assert "so this item hung it: failed, an attempt charged" in hangs[-1]


@pytest.mark.slow
def test_a_hang_in_one_of_several_workers_dies_alone_and_the_run_ends(
    sqlite_url: str, tmp_path: Path
) -> None:
    """``score --workers 2``: the worker whose pass hangs stops past forward_timeout_s and its
    process ends, though its forward thread never returns (the run would otherwise wait for
    it for good); the other worker scores on. The hang is in the model (a factory), as
    spawned workers build it."""
    from tests.integration import hang_model

    shipped = zoo.BUILTINS["w1-mlp"]
    path = write_config(
        "tabular.yaml",
        tmp_path,
        model={
            "name": "tests.integration.hang_model:build",
            "checkpoint": str(shipped.checkpoint_path),
        },
        batching={"max_batch_size": 8, "claim_size": 16, "max_wait_s": 0.01},
        queue=HANG_QUEUE,
    )
    config = cfg.load_config(path)
    lines = [json.loads(line) for line in workloads.w1_json_lines(N)]
    lines[57]["payload"]["x"][0] = hang_model.HANG_AT  # KILLER's row
    source = workloads.write_lines(tmp_path / "w1.jsonl", (json.dumps(r) for r in lines))
    records = [replace(r, max_attempts=MAX_ATTEMPTS) for r in ingest.read_records(source)]
    enqueue(sqlite_url, config, records)
    score = [BATCHING, "score", "-c", str(path), "--db", sqlite_url, "--quiet", "--until-empty"]
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])}
    hangs = hung_runs([*score, "--workers", "2"], tmp_path, env)

    killer = the_killer_died_alone(sqlite_url, tmp_path)
    assert killer.last_error.startswith("forward pass hung on this item, scored alone")
    assert 3 <= len(hangs) <= 6, [h[-300:] for h in hangs]
