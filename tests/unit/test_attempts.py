"""A retried run (``run_record.Attempt``): what is left of its limits, and what lineage it records."""

from __future__ import annotations

from typing import Any

import pytest

from batching import errors, models
from batching.compose import record as run_record
from batching.compose import run as app
from batching.loop.stats import RunLimits


@pytest.mark.parametrize(
    ("limits", "so_far", "now", "left"),
    [
        (RunLimits(max_items=200), None, 99.0, RunLimits(max_items=200)),
        (RunLimits(max_items=200), models.RunSoFar(0.0, 120, 5), 9.0, RunLimits(max_items=75)),
        (RunLimits(max_items=100), models.RunSoFar(0.0, 120, 0), 9.0, RunLimits(max_items=0)),
        (RunLimits(max_seconds=240), models.RunSoFar(10.0, 7, 0), 70.0, RunLimits(max_seconds=180)),
        # The time is spent: claim nothing (a deadline a moment away still claimed once).
        (RunLimits(max_seconds=240), models.RunSoFar(10.0, 7, 0), 250.0, RunLimits(max_items=0)),
        (
            RunLimits(until_empty=False, max_items=50, max_seconds=5),
            models.RunSoFar(0.0, 10, 0),
            9.0,
            RunLimits(until_empty=False, max_items=0),
        ),
        (RunLimits(), models.RunSoFar(0.0, 10, 0), 1e9, RunLimits()),
    ],
)
def test_a_retry_gets_what_its_earlier_attempts_left(
    limits: RunLimits, so_far: models.RunSoFar | None, now: float, left: RunLimits
) -> None:
    assert app._left(limits, so_far, now) == left


class Emitted:
    """A fake emitter: the events asked for, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def start(self, _ctx: Any) -> None:
        self.events.append(("START", None))

    def running(self, _ctx: Any, error: BaseException | None = None) -> None:
        self.events.append(("RUNNING", error))

    def fail(self, _ctx: Any, error: BaseException, outputs: Any = None) -> None:
        self.events.append(("FAIL", error))


def transient(exc: BaseException) -> bool:
    return isinstance(exc, errors.SinkError)


@pytest.mark.parametrize(
    ("number", "error", "expected"),
    [
        (1, errors.SinkError("disk"), ["START", "RUNNING"]),  # to be retried
        (1, errors.CheckpointError("sha"), ["START", "FAIL"]),  # not retryable
        (2, errors.SinkError("disk"), ["RUNNING", "RUNNING"]),
        (3, errors.CheckpointError("sha"), ["RUNNING", "FAIL"]),
    ],
)
def test_an_attempt_opens_and_fails_the_run_once_in_lineage(
    number: int, error: BaseException, expected: list[str]
) -> None:
    attempt = run_record.Attempt(number, transient)
    emitter: Any = Emitted()
    ctx: Any = None  # the fake ignores it
    attempt.open(emitter, ctx)
    attempt.fail(emitter, ctx, error, [])
    assert [kind for kind, _ in emitter.events] == expected
    assert emitter.events[-1][1] is error
