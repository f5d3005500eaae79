"""Group commit for POSTs: one writer thread per process enqueues the requests waiting at
that moment in ONE transaction per queue, and answers each with its own items' outcome.

On SQLite one writer holds the file at a time, so a transaction per request caps the HTTP
ingress at a few dozen requests a second; a group pays the commit once. Each request keeps its
own answer and errors:

- a request is parsed and validated before it joins a group (its 422 is its own);
- a key another tenant holds (in the database, or taken by an earlier request of the same
  group) fails that request alone with 409;
- idempotence on ``item_key``: a key two requests of one group both send is created by the
  first (``created: true``) and reported present to the second, with the same id;
- the depth cap: each request of the group is admitted or refused on its own, in order, in
  the group's one transaction (a savepoint each, ``SqlQueue.enqueue_each``), so only the
  requests that do not fit get 429;
- a request is answered only after the transaction holding its items committed.

The writer takes what is queued when its previous transaction ends (up to ``max_records``
records), lingering ``linger_s`` for more first when that is set (0: no artificial wait).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue as queues
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batching import errors, models
from batching.api import results
from batching.api.results import ItemView, Results
from batching.store import database

logger = logging.getLogger(__name__)

DEFAULT_MAX_RECORDS = 1000

Answer = tuple[dict[str, Any], bool]
"""The response document and whether any of the request's items is new (201, else 200)."""


class Conflict(errors.BatchingError):
    """An item_key of the request is held by another tenant (409)."""


@dataclass
class Post:
    """One request waiting for the writer: its records (validated) and its answer to come."""

    queue: str
    tenant: str
    records: Sequence[models.EnqueueRecord]
    answer: concurrent.futures.Future[Answer] = field(default_factory=concurrent.futures.Future)


class Writer:
    """The process's enqueue writer: ``submit`` a request's records, await its ``Future``.

    The thread starts on the first ``submit``; ``close`` stops it once the requests already
    submitted are written.
    """

    def __init__(
        self,
        results: Results,
        max_attempts: int,
        max_records: int = DEFAULT_MAX_RECORDS,
        linger_s: float = 0.0,
    ) -> None:
        self.results, self.max_attempts = results, max_attempts
        self.max_records, self.linger_s = max(1, max_records), max(0.0, linger_s)
        self._inbox: queues.SimpleQueue[Post | None] = queues.SimpleQueue()
        self._held: Post | None = None  # taken past a full group: first of the next one
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.groups = 0  # transactions tried (one per queue per group): for tests and logs

    def submit(self, queue: str, tenant: str, records: Sequence[models.EnqueueRecord]) -> Post:
        """Queue a request's records for the next group; its ``answer`` resolves after commit.

        Raises:
            QueueError: the writer is closed (the server is stopping).
        """
        post = Post(queue, tenant, records)
        with self._lock:
            if self._closed:
                raise errors.QueueError("the server is stopping; retry on another instance")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="batching-api-writer", daemon=True
                )
                self._thread.start()
            self._inbox.put(post)
        return post

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what was submitted, then stop the thread (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            self._inbox.put(None)
        if thread is not None:
            thread.join(timeout_s)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            posts, more = self._take()
            if posts:
                try:
                    self._write(posts)
                except Exception as exc:  # a bug: fail this group, keep serving the next
                    logger.error("enqueue group failed", exc_info=exc)
                    for post in posts:
                        _resolve(post, exc)
            if not more:
                return

    def _take(self) -> tuple[list[Post], bool]:
        """The next group (blocking for its first request) and whether to go on after it."""
        first = self._held if self._held is not None else self._inbox.get()
        self._held = None
        if first is None:
            return [], False
        posts, size = [first], len(first.records)
        ends = time.monotonic() + self.linger_s
        while size < self.max_records:
            left = ends - time.monotonic()
            try:
                nxt = self._inbox.get(timeout=left) if left > 0 else self._inbox.get_nowait()
            except queues.Empty:
                break
            if nxt is None:
                return posts, False
            if size + len(nxt.records) > self.max_records:
                self._held = nxt
                break
            posts.append(nxt)
            size += len(nxt.records)
        return posts, True

    def _write(self, posts: list[Post]) -> None:
        by_queue: dict[str, list[Post]] = collections.defaultdict(list)
        for post in posts:
            by_queue[post.queue].append(post)
        for queue, group in by_queue.items():
            self._write_queue(queue, group)

    def _write_queue(self, queue: str, posts: list[Post]) -> None:
        """Enqueue ``posts`` (all of ``queue``) in one transaction and answer each."""
        # A key another tenant holds is refused inside the transaction (``KeyTaken``): a read
        # before it could be overtaken by another API process, and a request half written.
        q = self.results.queue(queue)
        q.max_attempts = self.max_attempts
        run = f"api-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self.groups += 1
        keys = [r.item_key for p in posts for r in p.records]
        views: dict[str, ItemView] = {}
        try:
            outcomes = q.enqueue_each(
                [p.records for p in posts],
                enqueue_run=run,
                then=lambda conn: views.update(results.states(conn, queue, keys)),
            )
            # SQLite: committed to the file at its path, not to one deleted or moved under
            # this process's connection (written where no scorer reads, lost with it): 503
            database.require_file_still_there(self.results.engine)
        except errors.BatchingError as exc:
            for post in posts:
                _resolve(post, exc)
            return
        admitted: list[Post] = []
        inserted, duplicates = 0, list[str]()
        for post, outcome in zip(posts, outcomes, strict=True):
            if isinstance(outcome, errors.KeyTaken):  # another tenant's key: 409
                _resolve(post, _taken(outcome.key, queue))
                continue
            if isinstance(outcome, errors.BatchingError):  # its own 429 (or 422)
                _resolve(post, outcome)
                continue
            admitted.append(post)
            inserted += outcome.inserted
            duplicates.extend(outcome.duplicates)
        if admitted:
            done = models.EnqueueResult(inserted, tuple(duplicates))
            _answer(admitted, done, views)


def _answer(posts: list[Post], done: models.EnqueueResult, views: dict[str, ItemView]) -> None:
    """Each request's items as the transaction read them (``views``), ``created`` for the
    first request of the group sending a key the transaction inserted."""
    sent = collections.Counter(r.item_key for p in posts for r in p.records)
    dupes = collections.Counter(done.duplicates)
    new = {k for k, n in sent.items() if dupes[k] < n}
    for post in posts:  # another tenant's key was refused in the transaction (KeyTaken)
        items, any_new = [], False
        for r in post.records:
            created = r.item_key in new
            new.discard(r.item_key)
            any_new = any_new or created
            if r.item_key in views:
                items.append(posted(views[r.item_key], created))
        _resolve(post, ({"items": items}, any_new))


def posted(view: ItemView, created: bool) -> dict[str, Any]:
    """An item as a POST answers it."""
    return {
        "item_key": view.item_key,
        "id": view.id,
        "state": view.state.name.lower(),
        "created": created,
    }


def _taken(key: str, queue: str) -> Conflict:
    return Conflict(f"item_key {key!r} is taken in queue {queue!r}; use another key")


def _resolve(post: Post, outcome: Answer | BaseException) -> None:
    """Answer ``post`` (unless its client went away and the future was cancelled)."""
    try:
        if isinstance(outcome, BaseException):
            post.answer.set_exception(outcome)
        else:
            post.answer.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass
