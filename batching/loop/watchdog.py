"""The forward-pass watchdog: what a scorer does when one pass never returns.

A model can hang on one input (a loop in its own code that an input never lets end, a lock
it never gets back). Python cannot cancel a running thread, and before this watchdog the
heartbeat thread went on extending the batch's lease: the items stayed leased as long as the
process lived, and nothing but queue age said anything was wrong.

The scorer's heartbeat asks :meth:`ForwardWatch.overdue` each interval. A pass past
``queue.forward_timeout_s`` is declared hung once; the run stops, and its batch gets a
:func:`fate` from the model's own probe input (``TorchRunner.healthy``, run on another
thread and bounded, since a device that hangs hangs the probe too), applied by
:func:`settle`:

* ``CRASH``: the model passes its probe (or has none), so an input hung it, and the batch
  held several items. Its lease is ended now and the crash rule (``batching.crashes``)
  judges it, as if the process had died: nobody charged, every item a suspect, isolation
  rounds find which.
* ``CHARGE``: as ``CRASH``, but the item was alone in an isolation round: the input is the
  cause. It fails with a reason saying so, an attempt charged.
* ``MODEL``: the probe failed or did not finish: the model or the device is at fault, not
  the items. They go back without using an attempt and the queue is paused (as the
  retry-storm breaker does); charging them would dead-letter the queue one timeout at a time.
* ``CANDIDATE``: as ``MODEL``, in a rollout's candidate version: its items fail charged to
  it, so the rollout guard rolls it back, as it does for a candidate that cannot load;
  pausing would stop the stable traffic for the candidate's fault.

The hung thread is interrupted (:meth:`ForwardWatch.interrupt`: :class:`Abandoned` raised in
it at its next Python instruction), so a pass hung in Python code ends; one hung in native
code (a CUDA kernel, a C extension's loop) runs on until the process ends, and its result,
if it ever comes, is dropped (:meth:`ForwardWatch.finished`). The run fails with
``ForwardHung``: restart it.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from batching import errors, ports

J = TypeVar("J")
T = TypeVar("T")
PROBE_S = 60.0
"""The longest the probe may take (or ``forward_timeout_s`` when shorter)."""
logger = logging.getLogger(__name__)


class Fate(enum.Enum):
    """What happens to a hung batch's items (module doc)."""

    CRASH = "crash"
    CHARGE = "charge"
    MODEL = "model"
    CANDIDATE = "candidate"


class Abandoned(BaseException):
    """Raised by the watchdog in the thread of a hung pass. A ``BaseException``: a model's
    ``except Exception`` (or the runner's bisection) must not take it for the model's own."""


