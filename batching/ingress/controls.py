"""Queue controls for incidents: pause and resume a queue, cap its depth, cancel its ready
items, each change in one transaction with its row in ``batching_queue_audit`` (who, when,
why, what it changed).

* **pause**: every claim reads the queue's row of ``batching_queue_controls`` in its own
  transaction (one primary-key lookup) and a paused queue's claim takes nothing
  (``models.Claim.paused``); batches already claimed finish and commit. A claim already under
  way when the pause commits still takes its items (they are in flight like the rest).
* **depth cap**: an enqueue that would leave more than ``max_depth`` items ready or leased in
  the queue, or a tenant more than its share of them, is refused whole (``errors.QueueFull``;
  checked in the enqueue's transaction by :mod:`batching.ingress.admission`).
* **cancel**: ready items chosen by key, tenant and/or enqueue run go to
  ``State.CANCELLED`` (terminal, not dead letters); leased ones are in flight and are left
  to finish, and counted.

The functions taking a ``Connection`` run inside :class:`~batching.ingress.queue.SqlQueue`'s
claim and enqueue transactions; the others open their own.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from batching import errors, models
from batching.store import database, schema, sqlite

logger = logging.getLogger(__name__)

_C = schema.queue_controls
_A = schema.queue_audit
_T = schema.items
RANGE_LOCK_SPACE = 7271102  # PostgreSQL: pg_advisory_xact_lock(this, hashtext(queue))
_KEY_CHUNK = 1000  # keys per cancel statement (one transaction for all)
_AUDIT_KEYS = 20  # keys of a cancel listed in its audit row (the count is always there)
_MAX_DEPTH = 2**62
MAX_AUDIT = 1_000_000  # audit rows a listing shows at most (a larger --limit overflowed)


@dataclass(frozen=True)
class QueueControl:
    """A queue's controls; a queue without a row has the defaults (running, no cap)."""

    queue: str
    paused: bool = False
    paused_at: float | None = None
    paused_by: str | None = None
    reason: str | None = None
    max_depth: int | None = None
    ledger_horizon: float | None = None  # ``batching purge --ledger`` (store.retention)


@dataclass(frozen=True)
class AuditRow:
    """One recorded control action: ``pause``, ``resume``, ``cap`` or ``cancel``."""

    id: int
    queue: str
    action: str
    actor: str
    at: float
    reason: str | None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CancelResult:
    """What a cancel did: ready items cancelled, and matching leased items left to finish."""

    cancelled: int
    in_flight: int


# -- read -------------------------------------------------------------------------------------


def state(engine: Engine, queue: str) -> QueueControl:
    """The controls of ``queue`` (defaults when it has no row)."""
    with connect(engine) as conn:
        return _read(conn, queue)


def states(engine: Engine) -> dict[str, QueueControl]:
    """The controls of every queue that has a row, by queue name."""
    with connect(engine) as conn:
        return {r.queue: _control(r) for r in conn.execute(sa.select(_C).order_by(_C.c.queue))}


def audit(engine: Engine, queue: str | None = None, limit: int = 50) -> list[AuditRow]:
    """The latest ``limit`` audit rows (of ``queue``, or of every queue), oldest first."""
    if not 1 <= limit <= MAX_AUDIT:
        raise errors.InputError(f"the audit limit must be 1 to {MAX_AUDIT:,}, got {limit}")
    q = sa.select(_A).order_by(_A.c.id.desc()).limit(limit)
    if queue is not None:
        q = q.where(_A.c.queue == queue)
    with connect(engine) as conn:
        rows = list(conn.execute(q))
    return [
        AuditRow(r.id, r.queue, r.action, r.actor, r.at, r.reason, json.loads(r.detail or "{}"))
        for r in reversed(rows)
    ]


def known(conn: Connection, queue: str) -> bool:
    """Whether ``queue`` has an audit row, a control or an item (small tables first)."""
    return any(
        conn.execute(sa.select(t.c.queue).where(t.c.queue == queue).limit(1)).first()
        for t in (_A, _C, _T)
    )


def last_at(engine: Engine, action: str | None = None) -> dict[str, float]:
    """When each queue's latest audit row (of ``action``; ``purge``: the heartbeat) was."""
    q = sa.select(_A.c.queue, sa.func.max(_A.c.at))
    q = q if action is None else q.where(_A.c.action == action)
    with connect(engine) as conn:
        return {queue: float(at) for queue, at in conn.execute(q.group_by(_A.c.queue))}


# -- change -----------------------------------------------------------------------------------


def pause(engine: Engine, queue: str, *, actor: str, reason: str, now: float) -> QueueControl:
    """Pause ``queue``: from their next claim on, scorers claim nothing from it; what they
    hold finishes. Idempotent: pausing a paused queue keeps who paused it first, and is
    recorded too (``detail.changed`` false)."""
    actor, reason = check_actor(actor), check_reason(reason, "pause")
    with begin(engine) as conn:
        before = locked_row(conn, queue, now)
        if not before.paused:
            values = {"paused": True, "paused_at": now, "paused_by": actor, "pause_reason": reason}
            update_row(conn, queue, values, now)
        record(conn, queue, "pause", actor, now, reason, {"changed": not before.paused})
        after = _read(conn, queue)
    logger.info(
        "queue paused",
        extra={"action": "queue_pause", "queue": queue, "actor": actor, "reason": reason},
    )
    return after


