"""The last reconcile's result per queue, kept for the metrics exporter
(``batching_reconcile_*`` gauges): its findings by class and severity, when it ran, and when
a reconcile of the queue was last clean.

Kept in ``batching_sweeps`` (schema 12) as the row ``reconcile-result:<queue>`` (``progress``:
JSON), so no migration is needed; sweeps look their rows up by their own names.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import sqlalchemy as sa

from batching import errors, ports
from batching.evidence.findings import Report
from batching.store import schema

logger = logging.getLogger(__name__)

PREFIX = "reconcile-result:"


def remember(queue: ports.Fence, report: Report) -> None:
    """Record ``report`` as ``queue``'s last reconcile; a failure is logged, never raised
    (the reconcile's own result stands).

    A reconcile of part of the queue (``--run``, ``--since``) clears the findings kept only
    when it looked at everything they came from (:func:`_covers`): before, the clean
    reconcile of the next run cleared a missing file found by the whole-queue one, and the
    page resolved with the file still missing (found by a review). Its own findings are
    added to those kept, whose scope then widens to the whole queue."""
    name = PREFIX + queue.queue
    scope = {"since": report.since, "run_id": report.run_id}
    t = schema.sweeps
    try:
        with queue.begin() as conn:
            before = conn.execute(sa.select(t.c.progress).where(t.c.name == name)).scalar()
            kept = json.loads(before or "{}")
            open_ = kept.get("findings") if not kept.get("clean", True) else None
            kept_scope = kept.get("scope") or {"since": None, "run_id": None}
            findings = _counts(report)
            if open_ and not _covers(scope, kept_scope):
                findings = _merged(open_, findings)
                scope = kept_scope if report.clean else _widest(scope, kept_scope)
            clean = not any(f["severity"] != "info" for f in findings)
            result = {
                "findings": findings,
                "clean": clean,
                "last_clean_at": report.now if clean else kept.get("last_clean_at"),
                "scope": scope,
            }
            values = {
                "cursor": None,
                "started_at": report.now,
                "updated_at": report.now,
                "finished_at": report.now,
                "progress": json.dumps(result),
            }
            if before is None:
                conn.execute(sa.insert(t).values(name=name, **values))
            else:
                conn.execute(sa.update(t).where(t.c.name == name).values(**values))
    except errors.QueueError:
        logger.warning(
            "reconcile result not recorded for the metrics",
            extra={"action": "reconcile_result_failed", "queue": queue.queue},
            exc_info=True,
        )


def _counts(report: Report) -> list[dict[str, Any]]:
    counts: Counter[tuple[str, str]] = Counter()
    for f in report.findings:
        counts[(str(f.kind), str(f.severity))] += f.count
    return [{"class": k, "severity": s, "count": n} for (k, s), n in sorted(counts.items())]


def _merged(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each class and severity at the larger of its two counts (the same finding seen twice
    is not two)."""
    most: dict[tuple[str, str], int] = {}
    for f in [*kept, *new]:
        key = (f["class"], f["severity"])
        most[key] = max(most.get(key, 0), int(f["count"]))
    return [{"class": k, "severity": s, "count": n} for (k, s), n in sorted(most.items())]


def _widest(one: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """A scope covering both: the earlier of two windows, else the whole queue."""
    if (
        one["run_id"] is None
        and other["run_id"] is None
        and None
        not in (
            one["since"],
            other["since"],
        )
    ):
        return {"since": min(one["since"], other["since"]), "run_id": None}
    return {"since": None, "run_id": None}


def _covers(scope: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a reconcile of ``scope`` looked at everything one of ``kept`` looked at: the
    whole queue covers all; a run, that run; a window, any window starting no later (a
    run's batches may lie outside it)."""
    if scope["since"] is None and scope["run_id"] is None:
        return True
    if scope["run_id"] is not None:
        return bool(kept["run_id"] == scope["run_id"] and kept["since"] is None)
    return kept["run_id"] is None and kept["since"] is not None and scope["since"] <= kept["since"]
