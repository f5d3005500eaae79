"""Long polls that wake on commit: one :class:`~batching.ingress.watch.CommitWatch` per
process, fanned out to the event loop.

A long poll (``GET ...?wait_s=N``) must not hold a thread while it waits: the threadpool
(about 40 threads) would run out under load and starve the POSTs. So one thread waits on the
watch, and only while some request waits (the SQLite watch reads ``data_version`` every few
milliseconds while anyone waits); each change it sees replaces an :class:`asyncio.Event`
and sets the old one, waking every request that holds it.

A request takes its ticket (the current event) *before* it reads the item, then awaits that
ticket: a commit after the read sets it. The thread marks the watch's generation before it
fires, so a commit between the fire and the next wait is seen by that wait, and one before
the mark is already visible to every read that follows the fire. ``backstop_s`` bounds what
a missed change costs (an item that goes dead or expires wakes no PostgreSQL listener: only
acks notify).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from batching.ingress.watch import CommitWatch

logger = logging.getLogger(__name__)


class CommitSignal:
    """The watch's changes as asyncio events for the requests of one event loop."""

    def __init__(self, watch: CommitWatch, *, backstop_s: float = 0.5) -> None:
        self.backstop_s = backstop_s
        self._watch = watch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()
        self._waiting = 0  # requests awaiting a ticket (the event loop's thread only)
        self._demand = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commit-signal", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start watching for the requests of ``loop`` (the application's start-up)."""
        self._loop = loop
        self._thread.start()

    def ticket(self) -> asyncio.Event:
        """Take before reading the item; await it with :meth:`wait` after."""
        return self._event

    async def wait(self, ticket: asyncio.Event, timeout_s: float) -> None:
        """Return once a commit after ``ticket`` was taken is seen, or after ``timeout_s``
        (at most ``backstop_s``)."""
        self._waiting += 1
        self._demand.set()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ticket.wait(), min(timeout_s, self.backstop_s))
        finally:
            self._waiting -= 1
            if not self._waiting:
                self._demand.clear()

    def close(self) -> None:
        """Stop the thread and the watch (the application's shutdown)."""
        self._closed.set()
        self._demand.set()
        self._watch.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        gen = self._watch.mark()
        while not self._closed.is_set():
            if not self._demand.wait(self.backstop_s):
                continue
            try:
                changed = self._watch.wait(self.backstop_s, since=gen)
            except Exception:  # the requests' backstop still ends their waits
                logger.warning(
                    "commit watch failed; long polls fall back to re-reads", exc_info=True
                )
                self._closed.wait(self.backstop_s)
                continue
            if changed:
                gen = self._watch.mark()  # before the fire: see module docstring
                loop = self._loop
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        fired, self._event = self._event, asyncio.Event()
        fired.set()
