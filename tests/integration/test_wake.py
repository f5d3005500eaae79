"""Wake-ups on commit: a SQLite scorer wakes on another connection's enqueue (``PRAGMA
data_version``), not after ``poll_s``; ``CommitWatch`` wakes long-polling readers on a commit
on both databases, and times out when nothing commits.

No timed assertions: the backstops (``poll_s``, wait timeouts) are set far beyond what a
wake-up takes, so only a wake-up can make these pass in time.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import models
from batching.compose import run as wiring
from batching.ingress import queue as q
from batching.ingress import watch
from batching.loop import stats as run_stats
from batching.store import database, schema
from tests.conftest import REPO
from tests.integration.test_pipeline import load

BACKSTOP_S = 60.0  # poll_s and wait timeouts: far past any wake-up


def rec(key: str) -> models.EnqueueRecord:
    return models.EnqueueRecord(key, models.Payload(b'{"x": 1}'))


def enqueue_from(url: str, queue: str, key: str) -> None:
    """Enqueue on a connection of its own (its own engine)."""
    engine = database.create_engine(url)
    q.SqlQueue(engine, queue).enqueue([rec(key)])
    engine.dispose()


def ack_from(url: str, queue: str, key: str) -> None:
    """Enqueue, claim and ack one item on a connection of its own."""
    engine = database.create_engine(url)
    other = q.SqlQueue(engine, queue)
    other.enqueue([rec(key)])
    claim = other.claim(1, lease_s=60)
    assert other.ack(claim.lease_id, [i.id for i in claim.items]) == 1
    engine.dispose()


def test_a_sqlite_waiter_wakes_on_another_connections_commit(sqlite_url: str) -> None:
    engine = database.create_engine(sqlite_url)
    waiter = q.Waiter(engine, "wake")
    assert waiter.wait(0.05) is False  # nothing committed: the timeout
    timer = threading.Timer(0.2, enqueue_from, (sqlite_url, "wake", "k"))
    timer.start()
    assert waiter.wait(BACKSTOP_S) is True
    timer.join()
    waiter.close()
    engine.dispose()


def test_a_sqlite_waiter_sleeps_through_commits_that_bring_its_queue_no_work(
    sqlite_url: str,
) -> None:
    """Another queue's enqueue, or acks and heartbeats, change the file but leave nothing
    to claim here: the scorer is not woken to claim nothing."""
    engine = database.create_engine(sqlite_url)
    waiter = q.Waiter(engine, "mine")
    enqueue_from(sqlite_url, "theirs", "k")
    assert waiter.wait(0.3) is False
    enqueue_from(sqlite_url, "mine", "k")
    assert waiter.wait(BACKSTOP_S) is True
    waiter.close()
    engine.dispose()


PRODUCER = """
import sys
from batching.ingress import ingest, queue as q
from batching.store import database
engine = database.create_engine(sys.argv[1])
record = ingest.record_from_mapping({"item_key": "late", "payload": {"x": [0.5] * 64}}, "late")
q.SqlQueue(engine, sys.argv[2]).enqueue([record])
engine.dispose()
"""


def score_one_in_thread(
    config: Any, url: str, tmp_path: Path, on_scorer: Any
) -> tuple[threading.Thread, list[wiring.ScoreOutcome]]:
    """A long-running scorer (``max_items=1``) on a thread; its outcome lands in the list."""
    outcome: list[wiring.ScoreOutcome] = []
    run = threading.Thread(
        target=lambda: outcome.append(
            wiring.run_score(
                config,
                db_url=url,
                output=str(tmp_path / "outputs"),
                limits=run_stats.RunLimits(until_empty=False, max_items=1),
                on_scorer=on_scorer,
            )
        ),
        daemon=True,
    )
    run.start()
    return run, outcome


def produce(url: str, queue: str) -> None:
    """Enqueue the item ``late`` from another process."""
    subprocess.run(
        [sys.executable, "-c", PRODUCER, url, queue], check=True, cwd=REPO, timeout=BACKSTOP_S
    )


def test_a_waiting_sqlite_scorer_scores_another_processs_item_before_poll_s(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Long-running mode on SQLite: the scorer found the queue empty and waits with poll_s
    at 60 s; an item enqueued by another process commits long before a poll would claim it
    (low-load latency is the window plus the service time, not the poll interval)."""
    config = load("tabular.yaml", tmp_path, queue={"poll_s": BACKSTOP_S})
    waiting = threading.Event()

    def watch_the_wait(scorer: Any) -> None:
        wait = scorer._wait

        def marked(timeout_s: float) -> object:
            waiting.set()
            return wait(timeout_s)

        scorer._wait = marked

    run, outcome = score_one_in_thread(config, sqlite_url, tmp_path, watch_the_wait)
    assert waiting.wait(BACKSTOP_S), "the scorer never waited for work"
    produce(sqlite_url, config.queue.name)
    run.join(BACKSTOP_S / 2)  # a poll would claim the item only after BACKSTOP_S
    assert not run.is_alive(), "the enqueue did not wake the scorer"
    assert outcome[0].summary["items_committed"] == 1
    engine = database.create_engine(sqlite_url)
    with engine.connect() as conn:
        state = conn.execute(
            sa.select(schema.items.c.state).where(schema.items.c.item_key == "late")
        ).scalar_one()
    engine.dispose()
    assert state == models.State.DONE


