"""Bulk scoring in place: a run's input dataset and its shards in the queue
(:mod:`batching.ingress.shards`), the output rows of a scored shard, and the guard that keeps
plain scoring off a queue of shards. The scorer is :mod:`batching.compose.shard_scorer`.

Every input row gets exactly one output row, keyed by ``(input_file, input_row)``: its
``output``, or, when the model refused that row alone (the runner bisects a failing batch),
no output and its ``error``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa

from batching import config as cfg
from batching import errors, models, naming
from batching.compose import build
from batching.evidence import lineage
from batching.ingress import queue as q
from batching.ingress import shards
from batching.model import rows as rows_
from batching.store import schema

logger = logging.getLogger(__name__)

OUTPUT_FIELDS: tuple[tuple[str, str], ...] = (
    ("item_key", "string"),
    ("input_file", "string"),
    ("input_row", "int64"),
    ("input_key", "string"),
    ("output", "fixed_size_list<float>"),
    ("error", "string"),
    ("scored_at", "timestamp[us, tz=UTC]"),
    ("run_id", "string"),
    ("batch_id", "string"),
    ("queue", "string"),
    ("tenant", "string"),
)
"""The columns of an in-place output file (``input_key`` only when the input has
``item_key``)."""


def shard_table(
    shard: shards.Shard,
    item: models.WorkItem,
    scored: rows_.Scored,
    input_keys: pa.ChunkedArray | None,
    batch: tuple[str, str, float],
) -> pa.Table:
    """The output rows of a scored shard (:data:`OUTPUT_FIELDS`); ``batch``: (batch id, run
    id, scored at)."""
    batch_id, run_id, scored_at = batch
    n, dim = scored.matrix.shape
    values = pa.array(scored.matrix.reshape(-1), pa.float32())
    mask = pa.array([e is not None for e in scored.errors]) if scored.n_failed else None
    output = pa.FixedSizeListArray.from_arrays(values, dim, mask=mask)
    cols: dict[str, object] = {
        "item_key": pa.repeat(pa.scalar(item.item_key), n),
        "input_file": pa.repeat(pa.scalar(shard.relpath), n),
        "input_row": pa.array(np.arange(shard.first_row, shard.first_row + n, dtype=np.int64)),
    }
    if input_keys is not None:
        cols["input_key"] = pc.cast(input_keys, pa.string())
    cols |= {
        "output": output,
        "error": pa.array(scored.errors, pa.string()),
        "scored_at": pa.repeat(pa.scalar(round(scored_at * 1e6), pa.timestamp("us", tz="UTC")), n),
        "run_id": pa.repeat(pa.scalar(run_id), n),
        "batch_id": pa.repeat(pa.scalar(batch_id), n),
        "queue": pa.repeat(pa.scalar(item.queue), n),
        "tenant": pa.repeat(pa.scalar(item.tenant), n),
    }
    return pa.table(cols)


@dataclass(frozen=True, slots=True)
class InPlace:
    """A run of ``bulk --in-place``: the input dataset it scores, when the caller planned it
    (its version: :attr:`shards.Plan.version`), for the run's lineage."""

    dataset: lineage.DatasetRef | None = None
    plan: shards.Plan | None = None  # what was planned: whose rows are left after a run

    @classmethod
    def of(cls, found: shards.Plan) -> InPlace:
        """The input dataset of a plan, named by its path: the file, folder or table given."""
        ns, name = naming.file_dataset_id(found.source)
        ref = lineage.DatasetRef(
            ns, name, (("payload", found.payload_type),), version=found.version
        )
        return cls(ref, found)

    def read(self, ctx: lineage.RunContext, rows: int) -> lineage.RunContext:
        """``ctx`` with the input dataset's statistics: the rows this run read (scored or
        refused), not the dataset's (OpenLineage's inputStatistics are what a run read; every
        run reported the whole dataset, a rerun that read nothing included). The bytes read
        are not known: a shard is read by its row groups."""
        if self.dataset is None:
            return ctx
        mine = (self.dataset.namespace, self.dataset.name)
        inputs = tuple(
            d.with_stats(rows) if (d.namespace, d.name) == mine else d for d in ctx.inputs
        )
        return replace(ctx, inputs=inputs)

    def context(self, ctx: lineage.RunContext) -> lineage.RunContext:
        """The run's lineage: the input dataset beside the queue, the output's own columns."""
        out = replace(ctx.outputs[0], fields=OUTPUT_FIELDS, columns=(), row_inputs=())
        inputs = ctx.inputs + ((self.dataset,) if self.dataset is not None else ())
        return replace(ctx, inputs=inputs, outputs=(out, *ctx.outputs[1:]))


