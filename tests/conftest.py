"""Shared fixtures and helpers: a fake clock, ``wait_for``, and the database fixtures used by
integration tests."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import time
import types
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest

from batching.testing import FakeClock
from tests.pgcluster import pg_cluster  # noqa: F401  (a private cluster, one per session)

REPO = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get(
    "BATCHING_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
IN_CI = bool(os.environ.get("CI"))
T = TypeVar("T")

# Tests choose where lineage goes: a developer's exported OPENLINEAGE_URL (as the README's
# Marquez set-up has) would send their events to Marquez, and the CLI and flows read it.
for _name in [k for k in os.environ if k.upper().startswith("OPENLINEAGE")]:
    del os.environ[_name]
# pytest-xdist's workers export COLUMNS=80 and LINES=24: the CLI would lay piped tables out in
# 80 columns there and in 240 in a plain run. Tests see what a pipe sees.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


class KeptRecords(logging.Handler):
    """A log handler that keeps what it is given, for a test to look at."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def wait_for(probe: Callable[[], T | None], timeout_s: float = 30.0, what: str = "it") -> T:
    """Poll ``probe`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _pg_url(dbname: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{dbname}"


def _pg_reachable() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3):
            return None
    except Exception as exc:  # any failure means "not reachable"; reported as the skip reason
        return f"PostgreSQL not reachable at {PG_ADMIN_URL}: {str(exc).splitlines()[0]}"


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """Name of a migrated template database; each test copies it (CREATE DATABASE ... TEMPLATE)."""
    reason = _pg_reachable()
    if reason:
        if IN_CI:
            pytest.fail(f"{reason} (CI needs PostgreSQL)")
        pytest.skip(reason)
    import psycopg

    from batching.ingress import queue as q
    from batching.store import database

    name = f"batching_tpl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    engine = database.create_engine(_pg_url(name))
    q.SqlQueue(engine).migrate()
    engine.dispose()
    yield name
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """URL of a fresh, migrated PostgreSQL database for one test."""
    import psycopg

    name = f"batching_t_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    yield _pg_url(name)
    # A connection this test left open warns when the collector finds it: here, charged to
    # this test, not to whichever test of the worker happens to run when it is collected.
    gc.collect()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """URL of a fresh, migrated SQLite file for one test."""
    from batching.ingress import queue as q
    from batching.store import database

    url = f"sqlite:///{tmp_path / 'queue.db'}"
    engine = database.create_engine(url)
    q.SqlQueue(engine).migrate()
    engine.dispose()
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """Every queue contract test runs on both databases."""
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[..., object]]:
    """Start a real Prometheus: ``prometheus(targets, rule_files=(), interval_s=1.0)`` with
    ``targets`` a job -> ``host:port`` list; returns a ``tests.prometheus.Prometheus``. Every
    one started is stopped at the end of the test (see tests/prometheus.py)."""
    import contextlib

    from tests import prometheus as prom

    with contextlib.ExitStack() as stack:
        n = iter(range(1000))

        def start(targets: object, rule_files: object = (), interval_s: float = 1.0) -> object:
            folder = tmp_path / f"prometheus-{next(n)}"
            return stack.enter_context(
                prom.running_prometheus(folder, targets, rule_files, interval_s)  # type: ignore[arg-type]
            )

        yield start


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 32 KiB tmpfs (root only: skipped elsewhere): a few small Parquet files fill it."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(volume)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield volume
    subprocess.run(["umount", "-l", str(volume)], check=False)


class LineageBackend(BaseHTTPRequestHandler):
    """A lineage backend that records the events POSTed to it: subclass it with a
    ``received`` list (``type("B", (LineageBackend,), {"received": []})``) and serve it."""

    received: ClassVar[list[dict[str, Any]]]

    def do_POST(self) -> None:
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def as_held(conn: Any, rows: list[Any]) -> list[Any]:
    """Item rows as their leases hold them: an item a range lease holds stays ready in the
    table (``batching_ranges``) and is shown leased, with the claim's attempt counted and the
    range's lease id and expiry, as a per-item lease would have written it."""
    import sqlalchemy as sa

    from batching import models
    from batching.store import schema

    r = schema.ranges
    held = list(
        conn.execute(sa.select(r.c.lo, r.c.hi, r.c.lease_id, r.c.leased_by, r.c.lease_expires_at))
    )
    if not held:
        return rows
    out = []
    for row in rows:
        lease = next((h for h in held if h.lo <= row.id <= h.hi), None)
        if lease is not None and row.state == models.State.READY:
            row = types.SimpleNamespace(
                **row._asdict(),
            )
            row.state, row.attempts = int(models.State.LEASED), row.attempts + 1
            row.lease_id, row.leased_by = lease.lease_id, lease.leased_by
            row.lease_expires_at = lease.lease_expires_at
        out.append(row)
    return out