def resume(
    engine: Engine, queue: str, *, actor: str, reason: str | None, now: float
) -> QueueControl:
    """Resume ``queue``: scorers claim from it again at their next poll. Idempotent."""
    actor, reason = check_actor(actor), _optional_reason(reason)
    with begin(engine) as conn:
        before = locked_row(conn, queue, now)
        if before.paused:
            values = {"paused": False, "paused_at": None, "paused_by": None, "pause_reason": None}
            update_row(conn, queue, values, now)
        detail: dict[str, Any] = {"changed": before.paused}
        if before.paused:
            detail |= {"paused_at": before.paused_at, "paused_by": before.paused_by}
        record(conn, queue, "resume", actor, now, reason, detail)
        after = _read(conn, queue)
    logger.info("queue resumed", extra={"action": "queue_resume", "queue": queue, "actor": actor})
    return after


def set_max_depth(
    engine: Engine,
    queue: str,
    max_depth: int | None,
    *,
    actor: str,
    reason: str | None,
    now: float,
) -> QueueControl:
    """Cap ``queue`` at ``max_depth`` items ready or leased (None: no cap). Items already
    over the cap stay; enqueues are refused until the depth is back under it."""
    if max_depth is not None and not 0 <= max_depth <= _MAX_DEPTH:
        raise errors.InputError(f"the depth cap must be 0 to {_MAX_DEPTH} items, got {max_depth}")
    actor, reason = check_actor(actor), _optional_reason(reason)
    with begin(engine) as conn:
        before = locked_row(conn, queue, now)
        update_row(conn, queue, {"max_depth": max_depth}, now)
        detail = {"max_depth": max_depth, "was": before.max_depth}
        record(conn, queue, "cap", actor, now, reason, detail)
        after = _read(conn, queue)
    logger.info(
        "queue depth cap set",
        extra={"action": "queue_cap", "queue": queue, "actor": actor, "max_depth": max_depth},
    )
    return after


def cancel(
    engine: Engine,
    queue: str,
    *,
    keys: Sequence[str] | None = None,
    tenant: str | None = None,
    enqueue_run: str | None = None,
    actor: str,
    reason: str,
    now: float,
) -> int:
    """Cancel the ready items of ``queue`` that match every filter given; returns how many
    (:func:`cancel_items` says how many in flight were left to finish)."""
    who = {"actor": actor, "reason": reason}
    done = cancel_items(
        engine, queue, keys=keys, tenant=tenant, enqueue_run=enqueue_run, now=now, **who
    )
    return done.cancelled


def cancel_items(
    engine: Engine,
    queue: str,
    *,
    keys: Sequence[str] | None = None,
    tenant: str | None = None,
    enqueue_run: str | None = None,
    actor: str,
    reason: str,
    now: float,
) -> CancelResult:
    """Cancel the ready items (backoff and suspects included) of ``queue`` that match every
    filter given (keys, tenant, enqueue run; at least one), in one transaction with its audit
    row. They become ``cancelled`` with ``last_error`` naming who and why. Matching leased
    items are in flight: they are left to finish, and counted in ``in_flight``.

    Raises:
        InputError: no filter, an empty key list, an empty actor or reason.
    """
    wheres = _cancel_filters(queue, keys, tenant, enqueue_run)
    actor, reason = check_actor(actor), check_reason(reason, "cancel")
    note = f"cancelled by {actor}: {reason}"[:2000]
    with begin(engine) as conn:
        schema.require_current_to_write(conn)
        lock_ranges(conn, queue, exclusive=False)
        counts = [_cancel_where(conn, queue, where, now, note) for where in wheres]
        result = CancelResult(sum(c for c, _ in counts), sum(f for _, f in counts))
        detail = asdict(result) | {"tenant": tenant, "enqueue_run": enqueue_run}
        if keys is not None:
            detail |= {"n_keys": len(keys), "keys": list(keys[:_AUDIT_KEYS])}
        changed = bool(result.cancelled or result.in_flight)
        record(conn, queue, "cancel", actor, now, reason, detail, changed=changed)
    logger.info(
        "items cancelled",
        extra={"action": "queue_cancel", "queue": queue, "actor": actor, **asdict(result)},
    )
    return result


def _cancel_filters(
    queue: str, keys: Sequence[str] | None, tenant: str | None, enqueue_run: str | None
) -> list[list[sa.ColumnElement[bool]]]:
    """The WHERE clauses of a cancel: one per chunk of keys (one in all without keys)."""
    if keys is None and tenant is None and enqueue_run is None:
        raise errors.InputError("cancel needs a filter: item keys, a tenant and/or an enqueue run")
    if keys is not None and not keys:
        raise errors.InputError("cancel by key got an empty key list; give at least one key")
    where = [_T.c.queue == queue]
    if tenant is not None:
        where.append(_T.c.tenant == tenant)
    if enqueue_run is not None:
        where.append(_T.c.enqueue_run == enqueue_run)
    if keys is None:
        return [where]
    chunks = (keys[i : i + _KEY_CHUNK] for i in range(0, len(keys), _KEY_CHUNK))
    return [[*where, _T.c.item_key.in_(list(chunk))] for chunk in chunks]


