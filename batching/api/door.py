"""Refusing POSTs at the door while their queue is full: a 429 before the body is parsed.

Past capacity most POSTs are refused at the depth cap, and a refusal cost the API as much CPU
as an admission (1.3 ms here, 1.9 on another VM: the body parsed and validated, the
writer's group, a savepoint and the depth count, ``bench/api_cost.py``), taken from the
scorer on the same cores. Once the
writer finds the queue with no room at all (or a tenant with none left in its share of
it), :class:`Door` refuses the queue's (the tenant's) next POSTs with that same refusal,
their bodies read but not parsed, until there may be room again: a batch committed since
(``mark`` changed) or ``hold_s`` passed. Only an ack makes room (ready and leased items both
count against the cap; a dead, expired or cancelled item, a cap raised, or another tenant's items
leaving and so widening a share, free it too, and wait at most ``hold_s``).

So a POST refused here might have fitted after all in two cases only: its keys were all
present already (a resend, answered 200 through the writer) or room came by a way the mark
does not see; each is answered 429 with Retry-After, and its retry goes through. The mark is
read before the request goes to the writer, so a batch committed while the writer looked
opens the door at once. A request refused here counts its items by the ``"item_key":`` keys
in its body (:func:`items_in`), so the shed figures keep counting items.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from batching import errors

HOLD_S = 0.25
"""The longest a queue stays refused here without a new look by the writer."""
_ITEM_KEY = re.compile(rb'"item_key"\s*:')


def items_in(body: bytes) -> int:
    """The items of an unparsed POST body: its ``"item_key":`` keys, at least one (a key of
    that name inside a payload object counts too; a JSON string cannot hold the unescaped
    quotes)."""
    return max(1, len(_ITEM_KEY.findall(body)))


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
        self._shut: dict[tuple[str, str | None], tuple[errors.QueueFull, object, float]] = {}
        self.refused = 0  # POSTs refused here (for tests and logs)

    def mark(self) -> object:
        """The mark now: read it before a request goes to the writer, for :meth:`close`."""
        return self._now_mark()

    def close(self, queue: str, tenant: str, refusal: errors.QueueFull, mark: object) -> None:
        """The writer refused ``tenant``'s POST to ``queue``, sent when the mark was ``mark``:
        shut the queue when its cap had no room at all, or the tenant's way in when its share
        had none."""
        if refusal.room is not None and refusal.room <= 0:
            key: tuple[str, str | None]
            if refusal.reason == "depth_cap":  # the whole queue
                key = (queue, None)
                said = (
                    f"queue {queue!r} is at its depth cap; nothing was enqueued: retry after "
                    f"Retry-After or raise the cap with `batching queue cap {queue} --max-depth N`"
                )
            else:  # this tenant's way in
                key = (queue, tenant)
                said = (
                    f"tenant {tenant!r} is at its share of queue {queue!r}'s depth cap; nothing "
                    "was enqueued: retry after Retry-After"
                )
            shut = errors.QueueFull(said, reason=refusal.reason, room=refusal.room)
            self._shut[key] = (shut, mark, self._clock())

    def refusal(self, queue: str, tenant: str) -> errors.QueueFull | None:
        """The refusal to answer ``tenant``'s POST to ``queue`` with now, or None to let it in."""
        if not self._shut:
            return None
        for key in ((queue, None), (queue, tenant)):
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
