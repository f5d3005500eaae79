"""The queue's contract, verb by verb, on every queue: a real SQLite file, a real PostgreSQL
database, and ``batching.testing.InMemoryQueue`` (the twin users' tests run against).

What only a SQL queue has (migrations, transactions, plans, claim read-backs) is tested in
``test_queue_contract.py``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import crashes, errors, models
from batching.ingress import queue as q
from batching.store import database, schema
from batching.testing import FakeClock, InMemoryQueue
from tests.conftest import as_held

Queue = q.SqlQueue | InMemoryQueue


def rec(key: str, **kw: object) -> models.EnqueueRecord:
    return models.EnqueueRecord(item_key=key, payload=models.Payload(b'{"x":[1]}'), **kw)  # type: ignore[arg-type]


class RangeQueue(q.SqlQueue):
    """A SQL queue whose claims ask for columns, as the scorer's do: a claim whose items are
    one run of ids is then a range lease (one row in ``batching_ranges``), so every test of
    this file also runs on range leases."""

    def claim(self, n: int, **kw: Any) -> models.Claim:
        kw.setdefault("columns", True)
        return super().claim(n, **kw)


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        "sqlite-ranges",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("postgres-ranges", marks=pytest.mark.postgres),
    ]
)
def queue(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[Queue]:
    if request.param == "memory":
        yield InMemoryQueue("contract", clock=clock, rng=random.Random(7))
        return
    kind, _, ranges = request.param.partition("-")
    engine = database.create_engine(
        request.getfixturevalue({"sqlite": "sqlite_url"}.get(kind, "pg_url"))
    )
    cls = RangeQueue if ranges else q.SqlQueue
    yield cls(engine, "contract", clock=clock, rng=random.Random(7))
    engine.dispose()


def sibling(queue: Queue, name: str) -> Queue:
    """Another queue of the same table."""
    if isinstance(queue, InMemoryQueue):
        return queue.sibling(name)
    return type(queue)(queue.engine, name, clock=queue.clock)


def row(queue: Queue, key: str) -> Any:
    """The item's row: state, attempts, lease, last error, ..., as its lease holds it
    (``tests.conftest.as_held``: a range lease's items stay ready in the table)."""
    if isinstance(queue, InMemoryQueue):
        return queue.item(key)
    t = schema.items
    with queue.engine.connect() as conn:
        item = conn.execute(sa.select(t).where(t.c.item_key == key, t.c.queue == queue.queue)).one()
        return as_held(conn, [item])[0]


def archived(queue: Queue) -> int:
    if isinstance(queue, InMemoryQueue):
        return len(queue.archived)
    with queue.engine.connect() as conn:
        return int(
            conn.execute(sa.select(sa.func.count()).select_from(schema.items_archive)).scalar_one()
        )


def test_enqueue_is_idempotent_on_key(queue: Queue) -> None:
    first = queue.enqueue([rec("a"), rec("b"), rec("a")])
    assert first.inserted == 2
    assert first.duplicates == ("a",)
    again = queue.enqueue([rec("b"), rec("c")])
    assert again.inserted == 1
    assert again.duplicates == ("b",)
    assert queue.stats().by_state["ready"] == 3


def test_same_key_in_other_queue_is_distinct(queue: Queue) -> None:
    other = sibling(queue, "other")
    assert queue.enqueue([rec("k")]).inserted == 1
    assert other.enqueue([rec("k")]).inserted == 1


def test_tensor_payload_round_trips(queue: Queue) -> None:
    payload = models.Payload(b"\x00\x00\x80?" * 4, models.PayloadFormat.TENSOR, "float32", (4,))
    queue.enqueue([models.EnqueueRecord("t", payload)])
    (item,) = queue.claim(1, lease_s=30).items
    assert item.payload == payload


def test_claim_orders_by_priority_then_deadline_then_age(queue: Queue, clock: FakeClock) -> None:
    now = clock()
    queue.enqueue([rec("old-low")])
    clock.advance(1)
    queue.enqueue([rec("new-high", priority=5)])
    clock.advance(1)
    queue.enqueue(
        [rec("late-deadline", deadline_at=now + 500), rec("soon-deadline", deadline_at=now + 100)]
    )
    claim = queue.claim(10, lease_s=30)
    assert [i.item_key for i in claim.items] == [
        "new-high",
        "soon-deadline",
        "late-deadline",
        "old-low",
    ]
    assert all(i.attempts == 1 for i in claim.items)


def test_claim_limit_and_empty_queue(queue: Queue) -> None:
    queue.enqueue([rec(f"k{i}") for i in range(5)])
    assert len(queue.claim(3, lease_s=30)) == 3
    assert len(queue.claim(3, lease_s=30)) == 2
    assert len(queue.claim(3, lease_s=30)) == 0


def test_cost_budget_claim(queue: Queue) -> None:
    queue.enqueue([rec(f"k{i}", cost=c) for i, c in enumerate([40, 30, 20, 50, 10])])
    claim = queue.claim(10, lease_s=30, max_cost=100)
    assert [i.cost for i in claim.items] == [40, 30, 20]
    big = sibling(queue, "big")
    big.enqueue([rec("huge", cost=500), rec("small", cost=1)])
    assert [i.item_key for i in big.claim(10, lease_s=30, max_cost=100).items] == ["huge"]


def test_lane_filter(queue: Queue) -> None:
    queue.enqueue([rec("a", lane="short"), rec("b", lane="long"), rec("c", lane="short")])
    assert {i.item_key for i in queue.claim(10, lease_s=30, lane="short").items} == {"a", "c"}


def test_stale_lease_can_never_ack(queue: Queue, clock: FakeClock) -> None:
    queue.enqueue([rec("a"), rec("b")])
    first = queue.claim(2, lease_s=10)
    ids = [i.id for i in first.items]
    assert queue.ack("not-the-lease", ids) == 0
    clock.advance(11)
    assert queue.release_expired().released == 2
    second = queue.claim(2, lease_s=10, isolate=True)  # the lost lease's items are suspects
    assert [i.item_key for i in second.items] == ["a"]
    assert queue.ack(first.lease_id, ids) == 0
    assert queue.heartbeat(first.lease_id, 10) == 0
    assert queue.fail(first.lease_id, dict.fromkeys(ids, "x")) == models.FailResult(0, 0)
    assert queue.release(first.lease_id) == 0
    assert queue.ack(second.lease_id, ids) == 1
    assert queue.ack(second.lease_id, ids) == 0
    assert row(queue, "a").state == models.State.DONE


def test_a_heartbeat_on_a_sqlite_file_gone_from_its_path_stops_the_run(
    sqlite_url: str, clock: FakeClock
) -> None:
    """A scorer's pooled connection would go on claiming and acking in the unlinked file;
    its heartbeat says so instead (the scorer stops with this one line)."""
    queue = q.SqlQueue(database.create_engine(sqlite_url), "gone", clock=clock)
    queue.enqueue([rec("a")])
    claim = queue.claim(1, lease_s=10)
    assert queue.heartbeat(claim.lease_id, 10) == 1
    path = Path(sa.make_url(sqlite_url).database or "")
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        name.unlink(missing_ok=True)
    with pytest.raises(errors.QueueError, match="file is gone from its path"):
        queue.heartbeat(claim.lease_id, 10)
    queue.engine.dispose()


def test_heartbeat_keeps_lease_from_reaper(queue: Queue, clock: FakeClock) -> None:
    queue.enqueue([rec("a")])
    claim = queue.claim(1, lease_s=10)
    clock.advance(8)
    assert queue.heartbeat(claim.lease_id, 10) == 1
    clock.advance(8)
    assert queue.release_expired() == models.ReapResult(0, 0)
    clock.advance(3)
    assert queue.release_expired() == models.ReapResult(1, 0)
    r = row(queue, "a")
    assert (r.state, r.crash_count, r.lease_id) == (models.State.READY, 1, None)
    # Claimed by a plain claim, it was not alone in its process: no attempt is charged.
    assert (r.attempts, r.isolate_n) == (0, 1)
    assert r.last_error == crashes.REFUNDED.format(n=1)


def test_a_claim_reaps_its_queues_expired_leases_first(queue: Queue, clock: FakeClock) -> None:
    """A killed scorer's items come back to the next claim, with no reaper run, as suspects
    for an isolation round: a plain claim leaves them, and charges nobody."""
    other = sibling(queue, "other")
    queue.enqueue([rec("a"), rec("b"), rec("p", max_attempts=1)])
    other.enqueue([rec("x")])
    lost = queue.claim(3, lease_s=10)
    other_lost = other.claim(1, lease_s=10)
    clock.advance(9)
    assert len(queue.claim(3, lease_s=10)) == 0  # not expired yet
    clock.advance(2)
    plain = queue.claim(3, lease_s=10)
    assert (len(plain), plain.suspects, plain.isolated) == (0, True, False)
    # A lease of 3 lost: each suspect goes again with at most one other (half of 3, rounded up).
    again = queue.claim(3, lease_s=10, isolate=True)
    assert again.isolated
    assert len(again) == 2
    assert [i.item_key for i in again.items] == ["a", "b"]
    assert all(i.attempts == 1 for i in again.items), "the lost worker's attempt was given back"
    r = row(queue, "p")
    assert (r.state, r.attempts, r.isolate_n) == (models.State.READY, 0, 2)
    assert queue.ack(lost.lease_id, [i.id for i in lost.items]) == 0
    # Another queue's leases are its own scorers' (or the reaper's) to return.
    assert row(other, "x").lease_id == other_lost.lease_id


def test_an_item_alone_in_isolation_is_charged_until_dead(queue: Queue, clock: FakeClock) -> None:
    """Only a death while the item was the only one of its isolation round costs an attempt."""
    queue.enqueue([rec("p", max_attempts=2)])
    assert len(queue.claim(1, lease_s=5)) == 1
    clock.advance(6)
    queue.release_expired()
    assert row(queue, "p").attempts == 0
    for attempt in (1, 2):
        assert len(queue.claim(1, lease_s=5)) == 0, "a suspect waits for an isolation round"
        claim = queue.claim(5, lease_s=5, isolate=True)
        assert [i.attempts for i in claim.items] == [attempt]
        clock.advance(6)
        queue.release_expired()
    r = row(queue, "p")
    assert (r.state, r.attempts, r.crash_count) == (models.State.DEAD, 2, 3)
    assert r.last_error == crashes.KILLER
    assert len(queue.claim(1, lease_s=5, isolate=True)) == 0


def test_isolation_rounds_bisect_and_never_charge_the_good(queue: Queue, clock: FakeClock) -> None:
    """One killer among 8: each round that dies halves its suspects' company; the good ones
    commit with no attempt charged, and the killer alone ends dead."""
    queue.enqueue([rec(f"k{i}", max_attempts=2) for i in range(8)])
    killer = "k5"
    claim = queue.claim(8, lease_s=5)
    deaths = 0
    while True:
        ids = [i.id for i in claim.items]
        if killer in {i.item_key for i in claim.items}:  # the worker dies with this claim
            deaths += 1
            clock.advance(6)
            queue.release_expired()
        else:
            assert queue.ack(claim.lease_id, ids) == len(ids)
            assert all(i.attempts == 1 for i in claim.items), "a good item was charged"
        claim = queue.claim(8, lease_s=5, isolate=True)
        if not claim.items:
            break
        assert len(claim) <= 4
    stats = queue.stats().by_state
    assert (stats["done"], stats["dead"], stats["ready"]) == (7, 1, 0)
    assert row(queue, killer).last_error == crashes.KILLER
    assert deaths == 3 + 2  # the claim of 8, its rounds of 4 and 2; then 2 attempts alone


def test_fail_backs_off_with_jitter_then_dead_letters(queue: Queue, clock: FakeClock) -> None:
    queue.backoff_base_s, queue.max_attempts = 4.0, 3
    queue.enqueue([rec("f")])
    delays = []
    for attempt in (1, 2):
        claim = queue.claim(1, lease_s=30)
        assert claim.items[0].attempts == attempt
        assert queue.fail(claim.lease_id, {claim.items[0].id: f"boom {attempt}"}).retried == 1
        delay = row(queue, "f").run_after - clock()
        delays.append(delay)
        assert 0.5 * 4.0 * 2 ** (attempt - 1) <= delay <= 4.0 * 2 ** (attempt - 1)
        assert len(queue.claim(1, lease_s=30)) == 0, "not claimable before its backoff"
        clock.advance(delay + 0.001)
    claim = queue.claim(1, lease_s=30)
    assert queue.fail(claim.lease_id, {claim.items[0].id: "boom 3"}) == models.FailResult(0, 1)
    r = row(queue, "f")
    assert (r.state, r.last_error) == (models.State.DEAD, "boom 3")


def test_fail_without_retry_dead_letters_at_once(queue: Queue) -> None:
    queue.enqueue([rec("x")])
    claim = queue.claim(1, lease_s=30)
    assert queue.fail(claim.lease_id, {claim.items[0].id: "bad payload"}, retry=False).dead == 1


def test_items_past_deadline_expire_not_score(queue: Queue, clock: FakeClock) -> None:
    queue.enqueue([rec("late", deadline_at=clock() + 5), rec("fine", deadline_at=clock() + 60)])
    clock.advance(10)
    assert [i.item_key for i in queue.claim(10, lease_s=30).items] == ["fine"]
    r = row(queue, "late")
    assert (r.state, r.last_error) == (models.State.EXPIRED, "deadline passed before scoring")


def test_the_claim_that_expires_items_reports_them_by_tenant(
    queue: Queue, clock: FakeClock
) -> None:
    soon, now = clock() + 5, clock()
    queue.enqueue(
        [rec(f"a{i}", tenant="a", deadline_at=soon) for i in range(3)]
        + [rec(f"b{i}", tenant="b", deadline_at=soon) for i in range(2)]
        + [rec("late", tenant="b", deadline_at=now + 500)]
        + [rec(f"none{i}", tenant="a", priority=1) for i in range(2)]
    )
    assert queue.claim(1, lease_s=60).expired == ()  # nothing overdue: nothing to report
    clock.advance(10)
    assert sibling(queue, "other").claim(10, lease_s=60).expired == ()  # not its items
    claim = queue.claim(10, lease_s=60)
    assert claim.expired == (("a", 3), ("b", 2))  # (tenant, n), sorted by tenant
    assert sorted(i.item_key for i in claim.items) == ["late", "none1"]
    assert queue.claim(10, lease_s=60).expired == ()  # told once, by the claim that did it
    queue.enqueue([rec(f"c{i}", tenant="c", deadline_at=clock() + 1) for i in range(4)])
    clock.advance(2)
    assert queue.expire_overdue() == 4  # the maintenance path (the exporter's gauge shows it)
    assert queue.claim(10, lease_s=60).expired == ()


def test_release_gives_items_back_without_using_an_attempt(queue: Queue) -> None:
    queue.enqueue([rec("a")])
    claim = queue.claim(1, lease_s=30)
    assert queue.release(claim.lease_id) == 1
    assert queue.claim(1, lease_s=30).items[0].attempts == 1


def test_stats_counts_states_ages_and_expired_leases(queue: Queue, clock: FakeClock) -> None:
    queue.enqueue([rec("a", tenant="t1"), rec("b", tenant="t2"), rec("c", tenant="t2")])
    clock.advance(30)
    claim = queue.claim(1, lease_s=5)
    clock.advance(10)
    stats = queue.stats()
    assert stats.by_state == {
        "ready": 2,
        "leased": 1,
        "done": 0,
        "dead": 0,
        "expired": 0,
        "cancelled": 0,
    }
    assert stats.expired_leases == 1
    assert stats.oldest_ready_age_s == pytest.approx(40)
    assert {g.tenant for g in stats.groups} == {"t1", "t2"}
    assert claim.lease_id


def test_stats_without_done_are_the_live_counts_of_every_state(
    queue: Queue, clock: FakeClock
) -> None:
    """``done=False`` (a scrape, a flow's precondition): the same counts, read a state at a
    time, with done not counted (None, not 0) and a group of done items only left out."""
    other = sibling(queue, "other")
    queue.enqueue([rec(f"r{i}", tenant="t1") for i in range(4)] + [rec("x", tenant="t2")])
    other.enqueue([rec("o1", tenant="t3")])
    clock.advance(5)
    acked = queue.claim(2, lease_s=60)  # t1's first two: done
    queue.ack(acked.lease_id, [i.id for i in acked.items])
    failed = queue.claim(1, lease_s=60)
    queue.fail(failed.lease_id, {failed.items[0].id: "boom"}, retry=False)  # dead
    queue.claim(1, lease_s=5)  # leased, its lease lapses below
    finished = other.claim(1, lease_s=60)
    other.ack(finished.lease_id, [i.id for i in finished.items])  # queue other: done only
    clock.advance(10)
    whole, live = queue.stats(all_queues=True), queue.stats(all_queues=True, done=False)
    assert whole.by_state == {
        "ready": 1,
        "leased": 1,
        "done": 3,
        "dead": 1,
        "expired": 0,
        "cancelled": 0,
    }
    assert live.by_state == {k: v for k, v in whole.by_state.items() if k != "done"}
    assert (live.expired_leases, live.oldest_ready_age_s) == (1, whole.oldest_ready_age_s)
    assert {g.queue for g in whole.groups} == {"contract", "other"}
    states = ("ready", "leased", "dead", "expired", "cancelled")
    with_live = [g for g in whole.groups if any(getattr(g, s) for s in states)]
    assert "other" not in {g.queue for g in with_live}  # its one item is done
    assert live.groups == tuple(dataclasses.replace(g, done=None) for g in with_live)
    assert queue.stats(done=False).by_state == {
        "ready": 1,
        "leased": 1,
        "dead": 1,
        "expired": 0,
        "cancelled": 0,
    }


def test_redrive_and_purge(queue: Queue, clock: FakeClock) -> None:
    queue.enqueue([rec("d", priority=1), rec("e", deadline_at=clock() + 1), rec("ok")])
    claim = queue.claim(1, lease_s=30)
    queue.fail(claim.lease_id, {claim.items[0].id: "x"}, retry=False)
    clock.advance(2)
    done = queue.claim(5, lease_s=30)
    queue.ack(done.lease_id, [i.id for i in done.items])
    assert queue.stats().by_state["expired"] == 1
    assert queue.redrive() == 2
    assert queue.stats().by_state["ready"] == 2
    clock.advance(3600)
    assert queue.purge(60, archive=True) == 1
    assert archived(queue) == 1
