"""``batching init | enqueue | status | redrive | purge``: the queue commands of the CLI (the
controls, ``batching queue ...``, are in :mod:`batching.cli.controls`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from batching import errors
from batching.cli.controls import ActorOption, ReasonOption

if TYPE_CHECKING:
    from batching import models
from batching.cli.common import (
    DEFAULT_DB,
    AttemptsOption,
    ConfigQueueOption,
    DbOption,
    JsonOption,
    QueueOption,
    QuietOption,
    app,
    emit_json,
    err,
    handle_errors,
    load,
    open_queue,
    out,
    parse_duration,
    plain,
    progress_bar,
    queue_name,
    shown,
    warn_unknown_queue,
)

if TYPE_CHECKING:
    from batching.models import QueueStats


@app.command()
@handle_errors
def init(db: DbOption = DEFAULT_DB) -> None:
    """Create or upgrade the queue schema (a second run changes nothing)."""

    from batching.store import database

    queue = open_queue(db, create=True)
    database.check_intact(queue.engine)
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
    db: Annotated[
        str | None,
        typer.Option(
            "--db",
            envvar="BATCHING_DB_URL",
            help="Database URL: sqlite:///FILE or postgresql://USER@HOST:PORT/DB. Default: "
            f"the --config's database.url, else {DEFAULT_DB}.",
        ),
    ] = None,
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
def status(
    db: DbOption = DEFAULT_DB,
    queue: Annotated[
        str | None,
        typer.Option("--queue", "-q", help="Queue name (default: default).", callback=queue_name),
    ] = None,
    all_queues: Annotated[bool, typer.Option("--all", help="Every queue in the table.")] = False,
    costs: Annotated[
        bool,
        typer.Option(
            "--costs",
            help="Also the device seconds the queue's runs used, by tenant and model version.",
        ),
    ] = False,
    since: Annotated[
        str, typer.Option("--since", help="With --costs: runs that ended this long ago (24h).")
    ] = "24h",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Queue depth by state, oldest ready age, expired leases, per queue, lane and tenant; a
    pause (who, since when, why) and a depth cap. With --costs, the device seconds (forward
    time on the scorers' devices) the queue's runs used since --since, by tenant (shared by
    their items' cost) and by model version, from the run ledger.

    --json: by_state, oldest_ready_age_s, expired_leases, groups, backoff, and controls (by
    queue: paused, paused_at, paused_by, reason, max_depth); with --costs, costs (runs,
    device_s, by_tenant, by_model_version)."""
    from dataclasses import asdict

    from batching.cli.controls import control_lines
    from batching.ingress import controls

    if all_queues and queue is not None:
        raise errors.InputError("--all and --queue together: give one (--all: every queue)")
    if costs and all_queues:
        raise errors.InputError("--costs is per queue: give --queue NAME rather than --all")
    window_s = parse_duration(since, "--since") if costs else 0.0
    queue = queue or "default"
    q = open_queue(db, queue)
    q.check_schema()
    stats = q.stats(all_queues=all_queues)
    if not all_queues and not stats.groups:
        warn_unknown_queue(q)
    held = controls.states(q.engine)
    if not all_queues:
        held = {queue: held.get(queue, controls.QueueControl(queue))}
    spent = None
    if costs:
        from batching.ingress.run_ledger import RunLedger

        spent = RunLedger(q).costs(time.time() - window_s)
    if as_json:
        doc = asdict(stats) | {"controls": {k: asdict(c) for k, c in held.items()}}
        doc |= {"costs": spent} if spent is not None else {}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    out.print(status_table(stats, None if all_queues else queue))
    # cancelled only when some are, as in the table: the line stays within 80 columns
    totals = ", ".join(f"{k} {v}" for k, v in stats.by_state.items() if v or k != "cancelled")
    backoff = f"; {stats.backoff} ready waiting out a retry backoff" if stats.backoff else ""
    out.print(f"total: {totals}; expired leases {stats.expired_leases}{backoff}")
    depths: dict[str, int] = {}
    for g in stats.groups:
        depths[g.queue] = depths.get(g.queue, 0) + g.ready + g.leased
    for line in control_lines(held, depths):
        out.print(line, highlight=False)
    out.print(_lineage_backlog(q.engine), highlight=False)
    if spent is not None:
        out.print(cost_table(spent, queue, since))


