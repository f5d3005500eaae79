"""A table's payload column through the model in micro-batches (bulk scoring in place,
:mod:`batching.compose.inplace`): rows as work items with ids ``0..n-1``, a columnar block
when every row is a dense vector of the model's width; token rows sorted by length and cut by
``max_batch_cost``; a row the model refuses fails alone (the runner bisects)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa

from batching import errors, models

if TYPE_CHECKING:
    from batching.model.runner import TorchRunner


@dataclass(frozen=True, slots=True)
class Scored:
    """A shard's rows after the model: outputs (rows of failed ones are zero), each row's
    error (None when scored), and what the forward passes took."""

    matrix: np.ndarray
    errors: list[str | None]
    n_failed: int
    sizes: list[int]
    service_s: float
    real_tokens: int
    padded_tokens: int
    whole_error: str | None
    whole_failed: int  # micro-batches of two or more rows that failed whole in the model


class PassWatch(Protocol):
    """Told of each pass (``batching.loop.watchdog.ForwardWatch``)."""

    def started(self, job: Sequence[models.WorkItem]) -> None: ...

    def finished(self) -> bool: ...


def score_rows(
    runner: TorchRunner,
    payload: pa.ChunkedArray,
    max_batch: int,
    max_cost: int | None,
    watch: PassWatch | None = None,
) -> Scored:
    """Score a shard's payload column in micro-batches; a failing row fails alone. ``watch``
    times each pass; one it declared hung raises ``ForwardHung`` when it returns at last."""
    items = _work_items(payload, runner)
    n = len(items)
    order = list(range(n))
    if runner.input_kind != "dense":  # length buckets: little padding per batch
        order.sort(key=lambda i: _length(items[i]))
    out = np.zeros((n, runner.output_dim), dtype=np.float32)
    failures: dict[int, str] = {}
    sizes: list[int] = []
    service = 0.0
    real = padded = 0
    errs: list[str] = []
    for chunk in _cut(items, order, max_batch, max_cost):
        if watch is None:
            result = runner.score(chunk)
        else:
            watch.started(chunk)
            try:
                result = runner.score(chunk)
            finally:  # a pass that raised is no pass in flight
                hung = watch.finished()
            if hung:
                raise errors.ForwardHung("a pass returned after the watchdog declared it hung")
        sizes.append(len(chunk))
        service += result.service_s
        real, padded = real + result.real_tokens, padded + result.padded_tokens
        _place(out, result.outputs)
        failures.update(result.failures)
        if result.whole_batch_error:
            errs.append(result.whole_batch_error)
    row_errors: list[str | None] = [None] * n
    for i, reason in failures.items():
        row_errors[i] = reason
    whole = None
    if n > 0 and len(failures) == n:  # not one row scored: not the shard's output
        # Refused one by one, every row of several (a payload the model cannot read: the
        # wrong model for the data, most often), a file of errors committed as the shard's
        # output would mark the data scored for good; failing the shard leaves a dead item to
        # redrive once it is fixed. A shard of one row is that row's: it fails alone.
        if errs:
            whole = errs[-1]
        elif n > 1:
            whole = f"every row of the shard was refused, the first: {row_errors[0]}"
    return Scored(out, row_errors, len(failures), sizes, service, real, padded, whole, len(errs))


def _place(out: np.ndarray, outputs: object) -> None:
    if isinstance(outputs, models.OutputRows):
        out[np.asarray(outputs.ids, dtype=np.int64)] = outputs.matrix
        return
    assert isinstance(outputs, dict)
    for i, row in outputs.items():
        out[i] = row


def _length(item: models.WorkItem) -> int:
    shape = item.payload.shape
    return shape[0] if shape else 1


def _cut(
    items: Sequence[models.WorkItem], order: list[int], max_batch: int, max_cost: int | None
) -> list[Sequence[models.WorkItem]]:
    """Micro-batches in ``order``: at most ``max_batch`` rows and, for tokens, ``max_cost``
    padded tokens (rows x the longest). A dense block stays a block."""
    if isinstance(items, models.ItemBlock):
        return [items[a : a + max_batch] for a in range(0, len(items), max_batch)]
    batches: list[Sequence[models.WorkItem]] = []
    batch: list[models.WorkItem] = []
    longest = 0
    for i in order:
        item = items[i]
        length = _length(item)
        width = max(longest, length)
        if batch and (
            len(batch) >= max_batch
            or (max_cost is not None and width * (len(batch) + 1) > max_cost)
        ):
            batches.append(batch)
            batch, width = [], length
        batch.append(item)
        longest = width
    if batch:
        batches.append(batch)
    return batches


def _work_items(payload: pa.ChunkedArray, runner: TorchRunner) -> Sequence[models.WorkItem]:
    """The rows as work items, ids 0..n-1: one columnar block when every row is a dense
    vector of the model's width (no object per row), else an item each (JSON text is handed
    to the runner as is, so a bad row fails alone with the runner's reason)."""
    col = payload.combine_chunks()
    n = len(col)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        texts = col.to_pylist()
        return [
            models.WorkItem(i, "", models.Payload((t or "").encode()), 0.0)
            for i, t in enumerate(texts)
        ]
    valid = col.is_valid().to_numpy(zero_copy_only=False) if col.null_count else None
    values = col.flatten().to_numpy(zero_copy_only=False)
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    if pa.types.is_fixed_size_list(col.type):
        width = col.type.list_size
        offsets = np.arange(n + 1, dtype=np.int64) * width
    else:
        offsets = col.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]
    lengths = np.diff(offsets)
    dim = runner.input_dim
    if dim is not None and valid is None and n and (lengths == dim).all():
        template = models.WorkItem(
            0, "", models.Payload(b"", models.PayloadFormat.TENSOR, values.dtype.name, (dim,)), 0.0
        )
        zeros = [0.0] * n
        return models.ItemBlock(
            template, list(range(n)), [""] * n, zeros, [1] * n, [1] * n, values.data
        )
    size, dtype, raw = values.dtype.itemsize, values.dtype.name, values.tobytes()
    items = []
    for i, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)):
        if valid is not None and not valid[i]:
            body = models.Payload(b"null")  # the runner refuses it: "payload is null"-like
        else:
            body = models.Payload(
                raw[a * size : b * size], models.PayloadFormat.TENSOR, dtype, (b - a,)
            )
        items.append(models.WorkItem(i, "", body, 0.0))
    return items
