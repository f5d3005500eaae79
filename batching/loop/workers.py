"""Several scorer processes on one machine: ``batching score --workers N``.

One scorer process is bounded by the GIL: its claim, decode, forward and commit stages are
threads, and only one of them runs Python at a time. Processes do not share a GIL, so N
workers use N cores for that Python work (W1 on the 2-core benchmark host: 1.1-1.2x the
rows/s of one; README, Benchmarks). Each worker is a whole, independent scoring run
(the run function it is given: ``app.run_score``): its own run id, run-ledger row, lineage
events, leases and recovery; ``app.run_score_workers`` makes them child runs of one parent
lineage run. Claims never overlap (one
lease per claim), so nothing here coordinates the work; the parent only starts the workers,
forwards SIGTERM/SIGINT, adds up their progress and reports what each did.

Workers are *spawned* (a fresh interpreter each), never forked: a forked child would inherit
the parent's threads' locks and torch's thread pool half-initialised.
"""

from __future__ import annotations

import logging
import logging.handlers
import math
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from batching import errors
from batching.config import LineageConfig, PipelineConfig
from batching.loop import pipes as worker_pipes
from batching.loop.stats import RunLimits, RunStats

logger = logging.getLogger(__name__)


class Stoppable(Protocol):
    """A scorer, as a worker stops it on SIGTERM."""

    def stop(self) -> None: ...


class RunReport(Protocol):
    """What one scoring run reports (``app.ScoreOutcome``)."""

    @property
    def run_id(self) -> str: ...
    @property
    def stats(self) -> RunStats | None: ...
    @property
    def output(self) -> str: ...
    @property
    def events_path(self) -> Path | None: ...
    @property
    def lineage_failures(self) -> int: ...


class RunOne(Protocol):
    """One whole scoring run, as each worker runs it (``app.run_score``: a module-level
    function, so the spawned process finds it by name)."""

    def __call__(
        self,
        config: PipelineConfig,
        *,
        db_url: str | None,
        output: str | None,
        limits: RunLimits | None,
        on_progress: Callable[[RunStats], None] | None,
        on_scorer: Callable[[Stoppable], None] | None,
        parent: tuple[str, str] | None,
        job_name: str | None,
        lineage_config: LineageConfig | None,
        run_id: str | None,
    ) -> RunReport: ...


@dataclass(frozen=True, slots=True)
class WorkersOutcome:
    """Every worker's report, in worker order."""

    reports: list[worker_pipes.WorkerReport] = field(default_factory=list)

    @property
    def failed(self) -> list[worker_pipes.WorkerReport]:
        return [r for r in self.reports if r.error is not None]

    @property
    def exit_code(self) -> int:
        """0 when every worker finished; else the worst worker's code (2 bad input, 1 failed)."""
        return max((r.exit_code for r in self.reports), default=0)

    def stats(self) -> RunStats | None:
        """The finished workers' counters as one run (None when none finished)."""
        parts = [r.stats for r in self.reports if r.stats is not None]
        return RunStats.merged(parts) if parts else None

    def error(self) -> errors.BatchingError | None:
        """The workers' failures as one exception, or None when every worker finished.

        Its type is the failures' ``batching.errors`` type when they all share one, else the
        first usage error's (bad input), else plain ``BatchingError``: whatever the worker
        order, a retry policy keyed on the type (a ``QueueError`` is transient) retries only
        when every failure was of that type.
        """
        failed = self.failed
        if not failed:
            return None
        kinds = {r.error_type for r in failed}
        usage = [r for r in failed if r.exit_code == 2]
        name = kinds.pop() if len(kinds) == 1 else usage[0].error_type if usage else None
        cls = getattr(errors, name or "", None)
        if not (isinstance(cls, type) and issubclass(cls, errors.BatchingError)):
            cls = errors.BatchingError
        return cls("; ".join(self.errors()))

    def errors(self) -> list[str]:
        """Each distinct failure once, naming the workers it stopped."""
        by_message: dict[str, list[int]] = {}
        for r in self.failed:
            by_message.setdefault(r.error or "", []).append(r.index)
        return [
            f"worker{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}: {msg}"
            for msg, ix in by_message.items()
        ]


@dataclass(frozen=True, slots=True)
class _Job:
    run: RunOne
    config: PipelineConfig
    db_url: str | None
    output: str | None
    limits: RunLimits
    threads: int
    log_level: int
    parent: tuple[str, str] | None = None
    lineage_config: LineageConfig | None = None
    run_id: str | None = None

    def job_name(self, index: int) -> str | None:
        return worker_job_name(self.parent[1], index) if self.parent else None


def worker_job_name(parent_job: str, index: int) -> str:
    """Under a parent run, each worker is its child job ``<parent job>.worker-<i>``."""
    return f"{parent_job}.worker-{index}"


