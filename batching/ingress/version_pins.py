"""What each model version of a queue was when it first scored (migration 18).

Outputs are keyed by model version: its Parquet partition, the SQL sink's key, the ledger,
lineage. A version's name is therefore a promise about what scored the rows under it. A config
edit can keep the name and break the promise: another checkpoint under the old name, or the
same weights in another dtype (a promoted candidate copied into ``model`` without its
``dtype`` line scored fp32 items labelled with a bf16 version). Nothing downstream could tell.

So the first time a version runs for a queue, its identity (the model's name or factory, the
checkpoint's sha256, the dtype, the autocast setting) is pinned in ``batching_model_versions``,
and once outputs are committed under it, a run, or a routed batch, whose config gives the name
another identity is refused before it claims, naming what changed and the fix (a new version
name). Before the first commit the pin follows the config: nothing is labelled yet. ``batching check`` reports the same at plan time, read-only. The device is not part of
the identity: the same weights on a CPU or a GPU are the same version.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from batching import errors
from batching.store import retention, schema

if TYPE_CHECKING:
    from batching.config import ModelSpec

IDENTITY = ("name", "sha256", "dtype", "autocast")
"""The settings of a ``ModelSpec`` that decide what its outputs are."""

_P = schema.model_versions


def identity(spec: ModelSpec) -> dict[str, str]:
    """``spec``'s identity: the settings that decide its outputs."""
    return {key: str(getattr(spec, key)) for key in IDENTITY}


def pin(engine: Engine, queue: str, spec: ModelSpec, *, run_id: str, now: float) -> None:
    """Pin ``spec``'s identity as its version's for ``queue``, unless one is pinned already
    that outputs were committed under; a pin nothing was committed under (a run that found
    the queue empty, a config fixed before its first batch) moves to ``spec``.

    Raises:
        CheckpointError: the version is pinned with another identity and has outputs.
    """
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert  # type: ignore[assignment]
        mine = {"first_run_id": run_id, "first_at": now, **identity(spec)}
        new = conn.execute(  # a row back when inserted (rowcount: -1 on psycopg)
            insert(_P)
            .values(queue=queue, version=spec.version, **mine)
            .on_conflict_do_nothing(index_elements=["queue", "version"])
            .returning(_P.c.version)
        ).first()
        where = (_P.c.queue == queue, _P.c.version == spec.version)
        if new is not None and (earlier := _history(conn, queue, spec)) is not None:
            conn.execute(sa.update(_P).where(*where).values(**earlier))
        row = conn.execute(sa.select(_P).where(*where)).one()
        problem = _differs(queue, spec, row._mapping)
        if problem is not None and not _committed(conn, queue, spec.version, row.first_at):
            conn.execute(sa.update(_P).where(*where).values(**mine))
            return
    if problem is not None:
        raise errors.CheckpointError(problem)


def conflicts(conn: Connection, queue: str, specs: Mapping[str, ModelSpec]) -> list[str]:
    """One message for each of ``specs`` (by version) that ``queue`` pinned with another
    identity and committed outputs under; read-only (``batching check``)."""
    rows = conn.execute(
        sa.select(_P).where(_P.c.queue == queue, _P.c.version.in_(sorted(specs)))
    ).all()
    pins: dict[str, Mapping[Any, Any]] = {row.version: row._mapping for row in rows}
    for version in sorted(set(specs) - set(pins)):  # an upgraded queue's history, if any
        if (earlier := _history(conn, queue, specs[version])) is not None:
            pins[version] = earlier
    found = [(version, _differs(queue, specs[version], pin)) for version, pin in pins.items()]
    return [
        problem
        for version, problem in found
        if problem is not None and _committed(conn, queue, version, pins[version]["first_at"])
    ]


def _history(conn: Connection, queue: str, spec: ModelSpec) -> dict[str, Any] | None:
    """``spec``'s version as the run ledger knew it before the pins (a queue upgraded from
    schema 17 or older, with outputs under the version): the checkpoint sha256 of the LATEST
    run of that version that committed a batch of it, the rest of the identity taken from
    ``spec`` (the ledger kept no more). None when no such run is recorded. Without it the
    first run after the upgrade pinned whatever weights it brought, and refused the ones that
    had scored the rows (an upgrade review). The latest, not the first: before the pins a
    name could change weights, and the earliest would refuse the weights in production the
    moment after the upgrade. A rollout candidate's runs are not in the ledger by version
    (a run records its stable version), so a candidate's first pin is its config's."""
    r, b = schema.runs, schema.batches
    earliest = (
        sa.select(r.c.model_sha256, r.c.run_id, r.c.started_at)
        .where(
            r.c.queue == queue,
            r.c.model_version == spec.version,  # a rollout run's candidate batches: not its
            r.c.model_sha256.is_not(None),
            sa.exists().where(b.c.run_id == r.c.run_id, b.c.model_version == spec.version),
        )
        .order_by(r.c.started_at.desc())
        .limit(1)
    )
    found = conn.execute(earliest).first()
    if found is None:
        return None
    sha256, run_id, started_at = found
    return identity(spec) | {"sha256": sha256, "first_run_id": run_id, "first_at": started_at}


def _committed(conn: Connection, queue: str, version: str, first_at: Any) -> bool:
    """Whether the ledger holds a batch of ``version`` for ``queue`` (read only when an
    identity differs: the ledger has no index by version), or the version was pinned before
    the ledger's horizon (its batches' rows may be ones retention purged)."""
    at = retention.horizon(conn, queue)
    if at is not None and float(first_at) < at:
        return True
    b = schema.batches
    found = sa.select(b.c.batch_id).where(b.c.queue == queue, b.c.model_version == version)
    return conn.execute(found.limit(1)).first() is not None


def _differs(queue: str, spec: ModelSpec, pinned: Mapping[Any, Any]) -> str | None:
    now = identity(spec)
    changed = [key for key in IDENTITY if str(pinned[key]) != now[key]]
    if not changed:
        return None
    then = ", ".join(f"{key} {_short(key, pinned[key])}" for key in changed)
    given = ", ".join(f"{key} {_short(key, now[key])}" for key in changed)
    when = datetime.datetime.fromtimestamp(float(str(pinned["first_at"])), datetime.UTC)
    return (
        f"model version {spec.version!r} of queue {queue!r} first scored with {then} (run "
        f"{pinned['first_run_id']}, {when:%Y-%m-%d %H:%M} UTC), and this config gives it "
        f"{given}: outputs are keyed by version, so these settings need a version name of "
        "their own (a new `version` in model or model_versions)"
    )


def _short(key: str, value: object) -> str:
    text = str(value)
    return f"{text[:12]}..." if key == "sha256" else text
