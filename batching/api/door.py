"""Refusing POSTs at the door while their queue is full: a 429 before the body is parsed.

Past capacity most POSTs are refused at the depth cap, and a refusal cost the API as much CPU
as an admission (~1.9 ms: the body parsed and validated, the writer's group, a savepoint and
the depth count, ``bench/api_cost.py``), taken from the scorer on the same cores. Once the
writer finds the queue with no room at all (or a tenant with none left in its share of
it), :class:`Door` refuses the queue's (the tenant's) next POSTs with that same refusal,
their bodies read but not parsed, until there may be room again: a batch committed since
(``mark`` changed) or ``hold_s`` passed. Only an ack makes room (ready and leased items both
count against the cap; a dead or expired item, a cap raised, or another tenant's items
leaving and so widening a share, free it too, and wait at most ``hold_s``).

So a POST refused here might have fitted after all in two cases only: its keys were all
present already (a resend, answered 200 through the writer) or room came by a way the mark
does not see; each is answered 429 with Retry-After, and its retry goes through.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batching import errors

HOLD_S = 0.25
"""The longest a queue stays refused here without a new look by the writer."""


class Door:
    """Queues found full, refused without a look until their ``mark`` moves.

    Args:
        mark: a value that changes when a batch commits (``Results.acked`` on SQLite, the
            commit watch's ``mark`` on PostgreSQL); None: ``hold_s`` alone reopens.
        hold_s: see :data:`HOLD_S`.
        clock: monotonic seconds (injected by tests).

    Called from the event loop only: no lock.
    """

    def __init__(
        self,
        mark: Callable[[], object] | None,
        *,
        hold_s: float = HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mark, self.hold_s, self._clock = mark, hold_s, clock
        self._shut: dict[str, tuple[errors.QueueFull, object, float]] = {}
        self.refused = 0  # POSTs refused here (for tests and logs)

    def close(self, queue: str, tenant: str, refusal: errors.QueueFull) -> None:
        """The writer refused ``tenant``'s POST to ``queue``: shut the queue when its cap had
        no room at all, or the tenant's way in when its share had none."""
        if refusal.room is not None and refusal.room <= 0:
            key = queue if refusal.reason == "depth_cap" else f"{queue}\0{tenant}"
            self._shut[key] = (refusal, self._now_mark(), self._clock())

    def refusal(self, queue: str, tenant: str) -> errors.QueueFull | None:
        """The refusal to answer ``tenant``'s POST to ``queue`` with now, or None to let it in."""
        if not self._shut:
            return None
        for key in (queue, f"{queue}\0{tenant}"):
            shut = self._shut.get(key)
            if shut is None:
                continue
            refusal, mark, since = shut
            if self._clock() - since >= self.hold_s or self._now_mark() != mark:
                del self._shut[key]
                continue
            self.refused += 1
            # its own exception (and traceback) each time
            return errors.QueueFull(str(refusal), reason=refusal.reason, room=refusal.room)
        return None

    def _now_mark(self) -> object:
        if self._mark is None:
            return None
        try:
            return self._mark()
        except Exception:  # unknown: a new object, so the door opens and the writer looks
            return object()
