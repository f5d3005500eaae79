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

import contextlib
import logging
import logging.handlers
import math
import multiprocessing as mp
import os
import queue as stdqueue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import FrameType
from typing import Literal, Protocol

from batching import errors
from batching.config import LineageConfig, PipelineConfig
from batching.logs import OneLine
from batching.run_stats import RunLimits, RunStats

logger = logging.getLogger(__name__)

# (committed, failed, claimed) summed over the workers, after any worker's group commit.
WorkersProgress = Callable[[int, int, int], None]
Counts = tuple[int, int, int]
Message = (
    tuple[Literal["log"], int, logging.LogRecord]
    | tuple[Literal["progress"], int, Counts]
    | tuple[Literal["report"], int, "WorkerReport"]
)
"""What a worker sends its parent: a log record, its progress, or its final report."""
Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


class Watched(Protocol):
    """A worker process, as the parent watches it for its end (``multiprocessing``'s)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    def join(self, timeout: float | None = None) -> None: ...


class Process(Watched, Protocol):
    """A worker process, as the parent stops it."""

    def is_alive(self) -> bool: ...
    def kill(self) -> None: ...


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
class WorkerReport:
    """What one worker did, or why it failed (``error``, one line; ``exit_code`` 1 or 2).

    ``run_id`` is the worker's run; a failed worker has one only when ``run_workers`` was
    given the run ids."""

    index: int
    run_id: str | None = None
    stats: RunStats | None = None
    output: str | None = None
    events_path: str | None = None
    lineage_failures: int = 0
    error: str | None = None
    exit_code: int = 0
    error_type: str | None = None  # the exception's class name, to raise it again here
    died: bool = False  # exited without a report (killed): its run was never closed
    committed: int = 0  # when it died: the items its last progress report had committed


@dataclass(frozen=True, slots=True)
class WorkersOutcome:
    """Every worker's report, in worker order."""

    reports: list[WorkerReport] = field(default_factory=list)

    @property
    def failed(self) -> list[WorkerReport]:
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
    on_progress: WorkersProgress | None = None,
    stop: threading.Event | None = None,
    poll_s: float = 0.2,
    parent: tuple[str, str] | None = None,
    lineage_config: LineageConfig | None = None,
    resend_signals: bool = False,
    run_ids: Sequence[str] | None = None,
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

    SIGTERM and SIGINT received here stop every worker (see ``_StopRequests``): each
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
    stops = _StopRequests()
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
    watch = _Watch(procs, [reader for reader, _ in pipes], on_progress)
    started: list[Process] = []
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
    except BaseException:
        # This process failed (a progress callback raised, a worker could not start): stop
        # the workers, and keep reading their messages, or one blocked writing to its pipe
        # never exits.
        stops.stop(started)
        seen = stops.signals
        _wind_down(started, watch, hurry=lambda: stops.signals > seen)
        raise
    finally:
        stops.restore()
        for writer in (w for _, w in pipes if not w.closed):  # workers never started
            writer.close()
    # Every worker has reported: relay what they log as they exit.
    _wind_down(procs, watch, grace_s=math.inf)
    if resend_signals:
        stops.resend()
    reports = [watch.reports[i] for i in range(len(procs))]
    if run_ids:  # a worker that failed or died did not report its run id; it is known here
        reports = [r if r.run_id else replace(r, run_id=run_ids[r.index]) for r in reports]
    return WorkersOutcome(reports)


