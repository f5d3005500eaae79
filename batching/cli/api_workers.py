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
  never goes back when a worker is replaced. The folder goes when the parent stops.
- **A worker that dies is replaced** (an OOM kill, a crash in a C extension), with one line
  on stderr. One that dies within ``QUICK_S`` of its start ``MAX_QUICK`` times in a row
  (a database gone, a bad environment: every replacement would die the same way) stops the
  server, exit 1, rather than restarting for ever.
- **SIGTERM or SIGINT** to the parent: each worker gets SIGTERM (uvicorn finishes the
  requests in flight), and those not gone in ``GRACE_S`` are killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

QUICK_S = 10.0
"""A worker that exits sooner than this after its start counts toward :data:`MAX_QUICK`."""
MAX_QUICK = 3
GRACE_S = 30.0
"""How long a worker has to finish its requests after SIGTERM before it is killed."""
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


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

    Args:
        start: starts the worker of a slot (0..n-1) and returns it.
        n: how many.
        say: one line to the operator (stderr).
        wait: blocks until one of the sentinels is ready or the timeout passes
            (``multiprocessing.connection.wait``).
        clock: monotonic seconds.
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
        grace_s: float = GRACE_S,
    ) -> None:
        self._start, self.n, self._say, self._wait, self._clock = start, n, say, wait, clock
        self.quick_s, self.max_quick, self.grace_s = quick_s, max_quick, grace_s
        self._stop = threading.Event()
        self.workers: dict[int, Worker] = {}
        self._started: dict[int, float] = {}
        self.replaced = 0

    def stop(self) -> None:
        """Ask :meth:`run` to stop the workers and return (safe from a signal handler)."""
        self._stop.set()

    def run(self) -> int:
        """Start the workers, replace those that die, and on :meth:`stop` stop them all.
        Returns the exit code: 0, or 1 when workers kept dying at their start."""
        for slot in range(self.n):
            self._launch(slot)
        quick, code = 0, 0
        try:
            while not self._stop.is_set():
                self._wait([w.sentinel for w in self.workers.values()], 0.5)
                for slot, worker in list(self.workers.items()):
                    if worker.exitcode is None or self._stop.is_set():
                        continue
                    lived = self._clock() - self._started[slot]
                    quick = quick + 1 if lived < self.quick_s else 0
                    said = _exit_said(worker.exitcode)
                    if quick >= self.max_quick:
                        self._say(
                            f"error: API workers exited {quick} times in a row within "
                            f"{self.quick_s:g} s of their start (the last, worker {slot}, "
                            f"with {said}; its error is above); stopping"
                        )
                        code = 1
                        self._stop.set()
                        break
                    self._say(
                        f"warning: API worker {slot} (pid {worker.pid}) exited with {said}; "
                        "starting another"
                    )
                    self._launch(slot)
                    self.replaced += 1
        finally:
            self._shutdown()
        return code

    def _launch(self, slot: int) -> None:
        self.workers[slot] = self._start(slot)
        self._started[slot] = self._clock()

    def _shutdown(self) -> None:
        for worker in self.workers.values():
            if worker.exitcode is None:
                worker.terminate()
        deadline = self._clock() + self.grace_s
        for slot, worker in self.workers.items():
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
    n: int, target: Callable[..., None], args: tuple[Any, ...], say: Callable[[str], None]
) -> int:
    """Run ``target(*args)`` in ``n`` spawned processes under a :class:`Supervisor` until
    SIGTERM or SIGINT, their metrics in a fresh folder of their own; returns the exit code.
    ``target`` and ``args`` must pickle (a listening socket does: each child gets its own
    descriptor of it)."""
    import multiprocessing
    from multiprocessing import connection

    spawn = multiprocessing.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="batching-api-metrics-")
    previous = os.environ.get(METRICS_DIR_ENV)
    os.environ[METRICS_DIR_ENV] = folder  # inherited by every worker at its start

    def start(slot: int) -> Worker:
        process = spawn.Process(target=target, args=args, name=f"batching-api-{slot}")
        process.start()
        return process

    supervisor = Supervisor(start, n, say, lambda ready, t: connection.wait(ready, t))
    handlers = {
        sig: signal.signal(sig, lambda *_: supervisor.stop())
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        return supervisor.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if previous is None:
            os.environ.pop(METRICS_DIR_ENV, None)
        else:
            os.environ[METRICS_DIR_ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)
