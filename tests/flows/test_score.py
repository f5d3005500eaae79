"""The score flow under the real Prefect harness: real SQLite, torch, Parquet and OpenLineage."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq
import pytest
from referencing import Registry

from batching import errors
from batching.evidence import lineage
from batching.ingress import ingest
from batching.ingress import queue as q
from flows.score import score
from tests import olspec
from tests.conftest import wait_for
from tests.flows.support import (
    Pipeline,
    artifacts_of,
    logs_of,
    make_pipeline,
    run_id_of,
    task_runs_of,
)

N_ITEMS = 300


@dataclass
class Run:
    """One finished flow run: its pipeline, final state, id and wall time."""

    pipeline: Pipeline
    state: Any
    run_id: str
    wall_s: float

    @property
    def summary(self) -> dict[str, Any]:
        return dict(self.state.result())


def run_score(pipeline: Pipeline, **params: Any) -> Run:
    started = time.perf_counter()
    state = score(**pipeline.params(**params), return_state=True)
    return Run(pipeline, state, run_id_of(state), time.perf_counter() - started)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A score run over 300 W1 items in micro-batches of at most 64."""
    pipeline = make_pipeline(
        tmp_path_factory.mktemp("healthy"), N_ITEMS, batching={"max_batch_size": 64}
    )
    pipeline.overrides["metrics"] = {"textfile_path": str(pipeline.root / "run.prom")}
    return run_score(pipeline)


def test_a_score_run_scores_every_item_once(healthy: Run) -> None:
    assert healthy.state.is_completed(), healthy.state.message
    summary = healthy.summary
    assert summary["items_committed"] == N_ITEMS
    assert summary["batches"] >= N_ITEMS // 64
    assert healthy.pipeline.by_state()["done"] == N_ITEMS
    keys = pq.read_table(healthy.pipeline.output)["item_key"].to_pylist()
    assert sorted(keys) == sorted(f"w1-{i}" for i in range(N_ITEMS))


def test_the_run_writes_its_metrics_for_the_textfile_collector_at_its_end(healthy: Run) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    text = (healthy.pipeline.root / "run.prom").read_text()
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in ("batching_items_committed_total", "batching_batch_size_items_count")
    }
    summary = healthy.summary
    assert values == {
        "batching_items_committed_total": summary["items_committed"],
        "batching_batch_size_items_count": summary["batches"],
    }


def test_a_single_scorer_is_a_child_run_whose_parent_is_the_flow_run(
    healthy: Run, registry: Registry
) -> None:
    """Before: the scorer was the flow run's lineage run itself, with no parent facet."""
    children = [e for e in healthy.pipeline.lineage() if e["run"]["runId"] != healthy.run_id]
    assert [e["eventType"] for e in children] == ["START", "COMPLETE"]
    assert {e["job"]["name"] for e in children} == {"score-tabular.worker-0"}
    for event in children:
        olspec.assert_valid_event(event, registry)
        parent = event["run"]["facets"]["parent"]
        assert (parent["run"]["runId"], parent["job"]["name"]) == (healthy.run_id, "score-tabular")
    (out,) = children[-1]["outputs"]
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == N_ITEMS


def test_lineage_start_and_complete_are_valid_and_carry_datasets_and_rows(
    healthy: Run, registry: Registry
) -> None:
    events = healthy.pipeline.lineage(healthy.run_id)
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    for event in events:
        olspec.assert_valid_event(event, registry)
    complete = events[-1]
    assert complete["job"]["name"] == "score-tabular"
    (source,) = complete["inputs"]
    assert (source["namespace"], source["name"]) == (
        "sqlite",
        f"{healthy.pipeline.db_file}.batching_items",
    )
    (target,) = complete["outputs"]
    assert (target["namespace"], target["name"]) == ("file", str(healthy.pipeline.output))
    assert target["outputFacets"]["outputStatistics"]["rowCount"] == N_ITEMS


def test_the_run_has_summary_and_progress_artifacts(healthy: Run) -> None:
    found = {a.key: a for a in artifacts_of(healthy.run_id)}
    assert set(found) >= {"score-tabular-summary", "score-tabular-progress"}
    rows = {r["metric"]: r["value"] for r in _table(found["score-tabular-summary"].data)}
    assert rows["items committed"] == str(N_ITEMS)
    assert set(rows) >= {"batches", "batch size p50 / p99", "padding efficiency", "items/s"}
    assert 1 <= int(rows["commits"]) <= int(rows["batches"])
    assert float(rows["busy s: forward"]) > 0
    assert found["score-tabular-progress"].data == 100.0


