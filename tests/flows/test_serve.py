"""The serve supervisor with real processes: a runner that will not stop is killed after the
grace period (Prefect's runner does this when its server is gone); one that stops is waited for.
Targets are module-level functions: the child is spawned and imports them by name."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from flows import serve


def stuck(_limit: int, _supervisor: int, _grace_s: float) -> None:
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # like a runner retrying a dead API
    time.sleep(60)


def stops(_limit: int, _supervisor: int, _grace_s: float) -> None:
    os.setsid()
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        return


def term_self_after(seconds: float) -> None:
    threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM)).start()


def test_a_runner_that_ignores_the_signal_is_killed_after_the_grace_period(
    capfd: pytest.CaptureFixture[str],
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    term_self_after(1.0)
    started = time.monotonic()
    assert serve.supervise(1, 1.0, target=stuck) == 1
    assert time.monotonic() - started < 15
    err = capfd.readouterr().err
    assert "did not stop within 1s" in err
    assert "prefect deployment schedule pause --all" in err
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handlers are back


def test_a_runner_that_stops_on_the_signal_exits_cleanly() -> None:
    term_self_after(1.0)
    started = time.monotonic()
    assert serve.supervise(1, 10.0, target=stops) == 0
    assert time.monotonic() - started < 8
