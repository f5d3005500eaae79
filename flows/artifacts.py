"""Prefect artifacts of the flows: run summary, progress, reconcile findings.

Keys are stable per pipeline config (``<config name>-summary``, ...), so the Artifacts page keeps
one history per pipeline, and each run shows its own versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactUpdate

from batching.evidence import reconcile as rc
from batching.loop import stats as run_stats
from flows.settings import artifact_key

logger = logging.getLogger(__name__)
_SAMPLE = 3


def _id(created: UUID | Coroutine[Any, Any, UUID]) -> UUID:
    """The artifact id: Prefect's ``create_*`` return it directly when called from sync code."""
    return cast(UUID, created)


def summary_rows(summary: Mapping[str, Any]) -> list[dict[str, str]]:
    """The run summary as ``metric`` / ``value`` rows (the CLI's closing table)."""
    return [{"metric": m, "value": v} for m, v in run_stats.summary_rows(summary)]


def publish_summary(name: str, run_id: str, summary: Mapping[str, Any], output: str) -> UUID:
    """Create the run summary table artifact; returns its id."""
    return _id(
        create_table_artifact(
            table=summary_rows(summary),
            key=artifact_key(name, "summary"),
            description=f"Scoring run `{run_id}` of `{name}`; outputs in `{output}`.",
        )
    )


class Progress:
    """A progress artifact kept current from the pipeline's commit thread; a context manager.

    ``total`` is the work the run expects (ready items at its start, capped by ``max_items``).
    The artifact is updated at most every ``interval_s`` seconds, through a client this object
    owns (Prefect's helper would leave one open per worker thread), and never fails the run.
    Updates are sent from a thread of their own, the latest share only: with the API slow or
    down, the client's retries took minutes, and the commit thread waited on them. A clean
    exit records the final share (waiting at most ``exit_wait_s`` for it).
    """

    def __init__(
        self, name: str, total: int, interval_s: float = 2.0, exit_wait_s: float = 10.0
    ) -> None:
        self.name = name
        self.total = total
        self.interval_s = interval_s
        self.exit_wait_s = exit_wait_s
        self.artifact_id: UUID | None = None
        self._client: SyncPrefectClient | None = None
        self._done = 0
        self._last = time.monotonic()
        self._pending: float | None = None  # the latest share not sent yet
        self._wake = threading.Event()
        self._closing = False
        self._swap = threading.Lock()  # guards _pending and _closing
        self._sender: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self.artifact_id = _id(
            create_progress_artifact(
                progress=0.0,
                key=artifact_key(self.name, "progress"),
                description=f"Items committed or failed of the {self.total} ready at the start.",
            )
        )
        self._client = get_client(sync_client=True).__enter__()
        self._sender = threading.Thread(target=self._send_loop, name="progress", daemon=True)
        self._sender.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._post(self.percent(self._done))
        with self._swap:
            self._closing = True
        self._wake.set()
        if self._sender is None:
            return
        self._sender.join(self.exit_wait_s)  # it sends the last share, then closes the client
        if self._sender.is_alive():
            logger.warning("progress artifact not updated at the end (the API is slow)")

    def __call__(self, stats: run_stats.RunStats) -> None:
        """``on_progress`` hook: called after every batch."""
        self.counts(stats.committed, stats.failed, stats.claimed)

    def counts(self, committed: int, failed: int, _claimed: int) -> None:
        """The same from counts (the workers' summed progress, ``run_workers``)."""
        self._done = committed + failed
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        self._post(self.percent(self._done))

    def percent(self, done: int) -> float:
        """Share of ``total`` done, in percent, at most 100."""
        return 100.0 if self.total <= 0 else min(100.0, 100.0 * done / self.total)

    def _post(self, percent: float) -> None:
        with self._swap:
            self._pending = percent
        self._wake.set()

    def _send_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._swap:  # a post between a read and a reset would be lost
                percent, self._pending = self._pending, None
            if percent is not None:
                self._update(percent)
            with self._swap:
                if self._closing and self._pending is None:
                    break
        if self._client is not None:  # closed by whoever uses it last: this thread
            self._client.__exit__(None, None, None)
            self._client = None

    def _update(self, percent: float) -> None:
        if self._client is None or self.artifact_id is None:
            return
        try:
            self._client.update_artifact(self.artifact_id, ArtifactUpdate(data=percent))
        except Exception:  # progress is cosmetic: never fail or stall a run over it
            logger.warning("progress artifact not updated", exc_info=True)


def finding_rows(findings: Sequence[rc.Finding]) -> list[dict[str, Any]]:
    """One row per finding: class, severity, count, message and a few examples."""
    return [
        {
            "class": str(f.kind),
            "severity": str(f.severity),
            "count": f.count,
            "message": f.message,
            "examples": ", ".join((*f.item_keys, *f.files, *f.batch_ids)[:_SAMPLE]),
        }
        for f in findings
    ]


def _not_judged(report: rc.Report) -> str:
    """The queue's items the reconcile did not judge (not done), when there are any: a clean
    verdict beside a killed run's items still leased read as all scored (a review)."""
    if not report.not_done or not any(report.not_done):
        return ""
    leased, ready = report.not_done
    return f" Not judged yet: {leased} item(s) leased, {ready} ready (not done)."


def publish_findings(name: str, report: rc.Report, title: str) -> UUID:
    """Create the reconcile findings table artifact; returns its id."""
    verdict = "clean" if report.clean else "ok (warnings only)" if report.ok else "CRITICAL"
    repairs = ", ".join(f"{r.action} {r.target}" for r in report.repairs[:10]) or "none"
    rows = finding_rows(report.findings) or [
        {"class": "-", "severity": "clean", "count": 0, "message": "no findings", "examples": ""}
    ]
    return _id(
        create_table_artifact(
            table=rows,
            key=artifact_key(name, "reconcile"),
            description=f"{title}: {verdict} on `{report.location}`; repairs: {repairs}."
            + _not_judged(report),
        )
    )
