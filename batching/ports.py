"""The ports: every ``typing.Protocol`` one layer is given by another, in one place; standard
library only at run time.

* :data:`Clock` - the time, injected everywhere a decision depends on it.
* :class:`ClaimPort`, :class:`RunnerPort`, :class:`CommitPort` - what the scoring loop is given:
  a queue to claim from, a model runner, and the outputs to commit to. The loop imports none
  of their implementations (``SqlQueue``, ``TorchRunner``, ``outputs.contract.Outputs``).
* :class:`ScoreObserver` - what the scoring loop reports as it goes (the metrics recorder,
  ``batching.metrics.recorder.Recorder``); :class:`NoObserver` ignores it all.
* :class:`Fence` - what the outputs are given by the queue: a transaction in the queue's
  database, and in it the ack of a lease's items under its fence. A sink never sees the queue
  itself, so it can commit exactly once without knowing how the queue stores its items.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar

from batching import models, outcomes, routing

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from sqlalchemy.engine import Connection

Clock = Callable[[], float]
"""Returns the current time in epoch seconds; ``time.time`` in production, a fake in tests."""

D = TypeVar("D")
"""A runner's decoded batch: made by ``decode``, given to ``forward``, opaque to the loop."""


class ClaimPort(Protocol):
    """The queue, as the scoring loop uses it (``SqlQueue``; ``testing.InMemoryQueue``)."""

    def claim(
        self,
        n: int,
        *,
        lease_s: float,
        lane: str | None = None,
        max_cost: int | None = None,
        columns: bool = False,
        isolate: bool = False,
        lease_id: str | None = None,
        pin: routing.Pin | None = None,
    ) -> models.Claim: ...

    def heartbeat(self, lease_id: str, lease_s: float) -> int: ...

    def check_schema(self) -> None:
        """Raise ``SchemaError`` once the store is no longer at this release's schema."""
        ...

    def fail(
        self,
        lease_id: str,
        failures: Mapping[int, str],
        *,
        retry: bool = True,
        model_version: str | None = None,
    ) -> models.FailResult: ...

    def release(self, lease_id: str, ids: Sequence[int] | None = None) -> int: ...

    def expire(self, lease_id: str, reasons: Mapping[int, str]) -> int:
        """Move held items to ``expired`` unscored, each with its reason (``late_policy``)."""
        ...


class RunnerPort(Protocol[D]):
    """The model, as the scoring loop uses it (``TorchRunner``): ``decode`` on the dispatch
    thread while ``forward`` runs the previous batch on its own."""

    def decode(self, items: Sequence[models.WorkItem]) -> D: ...

    def forward(self, decoded: D) -> outcomes.ScoreResult: ...


class CommitPort(Protocol):
    """The outputs, as the scoring loop uses them (``outputs.contract.Outputs``): commit the
    scored items of one lease exactly once; record what was deferred."""

    def commit(
        self,
        items: Sequence[models.WorkItem],
        lease_id: str,
        outputs: Mapping[int, npt.NDArray[np.float32]],
        scored_at: float,
        model_version: str | None = None,
        forwards: Mapping[str, Sequence[int]] | None = None,
    ) -> outcomes.CommitResult:
        """Commit as scored by ``model_version`` (None: the run's own), in the forward passes
        ``forwards`` (pass id -> ids, for replay). Raises ``LeaseLost`` when the lease no
        longer holds every item (nothing written)."""
        ...

    def flush(self) -> None: ...

    def recover(self) -> object:
        """Settle what a commit left undecided (its database connection lost mid-commit):
        roll a batch the ledger holds forward, drop one it does not."""
        ...


class Fence(Protocol):
    """The queue's side of a commit, given to the sinks (``SqlQueue`` satisfies it).

    ``begin()`` opens a write transaction in the queue's database; inside it,
    ``ack_all_or_raise`` acks a lease's items (compare-and-set on the lease: ``LeaseLost``
    when any is no longer held), so whatever a sink records in the same transaction commits
    with the ack or not at all.
    """

    queue: str
    clock: Clock

    @property
    def dialect(self) -> str: ...

    @property
    def url(self) -> str:
        """The queue database's URL, its password masked (lineage names a table in it)."""
        ...

    @property
    def database_id(self) -> str:
        """The queue database's id (schema 20): what an output records as its owner."""
        ...

    def begin(self) -> AbstractContextManager[Connection]: ...

    def read(self) -> AbstractContextManager[Connection]: ...

    def ack_all_or_raise(
        self, conn: Connection, lease_id: str, ids: Sequence[int], batch_id: str
    ) -> None: ...

    def held_leases(self, conn: Connection, lease_ids: Collection[str]) -> set[str]: ...

    def rebatch(
        self, conn: Connection, old_batch_id: str, new_batch_id: str, keys: Sequence[str]
    ) -> int: ...


