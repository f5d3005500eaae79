"""A scored input shard as the sinks commit it (bulk scoring in place): one queue item, many
rows (:mod:`batching.compose.inplace`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from batching import errors
from batching.outputs import contract as sinks


@dataclass(frozen=True, eq=False)
class ShardBatch(sinks.ScoredBatch):
    """A scored input shard (bulk scoring in place): one queue item, whose rows are the
    shard's input rows, already as Arrow (``rows``: ``item_key`` the shard's key on every row,
    then the input row, output and error columns). It commits like any batch: the ack of
    its one item and its ledger row (``n_rows`` its rows) in one transaction, so reconcile
    holds it to exactly one file of exactly those rows.

    Raises:
        SinkError: not one item, no rows, or a row keyed by another item.
    """

    rows: pa.Table | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "items", tuple(self.items))
        for what, value in (("batch_id", self.batch_id), ("lease_id", self.lease_id)):
            if not sinks.SAFE_ID.match(value):
                raise errors.SinkError(f"{what} must match [A-Za-z0-9_-]{{1,36}}, got {value!r}")
        if len(self.items) != 1 or self.rows is None or self.rows.num_rows == 0:
            raise errors.SinkError(f"shard batch {self.batch_id}: one item and its rows needed")
        keys = self.rows.column("item_key").unique().to_pylist()
        if keys != [self.items[0].item_key]:
            raise errors.SinkError(f"shard batch {self.batch_id}: rows keyed by another item")

    @property
    def n_rows(self) -> int:
        assert self.rows is not None
        return int(self.rows.num_rows)

    def table(self) -> pa.Table:
        assert self.rows is not None
        return self.rows

    def matrix(self) -> npt.NDArray[np.float32]:
        raise errors.SinkError("a shard batch commits to a Parquet output only")