class ForwardWatch(Generic[J]):
    """The pass in flight and when it started; declares it hung once, past ``timeout_s``."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flight: tuple[float, J, int] | None = None
        self.hung: J | None = None
        self.ran_s = 0.0  # how long the hung pass had run when it was declared hung

    def started(self, job: J) -> None:
        """A pass of ``job`` starts now, on this thread."""
        with self._lock:
            self._flight = (self._clock(), job, threading.get_ident())

    @property
    def in_flight(self) -> bool:
        """Whether a pass is running now (started, not finished)."""
        return self._flight is not None

    def finished(self) -> bool:
        """The pass returned; True when it had been declared hung (drop its result: its
        batch is the watchdog's to settle)."""
        with self._lock:
            self._flight = None
            return self.hung is not None

    def overdue(self) -> J | None:
        """The job of a pass in flight past ``timeout_s``, once (then None: it stays hung)."""
        with self._lock:
            if self._flight is None or self.hung is not None:
                return None
            started, job, _ = self._flight
            ran = self._clock() - started
            if ran < self.timeout_s:
                return None
            self.hung, self.ran_s = job, ran
            return job

    def interrupt(self) -> bool:
        """Raise :class:`Abandoned` in the hung pass's thread at its next Python instruction
        (CPython's ``PyThreadState_SetAsyncExc``), only while that pass is still in flight:
        under the lock :meth:`finished` takes, so a thread past it (or a new thread given its
        id) never gets it. True when it was sent."""
        with self._lock:
            if self._flight is None or self.hung is None or self._flight[1] is not self.hung:
                return False
            set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
            sent = set_exc(ctypes.c_ulong(self._flight[2]), ctypes.py_object(Abandoned))
            return int(sent) == 1


def on_thread(
    settled: threading.Event, hung: Callable[[], BaseException], work: Callable[[], T]
) -> T:
    """``work`` (passes the watch times) on a daemon thread of its own, so a pass that never
    returns, even in native code, cannot hold the caller: once ``settled`` is set (the
    watchdog settled the hung batch), ``hung()`` is raised instead of waiting on."""
    box: list[T | BaseException] = []

    def run() -> None:
        try:
            box.append(work())
        except BaseException as exc:  # Abandoned included
            box.append(exc)

    thread = threading.Thread(target=run, name="watched-forward", daemon=True)
    thread.start()
    while thread.is_alive() and not settled.is_set():
        thread.join(0.1)
    if settled.is_set() or not box or isinstance(box[0], Abandoned | errors.ForwardHung):
        settled.wait(PROBE_S + 60)  # declared hung: its settle first (bounded by the probe)
        raise hung()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def probe(check: Callable[[], bool] | None, within_s: float) -> bool | None:
    """The model's own probe (``TorchRunner.healthy``) on a daemon thread: its answer, False
    when it raised or did not answer within ``within_s``, None when the runner has none."""
    if check is None:
        return None
    answer: list[bool] = []

    def run() -> None:
        try:
            answer.append(bool(check()))
        except Exception:
            answer.append(False)

    thread = threading.Thread(target=run, name="forward-probe", daemon=True)
    thread.start()
    thread.join(within_s)
    return answer[0] if answer else False


def fate(works: bool | None, n_items: int, *, isolated: bool, candidate: bool = False) -> Fate:
    """The fate of a hung batch of ``n_items``: ``works`` is the probe's answer (None: no
    probe, so nothing says the model is at fault: the crash rule's way); ``isolated``: its
    items were claimed in an isolation round; ``candidate``: a rollout candidate ran it."""
    if works is False:
        return Fate.CANDIDATE if candidate else Fate.MODEL
    if n_items == 1 and isolated:
        return Fate.CHARGE
    return Fate.CRASH


@dataclass(frozen=True, slots=True)
class Settled:
    """What :func:`settle` did: ``done`` False when the database refused (the lease then
    runs out by itself and the crash rule judges it); ``lost``: the lease held none of the
    batch any more (another scorer's reaper took it); ``not_paused``: why the queue was not
    paused (``Fate.MODEL``), None otherwise."""

    fate: Fate
    done: bool
    lost: bool
    not_paused: str | None
    failed: int
    released: int


def settle(
    queue: ports.ClaimPort,
    fate: Fate,
    ids_by_lease: Mapping[str, Sequence[int]],
    *,
    timeout_s: float,
    lease_s: float,
    model_version: str | None,
    pause: Callable[[str], str | None],
) -> Settled:
    """Apply ``fate`` to a hung batch (its item ids by lease; nothing else of the run still
    leased under them), and pause the queue for ``MODEL`` (``pause``: None when paused,
    else why not), even when the database refused the rest."""
    failed = released = ended = 0
    done = True
    try:
        for lease_id, ids in ids_by_lease.items():
            if fate in (Fate.CHARGE, Fate.CANDIDATE):
                reason = charge_reason(timeout_s, fate)
                res = queue.fail(lease_id, dict.fromkeys(ids, reason), model_version=model_version)
                failed += res.retried + res.dead
            elif fate is Fate.CRASH:  # ended now: the next claim's reaper judges it
                ended += queue.heartbeat(lease_id, -lease_s)
            else:
                released += queue.release(lease_id, ids)
    except errors.QueueError:
        done = False
        logger.warning(
            "the hung batch was not settled; its lease runs out by itself",
            extra={"action": "hung_settle_failed"},
            exc_info=True,
        )
    not_paused = pause(pause_reason(timeout_s)) if fate is Fate.MODEL else None
    lost = done and not (failed or released or ended)
    return Settled(fate, done, lost, not_paused, failed, released)


def charge_reason(timeout_s: float, fate: Fate = Fate.CHARGE) -> str:
    """The ``last_error`` of an item charged for a hung pass (``CHARGE``, ``CANDIDATE``)."""
    if fate is Fate.CANDIDATE:
        return (
            f"forward pass hung past queue.forward_timeout_s ({timeout_s:g} s) in the rollout "
            "candidate, which failed its own probe input"
        )
    return (
        f"forward pass hung on this item, scored alone: past queue.forward_timeout_s "
        f"({timeout_s:g} s) while the model scored its own probe input"
    )


def pause_reason(timeout_s: float) -> str:
    """The queue's pause reason when the model failed its probe (``Fate.MODEL``)."""
    return (
        f"forward pass hung past queue.forward_timeout_s ({timeout_s:g} s) and the model "
        "failed its own probe input"
    )


def message(
    ran_s: float, timeout_s: float, n_items: int, queue: str, settled: Settled | None
) -> str:
    """The one-line ``ForwardHung`` message (``settled`` None: not settled yet)."""
    head = (
        f"a forward pass of {n_items} item(s) ran {ran_s:.0f} s, past "
        f"queue.forward_timeout_s ({timeout_s:g} s); the run stopped"
    )
    tail = "restart the scorer (a pass hung in native code runs on until its process ends)"
    if settled is None:
        return f"{head}; {tail}"
    said = ""
    if settled.lost:
        said = (
            ". The batch's lease was already gone (another scorer's claim took it back as a "
            "lost worker's, for the crash rule to judge)"
        )
    elif not settled.done:
        said = (
            ". The database refused to settle the batch: its lease runs out by itself and "
            "the next claim judges it as a lost worker's"
        )
    elif settled.fate is Fate.CHARGE:
        said = ". The model scores its own probe input (or has none), so this item hung it: failed, an attempt charged"
    elif settled.fate is Fate.CRASH:
        said = (
            ". The model scores its own probe input (or has none), so an input hung it: the "
            "batch's lease was ended and the next claim scores its items in isolation rounds "
            "to find which"
        )
    elif settled.fate is Fate.CANDIDATE:
        said = (
            ". The rollout candidate failed (or did not finish) its own probe input: the "
            "batch failed charged to it, for the rollout guard to roll it back"
        )
    else:
        said = ". The model failed (or did not finish) its own probe input: the model or the device is at fault; the batch went back without using an attempt"
    if settled.fate is Fate.MODEL:
        said += (
            f", and queue {queue!r} is paused (`batching queue resume {queue} --reason ...` "
            "once the model is fixed)"
            if settled.not_paused is None
            else f", and the queue was not paused ({settled.not_paused})"
        )
    return f"{head}{said}; {tail}"
