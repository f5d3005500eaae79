"""Flow-test helpers: a real SQLite queue holding W1 items, and reads from the Prefect API."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import State, TaskRun
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter
from prefect.logging.handlers import APILogHandler

from batching.compose import build
from batching.config import load_config
from batching.evidence import lineage_log
from batching.ingress import ingest
from batching.ingress import queue as q
from batching.model import workloads

REPO = Path(__file__).resolve().parents[2]
TABULAR = str(REPO / "deployments" / "tabular.yaml")
BULK = str(REPO / "deployments" / "bulk.yaml")


@dataclass
class Pipeline:
    """One test's pipeline: a shipped config pointed at a SQLite file and folders in ``root``."""

    root: Path
    config: str
    overrides: dict[str, Any]

    @property
    def db_url(self) -> str:
        return str(self.overrides["database"]["url"])

    @property
    def db_file(self) -> Path:
        return self.root / "queue.db"

    @property
    def output(self) -> Path:
        return Path(self.overrides["output"]["path"])

    @property
    def events_path(self) -> Path:
        return Path(self.overrides["lineage"]["path"])

    def params(self, **extra: Any) -> dict[str, Any]:
        """Flow parameters naming this pipeline."""
        return {"config": self.config, "overrides": self.overrides, **extra}

    def queue(self, clock: Callable[[], float] = time.time) -> q.SqlQueue:
        """The pipeline's queue (dispose its engine when done)."""
        config = load_config(self.config, self.overrides)
        return build.open_queue(config, self.db_url, clock=clock, create=True)

    def by_state(self) -> dict[str, int]:
        queue = self.queue()
        try:
            return queue.stats().by_state
        finally:
            queue.engine.dispose()

    def lineage(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """OpenLineage events written by the file transport (of one run, when given)."""
        events = lineage_log.read_events(self.events_path)
        return [e for e in events if run_id is None or e["run"]["runId"] == run_id]


def make_pipeline(
    root: Path, n_items: int, *, config: str = TABULAR, batching: dict[str, Any] | None = None
) -> Pipeline:
    """Migrate a SQLite queue in ``root`` and enqueue the first ``n_items`` W1 rows."""
    root.mkdir(parents=True, exist_ok=True)
    overrides = {
        "database": {"url": f"sqlite:///{root / 'queue.db'}"},
        "output": {"path": str(root / "outputs" / "scores")},
        "lineage": {"path": str(root / "lineage" / "events.jsonl")},
        "batching": {"max_wait_s": 0.01, **(batching or {})},
    }
    pipeline = Pipeline(root, config, overrides)
    queue = pipeline.queue()
    try:
        queue.migrate()
        if n_items:
            file = workloads.write_w1_parquet(root / "w1.parquet", n_items)
            queue.enqueue(ingest.read_records(file))
    finally:
        queue.engine.dispose()
    return pipeline


def enqueue_w2(pipeline: Pipeline, n_items: int) -> None:
    """Enqueue the first ``n_items`` W2 token sequences (JSONL records)."""
    file = workloads.write_lines(pipeline.root / "w2.jsonl", workloads.w2_json_lines(n_items))
    queue = pipeline.queue()
    try:
        queue.enqueue(ingest.read_records(file))
    finally:
        queue.engine.dispose()


def run_id_of(state: State[Any]) -> str:
    """The flow-run id of a flow called with ``return_state=True``."""
    return str(state.state_details.flow_run_id)


def _runs(run_id: str) -> FlowRunFilter:
    return FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)]))


def artifacts_of(run_id: str) -> list[Any]:
    with get_client(sync_client=True) as client:
        return list(client.read_artifacts(flow_run_filter=_runs(run_id)))


def task_runs_of(run_id: str) -> list[TaskRun]:
    with get_client(sync_client=True) as client:
        return list(client.read_task_runs(flow_run_filter=_runs(run_id)))


def logs_of(run_id: str) -> list[Any]:
    """The run's logs on the server, after flushing the log worker."""
    APILogHandler().flush()
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
    with get_client(sync_client=True) as client:
        return list(client.read_logs(log_filter=log_filter))


def events_named(name: str, since: float) -> list[Any]:
    """Events called ``name`` the server stored since ``since`` (epoch seconds)."""
    when = EventOccurredFilter(since=datetime.fromtimestamp(since, UTC))
    event_filter = EventFilter(event=EventNameFilter(name=[name]), occurred=when)
    with get_client(sync_client=True) as client:
        return list(client.read_events(filter=event_filter, limit=50).events)
