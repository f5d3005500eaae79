"""Range leases on a real SQLite file and a real PostgreSQL database: a claim whose items are
one run of ids is leased by one ``batching_ranges`` row, with no write to the item rows; every
other verb keeps the rules of a per-item lease (``test_queue_verbs.py`` runs its whole
contract on range leases too)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import sqlalchemy as sa

from batching import models
from batching.ingress import controls
from batching.ingress import queue as q
from batching.store import database, schema
from batching.testing import FakeClock

T, R = schema.items, schema.ranges


def tensor(key: str, **kw: Any) -> models.EnqueueRecord:
    body = np.full(4, 0.5, dtype=np.float32).tobytes()
    payload = models.Payload(body, models.PayloadFormat.TENSOR, "float32", (4,))
    return models.EnqueueRecord(key, payload, **kw)


@pytest.fixture
def queue(db_url: str, clock: FakeClock) -> Iterator[q.SqlQueue]:
    engine = database.create_engine(db_url)
    queue = q.SqlQueue(engine, "ranges", clock=clock, rng=random.Random(3))
    queue.migrate()
    yield queue
    engine.dispose()


def ranges(queue: q.SqlQueue) -> list[Any]:
    with queue.engine.connect() as conn:
        return list(conn.execute(sa.select(R).where(R.c.queue == queue.queue).order_by(R.c.lo)))


def rows(queue: q.SqlQueue) -> dict[str, Any]:
    with queue.engine.connect() as conn:
        got = conn.execute(sa.select(T).where(T.c.queue == queue.queue)).all()
    return {r.item_key: r for r in got}


def test_a_run_of_ids_is_one_range_and_its_rows_are_written_once_at_ack(
    queue: q.SqlQueue,
) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(10)])
    claim = queue.claim(8, lease_s=30, columns=True)
    assert isinstance(claim.items, models.ItemBlock)
    assert [i.item_key for i in claim.items] == [f"k{i}" for i in range(8)]
    assert {i.attempts for i in claim.items} == {1}
    (held,) = ranges(queue)
    ids = [i.id for i in claim.items]
    assert (held.lo, held.hi, held.remaining, held.lease_id) == (
        ids[0],
        ids[-1],
        8,
        claim.lease_id,
    )
    before = rows(queue)
    assert {(r.state, r.attempts, r.lease_id) for r in before.values()} == {(0, 0, None)}
    stats = queue.stats()
    assert (stats.by_state["leased"], stats.by_state["ready"]) == (8, 2)
    # Another claim leaves the range alone and takes the rest.
    other = queue.claim(8, lease_s=30, columns=True)
    assert [i.item_key for i in other.items] == ["k8", "k9"]
    # Acks by batch: the range counts down, then goes.
    assert queue.ack(claim.lease_id, ids[:5], batch_id="b1") == 5
    assert ranges(queue)[0].remaining == 3
    assert queue.ack(claim.lease_id, ids[5:], batch_id="b2") == 3
    assert [r.lease_id for r in ranges(queue)] == [other.lease_id]
    after = rows(queue)
    assert {(after[f"k{i}"].state, after[f"k{i}"].attempts) for i in range(8)} == {(2, 1)}
    assert after["k0"].batch_id == "b1"
    assert after["k7"].batch_id == "b2"
    assert queue.ack(claim.lease_id, ids) == 0  # once


def test_claims_that_are_not_one_run_lease_item_by_item(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(6)])
    middle = [r.id for r in rows(queue).values() if r.item_key == "k2"]
    queue.enqueue([tensor("soon", deadline_at=clock() + 100)])
    with queue.engine.begin() as conn:  # a hole in the run: k2 taken by hand
        conn.execute(sa.update(T).where(T.c.id.in_(middle)).values(state=2))
    claim = queue.claim(5, lease_s=30, columns=True)
    assert [i.item_key for i in claim.items] == ["soon", "k0", "k1", "k3", "k4"]
    assert ranges(queue) == []
    assert {r.state for k, r in rows(queue).items() if k != "k2" and k != "k5"} == {1}
    # One item alone, a suspects' round, a cost budget: never a range.
    assert len(queue.claim(1, lease_s=30, columns=True).items) == 1
    assert ranges(queue) == []


def test_fail_and_expire_turn_the_range_into_item_leases_first(queue: q.SqlQueue) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(6)])
    claim = queue.claim(6, lease_s=30, columns=True)
    ids = [i.id for i in claim.items]
    assert len(ranges(queue)) == 1
    assert queue.fail(claim.lease_id, {ids[0]: "bad row"}) == models.FailResult(1, 0)
    assert ranges(queue) == []
    got = rows(queue)
    assert (got["k0"].state, got["k0"].attempts, got["k0"].last_error) == (0, 1, "bad row")
    assert {(got[f"k{i}"].state, got[f"k{i}"].lease_id) for i in range(1, 6)} == {
        (1, claim.lease_id)
    }
    assert queue.expire(claim.lease_id, {ids[1]: "late"}) == 1
    assert queue.heartbeat(claim.lease_id, 30) == 4
    assert queue.ack(claim.lease_id, ids[2:]) == 4
    got = rows(queue)
    assert [got[f"k{i}"].state for i in range(6)] == [0, 4, 2, 2, 2, 2]
    assert {got[f"k{i}"].attempts for i in range(2, 6)} == {1}


def test_release_gives_the_range_back_without_an_attempt(queue: q.SqlQueue) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(6)])
    claim = queue.claim(6, lease_s=30, columns=True)
    ids = [i.id for i in claim.items]
    assert queue.release(claim.lease_id, ids[:2]) == 2  # a part: the rest stays held
    assert ranges(queue) == []
    assert queue.stats().by_state["leased"] == 4
    again = queue.claim(6, lease_s=30, columns=True)
    assert [i.item_key for i in again.items] == ["k0", "k1"]
    assert queue.release(again.lease_id) == 2  # the whole range: its row goes, nothing else
    assert queue.release(claim.lease_id) == 4
    assert {(r.state, r.attempts) for r in rows(queue).values()} == {(0, 0)}
    assert ranges(queue) == []


def test_an_expired_range_is_reaped_by_the_crash_rule(queue: q.SqlQueue, clock: FakeClock) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(8)])
    claim = queue.claim(8, lease_s=10, columns=True)
    clock.advance(5)
    assert queue.heartbeat(claim.lease_id, 10) == 8
    clock.advance(8)
    assert queue.stats().groups[0].expired_leases == 0
    clock.advance(5)
    assert queue.stats().groups[0].expired_leases == 8
    assert queue.release_expired() == models.ReapResult(released=8, dead=0)
    assert ranges(queue) == []
    got = rows(queue)
    # Eight items in one lost lease: nobody is charged, all are suspects.
    assert {(r.state, r.attempts, r.crash_count, r.isolate_n) for r in got.values()} == {
        (0, 0, 1, 4)
    }
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 0
    plain = queue.claim(8, lease_s=10, columns=True)
    assert (len(plain.items), plain.suspects) == (0, True)
    round_ = queue.claim(8, lease_s=10, columns=True, isolate=True)
    assert len(round_.items) == 4
    assert ranges(queue) == []


def test_a_claim_reaps_an_expired_range_of_its_queue(queue: q.SqlQueue, clock: FakeClock) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(4)])
    queue.claim(4, lease_s=10, columns=True)
    clock.advance(11)
    claim = queue.claim(4, lease_s=10, columns=True)
    assert (len(claim.items), claim.suspects) == (0, True)
    assert ranges(queue) == []


def test_cancel_leaves_a_range_in_flight(queue: q.SqlQueue, clock: FakeClock) -> None:
    queue.enqueue([tensor(f"k{i}", tenant="t") for i in range(6)])
    claim = queue.claim(4, lease_s=30, columns=True)
    done = controls.cancel_items(
        queue.engine, queue.queue, tenant="t", actor="ops", reason="test", now=clock()
    )
    assert (done.cancelled, done.in_flight) == (2, 4)
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 4
    assert queue.stats().by_state == {
        "ready": 0,
        "leased": 0,
        "done": 4,
        "dead": 0,
        "expired": 0,
        "cancelled": 2,
    }


def test_a_range_is_held_for_a_commit_only_while_its_items_are(queue: q.SqlQueue) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(4)])
    claim = queue.claim(4, lease_s=30, columns=True)
    ids = [i.id for i in claim.items]
    with queue.engine.begin() as conn:
        assert queue.lease_held(conn, claim.lease_id, ids)
        assert not queue.lease_held(conn, "another", ids)
        assert queue.held_leases(conn, [claim.lease_id, "another"]) == {claim.lease_id}
        queue.ack_all_or_raise(conn, claim.lease_id, ids[:2], "b1")
        assert not queue.lease_held(conn, claim.lease_id, ids)
        assert queue.lease_held(conn, claim.lease_id, ids[2:])


def test_migration_16_adds_range_leases_to_a_queue_of_version_15(queue: q.SqlQueue) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(4)])
    with queue.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE batching_ranges"))
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 16))
    assert queue.migrate().from_version == 15
    claim = queue.claim(4, lease_s=30, columns=True)
    assert len(ranges(queue)) == 1
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 4
    assert queue.migrate().applied is False


def test_an_item_a_range_holds_reads_as_leased_over_http(queue: q.SqlQueue) -> None:
    from batching.api import results

    queue.enqueue([tensor(f"k{i}") for i in range(3)])
    claim = queue.claim(2, lease_s=30, columns=True)
    assert len(ranges(queue)) == 1
    with queue.read() as conn:
        views = results.states(conn, queue.queue, ["k0", "k1", "k2"])
    assert {k: v.state for k, v in views.items()} == {
        "k0": models.State.LEASED,
        "k1": models.State.LEASED,
        "k2": models.State.READY,
    }
    queue.ack(claim.lease_id, [i.id for i in claim.items])
    with queue.read() as conn:
        assert results.states(conn, queue.queue, ["k0"])["k0"].state is models.State.DONE


def test_acks_of_a_range_in_any_order_and_shape(queue: q.SqlQueue) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(8)])
    claim = queue.claim(8, lease_s=30, columns=True)
    ids = [i.id for i in claim.items]
    assert queue.ack(claim.lease_id, [ids[6], ids[0], ids[3]]) == 3  # not one run
    assert queue.ack(claim.lease_id, [ids[2], ids[1]]) == 2  # one run, out of order
    assert queue.ack(claim.lease_id, [ids[1], ids[4]]) == 1  # one of them acked already
    assert ranges(queue)[0].remaining == 2
    assert queue.ack(claim.lease_id, [ids[5], ids[7]]) == 2
    assert ranges(queue) == []
    assert {(r.state, r.attempts) for r in rows(queue).values()} == {(2, 1)}


def test_purge_keeps_the_done_items_of_a_range_still_held(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(4)])
    claim = queue.claim(4, lease_s=600, columns=True)
    ids = [i.id for i in claim.items]
    queue.ack(claim.lease_id, ids[2:])  # the highest ids: SQLite would hand them out again
    clock.advance(100)
    assert queue.purge(10) == 0
    assert queue.ack(claim.lease_id, ids[:2]) == 2
    clock.advance(100)
    assert queue.purge(10) == 4


def test_a_range_is_read_by_the_primary_key_on_a_queue_just_filled(queue: q.SqlQueue) -> None:
    """Without statistics (a queue just filled) PostgreSQL chose the ready index for ``id
    BETWEEN ... AND state = 0`` and read the whole of it for every range."""
    from batching.ingress import sqlite_claim

    queue.enqueue([tensor(f"k{i}") for i in range(3000)])
    claim = queue.claim(2048, lease_s=30, columns=True)
    ids = [i.id for i in claim.items]
    pg = queue.dialect == "postgresql"
    ack = sa.update(T).where(queue._ids(ids), q._STILL_READY).values(state=2)
    read = sa.text(q._RANGE_ROWS if pg else str(sqlite_claim.RANGE.claimed))
    explain = "EXPLAIN " if pg else "EXPLAIN QUERY PLAN "
    binds = {"range_lo": ids[0], "range_hi": ids[-1], "lease": claim.lease_id}
    with queue.engine.connect() as conn:
        compiled = ack.compile(conn, compile_kwargs={"literal_binds": True})
        for stmt, params in ((read, binds), (sa.text(str(compiled)), {})):
            plan = " ".join(str(r[-1]) for r in conn.execute(sa.text(explain + stmt.text), params))
            assert ("batching_items_pkey" if pg else "INTEGER PRIMARY KEY") in plan, plan
            assert "ix_batching_items_ready" not in plan, plan


def test_a_range_hands_each_item_its_own_body(queue: q.SqlQueue) -> None:
    def own(i: int) -> models.EnqueueRecord:
        body = np.arange(i, i + 4, dtype=np.float32).tobytes()
        return models.EnqueueRecord(
            f"k{i}", models.Payload(body, models.PayloadFormat.TENSOR, "float32", (4,))
        )

    queue.enqueue([own(i) for i in range(300)])
    claim = queue.claim(300, lease_s=30, columns=True)
    assert isinstance(claim.items, models.ItemBlock)
    assert len(ranges(queue)) == 1
    for item in claim.items:
        i = int(item.item_key[1:])
        assert item.payload.data == np.arange(i, i + 4, dtype=np.float32).tobytes()


def test_a_range_whose_body_row_is_gone_buries_it_and_claims_the_rest(queue: q.SqlQueue) -> None:
    queue.enqueue([tensor(f"k{i}") for i in range(4)])
    gone = rows(queue)["k1"].id
    with queue.engine.begin() as conn:
        conn.execute(schema.payloads.delete().where(schema.payloads.c.id == gone))
    claim = queue.claim(4, lease_s=30, columns=True)
    assert sorted(i.item_key for i in claim.items) == ["k0", "k2", "k3"]
    got = rows(queue)
    assert (got["k1"].state, got["k1"].last_error) == (3, "payload missing from batching_payloads")
    assert ranges(queue) == []  # demoted: the rest are leased item by item
    assert {got[k].state for k in ("k0", "k2", "k3")} == {1}
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 3


def test_a_range_that_cannot_be_read_back_is_given_back(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batching.ingress import sqlite_claim

    queue.enqueue([tensor(f"k{i}") for i in range(4)])

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("read back failed")

    monkeypatch.setattr(sqlite_claim, "unpack_claim", broken)
    with pytest.raises(RuntimeError, match="read back failed"):
        queue.claim(4, lease_s=30, columns=True)
    monkeypatch.undo()
    assert ranges(queue) == []
    assert {(r.state, r.attempts) for r in rows(queue).values()} == {(0, 0)}
    assert len(queue.claim(4, lease_s=30, columns=True).items) == 4


def test_a_range_demoted_before_it_is_read_back_is_still_handed_out(
    queue: q.SqlQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range is read back once it has committed; meanwhile another thread of the scorer
    may fail an item of the same lease, which demotes every range of the lease. The range's
    items are then leased by that lease, and are still this claim's (they were left leased
    and unscored, found by a rollout test under load)."""
    queue.enqueue([tensor(f"k{i}") for i in range(8)])
    first = queue.claim(4, lease_s=30, columns=True)
    read_back = q.SqlQueue._read_back

    def fail_first(self: q.SqlQueue, read: Any, params: dict[str, Any], now: float) -> Any:
        self.fail(first.lease_id, {first.items[0].id: "bad"})
        return read_back(self, read, params, now)

    monkeypatch.setattr(q.SqlQueue, "_read_back", fail_first)
    second = queue.claim(4, lease_s=30, columns=True, lease_id=first.lease_id)
    monkeypatch.undo()
    assert [i.item_key for i in second.items] == ["k4", "k5", "k6", "k7"]
    assert {i.attempts for i in second.items} == {1}
    assert ranges(queue) == []
    assert queue.ack(first.lease_id, [i.id for i in second.items]) == 4
    assert {r.attempts for r in rows(queue).values() if r.state == 2} == {1}