@pytest.mark.postgres
@pytest.mark.parametrize("poll_s", [BACKSTOP_S, 0.05])
def test_an_idle_postgres_scorer_claims_ever_less_often_and_wakes_on_a_notify(
    pg_url: str, tmp_path: Path, poll_s: float
) -> None:
    """Long-running mode on PostgreSQL: a scorer that keeps finding nothing claims ever less
    often (poll_s doubling up to idle_poll_max_s: ~10 claims in 3 s, not 60), and another
    process's enqueue still wakes it at once by its NOTIFY (with poll_s at 60 s, only the
    NOTIFY can end the run in time)."""
    config = load(
        "tabular.yaml", tmp_path, queue={"poll_s": poll_s, "idle_poll_max_s": max(poll_s, 0.4)}
    )
    claims: list[float] = []
    waiting = threading.Event()

    def count(scorer: Any) -> None:
        claim, wait = scorer._claim, scorer._wait

        def counted(limits: Any) -> object:
            claims.append(time.monotonic())
            return claim(limits)

        def marked(timeout_s: float) -> object:
            waiting.set()
            return wait(timeout_s)

        scorer._claim, scorer._wait = counted, marked

    run, outcome = score_one_in_thread(config, pg_url, tmp_path, count)
    assert waiting.wait(BACKSTOP_S), "the scorer never waited for work"
    time.sleep(3.0)
    idle_claims = len(claims)
    assert idle_claims <= 12, idle_claims  # every poll_s (0.05 s) would be ~60
    produce(pg_url, config.queue.name)
    run.join(BACKSTOP_S / 2)
    assert not run.is_alive(), "the enqueue did not wake the scorer"
    assert outcome[0].summary["items_committed"] == 1


def test_a_commit_watch_wakes_every_waiting_reader_on_a_commit(db_url: str) -> None:
    """SQLite: any commit to the file; PostgreSQL: an ack of the watched queue."""
    engine = database.create_engine(db_url)
    commit_watch = watch.CommitWatch(engine, "read")
    woke: list[bool] = []
    started = threading.Barrier(4)

    def reader() -> None:
        mark = commit_watch.mark()
        started.wait()
        woke.append(commit_watch.wait(BACKSTOP_S, since=mark))

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    started.wait()
    ack_from(db_url, "read", "k")
    for t in readers:
        t.join(BACKSTOP_S)
    assert woke == [True, True, True]
    commit_watch.close()
    engine.dispose()


