"""``batching lineage | reconcile``: the evidence commands of the CLI."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from batching import errors
from batching.cli import findings_view, full_sweep
from batching.cli.common import (
    ConfigOption,
    DbOverride,
    OutputOverride,
    QuietOption,
    app,
    flag,
    handle_errors,
    load,
    out,
    parse_duration,
    plain,
    warn_unknown_queue,
)

if TYPE_CHECKING:
    pass


_LINEAGE_ACTIONS = ("flush", "config-check")


@app.command()
@handle_errors
def lineage(
    action: Annotated[
        str | None,
        typer.Argument(
            metavar="[flush|config-check]",
            help="flush: as --flush; config-check: as --config-check; none: show a run.",
            show_default=False,
        ),
    ] = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Run id; default: the latest run.")
    ] = None,
    events: Annotated[Path | None, typer.Option("--events", help="Event log (JSONL).")] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Pipeline YAML whose event log to read (--flush: whose spool; "
            "--config-check: whose settings).",
        ),
    ] = None,
    output: OutputOverride = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    flush: Annotated[
        bool,
        typer.Option(
            "--flush",
            help="Re-send the events the backend did not take, spooled in the queue database "
            "of --config (--db overrides it), to where lineage goes now; exit 1 if some remain.",
        ),
    ] = False,
    config_check: Annotated[
        bool,
        typer.Option(
            "--config-check",
            help="Print the effective lineage settings (--config's, under openlineage.yml and "
            "OPENLINEAGE_*) and where each comes from; exit 1 on an invalid one.",
        ),
    ] = False,
    db: DbOverride = None,
    quiet: QuietOption = False,
) -> None:
    """Show a run's job, inputs, outputs and facets from the local OpenLineage event log.

    With --config, the log the config's runs write; add the --output a run was scored with to
    find its log beside that output. --flush re-sends spooled events; --config-check shows
    where lineage goes and why.
    """
    from batching.evidence import lineage_log

    if action is not None:
        if action not in _LINEAGE_ACTIONS:
            raise errors.InputError(
                f"lineage {action!r}: not an action; use `batching lineage flush`, "
                "`batching lineage config-check`, or no action to show a run"
            )
        flush = flush or action == "flush"
        config_check = config_check or action == "config-check"
    if flush or config_check:
        from batching.cli import lineage_tools

        lineage_tools.run(flush, config_check, run, events, config, db, output, as_json, quiet)
        return
    if output is not None and config is None:
        raise errors.InputError("--output needs --config (the config the run was scored with)")
    if events is not None and config is not None:
        raise errors.InputError(
            "--events and --config name two event logs; give one (--events: a file, --config: "
            "the log its runs write)"
        )
    path = events or _events_from_config(config, output)
    if path.is_dir():
        raise errors.InputError(f"{path}: a folder, not a lineage event log; give its JSONL file")
    if not path.is_file():
        fix = "check the path" if events else "run `batching score` first or pass --events"
        raise errors.InputError(f"{path}: no lineage event log; {fix}")
    read = lineage_log.read_events(path)
    summary = lineage_log.summarize_run(read, run)
    if not read and path.stat().st_size and events is not None:
        raise errors.InputError(
            f"{path}: no line of it is a lineage event; give the events file a run wrote "
            "(lineage.path in its config)"
        )
    if summary is None and run is None:
        raise errors.InputError(f"{path}: no lineage events; run `batching score` first")
    if summary is None:
        raise errors.InputError(f"{path}: no events for run {run!r}; omit --run for the latest run")
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2, default=str) + "\n")
        return
    _print_summary(summary)


def _events_from_config(config: Path | None, output: str | None) -> Path:
    if config is None:
        return Path("outputs/lineage/events.jsonl")
    from batching.compose import build
    from batching.config import load_config

    res = build.resolve(load_config(config), None, output)
    if res.events_path is None:
        raise errors.ConfigError(f"{config}: lineage transport is not file; nothing local to read")
    return res.events_path


def _print_summary(s: dict[str, Any]) -> None:
    job = s["job"]
    out.print(
        f"run {s['run_id']}  job {job['namespace']}/{job['name']}  state {s['state']}",
        highlight=False,
    )
    out.print(
        f"events: {' -> '.join(s['event_types'])}  started {s['started_at']}  "
        + (f"duration {s['duration_s']:.3f}s" if s["duration_s"] is not None else "not ended"),
        highlight=False,
    )
    if s.get("parent"):
        out.print(f"parent: {s['parent']['job']} run {s['parent']['run_id']}", highlight=False)
    if s.get("model"):
        out.print(f"model: {s['model']}", highlight=False)
    if s.get("error"):
        flag(out, "error", str(s["error"]))
    table = Table("direction", "namespace", "name", "rows", "bytes", "facets")
    for direction in ("inputs", "outputs"):
        for d in s[direction]:
            table.add_row(
                direction[:-1],
                plain(d["namespace"]),
                plain(d["name"]),
                plain(d.get("row_count", "-")),
                plain(d.get("size_bytes", "-")),
                plain(", ".join(d["facets"])),
            )
    out.print(table)
    out.print(
        f"run facets: {', '.join(s['run_facets'])}; config hash {s.get('config_hash')}",
        highlight=False,
    )


@app.command()
@handle_errors
def reconcile(
    config: ConfigOption,
    db: DbOverride = None,
    output: OutputOverride = None,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Fix what can be fixed: reap, roll forward, quarantine (never delete), requeue.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    since: Annotated[
        str | None,
        typer.Option(
            help="Only items and batches finished in the last DURATION: 90s, 30m, 12h, 7d."
        ),
    ] = None,
    run: Annotated[
        str | None, typer.Option("--run", help="Only the batches of this run id.")
    ] = None,
    dataset_lost: Annotated[
        bool,
        typer.Option(
            "--dataset-lost",
            help="The Parquet dataset was deleted: judge its batches (and with --repair requeue "
            "their items) instead of refusing an output folder without files.",
        ),
    ] = False,
    full: Annotated[
        bool,
        typer.Option(
            "--full",
            help="Sweep everything ever committed, a page at a time, resuming where the last "
            "sweep of this output stopped (see docs/operations.md).",
        ),
    ] = False,
    restart: Annotated[
        bool, typer.Option("--restart", help="With --full: start the sweep over.")
    ] = False,
    max_time: Annotated[
        str | None,
        typer.Option(
            "--max-time",
            help="With --full: stop after DURATION (30m, 2h); the next --full resumes there.",
        ),
    ] = None,
    quiet: QuietOption = False,
) -> None:
    """Prove every done item has exactly one committed output; list what is wrong.

    Exit 0: clean (info findings only). Exit 1: critical or warning findings.
    Exit 2: bad input. With --repair it checks again after repairing, shows both, and the
    exit code says what is left (the reconcile flow fails only on critical findings left).
    With --full (a sweep: progress on stderr) --repair repairs page by page and the exit code
    says what was found; run it again to see what is left.
    """
    import time

    full_sweep.check_options(full, since=since, run=run, restart=restart, max_time=max_time)
    cfg = load(config)
    window = parse_duration(since, "--since") if since is not None else None
    limit_s = parse_duration(max_time, "--max-time") if max_time is not None else None

    from batching.compose import build
    from batching.evidence import reconcile as rc

    now = time.time()
    res = build.resolve(cfg, db, output)
    queue = build.open_queue(cfg, res.db_url)
    if full:
        try:
            queue.check_schema()
            unknown = warn_unknown_queue(queue)  # a typo would sweep nothing and say clean
            sink = build.open_sink(queue, res, read_only=True)
            swept = full_sweep.run(
                queue,
                sink,
                now,
                repair=repair,
                dataset_lost=dataset_lost,
                restart=restart,
                limit_s=limit_s,
                quiet=quiet,
            )
        finally:
            queue.engine.dispose()
        findings_view.show(swept, None, as_json=as_json, unknown_queue=unknown)
        return
    try:
        queue.check_schema()
        unknown = None
        if run is not None:
            _check_run(queue, run, res.db_url)
        else:
            unknown = warn_unknown_queue(queue)  # a typo would judge nothing and say clean
        check = functools.partial(
            rc.reconcile,
            queue,
            build.open_sink(queue, res, read_only=True),
            since=now - window if window is not None else None,
            run_id=run,
            dataset_lost=dataset_lost,
        )
        report = check(now=now, repair=repair)
        # What a repair left: the same check again, repairing nothing (its exit code counts).
        after = check(now=time.time(), repair=False) if repair else None
    finally:
        queue.engine.dispose()
    findings_view.show(report, after, as_json=as_json, unknown_queue=unknown)


def _check_run(queue: Any, run: str, db_url: str) -> None:
    """Raise ``InputError`` when ``run`` is not in the run ledger (else reconcile finds nothing)."""
    import sqlalchemy as sa

    from batching.store import schema
    from batching.store.database import redact

    runs = schema.runs
    with queue.read() as conn:
        found = conn.execute(
            sa.select(runs.c.run_id).where(runs.c.run_id == run, runs.c.queue == queue.queue)
        ).first()
    if found is None:
        raise errors.InputError(
            f"no run {run} of queue {queue.queue!r} in the run ledger of {redact(db_url)}; "
            "see `batching lineage` or omit --run"
        )


@app.command()
@handle_errors
def maintain(
    config: ConfigOption,
    db: DbOverride = None,
    output: OutputOverride = None,
    vacuum_retention: Annotated[
        str | None,
        typer.Option(
            help="Keep files a table version of the last DURATION needs (at least the "
            "table's own retention, 7 days unless set; refused before any step runs); "
            "default: the table's own retention."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Housekeeping of the config's output: a Delta table's compaction, checkpoint, vacuum.

    A Parquet dataset or a SQL table needs none: it says so and changes nothing.
    """
    cfg = load(config)
    retention_s = (
        parse_duration(vacuum_retention, "--vacuum-retention") if vacuum_retention else None
    )
    from batching.compose import build

    res = build.resolve(cfg, db, output)
    queue = build.open_queue(cfg, res.db_url)
    try:
        queue.check_schema()
        done = build.open_sink(queue, res).maintain(
            vacuum_retention_h=None if retention_s is None else retention_s / 3600
        )
    finally:
        queue.engine.dispose()
    if as_json:
        sys.stdout.write(json.dumps(done, indent=2, default=str) + "\n")
    elif not done:
        out.print(
            f"{res.output}: a {cfg.output.kind} output needs no housekeeping", highlight=False
        )
    else:
        out.print(
            f"{res.output}: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in done.items()),
            highlight=False,
        )
