"""Admission to a capped queue, inside an enqueue's transaction (``SqlQueue.enqueue``).

* **the depth cap** (``batching queue cap``): an enqueue that would leave more than
  ``max_depth`` items ready or leased is refused whole (``errors.QueueFull``); keys already
  present do not count, so re-sending a file that went in is not refused.
* **shares of it**: once the queue is past half its cap, a tenant whose items would pass its
  weighted share of the cap is refused (``queue.tenant_weights``; 1.0 for a tenant not
  listed), so a tenant flooding the queue leaves the others the room of their shares, while a
  tenant alone still fills the whole queue.
"""

from __future__ import annotations

from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import errors
from batching.store import schema

_C = schema.queue_controls
_T = schema.items
# Built once (an enqueue of one request rebuilt three statements and their cache keys, ~40%
# of its CPU with a cap): the cap, and the count of one state's items by tenant.
_MAX_DEPTH = sa.select(_C.c.max_depth).where(_C.c.queue == sa.bindparam("b_queue"))
_BY_TENANT = {
    code: sa.select(_T.c.tenant, sa.func.count())
    .where(_T.c.queue == sa.bindparam("b_queue"), _T.c.state == sa.literal_column(code))
    .group_by(_T.c.tenant)
    for code in ("0", "1")
}


def max_depth(conn: Connection, queue: str) -> int | None:
    """``queue``'s depth cap, read in ``conn``'s transaction (an enqueue's). PostgreSQL: with
    a cap, enqueues to the queue then take turns (a transaction-scoped advisory lock, so a
    pause or a claim does not wait for them), each counting what those before committed;
    SQLite: the writer lock serializes them anyway."""
    value = conn.execute(_MAX_DEPTH, {"b_queue": queue}).scalar()
    if value is None:
        return None
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7271102, hashtext(:q))"), {"q": queue})
        value = conn.execute(_MAX_DEPTH, {"b_queue": queue}).scalar()
    return None if value is None else int(value)


def depth(conn: Connection, queue: str) -> int:
    """Items of ``queue`` ready or leased (each state counted on its partial index)."""
    total = 0
    for code in ("0", "1"):
        q = sa.select(sa.func.count()).select_from(_T)
        q = q.where(_T.c.queue == queue, _T.c.state == sa.literal_column(code))
        total += int(conn.execute(q).scalar_one())
    return total


def depth_by_tenant(conn: Connection, queue: str) -> dict[str, int]:
    """Items of ``queue`` ready or leased, by tenant: one count per state, each on its partial
    index (ready: ``ix_batching_items_tenant_ready``, in tenant order; leased: the leased
    index, a few claims' worth). One ``state IN (0, 1)`` count read the queue's rows through
    the key index and sorted them: a one-item capped enqueue at 100,000 ready items took
    ~50 ms against ~17 on SQLite (under its writer lock), ~65 against ~40 on PostgreSQL
    (``bench/cap_bench.py``). Still a count of the queue: a cap of millions needs counters
    kept per state, not counts."""
    depths: dict[str, int] = {}
    for count in _BY_TENANT.values():
        for tenant, n in conn.execute(count, {"b_queue": queue}):
            depths[str(tenant)] = depths.get(str(tenant), 0) + int(n)
    return depths


def over_share(
    queue: str,
    cap: int,
    depths: Mapping[str, int],
    added: Mapping[str, int],
    weights: Mapping[str, float],
    *,
    depth: int | None = None,
) -> None:
    """Raise ``QueueFull`` for a tenant whose items (ready, leased and just added) would pass
    its share of ``cap``: ``cap`` x its weight / the weights of the tenants with items (1.0
    for a tenant not in ``weights``). Called once the queue is past half its cap, so a lone
    tenant still fills it, and a flooding one leaves the others the room of their shares."""
    active = {t for t, n in depths.items() if n} | {t for t, n in added.items() if n}
    total = sum(weights.get(t, 1.0) for t in active)
    for tenant, n in sorted(added.items()):
        share = cap * weights.get(tenant, 1.0) / total
        have = depths.get(tenant, 0)
        if n and have + n > max(share, 1.0):
            raise errors.QueueFull(
                f"tenant {tenant!r} is at its share of queue {queue!r}'s depth cap ({have} items "
                f"ready or leased + {n} new > {share:.0f} of cap {cap}, shared by {len(active)} "
                f"tenants); nothing was enqueued: retry later",
                reason="tenant_share",
                room=_share_room(cap, depth, share, have),
            )


def _share_room(cap: int, depth: int | None, share: float, have: int) -> int | None:
    """Items the tenant's share still had room for, as the API's door reads it (0 or less:
    not even one); None when a one-item enqueue would not meet the share rule at all (it
    binds past half the cap only: ``depth`` is the queue's, the tenant's new items aside)."""
    if depth is None or 2 * (depth + 1) <= cap:
        return None
    return int(max(share, 1.0)) - have


def queue_full(queue: str, depth_now: int, adding: int, cap: int) -> errors.QueueFull:
    """The refusal of an enqueue of at least ``adding`` new items past ``cap``."""
    return errors.QueueFull(
        f"queue {queue!r} is at its depth cap ({depth_now} items ready or leased + at least "
        f"{adding} new > cap {cap}); nothing was enqueued: retry later or raise the cap with "
        f"`batching queue cap {queue} --max-depth N`",
        room=cap - depth_now,
    )