def _table(data: Any) -> list[dict[str, Any]]:
    return json.loads(data) if isinstance(data, str) else list(data)


def batching_logs(run_id: str) -> dict[str, Any]:
    """The run's ``batching`` logs by their constant message (the text before the numbers)."""
    return {
        _FIELDS_TAIL.split(log.message, maxsplit=1)[0]: log
        for log in logs_of(run_id)
        if log.name.startswith("batching")
    }


_FIELDS_TAIL = re.compile(r" (?=[a-z_]+=)")


def test_batching_logs_reach_the_run_at_info_from_every_thread(healthy: Run) -> None:
    logs = wait_for(
        lambda: found if "batch committed" in (found := batching_logs(healthy.run_id)) else None,
        what="batching logs in the run",
    )
    assert logs["model loaded"].level == 20  # the task's thread
    assert logs["batch committed"].level == 20  # the pipeline's commit thread


def test_the_logs_in_the_run_carry_their_numbers(healthy: Run) -> None:
    """Before, the UI showed "batch committed" alone: Prefect's handler drops ``extra``."""
    logs = wait_for(
        lambda: found if "batch committed" in (found := batching_logs(healthy.run_id)) else None,
        what="batching logs in the run",
    )
    committed = logs["batch committed"].message
    assert re.fullmatch(
        r"batch committed batch_id=\S+ sink=parquet n_items=\d+ n_bytes=\d+ n_replayed=0 "
        r"published=true duration_s=\d+\.\d{3}",
        committed,
    ), committed
    assert re.search(r" duration_s=\d+\.\d{3}$", logs["model loaded"].message)


def test_a_precondition_failing_once_is_retried_and_the_run_completes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = make_pipeline(tmp_path, 50)
    real = q.SqlQueue.check_schema
    calls: list[int] = []

    def unreachable_once(self: q.SqlQueue) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise errors.QueueError("database unreachable (connection refused)")
        real(self)

    monkeypatch.setattr(q.SqlQueue, "check_schema", unreachable_once)
    run = run_score(pipeline)
    assert run.state.is_completed(), run.state.message
    assert run.summary["items_committed"] == 50
    (check,) = [t for t in task_runs_of(run.run_id) if t.name.startswith("validate-preconditions")]
    assert check.run_count == 2


def test_a_wrong_checksum_claims_nothing_and_fails_the_run_with_a_fail_event(
    tmp_path: Any, registry: Registry
) -> None:
    pipeline = make_pipeline(tmp_path, 50)
    pipeline.overrides["model"] = {"sha256": "0" * 64}
    run = run_score(pipeline)
    assert run.state.is_failed()
    assert "sha256" in run.state.message
    assert pipeline.by_state() == {
        "ready": 50,
        "leased": 0,
        "done": 0,
        "dead": 0,
        "expired": 0,
        "cancelled": 0,
    }
    names = [t.name for t in task_runs_of(run.run_id)]
    assert not [n for n in names if n.startswith("score-queue")], names
    (check,) = [t for t in task_runs_of(run.run_id) if t.name.startswith("validate-preconditions")]
    assert check.run_count == 1, "a checksum mismatch is not retried"
    events = pipeline.lineage(run.run_id)
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    for event in events:
        olspec.assert_valid_event(event, registry)
    error = events[-1]["run"]["facets"]["errorMessage"]
    assert error["message"].startswith("CheckpointError: ")
    assert "sha256" in error["message"]
    assert error["programmingLanguage"] == "python"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The healthy run's work, done by two scorer processes (``workers=2``)."""
    pipeline = make_pipeline(
        tmp_path_factory.mktemp("workers"), N_ITEMS, batching={"max_batch_size": 64}
    )
    return run_score(pipeline, workers=2)


