"""``wakeup.Waiters``: one reader answers every waiting request, with fakes for the database
(``finished``, ``acked``) and no commit watch (a pass every ``backstop_s``)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Mapping, Sequence

import pytest

from batching import errors, models
from batching.api.results import ItemView
from batching.api.wakeup import Waiters


def view(key: str, state: models.State = models.State.DONE) -> ItemView:
    return ItemView(key, 1, state, "alpha", result={"output": [1.0]})


class Store:
    """What the database says: the final items, a mark, and the reads made."""

    def __init__(self) -> None:
        self.final: dict[tuple[str, str], ItemView] = {}
        self.mark = 0
        self.reads: list[tuple[str, tuple[str, ...]]] = []
        self.fail: Exception | None = None
        self.broken: set[str] = set()  # keys whose output cannot be read (SinkError)
        self.lock = threading.Lock()

    def finished(self, queue: str, keys: Sequence[str]) -> Mapping[str, ItemView]:
        with self.lock:
            self.reads.append((queue, tuple(sorted(keys))))
            if self.fail is not None:
                raise self.fail
            if self.broken.intersection(keys):
                raise errors.SinkError("batch b1: its file /srv/out/part-b1.parquet is missing")
            return {k: self.final[(queue, k)] for k in keys if (queue, k) in self.final}

    def acked(self) -> int:
        return self.mark

    def finish(self, queue: str, key: str) -> None:
        with self.lock:
            self.final[(queue, key)] = view(key)
            self.mark += 1


@pytest.fixture
def store() -> Store:
    return Store()


def waiters_of(store: Store, backstop_s: float = 0.01) -> Waiters:
    return Waiters(store.finished, None, backstop_s=backstop_s, min_gap_s=0.0)


def test_one_read_answers_every_request_waiting_on_a_queue(store: Store) -> None:
    waiters = waiters_of(store, backstop_s=0.05)
    try:
        futures = {k: waiters.register("q", k) for k in ("a", "b", "c")}
        twice = waiters.register("q", "a")  # two requests for one key: both answered
        store.finish("q", "a")
        store.finish("q", "c")
        assert futures["a"].result(5).item_key == "a"
        assert twice.result(5).item_key == "a"
        assert futures["c"].result(5).state is models.State.DONE
        assert not futures["b"].done()
        # Each read asks for every key waiting then, in one call (not one a request).
        assert all(keys in {("a", "b", "c"), ("b",)} for _, keys in store.reads), store.reads
    finally:
        waiters.close()
    assert futures["b"].cancelled()  # closing cancels what still waits


def test_queues_are_read_apart_and_a_cancelled_wait_is_read_no_more(store: Store) -> None:
    waiters = waiters_of(store)
    try:
        mine = waiters.register("q1", "k")
        other = waiters.register("q2", "k")
        waiters.cancel("q2", "k", other)
        store.finish("q1", "k")
        assert mine.result(5).item_key == "k"
        assert other.cancelled()
        reads = list(store.reads)
    finally:
        waiters.close()
    assert {q for q, _ in reads} <= {"q1", "q2"}
    assert ("q1", ("k",)) in reads
    last_q2 = max((i for i, (q, _) in enumerate(reads) if q == "q2"), default=-1)
    assert last_q2 < reads.index(("q1", ("k",))) + 2  # q2 is no longer read once cancelled


class Watch:
    """A commit watch the test bumps."""

    def __init__(self) -> None:
        self.gen = 0
        self.cond = threading.Condition()

    def mark(self) -> int:
        with self.cond:
            return self.gen

    def wait(self, timeout_s: float, *, since: int | None = None) -> bool:
        with self.cond:
            start = self.gen if since is None else since
            return self.cond.wait_for(lambda: self.gen != start, timeout_s)

    def bump(self) -> None:
        with self.cond:
            self.gen += 1
            self.cond.notify_all()

    def close(self) -> None:
        pass


def test_a_commit_that_acked_nothing_costs_no_read_until_the_backstop(store: Store) -> None:
    watch = Watch()
    waiters = Waiters(store.finished, watch, acked=store.acked, backstop_s=30.0, min_gap_s=0.0)
    try:
        future = waiters.register("q", "k")
        watch.bump()
        deadline = threading.Event()
        while not store.reads and not deadline.wait(0.01):
            pass
        first = len(store.reads)
        for _ in range(20):  # enqueues, claims, heartbeats: commits that finish nothing
            watch.bump()
            deadline.wait(0.005)
        assert len(store.reads) == first == 1
        store.finish("q", "k")  # an ack: the mark moves, the next wake-up reads
        watch.bump()
        assert future.result(5).item_key == "k"
        assert len(store.reads) == 2
    finally:
        waiters.close()


def test_a_failed_read_fails_the_requests_waiting_then(store: Store) -> None:
    store.fail = RuntimeError("database is locked")
    waiters = waiters_of(store)
    try:
        future = waiters.register("q", "k")
        with pytest.raises(RuntimeError, match="locked"):
            future.result(5)
        store.fail = None
        later = waiters.register("q", "k")
        store.finish("q", "k")
        assert later.result(5).item_key == "k"
    finally:
        waiters.close()


def test_an_output_that_cannot_be_read_fails_only_the_requests_waiting_on_it(
    store: Store,
) -> None:
    """One batch's file gone fails the polls of its items, not every poll of the queue (other
    tenants' among them): a failed read is tried again by halves. A database error fails
    every request waiting then, in one read."""
    store.broken.add("bad")
    store.finish("q", "done")
    waiters = waiters_of(store, backstop_s=0.05)
    try:
        waiting = {k: waiters.register("q", k) for k in ("w1", "bad", "done", "w2", "w3")}
        with pytest.raises(errors.SinkError, match="missing"):
            waiting["bad"].result(5)
        assert waiting["done"].result(5).item_key == "done"
        store.finish("q", "w2")
        assert waiting["w2"].result(5).item_key == "w2"
        assert not any(waiting[k].done() for k in ("w1", "w3"))

        with store.lock:
            reads = len(store.reads)
            store.fail = errors.QueueError("database is locked")
        with pytest.raises(errors.QueueError):
            waiting["w1"].result(5)
        with pytest.raises(errors.QueueError):
            waiting["w3"].result(5)
        assert store.reads[reads] == ("q", ("w1", "w3"))  # one read failed them both
    finally:
        waiters.close()


def test_close_cancels_what_waits_and_stops_the_thread(store: Store) -> None:
    waiters = waiters_of(store, backstop_s=10.0)
    future: concurrent.futures.Future[ItemView] = waiters.register("q", "k")
    waiters.close()
    assert future.cancelled()
    assert not waiters._thread.is_alive()


def test_a_waiting_post_whose_result_cannot_be_read_leaves_no_unretrieved_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The 503 comes from the item's future; the asyncio wrapper the POST waited on holds the
    same error, and unread it was logged with a traceback ("Future exception was never
    retrieved") when collected."""
    import asyncio
    import gc
    import time

    from batching.api import app

    items = [{"item_key": "k", "state": "ready"}]

    async def post() -> None:  # the item's future lives here: its done-callbacks hold the wrapper
        failed: concurrent.futures.Future[ItemView] = concurrent.futures.Future()
        waiting = asyncio.ensure_future(
            app._finals(None, "q", items, {"k": failed}, time.monotonic() + 5)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0)  # the POST is waiting on the wrapper
        failed.set_exception(errors.SinkError("the item's output cannot be read now"))
        try:  # not pytest.raises: its traceback would keep the wrapper alive past gc below
            await waiting
        except errors.SinkError:
            return
        pytest.fail("the POST's read did not fail")

    asyncio.run(post())
    gc.collect()
    assert "never retrieved" not in caplog.text
