"""``batching score``'s signal handler: a burst of signals stops the scorer once, and a signal
arriving inside the handler returns at once (a burst used to nest handlers until the stack
ran out, inside ``Event.set``'s lock)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from batching.cli import stop_signal


class Scorer:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


@pytest.fixture
def handler() -> Iterator[Any]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield stop_signal.handler()
    for sig, old in saved.items():
        signal.signal(sig, old)


def test_a_signal_inside_the_handler_returns_at_once(handler: Any) -> None:
    scorer = Scorer()
    handler.attach(scorer)
    nested: list[int] = []
    plain_set = threading.Event.set

    def set_interrupted(event: threading.Event) -> None:
        if len(nested) < 50:  # the next signal of the burst lands here
            nested.append(1)
            handler._on_signal(signal.SIGTERM, None)
        plain_set(event)

    handler.asked.set = set_interrupted.__get__(handler.asked)
    handler._on_signal(signal.SIGTERM, None)
    assert nested == [1]  # the nested call did not reach Event.set again
    assert scorer.stops == 1
    assert handler.asked.is_set()
    handler._on_signal(signal.SIGTERM, None)
    assert scorer.stops == 1


def test_the_command_takes_the_handler_main_installed_once_with_what_it_caught() -> None:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop_signal.install_early()
        signal.raise_signal(signal.SIGTERM)  # while the command's modules load
        early = stop_signal.handler()
        assert early.asked.is_set()
        scorer = Scorer()
        early.attach(scorer)  # the scorer stops as soon as it exists
        assert scorer.stops == 1
        fresh = stop_signal.handler()  # taken once: the next command gets its own
        assert fresh is not early
        assert not fresh.asked.is_set()
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
