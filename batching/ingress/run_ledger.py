"""The run ledger, ``batching_runs``: one row per scoring or reconcile run (start, heartbeat,
finish with its summary), closing runs whose process died without closing them, and which
runs that committed rows no reconcile has checked yet (``reconciled_at``, migration 12).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import models
from batching.ingress.queue import SqlQueue
from batching.store import schema

logger = logging.getLogger(__name__)


def _committed_rows(conn: Connection, run_id: str) -> int:
    """Rows the run and its workers committed, from the batch ledger."""
    r, b = schema.runs.c, schema.batches.c
    workers = sa.select(r.run_id).where(r.parent_run_id == run_id)
    ids = [run_id, *conn.execute(workers).scalars()]
    live = b.state.in_(models.LIVE_BATCH_STATES)  # a repair's rewrite keeps its run id
    total = sa.select(sa.func.coalesce(sa.func.sum(b.n_rows), 0)).where(b.run_id.in_(ids), live)
    return int(conn.execute(total).scalar_one())


class RunLedger:
    """Rows of ``batching_runs``: one per scoring or reconcile run (start, finish, summary)."""

    def __init__(self, queue: SqlQueue) -> None:
        self._queue = queue
        self._before: dict[str, tuple[int, int, int]] = {}  # a resumed run's earlier counts

    def start(
        self,
        run_id: str,
        flow: str,
        *,
        config_hash: str | None = None,
        model_version: str | None = None,
        model_sha256: str | None = None,
        parent_run_id: str | None = None,
        resume: bool = False,
        output: tuple[str, str] | None = None,
    ) -> models.RunSoFar | None:
        """Record a run as ``running``; ``parent_run_id``: the run this one is a worker of.

        ``output``: its output dataset (lineage's namespace and name).

        A run id already on record restarts its row, unless ``resume`` (a retry of the run:
        a Prefect task retry reuses the flow run's id): then the row keeps when the run
        started, and the rows that the run and its workers committed are counted from the
        batch ledger (an attempt that failed or died may have committed more than it
        reported); ``finish`` adds this attempt's counts to them. What the earlier attempts
        did is returned; else None.
        """
        r = schema.runs.c
        now = self._queue.clock()
        row = {
            "parent_run_id": parent_run_id,
            "flow": flow,
            "queue": self._queue.queue,
            "config_hash": config_hash,
            "model_version": model_version,
            "model_sha256": model_sha256,
            "output": json.dumps(output) if output is not None else None,
            "state": "running",
            "heartbeat_at": now,
            "finished_at": None,
            "error": None,
        }
        with self._queue.begin() as conn:
            prior = conn.execute(
                sa.select(r.started_at, r.n_failed, r.n_batches).where(r.run_id == run_id)
            ).first()
            if prior is None or not resume:
                conn.execute(sa.delete(schema.runs).where(r.run_id == run_id))
                conn.execute(schema.runs.insert().values(run_id=run_id, started_at=now, **row))
                self._before[run_id] = (0, 0, 0)
                return None
            committed = _committed_rows(conn, run_id)
            update = sa.update(schema.runs).where(r.run_id == run_id)
            conn.execute(update.values(n_items=committed, **row))
        self._before[run_id] = (int(committed), prior.n_failed, prior.n_batches)
        return models.RunSoFar(prior.started_at, int(committed), prior.n_failed)

    def beat(self, run_id: str) -> None:
        """Record that a running run is alive (its scorer's heartbeat calls it)."""
        r = schema.runs.c
        with self._queue.begin() as conn:
            conn.execute(
                sa.update(schema.runs)
                .where(r.run_id == run_id, r.state == "running")
                .values(heartbeat_at=self._queue.clock())
            )

    def close_abandoned(
        self, silent_for_s: float, *, but: str | None = None
    ) -> list[models.AbandonedRun]:
        """Close as ``failed`` this queue's runs still ``running`` whose heartbeat stopped
        more than ``silent_for_s`` ago: their process died (killed, or its machine lost)
        without closing them. Runs that never beat (before migration 8) are left alone, and
        so is ``but`` (the run about to start: a retry reuses its id)."""
        r = schema.runs.c
        now = self._queue.clock()
        stale = sa.and_(
            r.queue == self._queue.queue,
            r.state == "running",
            r.heartbeat_at.is_not(None),
            r.heartbeat_at < now - silent_for_s,
            r.run_id != but if but is not None else sa.true(),
        )
        with self._queue.begin() as conn:
            rows = conn.execute(
                sa.select(r.run_id, r.flow, r.parent_run_id, r.heartbeat_at, r.output).where(stale)
            ).all()
            closed = []
            for row in rows:
                when = datetime.fromtimestamp(row.heartbeat_at, UTC).isoformat(timespec="seconds")
                committed = _committed_rows(conn, row.run_id)  # it never reported them
                error = (
                    f"abandoned: no heartbeat since {when} (its process died), "
                    f"{committed} row(s) committed"
                )
                n = conn.execute(
                    sa.update(schema.runs)
                    .where(r.run_id == row.run_id, stale)
                    .values(state="failed", finished_at=now, error=error, n_items=committed)
                ).rowcount
                if n:
                    closed.append(
                        models.AbandonedRun(
                            row.run_id,
                            row.flow,
                            row.parent_run_id,
                            error,
                            committed=committed,
                            output=tuple(json.loads(row.output)) if row.output else None,
                        )
                    )
            # A worker whose parent is not running either (closed just now, or ended) has no
            # one left to close it in lineage.
            parents = {a.parent_run_id for a in closed if a.parent_run_id is not None}
            alive = set(
                conn.execute(
                    sa.select(r.run_id).where(r.run_id.in_(parents), r.state == "running")
                ).scalars()
            )
            closed = [
                replace(a, orphan=a.parent_run_id is not None and a.parent_run_id not in alive)
                for a in closed
            ]
        if closed:
            logger.warning(
                "%d abandoned run(s) closed as failed: %s",
                len(closed),
                ", ".join(a.run_id for a in closed),
                extra={"action": "runs_abandoned", "run_ids": [a.run_id for a in closed]},
            )
        return closed

    def finish(
        self, run_id: str, state: str, summary: Mapping[str, Any], error: str | None = None
    ) -> None:
        """Record how a run ended, ``completed`` or ``failed``, with its summary as JSON; or
        ``running``: an attempt failed and the run will be retried (if the retry never comes,
        the run is closed as abandoned). The counts of a run resumed by ``start`` are its
        earlier attempts' plus this one's."""
        items, failed, batches = self._before.get(run_id, (0, 0, 0))
        values = {
            "state": state,
            "finished_at": None if state == "running" else self._queue.clock(),
            "n_items": items + int(summary.get("items_committed", 0)),
            "n_failed": failed + int(summary.get("items_failed", 0)),
            "n_batches": batches + int(summary.get("batches", 0)),
            "summary": json.dumps(summary, default=str),
            "error": error[:2000] if error else None,
        }
        with self._queue.begin() as conn:
            conn.execute(
                sa.update(schema.runs).where(schema.runs.c.run_id == run_id).values(**values)
            )

    def known(self, run_id: str) -> bool:
        """Whether the ledger holds the run ``run_id`` (started, whatever became of it)."""
        r = schema.runs.c
        with self._queue.read() as conn:
            found = conn.execute(sa.select(r.run_id).where(r.run_id == run_id).limit(1)).first()
        return found is not None

    def committed(self, run_id: str) -> int:
        """Rows the run and its workers committed, from the batch ledger (0 for a run not on
        record): what decides whether a run's end asks for a reconcile of it."""
        with self._queue.begin() as conn:
            return _committed_rows(conn, run_id)

    def unreconciled(self, flow: str, settled_s: float, *, limit: int) -> list[str]:
        """Runs of ``flow`` (a config name) on this queue that no reconcile has checked, oldest
        first, at most ``limit``: top-level runs (a run's reconcile covers its workers) that
        committed rows and ended more than ``settled_s`` ago, or still read ``running`` with no
        heartbeat for that long (their process died and no later run closed them)."""
        r = schema.runs.c
        cutoff = self._queue.clock() - settled_s
        ended = sa.or_(
            sa.and_(r.state != "running", r.finished_at < cutoff, r.n_items > 0),
            sa.and_(r.state == "running", r.heartbeat_at < cutoff),
        )
        candidates = (
            sa.select(r.run_id)
            .where(
                r.queue == self._queue.queue,
                r.flow == flow,
                r.parent_run_id.is_(None),
                r.reconciled_at.is_(None),
                ended,
            )
            .order_by(r.started_at, r.run_id)
        )
        found: list[str] = []
        with self._queue.begin() as conn:
            for run_id in conn.execute(candidates).scalars():
                if _committed_rows(conn, run_id) > 0:
                    found.append(run_id)
                    if len(found) >= limit:
                        break
        return found

    def costs(self, since: float) -> dict[str, Any]:
        """Device seconds of this queue's runs that ended since ``since``, from their
        summaries: in all, by tenant (apportioned by cost) and by model version. Top-level
        runs only: a run's summary holds its workers'."""
        r = schema.runs.c
        stmt = sa.select(r.summary).where(
            r.queue == self._queue.queue,
            r.parent_run_id.is_(None),
            r.finished_at >= since,
            r.summary.is_not(None),
        )
        total, runs = 0.0, 0
        by: dict[str, dict[str, float]] = {"device_s_by_tenant": {}, "device_s_by_version": {}}
        with self._queue.read() as conn:
            for text in conn.execute(stmt).scalars():
                summary = json.loads(text)
                if "device_s" not in summary:  # a run from before costs were kept
                    continue
                runs += 1
                total += float(summary["device_s"])
                for field, into in by.items():
                    for key, seconds in (summary.get(field) or {}).items():
                        into[key] = into.get(key, 0.0) + float(seconds)
        return {
            "runs": runs,
            "device_s": total,
            "by_tenant": by["device_s_by_tenant"],
            "by_model_version": by["device_s_by_version"],
        }

    def mark_reconciled(self, run_id: str) -> None:
        """Record that a reconcile checked the run's batches (and so its workers')."""
        r = schema.runs.c
        with self._queue.begin() as conn:
            conn.execute(
                sa.update(schema.runs)
                .where(r.run_id == run_id)
                .values(reconciled_at=self._queue.clock())
            )