def refuse_before_queueing(
    config: cfg.PipelineConfig, db_url: str | None, output: str | None
) -> None:
    """What would refuse the scoring run, checked before any shard is queued (a refused
    ``bulk --in-place`` queued its shards first and left them behind): the database and the
    output folder (``build.checked``), the pinned checkpoint's digest (read, not loaded) and
    the service profile.

    Raises:
        ConfigError, CheckpointError: naming the input and the fix; nothing is queued.
    """
    from batching.model import zoo

    build.checked(config, db_url, output)
    spec = config.model
    path = zoo.checkpoint_path(spec.name, spec.checkpoint, Path(config.base_dir))
    zoo.read_pinned(path, spec.sha256)
    build.load_profile(config)


def enqueue_shards(
    config: cfg.PipelineConfig,
    db_url: str,
    source: str | Path,
    rows_per_shard: int = shards.ROWS_PER_SHARD,
    tenant: str = "default",
    on_bytes: Callable[[int, int], None] | None = None,
) -> tuple[shards.Plan, models.EnqueueResult]:
    """Plan ``source`` into shards and enqueue those the queue has not seen (idempotent);
    ``on_bytes(hashed, total)`` follows the files' fingerprinting.

    Raises:
        InputError: the input is unreadable, or a file changed since its shards were queued.
        ConfigError: the output is not a Parquet dataset (shards commit as Parquet files).
        QueueError, QueueFull: the database failed or the queue is at its cap (nothing queued).
    """
    if config.output.kind != "parquet":
        raise errors.ConfigError(
            f"bulk --in-place writes a Parquet dataset; output.kind is {config.output.kind!r}: "
            "give in-place runs a config with output.kind: parquet (the folder: output.path or --output)"
        )
    found = shards.plan(source, rows_per_shard, on_bytes)
    _refuse_other_width(config, found)
    queue = build.open_queue(config, db_url)
    try:
        queue.check_schema()
        with queue.engine.connect() as conn:
            refuse_changed(conn, queue.queue, found)
            _refuse_scored_by_another_version(conn, queue.queue, found, config.model.version)
        result = queue.enqueue(shards.records(found.shards, tenant))
    finally:
        queue.engine.dispose()
    return found, result


def _refuse_other_width(config: cfg.PipelineConfig, found: shards.Plan) -> None:
    """Refuse rows of another length than the model takes: each shard would fail whole, after
    every retry and its backoff, across several runs (found by a review)."""
    from batching.model import zoo

    if found.payload_width is None:
        return
    info = zoo.shape_of(config.model.name)
    if info is None or info.input_kind != "dense" or info.input_dim in (None, found.payload_width):
        return
    raise errors.InputError(
        f"{found.source}: payload rows hold {found.payload_width} numbers and model "
        f"{config.model.name!r} takes {info.input_dim}; give it the dataset it scores, or a "
        "config whose model takes these rows"
    )


