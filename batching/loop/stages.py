"""What the scoring loop's stages hand each other: named types, not tuples.

    dispatch --Dispatched[D]--> forward --Scored--> commit

``Dispatched`` carries a released batch, the lease each of its items was claimed under, and
the runner's decoded input (of the runner's own type ``D``); ``Scored`` the batch, the leases
and what the forward pass made of it. :func:`by_lease` groups what one group commit takes
into one :class:`LeasePart` per lease: a lease's items commit (or fail) together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from batching import models, outcomes

D = TypeVar("D")
FloatArray = npt.NDArray[np.float32]
Leases = dict[int, str]
"""Item id -> the lease it was claimed under, as the batch was dispatched."""


@dataclass(frozen=True, slots=True)
class Dispatched(Generic[D]):
    """A batch on its way to the forward stage."""

    batch: models.Batch
    leases: Leases
    decoded: D


@dataclass(frozen=True, slots=True)
class Scored:
    """A batch on its way to the commit stage."""

    batch: models.Batch
    leases: Leases
    result: outcomes.ScoreResult


INEXACT = "~"
"""Ends the id of a pass the runner split or that failed items (``LeasePart.forwards``)."""


class End:
    """The end of a stage's input: no job follows."""


END = End()


@dataclass
class LeasePart:
    """The items of one lease in a group commit: all of them, those scored, those failed (to
    retry), and those whose payload the model cannot read (dead at once: a retry cannot help).
    Uniform batches scored whole (ItemBlocks and their output matrices) stay columns, without
    an object per item, unless the part also holds items of the above."""

    items: list[models.WorkItem] = field(default_factory=list)
    ok: list[models.WorkItem] = field(default_factory=list)
    outputs: dict[int, FloatArray] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    undecodable: dict[int, str] = field(default_factory=dict)
    blocks: list[models.ItemBlock] = field(default_factory=list)
    matrices: list[FloatArray] = field(default_factory=list)
    model_version: str | None = None  # the version that scored them (None: the run's own)
    forwards: dict[str, list[int]] = field(default_factory=dict)  # forward pass -> ids scored

    def scored(
        self,
    ) -> tuple[Sequence[models.WorkItem], Mapping[int, FloatArray], Sequence[models.WorkItem]]:
        """``(items to commit, their outputs, every item the part held)``: one lease's blocks
        joined into one (one claim's shared fields), or everything as items when the part
        also holds items."""
        if self.blocks and not self.items:
            block = models.ItemBlock.join(self.blocks)
            matrix = self.matrices[0] if len(self.matrices) == 1 else np.concatenate(self.matrices)
            return block, models.OutputRows(block.ids, matrix), block
        for block, matrix in zip(self.blocks, self.matrices, strict=True):
            built = list(block)  # each item built once
            self.ok.extend(built)
            self.outputs.update(zip(block.ids, matrix, strict=True))
            self.items.extend(built)
        self.blocks, self.matrices = [], []
        return self.ok, self.outputs, self.items


def by_lease(jobs: Sequence[Scored]) -> list[tuple[str, LeasePart]]:
    """The scored batches of one group commit, as one part per lease and model version (a
    rollout's batches of two versions commit apart, each recorded with its own)."""
    parts: dict[tuple[str, str | None], LeasePart] = {}

    def part_of(lease_id: str, version: str | None) -> LeasePart:
        part = parts.get((lease_id, version))
        if part is None:
            part = parts[lease_id, version] = LeasePart(model_version=version)
        return part

    for job in jobs:
        batch, result = job.batch, job.result
        version = batch.model_version
        # A pass the runner split (bisection, an OOM split) or that failed items is not one
        # forward pass of these members: marked, so a replay does not promise its bits.
        pass_id = batch.pass_id + (INEXACT if result.n_forward > 1 or result.failures else "")
        owners = set(job.leases.values())
        if len(owners) == 1 and not result.failures:  # the common case, without a step per item
            part = part_of(owners.pop(), version)
            outputs = result.outputs
            if (
                isinstance(batch.items, models.ItemBlock)
                and isinstance(outputs, models.OutputRows)
                and outputs.ids == batch.items.ids
            ):
                part.blocks.append(batch.items)
                part.matrices.append(outputs.matrix)
                part.forwards.setdefault(pass_id, []).extend(batch.items.ids)
                continue
            built = tuple(batch.items)  # a block's items built once
            part.ok.extend(built)
            part.forwards.setdefault(pass_id, []).extend(models.item_column(built, "id"))
            part.outputs.update(outputs)
            part.items.extend(built)
            continue
        for item in batch.items:
            part = part_of(job.leases[item.id], version)
            if item.id in result.outputs:
                part.ok.append(item)
                part.forwards.setdefault(pass_id, []).append(item.id)
                part.outputs[item.id] = result.outputs[item.id]
            elif item.id in result.undecodable:
                part.undecodable[item.id] = result.failures[item.id]
            else:
                part.failures[item.id] = result.failures[item.id]
            part.items.append(item)
    return [(lease_id, part) for (lease_id, _), part in parts.items()]


def has_deadline(batch: models.Batch) -> bool:
    """Whether any item of ``batch`` has a deadline (it then commits without waiting)."""
    if isinstance(batch.items, models.ItemBlock):  # one for all
        return batch.items.template.deadline_at is not None
    return any(item.deadline_at is not None for item in batch.items)
