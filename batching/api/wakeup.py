"""Long polls answered from the commit that woke them: one reader for every waiting request.

A long poll (``GET ...?wait_s=N``, or a POST with ``wait_s``) must not hold a thread while it
waits (the threadpool, about 40 threads, would run out under load and starve the POSTs), and
must not read its own item on every commit: with hundreds waiting, each commit would cost
hundreds of reads, and the API process would spend its core re-reading items that did not
change. So each request registers its key and awaits a future; one thread, the
:class:`Waiters`' own, waits on the process's ``batching.ingress.watch.CommitWatch``
and, after each change it sees, asks the database once which of the waiting keys are final
(``Results.finished``: one read of the items, one read of each batch's output). It resolves
those requests and leaves the rest waiting.

A request registers *before* its first read. A commit that read missed landed after the
registration, so its change is seen after it too, and the pass that change starts includes
the request (the thread takes the watch's mark before it snapshots the waiting keys, the
mark-read-wait loop of ``watch``). ``backstop_s`` bounds what a missed change costs: on
PostgreSQL only acks notify, so an item that goes dead, expires or is cancelled is found by
the pass every ``backstop_s``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from batching import errors
from batching.api.results import ItemView

logger = logging.getLogger(__name__)

MIN_GAP_S = 0.005
"""The shortest time between two passes: commits closer than that share one read."""
Finished = Callable[[str, Sequence[str]], Mapping[str, ItemView]]
"""``Results.finished``: the final items of (queue, keys), by key."""
Acked = Callable[[], object]
"""``Results.acked``: a mark that changes when a batch commits (None: unknown, read)."""


class Watch(Protocol):
    """What the waiters use of :class:`~batching.ingress.watch.CommitWatch`."""

    def mark(self) -> int: ...
    def wait(self, timeout_s: float, *, since: int | None = None) -> bool: ...
    def close(self) -> None: ...


class Waiters:
    """Requests waiting for items to become final, answered by one thread.

    Args:
        finished: reads the final items among (queue, keys) (``Results.finished``).
        acked: a wake-up whose mark is unchanged is skipped until the backstop
            (``Results.acked``).
        watch: wakes the thread on commit; None: a pass every ``backstop_s`` only.
        backstop_s: the longest time between two passes while anyone waits.
        min_gap_s: the shortest (under a stream of commits, a read per commit would cost
            more than it saves).
    """

    def __init__(
        self,
        finished: Finished,
        watch: Watch | None,
        *,
        acked: Acked | None = None,
        backstop_s: float = 0.5,
        min_gap_s: float = MIN_GAP_S,
    ) -> None:
        self.backstop_s, self.min_gap_s = backstop_s, min_gap_s
        self.passes = 0  # reads made (for tests and logs)
        self._finished = finished
        self._acked = acked
        self._watch = watch
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, str], list[concurrent.futures.Future[ItemView]]] = {}
        self._demand = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="waiters", daemon=True)
        self._thread.start()

    def register(self, queue: str, key: str) -> concurrent.futures.Future[ItemView]:
        """Wait for ``key`` of ``queue``: call BEFORE reading the item; the future resolves
        with the item once final. ``cancel`` it when the request stops waiting."""
        future: concurrent.futures.Future[ItemView] = concurrent.futures.Future()
        with self._lock:
            self._waiting.setdefault((queue, key), []).append(future)
            self._demand.notify()
        return future

    def cancel(self, queue: str, key: str, future: concurrent.futures.Future[ItemView]) -> None:
        """Stop waiting (the request ends: answered, timed out or gone)."""
        future.cancel()
        with self._lock:
            held = self._waiting.get((queue, key))
            if held is not None:
                held[:] = [f for f in held if f is not future]
                if not held:
                    del self._waiting[(queue, key)]

    def close(self) -> None:
        """Stop the thread and the watch; pending futures are cancelled."""
        with self._lock:
            self._closed = True
            self._demand.notify()
            pending = [f for held in self._waiting.values() for f in held]
            self._waiting.clear()
        for future in pending:
            future.cancel()
        if self._watch is not None:
            self._watch.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _snapshot(self) -> dict[str, list[str]]:
        with self._lock:
            keys: dict[str, list[str]] = {}
            for queue, key in self._waiting:
                keys.setdefault(queue, []).append(key)
            return keys

    def _run(self) -> None:
        gen = self._watch.mark() if self._watch is not None else 0
        acked: object = None
        last = 0.0  # when the last pass read
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._demand.wait()
                if self._closed:
                    return
            if self._watch is not None:
                try:
                    self._watch.wait(self.backstop_s, since=gen)
                    gen = self._watch.mark()  # before the snapshot: see module docstring
                except Exception:  # the backstop still ends the waits
                    logger.warning("commit watch failed; long polls re-read", exc_info=True)
            else:
                with self._lock:
                    self._demand.wait(self.backstop_s)
            started = time.monotonic()
            if self._acked is not None:
                try:
                    seen, acked = acked, self._acked()
                except Exception:  # read anyway: the pass reports what fails
                    seen = acked = None
                if acked is not None and acked == seen and started - last < self.backstop_s:
                    continue  # nothing finished since the last pass
            last = started
            self._pass()
            with self._lock:  # closing ends the gap
                self._demand.wait_for(
                    lambda: self._closed, self.min_gap_s - (time.monotonic() - started)
                )

    def _pass(self) -> None:
        for queue, keys in self._snapshot().items():
            self._read(queue, keys)

    def _read(self, queue: str, keys: Sequence[str]) -> None:
        """One read of ``keys``; the items found final answer their requests. A read that
        fails fails the requests waiting on what failed, not every request of the queue: an
        output that cannot be read (one batch's file gone) is looked for by halves, so one
        tenant's broken item never answers another tenant's poll. The database failing
        fails them all at once (every half would fail the same)."""
        try:
            found = self._finished(queue, keys)
        except errors.QueueError as exc:
            self._fail(queue, keys, exc)
            return
        except Exception as exc:  # the waiting requests answer it (503), one line each
            if len(keys) == 1:
                self._fail(queue, keys, exc)
                return
            half = len(keys) // 2
            self._read(queue, keys[:half])
            self._read(queue, keys[half:])
            return
        self.passes += 1
        with self._lock:
            ready = [(f, found[k]) for k in found for f in self._waiting.pop((queue, k), ())]
        for future, view in ready:
            if not future.cancelled():
                future.set_result(view)

    def _fail(self, queue: str, keys: Sequence[str], exc: Exception) -> None:
        """A failed read fails the requests waiting then (503 with its message)."""
        with self._lock:
            failed = [f for k in keys for f in self._waiting.pop((queue, k), ())]
        for future in failed:
            if not future.cancelled():
                future.set_exception(exc)
