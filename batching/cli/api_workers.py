"""``batching api --workers N``: N processes serving one port, and the parent that keeps them.

One API process is one core's worth of Python (the GIL): past ~600 requests a second of W2 on
the 2-core VM it was the wall, before the model (docs/benchmarks.md). So the parent binds the
port once and starts N workers, each a fresh interpreter (``multiprocessing``'s *spawn*: no
thread, lock or database connection of the parent crosses into a child, as a fork would
carry them), each handed the one listening socket; the kernel gives each new connection to
whichever worker accepts it first. Nothing else is shared, and nothing else needs to be:
each worker's writer enqueues in its own transactions (the depth cap already counts under a
lock, as for producers on several hosts), and each waits for commits with its own watch.

- **Metrics summed.** A scrape of ``/metrics`` lands on any one worker, so the workers count
  in ``prometheus_client``'s multiprocess mode: each process's series in its own memory-mapped
  file in a folder the parent makes (``PROMETHEUS_MULTIPROC_DIR``, set before a worker
  imports the client), and each scrape sums every file, a dead worker's too, so a counter
  never goes back when a worker is replaced. The folder goes when the parent stops; one that
  a parent killed outright left is removed by the next parent started.
- **A worker that dies is replaced** (an OOM kill, a crash in a C extension), with one line
  on stderr; one that dies at its start, after a pause that doubles each time, while the
  others go on serving (:class:`Supervisor`). Only when every worker keeps dying at its start
  (a bad environment: every replacement would die the same way) does the server stop,
  exit 1, rather than restart for ever.
- **SIGTERM, SIGHUP or Ctrl-C** to the parent: it closes its copy of the listening socket
  (new connections are refused, so a load balancer moves on), each worker gets SIGTERM
  (uvicorn finishes the requests in flight), and those not gone in ``GRACE_S`` are killed.
  Workers are started with SIGINT ignored: Ctrl-C reaches the whole process group, and the
  parent's SIGTERM stops them, once and quietly. Exit 0, or 130 after Ctrl-C.
- **A worker dies with its parent** on Linux (``PR_SET_PDEATHSIG``): a parent killed outright
  leaves no orphan serving the port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

QUICK_S = 10.0
"""A worker that exits sooner than this after its start counts toward :data:`MAX_QUICK`."""
MAX_QUICK = 3
MAX_BACKOFF_S = 30.0
"""The longest pause before a worker that keeps dying at its start is started again."""
GRACE_S = 40.0
"""How long a worker has to finish its requests after SIGTERM before it is killed: past its
own uvicorn's 35 s (``batching.api.app.serve``: the longest long poll, 30 s, and then some),
so a poll begun just before the signal is answered, not killed at its end."""
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Where ``prometheus_client`` keeps a process's series in multiprocess mode (read at import)."""
SUMMED_ENV = "BATCHING_API_METRICS_DIR"
"""Set for the workers alone: their ``/metrics`` sums that folder. A single process does not
read ``PROMETHEUS_MULTIPROC_DIR`` for it, which a user may have set for other processes."""


