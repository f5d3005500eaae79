"""A scorer whose PostgreSQL connections are terminated under it (``pg_terminate_backend``,
as a failover or an administrator does) reconnects with backoff and finishes the run; its
leases stay fenced, so nothing is committed twice. On the private cluster
(:mod:`tests.pgcluster`), where terminating every backend of a database disturbs no other test."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from batching import config as cfg
from batching import models
from tests.integration.conftest import BATCHING
from tests.integration.test_pipeline import (
    SLOW,
    dataset,
    enqueue,
    items,
    w1_records,
    wait_for_done,
    write_config,
)
from tests.pgcluster import Cluster

N = 3000


@pytest.mark.slow
@pytest.mark.postgres
def test_a_scorer_reconnects_after_its_backends_are_terminated(
    pg_cluster: Cluster, tmp_path: Path
) -> None:
    database = pg_cluster.database()
    pg_url = pg_cluster.url_for(database)
    path = write_config("tabular.yaml", tmp_path, batching=SLOW, queue={"lease_s": 10})
    enqueue(pg_url, cfg.load_config(path), w1_records(N, tmp_path))
    proc = subprocess.Popen(
        [BATCHING, "score", "-c", str(path), "--db", pg_url, "--quiet", "--until-empty"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    terminated = 0
    for at_least in range(300, 2700, 300):
        wait_for_done(pg_url, at_least, proc)
        terminated += pg_cluster.terminate(database=database)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert terminated >= 8, "no connection was terminated: nothing tested"
    assert "reconnect" in err
    assert Counter(models.State(r.state).name for r in items(pg_url).values()) == Counter(DONE=N)
    assert len(dataset(tmp_path / "outputs")) == N
    reconciled = subprocess.run(
        [BATCHING, "reconcile", "-c", str(path), "--db", pg_url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert reconciled.returncode == 0, reconciled.stdout
