"""Wake-ups on commit, not on a timer: a SQLite change check and a watch for readers.

* :class:`SqliteChanges`: ``PRAGMA data_version`` on a connection of its own. Its value
  changes when ANOTHER connection (this process's pool included, or another process) commits
  to the file; the pragma on an open connection costs microseconds, so it is checked every
  few milliseconds (``CHECK_S``). ``any_ready`` then looks for a ready item of a queue (the
  ready index, a read that never waits for the writer), so a scorer is not woken by
  commits that bring it no work (its own acks and heartbeats, other queues).
  ``queue.Waiter`` uses it: a SQLite scorer waiting for work wakes a few ms after an
  enqueue commits; its ``poll_s`` stays the backstop.
* :class:`CommitWatch`: returns when the items table may have changed, for long-polling
  readers (``GET item?wait_s=N``). One per process, shared by every waiting request: one
  thread checks (SQLite: ``data_version`` while someone waits; PostgreSQL: ``LISTEN`` on
  ``DONE_CHANNEL``, which the queue notifies in the transaction that makes items of a queue
  final (an ack; a fail to ``dead``; an expiry), so it fires on commit) and fans out through
  a ``threading.Condition``.

A reader that must not miss a commit landing between its read and its wait takes a mark
first::

    watch = CommitWatch(engine, "default")      # once, at start-up; watch.close() at exit
    mark = watch.mark()
    row = read_item(key)
    while not finished(row) and time_left() > 0:
        watch.wait(time_left(), since=mark)     # True: something committed since the mark
        mark = watch.mark()
        row = read_item(key)

Each wake-up costs every waiting reader one read, whatever item the commit touched: on
SQLite any commit to the file wakes it, on PostgreSQL any item of the queue made final.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine

logger = logging.getLogger(__name__)

ITEMS_CHANNEL = "batching_items"  # enqueue NOTIFYs it (payload: the queue); scorers LISTEN
DONE_CHANNEL = "batching_done"  # NOTIFYed where items become final (payload: the queue)
CHECK_S = 0.002  # how often data_version is read while someone waits
LINGER_S = 1.0  # a CommitWatch keeps checking this long after its last waiter left
RETRY_S = 1.0  # after a failed check or a lost listening connection
_LAST_BATCH = "SELECT max(rowid) FROM batching_batches"
_READY = "SELECT 1 FROM batching_items WHERE queue = ? AND state = 0{} LIMIT 1"
# A range lease's items stay ready in the table (``SqlQueue.claim``): left out by id, on the
# ready index, so a waiting scorer does not wake to claim what another one holds.
_RANGES = "SELECT lo, hi FROM batching_ranges WHERE queue = ?"


class SqliteChanges:
    """``PRAGMA data_version`` of a SQLite file, on a connection of its own (thread-safe).

    Opened at construction, so the first ``changed()`` reports commits made since then. A
    failed read closes the connection and raises ``sqlite3.Error``; the next call opens it
    again and reports a change (a new connection's counter has no history).
    """

    def __init__(self, engine: Engine) -> None:
        args, kwargs = engine.dialect.create_connect_args(engine.url)
        self._database = str(args[0])
        self._options: dict[str, Any] = {**kwargs, "check_same_thread": False}
        self._conn: sqlite3.Connection | None = None
        self._seen: int | None = None
        self._lock = threading.Lock()
        # Unreadable now: the first call that reads it says changed.
        with contextlib.suppress(sqlite3.Error), self._lock:
            self._seen = self._version()

    def changed(self) -> bool:
        """Whether another connection committed since the last call."""
        with self._lock:
            try:
                version = self._version()
            except sqlite3.Error:
                self._close()
                raise
            if version == self._seen:
                return False
            self._seen = version
            return True

    def any_ready(self, queue: str) -> bool:
        """Whether ``queue`` holds a ready item (due or not: a backoff wait counts)."""
        with self._lock:
            try:
                # fetchall: a cursor left open would hold a read snapshot and stall checkpoints
                conn = self._connection()
                held = conn.execute(_RANGES, (queue,)).fetchall()
                sql = _READY.format(" AND id NOT BETWEEN ? AND ?" * len(held))
                binds = [queue, *(bound for pair in held for bound in pair)]
                return bool(conn.execute(sql, binds).fetchall())
            except sqlite3.Error:
                self._close()
                raise

    def last_batch(self) -> int | None:
        """The ledger's last rowid (``batching_batches``): it moves when a batch commits."""
        with self._lock:
            try:
                rows = self._connection().execute(_LAST_BATCH).fetchall()
            except sqlite3.Error:
                self._close()
                raise
            return None if rows[0][0] is None else int(rows[0][0])

    def close(self) -> None:
        with self._lock:
            self._close()

    def _version(self) -> int:
        return int(self._connection().execute("PRAGMA data_version").fetchall()[0][0])

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            database, options = _never_creating(self._database, self._options)
            conn = sqlite3.connect(database, **options)
            conn.isolation_level = None  # autocommit: no transaction is ever left open
            self._conn = conn
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
        self._conn = None
        self._seen = None


def _never_creating(database: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``sqlite3.connect``'s arguments for ``database`` opened read-write, never created: a
    watch that reconnected to a file deleted under the API made a new empty one there, so
    the writer's check that its file is still in place passed, and POSTs were acknowledged
    into the unlinked file, lost with the process (``test_api``'s unlinked-file test)."""
    if options.get("uri") or database in ("", ":memory:"):
        return database, options  # a URI of the user's own, or no file
    path = Path(database).absolute()
    return f"file:{urllib.parse.quote(str(path))}?mode=rw", {**options, "uri": True}


class CommitWatch:
    """Returns when the items table may have changed: one per process, shared by every
    waiting reader (see the module docstring for the mark-read-wait loop).

    SQLite: ``data_version`` read every ``check_s`` by one thread while anyone waits (and
    ``LINGER_S`` after), idle otherwise; any commit to the file counts. PostgreSQL: one
    connection ``LISTEN``s on ``DONE_CHANNEL``; items of ``queue`` (any queue when None)
    made final (done, dead, expired) count. A lost connection or a failed check counts too (something may have been
    missed); the reader's own timeout is the backstop.

    Args:
        engine: the queue's engine (its URL is reused; the watch holds its own connection).
        queue: the queue whose acks wake readers on PostgreSQL; None: every queue.
        check_s: SQLite: how often ``data_version`` is read while someone waits.
    """

    def __init__(self, engine: Engine, queue: str | None = None, *, check_s: float = CHECK_S):
        self._engine = engine
        self._queue = queue
        self._check_s = check_s
        self._sqlite = engine.dialect.name == "sqlite"
        self._cond = threading.Condition()
        self._gen = 0  # bumped on every change seen
        self._waiters = 0
        self._active_until = 0.0  # monotonic: the SQLite thread parks after this, unwatched
        self._parked = True  # SQLite: nobody is checking; a mark or a wait checks itself
        self._closed = False
        self._failing = False
        self._thread: threading.Thread | None = None
        self._changes = SqliteChanges(engine) if self._sqlite else None
        self._listener: Any = None  # PostgreSQL: the LISTENing psycopg connection

    def mark(self) -> int:
        """The current generation: pass it to ``wait(since=...)`` to count commits from now."""
        with self._cond:
            self._start_locked()
            return self._gen

    def wait(self, timeout_s: float, *, since: int | None = None) -> bool:
        """Block until a change is seen after ``since`` (default: from now) or ``timeout_s``
        passes; True when a change was seen, False on timeout or once closed."""
        with self._cond:
            self._start_locked()
            start = self._gen if since is None else since
            if self._gen != start:
                return True
            self._waiters += 1
            self._cond.notify_all()  # unpark the SQLite thread
            try:
                self._cond.wait_for(lambda: self._gen != start or self._closed, timeout_s)
            finally:
                self._waiters -= 1
                self._active_until = time.monotonic() + LINGER_S
            return self._gen != start and not self._closed

    def close(self) -> None:
        """Stop the thread and close the connection; waiters return False."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
        if self._changes is not None:
            self._changes.close()

    # -- internals (the condition held where the name says so) -------------------------------

    def _bump_locked(self) -> None:
        self._gen += 1
        self._cond.notify_all()

    def _start_locked(self) -> None:
        if self._closed:
            return
        self._active_until = time.monotonic() + LINGER_S
        if self._sqlite:
            if self._parked:  # nobody checked since it parked: look now, then keep looking
                self._check_locked()
                self._parked = False
                self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name="commit-watch", daemon=True)
                self._thread.start()
        elif self._thread is None:
            # LISTEN before the first mark returns: a commit after it is not missed.
            with contextlib.suppress(Exception):  # unreachable now: the thread retries
                self._listener = self._listen()
            self._thread = threading.Thread(target=self._consume, name="commit-watch", daemon=True)
            self._thread.start()

    def _check_locked(self) -> None:
        assert self._changes is not None
        try:
            changed = self._changes.changed()
        except sqlite3.Error as exc:
            self._failed(exc)
            changed = True  # may have changed: readers read again
        else:
            self._failing = False
        if changed:
            self._bump_locked()

    def _failed(self, exc: BaseException) -> None:
        if not self._failing:
            logger.warning(
                "commit watch cannot read the database; readers wake on their timeout",
                extra={"action": "watch", "error": str(exc).strip()[:200]},
            )
        self._failing = True

    def _poll(self) -> None:
        """SQLite: read data_version every check_s while anyone waits or lingers."""
        while True:
            with self._cond:
                while not self._closed and (
                    self._waiters == 0 and time.monotonic() >= self._active_until
                ):
                    self._parked = True
                    self._cond.wait()
                if self._closed:
                    return
                self._parked = False
                self._check_locked()
                pause = RETRY_S if self._failing else self._check_s
            time.sleep(pause)

    def _listen(self) -> Any:
        import psycopg

        url = self._engine.url.set(drivername="postgresql")
        conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
        try:
            conn.execute(f"LISTEN {DONE_CHANNEL}")
        except BaseException:  # closed here, not left for the collector to find open
            conn.close()
            raise
        return conn

    def _consume(self) -> None:
        """PostgreSQL: bump on every notify of the queue; reconnect (and bump) when the
        connection is lost."""
        import psycopg

        while not self._closed:
            try:
                if self._listener is None:
                    self._listener = self._listen()
                    with self._cond:  # notifications may have been missed meanwhile
                        self._failing = False
                        self._bump_locked()
                for note in self._listener.notifies(timeout=0.5):
                    if self._closed:
                        break
                    if self._queue is None or note.payload == self._queue:
                        with self._cond:
                            self._bump_locked()
            except psycopg.Error as exc:
                with self._cond:
                    self._failed(exc)
                    self._bump_locked()
                self._close_listener()
                time.sleep(RETRY_S)
        self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(Exception):
                self._listener.close()
        self._listener = None