@dataclass(frozen=True)
class Left:
    """The rows of a plan without output after a run, by why: their shard is dead, ready
    (waiting out a retry backoff, or not reached), leased (by a scorer, a dead one's until
    ``lease_until``) or cancelled by an operator. A shard split in two is its halves."""

    dead: int = 0
    ready: int = 0
    leased: int = 0
    cancelled: int = 0
    lease_until: float | None = None

    @property
    def rows(self) -> int:
        return self.dead + self.ready + self.leased + self.cancelled

    def describe(self, total: int, queue: str) -> str:
        """One line: how many of ``total`` rows have no output yet, by why, and what to do."""
        parts = []
        if self.leased:
            until = datetime.datetime.fromtimestamp(self.lease_until or 0, datetime.UTC)
            parts.append(
                f"{self.leased:,} in shards leased by a scorer until {until:%H:%M:%S} UTC (a "
                "dead scorer's come back then: run again after it)"
            )
        if self.dead:
            parts.append(
                f"{self.dead:,} in dead shards (`batching status -c CONFIG` and the run's log "
                "say why; once the input is as planned, `batching redrive -c CONFIG --reason "
                "...` and another run score them)"
            )
        if self.ready:
            parts.append(
                f"{self.ready:,} in shards waiting out a retry backoff or not reached (run again)"
            )
        if self.cancelled:
            parts.append(
                f"{self.cancelled:,} in shards an operator cancelled (`batching queue audit "
                f"{queue}`)"
            )
        return f"{self.rows:,} of {total:,} input rows have no output yet: {'; '.join(parts)}"


def left_of(config: cfg.PipelineConfig, db_url: str, found: shards.Plan) -> Left:
    """What of ``found`` has no output yet in the config's queue (:class:`Left`)."""
    queue = build.open_queue(config, db_url)
    try:
        with queue.read() as conn:
            mine = _plan_items(conn, queue.queue, found)
            spans = conn.execute(
                sa.select(
                    schema.ranges.c.lo, schema.ranges.c.hi, schema.ranges.c.lease_expires_at
                ).where(schema.ranges.c.queue == queue.queue)
            ).all()
    finally:
        queue.engine.dispose()
    counts = dict.fromkeys(("dead", "ready", "leased", "cancelled"), 0)
    until: list[float] = []
    for row in mine:
        held = [at for lo, hi, at in spans if lo <= row.id <= hi]  # a range lease: still ready
        state = models.State(row.state)
        if held or state is models.State.LEASED:
            counts["leased"] += row.cost
            until.append(held[0] if held else row.lease_expires_at)
        elif state in (models.State.DEAD, models.State.EXPIRED):
            counts["dead"] += row.cost
        elif state is models.State.READY:
            counts["ready"] += row.cost
        elif state is models.State.CANCELLED and not (row.last_error or "").startswith("split"):
            counts["cancelled"] += row.cost
    return Left(**counts, lease_until=max(until) if until else None)


def _plan_items(conn: sa.Connection, queue: str, found: shards.Plan) -> list[Any]:
    """The queue's items of ``found``'s shards, their split halves included."""
    t = schema.items
    roots = {s.key for s in found.shards}
    found_rows = conn.execute(
        sa.select(
            t.c.id,
            t.c.item_key,
            t.c.state,
            t.c.cost,
            t.c.lease_expires_at,
            t.c.last_error,
            t.c.batch_id,
        ).where(t.c.queue == queue, t.c.lane == shards.LANE)
    ).all()
    return [r for r in found_rows if _root(r.item_key) in roots]


def _root(key: str) -> str:
    """The planned shard a key is, or is a split half of (``<parent>/0/1...``)."""
    head, _, groups = key.rpartition(":")
    return f"{head}:{groups.split('/', 1)[0]}"


def _refuse_scored_by_another_version(
    conn: sa.Connection, queue: str, found: shards.Plan, version: str
) -> None:
    """Refuse to plan a dataset whose shards another model version scored in this queue: the
    shard keys name the input, not the version, so a run with a new version found them all
    "already queued", scored nothing and exited 0 (found by a review)."""
    done = [
        r.batch_id
        for r in _plan_items(conn, queue, found)
        if r.state == int(models.State.DONE) and r.batch_id
    ]
    b = schema.batches
    others: set[str] = set()
    for i in range(0, len(done), 500):
        chunk = done[i : i + 500]
        found_versions = sa.select(b.c.model_version).where(b.c.batch_id.in_(chunk)).distinct()
        others.update(v for v in conn.execute(found_versions).scalars() if v != version)
    if others:
        raise errors.InputError(
            f"{found.source}: queue {queue!r} holds shards of this dataset scored by model "
            f"version(s) {', '.join(map(repr, sorted(others)))}; a queue scores a dataset once, "
            f"so score it with {version!r} into a queue (queue.name) and output of its own"
        )


