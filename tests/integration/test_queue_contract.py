"""Queue contract, SQL side: migrations, transactions, plans and claim read-backs, on a real
SQLite file and a real PostgreSQL database (the verbs every queue keeps, the in-memory twin
included, are test_queue_verbs.py)."""

from __future__ import annotations

import contextlib
import json
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import errors, models, routing
from batching.ingress import pg_bulk, run_ledger
from batching.ingress import queue as q
from batching.store import database, schema
from batching.testing import FakeClock


def rec(key: str, **kw: object) -> models.EnqueueRecord:
    return models.EnqueueRecord(item_key=key, payload=models.Payload(b'{"x":[1]}'), **kw)  # type: ignore[arg-type]


@pytest.fixture
def queue(db_url: str, clock: FakeClock) -> Iterator[q.SqlQueue]:
    engine = database.create_engine(db_url)
    yield q.SqlQueue(engine, "contract", clock=clock, rng=random.Random(7))
    engine.dispose()


def row(queue: q.SqlQueue, key: str) -> sa.Row[object]:
    with queue.engine.connect() as conn:
        return conn.execute(sa.select(schema.items).where(schema.items.c.item_key == key)).one()


def rewind(queue: q.SqlQueue, version: int, *statements: str) -> None:
    """Run ``statements`` and forget migrations from ``version`` on: the database as before."""
    with queue.engine.begin() as conn:
        for sql in statements:
            conn.execute(sa.text(sql))
        conn.execute(
            schema.schema_version.delete().where(schema.schema_version.c.version >= version)
        )


def index_names(queue: q.SqlQueue) -> set[str]:
    with queue.engine.connect() as conn:
        return {str(ix["name"]) for ix in sa.inspect(conn).get_indexes("batching_items")}


def test_migrate_twice_is_a_noop_and_recorded(queue: q.SqlQueue) -> None:
    result = queue.migrate()
    assert not result.applied
    assert result.to_version == schema.SCHEMA_VERSION
    with queue.engine.connect() as conn:
        assert schema.current_version(conn) == schema.SCHEMA_VERSION


def test_migration_2_moves_a_v1_database_to_the_queue_led_expiry_index(
    queue: q.SqlQueue,
) -> None:
    rewind(  # to what version 1 created
        queue,
        2,
        "DROP INDEX ix_batching_items_expiry",
        "CREATE INDEX ix_batching_items_ready_deadline ON batching_items (deadline_at)"
        " WHERE state = 0 AND deadline_at IS NOT NULL",
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (1, schema.SCHEMA_VERSION)
    names = index_names(queue)
    assert "ix_batching_items_expiry" in names
    assert "ix_batching_items_ready_deadline" not in names


def test_migration_3_moves_inline_payloads_to_their_table_and_claims_still_read_them(
    queue: q.SqlQueue,
) -> None:
    queue.enqueue([rec("a"), rec("b")])
    with queue.engine.begin() as conn:  # rewind to version 2: payloads inline in the item row
        blob = "BYTEA" if queue.dialect == "postgresql" else "BLOB"
        conn.execute(sa.text(f"ALTER TABLE batching_items ADD COLUMN payload {blob}"))
        conn.execute(
            sa.text(
                "UPDATE batching_items SET payload = (SELECT p.payload FROM batching_payloads p"
                " WHERE p.id = batching_items.id)"
            )
        )
        conn.execute(sa.text("DROP TABLE batching_payloads"))
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 3))
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (2, schema.SCHEMA_VERSION)
    with queue.engine.connect() as conn:
        columns = {c["name"] for c in sa.inspect(conn).get_columns("batching_items")}
    assert "payload" not in columns
    claim = queue.claim(5, lease_s=30)
    assert sorted((i.item_key, i.payload.data) for i in claim.items) == [
        ("a", b'{"x":[1]}'),
        ("b", b'{"x":[1]}'),
    ]


def test_purge_deletes_payloads_and_archive_keeps_them(queue: q.SqlQueue, clock: FakeClock) -> None:
    queue.enqueue([rec("a"), rec("b")])
    claim = queue.claim(5, lease_s=30)
    queue.ack(claim.lease_id, [i.id for i in claim.items])
    clock.advance(100)
    assert queue.purge(10, archive=True) == 2
    with queue.engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(schema.payloads)).scalar()
        archived = conn.execute(
            sa.select(schema.items_archive.c.item_key, schema.items_archive.c.payload)
        ).all()
    assert left == 0
    assert sorted(archived) == [("a", b'{"x":[1]}'), ("b", b'{"x":[1]}')]


