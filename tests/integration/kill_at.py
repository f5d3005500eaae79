"""`batching ARGS` that SIGKILLs itself at a chosen point of an outbox sink's commit:

    python kill_at.py POINT [N] -- ARGS

POINT ``before-write``: the ledger row and the outbox row have committed with the ack, the
output (Delta commit, upsert) not yet; ``after-write``: the output has the batch, the ledger's
``published`` mark not yet. ``N`` (default 1): at the Nth batch. The process dies by the
kernel's hand, as an OOM kill would take it: no ``finally`` runs.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def main() -> None:
    sep = sys.argv.index("--")
    point, *rest = sys.argv[1:sep]
    nth = int(rest[0]) if rest else 1
    from batching.outputs import ledger, outbox

    seen = [0]

    def at_nth() -> None:
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "before-write":
        roll = outbox.OutboxSink._roll

        def dying_roll(self: outbox.OutboxSink, pending: Any, table: Any) -> None:
            at_nth()
            roll(self, pending, table)

        outbox.OutboxSink._roll = dying_roll  # type: ignore[method-assign]
    else:
        mark = ledger.mark_published

        def dying_mark(conn: Any, batch_ids: Any, now: float) -> int:
            at_nth()
            return mark(conn, batch_ids, now)

        ledger.mark_published = dying_mark
    from batching.cli import main as batching

    sys.argv = ["batching", *sys.argv[sep + 1 :]]
    batching()


if __name__ == "__main__":
    main()