def refuse_changed(conn: sa.Connection, queue: str, found: shards.Plan) -> None:
    """Refuse a plan whose rows the queue already holds in other shards: each would be scored
    twice, and every shard (its own key) would still reconcile clean. That is a file queued
    under another fingerprint (it changed), the same file (fingerprint) queued under another
    name (given once through its folder, once as a file), or the same file cut into other
    row groups (another ``--rows-per-shard``).

    Raises:
        InputError: naming the file, what the queue holds of it, and what to do.
    """
    t = schema.items
    q = sa.select(t.c.item_key).where(
        t.c.queue == queue,
        t.c.lane == shards.LANE,
        t.c.item_key.startswith(shards.KEY_PREFIX, autoescape=True),
    )
    queued: dict[tuple[str, str], set[str]] = {}  # (relpath, digest) -> row-group ranges
    for (key,) in conn.execute(q):
        rel, digest, cut = _parts(key)
        queued.setdefault((rel, digest), set()).add(cut)
    if not queued:
        return
    names: dict[str, set[str]] = {}  # fingerprint -> the names it is queued under
    for rel, digest in queued:
        names.setdefault(digest, set()).add(rel)
    digests = {rel: digest for rel, digest in queued}
    planned: dict[tuple[str, str], set[str]] = {}
    for shard in found.shards:
        rel, digest, cut = _parts(shard.key)
        planned.setdefault((rel, digest), set()).add(cut)
    planned_names = {rel for rel, _ in planned}
    for (rel, digest), groups in sorted(planned.items()):
        path = found.root / rel
        if rel in digests and digests[rel] != digest:
            raise errors.InputError(
                f"{path}: the queue holds shards of {rel!r} with other contents (sha256 "
                f"{digests[rel]}... then, {digest}... now): the file changed since, or this "
                "is another dataset with a file of that name; write changed data under a new "
                "file name, or score another dataset into another queue"
            )
        # The same bytes under another name: the input given through another folder, unless
        # the name it is queued under is in this input too (an identical copy beside it,
        # which a first run takes as two files: a later one must as well).
        if digest in names and rel not in names[digest] and not names[digest] & planned_names:
            raise errors.InputError(
                f"{path}: the same file (sha256 {digest}...) is queued as "
                f"{', '.join(map(repr, sorted(names[digest])))}; "
                "give the input as it was given then (the same folder or file), or score it "
                "into another queue"
            )
        held = queued.get((rel, digest))
        if held is not None and held != groups:
            raise errors.InputError(
                f"{path}: its shards are queued cut into other row groups ({len(held)} "
                f"shard(s), {len(groups)} now); rerun with the --rows-per-shard of that run, "
                "or score it into another queue"
            )


def _parts(key: str) -> tuple[str, str, str]:
    """(relpath, fingerprint, row groups) of a shard key; a split shard's are its parent's."""
    rel, _, rest = key.removeprefix(shards.KEY_PREFIX).rpartition("@")
    digest, _, groups = rest.partition(":")
    return rel, digest, groups.split("/", 1)[0]


def refuse_shards(queue: q.SqlQueue) -> None:
    """A plain scoring run refuses a queue holding input shards: it would fail each one as a
    payload the model cannot read.

    Raises:
        ConfigError: naming the queue and the command that scores shards.
    """
    t = schema.items
    found = sa.select(t.c.id).where(
        t.c.queue == queue.queue, t.c.lane == shards.LANE, t.c.state == int(models.State.READY)
    )
    with queue.read() as conn:  # database errors as the queue's (a raw one read as a bug)
        if conn.execute(found.limit(1)).first() is not None:
            raise errors.ConfigError(
                f"queue {queue.queue!r} holds input shards (lane 'shard'); score them with "
                "`batching bulk --in-place`, and give plain items another queue"
            )
