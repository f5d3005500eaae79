"""``batching init | enqueue | redrive | purge``: the queue commands of the CLI (``status`` is
in :mod:`batching.cli.status`, the controls, ``batching queue ...``, in
:mod:`batching.cli.controls`). With ``-c``, a config's database and queue are the defaults."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from batching import errors
from batching.cli.controls import ActorOption, ReasonOption

if TYPE_CHECKING:
    from batching import models
from batching.cli.common import (
    DEFAULT_DB,
    AttemptsOption,
    ConfigDbOption,
    ConfigQueueOption,
    JsonOption,
    QuietOption,
    TargetOption,
    app,
    emit_json,
    err,
    handle_errors,
    load,
    open_queue,
    out,
    parse_duration,
    progress_bar,
    shown,
    target,
    warn_unknown_queue,
    warn_unknown_tenant,
)

if TYPE_CHECKING:
    pass


LIVE_S = 600.0
"""A run whose heartbeat is this recent may be a scorer alive now: its heartbeats come every
third of its lease, and the shipped configs lease for up to 300 s (a 2 min window missed a
scorer between two beats of 100 s). A run killed without its end counts this long after its
last beat; ``--while-running`` goes on regardless."""


@app.command()
@handle_errors
def init(
    db: ConfigDbOption = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", "-c", help="Pipeline YAML: its database.url is the default of --db."
        ),
    ] = None,
    while_running: Annotated[
        bool,
        typer.Option(
            "--while-running",
            help="Upgrade even though scoring runs heartbeated in the last 10 min. Scorers of "
            "this release and later stop at their next heartbeat once the schema changes; "
            "older ones go on by the old schema's rules.",
        ),
    ] = False,
) -> None:
    """Create or upgrade the queue schema (a second run changes nothing). An upgrade waits
    for no one: stop the scorers, the API and producers first (docs/operations.md)."""

    from batching.store import database, schema

    db, _ = target(db, None, config)
    queue = open_queue(db, create=True)
    database.check_intact(queue.engine)
    with queue.read() as conn:
        before = schema.current_version(conn)
        upgrading = 0 < before < schema.SCHEMA_VERSION
        live = schema.live_runs(conn, time.time(), LIVE_S) if upgrading else []
    if live and not while_running:
        shown = "; ".join(f"queue {q!r}: run {run}" for run, q, _ in live[:3])
        latest = max(at for _, _, at in live)
        wait_s = max(1, math.ceil(latest + LIVE_S - time.time()))
        raise errors.Busy(
            f"{len(live)} scoring run(s) heartbeated in the last {LIVE_S / 60:.0f} min "
            f"({shown}): stop the scorers, the API and producers before an upgrade (a scorer "
            f"killed without its end counts for {wait_s} s more), or pass --while-running; "
            "nothing was changed"
        )
    result = queue.migrate()
    where = database.redact(db)
    if result.applied:
        out.print(
            f"{where}: schema upgraded from version {result.from_version} to {result.to_version}"
        )
    else:
        out.print(f"{where}: schema already at version {result.to_version}; nothing to do")


@app.command()
@handle_errors
def enqueue(
    file: Annotated[Path, typer.Argument(help="JSONL or Parquet file of records.")],
    db: ConfigDbOption = None,
    queue: ConfigQueueOption = None,
    max_attempts: AttemptsOption = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Pipeline YAML whose model section bounds each item (max_item_tokens, "
            "max_item_elements, max_item_bytes; default: those settings' defaults) and whose "
            "database.url, queue.name and queue.max_attempts are the defaults of --db, -q and "
            "--max-attempts (and queue.lane that of a record without a lane).",
        ),
    ] = None,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Enqueue every record of FILE in one transaction (all or nothing), idempotent on item_key.

    Each record: item_key, payload, and optionally tenant, priority, deadline, cost, lane. The
    file is streamed into the transaction; a record that fails its checks (or is past the
    model's item limits) rolls it back, naming FILE:LINE. A queue at its depth cap (`batching
    queue cap`) refuses the whole file (exit 2). The new items carry this command's enqueue
    run id, printed at the end (`batching queue cancel --enqueue-run ID` takes them back).

    --json: ok, queue, enqueue_run, inserted, duplicates (the keys already present).
    """
    from rich.progress import TextColumn, TimeElapsedColumn

    from batching import config as cfg
    from batching.ingress import ingest
    from batching.store import database

    pipeline = load(config) if config is not None else None
    limits = ingest.ItemLimits.of(pipeline.model) if pipeline is not None else None
    # -c names the queue as score -c reads it (before: queue 'default', which it never saw)
    qc = pipeline.queue if pipeline is not None else cfg.QueueConfig()
    db = (pipeline.database.url if pipeline is not None else DEFAULT_DB) if db is None else db
    queue, max_attempts = queue or qc.name, max_attempts or qc.max_attempts
    q = open_queue(db, queue, max_attempts=max_attempts)
    q.check_schema()  # before reading: a large file takes a while
    progress = progress_bar(
        TextColumn("{task.description}", markup=False),
        TextColumn("{task.completed} record(s)"),
        TimeElapsedColumn(),
        quiet=quiet,
    )
    seen = _Seen(time.time(), qc.lane)
    run = enqueue_run_id(seen.now)
    try:
        with progress:
            task = progress.add_task(
                f"reading {shown(file.name)}, enqueueing (one transaction)", total=None
            )
            records = seen.count(ingest.iter_records(file, limits))
            result = q.enqueue(
                records, lambda n: progress.update(task, completed=n), enqueue_run=run
            )
    except KeyboardInterrupt:
        err.print(f"interrupted: nothing of {file} was enqueued (one transaction)")
        raise typer.Exit(130) from None
    if as_json:
        _warn(file, seen)
        doc = {"ok": True, "queue": queue, "enqueue_run": run, "inserted": result.inserted}
        emit_json(doc | {"duplicates": list(result.duplicates)})
        return
    out.print(
        f"{file}: committed {result.inserted} new item(s) to queue {queue!r} of "
        f"{database.redact(db)}; "
        f"{len(result.duplicates)} already present (not enqueued again); enqueue run {run}"
    )
    _warn(file, seen)
    if result.duplicates:
        listed = ", ".join(result.duplicates[:5])
        more = f" and {len(result.duplicates) - 5} more" if len(result.duplicates) > 5 else ""
        out.print(f"duplicates: {listed}{more}")


