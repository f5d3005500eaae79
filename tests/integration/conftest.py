"""Fixtures shared by the integration tests: a queue on each database, a dataset root, a
`batching score` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batching.ingress import queue as q
from batching.outputs import parquet
from batching.store import database
from batching.testing import FakeClock


@pytest.fixture
def queue(db_url: str, clock: FakeClock) -> Iterator[q.SqlQueue]:
    engine = database.create_engine(db_url)
    yield q.SqlQueue(engine, "sinks", clock=clock)
    engine.dispose()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


@pytest.fixture
def sink(queue: q.SqlQueue, root: Path) -> parquet.ParquetSink:
    return parquet.ParquetSink(queue, root)


BATCHING = str(Path(sys.executable).with_name("batching"))
ScoreProcess = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture
def score_process(sqlite_url: str, tmp_path: Path) -> Iterator[ScoreProcess]:
    """Starts `batching score -c CONFIG [ARGS]` on ``sqlite_url`` as a real process (its own
    process group); kills the group if a test leaves it running."""
    procs: list[subprocess.Popen[str]] = []

    def start(config_path: Path, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [BATCHING, "score", "-c", str(config_path), "--db", sqlite_url, "--quiet", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            start_new_session=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
