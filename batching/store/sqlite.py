"""SQLite's set-up: every connection's pragmas, transactions, and the writer lock.

* Every connection: WAL, ``synchronous=NORMAL``, ``busy_timeout``. Write transactions begin
  ``BEGIN IMMEDIATE`` (a deferred transaction that upgrades to a write ignores the busy
  timeout); transactions with the ``READ_ONLY`` execution option begin deferred, a WAL snapshot
  that never waits for writers (``SqlQueue.read()``).
* :func:`writer_lock`: writers of one file queue on a thread lock and an ``flock``, not in
  SQLite's sleeping busy handler.

The claim's one-row read-back is the queue's: :mod:`batching.ingress.sqlite_claim`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from batching.store import schema

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows: writers queue in SQLite's busy handler
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

READ_ONLY = "batching_read_only"  # execution option set by SqlQueue.read()
_HOLDER = 64  # bytes at the start of the lock file: "<pid> <epoch s taken>", space-padded
_SAY_EVERY_S = 5.0  # a writer waiting this long says who holds the lock, and again after as long
_WRITER_LOCKS: dict[str, _WriterLock] = {}  # by engine URL
_LOCKS_GUARD = threading.Lock()


class _WriterLock:
    """SQLite's one writer, queued without its busy handler: a thread lock for this process,
    then an ``flock`` on ``<database>.writer-lock`` shared with other processes.

    SQLite's busy handler sleeps and retries (1, 2, 5, 10 ... 100 ms), so a writer that finds
    the write lock taken goes on sleeping long after it is free; this one retries the file
    lock every 2 ms at most, and the kernel releases it when a process dies. Two W1 scorer
    processes on one file: 53-55k rows/s against 46-51k with the busy handler alone.
    Correctness never depends on it: SQLite's own lock still guards every write. A writer
    that does not use this file (the sqlite3 shell), cannot lock it (logged once), or waited
    longer than the busy timeout for it goes on to SQLite's busy handler and its timeout.
    """

    def __init__(self, path: str | None, wait_s: float) -> None:
        self._thread = threading.Lock()
        self._path = path if fcntl is not None else None
        self._wait_s = wait_s
        self._fd: int | None = None
        self._held = False

    def __enter__(self) -> None:
        self._thread.acquire()
        try:
            fd = self._file()
            self._held = fd is not None and self._flock(fd)
            if self._held and fd is not None:  # who holds it, for a writer left waiting
                with contextlib.suppress(OSError):
                    os.pwrite(fd, f"{os.getpid()} {time.time():.3f}".ljust(_HOLDER).encode(), 0)
        except BaseException:
            self._thread.release()
            raise

    def __exit__(self, *_exc: object) -> None:
        try:
            if self._held and self._fd is not None:
                self._held = False
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread.release()

    def after_fork_in_child(self) -> None:
        """A forked child must not share the parent's lock: its own thread lock (the parent's
        may have been held by another thread at the fork) and, later, its own file."""
        self._thread = threading.Lock()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd, self._held = None, False

    def _flock(self, fd: int) -> bool:
        started = time.monotonic()
        deadline, pause, say_at = started + self._wait_s, 0.0001, started + _SAY_EVERY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    logger.warning(
                        "waited the busy timeout for the SQLite writer lock file%s; going on "
                        "to SQLite's own lock",
                        _holder_text(fd),
                        extra={"action": "writer_lock_timeout", "path": self._path},
                    )
                    return False
                if now >= say_at:
                    say_at = now + _SAY_EVERY_S
                    logger.warning(
                        "waiting %.0f s for the SQLite writer lock%s",
                        now - started,
                        _holder_text(fd),
                        extra={"action": "writer_lock_wait", "path": self._path},
                    )
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
            except OSError as exc:  # e.g. no flock on this (network) filesystem
                self._give_up(exc)
                return False

    def _file(self) -> int | None:
        if self._path is None:
            return None
        if self._fd is None:
            try:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self._give_up(exc)
        return self._fd

    def _give_up(self, exc: OSError) -> None:
        logger.warning(
            "cannot use the SQLite writer lock file; writers in other processes wait in "
            "SQLite's busy handler instead",
            extra={"action": "writer_lock_unavailable", "path": self._path, "error": str(exc)},
        )
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._path, self._fd = None, None


def _read_holder(fd: int) -> tuple[int, float] | None:
    """The ``(pid, since)`` the lock's last holder wrote, or None (none yet, or unreadable)."""
    try:
        pid, since = os.pread(fd, _HOLDER, 0).decode().split()
        return int(pid), float(since)
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _holder_text(fd: int) -> str:
    holder = _read_holder(fd)
    if holder is None:
        return " (held by a process that did not say who it is: another program?)"
    pid, since = holder
    return f": process {pid} has held it for {time.time() - since:.0f} s"


