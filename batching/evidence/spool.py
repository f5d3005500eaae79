"""The lineage spool: OpenLineage events the backend did not take, kept in the queue's database
(``batching_lineage_spool``) until a flush re-sends them.

* :meth:`Spool.add`: an event the emitter could not deliver (a failed send, a cooldown, or a
  later event of a run that still has spooled events: per-run order holds). The body is the
  event as first serialised; a flush sends those bytes again, so a re-send after a lost reply
  is the identical event (Marquez keeps one).
* :meth:`Spool.flush`: claims one run at a time (``claimed_by`` + ``claim_expires_at``, set by
  one conditional ``UPDATE``; on PostgreSQL after ``FOR UPDATE`` on the run's rows), sends its
  events in ``seq`` order, deletes each once sent, and stops that run at its first failure
  (later events wait). Flushers in several processes send each event once; a flusher that
  dies leaves its claim to expire.
* Retention: beyond ``max_events`` or older than ``max_age_s`` the oldest events are dropped,
  with a warning, and counted (:attr:`Spool.dropped`).
* :func:`backlog`: events, runs and the oldest event's age, for ``batching status``.

Engine-level (SQLite and PostgreSQL); sending is the caller's (``send(body)``), so this module
knows nothing of OpenLineage.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from batching import ports
from batching.redaction import redact_url
from batching.store import database, schema, sqlite

logger = logging.getLogger(__name__)

_T = schema.lineage_spool
_MAX_ERROR_CHARS = 500
_STOP_AFTER_FAILED_RUNS = 3  # in a row: the backend is down, later runs would fail alike
_CLAIM_MARGIN_S = 30.0


@dataclass(frozen=True)
class Backlog:
    """What waits in the spool: ``events`` of ``runs`` runs, the oldest spooled at
    ``oldest_at`` (epoch seconds; ``None`` when empty)."""

    events: int
    runs: int
    oldest_at: float | None

    def oldest_age_s(self, now: float) -> float | None:
        """Seconds the oldest event has waited, at ``now``."""
        return None if self.oldest_at is None else max(0.0, now - self.oldest_at)


@dataclass
class Flushed:
    """What one flush did: events ``sent`` (and deleted), runs stopped at a failed event
    (``failed_runs``, the last ``error``), events ``dropped`` by the retention cap, whether the
    deadline (or a stop) cut it short, and what is ``left`` in the spool after it."""

    sent: int = 0
    failed_runs: int = 0
    dropped: int = 0
    cut_short: bool = False
    error: str | None = None
    left: Backlog = Backlog(0, 0, None)


def backlog(engine: Engine) -> Backlog:
    """Events waiting in ``engine``'s spool, the runs they belong to and the oldest's time.

    Raises:
        QueueError: the database cannot be read.
    """
    query = sa.select(
        sa.func.count(), sa.func.count(sa.distinct(_T.c.run_id)), sa.func.min(_T.c.spooled_at)
    )
    with _read(engine) as conn:
        events, runs, oldest = conn.execute(query).one()
    return Backlog(int(events), int(runs), None if oldest is None else float(oldest))


class Spool:
    """The spool of one queue database.

    Args:
        engine: the queue's database (schema 12 or later).
        max_events: events kept at most (the oldest beyond it are dropped); 0 keeps none.
        max_age_s: an event older than this is dropped.
        clock: epoch seconds.

    Attributes:
        dropped: events this spool dropped by the retention cap.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_events: int = 10_000,
        max_age_s: float = 7 * 86400.0,
        clock: ports.Clock = time.time,
    ) -> None:
        self.engine = engine
        self.max_events = max_events
        self.max_age_s = max_age_s
        self.dropped = 0
        self._clock = clock

    def add(
        self, run_id: str, event_type: str, event_time: str, body: str, error: str | None = None
    ) -> None:
        """Keep one undelivered event (``body``: its JSON as sent) behind the run's earlier ones.

        Raises:
            QueueError: the database cannot be written.
        """
        row = {
            "run_id": run_id,
            "event_type": event_type,
            "event_time": event_time,
            "body": body,
            "spooled_at": self._clock(),
            "attempts": 0 if error is None else 1,
            "last_error": _short(error),
        }
        with _write(self.engine) as conn:
            conn.execute(_T.insert().values(**row))
            self._prune(conn)

    def pending(self, run_id: str) -> bool:
        """Whether events of ``run_id`` wait in the spool (a later one must wait behind them).

        Raises:
            QueueError: the database cannot be read.
        """
        query = sa.select(_T.c.seq).where(_T.c.run_id == run_id).limit(1)
        with _read(self.engine) as conn:
            return conn.execute(query).first() is not None

    def prune(self) -> int:
        """Drop what is past the retention cap now; returns how many events were dropped."""
        with _write(self.engine) as conn:
            return self._prune(conn)

    def flush(
        self,
        send: Callable[[str], object],
        *,
        send_s: float,
        deadline_s: float | None = None,
        stop: threading.Event | None = None,
        on_sent: Callable[[int], None] | None = None,
    ) -> Flushed:
        """Re-send spooled events, run by run, each run's in order, until none is left that
        another flusher does not hold, the deadline passes or ``stop`` is set.

        ``send(body)`` delivers one event or raises (it must be bounded: ``send_s`` seconds
        at most, which sizes the claims); ``on_sent(n)`` is told the events sent so far.
        A run stops at its first failed event; the flush stops after a few runs in a row
        failed (the backend is down).

        Raises:
            QueueError: the database cannot be read or written.
        """
        if not backlog(self.engine).events:  # the usual case: a read, no write lock taken
            return Flushed()
        owner = uuid.uuid4().hex
        done = Flushed(dropped=self.prune())
        end = None if deadline_s is None else time.monotonic() + deadline_s
        tried: set[str] = set()
        failed_in_a_row = 0

        def over() -> bool:
            return (end is not None and time.monotonic() >= end) or bool(stop and stop.is_set())

        while failed_in_a_row < _STOP_AFTER_FAILED_RUNS and not (cut := over()):
            run_id = self._next_run(tried)
            if run_id is None:
                break
            tried.add(run_id)
            rows = self._claim(run_id, owner, send_s)
            try:
                error = self._send_run(rows, send, done, over, on_sent)
            finally:
                self._release(run_id, owner)
            if error is None:
                failed_in_a_row = 0
                continue
            done.failed_runs += 1
            done.error = error
            failed_in_a_row += 1
        done.cut_short = cut
        done.left = backlog(self.engine)
        return done

    def _send_run(
        self,
        rows: list[tuple[int, str]],
        send: Callable[[str], object],
        done: Flushed,
        over: Callable[[], bool],
        on_sent: Callable[[int], None] | None,
    ) -> str | None:
        """Send one claimed run's events in order; the first failure's text, else None."""
        for seq, body in rows:
            if over():
                return None
            try:
                send(body)
            except Exception as exc:  # the backend's trouble: the run waits for the next flush
                text = _short(f"{type(exc).__name__}: {exc}")
                self._failed(seq, text)
                logger.info(  # not lost: it waits for the next flush, which says so
                    "spooled lineage event not delivered",
                    extra={"action": "lineage_flush_failed", "seq": seq, "error": text},
                )
                return text
            with _write(self.engine) as conn:
                conn.execute(_T.delete().where(_T.c.seq == seq))
            done.sent += 1
            if on_sent is not None:
                on_sent(done.sent)
        return None

    def _next_run(self, tried: set[str]) -> str | None:
        """The run with the oldest unclaimed (or expired) event, not tried in this flush."""
        now = self._clock()
        free = sa.or_(_T.c.claimed_by.is_(None), _T.c.claim_expires_at < now)
        first = sa.func.min(_T.c.seq)
        query = (
            sa.select(_T.c.run_id)
            .where(free)
            .group_by(_T.c.run_id)
            .order_by(first)
            .limit(len(tried) + 1)
        )
        with _read(self.engine) as conn:
            found = [r for (r,) in conn.execute(query) if r not in tried]
        return found[0] if found else None

    def _claim(self, run_id: str, owner: str, send_s: float) -> list[tuple[int, str]]:
        """Claim every event of ``run_id`` unless another flusher holds one of them; the
        claimed events (seq, body) in order, ``[]`` when another holds the run."""
        now = self._clock()
        other = _T.alias("other")
        held = (
            sa.select(other.c.seq)
            .where(
                other.c.run_id == run_id,
                other.c.claimed_by.is_not(None),
                other.c.claimed_by != owner,
                other.c.claim_expires_at >= now,
            )
            .exists()
        )
        with _write(self.engine) as conn:
            lock = sa.select(_T.c.seq).where(_T.c.run_id == run_id).order_by(_T.c.seq)
            if conn.dialect.name == "postgresql":  # a second claimer waits, then sees the claim
                n = len(conn.execute(lock.with_for_update()).all())
            else:  # BEGIN IMMEDIATE: this transaction is the only writer
                n = len(conn.execute(lock).all())
            hold_s = send_s * (n + 1) + _CLAIM_MARGIN_S
            conn.execute(
                _T.update()
                .where(_T.c.run_id == run_id, ~held)
                .values(claimed_by=owner, claim_expires_at=now + hold_s)
            )
            mine = sa.select(_T.c.seq, _T.c.body).where(
                _T.c.run_id == run_id, _T.c.claimed_by == owner
            )
            return [(int(s), str(b)) for s, b in conn.execute(mine.order_by(_T.c.seq))]

    def _release(self, run_id: str, owner: str) -> None:
        with _write(self.engine) as conn:
            conn.execute(
                _T.update()
                .where(_T.c.run_id == run_id, _T.c.claimed_by == owner)
                .values(claimed_by=None, claim_expires_at=None)
            )

    def _failed(self, seq: int, error: str | None) -> None:
        with _write(self.engine) as conn:
            conn.execute(
                _T.update()
                .where(_T.c.seq == seq)
                .values(attempts=_T.c.attempts + 1, last_error=error)
            )

    def _prune(self, conn: Connection) -> int:
        """Drop events older than ``max_age_s``, then the oldest beyond ``max_events``."""
        old = conn.execute(_T.delete().where(_T.c.spooled_at < self._clock() - self.max_age_s))
        dropped = max(old.rowcount or 0, 0)
        over = int(conn.execute(sa.select(sa.func.count()).select_from(_T)).scalar_one())
        over -= self.max_events
        if over > 0:
            oldest = sa.select(_T.c.seq).order_by(_T.c.seq).limit(over).scalar_subquery()
            gone = conn.execute(_T.delete().where(_T.c.seq.in_(oldest)))
            dropped += max(gone.rowcount or 0, 0)
        if dropped:
            self.dropped += dropped
            logger.warning(
                "lineage events dropped from the spool",
                extra={
                    "action": "lineage_spool_dropped",
                    "n_events": dropped,
                    "dropped": self.dropped,
                    "spool_max_events": self.max_events,
                    "spool_max_age_s": self.max_age_s,
                },
            )
        return dropped


def _short(text: str | None) -> str | None:
    return None if text is None else redact_url(text)[:_MAX_ERROR_CHARS]


def _url(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


@contextlib.contextmanager
def _write(engine: Engine) -> Iterator[Connection]:
    """A write transaction (SQLite: behind the file's writer lock, ``BEGIN IMMEDIATE``)."""
    with (
        sqlite.writer_lock(engine),
        database.translate_errors(_url(engine)),
        engine.begin() as conn,
    ):
        yield conn


@contextlib.contextmanager
def _read(engine: Engine) -> Iterator[Connection]:
    """A read (SQLite: a deferred ``BEGIN``, which never waits for a writer)."""
    with database.translate_errors(_url(engine)), engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.execution_options(**{sqlite.READ_ONLY: True})
        with conn.begin():
            yield conn


__all__ = ["Backlog", "Flushed", "Spool", "backlog"]
