"""Reconcile's query plans on PostgreSQL tables that were never analyzed.

Without statistics PostgreSQL took tables of 100k rows for a few rows and picked plans that
are quadratic at that size: reconcile with the SQL sink ran for over 22 minutes (2.5 s after
``ANALYZE``). These tests take the SQL a real reconcile sends and check the shape of each
plan (``EXPLAIN``, not a timing), on tables loaded the way commits leave them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from batching.evidence import reconcile as rc
from batching.ingress import queue as q
from batching.outputs import sql as sql_sink
from batching.store import database

pytestmark = pytest.mark.postgres

N_ITEMS = 10_000
BATCH = 64
_TABLES = ("batching_items", "batching_batches", "batching_results")


def load_done_items(url: str, n: int = N_ITEMS) -> None:
    """``n`` items done through the SQL sink in batches of ``BATCH`` (run ``run-1``): the
    rows a commit writes (item acked with its batch, ledger row ``published``, result row),
    inserted in bulk; the tables are never analyzed (autovacuum off for them)."""
    with psycopg.connect(url, autocommit=True) as c:
        for table in _TABLES:
            c.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        c.execute(
            "INSERT INTO batching_items (queue, item_key, state, enqueued_at, run_after,"
            " sort_deadline, finished_at, batch_id)"
            " SELECT 'default', 'k' || g, 2, 1000, 1000, 1e18, 2000 + g, 'b' || (g / %s)"
            " FROM generate_series(0, %s - 1) g",
            (BATCH, n),
        )
        c.execute(
            "INSERT INTO batching_batches (batch_id, run_id, queue, lease_id, model_version,"
            " sink, path, n_rows, state, committed_at, published_at)"
            " SELECT 'b' || b, 'run-1', 'default', 'l' || b, 'm1', 'sql', 'batching_results',"
            " %s, 'published', 2000 + b * %s, 2000 + b * %s"
            " FROM generate_series(0, (%s - 1) / %s) b",
            (BATCH, BATCH, BATCH, n, BATCH),
        )
        c.execute(
            "INSERT INTO batching_results (queue, model_version, item_key, output, output_dim,"
            " scored_at, run_id, batch_id)"
            " SELECT 'default', 'm1', 'k' || g, '\\x0000803f'::bytea, 1, 2000, 'run-1',"
            " 'b' || (g / %s) FROM generate_series(0, %s - 1) g",
            (BATCH, n),
        )
        never = c.execute(
            "SELECT count(*) FROM pg_class WHERE relname = ANY(%s) AND reltuples < 0",
            (list(_TABLES),),
        ).fetchone()
        assert never == (len(_TABLES),)


@pytest.fixture
def queue(pg_url: str) -> Iterator[q.SqlQueue]:
    load_done_items(pg_url)
    engine = database.create_engine(pg_url)
    yield q.SqlQueue(engine)
    engine.dispose()


def reconcile_sql(queue: q.SqlQueue, **kw: Any) -> list[tuple[str, Any]]:
    """The SELECTs of a real reconcile with the SQL sink (which must find nothing wrong)."""
    sent: list[tuple[str, Any]] = []

    def keep(_c: Any, _cur: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            sent.append((statement, params))

    sa.event.listen(queue.engine, "before_cursor_execute", keep)
    try:
        report = rc.reconcile(queue, sql_sink.SqlSink(queue, create=False), now=5e9, **kw)
    finally:
        sa.event.remove(queue.engine, "before_cursor_execute", keep)
    assert report.findings == (), report.to_dict()
    return sent


def plans(queue: q.SqlQueue, sent: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each statement with the plan PostgreSQL makes for it (EXPLAIN, FORMAT JSON)."""
    with queue.engine.connect() as conn:
        for statement, params in sent:
            raw = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, params).scalar()
            doc: Any = json.loads(raw) if isinstance(raw, str) else raw
            yield statement, doc[0]["Plan"]


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def conditions(plan: dict[str, Any]) -> str:
    """Every index, recheck and hash condition in a plan's subtree."""
    keys = ("Index Cond", "Recheck Cond", "Hash Cond", "Merge Cond")
    return " ".join(str(n.get(k, "")) for n in nodes(plan) for k in keys)


def test_the_sql_sinks_key_lookups_probe_the_key_without_statistics(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: each chunk of 500 keys read the whole ``(queue, model_version)`` range of the
    results table's key, the keys a filter on every row (Index Cond on queue and
    model_version, Filter on item_key): 9.7 s for 20k items, over 22 minutes for 100k. Each
    key must be an index condition, whatever the (missing) statistics say."""
    monkeypatch.setattr(rc, "fresh_statistics", lambda _q: [], raising=False)  # plans alone
    lookups = 0
    for statement, plan in plans(queue, reconcile_sql(queue)):
        for node in nodes(plan):
            if node.get("Relation Name") != "batching_results":
                continue
            lookups += 1
            assert "item_key" in node.get("Index Cond", ""), (statement[:200], plan)
            assert "item_key" not in node.get("Filter", ""), (statement[:200], plan)
    assert lookups


def test_a_runs_reconcile_joins_without_rescanning_a_table_per_row(queue: q.SqlQueue) -> None:
    """Before: ``--run`` joined the run's done items to its batches by a nested loop whose
    inner side (the run's batches, by ``run_id``) was read again for every item, the join a
    filter (0.75 s a query for 20k items, 16 s a reconcile for 100k). Reconcile analyzes
    tables that have no statistics, and no nested loop then joins on ``batch_id`` without
    looking the inner side up by it."""
    sent = reconcile_sql(queue, run_id="run-1")
    for statement, plan in plans(queue, sent):
        for node in nodes(plan):
            if node["Node Type"] != "Nested Loop" or "batch_id" not in node.get("Join Filter", ""):
                continue
            inner = node["Plans"][1]
            assert "batch_id" in conditions(inner), (statement[:200], plan)
    with queue.engine.connect() as conn:
        never = conn.execute(
            sa.text("SELECT relname FROM pg_class WHERE relname = ANY(:t) AND reltuples < 0"),
            {"t": ["batching_items", "batching_batches"]},
        ).all()
    assert never == []


def test_statistics_are_refreshed_only_when_missing_or_stale(queue: q.SqlQueue) -> None:
    assert sorted(rc.fresh_statistics(queue)) == ["batching_batches", "batching_items"]
    assert rc.fresh_statistics(queue) == []