@pytest.mark.postgres
def test_a_frozen_scorers_locked_range_does_not_stop_the_other_claims(
    pg_url: str, clock: FakeClock
) -> None:
    """A scorer frozen inside its commit (its range row locked, its lease lapsing) cost every
    other scorer of the queue: their claims' reaper waited on the row, under the queue's
    claim lock, until it resumed. The reaper now leaves a locked range to a later reap, and
    PostgreSQL ends a session idle in a transaction past ``IDLE_IN_TRANSACTION_S``."""
    import concurrent.futures

    engine = database.create_engine(pg_url)
    database.bound_idle_transactions(engine)  # as a scorer's
    queue = q.SqlQueue(engine, "frozen", clock=clock)
    queue.enqueue([tensor(f"k{i}") for i in range(10)])
    frozen = queue.claim(6, lease_s=5, columns=True)
    assert len(ranges(queue)) == 1
    queue.enqueue([tensor(f"new{i}") for i in range(3)])
    holder = database.create_engine(pg_url)
    conn = holder.connect()
    locked = conn.begin()
    conn.execute(sa.select(R.c.id).where(R.c.lease_id == frozen.lease_id).with_for_update())
    clock.advance(10)  # the frozen scorer's lease lapsed
    other = q.SqlQueue(database.create_engine(pg_url), "frozen", clock=clock)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        claimed = pool.submit(other.claim, 10, lease_s=30).result(timeout=20)
        assert sorted(i.item_key for i in claimed.items) == [
            "k6",
            "k7",
            "k8",
            "k9",
            "new0",
            "new1",
            "new2",
        ]
    finally:
        locked.rollback()
        conn.close()
        pool.shutdown(wait=True)
    reaped = other.release_expired(this_queue=True)  # the row is free: reaped as any other
    assert reaped.released == 6
    shown = sa.text("SHOW idle_in_transaction_session_timeout")
    with engine.connect() as c:
        assert c.execute(shown).scalar() == "1min"
    with holder.connect() as c:  # not a scorer's (an enqueue reads its file in its transaction)
        assert c.execute(shown).scalar() == "0"
    for e in (engine, holder, other.engine):
        e.dispose()
