"""``batching init`` upgrades a database only once its scorers are stopped (an upgrade
review: it migrated under a scorer that had heartbeated seconds before, without a word);
``--while-running`` upgrades anyway. A real SQLite file, the real CLI."""

from __future__ import annotations

import time
from pathlib import Path

import sqlalchemy as sa

from batching.store import database, schema
from tests.e2e.test_cli import DB, batching, one_error_line


def at_version_17_with_a_live_run(folder: Path) -> None:
    assert batching("init", "--db", DB, cwd=folder).rc == 0
    engine = database.create_engine(f"sqlite:///{folder / 'queue.db'}")
    with engine.begin() as conn:  # as migration 18 finds a queue of version 17
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 18))
        schema.model_versions.drop(conn)
        conn.execute(
            schema.runs.insert().values(
                run_id="r-alive", flow="score", queue="online", state="running",
                started_at=time.time() - 60, heartbeat_at=time.time() - 5,  # within 10 min
            )
        )  # fmt: skip
    engine.dispose()


def test_init_refuses_to_upgrade_under_a_live_scorer_and_changes_nothing(tmp_path: Path) -> None:
    at_version_17_with_a_live_run(tmp_path)
    r = batching("init", "--db", DB, cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "1 scoring run(s) heartbeated in the last 10 min (queue 'online': run r-alive)" in line
    assert "stop the scorers, the API and producers before an upgrade" in line
    assert "(a scorer killed without its end counts for 59" in line  # 600 s after its beat
    assert "--while-running; nothing was changed" in line
    engine = database.create_engine(f"sqlite:///{tmp_path / 'queue.db'}")
    with engine.connect() as conn:
        assert schema.current_version(conn) == 17
        assert not sa.inspect(conn).has_table(schema.model_versions.name)
    engine.dispose()
    r = batching("init", "--db", DB, "--while-running", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert f"schema upgraded from version 17 to {schema.SCHEMA_VERSION}" in r.out


def test_init_of_a_current_database_ignores_live_runs(tmp_path: Path) -> None:
    at_version_17_with_a_live_run(tmp_path)
    assert batching("init", "--db", DB, "--while-running", cwd=tmp_path).rc == 0
    r = batching("init", "--db", DB, cwd=tmp_path)  # nothing to migrate: nothing to wait for
    assert r.rc == 0, r.err
    assert "nothing to do" in r.out
