"""The batch ledger, ``batching_batches``, as the sinks write it: one row per committed batch
(what it holds, where it went, its state; see ``models.BatchState``), in the queue's database.

A row is inserted in the transaction that acks the batch's items (``sinks.commit``), so the
ledger and the queue never disagree on what was committed; its state moves from
``committed`` to ``published`` once the output is visible, and to ``quarantined`` or
``superseded`` by reconcile's repairs. Rows are never deleted.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Row

from batching import models, ports
from batching.outputs import contract as sinks
from batching.store import schema

_B = schema.batches


def row_values(
    fence: ports.Fence, kind: str, staged: sinks.Staged, **values: Any
) -> dict[str, Any]:
    """The ledger row of a staged batch of sink ``kind``, state ``committed`` unless
    ``values`` say otherwise (with any other column they set)."""
    batch = staged.batch
    return {
        "batch_id": batch.batch_id,
        "run_id": batch.run_id,
        "queue": fence.queue,
        "lease_id": batch.lease_id,
        "model_version": batch.model_version,
        "sink": kind,
        "path": staged.location,
        "staging_path": str(staged.path) if staged.path is not None else None,
        "n_rows": batch.n_rows,
        "n_bytes": staged.n_bytes,
        "sha256": staged.sha256,
        "state": models.BatchState.COMMITTED,
        "committed_at": fence.clock(),
        "forwards": encode_forwards(batch.forwards),
        **values,
    }


def encode_forwards(forwards: Mapping[str, Sequence[int]]) -> str | None:
    """The forward passes of a batch as the ledger keeps them: JSON ``[[pass id, [[first id,
    count], ...]], ...]``, each pass's ids in its order as runs of consecutive ids (a claim's
    block is one run); None when not recorded."""
    if not forwards:
        return None
    encoded = []
    for seq, ids in forwards.items():
        runs: list[list[int]] = []
        for i in ids:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1][1] += 1
            else:
                runs.append([int(i), 1])
        encoded.append([str(seq), runs])
    return json.dumps(encoded, separators=(",", ":"))


def decode_forwards(text: str | None) -> dict[str, list[int]]:
    """What :func:`encode_forwards` wrote (empty for None), in its order."""
    if not text:
        return {}
    return {
        str(seq): [first + k for first, n in runs for k in range(n)]
        for seq, runs in json.loads(text)
    }


_INSERT = _B.insert()
_MARK_PUBLISHED = (
    _B.update()
    .where(
        _B.c.batch_id.in_(sa.bindparam("b_ids", expanding=True)),
        _B.c.state == models.BatchState.COMMITTED,
    )
    .values(state=models.BatchState.PUBLISHED, published_at=sa.bindparam("b_now"))
)


def insert(conn: Connection, values: Mapping[str, Any]) -> None:
    # The values as parameters of one INSERT built once, not built into a new statement
    # each batch: 47 against 240-280 us of CPU a batch on SQLite (its cache key rebuilt).
    conn.execute(_INSERT, dict(values))


def row(conn: Connection, batch_id: str) -> Row[Any] | None:
    """The ledger row of ``batch_id``, or None."""
    return conn.execute(_B.select().where(_B.c.batch_id == batch_id)).first()


def mark_published(conn: Connection, batch_ids: Sequence[str], now: float) -> int:
    """``committed`` -> ``published`` for ``batch_ids``; returns rows changed."""
    if not batch_ids:
        return 0
    binds = {"b_ids": list(batch_ids), "b_now": now}
    return int(conn.execute(_MARK_PUBLISHED, binds).rowcount)


def committed(conn: Connection, owns: sa.ColumnElement[bool]) -> list[Row[Any]]:
    """The ``committed`` rows ``owns`` selects, oldest first (the order to roll forward)."""
    q = _B.select().where(owns, _B.c.state == models.BatchState.COMMITTED)
    return list(conn.execute(q.order_by(_B.c.committed_at, _B.c.seq, _B.c.batch_id)))


def states(conn: Connection, batch_ids: Collection[str]) -> dict[str, str]:
    """The state of each of ``batch_ids`` that has a ledger row."""
    found: dict[str, str] = {}
    ids = list(batch_ids)
    for start in range(0, len(ids), 500):
        q = sa.select(_B.c.batch_id, _B.c.state).where(_B.c.batch_id.in_(ids[start : start + 500]))
        found.update({str(r.batch_id): str(r.state) for r in conn.execute(q)})
    return found


def supersede(
    conn: Connection,
    fence: ports.Fence,
    old_id: str,
    new_id: str | None,
    keys: Sequence[str],
) -> bool:
    """Mark ``old_id`` superseded if it is still live, pointing the done items of ``keys`` at
    ``new_id``; False (nothing changed) when it is not: another repair got there first."""
    live = _B.c.state.in_(models.LIVE_BATCH_STATES)
    won = conn.execute(
        _B.update().where(_B.c.batch_id == old_id, live).values(state=models.BatchState.SUPERSEDED)
    ).rowcount
    if won:
        _drop_outbox(conn, old_id)
    if won and new_id is not None:
        fence.rebatch(conn, old_id, new_id, keys)
    return bool(won)


def retire(conn: Connection, batch_id: str) -> None:
    """Mark a batch ``quarantined``: its output was lost or corrupt, its items requeued."""
    conn.execute(
        _B.update().where(_B.c.batch_id == batch_id).values(state=models.BatchState.QUARANTINED)
    )
    _drop_outbox(conn, batch_id)


def _drop_outbox(conn: Connection, batch_id: str) -> None:
    # A batch no longer live is never rolled forward: rows it left in the outbox (a repair
    # of a batch still committed) would stay there for good.
    conn.execute(schema.outbox.delete().where(schema.outbox.c.batch_id == batch_id))


def set_rows(conn: Connection, batch_id: str, n_rows: int) -> None:
    """A live batch now holds ``n_rows`` rows (a repair removed the rest); superseded at 0."""
    values: dict[str, Any] = {"n_rows": n_rows}
    if n_rows == 0:
        values["state"] = models.BatchState.SUPERSEDED
    live = _B.c.state.in_(models.LIVE_BATCH_STATES)
    conn.execute(_B.update().where(_B.c.batch_id == batch_id, live).values(**values))
