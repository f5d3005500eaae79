"""The forward-pass watchdog: what a scorer does when one pass never returns.

A model can hang on one input (a loop in its own code that an input never lets end, a lock
it never gets back). Python cannot cancel a running thread, and before this watchdog the
heartbeat thread went on extending the batch's lease: the items stayed leased as long as the
process lived, and nothing but queue age said anything was wrong.

The scorer's heartbeat asks :meth:`ForwardWatch.overdue` each interval. A pass past
``queue.forward_timeout_s`` is declared hung once; the run stops, and its batch gets a
:func:`fate` from the model's own probe input (``TorchRunner.healthy``, run on another
thread and bounded, since a device that hangs hangs the probe too):

* ``CRASH``: the model passes its probe, so an input hung it, and the batch held several
  items. Its lease is ended now and the crash rule (``batching.crashes``) judges it, as if
  the process had died: nobody charged, every item a suspect, isolation rounds find which.
* ``CHARGE``: the model passes its probe and the item was alone in an isolation round: the
  input is the cause. It fails with a reason saying so, an attempt charged.
* ``MODEL``: the probe failed or did not finish: the model or the device is at fault, not
  the items. They go back without using an attempt and the queue is paused (as the
  retry-storm breaker does); charging them would dead-letter the queue one timeout at a time.

The hung thread is interrupted (:func:`interrupt`: :class:`Abandoned` raised in it at its
next Python instruction), so a pass hung in Python code ends; one hung in native code (a
CUDA kernel, a C extension's loop) runs on until the process ends, and its result, if it
ever comes, is dropped (:meth:`ForwardWatch.finished`). The run fails with ``ForwardHung``:
restart it.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

J = TypeVar("J")
PROBE_S = 60.0
"""The longest the probe may take (or ``forward_timeout_s`` when shorter)."""


class Fate(enum.Enum):
    """What happens to a hung batch's items (module doc)."""

    CRASH = "crash"
    CHARGE = "charge"
    MODEL = "model"


class ForwardWatch(Generic[J]):
    """The pass in flight and when it started; declares it hung once, past ``timeout_s``."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._flight: tuple[float, J] | None = None
        self.hung: J | None = None
        self.ran_s = 0.0  # how long the hung pass had run when it was declared hung

    def started(self, job: J) -> None:
        """A pass of ``job`` starts now."""
        with self._lock:
            self._flight = (self._clock(), job)

    def finished(self) -> bool:
        """The pass returned; True when it had been declared hung (drop its result: its
        batch's lease was ended or its items were settled by the watchdog)."""
        with self._lock:
            self._flight = None
            return self.hung is not None

    def overdue(self) -> J | None:
        """The job of a pass in flight past ``timeout_s``, once (then None: it stays hung)."""
        with self._lock:
            if self._flight is None or self.hung is not None:
                return None
            started, job = self._flight
            ran = self._clock() - started
            if ran < self.timeout_s:
                return None
            self.hung, self.ran_s = job, ran
            return job


class Abandoned(BaseException):
    """Raised by the watchdog in the thread of a hung pass. A ``BaseException``: a model's
    ``except Exception`` (or the runner's bisection) must not take it for the model's own."""


def interrupt(thread_id: int) -> bool:
    """Raise :class:`Abandoned` in thread ``thread_id`` at its next Python instruction
    (CPython's ``PyThreadState_SetAsyncExc``); True when such a thread was found."""
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    return int(set_exc(ctypes.c_ulong(thread_id), ctypes.py_object(Abandoned))) == 1


def charge_reason(timeout_s: float) -> str:
    """The ``last_error`` of an item charged for hanging a pass alone (``Fate.CHARGE``)."""
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
    ran_s: float,
    timeout_s: float,
    n_items: int,
    fate: Fate | None,
    queue: str,
    not_paused: str | None = None,
) -> str:
    """The one-line ``ForwardHung`` message. ``not_paused``: why the queue was not paused
    (``Fate.MODEL``), None when it was."""
    head = (
        f"a forward pass of {n_items} item(s) ran {ran_s:.0f} s, past "
        f"queue.forward_timeout_s ({timeout_s:g} s); the run stopped"
    )
    tail = "restart the scorer (a pass hung in native code runs on until its process ends)"
    probed = "The model scores its own probe input, so"
    if fate is Fate.CHARGE:
        return f"{head}. {probed} this item hung it: failed, an attempt charged; {tail}"
    if fate is Fate.CRASH:
        return (
            f"{head}. {probed} an input hung it: the batch's lease was ended and the next "
            f"claim scores its items in isolation rounds to find which; {tail}"
        )
    if fate is Fate.MODEL:
        where = (
            f"and queue {queue!r} is paused (`batching queue resume {queue} --reason ...` "
            "once the model is fixed)"
            if not_paused is None
            else f"and the queue was not paused ({not_paused})"
        )
        return (
            f"{head}. The model failed (or did not finish) its own probe input: the model or "
            f"the device is at fault; the batch went back without using an attempt {where}; "
            f"{tail}"
        )
    return f"{head}; {tail}"


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


def fate(works: bool | None, n_items: int, *, isolated: bool) -> Fate:
    """The fate of a hung batch of ``n_items``: ``works`` is the probe's answer (None: no
    probe, so nothing says the model is at fault: the crash rule's way); ``isolated``: its
    items were claimed in an isolation round."""
    if works is False:
        return Fate.MODEL
    if n_items == 1 and isolated:
        return Fate.CHARGE
    return Fate.CRASH