def lock_holder(engine: Engine) -> tuple[int, float] | None:
    """The process holding the SQLite file's writer lock now and since when (epoch s), or
    None when nobody holds it (or it is not a SQLite file with a lock file)."""
    if engine.dialect.name != "sqlite" or fcntl is None:
        return None
    path = _lock_for(engine, 30.0)._path
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:  # free if this takes it at once: let go, nobody holds it
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except BlockingIOError:
            return _read_holder(fd)
    finally:
        os.close(fd)


def _after_fork_in_child() -> None:
    global _LOCKS_GUARD
    _LOCKS_GUARD = threading.Lock()
    for lock in _WRITER_LOCKS.values():
        lock.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def writer_lock(engine: Engine) -> contextlib.AbstractContextManager[Any]:
    """One lock per SQLite file (serialises its writers, see ``_WriterLock``); a no-op elsewhere.

    Keyed by the database URL, so separate engines on the same file (a producer and a scorer
    in one process) also queue here rather than in SQLite's sleeping busy handler.
    """
    if engine.dialect.name != "sqlite":
        return contextlib.nullcontext()
    return _lock_for(engine, 30.0)


def _lock_for(engine: Engine, wait_s: float) -> _WriterLock:
    """The engine's file lock; the first engine on a file sets how long writers wait for it."""
    key = str(engine.url)
    with _LOCKS_GUARD:
        lock = _WRITER_LOCKS.get(key)
        if lock is None:
            database = engine.url.database
            on_disk = database not in (None, "", ":memory:") and "mode=memory" not in key
            path = f"{database}.writer-lock" if on_disk else None
            lock = _WRITER_LOCKS[key] = _WriterLock(path, wait_s)
        return lock


def configure(engine: Engine, busy_timeout_ms: int, file: Path | None = None) -> None:
    """Set up a SQLite engine: pragmas on connect, ``BEGIN IMMEDIATE`` or deferred on begin,
    the busy timeout as the longest wait for the writer lock file, and (``file``: the
    database's path) a pooled connection to a file since replaced at that path given up."""
    _lock_for(engine, busy_timeout_ms / 1000)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        cur.execute("PRAGMA synchronous = NORMAL")
        # WAL is a setting of the file: `batching init` sets it (use_wal), and a queue
        # database found without it (restored from a copy) gets it back. Any other file
        # (another program's database, an empty file given to a read-only command by
        # mistake) is left as it was: the schema check refuses it next.
        if cur.execute("PRAGMA journal_mode").fetchone()[0] != "wal" and _is_queue(cur):
            cur.execute("PRAGMA journal_mode = WAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # Writers take the lock up front (no deadlock-prone read-to-write upgrade); read()
        # transactions begin deferred: a WAL snapshot that never waits for writers.
        read_only = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    if file is not None:  # after the pragmas: the connection has made its file by then
        _follow_the_path(engine, file)


def _follow_the_path(engine: Engine, file: Path) -> None:
    """Connections use the file now at ``file``. An open connection keeps the file it opened,
    so after a backup was restored there (or `batching init` made a new one) a long-lived
    process (the API) acknowledged writes into the replaced file, lost with the process,
    while readers read the new one (found by a review). Each connection records its file's
    identity; one checked out from the pool after the path changed is replaced by a new
    connection (SQLAlchemy retries a checkout that raises ``DisconnectionError``). A path
    with no file is left to ``database.require_file_still_there``: a connection opened there
    would create an empty database. A ``stat`` a checkout."""

    @event.listens_for(engine, "connect")
    def _remember(_dbapi_conn: Any, record: Any) -> None:
        record.info[_FILE_ID] = _identity(file)

    @event.listens_for(engine, "checkout")
    def _check(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        now = _identity(file)
        if now is not None and now != record.info.get(_FILE_ID):
            raise sa.exc.DisconnectionError(f"the SQLite file {file} was replaced")


_FILE_ID = "batching_file_id"


def _identity(file: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _is_queue(cur: Any) -> bool:
    found = cur.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
        (schema.schema_version.name,),
    ).fetchone()
    return found is not None


def use_wal(engine: Engine) -> None:
    """Put the engine's SQLite file in WAL mode (before ``batching init`` creates the schema;
    the mode stays with the file). Outside any transaction: SQLite refuses it inside one."""
    try:  # the raw connection's errors (its connect events' too) are sqlite3's own
        raw = engine.raw_connection()
        try:
            raw.cursor().execute("PRAGMA journal_mode = WAL").fetchall()
        finally:
            raw.close()
    except sqlite3.Error as e:  # as SQLAlchemy raises them, for database.translate_errors
        raise sa.exc.OperationalError("PRAGMA journal_mode = WAL", None, e) from e
