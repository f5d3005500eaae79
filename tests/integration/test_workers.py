"""``batching score --workers N`` for real: spawned scorer processes on one queue, real torch,
Parquet read back; signals and a killed worker lose nothing."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from referencing import Registry

from batching import config as cfg
from batching import models
from batching.compose import record as run_record
from batching.compose import run as wiring
from batching.evidence import lineage, lineage_log
from batching.loop.pipes import Watch as _Watch
from batching.loop.pipes import wind_down as _wind_down
from batching.loop.stats import RunLimits
from batching.loop.workers import WorkersOutcome, run_workers
from batching.store import database, schema
from tests import olspec
from tests.conftest import KeptRecords, wait_for
from tests.integration.conftest import ScoreProcess
from tests.integration.test_pipeline import (
    SLOW,
    assert_done_once,
    enqueue,
    items,
    load,
    outlive_leases,
    reconcile,
    score,
    slow_w1_queue,
    w1_records,
    wait_for_done,
    write_config,
)

N = 3000
WORKERS = ("--workers", "2")
KEYS = {f"w1-{i}" for i in range(N)}


def runs(url: str) -> list[str]:
    engine = database.create_engine(url)
    with engine.connect() as conn:
        states = list(conn.execute(sa.select(schema.runs.c.state)).scalars())
    engine.dispose()
    return states


def holders(url: str) -> set[str]:
    """The workers holding a lease now (item leases and range leases alike)."""
    return {r.leased_by for r in items(url).values() if r.state == models.State.LEASED}


def test_two_workers_commit_every_item_exactly_once(db_url: str, tmp_path: Path) -> None:
    config = load("tabular.yaml", tmp_path, batching=SLOW)
    enqueue(db_url, config, w1_records(N, tmp_path))
    root = tmp_path / "outputs"
    seen: list[int] = []

    outcome = run_workers(
        wiring.run_score,
        config,
        2,
        db_url=db_url,
        output=str(root),
        on_progress=lambda c, f, n: seen.append(c),
    )

    assert outcome.exit_code == 0, outcome.errors()
    assert len({r.run_id for r in outcome.reports}) == 2
    total = outcome.stats()
    assert total is not None
    assert total.committed == N
    assert sum(r.stats.committed for r in outcome.reports if r.stats) == N
    assert_done_once(db_url, root, KEYS)
    assert runs(db_url) == ["completed", "completed"]
    assert seen == sorted(seen), "progress went backwards"
    assert seen[-1] == N, "progress is not the summed count"
    assert reconcile(config, db_url, root).clean


@dataclass
class Parented:
    """Two workers under one parent run (``run_score_workers``): what it left behind."""

    result: wiring.WorkersScoreOutcome
    config: cfg.PipelineConfig
    url: str
    root: Path
    events: list[dict[str, Any]]
    records: list[logging.LogRecord]  # ``batching`` records the parent received


@pytest.fixture(scope="module")
def parented(tmp_path_factory: pytest.TempPathFactory) -> Parented:
    tmp = tmp_path_factory.mktemp("parented")
    url = f"sqlite:///{tmp / 'queue.db'}"
    # Claims of 512 (the shipped 8192 would let one worker claim all 3,000 items, which can
    # then commit as a single file): several leases, so several files, whoever claims them.
    config = load("tabular.yaml", tmp, batching={"max_batch_size": 256, "claim_size": 512})
    enqueue(url, config, w1_records(N, tmp))
    run_id = lineage.new_run_id()
    library, kept = logging.getLogger("batching"), KeptRecords()
    level = library.level
    library.addHandler(kept)
    library.setLevel(logging.INFO)  # the workers log at the parent's level
    try:
        result = wiring.run_score_workers(
            config, 2, db_url=url, output=str(tmp / "outputs"), run_id=run_id
        )
    finally:
        library.removeHandler(kept)
        library.setLevel(level)
    assert result.run_id == run_id
    assert result.workers.error() is None, result.workers.errors()
    assert_done_once(url, tmp / "outputs", KEYS)
    assert result.events_path is not None
    events = lineage_log.read_events(result.events_path)
    return Parented(result, config, url, tmp / "outputs", events, kept.records)


def output_rows(event: dict[str, Any]) -> int:
    return int(event["outputs"][0]["outputFacets"]["outputStatistics"]["rowCount"])


def test_workers_are_one_lineage_run_with_a_child_job_each(parented: Parented) -> None:
    result, config, events = parented.result, parented.config, parented.events
    mine = [e for e in events if e["run"]["runId"] == result.run_id]
    assert [e["eventType"] for e in mine] == ["START", "COMPLETE"]
    assert {e["job"]["name"] for e in mine} == {config.name}
    assert output_rows(mine[-1]) == N
    assert result.summary["items_committed"] == N

    children = [e for e in events if e["run"]["runId"] != result.run_id]
    worker_runs = {r.run_id for r in result.workers.reports}
    assert {e["run"]["runId"] for e in children} == worker_runs
    assert {e["job"]["name"] for e in children} == {
        f"{config.name}.worker-0",
        f"{config.name}.worker-1",
    }
    for event in children:
        parent = event["run"]["facets"]["parent"]
        assert parent["run"]["runId"] == result.run_id
        assert parent["job"]["namespace"] == mine[0]["job"]["namespace"]
        assert parent["job"]["name"] == config.name
    completes = [e for e in children if e["eventType"] == "COMPLETE"]
    assert len(completes) == 2
    assert sum(output_rows(e) for e in completes) == N
    # The parent's output is described like a worker's (Marquez keeps the schema).
    assert (
        mine[-1]["outputs"][0]["facets"]["schema"] == completes[0]["outputs"][0]["facets"]["schema"]
    )


def test_reconciling_the_parent_run_covers_its_workers_batches(parented: Parented) -> None:
    result, config = parented.result, parented.config
    engine = database.create_engine(parented.url)
    with engine.connect() as conn:
        runs_ = schema.runs.c
        ledger = {r[0]: r[1] for r in conn.execute(sa.select(runs_.run_id, runs_.parent_run_id))}
        states = {r[0]: r[1] for r in conn.execute(sa.select(runs_.run_id, runs_.state))}
    engine.dispose()
    workers = {r.run_id for r in result.workers.reports}
    assert ledger == {result.run_id: None, **dict.fromkeys(workers, result.run_id)}
    assert set(states.values()) == {"completed"}

    assert reconcile(config, parented.url, parented.root, run_id=result.run_id).clean
    # A worker's file gone (one of several: with none left, reconcile refuses to judge an
    # empty dataset at all): the parent's reconcile sees it.
    files = sorted(parented.root.rglob("*.parquet"))
    assert len(files) > 1
    victim = files[0]
    hidden = victim.with_name(victim.name + ".away")
    victim.rename(hidden)
    try:
        report = reconcile(config, parented.url, parented.root, run_id=result.run_id)
    finally:
        hidden.rename(victim)
    assert report.counts.get("missing_file") == 1, report.findings


def test_the_workers_logs_reach_the_parents_handlers(parented: Parented) -> None:
    committed = [r for r in parented.records if r.getMessage() == "batch committed"]
    # Every worker that committed (on a loaded machine one may have claimed everything).
    reports = parented.result.workers.reports
    busy = {r.index for r in reports if r.stats is not None and r.stats.committed}
    assert busy
    assert {getattr(r, "worker", None) for r in committed} == busy
    assert sum(r.__dict__["n_items"] for r in committed) == N


def test_the_parent_and_worker_events_validate_against_the_spec(parented: Parented) -> None:
    registry: Registry = olspec.load_registry(
        olspec.require_spec_dir(), lineage.custom_facet_schemas()
    )
    events = parented.events
    assert len(events) == 6
    for event in events:
        olspec.assert_valid_event(event, registry)


def assert_stopped_mid_run(url: str, why_not: str) -> Counter[models.State]:
    """The run stopped cleanly before the end: nothing leased, some items still ready."""
    states = Counter(models.State(r.state) for r in items(url).values())
    assert states[models.State.LEASED] == 0, "a worker stopped with items still leased"
    assert states[models.State.READY] > 0, why_not
    return states


def worker_pids(parent: int) -> list[int]:
    """The spawned scorer processes of ``parent`` (not multiprocessing's resource tracker),
    whichever of its threads started them."""
    pids = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended
            continue
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmdline:
                pids.append(int(child))
    return pids


def two_workers_running(score_process: ScoreProcess, path: Path) -> subprocess.Popen[str]:
    """``batching score --workers 2`` on ``path``, once both worker processes are there."""
    proc = score_process(path, *WORKERS)
    wait_for(lambda: len(worker_pids(proc.pid)) == 2, 60, "two worker processes")
    return proc


def test_when_the_parent_fails_its_workers_stop_and_nothing_stays_leased(
    sqlite_url: str, tmp_path: Path
) -> None:
    _, config = slow_w1_queue(sqlite_url, tmp_path, N)

    def broken_progress(committed: int, failed: int, claimed: int) -> None:
        raise RuntimeError("the progress display broke")

    with pytest.raises(RuntimeError, match="progress display broke"):
        run_workers(
            wiring.run_score,
            config,
            2,
            db_url=sqlite_url,
            output=str(tmp_path / "outputs"),
            on_progress=broken_progress,
        )
    assert_stopped_mid_run(sqlite_url, "the workers were not told to stop")


def test_workers_run_from_another_thread_stop_when_asked(sqlite_url: str, tmp_path: Path) -> None:
    # Signals reach only the main thread: a caller elsewhere (a Prefect task) stops workers
    # through ``stop``.
    _, config = slow_w1_queue(sqlite_url, tmp_path, N)
    stop = threading.Event()
    outcome: list[WorkersOutcome] = []

    def first_commit(committed: int, failed: int, claimed: int) -> None:
        stop.set()

    runner = threading.Thread(
        target=lambda: outcome.append(
            run_workers(
                wiring.run_score,
                config,
                2,
                db_url=sqlite_url,
                output=str(tmp_path / "outputs"),
                on_progress=first_commit,
                stop=stop,
            )
        )
    )
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "the workers did not stop"
    assert outcome[0].exit_code == 0, outcome[0].errors()
    assert_stopped_mid_run(sqlite_url, "the workers ran to the end; stop was ignored")


def test_stopping_workers_after_they_exited_does_not_hang(sqlite_url: str, tmp_path: Path) -> None:
    """The parent fails (here its progress callback) once both workers have exited. Before,
    the stop went through a shared multiprocessing.Event, and its set() waited forever for
    the exited workers' waiting threads to wake (a CI run hung in the flow retry test)."""
    config = load("tabular.yaml", tmp_path, batching={"max_batch_size": 20})
    enqueue(sqlite_url, config, w1_records(40, tmp_path))
    failed: list[BaseException] = []

    def fail_once_exited(committed: int, failed_: int, claimed: int) -> None:
        if committed < 40:
            return
        wait_for(
            lambda: not [p for p in multiprocessing.active_children() if "worker" in p.name],
            60,
            "both workers to exit",
        )
        raise RuntimeError("the parent failed after its workers exited")

    def run() -> None:
        try:
            run_workers(
                wiring.run_score,
                config, 2, db_url=sqlite_url, output=str(tmp_path / "outputs"),
                on_progress=fail_once_exited,
            )  # fmt: skip
        except RuntimeError as exc:
            failed.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "stopping the exited workers hung"
    assert failed, "the callback's failure was not raised"


def test_workers_started_off_the_main_thread_survive_sigterm_while_starting(
    sqlite_url: str, tmp_path: Path
) -> None:
    # A supervisor's SIGTERM to the process group reaches workers still importing torch.
    _, config = slow_w1_queue(sqlite_url, tmp_path, N)
    outcome: list[WorkersOutcome] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            run_workers(
                wiring.run_score, config, 2, db_url=sqlite_url, output=str(tmp_path / "outputs")
            )
        )
    )
    runner.start()

    def two_workers() -> list[int] | None:
        pids = worker_pids(os.getpid())
        return pids if len(pids) == 2 else None

    pids = wait_for(two_workers, 60, "two worker processes")
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert outcome[0].exit_code == 0, outcome[0].errors()
    assert_stopped_mid_run(sqlite_url, "the signal was lost: the workers ran to the end")