def enqueue_run_id(now: float) -> str:
    """An id for one enqueue command, stamped on the items it inserts: sortable by time and
    unique (``enq-20261202T015057Z-3fa2c1d0``)."""
    import uuid

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return f"enq-{stamp}-{uuid.uuid4().hex[:8]}"


class _Seen:
    """What enqueue reports of the records streamed past it: how many, how many late; a
    record without a lane gets ``lane`` (the --config's queue.lane, which its scorers claim)."""

    def __init__(self, now: float, lane: str | None = None) -> None:
        self.now, self.n, self.late, self.lane = now, 0, 0, lane

    def count(self, records: Iterator[models.EnqueueRecord]) -> Iterator[models.EnqueueRecord]:
        for record in records:
            self.n += 1
            self.late += record.deadline_at is not None and record.deadline_at <= self.now
            yield replace(record, lane=self.lane) if self.lane and not record.lane else record


def _warn(file: Path, seen: _Seen) -> None:
    if not seen.n:
        err.print(f"warning: {file} holds no records; nothing to enqueue", highlight=False)
    if seen.late:
        err.print(
            f"warning: {seen.late} record(s) of {file} are already past their deadline; they "
            "expire at the next claim, unscored (an SLA miss)",
            highlight=False,
        )


@app.command()
@handle_errors
def redrive(
    db: ConfigDbOption = None,
    queue: ConfigQueueOption = None,
    config: TargetOption = None,
    only: Annotated[
        str,
        typer.Option(help="Which items: dead, expired, all (dead and expired) or cancelled."),
    ] = "all",
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant's items (e.g. one cancel taken back).")
    ] = None,
    enqueue_run: Annotated[
        str | None,
        typer.Option(help="Only the items of this enqueue run (`enq-...`, `batching enqueue`)."),
    ] = None,
    actor: ActorOption = None,
    reason: ReasonOption = None,
) -> None:
    """Move dead and/or expired (or cancelled) items back to ready with fresh attempts.

    Recorded in the queue's audit (`batching queue audit`) with --actor and --reason."""
    from batching import models
    from batching.cli.controls import acting
    from batching.ingress import controls

    choices = {
        "dead": (models.State.DEAD,),
        "expired": (models.State.EXPIRED,),
        "all": (models.State.DEAD, models.State.EXPIRED),
        "cancelled": (models.State.CANCELLED,),
    }
    if only not in choices:
        raise errors.ConfigError(f"--only must be dead, expired, all or cancelled, got {only!r}")
    who = controls.check_actor(acting(actor))
    db, queue = target(db, queue, config)
    q = open_queue(db, queue)
    q.check_schema()
    n = q.redrive(choices[only], tenant=tenant, enqueue_run=enqueue_run, actor=who, reason=reason)
    if n == 0:
        warn_unknown_queue(q)
        warn_unknown_tenant(q, tenant, tuple(s.name.lower() for s in choices[only]))
    out.print(f"redrove {n} item(s) in queue {queue!r} back to ready")


@app.command()
@handle_errors
def purge(
    older_than: Annotated[
        str, typer.Option(help="Age of done items to remove: 7d, 12h, 30m, 90s.")
    ] = "7d",
    db: ConfigDbOption = None,
    queue: ConfigQueueOption = None,
    config: TargetOption = None,
    archive: Annotated[
        bool, typer.Option(help="Copy to batching_items_archive before deleting.")
    ] = False,
    ledger: Annotated[
        bool,
        typer.Option(
            "--ledger",
            help="Then delete the batch ledger's rows committed before the UTC midnight at or "
            "before --older-than ago that no item or outbox row needs (the ledger horizon).",
        ),
    ] = False,
    actor: ActorOption = None,
    reason: ReasonOption = None,
) -> None:
    """Remove done and cancelled items older than --older-than (7d by default).

    Keep at least the reconcile window: reconcile cannot prove what is gone. With --ledger,
    the ledger rows of batches none of whose items is left go too, up to a UTC midnight (the
    horizon): reconcile then no longer reports orphan or duplicate outputs scored before that
    day. Recorded in the queue's audit with --actor and --reason."""
    from batching.cli.controls import acting
    from batching.ingress import controls

    age_s = parse_duration(older_than, "--older-than")
    who = controls.check_actor(acting(actor))
    db, queue = target(db, queue, config)
    q = open_queue(db, queue)
    q.check_schema()
    n = q.purge(age_s, archive=archive, actor=who, reason=reason)
    if n == 0:
        warn_unknown_queue(q)
    verb = "archived" if archive else "deleted"
    out.print(f"{verb} {n} done or cancelled item(s) older than {older_than} from queue {queue!r}")
    if ledger:
        from batching.store import retention

        rows, horizon = q.purge_ledger(age_s, actor=who, reason=reason)
        kept = (
            "the ledger is whole"
            if horizon is None
            else f"ledger kept from {retention.day(horizon)} 00:00 UTC: reconcile judges no "
            "orphan or duplicate output scored before that day"
        )
        out.print(f"deleted {rows} ledger row(s) of queue {queue!r} that no item needs; {kept}")
