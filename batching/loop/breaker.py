"""The retry-storm breaker: stop a run whose model fails batch after batch, before it burns
every item's attempts.

A model that always fails (a bad checkpoint, a broken device, a dependency gone) used to fail
every item of every batch: bisection looked for the poison item (63 forward calls for a batch
of 32), found none, every item used an attempt, was retried, and in the end the whole queue
was dead. The breaker tells that apart from poison by the runner's verdict on each batch
(:func:`verdict`):

* ``SCORED``: at least one item scored; the model works.
* ``WHOLE_FAILED``: two or more items reached the model and every one failed in it with an
  error (``ScoreResult.whole_batch_error``): bisection found no single poison.
* ``NEITHER``: nothing to learn: one item alone (a poison item cannot be told from a broken
  model), or no item reached the model (all undecodable). It neither extends nor breaks a
  streak, and its failures are applied at once: a poison item alone always uses its attempt,
  so it goes dead in the end and no run loops on it.

A ``WHOLE_FAILED`` batch's failures are *held*, not applied: its items stay leased (the
scorer's heartbeat extends them) until the streak is decided:

* a ``SCORED`` batch breaks it: the held batches go on to the commit stage first, and their
  failures are applied as before the breaker (an attempt used each);
* ``max_failed_batches`` of them in a row trip it: :class:`Trip` hands the held batches back
  to be released without using an attempt; the scorer pauses the queue, stops claiming,
  releases everything else it holds and fails the run with :class:`~batching.errors.RetryStorm`;
* the streak ends undecided (the queue ran dry, the run ends): :meth:`Breaker.settle` hands the
  held batches on to be applied, as a broken streak. Releasing them instead would let a small
  queue of whole-failing batches loop run after run without ever using an attempt. Only when
  the queue was found paused meanwhile (an operator, or another scorer's breaker) does the
  scorer release them: the pause asks for exactly that.

So at most ``max_failed_batches - 1`` batches are held, and a storm costs that many batches'
bisections, not the queue's. The state machine is pure (no clock, no I/O, no threads): the
scorer's forward stage feeds it in forward order and does what each :class:`Step` says.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from batching import errors, outcomes
from batching.config import BreakerConfig

J = TypeVar("J")
_MAX_ERROR_CHARS = 200  # the model error as the RetryStorm message quotes it


class Verdict(enum.Enum):
    """What one forward pass says about the model (see the module doc)."""

    SCORED = "scored"
    WHOLE_FAILED = "whole_failed"
    NEITHER = "neither"


def verdict(result: outcomes.ScoreResult) -> Verdict:
    """The breaker's reading of a forward pass's result."""
    if result.outputs:
        return Verdict.SCORED
    if result.whole_batch_error is not None:
        return Verdict.WHOLE_FAILED
    return Verdict.NEITHER


@dataclass(frozen=True)
class Trip(Generic[J]):
    """The breaker tripped: ``jobs`` (the streak's batches, oldest first, the last one
    included) must be released without using an attempt; ``sizes`` are their item counts
    and ``error`` the last one's model error."""

    jobs: tuple[J, ...]
    sizes: tuple[int, ...]
    error: str

    def message(self, queue: str, paused: str | None) -> str:
        """The one-line ``RetryStorm`` message. ``paused``: None when the queue was paused,
        else why it was not (the operator then resumes by scoring again)."""
        error = self.error if len(self.error) <= _MAX_ERROR_CHARS else self.error[:197] + "..."
        sizes = ", ".join(map(str, self.sizes))
        head = (
            f"retry storm on queue {queue!r}: {len(self.sizes)} batches in a row "
            f"({sizes} items) failed in the forward pass with no single poison item found; "
            f"last model error: {error}; the run stopped and gave back the items it held "
            "without using an attempt"
        )
        if paused is None:
            return (
                f"{head}, and the queue is paused: fix or roll back the model, then "
                f"`batching queue resume {queue} --reason ...`"
            )
        return f"{head}; the queue is not paused ({paused}): fix or roll back the model, then score again"


@dataclass(frozen=True)
class Step(Generic[J]):
    """What to do after one batch: hand ``forward`` on to the commit stage, in this order
    (held batches first, then the batch itself), and when ``trip`` is set, stop the run."""

    forward: tuple[J, ...] = ()
    trip: Trip[J] | None = None


class Breaker(Generic[J]):
    """The streak of ``WHOLE_FAILED`` batches, and the batches it holds (see module doc).

    ``J`` is whatever the caller holds per batch (the scorer: its ``Scored`` job).
    """

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._held: list[J] = []
        self._sizes: list[int] = []

    @property
    def held(self) -> Sequence[J]:
        """The batches held (their failures not applied yet), oldest first."""
        return tuple(self._held)

    @property
    def held_items(self) -> int:
        """Items of the held batches (all still leased)."""
        return sum(self._sizes)

    def observe(self, job: J, verdict: Verdict, n_items: int, error: str | None = None) -> Step[J]:
        """Feed one forward pass's verdict (``n_items``: the batch's items, ``error``: its
        ``whole_batch_error``); returns what to do with it and with what is held."""
        if not self.config.enabled or verdict is Verdict.NEITHER:
            return Step(forward=(job,))
        if verdict is Verdict.SCORED:
            return Step(forward=(*self.settle(), job))
        self._held.append(job)
        self._sizes.append(n_items)
        if len(self._held) < self.config.max_failed_batches:
            return Step()
        trip = Trip(tuple(self._held), tuple(self._sizes), error or "unknown error")
        self._held, self._sizes = [], []
        return Step(trip=trip)

    def settle(self) -> tuple[J, ...]:
        """End the streak undecided: the held batches, oldest first, to apply as failed (the
        streak is reset)."""
        held = tuple(self._held)
        self._held, self._sizes = [], []
        return held


def pause(
    pause_queue: Callable[[str], object] | None, config: BreakerConfig, reason: str
) -> str | None:
    """Pause the queue as a trip (or a hung pass the model's probe blames on the model)
    asks; None when paused, else why not (the message tells the operator). A failed pause is
    logged and still lets the run stop: its release must not wait on it."""
    if pause_queue is None:
        return "no pause was wired in" if config.pause_queue else "breaker.pause_queue is false"
    try:
        pause_queue(reason[:500])
    except Exception as exc:
        logging.getLogger(__name__).warning(
            "queue not paused", extra={"action": "pause_failed"}, exc_info=True
        )
        return f"pausing it failed: {errors.one_line(exc, 120)}"
    return None