class ReconcilePort(Fence, Protocol):
    """The queue, as reconcile uses it: the fence's transactions, and the reaper for stale
    leases (``SqlQueue`` satisfies it)."""

    def release_expired(
        self, limit: int = 5000, *, this_queue: bool = False
    ) -> models.ReapResult: ...


class ScoreObserver(Protocol):
    """What the scoring loop reports as it goes (``batching.metrics.recorder.Recorder``).

    Called from the loop's threads; each call is cheap and never raises. Times are epoch
    seconds (the loop's clock), durations seconds.
    """

    def started(self, at: float) -> None:
        """The run started: it is active from now."""

    def heartbeat(self, at: float) -> None:
        """The run is alive (each group commit, and each heartbeat interval)."""

    def batch_committed(self, batch: models.Batch, result: outcomes.ScoreResult) -> None:
        """A scored batch went through the commit stage (its size, cost, fill, forward time)."""

    def committed(
        self, items: Sequence[models.WorkItem], done_at: float, model_version: str | None = None
    ) -> None:
        """These items committed at ``done_at`` (latency from ``enqueued_at``, SLA misses),
        scored by ``model_version`` (None: the run's own)."""

    def failed(
        self, items: Sequence[models.WorkItem], *, retry: bool, model_version: str | None = None
    ) -> None:
        """These items failed: retried unless ``retry`` is False or their attempts ran out."""

    def released(self, items: Sequence[models.WorkItem]) -> None:
        """These items were given back without using an attempt."""

    def expired(self, by_tenant: Sequence[tuple[str, int]]) -> None:
        """A claim expired items whose deadline had passed: ``(tenant, n)`` pairs."""

    def lease_lost(self, n_items: int) -> None:
        """A commit found its lease lost: ``n_items`` were not committed by this run."""

    def commit_timed(self, seconds: float) -> None:
        """One group commit took ``seconds``."""

    def adaptive_state(self, terms: Mapping[str, float]) -> None:
        """The adaptive controller after a commit: ``forward_margin`` (relative),
        ``commit_tail_s`` and ``slack_s`` (``policy.adaptive.SloController.terms``)."""

    def lineage_failed(self, n_events: int) -> None:
        """``n_events`` lineage events were not delivered (spooled or dropped)."""

    def breaker_tripped(self) -> None:
        """The retry-storm breaker stopped the run."""

    def forward_hung(self) -> None:
        """A forward pass ran past ``queue.forward_timeout_s``: the watchdog stopped the run."""

    def finished(self, at: float) -> None:
        """The run ended (done, stopped or failed): no longer active."""


class NoObserver:
    """A :class:`ScoreObserver` that records nothing: the loop's default."""

    def started(self, at: float) -> None:
        """Nothing recorded."""

    def heartbeat(self, at: float) -> None:
        """Nothing recorded."""

    def batch_committed(self, batch: models.Batch, result: outcomes.ScoreResult) -> None:
        """Nothing recorded."""

    def committed(
        self, items: Sequence[models.WorkItem], done_at: float, model_version: str | None = None
    ) -> None:
        """Nothing recorded."""

    def failed(
        self, items: Sequence[models.WorkItem], *, retry: bool, model_version: str | None = None
    ) -> None:
        """Nothing recorded."""

    def released(self, items: Sequence[models.WorkItem]) -> None:
        """Nothing recorded."""

    def expired(self, by_tenant: Sequence[tuple[str, int]]) -> None:
        """Nothing recorded."""

    def lease_lost(self, n_items: int) -> None:
        """Nothing recorded."""

    def commit_timed(self, seconds: float) -> None:
        """Nothing recorded."""

    def adaptive_state(self, terms: Mapping[str, float]) -> None:
        """Nothing recorded."""

    def lineage_failed(self, n_events: int) -> None:
        """Nothing recorded."""

    def breaker_tripped(self) -> None:
        """Nothing recorded."""

    def forward_hung(self) -> None:
        """Nothing recorded."""

    def finished(self, at: float) -> None:
        """Nothing recorded."""