class _Watch:
    """The parent's view of its workers: their summed progress and their reports, read from
    one pipe per worker. A worker whose pipe ends without a report died (killed, out of
    memory); so did one that exited while nothing was left in its pipe."""

    def __init__(
        self,
        procs: Sequence[Watched],
        inboxes: Sequence[Connection],
        on_progress: WorkersProgress | None,
    ) -> None:
        self._procs = procs
        self._open = dict(enumerate(inboxes))
        self._on_progress = on_progress
        self._counts: dict[int, Counts] = {}
        self.reports: dict[int, WorkerReport] = {}

    def done(self) -> bool:
        return len(self.reports) == len(self._procs)

    def poll(self, timeout_s: float) -> None:
        """Read what the workers sent, waiting up to ``timeout_s`` for something to come."""
        self._read(timeout_s, logs_only=False)
        self._silent_deaths()

    def drain_logs(self, timeout_s: float = 0.0) -> None:
        """Relay the log records sent, waiting up to ``timeout_s`` for one: while workers
        exit (one blocked writing to a full pipe never would)."""
        self._read(timeout_s, logs_only=True)

    def forget(self, index: int) -> None:
        """Stop reading worker ``index``'s pipe (it never started)."""
        conn = self._open.pop(index, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in self._open.values():
            conn.close()
        self._open.clear()

    def _read(self, timeout_s: float, *, logs_only: bool) -> None:
        by_conn: dict[Connection, int] = {conn: i for i, conn in self._open.items()}
        for ready in wait(list(by_conn), timeout_s):
            index = by_conn[ready]  # type: ignore[index]  # wait() returns what it was given
            for _ in range(_READS_PER_LOOK):  # then the other workers' turn
                try:
                    message = self._open[index].recv()
                except (EOFError, OSError):  # the worker exited; or died mid-message
                    self._open.pop(index).close()
                    self._ended(index)
                    break
                if not logs_only or message[0] == "log":
                    self._take(message)
                if not self._open[index].poll(0):
                    break

    def _take(self, message: Message) -> None:
        if message[0] == "log":
            _relay(message[2])
            return
        if message[0] == "report":
            self.reports[message[1]] = message[2]
            return
        self._counts[message[1]] = message[2]
        if self._on_progress is not None:
            self._on_progress(*(sum(c[k] for c in self._counts.values()) for k in range(3)))

    def _ended(self, index: int) -> None:
        """Worker ``index``'s pipe ended: it has exited (or is exiting); without a report, it
        died."""
        if index in self.reports:
            return
        proc = self._procs[index]
        if proc.pid is not None:  # it started
            proc.join(timeout=10)  # its end of the pipe closes as it exits
        self.reports[index] = _died(index, proc.exitcode, self._counts.get(index, (0, 0, 0))[0])

    def _silent_deaths(self) -> None:
        # A worker that exited with nothing left in its pipe, whose end of file has not come
        # (a process it started holds the write end): dead, unless it reported.
        for i, p in enumerate(self._procs):
            conn = self._open.get(i)
            if i in self.reports or p.exitcode is None or conn is None or conn.poll(0):
                continue
            self._open.pop(i).close()
            self._ended(i)


def _relay(record: logging.LogRecord) -> None:
    """A worker's record to this process's handlers; a handler that fails (Prefect's, say)
    costs the record, never the run."""
    try:
        logging.getLogger(record.name).handle(record)
    except Exception:
        logger.debug("a worker's log record was not handled", exc_info=True)


def _died(index: int, exitcode: int | None, committed: int) -> WorkerReport:
    if exitcode is None:  # its pipe ended, yet it has not exited
        how = "closed its pipe"
    else:
        how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited {exitcode}"
    return WorkerReport(
        index,
        error=f"the worker process {how} before reporting; items it had leased return to "
        "the queue when their lease expires (queue.lease_s)",
        exit_code=1,
        died=True,
        committed=committed,
    )


def _wind_down(
    started: Sequence[Process],
    watch: _Watch,
    *,
    hurry: Callable[[], bool] = lambda: False,
    grace_s: float = 60.0,
) -> None:
    """Wait for stopped (or finished) workers, relaying what they say as they stop (items
    released, ...) and so emptying their pipes (a worker blocked writing to a full one never
    exits); kill those still running after ``grace_s``, or at once when ``hurry()`` (a
    second Ctrl-C). Their leased items return when the lease expires."""
    deadline = time.monotonic() + grace_s
    try:
        while any(p.is_alive() for p in started) and time.monotonic() < deadline and not hurry():
            watch.drain_logs(0.05)
    finally:
        for p in started:
            if p.is_alive():
                p.kill()  # not terminate(): a worker's SIGTERM handler only asks it to stop
            p.join()
        with contextlib.suppress(Exception):
            watch.drain_logs()  # their last words: the pipes hold them after they exit
        watch.close()


_READS_PER_LOOK = 1000

_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class _StopRequests:
    """SIGTERM/SIGINT to this process (or a stop asked for), passed on to every live worker
    as a SIGTERM of its own: each stops claiming, finishes its batches in flight and exits.

    Not a shared ``multiprocessing.Event``: a worker that had exited while a thread of it
    waited on the event still counted as a waiter, and ``Event.set()`` then waited for it to
    wake, forever (the parent hung, and the other workers went on).

    A worker spends seconds importing torch before its own handlers exist; a signal's default
    action would kill it then, mid-start. So the main thread blocks both signals while it
    starts the workers, and each inherits the mask: a stop signal sent to a starting worker
    waits (Linux never discards a blocked signal) for the handler it installs before it
    unblocks them. This process's handler is installed first, so a signal delivered to any
    of its threads meanwhile is kept, and passed on once every worker has started.
    (multiprocessing's resource tracker unblocks both signals in the thread
    that starts it, so it is started before the mask is set.) Any thread can hold the mask,
    but only the main thread can set handlers: elsewhere the caller stops workers through
    ``run_workers(stop=...)``.
    """

    def __init__(self) -> None:
        self.sent = False  # the workers were asked to stop
        self.signals = 0  # stop signals received so far
        self.received: int | None = None  # the first of them
        self._asked = threading.Event()
        self._old: dict[signal.Signals, Handler] = {}
        self._main = threading.current_thread() is threading.main_thread()

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around starting the workers; afterwards, SIGTERM/SIGINT ask them to stop."""
        if self._main:
            self._old = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signals += 1
        if self.received is None:
            self.received = signum
        self._asked.set()  # passed on by the watch loop, outside the handler

    def forward(self, workers: Sequence[Process], *, asked: bool = False) -> None:
        """Pass a stop request (a signal, or ``asked``) on to the workers, once."""
        if (asked or self._asked.is_set()) and not self.sent:
            self.stop(workers)

    def stop(self, workers: Sequence[Process]) -> None:
        """SIGTERM every worker still running (a starting one holds it until its handler is
        installed). One that exited but is not reaped yet keeps its pid: no other process
        can be signalled by mistake."""
        self.sent = True
        for p in workers:
            if p.exitcode is None and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def resend(self) -> None:
        """After ``restore``: raise the first stop signal received again, for the handler
        this process had before, when that is a Python function (a default action would
        kill this process, an ignored signal does nothing)."""
        if self.received is not None and callable(self._old.get(signal.Signals(self.received))):
            signal.raise_signal(self.received)


_CLOSE = object()


class _Outbox:
    """A worker's messages to the parent, written to its pipe by one thread of their own:
    ``put`` never blocks and never writes, so any thread may call it, even a signal handler
    (``SimpleQueue.put`` is reentrant), and a slow parent never stalls a scoring stage.
    Once the parent is gone (its end closed), messages are dropped."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._pending: stdqueue.SimpleQueue[Message | object] = stdqueue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, name="to-parent", daemon=True)
        self._sender.start()

    def put(self, message: object) -> None:
        """Send ``message`` (a :data:`Message`; one that cannot be pickled is dropped)."""
        self._pending.put(message)

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is pending, then stop (waiting at most ``timeout_s``)."""
        self._pending.put(_CLOSE)
        self._sender.join(timeout_s)

    def _send(self) -> None:
        while (message := self._pending.get()) is not _CLOSE:
            try:
                self._conn.send(message)  # pickled whole before a byte is written
            except OSError:  # the parent is gone (EPIPE): nobody will read the rest
                return
            except Exception:  # a message that cannot be pickled is dropped
                continue


class _ToParent(logging.handlers.QueueHandler):
    """A worker's ``batching`` records, sent to the parent as ``("log", index, record)``: the
    parent's handlers (stderr for the CLI, Prefect's API handler in a flow run) take them."""

    def __init__(self, index: int, outbox: _Outbox) -> None:
        super().__init__(outbox)  # type: ignore[arg-type]
        self.index = index
        self.outbox = outbox
        self.setFormatter(OneLine("%(message)s"))  # the exception on the line, no traceback

    def enqueue(self, record: logging.LogRecord) -> None:
        record.worker = self.index
        self.outbox.put(("log", self.index, record))


def _log_to_parent(index: int, outbox: _Outbox, level: int) -> None:
    """Route ``batching`` records to the parent only: a handler the spawned interpreter
    picked up on its own (Prefect's, when it re-imports the parent's ``__main__``) would send
    them a second time, without a flow run to send them to."""
    library = logging.getLogger("batching")
    for handler in list(library.handlers):
        library.removeHandler(handler)
    library.addHandler(_ToParent(index, outbox))
    library.setLevel(level)
    library.propagate = False


def _work(index: int, job: _Job, conn: Connection) -> None:
    """A worker process: one whole scoring run, reported back over ``conn``."""
    outbox = _Outbox(conn)
    try:
        _score(index, job, outbox)
    finally:
        outbox.close()


def _score(index: int, job: _Job, outbox: _Outbox) -> None:
    import torch

    stop = threading.Event()
    scorers: list[Stoppable] = []

    def request_stop(*_: object) -> None:
        stop.set()
        for s in list(scorers):
            s.stop()

    for sig in _STOP_SIGNALS:  # blocked until now (see _StopRequests)
        signal.signal(sig, request_stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)

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
    _log_to_parent(index, outbox, job.log_level)
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
        report = WorkerReport(index, error=str(exc), exit_code=code, error_type=kind)
        outbox.put(("report", index, report))
        return
    except BaseException as exc:  # not ours: one line to the parent and to its log
        logger.exception("worker %d failed", index)
        report = WorkerReport(index, error=f"{type(exc).__name__}: {exc}", exit_code=1)
        outbox.put(("report", index, report))
        return
    report = WorkerReport(
        index,
        run_id=outcome.run_id,
        stats=outcome.stats,
        output=outcome.output,
        events_path=str(outcome.events_path) if outcome.events_path else None,
        lineage_failures=outcome.lineage_failures,
    )
    outbox.put(("report", index, report))