def test_purge_works_through_many_chunks(
    queue: q.SqlQueue, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(q, "_PURGE_CHUNK", 2)
    queue.enqueue([rec(k) for k in "abcde"])
    claim = queue.claim(5, lease_s=30)
    queue.ack(claim.lease_id, [i.id for i in claim.items])
    clock.advance(100)
    assert queue.purge(10, archive=True) == 5
    with queue.engine.connect() as conn:
        archived = conn.execute(sa.select(schema.items_archive.c.item_key)).scalars().all()
        payloads = conn.execute(sa.select(sa.func.count()).select_from(schema.payloads)).scalar()
    assert sorted(archived) == list("abcde")
    assert payloads == 0
    assert queue.stats().by_state["done"] == 0


def test_an_item_requeued_while_purge_runs_keeps_its_payload(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    """PostgreSQL: reconcile requeued a done item between purge's payload and item deletes;
    the item came back ready without its payload (dead at its next claim)."""
    if queue.dialect != "postgresql":
        pytest.skip("SQLite's purge holds the only write lock: nothing runs between its steps")
    queue.enqueue([rec("a")])
    claim = queue.claim(1, lease_s=30)
    queue.ack(claim.lease_id, [claim.items[0].id])
    clock.advance(100)
    requeue = threading.Thread(target=_requeue_in_own_transaction, args=(queue.engine, "a"))

    def requeue_once(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.startswith("DELETE FROM batching_items") and requeue.ident is None:
            requeue.start()
            requeue.join(timeout=1)  # the rows locked, it waits for the purge to commit

    sa.event.listen(queue.engine, "before_cursor_execute", requeue_once)
    try:
        queue.purge(10)
    finally:
        sa.event.remove(queue.engine, "before_cursor_execute", requeue_once)
    requeue.join(timeout=30)
    with queue.engine.connect() as conn:
        left = conn.execute(
            sa.select(schema.items.c.state, schema.payloads.c.id).outerjoin(
                schema.payloads, schema.payloads.c.id == schema.items.c.id
            )
        ).all()
    assert all(payload is not None for _state, payload in left), left


def _requeue_in_own_transaction(engine: sa.Engine, key: str) -> None:
    with engine.begin() as conn:  # another pooled connection: its own transaction
        conn.execute(
            schema.items.update()
            .where(schema.items.c.item_key == key, schema.items.c.state == 2)
            .values(state=0)
        )


def test_an_item_whose_payload_row_is_gone_is_dead_lettered_and_the_rest_claimed(
    queue: q.SqlQueue,
) -> None:
    queue.enqueue([rec("a"), rec("b"), rec("c")])
    gone = row(queue, "b").id
    with queue.engine.begin() as conn:
        conn.execute(schema.payloads.delete().where(schema.payloads.c.id == gone))
    claim = queue.claim(5, lease_s=30)
    assert sorted(i.item_key for i in claim.items) == ["a", "c"]
    lost = row(queue, "b")
    assert (lost.state, lost.last_error) == (
        models.State.DEAD,
        "payload missing from batching_payloads",
    )


def test_a_claim_returns_every_field_exactly_as_enqueued(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    clock.now = 1_796_091_256.6041782  # sub-microsecond digits: floats must round-trip exactly
    tensor = models.PayloadFormat.TENSOR
    records = [
        models.EnqueueRecord(
            item_key="nul",
            payload=models.Payload(b"\x00\x01\x00\xff", tensor, "uint8", (4,)),
            deadline_at=clock.now + 100.123456789012,
            priority=3,
            cost=7,
            tenant="t1",
            lane="fast",
            max_attempts=2,
        ),
        models.EnqueueRecord(item_key="empty", payload=models.Payload(b"")),
        models.EnqueueRecord(
            item_key="big",
            payload=models.Payload(bytes(range(256)) * 300, tensor, "int8", (76800,)),
        ),
        models.EnqueueRecord(item_key="json", payload=models.Payload('{"x":["é"]}'.encode())),
    ]
    queue.enqueue(records)
    clock.advance(1)
    claim = queue.claim(10, lease_s=30)
    got = {i.item_key: i for i in claim.items}
    assert [i.item_key for i in claim.items] == ["nul", "empty", "big", "json"]  # claim order
    for r in records:
        item = got[r.item_key]
        assert item.payload == r.payload
        assert (item.tenant, item.priority, item.cost, item.deadline_at, item.lane) == (
            r.tenant,
            r.priority,
            r.cost,
            r.deadline_at,
            r.lane,
        )
        assert item.enqueued_at == 1_796_091_256.6041782
        assert (item.queue, item.attempts) == ("contract", 1)
        assert item.id == row(queue, r.item_key).id
    assert (got["nul"].max_attempts, got["empty"].max_attempts) == (2, queue.max_attempts)


@pytest.mark.parametrize("columns", [False, True])
def test_times_that_differ_within_a_claim_come_back_exactly(
    queue: q.SqlQueue, clock: FakeClock, columns: bool
) -> None:
    # Floats SQLite's own text (quote(), JSON: 15 digits) does not give back.
    times = [279_351_518.97043097, 1_796_091_256.6041782, 1_796_091_256.6041784]
    deadline = 1_796_099_999.1234567
    for i, at in enumerate(times):
        clock.now = at
        queue.enqueue([tensor_rec(f"t{i}", i, deadline_at=deadline if i == 2 else None)])
    clock.now = 1_796_091_300.0
    claim = queue.claim(10, lease_s=30, columns=columns)
    got = {i.item_key: (i.enqueued_at, i.deadline_at) for i in claim.items}
    assert got == {"t0": (times[0], None), "t1": (times[1], None), "t2": (times[2], deadline)}


def tensor_rec(key: str, value: int, **kw: Any) -> models.EnqueueRecord:
    data = bytes([value]) * 4
    payload = models.Payload(data, models.PayloadFormat.TENSOR, kw.pop("dtype", "uint8"), (4,))
    return models.EnqueueRecord(item_key=key, payload=payload, cost=4, **kw)


@pytest.mark.parametrize(
    ("odd_one", "block"),
    [
        (None, True),
        ({"deadline_at": 1_800_000_100.0}, False),
        ({"dtype": "int8"}, False),
        ({"priority": 2}, False),
        ({"tenant": "t2"}, False),
    ],
)
def test_a_columns_claim_of_uniform_items_is_one_block_of_the_same_items_in_claim_order(
    queue: q.SqlQueue, clock: FakeClock, odd_one: dict[str, Any] | None, block: bool
) -> None:
    # Enqueued in three rounds, the last one earlier on the clock: claim order is by
    # enqueued_at, not id, and the block must follow it (its bytes too).
    records = [tensor_rec(f"k{i}", i) for i in range(6)]
    for start, at in ((0, 10.0), (2, 30.0), (4, 20.0)):
        clock.now = 1_800_000_000.0 + at
        queue.enqueue(records[start : start + 2])
    if odd_one is not None:
        queue.enqueue([tensor_rec("odd", 99, **odd_one)])
    clock.now = 1_800_000_040.0  # all ready
    twin = q.SqlQueue(queue.engine, "contract", clock=clock)
    claim = queue.claim(10, lease_s=30, columns=True)
    assert isinstance(claim.items, models.ItemBlock) == block  # SQLite and PostgreSQL alike
    keys = [i.item_key for i in claim.items]
    want = ["k0", "k1", "k4", "k5", "k2", "k3"]
    assert [k for k in keys if k != "odd"] == want
    for item in claim.items:
        if item.item_key != "odd":
            assert item.payload.data == bytes([int(item.item_key[1:])]) * 4
            assert (item.cost, item.attempts, item.queue) == (4, 1, "contract")
    # the same claim made item by item on a second queue of the same items gives equal items
    twin.release(claim.lease_id)
    again = twin.claim(10, lease_s=30)
    assert [i._replace(attempts=1) for i in again.items] == list(claim.items)


def test_a_sqlite_claim_that_fails_after_its_update_gives_the_items_back(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    if queue.dialect != "sqlite":
        pytest.skip("PostgreSQL claims in one transaction")
    queue.enqueue([rec("a"), rec("b")])

    @contextlib.contextmanager
    def broken_read() -> Iterator[object]:
        raise errors.QueueError("database failed: disk I/O error")
        yield  # pragma: no cover

    with monkeypatch.context() as m:
        m.setattr(queue, "read", broken_read)
        with pytest.raises(errors.QueueError, match="disk I/O error"):
            queue.claim(5, lease_s=30)
    for key in ("a", "b"):
        r = row(queue, key)
        assert (r.state, r.attempts, r.lease_id) == (models.State.READY, 0, None)
    assert sorted(i.item_key for i in queue.claim(5, lease_s=30).items) == ["a", "b"]


def test_a_sqlite_claim_whose_bodies_exceed_the_longest_blob_reads_them_row_by_row(
    tmp_path: Path,
) -> None:
    """SQLite caps a string or blob (1 GB by default; 5,000 bytes here): bodies that add up to
    more cannot come back concatenated, so the claim reads them one by one."""
    engine = database.create_engine(f"sqlite:///{tmp_path / 'q.db'}")

    @sa.event.listens_for(engine, "connect")
    def _small_limit(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 5000)

    queue = q.SqlQueue(engine, "big")
    queue.migrate()
    bodies = {f"k{i}": bytes([i]) * (1500 + i) for i in range(4)}
    queue.enqueue([models.EnqueueRecord(k, models.Payload(v)) for k, v in bodies.items()])
    claim = queue.claim(10, lease_s=30)
    assert {i.item_key: i.payload.data for i in claim.items} == bodies
    engine.dispose()


def test_a_postgres_claim_whose_bodies_exceed_one_value_reads_them_row_by_row(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL refuses a value past 1 GB (pg_bulk.CONCAT_MAX_BYTES: 5,000 bytes here):
    bodies that add up to more come back a row each, uniform or not, and an item whose body
    row is gone is still dead-lettered alone."""
    if queue.dialect != "postgresql":
        pytest.skip("SQLite's limit: the test above")
    monkeypatch.setattr(pg_bulk, "CONCAT_MAX_BYTES", 5000)

    def tensors(keys: range) -> dict[str, bytes]:
        bodies = {f"k{i}": bytes([i]) * 1500 for i in keys}
        tensor = models.PayloadFormat.TENSOR
        queue.enqueue(
            [
                models.EnqueueRecord(k, models.Payload(v, tensor, "uint8", (1500,)))
                for k, v in bodies.items()
            ]
        )
        return bodies

    uniform = tensors(range(5))  # 7,500 bytes: over the limit
    claim = queue.claim(10, lease_s=30, columns=True)
    assert not isinstance(claim.items, models.ItemBlock)  # under the limit: one block
    assert {i.item_key: i.payload.data for i in claim.items} == uniform
    more = tensors(range(5, 9))
    with queue.engine.begin() as conn:
        conn.execute(schema.payloads.delete().where(schema.payloads.c.id == row(queue, "k8").id))
    claim = queue.claim(10, lease_s=30)
    assert {i.item_key: i.payload.data for i in claim.items} == {
        k: v for k, v in more.items() if k != "k8"
    }
    assert row(queue, "k8").state == models.State.DEAD


def test_purge_archive_keeps_working_when_sqlite_hands_out_a_purged_id_again(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    for key in ("a", "b"):  # on SQLite "b" gets "a"'s id back once "a" is purged
        queue.enqueue([rec(key)])
        claim = queue.claim(1, lease_s=30)
        queue.ack(claim.lease_id, [i.id for i in claim.items])
        clock.advance(100)
        assert queue.purge(10, archive=True) == 1
    with queue.engine.connect() as conn:
        keys = conn.execute(sa.select(schema.items_archive.c.item_key)).scalars().all()
    assert sorted(keys) == ["a", "b"]


def test_migration_4_gives_archive_rows_their_own_key_and_keeps_them(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([rec("a")])
    claim = queue.claim(1, lease_s=30)
    queue.ack(claim.lease_id, [i.id for i in claim.items])
    clock.advance(100)
    queue.purge(10, archive=True)
    with queue.engine.begin() as conn:  # rewind to version 3: the archive keyed by item id
        rows = [dict(r._mapping) for r in conn.execute(sa.select(schema.items_archive))]
        conn.execute(sa.text("DROP TABLE batching_items_archive"))
        v3 = sa.Table(  # the item row, payload inline, keyed by id
            "batching_items_archive",
            sa.MetaData(),
            *schema._item_columns(archive=False),
            sa.Column("payload", sa.LargeBinary, nullable=False),
        )
        v3.create(conn)
        conn.execute(v3.insert(), [{k: v for k, v in r.items() if k != "archive_id"} for r in rows])
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 4))
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (3, schema.SCHEMA_VERSION)
    with queue.engine.connect() as conn:
        got = conn.execute(
            sa.select(schema.items_archive.c.archive_id, schema.items_archive.c.item_key)
        ).all()
    assert [key for _, key in got] == ["a"]
    assert got[0][0] is not None


def test_migration_5_drops_the_lease_id_index_and_heartbeat_still_finds_the_lease(
    queue: q.SqlQueue,
) -> None:
    queue.enqueue([rec("a"), rec("b")])
    claim = queue.claim(5, lease_s=30)
    rewind(  # to version 4: leased rows indexed twice
        queue,
        5,
        "CREATE INDEX ix_batching_items_lease_id ON batching_items (lease_id) WHERE state = 1",
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (4, schema.SCHEMA_VERSION)
    assert "ix_batching_items_lease_id" not in index_names(queue)
    assert queue.heartbeat(claim.lease_id, 60) == 2
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 2


def test_migration_6_gives_runs_a_parent_and_keeps_the_runs_there(queue: q.SqlQueue) -> None:
    rewind(  # to version 5: runs without a parent
        queue,
        6,
        "DROP INDEX ix_batching_runs_parent",
        "ALTER TABLE batching_runs DROP COLUMN parent_run_id",
        "INSERT INTO batching_runs (run_id, flow, queue, state, started_at, n_items, n_failed,"
        " n_batches) VALUES ('old', 'score', 'q', 'completed', 1.0, 0, 0, 0)",
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (5, schema.SCHEMA_VERSION)
    run_ledger.RunLedger(queue).start("child", "score.worker-0", parent_run_id="old")
    with queue.engine.connect() as conn:
        rows = dict(
            conn.execute(sa.select(schema.runs.c.run_id, schema.runs.c.parent_run_id)).all()
        )
        indexes = {str(ix["name"]) for ix in sa.inspect(conn).get_indexes("batching_runs")}
    assert rows == {"old": None, "child": "old"}
    assert "ix_batching_runs_parent" in indexes


def test_migration_7_indexes_leased_rows_by_queue_then_expiry(queue: q.SqlQueue) -> None:
    rewind(  # to version 6: leased rows indexed by expiry alone
        queue,
        7,
        "DROP INDEX ix_batching_items_leased",
        "CREATE INDEX ix_batching_items_lease_exp ON batching_items (lease_expires_at)"
        " WHERE state = 1",
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (6, schema.SCHEMA_VERSION)
    names = index_names(queue)
    assert "ix_batching_items_leased" in names
    assert "ix_batching_items_lease_exp" not in names


def test_a_claims_reap_reads_its_queues_leased_rows_not_the_queue(queue: q.SqlQueue) -> None:
    """Every claim reaps first, under SQLite's write lock: it must not scan the queue."""
    if queue.dialect != "sqlite":
        pytest.skip("the plan checked is SQLite's (no ANALYZE statistics, as in production)")
    queue.enqueue([rec(f"k{i}") for i in range(50)])
    seen: list[tuple[str, Any]] = []

    def keep(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "lease_expires_at <" in statement and statement.lstrip().startswith("SELECT"):
            seen.append((statement, params))

    sa.event.listen(queue.engine, "before_cursor_execute", keep)
    try:
        queue.claim(5, lease_s=30)
    finally:
        sa.event.remove(queue.engine, "before_cursor_execute", keep)
    assert seen  # the claim looked for lapsed leases (before any reaping, which found none)
    for statement, params in seen:
        with queue.engine.connect() as conn:
            plan = " ".join(
                str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params)
            )
        assert "ix_batching_items_leased" in plan, plan
        assert "TEMP B-TREE" not in plan, plan


def test_migration_8_gives_runs_a_heartbeat_and_leaves_old_runs_alone(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    rewind(  # to version 7: runs without a heartbeat, one of them running
        queue,
        8,
        "ALTER TABLE batching_runs DROP COLUMN heartbeat_at",
        "INSERT INTO batching_runs (run_id, flow, queue, state, started_at, n_items, n_failed,"
        " n_batches) VALUES ('old', 'score', 'contract', 'running', 1.0, 0, 0, 0)",
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (7, schema.SCHEMA_VERSION)
    clock.advance(10_000)
    assert run_ledger.RunLedger(queue).close_abandoned(60) == []  # it never beat: not judged


def test_migration_9_keys_sql_results_by_queue_and_keeps_their_rows(queue: q.SqlQueue) -> None:
    blob = "BYTEA" if queue.dialect == "postgresql" else "BLOB"
    rewind(  # to version 8: results keyed by model version and item key
        queue,
        9,
        "DROP TABLE batching_results",
        "CREATE TABLE batching_results (model_version VARCHAR(100), item_key VARCHAR(500),"
        f" queue VARCHAR(200) NOT NULL, output {blob} NOT NULL, output_dim INTEGER NOT NULL,"
        " scored_at FLOAT NOT NULL, run_id VARCHAR(64) NOT NULL, batch_id VARCHAR(36) NOT NULL,"
        " PRIMARY KEY (model_version, item_key))",
        "INSERT INTO batching_results VALUES ('v1', 'k', 'contract', '', 0, 1.0, 'r', 'b')",
        "CREATE VIEW results_seen AS SELECT item_key FROM batching_results",  # a reader's view
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (8, schema.SCHEMA_VERSION)
    with queue.engine.connect() as conn:
        key = sa.inspect(conn).get_pk_constraint("batching_results")["constrained_columns"]
        rows = conn.execute(sa.select(schema.results.c.queue, schema.results.c.item_key)).all()
        seen = conn.execute(sa.text("SELECT item_key FROM results_seen")).scalars().all()
    assert set(key) == set(schema.RESULTS_KEY)
    assert [tuple(r) for r in rows] == [("contract", "k")]
    assert seen == ["k"]  # the view still reads the table
    assert queue.migrate().applied is False


def test_a_run_whose_heartbeat_stopped_is_closed_as_abandoned(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    runs, other = (
        run_ledger.RunLedger(queue),
        run_ledger.RunLedger(q.SqlQueue(queue.engine, "other", clock=clock)),
    )
    runs.start("dead", "score")
    runs.start("alive", "score")
    runs.start("done", "score")
    runs.finish("done", "completed", {})
    other.start("elsewhere", "score")
    add_batch(queue, clock, "b1", "dead", 17)  # committed before it died, never reported
    clock.advance(100)
    runs.beat("alive")
    clock.advance(30)
    (closed,) = runs.close_abandoned(120)  # "dead" last beat 130 s ago, "alive" 30 s ago
    assert run_row(queue, "dead")[2] == 17, "its rows are counted from the batch ledger"
    assert (closed.run_id, closed.flow, closed.parent_run_id) == ("dead", "score", None)
    assert closed.error.startswith("abandoned: no heartbeat since ")
    with queue.engine.connect() as conn:
        c = schema.runs.c
        states = dict(conn.execute(sa.select(c.run_id, c.state)).all())
    assert states == {
        "dead": "failed",
        "alive": "running",
        "done": "completed",
        "elsewhere": "running",
    }
    assert runs.close_abandoned(120) == []
    clock.advance(1000)  # "alive" is silent too now, but it is the run starting (a retry)
    assert runs.close_abandoned(120, but="alive") == []


def test_enqueue_reports_progress_after_each_chunk(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(q, "_ENQUEUE_CHUNK", 2)
    monkeypatch.setattr(pg_bulk, "CHUNK", 2)
    seen: list[int] = []
    result = queue.enqueue(
        [rec("a"), rec("b"), rec("a"), rec("c"), rec("d"), rec("e")], seen.append
    )
    assert (result.inserted, result.duplicates) == (5, ("a",))
    assert seen == [2, 4, 5]


def test_an_enqueue_in_chunks_keeps_every_field_and_skips_keys_already_queued(
    queue: q.SqlQueue, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of 100: on PostgreSQL each goes by COPY through the staging table, and a chunk
    # of fewer than pg_bulk.STAGE_MIN rows (the first enqueue, the last chunk) by unnest.
    monkeypatch.setattr(q, "_ENQUEUE_CHUNK", 100)
    monkeypatch.setattr(pg_bulk, "CHUNK", 100)
    assert queue.enqueue([rec(f"k{i}") for i in range(0, 300, 6)]).inserted == 50

    def tensor(i: int) -> models.EnqueueRecord:
        body = bytes([i % 256]) * 8 + b"\x00\xff"
        payload = models.Payload(body, models.PayloadFormat.TENSOR, "uint8", (2, 5))
        deadline = clock() + 10.0 + i / 7 if i % 3 else None
        return models.EnqueueRecord(
            f"k{i}", payload, tenant=f"t{i % 4}", priority=i % 2, deadline_at=deadline, cost=i
        )

    records = [tensor(i) for i in range(300)] + [tensor(7)]  # a repeat in the same call
    result = queue.enqueue(records, enqueue_run="run-1")
    assert result.inserted == 250
    assert set(result.duplicates) == {f"k{i}" for i in range(0, 300, 6)} | {"k7"}
    for i in (1, 2, 99, 100, 101, 299):
        r = row(queue, f"k{i}")
        want = tensor(i)
        assert (r.tenant, r.priority, r.cost, r.enqueue_run) == (f"t{i % 4}", i % 2, i, "run-1")
        assert (r.payload_format, r.dtype, json.loads(r.shape)) == ("tensor", "uint8", [2, 5])
        assert r.deadline_at == want.deadline_at  # exact, not rounded through text
        assert r.sort_deadline == (want.deadline_at or schema.NO_DEADLINE)
        assert r.route_bucket == routing.bucket(f"k{i}")
        assert r.state == models.State.READY
        assert r.enqueued_at == clock()
    claim = queue.claim(300, lease_s=30)
    assert len(claim.items) == 300
    by_key = {i.item_key: i for i in claim.items}
    assert by_key["k299"].payload.data == tensor(299).payload.data
    assert by_key["k6"].payload.data == b'{"x":[1]}'  # queued first, kept


def test_an_enqueue_that_fails_midway_leaves_nothing_and_the_next_one_works(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(q, "_ENQUEUE_CHUNK", 100)
    monkeypatch.setattr(pg_bulk, "CHUNK", 100)

    def records() -> Iterator[models.EnqueueRecord]:
        for i in range(250):
            yield rec(f"a{i}")
        raise ValueError("the input broke")

    with pytest.raises(ValueError, match="the input broke"):
        queue.enqueue(records())
    assert queue.stats().by_state.get("ready", 0) == 0
    # The same pooled connection: its staging table holds no rows of the failed enqueue.
    assert queue.enqueue([rec(f"b{i}") for i in range(150)]).inserted == 150
    assert queue.stats().by_state["ready"] == 150
    assert {i.item_key for i in queue.claim(200, lease_s=30).items} == {f"b{i}" for i in range(150)}


def test_ack_all_or_raise_rolls_back_with_caller(queue: q.SqlQueue) -> None:
    queue.enqueue([rec("a"), rec("b")])
    claim = queue.claim(2, lease_s=30)
    ids = [i.id for i in claim.items]
    with pytest.raises(errors.LeaseLost), queue.begin() as conn:
        queue.ack_all_or_raise(conn, claim.lease_id, [*ids, 10_000], "batch-1")
    assert row(queue, "a").state == models.State.LEASED
    with queue.begin() as conn:
        queue.ack_all_or_raise(conn, claim.lease_id, ids, "batch-2")
    assert row(queue, "b").batch_id == "batch-2"


def test_schema_check_refuses_uninitialised_db(tmp_path: object) -> None:
    engine = database.create_engine(f"sqlite:///{tmp_path}/empty.db")
    with pytest.raises(errors.SchemaError, match="batching init"):
        q.SqlQueue(engine).check_schema()
    engine.dispose()


def test_unreachable_database_is_a_queue_error_without_password() -> None:
    engine = database.create_engine("postgresql://u:sekret@127.0.0.1:9/none?connect_timeout=2")
    with pytest.raises(errors.QueueError) as info:
        q.SqlQueue(engine).check_schema()
    assert "sekret" not in str(info.value)
    assert "***" in str(info.value)


def test_sqlite_claim_uses_ready_index(sqlite_url: str) -> None:
    engine = database.create_engine(sqlite_url)
    sql = q.SqlQueue(engine)._claim_sql(None, None).update
    inner = sql[sql.index("SELECT id, cost") : sql.index("LIMIT :n")]
    with engine.connect() as conn:
        plan = conn.execute(
            sa.text("EXPLAIN QUERY PLAN " + inner), {"queue": "q", "now": 0.0}
        ).all()
    text = " ".join(str(r[-1]) for r in plan)
    assert "ix_batching_items_ready" in text
    assert "TEMP B-TREE" not in text
    engine.dispose()


@pytest.mark.postgres
def test_notify_wakes_a_waiting_scorer(pg_url: str) -> None:
    engine = database.create_engine(pg_url)
    waiter = q.Waiter(engine, "wake")
    assert waiter.wait(0.05) is False
    timer = threading.Timer(0.2, lambda: q.SqlQueue(engine, "wake").enqueue([rec("n")]))
    started = time.monotonic()
    timer.start()
    assert waiter.wait(10) is True
    assert time.monotonic() - started < 5
    timer.join()
    waiter.close()
    engine.dispose()


def test_payload_shape_is_stored_as_json(queue: q.SqlQueue) -> None:
    queue.enqueue(
        [
            models.EnqueueRecord(
                "s", models.Payload(b"\x00" * 8, models.PayloadFormat.TENSOR, "int64", (1,))
            )
        ]
    )
    assert json.loads(row(queue, "s").shape) == [1]


def test_a_run_started_again_is_resumed_with_what_it_and_its_workers_committed(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    """A Prefect task retry reuses the run id: before, its row was deleted and inserted
    again, and the first attempt's rows fell out of the run's counts."""
    runs = run_ledger.RunLedger(queue)
    assert runs.start("run", "score") is None
    runs.start("worker", "score.worker-0", parent_run_id="run")
    for batch, run_id, n in (("b1", "run", 30), ("b2", "worker", 12), ("b3", "other", 99)):
        add_batch(queue, clock, batch, run_id, n)
    runs.finish("run", "failed", {"items_committed": 20, "items_failed": 2}, error="disk gone")
    started = clock()
    clock.advance(50)

    so_far = runs.start("run", "score", resume=True)  # the retry

    assert so_far == models.RunSoFar(started, 42, 2)  # 30 + 12: more than it reported
    for _ in range(2):  # finishing twice (a dead worker closed again) counts once
        runs.finish("run", "completed", {"items_committed": 8, "items_failed": 1, "batches": 1})
    assert run_row(queue, "run") == ("completed", started, 50, 3, None)

    assert runs.start("run", "score") is None  # not a retry: the row starts again
    assert run_row(queue, "run") == ("running", started + 50, 0, 0, None)


def run_row(queue: q.SqlQueue, run_id: str) -> tuple[Any, ...]:
    with queue.engine.connect() as conn:
        c = schema.runs.c
        columns = (c.state, c.started_at, c.n_items, c.n_failed, c.error)
        return tuple(conn.execute(sa.select(*columns).where(c.run_id == run_id)).one())


def add_batch(queue: q.SqlQueue, clock: FakeClock, batch_id: str, run_id: str, n: int) -> None:
    """A published batch of ``n`` rows committed by ``run_id``, in the ledger alone."""
    with queue.begin() as conn:
        conn.execute(
            schema.batches.insert().values(
                batch_id=batch_id, run_id=run_id, queue=queue.queue, lease_id="l",
                model_version="v1", sink="parquet", n_rows=n, state="published",
                committed_at=clock(),
            )
        )  # fmt: skip


def test_migration_12_adds_the_lineage_spool_and_sweep_cursors(queue: q.SqlQueue) -> None:
    rewind(
        queue,
        12,
        "DROP TABLE batching_lineage_spool",
        "DROP TABLE batching_sweeps",
        "ALTER TABLE batching_runs DROP COLUMN reconciled_at",
    )
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (11, schema.SCHEMA_VERSION)
    with queue.engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
        runs = {c["name"] for c in sa.inspect(conn).get_columns("batching_runs")}
    assert {"batching_lineage_spool", "batching_sweeps"} <= tables
    assert "reconciled_at" in runs
    assert queue.migrate().applied is False


def test_migration_20_gives_the_database_an_id_that_stays(queue: q.SqlQueue) -> None:
    """The id an output records as its owner comes from when the database was made: kept by
    every later ``migrate``, and the same again when a backup from before 20 is restored and
    upgraded once more (the documented roll-back; a random id locked the database out of
    its own dataset, found by a review). Other databases: test_output_refusals."""
    with queue.engine.connect() as conn:
        made = schema.database_id(conn)
        first = conn.execute(
            sa.select(schema.schema_version.c.applied_at).where(
                schema.schema_version.c.version == 1
            )
        ).scalar()
    rewind(queue, 20, "DROP TABLE batching_meta")  # the backup from before 20
    assert queue.migrate().to_version == schema.SCHEMA_VERSION
    with queue.engine.connect() as conn:
        assert schema.database_id(conn) == made
    assert queue.migrate().applied is False
    with queue.engine.begin() as conn:  # another database: made at another time
        conn.execute(
            sa.update(schema.schema_version)
            .where(schema.schema_version.c.version == 1)
            .values(applied_at=float(first or 0) + 1e-6)
        )
    rewind(queue, 20, "DROP TABLE batching_meta")
    queue.migrate()
    with queue.engine.connect() as conn:
        assert schema.database_id(conn) != made
    assert len(made) == 36


@pytest.mark.parametrize("columns", [False, True], ids=["item-lease", "range-lease"])
def test_a_claim_with_nothing_to_do_takes_no_write_lock_and_skips_nothing(
    queue: q.SqlQueue, clock: FakeClock, columns: bool
) -> None:
    """Below capacity a scorer claims after every batch and on every change to the database:
    a claim that finds nothing to do reads, and neither waits for nor holds SQLite's write
    lock. Once there is something (a lease lapsed), the claim does it."""
    queue.enqueue([rec("a"), rec("b")])
    first = queue.claim(5, lease_s=30, columns=columns)  # short of 5: the next one looks first
    assert len(first) == 2
    got: list[models.Claim] = []
    if queue.dialect == "sqlite":
        with queue.begin():  # a writer holds the lock
            t = threading.Thread(target=lambda: got.append(queue.claim(5, lease_s=30)))
            t.start()
            t.join(timeout=30)
            assert not t.is_alive(), "an empty claim waited for the write lock"
    else:
        got.append(queue.claim(5, lease_s=30))
    assert len(got[0]) == 0
    assert not got[0].paused
    clock.advance(31)  # the first claim's lease lapses: reaped by the next claim
    again = queue.claim(5, lease_s=30)
    assert len(again) == 0
    assert again.suspects
    by_state = queue.stats().by_state
    assert (by_state["ready"], by_state["leased"]) == (2, 0)


def test_a_claim_still_expires_an_item_past_its_deadline_with_nothing_else_ready(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([rec("late", deadline_at=clock() + 5)])
    clock.advance(10)
    claim = queue.claim(5, lease_s=30)
    assert len(claim) == 0
    assert claim.expired == (("default", 1),)
    assert queue.stats().by_state["expired"] == 1


def test_acks_of_an_item_lease_in_any_shape_are_fenced_and_stamped(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([rec(f"k{i}") for i in range(6)])
    claim = queue.claim(6, lease_s=30)  # per-item leases
    ids = [i.id for i in claim.items]
    assert queue.ack("another-lease", ids) == 0  # a stale lease writes nothing
    assert queue.ack(claim.lease_id, [ids[4], ids[0]], batch_id="b1") == 2  # not one run
    clock.advance(1)
    assert queue.ack(claim.lease_id, [ids[2], ids[1], ids[3]], batch_id="b2") == 3  # one run
    assert queue.ack(claim.lease_id, [ids[1], ids[5]], batch_id="b3") == 1  # one acked already
    with queue.read() as conn:
        got = {
            r.id: (r.state, r.batch_id, r.finished_at, r.lease_id, r.attempts)
            for r in conn.execute(sa.select(schema.items).where(schema.items.c.id.in_(ids)))
        }
    t0 = clock() - 1
    assert got == {
        ids[0]: (2, "b1", t0, None, 1),
        ids[4]: (2, "b1", t0, None, 1),
        ids[1]: (2, "b2", t0 + 1, None, 1),
        ids[2]: (2, "b2", t0 + 1, None, 1),
        ids[3]: (2, "b2", t0 + 1, None, 1),
        ids[5]: (2, "b3", t0 + 1, None, 1),
    }
