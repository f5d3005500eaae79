"""Replay: score again exactly the items a past run committed, in the forward passes it scored
them in (the ledger records who was in each: ``batches.forwards``), with the version each was
scored by (or another), into a side dataset; then diff against what the run committed.

With the same checkpoint on the same device, a pass of the same members gives the same bits
on CPU: the diff then counts every item identical. Another version, device or dtype gives a
drift report instead (mean and max absolute difference). An item purged since the run (or
whose key was enqueued again, which is a new item) is named and skipped; a batch committed
before its passes were recorded (before schema 15) is replayed as one pass, and said so.

The replay is a lineage run of the job ``<config name>.replay``, with the original run's
outputs as its input, the side dataset as its output, and a ``batching_replay`` facet naming
the original run and the result.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from batching import config as cfg
from batching import errors, models, naming
from batching.compose import build, versions
from batching.evidence import lineage
from batching.ingress import queue as q
from batching.ingress import shards
from batching.loop.stages import INEXACT
from batching.outputs import ledger, outbox, registry
from batching.store import retention, schema

SKIPPED_SHOWN = 20  # purged keys named in the report (all are counted)
_B = schema.batches


@dataclass
class Report:
    """What a replay did and found."""

    run_id: str
    replay_run_id: str
    output: str
    model_versions: dict[str, int] = field(default_factory=dict)  # items replayed by each
    batches: int = 0
    passes: int = 0
    passes_unrecorded: int = 0  # batches without recorded passes, replayed as one pass each
    items: int = 0
    identical: int = 0
    differing: int = 0
    inexact: int = 0  # items of passes the runner split or that failed items (no bit promise)
    differing_inexact: int = 0  # of the differing, those
    max_abs_diff: float = 0.0
    sum_abs_diff: float = 0.0
    skipped: int = 0
    skipped_keys: list[str] = field(default_factory=list)

    @property
    def mean_abs_diff(self) -> float:
        return self.sum_abs_diff / self.items if self.items else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "replay_run_id": self.replay_run_id,
            "output": self.output,
            "model_versions": self.model_versions,
            "batches": self.batches,
            "passes": self.passes,
            "passes_unrecorded": self.passes_unrecorded,
            "items": self.items,
            "identical": self.identical,
            "differing": self.differing,
            "inexact": self.inexact,
            "differing_inexact": self.differing_inexact,
            "mean_abs_diff": self.mean_abs_diff,
            "max_abs_diff": self.max_abs_diff,
            "skipped": self.skipped,
            "skipped_keys": self.skipped_keys,
        }


def _check_side_folder(output: Path, target: registry.Target) -> None:
    """Refuse an ``output`` that is a file, or that is, holds or lies in the config's own
    output folder (a Parquet dataset: its replay files would be published beside the real
    ones)."""
    if output.exists() and not output.is_dir():
        raise errors.InputError(f"--output {output} is a file; give a folder for the replay")
    root = registry.kind_of(target).local_folder(target)
    if root is not None and build.overlaps(output, root):
        raise errors.InputError(
            f"--output {output} overlaps the config's output dataset {root}; replay writes a "
            "side dataset that is never published: give a folder outside it"
        )


def replay(
    config: cfg.PipelineConfig,
    db_url: str | None,
    run_id: str,
    *,
    output: Path,
    model_version: str | None = None,
    dataset: str | None = None,
) -> Report:
    """Replay ``run_id`` into ``output``
    (``<output>/run=<run_id>/replay=<replay run id>/part-<n>.parquet``).

    Raises:
        InputError: the run committed nothing in this queue, or ``model_version`` is not in
            the registry.
        CheckpointError: a version's checkpoint is not the pinned one.
    """
    if model_version is not None and model_version not in config.registry():
        raise errors.InputError(
            f"--model-version {model_version!r} is not in the config's registry (it lists "
            f"{', '.join(sorted(config.registry()))})"
        )
    res = build.resolve(config, db_url, dataset)
    _check_side_folder(output, res.target)
    queue = build.open_queue(config, res.db_url)
    try:
        queue.check_schema()
        with queue.read() as conn:
            rows = _run_batches(conn, queue.queue, run_id)
            if not rows:
                at = retention.horizon(conn, queue.queue)
                kept = "" if at is None else f" since {retention.day(at)} (`purge --ledger`)"
                raise errors.InputError(
                    f"run {run_id} committed no batch in queue {queue.queue!r} of "
                    f"{queue.url}{kept}; check the run id (`batching status`, the lineage log)"
                )
            if _scored_in_place(conn, rows):
                raise errors.InputError(
                    f"run {run_id} scored input shards in place (`batching bulk --in-place`), "
                    "whose rows are not queue items: replay scores queue items only; to score "
                    "the dataset again, run `batching bulk --in-place` with another queue.name "
                    "and output"
                )
            originals = {r.batch_id: _original_rows(conn, r, res.target) for r in rows}
            threads = _cpu_threads(conn, {r.run_id for r in rows})
        report = Report(run_id, lineage.new_run_id(), str(output))
        target = output / f"run={run_id}" / f"replay={report.replay_run_id}"
        target.mkdir(parents=True, exist_ok=True)
        models_ = versions.ModelSet(
            config, hint="or replay with --model-version and a version it lists"
        )
        emitter = build.make_emitter(config, res, engine=queue.engine)
        ctx = _context(config, res, report, target)
        emitter.start(ctx)
        try:
            passes = _passes(queue, rows, originals, report)
            from batching.model.runner import torch_threads  # torch: only when it replays

            with torch_threads(threads):
                for n, (pass_id, version, items, original) in enumerate(passes):
                    version = model_version or version
                    runner = models_(version)
                    scored = runner.forward(runner.decode(items))
                    differing = report.differing
                    _compare(items, scored.outputs, original, report)
                    if pass_id.endswith(INEXACT):
                        report.inexact += len(items)
                        report.differing_inexact += report.differing - differing
                    _write(target / f"part-{n:06d}.parquet", items, scored.outputs, version)
                    count = report.model_versions.get(version, 0) + len(items)
                    report.model_versions[version] = count
            emitter.complete(_context(config, res, report, target))
        except BaseException as exc:
            emitter.fail(ctx, exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            raise
        finally:
            emitter.close()
    finally:
        queue.engine.dispose()
    return report


def _cpu_threads(conn: Connection, run_ids: set[str]) -> int | None:
    """The CPU threads the runs that committed the batches scored with (``score --workers``
    gives each worker its share of the cores), when they recorded it and agree."""
    r = schema.runs
    found = conn.execute(sa.select(r.c.summary).where(r.c.run_id.in_(sorted(run_ids)))).scalars()
    threads = {json.loads(s).get("cpu_threads") for s in found if s}
    return threads.pop() if len(threads) == 1 else None


def _run_batches(conn: Connection, queue: str, run_id: str) -> list[Any]:
    """The live batches of ``run_id`` and of its workers (``score --workers``), in commit
    order."""
    workers = sa.select(schema.runs.c.run_id).where(schema.runs.c.parent_run_id == run_id)
    runs = [run_id, *conn.execute(workers).scalars()]
    live = [str(s) for s in models.LIVE_BATCH_STATES]
    stmt = (
        sa.select(_B)
        .where(_B.c.run_id.in_(runs), _B.c.queue == queue, _B.c.state.in_(live))
        .order_by(_B.c.committed_at, _B.c.batch_id)
    )
    return list(conn.execute(stmt))


def _scored_in_place(conn: Connection, rows: Sequence[Any]) -> bool:
    """Whether the batches ``rows`` committed input shards (``bulk --in-place``)."""
    t = schema.items
    ids = [r.batch_id for r in rows[:500]]  # a run scores shards or items, never both
    found = sa.select(t.c.id).where(t.c.batch_id.in_(ids), t.c.lane == shards.LANE).limit(1)
    return conn.execute(found).first() is not None


def _original_rows(
    conn: Connection, row: Any, target: registry.Target
) -> dict[str, np.ndarray[Any, Any]]:
    """What the run committed in batch ``row``, by key, read as a reader of the output would
    (a batch not rolled forward yet: from the outbox, where it waits)."""
    body = conn.execute(
        sa.select(schema.outbox.c.body).where(schema.outbox.c.batch_id == row.batch_id)
    ).scalar()
    if body is not None:
        table = outbox.decode(bytes(body))
    elif row.sink == "parquet":
        root = Path(target.where).resolve()
        path = (root / str(row.path)).resolve()
        if root not in path.parents:
            raise errors.SinkError(f"batch {row.batch_id}: ledger path outside the dataset")
        if not path.is_file() and row.staging_path:
            path = Path(row.staging_path)
        if not path.is_file():
            raise errors.SinkError(
                f"batch {row.batch_id}'s output file {row.path} is not in the dataset {root}: "
                "if the run wrote to another folder (`score --output`), give it with "
                "--dataset; if the file was removed, `batching reconcile` reports it"
            )
        table = pq.read_table(path, columns=["item_key", "output"])
    elif row.sink == "sql":
        results = schema.results_table(str(row.path))
        stmt = sa.select(results.c.item_key, results.c.output, results.c.output_dim).where(
            results.c.batch_id == row.batch_id
        )
        if target.url is None:  # in the queue's database
            found = conn.execute(stmt).all()
        else:  # a warehouse of its own
            from batching.store import database

            other = database.create_engine(target.url)
            with other.connect() as c:
                found = c.execute(stmt).all()
            other.dispose()
        return {k: np.frombuffer(bytes(o), np.float32) for k, o, _ in found}
    elif row.sink == "delta":
        from batching.outputs import delta

        sql = f"SELECT item_key, output FROM t WHERE batch_id = {delta.sql_literal(row.batch_id)}"
        table = delta.DeltaSink.read(
            str(row.path or target.where), sql, storage_options=target.storage_options
        )
    else:
        raise errors.SinkError(f"batch {row.batch_id}: unknown sink {row.sink!r} in the ledger")
    keys = table.column("item_key").to_pylist()
    outs = table.column("output").to_pylist()
    return {k: np.asarray(o, np.float32) for k, o in zip(keys, outs, strict=True)}


def _passes(
    queue: q.SqlQueue,
    rows: Sequence[Any],
    originals: dict[str, dict[str, np.ndarray[Any, Any]]],
    report: Report,
) -> Any:
    """``(version, items, originals by key)`` per forward pass of the run, in the order the
    passes first committed: a pass's members gathered from every batch that committed some
    of them (a pass can span two leases' commits)."""
    passes: dict[str, list[int]] = {}  # pass id -> ids; "" + batch id: a batch unrecorded
    version_of: dict[str, str] = {}
    unrecorded: dict[str, str] = {}  # such a pass -> its batch
    for row in rows:
        report.batches += 1
        recorded = ledger.decode_forwards(row.forwards)
        if not recorded:  # before schema 15: the whole batch as one pass, ids unknown yet
            report.passes_unrecorded += 1
            recorded = {f":{row.batch_id}": []}
            unrecorded[f":{row.batch_id}"] = row.batch_id
        for pass_id, ids in recorded.items():
            passes.setdefault(pass_id, []).extend(ids)  # (split passes keep their mark)
            version_of[pass_id] = str(row.model_version)
    keys_of: dict[str, np.ndarray[Any, Any]] = {}
    for row in rows:
        keys_of.update(originals[row.batch_id])
    all_ids = [i for ids in passes.values() for i in ids]
    found = queue.committed_items(all_ids)
    seen_keys: set[str] = set()
    for pass_id, ids in passes.items():
        if pass_id in unrecorded:  # the batch's items: the done items it committed
            items = _items_of_batch(queue, unrecorded[pass_id])
        else:
            items = [found[i] for i in ids if i in found]
        items = [i for i in items if i.item_key in keys_of]
        if not items:
            continue
        seen_keys.update(i.item_key for i in items)
        report.passes += 1
        yield pass_id, version_of[pass_id], tuple(items), {i.id: keys_of[i.item_key] for i in items}
    missing = sorted(set(keys_of) - seen_keys)
    report.skipped = len(missing)
    report.skipped_keys = missing[:SKIPPED_SHOWN]


def _items_of_batch(queue: q.SqlQueue, batch_id: str) -> list[models.WorkItem]:
    t = schema.items
    with queue.read() as conn:
        stmt = sa.select(t.c.id).where(t.c.queue == queue.queue, t.c.batch_id == batch_id)
        ids = [int(i) for i in conn.execute(stmt).scalars()]
    found = queue.committed_items(ids)
    return [found[i] for i in sorted(found)]


def _compare(
    items: Sequence[models.WorkItem],
    outputs: Any,
    original: dict[int, np.ndarray[Any, Any]],
    report: Report,
) -> None:
    for item in items:
        if item.id not in outputs:  # failed now: counted as differing, worst case
            report.items += 1
            report.differing += 1
            continue
        new = np.asarray(outputs[item.id], np.float32)
        old = original[item.id]
        report.items += 1
        if new.shape == old.shape and np.array_equal(new, old):
            report.identical += 1
            continue
        report.differing += 1
        if new.shape == old.shape:
            diff = np.abs(new.astype(np.float64) - old)
            report.max_abs_diff = max(report.max_abs_diff, float(diff.max()))
            report.sum_abs_diff += float(diff.mean())


def _write(path: Path, items: Sequence[models.WorkItem], outputs: Any, version: str) -> None:
    scored = [i for i in items if i.id in outputs]
    table = pa.table(
        {
            "item_key": [i.item_key for i in scored],
            "output": [np.asarray(outputs[i.id], np.float32) for i in scored],
            "model_version": [version] * len(scored),
        },
        schema=pa.schema(
            [
                ("item_key", pa.string()),
                ("output", pa.list_(pa.float32())),
                ("model_version", pa.string()),
            ]
        ),
    )
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def _context(
    config: cfg.PipelineConfig, res: build.Resolved, report: Report, target: Path
) -> lineage.RunContext:
    _, original = build.datasets(config, res)
    ns, name = naming.file_dataset_id(target)
    return lineage.RunContext(
        run_id=report.replay_run_id,
        job_name=f"{config.name}.replay",
        inputs=(original,),
        outputs=(lineage.DatasetRef(ns, name, (("item_key", "string"), ("output", "list"))),),
        replay={
            "originalRunId": report.run_id,
            "items": report.items,
            "identical": report.identical,
            "differing": report.differing,
            "skipped": report.skipped,
            "modelVersions": dict(report.model_versions),
        },
    )
