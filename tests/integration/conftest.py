"""Fixtures shared by the sink and reconcile tests: a queue on each database, a dataset root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batching import parquet
from batching import queue as q
from tests.conftest import FakeClock


@pytest.fixture
def queue(db_url: str, clock: FakeClock) -> Iterator[q.SqlQueue]:
    engine = q.create_engine(db_url)
    yield q.SqlQueue(engine, "sinks", clock=clock)
    engine.dispose()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "outputs"


@pytest.fixture
def sink(queue: q.SqlQueue, root: Path) -> parquet.ParquetSink:
    return parquet.ParquetSink(queue, root)
