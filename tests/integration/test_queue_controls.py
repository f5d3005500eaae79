"""Queue controls on a real SQLite file and a real PostgreSQL database: pause and resume
(claims see them), cancel by key, tenant and enqueue run, the depth cap (all or nothing), the
audit row of each, and migration 13 on a populated version-12 database."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import errors, models
from batching.cli.controls import _keys
from batching.ingress import controls
from batching.ingress import queue as q
from batching.store import database, schema
from batching.testing import FakeClock
from tests.conftest import wait_for
from tests.integration.conftest import ScoreProcess


def rec(key: str, **kw: Any) -> models.EnqueueRecord:
    return models.EnqueueRecord(item_key=key, payload=models.Payload(b'{"x":[1]}'), **kw)


@pytest.fixture
def queue(db_url: str, clock: FakeClock) -> Iterator[q.SqlQueue]:
    engine = database.create_engine(db_url)
    yield q.SqlQueue(engine, "ctl", clock=clock, rng=random.Random(7))
    engine.dispose()


def other(queue: q.SqlQueue, name: str = "ctl") -> q.SqlQueue:
    """Another scorer's handle on a queue of the same table (its own worker id)."""
    return q.SqlQueue(queue.engine, name, clock=queue.clock)


def states(queue: q.SqlQueue) -> dict[str, models.State]:
    t = schema.items
    with queue.engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.item_key, t.c.state).where(t.c.queue == queue.queue))
        return {k: models.State(s) for k, s in rows}


def pause(queue: q.SqlQueue, actor: str = "alice", reason: str = "bad model") -> Any:
    return controls.pause(queue.engine, queue.queue, actor=actor, reason=reason, now=queue.clock())


# ----------------------------------------------------------------------------- pause


