"""Fair share across tenants in claims, on SQLite and PostgreSQL: a flood cannot starve
another tenant, weights hold, aging serves a tenant past its share, priorities hold within a
tenant (the arithmetic is tests/unit/test_tenant_share.py)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from batching import models
from batching.ingress import queue as q
from batching.store import database, schema
from batching.testing import FakeClock


def records(tenant: str, n: int, **kw: object) -> list[models.EnqueueRecord]:
    return [
        models.EnqueueRecord(f"{tenant}{i}", models.Payload(b"{}"), tenant=tenant, **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = database.create_engine(db_url)
    yield engine
    engine.dispose()


def drain_counts(queue: q.SqlQueue, n: int, claims: int) -> list[Counter[str]]:
    out = []
    for _ in range(claims):
        claim = queue.claim(n, lease_s=60)
        queue.ack(claim.lease_id, [i.id for i in claim.items])
        out.append(Counter(i.tenant for i in claim.items))
    return out


def test_a_flooding_tenant_cannot_starve_another(engine: sa.Engine, clock: FakeClock) -> None:
    queue = q.SqlQueue(engine, "fair", clock=clock)
    queue.enqueue(records("a", 10_000))
    clock.advance(1.0)
    queue.enqueue(records("b", 100))
    n = 20
    within = math.ceil(100 / (n / 2))  # b's share of each claim: half
    counts = drain_counts(queue, n, within)
    assert sum(c["b"] for c in counts) == 100
    assert all(c == Counter({"a": 10, "b": 10}) for c in counts)


def test_without_fair_share_the_flood_goes_first(engine: sa.Engine, clock: FakeClock) -> None:
    queue = q.SqlQueue(engine, "fifo", clock=clock, fair_share=False)
    queue.enqueue(records("a", 100))
    clock.advance(1.0)
    queue.enqueue(records("b", 10))
    assert [c["b"] for c in drain_counts(queue, 20, 6)] == [0, 0, 0, 0, 0, 10]


def test_weights_split_each_claim(engine: sa.Engine, clock: FakeClock) -> None:
    queue = q.SqlQueue(engine, "w", clock=clock, tenant_weights={"a": 2.0})
    queue.enqueue(records("a", 300) + records("b", 300) + records("c", 3))
    counts = drain_counts(queue, 30, 5)
    assert counts[0] == Counter({"a": 18, "b": 9, "c": 3})  # c's 3 < its share of 7.5
    assert counts[1:] == [Counter({"a": 20, "b": 10})] * 4
    one = drain_counts(queue, 1, 30)  # claims of one take turns, two of a for one of b
    assert sum(one, Counter[str]()) == Counter({"a": 20, "b": 10})


def test_aging_claims_an_item_past_its_share(engine: sa.Engine, clock: FakeClock) -> None:
    queue = q.SqlQueue(
        engine, "age", clock=clock, tenant_weights={"a": 1000.0}, max_tenant_wait_s=30.0
    )
    queue.enqueue(records("a", 2000) + records("b", 10))
    assert drain_counts(queue, 10, 1)[0]["b"] == 1  # both start together
    clock.advance(10.0)
    assert drain_counts(queue, 10, 1)[0]["b"] == 0  # b is 1000 of a's items ahead
    clock.advance(21.0)
    aged = queue.claim(10, lease_s=60)  # b not served for max_tenant_wait_s
    assert Counter(i.tenant for i in aged.items) == Counter({"a": 9, "b": 1})
    assert [i.item_key for i in aged.items if i.tenant == "b"] == ["b1"]


def test_priority_and_deadline_order_hold_within_a_tenant(
    engine: sa.Engine, clock: FakeClock
) -> None:
    queue = q.SqlQueue(engine, "prio", clock=clock)
    queue.enqueue(records("a", 10))
    queue.enqueue(
        [
            models.EnqueueRecord(f"hi{i}", models.Payload(b"{}"), tenant="a", priority=9)
            for i in range(3)
        ]
    )
    queue.enqueue(
        [models.EnqueueRecord("soon", models.Payload(b"{}"), tenant="a", deadline_at=clock() + 50)]
    )
    queue.enqueue(records("b", 10, priority=5))
    claim = queue.claim(10, lease_s=60)
    keys = [i.item_key for i in claim.items if i.tenant == "a"]
    assert keys == ["hi0", "hi1", "hi2", "soon", "a0"]  # a's share, in a's own order
    assert [i.item_key for i in claim.items if i.tenant == "b"] == [f"b{i}" for i in range(5)]


def test_lanes_and_cost_budgets_apply_to_the_fair_claim(
    engine: sa.Engine, clock: FakeClock
) -> None:
    queue = q.SqlQueue(engine, "lanes", clock=clock)
    queue.enqueue(
        records("a", 10, lane="x") + records("b", 10, lane="y") + records("c", 10, lane="x", cost=3)
    )
    claim = queue.claim(10, lease_s=60, lane="x", max_cost=12)
    got = Counter(i.tenant for i in claim.items)
    assert {i.lane for i in claim.items} == {"x"}
    assert sum(i.cost for i in claim.items) <= 12
    assert got["a"] >= 1
    assert got["c"] >= 1
    assert got["b"] == 0


def test_sqlite_fair_claim_reads_the_tenant_index(sqlite_url: str) -> None:
    engine = database.create_engine(sqlite_url)
    queue = q.SqlQueue(engine, "plan")
    params: dict[str, object] = {}
    sql = queue._fair_claim_sql(None, None, queue._fair.ranking(0.0), params).update  # type: ignore[union-attr]
    inner = sql[sql.index("WITH RECURSIVE") : -1]
    with engine.connect() as conn:
        plan = conn.execute(
            sa.text("EXPLAIN QUERY PLAN " + inner), {"queue": "q", "now": 0.0, "n": 8, **params}
        ).all()
    text = " ".join(str(r[-1]) for r in plan)
    assert "ix_batching_items_tenant_ready (queue=? AND tenant>?)" in text  # the skip scan
    assert "ix_batching_items_tenant_ready (queue=? AND tenant=?)" in text
    assert "SCAN batching_items" not in text
    assert "SCAN i " not in text
    engine.dispose()


def test_migration_14_indexes_a_populated_v13_database(engine: sa.Engine, clock: FakeClock) -> None:
    queue = q.SqlQueue(engine, "m14", clock=clock)
    queue.enqueue(records("a", 5) + records("b", 5))
    with engine.begin() as conn:  # rewind to version 13
        conn.execute(sa.text("DROP INDEX ix_batching_items_tenant_ready"))
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 14))
    result = queue.migrate()
    assert (result.from_version, result.to_version) == (13, schema.SCHEMA_VERSION)
    with engine.connect() as conn:
        names = {ix["name"] for ix in sa.inspect(conn).get_indexes("batching_items")}
    assert "ix_batching_items_tenant_ready" in names
    assert drain_counts(queue, 4, 1) == [Counter({"a": 2, "b": 2})]