def test_two_workers_score_every_item_once_as_children_of_the_flow_run(
    two_workers: Run, registry: Registry
) -> None:
    run = two_workers
    assert run.state.is_completed(), run.state.message
    assert run.summary["items_committed"] == N_ITEMS
    assert run.pipeline.by_state()["done"] == N_ITEMS
    keys = pq.read_table(run.pipeline.output)["item_key"].to_pylist()
    assert sorted(keys) == sorted(f"w1-{i}" for i in range(N_ITEMS))

    events = run.pipeline.lineage()
    for event in events:
        olspec.assert_valid_event(event, registry)
    mine = [e for e in events if e["run"]["runId"] == run.run_id]
    assert [e["eventType"] for e in mine] == ["START", "COMPLETE"]
    assert mine[-1]["job"]["name"] == "score-tabular"
    assert mine[-1]["outputs"][0]["outputFacets"]["outputStatistics"]["rowCount"] == N_ITEMS
    children = [e for e in events if e["run"]["runId"] != run.run_id]
    assert {e["run"]["facets"]["parent"]["run"]["runId"] for e in children} == {run.run_id}
    assert {e["job"]["name"] for e in children} == {
        "score-tabular.worker-0",
        "score-tabular.worker-1",
    }

    found = {a.key: a for a in artifacts_of(run.run_id)}
    rows = {r["metric"]: r["value"] for r in _table(found["score-tabular-summary"].data)}
    assert rows["items committed"] == str(N_ITEMS)
    assert found["score-tabular-progress"].data == 100.0


def test_the_workers_logs_reach_the_flow_run(two_workers: Run) -> None:
    wait_for(
        lambda: any(
            log.message.startswith("batch committed batch_id=")
            and " worker=" in log.message
            and log.name.startswith("batching.")
            for log in logs_of(two_workers.run_id)
        ),
        what="a worker's batch committed log in the flow run",
    )


def test_zero_workers_is_refused_before_anything_is_claimed(tmp_path: Any) -> None:
    pipeline = make_pipeline(tmp_path, 10)
    run = run_score(pipeline, workers=0)
    assert run.state.is_failed()
    assert "workers must be at least 1, got 0" in run.state.message
    assert pipeline.by_state()["ready"] == 10


@pytest.mark.parametrize("flow", ["score", "reconcile"])
def test_a_malformed_lineage_url_fails_the_run_before_any_task(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, flow: str
) -> None:
    from flows.reconcile import reconcile

    monkeypatch.setenv("OPENLINEAGE_URL", "marquez:5000")
    pipeline = make_pipeline(tmp_path, 10)
    state = (score if flow == "score" else reconcile)(**pipeline.params(), return_state=True)
    assert state.is_failed()
    message = state.message or ""
    assert "lineage url 'marquez:5000' is not a URL like http://marquez:5000" in message
    assert "\n" not in message
    assert task_runs_of(run_id_of(state)) == [], "no task ran (the model was not even loaded)"
    assert {k: n for k, n in pipeline.by_state().items() if n} == {"ready": 10}


