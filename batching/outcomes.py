"""What the stages report back: a scored batch (``ScoreResult``), a commit (``CommitResult``)
and a start-up recovery (``RecoverResult``); standard library only.

The model runner produces the first, the outputs layer the other two; the scoring loop reads
all three without knowing who made them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batching import models

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Outputs of one batch: ``outputs`` (id -> float32 ``[output_dim]``; a batch scored in
    one pass without a failure gives them as one matrix, ``models.OutputRows``) and
    ``failures``.

    Every input item is in exactly one of the two. ``service_s`` is forward wall seconds (copies
    in and out included); ``n_forward`` counts model calls (more than 1 after splits).
    ``undecodable``: the failed items whose payload this model cannot read (a wrong shape,
    dtype or field): no retry can help them, unlike a failure in the forward pass.
    ``whole_batch_error``: set (to the first model error) when the forward pass failed for
    the batch as a whole: two or more items reached the model and every one of them failed
    in it with an error (bisection found no item that fails beside batch-mates that score;
    an output counts when not finite even alone). The retry-storm breaker
    (``batching.loop.breaker``) counts such batches. ``model_at_fault``: the model broke its
    contract for batches but for no item alone (it drops a row of any batch past one): the
    model's fault whatever a probe of one item says.
    ``n_oom_splits``: sub-batches split in half after a CUDA OOM; ``poisoned``: the failed items
    a bisection isolated (each failed alone while its batch-mates scored).
    """

    outputs: Mapping[int, npt.NDArray[np.float32]]
    failures: dict[int, str]
    service_s: float
    real_tokens: int
    padded_tokens: int
    batch_error: str | None = None
    n_forward: int = 0
    undecodable: frozenset[int] = frozenset()
    whole_batch_error: str | None = None
    n_oom_splits: int = 0
    poisoned: frozenset[int] = frozenset()
    model_at_fault: bool = False


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a commit wrote.

    ``location``: the file path relative to the dataset root, or the table name. ``n_rows``:
    rows written (a replayed SQL key is counted in ``n_replayed`` instead). ``n_bytes``: file
    size in bytes (None when the sink writes no file of its own). ``published`` is False when
    the batch committed but is not visible yet (a rename or a roll-forward failed); the
    sink's ``recover()`` and reconcile's repair publish it.
    """

    batch_id: str
    n_rows: int
    location: str
    n_bytes: int | None = None
    published: bool = True
    n_replayed: int = 0


@dataclass(frozen=True, slots=True)
class RecoverResult:
    """What a sink's ``recover()`` did: batches published (rolled forward), staging files
    deleted, staging files kept because their lease is still held (a commit may be in flight)."""

    rolled_forward: tuple[str, ...] = ()
    removed_staging: tuple[str, ...] = ()
    in_flight: tuple[str, ...] = ()


def by_cost(items: Sequence[models.WorkItem], seconds: float) -> dict[str, float]:
    """``seconds`` of a forward pass shared among the tenants of its ``items`` in proportion
    to their cost (each item's ``cost``: tokens, rows; at least 1): what each tenant's items
    used of the device. A claim's block is one tenant's: no step per item."""
    if isinstance(items, models.ItemBlock):
        return {items.template.tenant: seconds} if len(items) else {}
    shares: dict[str, float] = {}
    tenants, costs = models.item_column(items, "tenant"), models.item_column(items, "cost")
    for tenant, cost in zip(tenants, costs, strict=True):
        shares[tenant] = shares.get(tenant, 0.0) + max(int(cost), 1)
    total = sum(shares.values())
    return {t: seconds * c / total for t, c in shares.items()} if total else {}


def reasons_line(reasons: Mapping[str, int], most: int = 3) -> str:
    """The first ``most`` failure reasons of a run (commonest first), each with its count."""
    return "; ".join(f"{n} x {reason}" for reason, n in list(reasons.items())[:most])


def nothing_succeeded(summary: Mapping[str, object], queue: str | None = None) -> str | None:
    """Why a run that committed nothing and failed items is a failed run, or None: the
    CLI exits 1 and the flows fail with it (``errors.NothingSucceeded``). Such a run had
    ended green while every item was dead-lettered. Names the commonest reasons the run
    saw (``failure_reasons``), so the run's message says what to fix."""
    failed = int(str(summary.get("items_failed") or 0))
    if summary.get("items_committed") or not failed:
        return None
    reasons = summary.get("failure_reasons")
    why = (
        reasons_line(reasons)
        if isinstance(reasons, Mapping) and reasons
        else "see each item's last_error"
    )
    where = f" in queue {queue!r}" if queue else ""
    return (
        f"the run committed nothing and {failed} item(s) failed{where} (retried, or dead with "
        f"their reason): {why}; `batching status -q {queue or 'QUEUE'}` shows where they are, "
        "`batching redrive` sends dead items back once fixed"
    )
