"""SQLite specifics of the queue: engine set-up, the writer lock, the one-row claim read-back.

* Every connection: WAL, ``synchronous=NORMAL``, ``busy_timeout``. Write transactions begin
  ``BEGIN IMMEDIATE`` (a deferred transaction that upgrades to a write ignores the busy
  timeout); transactions with the ``READ_ONLY`` execution option begin deferred, a WAL snapshot
  that never waits for writers (``SqlQueue.read()``).
* :func:`writer_lock`: writers of one file queue on a thread lock and an ``flock``, not in
  SQLite's sleeping busy handler.
* :data:`CLAIMED` / :func:`unpack_claim`: a claim's rows read back as one row (see
  ``SqlQueue._claim_sqlite``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import orjson
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from batching import models, schema

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows: writers queue in SQLite's busy handler
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

READ_ONLY = "batching_read_only"  # execution option set by SqlQueue.read()
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
        deadline, pause = time.monotonic() + self._wait_s, 0.0001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "waited the busy timeout for the SQLite writer lock file; going on to "
                        "SQLite's own lock",
                        extra={"action": "writer_lock_timeout", "path": self._path},
                    )
                    return False
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
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CREAT, 0o644)
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


def configure(engine: Engine, busy_timeout_ms: int) -> None:
    """Set up a SQLite engine: pragmas on connect, ``BEGIN IMMEDIATE`` or deferred on begin,
    and the busy timeout as the longest wait for the writer lock file."""
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


# A SQLite claim read back as ONE row of columns (see SqlQueue._claim_sqlite, unpack_claim):
# JSON arrays; body lengths (null: the body row is missing); the earliest and latest
# enqueued_at and the number of deadlines; the bodies concatenated. Every aggregate walks the
# same rows in the same order. Most claims need no more: their items were enqueued together
# and have no deadline. The others read their times with CLAIMED_TIMES.
_SQLITE_JSON_COLUMNS = (
    "i.id",
    "i.item_key",
    "i.payload_format",
    "i.dtype",
    "i.shape",
    "i.lane",
    "i.tenant",
    "i.priority",
    "i.cost",
    "i.attempts",
    "i.max_attempts",
    "length(p.payload)",
)
_CLAIMED_COLUMNS_SQL = (
    "SELECT "
    + ", ".join(f"json_group_array({c})" for c in _SQLITE_JSON_COLUMNS)
    + ", min(i.enqueued_at), max(i.enqueued_at), count(i.deadline_at)"
)
_CLAIMED_WHERE_SQL = " WHERE i.lease_expires_at = :expires AND i.state = 1 AND i.lease_id = :lease"
_CLAIMED_FROM_SQL = (
    " FROM batching_items i LEFT JOIN batching_payloads p ON p.id = i.id" + _CLAIMED_WHERE_SQL
)
CLAIMED = sa.text(
    _CLAIMED_COLUMNS_SQL + ", CAST(group_concat(p.payload, '') AS BLOB)" + _CLAIMED_FROM_SQL
)
_TIMES = slice(len(_SQLITE_JSON_COLUMNS), len(_SQLITE_JSON_COLUMNS) + 3)  # min, max, deadlines
BODIES = _TIMES.stop  # CLAIMED's column of bodies
# Without the bodies, for a claim whose bodies add up to more than SQLite's longest blob.
CLAIMED_NO_BODIES = sa.text(_CLAIMED_COLUMNS_SQL + _CLAIMED_FROM_SQL)
# Each item's times, with its id, as two integers a time: its whole seconds and its fraction
# times 2^52, exact for any time of at least 1 s (every clock time and deadline; below that,
# within 2^-52 s). Text would not be: this SQLite's quote() and JSON keep 15 digits (87 of
# 700k random doubles came back changed through quote()), and formatting a float cost ~0.5 us
# a row against ~0.15 for the integers. Read only for claims that need it (see needs_times).
_WHOLE = "CAST({0} AS INTEGER)"
_FRACTION = "CAST(({0} - CAST({0} AS INTEGER)) * 4503599627370496 AS INTEGER)"
CLAIMED_TIMES = sa.text(
    "SELECT json_group_array(i.id), "
    + ", ".join(
        f"json_group_array({part.format(column)})"
        for column in ("i.enqueued_at", "i.deadline_at")
        for part in (_WHOLE, _FRACTION)
    )
    + " FROM batching_items i"
    + _CLAIMED_WHERE_SQL
)
_FRACTION_UNIT = 2.0**-52


def _exact(whole: int, fraction: int) -> float:
    """A time from its ``CLAIMED_TIMES`` integers."""
    return whole + fraction * _FRACTION_UNIT  # both exact, and so is their sum: the time


def _exact_or_none(whole: int | None, fraction: int | None) -> float | None:
    return None if whole is None or fraction is None else _exact(whole, fraction)


def needs_times(row: Sequence[Any]) -> bool:
    """Whether a ``CLAIMED`` row's items need ``CLAIMED_TIMES``: enqueued at different times,
    or with a deadline."""
    earliest, latest, deadlines = row[_TIMES]
    return bool(earliest != latest or deadlines)


def _times(
    ids: list[int], row: Sequence[Any], times: Sequence[Any] | None
) -> tuple[list[float], list[float | None]]:
    """Each item's enqueued_at and deadline, in the order of ``ids``: from the ``CLAIMED``
    row's shared values, or from a ``CLAIMED_TIMES`` row."""
    n = len(ids)
    if times is None:
        return [row[_TIMES.start]] * n, [None] * n
    times_ids, *parts = map(orjson.loads, times)
    enqueued = list(map(_exact, parts[0], parts[1]))
    deadlines = list(map(_exact_or_none, parts[2], parts[3]))
    if times_ids != ids:  # another walk of the rows: align them by id
        at = dict(zip(times_ids, range(len(times_ids)), strict=True))
        enqueued = [enqueued[at[i]] for i in ids]
        deadlines = [deadlines[at[i]] for i in ids]
    return enqueued, deadlines