@pytest.fixture
def dead_lineage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lineage goes over http to a loopback port where nothing listens."""
    monkeypatch.setenv("OPENLINEAGE_URL", "http://127.0.0.1:9")


@pytest.mark.usefixtures("dead_lineage")
def test_a_dead_lineage_backend_neither_fails_nor_slows_the_run(
    tmp_path: Any, healthy: Run
) -> None:
    pipeline = make_pipeline(tmp_path, N_ITEMS, batching={"max_batch_size": 64})
    run = run_score(pipeline)
    assert run.state.is_completed(), run.state.message
    assert run.summary["items_committed"] == N_ITEMS
    assert run.summary["lineage_failures"] >= 1, "events went to the dead endpoint"
    assert not pipeline.events_path.exists(), "no file transport"
    assert run.wall_s < healthy.wall_s + 3.0, (run.wall_s, healthy.wall_s)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_retried_score_task_resumes_one_run_and_counts_every_attempt(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, registry: Registry, workers: int
) -> None:
    """Before: a retry restarted the run's ledger row (the first attempt's rows vanished from
    its counts), emitted a second START, and got the whole max_items again."""
    import sqlalchemy as sa

    from batching.compose import run as app
    from batching.store import schema
    from flows import score as score_module

    pipeline = make_pipeline(tmp_path, 300, batching={"max_batch_size": 25})
    # The flow scores through run_score_workers, in process for one worker.
    real: dict[str, Callable[..., Any]] = {"run_score_workers": app.run_score_workers}
    calls: list[str] = []

    def first_fails(name: str) -> Callable[..., Any]:
        """The first call fails with a transient error once 50 rows are committed."""

        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if len(calls) > 1:
                return real[name](*args, **kwargs)
            report = kwargs["on_progress"]

            def then_fail(*counts: Any) -> None:
                report(*counts)
                if counts[0] >= 50:  # committed, failed, claimed
                    raise errors.SinkError("output disk gone")

            return real[name](*args, **{**kwargs, "on_progress": then_fail})

        return run

    for name in real:
        monkeypatch.setattr(app, name, first_fails(name))
    monkeypatch.setattr(
        score_module, "score_queue", score_module.score_queue.with_options(retry_delay_seconds=0)
    )
    run = run_score(pipeline, max_items=200, workers=workers)

    assert run.state.is_completed(), run.state.message
    assert len(calls) == 2, calls
    states = pipeline.by_state()
    done = states["done"]
    assert done == 200, ("the retry gets what the first attempt left of max_items", states)
    engine = sa.create_engine(pipeline.db_url)
    with engine.connect() as conn:
        r = schema.runs.c
        (row,) = conn.execute(
            sa.select(r.state, r.n_items).where(r.run_id == run.run_id, r.parent_run_id.is_(None))
        ).all()
    engine.dispose()
    assert tuple(row) == ("completed", done)
    events = pipeline.lineage(run.run_id)
    kinds = [e["eventType"] for e in events]
    assert kinds == ["START", "RUNNING", "RUNNING", "COMPLETE"], kinds
    assert "output disk gone" in events[1]["run"]["facets"]["errorMessage"]["message"]
    (out,) = events[-1]["outputs"]
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == done
    for event in events:
        olspec.assert_valid_event(event, registry)


def test_a_score_run_loads_the_model_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: validate-preconditions loaded it (to check its sha256), then the scoring task
    loaded it again."""
    from batching.model.runner import TorchRunner

    real = TorchRunner.load.__func__  # type: ignore[attr-defined]
    loads: list[str] = []

    def counted(cls: type[TorchRunner], *args: Any, **kwargs: Any) -> TorchRunner:
        loads.append(cls.__name__)
        return real(cls, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(TorchRunner, "load", classmethod(counted))
    run = run_score(make_pipeline(tmp_path, 20))
    assert run.state.is_completed(), run.state.message
    assert run.summary["items_committed"] == 20
    assert loads == ["TorchRunner"]


def test_limits_that_would_end_the_run_before_it_claims_are_refused(tmp_path: Any) -> None:
    """max_items 0 or below, max_seconds 0 or below: the run was green with nothing scored."""
    pipeline = make_pipeline(tmp_path, 10)
    for limits, says in (
        ({"max_items": 0}, "max_items must be at least 1 (or none), got 0"),
        ({"max_items": -3}, "max_items must be at least 1 (or none), got -3"),
        ({"max_seconds": -5.0}, "max_seconds must be > 0 (or none), got -5.0"),
    ):
        run = run_score(pipeline, **limits)
        assert run.state.is_failed(), limits
        assert says in run.state.message
    assert pipeline.by_state()["ready"] == 10


def test_a_run_whose_every_item_fails_fails_the_flow_run_as_the_cli_exits_1(
    tmp_path: Any,
) -> None:
    pipeline = make_pipeline(tmp_path, 0)
    bad = tmp_path / "bad.jsonl"  # W1 takes 64 numbers: 63 fail at decode, dead at once
    bad.write_text(
        "".join(
            json.dumps({"item_key": f"b{i}", "payload": {"x": [0.5] * 63}}) + "\n" for i in range(5)
        )
    )
    queue = pipeline.queue()
    try:
        queue.enqueue(ingest.read_records(bad))
    finally:
        queue.engine.dispose()
    run = run_score(pipeline)
    assert run.state.is_failed()  # it ended Completed, green, with every item dead
    with pytest.raises(errors.NothingSucceeded, match="committed nothing and 5 item"):
        run.state.result()
    assert pipeline.by_state()["dead"] == 5


def test_a_retried_run_whose_earlier_attempt_committed_is_not_failed_for_its_last(
    tmp_path: Any,
) -> None:
    """The flow judges the last attempt's summary; a retry that committed nothing after an
    attempt that committed items failed the run while its ledger row said completed (a
    review). The run ledger counts every attempt's rows."""
    from batching.compose import run as wiring
    from batching.config import load_config
    from batching.loop.stats import RunLimits
    from flows.score import fail_if_nothing_succeeded

    pipeline = make_pipeline(tmp_path, 20)
    cfg = load_config(pipeline.config, pipeline.overrides)
    earlier = wiring.run_score(cfg, db_url=pipeline.db_url, limits=RunLimits())
    assert earlier.summary["items_committed"] == 20
    last = {"items_committed": 0, "items_failed": 3}  # the retry's own summary
    fail_if_nothing_succeeded(cfg, pipeline.db_url, earlier.run_id, last)
    with pytest.raises(errors.NothingSucceeded, match="committed nothing and 3 item"):
        fail_if_nothing_succeeded(cfg, pipeline.db_url, "0" * 32, last)
