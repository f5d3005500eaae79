"""On PostgreSQL the queue's verbs run as server-side prepared statements: psycopg 3 prepares
a statement on its sixth execution on a connection (``prepare_threshold`` 5) and every verb
renders the same SQL each time, so a scorer's claims and acks are parsed and planned once a
connection. Claims of 1 and 64 items with their acks went 1.2-1.3x the rows/s of the same
statements unprepared (``bench/queue_bench.py --unprepared``; docs/benchmarks.md), so a change
that loses it (SQL text that varies by call, a pool that drops connections) fails here."""

from __future__ import annotations

import contextlib

import pytest
import sqlalchemy as sa

from batching import models
from batching.ingress import queue as q
from batching.store import database
from batching.testing import FakeClock

pytestmark = pytest.mark.postgres


def test_claims_and_acks_run_prepared(pg_url: str) -> None:
    engine = database.create_engine(pg_url)
    try:
        queue = q.SqlQueue(engine, "prepared", clock=FakeClock())
        queue.enqueue(
            [models.EnqueueRecord(f"k{i}", models.Payload(b'{"x": [0.5]}')) for i in range(200)]
        )
        for _ in range(12):
            claim = queue.claim(5, lease_s=60)
            assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 5
        with contextlib.ExitStack() as stack:  # every pooled connection: each prepares its own
            conns = [stack.enter_context(engine.connect()) for _ in range(2)]
            prepared = [
                str(text)
                for conn in conns
                for text in conn.execute(
                    sa.text("SELECT statement FROM pg_prepared_statements")
                ).scalars()
            ]
    finally:
        engine.dispose()
    updates = [s for s in prepared if s.startswith("UPDATE batching_items SET state=")]
    assert any("finished_at" in s and "batch_id" in s for s in updates), prepared  # the ack
    assert any(s.startswith("SELECT string_agg(payload") for s in prepared), prepared  # claim
    assert any("FROM batching_queue_controls" in s for s in prepared), prepared  # claim
