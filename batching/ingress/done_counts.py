"""Done items counted in the background: the one count that reads every done item (seconds
for ten million on SQLite, until ``purge``), kept off the request paths that report a queue's
states. The metrics exporter (every ``--done-every``, 5 min) and the HTTP API's queue read
(every ``API_DONE_EVERY_S``) serve the last count, with the live states read fresh
(``SqlQueue.stats(done=False)``, through their partial indexes).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Set

from batching import models
from batching.ingress.queue import SqlQueue

logger = logging.getLogger(__name__)


class DoneCounts:
    """The done items by (queue, lane, tenant), counted on a thread of their own, at most
    every ``every_s``, never inside a scrape: a scrape returns the last count finished (none
    before the first) and starts the next when it is due."""

    def __init__(
        self,
        queue: SqlQueue,
        every_s: float,
        clock: Callable[[], float] = time.time,
        *,
        all_queues: bool = True,
    ) -> None:
        self.queue, self.every_s, self.clock = queue, every_s, clock
        self.all_queues = all_queues
        self.counted_at: float | None = None  # when the last finished count started
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], int] | None = None
        self._started_at: float | None = None
        self._running: threading.Thread | None = None
        self._failed = False  # the last count raised

    def latest(self, now_too: bool = False) -> dict[tuple[str, str, str], int] | None:
        """The last finished count (None before the first); starts a count when due, or
        ``now_too`` (a queue appeared that no count has seen) unless the last count failed:
        a count that keeps failing is tried every ``every_s``, not at every scrape."""
        return self.latest_at(now_too)[0]

    def last(self) -> dict[tuple[str, str, str], int] | None:
        """The last finished count (None before the first), starting nothing."""
        with self._lock:
            return self._counts

    def latest_at(
        self, now_too: bool = False
    ) -> tuple[dict[tuple[str, str, str], int] | None, float | None]:
        """:meth:`latest` and when that count started (None before the first), read
        together: a count finishing in between cannot pair one count with another's time."""
        with self._lock:
            now = self.clock()
            due = self._started_at is None or now - self._started_at >= self.every_s
            due = due or (now_too and not self._failed)
            if due and self._running is None:
                self._started_at = now
                self._running = threading.Thread(target=self._count, name="done-count", daemon=True)
                self._running.start()
            return self._counts, self.counted_at

    def wait(self, timeout_s: float) -> bool:
        """Wait for the count in progress, if any; True when none is left running."""
        with self._lock:
            running = self._running
        if running is not None:
            running.join(timeout_s)
        return not (running is not None and running.is_alive())

    def _count(self) -> None:
        try:
            started = self.clock()
            counts = self.queue.done_counts(all_queues=self.all_queues)
        except Exception as exc:  # the next due read tries again; the live states go on
            logger.warning(
                "could not count the done items",
                extra={
                    "action": "done_count_failed",
                    "queue": None if self.all_queues else self.queue.queue,
                    "error": str(exc),
                },
            )
            counts = None
        with self._lock:
            if counts is not None:
                self._counts, self.counted_at = counts, started
            self._failed, self._running = counts is None, None


def filled(
    stats: models.QueueStats,
    counts: dict[tuple[str, str, str], int] | None,
    seen: Set[tuple[str, str, str]],
) -> models.QueueStats:
    """``stats`` of the live states (``done=False``) with the done ``counts`` filled in (None:
    none finished yet), and a group of zeros for each (queue, lane, tenant) in ``seen`` or
    ``counts`` that has no live item now: a drained queue shows ``ready 0``, as when one
    query counted every state, rather than no series at all."""
    groups = {(g.queue, g.lane, g.tenant): g for g in stats.groups}
    for key in (seen | (counts or {}).keys()) - groups.keys():
        groups[key] = models.LaneStats(*key, done=None)
    rows = tuple(
        groups[k] if counts is None else dataclasses.replace(groups[k], done=counts.get(k, 0))
        for k in sorted(groups)
    )
    return models.QueueStats.of(rows, done=counts is not None)