def cost_table(spent: dict[str, Any], queue: str, since: str) -> Table:
    """``--costs``: device seconds by tenant and by model version, the largest first."""
    table = Table(
        title=f"device seconds of queue {queue!r}, last {since} ({spent['runs']} run(s), "
        f"{spent['device_s']:.3g} s)",
        box=box.SIMPLE_HEAD,
    )
    for column in ("by", "name", "device s", "share"):
        table.add_column(column)
    total = spent["device_s"] or 1.0
    for by, key in (("tenant", "by_tenant"), ("model version", "by_model_version")):
        for name, seconds in sorted(spent[key].items(), key=lambda kv: -kv[1]):
            table.add_row(by, plain(name), f"{seconds:.3g}", f"{seconds / total:.1%}")
    return table


def _lineage_backlog(engine: Any) -> str:
    """The status line of the lineage spool: what waits for a re-send, and for how long."""
    from batching.evidence import spool

    left = spool.backlog(engine)
    age = left.oldest_age_s(time.time())
    if age is None:
        return "lineage spool: empty"
    return (
        f"lineage spool: {left.events} event(s) of {left.runs} run(s) waiting for a re-send, "
        f"oldest {age:.0f}s (`batching lineage flush -c CONFIG` sends them)"
    )


def status_table(stats: QueueStats, queue: str | None) -> Table:
    """``batching status``'s table: one row per (lane, tenant) of ``queue``, or per (queue,
    lane, tenant) of every queue when ``queue`` is None (``--all``); names shown as they are."""
    # No vertical rules: with --all, ten columns still fit 80 characters without folding names.
    table = Table(
        title=f"queue {'(all)' if queue is None else repr(queue)}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    keys = ("lane", "tenant") if queue is not None else ("queue", "lane", "tenant")
    for col in keys:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    # "stale": leases past their expiry that the reaper has not released yet. "cancelled"
    # only when some are (``batching queue cancel``): the table stays within 80 columns.
    counts = ["ready", "leased", "done", "dead", "expired", "expired_leases"]
    if any(g.cancelled for g in stats.groups):
        counts.insert(5, "cancelled")
    for col in [*counts, "oldest"]:
        title = "stale" if col == "expired_leases" else col
        table.add_column(title, justify="right", min_width=len(title))
    for g in stats.groups:
        age = f"{g.oldest_ready_age_s:.1f}s" if g.oldest_ready_age_s is not None else "-"
        names = {"queue": g.queue, "lane": g.lane or "-", "tenant": g.tenant}
        cells = (str(getattr(g, c)) for c in counts)
        table.add_row(*(plain(names[k]) for k in keys), *cells, age)
    return table


@app.command()
@handle_errors
def redrive(
    db: DbOption = DEFAULT_DB,
    queue: QueueOption = "default",
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
    """Move dead and/or expired (or cancelled) items back to ready with fresh attempts,
    recorded in the queue's audit (`batching queue audit`) with --actor and --reason."""
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
    q = open_queue(db, queue)
    q.check_schema()
    n = q.redrive(choices[only], tenant=tenant, enqueue_run=enqueue_run, actor=who, reason=reason)
    if n == 0:
        warn_unknown_queue(q)
    out.print(f"redrove {n} item(s) in queue {queue!r} back to ready")


@app.command()
@handle_errors
def purge(
    older_than: Annotated[
        str, typer.Option(help="Age of done items to remove: 7d, 12h, 30m, 90s.")
    ] = "7d",
    db: DbOption = DEFAULT_DB,
    queue: QueueOption = "default",
    archive: Annotated[
        bool, typer.Option(help="Copy to batching_items_archive before deleting.")
    ] = False,
    actor: ActorOption = None,
    reason: ReasonOption = None,
) -> None:
    """Remove done and cancelled items older than --older-than (keep at least the reconcile
    window); recorded in the queue's audit with --actor and --reason."""
    from batching.cli.controls import acting
    from batching.ingress import controls

    age_s = parse_duration(older_than, "--older-than")
    who = controls.check_actor(acting(actor))
    q = open_queue(db, queue)
    q.check_schema()
    n = q.purge(age_s, archive=archive, actor=who, reason=reason)
    if n == 0:
        warn_unknown_queue(q)
    verb = "archived" if archive else "deleted"
    out.print(f"{verb} {n} done or cancelled item(s) older than {older_than} from queue {queue!r}")