class Worker(Protocol):
    """What the supervisor needs of a worker process (``multiprocessing.Process``)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


def _exit_said(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Supervisor:
    """Keeps ``n`` workers running until :meth:`stop`.

    A worker that dies after ``quick_s`` of life is replaced at once. One that dies sooner
    (it could not start: a database down for a moment, a bad environment) is replaced after
    a pause that doubles with each such death of its slot (1, 2, 4 ... ``max_backoff_s``),
    while the other workers go on serving. Only when every slot's worker has died that way
    ``max_quick`` times in a row, none serving, does :meth:`run` give up.

    Args:
        start: starts the worker of a slot (0..n-1) and returns it.
        n: how many.
        say: one line to the operator (stderr).
        wait: blocks until one of the sentinels is ready or the timeout passes
            (``multiprocessing.connection.wait``).
        clock: monotonic seconds.
        on_stop: called once when the workers are about to be stopped (the parent closes
            its copy of the listening socket, so new connections are refused, not held).
    """

    def __init__(
        self,
        start: Callable[[int], Worker],
        n: int,
        say: Callable[[str], None],
        wait: Callable[[Sequence[int], float], object],
        *,
        clock: Callable[[], float] = time.monotonic,
        quick_s: float = QUICK_S,
        max_quick: int = MAX_QUICK,
        max_backoff_s: float = MAX_BACKOFF_S,
        grace_s: float = GRACE_S,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self._start, self.n, self._say, self._wait, self._clock = start, n, say, wait, clock
        self.quick_s, self.max_quick, self.grace_s = quick_s, max_quick, grace_s
        self.max_backoff_s, self._on_stop = max_backoff_s, on_stop
        self._stop = threading.Event()
        self.workers: dict[int, Worker] = {}
        self._started: dict[int, float] = {}
        self._quick = dict.fromkeys(range(n), 0)  # deaths soon after start, in a row, by slot
        self._retry_at: dict[int, float] = {}  # slots waiting out their pause
        self.replaced = 0

    def stop(self) -> None:
        """Ask :meth:`run` to stop the workers and return (safe from a signal handler)."""
        self._stop.set()

    def run(self) -> int:
        """Start the workers, replace those that die, and on :meth:`stop` stop them all.
        Returns the exit code: 0, or when every worker kept dying at its start, 2 if the
        last one said its input was bad (exit 2), else 1."""
        code = 0
        try:  # the workers started so far are stopped, even if starting one fails
            for slot in range(self.n):
                self._launch(slot)
            while not self._stop.is_set():
                now = self._clock()
                due = min(self._retry_at.values(), default=now + 0.5)
                running = [w.sentinel for s, w in self.workers.items() if s not in self._retry_at]
                self._wait(running, max(0.0, min(0.5, due - now)))
                if self._stop.is_set():
                    break
                code = self._tend()
                if code:
                    break
        finally:
            self._shutdown()
        return code

    def _tend(self) -> int:
        """Note the workers that died, start those whose pause is over; an exit code when
        every slot is failing."""
        now = self._clock()
        for slot, worker in list(self.workers.items()):
            if slot in self._retry_at:
                if now >= self._retry_at[slot]:
                    del self._retry_at[slot]
                    self._launch(slot)
                    self.replaced += 1
                continue
            if worker.exitcode is None:
                continue
            quick = now - self._started[slot] < self.quick_s
            self._quick[slot] = self._quick[slot] + 1 if quick else 0
            said = _exit_said(worker.exitcode)
            if all(q >= self.max_quick for q in self._quick.values()):
                self._say(
                    f"error: every API worker exited within {self.quick_s:g} s of its start "
                    f"{self.max_quick} times in a row (the last, worker {slot}, with {said}; "
                    "its error is above); stopping"
                )
                return 2 if worker.exitcode == 2 else 1
            pause = min(2.0 ** (self._quick[slot] - 1), self.max_backoff_s) if quick else 0.0
            self._say(
                f"warning: API worker {slot} (pid {worker.pid}) exited with {said}; starting "
                + (f"another in {pause:g} s" if pause else "another")
            )
            self._retry_at[slot] = now + pause
        return 0

    def _launch(self, slot: int) -> None:
        self.workers[slot] = self._start(slot)
        self._started[slot] = self._clock()

    def _shutdown(self) -> None:
        if self._on_stop is not None:
            self._on_stop()
        live = {s: w for s, w in self.workers.items() if w.exitcode is None}
        for worker in live.values():
            worker.terminate()
        deadline = self._clock() + self.grace_s
        for slot, worker in live.items():
            worker.join(max(0.0, deadline - self._clock()))
            if worker.exitcode is None:
                self._say(
                    f"warning: API worker {slot} (pid {worker.pid}) did not stop within "
                    f"{self.grace_s:g} s of SIGTERM; killed"
                )
                worker.kill()
                worker.join()


def die_with_parent(parent: int) -> None:
    """In a worker: SIGTERM when the parent ``parent`` dies (Linux; elsewhere nothing), so a
    supervisor killed outright leaves no orphan serving its port; and exit now if it is gone
    already."""
    if sys.platform.startswith("linux"):  # prctl(PR_SET_PDEATHSIG, SIGTERM)
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    if os.getppid() != parent:
        raise SystemExit(1)


def serve(
    n: int,
    target: Callable[..., None],
    args: tuple[Any, ...],
    say: Callable[[str], None],
    listening: socket.socket,
) -> int:
    """Run ``target(*args)`` in ``n`` spawned processes under a :class:`Supervisor` until
    SIGTERM, SIGHUP or SIGINT, their metrics in a fresh folder of their own; returns the exit
    code (130 after SIGINT, as a single process; 0 after SIGTERM or SIGHUP). ``target`` and
    ``args`` must pickle (``listening``, the socket among them, does: each child gets its own
    descriptor of it). The parent's copy of ``listening`` is closed before the workers are
    stopped, so a new connection is refused while they finish, not held unanswered."""
    import multiprocessing
    from multiprocessing import connection

    spawn = multiprocessing.get_context("spawn")
    folder = _metrics_folder()
    previous = {name: os.environ.get(name) for name in (METRICS_DIR_ENV, SUMMED_ENV)}
    os.environ[METRICS_DIR_ENV] = os.environ[SUMMED_ENV] = folder  # inherited by each worker
    stopped_by: list[int] = []

    def start(slot: int) -> Worker:
        process = spawn.Process(target=target, args=args, name=f"batching-api-{slot}")
        # Started with SIGINT ignored, which the exec keeps: Ctrl-C reaches the whole process
        # group, and a worker stops on the SIGTERM that follows, once, without a traceback.
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, handler)
        return process

    supervisor = Supervisor(
        start,
        n,
        say,
        lambda ready, t: connection.wait(ready, t),
        on_stop=listening.close,
    )

    def stop(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        supervisor.stop()

    handlers = {
        sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    }
    try:
        code = supervisor.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(folder, ignore_errors=True)
    if not code and stopped_by and stopped_by[0] == signal.SIGINT:
        return 128 + signal.SIGINT
    return code


def _metrics_folder() -> str:
    """A new folder for the workers' metrics, named by this process's pid; the folders that
    parents killed outright left behind (their pid no longer runs) are removed first."""
    prefix = "batching-api-metrics-"
    for old in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = old.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
