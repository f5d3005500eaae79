"""Ports the pipeline is given: ``typing.Protocol`` types, standard library only."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
"""Returns the current time in epoch seconds; ``time.time`` in production, a fake in tests."""