def _cancel_where(
    conn: Connection, queue: str, where: list[sa.ColumnElement[bool]], now: float, note: str
) -> tuple[int, int]:
    """Cancel the ready items matching ``where``; (cancelled, leased ones left in flight)."""
    ready, leased = _T.c.state == sa.literal_column("0"), _T.c.state == sa.literal_column("1")
    held = schema.held_by_ranges(conn, queue=queue)
    if held is not None:  # ready in the table, in flight in fact: left to finish
        leased, ready = sa.or_(leased, sa.and_(ready, held)), sa.and_(ready, sa.not_(held))
    cancelled = conn.execute(
        sa.update(_T)
        .where(*where, ready)
        .values(state=int(models.State.CANCELLED), finished_at=now, last_error=note)
    ).rowcount
    count = sa.select(sa.func.count()).select_from(_T).where(*where, leased)
    return int(cancelled), int(conn.execute(count).scalar_one())


# -- inside the queue's transactions ----------------------------------------------------------


def lock_ranges(conn: Connection, queue: str, *, exclusive: bool) -> None:
    """PostgreSQL: ``queue``'s range lock for ``conn``'s transaction. A claim that may lease a
    range (``SqlQueue.claim``) reads which items are ready without locking a row, so it holds
    the lock alone; every other claim and a cancel share it. SQLite's write lock already
    keeps every writer apart."""
    if conn.dialect.name == "postgresql":
        how = "" if exclusive else "_shared"
        conn.execute(
            sa.text(f"SELECT pg_advisory_xact_lock{how}(:space, hashtext(:queue))"),
            {"space": RANGE_LOCK_SPACE, "queue": queue},
        )


# -- shared with the rollouts (``rollout``): one transaction, one audit row ------------------


@contextlib.contextmanager
def begin(engine: Engine) -> Iterator[Connection]:
    """A write transaction, behind the SQLite writer lock as the queue's own writes are."""
    url = engine.url.render_as_string(hide_password=True)
    with sqlite.writer_lock(engine), database.translate_errors(url), engine.begin() as conn:
        yield conn


@contextlib.contextmanager
def connect(engine: Engine) -> Iterator[Connection]:
    url = engine.url.render_as_string(hide_password=True)
    with database.translate_errors(url), engine.connect() as conn:
        yield conn


def _control(row: Any) -> QueueControl:
    return QueueControl(
        queue=row.queue,
        paused=bool(row.paused),
        paused_at=row.paused_at,
        paused_by=row.paused_by,
        reason=row.pause_reason,
        max_depth=None if row.max_depth is None else int(row.max_depth),
        ledger_horizon=row.ledger_horizon,
    )


def _read(conn: Connection, queue: str) -> QueueControl:
    row = conn.execute(sa.select(_C).where(_C.c.queue == queue)).first()
    return QueueControl(queue) if row is None else _control(row)


def locked_row(conn: Connection, queue: str, now: float) -> QueueControl:
    """The queue's row, created if missing and locked (PostgreSQL) until the transaction ends,
    so two operators changing one queue take turns (SQLite: the writer lock does)."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
    conn.execute(
        insert(_C)
        .values(queue=queue, paused=False, updated_at=now)
        .on_conflict_do_nothing(index_elements=["queue"])
    )
    q = sa.select(_C).where(_C.c.queue == queue)
    if conn.dialect.name == "postgresql":
        q = q.with_for_update()
    return _control(conn.execute(q).one())


def update_row(conn: Connection, queue: str, values: dict[str, Any], now: float) -> None:
    conn.execute(sa.update(_C).where(_C.c.queue == queue).values(updated_at=now, **values))


def record(
    conn: Connection, queue: str, action: str, actor: str, now: float, reason: str | None,
    detail: dict[str, Any], *, changed: bool = True,
) -> None:  # fmt: skip
    """The audit row of ``action``; of one that ``changed`` nothing, only for a known queue
    (a typo's would make it one acted on, and a purge's row is the retention's heartbeat)."""
    if not changed and not known(conn, queue):
        return
    values = {"queue": queue, "action": action, "actor": actor, "at": now, "reason": reason}
    conn.execute(_A.insert().values(detail=json.dumps(detail, sort_keys=True), **values))


def check_actor(actor: str) -> str:
    actor = actor.strip()
    if not actor or len(actor) > 200:
        raise errors.InputError(
            f"the actor must be 1 to 200 characters (who is acting: a user, breaker:RUN), "
            f"got {actor!r}"
        )
    return actor


def check_reason(reason: str | None, verb: str) -> str:
    text = _optional_reason(reason)
    if text is None:
        raise errors.InputError(
            f"{verb} needs a reason (--reason TEXT): it is recorded with who and when"
        )
    return text


def _optional_reason(reason: str | None) -> str | None:
    text = (reason or "").strip()
    return text[:2000] or None
