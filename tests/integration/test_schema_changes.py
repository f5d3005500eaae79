"""A database migrated under a running release: its writes and its scorers stop, naming the
fix, instead of going on by the old schema's rules (an upgrade review: an older enqueue
waited out a migration on the table's lock and then wrote rows the new schema had to fill;
an older scorer went on claiming beside the new one's range leases, which lost 200 items of
work). Simulated by recording a migration past this release's, as a newer release would.
Real SQLite and PostgreSQL, a real scorer and torch model."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from batching import config as cfg
from batching import errors, models
from batching.compose import build
from batching.compose import run as wiring
from batching.ingress import ingest
from batching.loop.stats import RunLimits
from batching.store import database, schema
from tests.integration import test_rollout
from tests.integration.test_rollout import enqueue, make_config, states

ckpt = test_rollout.ckpt  # the rollout tests' empty checkpoint, a fixture
NEWER = schema.SCHEMA_VERSION + 1


def enqueue_only(url: str, config: cfg.PipelineConfig, key: str) -> None:
    """An enqueue alone, as a producer's (no migration first)."""
    queue = build.open_queue(config, url)
    record = {"item_key": key, "payload": {"x": [1.0, 2.0, 3.0, 4.0]}}
    try:
        queue.enqueue([ingest.record_from_mapping(record, key)])
    finally:
        queue.engine.dispose()


def record_newer(conn: sa.Connection) -> None:
    conn.execute(
        schema.schema_version.insert().values(
            version=NEWER, description="a later release's", applied_at=time.time()
        )
    )


def test_an_enqueue_into_a_database_a_newer_release_migrated_is_refused(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(db_url, config, ["before"])
    engine = database.create_engine(db_url)
    with engine.begin() as conn:
        record_newer(conn)
    engine.dispose()
    says = f"database schema is version {NEWER}, newer than this batching"
    with pytest.raises(errors.SchemaError, match=says):
        enqueue_only(db_url, config, "after")
    assert set(states(db_url)) == {"before"}


@pytest.mark.postgres
def test_an_enqueue_begun_during_a_migration_waits_for_it_then_is_refused(
    pg_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(pg_url, config, ["before"])
    migrating = database.create_engine(pg_url)
    outcome: list[BaseException | None] = []

    def late_enqueue() -> None:
        try:
            enqueue_only(pg_url, config, "during")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with migrating.begin() as conn:  # what a migration holds until it commits
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7271101)"))
        writer = threading.Thread(target=late_enqueue)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive()  # waits for the migration, not past it
        record_newer(conn)
    writer.join(30)
    migrating.dispose()
    (error,) = outcome
    assert isinstance(error, errors.SchemaError)
    assert set(states(pg_url)) == {"before"}


def test_a_running_scorer_stops_once_a_newer_release_migrates_its_database(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    config = config.model_copy(
        update={"queue": config.queue.model_copy(update={"heartbeat_s": 0.2})}
    )
    keys = [f"k{i}" for i in range(20)]
    enqueue(db_url, config, keys)
    outcome: list[BaseException | None] = []
    scored = threading.Event()

    def scorer() -> None:
        try:
            wiring.run_score(
                config,
                db_url=db_url,
                limits=RunLimits(until_empty=False, max_seconds=60),
                on_progress=lambda *_: scored.set(),
            )
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=scorer)
    thread.start()
    assert scored.wait(30)
    engine = build.open_queue(config, db_url).engine
    with engine.begin() as conn:
        record_newer(conn)
    engine.dispose()
    thread.join(30)
    assert not thread.is_alive()
    assert time.monotonic() - started < 30  # not its 60 s
    (error,) = outcome
    assert isinstance(error, errors.SchemaError)
    assert f"version {NEWER}, newer than this batching" in str(error)
    assert {states(db_url)[k] for k in keys} == {int(models.State.DONE)}


def test_a_running_bulk_in_place_run_stops_once_a_newer_release_migrates_its_database(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The shard scorer beats on its own thread: it must watch the schema as the scoring
    loop does (a review of the first version, which only the loop did)."""
    from batching.compose import inplace
    from tests.integration.test_inplace import config as inplace_config
    from tests.integration.test_inplace import migrate, write_dataset

    c = inplace_config(tmp_path, heartbeat_s=0.2)
    migrate(sqlite_url, c)
    write_dataset(tmp_path / "in", files=1, rows=1000, group=100)
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in", rows_per_shard=100)
    outcome: list[BaseException | None] = []
    scored = threading.Event()

    def scorer() -> None:
        try:
            wiring.run_score(
                c,
                db_url=sqlite_url,
                limits=RunLimits(until_empty=False, max_seconds=60),
                in_place=inplace.InPlace.of(found),
                on_progress=lambda *_: scored.set(),
            )
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=scorer)
    thread.start()
    assert scored.wait(30)
    engine = database.create_engine(sqlite_url)
    with engine.begin() as conn:
        record_newer(conn)
    engine.dispose()
    thread.join(30)
    assert not thread.is_alive()  # not its 60 s
    (error,) = outcome
    assert isinstance(error, errors.SchemaError)
