"""SIGTERM, SIGINT and SIGHUP for the commands that stop gracefully (``score``, ``bulk``): the
handler,
light enough that :func:`batching.cli.main` installs it before the command's imports.

Those imports (typer, SQLAlchemy, torch) take most of a second; a signal in that window used
to find the default action and kill the run (exit -15, seen in the crash fuzz: SIGTERM 0.53 s
after the start). ``main`` now installs the handler first (:func:`install_early`), and the
command takes that one (:func:`handler`), with a signal it already caught. Standard library
only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from typing import Any

_early: StopOnSignal | None = None


def _stop_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM, SIGINT, and SIGHUP unless the process ignores it (``nohup``: a scorer started
    so keeps running past its terminal) or the platform has none. With the default action, a
    scorer whose terminal or SSH session went away died with its items leased (released only
    when the lease ran out, and charged as a crash's); it stops as on SIGTERM."""
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is None or signal.getsignal(hangup) is signal.SIG_IGN:
        return (signal.SIGTERM, signal.SIGINT)
    return (signal.SIGTERM, signal.SIGINT, hangup)


STOP_SIGNALS = _stop_signals()


def install_early() -> None:
    """``main``, before the command's imports: handle the stop signals from now on."""
    global _early
    _early = StopOnSignal()


def handler() -> StopOnSignal:
    """The command's handler: the one :func:`install_early` installed (a signal it caught is
    kept), else a new one (a command invoked in-process, as the tests do)."""
    global _early
    made, _early = _early or StopOnSignal(), None
    return made


class StopOnSignal:
    """SIGTERM, SIGINT and SIGHUP, from the start of ``batching score`` to its end, stop the run:
    once it scores, its scorer stops claiming, commits what is in flight and releases the
    rest; a signal that comes earlier (config, model load, start-up recovery) is kept, and
    stops the scorer as soon as it exists, so the run closes in the ledger and in lineage
    (the signal's default action killed it there: exit -15, a run left ``running``). A
    second signal before then is not kept: start-up can wait minutes on an unreachable
    database or lineage backend, and signalling again is how to stop at once (the run is
    then closed as abandoned by a later one). Workers take ``asked``
    (``run_workers(stop=...)``; asked before they start, none starts)."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.caught: str | None = None  # the first stop signal's name (SIGTERM, ...)
        self._scorer: Any = None
        self._stopping = False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        # At exit the interpreter puts every Python handler back to the default action, and
        # a signal then killed a run that had finished (exit -15 after its summary); an
        # ignored signal stays ignored.
        atexit.register(_ignore_stop_signals)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.caught = self.caught or signal.Signals(signum).name
        if self._scorer is not None:
            # A flag first: a burst of signals nested handlers in Event.set until stack overflow
            if self._stopping:
                return
            self._stopping = True
            self.asked.set()
            self._scorer.stop()
            return
        if not self.asked.is_set():
            self.asked.set()
            # os.write, not the console: the main thread may be inside a print of its own
            with contextlib.suppress(OSError):  # a hung-up terminal
                os.write(2, b"stopping once start-up is done (signal again to stop now)\n")
            return
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, default)
        signal.raise_signal(signum)

    def attach(self, scorer: Any) -> None:
        self._scorer = scorer
        if self.asked.is_set():
            scorer.stop()

    def say_stopped(self, summary: Any) -> None:
        """A note on stderr when a signal stopped the run: its summary alone looked like a run
        that had finished (found by a review)."""
        if self.caught is None:
            return
        released = int(summary.get("items_released") or 0)
        with contextlib.suppress(OSError):
            os.write(
                2,
                f"note: stopped by {self.caught}: batches in flight were committed, {released} "
                "item(s) given back unspent; run again to score the rest\n".encode(),
            )


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