def _as_block(
    queue: str,
    cols: list[list[Any]],
    enqueued: list[float],
    deadlines: list[float | None],
    data: bytes | None,
) -> models.ItemBlock | None:
    """The parsed columns of a ``CLAIMED`` row as one ItemBlock, in claim order, when its items
    are uniform: tensor payloads of one dtype, shape and byte length, one lane, tenant,
    priority and cost, and no deadline. None otherwise."""
    ids, keys, fmts, dtypes, shapes, lanes, tenants, prios, costs, atts, maxes, sizes = cols
    n = len(ids)
    shared = (fmts, dtypes, shapes, lanes, tenants, prios, costs, sizes)
    if any(c.count(c[0]) != n for c in shared) or fmts[0] != "tensor" or sizes[0] is None:
        return None
    if deadlines.count(None) != n or not data or len(data) != n * sizes[0]:
        return None  # a deadline, or a body row missing
    # Claim order with one priority and no deadline: enqueued_at, then id. The aggregate
    # mostly returns them so already (ids in enqueue order); otherwise sort once.
    if ids != sorted(ids) or enqueued != sorted(enqueued):
        order = sorted(range(n), key=list(zip(enqueued, ids, strict=True)).__getitem__)
        ids, keys, enqueued, atts, maxes = (
            list(map(col.__getitem__, order)) for col in (ids, keys, enqueued, atts, maxes)
        )
        rows = np.frombuffer(data, dtype=np.uint8).reshape(n, sizes[0])
        data = rows[np.asarray(order)].tobytes()
    shape = tuple(map(int, orjson.loads(shapes[0]))) if shapes[0] else None
    payload = models.Payload(b"", models.PayloadFormat.TENSOR, dtypes[0], shape)
    template = models.WorkItem(
        0, "", payload, 0.0, queue, lanes[0], tenants[0], prios[0], costs[0], None, 0, 0
    )
    return models.ItemBlock(template, ids, keys, enqueued, atts, maxes, data)


@overload
def unpack_claim(
    queue: str,
    row: Sequence[Any],
    times: Sequence[Any] | None = None,
    *,
    columns: Literal[False] = False,
) -> tuple[list[Any], dict[int, bytes]]: ...
@overload
def unpack_claim(
    queue: str, row: Sequence[Any], times: Sequence[Any] | None = None, *, columns: bool
) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock: ...
def unpack_claim(
    queue: str, row: Sequence[Any], times: Sequence[Any] | None = None, *, columns: bool = False
) -> tuple[list[Any], dict[int, bytes]] | models.ItemBlock:
    """A row of ``CLAIMED`` as claimed rows (``_CLAIM_COLUMNS`` order) and bodies by
    id, a column at a time in C (JSON arrays, ``float`` over split text) and one ``zip``. A
    row of ``CLAIMED_NO_BODIES`` gives the rows and no bodies. ``times`` is the claim's
    ``CLAIMED_TIMES`` row, required when :func:`needs_times`. With ``columns``, uniform items
    (see ``_as_block``) come back as one :class:`~batching.models.ItemBlock` instead."""
    cols = list(map(orjson.loads, row[: _TIMES.start]))
    ids, keys, fmts, dtypes, shapes, lanes, tenants, prios, costs, atts, maxes, sizes = cols
    if not ids:
        return [], {}
    if times is None and needs_times(row):
        raise ValueError("this claim's items need their CLAIMED_TIMES row")
    enqueued, deadlines = _times(ids, row, times)
    data = row[BODIES] if len(row) > BODIES else None
    block = _as_block(queue, cols, enqueued, deadlines, data) if columns else None
    if block is not None:
        return block
    by_deadline = [schema.NO_DEADLINE if d is None else d for d in deadlines]
    rows = list(
        zip(
            ids,
            keys,
            fmts,
            dtypes,
            shapes,
            enqueued,
            itertools.repeat(queue, len(ids)),
            lanes,
            tenants,
            prios,
            costs,
            deadlines,
            atts,
            maxes,
            by_deadline,
            strict=True,
        )
    )
    bodies: dict[int, bytes] = {}
    if len(row) > BODIES:
        data = data or b""
        if None in sizes:  # a body row is missing (the caller buries those items)
            present = [
                (id_, size) for id_, size in zip(ids, sizes, strict=True) if size is not None
            ]
            ids, sizes = [p[0] for p in present], [p[1] for p in present]
        ends = list(itertools.accumulate(sizes))
        starts = itertools.chain((0,), ends)
        bodies = dict(zip(ids, map(data.__getitem__, map(slice, starts, ends)), strict=True))
    return rows, bodies