def test_a_commit_watch_times_out_when_nothing_commits(db_url: str) -> None:
    engine = database.create_engine(db_url)
    commit_watch = watch.CommitWatch(engine, "read")
    assert commit_watch.wait(0.2) is False
    if engine.dialect.name == "postgresql":  # another queue's ack is not this queue's change
        ack_from(db_url, "other", "k")
        assert commit_watch.wait(0.3) is False
    commit_watch.close()
    assert commit_watch.wait(BACKSTOP_S) is False  # closed: returns at once
    engine.dispose()


def test_a_commit_between_the_mark_and_the_wait_is_not_missed(db_url: str) -> None:
    """The reader's mark-read-wait loop: a commit landing after its mark (say, between
    its read and its wait) makes the wait return at once."""
    engine = database.create_engine(db_url)
    commit_watch = watch.CommitWatch(engine, "read")
    mark = commit_watch.mark()
    ack_from(db_url, "read", "k")
    assert commit_watch.wait(BACKSTOP_S, since=mark) is True
    commit_watch.close()
    engine.dispose()


@pytest.mark.postgres
def test_an_ack_notifies_only_when_it_commits(pg_url: str) -> None:
    """The NOTIFY is sent in the ack's transaction: rolled back, nobody wakes."""
    engine = database.create_engine(pg_url)
    commit_watch = watch.CommitWatch(engine, "read")
    mark = commit_watch.mark()
    queue = q.SqlQueue(engine, "read")
    queue.enqueue([rec("k")])
    claim = queue.claim(1, lease_s=60)
    with engine.connect() as conn:
        tx = conn.begin()
        assert queue.ack(claim.lease_id, [i.id for i in claim.items], conn=conn) == 1
        tx.rollback()
    assert commit_watch.wait(0.5, since=mark) is False
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 1
    assert commit_watch.wait(BACKSTOP_S, since=mark) is True
    commit_watch.close()
    engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("final", ["dead", "expired", "overdue"])
def test_an_item_made_dead_or_expired_wakes_a_commit_watch(pg_url: str, final: str) -> None:
    """A long-polling reader of an item waits for it to be final: dead (failed past its
    attempts) and expired (predicted late, or past its deadline before a claim) wake it as
    an ack does, not only its timeout."""
    engine = database.create_engine(pg_url)
    commit_watch = watch.CommitWatch(engine, "read")
    queue = q.SqlQueue(engine, "read")
    deadline = time.time() + (0.5 if final == "overdue" else 3600)
    queue.enqueue([models.EnqueueRecord("k", models.Payload(b'{"x": 1}'), deadline_at=deadline)])
    claim = queue.claim(1, lease_s=60) if final != "overdue" else None
    mark = commit_watch.mark()
    assert commit_watch.wait(0.3, since=mark) is False  # nothing final yet
    if claim is not None and final == "dead":
        assert queue.fail(claim.lease_id, {claim.items[0].id: "boom"}, retry=False).dead == 1
    elif claim is not None:
        assert queue.expire(claim.lease_id, {claim.items[0].id: "predicted late"}) == 1
    else:
        time.sleep(0.6)
        assert queue.claim(1, lease_s=60).expired == (("default", 1),)  # the claim's sweep
    assert commit_watch.wait(BACKSTOP_S, since=mark) is True
    commit_watch.close()
    engine.dispose()


def test_a_sqlite_commit_watch_idle_between_readers_still_wakes_the_next(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nobody waiting its thread stops reading data_version; the next reader starts it
    again, and a commit then wakes that reader."""
    monkeypatch.setattr(watch, "LINGER_S", 0.05)
    engine = database.create_engine(sqlite_url)
    commit_watch = watch.CommitWatch(engine)
    assert commit_watch.wait(0.1) is False
    enqueue_from(sqlite_url, "read", "before")  # while parked: absorbed by the next mark
    threading.Event().wait(0.2)  # past the linger: parked
    mark = commit_watch.mark()
    assert commit_watch.wait(0.1, since=mark) is False  # "before" was seen by the mark
    timer = threading.Timer(0.2, enqueue_from, (sqlite_url, "read", "after"))
    timer.start()
    assert commit_watch.wait(BACKSTOP_S, since=mark) is True
    timer.join()
    commit_watch.close()
    engine.dispose()
