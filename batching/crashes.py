"""Who pays when a worker dies: the attempt rule for a lease that expired, written once for
the SQL queue and its in-memory twin.

A model's exception names the item it failed on (the runner bisects a failed batch), but a
process that dies (an OOM kill, a segfault, ``os._exit`` in a model) names nobody: its lease
simply expires. Charging every item of it would dead-letter the good items claimed with the
one that killed it, after ``max_attempts`` deaths. So the rule is:

* An expired lease that held more than one item is **not charged**: each item gets its
  attempt back and becomes a *suspect* (``isolate_n``, the most suspects a claim may take
  together), at most half as many as the lease held. Scorers take suspects in an *isolation
  round*: nothing else in flight in the process, the suspects' own lease, until it commits.
* An isolation round that dies with several suspects bisects again (each gets half as many
  companions next time), still uncharged.
* Only an item that was **alone** in an isolation round when its worker died is charged the
  attempt; it goes ``dead`` when its attempts run out, with a reason that says so.

However many rounds it takes, a good item is never charged for a batch-mate: it pays only for
a death that happened while it was the only item in flight in its process. Rounds are few: a
lease of ``n`` items finds its killer in about ``log2(n)`` deaths.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

REFUNDED = (
    "worker lost while its lease held {n} item(s): attempt not charged, scored again in isolation"
)
CHARGED = "worker lost while this item was scored alone (isolation round)"
KILLER = "worker lost each time this item was scored alone; attempts exhausted"


@dataclass(frozen=True, slots=True)
class Expired:
    """One leased row whose lease expired: its id, lease and suspect bound (0: not a suspect)."""

    id: int
    lease_id: str
    isolate_n: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the reaper does to some of the rows: charge their attempt (``charged``) or give
    it back, and the suspect bound they leave with."""

    ids: tuple[int, ...]
    charged: bool
    isolate_n: int
    reason: str


def judge(rows: Iterable[Expired]) -> list[Verdict]:
    """The verdicts for the rows of expired leases, one per lease (see the module's rule)."""
    leases: dict[str, list[Expired]] = {}
    for row in rows:
        leases.setdefault(row.lease_id, []).append(row)
    verdicts = []
    for held in leases.values():
        ids = tuple(r.id for r in held)
        alone = len(held) == 1 and held[0].isolate_n > 0
        if alone:
            verdicts.append(Verdict(ids, True, 1, CHARGED))
        else:
            half = (len(held) + 1) // 2
            verdicts.append(Verdict(ids, False, half, REFUNDED.format(n=len(held))))
    return verdicts
