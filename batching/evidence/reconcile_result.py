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

import sqlalchemy as sa

from batching import errors, ports
from batching.evidence.findings import Report
from batching.store import schema

logger = logging.getLogger(__name__)

PREFIX = "reconcile-result:"


def remember(queue: ports.Fence, report: Report) -> None:
    """Record ``report`` as ``queue``'s last reconcile; a failure is logged, never raised
    (the reconcile's own result stands)."""
    name = PREFIX + queue.queue
    counts: Counter[tuple[str, str]] = Counter()
    for f in report.findings:
        counts[(str(f.kind), str(f.severity))] += f.count
    t = schema.sweeps
    try:
        with queue.begin() as conn:
            before = conn.execute(sa.select(t.c.progress).where(t.c.name == name)).scalar()
            last_clean = json.loads(before or "{}").get("last_clean_at")
            result = {
                "findings": [
                    {"class": k, "severity": s, "count": n} for (k, s), n in sorted(counts.items())
                ],
                "clean": report.clean,
                "last_clean_at": report.now if report.clean else last_clean,
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
