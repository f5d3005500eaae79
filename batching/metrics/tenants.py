"""Bounded tenant labels: the top N tenants by items seen keep their own label, the rest fold
into ``tenant="other"`` (``metrics.top_tenants``). Standard library only.

Each item goes to exactly one series, so sums over tenants stay exact. A tenant beyond the
top N is promoted once its volume passes the smallest labelled tenant's (which then folds
into ``other`` from then on); volumes are tracked for at most ``max_tracked`` tenants.

A demoted tenant's series stay exported (a counter that vanished would read as a reset), so
a process hands out at most ``max_labels`` (4 x N) tenant labels in its life: past that, only
a tenant labelled before is promoted again. A scorer running for months beside tenants that
come and go exported one more set of series for every tenant that ever rose to the top (200
such tenants: 4,500 lines; a soak review).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from batching.metrics.catalog import OTHER_TENANT


class TenantFolder:
    """Maps a tenant to its label: itself while among the top ``top_n``, else ``other``.

    Args:
        top_n: tenants that keep their own label (at least 1).
        max_tracked: tenants whose volume is remembered (the rest count as new each time).
    """

    def __init__(
        self, top_n: int, max_tracked: int = 10_000, max_labels: int | None = None
    ) -> None:
        if top_n < 1:
            raise ValueError(f"top_n must be >= 1, got {top_n}")
        self.top_n = top_n
        self.max_tracked = max(max_tracked, top_n)
        self.max_labels = max(max_labels or 4 * top_n, top_n)
        self._volume: dict[str, int] = {}
        self._labelled: set[str] = set()
        self._ever: set[str] = set()  # every tenant given its own label (its series exist)
        self._lock = threading.Lock()

    def label(self, tenant: str, n_items: int = 1) -> str:
        """Count ``n_items`` for ``tenant`` and return the label to record them under."""
        with self._lock:
            volume = self._volume.get(tenant, 0) + n_items
            if tenant in self._volume or len(self._volume) < self.max_tracked:
                self._volume[tenant] = volume
            if tenant in self._labelled:
                return tenant
            if tenant == OTHER_TENANT:
                return OTHER_TENANT
            if tenant not in self._ever and len(self._ever) >= self.max_labels:
                return OTHER_TENANT  # no new series: only a tenant labelled before comes back
            if len(self._labelled) < self.top_n:
                self._promote(tenant)
                return tenant
            smallest = min(self._labelled, key=lambda t: (self._volume.get(t, 0), t))
            if volume > self._volume.get(smallest, 0):
                self._labelled.discard(smallest)
                self._promote(tenant)
                return tenant
            return OTHER_TENANT

    def _promote(self, tenant: str) -> None:
        self._labelled.add(tenant)
        self._ever.add(tenant)

    def labelled(self) -> frozenset[str]:
        """The tenants that have their own label now."""
        with self._lock:
            return frozenset(self._labelled)


def top_tenants(volumes: Mapping[str, int], top_n: int) -> frozenset[str]:
    """The ``top_n`` tenants by volume in one snapshot (e.g. the queue table); ties go by
    name. Every other tenant is labelled ``other`` (:func:`fold`)."""
    ranked = sorted((t for t in volumes if t != OTHER_TENANT), key=lambda t: (-volumes[t], t))
    return frozenset(ranked[:top_n])


def fold(tenant: str, keep: frozenset[str]) -> str:
    """``tenant`` if it is kept, else ``other``."""
    return tenant if tenant in keep else OTHER_TENANT
