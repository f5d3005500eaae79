"""The pipes and signals between a ``--workers`` run's parent and its worker processes.

Parent side: :class:`Watch` reads one pipe per worker (progress, log records, the final
:class:`WorkerReport`) and tells a worker that died from one that finished;
:class:`StopRequests` passes SIGTERM/SIGINT on to every worker, even one still starting;
:func:`wind_down` waits for stopped workers, relaying their last words. Worker side:
:class:`Outbox` sends without ever blocking a scoring stage, and :func:`log_to_parent` routes
the worker's ``batching`` log records to the parent's handlers. The run itself, and why one
pipe per worker, is :mod:`batching.loop.workers`.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import queue as stdqueue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from types import FrameType
from typing import Literal, Protocol, TypeAlias

from batching.logs import OneLine
from batching.loop.stats import RunStats

logger = logging.getLogger(__name__)

Pipe: TypeAlias = "Connection[object, Message]"
"""One end of a worker's pipe: it carries :data:`Message` values (pickled whole)."""

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
    # leases it could not give back (its database cut off): the run's retry releases them
    unreleased: tuple[str, ...] = ()


class Watch:
    """The parent's view of its workers: their summed progress and their reports, read from
    one pipe per worker. A worker whose pipe ends without a report died (killed, out of
    memory); so did one that exited while nothing was left in its pipe."""

    def __init__(
        self,
        procs: Sequence[Watched],
        inboxes: Sequence[Pipe],
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
        by_conn: dict[Pipe, int] = {conn: i for i, conn in self._open.items()}
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
            relay(message[2])
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
        self.reports[index] = died(index, proc.exitcode, self._counts.get(index, (0, 0, 0))[0])

    def _silent_deaths(self) -> None:
        # A worker that exited with nothing left in its pipe, whose end of file has not come
        # (a process it started holds the write end): dead, unless it reported.
        for i, p in enumerate(self._procs):
            conn = self._open.get(i)
            if i in self.reports or p.exitcode is None or conn is None or conn.poll(0):
                continue
            self._open.pop(i).close()
            self._ended(i)


def relay(record: logging.LogRecord) -> None:
    """A worker's record to this process's handlers; a handler that fails (Prefect's, say)
    costs the record, never the run."""
    try:
        logging.getLogger(record.name).handle(record)
    except Exception:
        logger.debug("a worker's log record was not handled", exc_info=True)


def died(index: int, exitcode: int | None, committed: int) -> WorkerReport:
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


def wind_down(
    started: Sequence[Process],
    watch: Watch,
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

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


class StopRequests:
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
            self._old = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
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


class Outbox:
    """A worker's messages to the parent, written to its pipe by one thread of their own:
    ``put`` never blocks and never writes, so any thread may call it, even a signal handler
    (``SimpleQueue.put`` is reentrant), and a slow parent never stalls a scoring stage.
    Once the parent is gone (its end closed), messages are dropped."""

    def __init__(self, conn: Pipe) -> None:
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


class ToParent(logging.handlers.QueueHandler):
    """A worker's ``batching`` records, sent to the parent as ``("log", index, record)``: the
    parent's handlers (stderr for the CLI, Prefect's API handler in a flow run) take them."""

    def __init__(self, index: int, outbox: Outbox) -> None:
        super().__init__(outbox)  # type: ignore[arg-type]
        self.index = index
        self.outbox = outbox
        self.setFormatter(OneLine("%(message)s"))  # the exception on the line, no traceback

    def enqueue(self, record: logging.LogRecord) -> None:
        record.worker = self.index
        self.outbox.put(("log", self.index, record))


def log_to_parent(index: int, outbox: Outbox, level: int) -> None:
    """Route ``batching`` records to the parent only: a handler the spawned interpreter
    picked up on its own (Prefect's, when it re-imports the parent's ``__main__``) would send
    them a second time, without a flow run to send them to."""
    library = logging.getLogger("batching")
    for handler in list(library.handlers):
        library.removeHandler(handler)
    library.addHandler(ToParent(index, outbox))
    library.setLevel(level)
    library.propagate = False


def end_lock_hog(
    workers: Sequence[Process], holder: tuple[int, float] | None, lease_s: float
) -> None:
    """Kill the worker that has held the writer lock longer than a lease: a paused or hung
    process would stop every other writer until the database's busy timeout, and its
    leases, unrenewed meanwhile, are lost anyway."""
    if holder is None or time.time() - holder[1] <= lease_s:
        return
    for index, worker in enumerate(workers):
        if worker.pid == holder[0] and worker.is_alive():
            logger.error(
                "worker %d (pid %d) has held the database's writer lock for %.0f s, past its "
                "lease (%g s): ended",
                index,
                holder[0],
                time.time() - holder[1],
                lease_s,
                extra={"action": "worker_ended", "worker": index, "pid": holder[0]},
            )
            worker.kill()