class Cancelled(Exception):
    """What a supervisor's SIGTERM handler raises (Prefect's ends the flow run with it)."""


def test_a_stop_signal_is_passed_on_to_the_handler_before_once_the_workers_stopped(
    sqlite_url: str, tmp_path: Path
) -> None:
    _, config = slow_w1_queue(sqlite_url, tmp_path, N)

    def supervisor(_signum: int, _frame: Any) -> None:
        raise Cancelled

    def send_sigterm() -> None:
        wait_for(lambda: len(worker_pids(os.getpid())) == 2, 60, "two worker processes")
        wait_for(
            lambda: sum(r.state == models.State.DONE for r in items(sqlite_url).values()) >= 200,
            60,
            "200 items done",
        )
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, supervisor)
    sender = threading.Thread(target=send_sigterm, daemon=True)
    try:
        sender.start()
        with pytest.raises(Cancelled):
            run_workers(
                wiring.run_score,
                config,
                2,
                db_url=sqlite_url,
                output=str(tmp_path / "outputs"),
                resend_signals=True,
            )
        assert signal.getsignal(signal.SIGTERM) is supervisor, "the handler was not restored"
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join(timeout=5)
    assert_stopped_mid_run(sqlite_url, "the workers ran to the end; the signal was lost")


def test_a_worker_that_cannot_start_fails_the_run_with_its_own_error_and_stops_the_others(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the unstarted worker's closed pipe read as a death, whose join raised
    AssertionError ("can only join a started process") over the real error, and left
    the first worker running."""
    _, config = slow_w1_queue(sqlite_url, tmp_path, 50)
    spawn = multiprocessing.get_context("spawn").Process
    real_start, started = spawn.start, list[Any]()

    def start(self: Any) -> None:
        if started:
            raise BlockingIOError(11, "Resource temporarily unavailable (fork)")
        started.append(self)
        real_start(self)

    monkeypatch.setattr(spawn, "start", start)
    with pytest.raises(BlockingIOError, match="fork"):
        run_workers(
            wiring.run_score, config, 2, db_url=sqlite_url, output=str(tmp_path / "outputs")
        )
    (first,) = started
    assert not first.is_alive(), "the worker that started was left running"
    assert first.exitcode == 0, "it was killed, not stopped"


def test_workers_asked_to_stop_before_they_start_are_not_started(
    sqlite_url: str, tmp_path: Path
) -> None:
    _, config = slow_w1_queue(sqlite_url, tmp_path, 50)
    asked = threading.Event()
    asked.set()
    started = time.monotonic()
    outcome = run_workers(wiring.run_score, config, 2, db_url=sqlite_url, stop=asked)
    assert outcome.reports == []
    assert time.monotonic() - started < 2.0, "workers were started (a model load each)"
    assert {r.state for r in items(sqlite_url).values()} == {models.State.READY}


def _stubborn(ready: Any, _pipe: Any) -> None:
    """A worker stuck in a long batch: SIGTERM only asks it to stop, as in ``_work``."""
    signal.signal(signal.SIGTERM, lambda *_: None)
    ready.set()
    time.sleep(120)


@pytest.mark.parametrize("second_signal", [False, True])
def test_winding_down_kills_a_worker_that_outlives_the_grace(second_signal: bool) -> None:
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    worker = ctx.Process(target=_stubborn, args=(ready, writer))
    worker.start()
    writer.close()
    assert ready.wait(60), "the worker did not start"
    worker.terminate()  # asks; the worker goes on
    started = time.monotonic()
    _wind_down([worker], _Watch([worker], [reader], None), hurry=lambda: second_signal, grace_s=3.0)
    took = time.monotonic() - started
    assert worker.exitcode == -signal.SIGKILL
    assert took < (1.0 if second_signal else 10.0), took


@pytest.mark.slow
def test_max_items_is_shared_between_the_workers(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    path, _ = slow_w1_queue(sqlite_url, tmp_path, 50)
    proc = score_process(path, *WORKERS, "--max-items", "5")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "2 of 2 workers" in stdout
    assert "note:" not in stderr
    states = Counter(r.state for r in items(sqlite_url).values())
    assert states[models.State.DONE] == 5
    assert states[models.State.LEASED] == 0

    # Fewer items than workers: the user is told why only one ran.
    proc = score_process(path, *WORKERS, "--max-items", "1")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "1 of 1 workers" in stdout
    assert "1 of 2 had items to claim" in stderr


@pytest.mark.slow
def test_a_bad_checkpoint_fails_every_worker_in_one_line_with_exit_2(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    path = write_config("tabular.yaml", tmp_path, model={"sha256": "0" * 64})
    enqueue(sqlite_url, cfg.load_config(path), w1_records(10, tmp_path))
    proc = score_process(path, *WORKERS)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if "error" in line]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: workers 0, 1:")
    assert "sha256" in lines[0]

    # The parent run is on record as failed, with the workers' message; so is each worker.
    events_path = next(
        line.removeprefix("lineage: ")
        for line in stdout.splitlines()
        if line.startswith("lineage: ")
    )
    events = lineage_log.read_events(Path(events_path))
    parents = {e["run"]["runId"] for e in events if "parent" not in e["run"]["facets"]}
    assert len(parents) == 1
    by_run = Counter((e["run"]["runId"] in parents, e["eventType"]) for e in events)
    assert by_run == {
        (True, "START"): 1,
        (True, "FAIL"): 1,
        (False, "START"): 2,
        (False, "FAIL"): 2,
    }
    fail = next(e for e in events if e["run"]["runId"] in parents and e["eventType"] == "FAIL")
    message = fail["run"]["facets"]["errorMessage"]["message"]
    assert "workers 0, 1:" in message
    assert "sha256" in message


@pytest.mark.slow
def test_sigterm_to_the_parent_stops_every_worker_and_loses_nothing(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    path, config = slow_w1_queue(sqlite_url, tmp_path, N)
    proc = two_workers_running(score_process, path)
    wait_for_done(sqlite_url, 200, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "2 of 2 workers" in stdout

    states = assert_stopped_mid_run(sqlite_url, "the run finished before SIGTERM; nothing tested")
    assert states[models.State.DONE] + states[models.State.READY] == N

    root = tmp_path / "outputs"
    score(config, sqlite_url, root)
    assert_done_once(sqlite_url, root, KEYS)
    assert reconcile(config, sqlite_url, root).clean


def test_workers_whose_parent_is_killed_stop_and_exit(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    """Before, they ran on and then hung at exit on a full pipe nobody read, for ever."""
    path, _ = slow_w1_queue(sqlite_url, tmp_path, N)
    proc = two_workers_running(score_process, path)
    wait_for_done(sqlite_url, 200, proc)
    pids = worker_pids(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        except FileNotFoundError:
            return True

    wait_for(lambda: all(gone(p) for p in pids), 60, "the orphaned workers to exit")
    assert_stopped_mid_run(sqlite_url, "the workers ran to the end before they were orphaned")


@pytest.mark.slow
def test_sigterm_to_the_group_while_workers_start_stops_them_cleanly(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    # As a supervisor stopping a whole process group would: the workers get SIGTERM while
    # still importing torch, before they have handlers of their own.
    path, _ = slow_w1_queue(sqlite_url, tmp_path, N)
    proc = two_workers_running(score_process, path)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "2 of 2 workers" in stdout
    states = assert_stopped_mid_run(sqlite_url, "the workers ran to the end; the signal was lost")
    assert states[models.State.DONE] + states[models.State.READY] == N


@pytest.mark.slow
def test_a_killed_worker_is_reported_and_its_items_are_scored_after_the_lease(
    sqlite_url: str, tmp_path: Path, score_process: ScoreProcess
) -> None:
    lease_s = 4.0  # heartbeats every 1.3 s: a loaded machine must not lose a live lease
    path, config = slow_w1_queue(sqlite_url, tmp_path, N, lease_s=lease_s)
    proc = two_workers_running(score_process, path)
    wait_for_done(sqlite_url, 200, proc)
    # Both workers scoring (each holds a lease, so each has recorded its run and its lineage
    # START): on a loaded machine one worker may still be loading the model when the other
    # has done 200 items.
    wait_for(lambda: len(runs(sqlite_url)) == 3, 60, "both workers' runs")
    wait_for(lambda: len(holders(sqlite_url)) == 2, 60, "both workers holding a lease")
    os.kill(worker_pids(proc.pid)[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert "was killed by signal 9" in stderr
    assert "lease expires" in stderr
    assert "1 of 2 workers" in stdout, "the surviving worker's run is not summed up"
    assert "(failed)" in stdout, "the dead worker's run id is not listed"

    # The dead worker never closed its run: the parent did, in the ledger and in lineage.
    engine = database.create_engine(sqlite_url)
    with engine.connect() as conn:
        c = schema.runs.c
        rows = conn.execute(sa.select(c.run_id, c.state, c.error, c.parent_run_id)).all()
    engine.dispose()
    assert "running" not in {r.state for r in rows}, rows
    workers = [r for r in rows if r.parent_run_id is not None]
    (dead,) = [r for r in workers if r.error and "killed by signal 9" in r.error]
    assert dead.state == "failed"
    assert {r.state for r in rows} == {"completed", "failed"}  # the survivor; parent, dead
    events_path = next(
        line.removeprefix("lineage: ")
        for line in stdout.splitlines()
        if line.startswith("lineage: ")
    )
    events = [
        e for e in lineage_log.read_events(Path(events_path)) if e["run"]["runId"] == dead.run_id
    ]
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    assert events[-1]["run"]["facets"]["parent"]["run"]["runId"] == dead.parent_run_id

    outlive_leases(lease_s)
    root = tmp_path / "outputs"
    score(config, sqlite_url, root)  # its claims reap the dead worker's leases
    assert_done_once(sqlite_url, root, KEYS)
    assert reconcile(config, sqlite_url, root).clean


def test_a_retry_with_no_items_left_completes_without_starting_workers(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A retry whose earlier attempt used up max_items: before, run_workers divided the cores
    by zero workers, and the run failed after its work was done."""
    path = write_config("tabular.yaml", tmp_path)
    config = cfg.load_config(path)
    enqueue(sqlite_url, config, w1_records(10, tmp_path))
    out = str(tmp_path / "out")
    run_id = lineage.new_run_id()
    limits = RunLimits(max_items=4)
    first = wiring.run_score(config, db_url=sqlite_url, output=out, limits=limits, run_id=run_id)
    assert first.summary["items_committed"] == 4

    retry = wiring.run_score_workers(
        config, 2, db_url=sqlite_url, output=out, limits=limits, run_id=run_id,
        attempt=run_record.Attempt(2),
    )  # fmt: skip

    assert retry.workers.reports == []
    assert Counter(r.state for r in items(sqlite_url).values())[models.State.DONE] == 4
    assert retry.events_path is not None
    events = lineage_log.read_events(retry.events_path)
    (last,) = [e for e in events if e["run"]["runId"] == run_id][-1:]
    assert last["eventType"] == "COMPLETE"
    assert output_rows(last) == 4  # the run's rows: the earlier attempt's
