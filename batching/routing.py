"""Which model version scores an item: a queue's route (stable, candidate, split), as the
database holds it and every claim reads it (``batching rollout``; :mod:`batching.ingress.rollout`).

* **Stable** scores everything the candidate does not.
* **Candidate** scores the items of the listed ``tenants`` (all tenants when none are listed)
  whose key falls in the first ``percent`` of the key space: ``bucket(item_key) < percent
  * 100``, a hash of the key alone, so a key keeps its version when it is enqueued again and
  whichever scorer claims it (sticky), and the share converges on ``percent`` by the law of
  large numbers, not by coordination.
* **Shadow**: ``shadow`` percent of the stable items (by another slice of the same hash, so
  the sample is independent of the canary's) are also scored by the candidate, and its
  outputs kept aside, never published.

A pure value type: parsing, hashing and splitting a batch by version; reading and changing
routes is the ingress layer's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from batching import models

BUCKETS = 10_000
"""The key space's slices: ``percent`` is honoured to a hundredth of a percent."""


def bucket(item_key: str) -> int:
    """The key's slice in ``[0, BUCKETS)``: the first 8 bytes of its BLAKE2b digest, stable
    across processes and releases (never Python's salted ``hash``)."""
    digest = hashlib.blake2b(item_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def shadow_bucket(item_key: str) -> int:
    """The key's slice for shadow sampling: another hash than :func:`bucket`'s, so the shadow
    sample of the stable items is not the keys just past the canary's share."""
    digest = hashlib.blake2b(item_key.encode(), digest_size=8, person=b"shadow").digest()
    return int.from_bytes(digest, "big") % BUCKETS


@dataclass(frozen=True)
class Route:
    """A queue's route. ``epoch`` counts its changes (the guard's rollback is refused unless
    the route is still at the epoch it judged); ``since`` is when this route began."""

    stable: str
    candidate: str | None = None
    percent: float = 0.0
    tenants: tuple[str, ...] = ()
    shadow: float = 0.0
    epoch: int = 0
    since: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def versions(self) -> tuple[str, ...]:
        """The versions this route may use: stable first."""
        return (self.stable,) if self.candidate is None else (self.stable, self.candidate)

    def version_for(self, item_key: str, tenant: str) -> str:
        """The version that scores this item (sticky on its key)."""
        if self.candidate is None or (self.tenants and tenant not in self.tenants):
            return self.stable
        return self.candidate if bucket(item_key) < self.percent * 100 else self.stable

    def shadowed(self, item_key: str) -> bool:
        """Whether a stable item is also scored, aside, by the candidate."""
        return self.candidate is not None and shadow_bucket(item_key) < self.shadow * 100

    def split(
        self, items: tuple[models.WorkItem, ...] | models.ItemBlock
    ) -> list[tuple[str, tuple[models.WorkItem, ...] | models.ItemBlock]]:
        """``items`` by the version that scores them, stable first, each part in its order;
        a batch that is all one version is returned whole (an ``ItemBlock`` stays one)."""
        if self.candidate is None:
            return [(self.stable, items)]
        keys = models.item_column(items, "item_key")
        tenants = models.item_column(items, "tenant")
        versions = list(map(self.version_for, keys, tenants))
        if all(v == self.stable for v in versions):
            return [(self.stable, items)]
        if all(v == self.candidate for v in versions):
            return [(self.candidate, items)]
        mine = [i for i, v in enumerate(versions) if v == self.stable]
        theirs = [i for i, v in enumerate(versions) if v != self.stable]
        if isinstance(items, models.ItemBlock):  # stays columns: no object per item
            return [(self.stable, items.take(mine)), (self.candidate, items.take(theirs))]
        return [
            (self.stable, tuple(items[i] for i in mine)),
            (self.candidate, tuple(items[i] for i in theirs)),
        ]

    def as_dict(self) -> dict[str, Any]:
        """Its fields, as JSON holds them."""
        data = asdict(self)
        data["tenants"] = list(self.tenants)
        data.pop("extra")
        return data

    def to_json(self) -> str:
        """As the database holds it (``batching_queue_controls.route``)."""
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Route:
        """Parse what :meth:`to_json` wrote (unknown fields are kept aside, not lost)."""
        data = json.loads(text)
        known = {k: data.pop(k) for k in list(data) if k in _FIELDS}
        known["tenants"] = tuple(known.get("tenants", ()))
        return cls(**known, extra=data)

    def describe(self) -> str:
        """One line: ``stable 1`` or ``stable 1, candidate 2 at 10% of tenants a, b``."""
        if self.candidate is None:
            return f"stable {self.stable}"
        scope = f" of tenants {', '.join(self.tenants)}" if self.tenants else ""
        shadow = f", shadow {self.shadow:g}%" if self.shadow else ""
        return (
            f"stable {self.stable}, candidate {self.candidate} at {self.percent:g}%{scope}{shadow}"
        )


@dataclass(frozen=True, slots=True)
class Pin:
    """A scorer that serves one model version of a rollout: it claims only the items the
    queue's route sends to ``version`` (``default``: the version a queue without a route runs)."""

    version: str
    default: str


_FIELDS = {"stable", "candidate", "percent", "tenants", "shadow", "epoch", "since"}