def test_a_paused_queue_claims_nothing_for_any_scorer_until_resumed(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([rec(f"k{i}") for i in range(6)])
    held = queue.claim(2, lease_s=30)
    paused = pause(queue)
    assert (paused.paused, paused.paused_by, paused.reason) == (True, "alice", "bad model")
    assert paused.paused_at == clock()

    for scorer in (queue, other(queue)):
        claim = scorer.claim(10, lease_s=30)
        assert (len(claim.items), claim.paused) == (0, True)
        isolated = scorer.claim(10, lease_s=30, isolate=True, max_cost=5)
        assert (len(isolated.items), isolated.paused) == (0, True)
    # What was claimed before the pause is in flight: it is still held and commits.
    assert queue.heartbeat(held.lease_id, 30) == 2
    assert queue.ack(held.lease_id, [i.id for i in held.items]) == 2
    assert other(queue, "elsewhere").claim(1, lease_s=30).paused is False  # one queue only

    clock.advance(5)
    resumed = controls.resume(queue.engine, queue.queue, actor="bob", reason="fixed", now=clock())
    assert (resumed.paused, resumed.paused_by, resumed.paused_at) == (False, None, None)
    claim = other(queue).claim(10, lease_s=30)
    assert (len(claim.items), claim.paused) == (4, False)
    assert list(states(queue).values()).count(models.State.DONE) == 2


def test_pause_and_resume_are_idempotent_and_each_call_is_audited(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    first = pause(queue, "alice", "first")
    clock.advance(10)
    again = pause(queue, "breaker:run-1", "storm")
    assert again == first  # still paused by the first, since then, for its reason
    assert controls.state(queue.engine, "ctl") == first
    clock.advance(10)
    controls.resume(queue.engine, "ctl", actor="bob", reason=None, now=clock())
    controls.resume(queue.engine, "ctl", actor="bob", reason="twice", now=clock())

    rows = controls.audit(queue.engine, "ctl")
    assert [(r.action, r.actor, r.reason, r.detail["changed"]) for r in rows] == [
        ("pause", "alice", "first", True),
        ("pause", "breaker:run-1", "storm", False),
        ("resume", "bob", None, True),
        ("resume", "bob", "twice", False),
    ]
    start = first.paused_at
    assert [r.at for r in rows] == [start, start + 10, start + 20, start + 20]
    assert rows[2].detail["paused_by"] == "alice"
    assert [r.action for r in controls.audit(queue.engine, limit=2)] == ["resume", "resume"]
    assert controls.audit(queue.engine, "nope") == []


def test_pause_needs_an_actor_and_a_reason(queue: q.SqlQueue) -> None:
    with pytest.raises(errors.InputError, match="pause needs a reason"):
        pause(queue, reason="  ")
    with pytest.raises(errors.InputError, match="actor"):
        pause(queue, actor="")
    assert controls.state(queue.engine, "ctl") == controls.QueueControl("ctl")
    assert controls.audit(queue.engine) == []


# ----------------------------------------------------------------------------- cancel


def test_cancel_by_key_tenant_and_enqueue_run_takes_ready_items_only(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue(
        [rec("a1", tenant="a"), rec("a2", tenant="a"), rec("b1", tenant="b")], enqueue_run="run-1"
    )
    queue.enqueue(
        [rec("a3", tenant="a"), rec("b2", tenant="b"), rec("b3", tenant="b")], enqueue_run="run-2"
    )
    other(queue, "elsewhere").enqueue([rec("a1", tenant="a")], enqueue_run="run-1")
    held = queue.claim(1, lease_s=30)  # a1: in flight
    assert [i.item_key for i in held.items] == ["a1"]

    def cancel(**kw: Any) -> controls.CancelResult:
        return controls.cancel_items(
            queue.engine, "ctl", actor="carol", reason="tenant asked", now=clock(), **kw
        )

    assert cancel(tenant="a") == controls.CancelResult(cancelled=2, in_flight=1)
    assert cancel(enqueue_run="run-2", tenant="b") == controls.CancelResult(2, 0)
    assert cancel(keys=["b1", "a2", "missing"]) == controls.CancelResult(1, 0)  # a2: gone
    assert (
        controls.cancel(queue.engine, "ctl", keys=["b3"], actor="carol", reason="x", now=clock())
        == 0
    )
    assert states(queue) == {
        "a1": models.State.LEASED,
        "a2": models.State.CANCELLED,
        "a3": models.State.CANCELLED,
        "b1": models.State.CANCELLED,
        "b2": models.State.CANCELLED,
        "b3": models.State.CANCELLED,
    }
    assert states(other(queue, "elsewhere")) == {"a1": models.State.READY}
    assert queue.ack(held.lease_id, [held.items[0].id]) == 1  # the in-flight one finishes

    with queue.engine.connect() as conn:
        t = schema.items
        row = conn.execute(sa.select(t).where(t.c.item_key == "a2", t.c.queue == "ctl")).one()
    assert (row.last_error, row.finished_at) == ("cancelled by carol: tenant asked", clock())
    detail = [r.detail for r in controls.audit(queue.engine, "ctl")]
    assert [(d["cancelled"], d["in_flight"], d["tenant"], d["enqueue_run"]) for d in detail] == [
        (2, 1, "a", None),
        (2, 0, "b", "run-2"),
        (1, 0, None, None),
        (0, 0, None, None),
    ]
    assert (detail[2]["n_keys"], detail[2]["keys"]) == (3, ["b1", "a2", "missing"])


def test_cancelled_items_count_apart_are_purged_and_redriven_only_when_asked(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    queue.enqueue([rec("a"), rec("b"), rec("c")])
    controls.cancel(queue.engine, "ctl", keys=["a"], actor="c", reason="r", now=clock())
    clock.advance(100)
    controls.cancel(queue.engine, "ctl", keys=["b"], actor="c", reason="r", now=clock())
    stats = queue.stats()
    by_state = stats.by_state
    assert (by_state["cancelled"], by_state["dead"], by_state["ready"]) == (2, 0, 1)
    assert [(g.tenant, g.cancelled) for g in stats.groups] == [("default", 2)]
    assert queue.redrive() == 0  # dead and expired only, by default
    assert [i.item_key for i in queue.claim(5, lease_s=30).items] == ["c"]
    assert queue.purge(50, archive=True) == 1  # a, cancelled 100 s ago; b stays
    assert queue.redrive([models.State.CANCELLED]) == 1
    assert states(queue) == {"b": models.State.READY, "c": models.State.LEASED}


def test_cancel_needs_a_filter_and_a_reason(queue: q.SqlQueue, clock: FakeClock) -> None:
    queue.enqueue([rec("a")])
    cases: tuple[tuple[dict[str, Any], str], ...] = (
        ({}, "needs a filter"),
        ({"keys": []}, "empty key list"),
        ({"tenant": "default", "reason": ""}, "cancel needs a reason"),
    )
    for kw, says in cases:
        with pytest.raises(errors.InputError, match=says):
            controls.cancel(queue.engine, "ctl", **{"actor": "a", "reason": "r", "now": 1.0, **kw})
    assert states(queue) == {"a": models.State.READY}


def test_cancel_of_many_keys_runs_in_chunks_in_one_transaction(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    keys = [f"k{i}" for i in range(2500)]
    queue.enqueue([rec(k) for k in keys])
    n = controls.cancel(queue.engine, "ctl", keys=keys[:2400], actor="a", reason="r", now=clock())
    assert n == 2400
    (row,) = controls.audit(queue.engine, "ctl")
    assert (row.detail["n_keys"], len(row.detail["keys"])) == (2400, 20)


def test_cancel_keys_come_from_options_and_a_keys_file(tmp_path: Path) -> None:
    file = tmp_path / "keys.txt"
    file.write_text("a\n\n  b  \n")
    assert _keys(None, None) is None
    assert _keys(["x"], file) == ["x", "a", "b"]
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(errors.InputError, match="holds no keys"):
        _keys(None, tmp_path / "empty.txt")
    with pytest.raises(errors.InputError, match="cannot read it"):
        _keys(None, tmp_path / "missing.txt")


# ----------------------------------------------------------------------------- depth cap


def cap(queue: q.SqlQueue, max_depth: int | None) -> controls.QueueControl:
    return controls.set_max_depth(
        queue.engine, queue.queue, max_depth, actor="dave", reason="backlog", now=queue.clock()
    )


def test_the_depth_cap_refuses_a_whole_enqueue_that_would_pass_it(queue: q.SqlQueue) -> None:
    queue.enqueue([rec("a"), rec("b"), rec("c")])
    claim = queue.claim(1, lease_s=30)
    queue.ack(claim.lease_id, [claim.items[0].id])  # done: not counted
    queue.claim(1, lease_s=30)  # leased: counted
    assert cap(queue, 4).max_depth == 4

    with pytest.raises(errors.QueueFull) as refused:
        queue.enqueue([rec("d"), rec("e"), rec("f")])
    message = str(refused.value)
    assert "queue 'ctl' is at its depth cap (2 items ready or leased" in message
    assert "cap 4" in message
    assert "`batching queue cap ctl --max-depth N`" in message
    assert set(states(queue)) == {"a", "b", "c"}  # nothing of it went in

    assert queue.enqueue([rec("a"), rec("d"), rec("e")]).inserted == 2  # a: present, free
    assert queue.enqueue([rec("a"), rec("b")]).duplicates == ("a", "b")  # a retry at the cap
    with pytest.raises(errors.QueueFull):
        queue.enqueue([rec("f")])
    assert other(queue, "elsewhere").enqueue([rec("f")]).inserted == 1  # another queue

    cap(queue, None)
    assert queue.enqueue([rec("f")]).inserted == 1
    assert [(r.action, r.detail) for r in controls.audit(queue.engine, "ctl")] == [
        ("cap", {"max_depth": 4, "was": None}),
        ("cap", {"max_depth": None, "was": 4}),
    ]


def test_enqueue_each_admits_or_refuses_each_group_in_order_in_one_transaction(
    queue: q.SqlQueue,
) -> None:
    """The HTTP ingress's group write: a group past the cap (or its tenant's share) is rolled
    back alone; the groups after it go in while there is room; a key an earlier group wrote
    is a later group's duplicate; nothing is visible before the one commit."""
    queue.enqueue([rec("old")])
    cap(queue, 4)
    groups = [
        [rec("a"), rec("b")],
        [rec("c"), rec("d"), rec("e")],  # 1 + 2 + 3 > 4: refused whole
        [rec("c")],  # fits: 4
        [rec("a"), rec("old")],  # present keys do not count
        [rec("f")],  # 5 > 4
        [],
    ]
    out = queue.enqueue_each(groups, enqueue_run="grp")
    assert [o.inserted if isinstance(o, models.EnqueueResult) else "full" for o in out] == [
        2,
        "full",
        1,
        0,
        "full",
        0,
    ]
    assert isinstance(out[1], errors.QueueFull)
    assert "3 items ready or leased + at least 3 new > cap 4" in str(out[1])
    assert isinstance(out[3], models.EnqueueResult)
    assert out[3].duplicates == ("a", "old")
    assert set(states(queue)) == {"old", "a", "b", "c"}
    with queue.engine.connect() as conn:
        t = schema.items
        runs = conn.execute(sa.select(t.c.item_key, t.c.enqueue_run)).all()
        bodies = conn.execute(sa.select(sa.func.count()).select_from(schema.payloads)).scalar()
    assert dict(runs) == {"old": None, "a": "grp", "b": "grp", "c": "grp"}
    assert bodies == 4  # the refused groups' bodies rolled back with their rows

    cap(queue, 100)  # past half the cap, a tenant over its share is refused alone
    queue.enqueue([rec(f"x{i}", tenant="X") for i in range(50)])
    out = queue.enqueue_each([[rec("x-more", tenant="X")], [rec("y", tenant="Y")]])
    assert isinstance(out[0], errors.QueueFull)
    assert "tenant 'X' is at its share" in str(out[0])
    assert out[1] == models.EnqueueResult(1, ())


def test_enqueue_each_judges_each_group_by_its_own_tenants_share(queue: q.SqlQueue) -> None:
    """A group is judged as an enqueue of its own after the groups admitted before it: a
    request of tenant Y is not refused because tenant X's earlier request, admitted while X
    was alone, is past X's share once Y has items too."""
    cap(queue, 100)
    queue.enqueue([rec(f"x{i}", tenant="X") for i in range(40)])
    out = queue.enqueue_each(
        [[rec(f"x-more{i}", tenant="X") for i in range(15)], [rec("y", tenant="Y")]]
    )
    assert out == [models.EnqueueResult(15, ()), models.EnqueueResult(1, ())]
    # X is now past its share (55 > 100 / 2): its own next request is refused, Y's is not
    out = queue.enqueue_each([[rec("x-last", tenant="X")], [rec("y2", tenant="Y")]])
    assert isinstance(out[0], errors.QueueFull)
    assert "tenant 'X' is at its share" in str(out[0])
    assert out[1] == models.EnqueueResult(1, ())


def test_enqueue_each_rolls_back_a_large_group_and_writes_the_next(queue: q.SqlQueue) -> None:
    """Groups big enough for PostgreSQL's staging table (COPY, then a move that empties it):
    a refused group's rows leave neither the table nor the stage behind."""
    cap(queue, 150)
    out = queue.enqueue_each(
        [
            [rec(f"a{i}") for i in range(100)],
            [rec(f"b{i}") for i in range(80)],  # 180 > 150: refused
            [rec(f"c{i}") for i in range(50)],
        ]
    )
    assert isinstance(out[1], errors.QueueFull)
    assert [o.inserted for o in (out[0], out[2]) if isinstance(o, models.EnqueueResult)] == [
        100,
        50,
    ]
    keys = set(states(queue))
    assert len(keys) == 150
    assert not any(k.startswith("b") for k in keys)
    cap(queue, None)
    assert queue.enqueue([rec(f"b{i}") for i in range(80)]).inserted == 80  # the stage is clean
    assert len(states(queue)) == 230


def test_a_cap_passed_in_a_later_chunk_rolls_back_the_chunks_before(queue: q.SqlQueue) -> None:
    cap(queue, 1200)
    with pytest.raises(errors.QueueFull, match="at least 1500 new > cap 1200"):
        queue.enqueue(rec(f"k{i}") for i in range(1500))  # two chunks: 1000, then 500
    assert states(queue) == {}
    with pytest.raises(errors.InputError, match="depth cap must be 0"):
        cap(queue, -1)


def test_a_resend_is_accepted_past_a_cap_lowered_below_the_depth(queue: q.SqlQueue) -> None:
    """The runbook lowers a cap below the depth in an incident; producers retrying what is
    queued already must hear 'present', not 'full' (each told to retry, forever)."""
    queue.enqueue([rec(k) for k in "abcde"])
    cap(queue, 3)
    assert queue.enqueue([rec("a"), rec("b")]).duplicates == ("a", "b")
    with pytest.raises(errors.QueueFull):
        queue.enqueue([rec("a"), rec("f")])
    assert "f" not in states(queue)


def test_a_cap_of_zero_closes_intake_and_pause_leaves_enqueue_open(queue: q.SqlQueue) -> None:
    cap(queue, 0)
    with pytest.raises(errors.QueueFull):
        queue.enqueue([rec("a")])
    cap(queue, None)
    pause(queue)
    assert queue.enqueue([rec("a")], enqueue_run="r").inserted == 1
    with queue.engine.connect() as conn:
        t = schema.items
        assert conn.execute(sa.select(t.c.enqueue_run)).scalar_one() == "r"
    assert controls.states(queue.engine)["ctl"].paused


@pytest.mark.postgres
def test_capped_enqueues_on_postgresql_take_turns_and_count_each_other(pg_url: str) -> None:
    """Two enqueues of 5 on a queue capped at 6: the second waits for the first (an advisory
    lock), then counts its 5 and is refused. Without the turn both would count 0 and pass."""
    engine = database.create_engine(pg_url)
    first, second = q.SqlQueue(engine, "ctl"), q.SqlQueue(engine, "ctl")
    controls.set_max_depth(engine, "ctl", 6, actor="a", reason=None, now=1.0)
    holding, go = threading.Event(), threading.Event()

    def slow_records() -> Iterator[models.EnqueueRecord]:
        yield from (rec(f"a{i}") for i in range(5))
        holding.set()  # inside the first enqueue's transaction, its turn taken
        go.wait(30)

    outcome: dict[str, Any] = {}

    def enqueue(name: str, queue: q.SqlQueue, records: Any) -> None:
        try:
            outcome[name] = queue.enqueue(records).inserted
        except errors.QueueFull as exc:
            outcome[name] = exc

    threads = [threading.Thread(target=enqueue, args=("first", first, slow_records()))]
    threads[0].start()
    assert holding.wait(30)
    threads.append(
        threading.Thread(target=enqueue, args=("second", second, [rec(f"b{i}") for i in range(5)]))
    )
    threads[1].start()
    waiting = sa.text(  # the cap's turn (7271102, queue) in this database, waited for
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND classid = 7271102 AND database ="
        " (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    with engine.connect() as conn:
        wait_for(lambda: conn.execute(waiting).scalar_one(), what="the second enqueue to wait")
    go.set()
    for thread in threads:
        thread.join(30)
    engine.dispose()
    assert outcome["first"] == 5
    assert isinstance(outcome["second"], errors.QueueFull)
    assert "(5 items ready or leased + at least 5 new > cap 6)" in str(outcome["second"])


# ----------------------------------------------------------------------------- migration 13


def test_migration_13_adds_the_controls_to_a_populated_v12_database(queue: q.SqlQueue) -> None:
    queue.enqueue([rec("a"), rec("b")])
    done = queue.claim(1, lease_s=30)
    queue.ack(done.lease_id, [done.items[0].id])
    queue.purge(-1, archive=True)  # the archive has a row too
    with queue.engine.begin() as conn:  # rewind to version 12
        for sql in (
            "DROP TABLE batching_queue_controls",
            "DROP TABLE batching_queue_audit",
            "DROP INDEX ix_batching_items_cancelled",
            "ALTER TABLE batching_items DROP COLUMN enqueue_run",
            "ALTER TABLE batching_items_archive DROP COLUMN enqueue_run",
        ):
            conn.execute(sa.text(sql))
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 13))
    with pytest.raises(errors.SchemaError, match=f"version 12, expected {schema.SCHEMA_VERSION}"):
        queue.check_schema()

    result = queue.migrate()
    assert (result.from_version, result.to_version) == (12, schema.SCHEMA_VERSION)
    assert queue.migrate().applied is False
    with queue.engine.connect() as conn:
        inspector = sa.inspect(conn)
        assert {"batching_queue_controls", "batching_queue_audit"} <= set(
            inspector.get_table_names()
        )
        for table in ("batching_items", "batching_items_archive"):
            assert "enqueue_run" in {c["name"] for c in inspector.get_columns(table)}
        indexes = {str(ix["name"]) for ix in inspector.get_indexes("batching_items")}
        assert "ix_batching_items_cancelled" in indexes
        t = schema.items
        assert conn.execute(sa.select(t.c.enqueue_run).where(t.c.item_key == "b")).one() == (None,)
    pause(queue)
    assert queue.claim(1, lease_s=30).paused
    controls.resume(queue.engine, "ctl", actor="a", reason=None, now=queue.clock())
    assert [i.item_key for i in queue.claim(1, lease_s=30).items] == ["b"]


# ----------------------------------------------------------------------------- a real scorer


def test_a_scorer_paused_mid_run_finishes_its_batches_waits_and_resumes(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    """A long-running `batching score` process: the pause lets what it holds commit, then it
    claims nothing (it keeps polling); after the resume it scores the rest, each item once."""
    from tests.integration.test_pipeline import assert_done_once, slow_w1_queue, wait_for_done

    n = 2000  # a run long enough that a loaded machine cannot finish it before the pause
    path, config = slow_w1_queue(sqlite_url, tmp_path, n)
    proc = score_process(path, "--max-seconds", "300")
    wait_for_done(sqlite_url, 50, proc)
    engine = database.create_engine(sqlite_url)
    watch = q.SqlQueue(engine, config.queue.name)
    try:
        controls.pause(engine, watch.queue, actor="drill", reason="pause mid-run", now=time.time())
        wait_for(lambda: watch.stats().by_state["leased"] == 0, what="in-flight batches to finish")
        paused = watch.stats().by_state
        assert paused["ready"] > 0, "the run finished before the pause; nothing tested"
        time.sleep(1.0)  # 20 polls of the scorer (poll_s 0.05): none may claim
        assert watch.stats().by_state == paused
        assert proc.poll() is None, "the run ended instead of waiting"

        controls.resume(engine, watch.queue, actor="drill", reason=None, now=time.time())
        wait_for_done(sqlite_url, n, proc)
    finally:
        engine.dispose()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "queue paused; waiting for `batching queue resume`" in stderr  # --max-seconds: waits
    assert_done_once(sqlite_url, tmp_path / "outputs", {f"w1-{i}" for i in range(n)})
    engine = database.create_engine(sqlite_url)
    with engine.connect() as conn:
        attempts = set(conn.execute(sa.select(schema.items.c.attempts).distinct()).scalars())
    engine.dispose()
    assert attempts == {1}, "an item was claimed twice"


def test_past_half_its_cap_a_tenant_over_its_share_is_refused_and_the_others_are_not(
    queue: q.SqlQueue, clock: FakeClock
) -> None:
    """A flooding tenant takes what it likes of an empty queue, but cannot take the room the
    other tenants' shares keep for them."""
    controls.set_max_depth(queue.engine, "ctl", 100, actor="ops", reason="backpressure", now=1.0)
    queue.enqueue([rec(f"a{i}", tenant="A") for i in range(80)])  # alone: the whole cap is A's
    queue.enqueue([rec(f"b{i}", tenant="B") for i in range(10)])  # B under its half
    with pytest.raises(errors.QueueFull, match=r"tenant .A. is at its share .*\(80 items"):
        queue.enqueue([rec("a-more", tenant="A")])
    queue.enqueue([rec(f"b-more{i}", tenant="B") for i in range(10)])  # B's share keeps room
    assert "a-more" not in states(queue)
    assert sum(k.startswith("b") for k in states(queue)) == 20
    with pytest.raises(errors.QueueFull, match="at its depth cap"):  # the cap itself still holds
        queue.enqueue([rec(f"b-last{i}", tenant="B") for i in range(11)])


def test_weights_set_the_shares_of_the_cap(db_url: str, clock: FakeClock) -> None:
    engine = database.create_engine(db_url)
    weighted = q.SqlQueue(engine, "ctl", clock=clock, tenant_weights={"A": 3.0})
    controls.set_max_depth(engine, "ctl", 100, actor="ops", reason="backpressure", now=1.0)
    weighted.enqueue([rec(f"b{i}", tenant="B") for i in range(20)])
    weighted.enqueue([rec(f"a{i}", tenant="A") for i in range(75)])  # 3/4 of the cap is A's
    with pytest.raises(errors.QueueFull, match="tenant 'A'"):
        weighted.enqueue([rec("a-more", tenant="A")])
    weighted.enqueue([rec(f"b-more{i}", tenant="B") for i in range(5)])  # B up to its 25
    engine.dispose()


def test_enqueue_each_refuses_a_group_holding_another_tenants_key_whole(
    queue: q.SqlQueue,
) -> None:
    """Whose key it is, is judged in the writing transaction: a group with a key another
    tenant holds is rolled back whole with ``KeyTaken`` (none of its other items written),
    while the owner's own repeat of the key is an ordinary duplicate. A check read before
    the transaction could be overtaken by another API process, and the request half written."""
    queue.enqueue([rec("theirs", tenant="B"), rec("mine", tenant="A")])
    out = queue.enqueue_each(
        [
            [rec("new-1", tenant="A"), rec("theirs", tenant="A")],  # refused whole
            [rec("mine", tenant="A"), rec("new-2", tenant="A")],  # its own key: a duplicate
            [rec("new-2", tenant="B")],  # taken by the group before, in this transaction
            [rec("theirs", tenant="B")],
        ]
    )
    assert isinstance(out[0], errors.KeyTaken)
    assert (out[0].key, str(out[0])) == (
        "theirs",
        "item_key 'theirs' is taken in queue 'ctl'; use another key",
    )
    assert out[1] == models.EnqueueResult(1, ("mine",))
    assert isinstance(out[2], errors.KeyTaken)
    assert out[3] == models.EnqueueResult(0, ("theirs",))
    with queue.engine.connect() as conn:
        t = schema.items
        rows = dict(conn.execute(sa.select(t.c.item_key, t.c.tenant)).all())
    assert rows == {"theirs": "B", "mine": "A", "new-2": "A"}


def test_a_refused_group_of_several_keys_leaves_the_connection_fresh(
    queue: q.SqlQueue, db_url: str
) -> None:
    """A group refused for another tenant's keys (several of them: the read found more rows
    than it had looked at) must not leave its read open: the refusal, kept by the caller as
    the API keeps it, held the cursor, the connection stayed on its old snapshot, and on
    SQLite every write after another process's commit failed "database is locked"."""
    keys = [f"k{i}" for i in range(5)]
    queue.enqueue([rec(k, tenant="A") for k in keys])
    out = queue.enqueue_each([[rec(k, tenant="B") for k in keys]])
    assert isinstance(out[0], errors.KeyTaken)
    other_process = database.create_engine(db_url)
    try:
        with other_process.begin() as conn:  # someone else commits meanwhile (a scorer)
            conn.execute(sa.update(schema.items).values(priority=schema.items.c.priority))
    finally:
        other_process.dispose()
    after = queue.enqueue_each([[rec("later", tenant="B")]])
    assert after == [models.EnqueueResult(1, ())]
    assert out[0].key == "k0"  # the refusal is still held here


# ----------------------------------------------------------------------------- migration 17


def test_migration_17_indexes_failed_items_and_counts_stay_the_same(queue: q.SqlQueue) -> None:
    """Dead and expired items get a partial index, so the live counts (a scrape's) never
    read the done items; counts of a v16 database with items of every kind are unchanged."""
    queue.enqueue([rec("a"), rec("b"), rec("c")])
    dead = queue.claim(1, lease_s=30)
    queue.fail(dead.lease_id, {dead.items[0].id: "boom"}, retry=False)
    done = queue.claim(1, lease_s=30)
    queue.ack(done.lease_id, [done.items[0].id])
    before = queue.stats()
    with queue.engine.begin() as conn:  # rewind to version 16
        conn.execute(sa.text("DROP INDEX ix_batching_items_failed"))
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 17))
    with pytest.raises(errors.SchemaError, match=f"version 16, expected {schema.SCHEMA_VERSION}"):
        queue.check_schema()

    result = queue.migrate()
    assert (result.from_version, result.to_version) == (16, schema.SCHEMA_VERSION)
    assert queue.migrate().applied is False
    with queue.engine.connect() as conn:
        names = {ix["name"] for ix in sa.inspect(conn).get_indexes("batching_items")}
    assert "ix_batching_items_failed" in names
    assert queue.stats() == before
    assert queue.stats(done=False).by_state == {
        "ready": 1,
        "leased": 0,
        "dead": 1,
        "expired": 0,
        "cancelled": 0,
    }
