"""The serve supervisor with real processes: a runner that will not stop is killed after the
grace period (Prefect's runner does this when its server is gone); one that stops is waited for.
Targets are module-level functions: the child is spawned and imports them by name."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from flows import serve


def _ready_file(supervisor: int) -> Path:
    return Path(tempfile.gettempdir()) / f"batching-serve-test-{supervisor}.ready"


def stuck(_limit: int, supervisor: int, _grace_s: float) -> None:
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # like a runner retrying a dead API
    _ready_file(supervisor).touch()
    time.sleep(60)


def stops(_limit: int, supervisor: int, _grace_s: float) -> None:
    os.setsid()
    try:
        _ready_file(supervisor).touch()
        time.sleep(60)
    except KeyboardInterrupt:
        return


def term_self_after(seconds: float) -> list[float]:
    """SIGTERM this process ``seconds`` after the child reached its target (a spawned child
    imports the test module and Prefect first, which can take longer than ``seconds``);
    returns a list that gets the signal's ``time.monotonic()``."""
    ready = _ready_file(os.getpid())
    ready.unlink(missing_ok=True)
    sent: list[float] = []

    def term() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        ready.unlink(missing_ok=True)
        time.sleep(seconds)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=term, daemon=True).start()
    return sent


def test_a_runner_that_ignores_the_signal_is_killed_after_the_grace_period(
    capfd: pytest.CaptureFixture[str],
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    sent = term_self_after(1.0)
    assert serve.supervise(1, 1.0, target=stuck) == 1
    assert time.monotonic() - sent[0] < 10  # the 1 s grace, then the kill
    err = capfd.readouterr().err
    assert "did not stop within 1s" in err
    assert "prefect deployment schedule pause --all" in err
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handlers are back


def test_a_runner_that_stops_on_the_signal_exits_cleanly() -> None:
    sent = term_self_after(1.0)
    assert serve.supervise(1, 10.0, target=stops) == 0
    assert time.monotonic() - sent[0] < 8  # well inside the 10 s grace


def fails(_limit: int, _supervisor: int, _grace_s: float) -> None:
    os.setsid()
    raise SystemExit(1)  # as _serve does when the runner fails (its server went away)


def test_a_runner_that_fails_on_its_own_is_reported_with_the_pause_hint(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert serve.supervise(1, 10.0, target=fails) == 1
    err = capfd.readouterr().err
    assert "the runner stopped with exit code 1" in err
    assert "prefect deployment schedule pause --all" in err
