"""Two `batching score` processes writing one Delta table (or one results table in another
database), each SIGKILLed for real between the queue's commit and the output's: a restart
and reconcile leave every item exactly once, read back with ``deltalake`` and DuckDB."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from batching import config as cfg
from tests.integration.conftest import BATCHING
from tests.integration.outputs_read import delta_rows, duckdb_delta_rows, sql_rows
from tests.integration.test_pipeline import SLOW, enqueue, items, w1_records, write_config

N = 2000
KEYS = {f"w1-{i}" for i in range(N)}
KILL_AT = Path(__file__).with_name("kill_at.py")
LEASE_S = 2.0


def output_settings(kind: str, tmp_path: Path) -> dict[str, Any]:
    if kind == "delta":
        return {"kind": "delta"}  # at tmp_path / "outputs" (write_config)
    return {"kind": "sql", "table": "results", "url": f"sqlite:///{tmp_path / 'warehouse.db'}"}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def rows_by_key(kind: str, tmp_path: Path) -> Counter[str]:
    if kind == "delta":
        uri = str(tmp_path / "outputs")
        keys = Counter(r["item_key"] for r in delta_rows(uri))
        assert keys == Counter(k for k, _ in duckdb_delta_rows(uri)), "the readers disagree"
        return keys
    return Counter(
        r["item_key"] for r in sql_rows(f"sqlite:///{tmp_path / 'warehouse.db'}", "results")
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["delta", "warehouse"])
def test_two_scorers_killed_between_the_queue_commit_and_the_output_lose_nothing(
    kind: str, sqlite_url: str, tmp_path: Path
) -> None:
    path = write_config(
        "tabular.yaml",
        tmp_path,
        batching=SLOW | {"claim_size": 64},
        queue={"lease_s": LEASE_S},
        output=output_settings(kind, tmp_path),
    )
    config = cfg.load_config(path)
    enqueue(sqlite_url, config, w1_records(N, tmp_path))
    score = ["score", "-c", str(path), "--db", sqlite_url, "--quiet"]
    # Two scorers at once on one output: one dies before its 3rd batch reaches the output,
    # the other after its 5th did, before the ledger heard of it.
    procs = [
        subprocess.Popen(
            [sys.executable, str(KILL_AT), point, nth, "--", *score],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for point, nth in (("before-write", "3"), ("after-write", "5"))
    ]
    for proc in procs:
        proc.communicate(timeout=300)
        assert proc.returncode == -9, "the scorer was not killed where it should have been"
    states = Counter(i.state for i in items(sqlite_url).values())
    assert states[2] < N, "nothing was left for the restart: the kills came too late"

    time.sleep(LEASE_S + 0.3)  # their leases run out; the restart's claims reap them
    restart = run([BATCHING, *score, "--until-empty"], tmp_path)
    assert restart.returncode == 0, restart.stderr
    repaired = run(
        [BATCHING, "reconcile", "-c", str(path), "--db", sqlite_url, "--repair"], tmp_path
    )
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    clean = run([BATCHING, "reconcile", "-c", str(path), "--db", sqlite_url], tmp_path)
    assert clean.returncode == 0, clean.stdout
    assert "clean" in clean.stdout

    done = items(sqlite_url)
    assert set(done) == KEYS
    assert {i.state for i in done.values()} == {2}
    assert rows_by_key(kind, tmp_path) == Counter(KEYS)
