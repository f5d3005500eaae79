"""Rollouts: which model version scores a queue's items, changed only by command, each change
one transaction with its audit row, and what each version did since.

* **start** a candidate beside the stable version, on a share of the key space and/or a list
  of tenants (``batching.routing``), optionally shadowing a sample of the stable items;
* **promote**: the candidate becomes the stable version, for every item;
* **rollback**: the candidate stops; the stable version scores everything again. The guard
  (:func:`judge`, ``batching rollout guard``) rolls back on its own when the candidate's
  error rate or latency breaches ``rollout`` in the config (action ``auto-rollback``).

A change reads the queue's route under the row's lock (SQLite: the writer lock), refuses a
change that does not follow from it (promote without a candidate, a stale ``epoch``), writes
the new route and its ``batching_queue_audit`` row (``rollout-start``, ``promote``,
``rollback``, ``auto-rollback``; who, when, why, from, to) and commits both or neither: a
process killed part way leaves the old route and no row, or the new route and its row.
Scorers read the route in every claim's transaction (``queue._LOOK``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from batching import errors, models
from batching.config import RolloutConfig
from batching.ingress import controls
from batching.routing import Route
from batching.store import schema

ACTIONS = ("rollout-start", "promote", "rollback", "auto-rollback")
STATS_ROWS = 200_000
"""The most recent items a status reads (by id); older ones are left out, and it says so."""

_C = schema.queue_controls
_T = schema.items
_B = schema.batches


@dataclass(frozen=True)
class Change:
    """A route change as recorded: the route before (None: the queue had none) and after,
    who made it and why."""

    action: str
    before: Route | None
    after: Route
    actor: str
    reason: str


def current(engine: Engine, queue: str) -> Route | None:
    """The queue's route (None: it has none; the scorers' configured version runs)."""
    with controls.connect(engine) as conn:
        text = conn.execute(sa.select(_C.c.route).where(_C.c.queue == queue)).scalar()
    return None if text is None else Route.from_json(text)


def start(
    engine: Engine,
    queue: str,
    *,
    stable: str,
    candidate: str,
    percent: float,
    tenants: Sequence[str] = (),
    shadow: float = 0.0,
    actor: str,
    reason: str,
    now: float,
) -> Change:
    """Route ``percent`` of the keys (of ``tenants``, when given) to ``candidate``; ``stable``
    is the queue's stable version when it has no route yet (the config's ``model.version``).

    Raises:
        InputError: a bad share, ``candidate`` equal to the stable version, or a rollout
            already under way (promote or roll it back first).
    """
    if not 0 <= percent <= 100 or not 0 <= shadow <= 100 or math.isnan(percent + shadow):
        raise errors.InputError(
            f"--percent and --shadow are percentages from 0 to 100, got {percent:g} and {shadow:g}"
        )
    if percent == 0 and shadow == 0:
        raise errors.InputError(
            "a rollout with --percent 0 and no --shadow sends the candidate nothing; give "
            "--percent, --shadow, or both"
        )

    def change(before: Route | None) -> Route:
        base = before or Route(stable)
        if base.candidate is not None:
            raise errors.InputError(
                f"queue {queue!r} already has a rollout ({base.describe()}); promote or "
                "roll it back first"
            )
        if candidate == base.stable:
            raise errors.InputError(
                f"model version {candidate!r} is already the stable version of queue "
                f"{queue!r}; name another version as the candidate"
            )
        return replace(
            base,
            candidate=candidate,
            percent=float(percent),
            tenants=tuple(dict.fromkeys(tenants)),
            shadow=float(shadow),
        )

    return _change(engine, queue, "rollout-start", change, actor, reason, now)


def promote(
    engine: Engine,
    queue: str,
    *,
    actor: str,
    reason: str,
    now: float,
    listed: Collection[str] | None = None,
) -> Change:
    """Make the candidate the stable version for every item. ``listed``: the versions the
    promoting config's registry lists; a candidate outside them is refused (the scorers
    running that config would fail at their first batch).

    Raises:
        InputError: the queue has no candidate, or it is not ``listed``.
    """

    def change(before: Route | None) -> Route:
        if before is None or before.candidate is None:
            raise errors.InputError(
                f"queue {queue!r} has no candidate to promote; start one with "
                "`batching rollout start`"
            )
        if listed is not None and before.candidate not in listed:
            raise errors.InputError(
                f"queue {queue!r}'s candidate {before.candidate!r} is not in this config's "
                f"registry (it lists {', '.join(sorted(listed))}); promote with the config "
                "the scorers run, or add the version under model_versions; nothing changed"
            )
        return Route(before.candidate)

    return _change(engine, queue, "promote", change, actor, reason, now)


def rollback(
    engine: Engine,
    queue: str,
    *,
    actor: str,
    reason: str,
    now: float,
    action: str = "rollback",
    expect_epoch: int | None = None,
) -> Change:
    """Stop the candidate: the stable version scores everything again. ``expect_epoch``: refuse
    unless the route is still the one judged (the guard's; another change came first).

    Raises:
        InputError: the queue has no candidate, or its route changed since ``expect_epoch``.
    """

    def change(before: Route | None) -> Route:
        if before is None or before.candidate is None:
            undo = (
                ""
                if before is None
                else f" ({before.stable} is the stable version); to go back to an earlier "
                "version, start it as the candidate at 100% (`batching rollout start "
                "--candidate VERSION --percent 100`), then `batching rollout promote`"
            )
            raise errors.InputError(f"queue {queue!r} has no candidate to roll back{undo}")
        if expect_epoch is not None and before.epoch != expect_epoch:
            raise errors.InputError(
                f"queue {queue!r}'s route changed while it was judged (epoch {expect_epoch} "
                f"-> {before.epoch}); judge it again"
            )
        return Route(before.stable)

    return _change(engine, queue, action, change, actor, reason, now)


def history(engine: Engine, queue: str, limit: int = 20) -> list[controls.AuditRow]:
    """The latest ``limit`` route changes of ``queue``, oldest first."""
    if limit < 1:
        return []
    rows = controls.audit(engine, queue, limit=min(max(limit * 10, 100), controls.MAX_AUDIT))
    return [r for r in rows if r.action in ACTIONS][-limit:]


def _change(
    engine: Engine,
    queue: str,
    action: str,
    change: Callable[[Route | None], Route],
    actor: str,
    reason: str,
    now: float,
) -> Change:
    actor, reason = controls.check_actor(actor), controls.check_reason(reason, action)
    with controls.begin(engine) as conn:
        controls.locked_row(conn, queue, now)
        text = conn.execute(sa.select(_C.c.route).where(_C.c.queue == queue)).scalar()
        before = None if text is None else Route.from_json(text)
        after = change(before)
        epoch = (before.epoch if before is not None else 0) + 1
        after = replace(after, epoch=epoch, since=now)
        controls.update_row(conn, queue, {"route": after.to_json()}, now)
        detail = {
            "from": None if before is None else before.as_dict(),
            "to": after.as_dict(),
        }
        controls.record(conn, queue, action, actor, now, reason, detail)
    return Change(action, before, after, actor, reason)


# -- what each version did ------------------------------------------------------------------


@dataclass(frozen=True)
class VersionStats:
    """What one version did with the items it scored or failed since the route began."""

    version: str
    role: str  # "stable" or "candidate"
    items: int  # committed, or failed at least once, by this version
    committed: int
    errors: int  # items whose forward pass failed under this version (retried or dead)
    dead: int
    p50_s: float | None
    p99_s: float | None
    sla_misses: int

    @property
    def error_rate(self) -> float:
        return self.errors / self.items if self.items else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"error_rate": self.error_rate}


def version_stats(
    engine: Engine, queue: str, route: Route, slo_s: float
) -> tuple[list[VersionStats], bool]:
    """Per version of ``route`` (stable first), over the items of ``queue`` finished (or
    failed and scheduled again) since it began: committed (its batch's version, from the ledger), failed (the version recorded
    at the failure), latency from enqueue to commit, SLA misses (past a deadline or
    ``slo_s``). Also whether older items were left out (more than :data:`STATS_ROWS`)."""
    q = (
        sa.select(
            _T.c.state,
            _T.c.enqueued_at,
            _T.c.finished_at,
            _T.c.deadline_at,
            _T.c.model_version.label("failed_by"),
            _B.c.model_version.label("scored_by"),
        )
        .select_from(_T.outerjoin(_B, _B.c.batch_id == _T.c.batch_id))
        .where(
            _T.c.queue == queue,
            sa.or_(_T.c.finished_at >= route.since, _T.c.run_after >= route.since),
            # scored or failed by some version: a backlog not yet tried is no evidence
            sa.or_(_T.c.batch_id.is_not(None), _T.c.model_version.is_not(None)),
        )
        .order_by(_T.c.id.desc())
        .limit(STATS_ROWS + 1)
    )
    with controls.connect(engine) as conn:
        rows = conn.execute(q).all()
    cut = len(rows) > STATS_ROWS
    rows = rows[:STATS_ROWS]
    done, dead = int(models.State.DONE), int(models.State.DEAD)
    out = []
    for version in route.versions:
        latencies: list[float] = []
        items = errors_ = dead_n = misses = 0
        for r in rows:
            scored = r.state == done and r.scored_by == version
            # only a failure writes the item's version (an ack clears its error, not this)
            failed = r.failed_by == version
            if not (scored or failed):
                continue
            items += 1
            errors_ += failed
            dead_n += failed and r.state == dead
            if scored and r.finished_at is not None:
                latency = r.finished_at - r.enqueued_at
                latencies.append(latency)
                late = r.deadline_at is not None and r.finished_at > r.deadline_at
                misses += late or latency > slo_s
        latencies.sort()
        out.append(
            VersionStats(
                version,
                "stable" if version == route.stable else "candidate",
                items,
                len(latencies),
                errors_,
                dead_n,
                _quantile(latencies, 0.5),
                _quantile(latencies, 0.99),
                misses,
            )
        )
    return out, cut


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``values`` (nearest rank); None for none."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def judge(stats: Sequence[VersionStats], guard: RolloutConfig) -> str | None:
    """Why the candidate must be rolled back, or None: its error rate past
    ``max_error_rate``, or its p99 past ``max_p99_s`` or past ``max_p99_ratio`` times the
    stable version's, once it has ``min_items`` items (and the stable version too, for the
    ratio)."""
    by_role = {s.role: s for s in stats}
    cand, stable = by_role.get("candidate"), by_role.get("stable")
    if cand is None or cand.items < guard.min_items:
        return None
    if cand.error_rate > guard.max_error_rate:
        return (
            f"candidate {cand.version} failed {cand.errors} of {cand.items} items "
            f"({cand.error_rate:.1%} > max_error_rate {guard.max_error_rate:.1%})"
        )
    if cand.p99_s is None:
        return None
    if guard.max_p99_s is not None and cand.p99_s > guard.max_p99_s:
        return f"candidate {cand.version} p99 {cand.p99_s:.3f}s > max_p99_s {guard.max_p99_s:g}s"
    if (
        stable is not None
        and stable.p99_s is not None
        and stable.committed >= guard.min_items
        and cand.p99_s > guard.max_p99_ratio * stable.p99_s
    ):
        return (
            f"candidate {cand.version} p99 {cand.p99_s:.3f}s > {guard.max_p99_ratio:g}x "
            f"stable {stable.version}'s {stable.p99_s:.3f}s"
        )
    return None
