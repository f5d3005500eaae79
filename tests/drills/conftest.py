"""What every drill shares: a fresh database on the private cluster (:mod:`tests.pgcluster`)
with its own login role, a W1 queue in it, ``batching`` commands as an operator runs them, and
the one verdict every drill ends on (:func:`assert_nothing_lost`), and the metric signals a
drill checks: ``batching metrics serve``'s gauges read in-process (:meth:`Drill.gauge`) and a
run's textfile (:func:`textfile`, :func:`metric_sum`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from prometheus_client import Metric
from prometheus_client.parser import text_string_to_metric_families

from batching import config as cfg
from batching import models
from batching.ingress.queue import SqlQueue
from batching.metrics.exporter import TableCollector
from batching.store import database
from tests.integration.conftest import BATCHING
from tests.integration.test_pipeline import enqueue, items, w1_records, write_config
from tests.pgcluster import ADMIN_PASSWORD, Cluster

# Small batches: a run of a few thousand W1 items lasts a few seconds, long enough to be hit
# mid-way, short enough for CI.
SMALL_BATCHES = {"max_batch_size": 8, "claim_size": 32, "max_wait_s": 0.01}


@dataclass
class Drill:
    """One drill's world: its role and database on the private cluster, its folder, its config,
    and the ``batching score`` processes it started (killed if it leaves one running)."""

    cluster: Cluster
    role: str
    database: str
    folder: Path
    config_path: Path | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.cluster.url_for(self.database, self.role)

    @property
    def admin_url(self) -> str:
        """The same database as the superuser: what the drill reads whatever the role may do."""
        return self.cluster.url_for(self.database, "postgres", ADMIN_PASSWORD)

    @property
    def outputs(self) -> Path:
        return self.folder / "outputs"

    def queue(self, n: int, *, batching: dict[str, Any] | None = None, **sections: Any) -> Path:
        """``n`` W1 items enqueued, the shipped W1 config written with ``sections`` over it."""
        self.config_path = write_config(
            "tabular.yaml", self.folder, batching=batching or SMALL_BATCHES, **sections
        )
        enqueue(self.url, cfg.load_config(self.config_path), w1_records(n, self.folder))
        return self.config_path

    def _score_args(self, *args: str) -> list[str]:
        assert self.config_path is not None
        config = str(self.config_path)
        return ["score", "-c", config, "--db", self.url, "--quiet", "--until-empty", *args]

    def start_score(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``batching score -c CONFIG --db URL --quiet --until-empty ARGS``, a real process."""
        proc = subprocess.Popen(
            [BATCHING, *self._score_args(*args)],
            cwd=self.folder,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def batching(
        self, *args: str, env: dict[str, str] | None = None, timeout_s: float = 300
    ) -> Timed:
        """``batching ARGS`` to its end, with its time; a traceback fails the drill."""
        started = time.monotonic()
        done = subprocess.run(
            [BATCHING, *args],
            cwd=self.folder,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout_s,
            check=False,
        )
        assert "Traceback" not in done.stderr, done.stderr
        return Timed(done.returncode, done.stdout, done.stderr, time.monotonic() - started)

    def score(self, *args: str, env: dict[str, str] | None = None) -> Timed:
        """``batching score ... ARGS`` (as :meth:`start_score`) to its end."""
        return self.batching(*self._score_args(*args), env=env)

    def reconcile(self, *args: str, db: str | None = None) -> Timed:
        """``batching reconcile`` (as the drill's role, or on ``db``)."""
        assert self.config_path is not None
        url = db or self.url
        return self.batching("reconcile", "-c", str(self.config_path), "--db", url, *args)

    def states(self) -> Counter[str]:
        return Counter(models.State(r.state).name for r in items(self.admin_url).values())

    def gauge(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples with these labels, as ``batching metrics serve``
        would serve them now: its collector, in-process, on the database as the superuser
        (read whatever the role may do)."""
        assert self.config_path is not None
        config = cfg.load_config(self.config_path)
        queue = SqlQueue(database.create_engine(self.admin_url), config.queue.name)
        collector = TableCollector(config, queue)
        try:
            families = list(collector.collect())
        finally:
            collector.done.wait(30)  # its first done count: not left holding a connection
            queue.engine.dispose()
        return metric_sum(families, name, **labels)


def metric_sum(families: Iterable[Metric], name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``; a metric
    signal that is not there at all fails the drill (0 would pass for "no alert")."""
    found = [
        s.value
        for family in families
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert found, f"no {name} sample with {labels}"
    return float(sum(found))


def textfile(path: Path) -> list[Metric]:
    """The metric families of a node_exporter textfile (``metrics.textfile_path``)."""
    return list(text_string_to_metric_families(path.read_text()))


@dataclass(frozen=True)
class Timed:
    rc: int
    out: str
    err: str
    duration_s: float


def finish(proc: subprocess.Popen[str], timeout_s: float = 300) -> Timed:
    """Wait for a started process; its exit code, output and how long the wait took."""
    started = time.monotonic()
    out, err = proc.communicate(timeout=timeout_s)
    assert "Traceback" not in err, err
    return Timed(proc.returncode, out, err, time.monotonic() - started)


@dataclass(frozen=True)
class Verdict:
    items: int
    lost: int
    duplicated: int


def assert_nothing_lost(drill: Drill, n: int, root: Path | None = None) -> Verdict:
    """Every one of the ``n`` items is committed exactly once: done in the queue, one row in
    the Parquet dataset read back, pointing at the batch the queue names; and a full
    ``batching reconcile`` exits 0. Returns the figures the drill reports."""
    rows = items(drill.admin_url)
    table = ds.dataset(root or drill.outputs, format="parquet", partitioning="hive").to_table()
    keys = Counter(table["item_key"].to_pylist())
    duplicated = sum(c - 1 for c in keys.values() if c > 1)
    lost = sum(1 for key in rows if keys[key] == 0)
    assert len(rows) == n
    assert duplicated == 0, [k for k, c in keys.items() if c > 1][:5]
    assert lost == 0, [k for k in rows if keys[k] == 0][:5]
    assert Counter(models.State(r.state).name for r in rows.values()) == Counter(DONE=n)
    batch_of = dict(zip(table["item_key"].to_pylist(), table["batch_id"].to_pylist(), strict=True))
    assert all(batch_of[k] == r.batch_id for k, r in rows.items())
    clean = drill.reconcile()
    assert clean.rc == 0, clean.out + clean.err
    return Verdict(n, lost, duplicated)


def report(name: str, **figures: Any) -> None:
    """One line of figures on stdout (``pytest -s`` shows it; the drills' table in the docs
    comes from these)."""
    print(f"\ndrill={name} " + " ".join(f"{k}={v}" for k, v in figures.items()))


@pytest.fixture
def drill(pg_cluster: Cluster, tmp_path: Path) -> Iterator[Drill]:
    """A fresh database owned by a fresh login role on the private cluster."""
    role = pg_cluster.role()
    database = pg_cluster.database(owner=role)
    d = Drill(pg_cluster, role, database, tmp_path)
    yield d
    for proc in d.procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    pg_cluster.sql(f"ALTER ROLE {role} LOGIN")
    pg_cluster.sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    pg_cluster.sql(f"DROP ROLE IF EXISTS {role}")