def is_worker_job(job: str, parent_job: str) -> bool:
    """Whether ``job`` is a :func:`worker_job_name` of ``parent_job``."""
    head, _, index = job.rpartition(".worker-")
    return head == parent_job and index.isdigit()


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_limits(limits: RunLimits, n: int) -> list[RunLimits]:
    """Each worker's limits: ``max_items`` split as evenly as it goes (a worker whose share is
    0 is not started, so there may be fewer than ``n``); the other limits apply to each."""
    if n < 1:
        raise errors.ConfigError(f"--workers must be at least 1, got {n}")
    if limits.max_items is None:
        return [limits] * n
    base, extra = divmod(limits.max_items, n)
    shares = [base + (1 if i < extra else 0) for i in range(n)]
    return [replace(limits, max_items=s) for s in shares if s > 0]


def run_workers(
    run: RunOne,
    config: PipelineConfig,
    n: int,
    *,
    db_url: str | None = None,
    output: str | None = None,
    limits: RunLimits | None = None,
    threads: int | None = None,
    on_progress: worker_pipes.WorkersProgress | None = None,
    stop: threading.Event | None = None,
    poll_s: float = 0.2,
    parent: tuple[str, str] | None = None,
    lineage_config: LineageConfig | None = None,
    resend_signals: bool = False,
    run_ids: Sequence[str] | None = None,
    lock_holder: Callable[[], tuple[int, float] | None] | None = None,
) -> WorkersOutcome:
    """Run ``n`` scoring runs in ``n`` spawned processes and wait for all of them.

    Args:
        run: one whole scoring run (``app.run_score``), which each worker calls.
        config, db_url, output: as for ``run``; every worker gets the same.
        limits: see :func:`share_limits`.
        threads: torch CPU threads per worker; default: available cores // n, at least 1.
        on_progress: summed counts, called from this thread.
        stop: set it (from any thread) to stop every worker as SIGTERM would; the way to stop
            workers run from a thread other than the main one, where signals never arrive.
        poll_s: how often a silent worker is checked for having died.
        parent: ``(run id, job name)`` of the lineage run the workers belong to; each worker
            is then the child job ``<job name>.worker-<i>`` (see ``app.run_score_workers``).
        lineage_config: overrides the config's lineage settings in every worker.
        run_ids: worker ``i``'s run id (default: each worker makes its own); with them every
            report names its run, so the caller can close the run of a worker that died.
        resend_signals: once the workers have stopped, pass a stop signal received here on
            to the handler this process had before (a Prefect flow run's, which ends the run
            as cancelled), instead of returning as if the run had finished.
        lock_holder: the process holding the database's writer lock and since when (SQLite:
            ``store.sqlite.lock_holder``); a worker holding it past its lease (paused, hung)
            blocks every other writer, so it is ended (its leases expire; nobody is charged).

    SIGTERM and SIGINT received here stop every worker (see ``worker_pipes.StopRequests``): each
    stops claiming, finishes its batches in flight and releases the rest. A
    worker that dies without reporting (killed, out of memory) is reported as failed; the
    items it had leased return to the queue when their lease expires.
    """
    shares = share_limits(limits or RunLimits(), n)
    per_worker = threads or max(1, available_cores() // max(1, len(shares)))
    log_level = logging.getLogger("batching").getEffectiveLevel()  # the same as here
    ctx = mp.get_context("spawn")
    # One pipe per worker, not one shared queue: a worker killed while writing to a shared
    # queue dies holding its cross-process write lock, and every other worker then blocks
    # on its next message, forever; and a message it left half-written in a pipe that this
    # process also holds open is one a reader waits on forever. A pipe of its own whose
    # write end only the worker holds turns both into an end of file here (a process the
    # worker started could hold it too; batching starts none).
    pipes = [ctx.Pipe(duplex=False) for _ in shares]
    stops = worker_pipes.StopRequests()
    procs = [
        ctx.Process(
            target=_work,
            args=(
                i,
                _Job(
                    run,
                    config,
                    db_url,
                    output,
                    share,
                    per_worker,
                    log_level,
                    parent,
                    lineage_config,
                    run_ids[i] if run_ids else None,
                ),
                pipes[i][1],
            ),
            name=f"batching-worker-{i}",
        )
        for i, share in enumerate(shares)
    ]
    watch = worker_pipes.Watch(procs, [reader for reader, _ in pipes], on_progress)
    started: list[worker_pipes.Process] = []
    if stop is not None and stop.is_set():  # asked before any worker started: start none
        watch.close()
        for _, writer in pipes:
            writer.close()
        return WorkersOutcome()
    try:
        with stops.starting():
            for i, (p, (_, writer)) in enumerate(zip(procs, pipes, strict=True)):
                try:
                    p.start()
                except BaseException:
                    watch.forget(i)  # no worker behind that pipe: its end is no death
                    raise
                finally:
                    writer.close()  # the worker's copy is its own; this one would hide its end
                started.append(p)
        while not watch.done():
            watch.poll(poll_s)
            stops.forward(started, asked=stop is not None and stop.is_set())
            if lock_holder is not None:
                worker_pipes.end_lock_hog(started, lock_holder(), config.queue.lease_s)
    except BaseException:
        # This process failed (a progress callback raised, a worker could not start): stop
        # the workers, and keep reading their messages, or one blocked writing to its pipe
        # never exits.
        stops.stop(started)
        seen = stops.signals
        worker_pipes.wind_down(started, watch, hurry=lambda: stops.signals > seen)
        raise
    finally:
        stops.restore()
        for writer in (w for _, w in pipes if not w.closed):  # workers never started
            writer.close()
    # Every worker has reported: relay what they log as they exit.
    worker_pipes.wind_down(procs, watch, grace_s=math.inf)
    if resend_signals:
        stops.resend()
    reports = [watch.reports[i] for i in range(len(procs))]
    if run_ids:  # a worker that failed or died did not report its run id; it is known here
        reports = [r if r.run_id else replace(r, run_id=run_ids[r.index]) for r in reports]
    return WorkersOutcome(reports)


def _unreleased(scorers: Sequence[Stoppable]) -> tuple[str, ...]:
    """The leases a failed worker's scorers could not give back (their database cut off),
    for the parent to release at the run's retry: this process's memory of them ends here."""
    return tuple(sorted({lease for s in scorers for lease in getattr(s, "unreleased", ())}))


def _work(index: int, job: _Job, conn: worker_pipes.Pipe) -> None:
    """A worker process: one whole scoring run, reported back over ``conn``."""
    outbox = worker_pipes.Outbox(conn)
    try:
        _score(index, job, outbox)
    finally:
        outbox.close()


def _score(index: int, job: _Job, outbox: worker_pipes.Outbox) -> None:
    import torch

    stop = threading.Event()
    scorers: list[Stoppable] = []

    def request_stop(*_: object) -> None:
        stop.set()
        for s in list(scorers):
            s.stop()

    for sig in worker_pipes.STOP_SIGNALS:  # blocked until now (see worker_pipes.StopRequests)
        signal.signal(sig, request_stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, worker_pipes.STOP_SIGNALS)

    parent = mp.parent_process()  # set up at spawn: no window where its death is missed

    def watch_parent() -> None:
        """The parent was killed (SIGKILL, the OOM killer; also after it asked us to stop):
        nobody reads our messages or will stop us. Stop as if asked; our messages fail to
        send (the pipe is broken) and are dropped, so nothing waits on them at exit."""
        if parent is None:
            return
        parent.join()  # returns when the parent process ends
        request_stop()

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    worker_pipes.log_to_parent(index, outbox, job.log_level)
    torch.set_num_threads(job.threads)

    def on_scorer(scorer: Stoppable) -> None:
        scorers.append(scorer)
        if stop.is_set():  # stopped while the model was loading
            scorer.stop()

    def on_progress(stats: RunStats) -> None:
        outbox.put(("progress", index, (stats.committed, stats.failed, stats.claimed)))

    try:
        outcome = job.run(
            job.config,
            db_url=job.db_url,
            output=job.output,
            limits=job.limits,
            on_progress=on_progress,
            on_scorer=on_scorer,
            parent=job.parent,
            job_name=job.job_name(index),
            lineage_config=job.lineage_config,
            run_id=job.run_id,
        )
    except errors.BatchingError as exc:
        code = 2 if isinstance(exc, errors.USAGE_ERRORS) else 1
        kind = type(exc).__name__
        report = worker_pipes.WorkerReport(
            index, error=str(exc), exit_code=code, error_type=kind, unreleased=_unreleased(scorers)
        )
        outbox.put(("report", index, report))
        return
    except BaseException as exc:  # not ours: one line to the parent and to its log
        logger.exception("worker %d failed", index)
        error = f"{type(exc).__name__}: {exc}"
        report = worker_pipes.WorkerReport(
            index, error=error, exit_code=1, unreleased=_unreleased(scorers)
        )
        outbox.put(("report", index, report))
        return
    report = worker_pipes.WorkerReport(
        index,
        run_id=outcome.run_id,
        stats=outcome.stats,
        output=outcome.output,
        events_path=str(outcome.events_path) if outcome.events_path else None,
        lineage_failures=outcome.lineage_failures,
    )
    outbox.put(("report", index, report))
