"""The full sweep of the outputs rolled forward from the outbox (a Delta table, a results table
in another database), on a real SQLite file and a real PostgreSQL queue."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from batching.evidence import reconcile as rc
from batching.evidence import reconcile_result
from batching.evidence import sweep as sw
from batching.evidence.reconcile import Kind, Severity
from batching.ingress import queue as q
from batching.outputs import outbox
from batching.store import schema
from batching.testing import FakeClock
from tests.integration.test_outbox_sinks import Output, commit_dying, output, sink
from tests.integration.test_sinks import claim, scored
from tests.integration.test_sweep import DAYS_3, HOURS_2, shape

__all__ = ["output", "sink"]  # fixtures, shared with test_outbox_sinks


def test_outbox_batches_lost_or_stuck_days_ago_are_found_by_the_sweep(
    queue: q.SqlQueue,
    sink: outbox.OutboxSink,
    output: Output,
    clock: FakeClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sink.commit(scored(claim(queue, ["a", "b"]), clock))
    clock.advance(1)
    stuck = scored(claim(queue, ["s1"]), clock)
    commit_dying(sink, stuck, monkeypatch, type(sink), "_write")  # waits in the outbox
    clock.advance(1)
    gone = scored(claim(queue, ["g1", "g2"]), clock)
    commit_dying(sink, gone, monkeypatch, type(sink), "_write")
    with queue.begin() as conn:  # its outbox row lost
        conn.execute(schema.outbox.delete().where(schema.outbox.c.batch_id == gone.batch_id))
    clock.advance(DAYS_3)
    assert rc.reconcile(queue, sink, now=clock(), since=clock() - HOURS_2).findings == ()
    whole = rc.reconcile(queue, sink, now=clock())
    report = sw.sweep(queue, sink, now=clock(), page_size=1)
    assert shape(report) == shape(whole)
    got = {(f.kind, f.severity, f.batch_ids) for f in report.findings}
    assert got == {
        (Kind.UNPUBLISHED, Severity.CRITICAL, (stuck.batch_id,)),
        (Kind.MISSING_FILE, Severity.CRITICAL, (gone.batch_id,)),
    }
    with queue.engine.connect() as conn:
        sweeps = schema.sweeps.c.name.not_like(f"{reconcile_result.PREFIX}%")  # not reconciles
        assert (
            conn.execute(
                sa.select(sa.func.count()).select_from(schema.sweeps).where(sweeps)
            ).scalar()
            == 1
        )
